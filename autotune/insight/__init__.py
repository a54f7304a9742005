"""The insight layer: explaining a study.

What held each trial back (``_diagnose``), the dashboard notes, plots and ``autotune report``
(``_report``).
"""

from autotune.insight._diagnose import Diagnosis, annotate_trials, diagnose
from autotune.insight._report import annotate_study, write_report

__all__ = ["Diagnosis", "annotate_study", "annotate_trials", "diagnose", "write_report"]
