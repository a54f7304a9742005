"""Gradient accumulation under CUDA Graphs on a GPU: is the arithmetic right, and what does it cost?

    python -m benchmarks.runners.accumulation_check OUT.md

1. Correctness: an MLP (no BatchNorm) trained 6 global batches of 64 through ``ctx.train_step`` with SGD,
   eager without accumulation against every combination of accumulation (1, 4) and CUDA Graphs (off,
   on), at fp32 (TF32 off, so the arithmetic can be compared closely), bf16 and fp16 (GradScaler, fused
   SGD). The largest parameter difference after training is reported against eager at the same precision
   and accumulation, and against eager fp32 without accumulation.
2. Cost: ResNet-50 bf16 channels_last at a global batch of 512, as one micro-batch and as 4 micro-batches
   of 128, each eager and with CUDA Graphs (the two-graph capture), in img/s: median of 5 windows.
"""

from __future__ import annotations

import copy
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch
import torchvision
from torch import nn

from autotune._config import TrialConfig
from autotune.trial._context import TrialContext
from autotune.trial._knobs import applied


def _train_mlp(config: TrialConfig, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
               steps: int) -> tuple[nn.Module, int]:
    model = copy.deepcopy(model)
    with applied(config):
        ctx = TrialContext(config=config, device=torch.device("cuda"))
        optimizer = ctx.optimizer(torch.optim.SGD, model.parameters(), lr=0.05, momentum=0.9)
        step = ctx.train_step(model, optimizer, nn.CrossEntropyLoss())
        for s in range(steps):
            for start in range(0, 64, config.batch_size):
                rows = slice(s * 64 + start, s * 64 + start + config.batch_size)
                step(x[rows], y[rows])
        torch.cuda.synchronize()
    return model, step.graph_replays


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def correctness() -> list[str]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 10)).cuda()
    steps = 6
    x, y = torch.randn(64 * steps, 32, device="cuda"), torch.randint(0, 10, (64 * steps,), device="cuda")
    rows = ["| precision | accumulation | CUDA Graphs | max param diff vs eager (same precision, accumulation) | "
            "vs eager fp32 without accumulation | graph replays |", "|---|---:|---|---:|---:|---:|"]
    reference, _ = _train_mlp(TrialConfig(batch_size=64), model, x, y, steps)
    for precision in ("fp32", "bf16", "fp16"):
        for accumulation in (1, 4):
            base = TrialConfig(precision=precision, batch_size=64 // accumulation, global_batch=64)
            eager, _ = _train_mlp(base, model, x, y, steps)
            graphed, replays = _train_mlp(base.replace(cuda_graphs=True), model, x, y, steps)
            rows.append(f"| {precision} | {accumulation} | on | {_max_diff(graphed, eager):.2e} | "
                        f"{_max_diff(graphed, reference):.2e} | {replays} |")
    return rows


def _rate(config: TrialConfig, windows: int = 5, steps_per_window: int = 8) -> float:
    torch.manual_seed(0)
    with applied(config):
        ctx = TrialContext(config=config, device=torch.device("cuda"))
        model = ctx.model(torchvision.models.resnet50())
        optimizer = ctx.optimizer(torch.optim.SGD, model.parameters(), lr=0.02, momentum=0.9)
        step = ctx.train_step(model, optimizer, nn.CrossEntropyLoss())
        images = torch.randn(config.batch_size, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
        labels = torch.randint(0, 1000, (config.batch_size,), device="cuda")
        calls = steps_per_window * config.accumulation_steps
        for _ in range(2 * calls):  # warm-up, capture
            step(images, labels)
        rates = []
        for _ in range(windows):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                step(images, labels)
            torch.cuda.synchronize()
            rates.append(calls * config.batch_size / (time.perf_counter() - start))
    return statistics.median(rates), (max(rates) - min(rates)) / statistics.median(rates)


def cost() -> list[str]:
    rows = ["| micro-batch x accumulation | CUDA Graphs | img/s (median of 5) | window spread |", "|---|---|---:|---:|"]
    for micro in (512, 128):
        for graphs in (False, True):
            config = TrialConfig(precision="bf16", batch_size=micro, global_batch=512, channels_last=True,
                                 cudnn_benchmark=True, cuda_graphs=graphs)
            rate, spread = _rate(config)
            rows.append(f"| {micro}x{512 // micro} | {'on' if graphs else 'off'} | {rate:,.0f} | {spread:.1%} |")
            print(rows[-1], flush=True)
    return rows


def main(out: Path) -> None:
    text = "\n".join([
        f"Date {datetime.date.today()}; {torch.cuda.get_device_name()}; torch {torch.__version__}.",
        "",
        "Correctness (MLP, SGD momentum, 6 global batches of 64):",
        "",
        *correctness(),
        "",
        "Cost (ResNet-50 bf16 channels_last, global batch 512):",
        "",
        *cost(),
        "",
    ])
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
