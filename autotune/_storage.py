"""Where studies live: storage URLs (SQLite by default, any Optuna URL accepted) and output paths."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import optuna

from autotune._errors import StudyError

DEFAULT_STUDIES_DIR = Path("studies")
DEFAULT_DB = "autotune.db"


def default_storage_url(studies_dir: Path = DEFAULT_STUDIES_DIR) -> str:
    return f"sqlite:///{studies_dir / DEFAULT_DB}"


def open_storage(url: Optional[str], studies_dir: Path = DEFAULT_STUDIES_DIR) -> tuple[Any, str]:
    """Open an Optuna storage from a URL; ``None`` means ``studies/autotune.db``.

    ``journal:PATH`` opens a journal file (several processes on one host).

    Returns:
        The storage object and its URL as given (for messages and best_config.json).

    Raises:
        StudyError: the URL cannot be opened.
    """
    url = url or default_storage_url(studies_dir)
    try:
        if url.startswith("journal:"):
            from optuna.storages.journal import JournalFileBackend, JournalStorage

            path = Path(url[len("journal:") :])
            path.parent.mkdir(parents=True, exist_ok=True)
            return JournalStorage(JournalFileBackend(str(path))), url
        engine_kwargs: dict[str, Any] = {}
        if url.startswith("sqlite:///"):
            Path(url[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
            # Wait for a lock instead of failing at once when a dashboard or a second worker reads.
            engine_kwargs = {"connect_args": {"timeout": 60}}
        return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs), url
    except ImportError as exc:
        raise StudyError(f"{url}: a driver is missing ({exc.name}); for PostgreSQL install autotune[postgres]") from None
    except Exception as exc:  # SQLAlchemy raises many types; the user needs one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StudyError(f"cannot open storage {url}: {first}") from None


def study_dir(study_name: str, studies_dir: Path = DEFAULT_STUDIES_DIR) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in study_name)
    return studies_dir / safe


def study_exists(storage: Any, study_name: str) -> bool:
    return any(s.study_name == study_name for s in optuna.get_all_study_summaries(storage, include_best_trial=False))
