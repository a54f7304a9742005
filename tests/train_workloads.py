"""Workloads for ``autotune train`` (tests/test_train.py): small enough for a second on a CPU.

Each reports what the run did through ``ctx.report_metric`` (every report is kept in the run's metrics), so
a test reads the optimizer steps taken, the last learning rate and the epochs the hooks saw from the result.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
from torch import nn

from workloads import dataset, own_dataloader_run, tiny_model

TRAIN_WORKLOADS = str(Path(__file__).resolve())


class CountingSGD(torch.optim.SGD):
    """SGD that counts its steps (the optimizer steps the run took)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.taken = 0

    def step(self, closure=None):
        self.taken += 1
        return super().step(closure)


def train_scheduled(ctx) -> None:
    """A cosine schedule over ctx.optimizer_steps, an end-of-epoch hook; reports steps taken, then the last
    learning rate, then T_max, then each hook's (epoch, ctx.epoch)."""
    torch.manual_seed(ctx.seed)
    model = ctx.model(tiny_model())
    optimizer = ctx.optimizer(CountingSGD, model.parameters(), lr=0.1)
    loader = ctx.loader(dataset(256, seed=ctx.seed))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=ctx.optimizer_steps)
    step = ctx.train_step(model, optimizer, nn.CrossEntropyLoss(), scheduler=scheduler)
    seen: list[list[int]] = []
    ctx.on_epoch_end(lambda epoch: seen.append([epoch, ctx.epoch]))
    for inputs, targets in ctx.batches(loader):
        step(inputs, targets)
    ctx.report_metric(optimizer.taken)
    ctx.report_metric(optimizer.param_groups[0]["lr"])
    ctx.report_metric(ctx.optimizer_steps)
    for epoch, seen_epoch in seen:
        ctx.report_metric(1000 * (epoch + 1) + seen_epoch)



def train_at_batch_24(ctx) -> None:
    """The script trains at batch_size=24 and a cosine schedule over ctx.optimizer_steps; reports the batch
    of its first step, the steps taken and the last learning rate."""
    torch.manual_seed(ctx.seed)
    model = ctx.model(tiny_model())
    optimizer = ctx.optimizer(CountingSGD, model.parameters(), lr=0.1)
    loader = ctx.loader(dataset(240, seed=ctx.seed), batch_size=24)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=ctx.optimizer_steps)
    step = ctx.train_step(model, optimizer, nn.CrossEntropyLoss(), scheduler=scheduler)
    first = None
    for inputs, targets in ctx.batches(loader):
        first = first or len(inputs)
        step(inputs, targets)
    ctx.report_metric(first)
    ctx.report_metric(optimizer.taken)
    ctx.report_metric(optimizer.param_groups[0]["lr"])


def train_own_dataloader(ctx) -> None:
    """The script's own DataLoader, batch 24 and one persistent worker; reports the workers it loaded with."""
    _, loader = own_dataloader_run(ctx, 240, 24)
    ctx.report_metric(loader.num_workers)


def train_until_stopped(ctx) -> None:
    """Trains a long run; after 20 optimizer steps it sends itself SIGINT, as a Ctrl-C at the terminal does.
    After the loop it reports the steps taken, as a script's last evaluation would run."""
    torch.manual_seed(ctx.seed)
    model = ctx.model(tiny_model())
    optimizer = ctx.optimizer(CountingSGD, model.parameters(), lr=0.1)
    step = ctx.train_step(model, optimizer, nn.CrossEntropyLoss())
    for inputs, targets in ctx.batches(ctx.loader(dataset(1024, seed=ctx.seed))):
        step(inputs, targets)
        if optimizer.taken == 20:
            os.kill(os.getpid(), signal.SIGINT)
    ctx.report_metric(optimizer.taken)


# Two energy counter readings (millijoules): where the timed windows start, and where they end.
FAKE_ENERGY = [{"sm_clock_mhz": 1980, "energy_mj": 5_000_000}, {"sm_clock_mhz": 1980, "energy_mj": 5_512_000}]


def train_fake_energy(ctx) -> None:
    """train_tiny with a stand-in NVML behind the trial's sampler (a CPU trial has none): its energy counter
    reads 512 J over the timed windows."""
    from autotune.hardware import GpuSampler
    from autotune.testing import FakeNvml
    from workloads import train_tiny

    ctx._gpu_sampler = lambda: GpuSampler(nvml=FakeNvml(FAKE_ENERGY), interval=3600)
    train_tiny(ctx)
