"""Reliability: a killed tuner resumes, SQLite is shared, bad input is refused, secrets stay masked."""

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from tests.test_scaleout import TARGET, _autotune as _cmd, _gone

HERE = Path(__file__).resolve().parent
STALLS_ONCE = f"{HERE / 'scale_workloads.py'}:train_stalls_once"


def test_sigkilled_tuner_resumes_and_retries_the_orphan_once(space, tmp_path):
    marker = tmp_path / "stalled.pid"
    db = tmp_path / "a.db"
    command = _cmd("tune", STALLS_ONCE, "--prune-below", "0", "--space", str(space), "--storage", f"sqlite:///{db}", "--study", "s",
                   "--trials", "5", "--studies-dir", str(tmp_path / "studies"), "--no-progress", "--no-plots", "--top-k", "0")
    env = {**os.environ, "AUTOTUNE_TEST_STALL_ONCE": str(marker)}
    tuner = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    while not marker.exists():
        assert time.time() < deadline and tuner.poll() is None, tuner.communicate()[1]
        time.sleep(0.3)
    trial_pid = int(marker.read_text())
    before = optuna.load_study(study_name="s", storage=f"sqlite:///{db}")
    done_before = {t.number: t.values for t in before.trials if t.state == TrialState.COMPLETE}
    reference_before = before.user_attrs["reference_metrics"]
    tuner.send_signal(signal.SIGKILL)
    tuner.wait()
    assert _gone(trial_pid), "the trial outlived the killed tuner"
    running = [t for t in optuna.load_study(study_name="s", storage=f"sqlite:///{db}").trials
               if t.state == TrialState.RUNNING]
    assert len(running) == 1

    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{db}")
    failed = [t for t in study.trials if t.state == TrialState.FAIL]
    assert [t.number for t in failed] == [running[0].number]
    assert failed[0].user_attrs["failure"].startswith("stale")
    retries = [t for t in study.trials if t.user_attrs.get("retry_of") == failed[0].number]
    assert len(retries) == 1 and retries[0].state == TrialState.COMPLETE
    assert retries[0].params == failed[0].params
    complete = {t.number: t.values for t in study.trials if t.state == TrialState.COMPLETE}
    assert len(complete) == 5
    for number, values in done_before.items():  # nothing finished before the kill was lost or redone
        assert complete[number] == values
    assert study.user_attrs["reference_metrics"] == reference_before


def test_concurrent_tuners_and_dashboard_share_sqlite(space, tmp_path):
    db = tmp_path / "shared.db"
    url = f"sqlite:///{db}"
    studies = tmp_path / "studies"
    first = subprocess.run(_cmd("tune", TARGET, "--prune-below", "0", "--space", str(space), "--storage", url, "--study", "s0",
                                "--trials", "1", "--studies-dir", str(studies), "--no-progress", "--no-plots", "--top-k", "0"),
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dashboard = subprocess.Popen(_cmd("dashboard", "--storage", url, "--port", str(port), "--studies-dir", str(studies)),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tuners = [
        subprocess.Popen(_cmd("tune", TARGET, "--prune-below", "0", "--space", str(space), "--storage", url, "--study", f"s{i}",
                              "--trials", "3", "--studies-dir", str(studies), "--no-progress", "--no-plots", "--top-k", "0"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in (1, 2, 3)
    ]
    reads = 0
    try:
        while any(t.poll() is None for t in tuners):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=10) as response:
                    assert response.status == 200
                    json.loads(response.read())
                    reads += 1
            except OSError:
                pass  # the dashboard is still starting
            time.sleep(0.2)
        outputs = [t.communicate() for t in tuners]
    finally:
        dashboard.terminate()
        dash_out = dashboard.communicate(timeout=30)[0]
    assert reads > 0, dash_out
    for tuner, (out, err) in zip(tuners, outputs):
        assert tuner.returncode == 0, err
        assert "database is locked" not in err
    assert "database is locked" not in dash_out
    for i in (1, 2, 3):
        study = optuna.load_study(study_name=f"s{i}", storage=url)
        assert len([t for t in study.trials if t.state == TrialState.COMPLETE]) == 3


@pytest.mark.parametrize(
    "args, expected",
    [
        (["tune", TARGET, "--storage", "redis://127.0.0.1/0"], "unknown scheme 'redis'"),
        (["tune", f"{HERE / 'scale_workloads.py'}:nope"], "has no function 'nope'"),
        (["tune", "no.such.module:train"], "cannot import module 'no'"),
        (["tune", f"{HERE / 'scale_workloads.py'}:returns_text"], "train_fn returned a str"),
    ],
)
def test_malformed_input_is_one_line_and_creates_nothing(args, expected, space, tmp_path):
    studies = tmp_path / "studies"
    if "--storage" not in args:
        args = [*args, "--storage", f"sqlite:///{tmp_path}/x.db"]
    proc = subprocess.run(_cmd(*args, "--space", str(space), "--studies-dir", str(studies), "--no-progress", "--no-plots"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert expected in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    db = tmp_path / "x.db"
    if db.exists():
        assert optuna.get_all_study_summaries(f"sqlite:///{db}") == []


def test_password_in_storage_url_is_masked(space, tmp_path):
    url = "postgresql+psycopg://autotune_nobody:hunter2secret@127.0.0.1:5432/no_such_db"
    proc = subprocess.run(_cmd("tune", TARGET, "--prune-below", "0", "--space", str(space), "--storage", url,
                               "--studies-dir", str(tmp_path), "--no-progress", "--no-plots"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "hunter2secret" not in proc.stderr + proc.stdout
    assert "***" in proc.stderr


def test_dashboard_warns_when_bound_to_all_interfaces(tmp_path, space):
    url = f"sqlite:///{tmp_path}/d.db"
    subprocess.run(_cmd("tune", TARGET, "--prune-below", "0", "--space", str(space), "--storage", url, "--trials", "1",
                        "--studies-dir", str(tmp_path), "--no-progress", "--no-plots", "--top-k", "0"), check=True,
                   capture_output=True, timeout=300)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dashboard = subprocess.Popen(_cmd("dashboard", "--storage", url, "--host", "0.0.0.0", "--port", str(port),
                                      "--studies-dir", str(tmp_path)),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(3)
    finally:
        dashboard.terminate()
        out, err = dashboard.communicate(timeout=30)
    assert "warning: binding to 0.0.0.0" in err


def _isolated(fn, tmp_path, timeout=60.0, **config):
    from autotune import Budget, TrialConfig
    from autotune.trial._execute import TrialSpec
    from autotune.study._isolation import run_isolated

    spec = TrialSpec(f"{HERE / 'scale_workloads.py'}:{fn}", TrialConfig(**config), Budget(samples=512, warmup_steps=1, windows=3))
    return run_isolated(spec, workdir=tmp_path / fn, timeout=timeout)


def test_segfault_is_a_crash_with_the_signal_and_a_stack_in_the_tail(tmp_path):
    outcome = _isolated("segfault", tmp_path)
    assert outcome.status == "crash" and outcome.signal == "SIGSEGV"
    assert "Segmentation fault" in outcome.stderr_tail
    assert _isolated("train", tmp_path, batch_size=16).status == "ok"  # the next trial is unharmed


def test_hung_dataloader_worker_times_out_and_the_whole_group_is_gone(tmp_path, monkeypatch):
    pids = tmp_path / "workers.pids"
    monkeypatch.setenv("AUTOTUNE_TEST_WORKER_PIDS", str(pids))
    outcome = _isolated("loader_worker_hangs", tmp_path, timeout=8.0, batch_size=16, num_workers=2)
    assert outcome.status == "timeout"
    worker_pids = {int(p) for p in pids.read_text().split()}
    assert len(worker_pids) == 2  # both workers started, then hung
    for pid in worker_pids:
        assert _gone(pid, wait=5), f"DataLoader worker {pid} survived the timeout"


def test_stored_attributes_are_json_not_pickle(space, tmp_path):
    import sqlite3

    db = tmp_path / "j.db"
    subprocess.run(_cmd("tune", TARGET, "--prune-below", "0", "--space", str(space), "--storage", f"sqlite:///{db}", "--trials", "2",
                        "--studies-dir", str(tmp_path), "--no-progress", "--no-plots", "--top-k", "0"),
                   check=True, capture_output=True, timeout=300)
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT value_json FROM trial_user_attributes").fetchall()
        rows += conn.execute("SELECT value_json FROM study_user_attributes").fetchall()
    assert len(rows) > 20
    for (value,) in rows:
        json.loads(value)  # every stored attribute is plain JSON text


def test_a_trial_sees_the_environment_of_the_coordinator_now(tmp_path, monkeypatch):
    # The forkserver keeps the environment it started with; each trial must get the current one
    # (e.g. CUDA_VISIBLE_DEVICES set by `--gpus` after the reference ran).
    monkeypatch.setenv("AUTOTUNE_TEST_MARK", "before")
    assert _isolated("train_records_env", tmp_path, batch_size=16).measurement.extras["mark"] == "before"
    monkeypatch.setenv("AUTOTUNE_TEST_MARK", "after")
    assert _isolated("train_records_env", tmp_path, batch_size=16).measurement.extras["mark"] == "after"


@pytest.mark.parametrize("target", ["train_leaves_a_thread", "train_leaves_a_process"])
def test_a_train_fn_that_leaves_a_thread_or_process_running_finishes_its_trials(target, space, tmp_path):
    # The fp32 reference run and every trial wrote their whole measurement: none may wait out the timeout.
    left = tmp_path / "left.pids"
    url = f"sqlite:///{tmp_path / 'l.db'}"
    started = time.monotonic()
    proc = subprocess.run(_cmd("tune", f"{HERE / 'scale_workloads.py'}:{target}", "--prune-below", "0", "--space",
                               str(space), "--storage", url, "--study", "s", "--trials", "3", "--trial-timeout", "30",
                               "--studies-dir", str(tmp_path / "studies"), "--no-progress", "--no-plots", "--top-k", "0"),
                          env={**os.environ, "AUTOTUNE_TEST_LEFT": str(left)}, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - started < 90  # no trial waited out its 30 s
    study = optuna.load_study(study_name="s", storage=url)
    statuses = [t.user_attrs.get("status") for t in study.trials]
    assert len(statuses) >= 3 and set(statuses) == {"ok"}, statuses
    for pid in (int(p) for p in left.read_text().split()) if left.exists() else ():
        assert _gone(pid), f"process {pid} left by a trial survived it"
