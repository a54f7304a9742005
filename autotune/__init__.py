"""autotune: find the fastest training configuration by measuring it.

``autotune.run(train_fn)`` runs one isolated trial per configuration with Optuna, measures
steady-state throughput and accuracy loss against an fp32 reference, and returns the best config.
"""

from autotune._api import load_best, load_study_result, run
from autotune._config import Budget, Measurement, Result, TrialConfig, TrialOutcome, TrialRecord
from autotune.insight._diagnose import Diagnosis, annotate_trials, diagnose
from autotune._errors import (AutotuneError, KnobError, MissingExtraError, ReportError, SpaceError, StudyError,
                              TableError, WorkloadError)
from autotune.insight._report import annotate_study, write_report
from autotune.search._sampler import GuidedSampler
from autotune.search._simulate import ReplayTable, simulate
from autotune.search._space import SearchSpace, load_space
from autotune.study._train import TrainResult, TrainRun, train
from autotune.study._tuner import Tuner

__version__ = "0.1.0"

# These need torch; importing them lazily keeps the coordinator and the CLI free of a torch import.
_LAZY = {"TrialContext": "autotune.trial._context", "NonFiniteLoss": "autotune.trial._context", "applied": "autotune.trial._knobs",
         "float8_filter": "autotune.trial._float8"}


def __getattr__(name: str):  # noqa: ANN202 - module-level lazy attribute
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'autotune' has no attribute {name!r}")


__all__ = [
    "AutotuneError",
    "Budget",
    "Diagnosis",
    "GuidedSampler",
    "KnobError",
    "Measurement",
    "MissingExtraError",
    "NonFiniteLoss",
    "ReplayTable",
    "ReportError",
    "Result",
    "SearchSpace",
    "SpaceError",
    "StudyError",
    "TableError",
    "TrialConfig",
    "TrialContext",
    "TrialOutcome",
    "TrialRecord",
    "TrainResult",
    "TrainRun",
    "Tuner",
    "WorkloadError",
    "annotate_study",
    "annotate_trials",
    "applied",
    "diagnose",
    "float8_filter",
    "load_best",
    "load_space",
    "load_study_result",
    "run",
    "simulate",
    "train",
    "write_report",
]
