"""Faults, round three: real processes, real storages (SQLite, journal files, PostgreSQL), real signals.

Each test names the fault it guards against; benchmarks/results/faults.md ("Round three") has the table.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from round3_workloads import ENVDIR_ENV
from tests.test_scaleout import postgres_url  # noqa: F401 (a fixture)

HERE = Path(__file__).resolve().parent
WORKLOADS = HERE / "round3_workloads.py"


def _autotune(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autotune", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


# -- the password ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, secret", [
    ("postgresql://root:pa ssLEAK1@db:5432/x", "LEAK1"),  # a raw space
    ("cannot open storage postgresql://u:a b@/LEAK2@db/x: refused", "LEAK2"),  # a space, then "@/"
    ("postgresql://u:ab@/LEAK3@db/x and sqlite:///a.db", "LEAK3"),
    ("first line\npostgresql://u:pw LEAK4@db/x\nlast line user@example", "LEAK4"),
])
def test_mask_url_hides_passwords_with_spaces_and_raw_at_signs(text, secret):
    from autotune.study._storage import mask_url

    masked = mask_url(text)
    assert secret not in masked and ":***@db" in masked


def test_the_url_comes_from_the_environment_or_a_file_and_no_trial_sees_it(postgres_url, tmp_path):
    from scale_workloads import SPACE

    url = postgres_url.replace("postgres@", "postgres:pa ssLEAK5@")  # trust auth ignores the password
    (tmp_path / "space.yaml").write_text(SPACE)
    envdir = tmp_path / "env"
    envdir.mkdir()
    studies = str(tmp_path / "studies")
    proc = _autotune("tune", f"{WORKLOADS}:train_writes_its_environment", "--space", str(tmp_path / "space.yaml"),
                     "--study", "s", "--trials", "3", "--workers", "2", "--studies-dir", studies, "--no-progress",
                     "--no-plots", "--prune-below", "0", "--top-k", "0",
                     env={"AUTOTUNE_STORAGE": url, ENVDIR_ENV: str(envdir)})
    assert proc.returncode == 0, proc.stderr
    assert "LEAK5" not in proc.stdout + proc.stderr
    seen = sorted(envdir.glob("*.env"))
    assert len(seen) >= 3  # the coordinator's reference trial and the workers' trials
    assert not [p.name for p in seen if b"LEAK5" in p.read_bytes() or b"AUTOTUNE_STORAGE" in p.read_bytes()]
    done = [t for t in optuna.load_study(study_name="s", storage=postgres_url).trials if t.state == TrialState.COMPLETE]
    assert len(done) >= 3

    (tmp_path / "url").write_text(url + "\n")
    for how, env in ((["--storage-file", str(tmp_path / "url")], {}), ([], {"AUTOTUNE_STORAGE": url})):
        best = _autotune("best", "s", "--studies-dir", studies, "--format", "json", *how, env=env, timeout=120)
        assert best.returncode == 0 and '"batch_size"' in best.stdout, best.stderr
    missing = _autotune("best", "s", "--storage-file", str(tmp_path / "nope"), timeout=120)
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1 and "--storage-file" in missing.stderr


# -- damaged or full storage ---------------------------------------------------------------------------------


def _damaged_study(path: Path) -> None:
    """A SQLite study of 200 trials with 4 KiB (its third page) zeroed, as a bad sector or a torn copy leaves it."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="s", storage=f"sqlite:///{path}")
    for i in range(200):
        trial = study.ask()
        trial.set_user_attr("note", "x" * 200)
        study.tell(trial, float(i))
    del study
    with open(path, "r+b") as fh:
        fh.seek(2 * 4096)
        fh.write(b"\0" * 4096)


@pytest.mark.parametrize("page", [0, 2])
def test_a_damaged_sqlite_file_is_one_line_naming_it_and_what_to_do(tmp_path, page):
    path = tmp_path / "studies" / "damaged.db"
    path.parent.mkdir()
    _damaged_study(path)
    if page == 0:
        with open(path, "r+b") as fh:
            fh.write(b"\0" * 4096)  # the header too: "file is not a database"
    (tmp_path / "space.yaml").write_text("knobs:\n  batch_size: [8, 16]\nbaseline: {batch_size: 16}\n")
    for args in (["best", "s"], ["tune", f"{WORKLOADS}:train_writes_its_environment", "--space",
                                 str(tmp_path / "space.yaml"), "--study", "s", "--no-progress", "--no-plots"]):
        proc = _autotune(*args, "--storage", f"sqlite:///{path}", "--studies-dir", str(tmp_path / "studies"),
                         timeout=120, env={ENVDIR_ENV: str(tmp_path)})
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert f"{path} is damaged" in proc.stderr and "restore it from a copy" in proc.stderr, proc.stderr


@pytest.fixture
def small_disk(tmp_path):
    """A real 3 MiB file system (tmpfs), mounted for the test: root only, else skipped."""
    where = tmp_path / "disk"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_a_disk_that_fills_mid_study_is_one_line_and_the_rerun_resumes(small_disk, tmp_path):
    from scale_workloads import SPACE

    from round3_workloads import FILL_ENV

    (tmp_path / "space.yaml").write_text(SPACE)
    storage = f"sqlite:///{small_disk / 's.db'}"
    args = ["tune", f"{WORKLOADS}:train_fills_the_disk", "--space", str(tmp_path / "space.yaml"), "--storage", storage,
            "--study", "s", "--trials", "4", "--studies-dir", str(tmp_path / "studies"), "--no-progress", "--no-plots",
            "--prune-below", "0", "--top-k", "0"]
    proc = _autotune(*args, env={FILL_ENV: str(small_disk / "filler")})
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "the disk is full" in proc.stderr and "rerun the same command to resume" in proc.stderr

    (small_disk / "filler").unlink()  # space freed: the same command resumes
    proc = _autotune(*args, env={FILL_ENV: ""})
    assert proc.returncode == 0, proc.stderr
    trials = optuna.load_study(study_name="s", storage=storage).trials
    assert not [t.number for t in trials if t.state == TrialState.RUNNING]
    assert [t.user_attrs["failure"] for t in trials if t.state == TrialState.FAIL][0].startswith("stale: worker")
    assert len([t for t in trials if t.state == TrialState.COMPLETE]) >= 4


# -- the dashboard's address ---------------------------------------------------------------------------------


def _external_address() -> str:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: this picks the address of the default route
            address = probe.getsockname()[0]
        except OSError:
            return ""
    return "" if address.startswith("127.") else address


@pytest.mark.parametrize("host, says", [
    ("", "every network"), ("0", "every network"), ("0:0:0:0:0:0:0:0", "every network"), ("[::]", "every network"),
    ("external", "the networks that reach"), ("127.0.0.1", None), ("localhost", None),
])
def test_the_dashboard_warns_of_every_address_others_can_reach(tmp_path, host, says):
    import socket

    if host == "external":
        host = _external_address()
        if not host:
            pytest.skip("this machine has no address besides the loopback")
    url = f"sqlite:///{tmp_path}/d.db"
    optuna.create_study(study_name="s", storage=url)
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind(("::" if ":" in host else "127.0.0.1", 0))
        port = sock.getsockname()[1]
    dashboard = subprocess.Popen([sys.executable, "-m", "autotune", "dashboard", "--storage", url, "--host", host,
                                  "--port", str(port), "--studies-dir", str(tmp_path)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out = dashboard.stdout.readline()  # printed once the address is checked, before the server starts
    finally:
        dashboard.terminate()
        err = dashboard.communicate(timeout=30)[1]
    assert "cannot listen" not in err and "error" not in err, err
    assert f":{port}/" in out
    warnings = [line for line in err.splitlines() if "warning: binding to" in line]
    if says is None:
        assert not warnings, err
    else:
        assert len(warnings) == 1 and says in warnings[0], err


# -- a heartbeat timeout says why -------------------------------------------------------------------------------


def test_a_trial_failed_by_heartbeat_timeout_records_why_and_is_retried(tmp_path):
    import time
    from types import SimpleNamespace

    from autotune.study._loop import TrialLoop
    from autotune.study._storage import open_storage

    storage, _ = open_storage(f"sqlite:///{tmp_path / 's.db'}", tmp_path, grace_period=2)
    study = optuna.create_study(study_name="s", storage=storage)
    trial = study.ask({"batch_size": optuna.distributions.CategoricalDistribution([8, 16])})
    trial.set_user_attr("worker", "gone-host.example:4242:1")
    storage.record_heartbeat(trial._trial_id)
    time.sleep(3.5)  # the worker on the other host stopped heartbeating
    TrialLoop._recover_stale(SimpleNamespace(study=study, storage=storage, _leases=None))
    failed = study.trials[trial.number]
    assert failed.state == TrialState.FAIL
    assert failed.user_attrs["failure"] == "stale: worker gone-host.example:4242:1 sent no heartbeat for 2s (the grace period)"
    assert study.get_trials(states=(TrialState.WAITING,))[0].params == failed.params  # its config runs again


# -- an edited module the target imports ---------------------------------------------------------------------


def test_an_edited_module_beside_the_target_warns_on_resume(tmp_path):
    from tests.test_faults import _tune

    (tmp_path / "constants.py").write_text("SCALE = 1\n")
    (tmp_path / "workload.py").write_text(
        "from constants import SCALE\n"
        f"from scale_workloads import train as _train\n\n\n"
        "def train(ctx):\n    assert SCALE >= 1\n    _train(ctx)\n")
    target = f"{tmp_path / 'workload.py'}:train"
    storage = f"sqlite:///{tmp_path / 'a.db'}"
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    created = _tune(tmp_path, storage, target=target, env=env)
    assert created.returncode == 0, created.stderr
    same = _tune(tmp_path, storage, target=target, trials=3, env=env)
    assert same.returncode == 0 and "warning" not in same.stderr, same.stderr

    (tmp_path / "constants.py").write_text("SCALE = 2\n")
    edited = _tune(tmp_path, storage, target=target, trials=4, env=env)
    assert edited.returncode == 0, edited.stderr
    assert (f"warning: module constants.py that {tmp_path / 'workload.py'} imports changed since study 's' was created"
            in edited.stderr)
