"""Workloads of tests/test_real_scripts.py: scripts as their authors write them, small enough for a CPU second.

The models compute their own loss (nanoGPT's ``(logits, loss)``, a mapping, an object with ``.loss``); the
evaluations take real seconds, inside the loop or in a step hook. ``argparse_script.py`` beside it parses its
options at import, as PyTorch's examples and nanoGPT do.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn
from torch.nn import functional as F

from workloads import dataset, tiny_model

REAL_SCRIPT_WORKLOADS = str(Path(__file__).resolve())


class TargetsLoss(nn.Module):
    """nanoGPT's shape: ``model(x, y)`` returns the logits and the loss; without targets, the logits alone."""

    def __init__(self, form: str = "tuple") -> None:
        super().__init__()
        self.net = tiny_model()
        self.form = form

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor = None):
        logits = self.net(inputs)
        if targets is None:
            return logits[:1]  # nanoGPT's inference path: the last position only, the wrong shape to train on
        loss = F.cross_entropy(logits, targets)
        if self.form == "tuple":
            return logits, loss
        if self.form == "mapping":
            return {"logits": logits, "loss": loss}
        return SimpleNamespace(logits=logits, loss=loss)


class KeywordLoss(nn.Module):
    """An HF-style model: ``model(input_ids=..., labels=...)`` returns an object with ``.loss``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_model()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor):
        logits = self.net(input_ids)
        return SimpleNamespace(logits=logits, loss=F.cross_entropy(logits, labels))


class Pairs(torch.utils.data.Dataset):
    """``dataset``'s samples as ``{"input_ids", "labels"}`` mappings."""

    def __init__(self, n: int, seed: int) -> None:
        self.inner = dataset(n, seed=seed)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> dict:
        x, y = self.inner[i]
        return {"input_ids": x, "labels": y}


def train_own_loss(ctx, form: str = "tuple") -> None:
    torch.manual_seed(ctx.seed)
    model = ctx.model(TargetsLoss(form))
    optimizer = ctx.optimizer(torch.optim.SGD, model.parameters(), lr=0.1)
    step = ctx.train_step(model, optimizer)  # no loss function: the model computes its own
    for x, y in ctx.batches(ctx.loader(dataset(256, seed=ctx.seed))):
        step(x, y)


def evaluate_slowly(seconds: float) -> float:
    """An evaluation that takes ``seconds`` of wall time: what nanoGPT's estimate_loss costs."""
    time.sleep(seconds)
    return 1.0


EVAL_SECONDS = 0.4


def train_evaluating_every_steps(ctx) -> None:
    """Evaluates every 4 optimizer steps through ``ctx.on_step_end(..., every=4)``."""
    torch.manual_seed(ctx.seed)
    model = ctx.model(tiny_model())
    optimizer = ctx.optimizer(torch.optim.SGD, model.parameters(), lr=0.1)
    step = ctx.train_step(model, optimizer, nn.CrossEntropyLoss())
    ctx.on_step_end(lambda n: ctx.report_metric(evaluate_slowly(EVAL_SECONDS)), every=4)
    for x, y in ctx.batches(ctx.loader(dataset(512, seed=ctx.seed))):
        step(x, y)


def train_evaluating_inside_the_loop(ctx) -> None:
    """nanoGPT's form: the evaluation inside the loop, every 4 iterations, in ``with ctx.untimed("evaluation")``."""
    torch.manual_seed(ctx.seed)
    model = ctx.model(tiny_model())
    optimizer = ctx.optimizer(torch.optim.SGD, model.parameters(), lr=0.1)
    step = ctx.train_step(model, optimizer, nn.CrossEntropyLoss())
    for it, (x, y) in enumerate(ctx.batches(ctx.loader(dataset(512, seed=ctx.seed)))):
        if it % 4 == 0:
            with ctx.untimed("evaluation"):
                ctx.report_metric(evaluate_slowly(EVAL_SECONDS))
        step(x, y)



def train_with_its_own_epoch_loop(ctx) -> None:
    """The ImageNet example's shape: its own epoch loop, one pass of the loader each, a validation between."""
    torch.manual_seed(ctx.seed)
    model = ctx.model(tiny_model())
    optimizer = ctx.optimizer(torch.optim.SGD, model.parameters(), lr=0.1)
    step = ctx.train_step(model, optimizer, nn.CrossEntropyLoss())
    loader = ctx.loader(dataset(512, seed=ctx.seed))
    for epoch in ctx.epochs(range(0, 2)):
        for x, y in ctx.batches(loader):
            step(x, y)
        with ctx.untimed("evaluation"):
            ctx.report_metric(epoch)
