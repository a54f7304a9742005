"""Real scripts as they are written (issue 60): their own arguments under ``autotune train``, a model that
computes its own loss, evaluation every N steps kept out of the delivered throughput, and the adapters' real
runs. Every run here is a real training of a tiny workload on the CPU, in this process or in the command's own.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import autotune
from autotune import TrialConfig
from autotune.cli import main
HERE = Path(__file__).resolve().parent
ARGPARSE_SCRIPT = str(HERE / "argparse_script.py")  # not imported here: it parses its options at import
ONE_THREAD = TrialConfig(cpu_threads=1)


def _config_file(tmp_path: Path, config: TrialConfig, **fields) -> Path:
    """A best_config.json with the fields autotune train reads, and any others given."""
    doc = {"study": None, "config": config.to_dict(), "throughput": None, "measurement": {},
           "baseline": {"config": config.to_dict(), "throughput": None}, **fields}
    path = tmp_path / "best_config.json"
    path.write_text(json.dumps(doc))
    return path


def _metrics(tmp_path: Path, label: str = "pick") -> list:
    return [m["value"] for m in json.loads((tmp_path / "train.json").read_text())["runs"][label]["metrics"]]


# -- 1. the script's own arguments -------------------------------------------------------------------------
def test_train_passes_the_scripts_arguments_after_the_double_dash_from_the_cli_and_from_python(
        tmp_path: Path, capsys) -> None:
    target = f"{ARGPARSE_SCRIPT}:train_with_options"
    code = main(["train", target, "--steps", "3", "--out", str(tmp_path), "--no-progress", "--", "--width", "5"])
    assert code == 0, capsys.readouterr().err
    assert _metrics(tmp_path, "baseline") == [5, 3]  # --width 5 parsed at import; argv = [script, --width, 5]
    assert json.loads((tmp_path / "train.json").read_text())["script_args"] == ["--width", "5"]
    # Without --, the script gets no arguments: its argparse sees its defaults, not autotune's own options.
    assert main(["train", target, "--steps", "3", "--out", str(tmp_path), "--no-progress"]) == 0
    assert _metrics(tmp_path, "baseline") == [8, 1]
    # The Python twin; a string is refused (it would be split into letters).
    result = autotune.train(target, steps=3, out=tmp_path, progress=False, say=lambda _: None, args=["--width", "6"])
    assert [m["value"] for m in result.runs["baseline"].metrics] == [6, 3]
    with pytest.raises(ValueError, match="shlex.split"):
        autotune.train(target, steps=3, out=tmp_path, args="--width 6")


def test_train_reuses_the_arguments_its_study_recorded_unless_new_ones_are_given(tmp_path: Path, capsys) -> None:
    path = _config_file(tmp_path, ONE_THREAD, script_args=["--width", "7"])
    target = f"{ARGPARSE_SCRIPT}:train_with_options"
    for extra, width in (([], 7), (["--", "--width", "4"], 4)):
        code = main(["train", target, "--config", str(path), "--steps", "3", "--out", str(tmp_path),
                     "--no-progress", *extra])
        assert code == 0, capsys.readouterr().err
        assert _metrics(tmp_path)[0] == width
    # In a comparison the runs are the command's own processes: they get them too.
    code = main(["train", target, "--config", str(path), "--steps", "3", "--out", str(tmp_path), "--no-progress",
                 "--compare"])
    assert code == 0, capsys.readouterr().err
    assert _metrics(tmp_path, "baseline")[0] == _metrics(tmp_path, "pick")[0] == 7


@pytest.mark.parametrize("compare", [False, True])
def test_the_scripts_own_argparse_error_is_one_line_in_the_scripts_words(tmp_path: Path, capsys,
                                                                         compare: bool) -> None:
    path = _config_file(tmp_path, ONE_THREAD)
    code = main(["train", f"{ARGPARSE_SCRIPT}:train_with_options", "--config", str(path), "--steps", "3",
                 "--out", str(tmp_path), "--no-progress", *(["--compare"] if compare else []), "--", "--lr", "0.1"])
    out, err = capsys.readouterr()
    assert code == 1
    assert err == ("autotune: error: argparse_script.py: error: unrecognized arguments: --lr 0.1 (the script's own "
                   "arguments: --lr 0.1; they go after --)\n"), err
    assert "usage:" not in out + err


# -- 2. a model that computes its own loss -----------------------------------------------------------------
def _train_losses(model_fn, loss_fn, *, batch_form: bool = False) -> list[float]:
    """One untimed epoch (a context with no study and no run) of 8 steps; the loss of each."""
    import torch

    from autotune.trial._context import TrialContext
    from real_script_workloads import Pairs
    from workloads import dataset

    torch.manual_seed(0)
    ctx = TrialContext(config=ONE_THREAD.replace(batch_size=32))
    model = ctx.model(model_fn())
    step = ctx.train_step(model, ctx.optimizer(torch.optim.SGD, model.parameters(), lr=0.5), loss_fn)
    data = Pairs(256, seed=0) if batch_form else dataset(256, seed=0)
    if batch_form:
        return [float(step(batch)) for batch in ctx.batches(ctx.loader(data, shuffle=False))]
    return [float(step(x, y)) for x, y in ctx.batches(ctx.loader(data, shuffle=False))]


@pytest.mark.parametrize("form", ["tuple", "mapping", "object"])
def test_step_without_a_loss_function_trains_a_model_that_computes_its_own_loss(form: str) -> None:
    from torch import nn

    from real_script_workloads import KeywordLoss, TargetsLoss
    from workloads import tiny_model

    with_loss_fn = _train_losses(tiny_model, nn.CrossEntropyLoss())
    assert len(with_loss_fn) == 8 and with_loss_fn[-1] < with_loss_fn[0]
    # step(x, y) calls model(x, y): nanoGPT's (logits, loss), a mapping with "loss", an object with .loss. The
    # same weights and the same loss at every step as the loss function applied to model(x).
    assert _train_losses(lambda: TargetsLoss(form), None) == pytest.approx(with_loss_fn, rel=1e-6)
    # step(batch) with a mapping calls model(**batch): an HF-style model(input_ids=..., labels=...).
    assert _train_losses(KeywordLoss, None, batch_form=True) == pytest.approx(with_loss_fn, rel=1e-6)


def test_a_model_output_with_no_loss_or_an_ambiguous_one_is_named_in_one_line() -> None:
    import torch

    from autotune import WorkloadError
    from autotune.trial._knobs import own_loss

    with pytest.raises(WorkloadError, match=r"the model's output \(Tensor\) has no loss tensor"):
        own_loss(torch.ones(3))
    with pytest.raises(WorkloadError, match="2 scalar tensors: which one is the loss is a guess"):
        own_loss((torch.tensor(1.0), torch.tensor(2.0)))
    loss = torch.tensor(0.5)
    assert own_loss((loss, torch.ones(2, 3))) is loss  # an HF model's return_dict=False tuple: (loss, logits)


# -- 3. evaluation every N steps, kept out of the delivered throughput ----------------------------------------
@pytest.mark.parametrize("workload", ["train_evaluating_every_steps", "train_evaluating_inside_the_loop"])
def test_evaluation_every_n_steps_is_kept_out_of_the_delivered_throughput_and_said_beside_it(
        tmp_path: Path, workload: str) -> None:
    from real_script_workloads import EVAL_SECONDS, REAL_SCRIPT_WORKLOADS

    said: list[str] = []
    result = autotune.train(f"{REAL_SCRIPT_WORKLOADS}:{workload}", config=_config_file(tmp_path, ONE_THREAD),
                            steps=16, out=tmp_path, progress=False, say=said.append, args=[])
    run = result.runs["pick"]
    assert run.status == "ok", run.error
    evaluations = len(run.metrics)
    assert evaluations == 4  # at optimizer steps 4, 8, 12, 16 (or before iterations 0, 4, 8, 12)
    assert run.untimed_seconds["evaluation"] >= evaluations * EVAL_SECONDS
    # Not one window holds an evaluation's sleep: the windows time the training steps alone.
    assert run.window_throughputs and all(rate > 64 / EVAL_SECONDS for rate in run.window_throughputs)
    assert run.seconds >= sum(64 / r for r in run.window_throughputs) + evaluations * EVAL_SECONDS
    line = said[0]
    assert f"delivered {run.throughput:,.1f} samples/s while training (" in line
    assert f"{run.untimed_seconds['evaluation']:.1f} s in evaluation, outside it)" in line, line


def test_an_evaluation_inside_a_trials_loop_stops_the_windows_clock() -> None:
    from autotune import Budget
    from autotune.trial._context import TrialContext
    from real_script_workloads import EVAL_SECONDS, train_evaluating_inside_the_loop

    # One warm-up step (iteration 0, with its evaluation), then windows of steps 1-3, 4-6 and 7-9: the
    # evaluations before iterations 4 and 8 fall inside the second and the third.
    ctx = TrialContext(config=ONE_THREAD, budget=Budget(samples=64 * 12, warmup_steps=1, windows=3))
    train_evaluating_inside_the_loop(ctx)
    windows = ctx.recorder.windows
    assert len(windows) == 3
    assert all(w.seconds < EVAL_SECONDS for w in windows), [w.seconds for w in windows]
    assert ctx.extras["untimed.evaluation"] >= 2 * EVAL_SECONDS


# -- 7. the adapters' scripts under autotune train -----------------------------------------------------------
@pytest.mark.parametrize("function", ["train_hf", "train_lightning"])
def test_train_compare_runs_a_trainer_script_for_the_real_length_with_its_evaluation_untimed(
        tmp_path: Path, capsys, monkeypatch, function: str) -> None:
    from real_trainers import EVAL_SLEEP, REAL_TRAINERS

    monkeypatch.chdir(tmp_path)  # whatever the trainers write of their own
    # The pick accumulates two micro-batches of 8 into the script's global batch of 16.
    pick, baseline = TrialConfig(batch_size=8, global_batch=16, cpu_threads=1), TrialConfig(batch_size=16, cpu_threads=1)
    path = _config_file(tmp_path, pick, baseline={"config": baseline.to_dict(), "throughput": None})
    code = main(["train", f"{REAL_TRAINERS}:{function}", "--config", str(path), "--steps", "8", "--compare",
                 "--out", str(tmp_path), "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    doc = json.loads((tmp_path / "train.json").read_text())
    for label in ("baseline", "pick"):
        run = doc["runs"][label]
        assert run["status"] == "ok" and run["steps_done"] == run["optimizer_steps"] == 8, run
        assert run["samples"] == 128 and len(run["losses"]) == 8 and run["throughput"] > 0
        # Two evaluations (every 4 of 8 steps), each with its sleep: kept apart, outside every window.
        assert run["untimed_seconds"]["evaluation"] >= 2 * EVAL_SLEEP
    assert "Speed: the pick ran at" in out and "s in evaluation, outside it)" in out


def test_a_trainer_script_in_a_context_built_by_hand_trains_its_own_length() -> None:
    from autotune.trial._context import TrialContext
    from real_trainers import train_hf_own_length

    ctx = TrialContext(config=TrialConfig(batch_size=16))
    train_hf_own_length(ctx)  # raised "ctx.step_clock() times a study's trial: outside a study there is no budget"
    assert ctx.extras["trainer_saw"]["max_steps"] == 4


# -- 4. energy per sample over the steady state, the one-time joules apart ----------------------------------
class ClockedEnergy:
    """pynvml's energy counter on a clock: ``watts`` drawn all along, and ``burst`` joules more from the second
    reading on (the first is the run's start, the second where the first timed window opens): the one-time
    cost of a compile or a graph capture, which falls in the warm-up."""

    NVMLError = RuntimeError

    def __init__(self, watts: float, burst: float) -> None:
        import time

        self.watts, self.burst, self.reads, self.t0 = watts, burst, 0, time.perf_counter()

    def nvmlDeviceGetHandleByIndex(self, index: int) -> object:  # noqa: N802 - pynvml's names
        return object()

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: object) -> int:  # noqa: N802
        import time

        self.reads += 1
        joules = self.watts * (time.perf_counter() - self.t0) + (self.burst if self.reads > 1 else 0.0)
        return int(joules * 1000)  # millijoules


def test_joules_per_sample_are_the_steady_states_and_the_one_time_joules_are_apart() -> None:
    from autotune.study._train import run_once
    from autotune.trial._run import RunLength
    from benchmarks.workloads import planted

    run = run_once(planted.train_clean, ONE_THREAD, RunLength(steps=40), nvml=ClockedEnergy(100.0, 500.0))
    assert run.status == "ok" and run.throughput
    assert run.steady_joules_per_sample == pytest.approx(100.0 / run.throughput, rel=0.05)
    assert 500.0 <= run.one_time_joules <= 500.0 + 100.0 * run.wall_seconds
    assert run.joules_per_sample > run.steady_joules_per_sample  # the whole run's carries the burst


def test_the_comparisons_energy_line_divides_the_steady_states_not_a_compile_charged_to_the_samples() -> None:
    from autotune.study._train import TrainRun, _closing_lines

    def run(label: str, steady: float, whole: float, one_time: float) -> TrainRun:
        return TrainRun(label=label, config=TrialConfig(), length={"steps": 400}, status="ok", throughput=1000.0,
                        joules_per_sample=whole, steady_joules_per_sample=steady, one_time_joules=one_time)

    # The EfficientNet-B0: a pick 4.24x faster whose compile made its whole-run joules 1.70x.
    runs = {"baseline": run("baseline", 1.0, 1.0, 20.0), "pick": run("pick", 0.236, 1.70, 5_000.0)}
    lines = _closing_lines(runs, {"what": "x"}, {"speed_what": "s", "accuracy_what": "a"}, Path("train.json"), False)
    energy = next(line for line in lines if line.startswith("Energy:"))
    assert energy == ("Energy: 0.24x the baseline's joules per sample while training; one-time 5,000 J against 20 J "
                      "(start-up, compile, warm-up).")
    assert "0.236 J/sample while training, 5,000 J one-time (1.7 J/sample over the whole run)" in lines[1]


# -- 6. output that contradicts itself ---------------------------------------------------------------------
def test_a_reference_loss_that_rose_is_not_said_to_have_barely_fallen() -> None:
    from types import SimpleNamespace

    from autotune.study._verdict import ReferenceBand

    def band(losses: list) -> ReferenceBand:
        return ReferenceBand.of_measurements([SimpleNamespace(losses=losses, metric=None, loss_every=1, extras={})])

    rose = band([7.013] * 4 + [8.006] * 12).loss_blind_reason()
    assert rose is not None and "training loss rose (7.013 to 8.006)" in rose and "barely fell" not in rose
    flat = band([7.013] * 4 + [7.0] * 12).loss_blind_reason()
    assert flat is not None and "training loss barely fell (7.013 to 7)" in flat


def test_autotune_best_says_when_the_accuracy_check_was_blind(tmp_path: Path) -> None:
    from autotune.cli import best_summary

    doc = {"study": "s", "config": {"batch_size": 32}, "trial": 3, "verdict": "1.5x faster than the baseline",
           "baseline": {"config": {"batch_size": 16}}, "confirmed": {"confirmed": True},
           "accuracy_check": {"blind": True, "partly_blind": False, "reasons": ["no training loss was recorded"]}}
    lines = best_summary(doc, tmp_path / "best_config.json")
    assert "Accuracy check: blind, nothing vouches for the pick's accuracy: no training loss was recorded" in lines
    doc["accuracy_check"] = {"blind": False, "partly_blind": True, "reasons": ["the metric is saturated"]}
    assert ("Accuracy check: part of it is blind (the metric is saturated); the verdict rests on the other part"
            in best_summary(doc, tmp_path / "best_config.json"))
    doc["accuracy_check"] = {"blind": False, "partly_blind": False, "reasons": []}
    assert not any(line.startswith("Accuracy check") for line in best_summary(doc, tmp_path / "best_config.json"))


def test_the_scripts_own_epoch_loop_trains_one_epoch_per_pass_for_the_runs_length(tmp_path: Path) -> None:
    from real_script_workloads import REAL_SCRIPT_WORKLOADS

    # 512 samples at batch 64: 8 steps an epoch. The script's own loop says 2 epochs; the run says 20 steps.
    result = autotune.train(f"{REAL_SCRIPT_WORKLOADS}:train_with_its_own_epoch_loop",
                            config=_config_file(tmp_path, ONE_THREAD), steps=20, out=tmp_path, progress=False,
                            say=lambda _: None, args=[])
    run = result.runs["pick"]
    assert run.status == "ok" and run.steps_done == 20, run.error
    # One validation after each pass: epochs 0, 1 (the script's), then 2, numbered on; the last pass stops at 20.
    assert [m["value"] for m in run.metrics] == [0, 1, 2] and run.epochs_done == 2
    assert "evaluation" in run.untimed_seconds


def test_a_scripts_epoch_loop_under_autotune_train_validates_and_anneals_between_the_runs_epochs(
        tmp_path: Path, capsys) -> None:
    # examples/word_lm.py's own loop (validation, the learning rate divided by 4 when it stops improving) under
    # autotune train --epochs 3, the script's own --epochs 1: three passes, one an epoch, each validated.
    # Its loop used to be range(args.epochs) outside a study: the first pass trained the whole run, once.
    example = HERE.parent / "examples" / "word_lm.py"
    path = _config_file(tmp_path, ONE_THREAD.replace(batch_size=20))
    code = main(["train", f"{example}:train", "--config", str(path), "--epochs", "3", "--out", str(tmp_path),
                 "--no-progress", "--", "--epochs", "1", "--tokens", "3000", "--emsize", "16", "--nhid", "16",
                 "--nlayers", "1", "--bptt", "10", "--lr", "400"])
    out, err = capsys.readouterr()
    assert code == 0, err[-2000:]
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("epoch ")] == \
        ["epoch 1", "epoch 2", "epoch 3"], out
    run = json.loads((tmp_path / "train.json").read_text())["runs"]["pick"]
    assert run["epochs_done"] == 3 and run["untimed_seconds"]["between epochs"] > 0
