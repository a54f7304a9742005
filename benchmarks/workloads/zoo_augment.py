"""Two image classifiers as users write them, with per-sample random augmentation in the Dataset, for
``benchmarks/runners/augment_gpu.py`` (``augment: device``).

The images are decoded already and held in memory as uint8 (an ImageNet-sized subset, 256 x 256), and the
Dataset applies its torchvision ``transform`` in ``__getitem__``, as ``ImageFolder`` and the torchvision
datasets do: the DataLoader workers crop, flip, jitter and normalise every image on the CPU.

- ``train_vits``: a ViT-S/16 (timm's ``vit_small_patch16_224``; torchvision's ``VisionTransformer`` at the
  same sizes where timm is missing) with ``RandomResizedCrop``, ``RandomHorizontalFlip``, ``ToDtype`` and
  ``Normalize`` (torchvision v2); AdamW, batch 256.
- ``train_effnet``: a torchvision EfficientNet-B0 with ``RandomResizedCrop``, ``RandomHorizontalFlip`` and
  ``ColorJitter`` (v2) before the same conversion; SGD with Nesterov momentum, batch 256.

``AUGMENT_ZOO_TINY=1`` shrinks the images, the crop and the dataset for a check on a CPU.
"""

from __future__ import annotations

import os

import torch
import torchvision
from torchvision.transforms import v2

CLASSES = 10
BANK = 251  # noise images (prime: an image's class and its noise vary apart)
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
_IMAGES: dict[tuple[int, int], torch.Tensor] = {}  # decoded once per process, as a loaded dataset would be


def sizes() -> tuple[int, int, int]:
    """Images, their side, and the crop's side."""
    return (256, 72, 64) if os.environ.get("AUGMENT_ZOO_TINY") else (8192, 256, 224)


class DecodedImages(torch.utils.data.Dataset):
    """uint8 images in memory, each tinted by its class over noise (learnable), with a ``transform``."""

    def __init__(self, transform=None) -> None:
        n, side, _ = sizes()
        if (n, side) not in _IMAGES:
            # A bank of noise, each image one of it with its own brightness and its class's tint: drawing noise
            # for every image would take the CPU half a minute at ImageNet's size.
            generator = torch.Generator().manual_seed(0)
            bank = torch.randint(0, 128, (BANK, 3, side, side), generator=generator, dtype=torch.uint8)
            index = torch.arange(n)
            labels = index % CLASSES
            tint = torch.stack([(labels * 37) % 96, (labels * 71) % 96, (labels * 13) % 96], 1).to(torch.uint8)
            images = bank[index % BANK]
            images += tint.view(n, 3, 1, 1) + ((index // BANK) % 32).to(torch.uint8).view(n, 1, 1, 1)
            _IMAGES[(n, side)] = images
        self.images = _IMAGES[(n, side)]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        image = self.images[index]
        return (self.transform(image) if self.transform is not None else image), index % CLASSES


def _vit_small(crop: int) -> torch.nn.Module:
    try:
        import timm
    except ImportError:
        return torchvision.models.VisionTransformer(image_size=crop, patch_size=16, num_layers=12, num_heads=6,
                                                    hidden_dim=384, mlp_dim=1536, num_classes=CLASSES)
    return timm.create_model("vit_small_patch16_224", num_classes=CLASSES, img_size=crop)


def train_vits(ctx) -> None:
    _, _, crop = sizes()
    torch.manual_seed(ctx.seed)
    model = ctx.model(_vit_small(crop))
    optimizer = ctx.optimizer(torch.optim.AdamW, model.parameters(), lr=5e-4 * ctx.lr_scale, weight_decay=0.05)
    augment = v2.Compose([v2.RandomResizedCrop(crop, antialias=True), v2.RandomHorizontalFlip(),
                          v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])
    loader = ctx.loader(DecodedImages(augment), batch_size=256)
    step = ctx.train_step(model, optimizer, torch.nn.CrossEntropyLoss(label_smoothing=0.1))
    for images, labels in ctx.batches(loader):
        step(images, labels)


def train_effnet(ctx) -> None:
    _, _, crop = sizes()
    torch.manual_seed(ctx.seed)
    model = ctx.model(torchvision.models.efficientnet_b0(num_classes=CLASSES))
    optimizer = ctx.optimizer(torch.optim.SGD, model.parameters(), lr=0.05 * ctx.lr_scale, momentum=0.9,
                              nesterov=True, weight_decay=4e-5)
    augment = v2.Compose([v2.RandomResizedCrop(crop, scale=(0.35, 1.0), antialias=True), v2.RandomHorizontalFlip(),
                          v2.ColorJitter(0.3, 0.3, 0.3), v2.ToDtype(torch.float32, scale=True),
                          v2.Normalize(MEAN, STD)])
    own = torch.utils.data.DataLoader(DecodedImages(augment), batch_size=256, shuffle=True, num_workers=8,
                                      pin_memory=True, persistent_workers=True)
    loader = ctx.loader(own)
    step = ctx.train_step(model, optimizer, torch.nn.CrossEntropyLoss())
    for images, labels in ctx.batches(loader):
        step(images, labels)
