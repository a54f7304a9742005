"""A GPT-style language model (6 layers, d_model 512, 8 heads, 512 tokens, vocabulary 32,000: the shape of
``benchmarks/tables/gpt_h200.jsonl``) on synthetic token streams it can learn.

Each sequence follows a fixed random successor map over 1,024 of the vocabulary's tokens: the next token is
the current token's successor 90% of the time and a random one of the 1,024 otherwise. The loss falls from
ln(32000) = 10.4 towards the stream's entropy (about 1.0 nats), so the loss trajectory and the held-out
next-token accuracy are real, learnable signals. AdamW at lr 3e-4, not scaled with the batch.

``train`` also runs as a DDP trial (``processes_per_trial``): the model goes through ``ctx.ddp`` (nothing
changes with one process) and each rank draws its own streams. ``AUTOTUNE_BENCH_SIZE=tiny`` makes it the
2-layer, 64-token ``GPT_TINY``, to check a runner on a CPU.

``train_narrow`` is the same training on a narrower model (d_model 256, 4 heads): every linear layer is
below ``precision: fp8``'s size check (in <= 4096 and out <= 1024), the model where float8 is predicted
slower than bf16 (``benchmarks/runners/fp8_h200.py``).
"""

import os
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from benchmarks.tables.sweep import GPT, GPT_FULL, GPT_TINY, GPTShape

TINY = os.environ.get("AUTOTUNE_BENCH_SIZE") == "tiny"
SHAPE = GPT_TINY if TINY else GPT_FULL
NARROW = GPT_TINY if TINY else GPTShape(layers=6, d_model=256, heads=4, seq=512, vocab=32000)
FOLLOW = 0.9
RANK_SEED = 7919  # rank k draws its streams with seed + k * RANK_SEED (rank 0 keeps the one-process data)


def _streams(n: int, *, seed: int, device: torch.device, shape: GPTShape = SHAPE) -> torch.Tensor:
    """``n`` sequences of ``shape.seq + 1`` tokens; the successor map is fixed, ``seed`` draws the streams."""
    active = min(1024, shape.vocab)
    fixed = torch.Generator().manual_seed(1234)
    tokens = torch.randperm(shape.vocab, generator=fixed)[:active]
    successor = torch.randperm(active, generator=fixed)
    gen = torch.Generator().manual_seed(seed)
    length = shape.seq + 1
    index = torch.empty(n, length, dtype=torch.long)
    index[:, 0] = torch.randint(0, active, (n,), generator=gen)
    jumps = torch.rand(n, length, generator=gen) > FOLLOW
    random_next = torch.randint(0, active, (n, length), generator=gen)
    for t in range(1, length):
        index[:, t] = torch.where(jumps[:, t], random_next[:, t], successor[index[:, t - 1]])
    return tokens[index].to(device)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class _Sequences:
    """Micro-batches sliced in order from a pool already on the device (the same samples at any micro-batch)."""

    def __init__(self, pool: torch.Tensor, batch_size: int) -> None:
        self.pool, self.batch_size = pool, batch_size

    def __iter__(self):
        for start in range(0, len(self.pool) - self.batch_size + 1, self.batch_size):
            chunk = self.pool[start:start + self.batch_size]
            yield chunk[:, :-1], chunk[:, 1:]


def train(ctx, shape: GPTShape = SHAPE, prepare: Callable[[nn.Module], nn.Module] = lambda model: model) -> None:
    torch.manual_seed(ctx.seed)
    model = ctx.ddp(ctx.model(prepare(GPT(shape))))
    optimizer = ctx.optimizer(torch.optim.AdamW, model.parameters(), lr=3e-4, weight_decay=0.1)
    step = ctx.train_step(model, optimizer, _loss)
    pool = _streams(1024, seed=ctx.seed + RANK_SEED * ctx.rank, device=ctx.device, shape=shape)
    for ids, targets in ctx.batches(_Sequences(pool, ctx.config.batch_size)):
        step(ids, targets)
    test = _streams(64, seed=10_000, device=ctx.device, shape=shape)
    correct = 0
    model.eval()
    with torch.no_grad(), ctx.autocast():
        for start in range(0, len(test), 8):
            chunk = test[start:start + 8]
            correct += (model(chunk[:, :-1]).argmax(-1) == chunk[:, 1:]).sum().item()
    ctx.report_metric(correct / test[:, 1:].numel())


def train_narrow(ctx) -> None:
    """``train`` on ``NARROW``: no linear layer passes fp8's size check."""
    train(ctx, NARROW)


def train_narrow_all_float8(ctx) -> None:
    """``train_narrow`` with every linear layer in torchao's float8 (no size check) under ``precision: bf16``:
    what ``precision: fp8`` would run on this model if its size check did not keep the layers in bf16."""
    from torchao.float8 import convert_to_float8_training

    train(ctx, NARROW, prepare=convert_to_float8_training)  # converted before ctx.model compiles it
