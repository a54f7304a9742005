"""The study layer: driving a study.

The tuner loop and its parts (``_tuner``), trial processes, one or the ranks of a DDP job (``_isolation``), storage URLs
(``_storage``), worker liveness (``_workers``), the progress bar (``_progress``),
``best_config.json`` (``_results``) and the real run with the pick (``_train``).
"""

from autotune.study._options import (
    AccuracyOptions,
    ConfirmOptions,
    SearchOptions,
    StudyOptions,
    TrialOptions,
    TunerOptions,
)
from autotune.study._train import TrainPlan, TrainResult, TrainRun, train
from autotune.study._tuner import Tuner

__all__ = [
    "AccuracyOptions",
    "ConfirmOptions",
    "SearchOptions",
    "StudyOptions",
    "TrainPlan",
    "TrainResult",
    "TrainRun",
    "TrialOptions",
    "Tuner",
    "TunerOptions",
    "train",
]
