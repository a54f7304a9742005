"""Faults found by a hostile tester (round two): half-made studies, changed settings on resume, missing
metrics, paused workers, infrastructure failures, leaked passwords, hangs, tracebacks and path escapes.

Each test drives the real thing: the ``autotune`` command in a subprocess, real SQLite files, a real
PostgreSQL database (created and dropped per test), real signals.
"""

import json
import os
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from tests.test_scaleout import TARGET, _autotune as _cmd, postgres_url  # noqa: F401 (a fixture)

HERE = Path(__file__).resolve().parent
WORKLOADS = HERE / "scale_workloads.py"


def _tune(tmp_path, storage, *extra, target=TARGET, study="s", trials=2, env=None, timeout=300):
    space = tmp_path / "space.yaml"
    if not space.exists():
        from scale_workloads import SPACE

        space.write_text(SPACE)
    return subprocess.run(
        _cmd("tune", target, "--space", str(space), "--storage", storage, "--study", study, "--trials", str(trials),
             "--studies-dir", str(tmp_path / "studies"), "--no-progress", "--no-plots", "--prune-below", "0", "--top-k", "0",
             *extra),
        capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
    )


def _one_line_error(proc, expected):
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if not line.startswith("autotune: warning")]
    assert len(lines) == 1 and expected in lines[0], proc.stderr


# -- 4: an interrupted creation leaves no half-made study ---------------------------------------------------


def _fail_attribute_writes(storage: str) -> callable:
    """Make the storage fail to store the study's attributes, as a full disk would mid-creation; return the undo.

    SQLite: a trigger that calls a function no connection defines fails every insert with an
    OperationalError, the class of SQLITE_FULL (a trigger's RAISE is an IntegrityError, which Optuna
    ignores for attributes). PostgreSQL: a trigger raises on the ``space`` attribute.
    """
    optuna.storages.RDBStorage(storage)  # the tables, as the first `autotune` would make them
    if storage.startswith("sqlite:///"):
        path = storage[len("sqlite:///"):]
        with sqlite3.connect(path) as conn:
            conn.execute("CREATE TRIGGER full BEFORE INSERT ON study_user_attributes "
                         "BEGIN SELECT database_or_disk_is_full(); END")

        def undo() -> None:
            with sqlite3.connect(path) as conn:
                conn.execute("DROP TRIGGER full")
        return undo
    import psycopg

    plain = storage.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(plain, autocommit=True) as conn:
        conn.execute("CREATE FUNCTION full_disk() RETURNS trigger AS $$ BEGIN "
                     "IF NEW.key = 'space' THEN RAISE EXCEPTION 'could not extend file: No space left on device'; "
                     "END IF; RETURN NEW; END $$ LANGUAGE plpgsql")
        conn.execute("CREATE TRIGGER disk_full BEFORE INSERT ON study_user_attributes FOR EACH ROW EXECUTE FUNCTION full_disk()")

    def undo_pg() -> None:
        with psycopg.connect(plain, autocommit=True) as conn:
            conn.execute("DROP TRIGGER disk_full ON study_user_attributes")
    return undo_pg


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_an_interrupted_creation_is_finished_on_resume(kind, tmp_path, request):
    storage = f"sqlite:///{tmp_path / 'a.db'}" if kind == "sqlite" else request.getfixturevalue("postgres_url")
    undo = _fail_attribute_writes(storage)
    first = _tune(tmp_path, storage)
    _one_line_error(first, "failed while study 's' was being created")
    assert "No space left" in first.stderr or "disk_is_full" in first.stderr
    half = optuna.load_study(study_name="s", storage=storage)  # what the fault left: a study without its space
    assert "space" not in half.user_attrs and "creation_done" not in half.user_attrs and half.trials == []

    # A worker does not join it, and says why in one line.
    worker = subprocess.run(_cmd("worker", TARGET, "--study", "s", "--storage", storage, "--studies-dir",
                                 str(tmp_path / "studies"), "--no-progress", "--no-plots"), capture_output=True, text=True, timeout=120)
    _one_line_error(worker, "was left half-made")

    undo()  # the space is freed
    again = _tune(tmp_path, storage)
    assert again.returncode == 0, again.stderr
    study = optuna.load_study(study_name="s", storage=storage)
    attrs = study.user_attrs
    assert attrs["creation_done"] is True
    assert attrs["target"] == TARGET and attrs["metric_direction"] == "maximize" and "space" in attrs
    assert study.trials[0].user_attrs["role"] == "reference"
    assert len([t for t in study.trials if t.state == TrialState.COMPLETE]) == 2

    if kind != "sqlite":
        return
    # Now that the study records its space, a changed one is refused by name, not by an Optuna crash.
    changed = tmp_path / "changed.yaml"
    changed.write_text((tmp_path / "space.yaml").read_text().replace("[8, 16, 24, 32, 40, 48]", "[16, 32]"))
    refused = _tune(tmp_path, storage, "--space", str(changed), trials=3)
    _one_line_error(refused, "created with another search space")


def test_a_half_made_study_with_trials_is_refused_in_one_line(tmp_path):
    # What the old code left behind: a study row without attributes, resumed into trials anyway.
    storage = f"sqlite:///{tmp_path / 'a.db'}"
    study = optuna.create_study(study_name="s", storage=storage, directions=["maximize", "minimize"])
    study.add_trial(optuna.trial.create_trial(values=[1.0, 0.0]))
    proc = _tune(tmp_path, storage)
    _one_line_error(proc, "was left half-made (its creation was interrupted) and has 1 trials since")


# -- 5: a resume that changes how trials are judged is refused; an edited target is noticed ----------------


def test_a_resume_refuses_a_changed_direction_or_bound_and_warns_of_an_edited_target(tmp_path):
    target_path = tmp_path / "workload.py"
    target_path.write_text(WORKLOADS.read_text())
    target = f"{target_path}:train"
    storage = f"sqlite:///{tmp_path / 'a.db'}"
    created = _tune(tmp_path, storage, target=target)
    assert created.returncode == 0, created.stderr
    before = len(optuna.load_study(study_name="s", storage=storage).trials)

    direction = _tune(tmp_path, storage, "--metric-direction", "minimize", target=target, trials=3)
    _one_line_error(direction, "created with --metric-direction maximize, not minimize")
    bound = _tune(tmp_path, storage, "--max-accuracy-loss", "0.05", target=target, trials=3)
    _one_line_error(bound, "created with --max-accuracy-loss 0.01, not 0.05")
    assert len(optuna.load_study(study_name="s", storage=storage).trials) == before  # nothing ran

    target_path.write_text(target_path.read_text() + "\n# edited after the study was created\n")
    edited = _tune(tmp_path, storage, target=target, trials=3)
    assert edited.returncode == 0, edited.stderr
    assert f"warning: {target_path} changed since study 's' was created" in edited.stderr


# -- 6: a trial without the metric the reference reported is never a pass ----------------------------------


def test_a_trial_that_skips_report_metric_is_an_error_not_a_pass(tmp_path):
    from autotune.study._verdict import ReferenceBand, judge

    band = ReferenceBand.of([([1.0, 0.8, 0.5, 0.2, 0.1, 0.1, 0.1, 0.1], 0.9)] * 2)
    verdict = judge([1.0, 0.8, 0.5, 0.2, 0.1, 0.1, 0.1, 0.1], None, band, reference_metric=0.9, max_accuracy_loss=0.01)
    assert verdict.label == "unchecked" and "no metric was reported" in verdict.evidence  # the pure verdict

    storage = f"sqlite:///{tmp_path / 'a.db'}"
    proc = _tune(tmp_path, storage, target=f"{WORKLOADS}:train_metric_at_baseline_only", trials=3)
    assert proc.returncode == 0, proc.stderr
    study = optuna.load_study(study_name="s", storage=storage)
    others = [t for t in study.trials if t.state == TrialState.COMPLETE and t.user_attrs.get("role") != "reference"]
    assert others
    for trial in others:
        assert trial.user_attrs["status"] == "error", trial.user_attrs
        assert "reported no metric" in trial.user_attrs["error"]
        assert trial.constraints["failure"] > 0 and trial.values[1] == float("inf")  # infeasible, never the best
    best = json.loads((tmp_path / "studies" / "s" / "best_config.json").read_text())
    assert best["trial"] == 0


# -- 7: a paused worker whose trial was taken over goes on ------------------------------------------------


def test_a_paused_worker_finds_its_trial_taken_over_and_goes_on(postgres_url, tmp_path):
    target = f"{WORKLOADS}:train_pauses_once"
    created = _tune(tmp_path, postgres_url, "--create-only", target=target, trials=4)
    assert created.returncode == 0, created.stderr
    marker = tmp_path / "paused.pid"

    def worker(env):
        return subprocess.Popen(_cmd("worker", target, "--study", "s", "--storage", postgres_url, "--grace-period", "2",
                                     "--studies-dir", str(tmp_path / "studies"), "--no-progress", "--no-plots"),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env})

    paused = worker({"AUTOTUNE_TEST_PAUSE_ONCE": str(marker)})
    deadline = time.time() + 180
    while not marker.exists():
        assert time.time() < deadline and paused.poll() is None, paused.communicate()[1]
        time.sleep(0.2)
    paused.send_signal(signal.SIGSTOP)
    other = worker({})
    try:
        deadline = time.time() + 120
        while True:  # the other worker fails the silent trial as stale (no heartbeat for 2 s)
            study = optuna.load_study(study_name="s", storage=postgres_url)
            failed = [t for t in study.trials if t.state == TrialState.FAIL]
            if failed:
                break
            assert time.time() < deadline, "the paused worker's trial was never taken over"
            time.sleep(0.5)
    finally:
        paused.send_signal(signal.SIGCONT)
    out, err = paused.communicate(timeout=300)
    assert paused.returncode == 0, err
    assert f"trial {failed[0].number} was taken over by another worker" in err
    assert "UpdateFinishedTrialError" not in err
    other_err = other.communicate(timeout=300)[1]
    assert other.returncode == 0, other_err
    study = optuna.load_study(study_name="s", storage=postgres_url)
    retried = [t for t in study.trials if t.state == TrialState.COMPLETE and t.params == failed[0].params
               and "duplicate_of" not in t.user_attrs]
    assert len(retried) == 1, "the taken-over config was not run again exactly once"
    assert len([t for t in study.trials if t.state == TrialState.COMPLETE and "status" in t.user_attrs]) == 4


# -- 8: infrastructure faults are `infra`, retried, never reused; the trial server is restarted -------------


def _isolated(fn, tmp_path, timeout=60.0, memory_limit_gib=None, **config):
    from autotune import Budget, TrialConfig
    from autotune.study._isolation import run_isolated
    from autotune.trial._execute import TrialSpec

    spec = TrialSpec(f"{WORKLOADS}:{fn}", TrialConfig(**{"batch_size": 16, **config}),
                     Budget(samples=512, warmup_steps=1, windows=3), memory_limit_gib=memory_limit_gib)
    return run_isolated(spec, workdir=tmp_path / fn, timeout=timeout)


def test_a_killed_trial_server_is_infra_and_is_restarted(tmp_path):
    outcome = _isolated("kills_its_trial_server", tmp_path)
    assert outcome.status == "infra" and "trial server" in outcome.error, outcome
    assert _isolated("train", tmp_path).status == "ok"  # the next trial runs on a new server


def test_a_lost_log_folder_is_infra_and_a_bad_record_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_TEST_RMTREE", str(tmp_path / "train_loses_its_folder"))
    monkeypatch.setenv("AUTOTUNE_TEST_RMTREE_ONCE", str(tmp_path / "once"))
    outcome = _isolated("train_loses_its_folder", tmp_path, batch_size=32)
    assert outcome.status == "infra" and "could not write its log or result" in outcome.error, outcome
    recorded = _isolated("records_an_object", tmp_path)
    assert recorded.status == "error" and "not JSON-serialisable" in recorded.error, recorded


def test_threads_refused_under_memory_limit_are_oom(tmp_path):
    outcome = _isolated("starts_threads", tmp_path, memory_limit_gib=0.05)
    assert outcome.status == "oom", outcome


def test_an_infra_failure_is_retried_and_never_reused(tmp_path):
    storage = f"sqlite:///{tmp_path / 'a.db'}"
    env = {"AUTOTUNE_TEST_RMTREE": str(tmp_path / "studies" / "s" / "logs"),
           "AUTOTUNE_TEST_RMTREE_ONCE": str(tmp_path / "once")}
    proc = _tune(tmp_path, storage, target=f"{WORKLOADS}:train_loses_its_folder", trials=3, env=env)
    assert proc.returncode == 0, proc.stderr
    study = optuna.load_study(study_name="s", storage=storage)
    failed = [t for t in study.trials if t.state == TrialState.FAIL]
    assert len(failed) == 1 and failed[0].user_attrs["failure"].startswith("infra:"), failed
    again = [t for t in study.trials if t.user_attrs.get("retry_of") == failed[0].number]
    assert len(again) == 1 and again[0].state == TrialState.COMPLETE and again[0].user_attrs["status"] == "ok"
    assert "duplicate_of" not in again[0].user_attrs and again[0].params == failed[0].params


def test_three_infra_failures_in_a_row_stop_the_run_naming_the_last_failure(tmp_path):
    storage = f"sqlite:///{tmp_path / 'a.db'}"
    env = {"AUTOTUNE_TEST_RMTREE": str(tmp_path / "studies" / "s" / "logs"), "AUTOTUNE_TEST_RMTREE_ONCE": "always"}
    proc = _tune(tmp_path, storage, target=f"{WORKLOADS}:train_loses_its_folder", trials=6, env=env)
    _one_line_error(proc, "3 trials in a row failed outside the config (the trial process could not write its log")
    assert "()" not in proc.stderr


# -- 11: passwords stay out of everything printed, and out of the workers' argv ----------------------------


@pytest.mark.parametrize("url, secret", [
    ("postgresql://root:pa/ssLEAK1@db:5432/x", "LEAK1"),
    ("postgresql://root@db:5432/x?sslmode=off&password=LEAK2", "LEAK2"),
    ("postgresql://:LEAK3@db/x", "LEAK3"),
    ("postgresql://root:pa@ssLEAK4@db/x", "LEAK4"),
    ("cannot open storage mysql://u:LEAK5@db/x: refused", "LEAK5"),
])
def test_mask_url_hides_every_password(url, secret):
    from autotune.study._storage import mask_url

    masked = mask_url(url)
    assert secret not in masked and "***" in masked and "db" in masked


def _cmdlines() -> list[str]:
    lines = []
    for entry in Path("/proc").iterdir():
        try:
            lines.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            pass
    return lines


def test_workers_get_the_storage_url_outside_their_argv_and_nothing_prints_the_password(postgres_url, tmp_path):
    url = postgres_url.replace("postgres@", "postgres:pa/ssLEAK1@") + "?password=LEAK2"  # trust auth ignores it
    space = tmp_path / "space.yaml"
    from scale_workloads import SPACE

    space.write_text(SPACE)
    proc = subprocess.Popen(
        _cmd("tune", f"{WORKLOADS}:train_takes_seconds", "--space", str(space), "--storage", url, "--study", "s",
             "--trials", "3", "--workers", "2", "--studies-dir", str(tmp_path / "studies"), "--no-progress", "--no-plots",
             "--prune-below", "0", "--top-k", "0"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen_workers, leaked = 0, []
    while proc.poll() is None:
        for line in _cmdlines():
            if "autotune worker" in line or "autotune', 'worker" in line or " worker " in line and "autotune" in line:
                seen_workers += 1
            if "LEAK" in line and "pytest" not in line:
                leaked.append(line)
        time.sleep(0.2)
    out, err = proc.communicate()
    assert proc.returncode == 0, err
    assert seen_workers > 0, "never saw a worker process"
    assert not leaked, leaked
    assert "LEAK" not in out + err and "***" in out
    assert len([t for t in optuna.load_study(study_name="s", storage=postgres_url).trials
                if t.state == TrialState.COMPLETE]) >= 3


# -- 12: no quadratic hangs ----------------------------------------------------------------------------------


def test_a_range_with_a_tiny_step_is_refused_at_once(write_space):
    from autotune._errors import SpaceError
    from autotune.search._space import load_space

    path = write_space("knobs:\n  memory_fraction: {low: 0.1, high: 1.0, step: 1.0e-7}\n")
    started = time.monotonic()
    with pytest.raises(SpaceError, match=r"memory_fraction: 0.1 to 1.0 in steps of 1e-07 is 9,000,001 values; at most"):
        load_space(path)
    assert time.monotonic() - started < 1.0


def test_simulate_loads_a_large_table_in_linear_time(tmp_path):
    from autotune.search._simulate import ReplayTable

    path = tmp_path / "big.jsonl"
    with path.open("w") as fh:  # 40,000 rows, one param with 40,000 distinct values
        for i in range(40_000):
            fh.write(json.dumps({"params": {"batch_size": 8 * (i + 1), "precision": "bf16"}, "status": "ok",
                                 "throughput": 1.0 + i}) + "\n")
    started = time.monotonic()
    table = ReplayTable.load(path)
    assert len(table) == 40_000 and len(table.values["batch_size"]) == 40_000
    assert time.monotonic() - started < 5.0


# -- 13: one line, never a traceback ------------------------------------------------------------------------

MODULES = HERE / "fault_modules"


@pytest.mark.parametrize("args, expected", [
    (["--max-accuracy-loss", "-1"], "--max-accuracy-loss: -1 is not a finite number >= 0"),
    (["--max-accuracy-loss", "nan"], "--max-accuracy-loss: nan is not a finite number >= 0"),
    (["--prune-below", "1.5"], "--prune-below: 1.5 is not a fraction in [0, 1)"),
    (["--trial-timeout", "inf"], "--trial-timeout: inf is not a positive finite number"),
])
def test_options_out_of_range_are_one_line(args, expected, tmp_path):
    proc = subprocess.run(_cmd("tune", TARGET, "--storage", f"sqlite:///{tmp_path / 'a.db'}", *args),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and expected in proc.stderr, proc.stderr
    assert not (tmp_path / "a.db").exists()


def test_bad_files_modules_and_ports_are_one_line(tmp_path):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_bytes(b"knobs:\n  batch_size: [8, 16]\n# \xff\xfe\n")
    bad_table = tmp_path / "bad.jsonl"
    bad_table.write_bytes(b'{"params": {"a": 1}, "status": "ok", "throughput": 1}\n\xff\n')
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    storage = f"sqlite:///{tmp_path / 'a.db'}"
    cases = [
        (_cmd("tune", TARGET, "--space", str(bad_yaml), "--storage", storage), "not UTF-8 text"),
        (_cmd("simulate", str(bad_table)), "not UTF-8 text"),
        (_cmd("tune", TARGET, "--studies-dir", str(blocker / "studies")), "Not a directory"),
        (_cmd("tune", f"{MODULES / 'exits_at_import.py'}:train", "--storage", storage), "called sys.exit(0)"),
    ]
    for command, expected in cases:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        _one_line_error(proc, expected)
    import socket

    with socket.socket() as sock:  # a port in use
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        _tune(tmp_path, storage, trials=1)
        port = sock.getsockname()[1]
        proc = subprocess.run(_cmd("dashboard", "--storage", storage, "--port", str(port)), capture_output=True,
                              text=True, timeout=60)
        _one_line_error(proc, f"cannot listen on 127.0.0.1:{port}")



def test_a_script_that_fails_at_import_is_one_line_naming_its_file_and_line_in_tune_and_train(tmp_path):
    (tmp_path / "helper.py").write_text("import torch\n\nSIZE = torch.ones(2)[5]\n")
    (tmp_path / "script.py").write_text("import helper\n\n\ndef train(ctx):\n    pass\n")
    storage = f"sqlite:///{tmp_path / 'a.db'}"
    said = "script.py:train: importing it raised IndexError: index 5 is out of bounds"
    cases = [
        (_cmd("tune", f"{tmp_path / 'script.py'}:train", "--storage", storage), said),
        (_cmd("train", f"{tmp_path / 'script.py'}:train", "--steps", "1", "--studies-dir", str(tmp_path)),
         said),
        (_cmd("train", f"{MODULES / 'exits_at_import.py'}:train", "--steps", "1", "--studies-dir", str(tmp_path)),
         "called sys.exit(0)"),
    ]
    for command, expected in cases:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        _one_line_error(proc, expected)
        # The innermost line of the user's own files, not torch's nor importlib's.
        assert expected != said or proc.stderr.strip().endswith("(helper.py, line 3)"), proc.stderr


def test_a_module_that_prints_at_import_without_a_newline_still_tunes(tmp_path):
    proc = _tune(tmp_path, f"sqlite:///{tmp_path / 'a.db'}", target=f"{MODULES / 'prints_at_import.py'}:train", trials=1)
    assert proc.returncode == 0, proc.stderr


# -- 14: study names never escape studies/ nor share a folder ----------------------------------------------


def test_a_study_name_that_escapes_or_collides_is_refused_or_kept_apart(tmp_path):
    from autotune import load_best
    from autotune._errors import StudyError
    from autotune._records import study_dir

    for name in ("..", "x/y", "a" * 256):
        proc = subprocess.run(_cmd("tune", TARGET, "--study", name, "--storage", f"sqlite:///{tmp_path / 'a.db'}",
                                   "--studies-dir", str(tmp_path / "studies")),
                              capture_output=True, text=True, timeout=60, cwd=tmp_path)
        _one_line_error(proc, "study name")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written, inside studies/ or out

    assert study_dir("x y") != study_dir("x_y") and study_dir("x_y").name == "x_y"
    assert len({study_dir(n) for n in ("x y", "x:y", "x_y", "x?y")}) == 4

    folder = study_dir("x_y", tmp_path)
    folder.mkdir(parents=True)
    (folder / "best_config.json").write_text(json.dumps({"study": "x y", "config": {"batch_size": 16}}))
    with pytest.raises(StudyError, match="belongs to study 'x y', not 'x_y'"):
        load_best("x_y", studies_dir=tmp_path)


def test_an_empty_or_reserved_study_name_is_refused(tmp_path):
    # "" is not the function's name; "artifacts" would share the dashboard's artifact store.
    for name, says in (("", "must not be empty"), ("artifacts", "autotune's own"), ("autotune.db", "autotune's own")):
        proc = subprocess.run(_cmd("tune", TARGET, "--study", name, "--storage", f"sqlite:///{tmp_path / 'a.db'}",
                                   "--studies-dir", str(tmp_path / "studies")),
                              capture_output=True, text=True, timeout=60, cwd=tmp_path)
        _one_line_error(proc, f"study name {name!r}")
        assert says in proc.stderr, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# -- 15: small ones ------------------------------------------------------------------------------------------


def test_markup_in_a_path_and_concurrent_best_config_writers(tmp_path):
    import threading

    from autotune._api import load_study_result
    from autotune.study._results import write_best_config

    studies = tmp_path / "out[/red]"
    storage = f"sqlite:///{tmp_path / 'a.db'}"
    proc = _tune(tmp_path, storage, "--studies-dir", str(studies), trials=1)
    assert proc.returncode == 0, proc.stderr
    assert "MarkupError" not in proc.stderr and "Best config written to" in proc.stdout

    study, result = load_study_result("s", storage=storage)
    errors = []

    def write() -> None:
        for _ in range(50):
            try:
                write_best_config(study, result, studies)
            except OSError as exc:
                errors.append(exc)

    threads = [threading.Thread(target=write) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert json.loads((studies / "s" / "best_config.json").read_text())["study"] == "s"
    assert [p.name for p in (studies / "s").iterdir() if p.name.endswith(".tmp")] == []


def test_read_commands_create_no_storage(postgres_url, tmp_path):
    import psycopg

    missing = subprocess.run(_cmd("best", "foo", "--studies-dir", str(tmp_path / "studies")),
                             capture_output=True, text=True, timeout=60, cwd=tmp_path)
    _one_line_error(missing, "no study database at")
    assert not (tmp_path / "studies").exists()
    journal = subprocess.run(_cmd("best", "foo", "--storage", f"journal:{tmp_path / 'j.journal'}"),
                             capture_output=True, text=True, timeout=60, cwd=tmp_path)
    _one_line_error(journal, "no journal file at")
    assert not (tmp_path / "j.journal").exists()
    empty = subprocess.run(_cmd("best", "foo", "--storage", postgres_url), capture_output=True, text=True,
                           timeout=60, cwd=tmp_path)
    _one_line_error(empty, "holds no Optuna studies")
    with psycopg.connect(postgres_url.replace("postgresql+psycopg://", "postgresql://")) as conn:
        tables = conn.execute("SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'").fetchone()
    assert tables == (0,)
