"""A family of generated replay tables with known structure, to measure search strategies on tables nobody
tuned them for.

    python -m benchmarks.tables.family [--count 50] [--first-seed 0] [--out-dir DIR]

Table ``family-<seed>`` is drawn from ``random.Random(seed)`` alone, so the family is the same on every
machine and is generated at test and benchmark time (nothing is committed but this module). Each table is
one ``synthetic.Profile`` run through the analytic model of ``synthetic.py``; what varies:

- the bottleneck mix, cycled by seed: ``input`` (a DataLoader slower than the GPU), ``launch`` (a small
  model whose eager step is kernel launches), ``compute`` (tensor-core work dominates) and ``memory`` (the
  largest batches run out of memory);
- the grid: 2-4 precisions, a ladder of 4-6 batch sizes, 2-4 compile modes, and channels_last,
  cuda_graphs, cudnn_benchmark and loader knobs (workers, pinning, prefetch, persistence) where drawn;
- the model's constants (tensor-core and memory-bound time, launches, fp16 against bf16, compiled code's
  fixed cost), the noise (0.5-3%), random failures (0-3%), the compile time (15-120 s for ``default``), and
  in 2 of 5 tables an accuracy model under which the largest batches miss the 0.01 accuracy bound.

Rules of the family, so that every table has a sensible answer: at most 4,000 configs, and a best
feasible config under ``max_accuracy_loss=0.01``.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from autotune.search._simulate import ReplayTable, _parse_row
from benchmarks.tables.synthetic import Loader, Profile, best, dumps, generate

KINDS = ("input", "launch", "compute", "memory")
BATCHES = (16, 32, 64, 128, 256, 512, 1024)
MAX_CONFIGS = 4000


def profile(seed: int) -> Profile:
    """The model of table ``family-<seed>``."""
    rng = random.Random(f"family:{seed}")
    kind = KINDS[seed % len(KINDS)]
    u = rng.uniform
    precisions = ["fp32", "tf32", "fp16", "bf16"]
    rng.shuffle(precisions)
    precisions = sorted(precisions[: rng.randint(2, 4)] + (["fp32"] if rng.random() < 0.5 else []))
    precisions = sorted(set(precisions), key=["fp32", "tf32", "fp16", "bf16"].index)
    if len(precisions) < 2:
        precisions = ["fp32", "bf16"]
    start = rng.randint(0, 2)
    batches = list(BATCHES[start: start + rng.randint(4, 6)])
    modes = ["off", "default", "max-autotune-no-cudagraphs", "max-autotune"]
    compile_modes = ["off", "default"] + [m for m in modes[2:] if rng.random() < 0.5]
    grid: dict[str, list[Any]] = {"precision": precisions, "batch_size": batches}
    vision = rng.random() < 0.6
    if vision:
        grid["channels_last"] = [False, True]
    grid["compile"] = compile_modes
    if rng.random() < 0.8 or kind == "launch":
        grid["cuda_graphs"] = [False, True]
    if vision and rng.random() < 0.5:
        grid["cudnn_benchmark"] = [False, True]
    loader: Optional[Loader] = None
    if kind == "input" or rng.random() < 0.4:
        cores = rng.choice([8, 16, 32])
        # Input-bound tables decode slowly; elsewhere the loader keeps up once it has a few workers.
        decode = u(3.0, 12.0) if kind == "input" else u(0.3, 1.5)
        loader = Loader(cores=cores, decode_ms=decode, jitter=u(0.05, 0.25), contention=u(0.05, 0.15))
        step = max(2, cores // 4)
        grid["num_workers"] = list(range(0, cores + 1, step))
        grid["pin_memory"] = [False, True]
        if rng.random() < 0.5:
            grid["prefetch_factor"] = [2, 4]
        if rng.random() < 0.5:
            grid["persistent_workers"] = [False, True]
    while _size(grid) > MAX_CONFIGS:  # trim the longest optional knob list first
        longest = max(("num_workers", "batch_size", "compile"), key=lambda k: len(grid.get(k, [])))
        grid[longest] = grid[longest][:-1] if longest != "num_workers" else grid[longest][::2]
    matmul = {"input": u(0.03, 0.3), "launch": u(0.004, 0.03), "compute": u(0.6, 2.0), "memory": u(1.0, 2.5)}[kind]
    activation = u(0.05, 0.25)
    static = u(0.3, 3.0)
    capacity = 80.0
    if kind == "memory":
        # The largest batch that fits in fp32 lies inside the ladder: low precision and compile fit more.
        edge = batches[rng.randint(1, len(batches) - 2)]
        capacity = static + activation * edge * u(0.9, 1.3)
    elif rng.random() < 0.3:
        capacity = static + activation * batches[-1] * u(0.6, 0.95)  # only the top of the ladder fails
    fp16 = u(4.2, 5.6)
    return Profile(
        description=f"family-{seed}: {kind}-bound",
        grid=grid,
        matmul_ms=matmul,
        elementwise_ms=matmul * u(0.1, 0.5),
        half_batch=u(8.0, 48.0),
        optimizer_ms=u(0.2, 6.0) if kind != "launch" else u(0.05, 0.5),
        matmul_speedup={"fp32": 1.0, "tf32": u(2.0, 3.0), "fp16": fp16, "bf16": fp16 * u(0.9, 1.08)},
        channels_last_low=u(1.1, 1.6) if vision else 1.0,
        cudnn_benchmark_gain=u(1.0, 1.12),
        launch_ms=u(8.0, 25.0) if kind == "launch" else u(2.0, 14.0),
        compile_call_ms=u(0.5, 3.0),
        compile_fixed_ms=u(0.2, 3.0),
        scaler_sync_ms=u(0.3, 1.5),
        capacity_gib=capacity,
        static_gib=static,
        activation_gib=activation,
        loader=loader,
        noise=u(0.005, 0.03),
        error_rate=u(0.0, 0.03),
        accuracy=rng.random() < 0.4,
        compile_s=u(15.0, 120.0),
        build_s=u(1.0, 8.0),
        batch_accuracy_cost=u(0.002, 0.005),
    )


def _size(grid: dict[str, list[Any]]) -> int:
    size = 1
    for values in grid.values():
        size *= len(values)
    return size


def lines(seed: int, *, row_noise: bool = True) -> list[dict[str, Any]]:
    """The JSON lines of table ``family-<seed>``; ``row_noise=False``: without the per-row measurement noise
    baked into each throughput (a diagnostic: its best is the model's, not a line that noise lifted)."""
    return generate(f"family-{seed}", seed, profile(seed), row_noise=row_noise)


def table(seed: int, *, row_noise: bool = True) -> ReplayTable:
    """Table ``family-<seed>``, in memory."""
    return ReplayTable([_parse_row(line) for line in lines(seed, row_noise=row_noise)], name=f"family-{seed}")


def seeds(count: int = 50, first: int = 0) -> list[int]:
    """The first ``count`` seeds from ``first`` whose table has a feasible best (``max_accuracy_loss`` 0.01)."""
    out, seed = [], first
    while len(out) < count:
        if best(lines(seed), 0.01) is not None:
            out.append(seed)
        seed += 1
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tables.family", description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=50)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--out-dir", help="write each table as family-<seed>.jsonl here (default: summary only)")
    args = parser.parse_args(argv)
    for seed in seeds(args.count, args.first_seed):
        generated = lines(seed)
        top = best(generated, 0.01)
        counts = {s: sum(1 for line in generated if line["status"] == s) for s in ("ok", "oom", "error")}
        print(f"family-{seed} {profile(seed).description.split(': ')[1]} {len(generated)} configs {counts} "
              f"best {top['throughput'] if top else None} {top['params'] if top else ''}")
        if args.out_dir:
            path = Path(args.out_dir) / f"family-{seed}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(dumps(generated))
    return 0


if __name__ == "__main__":
    sys.exit(main())
