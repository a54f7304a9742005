"""The trial function of tests/test_integrations.py's Trainer study: the example's Trainer, tiny, with
deliberate sleeps in its start-up and evaluation that the measured windows must not contain.

Trial processes import this file by its path; the example comes from ``examples/`` beside ``tests/``.
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
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import torch  # noqa: E402

# Compiling on a 2-core CPU takes minutes: the tests ask for compile and check that the step ran through
# torch.compile's wrapper, with TorchDynamo switched off (TORCH_COMPILE_DISABLE=1). The flag is set here,
# not only in the environment: the trial server imported TorchDynamo before the test set the variable.
if os.environ.get("TORCH_COMPILE_DISABLE") == "1":
    torch._dynamo.config.disable = True

import hf_trainer  # noqa: E402 - the example, as its user wrote it
from transformers import TrainerCallback  # noqa: E402

from autotune.integrations import transformers as tuned  # noqa: E402

WORKLOAD = str(Path(__file__).resolve())
SLEEP = 0.3  # seconds, once in the Trainer's start-up and once in its evaluation
SLEPT: list[list[float]] = []  # each sleep's [start, end] on this process's perf_counter

# The example's TrainingArguments, evaluating every 2 steps: inside a trial that evaluation must not run, or
# its sleep would land in the timed windows.
ARGS = dataclasses.replace(hf_trainer.ARGS, per_device_train_batch_size=16, eval_strategy="steps", eval_steps=2)


def sleep() -> None:
    start = time.perf_counter()
    time.sleep(SLEEP)
    SLEPT.append([start, time.perf_counter()])


class SlowStart(TrainerCallback):
    """A Trainer whose start-up is slow: its on_train_begin work, after the model and data are set up."""

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        sleep()


def slow_metrics(prediction) -> dict:
    sleep()
    return {"sleeps": 1.0}


def build_slow_trainer(args):
    trainer = hf_trainer.build_trainer(args)
    trainer.compute_metrics = slow_metrics
    trainer.add_callback(SlowStart())
    return trainer


def train(ctx) -> None:
    tuned.run_trainer(ctx, build_slow_trainer, ARGS)
    ctx.record("slept", SLEPT)
    ctx.record("windows", [[w.started, w.started + w.seconds] for w in ctx.recorder.windows])


def build_from_overrides(overrides: dict):
    """A build_trainer that makes its own TrainingArguments, taking the trial's overrides as a dict."""
    mine = {"output_dir": "unused", "per_device_train_batch_size": 16, "learning_rate": 3e-3, "optim": "adamw_torch",
            "report_to": "none"}
    return hf_trainer.build_trainer(hf_trainer.TrainingArguments(**{**mine, **overrides}))


def train_with_overrides(ctx) -> None:
    tuned.run_trainer(ctx, build_from_overrides, metric=None)


def train_ignoring_the_overrides(ctx) -> None:
    tuned.run_trainer(ctx, lambda args: hf_trainer.build_trainer(ARGS), ARGS)


class _SlowInWorkers(torch.utils.data.Dataset):
    """The Trainer's dataset, each item 20 ms slower when a DataLoader worker reads it: a config with workers
    is clearly slower than the script's own (no workers), as the issue's 0.44x Trainer config was."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int):
        if torch.utils.data.get_worker_info() is not None:
            time.sleep(0.02)
        return self.inner[index]


def build_slow_in_workers(args):
    trainer = hf_trainer.build_trainer(args)
    trainer.train_dataset = _SlowInWorkers(trainer.train_dataset)
    return trainer


def train_slow_in_workers(ctx) -> None:
    tuned.run_trainer(ctx, build_slow_in_workers, ARGS)


# A script whose own TrainingArguments differ from the test space's baseline (one DataLoader worker).
OWN_ARGS = dataclasses.replace(ARGS, dataloader_num_workers=1)


def train_own_arguments(ctx) -> None:
    tuned.run_trainer(ctx, hf_trainer.build_trainer, OWN_ARGS)
