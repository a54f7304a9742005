"""A ViT-S/16 (timm) on synthetic images: a Dataset built item by item in Python, augmented at random.

A script as a user writes it, for ``benchmarks/runners/answer_first_h200.py``: no earlier result was tuned
on it. Its Dataset makes its 4,096 images of 256 px at construction, one at a time in a Python loop (a list
of PIL images, as a user's decode-and-cache step would keep them: seconds in every process that builds it), and
``__getitem__`` crops, resizes and flips each one at random with torchvision's transforms, drawn from the
process's own random state. So no two runs see the same batches, and the data cannot be kept on the device
(its random augmentation would be frozen). The script trains at ``batch_size=128`` with AdamW and anneals
its learning rate with OneCycle over the run.

``AUTOTUNE_BENCH_SIZE=tiny``: 256 images of 40 px cropped to 32, a two-block ViT-S (a check on a CPU).
"""

from __future__ import annotations

import os

import numpy as np
import timm
import torch
from PIL import Image
from torchvision.transforms import v2

CLASSES = 10
TINY = os.environ.get("AUTOTUNE_BENCH_SIZE") == "tiny"
IMAGES, SOURCE, CROP = (256, 40, 32) if TINY else (4096, 256, 224)


class CachedImages(torch.utils.data.Dataset):
    """``n`` images of ``SOURCE`` px (a class tint over noise, so the labels are learnable), kept as PIL images."""

    def __init__(self, n: int = IMAGES, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.images: list[Image.Image] = []
        self.labels: list[int] = []
        for i in range(n):  # one at a time, as a loop over a folder of files would
            label = i % CLASSES
            tint = np.array([(label * 37) % 96, (label * 71) % 96, (label * 13) % 96], dtype=np.uint8)
            pixels = rng.integers(0, 160, (SOURCE, SOURCE, 3), dtype=np.uint8) + tint
            self.images.append(Image.fromarray(pixels))
            self.labels.append(label)
        self.augment = v2.Compose([
            v2.RandomResizedCrop(CROP, scale=(0.35, 1.0), antialias=True), v2.RandomHorizontalFlip(),
            v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
            v2.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
        ])

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        return self.augment(self.images[index]), self.labels[index]


def train(ctx) -> None:
    torch.manual_seed(ctx.seed)
    shape = {"img_size": CROP, "depth": 2} if TINY else {}
    model = ctx.model(timm.create_model("vit_small_patch16_224", num_classes=CLASSES, **shape))
    optimizer = ctx.optimizer(torch.optim.AdamW, model.parameters(), lr=5e-4 * ctx.lr_scale, weight_decay=0.05)
    loader = ctx.loader(CachedImages(), batch_size=128)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-3 * ctx.lr_scale,
                                                   total_steps=ctx.optimizer_steps)
    step = ctx.train_step(model, optimizer, torch.nn.CrossEntropyLoss(label_smoothing=0.1), scheduler=schedule)
    for images, labels in ctx.batches(loader):
        step(images, labels)
