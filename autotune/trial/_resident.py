"""``loader=device``: a small map-style dataset copied to the device once, its batches indexed there.

The batches are the DataLoader's, element by element: the same sampler (``DataOrder``), batch size and
``drop_last`` choose the indices, and the whole dataset was collated by the same ``collate_fn``. What can
be kept there is checked first (``refusal``): random augmentation would be frozen at its first draw, and a
dataset that does not fit leaves the model no room.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch

from autotune._errors import KnobError

CHUNK = 4096  # items collated at a time on the host before they move to the device
# A fill predicted (from the first items' fetch time) to take longer than this fetches the items with DataLoader
# workers: a dataset that decodes or augments each item on the CPU would otherwise fill on one core (a ViT's
# 30,720 augmented images outlasted a 27 s probe process on an H200 host of 16 cores).
FILL_WORKERS_AFTER_S = 2.0
MAX_FILL_WORKERS = 16


def refusal(dataset: Any, *, share: float, device: torch.device) -> Optional[str]:
    """Why ``dataset`` cannot be kept on ``device`` (one line), else None.

    Cheap: it fetches the first, the last and two items between twice (a random augmentation makes
    them differ), and sizes the whole dataset from its first item.
    """
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return "an IterableDataset has no indices to serve batches by"
    try:
        n = len(dataset)
    except TypeError:
        return f"the dataset ({type(dataset).__name__}) has no __len__"
    if n == 0:
        return "the dataset is empty"
    probes = sorted({0, n // 3, 2 * n // 3, n - 1})
    first = [dataset[i] for i in probes]
    for index, item in zip(probes, first):
        if not same(item, dataset[index]):
            return f"random augmentation: item {index} differs between two fetches"
    per_item = nbytes(first[0])
    if per_item is None:
        return f"item 0 holds a value that is not a tensor, an array or a number ({_leaf_types(first[0])})"
    return _too_large(per_item * n, n, share=share, device=device)


def build(dataset: Any, *, batch_sampler: Any, collate_fn: Callable[[list[Any]], Any], device: torch.device,
          share: float) -> "DeviceLoader":
    """Collate every item of ``dataset`` with ``collate_fn``, move it to ``device`` and serve ``batch_sampler``'s
    batches from there.

    Raises:
        KnobError: the collated data is not one tensor per field with a row per item, it does not fit the
            share, or ``collate_fn`` does not act per item (a batch collated alone differs from its rows).
    """
    n = len(dataset)
    workers = fill_workers(dataset, n)
    if workers:
        # In order (a sequential sampler), collated by the same collate_fn as in-process chunks would be; a
        # worker fetches a whole chunk, so the chunks are small enough for every worker to have several.
        size = max(1, min(CHUNK, -(-n // (4 * workers))))
        fetched = torch.utils.data.DataLoader(dataset, batch_size=size, shuffle=False, num_workers=workers,
                                              collate_fn=collate_fn)
        chunks = [_apply(chunk, lambda t: t.to(device)) for chunk in fetched]
    else:
        chunks = [_apply(collate_fn([dataset[i] for i in range(start, min(n, start + CHUNK))]),
                         lambda t: t.to(device))
                  for start in range(0, n, CHUNK)]
    data = _concat(chunks)
    rows = {leaf.shape[0] if leaf.dim() else None for leaf in _leaves(data)}
    if rows != {n}:
        raise KnobError(f"loader=device: the collated dataset is not one tensor per field with a row per item "
                        f"(first dimensions {sorted(map(str, rows))}, {n} items)")
    reason = _too_large(sum(leaf.numel() * leaf.element_size() for leaf in _leaves(data)), n, share=share,
                        device=device)
    if reason:
        raise KnobError(f"loader=device: {reason}")
    head = list(range(min(n, max(2, getattr(batch_sampler, "batch_size", None) or 2))))
    if not same(_apply(collate_fn([dataset[i] for i in head]), lambda t: t.to(device)),
                _take(data, torch.tensor(head, device=device))):
        raise KnobError("loader=device: the collate_fn does not act per item (a batch collated alone differs from "
                        "the same rows of the whole dataset collated at once)")
    return DeviceLoader(data, batch_sampler, device)


def fill_workers(dataset: Any, n: int, *, probe_items: int = 8) -> int:
    """DataLoader workers to fetch ``dataset``'s ``n`` items with: 0 (in-process) when fetching the first
    ``probe_items`` predicts a fill under ``FILL_WORKERS_AFTER_S``, else the cores this process may use (at
    least 2, at most ``MAX_FILL_WORKERS``)."""
    count = min(n, probe_items)
    started = time.perf_counter()
    for i in range(count):
        dataset[i]
    predicted = (time.perf_counter() - started) / max(1, count) * n
    if predicted <= FILL_WORKERS_AFTER_S:
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(MAX_FILL_WORKERS, max(2, cores))


class DeviceLoader:
    """Batches of a dataset held whole on the device, indexed in ``batch_sampler``'s order.

    Each ``iter()`` is one epoch of the sampler, as a DataLoader's is: its indices go to the device in one
    copy, and every batch is an ``index_select`` of each field.
    """

    def __init__(self, data: Any, batch_sampler: Any, device: torch.device) -> None:
        self.data = data
        self.batch_sampler = batch_sampler
        self.sampler = getattr(batch_sampler, "sampler", None)
        self.batch_size = getattr(batch_sampler, "batch_size", None)
        self.drop_last = getattr(batch_sampler, "drop_last", False)
        self.device = device
        self.pin_memory = False  # read by ctx.batches' callers as a DataLoader's: nothing crosses from the host

    @property
    def nbytes(self) -> int:
        """Bytes of the dataset on the device."""
        return sum(leaf.numel() * leaf.element_size() for leaf in _leaves(self.data))

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[Any]:
        batches = [list(b) for b in self.batch_sampler]
        if not batches:
            return
        order = torch.tensor([i for b in batches for i in b], dtype=torch.long).to(self.device)
        start = 0
        for batch in batches:
            yield _take(self.data, order[start:start + len(batch)])
            start += len(batch)


def same(a: Any, b: Any) -> bool:
    """Whether two items (or batches) are equal, element by element, type and dtype included."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        a, b = a.cpu(), b.cpu()
        if torch.equal(a, b):
            return True
        return a.is_floating_point() and bool(torch.isclose(a, b, rtol=0, atol=0, equal_nan=True).all())
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    if isinstance(a, Mapping):
        return isinstance(b, Mapping) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and (a == b or (a != a and b != b))  # NaN equals NaN here


def nbytes(item: Any) -> Optional[int]:
    """Bytes of one item's tensors, arrays and numbers; None when it holds anything else (strings, objects)."""
    if isinstance(item, torch.Tensor):
        return item.numel() * item.element_size()
    if isinstance(item, np.ndarray):
        return int(item.nbytes)
    if isinstance(item, (bool, int, float, np.number)):
        return 8  # collated into an int64 or float64 tensor
    values = item.values() if isinstance(item, Mapping) else item if isinstance(item, (list, tuple)) else None
    if values is None:
        return None
    sizes = [nbytes(v) for v in values]
    return None if any(s is None for s in sizes) else sum(sizes)  # type: ignore[misc]


def memory_bytes(device: torch.device) -> int:
    """The device's memory; the host's physical memory on the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _too_large(size: int, n: int, *, share: float, device: torch.device) -> Optional[str]:
    room = share * memory_bytes(device)
    if size <= room:
        return None
    where = "the GPU's" if device.type == "cuda" else "the host's"
    return (f"too large: {n:,} items take about {size / 2**30:.3g} GiB, more than {share:.0%} of {where} "
            f"{memory_bytes(device) / 2**30:.3g} GiB (device_data_share)")


def _leaf_types(item: Any) -> str:
    if isinstance(item, Mapping):
        return ", ".join(sorted({_leaf_types(v) for v in item.values()}))
    if isinstance(item, (list, tuple)):
        return ", ".join(sorted({_leaf_types(v) for v in item}))
    return type(item).__name__


def _leaves(data: Any) -> list[torch.Tensor]:
    if isinstance(data, torch.Tensor):
        return [data]
    values = data.values() if isinstance(data, Mapping) else data if isinstance(data, (list, tuple)) else None
    if values is None:
        raise KnobError(f"loader=device: the collated dataset holds a {type(data).__name__}, not only tensors")
    return [leaf for v in values for leaf in _leaves(v)]


def _apply(data: Any, fn: Callable[..., Any], *others: Any) -> Any:
    """``fn`` over every tensor of ``data`` (and the same places of ``others``), keeping the structure."""
    if isinstance(data, torch.Tensor):
        return fn(data, *others)
    if isinstance(data, Mapping):
        return type(data)({k: _apply(v, fn, *(o[k] for o in others)) for k, v in data.items()})  # type: ignore[call-arg]
    if isinstance(data, (list, tuple)):
        items = [_apply(v, fn, *(o[i] for o in others)) for i, v in enumerate(data)]
        return type(data)(*items) if hasattr(data, "_fields") else type(data)(items)
    raise KnobError(f"loader=device: the collated dataset holds a {type(data).__name__}, not only tensors")


def _concat(chunks: list[Any]) -> Any:
    if len(chunks) == 1:
        return chunks[0]
    return _apply(chunks[0], lambda first, *rest: torch.cat([first, *rest]), *chunks[1:])


def _take(data: Any, index: torch.Tensor) -> Any:
    return _apply(data, lambda t: t.index_select(0, index))
