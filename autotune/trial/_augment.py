"""``augment=device``: a dataset's torchvision transforms run on the device, batch-wise, each sample with its
own random draw.

The items are served before their transforms (the image as a uint8 tensor, the rest of the item as it was),
through the DataLoader (pinned) or from the device (``loader=device``), and the same transforms then run on
each batch on the device. Where the transforms are found: a dataset's ``transform`` attribute, where
torchvision's datasets (``ImageFolder``, ``CIFAR10``, a ``Subset`` of one) keep it, or the transform given to
``ctx.loader(dataset, transform=...)``, which is applied to each item's first field.

What runs on the device (``compile_pipeline``), v2 and v1 classes alike: ``RandomResizedCrop`` (torchvision's
box sampling, per sample, then ``torchvision.ops.roi_align`` to the output size), ``RandomCrop`` (padding
included), ``RandomHorizontalFlip``, ``RandomVerticalFlip``, ``ColorJitter`` (per-sample factors and order),
``Normalize``, ``ToDtype``/``ConvertImageDtype``/``ToTensor``, ``Resize``, ``CenterCrop``, and the
conversions to a tensor (``ToImage``, ``PILToTensor``), in a ``Compose``. Anything else keeps the pipeline
on the CPU: ``Unsupported`` names it. Each op follows torchvision's tensor kernels, uint8 rounding included,
so a batch is distributed as the CPU's items are; the draws themselves differ (a device generator seeded
by the trial's seed, not the workers' CPU generators), so a run's batches are not the CPU's batch for batch.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from autotune._errors import KnobError


# torchvision's float-to-uint8 conversion (``to_dtype_image``): multiply by 256 - eps and truncate.
_TO_UINT8 = 255 + 1.0 - 1e-3
_GRAY = (0.2989, 0.587, 0.114)  # torchvision's rgb_to_grayscale weights
_RRC_ATTEMPTS = 10  # torchvision's RandomResizedCrop tries this many boxes before its central fallback


class Unsupported(KnobError):
    """A transform (or a dataset) that ``augment=device`` cannot run on the device; the message says which
    (``ctx.loader`` raises it as a ``KnobError`` starting ``augment=device: ``)."""


# -- the batch as the ops see it ----------------------------------------------------------------------------

@dataclass
class Images:
    """A batch of images on the device, (B, C, H, W) float32, and the dtype torchvision would hold them in.

    ``integer``: torchvision's pipeline would still hold uint8 here, so values are in [0, 255] and each op
    rounds as its uint8 kernel does; otherwise float values (in [0, 1] after a scaling conversion).
    """

    data: torch.Tensor
    integer: bool
    out_dtype: torch.dtype = torch.float32
    # Images of several sizes, zero-padded to the largest (``pad``): each one's (height, width), until an op
    # that gives them one size (RandomResizedCrop, Resize to a height and width); None when they have one.
    sizes: Optional[torch.Tensor] = None

    @property
    def bound(self) -> float:
        return 255.0 if self.integer else 1.0


class Op:
    """One transform on a batch: ``shape`` maps the input's (C, H, W) to the output's (checked once, when the
    pipeline is compiled for the served size), ``__call__`` runs it with the pipeline's generator."""

    name = "op"

    def shape(self, chw: tuple[int, int, int]) -> tuple[int, int, int]:
        return chw

    def __call__(self, x: Images, gen: torch.Generator) -> Images:
        raise NotImplementedError


def _uniform(n: int, low: float, high: float, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    return torch.rand(n, generator=gen, device=device, dtype=torch.float32) * (high - low) + low


def _randint(high: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Per element, an integer uniform in [0, high) (``high`` >= 1), drawn on ``high``'s device."""
    u = torch.rand(high.shape, generator=gen, device=high.device, dtype=torch.float64)
    return torch.minimum((u * high).floor().long(), high.long() - 1)


def _crop(x: torch.Tensor, top: torch.Tensor, left: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Per sample, the window of ``height`` x ``width`` at (``top``, ``left``): one gather for the batch."""
    b, c = x.shape[:2]
    rows = (top.view(b, 1) + torch.arange(height, device=x.device)).view(b, 1, height, 1)
    cols = (left.view(b, 1) + torch.arange(width, device=x.device)).view(b, 1, 1, width)
    batch = torch.arange(b, device=x.device).view(b, 1, 1, 1)
    channel = torch.arange(c, device=x.device).view(1, c, 1, 1)
    return x[batch, channel, rows, cols]


def _mode(interpolation: Any) -> str:
    return str(getattr(interpolation, "value", interpolation)).lower()


# -- geometry -------------------------------------------------------------------------------------------------

@dataclass
class RandomResizedCrop(Op):
    size: tuple[int, int]
    scale: tuple[float, float]
    ratio: tuple[float, float]
    antialias: bool = True
    name: str = "RandomResizedCrop"
    _hw: tuple[int, int] = (0, 0)

    def shape(self, chw: tuple[int, int, int]) -> tuple[int, int, int]:
        self._hw = chw[1:]
        return (chw[0], *self.size)

    def boxes(self, n: int, gen: torch.Generator, device: torch.device,
              sizes: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``n`` crop boxes (top, left, height, width), each drawn as torchvision's ``make_params`` does:
        the first of ten (area, aspect) attempts that fits, else the central fallback. ``sizes``: each
        image's (height, width) where they differ; else the size the pipeline was compiled for."""
        if sizes is None:  # filled on the device: a tensor made from a list would copy it there and wait
            height = torch.full((n, 1), float(self._hw[0]), dtype=torch.float64, device=device)
            width = torch.full((n, 1), float(self._hw[1]), dtype=torch.float64, device=device)
        else:
            height, width = sizes.to(device=device, dtype=torch.float64).split(1, dim=1)
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        target = height * width * _uniform(n * _RRC_ATTEMPTS, *self.scale, gen, device).view(n, _RRC_ATTEMPTS).double()
        aspect = torch.exp(_uniform(n * _RRC_ATTEMPTS, *log_ratio, gen, device).view(n, _RRC_ATTEMPTS).double())
        w = torch.round(torch.sqrt(target * aspect))  # round half to even, as Python's round
        h = torch.round(torch.sqrt(target / aspect))
        fits = (w > 0) & (w <= width) & (h > 0) & (h <= height)
        first = fits.int().argmax(dim=1, keepdim=True)
        w, h = w.gather(1, first).squeeze(1), h.gather(1, first).squeeze(1)
        any_fit = fits.any(dim=1)
        height, width = height.squeeze(1), width.squeeze(1)
        # The central fallback: the whole image, cut to the nearest aspect ratio the range allows.
        low, high = min(self.ratio), max(self.ratio)
        in_ratio = width / height
        fw = torch.where(in_ratio > high, torch.round(height * high), width)
        fh = torch.where(in_ratio < low, torch.round(width / low), height)
        w, h = torch.where(any_fit, w, fw), torch.where(any_fit, h, fh)
        top = torch.where(any_fit, _randint(height - h + 1, gen).double(),
                          torch.div(height - fh, 2, rounding_mode="floor"))
        left = torch.where(any_fit, _randint(width - w + 1, gen).double(),
                           torch.div(width - fw, 2, rounding_mode="floor"))
        return torch.stack([top, left, h, w], dim=1)

    def __call__(self, x: Images, gen: torch.Generator) -> Images:
        b = x.data.shape[0]
        box = self.boxes(b, gen, x.data.device, x.sizes).to(x.data.dtype)
        top, left, h, w = box.unbind(1)
        return Images(resized_crop(x, top, left, h, w, self.size), x.integer, x.out_dtype)


def resized_crop(x: Images, top: torch.Tensor, left: torch.Tensor, h: torch.Tensor, w: torch.Tensor,
                 size: tuple[int, int]) -> torch.Tensor:
    """Each sample's box resized to ``size``, bilinear (pixel centres as ``interpolate``'s
    ``align_corners=False``): ``roi_align`` samples every output pixel's bin, averaging more points where the
    box is larger than the output, as an antialiasing filter would (so a transform's ``antialias=False`` is
    antialiased here too)."""
    from torchvision.ops import roi_align

    b = x.data.shape[0]
    rois = torch.stack([torch.arange(b, device=x.data.device, dtype=x.data.dtype), left, top, left + w, top + h], 1)
    out = roi_align(x.data, rois, output_size=size, spatial_scale=1.0, sampling_ratio=-1, aligned=True)
    return out.round_().clamp_(0, 255) if x.integer else out


@dataclass
class Resize(Op):
    size: Sequence[int]
    mode: str = "bilinear"
    max_size: Optional[int] = None
    antialias: bool = True
    name: str = "Resize"
    _out: tuple[int, int] = (0, 0)

    def shape(self, chw: tuple[int, int, int]) -> tuple[int, int, int]:
        c, height, width = chw
        if len(self.size) == 2:
            self._out = (int(self.size[0]), int(self.size[1]))
            return (c, *self._out)
        short, long = (height, width) if height <= width else (width, height)
        new_short, new_long = int(self.size[0]), int(int(self.size[0]) * long / short)
        if self.max_size is not None and new_long > self.max_size:
            new_short, new_long = int(self.max_size * new_short / new_long), self.max_size
        self._out = (new_short, new_long) if height <= width else (new_long, new_short)
        return (c, *self._out)

    def __call__(self, x: Images, gen: torch.Generator) -> Images:
        if x.sizes is not None:  # images of several sizes, each resized whole (bilinear, checked by ``plan``)
            zero = torch.zeros(x.data.shape[0], dtype=x.data.dtype, device=x.data.device)
            h, w = x.sizes.to(device=x.data.device, dtype=x.data.dtype).unbind(1)
            return Images(resized_crop(x, zero, zero, h, w, self._out), x.integer, x.out_dtype)
        if tuple(x.data.shape[-2:]) == self._out:
            return x
        smooth = self.mode in ("bilinear", "bicubic")
        out = F.interpolate(x.data, size=self._out, mode=self.mode, antialias=self.antialias and smooth,
                            align_corners=False if smooth else None)
        if x.integer:
            out = out.round_().clamp_(0, 255)
        elif self.mode == "bicubic":
            out = out.clamp_(0, 1)  # torchvision clamps a float bicubic resize to the image's range
        return Images(out, x.integer, x.out_dtype)


@dataclass
class CenterCrop(Op):
    size: tuple[int, int]
    name: str = "CenterCrop"

    def __call__(self, x: Images, gen: torch.Generator) -> Images:
        th, tw = self.size
        data = x.data
        height, width = data.shape[-2:]
        if th > height or tw > width:
            # torchvision pads with zeros around the image (left/top get the smaller half).
            pw, ph = max(tw - width, 0), max(th - height, 0)
            data = F.pad(data, (pw // 2, (pw + 1) // 2, ph // 2, (ph + 1) // 2))
            height, width = data.shape[-2:]
        top, left = int(round((height - th) / 2.0)), int(round((width - tw) / 2.0))
        return Images(data[..., top:top + th, left:left + tw], x.integer, x.out_dtype)

    def shape(self, chw: tuple[int, int, int]) -> tuple[int, int, int]:
        return (chw[0], *self.size)


_PAD_MODES = {"constant": "constant", "edge": "replicate", "reflect": "reflect"}


@dataclass
class RandomCrop(Op):
    size: tuple[int, int]
    padding: tuple[int, int, int, int] = (0, 0, 0, 0)  # left, right, top, bottom
    pad_if_needed: bool = False
    fill: float = 0.0
    padding_mode: str = "constant"
    name: str = "RandomCrop"

    def _padding(self, height: int, width: int) -> tuple[int, int, int, int]:
        left, right, top, bottom = self.padding
        if self.pad_if_needed:
            if height + top + bottom < self.size[0]:
                diff = self.size[0] - (height + top + bottom)
                top, bottom = top + diff, bottom + diff
            if width + left + right < self.size[1]:
                diff = self.size[1] - (width + left + right)
                left, right = left + diff, right + diff
        return left, right, top, bottom

    def shape(self, chw: tuple[int, int, int]) -> tuple[int, int, int]:
        left, right, top, bottom = self._padding(*chw[1:])
        if chw[1] + top + bottom < self.size[0] or chw[2] + left + right < self.size[1]:
            raise Unsupported(f"RandomCrop{self.size} is larger than its padded input {chw[1:]}")
        return (chw[0], *self.size)

    def __call__(self, x: Images, gen: torch.Generator) -> Images:
        data = x.data
        pad = self._padding(*data.shape[-2:])
        if any(pad):
            mode = _PAD_MODES[self.padding_mode]
            data = F.pad(data, pad, mode=mode, value=float(self.fill)) if mode == "constant" else \
                F.pad(data, pad, mode=mode)
        b, (height, width) = data.shape[0], data.shape[-2:]
        th, tw = self.size
        top = _randint(torch.full((b,), height - th + 1, device=data.device), gen)
        left = _randint(torch.full((b,), width - tw + 1, device=data.device), gen)
        return Images(_crop(data, top, left, th, tw), x.integer, x.out_dtype)


@dataclass
class RandomFlip(Op):
    p: float
    dim: int = -1  # -1: horizontal (RandomHorizontalFlip), -2: vertical
    name: str = "RandomHorizontalFlip"

    def __call__(self, x: Images, gen: torch.Generator) -> Images:
        b = x.data.shape[0]
        flip = (torch.rand(b, generator=gen, device=x.data.device) < self.p).view(b, 1, 1, 1)
        return Images(torch.where(flip, x.data.flip(self.dim), x.data), x.integer, x.out_dtype)


# -- colour and dtype ------------------------------------------------------------------------------------------

@dataclass
class ToFloat(Op):
    """``ToDtype(float, scale=...)``, ``ConvertImageDtype(float)``, v1 ``ToTensor``: the batch becomes float,
    divided by 255 when scaling a uint8 image."""

    dtype: torch.dtype = torch.float32
    scale: bool = True
    name: str = "ToDtype"

    def __call__(self, x: Images, gen: torch.Generator) -> Images:
        if not x.integer:
            return Images(x.data, False, self.dtype, x.sizes)
        return Images(x.data / 255.0 if self.scale else x.data, False, self.dtype, x.sizes)


@dataclass
class Normalize(Op):
    mean: Sequence[float]
    std: Sequence[float]
    name: str = "Normalize"

    _on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def __call__(self, x: Images, gen: torch.Generator) -> Images:
        device, c = x.data.device, x.data.shape[1]
        if device not in self._on:  # copied once: no host-to-device copy per batch
            self._on[device] = tuple(torch.as_tensor(v, dtype=torch.float32, device=device).view(1, -1, 1, 1)
                                     .expand(1, c, 1, 1) for v in (self.mean, self.std))  # type: ignore[assignment]
        mean, std = self._on[device]
        return Images((x.data - mean) / std, False, x.out_dtype)


def _grayscale(x: Images) -> torch.Tensor:
    r, g, b = x.data.unbind(1)
    gray = (r * _GRAY[0] + g * _GRAY[1] + b * _GRAY[2]).unsqueeze(1)
    return gray.floor_() if x.integer else gray


def _blend(x: Images, other: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    out = (x.data * ratio + other * (1.0 - ratio)).clamp_(0, x.bound)
    return out.floor_() if x.integer else out


def _rgb_to_hsv(image: torch.Tensor) -> torch.Tensor:
    """torchvision's ``_rgb_to_hsv`` (Pillow's algorithm), batch-wise."""
    r, g, _ = image.unbind(dim=-3)
    minc, maxc = torch.aminmax(image, dim=-3)
    eqc = maxc == minc
    channels_range = maxc - minc
    ones = torch.ones_like(maxc)
    s = channels_range / torch.where(eqc, ones, maxc)
    divisor = torch.where(eqc, ones, channels_range).unsqueeze(-3)
    rc, gc, bc = ((maxc.unsqueeze(-3) - image) / divisor).unbind(dim=-3)
    maxc_neq_r = maxc != r
    maxc_eq_g = maxc == g
    hg = (rc + 2.0 - bc) * (maxc_eq_g & maxc_neq_r)
    hr = (bc - gc) * (~maxc_neq_r)
    hb = (gc + 4.0 - rc) * (maxc_neq_r & ~maxc_eq_g)
    h = ((hr + hg + hb) / 6.0 + 1.0).fmod(1.0)
    return torch.stack((h, s, maxc), dim=-3)


def _hsv_to_rgb(hsv: torch.Tensor) -> torch.Tensor:
    """HSV to RGB, elementwise: each channel is ``v - v s clamp(min(k, 4 - k), 0, 1)`` with
    ``k = (n + 6 h) mod 6`` (n = 5, 3, 1 for red, green, blue), the same values as torchvision's sector table
    (``_hsv_to_rgb``) without its gather of an index per pixel."""
    h, s, v = hsv.unbind(dim=-3)
    channels = []
    for n in (5.0, 3.0, 1.0):
        k = (h * 6.0 + n).remainder(6.0)
        channels.append(v - v * s * torch.minimum(k, 4.0 - k).clamp(0.0, 1.0))
    return torch.stack(channels, dim=-3)


@dataclass
class ColorJitter(Op):
    """Per sample: a factor for each of brightness, contrast, saturation and hue (uniform in its range) and a
    random order of the four, as torchvision draws them for each image."""

    brightness: Optional[tuple[float, float]] = None
    contrast: Optional[tuple[float, float]] = None
    saturation: Optional[tuple[float, float]] = None
    hue: Optional[tuple[float, float]] = None
    name: str = "ColorJitter"

    def __call__(self, x: Images, gen: torch.Generator) -> Images:
        b, c = x.data.shape[:2]
        device = x.data.device
        order = torch.rand(b, 4, generator=gen, device=device).argsort(dim=1)  # a uniform permutation per sample
        ranges = (self.brightness, self.contrast, self.saturation, self.hue)
        factors = [None if r is None else _uniform(b, r[0], r[1], gen, device).view(b, 1, 1, 1) for r in ranges]
        blends = [fn for fn in (0, 1, 2) if factors[fn] is not None and not (c == 1 and fn == 2)]
        hue = factors[3] is not None and c == 3  # saturation and hue leave a grey image as it is
        for position in range(4):
            chosen = order[:, position].view(b, 1, 1, 1)
            if blends:
                # Brightness, contrast and saturation are each a blend towards something (black, the grey mean,
                # the grey image): one blend a position, each sample towards its own op's target by its own
                # factor, and by 1 (itself, exactly) where its op here is another.
                ratio = torch.ones((b, 1, 1, 1), device=device)
                for fn in blends:
                    ratio = torch.where(chosen == fn, factors[fn], ratio)  # type: ignore[arg-type]
                target = torch.zeros((), device=device)
                if 1 in blends or 2 in blends:
                    gray = _grayscale(x) if c == 3 else x.data
                    mean = gray.mean(dim=(-3, -2, -1), keepdim=True)
                    target = torch.where(chosen == 1, mean, gray) if 2 in blends else mean
                    target = torch.where(chosen == 0, 0.0, target)
                x = Images(_blend(x, target, ratio), x.integer, x.out_dtype)
            if hue:
                x = Images(torch.where(chosen == 3, self._adjust(3, x, factors[3]), x.data),  # type: ignore[arg-type]
                           x.integer, x.out_dtype)
        return x

    @staticmethod
    def _adjust(fn: int, x: Images, factor: torch.Tensor) -> torch.Tensor:
        if fn == 0:  # brightness
            out = (x.data * factor).clamp_(0, x.bound)
            return out.floor_() if x.integer else out
        if fn == 1:  # contrast: towards the mean of the grey image
            gray = _grayscale(x) if x.data.shape[1] == 3 else x.data
            return _blend(x, gray.mean(dim=(-3, -2, -1), keepdim=True), factor)
        if fn == 2:  # saturation: towards the grey image
            return _blend(x, _grayscale(x), factor)
        image = x.data / 255.0 if x.integer else x.data  # hue: in HSV, on a float image
        hsv = _rgb_to_hsv(image)
        h, s, v = hsv.unbind(1)
        out = _hsv_to_rgb(torch.stack(((h + factor.view(-1, 1, 1)).remainder(1.0), s, v), dim=1))
        return (out * _TO_UINT8).floor_() if x.integer else out


@dataclass
class Identity(Op):
    """A conversion to a tensor (``ToImage``, ``PILToTensor``): the items are served as tensors already."""

    name: str = "ToImage"

    def __call__(self, x: Images, gen: torch.Generator) -> Images:
        return x


# -- recognising torchvision's transforms -------------------------------------------------------------------

def _pair(size: Any) -> tuple[int, int]:
    if isinstance(size, int):
        return (size, size)
    size = list(size)
    return (int(size[0]), int(size[0])) if len(size) == 1 else (int(size[0]), int(size[1]))


def _padding(padding: Any, v2: bool) -> tuple[int, int, int, int]:
    """(left, right, top, bottom) from a RandomCrop's ``padding`` (v2 keeps it so; v1 as the user gave it)."""
    if padding is None:
        return (0, 0, 0, 0)
    if isinstance(padding, int):
        return (padding,) * 4  # type: ignore[return-value]
    values = [int(v) for v in padding]
    if v2:
        return tuple(values)  # type: ignore[return-value]
    if len(values) == 1:
        return (values[0],) * 4  # type: ignore[return-value]
    if len(values) == 2:
        return (values[0], values[0], values[1], values[1])
    left, top, right, bottom = values
    return (left, right, top, bottom)


def _named(transform: Any) -> str:
    module = type(transform).__module__
    where = "torchvision v2" if ".v2" in module else "torchvision" if module.startswith("torchvision") else module
    return f"{type(transform).__name__} ({where})"


def flatten(transform: Any) -> list[Any]:
    """The transforms of a ``Compose`` (v1 or v2, nested ones unfolded) in order; a single transform alone."""
    name = type(transform).__name__
    if name == "Compose" and type(transform).__module__.startswith("torchvision"):
        return [t for inner in transform.transforms for t in flatten(inner)]
    return [transform]


def recognise(transform: Any) -> Op:
    """The device op of one torchvision transform.

    Raises:
        Unsupported: a transform (or a setting of one) that has no device op here, named.
    """
    name = type(transform).__name__
    module = type(transform).__module__
    if not module.startswith("torchvision.transforms"):
        raise Unsupported(f"{_named(transform)} is not a torchvision transform")
    v2 = ".v2" in module
    if name in ("ToImage", "PILToTensor", "ToPureTensor"):
        return Identity(name=name)
    if name == "ToTensor":
        return ToFloat(torch.float32, True, name=name)
    if name in ("ToDtype", "ConvertImageDtype"):
        dtype = transform.dtype
        if isinstance(dtype, dict) or not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise Unsupported(f"{_named(transform)} to {dtype} (only a conversion to a floating dtype runs on the "
                              "device)")
        return ToFloat(dtype, bool(getattr(transform, "scale", True)), name=name)
    if name == "Normalize":
        return Normalize(list(transform.mean), list(transform.std))
    if name in ("RandomHorizontalFlip", "RandomVerticalFlip"):
        return RandomFlip(float(transform.p), -1 if name == "RandomHorizontalFlip" else -2, name=name)
    if name == "RandomResizedCrop":
        if _mode(transform.interpolation) != "bilinear":
            raise Unsupported(f"{_named(transform)} with {_mode(transform.interpolation)} interpolation (the device "
                              "crop is bilinear)")
        return RandomResizedCrop(_pair(transform.size), tuple(transform.scale), tuple(transform.ratio),
                                 antialias=bool(transform.antialias))
    if name == "Resize":
        mode = _mode(transform.interpolation)
        if mode not in ("bilinear", "bicubic", "nearest", "nearest-exact"):
            raise Unsupported(f"{_named(transform)} with {mode} interpolation")
        size = [transform.size] if isinstance(transform.size, int) else list(transform.size or [])
        if not size:
            raise Unsupported(f"{_named(transform)} without a size (max_size alone)")
        return Resize(size, mode, transform.max_size, bool(transform.antialias if transform.antialias is not None
                                                            else True))
    if name == "CenterCrop":
        return CenterCrop(_pair(transform.size))
    if name == "RandomCrop":
        if transform.padding_mode not in _PAD_MODES:
            raise Unsupported(f"{_named(transform)} with padding_mode={transform.padding_mode}")
        fill = transform.fill
        if isinstance(fill, dict) or isinstance(fill, (list, tuple)):
            raise Unsupported(f"{_named(transform)} with a fill of several values ({fill!r})")
        return RandomCrop(_pair(transform.size), _padding(transform.padding, v2), bool(transform.pad_if_needed),
                          float(fill or 0), transform.padding_mode)
    if name == "ColorJitter":
        return ColorJitter(*(None if r is None else (float(r[0]), float(r[1]))
                             for r in (transform.brightness, transform.contrast, transform.saturation, transform.hue)))
    raise Unsupported(f"{_named(transform)} has no device implementation")


@dataclass
class Pipeline:
    """The device ops of a transform, compiled for the served images' size, with the generator that draws for
    every sample. ``names``: the transforms, in order, for the record."""

    ops: list[Op]
    names: list[str]
    generator: torch.Generator
    integer: bool  # the served images are uint8
    out_shape: tuple[int, int, int] = (0, 0, 0)

    def __call__(self, images: torch.Tensor, sizes: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The augmented batch of ``images`` (B, C, H, W); ``sizes``: each one's (height, width) where they
        were padded to one size (``pad``)."""
        x = Images(images.float(), self.integer, sizes=sizes)
        for op in self.ops:
            x = op(x, self.generator)
        if x.integer:
            return x.data.to(torch.uint8)
        return x.data.to(x.out_dtype)


def sizing_refusal(transform: Any) -> Optional[str]:
    """Why ``transform`` cannot take images of several sizes (None when it can): the first op past the
    conversions must give them one size, per image (``RandomResizedCrop``, or a bilinear ``Resize`` to a
    height and width)."""
    for t in flatten(transform):
        op = recognise(t)
        if isinstance(op, (Identity, ToFloat)):
            continue
        if isinstance(op, RandomResizedCrop) or (isinstance(op, Resize) and len(op.size) == 2
                                                  and op.mode == "bilinear"):
            return None
        return f"{op.name} comes first, which needs them in one size (RandomResizedCrop or Resize((h, w)) gives it)"
    return "no transform gives them one size (RandomResizedCrop or Resize((h, w)) would)"


def compile_pipeline(transform: Any, chw: tuple[int, int, int], *, integer: bool, seed: int,
                     device: torch.device) -> Pipeline:
    """The device pipeline of ``transform`` for served images of size ``chw``.

    Raises:
        Unsupported: a transform it cannot run, named, or a size that does not fit (a crop larger than its
            input).
    """
    transforms = flatten(transform)
    ops = [recognise(t) for t in transforms]
    shape, uint8 = chw, integer
    for op in ops:
        if isinstance(op, Normalize) and uint8:
            raise Unsupported("Normalize of a uint8 image (torchvision refuses it too): convert it with "
                              "ToDtype(torch.float32, scale=True) first")
        if isinstance(op, ColorJitter) and shape[0] not in (1, 3):
            raise Unsupported(f"ColorJitter on images of {shape[0]} channels (torchvision takes 1 or 3)")
        shape = op.shape(shape)
        uint8 = uint8 and not isinstance(op, ToFloat)
    generator = torch.Generator(device=device)
    generator.manual_seed(int(seed))
    return Pipeline(ops, [type(t).__name__ for t in transforms], generator, integer, shape)


# -- serving the items before their transforms --------------------------------------------------------------

class _Marked:
    """What a marking transform returns: the input it was given, found again in the item."""

    def __init__(self, value: Any) -> None:
        self.value = value


class _Mark:
    def __call__(self, value: Any) -> _Marked:
        return _Marked(value)


class Serve:
    """The transform that serves an item's image before its transforms: a CHW tensor (uint8 from a PIL image
    or an HWC uint8 array), contiguous, so the DataLoader collates and pins it."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __call__(self, value: Any) -> torch.Tensor:
        if self.kind == "pil":
            from torchvision.transforms.functional import pil_to_tensor

            return pil_to_tensor(value)
        if self.kind == "array":
            array = np.asarray(value)
            tensor = torch.from_numpy(np.ascontiguousarray(array))
            return (tensor.unsqueeze(0) if tensor.dim() == 2 else tensor.permute(2, 0, 1)).contiguous()
        return value.as_subclass(torch.Tensor).contiguous()


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        if value.dim() != 3:
            raise Unsupported(f"the image before its transforms is a tensor of {value.dim()} dimensions, not (C, H, W)")
        return "tensor"
    if isinstance(value, np.ndarray):
        if value.ndim not in (2, 3):
            raise Unsupported(f"the image before its transforms is an array of {value.ndim} dimensions")
        return "array"
    if type(value).__module__.startswith("PIL."):
        return "pil"
    raise Unsupported(f"the image before its transforms is a {type(value).__name__}, not a PIL image, an array "
                      "or a tensor")


class Transformed(torch.utils.data.Dataset):
    """``dataset`` with ``transform`` applied to each item's first field (the item itself when it is not a
    tuple, list or dict): the transform declared with ``ctx.loader(dataset, transform=...)``."""

    def __init__(self, dataset: Any, transform: Any) -> None:
        self.dataset = dataset
        self.transform = transform

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        item = self.dataset[index]
        if isinstance(item, tuple):
            return (self.transform(item[0]), *item[1:])
        if isinstance(item, list):
            return [self.transform(item[0]), *item[1:]]
        if isinstance(item, dict) and item:
            first = next(iter(item))
            return {**item, first: self.transform(item[first])}
        return self.transform(item)


def _with_transform(dataset: Any, transform: Any) -> Any:
    """A shallow copy of ``dataset`` whose transform is ``transform`` (through a ``Subset``; the joint
    ``transforms`` of a torchvision dataset follows): the script's own dataset is left as it is."""
    if isinstance(dataset, Transformed):
        return Transformed(dataset.dataset, transform)
    if isinstance(dataset, torch.utils.data.Subset):
        return torch.utils.data.Subset(_with_transform(dataset.dataset, transform), dataset.indices)
    served = copy.copy(dataset)
    old = getattr(dataset, "transform")
    served.transform = transform
    joint = getattr(dataset, "transforms", None)
    if type(joint).__name__ == "StandardTransform" and getattr(joint, "transform", None) is old:
        served.transforms = type(joint)(transform, getattr(joint, "target_transform", None))
    return served


def find_transform(dataset: Any) -> Any:
    """The transform a dataset applies to its images: its ``transform`` (a ``Subset``'s dataset's, a
    ``Transformed``'s), None when it has none."""
    if isinstance(dataset, torch.utils.data.Subset):
        return find_transform(dataset.dataset)
    return getattr(dataset, "transform", None)


def _path_to(item: Any, path: tuple[Any, ...] = ()) -> Optional[tuple[Any, ...]]:
    if isinstance(item, _Marked):
        return path
    children = item.items() if isinstance(item, dict) else enumerate(item) if isinstance(item, (list, tuple)) else ()
    for key, value in children:
        found = _path_to(value, (*path, key))
        if found is not None:
            return found
    return None


def at(batch: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        batch = batch[key]
    return batch


def replaced(batch: Any, path: tuple[Any, ...], value: Any) -> Any:
    """``batch`` with the leaf at ``path`` replaced by ``value`` (tuples and lists rebuilt, dicts copied)."""
    if not path:
        return value
    key, rest = path[0], path[1:]
    if isinstance(batch, dict):
        return {**batch, key: replaced(batch[key], rest, value)}
    items = list(batch)
    items[key] = replaced(items[key], rest, value)
    return type(batch)(items) if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields") else \
        type(batch)(*items)


def pad(images: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Images of several sizes as one batch: each at the top left of a zero tensor one row and one column
    larger than the largest, its last row and column copied once past its edge (so bilinear sampling at its
    border reads its own edge, as ``interpolate`` does, never the padding), and each one's (height, width)."""
    sizes = torch.tensor([[int(im.shape[-2]), int(im.shape[-1])] for im in images], dtype=torch.long)
    height, width = (int(v) + 1 for v in sizes.max(dim=0).values)
    out = images[0].new_zeros((len(images), images[0].shape[0], height, width))
    for i, image in enumerate(images):
        h, w = image.shape[-2:]
        out[i, :, :h, :w] = image
        out[i, :, h, :w] = image[:, h - 1]
        out[i, :, :h + 1, w] = out[i, :, :h + 1, w - 1]
    return out, sizes


class ServedCollate:
    """The DataLoader's collate of the served items: the default collate, with the images at ``path`` stacked,
    or padded with their sizes (``pad``) where they differ and the transforms take that (``ragged``).

    Raises:
        KnobError: images of several sizes where the transforms need one (which ``plan`` found first).
    """

    def __init__(self, path: tuple[Any, ...], ragged: Optional[str]) -> None:
        self.path = path
        self.ragged = ragged  # why the transforms cannot take several sizes, None when they can

    def __call__(self, items: list[Any]) -> Any:
        images = [at(item, self.path) for item in items]
        rest = torch.utils.data.default_collate([replaced(item, self.path, 0) for item in items])
        if all(image.shape == images[0].shape for image in images):
            return replaced(rest, self.path, torch.utils.data.default_collate(images))
        if self.ragged:
            raise KnobError(f"augment=device: its images before their transforms differ in size: {self.ragged}")
        return replaced(rest, self.path, pad(images))


@dataclass
class Plan:
    """How ``augment=device`` serves a dataset: ``served`` yields the items with the image before its
    transforms (a tensor of ``chw``) at ``path`` in each item (and in each batch that ``collate`` makes), and
    ``transform`` is what then runs on the device. ``one_size``: the images probed have one size (else the
    batches pad them, and they cannot be kept on the device)."""

    served: Any
    transform: Any
    path: tuple[Any, ...]
    chw: tuple[int, int, int]
    integer: bool
    one_size: bool = True
    names: list[str] = field(default_factory=list)

    @property
    def collate(self) -> ServedCollate:
        return ServedCollate(self.path, sizing_refusal(self.transform))


def plan(dataset: Any, transform: Any = None, *, collate_fn: Any = None) -> Plan:
    """How to serve ``dataset`` for ``augment=device``: its transform (``transform``, declared, else the one it
    keeps), each op recognised, and the images before the transforms found in the item and sized.

    Raises:
        Unsupported: no transform, one it cannot run (named), a collate of the script's own, items whose
            images differ in size, or a dataset without indices.
    """
    if isinstance(dataset, torch.utils.data.IterableDataset):
        raise Unsupported("an IterableDataset: its items cannot be served before their transforms")
    if collate_fn is not None and collate_fn is not torch.utils.data.default_collate:
        raise Unsupported("the script's own collate_fn: the images could not be found in its batches")
    if transform is None:
        transform = find_transform(dataset)
        if transform is None:
            raise Unsupported("the dataset has no transform (a torchvision dataset's transform, or "
                              "ctx.loader(dataset, transform=...))")
    else:
        dataset = Transformed(dataset, None)
    for each in flatten(transform):
        recognise(each)  # raises with the first unknown transform's name
    try:
        marked = _with_transform(dataset, _Mark())
        n = len(marked)
        if n == 0:
            raise Unsupported("the dataset is empty")
        item = marked[0]
        path = _path_to(item)
        if path is None:
            raise Unsupported("its items do not hold what its transform returns (the dataset's __getitem__ does "
                              "not apply dataset.transform to the image)")
        served = _with_transform(dataset, Serve(_kind(at(item, path).value)))
        images = [at(served[index], path) for index in sorted({0, n // 3, 2 * n // 3, n - 1})]
    except Unsupported:
        raise
    except Exception as exc:  # noqa: BLE001 - a dataset that cannot be served so is a reason, not a crash
        raise Unsupported(f"its items could not be fetched before their transforms ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''})") from exc
    shapes = sorted({tuple(image.shape) for image in images})
    if len({s[0] for s in shapes}) > 1:
        raise Unsupported(f"its images before their transforms differ in channels ({', '.join(map(str, shapes))})")
    if len(shapes) > 1 and sizing_refusal(transform):
        sizes = ", ".join("x".join(map(str, s)) for s in shapes)
        raise Unsupported(f"its images before their transforms differ in size ({sizes}): {sizing_refusal(transform)}")
    image = images[0]
    if image.dtype != torch.uint8 and not image.is_floating_point():
        raise Unsupported(f"its images before their transforms are {image.dtype}, not uint8 or floating point")
    chw = tuple(int(s) for s in image.shape)
    compile_pipeline(transform, chw, integer=image.dtype == torch.uint8, seed=0,
                     device=torch.device("cpu"))  # checks that the sizes fit and the dtypes follow
    return Plan(served, transform, path, chw, image.dtype == torch.uint8, len(shapes) == 1,  # type: ignore[arg-type]
                [type(t).__name__ for t in flatten(transform)])


def refusal(dataset: Any, transform: Any = None, *, collate_fn: Any = None) -> Optional[str]:
    """Why ``augment=device`` cannot serve ``dataset`` (one line), else None."""
    try:
        plan(dataset, transform, collate_fn=collate_fn)
    except Unsupported as exc:
        return str(exc)
    return None


class AugmentedLoader:
    """Batches of ``loader`` (a DataLoader of the served items, or a ``DeviceLoader``), moved to the device
    and augmented there by ``pipeline`` at ``path``.

    ``loader`` stays reachable (``.loader``) so a trial can restart a DataLoader at the same place of its
    order; its length, batch size and pinning read through.
    """

    def __init__(self, loader: Any, pipeline: Pipeline, path: tuple[Any, ...], device: torch.device) -> None:
        self.loader = loader
        self.pipeline = pipeline
        self.path = path
        self.device = device
        self.pin_memory = bool(getattr(loader, "pin_memory", False))
        self.batch_size = getattr(loader, "batch_size", None)
        self.sampler = getattr(loader, "sampler", None)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            images, sizes = at(batch, self.path), None
            if isinstance(images, (tuple, list)):  # padded images of several sizes, and their sizes (``pad``)
                images, sizes = images
                sizes = sizes.to(self.device, non_blocking=self.pin_memory)
            images = images.to(self.device, non_blocking=self.pin_memory)
            yield replaced(batch, self.path, self.pipeline(images, sizes))
