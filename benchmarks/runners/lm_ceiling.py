"""Where the GPT-style LM's tuned step spends its time, and what a larger global batch would buy.

    python -m benchmarks.runners.lm_ceiling --out benchmarks/results/lm-ceiling-h200.md

1. **Breakdown.** One config of ``examples/gpt_lm.py`` (by default the tuner's pick without CUDA Graphs, so
   that the profiler sees each kernel) trains a few steps, then ``--profile-steps`` more under torch.profiler.
   Its GPU kernels are summed by kind (matrix multiplies, attention, Triton-fused element-wise and
   reductions, the optimizer and clipping, the rest), beside the wall time of a step and the model's matmul FLOPs, so the
   table says how close the step is to what the card can do.
2. **Batch sweep.** The space's baseline, then the pick at global batches 64 to 512 (``batch_policy: scale``: a different optimisation,
   so not a candidate of the example's space), each trained for the same number of optimizer steps, so that
   every cell has warm-up and timed windows of the same length in steps.

Writes the markdown to ``--out`` and the raw numbers beside it (``.json``). ``--tiny`` runs the tiny model on
whatever device there is (the tests run it on a CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

from benchmarks.runners.loss_graph_ab import module_only_context
from benchmarks.runners.lm_h200 import SPACE, _example, grid

PICK = {"precision": "bf16", "attention": "auto", "compile": "default", "optimizer_impl": "fused"}
TINY_PICK = {"precision": "fp32", "attention": "auto", "optimizer_impl": "fused"}

# Kernel kinds, by substrings of the (lower-cased) kernel name; the first kind that matches wins.
KINDS = (
    ("attention", ("flash", "fmha", "sdpa", "attention")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "wgmma", "cublas", "sm90_", "sm80_", "ampere_", "hopper_")),
    ("optimizer and gradient clipping", ("adam", "multi_tensor", "foreach")),
    ("Triton fused (element-wise, norms, loss)", ("triton",)),
)


def kind_of(kernel: str) -> str:
    name = kernel.lower()
    return next((kind for kind, needles in KINDS if any(n in name for n in needles)), "other")


def matmul_flops(gpt: Any, tokens: int) -> float:
    """Forward + backward FLOPs of the model's matrix multiplies for ``tokens`` tokens (6 per weight and
    token), plus causal attention's score and value products (half of a full one, 3x forward)."""
    s = gpt.shape()
    weights = s.layers * 12 * s.d_model ** 2 + s.vocab * s.d_model  # the blocks and the tied output head
    attention = s.layers * 3 * 2 * 2 * tokens * s.seq * s.d_model / 2
    return 6.0 * weights * tokens + attention


def breakdown(gpt: Any, space: Any, device: Any, cell: dict[str, Any], *, warm: int, steps: int,
              compile_loss: bool = True) -> dict[str, Any]:
    """Part 1: GPU time per step by kernel kind, beside the step's wall time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from autotune.trial._context import TrialContext
    from autotune.trial._knobs import applied

    config = space.baseline.replace(**cell)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with applied(config, device):
        ctx = (TrialContext if compile_loss else module_only_context)(config=config, device=device)
        model = ctx.model(gpt.GPT(gpt.shape(), attention=ctx.attention, wrap=ctx.checkpoint))
        optimizer = ctx.optimizer(torch.optim.AdamW, model.parameters(), lr=gpt.shape().lr, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, gpt.schedule(warm + 2 * steps))
        step = ctx.train_step(model, optimizer, clip_grad_norm=1.0, scheduler=scheduler)
        pool = gpt.streams(config.batch_size * 2, gpt.shape(), seed=0, device=device)
        batches = list(gpt.Sequences(pool, config.batch_size))
        for i in range(warm):
            step(batches[i % len(batches)])
        sync()
        started = time.perf_counter()
        for i in range(steps):
            step(batches[i % len(batches)])
        sync()
        wall = (time.perf_counter() - started) / steps
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            for i in range(steps):
                step(batches[i % len(batches)])
            sync()
    per_kind: dict[str, float] = {}
    top: dict[str, float] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        seconds = event.time_range.elapsed_us() / 1e6 / steps  # over all profiled steps -> seconds per step
        per_kind[kind_of(event.name)] = per_kind.get(kind_of(event.name), 0.0) + seconds
        top[event.name] = top.get(event.name, 0.0) + seconds
    tokens = config.global_batch_size * gpt.shape().seq
    flops = matmul_flops(gpt, tokens)
    return {"config": config.describe(), "compiled": config.compile != "off",
            "compiled_loss": step.compiled_loss, "wall_s": wall, "kinds": per_kind, "flops": flops, "tokens": tokens,
            "top": sorted(top.items(), key=lambda kv: -kv[1])[:12]}


def batch_cells(pick: dict[str, Any], batches: list[int], *, steps: int, space_batch: int) -> list[dict[str, Any]]:
    """The pick at each global batch (no accumulation), each for ``steps`` optimizer steps; a batch other than
    the space's is a ``scale`` config."""
    cells: list[dict[str, Any]] = [{"samples": space_batch * steps}]  # the space's baseline, the ratios' base
    for b in batches:
        cell = {**pick, "batch_size": b, "global_batch": b, "samples": b * steps}
        if b != space_batch:
            cell["batch_policy"] = "scale"
        cells.append(cell)
    return cells


def report(caps: Any, gpt: Any, parts: dict[str, Any], seconds: float, command: str) -> str:
    seq = gpt.shape().seq
    lines = [
        "# GPT-style LM: where the tuned step's time goes, the loss in the compiled graph, and larger global batches",
        "",
        f"Command: `{command}`",
        "",
        f"Date: {datetime.date.today()}; device: {caps.device_label} (driver {caps.driver or '-'}); torch "
        f"{caps.torch}, CUDA {caps.cuda_version or '-'}. `examples/gpt_lm.py` "
        f"({os.environ.get('GPT_LM_SIZE', 'small')}, {seq} tokens per sequence). Whole run: {seconds:.0f} s.",
    ]
    if parts.get("breakdown"):
        lines += ["", "## 1. Where one step's time goes"]
    for key in ("breakdown_module", "breakdown"):
        lines += _breakdown_lines(parts.get(key))
    cells = parts.get("loss_graph") or []
    if cells:
        lines += ["", "## 2. The compiled module alone, and the forward pass compiled with the loss (the space's "
                  "budget)", ""] + _cell_lines(cells)
    cells = parts.get("batches") or []
    if cells:
        lines += ["", "## 3. The pick at larger global batches (the same optimizer steps each)", ""] + _cell_lines(cells)
    return "\n".join(lines) + "\n"


def _breakdown_lines(b: Optional[dict[str, Any]]) -> list[str]:
    if not b:
        return []
    lines: list[str] = []
    how = ("not compiled" if not b["compiled"] else
           "the loss compiled with the forward pass" if b["compiled_loss"] else "the module compiled alone")
    if not b["kinds"]:
        lines += ["", f"### {b['config']}, {how}", "",
                  f"Wall time per step {b['wall_s'] * 1e3:.2f} ms; no GPU kernels to break down (no CUDA device)."]
    elif b:
        gpu = sum(b["kinds"].values())
        lines += ["", f"### {b['config']}, {how}: by kernel kind", "",
                  f"Wall time per step {b['wall_s'] * 1e3:.2f} ms ({b['tokens']:,} tokens); GPU kernel time "
                  f"{gpu * 1e3:.2f} ms ({gpu / b['wall_s']:.0%} of the wall time). Model FLOPs per step "
                  f"{b['flops'] / 1e12:.2f} T: {b['flops'] / b['wall_s'] / 1e12:.0f} TFLOP/s over the wall time.",
                  "", "| kind | ms per step | share of GPU time |", "|---|---:|---:|"]
        for kind, sec in sorted(b["kinds"].items(), key=lambda kv: -kv[1]):
            lines.append(f"| {kind} | {sec * 1e3:.2f} | {sec / gpu:.0%} |")
        lines += ["", "Longest kernels (ms per step):", "", "| kernel | kind | ms |", "|---|---|---:|"]
        for name, sec in b["top"]:
            lines.append(f"| `{name[:90].replace('|', '/')}` | {kind_of(name)} | {sec * 1e3:.2f} |")
    return lines


def _cell_lines(cells: list[dict[str, Any]]) -> list[str]:
    base = next((c["throughput"] for c in cells if c.get("status") == "ok"), None)
    lines = ["| config | seq/s | tokens/s | x first row | peak GiB | window spread |", "|---|---:|---:|---:|---:|---:|"]
    for c in cells:
        if c.get("status") != "ok":
            lines.append(f"| {c['config']} | {c['status']} | | | | |")
            continue
        lines.append(f"| {c['config']} | {c['throughput']:,.1f} | {c['tokens_per_s']:,.0f} | "
                     f"{c['throughput'] / base:.2f}x | {c['peak_memory_gib']:.2f} | {c['spread'] * 100:.1f}% |")
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="markdown file to write")
    parser.add_argument("--tiny", action="store_true", help="the tiny model (a CPU test)")
    parser.add_argument("--profile-steps", type=int, default=10)
    parser.add_argument("--batches", default="64,128,256,512", help="global batches of the sweep")
    parser.add_argument("--steps", type=int, default=24, help="optimizer steps per sweep cell")
    parser.add_argument("--skip", choices=("breakdown", "loss-graph", "batches"), action="append", default=[])
    args = parser.parse_args(argv)
    started = time.monotonic()
    if args.tiny:
        os.environ["GPT_LM_SIZE"] = "tiny"
    import torch

    from autotune.hardware import probe
    from autotune.search._space import load_space, restrict_to

    caps = probe()
    space = restrict_to(load_space(SPACE), caps)
    device = torch.device("cuda" if caps.cuda else "cpu")
    gpt = _example()
    pick = TINY_PICK if args.tiny else PICK
    parts: dict[str, Any] = {}
    if "breakdown" not in args.skip:
        for key, compile_loss in (("breakdown_module", False), ("breakdown", True)):
            parts[key] = breakdown(gpt, space, device, pick, warm=5, steps=args.profile_steps,
                                   compile_loss=compile_loss)
            print(f"{key}: {parts[key]['wall_s'] * 1e3:.2f} ms per step", flush=True)
    if "loss-graph" not in args.skip:  # the space's pick, its module compiled alone and with the loss
        graphs = {**pick, "cuda_graphs": device.type == "cuda"}
        parts["loss_graph"] = (grid(gpt, space, caps, device, [{}])
                               + grid(gpt, space, caps, device, [graphs], context=module_only_context)
                               + grid(gpt, space, caps, device, [graphs]))
        for row, how in zip(parts["loss_graph"][1:], ("the module compiled alone", "the loss compiled with it")):
            row["config"] += f" ({how})"
    if "batches" not in args.skip:
        batches = [int(b) for b in args.batches.split(",")]
        cells = batch_cells({**pick, "cuda_graphs": device.type == "cuda"}, batches, steps=args.steps,
                            space_batch=space.global_batch)
        rows = []
        for cell in cells:  # each cell with its own budget: the same steps, not the same samples
            samples = cell.pop("samples")
            budgeted = dataclasses.replace(space, budget=dataclasses.replace(space.budget, samples=samples))
            rows += grid(gpt, budgeted, caps, device, [cell])
        parts["batches"] = rows
    command = "python3 -m benchmarks.runners.lm_ceiling " + " ".join(
        a if not a.startswith("/") else Path(a).name for a in (argv if argv is not None else sys.argv[1:]))
    text = report(caps, gpt, parts, time.monotonic() - started, command)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps(parts, indent=2, default=str))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
