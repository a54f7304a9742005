"""Writing a file whole or not at all: what trial processes hand the coordinator, and what a study leaves."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Union

__all__ = ["write_atomic"]


def write_atomic(path: Union[str, Path], text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees the old file or the whole new one, never a part.

    The text goes to a temporary file of its own in the same folder (two writers never share one; its name
    starts with a dot, so a reader counting a folder's marks by their prefix does not see it), readable as a
    plain write would leave it, then ``os.replace`` puts it in place.

    Raises:
        OSError: the folder cannot be written (a full disk, say); the temporary file is gone.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the file from other users of a shared studies folder
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
