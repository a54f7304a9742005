"""NVIDIA DALI behind ``ctx.image_loader`` (``loader: dali``). The only module that builds DALI pipelines
(``autotune.hardware`` only checks that ``nvidia.dali`` imports).

The pipeline: file reader (shared listing, global shuffle every epoch, sharded from the environment),
decode with a random crop (``mixed``: nvJPEG and the hardware JPEG decoder where the GPU has one;
``cpu`` without a GPU), resize to ``size`` x ``size``, random horizontal flip and normalisation in one
operator, labels moved to the GPU. It produces what the torch backend produces (``autotune.trial._images``).

Without a GPU the pipeline runs in DALI's CPU-only mode (``device_id=None``): every operator runs on
the CPU and batches come out as CPU tensors.
"""

from __future__ import annotations

import random
from typing import Any, Iterator, Sequence

import torch

from autotune._config import TrialConfig
from autotune._errors import KnobError
from autotune.trial._images import ImageList, Shard
from autotune.hardware import dali_availability

# nvJPEG's allocations grown once up front instead of at each larger image (NVIDIA's ResNet-50 recipe).
_DEVICE_MEMORY_PADDING = 211_025_920
_HOST_MEMORY_PADDING = 140_544_512


def output_dtype(precision: str) -> torch.dtype:
    """What the pipeline emits for a precision (before any cast on the device).

    DALI has no bfloat16, so bf16 trials get float16 and one cast on the device. Normalised pixels
    (a few units from zero) are far inside float16's range and float16 has 3 more mantissa bits than
    bfloat16, so the cast rounds to the same bfloat16 as float32 would (but for rare ties, one unit
    apart), while the pipeline writes half the bytes of float32.
    """
    return torch.float16 if precision in ("fp16", "bf16", "fp8") else torch.float32


class DaliImages:
    """A DALI pipeline as an iterable: each ``iter()`` is one epoch of ``(images, labels)`` batches.

    ``ctx.batches`` calls ``iter()`` again when an epoch ends; the underlying iterator resets itself
    at the end of every epoch (``auto_reset``). An epoch left half-read continues where it stopped.
    """

    def __init__(self, iterator: Any, *, dtype: torch.dtype, channels_last: bool, device: torch.device) -> None:
        self._iterator = iterator
        self.dtype = dtype
        self.channels_last = channels_last
        self.device = device

    def __len__(self) -> int:
        return len(self._iterator)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for outputs in self._iterator:
            images, labels = outputs[0]["images"], outputs[0]["labels"]
            if self.channels_last:
                # Batched HWC is NHWC memory: viewed as NCHW it is channels_last already, no copy.
                images = images.permute(0, 3, 1, 2)
            if images.dtype != self.dtype:
                images = images.to(self.dtype)  # bf16: see output_dtype
            yield images, labels.view(-1).long()


def build(
    listing: ImageList,
    *,
    config: TrialConfig,
    device: torch.device,
    seed: int,
    size: int,
    mean: Sequence[float],
    std: Sequence[float],
    shuffle: bool,
    shard: Shard,
    dtype: torch.dtype,
) -> DaliImages:
    """Build and start the pipeline for a trial's config.

    Raises:
        KnobError: DALI does not import here.
    """
    ok, detail = dali_availability()
    if not ok:
        raise KnobError(f"loader=dali needs NVIDIA DALI, the `dali` extra (pip install -e '.[dali]'): {detail}")
    from nvidia.dali import Pipeline, fn, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    gpu = device.type == "cuda"
    device_id = None
    if gpu:
        device_id = device.index if device.index is not None else torch.cuda.current_device()
    files = [path for path, _ in listing.samples]
    labels = [label for _, label in listing.samples]
    if shuffle:
        # DALI shuffles at every epoch, the first included in current releases; this fixes the first
        # epoch's order in older ones too. The same seed in every shard keeps the shards disjoint.
        order = list(range(len(files)))
        random.Random(seed).shuffle(order)
        files, labels = [files[i] for i in order], [labels[i] for i in order]
    pipe = Pipeline(
        batch_size=config.batch_size,
        num_threads=config.dali_threads,
        device_id=device_id,
        prefetch_queue_depth=config.dali_prefetch,
        seed=seed * 1009 + shard.index,  # augmentation differs per shard, the data order does not
    )
    with pipe:
        encoded, label = fn.readers.file(
            files=files,
            labels=labels,
            shuffle_after_epoch=shuffle,
            seed=seed,
            shard_id=shard.index,
            num_shards=shard.count,
            # Pad the shard's last batch instead of borrowing from the next epoch, so every epoch starts
            # at its first sample whatever the batch size; the iterator drops the padded batch.
            pad_last_batch=True,
            name="reader",
        )
        padding = {"device_memory_padding": _DEVICE_MEMORY_PADDING, "host_memory_padding": _HOST_MEMORY_PADDING}
        # Decoding with the crop window decodes only what the crop keeps on the CPU; torchvision's
        # RandomResizedCrop defaults (area 0.08-1, aspect 3/4-4/3) are DALI's too.
        images = fn.decoders.image_random_crop(
            encoded, device="mixed" if gpu else "cpu", output_type=types.RGB, **(padding if gpu else {})
        )
        images = fn.resize(images, resize_x=size, resize_y=size)
        images = fn.crop_mirror_normalize(
            images,
            dtype=types.FLOAT16 if output_dtype(config.precision) == torch.float16 else types.FLOAT,
            output_layout="HWC" if config.channels_last else "CHW",
            mean=[255.0 * m for m in mean],
            std=[255.0 * s for s in std],
            mirror=fn.random.coin_flip(probability=0.5),
        )
        pipe.set_outputs(images, label.gpu() if gpu else label)
    iterator = DALIGenericIterator(
        [pipe],
        ["images", "labels"],
        reader_name="reader",
        last_batch_policy=LastBatchPolicy.DROP,
        auto_reset=True,
    )
    return DaliImages(iterator, dtype=dtype, channels_last=config.channels_last, device=device)
