"""A ViT-B/32 (timm) on synthetic ImageNet-shaped images, augmented on the CPU in the Dataset.

A script as a user writes it, for ``benchmarks/runners/answer_first_h200.py``: no earlier result was tuned
on it. Its data (``zoo_data``) is augmented on the CPU in ``__getitem__``. The script trains at
``batch_size=128`` and anneals its learning rate with OneCycle over the run.
"""

from __future__ import annotations

import torch
import timm
from benchmarks.workloads.zoo_data import CLASSES, TintedImages


def train(ctx) -> None:
    torch.manual_seed(ctx.seed)
    model = ctx.model(timm.create_model("vit_base_patch32_224", num_classes=CLASSES))
    optimizer = ctx.optimizer(torch.optim.AdamW, model.parameters(), lr=5e-4 * ctx.lr_scale, weight_decay=0.05)
    loader = ctx.loader(TintedImages(), batch_size=128)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-3 * ctx.lr_scale,
                                                   total_steps=ctx.optimizer_steps)
    step = ctx.train_step(model, optimizer, torch.nn.CrossEntropyLoss(label_smoothing=0.1), scheduler=schedule)
    for images, labels in ctx.batches(loader):
        step(images, labels)
