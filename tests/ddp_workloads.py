"""Tiny DDP workloads for the multi-rank trial tests: every rank runs the function, rank 0 reports.

They use ``workloads.PlainSGD`` (no torch.optim import per rank) and a model of a few thousand parameters,
so a two-rank trial on gloo trains in about a second.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from workloads import FEATURES, CLASSES, PlainSGD, dataset

DDP_WORKLOADS = str(Path(__file__).resolve())
PIDDIR_ENV = "AUTOTUNE_TEST_PIDDIR"


def _model() -> nn.Module:
    # Two layers of different sizes, so a small bucket cap splits the gradients into several buckets.
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, CLASSES))


def _grads_agree(model: nn.Module) -> bool:
    """Whether every rank holds the same gradient of the first layer."""
    grad = next(model.parameters()).grad.detach().reshape(-1)
    everyone = [torch.zeros_like(grad) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, grad)
    return all(torch.equal(everyone[0], other) for other in everyone[1:])


def train_ddp(ctx) -> None:
    """Train with ctx.ddp; record what the DDP object says and whether no_sync kept the gradients local."""
    torch.manual_seed(ctx.seed)
    model = ctx.ddp(ctx.model(_model()))
    opt = PlainSGD(model.parameters(), lr=0.05)
    step = ctx.train_step(model, opt, nn.CrossEntropyLoss())
    accumulation = ctx.config.accumulation_steps
    agree = []
    for i, (x, y) in enumerate(ctx.batches(ctx.loader(dataset(2048)))):
        step(x, y)
        if i < accumulation and ctx.world_size > 1:  # the first global batch, in the warm-up
            agree.append(_grads_agree(model))
    if ctx.world_size > 1:
        hooks = getattr(model, "_comm_hooks", None) or []
        ctx.record("test.agree_per_micro_step", agree)
        ctx.record("test.bucket_bytes_cap", model.bucket_bytes_cap)
        ctx.record("test.gradient_as_bucket_view", model.gradient_as_bucket_view)
        ctx.record("test.static_graph", model.static_graph)
        ctx.record("test.comm_hook", [getattr(h, "compression", "") for h, _ in hooks])
        ctx.record("test.is_ddp", isinstance(model, nn.parallel.DistributedDataParallel))
        ctx.record("test.rank_batches", len(ctx.loader(dataset(2048)).sampler))
    ctx.record("test.world_size", ctx.world_size)
    ctx.report_metric(0.5)


def fail_on_rank_1(ctx) -> None:
    """Rank 1 raises after its first steps; rank 0 then waits on it in the next all-reduce."""
    model = ctx.ddp(ctx.model(_model()))
    opt = PlainSGD(model.parameters(), lr=0.05)
    step = ctx.train_step(model, opt, nn.CrossEntropyLoss())
    for i, (x, y) in enumerate(ctx.batches(ctx.loader(dataset(2048)))):
        step(x, y)
        if i == 2 and ctx.rank == 1:
            raise ValueError("rank one broke on purpose")


def hang_every_rank(ctx) -> None:
    """Each rank leaves a grandchild and its own pid, then hangs: a timeout must end them all."""
    folder = Path(os.environ[PIDDIR_ENV])
    sleeper = subprocess.Popen(["sleep", "1000"])
    (folder / f"rank{ctx.rank}.pids").write_text(f"{os.getpid()} {sleeper.pid}")
    time.sleep(1000)


def fail_on_rank_1_then_linger(ctx) -> None:
    """Rank 1 fails, then outlives the peer its failure brings down: it closes its process group a second
    later (rank 0's all-reduce then fails too) and keeps exiting for three more seconds."""
    import threading

    def close_late() -> None:
        time.sleep(1.0)
        dist.destroy_process_group()
        time.sleep(3.0)

    if ctx.rank == 1:
        threading.Thread(target=close_late).start()  # not a daemon: the process waits for it at exit
    fail_on_rank_1(ctx)


def train_ddp_teardown_hangs(ctx) -> None:
    """``train_ddp`` on a torch whose process group teardown never returns on rank 1 (as torch 2.13.0's CPU
    build can, in ``~ProcessGroupGloo`` joining its threads): the trial's result must not wait for it."""
    if ctx.rank == 1:
        dist.destroy_process_group = lambda *args, **kwargs: time.sleep(1000)
    train_ddp(ctx)
