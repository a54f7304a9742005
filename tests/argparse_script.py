"""A script that parses its own options at import (tests/test_real_scripts.py): autotune train gives it its
arguments after ``--``, or those its study was tuned with; autotune's own options would fail here."""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

from workloads import dataset, tiny_model

parser = argparse.ArgumentParser(description="a script with its own options")
parser.add_argument("--width", type=int, default=8)
parser.add_argument("--eval-interval", type=int, default=0)
ARGS = parser.parse_args()  # at import, as the scripts do: autotune's own options would fail here


def train_with_options(ctx) -> None:
    """Reports the --width it parsed at import, then the length of the sys.argv it trained under."""
    torch.manual_seed(ctx.seed)
    model = ctx.model(tiny_model())
    optimizer = ctx.optimizer(torch.optim.SGD, model.parameters(), lr=0.1)
    step = ctx.train_step(model, optimizer, nn.CrossEntropyLoss())
    for inputs, targets in ctx.batches(ctx.loader(dataset(256, seed=ctx.seed))):
        step(inputs, targets)
    ctx.report_metric(ARGS.width)
    ctx.report_metric(len(sys.argv))  # the script's path and its arguments, nothing of autotune's
