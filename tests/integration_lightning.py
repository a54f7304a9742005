"""The trial function of tests/test_integrations.py's Lightning study: the example's CNN, tiny, with
deliberate sleeps in its start-up and validation that the measured windows must not contain.

Trial processes import this file by its path; the example comes from ``examples/`` beside ``tests/``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("LIGHTNING_CNN_SAMPLES", "512")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import torch  # noqa: E402

# Compiling on a 2-core CPU takes minutes: the tests ask for compile and check that the step ran through
# torch.compile's wrapper, with TorchDynamo switched off (TORCH_COMPILE_DISABLE=1). The flag is set here,
# not only in the environment: the trial server imported TorchDynamo before the test set the variable.
if os.environ.get("TORCH_COMPILE_DISABLE") == "1":
    torch._dynamo.config.disable = True

import lightning as L  # noqa: E402
import lightning_cnn  # noqa: E402 - the example, as its user wrote it

from autotune.integrations import lightning as tuned  # noqa: E402

WORKLOAD = str(Path(__file__).resolve())
SLEEP = 0.3  # seconds, once in the fit's start-up and once in the validation
SLEPT: list[list[float]] = []  # each sleep's [start, end] on this process's perf_counter

# Validation every 2 steps and callbacks that need it, a logger or checkpoints: a trial runs none of them.
TRAINER = {**lightning_cnn.TRAINER, "val_check_interval": 2, "check_val_every_n_epoch": None,
           "callbacks": [L.pytorch.callbacks.EarlyStopping(monitor="val_loss"),
                         L.pytorch.callbacks.ModelCheckpoint(monitor="val_loss"),
                         L.pytorch.callbacks.LearningRateMonitor()]}


def sleep() -> None:
    start = time.perf_counter()
    time.sleep(SLEEP)
    SLEPT.append([start, time.perf_counter()])


class SlowCNN(lightning_cnn.CNN):
    def on_train_start(self) -> None:
        sleep()

    def on_validation_epoch_end(self) -> None:
        sleep()


def loader():
    """The DataLoader the user trains with (the baseline's batch and loader knobs)."""
    return lightning_cnn.Images(batch_size=16).train_dataloader()


def train(ctx) -> None:
    tuned.run_trainer(ctx, SlowCNN(), lightning_cnn.Images(batch_size=16), trainer=TRAINER, metric="val_acc")
    ctx.record("slept", SLEPT)
    ctx.record("windows", [[w.started, w.started + w.seconds] for w in ctx.recorder.windows])
