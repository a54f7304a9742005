"""EfficientNet-B0 (torchvision) on synthetic ImageNet-shaped images, augmented on the CPU in the Dataset.

A script as a user writes it, for ``benchmarks/runners/answer_first_h200.py``: no earlier result was tuned
on it. Its data (``zoo_data``) is augmented on the CPU in ``__getitem__``. The script builds its own
DataLoader (batch 128, 8 pinned persistent workers) and hands it to ``ctx.loader``; it trains with SGD,
Nesterov momentum and a cosine schedule over the run.
"""

from __future__ import annotations

import torch
import torchvision
from benchmarks.workloads.zoo_data import CLASSES, TintedImages


def train(ctx) -> None:
    torch.manual_seed(ctx.seed)
    model = ctx.model(torchvision.models.efficientnet_b0(num_classes=CLASSES))
    optimizer = ctx.optimizer(torch.optim.SGD, model.parameters(), lr=0.02 * ctx.lr_scale, momentum=0.9,
                              nesterov=True, weight_decay=4e-5)
    own = torch.utils.data.DataLoader(TintedImages(), batch_size=128, shuffle=True, num_workers=8, pin_memory=True,
                                      persistent_workers=True)
    loader = ctx.loader(own)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=ctx.optimizer_steps)
    step = ctx.train_step(model, optimizer, torch.nn.CrossEntropyLoss(), scheduler=schedule)
    for images, labels in ctx.batches(loader):
        step(images, labels)
