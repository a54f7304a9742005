"""Trials in real child processes: every way a trial ends is classified, and nothing outlives it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

import workloads
from autotune import Budget, KnobError, NonFiniteLoss, TrialConfig, WorkloadError
from autotune.trial._execute import TrialSpec, classify_exception
from autotune._target import load_target, target_of
from autotune.study._isolation import run_isolated
from workloads import PIDFILE_ENV, WORKLOADS

BUDGET = Budget(samples=512, warmup_steps=1, windows=3)


def spec(func: str, **changes) -> TrialSpec:
    fields = dict(target=f"{WORKLOADS}:{func}", config=TrialConfig(batch_size=32), budget=BUDGET)
    fields.update(changes)
    return TrialSpec(**fields)


def run(tmp_path: Path, trial: TrialSpec, timeout: float = 120.0):
    return run_isolated(trial, workdir=tmp_path / "trial", timeout=timeout)


def _gone(pid: int, within: float = 15.0) -> bool:
    """Whether the process is gone (a killed orphan is reaped by init, which can take a moment)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_ok_trial_returns_its_measurement(tmp_path: Path) -> None:
    outcome = run(tmp_path, spec("train_tiny"))
    assert outcome.status == "ok", outcome.stderr_tail
    m = outcome.measurement
    assert m is not None and m.throughput > 0
    assert len(m.window_throughputs) == 3
    assert m.steps == 512 // 32 and m.samples == 512
    assert m.metric is not None and 0.0 <= m.metric <= 1.0
    assert outcome.error == "" and outcome.stderr_tail == "" and outcome.signal is None
    assert outcome.wall_seconds > 0
    assert (tmp_path / "trial" / "result.json").is_file() and (tmp_path / "trial" / "trial.log").is_file()


def test_exception_is_error_with_one_line_and_the_stderr_tail(tmp_path: Path) -> None:
    outcome = run(tmp_path, spec("raise_value_error"))
    assert outcome.status == "error"
    assert outcome.error == "ValueError: the workload is broken"
    assert "Traceback" in outcome.stderr_tail
    assert "second line of the message" in outcome.stderr_tail
    assert "raise_value_error" in (tmp_path / "trial" / "trial.log").read_text()
    assert outcome.measurement is None


@pytest.mark.parametrize(
    "func", ["raise_torch_oom", "raise_cuda_oom_runtime", "raise_cudnn_not_supported", "train_oom_at_256"]
)
def test_out_of_memory_failures_are_oom(tmp_path: Path, func: str) -> None:
    outcome = run(tmp_path, spec(func, config=TrialConfig(batch_size=256)))
    assert outcome.status == "oom", outcome.error
    assert "\n" not in outcome.error and outcome.error
    assert outcome.stderr_tail


def test_abort_is_a_crash_with_the_signal(tmp_path: Path) -> None:
    outcome = run(tmp_path, spec("abort"))
    assert outcome.status == "crash"
    assert outcome.signal == "SIGABRT"
    assert outcome.error == "killed by SIGABRT"


def test_hanging_trial_times_out_and_leaves_no_process(tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild.pid"
    outcome = run(tmp_path, spec("hang_with_grandchild", env={PIDFILE_ENV: str(pidfile)}), timeout=5)
    assert outcome.status == "timeout"
    assert outcome.error == "no result within 5s"
    assert 5 <= outcome.wall_seconds < 60
    grandchild = int(pidfile.read_text())
    assert _gone(grandchild), f"grandchild {grandchild} survived the timeout"


def test_processes_left_by_a_finished_trial_are_killed(tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild.pid"
    outcome = run(tmp_path, spec("leave_grandchild", env={PIDFILE_ENV: str(pidfile)}))
    assert outcome.status == "ok", outcome.stderr_tail
    grandchild = int(pidfile.read_text())
    assert _gone(grandchild), f"grandchild {grandchild} survived its trial"


def test_ctx_record_reaches_the_measurement_extras(tmp_path: Path) -> None:
    outcome = run(tmp_path, spec("loader_start", config=TrialConfig(batch_size=32, num_workers=0)))
    assert outcome.status == "ok", outcome.stderr_tail
    assert 0 < outcome.measurement.extras["first_batch_seconds"] < 1.0


# Trial processes come from a forkserver, and a child inherits its context's start method; DataLoader
# workers must still be forked from the trial (~0.1 s), not started through a new forkserver that
# imports torch afresh (2-3 s per loader iterator, inside the timed windows).
def test_loader_workers_in_a_trial_start_as_fast_as_outside(tmp_path: Path) -> None:
    outcome = run(tmp_path, spec("loader_start", config=TrialConfig(batch_size=32, num_workers=1)))
    assert outcome.status == "ok", outcome.stderr_tail
    assert outcome.measurement.extras["first_batch_seconds"] < 1.0


def test_nan_loss_is_nan(tmp_path: Path) -> None:
    outcome = run(tmp_path, spec("nan_loss"))
    assert outcome.status == "nan"
    assert outcome.error.startswith("NonFiniteLoss: training loss is nan")


def test_no_measurement_is_an_error(tmp_path: Path) -> None:
    outcome = run(tmp_path, spec("no_window"))
    assert outcome.status == "error"
    assert "no timed window" in outcome.error


@pytest.mark.parametrize(
    "target, names",
    [
        ("{tmp}/missing.py:train", ["no such file", "missing.py"]),
        (f"{WORKLOADS}:no_such_function", ["no function 'no_such_function'"]),
        ("no_such_module_for_autotune:train", ["cannot import module 'no_such_module_for_autotune'"]),
        ("train", ["expected PATH.py:FUNCTION"]),
    ],
    ids=["missing-file", "missing-function", "missing-module", "no-colon"],
)
def test_bad_target_is_an_error_naming_it(tmp_path: Path, target: str, names: list[str]) -> None:
    target = target.format(tmp=tmp_path)
    outcome = run(tmp_path, spec("train_tiny", target=target))
    assert outcome.status == "error"
    assert outcome.error.startswith("WorkloadError: ")
    for name in names:
        assert name in outcome.error


def test_memory_limit_turns_a_huge_allocation_into_oom(tmp_path: Path) -> None:
    limited = run_isolated(spec("huge_allocation", memory_limit_gib=1.0), workdir=tmp_path / "limited", timeout=120)
    assert limited.status == "oom", limited.stderr_tail
    assert "allocate" in limited.error
    # The same workload runs when nothing limits it: the limit is what made it fail.
    free = run_isolated(spec("huge_allocation"), workdir=tmp_path / "free", timeout=120)
    assert free.status == "ok", free.stderr_tail


def test_a_stale_result_from_an_earlier_run_is_not_reused(tmp_path: Path) -> None:
    workdir = tmp_path / "trial"
    assert run(tmp_path, spec("train_tiny")).status == "ok"
    assert json.loads((workdir / "result.json").read_text())["status"] == "ok"
    outcome = run(tmp_path, spec("abort"))
    assert outcome.status == "crash"
    assert "ValueError" not in (workdir / "trial.log").read_text()


def test_spec_env_reaches_the_trial(tmp_path: Path) -> None:
    pidfile = tmp_path / "from-env.pid"
    run(tmp_path, spec("leave_grandchild", env={PIDFILE_ENV: str(pidfile)}))
    assert pidfile.is_file()
    assert PIDFILE_ENV not in os.environ  # set in the trial only


@pytest.mark.parametrize(
    "exc, status",
    [
        (NonFiniteLoss("training loss is nan"), "nan"),
        (MemoryError(), "oom"),
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "oom"),
        (RuntimeError("CUDA error: out of memory"), "oom"),
        (RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED"), "oom"),
        (RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory"), "oom"),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), "error"),
        (ValueError("out of memory"), "error"),  # only runtime errors are matched by message
        (KnobError("cuda_graphs needs a CUDA device"), "error"),
        (KeyboardInterrupt(), "error"),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else v,
)
def test_classify_exception(exc: BaseException, status: str) -> None:
    assert classify_exception(exc) == status


def test_cudnn_no_valid_algorithm_as_torch_words_it_is_oom() -> None:
    assert classify_exception(RuntimeError("Unable to find a valid cuDNN algorithm to run convolution")) == "oom"


def test_target_of_a_module_level_function_imports_back_to_it() -> None:
    target = target_of(workloads.train_tiny)
    assert target == f"{workloads.__name__}:train_tiny"
    assert load_target(target) is workloads.train_tiny


def test_load_target_by_path() -> None:
    fn = load_target(f"{WORKLOADS}:train_tiny")
    assert fn.__name__ == "train_tiny" and fn.__code__.co_filename == WORKLOADS


def test_target_of_refuses_lambdas_closures_and_methods() -> None:
    def local(ctx) -> None:
        pass

    class Holder:
        @staticmethod
        def train(ctx) -> None:
            pass

    for fn in (lambda ctx: None, local, Holder.train):
        with pytest.raises(WorkloadError, match="module-level function"):
            target_of(fn)


@pytest.mark.parametrize(
    "target, match",
    [("nocolon", "expected PATH.py:FUNCTION"), ("/no/such/dir/x.py:train", "no such file"),
     (f"{WORKLOADS}:PIDFILE_ENV", "no function 'PIDFILE_ENV'")],
)
def test_load_target_errors(target: str, match: str) -> None:
    with pytest.raises(WorkloadError, match=match):
        load_target(target)


@pytest.mark.parametrize("func", ["leave_thread", "leave_process"])
def test_a_trial_that_leaves_a_non_daemon_thread_or_process_is_finished_at_once(tmp_path: Path, func: str) -> None:
    # Its result holds the whole measurement: the lingering thread or process must not turn it into a timeout.
    pidfile = tmp_path / "left.pid"
    outcome = run(tmp_path, spec(func, env={PIDFILE_ENV: str(pidfile)}), timeout=20)
    assert outcome.status == "ok", (outcome.error, outcome.stderr_tail)
    assert outcome.measurement is not None and outcome.measurement.throughput > 0
    assert outcome.wall_seconds < 15
    left = int(pidfile.read_text())
    assert _gone(left), f"{left} (left by {func}) survived its trial"


def test_a_process_whose_exit_hangs_after_its_result_is_ended_by_the_launcher(tmp_path: Path) -> None:
    pidfile = tmp_path / "trial.pid"
    outcome = run(tmp_path, spec("exit_hangs", env={PIDFILE_ENV: str(pidfile)}), timeout=30)
    assert outcome.status == "ok", (outcome.error, outcome.stderr_tail)
    assert outcome.wall_seconds < 20
    trial = int(pidfile.read_text())
    assert _gone(trial), f"the trial process {trial} survived"


def test_a_trainer_library_is_preloaded_only_where_a_forked_trial_can_still_use_the_gpu() -> None:
    """A module is checked in a fresh interpreter before the trial server imports it for every trial: one that
    fails to import is left to the trials; without a GPU a touched driver cannot matter, so it is preloaded."""
    from autotune.study._isolation import _imports_without_cuda

    assert _imports_without_cuda(["json", "torch.nn"])
    assert not _imports_without_cuda(["no_such_module_for_autotune"])
