"""A workload's compiled step two ways, alternating in one process: the module compiled alone, and the
forward pass compiled with the loss (what ``ctx.train_step`` does under ``compile`` since the loss graph).

    python -m benchmarks.runners.loss_graph_ab --out OUT.md --workload benchmarks/workloads/resnet50.py:train_device \\
        --config precision:bf16,channels_last:true,batch_size:256,compile:default,cuda_graphs:true --samples 10240

Each round runs the module-alone side, then the loss-graph side, with the same budget; the first round
pays the compiles (the inductor cache then serves the second). Prints and writes a markdown table with the
per-round ratios.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

from benchmarks.runners.measure_configs import parse  # knob:value,... -> TrialConfig


def module_only_context(**kwargs: Any) -> Any:
    """A trial context whose ``train_step`` calls the compiled module (``compile_loss=False``), as steps did
    before the forward pass and the loss were compiled as one graph: the comparison's other side."""
    from autotune.trial import _context, _knobs

    ctx = _context.TrialContext(**kwargs)

    def train_step(model: Any, optimizer: Any, loss_fn: Any = None, **options: Any) -> Any:
        capacity = ctx._plan()[0] + _context.LOSS_SLACK if ctx.budget is not None else 0
        step = _knobs.TrainStep(model, optimizer, loss_fn, config=ctx.config, device=ctx.device,
                                loss_capacity=capacity, compile_loss=False, **options)
        ctx._train_steps.append(step)
        return step

    ctx.train_step = train_step
    return ctx


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workload", required=True, help="PATH.py:function or module:function")
    parser.add_argument("--config", required=True, help="knob:value,... (TrialConfig fields)")
    parser.add_argument("--samples", type=int, default=10240)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    import torch

    from autotune._config import Budget
    from autotune._target import load_target
    from autotune.hardware import probe
    from autotune.trial._context import TrialContext
    from autotune.trial._knobs import applied

    caps = probe()
    device = torch.device("cuda" if caps.cuda else "cpu")
    config = parse(args.config)
    budget = Budget(samples=args.samples, warmup_steps=args.warmup_steps, windows=args.windows)
    train = load_target(args.workload)
    rows = []
    for round_ in range(1, args.rounds + 1):
        for side, context in (("module compiled alone", module_only_context), ("loss in the graph", TrialContext)):
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            started = time.perf_counter()
            ctx = context(config=config, budget=budget, device=device)
            with applied(config, device):
                train(ctx)
            m = ctx.measurement()
            rows.append({"round": round_, "side": side, "throughput": m.throughput, "spread": m.spread,
                         "peak_memory_gib": m.peak_memory_gib, "seconds": time.perf_counter() - started})
            print(f"round {round_}, {side}: {m.throughput:,.1f}/s (spread {m.spread:.1%}, "
                  f"{rows[-1]['seconds']:.0f} s)", flush=True)
    ratios = [b["throughput"] / a["throughput"] for a, b in zip(rows[::2], rows[1::2])]
    workload = Path(args.workload.split(":")[0]).name + ":" + args.workload.split(":")[-1]
    lines = [
        f"Date: {datetime.date.today()}; device: {caps.device_label}; torch {caps.torch}. Workload `{workload}`, "
        f"config `{config.describe()}`, {args.samples} samples per run ({args.warmup_steps} warm-up steps, "
        f"{args.windows} windows), in one process.",
        "",
        "| round | step | samples/s | window spread | peak GiB | run s, compile included |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['round']} | {r['side']} | {r['throughput']:,.1f} | {r['spread'] * 100:.1f}% | "
                     f"{r['peak_memory_gib']:.2f} | {r['seconds']:.0f} |")
    lines += ["", f"Loss graph / module alone, per round: {', '.join(f'{x:.3f}' for x in ratios)} "
                  f"(median {statistics.median(ratios):.3f})."]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
