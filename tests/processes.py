"""Process checks shared by the tests that must leave no process behind (read from /proc, Linux)."""

from __future__ import annotations

import subprocess
import time


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie or a dead process does not)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def survivors(pids: list[int], seconds: float = 15.0) -> list[int]:
    """The processes of ``pids`` still alive after waiting up to ``seconds`` for all of them to end."""
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def stop(proc: subprocess.Popen, seconds: float = 10.0) -> None:
    """Terminate ``proc``, and kill it if it has not ended within ``seconds``."""
    proc.terminate()
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
