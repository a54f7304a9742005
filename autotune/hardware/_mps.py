"""The CUDA MPS control daemon: use a running one, or start one for a study and make sure it stops.

Several training processes on one GPU are time-sliced by default; under MPS (Multi-Process Service) their
kernels run concurrently. A CUDA client uses MPS when it can reach a control daemon through the named pipes
in ``CUDA_MPS_PIPE_DIRECTORY`` (default ``/tmp/nvidia-mps``) and runs without it otherwise, so a trial picks
MPS on or off by the pipe directory it is given, and the same packing can be measured both ways.

A daemon the study starts lives under the study's folder and is stopped when the study ends, on Ctrl-C,
and, through a guardian process that outlives a killed coordinator, when the coordinator dies. Nothing here
changes the GPU's compute mode or clocks.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal, Optional

from autotune._errors import KnobError

MPS_CONTROL = "nvidia-cuda-mps-control"
DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"
START_SECONDS = 15.0  # how long a started daemon may take to open its control pipe
STOP_SECONDS = 30.0  # how long ``quit`` may take (the daemon waits for its clients to finish)

MpsMode = Literal["auto", "on", "off"]
MPS_MODES: tuple[str, ...] = ("auto", "on", "off")


def _control_pipe(pipe_dir: Path) -> Path:
    return pipe_dir / "control"


def find_running_daemon(environ: Optional[dict[str, str]] = None) -> Optional[Path]:
    """The pipe directory of a control daemon that is already running, or None.

    Looks where a CUDA client would: ``CUDA_MPS_PIPE_DIRECTORY`` if set, else the default directory.
    """
    environ = os.environ if environ is None else environ
    pipe_dir = Path(environ.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIRECTORY)
    return pipe_dir if _control_pipe(pipe_dir).exists() else None


@dataclasses.dataclass(frozen=True)
class MpsSession:
    """What a study has for MPS: where clients connect, whether the study owns the daemon, and why not.

    Attributes:
        pipe_dir: The pipe directory MPS clients use; None when MPS is not available.
        log_dir: The daemon's log directory (None for a daemon the study did not start).
        owned: True when the study started the daemon and so must stop it.
        reason: Why MPS is not available ("" when it is).
    """

    pipe_dir: Optional[Path]
    log_dir: Optional[Path]
    owned: bool
    reason: str = ""

    @property
    def available(self) -> bool:
        return self.pipe_dir is not None

    def client_env(self, *, enabled: bool, no_mps_dir: Path) -> dict[str, str]:
        """The environment a trial process gets: MPS's pipes, or an empty folder no daemon listens on."""
        if enabled and self.pipe_dir is not None:
            env = {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir)}
            if self.log_dir is not None:
                env["CUDA_MPS_LOG_DIRECTORY"] = str(self.log_dir)
            return env
        no_mps_dir.mkdir(parents=True, exist_ok=True)
        return {"CUDA_MPS_PIPE_DIRECTORY": str(no_mps_dir)}


class MpsDaemon:
    """A control daemon started for one study, with its pipes and logs in the study's folder.

    Use as a context manager, or call ``start`` and ``stop``. ``start`` also launches a guardian: a small
    process in its own session that holds one end of a pipe to the coordinator and sends the daemon
    ``quit`` when that pipe closes, so a coordinator killed with SIGKILL leaves no daemon behind.

    Args:
        pipe_dir: Directory for the daemon's named pipes (short: UNIX socket paths are limited to ~100 bytes).
        log_dir: Directory for the daemon's logs.
        control: The control program (``nvidia-cuda-mps-control`` on the PATH by default).
    """

    def __init__(self, *, pipe_dir: Path, log_dir: Path, control: str = MPS_CONTROL) -> None:
        self.pipe_dir = Path(pipe_dir)
        self.log_dir = Path(log_dir)
        self.control = control
        self._guardian: Optional[subprocess.Popen] = None

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir),
                "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}

    @property
    def running(self) -> bool:
        return _control_pipe(self.pipe_dir).exists()

    def start(self) -> MpsSession:
        """Start the daemon and its guardian.

        Raises:
            KnobError: The control program is missing or the daemon did not come up; the message says why.
        """
        program = shutil.which(self.control)
        if program is None:
            raise KnobError(f"MPS: {self.control} is not on the PATH (it ships with the NVIDIA driver)")
        if len(str(_control_pipe(self.pipe_dir))) > 100:
            raise KnobError(f"MPS: the pipe directory {self.pipe_dir} is too long for a UNIX socket path")
        if self.running:
            raise KnobError(f"MPS: a daemon already listens in {self.pipe_dir}")
        self.pipe_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run([program, "-d"], env=self.env, capture_output=True, text=True, timeout=START_SECONDS)
        if proc.returncode != 0:
            detail = (proc.stderr or proc.stdout).strip().splitlines()
            raise KnobError(f"MPS: {self.control} -d exited with {proc.returncode}"
                            + (f": {detail[-1]}" if detail else ""))
        deadline = time.monotonic() + START_SECONDS
        while not self.running:
            if time.monotonic() > deadline:
                raise KnobError(f"MPS: the daemon did not open its control pipe within {START_SECONDS:.0f} s "
                                f"(see {self.log_dir / 'control.log'})")
            time.sleep(0.05)
        self._guardian = subprocess.Popen(
            [sys.executable, "-m", "autotune.hardware._mps", str(self.pipe_dir), str(self.log_dir), program],
            stdin=subprocess.PIPE, start_new_session=True)
        return MpsSession(pipe_dir=self.pipe_dir, log_dir=self.log_dir, owned=True)

    def stop(self) -> None:
        """Ask the daemon to quit and wait until it is gone; then retire the guardian. Safe to call twice."""
        if self.running:
            _quit(self.control, self.env)
            deadline = time.monotonic() + STOP_SECONDS
            while self.running and time.monotonic() < deadline:
                time.sleep(0.05)
        if self._guardian is not None:
            if self._guardian.stdin is not None:
                self._guardian.stdin.close()  # the guardian's quit finds no daemon: harmless
            try:
                self._guardian.wait(timeout=STOP_SECONDS)
            except subprocess.TimeoutExpired:
                self._guardian.kill()
                self._guardian.wait()
            self._guardian = None

    def __enter__(self) -> "MpsDaemon":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _quit(control: str, env: dict[str, str]) -> None:
    try:
        subprocess.run([control], input="quit\n", env=env, capture_output=True, text=True, timeout=STOP_SECONDS)
    except (OSError, subprocess.TimeoutExpired):
        pass


def open_mps(mode: str, *, study_dir: Path, control: str = MPS_CONTROL,
             environ: Optional[dict[str, str]] = None) -> tuple[MpsSession, Optional[MpsDaemon]]:
    """Resolve ``--mps auto|on|off`` for a study.

    ``auto`` uses a running daemon, else starts one under ``study_dir``, else reports why not (the study
    then measures time-sliced co-location). ``on`` is the same but raises where ``auto`` would fall back.

    Returns:
        The session, and the daemon the caller must stop (None when the study does not own one).

    Raises:
        KnobError: An unknown mode, or ``on`` where MPS cannot start.
    """
    if mode not in MPS_MODES:
        raise KnobError(f"--mps must be one of {', '.join(MPS_MODES)}, not {mode!r}")
    if mode == "off":
        return MpsSession(pipe_dir=None, log_dir=None, owned=False, reason="--mps off"), None
    running = find_running_daemon(environ)
    if running is not None:
        return MpsSession(pipe_dir=running, log_dir=None, owned=False), None
    daemon = MpsDaemon(pipe_dir=Path(study_dir) / "mps" / "pipe", log_dir=Path(study_dir) / "mps" / "log",
                       control=control)
    try:
        return daemon.start(), daemon
    except KnobError as exc:
        daemon.stop()
        if mode == "on":
            raise
        return MpsSession(pipe_dir=None, log_dir=None, owned=False, reason=str(exc)), None


def _guard(pipe_dir: str, log_dir: str, control: str) -> None:
    """The guardian: wait for the coordinator's pipe to close (normal stop or death), then quit the daemon."""
    try:
        while sys.stdin.buffer.read(4096):
            pass
    except OSError:
        pass
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": pipe_dir, "CUDA_MPS_LOG_DIRECTORY": log_dir}
    if _control_pipe(Path(pipe_dir)).exists():
        _quit(control, env)


if __name__ == "__main__":
    _guard(*sys.argv[1:4])
