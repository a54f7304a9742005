"""Writing a file whole or not at all: what trial processes hand the coordinator, and what a study leaves."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator, Union

__all__ = ["atomic_path", "write_atomic"]


@contextlib.contextmanager
def atomic_path(path: Union[str, Path]) -> Iterator[Path]:
    """A temporary file beside ``path`` for the ``with`` block to write, which then becomes ``path``.

    The temporary file is new and of its own (``mkstemp``: two writers never share one, and no link planted
    under a name known in advance is followed; its name starts with a dot, so a reader counting a folder's
    marks by their prefix does not see it), readable as a plain write would leave it. ``os.replace`` then
    puts it in place: a reader sees the old file or the whole new one, and a symlink planted at ``path`` is
    replaced, never written through. A block that raises leaves ``path`` as it was.

    Raises:
        OSError: the folder cannot be written (a full disk, say); the temporary file is gone.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the file from other users of a shared studies folder
        os.close(fd)
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_atomic(path: Union[str, Path], text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees the old file or the whole new one, never a part, and
    a symlink planted at ``path`` is replaced rather than followed (``atomic_path``).

    Raises:
        OSError: the folder cannot be written (a full disk, say); the temporary file is gone.
    """
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
