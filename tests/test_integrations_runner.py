"""The adapters' GPU runner in its tiny mode, on the CPU: a Hugging Face study from the example's own
arguments, and the report with the speed-up, the verdicts and the arguments to paste."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[1]


def test_the_tiny_mode_tunes_the_trainer_example_and_writes_what_to_paste(tmp_path: Path) -> None:
    # In a process of its own: the adapter has the trial server import transformers, which this one should not.
    out = tmp_path / "int.md"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.runners.integrations_h200", "--tiny", "--adapter",
                           "transformers", "--trials", "2", "--deadline", "120", "--out", str(out), "--workdir", str(tmp_path / "w")],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = json.loads(out.with_suffix(".json").read_text())["transformers"]
    assert found["baseline"].startswith("fp32 bs32")  # the example's TrainingArguments, not the space's baseline
    assert found["baseline_throughput"] > 0 and found["best"] and found["verdict"]
    assert json.loads(found["paste"])["per_device_train_batch_size"] * \
        json.loads(found["paste"])["gradient_accumulation_steps"] == 32  # the global batch kept
    assert found["trials"][0]["role"] == "reference" and len(found["trials"]) >= 2
    assert "cuda_graphs=true" in found["removed_knobs"]  # left out, with the reason
    text = out.read_text()
    assert "Arguments to paste:" in text and "| trial |" in text
    assert str(tmp_path) not in text  # the command is shown without the machine's paths
