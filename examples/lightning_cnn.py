"""A Lightning script, tuned by autotune: the lines marked ``# autotune`` are all it adds.

    python examples/lightning_cnn.py              # tune it; prints the Lightning arguments to paste

A small CNN learns synthetic CIFAR-shaped images (3x32x32, 10 noisy class templates; nothing is
downloaded) from a LightningDataModule, and validation logs ``val_acc``, the study's metric. The space is
``search_spaces/lightning.yaml``; ``tune(trainer=TRAINER, loader=...)`` starts from this Trainer's
arguments and this DataLoader, so the study keeps their global batch. ``LIGHTNING_CNN_SAMPLES`` sets the
training set's size (default 8,192).
"""

import os

import lightning as L
import torch
from torch import nn

from autotune.demo import synthetic_images
from autotune.integrations import lightning as tuned  # autotune


class CNN(L.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                                 nn.MaxPool2d(2))

        self.net = nn.Sequential(block(3, 16), block(16, 32), block(32, 64), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                 nn.Linear(64, 10))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = nn.functional.cross_entropy(self(images), labels)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        self.log("val_loss", nn.functional.cross_entropy(logits, labels))
        self.log("val_acc", (logits.argmax(dim=1) == labels).float().mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class Images(L.LightningDataModule):
    def __init__(self, batch_size: int = 256, num_workers: int = 0) -> None:
        super().__init__()
        self.batch_size, self.num_workers = batch_size, num_workers
        n = int(os.environ.get("LIGHTNING_CNN_SAMPLES", 8192))
        self.train_set = torch.utils.data.TensorDataset(*synthetic_images(n, 32, seed=0))
        self.val_set = torch.utils.data.TensorDataset(*synthetic_images(1024, 32, seed=10_000))

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True,
                                           num_workers=self.num_workers)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.val_set, batch_size=512)


TRAINER = {"max_epochs": 5, "precision": "32-true"}


def train(ctx) -> None:                                                                  # autotune
    tuned.run_trainer(ctx, CNN(), Images(), trainer=TRAINER, metric="val_acc")            # autotune


if __name__ == "__main__":
    result = tuned.tune(train, trainer=TRAINER, loader=Images().train_dataloader(), n_trials=20)  # autotune
    print(result.verdict)                                                                 # autotune
    print(tuned.trainer_arguments(result.best_config).code())                             # autotune
