"""Where studies live: storage URLs (SQLite by default, any Optuna URL accepted) and output paths."""

from __future__ import annotations

import contextlib
import re
import warnings
from pathlib import Path
from typing import Any, Optional

import optuna

from autotune._errors import StudyError
from autotune._records import DEFAULT_STUDIES_DIR
from autotune.study._locks import file_lock

DEFAULT_DB = "autotune.db"


def default_storage_url(studies_dir: Path = DEFAULT_STUDIES_DIR) -> str:
    return f"sqlite:///{studies_dir / DEFAULT_DB}"


RDB_SCHEMES = ("sqlite", "postgresql", "mysql", "oracle", "mssql")


def mask_url(url: str) -> str:
    """The URL with any password replaced by ``***``, for messages, logs and files."""
    return re.sub(r"(://[^:/@]+:)[^@/]*@", r"\1***@", url)


def _enable_sqlite_wal(path: Path) -> None:
    # WAL lets readers (a dashboard, other workers) read while one writer writes; it persists in the file.
    import sqlite3

    with contextlib.closing(sqlite3.connect(path, timeout=60)) as conn:
        conn.execute("PRAGMA journal_mode=WAL")


def open_storage(
    url: Optional[str], studies_dir: Path = DEFAULT_STUDIES_DIR, *, grace_period: Optional[int] = None
) -> tuple[Any, str]:
    """Open an Optuna storage from a URL; ``None`` means ``studies/autotune.db``.

    ``journal:PATH`` opens a journal file (several processes on one host), refusing one that ends in a
    cut-off record (``_journal``). A SQLite file is first created by one process at a time (a lock file
    ``PATH.lock`` beside it).

    Args:
        grace_period: Keep heartbeats of running trials (RDB storages; leases in a journal): a trial without
            one for this many seconds is failed and its config retried once. ``None`` keeps no heartbeats
            (a journal then uses 60 s).

    Returns:
        The storage object and its URL with any password masked (for messages and files).

    Raises:
        StudyError: the URL has an unknown scheme or cannot be opened.
    """
    url = url or default_storage_url(studies_dir)
    scheme = url.split(":", 1)[0].split("+", 1)[0]
    if scheme not in RDB_SCHEMES + ("journal",):
        raise StudyError(
            f"storage {mask_url(url)}: unknown scheme {scheme!r} "
            "(use sqlite:///PATH, postgresql://..., mysql://... or journal:PATH)"
        )
    try:
        if url.startswith("journal:"):
            from autotune.study._journal import open_journal

            return open_journal(Path(url[len("journal:") :]), grace_period=grace_period), url
        engine_kwargs: dict[str, Any] = {}
        creation: Any = contextlib.nullcontext()
        if url.startswith("sqlite:///"):
            path = Path(url[len("sqlite:///") :])
            path.parent.mkdir(parents=True, exist_ok=True)
            # Concurrent first openers would each create Optuna's tables; one at a time, the others find them.
            creation = file_lock(path.with_name(path.name + ".lock"))
            # Wait for a lock instead of failing at once when a dashboard or a second worker writes.
            engine_kwargs = {"connect_args": {"timeout": 60}}
        options: dict[str, Any] = {}
        with warnings.catch_warnings(), creation:
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            if url.startswith("sqlite:///"):
                _enable_sqlite_wal(path)
            if grace_period is not None:
                options = {
                    "heartbeat_interval": max(1, grace_period // 6),
                    "grace_period": grace_period,
                    "heartbeat_stale_trial_callback": optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1),
                }
            return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs, **options), mask_url(url)
    except StudyError:
        raise
    except ImportError as exc:
        raise StudyError(
            f"{mask_url(url)}: a driver is missing ({exc.name}); for PostgreSQL install autotune[postgres]"
        ) from None
    except Exception as exc:  # SQLAlchemy raises many types; the user needs one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StudyError(f"cannot open storage {mask_url(url)}: {mask_url(first)}") from None


def study_exists(storage: Any, study_name: str) -> bool:
    return any(s.study_name == study_name for s in optuna.get_all_study_summaries(storage, include_best_trial=False))
