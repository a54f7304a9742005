"""A user-style CPU script whose every process pays a slow build: a Dataset made item by item in Python (a
few seconds on a CPU, as a tokenizer or a folder scan would take), then a small MLP trained through
``ctx.loader``. For the planner's fixed costs on a CPU (``benchmarks/runners/seeds_first_cpu.py``)."""

from __future__ import annotations

import math

import torch

ITEMS = 900_000  # items built one by one in Python in every process: about 4 s on one core


class BuiltItems(torch.utils.data.Dataset):
    """Features computed one item at a time in Python, with their labels."""

    def __init__(self, n: int, size: int = 4096) -> None:
        rows = [[0.0] * 32 for _ in range(size)]
        for i in range(n):  # every item folded into one of ``size`` rows: the build's time without its memory
            row = rows[i % size]
            for k in range(32):
                row[k] += math.sin(i * (k + 1) * 0.37) / (1 + i // size)
        self.x = torch.tensor(rows, dtype=torch.float32)
        self.y = (self.x[:, :16].sum(dim=1) > self.x[:, 16:].sum(dim=1)).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]


def train(ctx) -> None:
    data = BuiltItems(ITEMS)
    torch.manual_seed(ctx.seed)
    model = ctx.model(torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 2)))
    optimizer = ctx.optimizer(torch.optim.AdamW, model.parameters(), lr=1e-3)
    step = ctx.train_step(model, optimizer, torch.nn.functional.cross_entropy)
    for x, y in ctx.batches(ctx.loader(data)):
        step(x, y)
