"""The MPS daemon's life cycle, against a stand-in control program that speaks its protocol.

The real daemon needs an NVIDIA driver; the evidence that it starts and stops on a GPU host is in
``benchmarks/results/colocation-h200.md``. Here the stand-in is a real daemon process with a real control
FIFO, so starting, quitting and a killed coordinator are exercised for real.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from autotune._errors import KnobError
from autotune.hardware._mps import MpsDaemon, find_running_daemon, open_mps

STAND_IN = str(Path(__file__).parent / "fake_mps" / "nvidia-cuda-mps-control")
REPO = Path(__file__).resolve().parents[1]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (not yet reaped by init) has exited
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pid: int, seconds: float = 15.0) -> bool:
    deadline = time.monotonic() + seconds
    while _pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _pid_alive(pid)


def _daemon_pid(pipe_dir: Path) -> int:
    return int((pipe_dir / "nvidia-cuda-mps-control.pid").read_text())


def test_a_started_daemon_serves_clients_and_stops_with_nothing_left(tmp_path):
    daemon = MpsDaemon(pipe_dir=tmp_path / "pipe", log_dir=tmp_path / "log", control=STAND_IN)
    with daemon:
        assert daemon.running
        pid = _daemon_pid(tmp_path / "pipe")
        assert _pid_alive(pid)
        guardian = daemon._guardian
        assert guardian is not None and guardian.poll() is None
        assert find_running_daemon({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "pipe")}) == tmp_path / "pipe"
    assert not daemon.running
    assert _wait_gone(pid)
    assert guardian.poll() is not None
    assert "quit" in (tmp_path / "log" / "control.log").read_text()
    daemon.stop()  # twice is harmless


def test_a_killed_coordinator_leaves_no_daemon(tmp_path):
    script = textwrap.dedent("""
        import sys, time
        from pathlib import Path
        from autotune.hardware._mps import open_mps
        session, daemon = open_mps("on", study_dir=Path(sys.argv[1]), control=sys.argv[2])
        print(session.pipe_dir, flush=True)
        time.sleep(600)
    """)
    coordinator = subprocess.Popen([sys.executable, "-c", script, str(tmp_path), STAND_IN], stdout=subprocess.PIPE,
                                   text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    pipe_dir = Path(coordinator.stdout.readline().strip())
    assert pipe_dir == tmp_path / "mps" / "pipe"
    pid = _daemon_pid(pipe_dir)
    assert _pid_alive(pid)
    coordinator.send_signal(signal.SIGKILL)
    coordinator.wait()
    assert _wait_gone(pid), "the guardian did not stop the daemon of a killed coordinator"
    assert not (pipe_dir / "control").exists()


def test_auto_uses_a_running_daemon_and_does_not_own_it(tmp_path):
    theirs = MpsDaemon(pipe_dir=tmp_path / "theirs", log_dir=tmp_path / "theirs-log", control=STAND_IN)
    with theirs:
        session, ours = open_mps("auto", study_dir=tmp_path / "study", control=STAND_IN,
                                 environ={"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "theirs")})
        assert ours is None and not session.owned and session.pipe_dir == tmp_path / "theirs"
        env = session.client_env(enabled=True, no_mps_dir=tmp_path / "none")
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "theirs")
        assert theirs.running
    assert not (tmp_path / "study" / "mps").exists()


def test_auto_starts_one_under_the_study_and_the_caller_stops_it(tmp_path):
    session, daemon = open_mps("auto", study_dir=tmp_path, control=STAND_IN, environ={
        "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "nothing-here")})
    try:
        assert session.owned and session.available and daemon is not None and daemon.running
        assert session.pipe_dir == tmp_path / "mps" / "pipe"
        off = session.client_env(enabled=False, no_mps_dir=tmp_path / "no-mps")
        assert off == {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "no-mps")}
        assert not (tmp_path / "no-mps" / "control").exists()  # no daemon listens there: clients run without MPS
    finally:
        daemon.stop()
    assert not daemon.running


def test_where_mps_cannot_start_auto_says_why_and_on_refuses(tmp_path):
    session, daemon = open_mps("auto", study_dir=tmp_path, control="no-such-mps-control", environ={})
    assert daemon is None and not session.available
    assert "no-such-mps-control is not on the PATH" in session.reason
    with pytest.raises(KnobError, match="not on the PATH"):
        open_mps("on", study_dir=tmp_path, control="no-such-mps-control", environ={})
    off, none = open_mps("off", study_dir=tmp_path, control=STAND_IN, environ={})
    assert none is None and not off.available and off.reason == "--mps off"
    with pytest.raises(KnobError, match="--mps must be one of auto, on, off"):
        open_mps("sometimes", study_dir=tmp_path)
