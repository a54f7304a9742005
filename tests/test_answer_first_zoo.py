"""The model-zoo scripts of issue 57's GPU bar and the runner's hand-measured best known, on the CPU at their
tiny sizes: each script trains as one of autotune's isolated trials, and the pick's share is taken of the best
of the hand configs and of the study's trials that no verdict ruled out (``benchmarks/runners/answer_first_h200.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.runners import answer_first_h200 as runner


def _space(tmp_path: Path) -> str:
    path = tmp_path / "space.yaml"
    path.write_text(runner.TINY_SPACE % {"batch": runner.TINY_BATCH, "samples": 8 * runner.TINY_BATCH})
    return str(path)


def test_the_pick_share_is_of_the_best_hand_config_or_study_trial_that_no_verdict_ruled_out() -> None:
    record = {
        "pick": {"throughput": 900.0, "config": {"precision": "bf16"}},
        "hand": [{"config": "bf16 compile", "throughput": 1000.0}, {"config": "fp16", "status": "timeout"}],
        "trials": [
            {"number": 0, "role": "reference", "status": "ok", "throughput": 100.0, "config": {"precision": "fp32"}},
            {"number": 1, "status": "ok", "throughput": 950.0, "config": {"precision": "bf16"}},
            {"number": 2, "status": "ok", "throughput": 5000.0, "accuracy_verdict": "degraded", "config": {}},
            {"number": 3, "status": "pruned", "throughput": 4000.0, "config": {}},
        ],
    }
    runner.best_known(record)
    assert record["best_known"] == {"throughput": 1000.0, "source": "by hand: bf16 compile"}
    assert record["pick_share"] == 0.9 and record["pick_trial_share"] == 0.95
    assert record["best_study_trial"] == 950.0 and record["best_study_trial_any_verdict"] == 5000.0
    record["trials"][1]["throughput"] = 1200.0  # a study trial faster than the hand config is the best known
    runner.best_known(record)
    assert record["best_known"]["source"].startswith("study trial #1") and record["pick_share"] == 0.75


def test_a_run_names_its_workload_and_budget_and_the_demo_may_keep_its_own() -> None:
    assert runner.parse_run("vits:4") == ("vits", "4", "vits-b4")
    assert runner.parse_run("gpt2:4:again") == ("gpt2", "4", "again")
    assert runner.parse_run("demo") == ("demo", None, "demo")
    with pytest.raises(SystemExit, match="say the budget"):
        runner.parse_run("vits")
    command, shown = runner.study_command("demo", None, "demo", Path("/nowhere/studies"), None)
    assert "--budget" not in command and "/nowhere" not in shown
    command, shown = runner.study_command("gpt2", "4", "gpt2-b4", Path("/nowhere/studies"), None)
    assert command[1] == "-c" and "args=zoo_gpt2_trainer.ARGS, budget=4" in shown
    assert runner.hand_config("vits", runner.HAND["vits"][0], tiny=False).describe() == \
        "bf16 bs128 compile=default optimizer=fused workers=8 pinned persistent"


def test_the_gpt2_trainer_script_trains_one_trial_through_the_adapter(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("AUTOTUNE_BENCH_SIZE", "tiny")
    row = runner.measure_hand("gpt2", runner.HAND["gpt2"][0], space=_space(tmp_path), work=tmp_path / "hand",
                              left=None, tiny=True)
    assert row["status"] == "ok", row
    assert row["throughput"] > 0 and row["samples"] >= 8 * runner.TINY_BATCH


def test_the_vits_script_trains_one_trial_and_its_random_augmentation_keeps_its_data_off_the_device(
        tmp_path, monkeypatch) -> None:
    pytest.importorskip("timm")
    import torch

    from autotune.trial._resident import refusal

    monkeypatch.setenv("AUTOTUNE_BENCH_SIZE", "tiny")
    row = runner.measure_hand("vits", runner.HAND["vits"][0], space=_space(tmp_path), work=tmp_path / "hand",
                              left=None, tiny=True)
    assert row["status"] == "ok", row
    from benchmarks.workloads.zoo_vits import CachedImages

    assert refusal(CachedImages(n=8), share=0.25, device=torch.device("cpu")).startswith("random augmentation")
