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
