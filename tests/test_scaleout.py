"""Many workers, one study: PostgreSQL and journal storages with real worker processes."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

HERE = Path(__file__).resolve().parent
TARGET = f"{HERE / 'scale_workloads.py'}:train"
STALLING = f"{HERE / 'scale_workloads.py'}:train_stalls"
# Trials of a few seconds: each worker makes its trial server ready (a torch import) before it asks for
# one, and sub-second trials could all go to whichever worker was ready first.
SECONDS_LONG = f"{HERE / 'scale_workloads.py'}:train_takes_seconds"
PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"


def _autotune(*args):
    return [sys.executable, "-m", "autotune", *args]


@pytest.fixture
def postgres_url():
    psycopg = pytest.importorskip("psycopg")
    name = f"autotune_test_{uuid.uuid4().hex[:10]}"
    try:
        admin = psycopg.connect(PG_ADMIN, autocommit=True)
    except psycopg.OperationalError as exc:  # the project's machines run one; elsewhere say why
        pytest.skip(f"no PostgreSQL at 127.0.0.1:5432: {exc}")
    admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    finally:
        admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
        admin.close()


def _create(space, storage, tmp_path, trials, target=TARGET, *extra):
    proc = subprocess.run(
        _autotune("tune", target, "--space", str(space), "--storage", storage, "--study", "s",
                  "--trials", str(trials), "--create-only", "--studies-dir", str(tmp_path / "studies"),
                  "--no-progress", "--no-plots", "--prune-below", "0", *extra),
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "autotune worker" in proc.stdout


def _worker(storage, tmp_path, target=TARGET, env=None, grace=60):
    return subprocess.Popen(
        _autotune("worker", target, "--study", "s", "--storage", storage, "--grace-period", str(grace),
                  "--studies-dir", str(tmp_path / "studies"), "--no-progress", "--no-plots"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})},
    )


def _complete(study):
    return [t for t in study.trials if t.state == TrialState.COMPLETE]


def test_three_workers_complete_exactly_the_budget(postgres_url, space, tmp_path):
    _create(space, postgres_url, tmp_path, 6, SECONDS_LONG, "--max-accuracy-loss", "0.2")
    workers = [_worker(postgres_url, tmp_path, target=SECONDS_LONG) for _ in range(3)]
    for w in workers:
        out, err = w.communicate(timeout=600)
        assert w.returncode == 0, err
    study = optuna.load_study(study_name="s", storage=postgres_url)
    done = _complete(study)
    assert len(done) == 6
    run = [t for t in done if "duplicate_of" not in t.user_attrs]
    keys = [json.dumps(t.params, sort_keys=True) for t in run]
    assert len(keys) == len(set(keys)), "a config was run twice"
    workers_seen = {t.user_attrs["worker"].rsplit(":", 1)[0] for t in done}
    assert len(workers_seen) >= 2, "the trials were not spread over the workers"
    attrs = study.user_attrs
    for t in done:
        assert t.user_attrs["hostname"] and t.user_attrs["device"].startswith("cpu")
        # The study's bound (0.2), not a worker's default, plus the noise band of the trial's own global batch.
        noise = attrs.get(f"reference_noise:batch={t.params['batch_size']}", attrs["metric_noise"])
        assert t.constraints["accuracy"] == pytest.approx(t.values[1] - (0.2 + noise))
    # The fp32 reference ran once for the study, not once per worker.
    logs = tmp_path / "studies" / "s" / "logs"
    assert sorted(p.name for p in logs.glob("reference-[0-9]*")) == ["reference-0", "reference-1"]
    # So did each global batch's (batch_policy scale): two seeds each, however many workers reached it.
    for folder in logs.glob("reference-batch-*"):
        assert sorted(p.name for p in folder.iterdir()) == ["seed-0", "seed-1"], folder.name


def test_killed_worker_trial_is_failed_and_retried_by_survivor(postgres_url, space, tmp_path):
    _create(space, postgres_url, tmp_path, trials=6, target=STALLING)
    stall = tmp_path / "stall.pids"
    storage = postgres_url
    # Worker A gets the stalling config first: enqueue it so it is the next trial asked for.
    optuna.load_study(study_name="s", storage=storage).enqueue_trial({"batch_size": 48})
    victim = _worker(storage, tmp_path, target=STALLING, env={"AUTOTUNE_TEST_STALL": str(stall)}, grace=4)
    deadline = time.time() + 120
    while not (stall.exists() and stall.read_text().strip()):
        assert time.time() < deadline, "the stalling trial never started"
        assert victim.poll() is None, victim.communicate()[1]
        time.sleep(0.5)
    trial_pid = int(stall.read_text().split()[0])
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    survivor = _worker(storage, tmp_path, target=STALLING, grace=4)
    out, err = survivor.communicate(timeout=600)
    assert survivor.returncode == 0, err

    study = optuna.load_study(study_name="s", storage=storage)
    failed = [t for t in study.trials if t.state == TrialState.FAIL]
    assert len(failed) == 1 and failed[0].params == {"batch_size": 48}
    retried = [t for t in _complete(study) if t.params == {"batch_size": 48} and "duplicate_of" not in t.user_attrs]
    assert len(retried) == 1, "the stale trial's config was not run again exactly once"
    assert retried[0].user_attrs.get("retry_of") == failed[0].number or "failed_trial" in retried[0].system_attrs
    assert failed[0].user_attrs.get("failure", "").startswith("stale") or "failed_trial" in retried[0].system_attrs
    assert len(_complete(study)) == 6
    # The orphaned trial process died with its coordinator.
    assert _gone(trial_pid), f"trial process {trial_pid} outlived its killed worker"


def _gone(pid, wait=10.0):
    """True once ``pid`` no longer runs (a zombie waiting to be reaped counts as gone)."""
    deadline = time.time() + wait
    while time.time() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.1)
    return False


def test_tune_with_several_workers_uses_a_journal_file(space, tmp_path):
    studies = tmp_path / "studies"
    proc = subprocess.run(
        _autotune("tune", SECONDS_LONG, "--space", str(space), "--study", "s", "--trials", "5", "--workers", "2",
                  "--studies-dir", str(studies), "--no-progress", "--no-plots", "--top-k", "0", "--prune-below", "0"),
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "journal" in proc.stderr
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    storage = JournalStorage(JournalFileBackend(str(studies / "autotune.journal")))
    study = optuna.load_study(study_name="s", storage=storage)
    assert len(_complete(study)) == 5
    trials = [t for t in _complete(study) if t.user_attrs.get("role") != "reference"]
    assert len({t.user_attrs["worker"] for t in trials}) == 2  # the two workers, not the creating process
    assert (studies / "s" / "best_config.json").is_file()


def test_worker_refuses_a_missing_study(tmp_path):
    proc = subprocess.run(
        _autotune("worker", TARGET, "--study", "nope", "--storage", f"sqlite:///{tmp_path}/x.db",
                  "--studies-dir", str(tmp_path)),
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0 and "no study 'nope'" in proc.stderr
