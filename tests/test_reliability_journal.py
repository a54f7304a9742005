"""Reliability, round two, of storage: a torn journal, a journal resume across hostnames, concurrent first
creation of a SQLite file and of a study, and the dashboard on a journal."""

import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from tests.test_scaleout import TARGET, _autotune as _cmd, _gone

HERE = Path(__file__).resolve().parent
STALLS_ONCE = f"{HERE / 'scale_workloads.py'}:train_stalls_once"
SECONDS_LONG = f"{HERE / 'scale_workloads.py'}:train_takes_seconds"


def _tune(space, storage, studies, *extra, trials=3, study="s", env=None, timeout=300):
    return subprocess.run(
        _cmd("tune", TARGET, "--prune-below", "0", "--space", str(space), "--storage", storage, "--study", study,
             "--trials", str(trials), "--studies-dir", str(studies), "--no-progress", "--no-plots", "--top-k", "0", *extra),
        capture_output=True, text=True, timeout=timeout, env=env)


# -- 1. a journal with a cut-off last line --------------------------------------------------------------

def test_a_torn_journal_tail_stops_in_one_line_and_is_never_written_after(space, tmp_path):
    journal = tmp_path / "j.journal"
    studies = tmp_path / "studies"
    first = _tune(space, f"journal:{journal}", studies, trials=2)
    assert first.returncode == 0, first.stderr
    assert f"(plain optuna-dashboard {journal} " in first.stdout  # the hint (10.) names what the dashboard reads
    size = journal.stat().st_size
    os.truncate(journal, size - 200)  # a crash or a full disk cut the last record
    damaged = journal.read_bytes()
    for attempt in range(2):  # the repro: resume twice
        again = _tune(space, f"journal:{journal}", studies, trials=4)
        assert again.returncode == 1, again.stderr
        lines = again.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in again.stderr, again.stderr
        assert "cut-off record" in lines[0] and str(journal) in lines[0] and "truncate -s" in lines[0]
        assert journal.read_bytes() == damaged, f"resume {attempt + 1} wrote after the torn record"
    best = subprocess.run(_cmd("best", "s", "--storage", f"journal:{journal}", "--studies-dir", str(studies)),
                          capture_output=True, text=True, timeout=120)
    assert best.returncode == 1 and "cut-off record" in best.stderr and "Traceback" not in best.stderr

    # The repair the message gives (a prefix of complete records) makes the study usable again.
    offset = int(lines[0].split("truncate -s ")[1].split()[0])
    os.truncate(journal, offset)
    resumed = _tune(space, f"journal:{journal}", studies, trials=4)
    assert resumed.returncode == 0, resumed.stderr
    study = optuna.load_study(study_name="s", storage=optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(journal))))
    assert len([t for t in study.trials if t.state == TrialState.COMPLETE]) == 4


def test_a_record_torn_while_open_is_not_appended_to(tmp_path):
    from autotune._errors import StudyError
    from autotune.study._storage import open_storage

    journal = tmp_path / "j.journal"
    storage, _ = open_storage(f"journal:{journal}", tmp_path)
    study = optuna.create_study(study_name="s", storage=storage)
    with open(journal, "ab") as fh:  # another writer died mid-record after this process opened the file
        fh.write(b'{"op_code":5,"worker_id":"x","trial_id":0,"us')
    damaged = journal.read_bytes()
    with pytest.raises(StudyError, match="cut-off record"):
        study.set_user_attr("k", 1)
    assert journal.read_bytes() == damaged


def test_a_garbled_record_inside_the_journal_is_named(tmp_path):
    from autotune.study._journal import find_torn_record

    journal = tmp_path / "j.journal"
    journal.write_bytes(b'{"a":1}\n{"b":\n{"c":3}\n')
    message = find_torn_record(journal)
    assert message is not None and "line 2 (from byte 8)" in message and "the 1 line(s) after it" in message
    journal.write_bytes(b'{"a":1}\n')
    assert find_torn_record(journal) is None


# -- 2. a journal resume after a worker died on another hostname --------------------------------------

# The tuner as if on another host: what it records as its hostname is all that differs (in a container,
# `unshare --uts` does the same as root; this works anywhere).
OTHER_HOST = ("import socket, sys; socket.gethostname = lambda: 'other-host'; "
              "from autotune.cli import main; sys.exit(main(sys.argv[1:]))")


def test_a_journal_resume_fails_a_dead_trial_of_another_host_by_its_lease(space, tmp_path):
    marker = tmp_path / "stalled.pid"
    journal = tmp_path / "h.journal"
    args = ["tune", STALLS_ONCE, "--prune-below", "0", "--space", str(space), "--storage", f"journal:{journal}",
            "--study", "s", "--trials", "3", "--studies-dir", str(tmp_path / "studies"), "--no-progress", "--no-plots",
            "--top-k", "0", "--grace-period", "3"]
    env = {**os.environ, "AUTOTUNE_TEST_STALL_ONCE": str(marker)}
    tuner = subprocess.Popen([sys.executable, "-c", OTHER_HOST, *args], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    while not marker.exists():
        assert time.time() < deadline and tuner.poll() is None, tuner.communicate()[1]
        time.sleep(0.3)
    time.sleep(1.5)  # at least one renewal of the lease
    tuner.send_signal(signal.SIGKILL)
    tuner.wait()
    assert _gone(int(marker.read_text()))

    def journal_study():
        return optuna.load_study(study_name="s", storage=optuna.storages.JournalStorage(
            optuna.storages.journal.JournalFileBackend(str(journal))))

    running = [t for t in journal_study().trials if t.state == TrialState.RUNNING]
    assert len(running) == 1 and running[0].user_attrs["worker"].startswith("other-host:")
    assert "heartbeat" in running[0].user_attrs

    again = subprocess.run(_cmd(*args), env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    study = journal_study()
    failed = [t for t in study.trials if t.state == TrialState.FAIL and t.user_attrs.get("status") != "not_run"]
    assert [t.number for t in failed] == [running[0].number]
    # Where the probes queued a pick before the dead trial was found, the retry takes the last place, not it.
    for dropped in [t for t in study.trials if t.user_attrs.get("status") == "not_run"]:
        assert "retries of trials whose worker died" in dropped.user_attrs["failure"]
    assert "renewed no lease" in failed[0].user_attrs["failure"]
    retries = [t for t in study.trials if t.user_attrs.get("retry_of") == failed[0].number]
    assert len(retries) == 1 and retries[0].state == TrialState.COMPLETE
    assert len([t for t in study.trials if t.state == TrialState.COMPLETE]) == 3


def test_a_lease_renewed_by_a_skewed_clock_is_not_stale():
    from types import SimpleNamespace

    from autotune.study._workers import LeaseWatch

    watch = LeaseWatch(SimpleNamespace(lease_grace_period=3, lease_interval=0.2))
    trial = SimpleNamespace(_trial_id=1, user_attrs={"heartbeat": time.time() - 3600}, datetime_start=None)
    assert watch.stale_for(trial) is None  # first sight: not yet seen unrenewed
    for _ in range(4):
        time.sleep(0.15)
        trial.user_attrs = {"heartbeat": trial.user_attrs["heartbeat"] + 0.15}  # an hour behind, but renewing
        assert watch.stale_for(trial) is None
    time.sleep(0.45)
    assert watch.stale_for(trial) > 3000  # it stopped renewing


# -- 9. concurrent first creation -----------------------------------------------------------------------

def _open_and_create(url, number, barrier, errors):
    from autotune.study._storage import open_storage

    try:
        barrier.wait(timeout=60)
        storage, _ = open_storage(url)
        optuna.create_study(study_name=f"s{number}", storage=storage)
    except Exception as exc:  # reported to the test, which names it
        errors.put(f"{number}: {type(exc).__name__}: {str(exc).splitlines()[0]}")


def test_sixteen_concurrent_first_openers_of_a_sqlite_file_all_succeed(tmp_path):
    url = f"sqlite:///{tmp_path / 'new.db'}"
    context = multiprocessing.get_context("fork")  # cheap: the test process has imported everything
    barrier, errors = context.Barrier(16), context.Queue()
    procs = [context.Process(target=_open_and_create, args=(url, i, barrier, errors)) for i in range(16)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    failed = []
    while not errors.empty():
        failed.append(errors.get())
    assert not failed, f"{len(failed)} of 16 failed: {failed[:3]}"
    assert all(p.exitcode == 0 for p in procs)
    assert len(optuna.get_all_study_summaries(url)) == 16


def test_concurrent_tunes_of_one_study_run_its_reference_once(space, tmp_path):
    runs = tmp_path / "runs.txt"
    url = f"journal:{tmp_path / 'r.journal'}"  # (SQLite's first creation is the test above)
    command = _cmd("tune", f"{HERE / 'scale_workloads.py'}:train_counts_runs", "--prune-below", "0", "--space",
                   str(space), "--storage", url, "--study", "s", "--trials", "2", "--studies-dir",
                   str(tmp_path / "studies"), "--no-progress", "--no-plots", "--top-k", "0")
    env = {**os.environ, "AUTOTUNE_TEST_RUNS": str(runs)}
    tuners = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(2)]
    for tuner in tuners:
        _, err = tuner.communicate(timeout=300)
        assert tuner.returncode == 0, err
    baseline_runs = [line for line in runs.read_text().splitlines() if line.split()[0] == "16"]
    assert baseline_runs and len(baseline_runs) == len(set(baseline_runs)), baseline_runs  # each seed once
    study = optuna.load_study(study_name="s", storage=optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(tmp_path / "r.journal"))))
    assert len([t for t in study.trials if t.user_attrs.get("role") == "reference"]) == 1


# -- 10. the dashboard on a journal -----------------------------------------------------------------------

def _port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _studies_served(command, port):
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and server.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=10) as response:
                    return [s["study_name"] for s in json.loads(response.read())["study_summaries"]]
            except OSError:
                time.sleep(0.3)  # still starting
        raise AssertionError(server.communicate(timeout=10)[0] if server.poll() is not None else "no answer")
    finally:
        server.terminate()
        server.communicate(timeout=30)


def test_the_dashboard_and_its_printed_hint_open_a_journal(tmp_path):
    pytest.importorskip("optuna_dashboard")
    journal = tmp_path / "d.journal"
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
    optuna.create_study(study_name="journal-study", storage=storage).optimize(lambda t: t.suggest_float("x", 0, 1), 2)
    port = _port()
    assert _studies_served(_cmd("dashboard", "--storage", f"journal:{journal}", "--port", str(port),
                                "--studies-dir", str(tmp_path)), port) == ["journal-study"]
    port = _port()  # the hint: optuna-dashboard itself, given the file's path
    hint = [sys.executable, "-c", "from optuna_dashboard._cli import main; main()", str(journal), "--port", str(port)]
    assert _studies_served(hint, port) == ["journal-study"]
