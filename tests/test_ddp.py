"""Trials of several ranks (DDP) on the CPU: two gloo ranks per trial, real processes, a real study.

The trials are few and shared across assertions (module-scoped fixtures): one DDP trial with the bucket
size, bucket views and bf16 compression set, one failing rank, one hung trial, and one small study that
also runs static_graph.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from autotune import Budget, SearchSpace, SpaceError, TrialConfig, Tuner
from autotune.hardware import Capabilities
from autotune.insight._diagnose import COMMUNICATION_BOUND, COMPUTE_BOUND, diagnose
from autotune.search._space import parse_space, restrict_to
from autotune.study._isolation import ProcessFiles, launch, run_isolated, start_trial_server
from autotune.trial._execute import TrialSpec
from ddp_workloads import DDP_WORKLOADS, PIDDIR_ENV
from processes import survivors

BUDGET = Budget(samples=2048, warmup_steps=2, windows=3)
KNOBS = dict(bucket_cap_mb=1, gradient_as_bucket_view=True, grad_compression="bf16")


def _spec(func: str, config: TrialConfig, **changes) -> TrialSpec:
    return TrialSpec(target=f"{DDP_WORKLOADS}:{func}", config=config, budget=BUDGET, **changes)




@pytest.fixture(scope="module")
def trial(tmp_path_factory: pytest.TempPathFactory):
    """One two-rank trial with every DDP knob off its default and gradient accumulation (16 x 2 x 2 = 64)."""
    config = TrialConfig(batch_size=16, global_batch=64, processes_per_trial=2, **KNOBS)
    workdir = tmp_path_factory.mktemp("ddp") / "trial"
    return config, workdir, run_isolated(_spec("train_ddp", config), workdir=workdir, timeout=120)


def test_the_ddp_knobs_reach_the_ddp_object(trial) -> None:
    config, _, outcome = trial
    assert outcome.status == "ok", outcome.error + outcome.stderr_tail
    extras = outcome.measurement.extras
    assert extras["test.is_ddp"] is True
    assert extras["test.bucket_bytes_cap"] == 1 * 1024 * 1024
    assert extras["test.gradient_as_bucket_view"] is True
    assert extras["test.static_graph"] is False
    assert extras["test.comm_hook"] == ["bf16_compress_hook"]  # the bf16 compression hook, inside the timer


def test_accumulation_steps_run_under_no_sync(trial) -> None:
    config, _, outcome = trial
    extras = outcome.measurement.extras
    # The first micro-step of a global batch keeps its gradients local; the last one all-reduces them.
    assert extras["test.agree_per_micro_step"] == [False, True]
    assert config.accumulation_steps == 2
    assert extras["ddp.no_sync_steps"] == outcome.measurement.steps // 2


def test_throughput_counts_every_rank(trial) -> None:
    config, _, outcome = trial
    m = outcome.measurement
    assert m.extras["ddp.world_size"] == 2 and m.extras["test.world_size"] == 2
    assert m.extras["test.rank_batches"] == 1024  # each rank reads half of the dataset's order
    # Every window is every rank's samples over the slowest rank's seconds: rate x step time = 2 x 16.
    assert math.isclose(m.throughput * m.step_time, config.batch_size * 2, rel_tol=1e-6)
    assert m.samples == BUDGET.samples  # the budget is in global samples
    assert 0 < m.extras["ddp.allreduce_share"] <= 1 and m.extras["ddp.allreduce_timer"] == "wall-clock"


def test_each_rank_logs_in_its_own_folder(trial) -> None:
    _, workdir, _ = trial
    assert (workdir / "trial.log").exists() and (workdir / "result.json").exists()
    assert (workdir / "rank1" / "trial.log").exists() and (workdir / "rank1" / "result.json").exists()


def test_a_failing_rank_fails_the_trial_by_name(tmp_path: Path) -> None:
    """Rank 1 fails, and its closed process group then fails rank 0, which exits first: rank 1 is named."""
    config = TrialConfig(batch_size=16, processes_per_trial=2)
    start = time.monotonic()
    outcome = run_isolated(_spec("fail_on_rank_1_then_linger", config), workdir=tmp_path, timeout=120)
    assert outcome.status == "error"
    assert outcome.error.startswith("rank 1 of 2: ValueError: rank one broke on purpose")
    assert "rank one broke on purpose" in outcome.stderr_tail  # rank 1's log, not rank 0's
    # The launcher ends the trial once rank 1's failed result is written (it lingers after it); rank 0 is
    # killed then, or fails on the closed group first and exits: either way its log holds no rank 1 error.
    assert "rank one broke on purpose" not in (tmp_path / "trial.log").read_text()
    assert time.monotonic() - start < 60


def test_the_result_is_written_before_the_process_group_is_torn_down(tmp_path: Path) -> None:
    """A teardown that hangs on one rank (torch 2.13.0's CPU build, in ~ProcessGroupGloo) costs nothing: each
    rank writes its result, then ends without tearing its group down."""
    config = TrialConfig(batch_size=16, processes_per_trial=2)
    start = time.monotonic()
    outcome = run_isolated(_spec("train_ddp_teardown_hangs", config), workdir=tmp_path, timeout=60)
    assert outcome.status == "ok", outcome.error + outcome.stderr_tail
    assert (tmp_path / "rank1" / "result.json").exists()
    assert time.monotonic() - start < 45


def test_a_timeout_kills_every_rank_and_its_children(tmp_path: Path) -> None:
    start_trial_server()  # its start-up (torch's import) would otherwise eat the short deadline
    piddir = tmp_path / "pids"
    piddir.mkdir()
    config = TrialConfig(batch_size=16, processes_per_trial=2)
    outcome = run_isolated(_spec("hang_every_rank", config, env={PIDDIR_ENV: str(piddir)}),
                           workdir=tmp_path / "trial", timeout=5)
    assert outcome.status == "timeout" and "all 2 ranks killed" in outcome.error
    pids = [int(p) for f in sorted(piddir.glob("rank*.pids")) for p in f.read_text().split()]
    assert len(pids) == 4, pids  # both ranks wrote their own pid and their sleeper's before hanging
    assert not survivors(pids, seconds=10)


def test_launch_can_let_independent_copies_run_on(tmp_path: Path) -> None:
    """The launcher is not DDP-specific: N independent processes, one failing, the others finishing."""
    import workloads

    ok = TrialSpec(target=f"{workloads.WORKLOADS}:train_tiny", config=TrialConfig(batch_size=16),
                   budget=Budget(samples=512, warmup_steps=1, windows=3))
    bad = TrialSpec(target=f"{workloads.WORKLOADS}:raise_value_error", config=TrialConfig(), budget=Budget())
    files = [ProcessFiles(folder=tmp_path / str(i)) for i in range(2)]
    for where in files:
        where.prepare()
    done = launch([bad, ok], files, timeout=60, stop_on_failure=False)
    assert done.first_failure is not None and done.first_failure.index == 0
    assert done.ends[1].outcome is not None and done.ends[1].outcome.status == "ok"


# -- the space ---------------------------------------------------------------------------------------
def _space(**top) -> SearchSpace:
    return parse_space({"knobs": {"batch_size": [16, 32], "bucket_cap_mb": [10, 25, 50],
                                  "gradient_as_bucket_view": [False, True], "static_graph": [False, True],
                                  "grad_compression": ["none", "bf16"]},
                        "baseline": {"batch_size": 32}, "budget": {"samples": 4096}, **top}, where="s.yaml")


@pytest.mark.parametrize(("knobs", "match"), [
    ({"bucket_cap_mb": [0]}, "knobs.bucket_cap_mb: 0 is below 1"),
    ({"grad_compression": ["fp8"]}, "knobs.grad_compression: 'fp8' is not one of none, bf16"),
    ({"static_graph": ["yes"]}, "knobs.static_graph: 'yes' is not true or false"),
])
def test_bad_ddp_knob_values_are_refused(knobs, match) -> None:
    with pytest.raises(SpaceError, match=match):
        parse_space({"knobs": knobs}, where="s.yaml")


@pytest.mark.parametrize("value", [0, -1, True, "2"])
def test_processes_per_trial_must_be_a_positive_integer(value) -> None:
    with pytest.raises(SpaceError, match="processes_per_trial: .* is not a positive integer"):
        _space(processes_per_trial=value)


def test_the_global_batch_counts_every_rank() -> None:
    space = _space(processes_per_trial=2)
    assert space.global_batch == 64  # the baseline's 32 on each of 2 ranks: the default DDP job
    config = space.baseline.replace(batch_size=16)
    assert config.accumulation_steps == 2 and config.global_batch_size == 64
    assert _space().with_processes(2).global_batch == 64
    stated = _space(processes_per_trial=2, global_batch=256)
    assert stated.global_batch == 256 and stated.baseline.accumulation_steps == 4
    with pytest.raises(SpaceError, match="does not divide the global batch 96"):
        _space(processes_per_trial=4, global_batch=96)
    with pytest.raises(ValueError, match="micro-batch 32 x 2 ranks does not divide the global batch 96"):
        TrialConfig(batch_size=32, global_batch=96, processes_per_trial=2)


def test_the_probe_drops_ddp_knobs_with_one_process_and_graphs_with_several() -> None:
    caps = Capabilities(cuda=False, bf16=False, compile=True, dali=True, cpu_count=2)
    one = restrict_to(_space(), caps)
    for key in ("bucket_cap_mb=10", "bucket_cap_mb=50", "gradient_as_bucket_view=true", "static_graph=true",
                "grad_compression=bf16"):
        assert "one process per trial" in one.removed[key]
    assert [one.knobs[k].values for k in ("bucket_cap_mb", "gradient_as_bucket_view", "grad_compression")] == [
        (25,), (False,), ("none",)]  # torch's defaults stay, fixed
    two = restrict_to(_space(processes_per_trial=2), caps)
    assert two.knobs["bucket_cap_mb"].values == (10, 25, 50) and "grad_compression" in two.knobs
    gpus = Capabilities(cuda=True, gpu_count=1, bf16=True, compile=True, dali=True, cpu_count=8)
    with pytest.raises(SpaceError, match="processes_per_trial 2 needs 2 GPUs"):
        restrict_to(_space(processes_per_trial=2), gpus)


def test_one_process_spaces_keep_their_fingerprint() -> None:
    assert "processes_per_trial" not in _space().to_dict()
    assert _space().fingerprint != _space(processes_per_trial=2).fingerprint


# -- the diagnosis, on recorded numbers ---------------------------------------------------------------
def _recorded(share: float, *, ranks: int = 2, step: float = 0.050, number: int = 1, **config) -> dict:
    return {"number": number, "status": "ok", "throughput": 1000.0, "data_wait_fraction": 0.01,
            "step_time": step, "extra:ddp.allreduce_share": share,
            "config": {"batch_size": 64, "processes_per_trial": ranks, "global_batch": 64 * ranks, **config}}


def test_a_high_allreduce_share_is_communication_bound() -> None:
    d = diagnose(_recorded(0.62))
    assert d.bottleneck == COMMUNICATION_BOUND
    assert "in flight for 62% of the timed windows" in d.evidence and "no one-process run" in d.evidence
    assert d.numbers["allreduce_share"] == 0.62


def test_communication_bound_needs_the_step_to_grow_with_the_world_size() -> None:
    ddp = _recorded(0.62, step=0.080, bucket_cap_mb=50)
    one_rank = {**_recorded(0.0, ranks=1, step=0.050, number=0), "extra:ddp.allreduce_share": None}
    d = diagnose(ddp, [one_rank, ddp])
    assert d.bottleneck == COMMUNICATION_BOUND and d.numbers["step_growth_vs_one_rank"] == 1.6
    assert "1.60x as long as the same per-rank config as one process (trial #0)" in d.evidence
    hidden = _recorded(0.62, step=0.052)  # the all-reduce overlapped the backward: the step barely grew
    assert diagnose(hidden, [one_rank, hidden]).bottleneck == COMPUTE_BOUND


def test_a_low_allreduce_share_is_not_communication_bound() -> None:
    assert diagnose(_recorded(0.1)).bottleneck == COMPUTE_BOUND


# -- a study ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("ddp-study")
    space = parse_space({"knobs": {"batch_size": [16], "static_graph": [False, True],
                                   "grad_compression": ["none", "bf16"]},
                         "baseline": {"batch_size": 16}, "global_batch": 64,
                         "budget": {"samples": 2048, "warmup_steps": 2, "windows": 3}}, where="ddp.yaml", name="ddp")
    tuner = Tuner(f"{DDP_WORKLOADS}:train_ddp", space=space, processes_per_trial=2, n_trials=3, top_k=0,
                  reference_repeats=1, prune_below=None, studies_dir=root, storage=f"sqlite:///{root}/s.db",
                  progress=False,
                  capabilities=Capabilities(cuda=False, bf16=False, compile=True, dali=True, cpu_count=2))
    return tuner.run()


def test_a_study_runs_two_rank_trials(study) -> None:
    import optuna

    loaded = optuna.load_study(study_name=study.study_name, storage=study.storage)
    ran = [t for t in loaded.trials if t.user_attrs.get("status") == "ok"]
    assert len(ran) == 3
    assert all(t.user_attrs["config"]["processes_per_trial"] == 2 for t in ran)
    assert all(t.user_attrs["extra:ddp.world_size"] == 2 for t in ran)
    assert all(t.user_attrs["extra:ddp.allreduce_share"] > 0 for t in ran)
    # static_graph as each trial asked for it, on the DDP object; the guided walk tries it on.
    assert all(t.user_attrs["extra:test.static_graph"] == t.user_attrs["config"]["static_graph"] for t in ran)
    assert any(t.user_attrs["config"]["static_graph"] for t in ran)
    assert loaded.user_attrs["space"]["processes_per_trial"] == 2
    assert study.baseline.processes_per_trial == 2 and study.baseline.global_batch_size == 64
    assert not any(k.startswith(("static_graph", "grad_compression")) for k in study.removed_knobs)


def test_nproc_per_trial_reaches_the_tuner_and_is_checked() -> None:
    from autotune import cli

    args = cli.build_parser().parse_args(["tune", "examples/train.py:train", "--nproc-per-trial", "2"])
    assert cli._tuner(args, "examples/train.py:train").options.search.processes_per_trial == 2
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["tune", "examples/train.py:train", "--nproc-per-trial", "0"])
    with pytest.raises(ValueError, match="processes_per_trial must be a positive integer"):
        Tuner("examples/train.py:train", processes_per_trial=0)
