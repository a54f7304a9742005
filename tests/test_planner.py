"""The planner's decisions on recorded studies, without running a trial (``autotune.study._planner``).

The recorded studies are H200 studies committed under ``benchmarks/results``; each test gives the planner a
study's records up to some trial and checks the next action and its reason.
"""

from __future__ import annotations

import math
from pathlib import Path

import optuna
import pytest

from autotune._config import TrialConfig
from autotune.study._budget import StudyClock
from autotune.study._planner import (BASELINE_SPEED, PROBE, REFERENCE, REFERENCE_SHARE, RETRY_REASON, STOP, TRIAL, StudyView,
                                     first_faster, next_action, probes_why, reference_seconds, view_of)

optuna.logging.set_verbosity(optuna.logging.WARNING)
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
# The input-bound study of the order this planner replaces: the fp32 reference waited 96% on its input, so
# two fp32 loader-only trials (probes' picks) ran before the prior point (trial 3).
INPUT_BOUND_DB = RESULTS / "budget-h200" / "input-bound.db"


def _recorded(path: Path, upto: int) -> tuple[optuna.Study, dict]:
    """An in-memory copy of a recorded study's first ``upto`` + 1 trials, and its space's knob values."""
    stored = optuna.load_study(study_name=optuna.get_all_study_names(f"sqlite:///{path}")[0],
                               storage=f"sqlite:///{path}")
    study = optuna.create_study(directions=["maximize", "minimize"])
    for key, value in stored.user_attrs.items():
        study.set_user_attr(key, value)
    for trial in stored.trials[:upto + 1]:
        study.add_trial(optuna.trial.create_trial(params=trial.params, distributions=trial.distributions,
                                                  values=trial.values, user_attrs=trial.user_attrs,
                                                  system_attrs=trial.system_attrs, state=trial.state))
    knobs = {name: spec["choices"] for name, spec in stored.user_attrs["space"]["knobs"].items() if "choices" in spec}
    return study, knobs


def _view(path: Path, upto: int, *, budget: float | None = None, elapsed: float = 0.0, **keywords) -> StudyView:
    study, knobs = _recorded(path, upto)
    import time

    clock = StudyClock(budget_seconds=budget, started=time.monotonic() - elapsed)
    return view_of(study, knobs=knobs, n_trials=keywords.pop("n_trials", 30), clock=clock, **keywords)


def test_an_input_bound_fp32_reference_gets_the_prior_point_before_any_probe() -> None:
    decision = next_action(_view(INPUT_BOUND_DB, 0))
    assert decision.action == TRIAL
    assert "96%" in decision.reason and "before any loader probe" in decision.reason


def test_the_prior_point_waiting_on_its_input_gets_its_loader_probed() -> None:
    """With the reference and the prior point (trial 3 of the recording, bf16 compiled, 99% waiting): the
    fastest feasible trial is input-bound, its step faster than its loader, so its loader variants are probed."""
    study, knobs = _recorded(INPUT_BOUND_DB, 3)
    kept = optuna.create_study(directions=["maximize", "minimize"])
    for key, value in study.user_attrs.items():
        kept.set_user_attr(key, value)
    for trial in (study.trials[0], study.trials[3]):
        kept.add_trial(optuna.trial.create_trial(params=trial.params, distributions=trial.distributions,
                                                 values=trial.values, user_attrs=trial.user_attrs,
                                                 system_attrs=trial.system_attrs, state=trial.state))
    view = view_of(kept, knobs=knobs, n_trials=30, clock=StudyClock())
    decision = next_action(view)
    assert decision.action == PROBE and "trial #1, the best so far," in decision.reason
    assert next_action(view_of(kept, knobs=knobs, n_trials=30, clock=StudyClock(),
                               probed=lambda best: True)).action == TRIAL  # probed: the walk goes on
    # Where the space offers it the device-resident loader, that variant is the round's full trial, not probed.
    device = next_action(view_of(kept, knobs=knobs, n_trials=30, clock=StudyClock(), device_next=lambda best: True))
    assert device.action == PROBE and "the device-resident loader: that variant runs as the next full trial" \
        in device.reason
    assert "probed apart" in decision.reason and "device-resident" not in decision.reason


def test_the_recorded_order_would_have_stopped_for_the_race_and_the_trial_budget() -> None:
    import time

    view = _view(INPUT_BOUND_DB, 5, budget=240.0, elapsed=236.0, race=20.0)
    assert next_action(view).action == STOP and "race" in next_action(view).reason
    assert next_action(_view(INPUT_BOUND_DB, 5, n_trials=5)).action == STOP


def test_a_recorded_walk_with_a_trial_that_did_not_wait_just_walks() -> None:
    """ResNet-50 on synthetic data (the gpu_default study): nothing waits on its input, so no probe."""
    path = RESULTS / "search-h200" / "gpu-default-first.db"
    stored = optuna.load_study(study_name="r50-default", storage=f"sqlite:///{path}")
    assert stored.trials[1].user_attrs["data_wait_fraction"] < 0.5
    study = optuna.create_study(directions=["maximize", "minimize"])
    for trial in stored.trials[:2]:
        study.add_trial(optuna.trial.create_trial(params=trial.params, distributions=trial.distributions,
                                                  values=trial.values, user_attrs=trial.user_attrs,
                                                  system_attrs=trial.system_attrs, state=trial.state))
    decision = next_action(view_of(study, knobs={"precision": ["fp32", "bf16"]}, n_trials=30, clock=StudyClock()))
    assert decision.action == TRIAL and decision.reason == "the walk's next move from the best so far"


def test_references_come_first_within_their_share_of_the_budget() -> None:
    decision = next_action(StudyView(references_done=0, reference_repeats=2, budget_seconds=240.0))
    assert decision.action == REFERENCE and decision.seconds == pytest.approx(REFERENCE_SHARE * 240 / 2)
    assert reference_seconds(None, 2) is None
    assert next_action(StudyView(references_done=1, reference_repeats=2)).seconds is None  # no budget: full length


def test_a_loader_only_space_probes_the_reference_at_once() -> None:
    """Where the space moves only loader knobs, the reference's step is the only step: probe it."""
    best = {"data_wait_fraction": 0.9, "extra:loader_built": True, "number": 0, "role": "reference"}
    decision = next_action(StudyView(references_done=2, best=best, step_levers=False, full_trials=0))
    assert decision.action == PROBE and decision.reason.startswith("the reference waits 90%")


def test_an_input_bound_trial_without_ctx_loader_is_walked_and_the_reason_says_so() -> None:
    best = {"data_wait_fraction": 0.7, "extra:loader_built": False, "number": 2}
    decision = next_action(StudyView(references_done=2, best=best, best_is_reference=False, full_trials=2))
    assert decision.action == TRIAL and "not ctx.loader's" in decision.reason
    plan = [{"action": TRIAL, "reason": decision.reason}]
    assert probes_why(plan, []).startswith("none ran: the best so far waits 70%")
    assert probes_why([], []).startswith("none ran: no full trial waited")


def test_first_faster_skips_the_reference_duplicates_and_harmful_trials() -> None:
    trials = [
        {"number": 0, "role": "reference", "status": "ok", "throughput": 100.0},
        {"number": 1, "status": "ok", "throughput": 90.0, "accuracy_verdict": "equivalent"},
        {"number": 2, "status": "ok", "throughput": 300.0, "accuracy_verdict": "degraded"},
        {"number": 3, "status": "oom", "throughput": 0.0},
        {"number": 4, "status": "ok", "throughput": 250.0, "accuracy_verdict": "equivalent"},
    ]
    assert first_faster(trials, 100.0) == {"trial": 4, "throughput": 250.0, "speedup": 2.5}
    assert first_faster(trials[:4], 100.0) is None


def test_a_reference_run_with_another_loader_than_the_baselines_can_be_the_first_faster_config() -> None:
    """The references ran with the prior point's loader: trial 0 is then a config of its own, and the baseline's
    speed comes from a run of its own loader; faster than that, trial 0 is the first faster config."""
    baseline = {"precision": "fp32", "num_workers": 0}
    trials = [
        {"number": 0, "role": "reference", "status": "ok", "throughput": 400.0,
         "config": {"precision": "fp32", "num_workers": 8}},
        {"number": 1, "status": "ok", "throughput": 2800.0, "accuracy_verdict": "degraded"},
    ]
    assert first_faster(trials, 270.0, baseline) == {"trial": 0, "throughput": 400.0, "speedup": 1.481}
    same = [{**trials[0], "config": baseline, "throughput": 280.0}, trials[1]]
    assert first_faster(same, 270.0, baseline) is None  # the baseline's own reference is no faster config


def test_a_config_within_a_few_percent_of_the_baseline_is_no_faster_config() -> None:
    """The H100 GPT-2 Trainer study of 2026-12-07 (answer-first-h200/dec07-h100-b): its fp32 reference, run with
    the prior point's two workers, read 180.2 samples/s against the baseline's own 179.1, and was reported as
    the first faster config at 23% of the budget. Two runs of one config differ that much; the prior point,
    4.7x, was the first faster config."""
    import optuna

    study = optuna.load_study(study_name="gpt2-b4",
                              storage=f"sqlite:///{RESULTS / 'answer-first-h200' / 'dec07-h100-b' / 'gpt2.db'}")
    trials = [{**t.user_attrs, "number": t.number} for t in study.trials if t.state.name == "COMPLETE"]
    base = study.user_attrs["baseline_throughput"]
    assert trials[0]["role"] == "reference" and 1.0 < trials[0]["throughput"] / base < 1.01
    found = first_faster(trials, base, study.user_attrs["baseline_config"])
    assert found is not None and found["trial"] == 1 and found["speedup"] > 4


def test_a_dead_workers_retry_keeps_its_place_when_a_probes_pick_filled_the_budget() -> None:
    """The recorded input-bound study up to its second trial, then a third that a dead worker left RUNNING:
    the probes queue a pick, the stale trial is failed and its retry queued behind it. With three trials the
    budget reads spent once the retry's place counts, and the retry, not the pick, takes that place."""
    study, knobs = _recorded(INPUT_BOUND_DB, 1)
    dead = study.ask()
    study.tell(dead, state=optuna.trial.TrialState.FAIL)
    study.enqueue_trial({"num_workers": 8}, user_attrs={"predicted_from": "probes"})
    study.enqueue_trial({"num_workers": 4}, user_attrs={"retry_of": dead.number})
    view = view_of(study, knobs=knobs, n_trials=3, clock=StudyClock())
    assert (view.waiting, view.retries, view.finished) == (2, 1, 3)
    decision = next_action(view)
    assert decision.action == TRIAL and decision.reason == RETRY_REASON
    # Without the retry the same records stop: a dead trial's place is not counted twice.
    study.tell(study.ask(), state=optuna.trial.TrialState.FAIL)  # the probes' pick, taken off the queue
    retry = study.ask()
    assert retry.user_attrs.get("retry_of") == dead.number
    study.tell(retry, values=[1.0, 0.0])
    view = view_of(study, knobs=knobs, n_trials=3, clock=StudyClock())
    assert (view.retries, view.finished) == (0, 3) and next_action(view).action == STOP


# The ViT-B/32 study of the answer-first H200 run (2026-12-05, before the baseline's speed run moved): its
# references ran with the prior point's loader, and the baseline's own speed run came before trial #1.
VIT_DB = RESULTS / "answer-first-h200" / "dec05-before" / "vit.db"


def test_the_baseline_speed_run_waits_for_the_first_full_trial_and_still_runs_when_the_trials_are_spent() -> None:
    study, knobs = _recorded(VIT_DB, -1)  # the references alone (its reference config is no point of the space)
    study.set_user_attr("baseline_speed_pending", True)
    clock = StudyClock(budget_seconds=240.0)
    first = next_action(view_of(study, knobs=knobs, n_trials=40, clock=clock))
    assert first.action == TRIAL and "prior point" in first.reason
    study, _ = _recorded(VIT_DB, 0)  # and trial #0, the prior point, measured
    study.set_user_attr("baseline_speed_pending", True)
    after = next_action(view_of(study, knobs=knobs, n_trials=40, clock=clock))
    assert after.action == BASELINE_SPEED and "after the first full trial" in after.reason
    assert next_action(view_of(study, knobs=knobs, n_trials=1, clock=clock)).action == BASELINE_SPEED
    study.set_user_attr("baseline_speed_pending", False)
    assert next_action(view_of(study, knobs=knobs, n_trials=40, clock=clock)).action != BASELINE_SPEED
    study.set_user_attr("baseline_speed_pending", True)
    late = StudyClock(budget_seconds=240.0, started=__import__("time").monotonic() - 239.0)
    assert next_action(view_of(study, knobs=knobs, n_trials=40, clock=late)).action == STOP  # no time left: the race times it


# The H100 ViT-B/32 study under --budget 4 (answer-first-h200.md, 2026-12-06): the probes queued bf16 with
# the data on the device, predicted 7,712 img/s against the best trial's 2,273, and the race's 73 s reservation
# stopped it with 73 s left. Its --budget 5 study measured that config at 7,651.
VIT_B4_DB = RESULTS / "answer-first-h200" / "dec06-h100-b" / "vit-after-b4.db"


def test_a_probes_pick_far_beyond_the_best_runs_in_the_races_place() -> None:
    view = StudyView(references_done=2, full_trials=1, best={"number": 1, "data_wait_fraction": 0.98},
                     best_is_reference=False, probed=True, waiting=1, finished=2, budget_seconds=240.0,
                     usable_seconds=73.0, race_seconds=73.0, faster_found=True)
    assert next_action(view).action == STOP  # no decisive pick: the race's reservation stands
    decisive = next_action(StudyView(**{**view.__dict__, "decisive_seconds": 58.0}))
    assert decisive.action == TRIAL and "in the race's place (58 s with one round" in decisive.reason
    assert next_action(StudyView(**{**view.__dict__, "decisive_seconds": 80.0})).action == STOP  # it does not fit
    retry = StudyView(**{**view.__dict__, "decisive_seconds": 58.0, "retries": 1})
    assert next_action(retry).action == STOP  # a retry runs first from the queue: the pick would not be next


def test_the_recorded_vit_study_would_have_run_its_probes_pick_with_one_round_of_its_race() -> None:
    """Given the recorded study up to its prior point and the probes' pick queued again, with the 73 s it had
    left: with one round of the race kept free (the leader's run and the baseline's), the pick (predicted 3.4x
    the best trial) runs where the recorded study stopped."""
    import time

    from autotune._config import Budget
    from autotune.study._confirm import race_seconds
    from autotune.study._loop import decisive_seconds
    from autotune.study._probes import PREDICTED, PREDICTED_CONFIG

    stored = optuna.load_study(study_name="vit-b4", storage=f"sqlite:///{VIT_B4_DB}")
    study, knobs = _recorded(VIT_B4_DB, 1)
    queued = stored.trials[2]
    assert queued.user_attrs["status"] == "not_run" and "73 s" in queued.user_attrs["failure"]
    pick = TrialConfig.from_dict(study.trials[1].user_attrs["config"]).replace(
        loader="device", num_workers=0, pin_memory=False, persistent_workers=False, prefetch_factor=2)
    study.enqueue_trial(queued.system_attrs["fixed_params"],
                        user_attrs={PREDICTED: queued.user_attrs[PREDICTED], PREDICTED_CONFIG: pick.to_dict()})
    budget = Budget(samples=study.user_attrs["trial_budget"]["samples"], warmup_steps=10, windows=5)
    race = race_seconds(study, study.user_attrs["top_k"], budget)
    reserve = StudyClock(budget_seconds=240.0).left() - StudyClock(budget_seconds=240.0).usable()
    clock = StudyClock(budget_seconds=240.0, started=time.monotonic() - (240.0 - reserve - 73.0))
    keywords = dict(knobs=knobs, n_trials=40, clock=clock, race=race, probed=lambda best: True)
    # The recorded study kept the race's two rounds free (73 s) and stopped; one round, the pick and the baseline
    # each once, is what is kept now: the queued pick runs as the next trial.
    assert race == pytest.approx(73 / 2, abs=3)
    decision = next_action(view_of(study, **keywords))
    assert decision.action == TRIAL and "a queued trial runs next" in decision.reason
    seconds = decisive_seconds(study, dict(study.get_trials(states=(optuna.trial.TrialState.WAITING,))[0].user_attrs),
                               budget)
    assert seconds is not None and sum(seconds) < 70, seconds
    # A pick predicted within the race's reach of the best is an ordinary queued trial: the reservation stands.
    near = {PREDICTED: 1.2 * study.trials[1].user_attrs["throughput"], PREDICTED_CONFIG: pick.to_dict()}
    assert decisive_seconds(study, near, budget) is None
