"""The two real public scripts adapted for autotune (issue 60): nanoGPT's ``train.py`` and PyTorch's ImageNet
example, each tuned at a tiny size on the CPU through ``autotune tune`` with its own arguments after ``--``, then
trained for real with the pick and compared with the baseline through ``autotune train --study ... --compare``,
which reuses the arguments the study recorded.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from autotune.cli import main

REPO = Path(__file__).resolve().parent.parent
NANOGPT = REPO / "examples" / "nanogpt"
# nanoGPT's own options (its configurator's --key=value), at a size that trains in seconds on a CPU.
NANOGPT_ARGS = ["--device=cpu", "--compile=False", "--dataset=tiny", "--n_layer=1", "--n_head=2", "--n_embd=16",
                "--block_size=16", "--batch_size=8", "--gradient_accumulation_steps=1", "--dropout=0.0", "--eval_iters=2", "--eval_interval=4",
                "--warmup_iters=2", "--max_iters=40", "--lr_decay_iters=40", "--out_dir=out"]
TINY_SPACE = """\
knobs:
  precision: [fp32, bf16]
  num_workers: [0, 1]
budget: {samples: 256, warmup_steps: 1, windows: 3}
"""


def _tokens(tmp_path: Path) -> None:
    """data/tiny as nanoGPT's prepare.py writes a dataset: train.bin and val.bin of uint16 tokens, meta.pkl."""
    import pickle

    folder = tmp_path / "data" / "tiny"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    successor = rng.permutation(32)
    for split, n in (("train", 20_000), ("val", 2_000)):
        tokens = np.empty(n, dtype=np.uint16)
        tokens[0] = 0
        for i in range(1, n):  # a fixed successor most of the time: a loss that falls
            tokens[i] = successor[tokens[i - 1]] if rng.random() < 0.9 else rng.integers(32)
        tokens.tofile(folder / f"{split}.bin")
    (folder / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 32}))


def test_nanogpt_tunes_and_trains_for_real_with_its_own_arguments_loss_and_evaluation(
        tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # nanoGPT reads configurator.py and data/ from where it runs, as its README says
    shutil.copy(NANOGPT / "configurator.py", tmp_path)
    _tokens(tmp_path)
    (tmp_path / "space.yaml").write_text(TINY_SPACE)
    target = f"{NANOGPT / 'train.py'}:train"
    code = main(["tune", target, "--space", "space.yaml", "--study", "nano", "--trials", "2", "--top-k", "0",
                 "--batch-size", "8", "--metric-direction", "minimize", "--max-accuracy-loss", "1", "--no-progress",
                 "--no-plots", "--", *NANOGPT_ARGS])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    best = json.loads((tmp_path / "studies" / "nano" / "best_config.json").read_text())
    assert best["script_args"] == NANOGPT_ARGS and best["baseline"]["config"]["batch_size"] == 8
    # The real run: no --, so the study's arguments; 12 steps, evaluating every 4 (eval_interval) untimed.
    code = main(["train", target, "--study", "nano", "--steps", "12", "--compare", "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    doc = json.loads((tmp_path / "studies" / "nano" / "train.json").read_text())
    assert doc["script_args"] == NANOGPT_ARGS
    for label in ("baseline", "pick"):
        run = doc["runs"][label]
        assert run["status"] == "ok" and run["steps_done"] == 12, run
        assert run["losses"][-1] < run["losses"][0]  # model(X, Y)'s own loss trained it
        assert run["untimed_seconds"]["evaluation"] > 0 and run["metric"] is not None
    assert "delivered" in out and "while training" in out and "Accuracy: the pick's training" in out
    assert (tmp_path / "out" / "ckpt.pt").is_file()  # its evaluation saved its checkpoint, as the script does


IMAGENET = REPO / "examples" / "imagenet"
# The ImageNet example's own arguments: a folder of images (its ImageFolder route, a val split small enough to
# validate in a second; --dummy's FakeData validates 50,000 images), a small torchvision model, batch 4.
IMAGENET_ARGS = ["data", "-a", "mobilenet_v3_small", "-j", "0", "-b", "4", "--epochs", "1"]
IMAGENET_SPACE = """\
knobs:
  precision: [fp32, bf16]
  channels_last: [false, true]
budget: {samples: 32, warmup_steps: 1, windows: 3}
"""


def _images(tmp_path: Path) -> None:
    """data/train and data/val as ImageFolder reads them: two classes of 32x32 PNGs (a bright and a dark one)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", 8), ("val", 4)):
        for label, base in (("bright", 180), ("dark", 60)):
            folder = tmp_path / "data" / split / label
            folder.mkdir(parents=True)
            for i in range(n):
                pixels = np.clip(base + rng.normal(0, 30, (32, 32, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")


def test_the_imagenet_example_tunes_and_trains_for_real_its_own_epoch_loop_between_passes(
        tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    _images(tmp_path)
    (tmp_path / "space.yaml").write_text(IMAGENET_SPACE)
    target = f"{IMAGENET / 'main.py'}:tuned"
    code = main(["tune", target, "--space", "space.yaml", "--study", "img", "--trials", "2", "--top-k", "0",
                 "--batch-size", "4", "--max-accuracy-loss", "1", "--no-progress", "--no-plots", "--", *IMAGENET_ARGS])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    assert json.loads((tmp_path / "studies" / "img" / "best_config.json").read_text())["script_args"] == IMAGENET_ARGS
    # 16 images at batch 4: 4 steps an epoch. 6 steps: a whole epoch, its validation and checkpoint, then 2 steps.
    code = main(["train", target, "--study", "img", "--steps", "6", "--compare", "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    doc = json.loads((tmp_path / "studies" / "img" / "train.json").read_text())
    for label in ("baseline", "pick"):
        run = doc["runs"][label]
        assert run["status"] == "ok" and run["steps_done"] == 6 and run["epochs_done"] == 1, run
        assert run["untimed_seconds"]["between epochs"] > 0  # its validation and checkpoint, outside every window
    assert (tmp_path / "checkpoint.pth.tar").is_file() and "Speed: the pick ran at" in out
