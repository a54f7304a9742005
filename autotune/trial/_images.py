"""Image-folder input for ``ctx.image_loader``: the listing, sharding, and the torch backend.

Both backends (torch here, DALI in ``autotune.trial._dali``) read the same listing, apply the same augmentation
(random resized crop with torchvision's defaults, a horizontal flip with probability 0.5, normalisation)
and hand over batches in the same form, so that their throughputs compare like with like:

- images ``(N, 3, size, size)`` on the trial's device, in the trial's input dtype (``input_dtype``),
  NCHW-contiguous, or channels_last when the config asks for it;
- labels ``(N,)`` int64 on the device.

Incomplete last batches are dropped on both.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

import torch

from autotune._errors import WorkloadError
from autotune.trial._knobs import AUTOCAST_DTYPES

IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)
# What torchvision's ImageFolder reads; DALI's image decoders read each of these formats too.
IMAGE_EXTENSIONS: tuple[str, ...] = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

ImageSource = Union[str, os.PathLike, Sequence[tuple[Union[str, os.PathLike], int]]]


@dataclass(frozen=True)
class ImageList:
    """The samples of an image source: ``(path, label)`` pairs, and the class names by label."""

    samples: tuple[tuple[str, int], ...]
    classes: tuple[str, ...]

    @property
    def labels(self) -> frozenset[int]:
        return frozenset(label for _, label in self.samples)


@dataclass(frozen=True)
class Shard:
    """Which part of the data this process reads when a job runs as several processes."""

    index: int = 0
    count: int = 1

    def bounds(self, n: int) -> tuple[int, int]:
        """The ``[start, end)`` of this shard among ``n`` samples, split the way DALI's readers split."""
        return n * self.index // self.count, n * (self.index + 1) // self.count


def list_images(source: ImageSource) -> ImageList:
    """List an image folder (one subfolder per class, like torchvision's ImageFolder) or a list of pairs.

    Classes are the sorted subfolder names and labels their positions; files are sorted, so the listing
    is the same in every process.

    Raises:
        WorkloadError: the folder does not exist or holds no image, or a label is not a non-negative int.
    """
    if isinstance(source, (str, os.PathLike)):
        root = Path(source)
        if not root.is_dir():
            raise WorkloadError(f"image folder {root} does not exist or is not a folder")
        classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
        samples: list[tuple[str, int]] = []
        for label, name in enumerate(classes):
            for folder, _, files in sorted(os.walk(root / name, followlinks=True)):
                for file in sorted(files):
                    if file.lower().endswith(IMAGE_EXTENSIONS):
                        samples.append((os.path.join(folder, file), label))
        if not samples:
            raise WorkloadError(
                f"image folder {root} holds no image in class subfolders (root/<class>/<image>, "
                f"extensions {', '.join(IMAGE_EXTENSIONS)})"
            )
        return ImageList(tuple(samples), tuple(classes))
    pairs = [(os.fspath(path), label) for path, label in source]
    if not pairs:
        raise WorkloadError("the image list is empty")
    for path, label in pairs:
        if not isinstance(label, int) or isinstance(label, bool) or label < 0:
            raise WorkloadError(f"image list: label {label!r} of {path} is not a non-negative integer")
    labels = sorted({label for _, label in pairs})
    return ImageList(tuple(pairs), tuple(str(label) for label in labels))


def shard_from_env(environ: Optional[Mapping[str, str]] = None) -> Shard:
    """This process's shard when the job is distributed, from the launcher's environment.

    ``RANK``/``WORLD_SIZE`` (torchrun, one shard per process of the job) win; ``LOCAL_RANK`` with
    ``LOCAL_WORLD_SIZE`` (one host) come next. Anything else is one shard, the whole data set.

    Raises:
        WorkloadError: the variables are set but not integers, or the rank is out of range.
    """
    env = os.environ if environ is None else environ
    for rank_key, size_key in (("RANK", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        if rank_key in env and size_key in env:
            try:
                index, count = int(env[rank_key]), int(env[size_key])
            except ValueError:
                raise WorkloadError(
                    f"{rank_key}={env[rank_key]!r} and {size_key}={env[size_key]!r} are not integers"
                ) from None
            if count < 1 or not 0 <= index < count:
                raise WorkloadError(f"{rank_key}={index} is not a rank of {size_key}={count}")
            return Shard(index, count)
    return Shard()


def shard_samples(listing: ImageList, shard: Shard, *, seed: int, shuffle: bool) -> list[tuple[str, int]]:
    """The samples one shard of the torch backend reads.

    With several shards and shuffling, the listing is shuffled once with the seed before it is split,
    so that no shard gets only a few classes of a class-sorted folder.
    """
    samples = list(listing.samples)
    if shard.count == 1:
        return samples
    if shuffle:
        random.Random(seed).shuffle(samples)
    start, end = shard.bounds(len(samples))
    return samples[start:end]


def input_dtype(precision: str) -> torch.dtype:
    """The dtype image batches arrive in: the autocast dtype, so the first layer casts nothing."""
    return AUTOCAST_DTYPES.get(precision, torch.float32)


class ImageFolderDataset(torch.utils.data.Dataset):
    """Decode (PIL), random resized crop, random horizontal flip; an HWC uint8 tensor and the label.

    Normalisation happens on the device (``DeviceImages``): uint8 crosses the bus at a quarter of the
    bytes of float32, as it does on DALI's side.
    """

    def __init__(self, samples: Sequence[tuple[str, int]], size: int) -> None:
        from torchvision import transforms

        self.samples = list(samples)
        self.transform = transforms.Compose(
            [transforms.RandomResizedCrop(size, antialias=True), transforms.RandomHorizontalFlip()]
        )

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        import numpy as np
        from PIL import Image

        path, label = self.samples[index]
        with Image.open(path) as image:
            image = self.transform(image.convert("RGB"))
        return torch.from_numpy(np.array(image, dtype=np.uint8)), label


class DeviceImages:
    """Wraps a DataLoader of uint8 HWC batches: each ``iter()`` is one epoch of device batches.

    The copy to the device and the normalisation happen inside ``next()``, so ``ctx.batches`` counts
    them as input wait, as DALI's own decode, crop and normalisation are.

    Args:
        loader: Yields ``(images uint8 (N, H, W, 3), labels (N,))`` on the host.
        device: Where batches go.
        dtype: The images' dtype (``input_dtype``).
        channels_last: Images in channels_last memory instead of NCHW-contiguous.
        mean, std: Per-channel normalisation, on the 0-1 scale.
        non_blocking: Asynchronous copies (the loader pins memory).
    """

    def __init__(
        self,
        loader: Any,
        *,
        device: torch.device,
        dtype: torch.dtype,
        channels_last: bool,
        mean: Sequence[float],
        std: Sequence[float],
        non_blocking: bool,
    ) -> None:
        self.loader = loader
        self.device = device
        self.dtype = dtype
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.non_blocking = non_blocking
        self._mean = torch.tensor([255.0 * m for m in mean], device=device).view(1, -1, 1, 1)
        self._scale = torch.tensor([1.0 / (255.0 * s) for s in std], device=device).view(1, -1, 1, 1)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for images, labels in self.loader:
            yield self.prepare(images, labels)

    def prepare(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Host uint8 NHWC -> normalised device images in the dtype and layout asked; labels int64."""
        images = images.to(self.device, non_blocking=self.non_blocking)
        labels = labels.to(self.device, non_blocking=self.non_blocking).long()
        # NHWC memory viewed as NCHW is channels_last; the one transposing copy (for NCHW) is done on
        # uint8, where it moves a quarter of the bytes. Arithmetic in float32, as DALI's normalisation.
        images = images.permute(0, 3, 1, 2).contiguous(memory_format=self.memory_format)
        images = images.to(torch.float32).sub_(self._mean).mul_(self._scale)
        return images.to(self.dtype), labels
