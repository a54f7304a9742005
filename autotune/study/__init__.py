"""The study layer: driving a study.

The tuner loop and its parts (``_tuner``), trial processes, one or the ranks of a DDP job (``_isolation``), storage URLs
(``_storage``), worker liveness (``_workers``), the progress bar (``_progress``) and
``best_config.json`` (``_results``).
"""

from autotune.study._options import (
    AccuracyOptions,
    ConfirmOptions,
    SearchOptions,
    StudyOptions,
    TrialOptions,
    TunerOptions,
)
from autotune.study._tuner import Tuner

__all__ = [
    "AccuracyOptions",
    "ConfirmOptions",
    "SearchOptions",
    "StudyOptions",
    "TrialOptions",
    "Tuner",
    "TunerOptions",
]
