"""What runs inside a trial process: load ``train_fn``, apply the config, run it, classify how it ended.

The coordinator side (forking, limits, process groups, reaping) is ``autotune.study._isolation``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from autotune._config import Budget, TrialConfig, TrialOutcome
from autotune._errors import WorkloadError
from autotune._files import write_atomic
from autotune._target import load_target

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
    probe: Optional[str] = None  # "loader" or "step": measure that side of the trial alone (trial/_context)
    loader_variants: tuple[TrialConfig, ...] = ()  # a loader probe's further configs, measured in turn
    adopt_script_batch: bool = False  # the first reference run: train at the script's ctx.loader batch


# Set by the launcher on every rank of a trial of several processes (its value: the ranks). torch's own
# RANK/WORLD_SIZE alone do not make a rank: a tuner itself started under torchrun passes them to every trial.
RANKS_ENV = "AUTOTUNE_TRIAL_RANKS"
# The coordinator's working directory, in the environment a trial process is given: the process moves there
# before it imports the script (the trial server was started in the working directory of its day).
TRIAL_CWD_ENV = "AUTOTUNE_TRIAL_CWD"
# The exit code of a trial process that could not write its log or its result: an infrastructure fault.
INFRA_EXIT_CODE = 75  # EX_TEMPFAIL
# What an address-space limit (--memory-limit) breaks besides big allocations: threads and processes.
ADDRESS_SPACE_PATTERNS = ("can't start new thread", "bad_alloc", "Resource temporarily unavailable")


def classify_exception(exc: BaseException, *, memory_limited: bool = False) -> str:
    """Map an exception raised by a trial to a failure class.

    Args:
        memory_limited: The trial ran under ``--memory-limit``, whose address-space limit also makes
            thread and process creation fail: those count as out of memory.
    """
    import errno

    from autotune.trial._context import NonFiniteLoss

    if isinstance(exc, NonFiniteLoss):
        return "nan"
    if memory_limited and (any(p.lower() in str(exc).lower() for p in ADDRESS_SPACE_PATTERNS)
                           or (isinstance(exc, OSError) and exc.errno in (errno.ENOMEM, errno.EAGAIN))):
        return "oom"
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


def infra_fault(exc: BaseException, cache_dir: Optional[str] = None) -> str:
    """Why ``exc`` is a fault of the tuner's own files, not of the config ("" when it is not): a full disk
    anywhere, or an OS error on a file of the study's compile cache ``cache_dir``.

    Torch wraps what failed (``InductorError``, ``BackendCompilerFailed``): the whole chain is read.
    """
    import errno

    seen: set[int] = set()
    current: Optional[BaseException] = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = str(current)
        if (isinstance(current, OSError) and current.errno in (errno.ENOSPC, errno.EDQUOT)) or \
                "No space left on device" in text:
            return f"the disk is full: {_one_line(current)}"
        if cache_dir and isinstance(current, OSError) and (
                str(current.filename or "").startswith(cache_dir) or cache_dir in text):
            return f"the study's compile cache {cache_dir} failed: {_one_line(current)}"
        current = current.__cause__ or current.__context__
    if cache_dir and cache_dir in str(exc) and any(
            name in type(exc).__name__ for name in ("InductorError", "BackendCompilerFailed")) and "Errno" in str(exc):
        return f"the study's compile cache {cache_dir} failed: {_one_line(exc)}"
    return ""


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:500]


def _limit_address_space(extra_gib: float) -> None:
    import resource

    with open("/proc/self/status") as status:
        vm_kib = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
    limit = vm_kib * 1024 + int(extra_gib * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))


def execute(spec: TrialSpec, compile_clock_path: Optional[str] = None,
            partial_path: Optional[str] = None) -> TrialOutcome:
    """Run one trial in this process and classify how it ended. Used by the trial child.

    Args:
        spec: What to run.
        compile_clock_path: Where to keep the compile clock the coordinator's compile deadline reads
            (only when the config compiles).
        partial_path: Where a loader probe keeps the rates it measured so far, for a coordinator that
            kills it at its deadline.
    """
    import torch

    from autotune.trial import _compile_cache, _distributed, _knobs, _phase
    from autotune.trial._context import ProbeDone, TrialContext, TrialPruned

    start = time.perf_counter()
    discarded: list[str] = []
    if spec.config.compile != "off":
        _compile_cache.apply_switches()  # the study's compile cache, before anything compiles
        if os.environ.get(_compile_cache.OWN_CACHE_ENV):
            discarded = _compile_cache.discard_corrupt_entries(Path(os.environ[_compile_cache.CACHE_DIR_ENV]))
            if discarded:
                print(f"autotune trial: discarded {len(discarded)} corrupt compile cache entries, e.g. {discarded[0]}",
                      file=sys.stderr, flush=True)
        if compile_clock_path is not None:
            _phase.install(compile_clock_path, spec.config.compile)
    rank = _distributed.rank_from_env() if RANKS_ENV in os.environ else None
    try:
        fn = load_target(spec.target)
        device = _distributed.device_for(rank) if rank is not None else _knobs.pick_device()
        if spec.memory_limit_gib is not None and device.type == "cpu":
            _limit_address_space(spec.memory_limit_gib)
        copies = spec.config.processes_per_gpu
        if rank is None and copies > 1 and device.type == "cpu" and spec.config.cpu_threads is None:
            _share_cores(copies)  # co-located copies on the CPU share its cores, as they share a GPU
        if rank is not None:
            if device.type == "cpu" and spec.config.cpu_threads is None:
                _share_cores(rank.world_size)
            _distributed.start(rank, device)
        torch.manual_seed(spec.seed)
        with _knobs.applied(spec.config, device):
            ctx = TrialContext(
                config=spec.config,
                budget=spec.budget,
                seed=spec.seed,
                baseline_batch_size=spec.baseline_batch_size,
                device=device,
                prune_below=spec.prune_below,
                probe=spec.probe,
                loader_variants=spec.loader_variants,
                adopt_script_batch=spec.adopt_script_batch,
                partial_path=partial_path,
                started=start,
            )
            try:
                returned = fn(ctx)
            except ProbeDone:
                return TrialOutcome("ok", ctx.measurement(), run_seconds=time.perf_counter() - start)
            except TrialPruned as pruned:
                # Hopeless: keep what the first window measured, so the sampler and the dashboard see it.
                return TrialOutcome("pruned", ctx.measurement(), error=str(pruned),
                                    run_seconds=time.perf_counter() - start)
            if spec.probe == "loader":
                raise WorkloadError("a loader probe needs train_fn to build its loader with ctx.loader or "
                                    "ctx.image_loader; it returned without one")
            if returned is not None:
                if isinstance(returned, (int, float)) and not isinstance(returned, bool) and ctx.metric is None:
                    ctx.report_metric(returned)  # a returned number is taken as the metric
                else:
                    raise WorkloadError(
                        f"train_fn returned a {type(returned).__name__}; it should return None and report "
                        "with ctx.report_metric(...), or return the metric as a number"
                    )
            if discarded:
                ctx.extras["compile_cache_discarded"] = len(discarded)
            measurement = ctx.measurement()
        return TrialOutcome("ok", measurement, run_seconds=time.perf_counter() - start)
    except BaseException as exc:  # noqa: BLE001 - every way a trial ends must be classified
        traceback.print_exc()
        infra = infra_fault(exc, os.environ.get(_compile_cache.CACHE_DIR_ENV) if spec.config.compile != "off" else None)
        if infra:
            return TrialOutcome("infra", error=infra, run_seconds=time.perf_counter() - start)
        status = "error" if isinstance(exc, WorkloadError) else classify_exception(
            exc, memory_limited=spec.memory_limit_gib is not None)
        return TrialOutcome(status, error=_one_line(exc), run_seconds=time.perf_counter() - start)  # type: ignore[arg-type]
    # A rank's process group is never torn down here: the trial process writes its result, then ends with
    # os._exit, which skips the teardown. Tearing it down first can hang before the result exists (torch
    # 2.13.0's CPU build joins gloo's threads in ~ProcessGroupGloo; a failed peer leaves it waiting too).


def _share_cores(ranks: int) -> None:
    """Give each CPU rank its share of the cores (torch would start as many threads as cores in every rank)."""
    import torch

    from autotune.hardware._machine import usable_cpus

    torch.set_num_threads(max(1, usable_cpus() // ranks))


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


def _child(spec: TrialSpec, result_path: str, log_path: str, coordinator: int, environ: dict[str, str],
           compile_clock_path: Optional[str] = None, partial_path: Optional[str] = None) -> None:
    os.setsid()  # own process group: the parent kills it whole, DataLoader workers included
    _die_with_coordinator(coordinator)
    if sys.platform.startswith("linux"):
        # A forkserver child inherits "forkserver" as its default start method; the user's DataLoader
        # workers would then have to unpickle a dataset defined in a file loaded by path. Give the
        # trial the platform's usual default instead.
        multiprocessing.set_start_method("fork", force=True)
    try:
        # Never through a link planted at its name (the coordinator removed one before the trial started).
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as exc:
        print(f"autotune trial: cannot open its log {log_path}: {exc}", file=sys.stderr, flush=True)
        os._exit(INFRA_EXIT_CODE)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    import faulthandler

    faulthandler.enable(all_threads=False)  # a segfault or abort leaves its Python stack in the log
    # The forkserver's environment is the one it started with; a trial gets the coordinator's current
    # one (e.g. CUDA_VISIBLE_DEVICES set after the first trial), before anything initialises CUDA.
    environ = dict(environ)
    cwd = environ.pop(TRIAL_CWD_ENV, None)
    os.environ.clear()
    os.environ.update(environ)
    if spec.env:
        os.environ.update(spec.env)
    if cwd:
        try:
            os.chdir(cwd)  # trials run where the study was started: relative paths in the script mean the same
        except OSError as exc:
            print(f"autotune trial: cannot enter the study's working directory {cwd}: {exc}", file=sys.stderr,
                  flush=True)
    try:
        outcome = execute(spec, compile_clock_path, partial_path)
    except OSError:  # the log itself cannot be written (a full disk): nothing to classify, nowhere to say it
        os._exit(INFRA_EXIT_CODE)
    try:
        # When it ended, for the launcher: of the ranks of one trial, the first to fail is the one to name.
        text = json.dumps({**outcome.to_dict(), "ended_at": time.time()})
    except (TypeError, ValueError) as exc:  # something the workload handed over is not JSON
        text = json.dumps(TrialOutcome("error", error=f"the trial's result is not JSON-serialisable: {exc}",
                                       run_seconds=outcome.run_seconds).to_dict())
    # The log is complete before the result exists: the launcher may end the process once it sees the result.
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError:
        pass  # a full disk: the log loses its tail, the result below says whether the trial is lost too
    try:
        write_atomic(result_path, text)
    except OSError as exc:
        try:
            print(f"autotune trial: cannot write its result {result_path}: {exc}", file=sys.stderr, flush=True)
        except OSError:
            pass
        os._exit(INFRA_EXIT_CODE)
    # Written: the trial is over. A normal exit would wait for every non-daemon thread and join every
    # non-daemon multiprocessing child that train_fn left running (the launcher kills its group).
    os._exit(0)
