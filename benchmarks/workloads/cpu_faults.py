"""Each function is a real fault inside a trial process (see benchmarks/runners/faults.py)."""

import ctypes
import os
import time

import torch
from torch import nn


class _Data(torch.utils.data.Dataset):
    def __init__(self, hang: bool = False) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(2048, 32, generator=gen)
        self.y = (self.x.sum(1) > 0).long()
        self.hang = hang

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        if self.hang and torch.utils.data.get_worker_info() is not None:
            time.sleep(3600)  # a DataLoader worker that never answers
        return self.x[i], self.y[i]


def train(ctx, data=None) -> None:
    torch.manual_seed(ctx.seed)
    model = ctx.model(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2)))
    opt = ctx.optimizer(torch.optim.SGD, model.parameters(), lr=0.05)
    step = ctx.train_step(model, opt, nn.CrossEntropyLoss())
    for x, y in ctx.batches(ctx.loader(data or _Data())):
        step(x, y)
    ctx.report_metric(0.5)


def oom_torch(ctx):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")


def oom_cuda_message(ctx):
    raise RuntimeError("CUDA error: out of memory")


def oom_cudnn_message(ctx):
    raise RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input.")


def segfault(ctx):
    ctypes.string_at(0)


def abort(ctx):
    os.abort()


def hang(ctx):
    time.sleep(3600)


def loader_worker_hang(ctx):
    train(ctx, _Data(hang=True))


def nan(ctx):
    torch.manual_seed(ctx.seed)
    model = ctx.model(nn.Linear(32, 2))
    opt = ctx.optimizer(torch.optim.SGD, model.parameters(), lr=0.05)
    step = ctx.train_step(model, opt, lambda out, y: (out * float("nan")).sum())
    for x, y in ctx.batches(ctx.loader(_Data())):
        step(x, y)
