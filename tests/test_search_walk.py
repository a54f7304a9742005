"""The walk follows the bottleneck, prices trials in seconds and steers away from failures (issue 17)."""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from autotune import Tuner
from autotune.insight._diagnose import Diagnosis, diagnose, next_step
from autotune.search._cost import CACHED_COMPILE_SHARE, CostModel, CostSample, compile_group, samples_from_trials
from autotune.search._sampler import GuidedSampler, seen_trial
from autotune.search._simulate import ReplayTable, TableRow, TrialClock, replay, replay_env
from autotune.study._progress import minutes_text

ROOT = Path(__file__).resolve().parents[1]
REPLAY = "autotune.search._simulate:replay_train"

SPACE = {
    "precision": CategoricalDistribution(["fp32", "bf16"]),
    "batch_size": CategoricalDistribution([64, 128, 256, 512]),
    "compile": CategoricalDistribution(["off", "default"]),
    "channels_last": CategoricalDistribution([False, True]),
    "cuda_graphs": CategoricalDistribution([False, True]),
    "num_workers": CategoricalDistribution([0, 4, 8, 16]),
    "pin_memory": CategoricalDistribution([False, True]),
}
INPUT = {"num_workers", "pin_memory"}
COMPUTE = {"precision", "compile", "channels_last", "cuda_graphs"}


def _study():
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(direction="maximize", sampler=GuidedSampler(search_space=SPACE, seed=0))


def _ask(study):
    trial = study.ask()
    return trial, {name: trial.suggest_categorical(name, d.choices) for name, d in SPACE.items()}


def _tell(study, trial, value, status="ok", **attrs):
    trial.set_user_attr("status", status)
    for key, v in attrs.items():
        trial.set_user_attr(key, v)
    trial.set_constraint("failure", 0.0 if status == "ok" else 1.0)
    study.tell(trial, value)


def _walk(label, moves=5, **attrs):
    """The knobs changed by the first ``moves`` moves after a prior point diagnosed ``label``, every move
    slower than it (so the incumbent and its diagnosis stay)."""
    study = _study()
    trial, prior = _ask(study)
    _tell(study, trial, 100.0, **({"diagnosis": label} if label else {}), **attrs)
    changed = []
    for _ in range(moves):
        trial, params = _ask(study)
        changed.append(next(k for k in params if params[k] != prior[k]))
        _tell(study, trial, 50.0, diagnosis=label or "", **attrs)
    return changed


@pytest.mark.parametrize("label, first, group", [
    ("input-bound", "num_workers", INPUT),
    ("launch-bound", "cuda_graphs", {"cuda_graphs", "compile", "batch_size"}),
    ("compute-bound", "precision", {"precision", "compile", "channels_last", "batch_size"}),
    ("compute-bound (no GPU readings)", "precision", {"precision", "compile", "channels_last", "batch_size"}),
    ("memory-capacity-bound", "batch_size", {"batch_size", "precision"}),
])
def test_the_incumbents_diagnosis_picks_the_knob_group_tried_first(label, first, group):
    changed = _walk(label, moves=4)
    assert changed[0] == first
    assert set(changed[:2]) <= group, changed
    # The knobs that cannot help wait: no loader move for a step that does not wait for input, and no
    # compute move while it does.
    waiting = COMPUTE if label == "input-bound" else INPUT
    assert not set(changed) & waiting, changed


def test_without_a_diagnosis_the_input_wait_stands_in():
    assert _walk(None, moves=1, data_wait_fraction=0.6)[0] == "num_workers"  # waits: input-bound
    assert "num_workers" not in _walk(None, moves=4, data_wait_fraction=0.0)  # no wait: the loader waits


def test_channels_last_waits_where_the_model_has_no_4d_activations():
    changed = _walk("compute-bound", moves=6, **{"extra:activations_4d": False})
    assert "channels_last" not in changed and {"precision", "compile", "batch_size"} <= set(changed)
    assert "channels_last" in _walk("compute-bound", moves=3)  # unknown: it keeps its place


LOADER_SPACE = {**SPACE, "loader": CategoricalDistribution(["torch", "device"])}


def _loader_walk(label, moves, **attrs):
    """The knobs changed by the first ``moves`` moves in a space with ``loader: [torch, device]``, from a
    prior point diagnosed ``label`` (``_walk`` with the loader knob)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=GuidedSampler(search_space=LOADER_SPACE, seed=0))

    def ask():
        trial = study.ask()
        return trial, {name: trial.suggest_categorical(name, d.choices) for name, d in LOADER_SPACE.items()}

    trial, prior = ask()
    assert prior["loader"] == "torch"  # the DataLoader runs anything: it is the prior
    _tell(study, trial, 100.0, diagnosis=label, **attrs)
    changed = []
    for _ in range(moves):
        trial, params = ask()
        changed.append(next((k, params[k]) for k in params if params[k] != prior[k]))
        _tell(study, trial, 50.0, diagnosis=label, **attrs)
    return changed


def test_an_input_bound_step_tries_the_data_on_the_device_first():
    assert _loader_walk("input-bound", moves=1, data_wait_fraction=0.6) == [("loader", "device")]
    assert ("loader", "device") in _loader_walk("input-bound", moves=3)[:1]


def test_a_value_that_refused_the_workload_is_dropped_after_one_trial():
    # loader=device refused the dataset (random augmentation): one trial says so, and the walk goes on
    # without it, though the step still waits on the loader.
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=GuidedSampler(search_space=LOADER_SPACE, seed=0))
    proposals = []
    for i in range(8):
        trial = study.ask()
        params = {name: trial.suggest_categorical(name, d.choices) for name, d in LOADER_SPACE.items()}
        proposals.append(params)
        if params["loader"] == "device":
            trial.set_user_attr("refused_value", {"knob": "loader", "value": "device"})
            _tell(study, trial, 0.0, status="error")
        else:
            _tell(study, trial, 100.0 - i, diagnosis="input-bound")
    assert [p["loader"] for p in proposals[:2]] == ["torch", "device"]
    assert all(p["loader"] == "torch" for p in proposals[2:]), proposals
    # Dropped as a value (not only as a move from that incumbent): pair moves and the random fallback skip it too.
    seen = [seen_trial(t, LOADER_SPACE) for t in study.trials]
    assert ("loader", "device") in study.sampler._dropped(seen)


def test_a_launch_bound_step_moves_the_batch_before_any_loader_knob():
    # Under batch_policy scale the batch knob is the global batch: a larger one launches fewer kernels per
    # sample. The loader knobs, even where the step also waited on input, wait for every batch move.
    changed = [knob for knob, _ in _loader_walk("launch-bound", moves=12, data_wait_fraction=0.3)]
    batch_moves = [i for i, knob in enumerate(changed) if knob == "batch_size"]
    loader_moves = [i for i, knob in enumerate(changed) if knob in {"loader", *INPUT}]
    assert len(batch_moves) == 3 and (not loader_moves or max(batch_moves) < min(loader_moves)), changed


def _undiagnosed_study(rates):
    """A study of ``SPACE`` whose trials ran the prior point changed by each ``(knob, value)`` of ``rates`` at its
    rate, with nothing recorded of their bottleneck (no diagnosis, no input wait)."""
    study = _study()
    trial, prior = _ask(study)
    _tell(study, trial, 1000.0)
    for change, rate in rates:
        study.enqueue_trial({**prior, **dict([change])})
        trial, _ = _ask(study)
        _tell(study, trial, rate)
    return study, [seen_trial(t, SPACE) for t in study.trials]


def test_without_a_diagnosis_a_step_whose_own_knobs_read_flat_is_read_as_waiting_on_its_input():
    # The batch line alone reads compute-bound (time per sample constant), as a loader's cost per sample also
    # draws it. Precision and compile then measure flat: nothing the step does moves the rate, so the input
    # pipeline's knobs go first, and the step's wait.
    flat = [(("batch_size", 512), 1001.0), (("precision", "fp32"), 992.0), (("compile", "off"), 996.0)]
    study, seen = _undiagnosed_study(flat)
    best = max((s for s in seen if s.value), key=lambda s: s.value)
    assert study.sampler._bottleneck_of(seen, best) == "input-bound"
    trial, params = _ask(study)
    assert {k for k in params if params[k] != best.params[k]} <= INPUT, params
    # A step knob that moves the rate (fp32 at half of bf16's) leaves the batch line's reading in place.
    _, seen = _undiagnosed_study([*flat[:1], (("precision", "fp32"), 500.0), flat[2]])
    best = max((s for s in seen if s.value), key=lambda s: s.value)
    assert study.sampler._bottleneck_of(seen, best) == "compute-bound"
    # One step knob measured is not enough to say.
    _, seen = _undiagnosed_study(flat[:2])
    assert study.sampler._bottleneck_of(seen, max((s for s in seen if s.value), key=lambda s: s.value)) != "input-bound"


def _host_queue_table(tmp_path):
    """An input-bound table without its diagnosis where the best needs two loader knobs moved together: 32
    workers beat 16, but their prefetch queue outgrows the host memory kept for it at batch 128 and prefetch 4
    (20% slower), so 32 workers alone read slower, and a smaller batch or prefetch alone reads flat."""
    knobs = {"precision": ["fp32", "bf16"], "compile": ["off", "default"], "channels_last": [False, True],
             "batch_size": [64, 128], "num_workers": [0, 8, 16, 32], "prefetch_factor": [2, 4],
             "pin_memory": [False, True]}
    feed = {0: 150.0, 8: 500.0, 16: 823.0, 32: 1000.0}
    rows = []
    for values in itertools.product(*knobs.values()):
        p = dict(zip(knobs, values))
        rate = feed[p["num_workers"]] * (1.0 if p["precision"] == "bf16" else 0.996)
        rate *= 1.0 if p["compile"] == "default" else 0.998
        if p["num_workers"] * p["prefetch_factor"] * p["batch_size"] > 8192:
            rate *= 0.8
        rows.append({"params": p, "status": "ok", "throughput": round(rate, 3), "accuracy_loss": 0.0})
    path = tmp_path / "host_queue.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ReplayTable.load(path)


def test_knobs_flat_alone_are_still_tried_in_pairs_where_the_best_needs_two_moved_together(tmp_path):
    table = _host_queue_table(tmp_path)
    runs = [replay(table, "guided", trials=30, seed=seed, noise=0.02) for seed in range(10)]
    # Before the step-flat reading and the flat knobs' pairs: 22 and 25 trials on the worst seeds.
    assert max(r.trials_to_95 for r in runs) <= 15, [r.trials_to_95 for r in runs]
    assert min(r.best_fraction for r in runs) >= 0.95


def test_moves_go_by_expected_gain_and_cost_only_breaks_near_ties():
    # Memory-bound at bf16 bs256 compiled: a new batch recompiles (40 s seen), fp16 reuses bf16's compile.
    space = {**SPACE, "precision": CategoricalDistribution(["fp32", "fp16", "bf16"])}
    study = optuna.create_study(direction="maximize", sampler=GuidedSampler(search_space=space, seed=0))

    def _ask(study):
        trial = study.ask()
        return trial, {name: trial.suggest_categorical(name, d.choices) for name, d in space.items()}

    trial, prior = _ask(study)
    _tell(study, trial, 100.0, diagnosis="memory-capacity-bound", wall_seconds=60.0, compile_seconds=40.0)
    trial, params = _ask(study)
    # The memory-bound group puts the batch first (gain 1) and precision second (1/2): not a near-tie, so the
    # batch goes first although it costs a fresh compile (about 60 s against 20 s); by gain per second,
    # precision would.
    assert params == {**prior, "batch_size": 512}
    _tell(study, trial, 50.0, wall_seconds=60.0, compile_seconds=40.0)
    trial, params = _ask(study)
    # Next the batch down (1/2, a fresh compile) and fp16 (1/2, bf16's compile cached) tie: the cheaper first.
    assert params == {**prior, "precision": "fp16"}


# -- the cost model -----------------------------------------------------------------------------------
def test_compile_groups_share_shapes_and_mode_across_half_precisions_and_graphs():
    a = {"precision": "bf16", "batch_size": 256, "compile": "default", "cuda_graphs": True, "num_workers": 8}
    assert compile_group(a) == compile_group({**a, "precision": "fp16", "cuda_graphs": False, "num_workers": 0})
    # Full precision traces another graph than autocast's (a tf32 compile after bf16 and fp16 missed every cache).
    assert compile_group(a) != compile_group({**a, "precision": "tf32"}) != compile_group({**a, "precision": "fp32"})
    assert compile_group(a) != compile_group({**a, "batch_size": 512})
    assert compile_group(a) != compile_group({**a, "compile": "max-autotune-no-cudagraphs"})
    assert compile_group({**a, "compile": "off"}) is None


COMPILE_S, TIME_SCALE = 40.0, 0.05  # a 40 s compile in the table, 2 s of it slept by the replay


def _cost_rows():
    # Every compiled config has shapes of its own, so each compile in the study is a fresh one, as the
    # replay sleeps it (the cached case is the next test's).
    rates = {8: 2400.0, 16: 2700.0, 32: 2900.0, 64: 3000.0}
    for batch, mode in itertools.product(rates, ["off", "default"]):
        yield {"params": {"batch_size": batch, "compile": mode}, "status": "ok",
               "throughput": rates[batch] * (1.1 if mode == "default" else 1.0),
               "compile_seconds": COMPILE_S if mode == "default" else 0.0}


COST_SPACE = """
knobs:
  batch_size: [8, 16, 32, 64]
  compile: ["off", default]
baseline: {precision: fp32, batch_size: 8}
batch_policy: scale
budget: {samples: 960, warmup_steps: 0, windows: 3}
"""


def test_the_cost_model_predicts_the_seconds_of_a_replayed_study(tmp_path, write_space, cpu_caps, monkeypatch):
    table = tmp_path / "cost.jsonl"
    table.write_text("".join(json.dumps(r) + "\n" for r in _cost_rows()))
    for key, value in replay_env(table, time_scale=TIME_SCALE).items():
        monkeypatch.setenv(key, value)
    storage = f"sqlite:///{tmp_path}/s.db"
    Tuner(REPLAY, space=write_space(COST_SPACE), n_trials=7, storage=storage, studies_dir=tmp_path / "studies",
          progress=False, plots=False, reference_repeats=1, trial_timeout=120, top_k=0, study_name="cost", prune_below=0.0,
          capabilities=cpu_caps).run()
    study = optuna.load_study(study_name="cost", storage=storage)
    trials = [t for t in study.get_trials() if t.state == TrialState.COMPLETE and "wall_seconds" in t.user_attrs]
    compiled = [t for t in trials if t.user_attrs["config"]["compile"] == "default"]
    assert compiled and all(t.user_attrs["compile_seconds"] >= COMPILE_S * TIME_SCALE for t in compiled)
    errors = []
    for k, trial in enumerate(trials):
        earlier = samples_from_trials(trials[:k])
        if not any(s.compile_seconds for s in earlier) or len(earlier) < 2:
            continue  # the model predicts from what it has seen; before a compile it has only a prior
        predicted = CostModel.fit(earlier).predict(trial.user_attrs["config"], trial.user_attrs["throughput"])
        actual = trial.user_attrs["wall_seconds"]
        errors.append((trial.number, round(predicted, 2), actual, trial.user_attrs["compile_seconds"]))
        # Tolerance: the trial process's start varies by a second on a busy 2-core host.
        assert abs(predicted - actual) <= 1.0 + 0.25 * actual, errors
    assert len(errors) >= 3, errors
    # The progress bar states the minutes spent (the trials' wall seconds) and predicted.
    spent = sum(s.seconds or 0.0 for s in samples_from_trials(study.get_trials()))
    assert minutes_text(study, 7).startswith(f"{spent / 60:.1f} min spent, ~")


def test_a_compile_seen_at_the_same_shapes_and_mode_is_predicted_cached():
    model = CostModel.fit(samples_from_trials([optuna.trial.create_trial(
        state=TrialState.COMPLETE, values=[100.0], params={},
        user_attrs={"wall_seconds": 60.0, "compile_seconds": 40.0, "samples": 1000, "throughput": 100.0,
                    "config": {"precision": "bf16", "batch_size": 256, "compile": "default"}})]))
    same = {"precision": "fp16", "batch_size": 256, "compile": "default"}
    assert model.predict(same, 100.0) == pytest.approx(20.0 + 40.0 * 0.16)  # 10 s overhead + cached + 10 s steady
    assert model.predict({**same, "batch_size": 512}, 100.0) == pytest.approx(60.0)  # fresh: the median seen
    assert model.predict({**same, "compile": "off"}, 100.0) == pytest.approx(20.0)
    # An unseen mode: its prior, scaled by how this model's "default" compile compared with its prior.
    assert model.predict({**same, "compile": "max-autotune-no-cudagraphs"}, 100.0) == pytest.approx(20.0 + 180.0)


def _compiled(number: int, batch: int, seconds: float, cache: str | None, **knobs) -> CostSample:
    params = {"precision": "bf16", "batch_size": batch, "compile": "default", "num_workers": 0, **knobs}
    return CostSample(number, params, seconds=seconds + 20.0, compile_seconds=seconds, compile_cache=cache)


def test_the_cost_model_learns_warm_against_cold_compiles_from_the_trials_records():
    # Batch 256 compiled cold (40 s), then warm from the study's cache after a loader change (4 s); batch 512
    # compiled cold once (50 s). A precision move at 512 reuses its shapes: the measured 0.1, not the prior.
    seen = [_compiled(0, 256, 40.0, "cold"), _compiled(1, 256, 4.0, "warm", num_workers=4),
            _compiled(2, 512, 50.0, "cold")]
    model = CostModel.fit(seen)
    assert model.warm_share == pytest.approx(0.1)
    at_512 = {"precision": "fp16", "batch_size": 512, "compile": "default"}
    assert model.compile_seconds(at_512) == pytest.approx(5.0)
    assert model.compile_seconds({**at_512, "batch_size": 256}) == pytest.approx(4.0)  # measured there
    assert model.compile_seconds({**at_512, "batch_size": 1024}) == pytest.approx(45.0)  # fresh: the cold median
    # Without a warm record (partial hits, or trials from before the records), the prior share stands.
    for cache in ("partial", None):
        prior = CostModel.fit([seen[0], _compiled(1, 256, 4.0, cache, num_workers=4), seen[2]])
        assert prior.warm_share == CACHED_COMPILE_SHARE
        assert prior.compile_seconds(at_512) == pytest.approx(50.0 * CACHED_COMPILE_SHARE)


def test_a_compile_recorded_warm_first_is_no_fresh_compile_and_a_cold_repeat_is_learned():
    # The cache outlived a resume: the group's first trial here compiled warm (3 s), which says nothing of
    # a fresh compile. Another group compiled cold twice (caches off for it): a repeat costs a cold compile.
    model = CostModel.fit([_compiled(0, 256, 3.0, "warm"), _compiled(1, 512, 30.0, "cold"),
                           _compiled(2, 512, 32.0, "cold", num_workers=4)])
    assert model.fresh_compile == {"default": 30.0}
    assert model.compile_seconds({"precision": "bf16", "batch_size": 256, "compile": "default"}) == pytest.approx(3.0)
    assert model.compile_seconds({"precision": "bf16", "batch_size": 512, "compile": "default"}) == pytest.approx(32.0)
    assert model.warm_share == CACHED_COMPILE_SHARE


def test_the_reference_trials_compile_is_a_cost_sample():
    """The reference run recorded as trial 0 has no wall seconds, but its cold compile prices the warm ones."""
    config = {"precision": "fp32", "batch_size": 64, "compile": "default", "num_workers": 0}
    reference = optuna.trial.create_trial(state=TrialState.COMPLETE, values=[100.0], params={}, user_attrs={
        "role": "reference", "compile_seconds": 20.0, "extra:compile_cache": "cold", "config": config})
    warm = optuna.trial.create_trial(state=TrialState.COMPLETE, values=[100.0], params={}, user_attrs={
        "wall_seconds": 9.0, "compile_seconds": 2.0, "extra:compile_cache": "warm",
        "config": {**config, "num_workers": 1}})
    warm.number = 1
    samples = samples_from_trials([reference, warm])
    assert [(s.seconds, s.compile_cache) for s in samples] == [(None, "cold"), (9.0, "warm")]
    assert CostModel.fit(samples).warm_share == pytest.approx(0.1)


# -- replay knows cost -----------------------------------------------------------------------------
def test_replay_charges_a_cached_compile_at_shapes_already_compiled():
    row = TableRow({"precision": "bf16", "batch_size": 256, "compile": "default"}, "ok", 100.0,
                   trial_seconds=60.0, compile_seconds=40.0)
    clock = TrialClock(ReplayTable([row]))
    assert clock.charge(row.params, row) == (60.0, 40.0)
    seconds, compile_s = clock.charge({**row.params, "precision": "fp16"}, row)
    assert compile_s == pytest.approx(40.0 * 0.16) and seconds == pytest.approx(20.0 + 40.0 * 0.16)


def _seconds_table(path: Path, *, seconds: bool) -> Path:
    rows = []
    for precision, batch in itertools.product(["fp32", "bf16"], [64, 128, 256, 512]):
        rate = (3.0 if precision == "bf16" else 1.0) * batch
        row = {"params": {"precision": precision, "batch_size": batch}, "status": "ok", "throughput": rate}
        if seconds:
            row["trial_seconds"] = 30.0 + batch / 16
        rows.append(row)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_simulate_reports_minutes_to_95_next_to_trials(tmp_path):
    table = _seconds_table(tmp_path / "t.jsonl", seconds=True)
    out = subprocess.run([sys.executable, "-m", "autotune", "simulate", str(table), "--trials", "6", "--seeds", "2",
                          "--strategies", "guided,random", "--json"], capture_output=True, text=True, cwd=ROOT,
                         check=True)
    doc = json.loads(out.stdout)
    assert doc["seconds"] == "recorded"
    for result in doc["results"]:
        assert {"minutes_to_95_median", "minutes_to_95_worst", "minutes_to_95"} <= set(result)
        assert result["minutes_to_95_worst"] >= result["minutes_to_95_median"] > 0
    loaded = ReplayTable.load(table)
    for seed in range(2):
        run = replay(loaded, "random", trials=6, seed=seed)
        reached = run.trials_to_95
        expected = sum(run.seconds[:reached]) if reached <= 6 else sum(run.seconds) + statistics.median(run.seconds)
        assert run.minutes_to_95 == pytest.approx(expected / 60)
        assert doc["results"][1]["minutes_to_95"][seed] == pytest.approx(round(expected / 60, 2))
    # guided starts at bf16 bs256 (the upper median), not within 95% of bf16 bs512; it moves up next.
    guided = replay(loaded, "guided", trials=6, seed=0)
    assert guided.trials_to_95 == 2 and guided.minutes_to_95 == pytest.approx((46.0 + 62.0) / 60)


def test_simulate_without_seconds_still_works_and_says_so(tmp_path):
    table = _seconds_table(tmp_path / "t.jsonl", seconds=False)
    out = subprocess.run([sys.executable, "-m", "autotune", "simulate", str(table), "--trials", "4", "--seeds", "1",
                          "--strategies", "guided", "--json"], capture_output=True, text=True, cwd=ROOT, check=True)
    doc = json.loads(out.stdout)
    assert doc["seconds"].startswith("none") and doc["results"][0]["minutes_to_95_median"] is None
    assert doc["results"][0]["trials_to_95_median"] == 2


# -- failures steer the walk ------------------------------------------------------------------------
FAULT_SPACE = """
knobs:
  precision: [fp32, bf16]
  batch_size: [64, 128, 256]
  channels_last: [false, true]
  num_workers: [0, 2]
baseline: {precision: fp32, batch_size: 64}
batch_policy: scale
budget: {samples: 1536, warmup_steps: 0, windows: 3}
"""


def test_a_fault_tied_to_a_prior_value_costs_at_most_two_trials(tmp_path, write_space, cpu_caps, monkeypatch):
    # channels_last=True, the prior's value, always fails (as the abort of issue 17 did).
    rows = []
    for precision, batch, layout, workers in itertools.product(["fp32", "bf16"], [64, 128, 256], [False, True], [0, 2]):
        params = {"precision": precision, "batch_size": batch, "channels_last": layout, "num_workers": workers}
        if layout:
            rows.append({"params": params, "status": "error", "throughput": None})
        else:
            rate = batch * (2.0 if precision == "bf16" else 1.0) * (1.2 if workers else 1.0)
            rows.append({"params": params, "status": "ok", "throughput": rate})
    table = tmp_path / "faults.jsonl"
    table.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for key, value in replay_env(table).items():
        monkeypatch.setenv(key, value)
    storage = f"sqlite:///{tmp_path}/s.db"
    result = Tuner(REPLAY, space=write_space(FAULT_SPACE), n_trials=8, storage=storage,
                   studies_dir=tmp_path / "studies", progress=False, plots=False, reference_repeats=1, trial_timeout=120,
                   top_k=0, study_name="faults", prune_below=0.0, capabilities=cpu_caps).run()
    study = optuna.load_study(study_name="faults", storage=storage)
    runs = [t for t in study.get_trials() if t.state == TrialState.COMPLETE and t.user_attrs.get("role") != "reference"]
    lost = [t for t in runs if t.user_attrs.get("status") != "ok"]
    assert runs[0].params["channels_last"] is True  # the walk started at the prior, which fails
    assert len(lost) <= 2, [(t.number, t.params, t.user_attrs.get("status")) for t in runs]
    assert all(t.params["channels_last"] for t in lost)
    assert len(runs) >= 7 and result.best.config.channels_last is False  # the reference is the 8th


def test_a_value_that_failed_twice_and_never_ran_is_not_proposed_again():
    # num_workers=16 crashes wherever it runs (a bus error, say); the walk moves the workers about, so the
    # measured pair alone would not keep it away at every new incumbent.
    study = _study()
    for _ in range(24):
        trial, params = _ask(study)
        fails = params["num_workers"] == 16
        rate = 100.0 + params["num_workers"] + (10.0 if params["precision"] == "bf16" else 0.0)
        _tell(study, trial, 0.0 if fails else rate, status="error" if fails else "ok", data_wait_fraction=0.5)
    bad = [t for t in study.trials if t.params.get("num_workers") == 16]
    assert 1 <= len(bad) <= 2


def test_a_value_that_crashed_once_is_tried_again_from_another_incumbent_after_its_single_moves():
    # Batch 512 crashes once, at the prior point (chance: a worker killed, say), then runs. A crash does not
    # condemn the value at every incumbent as a measured slowdown does: from the next incumbent it waits with
    # the deferred values and runs once the single moves are done, before any two-knob move.
    study = _study()
    crashed = False
    proposals = []
    for _ in range(16):
        trial, params = _ask(study)
        proposals.append(params)
        if params["batch_size"] == 512 and not crashed:
            crashed = True
            _tell(study, trial, 0.0, status="error", data_wait_fraction=0.0)
            continue
        rate = 100.0 + (20.0 if params["precision"] == "fp32" else 0.0) + {64: -10.0, 128: -5.0, 256: 0.0, 512: 30.0}[params["batch_size"]]
        _tell(study, trial, rate - sum(params[k] != proposals[0][k] for k in ("compile", "channels_last", "cuda_graphs")),
              data_wait_fraction=0.0)
    assert crashed and proposals[0]["batch_size"] == 256
    again = [i for i, p in enumerate(proposals) if p["batch_size"] == 512 and p["precision"] == "fp32"]
    assert again, proposals
    incumbent = next(i for i, p in enumerate(proposals) if p == {**proposals[0], "precision": "fp32"})
    # From the fp32 incumbent: single moves only, then the crashed value again, before any two-knob move.
    assert all(sum(p[k] != proposals[incumbent][k] for k in p) == 1 for p in proposals[incumbent + 1:again[0] + 1])
    best = max((t for t in study.trials if t.values and t.user_attrs["status"] == "ok"), key=lambda t: t.values[0])
    assert best.params["batch_size"] == 512 and best.params["precision"] == "fp32"


def test_a_value_that_keeps_crashing_at_a_combination_is_retried_once_not_at_every_incumbent():
    # Batch 512 crashes wherever channels_last is on, and runs without it, so it is never dropped as a value that
    # never ran. A crash waits, once; the second makes it worse like a slow value, and the walk stops meeting it.
    def rate(p):
        return (100.0 + (20.0 if p["precision"] == "fp32" else 0.0) + (10.0 if p["compile"] == "off" else 0.0)
                + (6.0 if p["pin_memory"] is False else 0.0) + (4.0 if p["num_workers"] == 16 else 0.0)
                + {64: -20.0, 128: -10.0, 256: 0.0, 512: -10.0}[p["batch_size"]] - (0.0 if p["channels_last"] else 30.0))

    study = _study()
    trial, prior = _ask(study)
    _tell(study, trial, rate(prior), data_wait_fraction=0.0)
    study.enqueue_trial({**prior, "channels_last": False, "batch_size": 512})  # the value runs here
    crashes = 0
    for _ in range(30):
        trial, params = _ask(study)
        if params["batch_size"] == 512 and params["channels_last"]:
            crashes += 1
            _tell(study, trial, 0.0, status="error", data_wait_fraction=0.0)
        else:
            _tell(study, trial, rate(params), data_wait_fraction=0.0)
    assert crashes == 2  # 4 when each new incumbent retried it; 1 when one crash condemned it everywhere


# -- hints follow the same rules --------------------------------------------------------------------
def _compute_bound(**extra):
    m = {"status": "ok", "throughput": 900.0, "data_wait_fraction": 0.0, "extra:gpu.gpu_util_pct.mean": 99.0,
         "config": {"precision": "bf16", "batch_size": 16, "compile": "default"}, **extra}
    return diagnose(m, [m])


def test_hints_never_suggest_channels_last_without_4d_activations():
    lm = _compute_bound(**{"extra:activations_4d": False})
    hint = next_step(lm, {"precision": "fp32", "compile": "off", "channels_last": False})
    assert "channels_last" not in hint
    assert "bf16" in hint and "torch.compile" in hint and "fused optimizer" in hint
    unknown = _compute_bound()
    assert "channels_last" in next_step(unknown, {"precision": "fp32", "compile": "off", "channels_last": False})
    cnn = _compute_bound(**{"extra:activations_4d": True})
    assert "channels_last" in next_step(cnn, {"precision": "bf16", "compile": "default", "channels_last": False})


def test_hints_for_input_and_memory_bounds_name_the_knobs_the_walk_tries():
    wait = Diagnosis("input-bound", "waited", {"data_wait_fraction": 0.9}, True)
    hint = next_step(wait, {"num_workers": 4, "pin_memory": True, "persistent_workers": False})
    for text in ("loader: device to keep a small dataset", "more DataLoader workers", "prefetch_factor",
                 "persistent_workers", "DALI"):
        assert text in hint
    assert hint.index("loader: device") < hint.index("more DataLoader workers")  # the biggest lever first
    assert "loader: device" not in next_step(wait, {"loader": "device"})
    memory = Diagnosis("memory-capacity-bound", "oom", {}, True)
    assert "micro-batch with gradient accumulation" in next_step(memory, {"precision": "bf16"})


def test_values_that_won_on_separate_lines_are_tried_together_first():
    # Rule 10: workers 16 won at the prior, pageable memory and batch 512 each won on a line of their own;
    # the additive model of log-throughput switches both at the incumbent in one move, before single moves.
    from autotune.search._sampler import _Seen

    sampler = GuidedSampler(search_space=SPACE, seed=0)
    prior = {**sampler.prior_point(), "num_workers": 8}
    runs = [({}, 100.0), ({"num_workers": 16}, 110.0), ({"pin_memory": False}, 108.0), ({"batch_size": 512}, 106.0)]
    seen = [_Seen(number=i, params={**prior, **change}, value=value, feasible=True, oom=False, reference=False)
            for i, (change, value) in enumerate(runs)]
    assert sampler.propose(seen) == {**prior, "num_workers": 16, "pin_memory": False, "batch_size": 512}
    # Within the margin of the noise (1% apart) there is nothing to combine: the walk moves one knob.
    flat = [_Seen(number=i, params={**prior, **change}, value=100.0 + i * 0.3, feasible=True, oom=False,
                  reference=False) for i, (change, _) in enumerate(runs)]
    nxt = sampler.propose(flat)
    assert sum(nxt[k] != flat[-1].params[k] for k in nxt) == 1


def test_a_prior_point_that_misses_the_accuracy_bound_moves_to_more_precise_values_first():
    """Under ``fixed`` (global batch 128), the prior point (bf16) ran fast but missed the accuracy bound, and
    nothing but the fp32 reference passed: the walk's next moves keep the prior's other knobs and try the more
    precise values (fp16, then tf32), never fp8, which keeps less of fp32's arithmetic than a precision that
    already missed (rule 11). Before, the walk moved the batch first and tried fp8 among the precisions, as
    the H200 ConvNeXt-T study did (bf16 at micro-batch 128, then fp8)."""
    space = {"precision": CategoricalDistribution(["fp32", "tf32", "fp16", "bf16", "fp8"]),
             "batch_size": CategoricalDistribution([64, 128]),
             "compile": CategoricalDistribution(["off", "default"]),
             "num_workers": CategoricalDistribution([0, 8])}
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize",
                                sampler=GuidedSampler(search_space=space, seed=0, whole_batch=128))
    study.add_trial(optuna.trial.create_trial(
        params={"precision": "fp32", "batch_size": 64, "compile": "off", "num_workers": 0}, distributions=space,
        value=100.0, user_attrs={"status": "ok", "role": "reference"}, system_attrs={"constraints:failure": 0.0}))
    precisions = []
    for _ in range(4):
        trial = study.ask()
        params = {name: trial.suggest_categorical(name, d.choices) for name, d in space.items()}
        precisions.append(params["precision"])
        missed = params["precision"] in ("bf16", "fp16")  # tf32 and fp32 pass
        trial.set_user_attr("status", "ok")
        trial.set_constraint("failure", 1.0 if missed else 0.0)
        study.tell(trial, {"fp8": 700.0, "bf16": 600.0, "fp16": 590.0, "tf32": 400.0}.get(params["precision"], 150.0))
        if precisions[0] != "bf16":
            break
    assert precisions[:3] == ["bf16", "fp16", "tf32"], precisions
    first = study.trials[1].params
    assert all({k: v for k, v in t.params.items() if k != "precision"} == {k: v for k, v in first.items() if k != "precision"}
               for t in study.trials[1:4]), [t.params for t in study.trials]
    assert "fp8" not in precisions[:3]


def test_an_input_bound_plateau_tries_the_loader_knobs_in_pairs_before_the_other_single_moves():
    # Without a diagnosis the step's knobs read flat (input-bound), and every loader knob alone read no faster:
    # nothing has lifted the rate since the first trial. The loader's knobs share the host, so their pairs
    # come next, before the batch's single moves (before: a noise-level combined move, then the batch ladder).
    flat = [(("batch_size", 512), 999.0), (("precision", "fp32"), 992.0), (("compile", "off"), 996.0),
            (("num_workers", 16), 990.0), (("num_workers", 4), 985.0), (("num_workers", 0), 150.0),
            (("pin_memory", False), 995.0)]
    study, seen = _undiagnosed_study(flat)
    best = max((s for s in seen if s.value), key=lambda s: s.value)
    assert study.sampler._bottleneck_of(seen, best) == "input-bound"
    for _ in range(2):
        trial, params = _ask(study)
        changed = {k for k in params if params[k] != best.params[k]}
        assert len(changed) == 2 and changed <= INPUT, params
        _tell(study, trial, 990.0)


def test_the_combined_move_reads_no_effect_off_trials_far_slower_than_the_fastest():
    # Rule 10: the zero- and four-worker trials, many times slower, ran with pinning off; in the fit their residual
    # leaked into pinning off, and pinning on, measured slower beside the incumbent, read the winner. They ran in
    # another regime (the step waiting for its input) and are left out of the fit: nothing to combine.
    from autotune.search._sampler import _Seen

    sampler = GuidedSampler(search_space=SPACE, seed=0)
    prior = sampler.prior_point()
    runs = [({}, 100.0), ({"pin_memory": False}, 101.0), ({"batch_size": 512}, 100.5),
            ({"pin_memory": False, "num_workers": 0}, 5.0), ({"pin_memory": False, "num_workers": 4}, 15.0)]
    seen = [_Seen(number=i, params={**prior, **change}, value=value, feasible=True, oom=False, reference=False)
            for i, (change, value) in enumerate(runs)]
    assert sampler._combined(seen, seen[1].params, set(), set()) == []


def test_a_flat_knobs_value_that_never_ran_is_a_single_move_before_the_pairs():
    # The batch read flat on two lines (256 and 512, within 1%), so its measured values wait; batch 128, on the
    # other side of the incumbent, never ran and has shown nothing: it is the next single move, not a pair's half.
    from autotune.search._sampler import _Seen

    space = {"precision": CategoricalDistribution(["fp32", "bf16"]),
             "batch_size": CategoricalDistribution([64, 128, 256, 512]),
             "compile": CategoricalDistribution(["off", "default"]),
             "channels_last": CategoricalDistribution([False, True])}
    sampler = GuidedSampler(search_space=space, seed=0)
    prior = sampler.prior_point()
    runs = [({}, 100.4), ({"batch_size": 512}, 100.0), ({"precision": "fp32"}, 99.6), ({"compile": "off"}, 99.8),
            ({"channels_last": False}, 99.7), ({"channels_last": False, "batch_size": 512}, 99.9)]
    seen = [_Seen(number=i, params={**prior, **change}, value=value, feasible=True, oom=False, reference=False)
            for i, (change, value) in enumerate(runs)]
    assert "batch_size" in sampler._barely_matters(seen)
    assert sampler.propose(seen) == {**prior, "batch_size": 128}
