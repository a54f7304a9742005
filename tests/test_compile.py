"""Bounded compiles: the compile deadline in real trial processes and a real study, and the break-even rule."""

from __future__ import annotations

import json
import math
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from autotune import Budget, TrialConfig, Tuner
from autotune.cli import build_parser, _tuner
from autotune.search import _compile
from autotune.search._compile import (
    PRIOR_COMPILE_SECONDS,
    CompilePlan,
    TrainingLength,
    compile_break_even,
    plan_expensive_compiles,
    restrict_expensive_compiles,
    slow_compile_modes,
)
from autotune.search._space import parse_space, restrict_to
from autotune.study._isolation import run_isolated, start_trial_server
from autotune.study._options import TrialOptions
from autotune.trial._execute import TrialSpec
from test_isolation import _gone
from workloads import PIDFILE_ENV, WORKLOADS

optuna.logging.set_verbosity(optuna.logging.WARNING)

BUDGET = Budget(samples=512, warmup_steps=1, windows=3)
TRIAL_TIMEOUT = 120.0
# A real inductor compile of the tiny MLP: about 1 s on this CPU from warm inductor caches, 10 s and more
# with them off. The compiling trials turn them off, so that each compile outlasts the deadline by far.
DEADLINE = 1.0
COLD = {"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}




def compiled_spec(func: str, mode: str = "default", env: dict[str, str] = {}) -> TrialSpec:  # noqa: B006
    return TrialSpec(target=f"{WORKLOADS}:{func}", config=TrialConfig(batch_size=32, compile=mode), budget=BUDGET,
                     env={**COLD, **env})


# -- the deadline in a real trial process --------------------------------------------------------------
def test_a_slow_compile_ends_at_its_deadline_not_the_trials(tmp_path: Path) -> None:
    start_trial_server()  # the forkserver's torch import is not the trial's
    pidfile = tmp_path / "grandchild.pid"
    outcome = run_isolated(compiled_spec("compile_with_grandchild", env={PIDFILE_ENV: str(pidfile)}),
                           workdir=tmp_path / "trial", timeout=TRIAL_TIMEOUT, compile_timeout=DEADLINE)
    assert outcome.status == "compile_timeout", (outcome.error, outcome.stderr_tail)
    assert outcome.error.startswith("compile=default still compiling after ")
    assert outcome.error.endswith("(compile timeout 1s)")
    assert outcome.measurement is None
    # Cut at the deadline plus the process start and the poll (about 3 s here, unloaded), far from the
    # trial's 120 s; an uncut compile would have finished the trial as ok.
    assert DEADLINE < outcome.wall_seconds < 20.0, outcome.wall_seconds
    clock = json.loads((tmp_path / "trial" / "compile_clock.json").read_text())
    assert clock["mode"] == "default" and clock["since"] is not None  # killed while compiling
    grandchild = int(pidfile.read_text())
    assert _gone(grandchild), f"grandchild {grandchild} survived the compile timeout"


def test_a_compile_in_a_hand_written_loop_has_the_deadline_too(tmp_path: Path) -> None:
    """No ctx.batches: TorchDynamo's own compile callbacks run the clock."""
    start_trial_server()
    outcome = run_isolated(compiled_spec("compile_in_own_loop"), workdir=tmp_path / "trial",
                           timeout=TRIAL_TIMEOUT, compile_timeout=DEADLINE)
    assert outcome.status == "compile_timeout", (outcome.error, outcome.stderr_tail)
    assert outcome.wall_seconds < 20.0


def test_an_eager_trial_has_no_compile_clock(tmp_path: Path) -> None:
    outcome = run_isolated(compiled_spec("train_tiny", mode="off"), workdir=tmp_path / "trial",
                           timeout=TRIAL_TIMEOUT, compile_timeout=0.01)
    assert outcome.status == "ok", outcome.stderr_tail
    assert not (tmp_path / "trial" / "compile_clock.json").exists()


def test_the_default_compile_timeout_is_half_the_trials() -> None:
    assert TrialOptions().compile_deadline == 300.0
    assert TrialOptions(trial_timeout=150).compile_deadline == 75.0
    assert TrialOptions(compile_timeout=40).compile_deadline == 40.0
    with pytest.raises(ValueError, match="compile_timeout"):
        TrialOptions(compile_timeout=0)


# -- a study --------------------------------------------------------------------------------------------
STUDY_SPACE = """\
knobs:
  compile: ['off', default, max-autotune-no-cudagraphs]
  batch_size: [32, 64]
baseline: {batch_size: 32}
batch_policy: scale
budget: {samples: 512, warmup_steps: 1, windows: 3}
"""


def test_a_compile_timeout_in_a_study_marks_the_mode_slow_and_the_study_goes_on(tmp_path: Path, cpu_caps,
                                                                                  write_space, monkeypatch) -> None:
    for key, value in COLD.items():
        monkeypatch.setenv(key, value)  # trials take the coordinator's environment
    url = f"sqlite:///{tmp_path}/studies.db"
    settings = dict(space=write_space(STUDY_SPACE), storage=url, studies_dir=tmp_path / "studies", progress=False, plots=False,
                    capabilities=cpu_caps, reference_repeats=1, trial_timeout=TRIAL_TIMEOUT, compile_timeout=DEADLINE,
                    top_k=0, prune_below=None, n_trials=3, study_name="compile")
    Tuner(f"{WORKLOADS}:train_tiny", mode="create", **settings).run()
    study = optuna.load_study(study_name="compile", storage=url)
    study.enqueue_trial({"compile": "default", "batch_size": 32})
    study.enqueue_trial({"compile": "off", "batch_size": 64})
    Tuner(f"{WORKLOADS}:train_tiny", **settings).run()

    study = optuna.load_study(study_name="compile", storage=url)
    trials = study.get_trials()
    assert [t.user_attrs["status"] for t in trials] == ["ok", "compile_timeout", "ok"]
    slow = trials[1]
    assert slow.state == TrialState.COMPLETE and slow.constraints["failure"] == 1.0  # infeasible, not FAIL
    assert slow.user_attrs["failure"] == "compile_timeout"
    assert slow.user_attrs["compile_mode"] == "default"
    assert slow.user_attrs["compile_timeout_seconds"] == DEADLINE
    assert slow.user_attrs["wall_seconds"] < 20.0
    assert trials[2].user_attrs["throughput"] > 0  # the next trial ran
    assert slow_compile_modes(trials) == {"default": f"trial 1: {slow.user_attrs['error']}"}
    # Not an out-of-memory: nothing was ruled out by the memory rule.
    assert all(t.user_attrs["status"] != "infeasible" for t in trials)

    # Undeclared training: the expensive mode left the space before the study, with the break-even stated.
    attrs = study.user_attrs
    assert "max-autotune-no-cudagraphs" not in attrs["space"]["knobs"]["compile"]["choices"]
    reason = attrs["removed_knobs"]["compile=max-autotune-no-cudagraphs"]
    assert "no training length declared" in reason
    plan = attrs["compile_break_even"]
    assert plan["modes"]["max-autotune-no-cudagraphs"]["kept"] is False
    assert plan["train_seconds"] is None and attrs["compile_timeout_seconds"] == DEADLINE

    # A resume rebuilds the same space (the stored decision), so the study is accepted as it is.
    Tuner(f"{WORKLOADS}:train_tiny", **settings).run()
    assert len(optuna.load_study(study_name="compile", storage=url).trials) == 3


# -- the break-even rule --------------------------------------------------------------------------------
def test_compile_break_even() -> None:
    # 60 s of compile for 10% more samples/s: 60 / (1 - 100/110) = 660 s of training.
    assert compile_break_even(60, 110, 100) == pytest.approx(660.0)
    # Twice as fast: the compile is paid back after twice its own time.
    assert compile_break_even(30, 200, 100) == pytest.approx(60.0)
    assert compile_break_even(60, 100, 100) == math.inf
    assert compile_break_even(60, 90, 100) == math.inf
    assert compile_break_even(0, 90, 100) == 0.0


def _space(compile_modes: str, baseline: str = "{}") -> object:
    return parse_space({"knobs": {"compile": json.loads(compile_modes), "batch_size": [64, 128]},
                        "baseline": json.loads(baseline), "batch_policy": "scale"}, where="test")


MODES = '["off", "default", "max-autotune-no-cudagraphs", "max-autotune"]'


@pytest.mark.parametrize(("length", "kept"), [
    (TrainingLength(), False),
    (TrainingLength(minutes=30), False),
    (TrainingLength(minutes=240), True),
    # 2,000,000 steps of 64 samples at 1,000 samples/s: 35.6 hours.
    (TrainingLength(steps=2_000_000), True),
    (TrainingLength(steps=1_000), False),
])
def test_expensive_modes_stay_only_when_the_declared_training_pays(length: TrainingLength, kept: bool) -> None:
    space = _space(MODES)
    plan = plan_expensive_compiles(space, length, samples_per_second=1000.0)
    break_even = compile_break_even(PRIOR_COMPILE_SECONDS, _compile.PRIOR_GAIN, 1.0)
    assert [m.mode for m in plan.modes] == ["max-autotune-no-cudagraphs", "max-autotune"]
    assert all(m.kept is kept and m.break_even_seconds == pytest.approx(break_even) for m in plan.modes)
    restricted = restrict_expensive_compiles(space, plan)
    left = set(restricted.knobs["compile"].values)
    assert left == ({"off", "default", "max-autotune-no-cudagraphs", "max-autotune"} if kept else {"off", "default"})
    assert set(restricted.removed) == (set() if kept else {"compile=max-autotune-no-cudagraphs", "compile=max-autotune"})
    for reason in restricted.removed.values():
        assert f"~{break_even / 60:.0f} min of training" in reason


def test_a_measured_default_compile_scales_the_predicted_cost() -> None:
    space = _space(MODES)
    hour = TrainingLength(minutes=60)
    # The prior (300 s of compile, 105 min to break even) says no to an hour of training ...
    assert not any(m.kept for m in plan_expensive_compiles(space, hour, samples_per_second=1.0).modes)
    # ... a study whose default compile took 20 s predicts 100 s for max-autotune: 35 min, so yes.
    plan = plan_expensive_compiles(space, hour, samples_per_second=1.0, default_compile_seconds=20.0)
    assert all(m.kept and m.compile_seconds == 100.0 for m in plan.modes)
    assert plan.modes[0].break_even_seconds == pytest.approx(2100.0)


def test_the_baselines_own_mode_and_probe_removals_are_respected(cpu_caps) -> None:
    space = _space(MODES, '{"compile": "max-autotune-no-cudagraphs"}')
    plan = plan_expensive_compiles(restrict_to(space, cpu_caps), TrainingLength(), samples_per_second=1.0)
    # max-autotune was already removed by the probe (no CUDA); the baseline keeps its own mode.
    assert [(m.mode, m.kept) for m in plan.modes] == [("max-autotune-no-cudagraphs", True)]
    assert plan.removed == {}
    assert CompilePlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


def test_slow_compile_modes_reads_the_trials() -> None:
    study = optuna.create_study(directions=["maximize", "minimize"])
    for status, mode in (("ok", "default"), ("compile_timeout", "max-autotune"), ("timeout", "default"),
                         ("compile_timeout", "max-autotune")):
        attrs = {"status": status, "config": {"compile": mode}}
        if status == "compile_timeout":
            attrs.update(failure=status, compile_mode=mode, compile_timeout_seconds=300.0,
                         error=f"compile={mode} still compiling after 301s (compile timeout 300s)")
        study.add_trial(optuna.trial.create_trial(values=[0.0, 0.0], user_attrs=attrs))
    expected = "compile=max-autotune still compiling after 301s (compile timeout 300s)"
    assert slow_compile_modes(study.trials) == {"max-autotune": f"trial 1: {expected}"}
    assert slow_compile_modes([t.user_attrs for t in study.trials]) == {"max-autotune": expected}
    assert slow_compile_modes(study.trials[:1]) == {}


# -- the command line -----------------------------------------------------------------------------------
def test_cli_options_reach_the_tuner() -> None:
    args = build_parser().parse_args(["tune", "x.py:train", "--compile-timeout", "90", "--train-minutes", "45"])
    tuner = _tuner(args, "x.py:train")
    assert tuner.options.trial.compile_timeout == 90.0
    assert tuner.options.search.train_minutes == 45.0 and tuner.options.search.train_steps is None
    args = build_parser().parse_args(["demo", "--train-steps", "5000"])
    assert _tuner(args, "autotune.demo:train").options.search.train_steps == 5000
    with pytest.raises(SystemExit):
        build_parser().parse_args(["tune", "x.py:train", "--train-minutes", "4", "--train-steps", "5"])
    worker = build_parser().parse_args(["worker", "x.py:train", "--study", "s", "--storage", "sqlite:///s.db",
                                        "--compile-timeout", "60"])
    assert _tuner(worker, "x.py:train", mode="join").options.trial.compile_timeout == 60.0


def test_the_guided_sampler_drops_a_mode_after_one_compile_timeout() -> None:
    from optuna.distributions import CategoricalDistribution

    from autotune.search._sampler import GuidedSampler, seen_trial

    space = {"compile": CategoricalDistribution(["off", "default", "max-autotune-no-cudagraphs"]),
             "batch_size": CategoricalDistribution([32, 64, 128])}
    sampler = GuidedSampler(search_space=space, seed=0)
    slow = optuna.trial.create_trial(
        params={"compile": "default", "batch_size": 64}, distributions=space, values=[0.0, math.inf],
        user_attrs={"status": "compile_timeout", "failure": "compile_timeout", "compile_mode": "default",
                    "config": {"compile": "default", "batch_size": 64}},
        system_attrs={"constraints:failure": 1.0, "constraints:accuracy": 0.0})
    crashed = optuna.trial.create_trial(
        params={"compile": "max-autotune-no-cudagraphs", "batch_size": 128}, distributions=space,
        values=[0.0, math.inf], user_attrs={"status": "crash", "config": {"batch_size": 128}},
        system_attrs={"constraints:failure": 1.0, "constraints:accuracy": 0.0})
    # One compile past its deadline drops the mode from the walk; one crash does not drop its value yet.
    assert sampler._dropped([seen_trial(slow, space), seen_trial(crashed, space)]) == {("compile", "default")}
