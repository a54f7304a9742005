"""An advisory file lock between processes of one host (``fcntl.flock``), for one-time work such as
creating a SQLite file or running a study's reference."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Callable, Iterator, Optional


@contextlib.contextmanager
def file_lock(path: Path, *, on_wait: Optional[Callable[[], None]] = None) -> Iterator[bool]:
    """Hold an exclusive lock on ``path`` (created if missing) for the ``with`` block.

    The lock file is separate from what it guards: closing a descriptor of an SQLite file would drop
    SQLite's own POSIX locks held by this process. The kernel releases the lock when the process dies,
    so a killed holder never blocks the next one.

    Args:
        path: The lock file.
        on_wait: Called once when another process holds the lock, before waiting for it.

    Yields:
        True when the lock is held; False when the lock file cannot be created here (a read-only
        directory, no ``fcntl``): the block then runs unlocked.
    """
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield False
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = _open_lock_file(path)
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)  # releases the lock


def _open_lock_file(path: Path) -> int:
    """Open (or create) the lock file itself: a symlink planted at its name (dangling or not) is removed, not
    followed, so the lock never creates or truncates a file elsewhere (raises OSError)."""
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
    try:
        return os.open(path, flags, 0o644)
    except OSError as exc:
        if not path.is_symlink():
            raise exc
    path.unlink()
    return os.open(path, flags | os.O_EXCL, 0o644)
