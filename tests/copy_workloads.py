"""Workloads for co-located trials (processes_per_gpu > 1) on the CPU: tiny, each copy a real process.

Trials import these by ``path.py:func``. ``PIDDIR_ENV`` names a folder where a copy writes its pid and the
pid of a child it starts, so a test can check that no process of a trial outlives it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

from workloads import PlainSGD, accuracy, dataset, tiny_model

COPY_WORKLOADS = str(Path(__file__).resolve())
PIDDIR_ENV = "AUTOTUNE_TEST_PIDDIR"
# The tiny MLP's step takes well under a millisecond, so its timed windows would span some 20 ms, where a
# millisecond of scheduling skew between copies is 5% of the overlap. A pause per step stretches them to
# a few hundred milliseconds, so the overlap measures the barrier and the train-on, not the scheduler.
STEP_PAUSE = 0.004


def _note_pids(ctx) -> None:
    """Write this copy's pid and a sleeping child's into the pid folder (when the test asked for one)."""
    folder = os.environ.get(PIDDIR_ENV)
    if not folder:
        return
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    Path(folder, f"copy{ctx.copy_index}.mps").write_text(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", ""))
    Path(folder, f"copy{ctx.copy_index}.pids").write_text(f"{os.getpid()} {sleeper.pid}")


def train_copy(ctx) -> None:
    """The tiny MLP, recording which copy ran, with which seed and how many compute threads."""
    torch.manual_seed(ctx.seed)
    _note_pids(ctx)
    model = ctx.model(tiny_model())
    optimizer = ctx.optimizer(PlainSGD, model.parameters(), lr=0.1 * ctx.lr_scale)
    step = ctx.train_step(model, optimizer, nn.CrossEntropyLoss())
    for inputs, targets in ctx.batches(ctx.loader(dataset(seed=ctx.seed))):
        step(inputs, targets)
        time.sleep(STEP_PAUSE)
    ctx.record("test.copy", ctx.copy_index)
    ctx.record("test.seed", ctx.seed)
    ctx.record("test.threads", torch.get_num_threads())
    ctx.record("test.mps_pipe", os.environ.get("CUDA_MPS_PIPE_DIRECTORY", ""))
    ctx.report_metric(accuracy(ctx, model, dataset(256, seed=10_000)))


def fail_on_copy_1(ctx) -> None:
    """Copy 1 breaks after its first steps; the others train (and would wait for it at the barrier)."""
    torch.manual_seed(ctx.seed)
    _note_pids(ctx)
    model = ctx.model(tiny_model())
    optimizer = ctx.optimizer(PlainSGD, model.parameters(), lr=0.1)
    step = ctx.train_step(model, optimizer, nn.CrossEntropyLoss())
    for i, (inputs, targets) in enumerate(ctx.batches(ctx.loader(dataset(seed=ctx.seed)))):
        if ctx.copy_index == 1 and i == 1:
            time.sleep(0.5)  # the others are at the barrier or past it by now
            raise ValueError("copy one broke on purpose")
        step(inputs, targets)


def slow_copy(ctx) -> None:
    """Trains slowly (for a study that is killed while its copies run)."""
    _note_pids(ctx)
    model = ctx.model(tiny_model())
    optimizer = ctx.optimizer(PlainSGD, model.parameters(), lr=0.1)
    step = ctx.train_step(model, optimizer, nn.CrossEntropyLoss())
    for inputs, targets in ctx.batches(ctx.loader(dataset(seed=ctx.seed))):
        if ctx.config.processes_per_gpu > 1:
            time.sleep(0.2)
        step(inputs, targets)


def late_copy_1(ctx) -> None:
    """Copy 1 takes far longer over its warm-up than the start barrier waits."""
    model = ctx.model(tiny_model())
    optimizer = ctx.optimizer(PlainSGD, model.parameters(), lr=0.1)
    step = ctx.train_step(model, optimizer, nn.CrossEntropyLoss())
    for i, (inputs, targets) in enumerate(ctx.batches(ctx.loader(dataset(seed=ctx.seed)))):
        if ctx.copy_index == 1 and i == 0:
            time.sleep(30)
        step(inputs, targets)
