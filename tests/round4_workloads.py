"""Workloads for tests/test_faults_four.py."""

from __future__ import annotations

import torch

from workloads import dataset


def _tiny(x: torch.Tensor) -> torch.Tensor:
    return (x.sin() * 2 + 1).sum(dim=1)


def train_compiles_a_function(ctx) -> None:
    """The cheapest real Inductor compile (one elementwise kernel, no backward) inside ``ctx.batches``:
    14 s cold on a 2-core CPU, about 1 s warm from the study's cache."""
    fn = torch.compile(_tiny) if ctx.config.compile != "off" else _tiny
    total = 0.0
    with torch.no_grad():
        for inputs, _ in ctx.batches(ctx.loader(dataset(256, seed=ctx.seed))):
            total += float(fn(inputs).sum())
    ctx.report_metric(1.0)
