"""Does ``allocator: expandable`` let a larger micro-batch run where memory binds? Measured, both allocators.

    python -m benchmarks.runners.allocator_h200 OUT_DIR [--cap-gib 16] [--tiny]

The case: the GPT-style LM of ``benchmarks/workloads/gpt.py`` (6 layers, d_model 512, vocabulary 32,000), bf16
autocast, AdamW, where the sequence length changes from step to step (128-512 tokens, one seeded draw shared by
both runs): blocks of many sizes are what fragment the caching allocator. The process may use ``--cap-gib`` of
the GPU (``torch.cuda.set_per_process_memory_fraction``, a co-located job's share), so memory binds at
micro-batches that step quickly.

Each allocator runs in its own process (the setting must be in the environment before CUDA starts, as a
trial's is), and climbs the same ladder of micro-batches: at each, 12 steps with the seeded lengths, the
longest one included. The climb stops at the first out-of-memory. For each rung: ok or out of memory, the
peak allocated and reserved memory, and tokens/s. The result: the largest micro-batch each allocator ran, and
the speed of both at the largest micro-batch both ran. ``--tiny`` runs a small model on the CPU (no cap, no
allocator difference: a check of the runner).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from autotune._config import ALLOC_CONF_ENV, EXPANDABLE_SEGMENTS

LADDER = (32, 40, 48, 52, 56, 60, 64, 72, 80, 96, 128)
TINY_LADDER = (2, 4, 8)
STEPS = 12
MIN_SEQ, MAX_SEQ = 128, 512


def lengths(steps: int, *, seed: int = 0, low: int = MIN_SEQ, high: int = MAX_SEQ) -> list[int]:
    """The sequence length of each step (multiples of 8), the longest one always among them."""
    rng = random.Random(seed)
    out = [rng.randrange(low, high + 1, 8) for _ in range(steps - 1)]
    out.insert(steps // 2, high)
    return out


def child(allocator: str, cap_gib: float, tiny: bool) -> dict[str, Any]:
    """One allocator's climb, in this process (``ALLOC_CONF_ENV`` was set by the parent)."""
    import torch
    from torch.nn import functional as F

    from benchmarks.tables.sweep import GPT, GPT_FULL, GPT_TINY, GPTShape

    cuda = torch.cuda.is_available() and not tiny
    device = torch.device("cuda" if cuda else "cpu")
    shape = GPT_TINY if tiny else GPTShape(layers=GPT_FULL.layers, d_model=GPT_FULL.d_model, heads=GPT_FULL.heads,
                                            seq=MAX_SEQ, vocab=GPT_FULL.vocab)
    high = shape.seq
    low = min(MIN_SEQ, high // 2)
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2**30 / total))
    torch.manual_seed(0)
    model = GPT(shape).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=cuda)
    dtype = torch.bfloat16
    rungs = []
    for batch in (TINY_LADDER if tiny else LADDER):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        tokens, start, status = 0, time.perf_counter(), "ok"
        try:
            for seq in lengths(STEPS, seed=batch, low=low, high=high):
                ids = torch.randint(0, shape.vocab, (batch, seq + 1), device=device)
                with torch.autocast(device.type, dtype=dtype):
                    logits = model(ids[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                tokens += batch * seq
            if cuda:
                torch.cuda.synchronize()
        except torch.OutOfMemoryError:
            status = "oom"
        seconds = time.perf_counter() - start
        rung = {"batch": batch, "status": status,
                "tokens_per_s": round(tokens / seconds, 1) if status == "ok" else None,
                "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
                "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2) if cuda else None}
        rungs.append(rung)
        print(json.dumps({"allocator": allocator, **rung}), file=sys.stderr, flush=True)
        if status == "oom":
            break
    return {"allocator": allocator, "torch": torch.__version__, "cap_gib": cap_gib if cuda else None,
            "device": torch.cuda.get_device_name(0) if cuda else "cpu", "rungs": rungs}


def largest(run: dict[str, Any]) -> int:
    ok = [r["batch"] for r in run["rungs"] if r["status"] == "ok"]
    return max(ok) if ok else 0


def report(runs: dict[str, dict[str, Any]], command: str) -> str:
    default, expandable = runs["default"], runs["expandable"]
    both = min(largest(default), largest(expandable))
    lines = [
        "# `allocator: expandable` where memory binds",
        "",
        f"- Date: {datetime.date.today()}; device: {default['device']}; torch {default['torch']}; "
        f"process cap: {default['cap_gib']} GiB",
        f"- Command: `{command}`",
        f"- Case: GPT-style LM (6 layers, d_model 512, vocabulary 32,000), bf16 autocast, AdamW, sequence length "
        f"varying per step ({MIN_SEQ}-{MAX_SEQ}, the same seeded draw for both allocators), {STEPS} steps a rung.",
        "",
        "| micro-batch | default | default peak alloc / reserved GiB | default tok/s | expandable | "
        "expandable peak alloc / reserved GiB | expandable tok/s |",
        "|---:|---|---:|---:|---|---:|---:|",
    ]
    by_batch: dict[int, dict[str, dict[str, Any]]] = {}
    for name, run in runs.items():
        for rung in run["rungs"]:
            by_batch.setdefault(rung["batch"], {})[name] = rung

    def cells(rung: dict[str, Any] | None) -> str:
        if rung is None:
            return "- | - | -"
        memory = f"{rung['peak_allocated_gib']} / {rung['peak_reserved_gib']}"
        rate = f"{rung['tokens_per_s']:,.0f}" if rung["tokens_per_s"] else "-"
        return f"{rung['status']} | {memory} | {rate}"

    for batch in sorted(by_batch):
        lines.append(f"| {batch} | {cells(by_batch[batch].get('default'))} | "
                     f"{cells(by_batch[batch].get('expandable'))} |")
    lines += ["", f"Largest micro-batch that ran: default {largest(default)}, expandable {largest(expandable)}."]
    if both:
        d = by_batch[both]["default"]["tokens_per_s"]
        e = by_batch[both]["expandable"]["tokens_per_s"]
        lines.append(f"At micro-batch {both}, both ran: expandable / default = {e / d:.3f} (one run each).")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, nargs="?")
    parser.add_argument("--cap-gib", type=float, default=16.0)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--child", choices=("default", "expandable"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.cap_gib, args.tiny)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    runs = {}
    for allocator in ("default", "expandable"):
        env = dict(os.environ)
        env.pop(ALLOC_CONF_ENV, None)
        if allocator == "expandable":
            env[ALLOC_CONF_ENV] = EXPANDABLE_SEGMENTS
        cmd = [sys.executable, "-m", "benchmarks.runners.allocator_h200", "--child", allocator,
               "--cap-gib", str(args.cap_gib), *(["--tiny"] if args.tiny else [])]
        done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True)
        runs[allocator] = json.loads(done.stdout.strip().splitlines()[-1])
        (args.out / "allocator-h200.json").write_text(json.dumps(runs, indent=1))
    command = "python -m benchmarks.runners.allocator_h200 OUT" + (" --tiny" if args.tiny else "") + (
        f" --cap-gib {args.cap_gib:g}" if args.cap_gib != 16.0 else "")
    (args.out / "allocator-h200.md").write_text(report(runs, command))
    print(report(runs, command))


if __name__ == "__main__":
    main()
