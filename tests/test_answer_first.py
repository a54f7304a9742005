"""The answer first, in real CPU studies: the references inside their share of the budget, the script's batch
learnt before any seed runs twice, the prior point before any loader probe, and references reused by a
second study of the same target (``autotune.study._planner``, ``_references``, ``_stored``)."""

from __future__ import annotations

import json
import math
import os
import shutil
import textwrap
from pathlib import Path

import optuna
import pytest

from autotune import Tuner

import answer_workloads

optuna.logging.set_verbosity(optuna.logging.WARNING)

WORKLOADS = Path(__file__).with_name("answer_workloads.py")
SPACE = """\
knobs:
  batch_size: [32]
  optimizer_impl: [default, fused]
  num_workers: [0, 1]
baseline: {batch_size: 32}
global_batch: 32
budget: {samples: %d, warmup_steps: 2, windows: 3}
"""


def _tuner(tmp_path: Path, cpu_caps, target: str, *, samples: int = 1024, space: str = SPACE, **options) -> Tuner:
    (tmp_path / "space.yaml").write_text(space % samples if "%d" in space else space)
    settings = dict(space=tmp_path / "space.yaml", n_trials=8, storage=f"sqlite:///{tmp_path}/s.db",
                    studies_dir=tmp_path / "studies", progress=False, plots=False, capabilities=cpu_caps,
                    trial_timeout=120, top_k=0, prune_below=None, study_name="a")
    settings.update(options)
    return Tuner(target, **settings)


def _study(tmp_path: Path, name: str = "a") -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path}/s.db")


def _full_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return [t for t in study.trials if t.state.name == "COMPLETE" and t.user_attrs.get("role") != "reference"
            and t.user_attrs.get("status") == "ok" and t.user_attrs.get("duplicate_of") is None]


def test_a_reference_too_long_for_its_share_trains_fewer_samples_and_trials_still_run(tmp_path, cpu_caps,
                                                                                        monkeypatch) -> None:
    """Each fp32 seed at the space's length would take over 35% of the budget: the first trains within its
    share, every run after it trains that many samples (paired), at least two non-baseline full trials run,
    and the faster config is the pick. The shortened length is stated."""
    monkeypatch.setenv(answer_workloads.STEP_ENV, "0.2")  # 128 steps: over 25 s a seed of a 60 s budget
    result = _tuner(tmp_path, cpu_caps, f"{WORKLOADS}:train", samples=4096, budget_minutes=1.0).run()
    study = _study(tmp_path)
    shortened = study.user_attrs["references_shortened"]
    trained = study.user_attrs["trial_budget"]
    assert shortened["from_samples"] == 4096 and shortened["samples"] < 4096 * 0.5
    # The budget whose share would train both seeds at full length: the 60 s and what the two seeds lacked.
    assert shortened["full_length_budget_minutes"] == math.ceil((60 + 2 * shortened["missing_seconds"] / 0.2) / 60) > 1
    assert trained == {"samples": shortened["samples"], "schedule_samples": 4096}
    full = _full_trials(study)
    assert len(full) >= 2, [t.user_attrs.get("status") for t in study.trials]
    reference = next(t for t in study.trials if t.user_attrs.get("role") == "reference")
    assert all(t.user_attrs["samples"] == reference.user_attrs["samples"] == shortened["samples"] for t in full)
    assert result.best_config is not None and result.best_config.optimizer_impl == "fused"
    saved = json.loads((tmp_path / "studies" / "a" / "best_config.json").read_text())
    assert saved["evidence_length"] == {**saved["evidence_length"], "samples": shortened["samples"], "shortened": True}
    assert saved["time_to_first_faster"]["trial"] >= 1 and saved["time_split"]["first_faster"]["seconds"] < 60


def test_a_script_batch_is_learnt_in_the_first_seed_and_no_seed_runs_twice(tmp_path, cpu_caps, monkeypatch) -> None:
    """``ctx.loader(..., batch_size=16)`` with a space whose baseline is 32: the first seed trains at 16, and
    each seed runs once (one process per seed; before, both ran at 32 and again at 16)."""
    runs = tmp_path / "runs.txt"
    monkeypatch.setenv(answer_workloads.RUNS_ENV, str(runs))
    # Nothing states the batch, so the script's is adopted; 16 is a value of the space, so trial 0 is the reference.
    space = SPACE.replace("global_batch: 32\n", "").replace("batch_size: [32]", "batch_size: [16, 32]") % 1024
    _tuner(tmp_path, cpu_caps, f"{WORKLOADS}:train_at_batch_16", mode="create", space=space).run()
    lines = runs.read_text().split()
    assert lines == ["16", "16"], lines  # the batch each reference process trained at, one line a process
    study = _study(tmp_path)
    assert study.user_attrs["baseline_config"]["batch_size"] == 16
    assert study.user_attrs["global_batch"] == 16 and study.trials[0].user_attrs["config"]["batch_size"] == 16


def test_a_reference_with_the_prior_loader_at_the_scripts_batch_is_trial_0(tmp_path, cpu_caps) -> None:
    """The references ran with the prior point's loader at the batch the script passes (16, not the space's
    32): that config is a point of the space, so it is trial 0, a candidate for the pick like any other (on
    the H200 both model-zoo studies left it out, a 2x fp32 config that no verdict could rule out)."""
    space = SPACE.replace("global_batch: 32\n", "").replace("batch_size: [32]", "batch_size: [16, 32]") % 1024
    _tuner(tmp_path, cpu_caps, f"{WORKLOADS}:train_at_batch_16", mode="create", space=space, n_trials=2,
           reference_loader="prior").run()
    study = _study(tmp_path)
    reference = study.user_attrs["reference_config"]
    assert reference["batch_size"] == 16 and reference["global_batch"] == study.user_attrs["global_batch"] == 16
    first = study.trials[0].user_attrs
    assert first.get("role") == "reference" and first["config"] == reference, first.get("config")


def test_an_input_bound_reference_with_an_untuned_step_runs_the_prior_point_before_any_probe(
        tmp_path, cpu_caps, monkeypatch) -> None:
    """The reference waits on its input, but its step is the ceiling the prior point lifts: the first full
    trial is the prior point, not a loader-only config the probes picked; the plan says why."""
    monkeypatch.setenv(answer_workloads.ITEM_ENV, "0.003")  # 96 ms of reads a batch against a 40 ms step
    monkeypatch.setenv(answer_workloads.STEP_ENV, "0.04")
    _tuner(tmp_path, cpu_caps, f"{WORKLOADS}:train", samples=640, n_trials=2, reference_repeats=1).run()
    study = _study(tmp_path)
    assert study.trials[0].user_attrs["data_wait_fraction"] >= 0.5
    first = study.trials[1]
    assert first.user_attrs.get("predicted_from") is None and first.params["optimizer_impl"] == "fused"
    assert not [p for p in study.user_attrs.get("probes", []) if p.get("seconds") is not None
                and p["config"]["optimizer_impl"] == "default" and p["kind"] == "step"]
    plan = study.user_attrs["plan"]
    assert plan[0]["action"] == "trial" and "before any loader probe" in plan[0]["reason"]


def _reuse_target(tmp_path: Path) -> str:
    folder = tmp_path / "script"
    folder.mkdir(exist_ok=True)
    shutil.copy(WORKLOADS, folder / "answer_workloads.py")
    (folder / "helper.py").write_text("STEP = 0.0\n")
    (folder / "main.py").write_text(textwrap.dedent("""\
        import helper
        from answer_workloads import train as _train

        def train(ctx):
            _train(ctx)
        """))
    return f"{folder / 'main.py'}:train"


def test_a_second_study_of_the_same_target_reuses_the_references_until_one_of_their_inputs_changes(
        tmp_path, cpu_caps, monkeypatch) -> None:
    runs = tmp_path / "runs.txt"
    monkeypatch.setenv(answer_workloads.RUNS_ENV, str(runs))
    target = _reuse_target(tmp_path)

    def references_run(**options) -> int:
        before = len(runs.read_text().split()) if runs.exists() else 0
        _tuner(tmp_path, cpu_caps, target, samples=options.pop("samples", 512), reference_repeats=1,
               **options).run()
        return len(runs.read_text().split()) - before

    assert references_run(study_name="first", mode="create") == 1
    assert references_run(study_name="second", n_trials=1) == 0  # a new study: its references are the first's
    split = _study(tmp_path, "second").user_attrs["time_split"]
    assert split["parts"]["references"] < 0.05 and split["references_reused"]["study"] == "first"
    assert _study(tmp_path, "second").trials[0].user_attrs["role"] == "reference"
    assert references_run(study_name="fresh", mode="create", fresh_references=True) == 1
    assert references_run(study_name="longer", mode="create", samples=640) == 1
    assert references_run(study_name="stated", mode="create", baseline="num_workers=1") == 1
    (tmp_path / "script" / "helper.py").write_text("STEP = 0.001\n")  # a module the target imports
    assert references_run(study_name="edited", mode="create") == 1
    assert references_run(study_name="edited-again", mode="create") == 0


def test_references_with_the_prior_points_loader_train_more_in_their_share_and_the_baseline_is_timed_apart(
        tmp_path, cpu_caps, monkeypatch) -> None:
    """The baseline's loader (no workers) feeds 8 ms an item, the prior point's (four workers) faster:
    under a budget the fp32 references run with the prior's loader, so in their share they train more samples
    than the baseline's loader could deliver; the baseline's own speed comes from a short run of it, and the
    speed-up divides by that."""
    monkeypatch.setenv(answer_workloads.ITEM_ENV, "0.008")
    space = SPACE.replace("num_workers: [0, 1]", "num_workers: [0, 4]")
    _tuner(tmp_path, cpu_caps, f"{WORKLOADS}:train", samples=8192, space=space, budget_minutes=1.5, n_trials=2,
           reference_loader="prior").run()
    attrs = _study(tmp_path).user_attrs
    # The baseline's own speed run waits for the first full trial (the prior point), then runs once.
    actions = [d["action"] for d in attrs["plan"]]
    assert actions.index("trial") < actions.index("baseline-speed") and actions.count("baseline-speed") == 1, actions
    assert attrs["baseline_speed_pending"] is False
    found = attrs["first_faster"]  # noted again against the baseline's own rate once that was measured
    assert found["speedup"] == round(found["throughput"] / attrs["baseline_speed"]["throughput"], 3), found
    assert attrs["baseline_config"]["num_workers"] == 0 and attrs["reference_config"]["num_workers"] == 4
    speed = attrs["baseline_speed"]
    assert attrs["baseline_throughput"] == speed["throughput"] and speed["samples"] < 8192
    reference = next(t for t in _study(tmp_path).trials if t.user_attrs.get("role") == "reference")
    assert reference.user_attrs["config"]["num_workers"] == 4
    assert reference.user_attrs["throughput"] > 1.4 * speed["throughput"]
    assert found["trial"] == reference.number  # the first config measured faster than the baseline's own speed
    # Each seed's share of the 90 s budget is 9 s: at the baseline's own speed that is this many samples at most.
    shortened = attrs["references_shortened"]
    assert shortened["seconds"] == 9.0 and shortened["samples"] > speed["throughput"] * 9.0, (shortened, speed)
    # Trial 0, the reference run with two workers, is a config like any other: measured faster than the
    # baseline's own speed run, beyond both runs' windows, it is the pick.
    saved = json.loads((tmp_path / "studies" / "a" / "best_config.json").read_text())
    assert saved["faster"] and saved["config"]["num_workers"] == 4 and saved["speedup_spread"]["low"] > 1.0
    # A second study of the same target reuses the references with the baseline's speed: it runs neither.
    _tuner(tmp_path, cpu_caps, f"{WORKLOADS}:train", samples=8192, space=space, budget_minutes=1.5, n_trials=1,
           reference_loader="prior", study_name="again", top_k=0).run()
    again = _study(tmp_path, "again").user_attrs
    assert again["references_reused"]["study"] == "a" and again["baseline_speed"] == speed
    assert "baseline-speed" not in [d["action"] for d in again.get("plan", [])]
