"""The co-location runner's tiny mode, on the CPU: a study with processes_per_gpu, the reruns, the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.runners import colocation_h200


def test_the_tiny_mode_tunes_packed_trials_and_writes_its_report(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(colocation_h200.SIZE_ENV, "tiny")  # main sets it too; this puts it back afterwards
    out = tmp_path / "coloc.md"
    assert colocation_h200.main(["--tiny", "--workloads", "lm", "--rounds", "2", "--deadline", "60",
                                 "--out", str(out), "--workdir", str(tmp_path / "run")]) == 0
    text = out.read_text()
    assert "## lm: reruns" in text and "## MPS daemon and compute mode" in text and "(the daemon is gone)" in text
    data = json.loads(out.with_suffix(".json").read_text())
    (row,) = data["workloads"]
    assert "no CUDA device" in row["removed_knobs"]["mps=true"]  # on a CPU: time-sliced copies only
    reruns = row["reruns"]
    assert len(reruns["rates"]["pick"]) == 2 and reruns["medians"]["one_process"] > 0
    assert reruns["speedup_vs_one_process"] == pytest.approx(reruns["medians"]["pick"] / reruns["medians"]["one_process"])
    assert any(t["config"]["processes_per_gpu"] == 2 and t["status"] == "ok" for t in row["trials"])
    assert data["meta"]["mps_after"] == []


@pytest.mark.parametrize("tiny", [True, False])
def test_every_space_of_the_runner_validates(tiny: bool) -> None:
    from autotune.search._space import parse_space

    for workload in colocation_h200.workloads(tiny):
        space = parse_space(workload.space, where=workload.name)
        assert space.knobs["mps"].values == (False, True) and 1 in space.knobs["processes_per_gpu"].values
        assert space.baseline.processes_per_gpu == 1 and not space.baseline.mps
