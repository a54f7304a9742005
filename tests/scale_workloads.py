"""Workloads for the scale-out and reliability tests: a tiny linear model, with ways to stall."""

import os
import time

import torch
from torch import nn

# The search space these workloads are tuned over in the tests (the `space` fixture).
SPACE = """
knobs:
  batch_size: [8, 16, 24, 32, 40, 48]
  num_workers: [0]
batch_policy: scale  # the batch knob is the global batch here
baseline: {batch_size: 16}
budget: {samples: 512, warmup_steps: 1, windows: 3}
"""
SLOW_BATCH = 48  # the config that stalls in `train_stalls`, so a test can kill its worker mid-trial


def _data(seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 8, generator=gen)
    y = (x.sum(dim=1) > 0).long()
    return torch.utils.data.TensorDataset(x, y)


def train(ctx) -> None:
    torch.manual_seed(ctx.seed)
    model = ctx.model(nn.Linear(8, 2))
    params = list(model.parameters())
    step_fn = nn.CrossEntropyLoss()
    for x, y in ctx.batches(ctx.loader(_data(ctx.seed))):
        loss = step_fn(model(x), y)
        loss.backward()
        with torch.no_grad():
            for p in params:
                p -= 0.1 * p.grad
                p.grad = None
    with torch.no_grad():
        x, y = _data(99).tensors
        ctx.report_metric((model(x).argmax(1) == y).float().mean().item())


def train_takes_seconds(ctx) -> None:
    """train, 3 s slower: long enough that a worker still starting its trial server gets a share."""
    time.sleep(3.0)
    train(ctx)


def train_stalls(ctx) -> None:
    if ctx.config.batch_size == SLOW_BATCH and os.environ.get("AUTOTUNE_TEST_STALL"):
        with open(os.environ["AUTOTUNE_TEST_STALL"], "a") as fh:
            fh.write(f"{os.getpid()}\n")
        time.sleep(3600)
    train(ctx)


def train_stalls_once(ctx) -> None:
    """Stalls in the first non-baseline trial only (a marker file remembers), so a test can kill the tuner."""
    marker = os.environ.get("AUTOTUNE_TEST_STALL_ONCE")
    if marker and ctx.config.batch_size != 16 and not os.path.exists(marker):
        with open(marker, "w") as fh:
            fh.write(f"{os.getpid()}\n")
        time.sleep(3600)
    train(ctx)


def returns_text(ctx) -> str:
    train(ctx)
    return "done"


def segfault(ctx) -> None:
    import ctypes

    ctypes.string_at(0)


class _HangingDataset(torch.utils.data.Dataset):
    """Each DataLoader worker writes its pid, then never returns an item."""

    def __len__(self) -> int:
        return 1024

    def __getitem__(self, i: int):
        with open(os.environ["AUTOTUNE_TEST_WORKER_PIDS"], "a") as fh:
            fh.write(f"{os.getpid()}\n")
        time.sleep(3600)


def loader_worker_hangs(ctx) -> None:
    for _ in ctx.batches(ctx.loader(_HangingDataset())):
        pass


def train_records_env(ctx) -> None:
    ctx.record("mark", os.environ.get("AUTOTUNE_TEST_MARK"))
    train(ctx)


def train_metric_at_baseline_only(ctx) -> None:
    """Reports its metric only at the baseline's batch (16): a code path that skips ctx.report_metric."""
    if ctx.config.batch_size == 16:
        train(ctx)
        return
    torch.manual_seed(ctx.seed)
    model = ctx.model(nn.Linear(8, 2))
    for x, y in ctx.batches(ctx.loader(_data(ctx.seed))):
        nn.CrossEntropyLoss()(model(x), y).backward()


def train_pauses_once(ctx) -> None:
    """The first non-baseline trial writes its pid to a marker file and takes 8 s, so a test can pause its worker."""
    marker = os.environ.get("AUTOTUNE_TEST_PAUSE_ONCE")
    if marker and ctx.config.batch_size != 16 and not os.path.exists(marker):
        with open(marker, "w") as fh:
            fh.write(f"{os.getpid()}\n")
        time.sleep(8.0)
    train(ctx)


def train_loses_its_folder(ctx) -> None:
    """The first non-baseline trial (every one, when AUTOTUNE_TEST_RMTREE_ONCE is "always") deletes the
    study's log folder under itself (a clean-up gone wrong)."""
    import shutil

    marker = os.environ.get("AUTOTUNE_TEST_RMTREE_ONCE")
    train(ctx)
    if marker and ctx.config.batch_size != 16 and not os.path.exists(marker):
        if marker != "always":
            open(marker, "w").close()
        shutil.rmtree(os.environ["AUTOTUNE_TEST_RMTREE"], ignore_errors=True)


def kills_its_trial_server(ctx) -> None:
    """Kills the process that forked it (the forkserver), as an OOM killer or an operator might."""
    import signal

    os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(5)
    train(ctx)


def records_an_object(ctx) -> None:
    train(ctx)
    ctx.record("k", object())


def starts_threads(ctx) -> None:
    """Starts a thread as a DataLoader or a profiler would; under a tight address-space limit it cannot."""
    import threading

    threads = [threading.Thread(target=time.sleep, args=(0.1,)) for _ in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    train(ctx)


def train_counts_runs(ctx) -> None:
    """train, first appending "batch seed" to the file AUTOTUNE_TEST_RUNS: a test counts the runs of a config."""
    with open(os.environ["AUTOTUNE_TEST_RUNS"], "a") as fh:
        fh.write(f"{ctx.config.batch_size} {ctx.seed}\n")
    train(ctx)


def train_finishes_then_lingers(ctx) -> None:
    """Once (a marker file remembers), in a non-baseline trial: finish, then keep the process alive in its
    exit (as a teardown stuck in a driver would), so the trial has written its result when a test interrupts
    the tuner. The launcher gives such a process RESULT_GRACE_SECONDS before it kills it."""
    train(ctx)
    marker = os.environ.get("AUTOTUNE_TEST_LINGER_ONCE")
    if marker and ctx.config.batch_size != 16 and not os.path.exists(marker):
        def linger(code: int) -> None:  # the trial process's exit, after it wrote its result
            with open(marker, "w") as fh:
                fh.write(f"{os.getpid()}\n")
            time.sleep(3600)

        os._exit = linger  # this trial process only: each trial is a fresh fork


def train_leaves_a_thread(ctx) -> None:
    """train, with a non-daemon thread left running (a logger or prefetcher that is never stopped)."""
    import threading

    threading.Thread(target=time.sleep, args=(1000,)).start()
    train(ctx)


def train_leaves_a_process(ctx) -> None:
    """train, with a non-daemon multiprocessing.Process left running (its pid appended to AUTOTUNE_TEST_LEFT)."""
    import multiprocessing

    child = multiprocessing.Process(target=time.sleep, args=(1000,))
    child.start()
    with open(os.environ["AUTOTUNE_TEST_LEFT"], "a") as fh:
        fh.write(f"{child.pid}\n")
    train(ctx)
