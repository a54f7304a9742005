"""The trial process's compile clock: how long torch.compile has worked so far, in a file the coordinator reads.

The coordinator gives a compile its own deadline (``TrialOptions.compile_timeout``), so it has to know
when the trial is compiling. Two signals feed one clock:

- TorchDynamo's compile callbacks (``torch._dynamo.callback``), which bracket every frame compile, the
  lazily compiled backward and CUDA Graph recording, wherever they happen: in ``ctx.batches``, in a
  hand-written loop, or later on a new shape (a recompile);
- the first step of ``ctx.batches`` when the config compiles, which also covers what runs outside those
  callbacks on the first call (kernel autotuning at first launch, the first run of the compiled code).

Nested or overlapping signals count once. The file holds the compile seconds finished so far and, while
compiling, the wall-clock time the current stretch began; it is replaced atomically on each change.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from typing import Iterator, Optional

from autotune._files import write_atomic


class CompileClock:
    """Accumulates the seconds spent compiling and writes them to ``path`` on every change.

    Args:
        path: The file the coordinator polls.
        mode: The config's compile mode, written beside the seconds.
    """

    def __init__(self, path: str, mode: str) -> None:
        self.path = path
        self.mode = mode
        self.depth = 0
        self.since: Optional[float] = None
        self.seconds = 0.0
        self._lock = threading.Lock()
        self._write()

    def enter(self, *_: object) -> None:
        with self._lock:
            self.depth += 1
            if self.depth == 1:
                self.since = time.time()  # wall clock: the coordinator compares it with its own
                self._write()

    def exit(self, *_: object) -> None:
        with self._lock:
            if self.depth == 0:
                return  # an end without a start (callbacks installed mid-compile)
            self.depth -= 1
            if self.depth == 0 and self.since is not None:
                self.seconds += time.time() - self.since
                self.since = None
                self._write()

    def _write(self) -> None:
        write_atomic(self.path, json.dumps({"mode": self.mode, "seconds": self.seconds, "since": self.since}))


_CLOCK: Optional[CompileClock] = None


def install(path: str, mode: str) -> CompileClock:
    """Start this process's compile clock and hook it to TorchDynamo's compile callbacks where torch has them."""
    global _CLOCK
    _CLOCK = CompileClock(path, mode)
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:  # an older torch: only ctx.batches' first step is timed
        return _CLOCK
    callback_handler.register_start_callback(_CLOCK.enter)
    callback_handler.register_end_callback(_CLOCK.exit)
    return _CLOCK


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """Count the enclosed code as compile time (a no-op outside a trial process with a compile clock)."""
    clock = _CLOCK
    if clock is None:
        yield
        return
    clock.enter()
    try:
        yield
    finally:
        clock.exit()


def read_compile_seconds(path: str, now: Optional[float] = None) -> tuple[str, float]:
    """The mode and the compile seconds so far, as a clock file records them; ``("", 0.0)`` before it exists."""
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return "", 0.0
    seconds = float(data.get("seconds") or 0.0)
    if data.get("since") is not None:
        seconds += max(0.0, (time.time() if now is None else now) - float(data["since"]))
    return str(data.get("mode", "")), seconds
