"""The ``autotune`` command, run as a real subprocess: exit codes, one-line errors, and the files it writes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml

from autotune.search._space import builtin_spaces
from workloads import WORKLOADS

REPO = Path(__file__).resolve().parent.parent
CONSOLE_SCRIPT = Path(sys.executable).parent / "autotune"
TINY_SPACE = """\
knobs:
  cpu_threads: [null, 1, 2]
budget: {samples: 512, warmup_steps: 1, windows: 3}
"""


def cli(*args, cwd: Path, timeout: float = 300, script: bool = False) -> subprocess.CompletedProcess:
    """Run ``python -m autotune ARGS`` (or the console script) and capture what it prints."""
    command = [str(CONSOLE_SCRIPT)] if script else [sys.executable, "-m", "autotune"]
    env = {**os.environ, "COLUMNS": "400"}  # rich wraps long paths at 80 columns otherwise
    return subprocess.run([*command, *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def assert_one_line_error(proc: subprocess.CompletedProcess, *names: str) -> str:
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    for name in names:
        assert name in lines[0], lines[0]
    return lines[0]


def console_script() -> Path:
    found = CONSOLE_SCRIPT if CONSOLE_SCRIPT.exists() else shutil.which("autotune")
    if found is None:
        pytest.skip("the autotune console script is not installed")
    return Path(found)


def test_spaces_validates_the_built_ins(tmp_path: Path) -> None:
    proc = cli("spaces", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    for path in builtin_spaces():
        assert any(line.startswith("ok") and str(path) in line for line in proc.stdout.splitlines()), path


def test_console_script_runs(tmp_path: Path) -> None:
    console_script()
    proc = cli("spaces", cwd=tmp_path, script=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("ok ") == len(builtin_spaces())


def test_spaces_with_an_invalid_file_exits_1_with_one_line(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(TINY_SPACE)
    bad = tmp_path / "bad.yaml"
    bad.write_text("knobs:\n  batch_size: [32, -100]\n")
    proc = cli("spaces", good, bad, cwd=tmp_path)
    line = assert_one_line_error(proc, str(bad), "knobs.batch_size", "-100")
    assert line.startswith("invalid")
    assert f"ok       {good}" in proc.stdout


def test_tune_with_an_invalid_space_exits_1_with_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("knobs:\n  batch_size: [32]\nsampler: tpe\n")
    proc = cli("tune", f"{WORKLOADS}:train_tiny", "--space", bad, "--studies-dir", tmp_path / "studies",
               "--no-progress", "--no-plots", cwd=tmp_path, script=CONSOLE_SCRIPT.exists())
    line = assert_one_line_error(proc, str(bad), "'sampler'")
    assert line.startswith("autotune: error: ")


def test_tune_with_a_missing_file_exits_1_with_one_line(tmp_path: Path) -> None:
    space = tmp_path / "space.yaml"
    space.write_text(TINY_SPACE)
    proc = cli("tune", "missing.py:train", "--space", space, "--studies-dir", tmp_path / "studies",
               "--no-progress", "--no-plots", cwd=tmp_path)
    assert_one_line_error(proc, "autotune: error:", "missing.py", "no such file")


def test_tune_then_best(tmp_path: Path) -> None:
    space = tmp_path / "space.yaml"
    space.write_text(TINY_SPACE)
    studies = tmp_path / "studies"
    proc = cli("tune", f"{WORKLOADS}:train_tiny", "--space", space, "--trials", 2, "--study", "cli-tiny", "--prune-below", 0,
               "--studies-dir", studies, "--no-progress", "--no-plots", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    best_json = studies / "cli-tiny" / "best_config.json"
    assert f"Best config written to {best_json}" in proc.stdout
    url = f"sqlite:///{studies}/autotune.db"
    trials = optuna.load_study(study_name="cli-tiny", storage=url).get_trials()
    assert len(trials) == 2 and all(t.user_attrs["status"] == "ok" for t in trials)
    written = json.loads(best_json.read_text())
    assert written["config"] is not None

    as_json = cli("best", "cli-tiny", "--studies-dir", studies, "--format", "json", cwd=tmp_path)
    assert as_json.returncode == 0, as_json.stderr
    doc = json.loads(as_json.stdout)
    assert doc["config"] == written["config"] and doc["study"] == "cli-tiny"
    assert doc["written"] == written["written"]  # when the file was written, not when it is printed
    assert "per GPU" not in doc["packing"]["what"]  # a CPU study

    text = cli("best", "cli-tiny", "--studies-dir", studies, cwd=tmp_path)  # the default: a few lines
    assert text.returncode == 0, text.stderr
    lines = text.stdout.strip().splitlines()
    # Two tiny configs on a shared CPU: the pick may be shown faster, or be inside the noise (keep the baseline).
    head = "Study cli-tiny: no faster config found" if written.get("keep_baseline") else "Study cli-tiny, trial #"
    assert lines[0].startswith(head) and len(lines) <= 10, lines
    assert any(line.startswith("Apply it: ") and str(best_json) in line for line in lines)
    assert f"Written {written['written']}" in text.stdout and "per GPU" not in text.stdout
    assert "{" not in text.stdout and text.stderr == ""

    as_yaml = cli("best", "cli-tiny", "--storage", url, "--format", "yaml", cwd=tmp_path)
    assert as_yaml.returncode == 0, as_yaml.stderr
    assert yaml.safe_load(as_yaml.stdout)["config"] == written["config"]

    missing = cli("best", "nope", "--storage", url, cwd=tmp_path)
    assert_one_line_error(missing, "no study 'nope'", "cli-tiny")


@pytest.mark.parametrize("command", ["best", "report", "dashboard", "spaces"])
def test_read_commands_describe_every_option(command: str) -> None:
    from autotune.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    for action in sub._actions:
        assert action.help, f"autotune {command} {action.option_strings or action.dest}: no help"


def test_demo_completes_and_writes_best_config(tmp_path: Path) -> None:
    studies = tmp_path / "studies"
    proc = cli("demo", "--trials", 2, "--studies-dir", studies, "--no-progress", "--no-plots", cwd=tmp_path, timeout=400)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((studies / "demo" / "best_config.json").read_text())
    assert doc["study"] == "demo" and doc["target"] == "autotune.demo:train"
    assert doc["baseline"]["throughput"] > 0
    # The last lines say the verdict in best_config.json's words, and never claim a speed-up for the baseline.
    assert f"Verdict: {doc['verdict']}" in proc.stdout
    if doc["config"] == doc["baseline"]["config"] or not doc["faster"]:
        assert doc["verdict"] == "no faster config found" and "faster than the baseline" not in proc.stdout
    study = optuna.load_study(study_name="demo", storage=f"sqlite:///{studies}/autotune.db")
    if "top_k_confirmation" in study.user_attrs:  # two feasible configs or more: the baseline alternated with them
        assert doc["speedup_spread"]["basis"] == "alternation"
        assert doc["baseline"]["throughput"] == study.user_attrs["top_k_confirmation"]["baseline"]["median"]
    budgeted = [t for t in study.trials if t.user_attrs["status"] != "infeasible"]  # ruled out without a run
    assert len(budgeted) == 2
    assert study.user_attrs["space_name"] == "demo_cpu"
    assert all(t.user_attrs["status"] in ("ok", "pruned", "oom", "nan", "error", "crash", "timeout") for t in budgeted)
    # The policy, the global batch and the best's verdict are in best_config.json and in the last lines.
    policy = doc["batch_policy"]
    assert policy["policy"] == "fixed" and policy["global_batch"] == 128
    assert policy["micro_batch"] * policy["accumulation_steps"] == 128
    assert f"Batch policy fixed: global batch 128 = micro-batch {policy['micro_batch']}" in proc.stdout
    assert doc["accuracy_verdict"] in ("equivalent", "unchecked")
    # The pick's verdict is said when it is the config to train with; a config not recommended gets none.
    said = f"Accuracy verdict: {doc['accuracy_verdict']}" in proc.stdout
    assert said == (doc["not_recommended"] is None), proc.stdout
    assert ("The accuracy check is blind here" in proc.stdout) == bool(doc["accuracy_check"]["blind"])
    partly = bool(doc["accuracy_check"]["reasons"]) and not doc["accuracy_check"]["blind"]
    assert ("Part of the accuracy check is blind" in proc.stdout) == partly


def test_cifar_example_overflowing_batch_fails_as_oom_and_is_infeasible(tmp_path: Path) -> None:
    # The example space itself (8 trials) takes minutes here, so this runs the example's workload, space
    # and budget with the batch fixed at 1024 under the documented --memory-limit 0.3: the batch-64
    # reference fits in it, batch 1024 needs well over it (0.5 let it pass in one of three runs, since
    # RLIMIT_AS counts address space, whose growth varies from run to run).
    doc = yaml.safe_load((REPO / "search_spaces" / "example_cifar_cnn.yaml").read_text())
    doc["knobs"]["batch_size"] = [1024]
    space = tmp_path / "cifar_1024.yaml"
    space.write_text(yaml.safe_dump(doc))
    url = f"sqlite:///{tmp_path}/cifar.db"
    proc = cli("tune", "examples/cifar_cnn.py:train", "--space", space, "--memory-limit", 0.3, "--trials", 1,
               "--storage", url, "--study", "cifar-oom", "--studies-dir", tmp_path / "studies", "--no-progress", "--no-plots",
               cwd=REPO, timeout=400)
    assert proc.returncode == 0, proc.stderr
    assert "No feasible config was found" in proc.stdout
    study = optuna.load_study(study_name="cifar-oom", storage=url)
    assert study.user_attrs["baseline_throughput"] > 0  # the reference (batch 64) fits in the limit
    (trial,) = study.get_trials()
    assert "batch_size" not in trial.params  # a fixed knob is not asked of the sampler
    assert trial.user_attrs["config"]["batch_size"] == 1024
    assert trial.user_attrs["status"] == "oom", trial.user_attrs.get("error")
    assert "allocate" in trial.user_attrs["error"]
    assert trial.constraints["failure"] > 0

    best = cli("best", "cifar-oom", "--storage", url, "--format", "json", cwd=tmp_path)
    assert best.returncode == 1  # nothing feasible to print
    assert json.loads(best.stdout)["config"] is None


def test_a_resumed_run_does_not_charge_the_trial_server_start_to_its_first_trial(tmp_path: Path) -> None:
    # The process that forks trials imports torch (seconds). A new study starts it for its reference
    # run; a resumed one has no reference to run, so it must start it before the first trial's clock.
    space = tmp_path / "space.yaml"
    space.write_text(TINY_SPACE)
    studies = tmp_path / "studies"
    for trials in (2, 3):
        proc = cli("tune", f"{WORKLOADS}:train_tiny", "--space", space, "--trials", trials, "--study", "resumed",
                   "--prune-below", 0, "--top-k", 0, "--studies-dir", studies, "--no-progress", "--no-plots", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
    trial = optuna.load_study(study_name="resumed", storage=f"sqlite:///{studies}/autotune.db").trials[2]
    ask_to_tell = (trial.datetime_complete - trial.datetime_start).total_seconds()
    assert ask_to_tell - trial.user_attrs["run_seconds"] < 1.5, (ask_to_tell, trial.user_attrs["run_seconds"])
    # --no-plots: the study's folder has its best config and logs, and no plot.
    assert (studies / "resumed" / "best_config.json").exists()
    assert not list((studies / "resumed").glob("*.png")) and not (studies / "artifacts").exists()


@pytest.mark.parametrize("text, names", [
    ("knobs:\n  batch_size: [16, 48, 64]\nbaseline: {batch_size: 64}\n",
     ["knobs.batch_size", "48", "does not divide the global batch 64"]),
    ("knobs:\n  batch_size: [32, 64]\nbatch_policy: sideways\n", ["batch_policy", "sideways"]),
    ("knobs:\n  batch_size: [32, 64]\nbatch_policy: scale\nglobal_batch: 128\n", ["global_batch", "batch_policy fixed"]),
    ("knobs:\n  batch_size: [32]\nbaseline: {batch_size: 48}\nglobal_batch: 64\n", ["baseline.batch_size", "48"]),
    ("knobs:\n  batch_size: [32, 64]\nglobal_batch: 1024\nbudget: {samples: 4096}\n", ["fewer than 8 optimizer steps"]),
])
def test_a_bad_batch_policy_or_batch_combination_fails_in_one_line(tmp_path: Path, text: str, names: list) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    proc = cli("tune", f"{WORKLOADS}:train_tiny", "--space", bad, "--studies-dir", tmp_path / "studies", cwd=tmp_path)
    assert_one_line_error(proc, str(bad), *names)
    db = tmp_path / "studies" / "autotune.db"
    assert not db.exists() or not optuna.get_all_study_summaries(f"sqlite:///{db}")  # no study was created


def test_a_bad_space_is_reported_before_the_workload_is_imported(tmp_path: Path) -> None:
    # The space is read before the trial server starts (a torch import) and imports the target to probe the
    # hardware: a bad space is one line in about a second, whatever the target.
    bad = tmp_path / "bad.yaml"
    bad.write_text("knobs:\n  batch_size: [32, 64]\nbatch_policy: sideways\n")
    proc = cli("tune", "no_such_module_here:train", "--space", bad, "--studies-dir", tmp_path / "studies", cwd=tmp_path)
    assert_one_line_error(proc, str(bad), "batch_policy", "sideways")
    assert "no_such_module_here" not in proc.stderr


def test_the_batch_policy_flag_overrides_the_space(tmp_path: Path) -> None:
    space = tmp_path / "space.yaml"
    space.write_text("knobs:\n  batch_size: [16, 32, 64]\nbaseline: {batch_size: 32}\n"
                     "budget: {samples: 1024, warmup_steps: 1, windows: 3}\n")
    proc = cli("tune", f"{WORKLOADS}:train_tiny", "--space", space, "--batch-policy", "scale", "--trials", 3,
               "--top-k", 0, "--prune-below", 0, "--no-progress", "--no-plots", "--studies-dir", tmp_path / "studies", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    study = optuna.load_study(study_name="train_tiny", storage=f"sqlite:///{tmp_path}/studies/autotune.db")
    assert study.user_attrs["batch_policy"] == "scale"
    batches = {t.user_attrs["config"]["batch_size"] for t in study.trials}
    assert 64 in batches  # above the baseline's 32: only scale runs it
    at_64 = next(t for t in study.trials if t.user_attrs["config"]["batch_size"] == 64)
    assert at_64.user_attrs["config"]["global_batch"] is None and at_64.user_attrs["status"] == "ok"
    assert "reference_band:batch=64" in study.user_attrs  # judged against fp32 at its own global batch


def test_tune_without_a_terminal_prints_whole_lines_for_every_trial(tmp_path: Path) -> None:
    """stdout piped, no COLUMNS: nothing wraps at 80 columns; the reference run (trial 0) and the configs the
    memory rule rules out get a line each; the probe says what it dropped and why; --top-k 0 gets no advice."""
    space = tmp_path / "space.yaml"
    space.write_text("knobs:\n  batch_size: [64, 256, 512]\n  channels_last: [false, true]\n  cpu_threads: [1, 4096]\n"
                     "baseline: {batch_size: 64, cpu_threads: 1}\nbudget: {samples: 512, warmup_steps: 1, windows: 3}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    args = ["tune", f"{WORKLOADS}:train_oom_at_256", "--space", space, "--batch-policy", "scale", "--trials", 3,
            "--top-k", 0, "--prune-below", 0, "--studies-dir", tmp_path / "studies"]
    proc = subprocess.run([sys.executable, "-m", "autotune", *map(str, args)], cwd=tmp_path, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    study = optuna.load_study(study_name="train_oom_at_256", storage=f"sqlite:///{tmp_path}/studies/autotune.db")
    removed = study.user_attrs["removed_knobs"]
    assert "this process may use" in removed["cpu_threads=4096"]  # more threads than usable cores
    assert "no 4-D activations" in removed["channels_last=true"]  # an MLP: the memory format cannot matter
    (said,) = [line for line in lines if line.startswith("Removed before the search")]
    assert "cpu_threads=4096 (this process may use" in said and "channels_last=true (the model has no 4-D" in said
    assert len(said) > 80  # one line, however long
    reference = study.trials[0]
    assert reference.user_attrs["role"] == "reference"
    assert any(line.startswith("  #0   ref ") and "fp32 reference run" in line for line in lines), proc.stdout
    oom = [t for t in study.trials if t.user_attrs.get("status") == "oom"]
    implied = [t for t in study.trials if t.user_attrs.get("status") == "infeasible"]
    assert oom and implied, [t.user_attrs.get("config") for t in study.trials]
    assert any(line.startswith(f"  #{oom[0].number:<3} oom ") for line in lines), proc.stdout
    assert any(f"memory rule: {len(implied)} config" in line and f"than #{oom[0].number}" in line for line in lines)
    assert "--top-k 3" not in proc.stdout and "re-measurement" not in proc.stdout


def test_a_config_the_memory_rule_answers_gets_a_whole_line(capsys, monkeypatch) -> None:
    from autotune._config import TrialConfig
    from autotune.study._progress import _Progress

    monkeypatch.delenv("COLUMNS", raising=False)
    reason = ("infeasible: needs at least the memory of trial 3 (precision=fp32, batch_size=256, channels_last=False), "
              "which ran out of memory")
    with _Progress(True, 5) as ui:
        ui.ruled_out(7, TrialConfig(batch_size=512), reason)
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  #7")]
    assert "skipped" in line and "bs512" in line and reason in line and "not run" in line


def test_tune_with_a_stated_baseline_uses_it_and_says_where_it_came_from(tmp_path: Path) -> None:
    space = tmp_path / "space.yaml"
    space.write_text(TINY_SPACE)  # its baseline is the default batch 64
    studies = tmp_path / "studies"
    proc = cli("tune", f"{WORKLOADS}:train_tiny", "--space", space, "--trials", 1, "--top-k", 0, "--study", "stated",
               "--baseline", "batch_size=32,cpu_threads=1", "--studies-dir", studies, "--no-progress", "--no-plots", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    source = ("--baseline batch_size=32,cpu_threads=1, the other knobs from the space space; the global batch from "
              "--baseline batch_size=32")
    assert f"Baseline fp32 bs32 workers=0 threads=1: from {source}." in proc.stdout
    study = optuna.load_study(study_name="stated", storage=f"sqlite:///{studies}/autotune.db")
    assert study.user_attrs["baseline_config"]["batch_size"] == 32
    assert study.user_attrs["baseline_config"]["global_batch"] == 32  # fixed: the stated batch is the global one
    assert study.user_attrs["baseline_source"] == source
    assert study.trials[0].user_attrs["role"] == "reference"  # the stated baseline is a point of the space
    written = json.loads((studies / "stated" / "best_config.json").read_text())
    assert written["baseline"]["source"] == source and written["baseline"]["config"]["batch_size"] == 32

    # Resuming with another baseline is another space.
    again = cli("tune", f"{WORKLOADS}:train_tiny", "--space", space, "--trials", 1, "--study", "stated",
                "--studies-dir", studies, "--no-progress", "--no-plots", cwd=tmp_path)
    assert_one_line_error(again, "another search space", "baseline.batch_size")


@pytest.mark.parametrize("stated, names", [
    ("batch_sise=32", ["--baseline: batch_sise: unknown knob"]),
    # Before: an fp32 baseline ran while the summary said "from --baseline precision=fp16" (also on a CPU).
    ("precision=fp16", ["--baseline: precision: fp16: the baseline trains in fp32"]),
    ("precision=bf16", ["--baseline: precision: bf16: the baseline trains in fp32", "list bf16 among"]),
])
def test_tune_with_a_bad_stated_baseline_exits_1_with_one_line(tmp_path: Path, stated: str, names: list[str]) -> None:
    space = tmp_path / "space.yaml"
    space.write_text(TINY_SPACE.replace("knobs:\n", "knobs:\n  precision: [fp32, fp16]\n"))
    proc = cli("tune", f"{WORKLOADS}:train_tiny", "--space", space, "--baseline", stated,
               "--studies-dir", tmp_path / "studies", "--no-progress", "--no-plots", cwd=tmp_path)
    assert_one_line_error(proc, "autotune: error: ", *names)
    assert not (tmp_path / "studies" / "train_tiny").exists()


def test_a_failed_trials_line_shows_its_error_with_control_characters_escaped(capsys, monkeypatch) -> None:
    from optuna.trial import create_trial

    from autotune._config import TrialConfig
    from autotune.study._progress import _Progress

    monkeypatch.delenv("COLUMNS", raising=False)
    error = "ValueError: \x1b[5mblink\x1b[0m \x1b]0;retitled\x07 \x9b2J end"
    trial = create_trial(params={}, distributions={}, values=[0.0, float("inf")],
                         user_attrs={"status": "error", "error": error, "config": TrialConfig(batch_size=32).to_dict()})
    trial.number = 3
    with _Progress(True, 5) as ui:
        ui.end_trial(trial)
    out = capsys.readouterr().out
    (line,) = [line for line in out.splitlines() if line.startswith("  #3")]
    assert "\x1b" not in out.replace("\x1b[?25l", "").replace("\x1b[?25h", "")  # rich's own cursor hiding aside
    assert "\x07" not in out and "\x9b" not in out
    assert r"[ValueError: \x1b[5mblink\x1b[0m \x1b]0;retitled\x07 \x9b2J end]" in line, line


def test_an_error_line_escapes_the_control_characters_of_a_trials_exception(tmp_path: Path) -> None:
    # The fp32 reference run fails with the workload's exception, quoted in the CLI's one error line.
    space = tmp_path / "space.yaml"
    space.write_text("knobs:\n  batch_size: [32]\nbudget: {samples: 512, warmup_steps: 1, windows: 3}\n")
    proc = subprocess.run([sys.executable, "-m", "autotune", "tune", f"{WORKLOADS}:raise_control_sequences", "--space",
                           str(space), "--trials", "2", "--studies-dir", str(tmp_path / "studies"), "--no-progress",
                           "--no-plots"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "\x1b" not in proc.stderr and "\x07" not in proc.stderr, repr(proc.stderr)
    assert r"the fp32 reference run failed (error: ValueError: \x1b[5mblink\x1b]0;retitled\x07" in proc.stderr
