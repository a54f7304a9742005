"""The data of the model-zoo scripts (``zoo_convnext``, ``zoo_vit``): synthetic ImageNet-shaped images,
augmented on the CPU in the Dataset as a user's pipeline would be.

Each image is made from its index (a class tint over noise, so the labels are learnable), then randomly
cropped, resized, flipped and normalised in ``__getitem__`` with torchvision's transforms: the input
pipeline's cost is real CPU work per image. The scripts report no metric: the accuracy verdict rests on the
training loss paired step by step with the fp32 reference's (a held-out accuracy on this easy task saturates
at 1.0 within a short trial, which makes that part of the check blind).
"""

from __future__ import annotations

import torch
from torchvision.transforms import v2

CLASSES = 10


class TintedImages(torch.utils.data.Dataset):
    def __init__(self, n: int = 8192, size: int = 256, train: bool = True) -> None:
        self.n, self.size, self.train = n, size, train
        self.augment = v2.Compose([
            v2.RandomResizedCrop(224, scale=(0.35, 1.0), antialias=True), v2.RandomHorizontalFlip(),
            v2.ToDtype(torch.float32, scale=True), v2.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
        ]) if train else v2.Compose([
            v2.CenterCrop(224), v2.ToDtype(torch.float32, scale=True),
            v2.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
        ])

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        label = index % CLASSES
        generator = torch.Generator().manual_seed(index + (0 if self.train else 1_000_000))
        noise = torch.randint(0, 160, (3, self.size, self.size), generator=generator, dtype=torch.uint8)
        tint = torch.tensor([(label * 37) % 96, (label * 71) % 96, (label * 13) % 96], dtype=torch.uint8)
        image = noise + tint.view(3, 1, 1)
        # Each image's crop and flip are drawn from its own index, so the same sample is augmented the same
        # way in a worker or in the main process: the data order alone decides what a step sees.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(index)
            return self.augment(image), label
