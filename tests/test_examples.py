"""The documentation's training example (``docs/training-function.md``) is ``examples/train.py``, the README's is
``examples/minimal.py``, and both tune for real through ``autotune tune``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import optuna

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "train.py"
# A short study of the example: one sampled trial beside the two fp32 references, 16 steps each.
TINY_SPACE = """\
knobs:
  channels_last: [false, true]
  batch_size: [32, 64]
budget: {samples: 1024, warmup_steps: 1, windows: 3}
"""


def test_the_docs_show_the_example_file_as_it_is() -> None:
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "training-function.md").read_text(), flags=re.S)
    shown = [b for b in blocks if b.startswith("# examples/train.py")]
    assert len(shown) == 1, "docs/training-function.md shows examples/train.py once, starting with its first line"
    assert shown[0] == EXAMPLE.read_text()


def test_the_example_tunes_through_the_cli(tmp_path: Path) -> None:
    space = tmp_path / "space.yaml"
    space.write_text(TINY_SPACE)
    studies = tmp_path / "studies"
    env = {**os.environ, "COLUMNS": "400"}
    proc = subprocess.run(
        [sys.executable, "-m", "autotune", "tune", f"{EXAMPLE.relative_to(REPO)}:train", "--space", str(space),
         "--trials", "2", "--top-k", "0", "--studies-dir", str(studies), "--no-progress", "--no-plots"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Verdict:" in proc.stdout
    study = optuna.load_study(study_name="train", storage=f"sqlite:///{studies}/autotune.db")
    trials = study.get_trials()
    assert len(trials) == 2 and all(t.user_attrs["status"] == "ok" for t in trials), \
        [(t.user_attrs.get("status"), t.user_attrs.get("error")) for t in trials]
    # evaluate() ran on the trial's device and the model learned: held-out accuracy far above chance (0.1).
    assert study.user_attrs["reference_metric"] > 0.5
    assert all(t.user_attrs["metric"] > 0.5 for t in trials)
    assert json.loads((studies / "train" / "best_config.json").read_text())["config"] is not None


MINIMAL = REPO / "examples" / "minimal.py"


def test_the_readme_shows_the_minimal_example_as_it_is() -> None:
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
    shown = [b for b in blocks if b.startswith("# examples/minimal.py")]
    assert len(shown) == 1, "the README shows examples/minimal.py once, starting with its first line"
    assert shown[0] == MINIMAL.read_text()
    assert len(shown[0].splitlines()) <= 20


def test_the_minimal_example_tunes_through_the_cli(tmp_path: Path) -> None:
    space = tmp_path / "space.yaml"
    space.write_text(TINY_SPACE)
    studies = tmp_path / "studies"
    proc = subprocess.run(
        [sys.executable, "-m", "autotune", "tune", f"{MINIMAL.relative_to(REPO)}:train", "--space", str(space),
         "--trials", "2", "--top-k", "0", "--studies-dir", str(studies), "--no-progress", "--no-plots"],
        cwd=REPO, env={**os.environ, "COLUMNS": "400"}, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Verdict:" in proc.stdout
    study = optuna.load_study(study_name="train", storage=f"sqlite:///{studies}/autotune.db")
    assert all(t.user_attrs["status"] == "ok" for t in study.get_trials())
    assert json.loads((studies / "train" / "best_config.json").read_text())["config"] is not None
