"""Trial processes, from the coordinator's side: each in its own process group, a wall-clock limit, reaping.

A trial is one process, or ``processes_per_trial`` ranks of a DDP job that rendezvous through torch's
env:// variables on a free local port (``launch`` starts any such set of processes and ends them together;
``run_isolated`` turns what they left into the trial's outcome).

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
import multiprocessing.connection
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from autotune._config import TrialOutcome
from autotune._errors import AutotuneError
from autotune._target import script_argv_env
from autotune.hardware import Capabilities
from autotune.hardware._machine import capabilities_from_answer, no_answer_error, probe, probe_into
from autotune.study._signals import track_group, untrack_group
from autotune.trial._execute import ADDRESS_SPACE_PATTERNS, INFRA_EXIT_CODE, RANKS_ENV, TRIAL_CWD_ENV, TrialSpec, _child
from autotune.trial._phase import read_compile_seconds

STDERR_TAIL_CHARS = 2000
COMPILE_POLL_SECONDS = 0.25  # how often a compiling trial's clock is read: the deadline's resolution
RESULT_POLL_SECONDS = 0.5  # how often the launcher looks for results written by processes still running
# A trial process exits as soon as it has written its result (``_child``); one still there this long after
# is stuck in its exit, and its group is killed: the result stands.
RESULT_GRACE_SECONDS = 5.0


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
    if not new or not _imports_without_cuda(new):
        return
    _PRELOAD.extend(new)
    if _CONTEXT is not None and _CONTEXT.get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver._forkserver._stop()  # a no-op when it has not started
        _CONTEXT.set_forkserver_preload(list(_PRELOAD))


def _imports_without_cuda(modules: Sequence[str]) -> bool:
    """Whether a process forked after importing ``modules`` can still use the GPU, tried in a fresh interpreter:
    a library that touches CUDA at import (transformers 5.17 with accelerate did, on an H100) leaves every trial
    forked from the server unable to ("Cannot re-initialize CUDA in forked subprocess"). Such modules are left
    to each trial to import; so is a module that fails to import. Without a GPU it cannot matter."""
    # A fork after the imports tells: torch marks a child forked once CUDA's driver was touched as a bad fork,
    # which matters only where there is a GPU (asked after the fork, in this throwaway interpreter).
    code = ("import importlib, os, sys, torch\n"
            f"for name in {list(modules)!r}: importlib.import_module(name)\n"
            "pid = os.fork()\n"
            "if pid == 0: os._exit(1 if torch.cuda._is_in_bad_fork() else 0)\n"
            "bad = os.waitpid(pid, 0)[1] != 0\n"
            "sys.exit(1 if bad and torch.cuda.is_available() else 0)\n")
    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=300).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


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


def probe_in_trial_server(target: Optional[str], *, timeout: float = 300.0,
                          script_args: Optional[Sequence[str]] = None) -> Capabilities:
    """``hardware.probe`` in a process forked from the trial server, which has torch imported already.

    The same answer as a fresh probe process (the fork has not touched CUDA either), without paying a
    second torch import per study. Falls back to ``hardware.probe`` where there is no forkserver. The target
    is imported as a trial imports it: in the coordinator's working directory and environment, with
    ``script_args`` as its ``sys.argv[1:]`` when given.

    Raises:
        WorkloadError: ``target`` cannot be imported.
        AutotuneError: the probe process died or did not answer.
    """
    environ = trial_environ()
    if script_args is not None:
        environ.update(script_argv_env(script_args))
    context = _mp_context()
    if context.get_start_method() != "forkserver":
        return probe(target=target, timeout=timeout, env=environ)
    receive, send = context.Pipe(duplex=False)
    with tempfile.TemporaryDirectory(prefix="autotune-probe-") as folder:
        log_path = os.path.join(folder, "probe.log")
        process = context.Process(target=probe_into, args=(send, target, log_path, environ, os.getcwd()), daemon=True)
        process.start()
        send.close()
        try:
            if not receive.poll(timeout):
                raise AutotuneError(f"the hardware probe did not answer within {timeout:.0f}s")
            answer = json.loads(receive.recv())
        except EOFError:
            process.join(5)
            output = Path(log_path).read_text(errors="replace").strip().splitlines() if os.path.exists(log_path) else []
            raise no_answer_error(target, (output or [f"exit code {process.exitcode}"])[-1]) from None
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


def trial_environ() -> dict[str, str]:
    """The coordinator's environment as a trial gets it: without the storage URL (``STORAGE_ENV``), whose
    password the user's code has no need of, and with the coordinator's working directory (``TRIAL_CWD_ENV``,
    which the trial process moves to and takes out: the trial server's own may be an older one)."""
    from autotune.study._storage import STORAGE_ENV

    environ = {key: value for key, value in os.environ.items() if key != STORAGE_ENV}
    environ[TRIAL_CWD_ENV] = os.getcwd()
    return environ


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


# What a trial's log keeps once the trial has ended: its first and its last bytes. A script that prints
# 100 MB a run would otherwise fill the disk in a few hundred trials; its start (the errors of setting up)
# and its end (the error that ended it) are what a person reads.
LOG_HEAD_BYTES = 1 << 20
LOG_TAIL_BYTES = 4 << 20


def cap_log(path: Path, *, head: int = LOG_HEAD_BYTES, tail: int = LOG_TAIL_BYTES) -> None:
    """Cut the log at ``path`` to its first ``head`` and last ``tail`` bytes, in place, with a line between
    that says how much was cut (a log that cannot be read or written is left as it is)."""
    try:
        size = path.stat().st_size
        if size <= head + tail:
            return
        with open(path, "r+b") as handle:
            handle.seek(size - tail)
            end = handle.read(tail)
            handle.seek(head)
            handle.write(f"\n[autotune: {size - head - tail:,} bytes of this log cut here; it keeps its first "
                         f"{head:,} and last {tail:,} bytes]\n".encode())
            handle.write(end)
            handle.truncate()
    except OSError:
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


# Each launch's processes carry a tag of their own in their environment, which their descendants inherit
# (also one that starts a session of its own, out of the reach of a group kill, and one whose parent died).
TRIAL_TAG_ENV = "AUTOTUNE_TRIAL_TAG"


def _process_table() -> dict[int, tuple[int, bytes]]:
    """Every process this one may read: pid -> (parent pid, initial environment block)."""
    table: dict[int, tuple[int, bytes]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as stat:
                parent = int(stat.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{entry.name}/environ", "rb") as environ:
                block = environ.read()
        except (OSError, IndexError, ValueError):
            continue  # gone, or another user's
        table[int(entry.name)] = (parent, block)
    return table


def kill_leftovers(roots: Sequence[int], tag: str) -> list[int]:
    """SIGKILL what a launch's processes (``roots``) left behind that a group kill cannot reach: their
    descendants still in the process tree, and any process whose environment carries the launch's ``tag``
    (one that started its own session, or whose parent died). Returns the pids signalled. Linux only (no
    /proc: nothing is done)."""
    if not os.path.isdir("/proc"):
        return []
    table = _process_table()
    marker = f"{TRIAL_TAG_ENV}={tag}".encode()
    found = {pid for pid, (_, block) in table.items() if marker in block.split(b"\0")}
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    found -= {os.getpid(), *roots}
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return sorted(found)


def _free_port() -> int:
    """A TCP port free on the loopback now, for one trial's rendezvous (the ranks bind it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _result(result_path: Path, tail: str, wall: float) -> Optional[TrialOutcome]:
    """The outcome the trial wrote (atomically, by rename), or None when it wrote none."""
    try:
        data = json.loads(result_path.read_text())
    except (OSError, ValueError):
        return None
    outcome = TrialOutcome.from_dict({**data, "stderr_tail": tail if data["status"] != "ok" else ""})
    return dataclasses.replace(outcome, wall_seconds=wall)


def read_partial(workdir: Path) -> Optional[dict[str, Any]]:
    """What a loader probe in ``workdir`` measured before it ended without a result (a deadline killed it),
    or None: ``rates``, ``errors`` and ``windows`` of the configs it finished, in order."""
    try:
        return json.loads(ProcessFiles(folder=workdir).partial.read_text())
    except (OSError, ValueError):
        return None


@dataclass(frozen=True, kw_only=True)
class ProcessFiles:
    """Where one trial process writes: its log (stdout and stderr), compile clock and result."""

    folder: Path

    @property
    def result(self) -> Path:
        return self.folder / "result.json"

    @property
    def log(self) -> Path:
        return self.folder / "trial.log"

    @property
    def clock(self) -> Path:
        return self.folder / "compile_clock.json"

    @property
    def partial(self) -> Path:
        """What a loader probe measured so far (``read_partial``)."""
        return self.folder / "partial.json"

    def prepare(self) -> None:
        """Create the folder and drop what an earlier run left in it (raises OSError).

        A symlink at the folder's name (or at a file's) is removed, not followed: a trial writes its log and
        result in the study's own folder, never through a link planted there into a folder elsewhere.
        """
        if self.folder.is_symlink():
            self.folder.unlink()
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in (self.result, self.log, self.clock, self.partial):
            stale.unlink(missing_ok=True)


@dataclass(frozen=True, kw_only=True)
class ProcessEnd:
    """How one process of a launch ended.

    Attributes:
        index: Its place among the launched specs (the rank, in a DDP trial).
        exitcode: Its exit code, negative for a signal (as multiprocessing reports it).
        outcome: What it wrote as its result, or ``None``.
        killed: The launcher killed it (a deadline, or another process of the launch failed first).
        ended_at: When it ended (``time.time()``): the moment it wrote its result by its own clock, else when
            the launcher saw it exit; infinite when it was killed without a result.
    """

    index: int
    exitcode: int
    outcome: Optional[TrialOutcome]
    killed: bool
    ended_at: float
    files: ProcessFiles

    @property
    def failed(self) -> bool:
        """It wrote a result that is not ok (or pruned), or exited by itself without one. A process killed
        after it wrote its failure (it was still exiting) counts: it failed first."""
        if self.outcome is not None:
            return self.outcome.status not in ("ok", "pruned")
        return not self.killed


@dataclass(frozen=True, kw_only=True)
class Launch:
    """What a set of trial processes did, as ``launch`` saw it."""

    ends: tuple[ProcessEnd, ...]
    wall_seconds: float
    timed_out: bool = False
    compile_over: Optional[tuple[int, str, float]] = None  # (process, compile mode, seconds) past the deadline

    @property
    def first_failure(self) -> Optional[ProcessEnd]:
        """The process that failed first. A rank that fails makes its peers fail soon after (their
        collectives lose it), and may still be exiting when they have: the time each failure was written,
        not the order of the exits, tells them apart."""
        failed = [end for end in self.ends if end.failed]
        return min(failed, key=lambda end: (end.ended_at, end.index), default=None)


def launch(specs: Sequence[TrialSpec], files: Sequence[ProcessFiles], *, timeout: float,
           compile_timeout: Optional[float] = None, stop_on_failure: bool = True) -> Launch:
    """Start one trial process per spec (each its own session and process group) and wait for them.

    The wait ends when every process has ended, when ``timeout`` seconds have passed, when a process's
    compile clock passes ``compile_timeout``, or (``stop_on_failure``) when one process ends without an ok
    result. A process has ended when it exited, or when it wrote its result: one still running
    ``RESULT_GRACE_SECONDS`` after that has its group killed, and one still exiting at the deadline is
    finished, not timed out. Then every process group still alive is killed, and so is anything a finished process left
    behind, so no process of the launch outlives it. Ctrl-C or SIGTERM kills them all at once and is
    raised again, with ``finished_outcome`` set when a single process had already written its result.

    Args:
        specs: What each process runs (a rank's spec carries its rendezvous variables in ``env``).
        files: Where each process writes (folders already prepared).
        timeout: Seconds before every process group is killed.
        compile_timeout: Seconds of torch.compile work (the longest compile clock of the processes).
        stop_on_failure: End the whole launch as soon as one process fails (the ranks of one job), or let
            the others run on (independent copies).
    """
    if _trial_server_dead():
        start_trial_server()  # a killed server is started again now, not inside the trial's wall time
    start = time.perf_counter()
    procs = []
    tag = f"{os.getpid()}-{time.time_ns()}"  # see kill_leftovers
    specs = [dataclasses.replace(spec, env={**(spec.env or {}), TRIAL_TAG_ENV: tag}) for spec in specs]
    for spec, where in zip(specs, files):
        proc = _mp_context().Process(
            target=_child,
            args=(spec, str(where.result), str(where.log), os.getpid(), trial_environ(), str(where.clock),
                  str(where.partial)),
            daemon=False,
        )
        proc.start()
        assert proc.pid is not None
        track_group(proc.pid)  # a second Ctrl-C kills it at once
        procs.append(proc)
    watch_compile = compile_timeout is not None and any(s.config.compile != "off" for s in specs)
    exited: dict[int, float] = {}  # process -> when the launcher saw it exit (or its result, see below)
    written: dict[int, float] = {}  # process still running -> when the launcher first saw its result
    compile_over: Optional[tuple[int, str, float]] = None
    failed = False

    def end(i: int) -> None:
        nonlocal failed
        exited[i] = time.time()
        outcome = _result(files[i].result, "", 0.0)
        failed = failed or outcome is None or outcome.status not in ("ok", "pruned")

    try:
        while len(exited) < len(procs) and compile_over is None and not (failed and stop_on_failure):
            left = timeout - (time.perf_counter() - start)
            if left <= 0:
                break
            alive = [p.sentinel for i, p in enumerate(procs) if i not in exited]
            multiprocessing.connection.wait(alive, min(COMPILE_POLL_SECONDS if watch_compile else RESULT_POLL_SECONDS,
                                                       left))
            for i, proc in enumerate(procs):
                if i in exited:
                    continue
                if proc.is_alive():
                    # A complete result is the end of the trial process, whatever still keeps it alive.
                    if i not in written and _result(files[i].result, "", 0.0) is not None:
                        written[i] = time.monotonic()
                    if i not in written or time.monotonic() - written[i] < RESULT_GRACE_SECONDS:
                        continue
                    _kill_group(proc.pid)
                end(i)
            if watch_compile:
                assert compile_timeout is not None
                for i, (spec, where) in enumerate(zip(specs, files)):
                    mode, seconds = read_compile_seconds(str(where.clock))
                    if i not in exited and seconds > compile_timeout:
                        compile_over = (i, mode or spec.config.compile, seconds)
                        break
    except BaseException as exc:
        # Ctrl-C or SIGTERM: end the trial now (multiprocessing would otherwise join it at exit), and
        # hand on its result if it had already written one.
        leftovers = [proc.pid for proc in procs if proc.pid is not None]
        kill_leftovers(leftovers, tag)  # while the trial processes live, their descendants are in the tree
        for proc in procs:
            _kill_group(proc.pid)
        for proc in procs:
            proc.join(5)
            untrack_group(proc.pid)
        finished = None
        if len(procs) == 1:
            finished = _result(files[0].result, _tail(files[0].log), time.perf_counter() - start)
        try:
            exc.finished_outcome = finished  # type: ignore[attr-defined]
        except AttributeError:  # an exception type that takes no attributes: the result is lost with it
            pass
        raise
    for i in range(len(procs)):
        if i not in exited and (i in written or _result(files[i].result, "", 0.0) is not None):
            end(i)  # it wrote its result before the deadline and was still exiting: finished, not timed out
    timed_out = len(exited) < len(procs) and compile_over is None and not (failed and stop_on_failure)
    killed = {i for i in range(len(procs)) if i not in exited}
    kill_leftovers([proc.pid for proc in procs if proc.pid is not None], tag)  # a group kill misses those
    for proc in procs:
        _kill_group(proc.pid)  # on a deadline or a failure, and to reap anything a finished process left behind
    for proc in procs:
        proc.join()
        untrack_group(proc.pid)
    for where in files:
        cap_log(where.log)
    wall = time.perf_counter() - start
    ends = []
    for i, proc in enumerate(procs):
        outcome = _result(files[i].result, _tail(files[i].log), wall)
        written = _written_at(files[i]) if outcome is not None else None
        ended_at = written if written is not None else exited.get(i, float("inf"))
        ends.append(ProcessEnd(index=i, exitcode=proc.exitcode or 0, outcome=outcome, killed=i in killed,
                               ended_at=ended_at, files=files[i]))
    return Launch(ends=tuple(ends), wall_seconds=wall, timed_out=timed_out, compile_over=compile_over)


def _written_at(files: ProcessFiles) -> Optional[float]:
    """When the process wrote its result, by its own clock (``ended_at`` in the result)."""
    try:
        value = json.loads(files.result.read_text()).get("ended_at")
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) else None


def rank_specs(spec: TrialSpec) -> list[TrialSpec]:
    """The spec of each rank of a trial: torch's env:// rendezvous on a free loopback port."""
    ranks = spec.config.processes_per_trial
    if ranks == 1:
        return [spec]
    port = str(_free_port())
    shared = {RANKS_ENV: str(ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(ranks),
              "LOCAL_WORLD_SIZE": str(ranks)}
    return [dataclasses.replace(spec, env={**(spec.env or {}), **shared, "RANK": str(rank), "LOCAL_RANK": str(rank)})
            for rank in range(ranks)]


def rank_files(workdir: Path, ranks: int) -> list[ProcessFiles]:
    """Rank 0 writes in the trial's folder (as a one-process trial does), rank k in ``rank<k>/`` inside it."""
    return [ProcessFiles(folder=workdir if rank == 0 else workdir / f"rank{rank}") for rank in range(ranks)]


def run_isolated(spec: TrialSpec, *, workdir: Path, timeout: float,
                 compile_timeout: Optional[float] = None) -> TrialOutcome:
    """Run one trial in fresh processes under a wall-clock limit, and its compiles under their own.

    A trial of ``processes_per_trial`` ranks starts them all; rank 0's outcome is the trial's when every
    rank finished, else the first rank that failed is the trial's failure, named in its error (the other
    ranks are killed at once: they would wait on it in a collective).

    Args:
        spec: What to run.
        workdir: Where the trial's log (stdout and stderr), compile clock and result file go (rank 0's;
            rank k's in ``workdir/rank<k>``).
        timeout: Seconds before the trial's process groups are killed.
        compile_timeout: Seconds of torch.compile work (as the trial's compile clock counts them) before
            the groups are killed and the trial ends as ``compile_timeout``; ``None``: no compile deadline.
    """
    ranks = spec.config.processes_per_trial
    files = rank_files(workdir, ranks)
    try:
        for where in files:
            where.prepare()
    except OSError as exc:
        return TrialOutcome("infra", error=f"cannot prepare the trial's folder {workdir}: {exc.strerror or exc}")
    done = launch(rank_specs(spec), files, timeout=timeout, compile_timeout=compile_timeout)
    wall = done.wall_seconds
    who = (lambda i: f"rank {i} of {ranks}: ") if ranks > 1 else (lambda i: "")
    if done.compile_over is not None:
        index, mode, seconds = done.compile_over
        return TrialOutcome("compile_timeout", stderr_tail=_tail(files[index].log), wall_seconds=wall,
                            error=f"{who(index)}compile={mode} still compiling after {seconds:.0f}s "
                                  f"(compile timeout {compile_timeout:g}s)")
    if done.timed_out:
        every = f" (all {ranks} ranks killed)" if ranks > 1 else ""
        return TrialOutcome("timeout", error=f"no result within {timeout:.0f}s{every}",
                            stderr_tail=_tail(files[0].log), wall_seconds=wall)
    failure = done.first_failure
    if failure is None:
        outcome = done.ends[0].outcome
        assert outcome is not None
        return outcome
    outcome = _ended(failure, spec, wall)
    return dataclasses.replace(outcome, error=who(failure.index) + outcome.error) if ranks > 1 else outcome


def _disk_full(folder: Path) -> str:
    """Where the file system of ``folder`` (or of the nearest folder above it) has no space left ("" if it has)."""
    for place in (folder, *folder.parents):
        try:
            stat = os.statvfs(place)
        except OSError:
            continue
        if stat.f_bavail == 0 or (stat.f_files and stat.f_favail == 0):
            return f"no space left under {place}"
        return ""
    return ""


def _ended(end: ProcessEnd, spec: TrialSpec, wall: float) -> TrialOutcome:
    """The outcome of a process that ended by itself: its result, or what its exit says."""
    if end.outcome is not None:
        return end.outcome
    tail = _tail(end.files.log)
    code = end.exitcode
    full = _disk_full(end.files.folder)
    if code != 0 and full:
        return TrialOutcome("infra", error=f"the disk is full: {full}", stderr_tail=tail, wall_seconds=wall)
    if code == INFRA_EXIT_CODE:
        return TrialOutcome("infra", error="the trial process could not write its log or result "
                            f"(its folder {end.files.folder} vanished or is not writable)", stderr_tail=tail,
                            wall_seconds=wall)
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
