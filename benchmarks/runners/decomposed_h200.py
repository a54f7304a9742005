"""The input pipeline and the device step measured apart, against full trials, on a tiny in-memory LM.

    python -m benchmarks.runners.decomposed_h200 OUT_DIR [--samples N] [--batch B] [--step KNOBS] [--full-only]

The workload (``benchmarks/workloads/colocation.py:train_lm_host``) keeps 4,096 sequences of 64 tokens in
host memory as a map-style Dataset read through ``ctx.loader``. For each loader config (the DataLoader with
0, 4 and 8 workers, and ``loader: device``), at bf16 and the default ``fixed`` batch of 256, it runs a full
trial, a loader probe and a step probe, each an isolated trial process, and writes
``OUT_DIR/decomposed.json`` and ``OUT_DIR/decomposed.md``: the measured rates, the prediction
min(loader, step) and its error against the full trial. ``AUTOTUNE_BENCH_SIZE=tiny`` runs it on a CPU.

``--step compile=default,cuda_graphs=true`` gives every cell those step knobs too (the files then carry a
``-compiled`` style suffix taken from the knobs); the cells share one compile cache, as a study's trials do, so
only the first compiles cold. ``--full-only`` skips the probes.

Then one more loader probe measures all four loader configs in one process, as a study's loop does (the
first config is the process's, the others its ``loader_variants``): its rates beside the separate probes', and
its wall seconds against theirs summed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from pathlib import Path

import os

from autotune._config import Budget, TrialConfig
from autotune.hardware import probe
from autotune.study._isolation import run_isolated
from autotune.study._probes import predict
from autotune.trial._compile_cache import compile_cache_env
from autotune.trial._execute import TrialSpec

TARGET = "benchmarks.workloads.colocation:train_lm_host"
LOADERS = {"torch, 0 workers": dict(num_workers=0), "torch, 4 workers": dict(num_workers=4),
           "torch, 8 workers": dict(num_workers=8, pin_memory=True), "device": dict(loader="device")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--samples", type=int, default=65_536)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--step", default="", help="step knobs for every cell, e.g. compile=default,cuda_graphs=true")
    parser.add_argument("--full-only", action="store_true", help="full trials only, no probes")
    parser.add_argument("--target", default=TARGET, help="the workload (train_lm_lists: a Dataset of Python lists)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    step_knobs = {k: _value(v) for k, v in (kv.split("=", 1) for kv in args.step.split(",") if kv)}
    tag = ("-" + "-".join(f"{k}{v}" for k, v in step_knobs.items())) if step_knobs else ""
    tag += "" if args.target == TARGET else "-" + args.target.rsplit(":", 1)[1]
    os.environ.update(compile_cache_env(args.out / f"compile_cache{tag}", os.environ))
    caps = probe()
    precision = "bf16" if caps.cuda else "fp32"
    budget = Budget(samples=args.samples, warmup_steps=5, windows=3)
    rows = []
    for name, knobs in LOADERS.items():
        config = TrialConfig(precision=precision, batch_size=args.batch, **knobs, **step_knobs)
        rates = {kind: {"rate": None, "windows": [], "data_wait": None} for kind in ("loader", "step")}
        for kind in (None,) if args.full_only else (None, "loader", "step"):
            spec = TrialSpec(target=args.target, config=config, budget=budget, seed=0, probe=kind)
            outcome = run_isolated(spec, workdir=args.out / f"logs{tag}" / f"{name.replace(' ', '').replace(',', '-')}-{kind or 'full'}",
                                   timeout=300)
            m = outcome.measurement
            rates[kind or "full"] = {"status": outcome.status, "error": outcome.error,
                                     "rate": m.throughput if m else None, "windows": list(m.window_throughputs) if m else [],
                                     "data_wait": m.data_wait_fraction if m else None, "wall": outcome.wall_seconds,
                                     "compile_seconds": m.compile_seconds if m else None,
                                     "compile_cache": (m.extras or {}).get("compile_cache") if m else None}
            print(name, kind or "full", outcome.status, m and round(m.throughput), flush=True)
        predicted = predict(rates["loader"]["rate"], rates["step"]["rate"])
        full = rates["full"]["rate"]
        rows.append({"pipeline": name, "config": config.to_dict(), **rates, "predicted": predicted,
                     "prediction_error": full / predicted - 1 if full and predicted else None})
    batched = None
    if not args.full_only:
        configs = [TrialConfig(precision=precision, batch_size=args.batch, **knobs, **step_knobs) for knobs in LOADERS.values()]
        spec = TrialSpec(target=args.target, config=configs[0], budget=budget, seed=0, probe="loader",
                         loader_variants=tuple(configs[1:]))
        outcome = run_isolated(spec, workdir=args.out / f"logs{tag}" / "batched-loader", timeout=300)
        m = outcome.measurement
        extras = (m.extras or {}) if m else {}
        batched = {"status": outcome.status, "error": outcome.error, "wall": outcome.wall_seconds,
                   "rates": [m.throughput if m else None, *(extras.get("loader_rates") or [])],
                   "errors": [None, *(extras.get("loader_errors") or [])],
                   "separate_wall": sum(r["loader"].get("wall") or 0.0 for r in rows)}
        print("batched loader probe", outcome.status, batched["rates"], round(outcome.wall_seconds, 1), flush=True)
    (args.out / f"decomposed{tag}.json").write_text(json.dumps({"rows": rows, "batched_loader_probe": batched},
                                                               indent=1, default=str))
    best_torch = max(r["full"]["rate"] or 0 for r in rows if r["pipeline"] != "device")
    device = next(r["full"]["rate"] or 0 for r in rows if r["pipeline"] == "device")

    def spread(values: list[float]) -> str:
        return f"{(max(values) - min(values)) / sorted(values)[len(values) // 2]:.1%}" if values else "-"

    lines = [f"Date {datetime.date.today()}; {caps.gpu_name or 'CPU'}; torch {caps.torch}; Python {platform.python_version()}; "
             f"{precision}, batch {args.batch}, {args.samples:,} samples per run, 3 timed windows; "
             f"step knobs: {args.step or 'none (eager)'}; workload {args.target}.", "",
             "| loader | full trial seq/s (window spread) | data wait | loader probe seq/s | step probe seq/s | predicted | error |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        f, lo, st = r["full"], r["loader"], r["step"]
        lines.append(f"| {r['pipeline']} | {f['rate'] or 0:,.0f} ({spread(f['windows'])}) | {f['data_wait'] or 0:.0%} | "
                     f"{lo['rate'] or 0:,.0f} | {st['rate'] or 0:,.0f} | {r['predicted'] or 0:,.0f} | "
                     f"{(r['prediction_error'] or 0):+.1%} |")
    lines += ["", f"`loader: device` against the best DataLoader config: {device / best_torch:.2f}x."]
    if batched is not None:
        lines += ["", f"One loader probe process for all {len(rows)} loader configs: {batched['status']}, "
                  f"{batched['wall']:.1f} s wall against {batched['separate_wall']:.1f} s for the {len(rows)} separate "
                  "loader probes.", "", "| loader | separate probe seq/s | in the one process seq/s |", "|---|---:|---:|"]
        for r, rate, error in zip(rows, batched["rates"], batched["errors"]):
            lines.append(f"| {r['pipeline']} | {r['loader']['rate'] or 0:,.0f} | "
                         + (f"{rate:,.0f}" if rate else f"- ({error})") + " |")
    (args.out / f"decomposed{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _value(text: str):
    return {"true": True, "false": False}.get(text.lower(), text)


if __name__ == "__main__":
    main()
