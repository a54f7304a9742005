"""Workloads for tests/test_answer_first.py: scripts whose step and input costs are set by the config, slept,
so the study's order (which runs first, what fits the budget) shows in seconds on any machine."""

from __future__ import annotations

import os
import time

import torch

STEP_ENV = "AUTOTUNE_TEST_STEP_SECONDS"  # the baseline's step; optimizer_impl=fused makes it FAST_FACTOR faster
ITEM_ENV = "AUTOTUNE_TEST_ITEM_SECONDS"  # each item's read in the Dataset (the input pipeline's cost)
FAST_FACTOR = 5.0
RUNS_ENV = "AUTOTUNE_TEST_RUNS"  # a file: each full run (not a probe) appends the batch it trained at
BUILD_ENV = "AUTOTUNE_TEST_BUILD_SECONDS"  # slept at import: a script that builds its data when imported

time.sleep(float(os.environ.get(BUILD_ENV, "0") or 0))


class SlowItems(torch.utils.data.Dataset):
    """A deterministic map-style dataset whose every item costs ``ITEM_ENV`` seconds to read."""

    def __init__(self, n: int = 512) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=generator)
        self.y = (self.x.sum(dim=1) > 0).long()
        self.item_seconds = float(os.environ.get(ITEM_ENV, "0") or 0)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        if self.item_seconds:
            time.sleep(self.item_seconds)
        return self.x[index], self.y[index]


def _train(ctx, *, batch_size=None) -> None:
    torch.manual_seed(ctx.seed)
    model = ctx.model(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    step = ctx.train_step(model, optimizer, torch.nn.functional.cross_entropy)
    kwargs = {} if batch_size is None else {"batch_size": batch_size}
    loader = ctx.loader(SlowItems(), **kwargs)
    seconds = float(os.environ.get(STEP_ENV, "0") or 0)
    if ctx.config.optimizer_impl == "fused":  # a step lever the prior point takes (it has no loader knob)
        seconds /= FAST_FACTOR
    for x, y in ctx.batches(loader):
        if seconds:
            time.sleep(seconds)
        step(x, y)
    runs = os.environ.get(RUNS_ENV)
    if runs and not ctx.probe:
        with open(runs, "a") as out:
            out.write(f"{ctx.config.batch_size}\n")
    with torch.no_grad():
        x, y = SlowItems(256).x, SlowItems(256).y
        ctx.report_metric(float((model(x.to(ctx.device)).argmax(dim=1).cpu() == y).float().mean()))


def train(ctx) -> None:
    """The config's batch; a slept step (``STEP_ENV``) and slept item reads (``ITEM_ENV``)."""
    _train(ctx)


def train_at_batch_16(ctx) -> None:
    """As ``train``, at the batch the script passes to ``ctx.loader``: 16."""
    _train(ctx, batch_size=16)
