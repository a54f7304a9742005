"""One process per trial, from the coordinator's side: its own process group, a wall-clock limit, reaping.

A compiling trial also has a compile deadline: the coordinator polls the compile clock the trial keeps
in its workdir (``autotune.trial._phase``) and ends the trial as ``compile_timeout`` once torch.compile
has worked longer than that.

Trial processes are forked from a forkserver that has already imported torch (but never touched
CUDA), so isolation does not cost a torch import per trial. Each child starts its own session, so a
timeout kills the whole group, DataLoader workers included.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from autotune._config import TrialOutcome
from autotune._errors import AutotuneError
from autotune.hardware import Capabilities
from autotune.hardware._machine import capabilities_from_answer, probe, probe_into
from autotune.study._signals import track_group, untrack_group
from autotune.trial._execute import ADDRESS_SPACE_PATTERNS, INFRA_EXIT_CODE, TrialSpec, _child
from autotune.trial._phase import read_compile_seconds

STDERR_TAIL_CHARS = 2000
COMPILE_POLL_SECONDS = 0.25  # how often a compiling trial's clock is read: the deadline's resolution


_CONTEXT: Optional[Any] = None
# Import torch once in the server (it does not initialise CUDA), not once per trial. Building any torch.optim
# optimizer imports torch._dynamo (seconds on a small CPU), so preload it too.
_PRELOAD = ["torch", "torch._dynamo", "autotune.trial._context", "autotune.trial._execute"]


def _mp_context() -> Any:
    global _CONTEXT
    if _CONTEXT is None:
        if "forkserver" in multiprocessing.get_all_start_methods():
            _CONTEXT = multiprocessing.get_context("forkserver")
            _CONTEXT.set_forkserver_preload(list(_PRELOAD))
        else:
            _CONTEXT = multiprocessing.get_context("spawn")
    return _CONTEXT


def preload_in_trial_server(*modules: str) -> None:
    """Have the trial server import ``modules`` as well, so that each trial does not (a trainer library: seconds).

    Call it between studies, with no trial running: a server already started without them is stopped, and
    the next trial starts it again with them. Only modules that import without touching CUDA belong here
    (trials are forked from the server); one that fails to import is left to the trials.
    """
    new = [m for m in modules if m not in _PRELOAD]
    if not new:
        return
    _PRELOAD.extend(new)
    if _CONTEXT is not None and _CONTEXT.get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver._forkserver._stop()  # a no-op when it has not started
        _CONTEXT.set_forkserver_preload(list(_PRELOAD))


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


def probe_in_trial_server(target: Optional[str], *, timeout: float = 300.0) -> Capabilities:
    """``hardware.probe`` in a process forked from the trial server, which has torch imported already.

    The same answer as a fresh probe process (the fork has not touched CUDA either), without paying a
    second torch import per study. Falls back to ``hardware.probe`` where there is no forkserver.

    Raises:
        WorkloadError: ``target`` cannot be imported.
        AutotuneError: the probe process died or did not answer.
    """
    context = _mp_context()
    if context.get_start_method() != "forkserver":
        return probe(target=target, timeout=timeout)
    receive, send = context.Pipe(duplex=False)
    with tempfile.TemporaryDirectory(prefix="autotune-probe-") as folder:
        log_path = os.path.join(folder, "probe.log")
        process = context.Process(target=probe_into, args=(send, target, log_path), daemon=True)
        process.start()
        send.close()
        try:
            if not receive.poll(timeout):
                raise AutotuneError(f"the hardware probe did not answer within {timeout:.0f}s")
            answer = receive.recv()
        except EOFError:
            process.join(5)
            output = Path(log_path).read_text(errors="replace").strip().splitlines() if os.path.exists(log_path) else []
            raise AutotuneError(f"the hardware probe gave no answer (did {target or 'it'} exit at import?): "
                                f"{(output or [f'exit code {process.exitcode}'])[-1][:300]}") from None
        finally:
            if process.is_alive():
                process.join(10)
            if process.is_alive():
                process.kill()
                process.join()
            receive.close()
    return capabilities_from_answer(answer)


def _nothing() -> None:
    pass


def _trial_server_dead(wait: float = 0.0) -> bool:
    """Whether the forkserver was started and has died since (it is then a zombie, or gone).

    Args:
        wait: Seconds to keep looking: a killed server closes its pipes (which ends the trial's wait)
            a moment before it is a zombie.
    """
    deadline = time.monotonic() + wait
    while not _server_gone():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _server_gone() -> bool:
    from multiprocessing import forkserver

    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return os.path.exists("/proc/self")  # gone from a working /proc: dead (without /proc: cannot tell)


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


def _result(result_path: Path, tail: str, wall: float) -> Optional[TrialOutcome]:
    """The outcome the trial wrote (atomically, by rename), or None when it wrote none."""
    try:
        data = json.loads(result_path.read_text())
    except (OSError, ValueError):
        return None
    outcome = TrialOutcome.from_dict({**data, "stderr_tail": tail if data["status"] != "ok" else ""})
    return dataclasses.replace(outcome, wall_seconds=wall)


def run_isolated(spec: TrialSpec, *, workdir: Path, timeout: float,
                 compile_timeout: Optional[float] = None) -> TrialOutcome:
    """Run one trial in a fresh process under a wall-clock limit, and its compiles under their own.

    Args:
        spec: What to run.
        workdir: Where the trial's log (stdout and stderr), compile clock and result file go.
        timeout: Seconds before the trial's whole process group is killed.
        compile_timeout: Seconds of torch.compile work (as the trial's compile clock counts them) before
            the group is killed and the trial ends as ``compile_timeout``; ``None``: no compile deadline.
    """
    result_path = workdir / "result.json"
    log_path = workdir / "trial.log"
    clock_path = workdir / "compile_clock.json"
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        for stale in (result_path, log_path, clock_path):
            stale.unlink(missing_ok=True)
    except OSError as exc:
        return TrialOutcome("infra", error=f"cannot prepare the trial's folder {workdir}: {exc.strerror or exc}")
    if _trial_server_dead():
        start_trial_server()  # a killed server is started again now, not inside the trial's wall time
    start = time.perf_counter()
    proc = _mp_context().Process(
        target=_child,
        args=(spec, str(result_path), str(log_path), os.getpid(), dict(os.environ), str(clock_path)),
        daemon=False,
    )
    proc.start()
    assert proc.pid is not None
    track_group(proc.pid)  # a second Ctrl-C kills it at once
    watch_compile = compile_timeout is not None and spec.config.compile != "off"
    compile_over: Optional[tuple[str, float]] = None
    try:
        if watch_compile:
            assert compile_timeout is not None
            while compile_over is None:
                left = timeout - (time.perf_counter() - start)
                if left <= 0:
                    break
                proc.join(min(COMPILE_POLL_SECONDS, left))
                if not proc.is_alive():
                    break
                mode, seconds = read_compile_seconds(str(clock_path))
                if seconds > compile_timeout:
                    compile_over = (mode or spec.config.compile, seconds)
        else:
            proc.join(timeout)
    except BaseException as exc:
        # Ctrl-C or SIGTERM: end the trial now (multiprocessing would otherwise join it at exit), and
        # hand on its result if it had already written one.
        _kill_group(proc.pid)
        proc.join(5)
        untrack_group(proc.pid)
        finished = _result(result_path, _tail(log_path), time.perf_counter() - start)
        try:
            exc.finished_outcome = finished  # type: ignore[attr-defined]
        except AttributeError:  # an exception type that takes no attributes: the result is lost with it
            pass
        raise
    timed_out = proc.is_alive()
    _kill_group(proc.pid)  # on a deadline, and to reap anything a finished trial left behind
    proc.join()
    untrack_group(proc.pid)
    wall = time.perf_counter() - start
    tail = _tail(log_path)
    if compile_over is not None:
        mode, seconds = compile_over
        return TrialOutcome("compile_timeout", stderr_tail=tail, wall_seconds=wall,
                            error=f"compile={mode} still compiling after {seconds:.0f}s "
                                  f"(compile timeout {compile_timeout:g}s)")
    if timed_out:
        return TrialOutcome("timeout", error=f"no result within {timeout:.0f}s", stderr_tail=tail, wall_seconds=wall)
    outcome = _result(result_path, tail, wall)
    if outcome is not None:
        return outcome
    code = proc.exitcode or 0
    if code == INFRA_EXIT_CODE:
        return TrialOutcome("infra", error="the trial process could not write its log or result "
                            f"(its folder {workdir} vanished or is not writable)", stderr_tail=tail, wall_seconds=wall)
    if code == 255 and _trial_server_dead(wait=2.0):
        # The forkserver reports a child's exit; when it dies, every trial it forked reads as code 255.
        start_trial_server()
        return TrialOutcome("infra", error="the trial server (forkserver) died during the trial; it was restarted",
                            stderr_tail=tail, wall_seconds=wall)
    if spec.memory_limit_gib is not None and any(p in tail for p in ADDRESS_SPACE_PATTERNS + ("Cannot allocate memory",)):
        return TrialOutcome("oom", error=f"exited with code {code} under --memory-limit {spec.memory_limit_gib:g} GiB "
                            "(the address-space limit stopped an allocation, a thread or a process)",
                            stderr_tail=tail, wall_seconds=wall)
    if code < 0:
        name = signal.Signals(-code).name
        return TrialOutcome("crash", error=f"killed by {name}", signal=name, stderr_tail=tail, wall_seconds=wall)
    return TrialOutcome("crash", error=f"exited with code {code} and no result", stderr_tail=tail, wall_seconds=wall)
