# examples/train.py: a complete training function (autotune tune examples/train.py:train --trials 30)
import torch
from torch import nn

import autotune


def make_data(n: int, *, seed: int) -> torch.utils.data.TensorDataset:
    """Stand-in for your dataset: n noisy 3x32x32 images of 10 smooth class patterns, int64 labels."""
    coarse = torch.randn(10, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    patterns = nn.functional.interpolate(coarse, size=(32, 32), mode="bilinear", align_corners=False)
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=gen)
    images = patterns[labels] + 2.0 * torch.randn(n, 3, 32, 32, generator=gen)
    return torch.utils.data.TensorDataset(images, labels)


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(32 * 4 * 4, 10),
    )


@torch.no_grad()
def evaluate(ctx: autotune.TrialContext, model: nn.Module, test_set) -> float:
    """Held-out accuracy, on the trial's device and in its precision."""
    model.eval()                                          # BatchNorm uses its running statistics
    correct = 0
    for images, labels in torch.utils.data.DataLoader(test_set, batch_size=256):
        with ctx.autocast():                              # the trial's precision (nothing in fp32)
            predicted = model(ctx.to_device(images)).argmax(dim=1)
        correct += (predicted == ctx.to_device(labels)).sum().item()
    model.train()                                         # back to training mode
    return correct / len(test_set)


def train(ctx: autotune.TrialContext) -> None:
    torch.manual_seed(ctx.seed)                           # the same initial weights for every config
    train_set, test_set = make_data(4096, seed=ctx.seed), make_data(1024, seed=10_000)
    model = ctx.model(make_model())                       # to ctx.device, channels_last, torch.compile
    opt = ctx.optimizer(torch.optim.SGD, model.parameters(), lr=0.05 * ctx.lr_scale, momentum=0.9)
    loader = ctx.loader(train_set)                        # batch size, workers, pinning, prefetch
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=ctx.optimizer_steps)  # the whole run
    loss_fn = nn.CrossEntropyLoss()                       # loss_fn(outputs, targets) -> a scalar tensor
    step = ctx.train_step(model, opt, loss_fn, scheduler=schedule)  # autocast, GradScaler, accumulation, graphs

    def end_of_epoch(epoch: int) -> None:                 # autotune train runs it between epochs; a trial never
        ctx.report_metric(evaluate(ctx, model, test_set))  # the progress line shows the best so far
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch}, "checkpoint.pt")

    ctx.on_epoch_end(end_of_epoch)
    for images, labels in ctx.batches(loader):            # on ctx.device; a trial's budget, or the real run
        step(images, labels)                              # loss_fn(model(images), labels), backward, step
    ctx.report_metric(evaluate(ctx, model, test_set))     # accuracy (or a loss, see --metric-direction)


if __name__ == "__main__":
    result = autotune.run(train, n_trials=30)
    print(result.best_config, result.speedup)
