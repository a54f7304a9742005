"""Workloads over a folder of real JPEGs through ``ctx.image_loader`` (torch or DALI, per ``loader``).

Set by environment variables, so that trial processes read them:

- ``AUTOTUNE_JPEG_ROOT``: the image folder (``root/<class>/<image>.jpg``, see ``benchmarks/workloads/make_jpegs.py``).
- ``AUTOTUNE_JPEG_MODEL``: ``resnet50`` (torchvision, the default) or ``tiny`` (a small CNN, for CPU checks).
- ``AUTOTUNE_JPEG_SIZE``: crop size, 224 by default.
- ``AUTOTUNE_JPEG_EVAL``: held-out images for the accuracy metric, 512 by default.

``train``: the model trained on the JPEG folder. ``loader_only``: the same loader iterated without a
model, so its throughput is the loader's alone (decode, augmentation and the copy to the device).
``train_synthetic``: the same model on batches already on the device, the compute ceiling for the
config.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from autotune.trial._images import IMAGENET_MEAN, IMAGENET_STD, input_dtype, list_images


def _root() -> str:
    root = os.environ.get("AUTOTUNE_JPEG_ROOT")
    if not root:
        raise RuntimeError("set AUTOTUNE_JPEG_ROOT to a folder of JPEGs in class subfolders (benchmarks/workloads/make_jpegs.py)")
    return root


def _size() -> int:
    return int(os.environ.get("AUTOTUNE_JPEG_SIZE", "224"))


def _model(classes: int) -> nn.Module:
    name = os.environ.get("AUTOTUNE_JPEG_MODEL", "resnet50")
    if name == "resnet50":
        import torchvision

        return torchvision.models.resnet50(num_classes=classes)
    if name == "tiny":
        return nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes),
        )
    raise ValueError(f"AUTOTUNE_JPEG_MODEL={name!r}: use resnet50 or tiny")


def _held_out(ctx, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every k-th image of the folder, resized (no augmentation) and normalised as the loaders do."""
    import numpy as np
    from PIL import Image

    samples = list_images(_root()).samples
    picked = samples[:: max(1, len(samples) // count)][:count]
    size = _size()
    images = []
    for path, _ in picked:
        with Image.open(path) as image:
            images.append(np.asarray(image.convert("RGB").resize((size, size), Image.BILINEAR)))
    x = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float()
    x = (x - torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1) * 255) / (torch.tensor(IMAGENET_STD).view(1, 3, 1, 1) * 255)
    return x.to(input_dtype(ctx.config.precision)), torch.tensor([label for _, label in picked])


@torch.no_grad()
def _accuracy(ctx, model: nn.Module, images: torch.Tensor, labels: torch.Tensor, batch: int = 128) -> float:
    model.eval()
    correct = 0
    for start in range(0, len(images), batch):
        with ctx.autocast():
            pred = model(ctx.to_device(images[start : start + batch])).argmax(dim=1)
        correct += (pred.cpu() == labels[start : start + batch]).sum().item()
    model.train()
    return correct / len(images)


def _fit(ctx, batches) -> None:
    torch.manual_seed(ctx.seed)
    classes = len(list_images(_root()).classes)
    model = ctx.model(_model(classes))
    optimizer = ctx.optimizer(torch.optim.SGD, model.parameters(), lr=0.1 * ctx.lr_scale, momentum=0.9)
    step = ctx.train_step(model, optimizer, nn.CrossEntropyLoss())
    for images, labels in ctx.batches(batches(ctx)):
        step(images, labels)
    ctx.report_metric(_accuracy(ctx, model, *_held_out(ctx, int(os.environ.get("AUTOTUNE_JPEG_EVAL", "512")))))


def train(ctx) -> None:
    """The model on the JPEG folder, through ``ctx.image_loader`` (the backend is ``ctx.config.loader``)."""
    _fit(ctx, lambda c: c.image_loader(_root(), size=_size()))


def loader_only(ctx) -> None:
    """Iterate ``ctx.image_loader`` alone: the trial's throughput is the loader's, in images/s."""
    for _ in ctx.batches(ctx.image_loader(_root(), size=_size())):
        pass


class _DeviceBatches:
    """Two batches made once on the device, in the config's dtype and layout, yielded in turn."""

    def __init__(self, ctx) -> None:
        cfg, size = ctx.config, _size()
        gen = torch.Generator().manual_seed(ctx.seed)
        classes = len(list_images(_root()).classes)
        self.images = torch.randn(2 * cfg.batch_size, 3, size, size, generator=gen).to(input_dtype(cfg.precision))
        self.labels = torch.randint(0, classes, (2 * cfg.batch_size,), generator=gen)
        self.images, self.labels = ctx.to_device(self.images), ctx.to_device(self.labels)
        self.batch_size = cfg.batch_size

    def __iter__(self):
        for start in (0, self.batch_size):
            yield self.images[start : start + self.batch_size], self.labels[start : start + self.batch_size]


def train_synthetic(ctx) -> None:
    """The same model on batches already on the device: the config's compute ceiling."""
    _fit(ctx, _DeviceBatches)
