"""Ctrl-C and SIGTERM: the first ends the run cleanly, a second at once; workers die with their parent.

The first signal raises ``Interrupted`` in the main thread, wherever it is. The trial process running
then is killed with its group by ``run_isolated`` (which keeps its result if it had finished), the
trial loop records the trial, and the CLI exits non-zero with one line. While that cleanup runs, a
second signal kills every trial group and worker this process started, and exits at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterator, Optional

_GROUPS: set[int] = set()  # process groups of the trials running now
_CHILDREN: set[int] = set()  # worker processes started by this one
_FIRST: list[int] = []  # the first signal received
_SETTLED: list[bool] = []  # the interrupted run has recorded everything and is only exiting now
_HOLDING: list[list[int]] = []  # the open held_signals() blocks, innermost last: where a first signal waits


class Interrupted(KeyboardInterrupt):
    """A Ctrl-C (SIGINT) or SIGTERM ended the run.

    Args:
        signum: The signal.
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.signal_name = signal.Signals(signum).name
        super().__init__(self.signal_name)

    @property
    def reason(self) -> str:
        return "SIGINT (Ctrl-C)" if self.signum == signal.SIGINT else self.signal_name


def interrupt_reason(exc: BaseException) -> str:
    """What stopped a trial, for its ``failure`` attribute."""
    if isinstance(exc, Interrupted):
        return f"interrupted: {exc.reason}"
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted: KeyboardInterrupt"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"aborted: {type(exc).__name__}" + (f": {first[:300]}" if first else "")


def track_group(pid: int) -> None:
    _GROUPS.add(pid)


def untrack_group(pid: int) -> None:
    _GROUPS.discard(pid)


def track_child(pid: int) -> None:
    _CHILDREN.add(pid)


def _kill_everything() -> None:
    for pid in list(_GROUPS):
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except OSError:
                pass
    for pid in list(_CHILDREN):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _first_signal(signum: int) -> None:
    _FIRST.append(signum)
    if _HOLDING:
        _HOLDING[-1].append(signum)
        return
    raise Interrupted(signum)


def _handler(signum: int, frame: Any) -> None:
    if not _FIRST:
        _first_signal(signum)
        return
    if _SETTLED:  # nothing is left to record and the one line is said: exit as the first signal asked
        os._exit(128 + _FIRST[0])
    _kill_everything()
    os.write(2, f"autotune: killed at once by a second {signal.Signals(signum).name}; rerun the same command "
                "to resume\n".encode())
    os._exit(128 + _FIRST[0])


@contextlib.contextmanager
def held_signals() -> Iterator[list[int]]:
    """Hold a first SIGINT or SIGTERM that arrives inside the block: it is not raised there but appended to
    the yielded list, for the caller to act on once the block's work is whole. ``study.ask()`` is such work:
    it stores the new trial, then runs the sampler, and an interruption in between would leave a RUNNING
    trial that no one holds. A second signal still kills at once."""
    held: list[int] = []
    _HOLDING.append(held)
    try:
        yield held
    finally:
        _HOLDING.remove(held)


def settled() -> None:
    """Say that the interrupted run has recorded its trials: a further signal then exits at once, quietly,
    instead of saying that it killed the run (there is nothing left to kill or lose)."""
    _SETTLED.append(True)


def install() -> Callable[[], None]:
    """Handle SIGINT and SIGTERM as described in the module docstring (main thread only).

    Returns:
        A function that puts the previous handlers back (for a caller that runs the CLI in-process).
    """
    previous = {signum: signal.signal(signum, _handler) for signum in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _FIRST.clear()
        _SETTLED.clear()

    return restore


def exit_code(exc: BaseException) -> int:
    """128 + the signal's number (130 for Ctrl-C, 143 for SIGTERM), as a shell reports it."""
    return 128 + exc.signum if isinstance(exc, Interrupted) else 128 + signal.SIGINT


PARENT_ENV = "AUTOTUNE_PARENT_PID"  # set for the workers `autotune tune --workers/--gpus` starts


def _parent_gone(signum: int, frame: Any) -> None:
    """The parent died: act as on a first SIGTERM, once. Later notices are ignored, not a second signal."""
    if not _FIRST:
        _first_signal(signal.SIGTERM)


def die_with_parent(parent: Optional[int] = None, *, interval: float = 1.0) -> None:
    """Stop this process as on a SIGTERM (it records its trial and exits) once its parent is gone.

    The notice is a SIGHUP, handled once: on Linux the kernel sends it (``PR_SET_PDEATHSIG``), and it sends
    it again each time the orphan is handed to another thread of the dying parent, so a SIGTERM there could
    arrive twice and count as the second signal, which kills at once without recording the trial. A parent
    already gone when the notice is set is answered at once; a thread that watches the parent's pid covers
    other systems. Call it from the main thread (it installs the SIGHUP handler).
    """
    if parent is None:
        try:
            parent = int(os.environ.get(PARENT_ENV, ""))
        except ValueError:
            return
    signal.signal(signal.SIGHUP, _parent_gone)
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            if ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGHUP), 0, 0, 0) == 0:  # PR_SET_PDEATHSIG
                if os.getppid() != parent:
                    os.kill(os.getpid(), signal.SIGHUP)  # the parent died before the notice was set
                return
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        os.kill(os.getpid(), signal.SIGHUP)

    threading.Thread(target=watch, name="autotune-parent-watch", daemon=True).start()
