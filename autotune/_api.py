"""The top-level functions: thin wrappers over ``Tuner`` and the study readers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional, Union

import optuna

from autotune._config import Result, TrialConfig
from autotune._errors import StudyError
from autotune._records import DEFAULT_STUDIES_DIR, study_dir
from autotune.study._storage import open_storage, study_exists
from autotune._records import summarize_study
from autotune.study._tuner import Tuner


def run(train_fn: Union[Callable[..., Any], str], *, summary: bool = True, **options: Any) -> Result:
    """Tune ``train_fn(ctx)`` and return what the study found (``Result.best_config``: the config to train with).

    Args:
        train_fn: A module-level ``train(ctx)``, or its ``path.py:func`` / ``module:func``.
        summary: Print the summary ``autotune tune`` prints at the end (the verdict, the accuracy check, where
            the minutes went); ``False``: print nothing.
        **options: ``Tuner``'s (``n_trials``, ``study_name``, ...), or the CLI's names where they differ
            (``trials``, ``study``, ``budget``, ``memory_limit``, ``nproc_per_trial``).
    """
    from autotune.integrations._summary import run_and_summarize

    return run_and_summarize(Tuner(train_fn, **options), summary=summary)


def load_study_result(study_name: str, *, storage: Optional[str] = None,
                      studies_dir: Union[str, Path] = DEFAULT_STUDIES_DIR) -> tuple[optuna.Study, Result]:
    """Open a finished (or running) study and summarise it.

    Raises:
        StudyError: no such study in the storage.
    """
    opened, url = open_storage(storage, Path(studies_dir), create=False)
    if not study_exists(opened, study_name):
        names = ", ".join(s.study_name for s in optuna.get_all_study_summaries(opened)) or "none"
        raise StudyError(f"no study {study_name!r} in {url} (studies there: {names})")
    study = optuna.load_study(study_name=study_name, storage=opened)
    return study, summarize_study(study, storage_url=url)


def _best_config_document(path: Path) -> dict[str, Any]:
    """The mapping a ``best_config.json`` holds.

    Raises:
        StudyError: it cannot be read, is torn or nested too deeply, or is not a mapping; one line.
    """
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except RecursionError:
        raise StudyError(f"{path}: not a best_config.json (nested too deeply)") from None
    except (OSError, ValueError) as exc:
        raise StudyError(f"{path}: not a best_config.json ({str(exc)[:200]})") from None
    if not isinstance(doc, dict):
        raise StudyError(f"{path}: not a best_config.json (a {type(doc).__name__}, not a mapping)")
    return doc


def load_best(study_or_path: Union[str, Path], *, storage: Optional[str] = None,
              studies_dir: Union[str, Path] = DEFAULT_STUDIES_DIR) -> TrialConfig:
    """The config to train with, from a study's ``best_config.json`` or from the storage: its pick when that
    is faster than the baseline, else the baseline itself (``Result.best_config``).

    Args:
        study_or_path: A path to ``best_config.json``, or a study name.

    Raises:
        StudyError: nothing feasible was found, or the study does not exist.
    """
    path = Path(study_or_path)
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise StudyError(f"{path}: no such file")
        doc = _best_config_document(path)
        if not doc.get("config"):
            raise StudyError(f"{path}: the study found no feasible config")
        baseline = doc.get("baseline").get("config") if isinstance(doc.get("baseline"), dict) else None
        try:  # every value against its knob's: a mistyped "bf-16" would train fp32 under that label
            if doc.get("faster") is False and "keep_baseline" not in doc and baseline:
                return TrialConfig.from_dict(baseline)  # a file written before keep_baseline: its config may be slower
            return TrialConfig.from_dict(doc["config"])
        except (TypeError, ValueError) as exc:
            raise StudyError(f"{path}: not a config autotune can train ({exc})") from None
    json_path = study_dir(str(study_or_path), Path(studies_dir)) / "best_config.json"
    if storage is None and json_path.is_file():
        doc = _best_config_document(json_path)
        if doc.get("study") != str(study_or_path):
            raise StudyError(f"{json_path} belongs to study {doc.get('study')!r}, not {str(study_or_path)!r}; "
                             "pass the file's path, or the study's --storage")
        return load_best(json_path)
    _, result = load_study_result(str(study_or_path), storage=storage, studies_dir=studies_dir)
    if result.best_config is None:
        raise StudyError(f"study {study_or_path!r} has no feasible config yet")
    return result.best_config
