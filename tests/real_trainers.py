"""The adapters' scripts for tests/test_real_scripts.py's real runs: the examples' Hugging Face and Lightning
Trainers, tiny, evaluating every 4 optimizer steps as their own arguments say, each evaluation with a
deliberate sleep that the real run's timed windows must not contain.

The runs import this file by its path; the examples come from ``examples/`` beside ``tests/``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_TRAINER_SIZE", "tiny")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("LIGHTNING_CNN_SAMPLES", "512")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import hf_trainer  # noqa: E402 - the examples, as their users wrote them
import lightning_cnn  # noqa: E402

from autotune.integrations import lightning as tuned_lightning  # noqa: E402
from autotune.integrations import transformers as tuned_hf  # noqa: E402

REAL_TRAINERS = str(Path(__file__).resolve())
EVAL_SLEEP = 0.25  # seconds in every evaluation

# Evaluation every 4 steps, nothing saved or logged: a real run keeps the script's own arguments.
HF_ARGS = dataclasses.replace(hf_trainer.ARGS, per_device_train_batch_size=16, eval_strategy="steps", eval_steps=4,
                              save_strategy="no", logging_strategy="no", disable_tqdm=True)
LIGHTNING_TRAINER = {"precision": "32-true", "val_check_interval": 4, "check_val_every_n_epoch": None,
                     "limit_val_batches": 1, "num_sanity_val_steps": 0, "logger": False,
                     "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}


def slow_metrics(prediction) -> dict:
    time.sleep(EVAL_SLEEP)
    return {"slept": 1.0}


def build_trainer(args):
    trainer = hf_trainer.build_trainer(args)
    trainer.compute_metrics = slow_metrics
    return trainer


def train_hf(ctx) -> None:
    tuned_hf.run_trainer(ctx, build_trainer, HF_ARGS)


def train_hf_own_length(ctx) -> None:
    """The script's own length (4 steps): what a context built by hand trains."""
    tuned_hf.run_trainer(ctx, build_trainer, dataclasses.replace(HF_ARGS, max_steps=4), metric=None)


class SlowValidation(lightning_cnn.CNN):
    def on_validation_epoch_end(self) -> None:
        time.sleep(EVAL_SLEEP)


def train_lightning(ctx) -> None:
    tuned_lightning.run_trainer(ctx, SlowValidation(), lightning_cnn.Images(batch_size=16),
                                trainer=LIGHTNING_TRAINER, metric="val_acc")
