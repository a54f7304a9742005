"""The one small tree of errors autotune raises; the CLI maps each to one line and exit code 1."""

from __future__ import annotations


class AutotuneError(Exception):
    """Base class of every error autotune raises on purpose."""


class SpaceError(AutotuneError):
    """A search space that does not load or validate."""


class WorkloadError(AutotuneError):
    """A training function that cannot be found, imported or run at all."""


class MissingExtraError(WorkloadError):
    """An optional library that a feature needs is not installed; the message names the extra that installs it."""


class StudyError(AutotuneError):
    """A study that cannot be created, resumed or read (e.g. a changed search space)."""


class KnobError(AutotuneError):
    """A knob that cannot be applied as configured (e.g. CUDA Graphs without CUDA)."""


class ReportError(AutotuneError):
    """A report that cannot be written (e.g. the plotting extras are not installed)."""


class TableError(AutotuneError):
    """A replay table that is missing or malformed."""


__all__ = ["AutotuneError", "KnobError", "MissingExtraError", "ReportError", "SpaceError", "StudyError", "TableError",
           "WorkloadError"]
