"""The torch range that pyproject.toml declares: its lower bounds are a torch/torchvision pair, a recorded run
of the DDP tests at those lower bounds backs them, and the install commands in the docs quote the same range.

CI installs the newest torch the range admits, so the lower bound is not exercised there: it stands on the
run recorded in benchmarks/results/faults.md (round three). Moving a bound without a new run, or without the
docs, fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parent.parent
# torchvision 0.N is built for torch 2.(N - 15): 0.19 for 2.4, 0.29 for 2.14.
TORCHVISION_MINOR_OFFSET = 15
# The record's line: "DDP tests at the lower bounds: torch 2.4.1, torchvision 0.19.1: ... passed ...".
RECORD = re.compile(r"DDP tests at the lower bounds: torch (\S+), torchvision (\S+): ([^\n]*)")


def _declared() -> dict[str, SpecifierSet]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {req.name: req.specifier for req in map(Requirement, deps) if req.name in ("torch", "torchvision")}


def _bound(spec: SpecifierSet, operator: str) -> Version:
    (version,) = [Version(s.version) for s in spec if s.operator == operator]
    return version


def test_the_lower_and_upper_bounds_are_torch_torchvision_pairs() -> None:
    declared = _declared()
    for operator in (">=", "<"):
        torch, vision = _bound(declared["torch"], operator), _bound(declared["torchvision"], operator)
        assert (torch.major, vision.major) == (2, 0), (operator, torch, vision)
        assert vision.minor == torch.minor + TORCHVISION_MINOR_OFFSET, (operator, torch, vision)


def test_the_lower_bounds_are_backed_by_a_recorded_ddp_run() -> None:
    declared = _declared()
    text = (ROOT / "benchmarks" / "results" / "faults.md").read_text()
    found = RECORD.search(text)
    assert found, "faults.md records no run of the DDP tests at the declared lower bounds"
    for name, ran in zip(("torch", "torchvision"), found.group(1, 2)):
        version, lowest = Version(ran.rstrip(",.")), _bound(declared[name], ">=")
        assert version in declared[name], f"{name} {version} is outside the declared {declared[name]}"
        assert version.release[:2] == lowest.release[:2], (
            f"the recorded run used {name} {version}, the declared lower bound is {lowest}: run tests/test_ddp.py "
            f"at the new bound and record it, or put the bound back")
    outcome = found.group(3)
    assert "passed" in outcome and "failed" not in outcome and "error" not in outcome, outcome


@pytest.mark.parametrize("doc", ["README.md", "docs/index.md", "docs/install.md"])
def test_the_install_commands_quote_the_declared_upper_bounds(doc: str) -> None:
    declared = _declared()
    text = (ROOT / doc).read_text()
    commands = re.findall(r"pip install 'torch(<[\d.]+)' 'torchvision(<[\d.]+)'", text)
    assert commands, f"{doc} has no CPU-index install command"
    for torch, vision in commands:
        assert _bound(SpecifierSet(torch), "<") == _bound(declared["torch"], "<")
        assert _bound(SpecifierSet(vision), "<") == _bound(declared["torchvision"], "<")


def test_the_install_page_quotes_the_declared_range() -> None:
    quoted = re.findall(r"`torch([<>=][^`]*)`", (ROOT / "docs" / "install.md").read_text())
    assert quoted and all(SpecifierSet(q) == _declared()["torch"] for q in quoted), quoted
