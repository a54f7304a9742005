"""One process per trial: its own process group, a wall-clock limit, and a classified failure.

Trial processes are forked from a forkserver that has already imported torch (but never touched
CUDA), so isolation does not cost a torch import per trial. Each child starts its own session, so a
timeout kills the whole group, DataLoader workers included.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import multiprocessing
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from autotune._config import Budget, TrialConfig, TrialOutcome
from autotune._errors import WorkloadError

OOM_PATTERNS = (
    "out of memory",
    "CUDNN_STATUS_NOT_SUPPORTED",
    "unable to find a valid cuDNN algorithm",
    "can't allocate memory",
    "Cannot allocate memory",
)
# Errors after which the CUDA context is unusable until the process ends.
CUDA_FATAL_PATTERNS = (
    "illegal memory access",
    "device-side assert",
    "unspecified launch failure",
    "misaligned address",
    "illegal instruction",
)
STDERR_TAIL_CHARS = 2000


@dataclass(frozen=True)
class TrialSpec:
    """Everything a trial process needs; plain data, so it crosses the process boundary."""

    target: str
    config: TrialConfig
    budget: Budget
    seed: int = 0
    baseline_batch_size: int = 64
    memory_limit_gib: Optional[float] = None
    env: Optional[dict[str, str]] = None
    prune_below: Optional[float] = None  # samples/s under which the first window stops the trial


def target_of(fn: Callable[..., Any]) -> str:
    """The ``module:function`` or ``path.py:function`` a trial process can import ``fn`` from.

    Raises:
        WorkloadError: ``fn`` is a lambda, a closure or otherwise not importable by name.
    """
    name = getattr(fn, "__qualname__", "")
    module = getattr(fn, "__module__", None)
    if not name or "<" in name or "." in name or module is None:
        raise WorkloadError(
            f"train_fn must be a module-level function, got {getattr(fn, '__qualname__', fn)!r}; "
            "trials run in separate processes and import it by name"
        )
    if module == "__main__":
        path = getattr(sys.modules["__main__"], "__file__", None)
        if not path:
            raise WorkloadError("train_fn is defined in an interactive session; put it in a .py file")
        return f"{os.path.abspath(path)}:{name}"
    return f"{module}:{name}"


def load_target(target: str) -> Callable[..., Any]:
    """Import ``path/to/file.py:func`` or ``package.module:func``.

    Raises:
        WorkloadError: the file, module or function is missing.
    """
    module_part, sep, func_name = target.rpartition(":")
    if not sep or not module_part or not func_name:
        raise WorkloadError(f"{target}: expected PATH.py:FUNCTION or MODULE:FUNCTION")
    if module_part.endswith(".py") or os.sep in module_part:
        path = Path(module_part)
        if not path.is_file():
            raise WorkloadError(f"{target}: no such file {module_part}")
        mod_name = f"_autotune_workload_{path.stem}"
        spec = importlib.util.spec_from_file_location(mod_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        sys.path.insert(0, str(path.resolve().parent))
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_part)
        except ModuleNotFoundError as exc:
            raise WorkloadError(f"{target}: cannot import module {exc.name!r}") from None
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise WorkloadError(f"{target}: {module_part} has no function {func_name!r}")
    return fn


def classify_exception(exc: BaseException) -> str:
    """Map an exception raised by a trial to a failure class."""
    from autotune._context import NonFiniteLoss

    if isinstance(exc, NonFiniteLoss):
        return "nan"
    if isinstance(exc, MemoryError):
        return "oom"
    oom_type = getattr(sys.modules.get("torch"), "OutOfMemoryError", None)
    if oom_type is not None and isinstance(exc, oom_type):
        return "oom"
    message = str(exc).lower()  # torch words these in varying case ("Unable to find a valid cuDNN ...")
    if isinstance(exc, RuntimeError) and any(p.lower() in message for p in OOM_PATTERNS):
        return "oom"
    if isinstance(exc, RuntimeError) and any(p.lower() in message for p in CUDA_FATAL_PATTERNS):
        return "cuda_fatal"
    return "error"


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:500]


def _limit_address_space(extra_gib: float) -> None:
    import resource

    with open("/proc/self/status") as status:
        vm_kib = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
    limit = vm_kib * 1024 + int(extra_gib * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))


def execute(spec: TrialSpec) -> TrialOutcome:
    """Run one trial in this process and classify how it ended. Used by the trial child."""
    import torch

    from autotune import _knobs
    from autotune._context import TrialContext, TrialPruned

    start = time.perf_counter()
    try:
        fn = load_target(spec.target)
        device = _knobs.pick_device()
        if spec.memory_limit_gib is not None and device.type == "cpu":
            _limit_address_space(spec.memory_limit_gib)
        torch.manual_seed(spec.seed)
        with _knobs.applied(spec.config, device):
            ctx = TrialContext(
                config=spec.config,
                budget=spec.budget,
                seed=spec.seed,
                baseline_batch_size=spec.baseline_batch_size,
                device=device,
                prune_below=spec.prune_below,
            )
            try:
                returned = fn(ctx)
            except TrialPruned as pruned:
                # Hopeless: keep what the first window measured, so the sampler and the dashboard see it.
                return TrialOutcome("pruned", ctx.measurement(), error=str(pruned),
                                    run_seconds=time.perf_counter() - start)
            if returned is not None:
                if isinstance(returned, (int, float)) and not isinstance(returned, bool) and ctx.metric is None:
                    ctx.report_metric(returned)  # a returned number is taken as the metric
                else:
                    raise WorkloadError(
                        f"train_fn returned a {type(returned).__name__}; it should return None and report "
                        "with ctx.report_metric(...), or return the metric as a number"
                    )
            measurement = ctx.measurement()
        return TrialOutcome("ok", measurement, run_seconds=time.perf_counter() - start)
    except BaseException as exc:  # noqa: BLE001 - every way a trial ends must be classified
        traceback.print_exc()
        status = "error" if isinstance(exc, WorkloadError) else classify_exception(exc)
        return TrialOutcome(status, error=_one_line(exc), run_seconds=time.perf_counter() - start)  # type: ignore[arg-type]


def _die_with_coordinator(pid: int, interval: float = 1.0) -> None:
    """Kill this trial's process group once the coordinator is gone.

    A trial must not outlive a SIGKILLed tuner and hold the GPU. Its parent is the forkserver, which
    itself lives as long as any trial holds its liveness pipe, so a parent-death signal would never
    fire: poll the coordinator instead.
    """
    import threading

    def watch() -> None:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os.killpg(0, signal.SIGKILL)
            except PermissionError:
                pass
            time.sleep(interval)

    threading.Thread(target=watch, name="autotune-coordinator-watch", daemon=True).start()


def _child(spec: TrialSpec, result_path: str, log_path: str, coordinator: int, environ: dict[str, str]) -> None:
    os.setsid()  # own process group: the parent kills it whole, DataLoader workers included
    _die_with_coordinator(coordinator)
    if sys.platform.startswith("linux"):
        # A forkserver child inherits "forkserver" as its default start method; the user's DataLoader
        # workers would then have to unpickle a dataset defined in a file loaded by path. Give the
        # trial the platform's usual default instead.
        multiprocessing.set_start_method("fork", force=True)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    import faulthandler

    faulthandler.enable(all_threads=False)  # a segfault or abort leaves its Python stack in the log
    # The forkserver's environment is the one it started with; a trial gets the coordinator's current
    # one (e.g. CUDA_VISIBLE_DEVICES set after the first trial), before anything initialises CUDA.
    os.environ.clear()
    os.environ.update(environ)
    if spec.env:
        os.environ.update(spec.env)
    outcome = execute(spec)
    tmp = result_path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(outcome.to_dict(), fh)
    os.replace(tmp, result_path)
    sys.stdout.flush()
    sys.stderr.flush()


_CONTEXT: Optional[Any] = None


def _mp_context() -> Any:
    global _CONTEXT
    if _CONTEXT is None:
        if "forkserver" in multiprocessing.get_all_start_methods():
            _CONTEXT = multiprocessing.get_context("forkserver")
            # Import torch once in the server (it does not initialise CUDA), not once per trial. Building
            # any torch.optim optimizer imports torch._dynamo (seconds on a small CPU), so preload it too.
            _CONTEXT.set_forkserver_preload(["torch", "torch._dynamo", "autotune._context", "autotune._isolation"])
        else:
            _CONTEXT = multiprocessing.get_context("spawn")
    return _CONTEXT


def start_trial_server() -> None:
    """Start the process that forks trials now (it imports torch: seconds), not inside the first trial.

    Otherwise the first trial of a run that has no reference run to do (a resume, a joining worker)
    pays the start-up in its own wall time, which is then counted as that trial's overhead.
    """
    context = _mp_context()
    if context.get_start_method() == "forkserver":
        # The server imports its preload after it is launched; the first fork waits for that import.
        ready = context.Process(target=_nothing)
        ready.start()
        ready.join()


def _nothing() -> None:
    pass


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - STDERR_TAIL_CHARS))
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


def _kill_group(pid: int) -> None:
    for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            kill()
        except (ProcessLookupError, PermissionError):
            pass


def run_isolated(spec: TrialSpec, *, workdir: Path, timeout: float) -> TrialOutcome:
    """Run one trial in a fresh process under a wall-clock limit.

    Args:
        spec: What to run.
        workdir: Where the trial's log (stdout and stderr) and result file go.
        timeout: Seconds before the trial's whole process group is killed.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    result_path = workdir / "result.json"
    log_path = workdir / "trial.log"
    for stale in (result_path, log_path):
        stale.unlink(missing_ok=True)
    start = time.perf_counter()
    proc = _mp_context().Process(
        target=_child,
        args=(spec, str(result_path), str(log_path), os.getpid(), dict(os.environ)),
        daemon=False,
    )
    proc.start()
    assert proc.pid is not None
    proc.join(timeout)
    timed_out = proc.is_alive()
    _kill_group(proc.pid)  # on timeout, and to reap anything a finished trial left behind
    proc.join()
    wall = time.perf_counter() - start
    tail = _tail(log_path)
    if timed_out:
        return TrialOutcome("timeout", error=f"no result within {timeout:.0f}s", stderr_tail=tail, wall_seconds=wall)
    if result_path.exists():
        data = json.loads(result_path.read_text())
        outcome = TrialOutcome.from_dict({**data, "stderr_tail": tail if data["status"] != "ok" else ""})
        return dataclasses.replace(outcome, wall_seconds=wall)
    code = proc.exitcode or 0
    if code < 0:
        name = signal.Signals(-code).name
        return TrialOutcome("crash", error=f"killed by {name}", signal=name, stderr_tail=tail, wall_seconds=wall)
    return TrialOutcome("crash", error=f"exited with code {code} and no result", stderr_tail=tail, wall_seconds=wall)
