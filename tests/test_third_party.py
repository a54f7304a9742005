"""A third-party script tuned as a new user tunes it (issue 43): real subprocess studies on the CPU, on the
replay workload with scripted throughputs where the verdict must be forced, through the CLI and the Python
routes alike.

- When nothing beats the baseline, every route says to keep it: the summary, ``autotune best``,
  ``best_config.json``, ``Result.best_config``, ``load_best`` and the adapters' arguments; nothing slower is
  offered to paste.
- The script's own batch is the baseline on any device (a CPU has no Tensor Cores), its own arguments reach
  every trial (after ``--``), and trials run in the study's working directory.
- The word-language-model example of docs/adapting-a-script.md tunes as the docs say.
- ``autotune.run`` prints the summary the CLI prints (``summary=False``: none), takes the CLI's option names,
  and names the nearest valid option for a wrong one.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import optuna
import pytest

import autotune
from autotune._config import NO_FASTER_CONFIG, TrialConfig
from autotune.cli import main
from autotune.search._simulate import config_key, replay_env

optuna.logging.set_verbosity(optuna.logging.WARNING)

REPO = Path(__file__).resolve().parent.parent
REPLAY = "autotune.search._simulate:replay_train"
# Two configs besides the baseline, every one at the global batch 16; the budget is the fewest samples a
# trial may take, so a replayed study costs seconds.
SPACE = """\
knobs:
  batch_size: [8, 16]
  channels_last: [false, true]
baseline: {batch_size: 16}
global_batch: 16
budget: {samples: 256, warmup_steps: 1, windows: 3}
"""
BASE = {"batch_size": 16, "channels_last": False}
SLOWER = {"batch_size": 8, "channels_last": False}
OTHER = {"batch_size": 16, "channels_last": True}


def _replay(tmp_path: Path, rates: dict[str, float], script: dict[str, list[float]]) -> dict[str, str]:
    """The environment of a replayed study: the table of rates and the scripted factors of each config."""
    named = {"base": BASE, "slower": SLOWER, "other": OTHER}
    table = tmp_path / "table.jsonl"
    table.write_text("".join(json.dumps({"params": named[n], "status": "ok", "throughput": r, "accuracy_loss": 0.0})
                             + "\n" for n, r in rates.items()))
    scripted = {config_key(named[n]): factors for n, factors in script.items()}
    return replay_env(table, script=scripted, state_dir=tmp_path)


def _tune(tmp_path: Path, monkeypatch, env: dict[str, str], *args: str, target: str = REPLAY) -> None:
    """``autotune tune`` in this process (the trial server is already up: no second torch import), in
    ``tmp_path`` as the working directory."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "400")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main(["tune", target, "--no-progress", "--no-plots", *args]) == 0


def test_a_pick_inside_the_spread_is_never_recommended_on_any_route(tmp_path: Path, capsys, monkeypatch) -> None:
    # "slower" measures 3% above the baseline by its median, but one round of the race had it slower: noise.
    # The fastest config measured is then not faster, and every route must say to keep the baseline.
    (tmp_path / "space.yaml").write_text(SPACE)
    env = _replay(tmp_path, {"base": 100.0, "slower": 103.0, "other": 60.0}, {"slower": [1.0, 0.95, 1.05]})
    _tune(tmp_path, monkeypatch, env, "--space", "space.yaml", "--study", "keep", "--trials", "3", "--prune-below", "0")
    out = capsys.readouterr().out
    assert f"Verdict: {NO_FASTER_CONFIG}: its 1.03x is inside the measured spread" in out
    assert "keep the baseline: train as your script does" in out
    assert "fastest other (not faster)" in out and " best " not in out.replace("Best config", "")
    assert "Paste" not in out and "Why it wins" not in out

    doc = json.loads((tmp_path / "studies" / "keep" / "best_config.json").read_text())
    baseline = TrialConfig.from_dict(doc["baseline"]["config"])
    assert doc["keep_baseline"] is True and doc["faster"] is False
    assert TrialConfig.from_dict(doc["config"]) == baseline
    assert doc["not_recommended"]["config"]["batch_size"] == 8 and "inside the measured spread" in \
        doc["not_recommended"]["why"]

    studies = tmp_path / "studies"
    assert main(["best", "keep", "--studies-dir", str(studies)]) == 0
    said = capsys.readouterr().out
    lines = said.splitlines()
    assert lines[0].startswith(f"Study keep: {NO_FASTER_CONFIG}: keep the baseline; the fastest other, trial #")
    assert "Changes: none (keep the baseline" in said and "Apply it: nothing to change" in said
    assert "paste" not in said.lower()
    assert main(["best", "keep", "--studies-dir", str(studies), "--format", "json"]) == 0
    as_json = json.loads(capsys.readouterr().out)
    assert "paste" not in as_json and as_json["config"] == doc["config"]

    # The Python routes give the baseline back too, from the file and from the storage.
    assert autotune.load_best(studies / "keep" / "best_config.json") == baseline
    assert autotune.load_best("keep", storage=f"sqlite:///{studies}/autotune.db") == baseline
    _, result = autotune.load_study_result("keep", studies_dir=studies)
    assert result.keep_baseline and result.best_config == baseline and result.best.config != baseline
    from autotune.integrations import transformers as tuned

    # The adapter's arguments of the result are the baseline's: the script's own batch, no accumulation.
    arguments = tuned.training_arguments(result.best_config, cuda=False)
    assert arguments["per_device_train_batch_size"] == 16 and arguments["gradient_accumulation_steps"] == 1


def test_autotune_run_prints_the_clis_summary_and_names_the_nearest_option(tmp_path: Path, capsys,
                                                                           monkeypatch) -> None:
    (tmp_path / "space.yaml").write_text(SPACE)
    for key, value in _replay(tmp_path, {"base": 100.0, "slower": 300.0, "other": 50.0}, {}).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("COLUMNS", "400")
    result = autotune.run(REPLAY, space=tmp_path / "space.yaml", study="py", trials=3, top_k=0, prune_below=0,
                          studies_dir=tmp_path / "studies", storage=f"sqlite:///{tmp_path}/s.db", progress=False,
                          plots=False)
    out = capsys.readouterr().out
    assert result.faster and result.best_config == result.best.config
    assert f"Verdict: {result.verdict}" in out and "Where the minutes went:" in out
    assert f"Best config written to {result.best_config_path}" in out
    assert "Reference metric 1.0000, noise band 0.0000." in out  # rounded as the noise band is

    # Resumed with the summary off: nothing printed.
    again = autotune.run(REPLAY, space=tmp_path / "space.yaml", study="py", trials=3, top_k=0, prune_below=0,
                         studies_dir=tmp_path / "studies", storage=f"sqlite:///{tmp_path}/s.db", progress=False,
                         plots=False, summary=False)
    assert again.best_config == result.best_config and capsys.readouterr().out == ""

    with pytest.raises(TypeError) as info:
        autotune.run(REPLAY, study_nam="py")
    assert str(info.value).startswith("unknown tuner option 'study_nam'; did you mean 'study_name'?")
    assert "\n" not in str(info.value)
    with pytest.raises(TypeError, match="did you mean 'n_trials'"):
        autotune.Tuner(REPLAY, n_trial=3)
    with pytest.raises(TypeError, match="'study' is 'study_name' by its other name"):
        autotune.Tuner(REPLAY, study="a", study_name="b")


def test_the_words_agree_with_each_other_and_with_best_config_json(tmp_path: Path) -> None:
    from optuna.distributions import CategoricalDistribution
    from optuna.trial import create_trial

    from autotune._config import Result, TrialRecord
    from autotune.cli import best_summary
    from autotune.study._progress import _failed_part
    from autotune.study._results import _accuracy_check, confirmation_status

    # A race that ended after one run, before the baseline ran beside the pick: not "confirmed", as the
    # caption's "single runs" says.
    study = optuna.create_study(directions=["maximize", "minimize"])
    study.add_trial(create_trial(params={"x": 1}, distributions={"x": CategoricalDistribution([1])}, values=[1.0, 0.0]))
    study.set_user_attr("top_k_confirmation", {"winner": 0, "rounds": [{"0": 120.0}], "medians": {"0": 120.0},
                                               "baseline": {"trial": None, "throughputs": [None]},
                                               "race": {"runs": 1, "ended": "budget"}})
    pick = TrialRecord(number=0, config=TrialConfig(batch_size=32), throughput=120.0, accuracy_loss=0.0,
                       status="ok", feasible=True)
    result = Result(study_name="s", storage="", best=pick, baseline=TrialConfig(), baseline_throughput=100.0,
                    reference_metric=7.349842654811488, metric_noise=0.0, pareto=(), removed_knobs={})
    status = confirmation_status(study, result)
    assert status["confirmed"] is False and "before the baseline ran beside the pick" in status["why"]
    assert "1 run(s) in 1 round(s)" in status["why"]

    # "Part of the accuracy check is blind" has its own field: blind is false, partly_blind true.
    assert _accuracy_check({"blind": False, "reasons": ["the metric is saturated"]})["partly_blind"] is True
    assert _accuracy_check({"blind": True, "reasons": ["no loss"]})["partly_blind"] is False

    # A trial over the bound is labelled by the part of the check that failed, not by the one that passed.
    failed = create_trial(params={}, distributions={}, values=[1.0, -0.063], user_attrs={
        "accuracy_verdict": "degraded", "accuracy_loss": -0.063,
        "accuracy_evidence": "final-quarter loss 5.1 against fp32 4.8 (2 seeds, tolerance +0.1): +0.3 is outside the "
                             "reference band; metric 7.2 against fp32 7.3 (loss -0.063, bound 0.5): within"})
    part = _failed_part(failed)
    assert "outside the reference band" in part and "-0.063" not in part

    # Said once: a faster pick's headline has its speed-up once.
    doc = {"study": "s", "config": {"batch_size": 32}, "trial": 3, "verdict": "2.92x faster than the baseline",
           "speedup": 2.92, "baseline": {"config": {"batch_size": 16}}, "confirmed": {"confirmed": True}}
    assert best_summary(doc, tmp_path / "best_config.json")[0] == "Study s, trial #3: 2.92x faster than the baseline"


# A script in the shape of PyTorch's word-language-model example: argparse at import, before any autotune
# code runs (the probe imports it too), and a train(ctx) that reads the options and records what it saw.
ARGPARSE_SCRIPT = """\
import argparse, os, sys

parser = argparse.ArgumentParser()
parser.add_argument("--emsize", type=int, default=200)
parser.add_argument("--data", default="./data")
ARGS = parser.parse_args()  # at import, as the example does: unknown options would exit here


def train(ctx):
    import torch
    ctx.record("seen", {"emsize": ARGS.emsize, "argv": sys.argv, "cwd": os.getcwd(), "in_study": ctx.in_study,
                        "data_found": os.path.isdir(ARGS.data)})
    model = ctx.model(torch.nn.Linear(4, 2))
    optimizer = ctx.optimizer(torch.optim.SGD, model.parameters(), lr=0.1)
    step = ctx.train_step(model, optimizer, torch.nn.functional.cross_entropy)
    data = torch.utils.data.TensorDataset(torch.randn(256, 4), torch.randint(2, (256,)))
    for x, y in ctx.batches(ctx.loader(data, batch_size=16)):
        step(x, y)
"""


def test_the_scripts_own_arguments_and_working_directory_reach_every_trial(tmp_path: Path, capsys,
                                                                           monkeypatch) -> None:
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)  # the script's relative --data, found where the study was started
    (tmp_path / "main.py").write_text(ARGPARSE_SCRIPT)
    (work / "space.yaml").write_text("knobs:\n  num_workers: [0, 1]\nbaseline: {batch_size: 16}\n"
                                     "budget: {samples: 128, warmup_steps: 1, windows: 3}\n")
    _tune(work, monkeypatch, {}, "--space", "space.yaml", "--study", "args", "--trials", "2", "--top-k", "0",
          "--", "--emsize", "64", "--data", "data", target=f"{tmp_path / 'main.py'}:train")
    study = optuna.load_study(study_name="args", storage=f"sqlite:///{work}/studies/autotune.db")
    seen = [t.user_attrs["extra:seen"] for t in study.trials]
    assert len(seen) >= 2 and all(s["emsize"] == 64 and s["in_study"] and s["data_found"] for s in seen), seen
    assert all(s["argv"] == [str(tmp_path / "main.py"), "--emsize", "64", "--data", "data"] for s in seen)
    assert all(Path(s["cwd"]) == work for s in seen)
    # The study records them, and autotune train --study gives them to the real run without a -- of its own.
    assert json.loads((work / "studies" / "args" / "best_config.json").read_text())["script_args"] == \
        ["--emsize", "64", "--data", "data"]
    assert main(["train", f"{tmp_path / 'main.py'}:train", "--study", "args", "--steps", "2", "--no-progress"]) == 0
    done = json.loads((work / "studies" / "args" / "train.json").read_text())
    assert done["script_args"] == ["--emsize", "64", "--data", "data"] and done["runs"]["pick"]["status"] == "ok"
    # Without --, a trial's argparse sees no arguments: not autotune's own (it would exit on --space).
    _tune(work, monkeypatch, {}, "--space", "space.yaml", "--study", "no-args", "--trials", "1", "--top-k", "0",
          target=f"{tmp_path / 'main.py'}:train")
    study = optuna.load_study(study_name="no-args", storage=f"sqlite:///{work}/studies/autotune.db")
    assert [t.user_attrs["extra:seen"]["argv"] for t in study.trials] == [[str(tmp_path / "main.py")]]
    assert study.trials[0].user_attrs["extra:seen"]["emsize"] == 200
    # The Python twin: script_args=, and a string is refused in one line (it would be split into letters).
    with pytest.raises(ValueError, match="split it with shlex.split"):
        autotune.Tuner(f"{tmp_path / 'main.py'}:train", script_args="--emsize 64")
    # Only the commands that run the script take arguments after --.
    with pytest.raises(SystemExit):
        main(["best", "args", "--", "--emsize", "64"])
    assert "arguments after -- are the script's" in capsys.readouterr().err


WORD_LM_SPACE = """\
knobs:
  batch_size: [10, 20]
  num_workers: [0, 1]
budget: {samples: 200, warmup_steps: 1, windows: 3}
"""


def test_the_word_language_model_example_tunes_with_its_own_options(tmp_path: Path, capsys, monkeypatch) -> None:
    # docs/adapting-a-script.md's walk-through: argparse options after --, a stateful LSTM (micro-batches of 10
    # keep a state each), the validation loss minimised. Its batch of 20 streams is the baseline on a CPU: the
    # YAML's [10, 20] and --batch-size 20 were refused as "not a positive multiple of 8 (Tensor Core multiple)".
    (tmp_path / "space.yaml").write_text(WORD_LM_SPACE)
    _tune(tmp_path, monkeypatch, {}, "--space", "space.yaml", "--study", "wlm", "--batch-size", "20", "--trials", "2",
          "--top-k", "0", "--prune-below", "0", "--metric-direction", "minimize", "--max-accuracy-loss", "0.05",
          "--", "--tokens", "3000", "--bptt", "10", "--emsize", "16", "--nhid", "16", "--nlayers", "1",
          target=f"{REPO / 'examples' / 'word_lm.py'}:train")
    out = capsys.readouterr().out
    assert "Verdict: " in out and "Where the minutes went:" in out
    study = optuna.load_study(study_name="wlm", storage=f"sqlite:///{tmp_path}/studies/autotune.db")
    ran = [t for t in study.trials if t.user_attrs.get("status") == "ok"]
    assert len(ran) == len(study.trials) >= 2, [(t.user_attrs.get("status"), t.user_attrs.get("error")) for t in study.trials]
    assert all(t.user_attrs["extra:script_args"] == {"emsize": 16, "nhid": 16, "batch_size": 20} for t in ran)
    assert study.user_attrs["baseline_config"]["batch_size"] == 20 and "--batch-size 20" in out
    doc = json.loads((tmp_path / "studies" / "wlm" / "best_config.json").read_text())
    assert doc["baseline"]["config"]["batch_size"] == 20 and doc["batch_policy"]["global_batch"] == 20
    assert 0 < study.user_attrs["reference_metric"] < 6  # nats: below ln(200), what guessing gives


def test_an_older_best_config_json_that_found_nothing_faster_loads_the_baseline(tmp_path: Path) -> None:
    # Written before keep_baseline existed: its config is the slower pick, its faster is false.
    path = tmp_path / "best_config.json"
    path.write_text(json.dumps({"study": "old", "config": TrialConfig(num_workers=2).to_dict(), "faster": False,
                                "baseline": {"config": TrialConfig(batch_size=16).to_dict()}}))
    assert autotune.load_best(path) == TrialConfig(batch_size=16)


def test_the_summary_says_when_the_baseline_is_not_the_scripts_trainer_arguments() -> None:
    # The HF adapter's trials record what the script's TrainingArguments train with; from the shell the study's
    # baseline is the space's, and the two routes then compare against different baselines.
    from autotune.integrations._summary import _other_baseline

    baseline = TrialConfig(batch_size=16)
    doc = {"measurement": {"extra:script_baseline": {"precision": "fp32", "batch_size": 16, "optimizer_impl": "fused",
                                                     "num_workers": 0}}}
    assert _other_baseline(doc, baseline) == "optimizer_impl=fused"
    assert _other_baseline(doc, baseline.replace(optimizer_impl="fused")) == ""
    assert _other_baseline({"measurement": {}}, baseline) == ""


def test_a_real_noisy_study_says_each_thing_once_and_as_best_config_json_does(tmp_path: Path, capsys,
                                                                              monkeypatch) -> None:
    """Defect 5 through a real study: a pick twice the baseline's speed, the baseline's race runs 40% apart
    (a noisy machine). The summary says noisy once, the speed-up once, a rounded reference metric, and what
    confirmed the pick in the words ``best_config.json`` uses."""
    (tmp_path / "space.yaml").write_text(SPACE)
    # The baseline's first two runs are its fp32 references; the race's runs of it follow, 40% apart.
    env = _replay(tmp_path, {"base": 100.0, "slower": 90.0, "other": 200.0}, {"base": [1.0, 1.0, 1.0, 0.6, 1.0]})
    _tune(tmp_path, monkeypatch, env, "--space", "space.yaml", "--study", "noisy", "--trials", "3",
          "--prune-below", "0", "--top-k", "2")
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "studies" / "noisy" / "best_config.json").read_text())
    assert doc["faster"] and doc["speedup_spread"]["basis"] == "alternation" and doc["confirmed"]["confirmed"]
    verdict = next(line for line in out.splitlines() if line.startswith("Verdict: "))
    low, high = doc["speedup_spread"]["low"], doc["speedup_spread"]["high"]
    assert verdict.startswith(f"Verdict: {low:.2f}x to {high:.2f}x faster than the baseline (the machine was noisy"), verdict
    assert verdict.count(f"{high:.2f}x") == 1, verdict  # the range once (before: again inside the parentheses)
    assert out.count("the machine was noisy") + out.count("a noisy machine") == 1, out
    assert "single runs" not in out, out  # the speed-up is the race's, as best_config.json's basis says
    metric = next((line for line in out.splitlines() if "Reference metric" in line), "")
    assert not re.search(r"\d\.\d{6,}", metric), metric
    # The accuracy check's words and best_config.json's fields say the same.
    assert ("Part of the accuracy check is blind" in out) == doc["accuracy_check"]["partly_blind"], out
    assert ("The accuracy check is blind" in out) == doc["accuracy_check"]["blind"], out
