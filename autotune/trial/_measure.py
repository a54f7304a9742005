"""Timed windows: measuring only, no decisions.

A window starts and ends with a device synchronisation, so its wall time covers exactly the work
queued inside it. Throughput is the median over windows; the spread is reported beside it. In a trial of
several ranks every rank starts a window together (a barrier) and the window counts every rank's samples
over the slowest rank's seconds, so rank 0 reports the job's global throughput.
"""

from __future__ import annotations

import resource
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from autotune._config import Measurement
from autotune.trial import _distributed


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Window:
    seconds: float
    steps: int
    samples: int
    data_wait_seconds: float
    started: float = 0.0  # time.perf_counter() when it began (0: a window the user's loop measured)

    @property
    def throughput(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0


@dataclass
class WindowRecorder:
    """Collects timed windows and the warm-up timings of one trial."""

    device: torch.device
    distributed: bool = False  # one rank of several: windows are agreed across ranks
    windows: list[Window] = field(default_factory=list)
    warmup_seconds: float = 0.0
    first_step_seconds: float = 0.0
    _start: Optional[float] = None
    _steps: int = 0
    _samples: int = 0
    _wait: float = 0.0

    def begin_window(self) -> None:
        synchronize(self.device)
        if self.distributed:
            _distributed.barrier(self.device)
        self._start = time.perf_counter()
        self._steps = self._samples = 0
        self._wait = 0.0

    def add(self, samples: int, data_wait_seconds: float) -> None:
        self._steps += 1
        self._samples += samples
        self._wait += data_wait_seconds

    @property
    def in_window(self) -> bool:
        return self._start is not None

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` of the open window out of its time (``ctx.untimed``: work that is not training)."""
        if self._start is not None:
            self._start += seconds

    def end_window(self) -> Window:
        assert self._start is not None, "end_window without begin_window"
        synchronize(self.device)
        window = Window(time.perf_counter() - self._start, self._steps, self._samples, self._wait, started=self._start)
        if self.distributed:
            seconds, samples, wait = _distributed.agree_window(window.seconds, window.samples,
                                                               window.data_wait_seconds, self.device)
            window = Window(seconds, window.steps, samples, wait, started=self._start)
        self.windows.append(window)
        self._start = None
        return window

    def record(self, window: Window) -> None:
        """A window measured by the user's own loop."""
        self.windows.append(window)


class BlockSeconds:
    """The seconds a ``with`` block took (``seconds``, set when it ends), the device's queued work finished
    before it starts and before it ends: what ``ctx.untimed`` keeps out of the timed windows."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds = 0.0
        self._began = 0.0

    def __enter__(self) -> "BlockSeconds":
        synchronize(self.device)
        self._began = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        synchronize(self.device)
        self.seconds = time.perf_counter() - self._began


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # ru_maxrss is in KiB on Linux: the process's peak resident set, the nearest CPU analogue.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def summarize(
    recorder: WindowRecorder,
    *,
    total_samples: int,
    total_steps: int,
    compiled: bool,
    capture_seconds: float = 0.0,
    metric: Optional[float] = None,
    scaler_skips: int = 0,
    graph_replays: int = 0,
    extras: Optional[dict[str, Any]] = None,
    losses: Sequence[float] = (),
    loss_every: int = 1,
) -> Measurement:
    """Reduce the windows of one trial to a Measurement.

    Raises:
        ValueError: fewer than one timed window was recorded.
    """
    windows = recorder.windows
    if not windows:
        raise ValueError("no timed window was recorded: iterate ctx.batches(...) or call ctx.record_window(...)")
    rates = [w.throughput for w in windows]
    step_times = [w.seconds / w.steps for w in windows if w.steps]
    step_time = statistics.median(step_times) if step_times else 0.0
    timed = sum(w.seconds for w in windows)
    wait = sum(w.data_wait_seconds for w in windows)
    compile_seconds = max(0.0, recorder.first_step_seconds - step_time) if compiled else 0.0
    return Measurement(
        throughput=statistics.median(rates),
        window_throughputs=tuple(rates),
        step_time=step_time,
        data_wait_fraction=min(1.0, wait / timed) if timed > 0 else 0.0,
        peak_memory_gib=peak_memory_gib(recorder.device),
        warmup_seconds=recorder.warmup_seconds,
        first_step_seconds=recorder.first_step_seconds,
        compile_seconds=compile_seconds,
        capture_seconds=capture_seconds,
        samples=total_samples,
        steps=total_steps,
        metric=metric,
        scaler_skips=scaler_skips,
        graph_replays=graph_replays,
        # The timed windows' own seconds: the study's time split reads them (study/_budget).
        extras={**(extras or {}), "timed_seconds": round(timed, 4)},
        losses=tuple(losses),
        loss_every=loss_every,
    )
