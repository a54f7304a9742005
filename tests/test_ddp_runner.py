"""The two-GPU DDP runner's tiny mode, on the CPU: two gloo ranks per trial, the whole report path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.runners import ddp_h200x2


def test_the_tiny_mode_tunes_two_rank_trials_and_writes_its_report(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ddp_h200x2.SIZE_ENV, "tiny")  # main sets it too; this puts it back afterwards
    out = tmp_path / "ddp.md"
    # One workload and one trial per study (the reference) keep it short; the resnet50 path differs only in
    # its spaces, which the next test checks.
    assert ddp_h200x2.main(["--tiny", "--trials", "1", "--workloads", "gpt", "--out", str(out),
                            "--workdir", str(tmp_path / "run")]) == 0
    text = out.read_text()
    assert "| gpt | `fp32 bs32 workers=0`" in text and "ranks=2" in text
    (row,) = json.loads(out.with_suffix(".json").read_text())
    assert row["two_ranks"]["baseline"].startswith("fp32 bs16 ranks=2")  # default DDP settings: no DDP knob shown
    medians = row["alternation"]["medians"]
    assert set(medians) == {"pick", "pick_default_ddp", "one_gpu_best"} and all(v > 0 for v in medians.values())
    assert row["scaling_efficiency"] == pytest.approx(medians["pick"] / (2 * medians["one_gpu_best"]))
    assert row["ddp_knob_speedup"] == pytest.approx(medians["pick"] / medians["pick_default_ddp"])


@pytest.mark.parametrize("tiny", [True, False])
def test_every_space_of_the_runner_validates(tiny: bool) -> None:
    from autotune.search._space import parse_space

    for workload in ddp_h200x2.workloads(tiny):
        one = parse_space(workload.one_gpu, where=workload.name)
        two = parse_space({**workload.two_ranks, "processes_per_trial": 2}, where=workload.name)
        assert one.processes_per_trial == 1 and two.processes_per_trial == 2
        assert two.baseline == ddp_h200x2.default_ddp(two.baseline)  # the study starts from default DDP settings
