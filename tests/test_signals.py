"""Ctrl-C and SIGTERM, sent for real to real tuner processes: the trial ends within seconds and is recorded,
a second Ctrl-C kills at once, and workers die with their parent."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from tests.test_scaleout import _autotune as _cmd, _gone

HERE = Path(__file__).resolve().parent
WORKLOADS = HERE / "scale_workloads.py"


def _start(space, tmp_path, target, env, *extra, trials=3):
    url = f"sqlite:///{tmp_path / 's.db'}"
    command = _cmd("tune", f"{WORKLOADS}:{target}", "--prune-below", "0", "--space", str(space), "--storage", url,
                   "--study", "s", "--trials", str(trials), "--studies-dir", str(tmp_path / "studies"),
                   "--no-progress", "--no-plots", "--top-k", "0", *extra)
    # Its own session, like a shell's foreground job: killpg is what a terminal's Ctrl-C does.
    proc = subprocess.Popen(command, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    return proc, url


def _communicate(proc, timeout):
    """The tuner's output; on a timeout its whole group is killed first, so a failing test leaves nothing."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise


def _wait_for(path, proc, seconds=180):
    deadline = time.time() + seconds
    while not path.exists() or not path.read_text().strip():
        assert time.time() < deadline and proc.poll() is None, proc.communicate()[1]
        time.sleep(0.2)
    return int(path.read_text())


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_ends_a_hung_trial_within_seconds_and_records_it(space, tmp_path, signum, code):
    marker = tmp_path / "stalled.pid"
    proc, url = _start(space, tmp_path, "train_stalls_once", {"AUTOTUNE_TEST_STALL_ONCE": str(marker)})
    trial_pid = _wait_for(marker, proc)
    sent = time.monotonic()
    if signum == signal.SIGINT:
        os.killpg(proc.pid, signum)  # the whole foreground group, as a terminal sends it
    else:
        proc.send_signal(signum)  # the tuner alone, as a scheduler or `kill` sends it
    out, err = _communicate(proc, 60)
    assert time.monotonic() - sent < 15, "the tuner waited for the hung trial"
    assert proc.returncode == code, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "interrupted by" in err
    assert _gone(trial_pid, wait=5), "the trial outlived the interrupted tuner"
    study = optuna.load_study(study_name="s", storage=url)
    assert not [t for t in study.trials if t.state == TrialState.RUNNING]
    failed = [t for t in study.trials if t.state == TrialState.FAIL]
    reason = "interrupted: SIGINT (Ctrl-C)" if signum == signal.SIGINT else "interrupted: SIGTERM"
    assert [t.user_attrs.get("failure") for t in failed] == [reason]


def test_ctrl_c_keeps_the_result_of_a_trial_that_had_finished(space, tmp_path):
    marker = tmp_path / "lingers.pid"
    proc, url = _start(space, tmp_path, "train_finishes_then_lingers", {"AUTOTUNE_TEST_LINGER_ONCE": str(marker)})
    trial_pid = _wait_for(marker, proc)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = _communicate(proc, 60)
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert _gone(trial_pid, wait=5)
    study = optuna.load_study(study_name="s", storage=url)
    assert not [t for t in study.trials if t.state in (TrialState.RUNNING, TrialState.FAIL)]
    last = study.trials[-1]
    assert last.state == TrialState.COMPLETE and last.user_attrs["status"] == "ok" and last.number > 0


def test_a_second_ctrl_c_kills_at_once_without_a_traceback(space, tmp_path):
    marker = tmp_path / "stalled.pid"
    proc, url = _start(space, tmp_path, "train_stalls_once", {"AUTOTUNE_TEST_STALL_ONCE": str(marker)})
    trial_pid = _wait_for(marker, proc)
    sent = time.monotonic()
    while proc.poll() is None and time.monotonic() - sent < 30:  # Ctrl-C, again and again
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.02)
    out, err = _communicate(proc, 30)
    # 130 from the handler, or death by SIGINT when a Ctrl-C lands after the interpreter has put the default
    # handler back on its way out: both are what a shell shows as 130.
    assert proc.returncode in (130, -signal.SIGINT), err
    # One line: "killed at once" when a second Ctrl-C came during the cleanup, else the interrupted line
    # (a Ctrl-C after it has been said ends the exit quietly).
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert _gone(trial_pid, wait=5)


def _children(pid):
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if entry.name.isdigit() and int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"worker" in cmdline:
            found.append(int(entry.name))
    return found


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process table from /proc")
def test_workers_die_with_a_sigkilled_parent_and_record_their_trials(space, tmp_path):
    journal = tmp_path / "w.journal"
    proc = subprocess.Popen(
        _cmd("tune", f"{WORKLOADS}:train_takes_seconds", "--prune-below", "0", "--space", str(space), "--storage",
             f"journal:{journal}", "--study", "s", "--trials", "20", "--workers", "2", "--studies-dir",
             str(tmp_path / "studies"), "--no-progress", "--no-plots", "--top-k", "0"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def study():
        return optuna.load_study(study_name="s", storage=optuna.storages.JournalStorage(
            optuna.storages.journal.JournalFileBackend(str(journal))))

    deadline = time.time() + 240
    try:
        while True:  # until a worker runs a trial
            assert time.time() < deadline and proc.poll() is None, proc.communicate()[1]
            workers = _children(proc.pid)
            if len(workers) == 2 and journal.exists() and any(
                    t.state == TrialState.RUNNING for t in study().trials):
                break
            time.sleep(0.5)
    finally:
        proc.kill()
        proc.wait()
    for pid in workers:
        assert _gone(pid, wait=20), f"worker {pid} outlived its SIGKILLed parent"
    trials = study().trials
    # A worker between trials may be inside study.ask(), which stores the new trial before it returns it:
    # the signal is held there, so that trial is recorded too (it once stayed RUNNING, a run in three).
    assert not [t.number for t in trials if t.state == TrialState.RUNNING]
    assert {t.user_attrs.get("failure") for t in trials if t.state == TrialState.FAIL} <= {"interrupted: SIGTERM"}


class _SignalDuringAsk(optuna.samplers.RandomSampler):
    """A real sampler that sends this process SIGTERM while Optuna asks for trial ``at``: in
    ``before_trial``, after the storage has created the trial and before ``ask`` returns it: the window
    (the storage reading the new trial back, a journal replaying its log, the sampler's ``before_trial``)
    where a signal once left the trial RUNNING."""

    def __init__(self, at: int) -> None:
        super().__init__(seed=0)
        self.at = at

    def before_trial(self, study, trial):
        if trial.number == self.at:
            os.kill(os.getpid(), signal.SIGTERM)
        super().before_trial(study, trial)


def test_a_signal_while_a_trial_is_asked_for_records_that_trial(tmp_path):
    from autotune import Tuner
    from autotune.search._space import parse_space
    from autotune.study import _signals

    space = parse_space({"knobs": {"batch_size": [16, 32, 64]}, "baseline": {"batch_size": 16}, "batch_policy": "scale",
                         "budget": {"samples": 256, "warmup_steps": 1, "windows": 3}}, where="s.yaml", name="s")
    url = f"sqlite:///{tmp_path}/s.db"
    restore = _signals.install()
    try:
        tuner = Tuner(f"{HERE / 'workloads.py'}:train_tiny", space=space, n_trials=3, top_k=0, reference_repeats=1,
                      prune_below=None, studies_dir=tmp_path, storage=url, study_name="s", progress=False,
                      plots=False, sampler=_SignalDuringAsk(at=2))
        with pytest.raises(_signals.Interrupted):
            tuner.run()
    finally:
        restore()
    trials = optuna.load_study(study_name="s", storage=url).trials
    assert not [t.number for t in trials if t.state == TrialState.RUNNING]
    asked = trials[2]
    assert asked.state == TrialState.FAIL and asked.user_attrs.get("failure") == "interrupted: SIGTERM"
    assert trials[1].state == TrialState.COMPLETE  # the trial before it ran as usual


_NOTICED = """
import os, sys, time
from autotune.study import _signals
_signals.install()
_signals.die_with_parent(parent=os.getppid())
try:
    print("ready", flush=True)  # inside the try: the test's first notice may land while it prints
    time.sleep(30)
except _signals.Interrupted as exc:
    print("stopping:", exc.reason, flush=True)
    time.sleep(1.0)  # recording the trial: a second notice lands here
    print("recorded", flush=True)
    sys.exit(143)
"""


def test_the_parent_gone_notice_stops_a_worker_once_however_often_it_comes():
    # The kernel repeats the death notice each time it hands the orphan to another thread of the dying
    # parent; the first stops the worker as a SIGTERM, the rest must not count as a second signal.
    proc = subprocess.Popen([sys.executable, "-c", _NOTICED], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=HERE.parent)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGHUP)
    time.sleep(0.3)
    proc.send_signal(signal.SIGHUP)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 143, err
    assert out.splitlines() == ["stopping: SIGTERM", "recorded"]
    assert "killed at once" not in err
