"""The journal file storage, guarded: a cut-off record stops it in one line, and running trials hold leases.

Optuna's journal skips an unterminated last line as a write in progress, then appends the next record
onto it; the merged line breaks every later read. Here the whole file is checked under the journal's
lock when it is opened, and every append checks (under the same lock) that the file still ends with a
complete record, so nothing is ever written after a torn one.

The journal keeps no Optuna heartbeats, so a running trial records a lease instead (its worker
refreshes the ``heartbeat`` user attribute, see ``_workers``); ``lease_interval`` and
``lease_grace_period`` on the storage say how often, and after how long without one the trial is stale.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any, Optional

from optuna.storages.journal import JournalFileBackend, JournalStorage
from optuna.storages.journal._file import get_lock_file

from autotune._errors import StudyError


class TornJournalError(StudyError):
    """The journal file holds a record that is not complete (cut off by a crash or a full disk)."""


def _torn_message(path: Path, line: int, offset: int, after: int) -> str:
    quoted = shlex.quote(str(path))
    lost = f"; the {after} line(s) after it are lost with it" if after else ""
    return (f"journal {path} is damaged: line {line} (from byte {offset}) is a cut-off record, so nothing more "
            f"is written to it{lost}; keep a copy and cut the file there: "
            f"cp {quoted} {shlex.quote(str(path) + '.bak')} && truncate -s {offset} {quoted}")


def find_torn_record(path: Path) -> Optional[str]:
    """The one-line message for the first record of ``path`` that is incomplete, else None."""
    offset, bad, after = 0, None, 0
    with open(path, "rb") as fh:
        for number, line in enumerate(fh, start=1):
            if bad is not None:
                after += 1
                continue
            try:
                if not line.endswith(b"\n"):
                    raise ValueError("unterminated")
                json.loads(line)
            except ValueError:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                bad = (number, offset)
                continue
            offset += len(line)
    return None if bad is None else _torn_message(path, bad[0], bad[1], after)


class GuardedJournalBackend(JournalFileBackend):
    """A journal file that refuses to open, or to be appended to, while it ends in a torn record."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        self.path = path
        with get_lock_file(self._lock):  # no writer is mid-record while the file is read
            message = find_torn_record(path)
        if message:
            raise TornJournalError(message)

    def _ends_complete(self) -> bool:
        with open(self._file_path, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            if size == 0:
                return True
            fh.seek(size - 1)
            return fh.read(1) == b"\n"

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        # The base class's append, with the tail check inside the same lock.
        with get_lock_file(self._lock):
            if not self._ends_complete():
                raise TornJournalError(find_torn_record(self.path) or f"journal {self.path} ends in a cut-off record")
            text = "\n".join(json.dumps(log, separators=(",", ":")) for log in logs) + "\n"
            with open(self._file_path, "ab") as fh:
                fh.write(text.encode("utf-8"))
                fh.flush()
                os.fsync(fh.fileno())


class LeasedJournalStorage(JournalStorage):
    """A JournalStorage whose running trials hold leases (see the module docstring).

    Args:
        path: The journal file.
        grace_period: Seconds without a lease renewal before another host's running trial is stale.
    """

    def __init__(self, path: Path, *, grace_period: int) -> None:
        super().__init__(GuardedJournalBackend(path))
        self.path = path
        self.lease_grace_period = grace_period
        self.lease_interval = max(1, grace_period // 6)


def open_journal(path: Path, *, grace_period: Optional[int]) -> LeasedJournalStorage:
    """Open (creating it if missing) the journal file at ``path``.

    Raises:
        TornJournalError: the file holds a cut-off record; the message says how to cut it off.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    return LeasedJournalStorage(path, grace_period=grace_period or 60)
