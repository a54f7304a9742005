"""Tiny workloads shared by the tests.

Trials import these by ``path.py:func`` (see ``WORKLOADS``), so every workload is a module-level
function taking a ``TrialContext``. They are small enough to run in well under a second on a CPU.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

WORKLOADS = str(Path(__file__).resolve())
PIDFILE_ENV = "AUTOTUNE_TEST_PIDFILE"
FEATURES = 16
CLASSES = 4


def dataset(n: int = 1024, *, seed: int = 0) -> torch.utils.data.TensorDataset:
    """A linearly separable classification task: the label is the argmax of a fixed projection."""
    gen = torch.Generator().manual_seed(1234)
    projection = torch.randn(FEATURES, CLASSES, generator=gen)
    gen.manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=gen)
    y = (x @ projection).argmax(dim=1)
    return torch.utils.data.TensorDataset(x, y)


class PlainSGD:
    """Plain SGD for the isolated-trial workloads.

    ``torch.optim`` imports ``torch._dynamo`` when an optimizer is built, which costs about 2 s in
    every fresh trial process on this machine; the tests run dozens of trials, so the tiny workloads
    use this instead. The in-process knob tests use ``torch.optim.SGD``.
    """

    def __init__(self, params, lr: float) -> None:
        self.params = list(params)
        self.lr = lr

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for p in self.params:
            if p.grad is not None:
                p.add_(p.grad, alpha=-self.lr)


def tiny_model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, CLASSES))


@torch.no_grad()
def accuracy(ctx, model: nn.Module, data: torch.utils.data.TensorDataset) -> float:
    x, y = data.tensors
    with ctx.autocast():
        pred = model(ctx.to_device(x)).argmax(dim=1)
    return (pred.cpu() == y).float().mean().item()


def train_tiny(ctx) -> None:
    """The standard tiny workload: a small MLP through ctx.loader / ctx.batches / ctx.train_step."""
    torch.manual_seed(ctx.seed)
    model = ctx.model(tiny_model())
    optimizer = ctx.optimizer(PlainSGD, model.parameters(), lr=0.1 * ctx.lr_scale)
    step = ctx.train_step(model, optimizer, nn.CrossEntropyLoss())
    for inputs, targets in ctx.batches(ctx.loader(dataset(seed=ctx.seed))):
        step(inputs, targets)
    ctx.report_metric(accuracy(ctx, model, dataset(256, seed=10_000)))


def train_plain_script(ctx) -> None:
    """A plain script adapted: it keeps its own batch size (256) and sets a cosine schedule from the context."""
    torch.manual_seed(ctx.seed)
    model = ctx.model(tiny_model())
    optimizer = ctx.optimizer(torch.optim.SGD, model.parameters(), lr=0.1 * ctx.lr_scale)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=ctx.optimizer_steps)
    step = ctx.train_step(model, optimizer, nn.CrossEntropyLoss(), scheduler=scheduler)
    for inputs, targets in ctx.batches(ctx.loader(dataset(2048, seed=ctx.seed), batch_size=256)):
        step(inputs, targets)
    ctx.record("schedule", {"stepped": scheduler.last_epoch, "optimizer_steps": ctx.optimizer_steps,
                            "micro_steps": ctx.micro_steps, "warmup_steps": ctx.warmup_steps,
                            "last_lr": optimizer.param_groups[0]["lr"], "batch_size": ctx.config.batch_size})
    ctx.report_metric(accuracy(ctx, model, dataset(256, seed=10_000)))



def own_dataloader_run(ctx, samples: int, batch: int):
    """Trains through the script's own DataLoader (one persistent worker) handed to ctx.loader; the model and
    the loader it trained with."""
    torch.manual_seed(ctx.seed)
    model = ctx.model(tiny_model())
    optimizer = ctx.optimizer(torch.optim.SGD, model.parameters(), lr=0.1 * ctx.lr_scale)
    own = torch.utils.data.DataLoader(dataset(samples, seed=ctx.seed), batch_size=batch, shuffle=True,
                                      num_workers=1, persistent_workers=True)
    loader = ctx.loader(own)
    step = ctx.train_step(model, optimizer, nn.CrossEntropyLoss())
    for inputs, targets in ctx.batches(loader):
        step(inputs, targets)
    return model, loader


def train_own_dataloader(ctx) -> None:
    """A script that passes its own DataLoader (batch 256, one persistent worker) to ctx.loader."""
    model, _ = own_dataloader_run(ctx, 2048, 256)
    ctx.report_metric(accuracy(ctx, model, dataset(256, seed=10_000)))


def train_oom_at_256(ctx) -> None:
    """Like train_tiny, but batch 256 and up fail the way a too-large batch fails on a GPU."""
    if ctx.config.batch_size >= 256:
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate batch {ctx.config.batch_size}")
    train_tiny(ctx)


def raise_value_error(ctx) -> None:
    raise ValueError("the workload is broken\nsecond line of the message")


def raise_torch_oom(ctx) -> None:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")


def raise_cuda_oom_runtime(ctx) -> None:
    raise RuntimeError("CUDA error: out of memory")


def raise_cudnn_not_supported(ctx) -> None:
    raise RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input.")


def abort(ctx) -> None:
    os.abort()


def _spawn_sleeper() -> subprocess.Popen:
    """A grandchild process (of the trial) that would outlive its parent; its pid goes to the pidfile."""
    sleeper = subprocess.Popen(["sleep", "1000"])
    Path(os.environ[PIDFILE_ENV]).write_text(str(sleeper.pid))
    return sleeper


def hang_with_grandchild(ctx) -> None:
    """A step that never ends, with a grandchild process that must not survive the timeout."""
    _spawn_sleeper()
    time.sleep(1000)


def leave_grandchild(ctx) -> None:
    """A trial that succeeds but leaves a process behind."""
    _spawn_sleeper()
    train_tiny(ctx)


def compile_with_grandchild(ctx) -> None:
    """train_tiny (a real torch.compile when the config compiles) with a grandchild that must not survive."""
    _spawn_sleeper()
    train_tiny(ctx)


def compile_in_own_loop(ctx) -> None:
    """A hand-written loop (no ctx.batches) around a model that ctx.model compiles; windows by hand."""
    model = ctx.model(tiny_model())
    optimizer = PlainSGD(model.parameters(), lr=0.1)
    x, y = dataset(ctx.config.batch_size).tensors
    for _ in range(4):
        start = time.perf_counter()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        ctx.record_window(len(x), time.perf_counter() - start)


def nan_loss(ctx) -> None:
    """A workload whose loss is NaN from the first step."""
    model = ctx.model(tiny_model())
    optimizer = ctx.optimizer(PlainSGD, model.parameters(), lr=0.1)

    def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(outputs, targets) * float("nan")

    step = ctx.train_step(model, optimizer, loss_fn)
    for inputs, targets in ctx.batches(ctx.loader(dataset())):
        step(inputs, targets)


def huge_allocation(ctx) -> None:
    """Allocate 4 GiB, far beyond the tests' memory limit (never touched, so it is cheap without one)."""
    scratch = torch.empty(4 * 2**30, dtype=torch.uint8)
    del scratch
    train_tiny(ctx)


def no_window(ctx) -> None:
    """Returns without iterating ctx.batches or reporting a window: nothing was measured."""


def _manual_windows(ctx) -> None:
    """Three hand-timed windows; more loader workers report a higher throughput (1000 x (1 + workers)/s)."""
    seconds = 1.0 / (1 + ctx.config.num_workers)
    for _ in range(3):
        ctx.record_window(1000, seconds, steps=10, data_wait_seconds=0.1 * seconds)


def faster_but_less_accurate(ctx) -> None:
    """Deterministic numbers through the manual reporting path.

    Each loader worker doubles the throughput and costs 0.02 of accuracy; the seed moves the metric
    by 0.005, so two fp32 reference runs (seeds 0 and 1) give a noise band of 0.005.
    """
    _manual_windows(ctx)
    ctx.report_metric(0.9 - 0.02 * ctx.config.num_workers - 0.005 * ctx.seed)


def faster_but_higher_loss(ctx) -> None:
    """The same as faster_but_less_accurate for a metric that is minimised (a validation loss)."""
    _manual_windows(ctx)
    ctx.report_metric(0.1 + 0.02 * ctx.config.num_workers + 0.005 * ctx.seed)


def loader_start(ctx) -> None:
    """Time the first batch of ctx.loader (its worker start-up) and report it with ctx.record."""
    start = time.perf_counter()
    next(iter(ctx.loader(dataset(256))))
    ctx.record("first_batch_seconds", time.perf_counter() - start)
    _manual_windows(ctx)


def accuracy_by_batch(ctx) -> None:
    """A metric that falls with the batch size (fewer optimizer steps over the same samples) and with
    channels_last (standing in for a knob that really costs accuracy), through the manual path."""
    _manual_windows(ctx)
    ctx.report_metric(0.9 - ctx.config.batch_size / 1000 - (0.05 if ctx.config.channels_last else 0.0))


def accuracy_noisy_at_64(ctx) -> None:
    """At batch 64 the metric moves 0.03 from seed 0 to seed 1 (a short large-batch run is noisy);
    channels_last loses 0.02."""
    _manual_windows(ctx)
    noise = 0.03 * ctx.seed if ctx.config.batch_size == 64 else 0.0
    ctx.report_metric(0.9 - ctx.config.batch_size / 1000 - (0.02 if ctx.config.channels_last else 0.0) - noise)


def accuracy_by_batch_fp32_never_fits_64(ctx) -> None:
    """accuracy_by_batch, but fp32 at a global batch of 64 runs out of memory at any micro-batch."""
    if ctx.config.precision == "fp32" and ctx.config.global_batch_size >= 64:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate an fp32 global batch of 64")
    accuracy_by_batch(ctx)


def accuracy_by_batch_fp32_oom_at_64(ctx) -> None:
    """accuracy_by_batch, but fp32 at batch 64 runs out of memory where bf16 fits."""
    if ctx.config.precision == "fp32" and ctx.config.batch_size >= 64:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate an fp32 batch of 64")
    accuracy_by_batch(ctx)


def train_slow_first_window(ctx) -> None:
    """train_tiny whose first timed window always starts slow (a stall at the first step after the warm-up),
    in every config alike: pruning on it must compare it with other first windows, not with medians."""
    torch.manual_seed(ctx.seed)
    model = ctx.model(tiny_model())
    optimizer = ctx.optimizer(PlainSGD, model.parameters(), lr=0.1 * ctx.lr_scale)
    step = ctx.train_step(model, optimizer, nn.CrossEntropyLoss())
    for index, (inputs, targets) in enumerate(ctx.batches(ctx.loader(dataset(seed=ctx.seed)))):
        if index == ctx.budget.warmup_steps:
            time.sleep(0.5)
        step(inputs, targets)
    ctx.report_metric(accuracy(ctx, model, dataset(256, seed=10_000)))


def leave_thread(ctx) -> None:
    """train_tiny with a non-daemon thread left running (a logger, a prefetcher): the process would wait
    for it at exit. The trial process's pid goes to the pidfile."""
    import threading

    Path(os.environ[PIDFILE_ENV]).write_text(str(os.getpid()))
    threading.Thread(target=time.sleep, args=(1000,)).start()
    train_tiny(ctx)


def leave_process(ctx) -> None:
    """train_tiny with a non-daemon multiprocessing.Process left running (its pid goes to the pidfile):
    multiprocessing joins it when the trial process exits."""
    import multiprocessing

    child = multiprocessing.Process(target=time.sleep, args=(1000,))
    child.start()
    Path(os.environ[PIDFILE_ENV]).write_text(str(child.pid))
    train_tiny(ctx)


def exit_hangs(ctx) -> None:
    """train_tiny, then a process that does not end after it wrote its result (as a teardown stuck in a
    driver would): ``os._exit`` is made to write the pidfile and sleep."""
    def stuck(code: int) -> None:
        Path(os.environ[PIDFILE_ENV]).write_text(str(os.getpid()))
        time.sleep(1000)

    os._exit = stuck  # this trial process only: each trial is a fresh fork
    train_tiny(ctx)


def raise_control_sequences(ctx) -> None:
    """An exception whose text holds terminal control sequences (blink, a window title), as a library's may."""
    raise ValueError("\x1b[5mblink\x1b]0;retitled\x07 and the rest")


class PerSampleDataset(torch.utils.data.Dataset):
    """A map-style dataset that builds each sample in Python, one ``__getitem__`` at a time, as many
    hand-written datasets do: the DataLoader pays that per sample, ``loader=device`` once."""

    def __init__(self, n: int = 4096) -> None:
        data = dataset(n)
        self.x, self.y = data.tensors[0].tolist(), data.tensors[1].tolist()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"inputs": torch.tensor(self.x[index]), "targets": torch.tensor(self.y[index])}


def train_per_sample(ctx) -> None:
    """A trivial model fed by a per-sample Python dataset: the step waits on the loader."""
    _train_linear(ctx, PerSampleDataset())


def _train_linear(ctx, data: torch.utils.data.Dataset) -> None:
    torch.manual_seed(ctx.seed)
    model = ctx.model(nn.Linear(FEATURES, CLASSES))
    optimizer = ctx.optimizer(PlainSGD, model.parameters(), lr=0.1)
    step = ctx.train_step(model, optimizer, nn.CrossEntropyLoss())
    for batch in ctx.batches(ctx.loader(data)):
        step(batch["inputs"], batch["targets"])
    ctx.report_metric(accuracy(ctx, model, dataset(256, seed=10_000)))


class AugmentedDataset(PerSampleDataset):
    """``PerSampleDataset`` with random noise added at every fetch, as a random augmentation does."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        item = super().__getitem__(index)
        return {**item, "inputs": item["inputs"] + 0.01 * torch.randn(FEATURES)}


def train_augmented(ctx) -> None:
    """``train_per_sample`` on ``AugmentedDataset``: loader=device must refuse it."""
    _train_linear(ctx, AugmentedDataset(1024))


class SlowItems(torch.utils.data.Dataset):
    """``dataset()``'s samples, each fetched after a short wait (as from storage): an input pipeline slower
    than the tiny model's step, which DataLoader workers speed up even on busy cores."""

    def __init__(self, n: int = 2048, *, seed: int = 0, seconds: float = 0.0004) -> None:
        self.data = dataset(n, seed=seed)
        self.seconds = seconds

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        time.sleep(self.seconds)
        return self.data[index]


def train_input_bound(ctx) -> None:
    """train_tiny over ``SlowItems``; every forward pass of the model is counted in ``forward_calls``."""
    torch.manual_seed(ctx.seed)
    model = ctx.model(tiny_model())
    calls = [0]

    def count(*_):
        calls[0] += 1
        ctx.record("forward_calls", calls[0])

    model.register_forward_hook(count)
    optimizer = ctx.optimizer(PlainSGD, model.parameters(), lr=0.1 * ctx.lr_scale)
    step = ctx.train_step(model, optimizer, nn.CrossEntropyLoss())
    for inputs, targets in ctx.batches(ctx.loader(SlowItems(seed=ctx.seed))):
        step(inputs, targets)
    ctx.report_metric(accuracy(ctx, model, dataset(256, seed=10_000)))


def train_slow_items(ctx) -> None:
    """``train_input_bound`` over 65,536 items that take 10 ms each: filling device memory with all of them
    (``loader: device``) takes over 40 s even with 16 workers, where a DataLoader's first batches come in a
    fraction of a second."""
    _train_tiny_on(ctx, SlowItems(65536, seed=ctx.seed, seconds=0.01))


def _train_tiny_on(ctx, data: torch.utils.data.Dataset, before_step: Optional[Callable[[], None]] = None) -> None:
    """The tiny model trained on ``data`` through ctx.loader, ``before_step`` called ahead of each step."""
    torch.manual_seed(ctx.seed)
    model = ctx.model(tiny_model())
    optimizer = ctx.optimizer(PlainSGD, model.parameters(), lr=0.1 * ctx.lr_scale)
    step = ctx.train_step(model, optimizer, nn.CrossEntropyLoss())
    for inputs, targets in ctx.batches(ctx.loader(data)):
        if before_step is not None:
            before_step()
        step(inputs, targets)


class HangsWithoutWorkers(SlowItems):
    """``SlowItems`` whose items never come in the main process: a loader without workers hangs, as a
    dataset reading from a stalled mount would, while one with workers is served."""

    def __getitem__(self, index: int):
        if torch.utils.data.get_worker_info() is None:
            time.sleep(3600)
        return super().__getitem__(index)


def train_hangs_without_workers(ctx) -> None:
    """The tiny model over ``HangsWithoutWorkers``."""
    _train_tiny_on(ctx, HangsWithoutWorkers(seed=ctx.seed))


def train_step_probe_fails(ctx) -> None:
    """The tiny model over ``SlowItems``, whose step fails in a step probe (and only there): what a probe that measures
    nothing leaves the prediction."""

    def refuse_in_a_step_probe() -> None:
        if ctx.probe == "step":
            raise RuntimeError("the step cannot run in a probe")

    _train_tiny_on(ctx, SlowItems(seed=ctx.seed), refuse_in_a_step_probe)


class IterableItems(torch.utils.data.IterableDataset):
    """``PerSampleDataset``'s samples as a stream: no indices, so ``loader=device`` must refuse it."""

    def __init__(self, n: int = 1024) -> None:
        self.items = PerSampleDataset(n)

    def __iter__(self):
        return (self.items[i] for i in range(len(self.items)))


def train_iterable(ctx) -> None:
    """``train_per_sample`` on ``IterableItems`` (not shuffled: a stream has no indices to shuffle)."""
    torch.manual_seed(ctx.seed)
    model = ctx.model(nn.Linear(FEATURES, CLASSES))
    optimizer = ctx.optimizer(PlainSGD, model.parameters(), lr=0.1)
    step = ctx.train_step(model, optimizer, nn.CrossEntropyLoss())
    for batch in ctx.batches(ctx.loader(IterableItems(), shuffle=False)):
        step(batch["inputs"], batch["targets"])
    ctx.report_metric(accuracy(ctx, model, dataset(256, seed=10_000)))


def train_stored_items(ctx) -> None:
    """The linear model over ``SlowItems`` (each item read as from storage, deterministic): the step waits on
    the DataLoader, and ``loader=device`` reads each item once."""
    torch.manual_seed(ctx.seed)
    model = ctx.model(nn.Linear(FEATURES, CLASSES))
    optimizer = ctx.optimizer(PlainSGD, model.parameters(), lr=0.1)
    step = ctx.train_step(model, optimizer, nn.CrossEntropyLoss())
    for inputs, targets in ctx.batches(ctx.loader(SlowItems(1024, seed=ctx.seed))):
        step(inputs, targets)
    ctx.report_metric(accuracy(ctx, model, dataset(256, seed=10_000)))


BATCH_COST_SECONDS = 0.02  # what collating one batch costs, whatever its size (a per-batch round trip)


def _collate_at_a_cost(items):
    time.sleep(BATCH_COST_SECONDS)
    return torch.utils.data.default_collate(items)


def train_batch_cost(ctx) -> None:
    """The linear model fed by a loader whose cost is per batch: its rate grows with the batch."""
    torch.manual_seed(ctx.seed)
    model = ctx.model(nn.Linear(FEATURES, CLASSES))
    optimizer = ctx.optimizer(PlainSGD, model.parameters(), lr=0.1)
    step = ctx.train_step(model, optimizer, nn.CrossEntropyLoss())
    for inputs, targets in ctx.batches(ctx.loader(dataset(2048, seed=ctx.seed), collate_fn=_collate_at_a_cost)):
        step(inputs, targets)
    ctx.report_metric(accuracy(ctx, model, dataset(256, seed=10_000)))
