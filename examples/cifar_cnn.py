"""An example workload in the shape of a user's own training script.

    autotune tune examples/cifar_cnn.py:train --space search_spaces/example_cifar_cnn.yaml --memory-limit 0.3

A CIFAR-shaped (3x32x32, 10 classes) CNN on synthetic data, fed through the DataLoader. The space
includes batches (256, 1024) that need more memory than the limit allows: such a trial fails as
`oom`, is recorded as infeasible, and the study goes on.
"""

import torch
from torch import nn

from autotune.demo import evaluate, synthetic_images


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
    )


def train(ctx) -> None:
    torch.manual_seed(ctx.seed)
    train_x, train_y = synthetic_images(4096, 32, seed=ctx.seed)
    test_x, test_y = synthetic_images(1024, 32, seed=10_000)

    model = ctx.model(make_model())
    optimizer = ctx.optimizer(torch.optim.SGD, model.parameters(), lr=0.05 * ctx.lr_scale, momentum=0.9)
    step = ctx.train_step(model, optimizer, nn.CrossEntropyLoss())
    loader = ctx.loader(torch.utils.data.TensorDataset(train_x, train_y))
    for images, labels in ctx.batches(loader):
        step(images, labels)
    ctx.report_metric(evaluate(ctx, model, test_x, test_y))
