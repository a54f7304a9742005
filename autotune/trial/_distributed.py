"""One rank of a trial that runs as a DDP job: its process group, its device, DDP with the config's knobs,
and the timed windows agreed across ranks.

The launcher (``autotune.study._isolation``) starts every rank with torch's env:// rendezvous variables
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``). Each rank runs ``train_fn``;
rank 0's measurement is the trial's. NCCL joins the ranks on GPUs (rank k on GPU ``LOCAL_RANK``), gloo on
the CPU.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from autotune._config import TrialConfig
from autotune._errors import KnobError

# The process group's own timeout: a rank stuck in a collective fails by itself well after the launcher's
# deadline, which kills every rank first.
GROUP_TIMEOUT_SECONDS = 1800


@dataclass(frozen=True, kw_only=True)
class Rank:
    """Where this process stands in its trial's job."""

    rank: int
    world_size: int
    local_rank: int


def rank_from_env(environ: Optional[dict[str, str]] = None) -> Optional[Rank]:
    """This process's rank when the launcher started it as one of several, else ``None``."""
    env = os.environ if environ is None else environ
    world = int(env.get("WORLD_SIZE", "1") or 1)
    if world <= 1 or "MASTER_PORT" not in env:
        return None
    rank = int(env["RANK"])
    return Rank(rank=rank, world_size=world, local_rank=int(env.get("LOCAL_RANK", rank)))


def device_for(rank: Rank) -> torch.device:
    """Rank k's device: GPU ``LOCAL_RANK`` when there are GPUs, else the CPU.

    Raises:
        KnobError: fewer visible GPUs than ranks on this host.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if rank.local_rank >= count:
        raise KnobError(f"rank {rank.rank} needs GPU {rank.local_rank}, but this process sees {count} GPU(s): a trial "
                        f"of {rank.world_size} processes needs one GPU per rank")
    torch.cuda.set_device(rank.local_rank)
    return torch.device("cuda", rank.local_rank)


def start(rank: Rank, device: torch.device) -> None:
    """Join the trial's process group (NCCL on GPUs, gloo on the CPU)."""
    import datetime

    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    options: dict[str, Any] = {}
    if device.type == "cuda":
        options["device_id"] = device  # binds the communicator to this rank's GPU
    try:
        dist.init_process_group(backend, init_method="env://", rank=rank.rank, world_size=rank.world_size,
                                timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_SECONDS), **options)
    except TypeError:  # a torch without device_id=
        dist.init_process_group(backend, init_method="env://", rank=rank.rank, world_size=rank.world_size,
                                timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_SECONDS))


def active() -> bool:
    """Whether this process is one rank of several."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return _dist().get_world_size() if active() else 1


def rank() -> int:
    return _dist().get_rank() if active() else 0


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def barrier(device: torch.device) -> None:
    """Every rank reaches this point before any goes on (a collective, then the device's queue drained)."""
    flag = torch.zeros(1, device=device)
    _dist().all_reduce(flag)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def agree_window(seconds: float, samples: int, wait: float, device: torch.device) -> tuple[float, int, float]:
    """One timed window as the whole job ran it: the slowest rank's seconds, every rank's samples, and the
    mean data wait."""
    dist = _dist()
    mine = torch.tensor([seconds, float(samples), wait], dtype=torch.float64, device=device)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    table = torch.stack(everyone).cpu()
    return float(table[:, 0].max()), int(table[:, 1].sum()), float(table[:, 2].mean())


def mean_across_ranks(values: list[float], device: torch.device) -> list[float]:
    """The element-wise mean of a list of the same length on every rank (the loss trajectory)."""
    if not values:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    _dist().all_reduce(tensor)
    return (tensor / world_size()).cpu().tolist()


def find_ddp(model: Any) -> Optional[torch.nn.Module]:
    """The ``DistributedDataParallel`` module of ``model`` (itself, or the one inside ``torch.compile``)."""
    from torch.nn.parallel import DistributedDataParallel

    for candidate in (model, getattr(model, "_orig_mod", None)):
        if isinstance(candidate, DistributedDataParallel):
            return candidate
    return None


class CommTimer:
    """How long the gradient all-reduce was in flight during the timed windows, from a comm hook.

    Each bucket's interval runs from the hook's call (the bucket is ready) to its future's completion. On a
    GPU both ends are CUDA events (the completion one recorded on the stream that waits for the NCCL
    kernel), read after the window's synchronisation; on the CPU they are wall-clock times (gloo completes
    the future in its own thread). A window's communication time is the union of its intervals, so buckets
    in flight together count once.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.active = False
        self.buckets = 0
        self._intervals: list[list[Any]] = []
        self._origin: Any = None
        self.seconds = 0.0

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def begin_window(self) -> None:
        self._intervals.clear()
        self._origin = self._now()
        self.active = True

    def end_window(self) -> float:
        """Seconds of the window with an all-reduce in flight (call after the device was synchronised)."""
        self.active = False
        if self.cuda:
            spans = [(self._origin.elapsed_time(a) / 1e3, self._origin.elapsed_time(b) / 1e3)
                     for a, b in self._intervals if b is not None]
        else:
            spans = [(a - self._origin, b - self._origin) for a, b in self._intervals if b is not None]
        self._intervals.clear()
        covered, reach = 0.0, float("-inf")
        for a, b in sorted(spans):
            if b > reach:
                covered += b - max(a, reach)
                reach = b
        self.seconds += covered
        return covered

    def hook(self, inner: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        """A DDP comm hook that runs ``inner(process_group, bucket)`` and times it."""

        # Unannotated: DDP checks a hook's annotations, and this module's are strings (postponed evaluation).
        def timed(state, bucket):  # type: ignore[no-untyped-def]
            if not self.active:
                return inner(state, bucket)
            self.buckets += 1
            interval = [self._now(), None]
            self._intervals.append(interval)

            def done(fut: Any) -> Any:
                interval[1] = self._now()
                return fut.value()

            return inner(state, bucket).then(done)

        timed.compression = getattr(inner, "__name__", "")  # type: ignore[attr-defined]
        return timed


def wrap(model: torch.nn.Module, config: TrialConfig, device: torch.device, timer: CommTimer) -> torch.nn.Module:
    """``model`` in ``DistributedDataParallel`` with the config's DDP knobs and a timed comm hook.

    A model that ``ctx.model`` compiled is unwrapped, put in DDP, and compiled again with the same mode
    (``torch.compile(DDP(model))`` is the form torch's DDP optimizer splits at the buckets); it has not
    compiled yet, as compiling is lazy.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    if find_ddp(model) is not None:
        raise KnobError("ctx.ddp: the model is already wrapped in DistributedDataParallel")
    inner = getattr(model, "_orig_mod", None)
    compiled = isinstance(inner, torch.nn.Module) and config.compile != "off"
    module = inner if compiled else model
    ddp = DistributedDataParallel(
        module,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=config.bucket_cap_mb,
        gradient_as_bucket_view=config.gradient_as_bucket_view,
        static_graph=config.static_graph,
    )
    compress = {"none": default_hooks.allreduce_hook, "bf16": default_hooks.bf16_compress_hook}[config.grad_compression]
    ddp.register_comm_hook(state=None, hook=timer.hook(compress))
    if compiled:
        return torch.compile(ddp, mode=None if config.compile == "default" else config.compile)
    return ddp
