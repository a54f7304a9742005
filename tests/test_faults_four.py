"""Faults, round four: real processes, real Inductor on the CPU, a real small file system, real SQLite.

Each test names the fault it guards against; benchmarks/results/faults.md ("Round four") has the table.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from autotune import Budget, TrialConfig
from autotune.study._runner import TrialRunner
from autotune.trial._compile_cache import CACHE_DIR_ENV, cache_folder_fault
from autotune.trial._execute import infra_fault

HERE = Path(__file__).resolve().parent
WORKLOADS4 = HERE / "round4_workloads.py"


def _autotune(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autotune", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


# -- 1: a broken compile cache is the tuner's fault, and its content is never executed ---------------------


def _runner(studies: Path) -> TrialRunner:
    return TrialRunner(target=f"{WORKLOADS4}:train_compiles_a_function", logdir=studies / "s" / "logs",
                       baseline=TrialConfig(batch_size=32), budget=Budget(samples=256, warmup_steps=1, windows=3),
                       timeout=240)


def test_a_broken_compile_cache_falls_back_and_a_corrupt_entry_is_discarded_not_run(tmp_path, monkeypatch, capfd):
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    runner = _runner(tmp_path / "studies")
    config = TrialConfig(batch_size=32, compile="default")
    runner.compile_cache.parent.mkdir(parents=True)
    runner.compile_cache.write_text("not a folder")  # a file in place of the folder
    first = runner.run(config, "t0", seed=0)
    assert first.status == "ok", first
    fallback = runner.compile_cache.with_name("compile_cache-fallback")
    err = capfd.readouterr().err
    assert err.count("compile cache is unusable") == 1 and "is not a folder" in err and str(fallback) in err, err
    assert first.measurement.extras["compile_cache"] == "cold"
    assert runner.compile_cache.read_text() == "not a folder"  # the user's file is left alone

    # Junk in every file of the cache (the fallback, now holding the first trial's entries).
    entries = [p for p in fallback.rglob("*") if p.is_file() and "triton" not in p.parts]
    assert any(p.suffix == ".py" for p in entries) and any(p.suffix == ".so" for p in entries)
    for path in entries:
        path.write_text("junk\n")
    second = runner.run(config, "t1", seed=0)
    assert second.status == "ok", (second.error, second.stderr_tail)  # not NameError: name 'junk' is not defined
    assert second.measurement.extras["compile_cache_discarded"] >= 3
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "corrupt entries of the study's compile cache" in err, err
    assert "junk" not in (tmp_path / "studies" / "s" / "logs" / "t1" / "trial.log").read_text()


def test_a_read_only_cache_is_checked_before_a_trial_and_replaced(tmp_path, capfd):
    runner = _runner(tmp_path / "studies")
    cache = runner.compile_cache
    (cache / "locks").mkdir(parents=True)
    mounted = subprocess.run(["mount", "-o", "bind,ro", str(cache), str(cache)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot bind-mount read-only here: {mounted.stderr.decode().strip()}")
    try:
        assert "Read-only file system" in cache_folder_fault(cache)
        config = TrialConfig(batch_size=32, compile="default")
        env = runner.spec(config, seed=0).env
        assert env[CACHE_DIR_ENV] == str(cache.with_name("compile_cache-fallback")), env
        env = runner.spec(config, seed=0).env  # said once, not once per trial
        err = capfd.readouterr().err
        assert err.count("compile cache is unusable") == 1 and "Read-only file system" in err, err
        # A compiling trial on the read-only mount runs, compiled by real Inductor into the fallback (before:
        # InductorError: OSError: [Errno 30] Read-only file system, and the config ruled out).
        ran = runner.run(config, "t0", seed=0)
        assert ran.status == "ok", (ran.error, ran.stderr_tail)
        assert ran.measurement.extras["compile_cache"] == "cold"
        assert any(cache.with_name("compile_cache-fallback").rglob("*.py"))
    finally:
        subprocess.run(["umount", "-l", str(cache)], capture_output=True)
    runner.spec(config, seed=0)
    assert "works again" in capfd.readouterr().err
    assert runner.spec(config, seed=0).env[CACHE_DIR_ENV] == str(cache)


def test_an_os_error_on_the_cache_or_a_full_disk_is_infra_not_the_configs(tmp_path):
    cache = str(tmp_path / "compile_cache")
    try:
        try:
            raise OSError(errno.EROFS, "Read-only file system", f"{cache}/locks/x.lock")
        except OSError as cause:
            raise RuntimeError("InductorError: OSError: [Errno 30] Read-only file system") from cause
    except RuntimeError as exc:
        assert "compile cache" in infra_fault(exc, cache)
        assert infra_fault(exc, str(tmp_path / "elsewhere")) == ""
    assert "the disk is full" in infra_fault(OSError(errno.ENOSPC, "No space left on device"))
    assert infra_fault(ValueError("a bug in train_fn"), cache) == ""


# -- 2: a full disk under the studies folder is the tuner's fault, and a resume runs those configs ---------


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


def test_a_full_disk_under_the_studies_folder_is_infra_and_a_resume_runs_those_configs(small_disk, tmp_path):
    from scale_workloads import SPACE

    from round3_workloads import FILL_ENV

    (tmp_path / "space.yaml").write_text(SPACE)
    storage = f"sqlite:///{tmp_path / 's.db'}"  # the database elsewhere: only the studies folder fills
    args = ["tune", f"{HERE / 'round3_workloads.py'}:train_fills_the_disk", "--space", str(tmp_path / "space.yaml"),
            "--storage", storage, "--study", "s", "--trials", "3", "--studies-dir", str(small_disk), "--no-progress",
            "--no-plots", "--prune-below", "0", "--top-k", "0"]
    proc = _autotune(*args, env={FILL_ENV: str(small_disk / "filler")})
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert "failed outside the config (the disk is full: no space left under" in proc.stderr, proc.stderr
    trials = optuna.load_study(study_name="s", storage=storage).trials
    full = [t for t in trials if t.user_attrs.get("status") not in (None, "ok")]
    assert full and all(t.state == TrialState.FAIL and t.user_attrs["status"] == "infra" for t in full), \
        [(t.state, t.user_attrs.get("status")) for t in full]  # before: COMPLETE, "crash", infeasible for good

    (small_disk / "filler").unlink()  # space freed: the same command runs those configs again
    proc = _autotune(*args, env={FILL_ENV: ""})
    assert proc.returncode == 0, proc.stderr
    trials = optuna.load_study(study_name="s", storage=storage).trials
    ok = {str(t.params) for t in trials if t.state == TrialState.COMPLETE and t.user_attrs.get("status") == "ok"}
    assert {str(t.params) for t in full} <= ok, (ok, [t.params for t in full])
    assert not [t for t in trials if t.state in (TrialState.WAITING, TrialState.RUNNING)]


# -- 3: a stated baseline precision is refused in one line, never printed as used --------------------------


def test_a_baseline_precision_other_than_fp32_is_refused_in_one_line(tmp_path, write_space, cpu_caps):
    from autotune import SpaceError, Tuner
    from autotune.search._space import load_space

    with pytest.raises(SpaceError, match=r"baseline\.precision: fp16: the baseline trains in fp32"):
        load_space(write_space("knobs:\n  precision: [fp32, fp16]\nbaseline: {precision: fp16}\n"))
    tuner = Tuner(f"{HERE / 'workloads.py'}:train_tiny", space=write_space("knobs:\n  num_workers: [0]\n"),
                  storage=f"sqlite:///{tmp_path / 's.db'}", studies_dir=tmp_path / "studies", progress=False,
                  plots=False, capabilities=cpu_caps, baseline={"precision": "bf16"}, n_trials=1)
    with pytest.raises(SpaceError, match=r"precision: bf16: the baseline trains in fp32"):
        tuner.run()
    assert not (tmp_path / "studies").exists() or not any((tmp_path / "studies").iterdir())
    assert load_space(write_space("knobs:\n  precision: [fp32, bf16]\nbaseline: {precision: fp32}\n")).baseline.precision == "fp32"


# -- 4: a finalist that crashes in every race run drops out, its failure named -----------------------------


def _race_study(tmp_path, cpu_caps, monkeypatch, rates, *, target, enqueue, script=None, env=None, **options):
    from test_budget import _Enqueued, _env

    for key, value in {**_env(tmp_path, rates, default=500.0, time_scale=0.0, script=script), **(env or {})}.items():
        monkeypatch.setenv(key, value)
    from test_budget import _tuner

    tuner = _tuner(tmp_path, cpu_caps, n_trials=len(enqueue) + 1, top_k=len(enqueue), confirm_rounds=3,
                   sampler=_Enqueued(enqueue), **options)
    tuner.target = target
    return tuner.run()


def test_a_finalist_that_crashes_in_every_race_run_drops_out_with_its_failure_named(tmp_path, cpu_caps, monkeypatch,
                                                                                   capsys):
    import json

    from test_budget import _key, _study

    from autotune.cli import print_summary
    from round4_workloads import CRASH_ENV

    result = _race_study(tmp_path, cpu_caps, monkeypatch, {_key(num_workers=1): 2000.0, _key(num_workers=2): 1900.0},
                         target=f"{WORKLOADS4}:replay_crashes_from_its_second_run",
                         enqueue=[{"num_workers": 1}, {"num_workers": 2}], env={CRASH_ENV: f"1:{tmp_path}"})
    race = _study(tmp_path).user_attrs["top_k_confirmation"]
    crashed = next(str(t.number) for t in _study(tmp_path).trials if t.params.get("num_workers") == 1)
    assert race["throughputs"][crashed] == []  # it never measured in the race...
    why = race["race"]["dropped"][crashed]  # ...so it is out (before: dropped {}, "#3, #1 within 10%")
    assert why.startswith("failed in each of its 2 race runs: crash: killed by SIGSEGV"), why
    assert result.best.config.num_workers == 2 and race["winner"] != int(crashed)
    doc = json.loads(Path(result.best_config_path).read_text())
    assert doc["confirmed"]["confirmed"] and doc["confirmed"]["dropped"][crashed] == why
    capsys.readouterr()
    print_summary(result, storage=None, studies_dir=str(tmp_path / "studies"), top_k=2)
    out = capsys.readouterr().out
    assert f"dropped #{crashed} (failed in each of its 2 race runs: crash: killed by SIGSEGV" in out, out
    assert f"#{crashed}, " not in race["race"]["ended"] and f", #{crashed}" not in race["race"]["ended"]
    # 9: a study name with ESC in it is escaped in the summary's title (before: printed raw).
    import dataclasses

    print_summary(dataclasses.replace(result, study_name="a\x1b[2Jb"), storage=None,
                  studies_dir=str(tmp_path / "studies"), top_k=2)
    out = capsys.readouterr().out
    assert "\x1b" not in out and "a\\x1b[2Jb" in out, out


def test_a_finalist_that_raises_in_every_race_run_drops_out_with_its_error_named(tmp_path, cpu_caps, monkeypatch):
    """Item 4's other half: the finalist's train_fn raises (not a signal) from its second run on."""
    from test_budget import _key, _study

    from round4_workloads import CRASH_ENV

    result = _race_study(tmp_path, cpu_caps, monkeypatch, {_key(num_workers=1): 2000.0, _key(num_workers=2): 1900.0},
                         target=f"{WORKLOADS4}:replay_crashes_from_its_second_run",
                         enqueue=[{"num_workers": 1}, {"num_workers": 2}], env={CRASH_ENV: f"1:{tmp_path}:raise"})
    race = _study(tmp_path).user_attrs["top_k_confirmation"]
    failed = next(str(t.number) for t in _study(tmp_path).trials if t.params.get("num_workers") == 1)
    assert race["throughputs"][failed] == []
    why = race["race"]["dropped"][failed]
    assert why.startswith("failed in each of its 2 race runs: ") and "this config fails from its second run on" in why, why
    assert result.best.config.num_workers == 2 and race["winner"] != int(failed)


# -- 5: the race checks each config's own runs and their gap to its full trial -----------------------------


def test_a_race_whose_runs_contradict_the_trials_is_noisy_and_a_range(tmp_path, cpu_caps, monkeypatch):
    from test_budget import BASE, _key, _study

    from autotune._config import NO_FASTER_CONFIG
    from autotune.search._simulate import config_key

    # The shape: the pick's trial near the baseline's, its two race runs 3.3x apart, and the
    # baseline's race runs 25x below its own trial (another job loaded the machine in the race only).
    result = _race_study(tmp_path, cpu_caps, monkeypatch, {_key(num_workers=1): 1000.0},
                         target="autotune.search._simulate:replay_train", enqueue=[{"num_workers": 1}],
                         script={_key(num_workers=1): [0.6, 1.0, 0.3], config_key(BASE): [1.0, 0.04, 0.04]})
    race = _study(tmp_path).user_attrs["top_k_confirmation"]
    assert race["race"]["baseline_disagreement"] == pytest.approx(0.0)  # its race runs agree with each other...
    assert race["race"]["noisy"] and race["race"]["noise_from_trials"]  # ...not with its trial (before: not noisy)
    assert "the baseline's race runs (median 20/s) and its full trial (500/s) differed by 2400%" in \
        race["race"]["noisy_reason"]
    # Every run of the pick (1000, 300, its trial 600) against every run of the baseline (20, 20, its 500).
    assert (result.speedup_low, result.speedup_high) == (pytest.approx(300 / 500), pytest.approx(1000 / 20))
    assert not result.faster and result.verdict == NO_FASTER_CONFIG  # before: "32.50x faster", not noisy
    assert "the machine was noisy: the baseline's race runs" in result.why_not_faster


def test_a_finalists_own_scattered_race_runs_make_the_machine_noisy(tmp_path, cpu_caps, monkeypatch):
    from test_budget import _key, _study

    result = _race_study(tmp_path, cpu_caps, monkeypatch, {_key(num_workers=1): 2000.0},
                         target="autotune.search._simulate:replay_train", enqueue=[{"num_workers": 1}],
                         script={_key(num_workers=1): [1.0, 1.0, 0.6]})
    race = _study(tmp_path).user_attrs["top_k_confirmation"]
    crowned = str(race["winner"])
    assert race["race"]["noisy"] and not race["race"]["noise_from_trials"]
    assert race["race"]["noisy_reason"] == f"#{crowned}'s own runs in the race differed by 67%"
    assert result.noisy == pytest.approx(2 / 3, abs=1e-3) and " to " in result.verdict  # a range, not a point
    assert "the machine was noisy" in result.spread_text


# -- 7: a trial the probes queued never stays WAITING once the budget is spent ------------------------------


def test_a_trial_queued_by_the_probes_past_the_budget_is_taken_off_the_queue_with_a_reason(tmp_path, cpu_caps):
    from test_probes import SPACE

    from autotune import Tuner

    (tmp_path / "space.yaml").write_text(SPACE)
    settings = dict(space=tmp_path / "space.yaml", n_trials=1, storage=f"sqlite:///{tmp_path}/s.db",
                    studies_dir=tmp_path / "studies", plots=False, capabilities=cpu_caps, reference_repeats=1,
                    top_k=0, prune_below=None, study_name="p")
    # The one trial (the reference) is done; a trial the probes queued is left WAITING (as one queued just
    # before the budget ran out is), and the same command is run again.
    Tuner(f"{HERE / 'workloads.py'}:train_input_bound", progress=False, **settings).run()
    study = optuna.load_study(study_name="p", storage=settings["storage"])
    study.enqueue_trial({**study.trials[0].params, "num_workers": 1},
                        user_attrs={"predicted_throughput": 1.0, "predicted_from": "probes"})
    Tuner(f"{HERE / 'workloads.py'}:train_input_bound", progress=False, **settings).run()
    trials = optuna.load_study(study_name="p", storage=settings["storage"]).trials
    queued = [t for t in trials if t.user_attrs.get("predicted_from") == "probes"]
    assert queued, [t.user_attrs for t in trials]
    assert all(t.state == TrialState.FAIL and t.user_attrs["status"] == "not_run" for t in queued)  # before: WAITING
    assert queued[0].user_attrs["failure"] == "not run: the study's 1 trials were done first"
    assert not [t for t in trials if t.state in (TrialState.WAITING, TrialState.RUNNING)]  # a resume finds none


# -- 8: the unconfirmed pick names the process that holds the race, not the budget --------------------------


def test_an_unconfirmed_pick_names_the_process_that_holds_the_race(tmp_path, cpu_caps, monkeypatch):
    import json

    from test_budget import _env, _key, _study, _tuner

    from autotune.study._confirm import CLAIM, _entrants
    from autotune.study._workers import _process_start

    for key, value in _env(tmp_path, {_key(num_workers=1): 2000.0}, default=500.0, time_scale=0.0).items():
        monkeypatch.setenv(key, value)
    _tuner(tmp_path, cpu_caps, n_trials=2, top_k=0).run()  # the reference and one trial, nothing raced
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # a live process on this host
    try:
        import socket
        import time

        holder = f"{socket.gethostname()}:{other.pid}:{_process_start(other.pid)}"
        study = _study(tmp_path)
        signature = _entrants(study, 3)[2]
        study.set_user_attr(CLAIM, {"worker": holder, "candidates": signature, "at": time.time()})
        # The same study under a budget: before, "the budget left no time for the race (N s left)".
        result = _tuner(tmp_path, cpu_caps, n_trials=2, top_k=3, budget_minutes=5).run()
    finally:
        other.kill()
        other.wait()
    why = json.loads(Path(result.best_config_path).read_text())["confirmed"]["why"]
    assert why == f"another process ({holder}) holds the race of these finalists; it records the race", why


# -- 9: output hygiene ----------------------------------------------------------------------------------


def test_a_full_disk_under_the_default_storage_names_its_file(small_disk, tmp_path):
    with open(small_disk / "filler", "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
        except OSError:
            pass
    (tmp_path / "space.yaml").write_text("knobs:\n  num_workers: [0]\n")
    proc = _autotune("tune", f"{HERE / 'workloads.py'}:train_tiny", "--space", str(tmp_path / "space.yaml"),
                     "--studies-dir", str(small_disk), "--no-progress", "--no-plots")
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    # Before: "storage the study database: the disk is full (...)".
    assert f"storage sqlite:///{small_disk / 'autotune.db'}: the disk is full" in proc.stderr, proc.stderr


def test_a_stored_attribute_that_is_not_json_is_one_line_naming_the_study_and_the_attribute(tmp_path):
    import sqlite3

    storage = f"sqlite:///{tmp_path / 'a.db'}"
    optuna.create_study(study_name="s", storage=storage).set_user_attr("baseline_config", {"batch_size": 32})
    optuna.create_study(study_name="t", storage=storage)
    with sqlite3.connect(tmp_path / "a.db") as db:
        db.execute("update study_user_attributes set value_json = '{bad' where key = 'baseline_config'")
    proc = _autotune("best", "t", "--storage", storage)  # optuna reads every study's attributes: a traceback
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "study 's': the user attribute 'baseline_config' (study_user_attributes) is not valid JSON" in proc.stderr


def test_options_and_spaces_print_one_short_line(tmp_path, capsys):
    from autotune.cli import DESCRIPTION_CHARS, main

    (tmp_path / "huge.yaml").write_text("description: " + "x" * 1_000_000 + "\nknobs:\n  num_workers: [0]\n")
    assert main(["spaces", str(tmp_path / "huge.yaml")]) == 0
    out = capsys.readouterr().out
    assert len(out) < DESCRIPTION_CHARS + 300 and "more characters" in out, len(out)  # before: all of it (10 MB in the issue)
    with pytest.raises(SystemExit):
        main(["tune", "x.py:f", "--budget", "abc"])
    err = capsys.readouterr().err
    assert "'abc' is not a positive finite number" in err and "_positive_float" not in err, err
    # Before: the reference ran anyway, with its 5 s floor, far past a 0.6 s budget.
    assert main(["tune", f"{HERE / 'workloads.py'}:train_tiny", "--budget", "0.01",
                 "--studies-dir", str(tmp_path / "studies")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--budget) 0.01 is 0.6 s, less than the 2 fp32 reference runs" in err, err
    assert not (tmp_path / "studies").exists()


# -- 6: the storage URL stays out of every /proc/PID/environ, and out of the driver's words ---------------


def test_the_initial_environment_block_loses_the_storage_url():
    code = ("import os; from autotune.study._storage import scrub_initial_environ as s; "
            "assert b'LEAK7' in open('/proc/self/environ','rb').read(); "
            "assert s('AUTOTUNE_STORAGE'); "
            "assert b'LEAK7' not in open('/proc/self/environ','rb').read(); print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "AUTOTUNE_STORAGE": "postgresql://u:pwLEAK7@db/x"})
    assert proc.stdout.strip() == "ok", proc.stderr


def test_no_worker_tuner_or_trial_shows_the_storage_url_in_its_environ(tmp_path):
    from scale_workloads import SPACE

    from round4_workloads import ANCESTORS_ENV

    (tmp_path / "space.yaml").write_text(SPACE)
    seen = tmp_path / "seen"
    seen.mkdir()
    url = f"journal:{tmp_path / 'secretLEAK8.journal'}"
    proc = _autotune("tune", f"{WORKLOADS4}:train_reads_its_ancestors_environ", "--space", str(tmp_path / "space.yaml"),
                     "--study", "s", "--trials", "2", "--workers", "1", "--studies-dir", str(tmp_path / "studies"),
                     "--no-progress", "--no-plots", "--prune-below", "0", "--top-k", "0",
                     env={"AUTOTUNE_STORAGE": url, ANCESTORS_ENV: str(seen)})
    assert proc.returncode == 0, proc.stderr
    files = list(seen.glob("*.environ"))
    assert len(files) >= 2  # the reference's trial (the tuner above it) and the worker's trial
    assert all(b"LEAK8" not in f.read_bytes() for f in files)  # before: in the tuner's and every worker's


def test_a_password_with_a_raw_slash_is_hidden_in_the_drivers_own_words():
    from autotune.study._storage import hide_secret

    url = "postgresql://root:pa/ssLEAK9@db:5432/x"
    driver = 'could not translate host name "ssLEAK9@db" to address: Name or service not known'
    assert "LEAK9" not in hide_secret(f"{driver} ({url})", url)
