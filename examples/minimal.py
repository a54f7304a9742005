# examples/minimal.py: a minimal training function (autotune tune examples/minimal.py:train --trials 20)
import torch
from torch import nn

import autotune


def train(ctx: autotune.TrialContext) -> None:
    torch.manual_seed(ctx.seed)                               # the same initial weights for every config
    gen = torch.Generator().manual_seed(0)                    # stand-in data: use your dataset here
    images = torch.randn(4096, 3, 32, 32, generator=gen)
    data = torch.utils.data.TensorDataset(images, (images.mean(dim=(1, 2, 3)) > 0).long())
    model = ctx.model(nn.Sequential(                          # to the device, channels_last, torch.compile
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(16 * 4 * 4, 10)))
    opt = ctx.optimizer(torch.optim.SGD, model.parameters(), lr=0.05 * ctx.lr_scale, momentum=0.9)
    step = ctx.train_step(model, opt, nn.CrossEntropyLoss())  # precision, accumulation, CUDA Graphs
    for images, labels in ctx.batches(ctx.loader(data)):      # batch size, workers, pinning; timed windows
        step(images, labels)
