"""A GPT-style language model in the shape of a transformer LM script, tuned through ctx.train_step.

    autotune tune examples/gpt_lm.py:train --space search_spaces/example_gpt_lm.yaml

What it shows, beside the image loop of ``cifar_cnn.py``:

- dict batches (``{"input_ids", "labels"}``) and a model that returns its own loss (``outputs.loss``), as
  Hugging Face models do: ``step(batch)`` calls ``model(**batch)`` and backpropagates ``outputs.loss``;
- gradient clipping (``clip_grad_norm=1.0``) and a warm-up + cosine LR schedule stepped every optimizer
  step, both inside the CUDA Graph when ``cuda_graphs`` is on;
- the attention through ``ctx.attention``: written out (``attention: explicit``, the untuned baseline of
  the space) or ``scaled_dot_product_attention`` with the backend the knob pins;
- each transformer block wrapped with ``ctx.checkpoint`` (the ``activation_checkpointing`` knob);
- AdamW from ``ctx.optimizer`` (the ``optimizer_impl`` knob: for-loop, foreach or fused).

Size: ``GPT_LM_SIZE=small`` (the default: 6 layers, d_model 512, 8 heads, 512 tokens, vocabulary 32,000,
the shape of ``benchmarks/workloads/gpt.py``) or ``tiny`` (2 layers, d_model 32, 32 tokens, vocabulary 256:
seconds per trial on a CPU). One sample is one sequence: tokens/s = samples/s x the sequence length,
which each trial records as ``tokens_per_sequence``.

The data are synthetic token streams it can learn: the next token is a fixed successor of the current one
90% of the time, a random one of 1,024 (64 for tiny) otherwise, so the loss and the held-out next-token
accuracy (the reported metric) are real signals.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class Shape:
    layers: int
    d_model: int
    heads: int
    seq: int
    vocab: int
    active: int  # tokens the streams use
    lr: float  # AdamW's peak learning rate


SIZES = {
    "small": Shape(layers=6, d_model=512, heads=8, seq=512, vocab=32000, active=1024, lr=6e-4),
    "tiny": Shape(layers=2, d_model=32, heads=2, seq=32, vocab=256, active=64, lr=3e-3),
}
FOLLOW = 0.9
POOL = 1024  # training sequences kept on the device; the batches cycle through them in order
WARMUP_STEPS = 4  # optimizer steps of linear LR warm-up, then a cosine decay


def shape() -> Shape:
    name = os.environ.get("GPT_LM_SIZE", "small")
    if name not in SIZES:
        raise ValueError(f"GPT_LM_SIZE={name!r}: use one of {', '.join(SIZES)}")
    return SIZES[name]


@dataclass
class LMOutput:
    """What the model returns: the mean next-token loss (when labels were given) and the logits."""

    logits: torch.Tensor
    loss: Optional[torch.Tensor] = None


Attention = Callable[..., torch.Tensor]


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP."""

    def __init__(self, d: int, heads: int, attention: Attention) -> None:
        super().__init__()
        self.heads = heads
        self.attention = attention
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d, bias=False)
        self.out = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = self.attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A small GPT-style LM; the output head shares the token embedding."""

    def __init__(self, s: Shape, *, attention: Attention = F.scaled_dot_product_attention,
                 wrap: Callable[[nn.Module], nn.Module] = lambda block: block) -> None:
        super().__init__()
        self.tok = nn.Embedding(s.vocab, s.d_model)
        self.pos = nn.Parameter(torch.zeros(s.seq, s.d_model))
        self.blocks = nn.Sequential(*(wrap(Block(s.d_model, s.heads, attention)) for _ in range(s.layers)))
        self.ln_f = nn.LayerNorm(s.d_model)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None) -> LMOutput:
        x = self.blocks(self.tok(input_ids) + self.pos[: input_ids.shape[1]])
        logits = self.ln_f(x) @ self.tok.weight.t()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        return LMOutput(logits=logits, loss=loss)


def streams(n: int, s: Shape, *, seed: int, device: torch.device) -> torch.Tensor:
    """``n`` sequences of ``s.seq + 1`` tokens; the successor map is fixed, ``seed`` draws the streams."""
    fixed = torch.Generator().manual_seed(1234)
    tokens = torch.randperm(s.vocab, generator=fixed)[: s.active]
    successor = torch.randperm(s.active, generator=fixed)
    gen = torch.Generator().manual_seed(seed)
    length = s.seq + 1
    index = torch.empty(n, length, dtype=torch.long)
    index[:, 0] = torch.randint(0, s.active, (n,), generator=gen)
    jumps = torch.rand(n, length, generator=gen) > FOLLOW
    random_next = torch.randint(0, s.active, (n, length), generator=gen)
    for t in range(1, length):
        index[:, t] = torch.where(jumps[:, t], random_next[:, t], successor[index[:, t - 1]])
    return tokens[index].to(device)


class Sequences:
    """Dict batches sliced in order from a pool on the device (the same samples at any micro-batch)."""

    def __init__(self, pool: torch.Tensor, batch_size: int) -> None:
        self.pool, self.batch_size = pool, batch_size

    def __iter__(self):
        for start in range(0, len(self.pool) - self.batch_size + 1, self.batch_size):
            chunk = self.pool[start:start + self.batch_size]
            yield {"input_ids": chunk[:, :-1], "labels": chunk[:, 1:]}


def schedule(total_steps: int) -> Callable[[int], float]:
    """Linear warm-up over ``WARMUP_STEPS`` optimizer steps, then a cosine decay to a tenth."""
    def factor(step: int) -> float:
        if step < WARMUP_STEPS:
            return (step + 1) / WARMUP_STEPS
        progress = min(1.0, (step - WARMUP_STEPS) / max(1, total_steps - WARMUP_STEPS))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))
    return factor


@torch.no_grad()
def next_token_accuracy(ctx, model: nn.Module, test: torch.Tensor, batch: int = 8) -> float:
    model.eval()
    correct = 0
    for start in range(0, len(test), batch):
        chunk = test[start:start + batch]
        with ctx.autocast():
            correct += (model(chunk[:, :-1]).logits.argmax(-1) == chunk[:, 1:]).sum().item()
    model.train()
    return correct / test[:, 1:].numel()


def train(ctx) -> None:
    s = shape()
    torch.manual_seed(ctx.seed)
    model = ctx.model(GPT(s, attention=ctx.attention, wrap=ctx.checkpoint))
    optimizer = ctx.optimizer(torch.optim.AdamW, model.parameters(), lr=s.lr, weight_decay=0.1)
    # Optimizer steps of the trial (every trial takes the same ones under batch_policy: fixed).
    total = ctx.budget.samples // ctx.config.global_batch_size if ctx.budget else POOL // ctx.config.global_batch_size
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(total))
    step = ctx.train_step(model, optimizer, clip_grad_norm=1.0, scheduler=scheduler)
    ctx.record("tokens_per_sequence", s.seq)
    pool = streams(POOL, s, seed=ctx.seed, device=ctx.device)
    for batch in ctx.batches(Sequences(pool, ctx.config.batch_size)):
        step(batch)
    ctx.report_metric(next_token_accuracy(ctx, model, streams(64, s, seed=10_000, device=ctx.device)))
