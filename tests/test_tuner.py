"""The tuner end to end with real Optuna studies in SQLite and journal files, trials in real processes."""

from __future__ import annotations

import dataclasses
import json
import statistics
import math
from pathlib import Path

import optuna
import pytest
from optuna.storages.journal import JournalFileBackend, JournalStorage
from optuna.study import StudyDirection
from optuna.trial import TrialState

import workloads
from autotune import StudyError, TrialConfig, Tuner, WorkloadError, load_best, load_space, load_study_result
from autotune.insight._report import summary_lines
from autotune.search._space import restrict_to
from autotune._records import summarize_study
from autotune.study._confirm import OUT_OF_REACH, TRIAL_GAP, disagreement
from workloads import WORKLOADS

optuna.logging.set_verbosity(optuna.logging.WARNING)

TINY_BUDGET = "budget: {samples: 512, warmup_steps: 1, windows: 3}\n"
# Knobs that do not change the numbers of an MLP, so every config keeps the reference accuracy. (Loader
# workers are left out of train_tiny's spaces: each worker start costs seconds in a trial process.)
# (channels_last is no such knob: the probe removes it for a model without 4-D activations, as this MLP.)
# The baseline (torch's default thread count) is no point of it; 3 threads needs caps of 3 cores or more.
NEUTRAL_SPACE = "knobs:\n  cpu_threads: [1, 2, 3]\n  pin_memory: [false, true]\n" + TINY_BUDGET
THREADS_SPACE = "knobs:\n  cpu_threads: [null, 1]\n" + TINY_BUDGET
# For the manual-reporting workloads, which build no loader: num_workers only labels the config.
WORKERS_SPACE = "knobs:\n  num_workers: [0, 1]\n" + TINY_BUDGET
OOM_SPACE = ("knobs:\n  batch_size: [64, 256]\n  cpu_threads: [null, 1]\nbatch_policy: scale\n"
             "budget: {samples: 1024, warmup_steps: 1, windows: 3}\n")


def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/studies.db"


def make_tuner(tmp_path: Path, caps, func: str, space, **options) -> Tuner:
    settings = dict(
        space=space,
        n_trials=3,
        storage=sqlite_url(tmp_path),
        studies_dir=tmp_path / "studies",
        progress=False, plots=False,
        capabilities=caps,
        reference_repeats=1,
        trial_timeout=120,
        top_k=0,  # the top-K re-measurement is tested on its own
        prune_below=None,  # so is pruning: timing noise must not turn these trials into PRUNED ones
    )
    settings.update(options)
    return Tuner(f"{WORKLOADS}:{func}", **settings)


def open_study(url: str, name: str) -> optuna.Study:
    """Read a study back with Optuna alone."""
    storage = JournalStorage(JournalFileBackend(url[len("journal:"):])) if url.startswith("journal:") else url
    return optuna.load_study(study_name=name, storage=storage)


@pytest.mark.parametrize(("backend", "top_k"), [("sqlite", 3), ("journal", 1)])  # top-1 alternates too
def test_study_end_to_end(tmp_path: Path, cpu_caps, write_space, backend: str, top_k: int) -> None:
    cpu_caps = dataclasses.replace(cpu_caps, cpu_count=4)  # keeps cpu_threads=3 in the space
    url = sqlite_url(tmp_path) if backend == "sqlite" else f"journal:{tmp_path}/j.log"
    space_path = write_space(NEUTRAL_SPACE)
    result = make_tuner(tmp_path, cpu_caps, "train_tiny", space_path, storage=url, reference_repeats=2,
                        top_k=top_k, confirm_rounds=2, study_name="e2e").run()

    study = open_study(url, "e2e")
    trials = study.get_trials()
    assert len(trials) == 3
    for trial in trials:
        assert trial.state == TrialState.COMPLETE
        attrs = trial.user_attrs
        for key in ("throughput", "data_wait_fraction", "peak_memory_gib", "status", "accuracy_loss", "config"):
            assert key in attrs, (trial.number, key)
        assert attrs["status"] == "ok", attrs.get("error")
        assert attrs["throughput"] > 0 and attrs["throughput"] == trial.values[0]
        assert attrs["accuracy_loss"] == trial.values[1]
        assert set(trial.constraints) == {"failure", "accuracy"}
        assert all(v <= 0 for v in trial.constraints.values())
        assert TrialConfig.from_dict(attrs["config"]).pin_memory is False  # removed by the probe

    attrs = study.user_attrs
    assert attrs["baseline_throughput"] > 0
    assert 0.0 <= attrs["reference_metric"] <= 1.0
    assert attrs["metric_noise"] == pytest.approx(abs(attrs["reference_metrics"][0] - attrs["reference_metrics"][1]))
    assert attrs["hardware"] == cpu_caps.to_dict()
    assert set(attrs["removed_knobs"]) == {"pin_memory=true"}
    assert "no CUDA device" in attrs["removed_knobs"]["pin_memory=true"]
    assert attrs["space_fingerprint"] == restrict_to(load_space(space_path), cpu_caps).fingerprint
    assert attrs["target"] == f"{WORKLOADS}:train_tiny"
    assert study.metric_names == ["throughput", "accuracy_loss"]
    assert study.directions == [StudyDirection.MAXIMIZE, StudyDirection.MINIMIZE]

    # The top configs were raced, and the best is the winner by median among those not dropped.
    confirmation = attrs["top_k_confirmation"]
    fastest: dict[str, float] = {}  # each distinct config's fastest run
    for t in sorted(trials, key=lambda t: -t.values[0]):
        fastest.setdefault(json.dumps(t.params, sort_keys=True), t.values[0])
    ranked = sorted(fastest.values(), reverse=True)[:top_k]  # at most 3 configs here
    # Less those more than OUT_OF_REACH slower than the leader: no finalists.
    assert len(confirmation["trials"]) == sum(1 for v in ranked if v * OUT_OF_REACH >= ranked[0])
    assert confirmation["trials"] == sorted(confirmation["trials"], key=lambda n: -trials[n].values[0])
    dropped = confirmation["race"]["dropped"]
    for number in confirmation["trials"]:
        rates = confirmation["throughputs"][str(number)]
        assert len(rates) >= (1 if str(number) in dropped else 2) and all(r > 0 for r in rates)
        assert confirmation["medians"][str(number)] == pytest.approx(statistics.median(rates))
    winner = confirmation["winner"]
    assert str(winner) not in dropped
    assert confirmation["medians"][str(winner)] == max(v for k, v in confirmation["medians"].items() if k not in dropped)
    assert result.best is not None and result.best.feasible and result.best.status == "ok"
    assert result.best.number == winner
    assert result.best.throughput == pytest.approx(confirmation["medians"][str(winner)])
    # The baseline (not a point of this space: no trial) took part in the same alternation, and the
    # speed-up is the ratio of the two medians, with the per-round ratios as its spread.
    baseline = confirmation["baseline"]
    base_runs = [b for b in baseline["throughputs"] if b]
    assert baseline["trial"] is None and len(base_runs) in (2, 3)  # a third when its two disagreed (a noisy CPU)
    assert baseline["median"] == pytest.approx(statistics.median(base_runs))
    assert result.baseline_throughput == pytest.approx(baseline["median"])
    assert result.speedup == pytest.approx(result.best.throughput / baseline["median"])
    ratios = [r[str(winner)] / b for r, b in zip(confirmation["rounds"], baseline["throughputs"]) if b and r[str(winner)]]
    assert result.speedup_basis == "alternation" and result.speedup_rounds == len(ratios) >= 2
    mine = list(confirmation["throughputs"][str(winner)])
    theirs = list(base_runs)
    own, base = confirmation["trial_throughputs"][str(winner)], confirmation["trial_throughputs"]["baseline"]
    # The full trials join whenever either one's race runs are more than TRIAL_GAP from it, or they say slower
    # where every round says faster.
    trials_join = (confirmation["race"]["noise_from_trials"]
                   or any(disagreement([statistics.median(runs), trial]) > TRIAL_GAP
                          for runs, trial in ((mine, own), (theirs, base)))
                   or (own < base and min(ratios) > 1.0))
    if confirmation["race"]["noisy"] or trials_join:  # every pick run against every baseline run
        if trials_join:
            mine.append(own)
            theirs.append(base)
        low, high = min(mine) / max(theirs), max(mine) / min(theirs)
    else:
        low, high = min(ratios), max(ratios)
    assert (result.speedup_low, result.speedup_high) == (pytest.approx(low), pytest.approx(high))
    assert result.faster == (low > 1.0)
    assert result.removed_knobs == attrs["removed_knobs"]
    assert result.pareto and all(r.feasible for r in result.pareto)
    path = tmp_path / "studies" / "e2e" / "best_config.json"
    assert result.best_config_path == str(path)
    doc = json.loads(path.read_text())
    assert doc["config"] == result.best_config.to_dict()
    assert doc["trial"] == result.best.number and doc["target"] == f"{WORKLOADS}:train_tiny"
    assert doc["speedup"] == pytest.approx(result.speedup)
    assert doc["faster"] == result.faster and doc["verdict"] == result.verdict
    assert doc["speedup_spread"]["low"] == pytest.approx(result.speedup_low)
    assert doc["speedup_spread"]["basis"] == "alternation"
    assert doc["throughput"] == pytest.approx(result.best.throughput)
    assert load_best(path) == result.best_config
    assert load_best("e2e", studies_dir=tmp_path / "studies") == result.best_config
    assert load_best("e2e", storage=url, studies_dir=tmp_path / "studies") == result.best_config

    logs = tmp_path / "studies" / "e2e" / "logs"
    # The baseline's thread count (torch's default) is not among this space's choices, so the reference
    # run is not recorded as a trial here (see test_timeout_stops_before_any_trial_and_the_baseline_stands).
    assert all(t.user_attrs.get("role") != "reference" for t in trials)
    measured = [t for t in trials if "duplicate_of" not in t.user_attrs and t.user_attrs.get("role") != "reference"]
    expected = {"reference-0", "reference-1"} | {f"trial-{t.number}" for t in measured}
    # One folder per race run: each finalist and the baseline in the rounds it ran in.
    expected |= {f"confirm-{key}-{r}" for r, rates in enumerate(confirmation["rounds"])
                 for key, rate in rates.items() if rate is not None}
    assert {p.name for p in logs.iterdir()} == expected


def test_oom_config_is_infeasible_and_the_study_goes_on(tmp_path: Path, cpu_caps, write_space) -> None:
    space = write_space(OOM_SPACE)
    make_tuner(tmp_path, cpu_caps, "train_oom_at_256", space, n_trials=1, study_name="oom").run()
    study = open_study(sqlite_url(tmp_path), "oom")
    reference = study.user_attrs["reference_throughputs"]
    # Resume with batch 256 and then batch 64 queued next (real Optuna enqueues on the tuner's study),
    # in the thread setting trial 0 did not use, so that both are new configs and really run.
    threads = 1 if study.get_trials()[0].params["cpu_threads"] is None else None
    study.enqueue_trial({"batch_size": 256, "cpu_threads": threads})
    study.enqueue_trial({"batch_size": 64, "cpu_threads": threads})
    result = make_tuner(tmp_path, cpu_caps, "train_oom_at_256", space, n_trials=3, study_name="oom").run()

    study = open_study(sqlite_url(tmp_path), "oom")
    trials = study.get_trials()
    assert len(trials) == 3 and all(t.state == TrialState.COMPLETE for t in trials)
    failed, after = trials[1], trials[2]
    assert failed.params == {"batch_size": 256, "cpu_threads": threads}
    assert "duplicate_of" not in failed.user_attrs
    assert failed.user_attrs["status"] == "oom"
    assert failed.user_attrs["failure"] == "oom"
    assert "OutOfMemoryError" in failed.user_attrs["error"] and "Traceback" in failed.user_attrs["stderr_tail"]
    assert failed.user_attrs["throughput"] == 0.0 and math.isinf(failed.user_attrs["accuracy_loss"])
    assert failed.constraints["failure"] > 0
    assert failed.values[0] == 0.0 and math.isinf(failed.values[1])

    # The study went on after the failure: the next config ran, succeeded, and is the best.
    assert after.params == {"batch_size": 64, "cpu_threads": threads}
    assert after.user_attrs["status"] == "ok" and "duplicate_of" not in after.user_attrs
    assert all(v <= 0 for v in after.constraints.values())
    assert result.best is not None and result.best.config.batch_size == 64
    assert all(r.config.batch_size == 64 for r in result.pareto)
    assert study.user_attrs["reference_throughputs"] == reference  # resuming did not rerun the reference


def test_resuming_with_a_changed_space_is_refused(tmp_path: Path, cpu_caps, write_space) -> None:
    original = write_space("knobs:\n  batch_size: [32, 64]\n" + TINY_BUDGET, "original.yaml")
    make_tuner(tmp_path, cpu_caps, "train_tiny", original, n_trials=1, study_name="resume").run()

    changed = write_space("knobs:\n  batch_size: [32, 128]\n" + TINY_BUDGET, "changed.yaml")
    with pytest.raises(StudyError, match=r"knobs\.batch_size") as info:
        make_tuner(tmp_path, cpu_caps, "train_tiny", changed, n_trials=5, study_name="resume").run()
    assert "'resume'" in str(info.value) and "\n" not in str(info.value)

    longer = write_space("knobs:\n  batch_size: [32, 64]\nbudget: {samples: 1024, warmup_steps: 1, windows: 3}\n",
                         "longer.yaml")
    with pytest.raises(StudyError, match=r"budget\.samples"):
        make_tuner(tmp_path, cpu_caps, "train_tiny", longer, n_trials=5, study_name="resume").run()

    with pytest.raises(StudyError, match="tunes .*train_tiny, not .*train_oom_at_256"):
        make_tuner(tmp_path, cpu_caps, "train_oom_at_256", original, n_trials=5, study_name="resume").run()

    assert len(open_study(sqlite_url(tmp_path), "resume").get_trials()) == 1  # nothing was created


@pytest.mark.parametrize(
    "func, names",
    [("raise_value_error", ["ValueError: the workload is broken"]), ("missing.py", ["no such file"])],
)
def test_reference_failure_raises_workload_error(tmp_path: Path, cpu_caps, write_space, func, names) -> None:
    target = f"{WORKLOADS}:{func}" if func != "missing.py" else f"{tmp_path}/missing.py:train"
    tuner = Tuner(target, space=write_space(THREADS_SPACE), n_trials=2, storage=sqlite_url(tmp_path),
                  studies_dir=tmp_path / "studies", progress=False, plots=False, capabilities=cpu_caps, study_name="ref")
    with pytest.raises(WorkloadError, match="fp32 reference run failed") as info:
        tuner.run()
    message = str(info.value)
    assert "\n" not in message
    for name in names:
        assert name in message
    assert str(tmp_path / "studies" / "ref" / "logs" / "reference-0" / "trial.log") in message
    # Nothing is created until the reference has passed: no half-made study is left behind.
    assert "ref" not in [s.study_name for s in optuna.get_all_study_summaries(sqlite_url(tmp_path))]


@pytest.mark.parametrize(
    "func, direction, max_loss, best_workers",
    [
        ("faster_but_less_accurate", "maximize", 0.01, 0),
        ("faster_but_less_accurate", "maximize", 0.02, 1),
        ("faster_but_higher_loss", "minimize", 0.01, 0),
        ("faster_but_higher_loss", "minimize", 0.02, 1),
    ],
)
def test_accuracy_bound_with_noise_band_decides_the_best(tmp_path, cpu_caps, write_space, func, direction,
                                                         max_loss, best_workers) -> None:
    # Reference metrics (seeds 0 and 1) differ by 0.005: the noise band. The 2x faster config (one loader
    # worker) loses 0.02, which is within 0.02 + 0.005 but not within 0.01 + 0.005.
    result = make_tuner(tmp_path, cpu_caps, func, write_space(WORKERS_SPACE), n_trials=20, reference_repeats=2,
                        metric_direction=direction, max_accuracy_loss=max_loss, study_name="bound").run()
    study = open_study(sqlite_url(tmp_path), "bound")
    assert study.user_attrs["metric_noise"] == pytest.approx(0.005)
    assert study.user_attrs["reference_metric"] == pytest.approx(0.9 if direction == "maximize" else 0.1)
    assert study.user_attrs["baseline_throughput"] == pytest.approx(1000.0)
    by_workers = {t.params["num_workers"]: t for t in study.get_trials()}
    assert set(by_workers) == {0, 1}, "both configs must have been measured"
    fast = by_workers[1]
    assert fast.values[0] == pytest.approx(2000.0)
    assert fast.user_attrs["accuracy_loss"] == pytest.approx(0.02)
    assert fast.constraints["accuracy"] == pytest.approx(0.02 - (max_loss + 0.005))
    assert by_workers[0].user_attrs["accuracy_loss"] == pytest.approx(0.0)

    assert result.best is not None and result.best.config.num_workers == best_workers
    assert result.speedup == pytest.approx(2.0 if best_workers else 1.0)
    assert all(r.config.num_workers == best_workers or r.feasible for r in result.pareto)


def test_duplicates_are_reused_and_a_measured_space_stops_the_study(tmp_path, cpu_caps, write_space) -> None:
    space = write_space(WORKERS_SPACE)
    make_tuner(tmp_path, cpu_caps, "faster_but_less_accurate", space, n_trials=1, study_name="dup").run()
    study = open_study(sqlite_url(tmp_path), "dup")
    (first,) = study.get_trials()  # the baseline (num_workers 0) recorded from the reference run
    assert first.user_attrs["role"] == "reference"
    study.enqueue_trial(first.params)
    make_tuner(tmp_path, cpu_caps, "faster_but_less_accurate", space, n_trials=2, study_name="dup").run()

    study = open_study(sqlite_url(tmp_path), "dup")
    copy = study.get_trials()[1]
    assert copy.user_attrs["duplicate_of"] == first.number
    assert copy.values == first.values and copy.constraints == first.constraints
    assert copy.user_attrs["throughput"] == first.user_attrs["throughput"]
    logs = tmp_path / "studies" / "dup" / "logs"
    assert not (logs / "trial-1").exists()  # reused, not run again

    make_tuner(tmp_path, cpu_caps, "faster_but_less_accurate", space, n_trials=20, study_name="dup").run()
    trials = open_study(sqlite_url(tmp_path), "dup").get_trials()
    assert {t.params["num_workers"] for t in trials} == {0, 1}
    assert len(trials) < 20  # every config of the space was measured, so it stopped early
    assert trials[-1].params != first.params  # the last trial is the one that completed the space
    runs = {p.name for p in logs.iterdir() if p.name.startswith("trial-")}
    assert runs == {f"trial-{t.number}" for t in trials
                    if "duplicate_of" not in t.user_attrs and t.user_attrs.get("role") != "reference"}


def test_timeout_stops_before_any_trial_and_the_baseline_stands(tmp_path, cpu_caps, write_space) -> None:
    result = make_tuner(tmp_path, cpu_caps, "train_tiny", write_space(THREADS_SPACE), timeout=0.0,
                        study_name="none").run()
    (reference,) = open_study(sqlite_url(tmp_path), "none").get_trials()  # no trial beyond the reference
    assert reference.user_attrs["role"] == "reference"
    assert result.best is not None and result.best.number == 0 and result.best_config == result.baseline
    assert result.speedup == pytest.approx(1.0)
    assert load_best(Path(result.best_config_path)) == result.baseline


def test_nothing_feasible_when_the_baseline_is_outside_the_space(tmp_path, cpu_caps, write_space) -> None:
    space = write_space("knobs:\n  cpu_threads: [1]\n" + TINY_BUDGET)  # the baseline has torch's default
    result = make_tuner(tmp_path, cpu_caps, "train_tiny", space, timeout=0.0, study_name="none").run()
    assert result.best is None and result.pareto == ()
    assert open_study(sqlite_url(tmp_path), "none").get_trials() == []
    path = Path(result.best_config_path)
    assert json.loads(path.read_text())["config"] is None
    with pytest.raises(StudyError, match="no feasible config"):
        load_best(path)
    with pytest.raises(StudyError, match="no feasible config"):
        load_best("none", storage=sqlite_url(tmp_path))


def test_confirmation_trains_reference_and_best_for_longer(tmp_path, cpu_caps, write_space) -> None:
    space = write_space("knobs:\n  cpu_threads: [1]\n" + TINY_BUDGET)
    result = make_tuner(tmp_path, cpu_caps, "train_tiny", space, n_trials=3, confirm_samples=1024,
                        study_name="confirm").run()
    study = open_study(sqlite_url(tmp_path), "confirm")
    assert len(study.get_trials()) == 1  # a one-config space is measured once
    report = study.user_attrs["confirmation"]
    assert report["samples"] == 1024
    for role in ("reference", "best"):
        assert report[role]["status"] == "ok"
        assert report[role]["measurement"]["samples"] == 1024
    assert "accuracy_loss" in report
    assert json.loads(Path(result.best_config_path).read_text())["confirmation"] == report


def test_callable_target_and_default_storage(tmp_path, cpu_caps, write_space) -> None:
    studies = tmp_path / "studies"
    result = Tuner(workloads.train_tiny, space=write_space(THREADS_SPACE), n_trials=1, studies_dir=studies,
                   progress=False, plots=False, capabilities=cpu_caps, reference_repeats=1, top_k=0).run()
    assert result.study_name == "train_tiny"
    study = open_study(f"sqlite:///{studies}/autotune.db", "train_tiny")
    assert study.user_attrs["target"] == "workloads:train_tiny"  # imported by module name in the trial
    assert study.get_trials()[0].user_attrs["status"] == "ok"
    _, again = load_study_result("train_tiny", studies_dir=studies)
    assert again.best == result.best


def test_result_storage_reopens_the_study(tmp_path, cpu_caps, write_space) -> None:
    studies = tmp_path / "studies"
    result = Tuner(workloads.train_tiny, space=write_space(THREADS_SPACE), n_trials=1, studies_dir=studies,
                   progress=False, plots=False, capabilities=cpu_caps, reference_repeats=1, top_k=0).run()
    _, again = load_study_result(result.study_name, storage=result.storage)
    assert again.best == result.best


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
@pytest.mark.parametrize("sampler", ["grid", "brute-force"])
def test_exhaustive_samplers_measure_the_whole_space(tmp_path, cpu_caps, write_space, sampler) -> None:
    chosen = (optuna.samplers.GridSampler({"num_workers": [0, 1]}, seed=0) if sampler == "grid"
              else optuna.samplers.BruteForceSampler(seed=0))
    result = make_tuner(tmp_path, cpu_caps, "faster_but_less_accurate", write_space(WORKERS_SPACE), n_trials=4,
                        sampler=chosen, study_name="grid").run()
    trials = open_study(sqlite_url(tmp_path), "grid").get_trials()
    assert {t.params["num_workers"] for t in trials} == {0, 1}
    assert result.best is not None


@pytest.mark.parametrize(
    "options, match",
    [(dict(n_trials=0), "n_trials"), (dict(metric_direction="up"), "metric_direction"),
     (dict(reference_repeats=0), "reference_repeats"), (dict(max_accuracy_loss=-0.1), "max_accuracy_loss")],
)
def test_tuner_rejects_bad_options(options, match) -> None:
    with pytest.raises(ValueError, match=match):
        Tuner(f"{WORKLOADS}:train_tiny", **options)


def test_tuner_refuses_a_lambda() -> None:
    with pytest.raises(WorkloadError, match="module-level function"):
        Tuner(lambda ctx: None)


def test_reading_a_study_that_is_missing_or_has_no_reference(tmp_path) -> None:
    url = sqlite_url(tmp_path)
    optuna.create_study(study_name="bare", storage=url, directions=["maximize", "minimize"])
    with pytest.raises(StudyError, match="no study 'nope' .*studies there: bare"):
        load_study_result("nope", storage=url)
    with pytest.raises(StudyError, match="no reference run yet"):
        summarize_study(optuna.load_study(study_name="bare", storage=url))
    with pytest.raises(StudyError, match="no such file"):
        load_best(tmp_path / "missing.json")


# Under batch_policy scale a trial is judged against fp32 at its own global batch, however it was asked for:
# the old accuracy_reference="batch", or the policy itself. (Judging it against the baseline's batch, which
# took more optimizer steps, rejected larger batches for that alone: the defect batch policies remove.)
@pytest.mark.parametrize("reference, options", [("batch", {}), ("baseline", {"batch_policy": "scale"})])
def test_accuracy_reference_at_the_trials_batch_size(tmp_path, cpu_caps, write_space, reference, options) -> None:
    # accuracy_by_batch: batch 64 loses 0.048 against batch 16 (fewer steps), channels_last loses 0.05.
    batch_loss = 0.0
    space = write_space("knobs:\n  batch_size: [16, 64]\n  channels_last: [false, true]\nbaseline: {batch_size: 16}\n"
                        + TINY_BUDGET)
    make_tuner(tmp_path, cpu_caps, "accuracy_by_batch", space, n_trials=4, accuracy_reference=reference,
               study_name="ref", **options).run()
    study = open_study(sqlite_url(tmp_path), "ref")
    loss = {(t.params["batch_size"], t.params["channels_last"]): t.user_attrs["accuracy_loss"]
            for t in study.get_trials(states=(TrialState.COMPLETE,))}
    assert set(loss) == {(16, False), (16, True), (64, False), (64, True)}
    assert loss[(16, False)] == pytest.approx(0.0) and loss[(16, True)] == pytest.approx(0.05)
    assert loss[(64, False)] == pytest.approx(batch_loss)
    assert loss[(64, True)] == pytest.approx(batch_loss + 0.05)  # the knob that costs accuracy is still caught
    assert study.user_attrs["accuracy_reference"] == reference
    assert study.user_attrs["batch_policy"] == "scale"
    batch_refs = {k: v for k, v in study.user_attrs.items() if k.startswith("reference_metric:batch=")}
    assert batch_refs == {"reference_metric:batch=64": pytest.approx(0.836)}
    # The batch reference runs inside the ask-to-tell of the first trial at batch 64, and that trial says how long.
    timed = [t for t in study.trials if "reference_seconds" in t.user_attrs]
    assert len(timed) == 1
    if timed:
        assert timed[0].params["batch_size"] == 64
        ask_to_tell = (timed[0].datetime_complete - timed[0].datetime_start).total_seconds()
        assert 0 < timed[0].user_attrs["reference_seconds"] < ask_to_tell - timed[0].user_attrs["run_seconds"]
    note = "\n".join(summary_lines(study, {}))  # the study note in the dashboard says which reference
    assert "against fp32 at its own batch size (batch 64: 0.8360)" in note


def test_an_unknown_accuracy_reference_is_refused(tmp_path, cpu_caps, write_space) -> None:
    with pytest.raises(ValueError, match="accuracy_reference"):
        make_tuner(tmp_path, cpu_caps, "accuracy_by_batch", write_space(THREADS_SPACE), accuracy_reference="seed")


@pytest.mark.parametrize("repeats, knob_passes_at_64", [(1, False), (2, True)])
def test_a_batch_reference_with_two_seeds_gives_its_batch_its_own_noise_band(
        tmp_path, cpu_caps, write_space, repeats, knob_passes_at_64) -> None:
    # accuracy_noisy_at_64: batch 64's metric moves 0.03 between seeds, channels_last loses 0.02.
    space = write_space("knobs:\n  batch_size: [16, 64]\n  channels_last: [false, true]\nbaseline: {batch_size: 16}\n"
                        + TINY_BUDGET)
    make_tuner(tmp_path, cpu_caps, "accuracy_noisy_at_64", space, n_trials=4, accuracy_reference="batch",
               reference_repeats=repeats, study_name="ref").run()
    study = open_study(sqlite_url(tmp_path), "ref")
    trials = {(t.params["batch_size"], t.params["channels_last"]): t for t in study.get_trials(states=(TrialState.COMPLETE,))}

    def feasible(key):
        return all(c <= 0 for c in trials[key].constraints.values())

    assert trials[(64, True)].user_attrs["accuracy_loss"] == pytest.approx(0.02)
    # Two seeds at batch 64 measure its noise (0.03), and a loss within bound + noise passes there ...
    assert feasible((64, True)) == knob_passes_at_64
    assert study.user_attrs.get("reference_noise:batch=64") == (pytest.approx(0.03) if repeats == 2 else None)
    # ... while batch 16 keeps the baseline's band (its seeds agree), so the same knob is caught there.
    assert not feasible((16, True)) and feasible((16, False)) and feasible((64, False))
    runs = sorted(p.name for p in (tmp_path / "studies" / "ref" / "logs" / "reference-batch-64").iterdir())
    assert runs == [f"seed-{seed}" for seed in range(repeats)]
    note = "\n".join(summary_lines(study, {}))
    assert ("batch 64: 0.8360, noise band 0.0300" in note) == (repeats == 2)


def test_a_batch_reference_that_does_not_fit_runs_at_a_micro_batch_that_does(tmp_path, cpu_caps, write_space) -> None:
    # fp32 at a micro-batch of 64 runs out of memory; its global batch 64 then runs as 2 x 32, same optimization.
    space = write_space("knobs:\n  batch_size: [16, 64]\n  precision: [bf16]\nbaseline: {batch_size: 16}\n" + TINY_BUDGET)
    make_tuner(tmp_path, cpu_caps, "accuracy_by_batch_fp32_oom_at_64", space, n_trials=2, batch_policy="scale",
               reference_repeats=2, study_name="ref").run()
    study = open_study(sqlite_url(tmp_path), "ref")
    assert "reference_failed:batch=64" not in study.user_attrs
    assert "reference_band:batch=64" in study.user_attrs
    runs = sorted(p.name for p in (tmp_path / "studies" / "ref" / "logs" / "reference-batch-64").iterdir())
    assert runs == ["seed-0", "seed-0-micro32", "seed-1-micro32"]  # the oom at 64, then both seeds at 32
    at_64 = next(t for t in study.get_trials() if t.params.get("batch_size") == 64)
    # accuracy_by_batch scores the micro-batch: 0.9 - 32/1000 for the reference, 0.9 - 64/1000 for the trial.
    assert at_64.user_attrs["accuracy_loss"] == pytest.approx(0.032)


def test_a_batch_reference_that_does_not_fit_falls_back_to_the_baseline(tmp_path, cpu_caps, write_space) -> None:
    space = write_space("knobs:\n  batch_size: [16, 64]\n  precision: [bf16]\nbaseline: {batch_size: 16}\n" + TINY_BUDGET)
    make_tuner(tmp_path, cpu_caps, "accuracy_by_batch_fp32_never_fits_64", space, n_trials=2,
               accuracy_reference="batch", study_name="ref").run()
    study = open_study(sqlite_url(tmp_path), "ref")
    assert study.user_attrs["reference_failed:batch=64"].startswith("oom:")
    at_64 = next(t for t in study.get_trials() if t.params.get("batch_size") == 64)
    assert at_64.user_attrs["status"] == "ok"
    assert at_64.user_attrs["accuracy_loss"] == pytest.approx(0.048)  # judged against the batch-16 baseline


def test_channels_last_goes_when_the_reference_shows_no_4d_activations_and_a_resume_keeps_that(
        tmp_path, cpu_caps, write_space) -> None:
    space = write_space("knobs:\n  channels_last: [false, true]\n  cpu_threads: [null, 1]\n" + TINY_BUDGET)
    make_tuner(tmp_path, cpu_caps, "train_tiny", space, n_trials=1, study_name="flat").run()
    study = open_study(sqlite_url(tmp_path), "flat")
    assert study.trials[0].user_attrs["extra:activations_4d"] is False  # train_tiny is an MLP
    assert "no 4-D activations" in study.user_attrs["removed_knobs"]["channels_last=true"]
    # Resumed, the space is the one the study was made with (no "another search space" error).
    make_tuner(tmp_path, cpu_caps, "train_tiny", space, n_trials=2, study_name="flat").run()
    trials = open_study(sqlite_url(tmp_path), "flat").get_trials()
    assert len(trials) == 2 and not any(t.user_attrs["config"]["channels_last"] for t in trials)


def test_a_resume_with_other_accuracy_rules_is_refused_before_the_probe(tmp_path: Path, cpu_caps, write_space) -> None:
    # The target marks each import of its module; the probe would import it, the early refusal does not.
    marker = tmp_path / "imported"
    target = tmp_path / "marked.py"
    target.write_text(Path(workloads.__file__).read_text() + f"\nopen({str(marker)!r}, 'a').write('x')\n")
    space = write_space(WORKERS_SPACE)
    options = dict(space=space, n_trials=1, storage=sqlite_url(tmp_path), studies_dir=tmp_path / "studies",
                   progress=False, plots=False, reference_repeats=1, top_k=0, prune_below=None, study_name="rules")
    Tuner(f"{target}:train_tiny", capabilities=cpu_caps, **options).run()
    marker.unlink()
    with pytest.raises(StudyError, match="created with --metric-direction maximize, not minimize"):
        Tuner(f"{target}:train_tiny", metric_direction="minimize", **options).run()
    assert not marker.exists()  # refused from the stored study alone: no probe, no trial server


def test_pruning_compares_a_first_window_with_first_windows(tmp_path: Path, cpu_caps, write_space) -> None:
    # Every config stalls at its first timed step alike: against the baseline's median, each would read as
    # hopeless; against the baseline's own first window, none is.
    result = make_tuner(tmp_path, cpu_caps, "train_slow_first_window", write_space(WORKERS_SPACE), n_trials=2,
                        prune_below=0.5).run()
    study = optuna.load_study(study_name=result.study_name, storage=result.storage)
    reference = study.trials[0].user_attrs["window_throughputs"]
    assert reference[0] < 0.5 * study.trials[0].user_attrs["throughput"]  # the stall shows in its first window
    searched = [t for t in study.trials if t.user_attrs.get("role") != "reference"]
    assert searched and all(t.state == TrialState.COMPLETE for t in searched), [t.user_attrs.get("error") for t in searched]


def test_configs_whose_values_cannot_run_together_are_pruned_without_a_run(tmp_path: Path, cpu_caps,
                                                                           write_space) -> None:
    # The probe's answer on a machine where the flash kernel takes no bf16 (data, as the probe reports it):
    # train_tiny calls no attention, so only the tuner can keep those configs from running.
    why = "SDPA has no flash kernel for bfloat16 on CPU here (torch: No available kernel)"
    caps = dataclasses.replace(cpu_caps, attention_precision_unavailable={"flash": {"bf16": why}})
    space = write_space("knobs:\n  precision: [fp32, bf16]\n  attention: [explicit, flash]\n" + TINY_BUDGET)
    make_tuner(tmp_path, caps, "train_tiny", space, n_trials=1, study_name="pairs").run()  # the reference
    study = open_study(sqlite_url(tmp_path), "pairs")
    assert study.user_attrs["removed_knobs"]["attention=flash with precision=bf16"] == why
    assert study.user_attrs["space_fingerprint"] == load_space(space).fingerprint
    study.enqueue_trial({"precision": "bf16", "attention": "flash"})  # as another sampler might propose it
    result = make_tuner(tmp_path, caps, "train_tiny", space, n_trials=3, study_name="pairs").run()

    trials = open_study(sqlite_url(tmp_path), "pairs").get_trials()
    pruned = trials[1]
    assert pruned.params == {"precision": "bf16", "attention": "flash"} and pruned.state == TrialState.PRUNED
    assert pruned.user_attrs["status"] == "cannot_run" and pruned.user_attrs["pruned_reason"] == why
    logs = tmp_path / "studies" / "pairs" / "logs"
    assert not (logs / "trial-1").exists()  # not run
    # It cost none of the budget (3 trials): the three configs that can run ran, each once, the sampler
    # choosing the two after the queued one; the one that cannot run was not proposed again.
    ran = [t for t in trials if t.number != 1]
    assert len(trials) == 4
    assert sorted((t.params["precision"], t.params["attention"]) for t in ran) == [
        ("bf16", "explicit"), ("fp32", "explicit"), ("fp32", "flash")]
    assert all(t.state == TrialState.COMPLETE and t.user_attrs["status"] == "ok" for t in ran)
    assert result.removed_knobs["attention=flash with precision=bf16"] == why
