"""Workloads with planted accuracy harm, and their clean twins, for testing the accuracy verdict.

A small MLP fits a smooth function of 16 inputs (regression, mean squared error). Its hidden activations
pass through a large offset and back, ``(h + OFFSET) - OFFSET``: exact in fp32, but bf16 keeps 8 bits of
significand, so near the offset it rounds ``h`` to a coarse grid: spacing 0.125 at an offset of 16, and 8 at
the default 1024, where every activation in (-1, 1) is lost and only the output bias can learn. The gradient passes through unchanged, so the damage is in the
forward pass only, as a real precision bug would be. ``train_clean`` is the same model without the
offset: bf16 must not harm it. The metric is the held-out R² (higher is better).

The dataset is fixed (a user's data does not change with the seed); the seed sets the initialisation and
the sample order. ``AUTOTUNE_PLANTED_OFFSET`` sets the offset of ``train_harmed`` (default 1024), so a
runner can measure how small a harm the verdict still sees.
"""

from __future__ import annotations

import math
import os

import torch
from torch import nn

FEATURES, HIDDEN = 16, 64
DEFAULT_OFFSET = 1024.0


def data(n: int, *, seed: int) -> torch.utils.data.TensorDataset:
    """Inputs and a smooth target with a little noise; the function is fixed, ``seed`` draws the points."""
    weights = torch.randn(FEATURES, 4, generator=torch.Generator().manual_seed(1234)) / math.sqrt(FEATURES)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=gen)
    z = x @ weights
    y = torch.sin(2 * z[:, 0]) + z[:, 1] + 0.5 * torch.tanh(z[:, 2] - z[:, 3]) + 0.05 * torch.randn(n, generator=gen)
    return torch.utils.data.TensorDataset(x, y.unsqueeze(1))


class OffsetMLP(nn.Module):
    def __init__(self, offset: float) -> None:
        super().__init__()
        self.hidden = nn.Linear(FEATURES, HIDDEN)
        self.out = nn.Linear(HIDDEN, 1)
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.hidden(x))
        if self.offset:
            h = (h + self.offset) - self.offset  # exact in fp32; bf16 rounds h to the grid near the offset
        return self.out(h)


def _train(ctx, offset: float, max_lr: float = 0.0) -> None:
    torch.manual_seed(ctx.seed)
    model = ctx.model(OffsetMLP(offset))
    optimizer = ctx.optimizer(torch.optim.Adam, model.parameters(), lr=0.03 * ctx.lr_scale)
    step = ctx.train_step(model, optimizer, nn.MSELoss())
    # With max_lr, OneCycle over the run's schedule (ctx.optimizer_steps), as many users' scripts anneal.
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=max_lr * ctx.lr_scale,
                                                   total_steps=ctx.optimizer_steps) if max_lr else None
    for x, y in ctx.batches(ctx.loader(data(4096, seed=0))):
        step(x, y)
        if schedule is not None and schedule.last_epoch + 1 < ctx.optimizer_steps:
            schedule.step()
    x, y = (ctx.to_device(t) for t in data(2048, seed=10_000).tensors)
    with torch.no_grad(), ctx.autocast():
        mse = ((model(x).float() - y) ** 2).mean().item()
    ctx.report_metric(1.0 - mse / y.var().item())


def train_unseeded(ctx) -> None:
    """The clean model fed by a plain DataLoader shuffled from the OS's entropy: every run sees other
    batches, so it cannot be paired with a reference at its seed (as a loader outside ``ctx.loader``
    without a seeded generator)."""
    torch.manual_seed(ctx.seed)
    model = ctx.model(OffsetMLP(0.0))
    optimizer = ctx.optimizer(torch.optim.Adam, model.parameters(), lr=0.03 * ctx.lr_scale)
    step = ctx.train_step(model, optimizer, nn.MSELoss())
    generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    loader = torch.utils.data.DataLoader(data(4096, seed=0), batch_size=ctx.config.batch_size, shuffle=True,
                                         drop_last=True, generator=generator)
    for x, y in ctx.batches(loader):
        step(x, y)


def train_harmed(ctx) -> None:
    _train(ctx, float(os.environ.get("AUTOTUNE_PLANTED_OFFSET", DEFAULT_OFFSET)))


def train_clean(ctx) -> None:
    _train(ctx, 0.0)


ONECYCLE_MAX_LR = float(os.environ.get("AUTOTUNE_PLANTED_MAX_LR", "0.1"))


def train_harmed_onecycle(ctx) -> None:
    """``train_harmed`` with OneCycle over the run's schedule (``AUTOTUNE_PLANTED_MAX_LR``, default 0.1)."""
    _train(ctx, float(os.environ.get("AUTOTUNE_PLANTED_OFFSET", DEFAULT_OFFSET)), ONECYCLE_MAX_LR)


def train_clean_onecycle(ctx) -> None:
    _train(ctx, 0.0, ONECYCLE_MAX_LR)
