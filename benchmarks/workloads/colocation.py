"""Small models that leave a big GPU mostly idle, for co-located trials (``processes_per_gpu``).

- ``train_lm``: a tiny GPT-style transformer LM (2 layers, d_model 128, 4 heads, 64 tokens, vocabulary
  1,024) on synthetic streams it can learn: each next token is the current token's successor under a fixed
  random map 90% of the time, a random token otherwise.
- ``train_cnn``: a small CNN (3 conv blocks) on CIFAR-sized synthetic images (3 x 32 x 32, 10 classes)
  whose class is a fixed pattern plus noise.

The data is made on the device before the loop, so the GPU's speed is what the trials measure; each copy
of a trial draws its own data from its seed. ``AUTOTUNE_BENCH_SIZE=tiny`` shrinks both, to check a runner on
a CPU.
"""

import os

import torch
from torch import nn
from torch.nn import functional as F

from benchmarks.tables.sweep import GPT, GPTShape

TINY = os.environ.get("AUTOTUNE_BENCH_SIZE") == "tiny"
LM_SHAPE = GPTShape(layers=1, d_model=32, heads=2, seq=16, vocab=128) if TINY else \
    GPTShape(layers=2, d_model=128, heads=4, seq=64, vocab=1024)
FOLLOW = 0.9
POOL = 256 if TINY else 4096  # samples made on the device; the loop cycles through them
IMAGE = 8 if TINY else 32
CLASSES = 10


class _Pool:
    """Micro-batches sliced in order from tensors already on the device."""

    def __init__(self, tensors: tuple[torch.Tensor, ...], batch_size: int) -> None:
        self.tensors, self.batch_size = tensors, batch_size

    def __iter__(self):
        n = len(self.tensors[0])
        for start in range(0, n - self.batch_size + 1, self.batch_size):
            yield tuple(t[start:start + self.batch_size] for t in self.tensors)


def _streams(n: int, *, seed: int, device: torch.device) -> torch.Tensor:
    fixed = torch.Generator().manual_seed(1234)
    successor = torch.randperm(LM_SHAPE.vocab, generator=fixed)
    gen = torch.Generator().manual_seed(seed)
    length = LM_SHAPE.seq + 1
    index = torch.empty(n, length, dtype=torch.long)
    index[:, 0] = torch.randint(0, LM_SHAPE.vocab, (n,), generator=gen)
    jumps = torch.rand(n, length, generator=gen) > FOLLOW
    random_next = torch.randint(0, LM_SHAPE.vocab, (n, length), generator=gen)
    for t in range(1, length):
        index[:, t] = torch.where(jumps[:, t], random_next[:, t], successor[index[:, t - 1]])
    return index.to(device)


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def train_lm(ctx) -> None:
    torch.manual_seed(ctx.seed)
    model = ctx.model(GPT(LM_SHAPE))
    optimizer = ctx.optimizer(torch.optim.AdamW, model.parameters(), lr=1e-3, weight_decay=0.01)
    step = ctx.train_step(model, optimizer, _lm_loss)
    pool = _streams(POOL, seed=ctx.seed, device=ctx.device)
    for ids, targets in ctx.batches(_Pool((pool[:, :-1], pool[:, 1:]), ctx.config.batch_size)):
        step(ids, targets)
    test = _streams(64, seed=10_000, device=ctx.device)
    model.eval()
    with torch.no_grad(), ctx.autocast():
        correct = (model(test[:, :-1]).argmax(-1) == test[:, 1:]).float().mean().item()
    ctx.record("tokens_per_sample", LM_SHAPE.seq)
    ctx.report_metric(correct)


def _images(n: int, *, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    fixed = torch.Generator().manual_seed(4321)
    patterns = torch.randn(CLASSES, 3, IMAGE, IMAGE, generator=fixed)
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, CLASSES, (n,), generator=gen)
    images = patterns[labels] + 1.5 * torch.randn(n, 3, IMAGE, IMAGE, generator=gen)
    return images.to(device), labels.to(device)


def small_cnn() -> nn.Module:
    def block(cin: int, cout: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                             nn.MaxPool2d(2))

    width = 8 if TINY else 32
    return nn.Sequential(block(3, width), block(width, 2 * width), block(2 * width, 4 * width),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, CLASSES))


def train_cnn(ctx) -> None:
    torch.manual_seed(ctx.seed)
    model = ctx.model(small_cnn())
    optimizer = ctx.optimizer(torch.optim.SGD, model.parameters(), lr=0.05, momentum=0.9)
    step = ctx.train_step(model, optimizer, nn.CrossEntropyLoss())
    images, labels = _images(POOL, seed=ctx.seed, device=ctx.device)
    if ctx.config.channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    for x, y in ctx.batches(_Pool((images, labels), ctx.config.batch_size)):
        step(x, y)
    test_x, test_y = _images(512, seed=10_000, device=ctx.device)
    model.eval()
    with torch.no_grad(), ctx.autocast():
        correct = (model(test_x).argmax(-1) == test_y).float().mean().item()
    ctx.report_metric(correct)


def train_lm_host(ctx) -> None:
    """``train_lm`` with its sequences held in host memory as a map-style Dataset read through ``ctx.loader``:
    the DataLoader's per-sample indexing and collation is then the ceiling, and ``loader: device`` lifts it."""
    torch.manual_seed(ctx.seed)
    model = ctx.model(GPT(LM_SHAPE))
    optimizer = ctx.optimizer(torch.optim.AdamW, model.parameters(), lr=1e-3, weight_decay=0.01)
    step = ctx.train_step(model, optimizer, _lm_loss)
    pool = _streams(POOL, seed=ctx.seed, device=torch.device("cpu"))
    for ids, targets in ctx.batches(ctx.loader(torch.utils.data.TensorDataset(pool[:, :-1], pool[:, 1:]))):
        step(ids, targets)
    test = _streams(64, seed=10_000, device=ctx.device)
    model.eval()
    with torch.no_grad(), ctx.autocast():
        correct = (model(test[:, :-1]).argmax(-1) == test[:, 1:]).float().mean().item()
    ctx.report_metric(correct)


class TokenLists(torch.utils.data.Dataset):
    """Sequences kept as Python lists of token ids, made into tensors item by item, as many users' Datasets are."""

    def __init__(self, pool: torch.Tensor) -> None:
        self.rows = pool.tolist()

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.rows[index]
        return torch.tensor(row[:-1]), torch.tensor(row[1:])


def train_lm_lists(ctx) -> None:
    """``train_lm_host`` with a Dataset of Python lists (``TokenLists``): each item costs two tensor builds."""
    torch.manual_seed(ctx.seed)
    model = ctx.model(GPT(LM_SHAPE))
    optimizer = ctx.optimizer(torch.optim.AdamW, model.parameters(), lr=1e-3, weight_decay=0.01)
    step = ctx.train_step(model, optimizer, _lm_loss)
    dataset = TokenLists(_streams(POOL, seed=ctx.seed, device=torch.device("cpu")))
    for ids, targets in ctx.batches(ctx.loader(dataset)):
        step(ids, targets)
