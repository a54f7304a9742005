"""Ctrl-C and SIGTERM: the first ends the run cleanly, a second at once; workers die with their parent.

The first signal raises ``Interrupted`` in the main thread, wherever it is. The trial process running
then is killed with its group by ``run_isolated`` (which keeps its result if it had finished), the
trial loop records the trial, and the CLI exits non-zero with one line. While that cleanup runs, a
second signal kills every trial group and worker this process started, and exits at once.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Optional

_GROUPS: set[int] = set()  # process groups of the trials running now
_CHILDREN: set[int] = set()  # worker processes started by this one
_FIRST: list[int] = []  # the first signal received


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


def _handler(signum: int, frame: Any) -> None:
    if not _FIRST:
        _FIRST.append(signum)
        raise Interrupted(signum)
    _kill_everything()
    os.write(2, f"autotune: killed at once by a second {signal.Signals(signum).name}; rerun the same command "
                "to resume\n".encode())
    os._exit(128 + _FIRST[0])


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

    return restore


def exit_code(exc: BaseException) -> int:
    """128 + the signal's number (130 for Ctrl-C, 143 for SIGTERM), as a shell reports it."""
    return 128 + exc.signum if isinstance(exc, Interrupted) else 128 + signal.SIGINT


PARENT_ENV = "AUTOTUNE_PARENT_PID"  # set for the workers `autotune tune --workers/--gpus` starts


def die_with_parent(parent: Optional[int] = None, *, interval: float = 1.0) -> None:
    """Send this process SIGTERM (so it records its trial and exits) once its parent is gone.

    On Linux the kernel does it (``PR_SET_PDEATHSIG``), and a parent already gone when it is set is
    answered at once; a thread that watches the parent's pid covers other systems.
    """
    if parent is None:
        try:
            parent = int(os.environ.get(PARENT_ENV, ""))
        except ValueError:
            return
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            if ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0) == 0:  # PR_SET_PDEATHSIG
                if os.getppid() == parent:
                    # The kernel will send the one SIGTERM. A watch thread sending its own as well could land
                    # before the kernel's is handled and count as the second signal, which kills at once
                    # without recording the trial.
                    return
                os.kill(os.getpid(), signal.SIGTERM)  # the parent died before the death signal was set
                return
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        if not _FIRST:
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="autotune-parent-watch", daemon=True).start()
