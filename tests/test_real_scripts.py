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
