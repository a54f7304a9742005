"""Shared fixtures: a CPU Capabilities record for the coordinator, and small YAML spaces in tmp_path."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

# The shared workloads are imported as the top-level module ``workloads`` (trial processes import them
# by that name too), whether or not tests/ is a package.
_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

from autotune.hardware import Capabilities

_ROOT_DB = Path(__file__).resolve().parent.parent / "autotune.db"


@pytest.fixture(autouse=True)
def _no_storage_at_the_repository_root():
    """No test may leave a study storage (``autotune.db``) at the repository's root."""
    existed = _ROOT_DB.exists()
    yield
    if not existed and _ROOT_DB.exists():
        _ROOT_DB.unlink()
        pytest.fail(f"this test wrote {_ROOT_DB.name} at the repository's root; give it a tmp_path storage")


@pytest.fixture
def cpu_caps() -> Capabilities:
    """What the probe reports on a CPU-only machine with a C++ compiler (data, built directly)."""
    return Capabilities(cuda=False, bf16=True, cpu_count=2, compile=True, hostname="test-host", torch="test")


@pytest.fixture
def write_space(tmp_path: Path):
    """Write a YAML search space into tmp_path and return its path."""

    def write(text: str, name: str = "space.yaml") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return path

    return write


@pytest.fixture
def space(tmp_path: Path) -> Path:
    """The small space of the scale-out and reliability workloads (tests/scale_workloads.py)."""
    from scale_workloads import SPACE

    path = tmp_path / "space.yaml"
    path.write_text(SPACE)
    return path
