"""The one small tree of errors autotune raises; the CLI maps each to one line and exit code 1."""

from __future__ import annotations

import unicodedata


class AutotuneError(Exception):
    """Base class of every error autotune raises on purpose."""


class SpaceError(AutotuneError):
    """A search space that does not load or validate."""


class WorkloadError(AutotuneError):
    """A training function that cannot be found, imported or run at all."""


class MissingExtraError(WorkloadError):
    """An optional library that a feature needs is not installed; the message names the extra that installs it."""


class InstallError(AutotuneError):
    """Installed packages that do not work together (e.g. torch and a torchvision built for another torch)."""


class StudyError(AutotuneError):
    """A study that cannot be created, resumed or read (e.g. a changed search space)."""


class KnobError(AutotuneError):
    """A knob that cannot be applied as configured (e.g. CUDA Graphs without CUDA)."""


class ReportError(AutotuneError):
    """A report that cannot be written (e.g. the plotting extras are not installed)."""


class TableError(AutotuneError):
    """A replay table that is missing or malformed."""


def printable(text: str) -> str:
    """``text`` with its control characters (ESC, BEL, CR, newlines, C1) written as ``\\x1b`` escapes.

    An exception's text is the workload's or a library's: printed raw, its terminal control sequences would
    blink, retitle or clear the user's terminal, or hide the rest of the line.
    """
    return "".join(f"\\x{ord(c):02x}" if unicodedata.category(c) == "Cc" else c for c in text)


ERROR_CHARS = 2000  # the most of an error's text one line prints: a value quoted in it may be any size


def one_line(text: str, limit: int = ERROR_CHARS) -> str:
    """``printable(text)`` cut to ``limit`` characters, saying how many it left out."""
    text = printable(text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit:,} more characters)"


__all__ = ["AutotuneError", "InstallError", "KnobError", "MissingExtraError", "ReportError", "SpaceError", "StudyError", "TableError",
           "WorkloadError"]
