"""Loader and step probes in real studies: each side measured apart, a prediction, and a full trial to confirm.

The workload's Dataset does per-sample Python work, so the tiny model waits on its input: the loop probes
the loader variants of the incumbent alone and its step alone, and enqueues the variant they predict fastest.
"""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
import yaml

from autotune import Tuner
from autotune._config import TrialConfig
from autotune.study._isolation import run_isolated
from autotune.search._predict import SLOW_VARIANT_SHARE
from autotune.search._predict import MAX_LOADER_PROBES, loader_moves
from autotune.study._probes import PREDICTED, PROBES, loader_variants, predict
from autotune.search._space import parse_space
from autotune.trial._execute import TrialSpec
from autotune._config import Budget

optuna.logging.set_verbosity(optuna.logging.WARNING)

WORKLOADS = Path(__file__).parent / "workloads.py"
SPACE = """\
knobs:
  num_workers: [0, 1, 2]
  cpu_threads: [1]
baseline: {batch_size: 32, num_workers: 0, cpu_threads: 1}
budget: {samples: 2048, warmup_steps: 2, windows: 3}
"""


def _spec(probe, target="train_input_bound", variants=(), **config) -> TrialSpec:
    return TrialSpec(target=f"{WORKLOADS}:{target}", config=TrialConfig(batch_size=32, cpu_threads=1, **config),
                     budget=Budget(samples=2048, warmup_steps=2, windows=3), probe=probe,
                     loader_variants=tuple(TrialConfig(batch_size=32, cpu_threads=1, **v) for v in variants))


def test_a_loader_probe_never_steps_the_model_and_a_step_probe_never_waits_on_the_loader(tmp_path):
    loader = run_isolated(_spec("loader"), workdir=tmp_path / "loader", timeout=120)
    assert loader.ok, loader.error
    m = loader.measurement
    assert m.extras["probe"] == "loader" and "forward_calls" not in m.extras and m.steps == 0
    assert m.throughput > 0 and len(m.window_throughputs) == 3 and m.data_wait_fraction > 0.9

    step = run_isolated(_spec("step"), workdir=tmp_path / "step", timeout=120)
    assert step.ok, step.error
    s = step.measurement
    assert s.extras["probe"] == "step" and s.extras["probe_batches"] == 4
    assert s.steps == 2048 // 32 and s.extras["forward_calls"] == s.steps + 1  # every step, then the evaluation
    assert s.data_wait_fraction < 0.1 < m.data_wait_fraction
    assert s.throughput > 2 * m.throughput  # the step outruns the loader: the workload is input-bound

    full = run_isolated(_spec(None), workdir=tmp_path / "full", timeout=120)
    assert full.ok and full.measurement.data_wait_fraction > 0.5
    # The full trial runs at about the slower side's pace.
    assert predict(m.throughput, s.throughput) == pytest.approx(full.measurement.throughput, rel=0.5)


def test_one_loader_probe_process_measures_every_variant_on_the_same_dataset(tmp_path):
    variants = ({"num_workers": 2}, {"loader": "device"})
    outcome = run_isolated(_spec("loader", variants=variants), workdir=tmp_path / "batched", timeout=120)
    assert outcome.ok, outcome.error
    m = outcome.measurement
    assert m.extras["probe"] == "loader" and "forward_calls" not in m.extras and m.steps == 0
    rates = m.extras["loader_rates"]
    assert m.extras["loader_errors"] == [None, None] and len(rates) == 2
    # Served from memory, the slow items are read once: the device variant outruns the per-sample reads.
    assert rates[1] > 3 * m.throughput and all(r > 0 for r in rates)
    assert m.extras["loader_windows"] == [3, 3] and len(m.window_throughputs) == 3
    alone = run_isolated(_spec("loader", num_workers=2), workdir=tmp_path / "alone", timeout=120)
    assert alone.ok and rates[0] == pytest.approx(alone.measurement.throughput, rel=0.5)  # as if it ran alone


def test_a_variant_far_slower_than_one_measured_before_it_stops_after_its_first_window(tmp_path):
    outcome = run_isolated(_spec("loader", variants=({"num_workers": 0},), loader="device"), workdir=tmp_path,
                           timeout=120)
    assert outcome.ok, outcome.error
    m = outcome.measurement
    assert len(m.window_throughputs) == 3  # the process's own config is measured in full
    assert m.extras["loader_windows"] == [1] and m.extras["loader_rates"][0] < SLOW_VARIANT_SHARE * m.throughput


def test_a_variant_that_cannot_be_built_is_reported_and_the_others_are_measured(tmp_path):
    variants = ({"loader": "device"}, {"num_workers": 1})
    outcome = run_isolated(_spec("loader", target="train_augmented", variants=variants), workdir=tmp_path, timeout=120)
    assert outcome.ok, outcome.error
    rates, errors = outcome.measurement.extras["loader_rates"], outcome.measurement.extras["loader_errors"]
    assert rates[0] is None and "loader=device" in errors[0] and "random" in errors[0]
    assert rates[1] > 0 and errors[1] is None


def test_a_loader_probe_of_a_train_fn_without_ctx_loader_is_an_error(tmp_path):
    spec = TrialSpec(target=f"{WORKLOADS}:no_window", config=TrialConfig(batch_size=32), budget=Budget(samples=256),
                     probe="loader")
    outcome = run_isolated(spec, workdir=tmp_path, timeout=60)
    assert outcome.status == "error" and "needs train_fn to build its loader with ctx.loader" in outcome.error


def test_an_input_bound_study_probes_the_loader_apart_and_confirms_the_prediction(tmp_path, cpu_caps):
    (tmp_path / "space.yaml").write_text(SPACE)
    result = Tuner(f"{WORKLOADS}:train_input_bound", space=tmp_path / "space.yaml", n_trials=4,
                   storage=f"sqlite:///{tmp_path}/s.db", studies_dir=tmp_path / "studies", progress=False,
                   plots=False, capabilities=cpu_caps, reference_repeats=1, top_k=0, prune_below=None,
                   study_name="p").run()
    study = optuna.load_study(study_name="p", storage=f"sqlite:///{tmp_path}/s.db")
    probes = study.user_attrs[PROBES]
    kinds = sorted(p["kind"] for p in probes)
    assert kinds.count("step") >= 1 and kinds.count("loader") >= 1  # a step probe per input-bound incumbent
    for probe in probes:
        assert probe["status"] == "ok" and probe["rate"] > 0
        if probe["kind"] == "loader":
            assert "forward_calls" not in probe["extras"] and probe["steps"] == 0
    # Every loader variant of an incumbent in one process: its record says how many it shared it with.
    loaders = [p for p in probes if p["kind"] == "loader"]
    assert loaders[0]["batched"] == len(loader_variants(parse_space(yaml.safe_load(SPACE)), TrialConfig(
        batch_size=32, num_workers=0, cpu_threads=1)))
    predicted = [t for t in study.trials if t.user_attrs.get(PREDICTED)]
    assert predicted, [t.user_attrs.get("config") for t in study.trials]
    trial = predicted[0]
    assert trial.user_attrs["status"] == "ok" and TrialConfig.from_dict(trial.user_attrs["config"]).num_workers > 0
    error = trial.user_attrs["prediction_error"]
    assert error == pytest.approx(trial.user_attrs["throughput"] / trial.user_attrs[PREDICTED] - 1, abs=1e-3)
    assert result.best.config.num_workers > 0  # the workers the probes found beat the baseline's none
    from autotune.insight._report import summary_lines

    assert f"predicted full trials #{trial.number} {error:+.0%}" in "\n".join(summary_lines(study, {}))
    split = study.user_attrs["time_split"]
    assert split["parts"]["probes"] > 0 and abs(sum(split["parts"].values()) - split["wall"]) <= 0.05 * split["wall"]


def test_loader_variants_move_one_loader_knob_each_then_two_at_their_nearest_values():
    space = parse_space({"knobs": {"num_workers": [0, 2, 4], "pin_memory": [False, True], "precision": ["fp32", "bf16"]},
                         "baseline": {"batch_size": 32}})
    base = space.baseline
    assert (base.num_workers, base.pin_memory) == (0, False)
    variants = loader_variants(space, base)
    # Every single move first; then the pair, with the workers only at their nearest value (2, not 4).
    assert [(v.num_workers, v.pin_memory) for v in variants] == [(2, False), (4, False), (0, True), (2, True)]
    assert all(v.precision == base.precision for v in variants)


def test_loader_moves_pair_knobs_of_one_backend_and_stop_at_the_cap():
    values = {"loader": ["torch", "device"], "num_workers": [0, 4, 8, 12, 16], "prefetch_factor": [2, 4],
              "pin_memory": [False, True], "precision": ["fp32", "bf16"]}
    current = {"loader": "torch", "num_workers": 8, "prefetch_factor": 4, "pin_memory": True, "precision": "bf16"}
    moves = list(loader_moves(values, current))
    singles = [m for m in moves if len(m) == 1]
    assert moves[:len(singles)] == singles and len(singles) == 1 + 4 + 1 + 1  # every other value, one knob each
    pairs = [m for m in moves if len(m) == 2]
    assert len(moves) == len(singles) + len(pairs)
    assert all("loader" not in m and "precision" not in m for m in pairs)
    assert {m["num_workers"] for m in pairs if "num_workers" in m} == {4, 12}  # the nearest values only
    assert {"num_workers": 12, "prefetch_factor": 2} in pairs
    many = {"num_workers": list(range(0, 17, 2)), "prefetch_factor": [2, 4], "pin_memory": [False, True]}
    space = parse_space({"knobs": many, "baseline": {"batch_size": 32}})
    assert len(list(loader_moves(many, {**space.baseline.to_dict(), "num_workers": 8}))) > MAX_LOADER_PROBES
    assert len(loader_variants(space, space.baseline.replace(num_workers=8))) == MAX_LOADER_PROBES
    # Without workers, prefetch and persistence change nothing a trial runs: no variant moves only them there.
    idle = [v for v in loader_variants(space, space.baseline.replace(num_workers=0)) if v.num_workers == 0]
    assert [(v.pin_memory, v.prefetch_factor, v.persistent_workers) for v in idle] == [
        (not space.baseline.pin_memory, space.baseline.prefetch_factor, space.baseline.persistent_workers)]


SCALE_SPACE = """\
knobs:
  batch_size: [16, 32, 64, 128, 256]
  num_workers: [0, 1]
  cpu_threads: [1]
batch_policy: scale
baseline: {batch_size: 32, num_workers: 0, cpu_threads: 1}
budget: {samples: 2048, warmup_steps: 1, windows: 3}
"""


def test_under_scale_the_loader_probe_measures_larger_batches_and_the_walk_moves_the_batch(tmp_path, cpu_caps):
    # The loader's cost is per batch (a collate that waits), so its rate grows with the batch.
    (tmp_path / "space.yaml").write_text(SCALE_SPACE)
    storage = f"sqlite:///{tmp_path}/s.db"
    Tuner(f"{WORKLOADS}:train_batch_cost", space=tmp_path / "space.yaml", n_trials=4, storage=storage,
          studies_dir=tmp_path / "studies", progress=False, plots=False, capabilities=cpu_caps, reference_repeats=1,
          top_k=0, prune_below=None, study_name="scale").run()
    study = optuna.load_study(study_name="scale", storage=storage)
    # The planner runs the prior point first; the probes then start from the incumbent, whichever it is.
    probes = study.user_attrs[PROBES]
    incumbent = next(p["config"] for p in probes if p["kind"] == "step")
    loaders = {p["config"]["batch_size"]: p["rate"] for p in probes
               if p["kind"] == "loader" and p["config"]["num_workers"] == incumbent["num_workers"]}
    larger = {b for b in (16, 32, 64, 128, 256) if b > incumbent["batch_size"]}
    assert larger and larger <= set(loaders)  # each larger batch than the incumbent's, in one probe process
    assert loaders[256] > loaders[min(larger)]  # the loader's rate grows with the batch
    steps = {p["config"]["batch_size"] for p in probes if p["kind"] == "step"}
    assert steps == {incumbent["batch_size"], 256}  # the incumbent's batch, and the batch whose loader is fastest
    full = [t for t in study.trials if t.user_attrs.get("role") != "reference"][:4]
    assert max(t.params["batch_size"] for t in full) == 256, [t.params for t in full]
    assert any(t.params["batch_size"] == 256 and t.user_attrs.get(PREDICTED) for t in full)


def test_a_device_loader_too_slow_to_fill_loses_none_of_the_dataloaders_probe_rates(tmp_path):
    """``loader: device`` first fills device memory with the whole dataset (65,536 items of 10 ms: over 40 s
    even with 16 workers); with a 25 s limit on each probe process it cannot finish. The DataLoader's variants
    run in a process of their own, after it, so their rates are kept; the device variant's says it timed out."""
    from autotune.study._budget import StudyClock
    from autotune.study._probes import LoaderProbes
    from autotune.study._progress import _Progress
    from autotune.study._runner import TrialRunner

    space = parse_space(yaml.safe_load(SPACE.replace("num_workers: [0, 1, 2]", "num_workers: [0, 4, 8]\n  loader: [torch, device]")))
    baseline = TrialConfig(batch_size=32, cpu_threads=1)
    runner = TrialRunner(target=f"{WORKLOADS}:train_slow_items", logdir=tmp_path, baseline=baseline,
                         budget=Budget(samples=2048, warmup_steps=2, windows=3), timeout=25)
    study = optuna.create_study(directions=["maximize", "minimize"])
    probes = LoaderProbes(study=study, space=space, runner=runner, clock=StudyClock(), seed=0)
    configs = [baseline.replace(loader="device"), baseline.replace(num_workers=4), baseline.replace(num_workers=8)]
    with _Progress(False, 1) as ui:
        rates = probes._loaders(configs, ui, keep=0.0)
    records = {TrialConfig.from_dict(p["config"]).describe(): p for p in study.user_attrs[PROBES]}
    assert rates[1] and rates[2] and rates[2] > rates[1], records  # eight workers fetch faster than four
    device = records[configs[0].describe()]
    assert rates[0] is None and device["status"] == "timeout" and device["batched"] == 1, device


def test_a_device_loader_that_outruns_the_step_spares_the_dataloaders_probes(tmp_path):
    """The device-resident loader is probed first: where it feeds at least the step's rate (``enough``), no
    DataLoader variant could be predicted faster, so none is probed; where it feeds less, they are."""
    from autotune.study._budget import StudyClock
    from autotune.study._probes import LoaderProbes
    from autotune.study._progress import _Progress
    from autotune.study._runner import TrialRunner

    space = parse_space(yaml.safe_load(SPACE.replace("cpu_threads: [1]", "cpu_threads: [1]\n  loader: [torch, device]")))
    baseline = TrialConfig(batch_size=32, cpu_threads=1)
    configs = [baseline.replace(loader="device"), baseline.replace(num_workers=1), baseline.replace(num_workers=2)]

    def probed(enough: float) -> tuple[list, list]:
        runner = TrialRunner(target=f"{WORKLOADS}:train_input_bound", logdir=tmp_path / str(enough), baseline=baseline,
                             budget=Budget(samples=2048, warmup_steps=2, windows=3), timeout=120)
        study = optuna.create_study(directions=["maximize", "minimize"])
        probes = LoaderProbes(study=study, space=space, runner=runner, clock=StudyClock(), seed=0)
        with _Progress(False, 1) as ui:
            rates = probes._loaders(configs, ui, keep=0.0, enough=enough)
        return rates, [TrialConfig.from_dict(p["config"]).loader for p in study.user_attrs[PROBES]]

    rates, loaders = probed(1.0)
    assert rates[0] and rates[1] is None and rates[2] is None and loaders == ["device"], (rates, loaders)
    rates, loaders = probed(1e12)  # a step no loader keeps up with: every variant is probed, the device's first
    assert all(rates) and loaders == ["device", "torch", "torch"], (rates, loaders)


def test_the_device_resident_loader_runs_as_the_next_full_trial_without_a_probe_and_then_the_dataloaders(
        tmp_path, cpu_caps):
    """An input-bound reference whose space offers ``loader: device``: that variant's full trial is queued next
    with no probe process (its rate would only say it runs), bounded by the reference's step ceiling, which
    the correction of later predictions does not read. Where that trial is refused (the augmented dataset
    differs between fetches; the reference's workers left the question open), the DataLoader's variants are
    probed next, as before."""
    from autotune.study._probes import CEILING_BASIS, PREDICTED_BASIS, correction

    space = SPACE.replace("cpu_threads: [1]", "cpu_threads: [1]\n  loader: [torch, device]")
    (tmp_path / "space.yaml").write_text(space)

    def study_of(target: str, name: str, n_trials: int, workers: int = 0) -> optuna.Study:
        (tmp_path / f"{name}.yaml").write_text(space.replace("num_workers: 0,", f"num_workers: {workers},"))
        Tuner(f"{WORKLOADS}:{target}", space=tmp_path / f"{name}.yaml", n_trials=n_trials,
              storage=f"sqlite:///{tmp_path}/s.db", studies_dir=tmp_path / "studies", progress=False, plots=False,
              capabilities=cpu_caps, reference_repeats=1, top_k=0, prune_below=None, study_name=name).run()
        return optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path}/s.db")

    study = study_of("train_input_bound", "direct", 2)
    trials = study.trials
    assert trials[0].user_attrs["data_wait_fraction"] >= 0.5 and trials[1].params["loader"] == "device"
    attrs = trials[1].user_attrs
    assert attrs["status"] == "ok" and attrs[PREDICTED_BASIS] == CEILING_BASIS
    ceiling = trials[0].user_attrs["throughput"] / (1 - trials[0].user_attrs["data_wait_fraction"])
    assert attrs[PREDICTED] == pytest.approx(ceiling, rel=1e-3)
    assert correction(study) == 1.0  # the bound is no prediction to correct others by
    probes = study.user_attrs[PROBES]
    assert [(p["kind"], p["status"]) for p in probes] == [("loader", "as_trial")]  # no probe process ran
    assert "the device-resident loader as a full trial, not probed" in study.user_attrs["time_split"]["probes_why"]
    probe = next(d for d in study.user_attrs["plan"] if d["action"] == "probe")
    assert "offers the device-resident loader: that variant runs as the next full trial" in probe["reason"]
    assert attrs["throughput"] > 2 * trials[0].user_attrs["throughput"]

    study = study_of("train_augmented", "refused", 3, workers=1)
    trials = study.trials
    assert trials[1].params["loader"] == "device" and trials[1].user_attrs["status"] == "error"
    measured = [p for p in study.user_attrs[PROBES] if p["status"] == "ok"]
    assert measured and all(p["config"]["loader"] == "torch" for p in measured), study.user_attrs[PROBES]


def test_a_loader_variant_whose_probe_timed_out_is_not_predicted():
    """Without its loader's rate, a variant would be predicted at the step's rate alone: the H100 ViT-B/32 study
    (``answer-first-h200.md``) had every DataLoader variant's probe time out, each then promised 7,712 img/s."""
    from autotune.search._predict import best_predicted

    assert best_predicted([(None, "timed out"), (900.0, "measured")], 1000.0, 1.0, 100.0) == (900.0, "measured")
    assert best_predicted([(None, "timed out")], 1000.0, 1.0, 100.0) is None


def test_a_loader_probe_killed_at_its_deadline_keeps_the_rates_it_measured(tmp_path):
    """The loader probe writes each config's rate as it finishes it: killed at its deadline on the config
    it was measuring (here one without workers, whose dataset never answers the main process), it loses
    that config alone, and the ones before it keep their rates."""
    from autotune.study._budget import StudyClock
    from autotune.study._probes import LoaderProbes
    from autotune.study._progress import _Progress
    from autotune.study._runner import TrialRunner

    space = parse_space(yaml.safe_load(SPACE))
    baseline = TrialConfig(batch_size=32, cpu_threads=1)
    runner = TrialRunner(target=f"{WORKLOADS}:train_hangs_without_workers", logdir=tmp_path, baseline=baseline,
                         budget=Budget(samples=2048, warmup_steps=2, windows=3), timeout=40)
    study = optuna.create_study(directions=["maximize", "minimize"])
    probes = LoaderProbes(study=study, space=space, runner=runner, clock=StudyClock(), seed=0)
    configs = [baseline.replace(num_workers=2), baseline.replace(num_workers=1), baseline]
    with _Progress(False, 1) as ui:
        probes._loader_group(configs, ui, keep=0.0)
    records = study.user_attrs[PROBES]
    assert [r["status"] for r in records] == ["ok", "ok", "timeout"], records
    assert records[0]["rate"] > 0 and records[1]["rate"] > 0 and records[2]["rate"] is None
    assert "timeout" in records[2]["error"]


def test_the_loader_variants_are_probed_before_the_step_and_a_step_probe_that_measures_nothing_leaves_the_ceiling(
        tmp_path):
    """The incumbent waits on its input, so its loader variants decide and run first; the step probe runs
    after them, and only where some variant's loader could be worth a trial. Where it measures nothing (a
    budget spent, a compile too long; here the step raises in the probe), the incumbent's own trial bounds
    the step: its rate over the share of its time it did not wait (``step_ceiling``)."""
    from autotune.search._predict import step_ceiling
    from autotune.study._budget import StudyClock
    from autotune.study._probes import LoaderProbes
    from autotune.study._progress import _Progress
    from autotune.study._runner import TrialRunner

    space = parse_space(yaml.safe_load(SPACE))
    baseline = TrialConfig(batch_size=32, cpu_threads=1)

    def probed(incumbent_rate: float) -> tuple[list, optuna.Study]:
        runner = TrialRunner(target=f"{WORKLOADS}:train_step_probe_fails", logdir=tmp_path / str(incumbent_rate),
                             baseline=baseline, budget=Budget(samples=2048, warmup_steps=2, windows=3), timeout=120)
        study = optuna.create_study(directions=["maximize", "minimize"])
        probes = LoaderProbes(study=study, space=space, runner=runner, clock=StudyClock(), seed=0)
        with _Progress(False, 1) as ui:
            probes.run(baseline, incumbent_rate, ui, incumbent_wait=0.9)
        return study.user_attrs[PROBES], study

    records, study = probed(1.0)  # any loader beats it: the step probe runs, after the loaders, and fails
    assert [r["kind"] for r in records] == ["loader", "loader", "step"], records
    assert records[-1]["rate"] is None and records[-1]["status"] != "ok"
    queued = study.get_trials(deepcopy=False)
    assert len(queued) == 1, queued
    fastest = max(r["rate"] for r in records if r["kind"] == "loader")
    assert queued[0].user_attrs[PREDICTED] == pytest.approx(min(fastest, step_ceiling(1.0, 0.9)), rel=1e-3)

    records, study = probed(1e9)  # no loader could be worth a trial: the step would change nothing
    assert [r["kind"] for r in records] == ["loader", "loader"] and not study.get_trials(deepcopy=False)
