"""``augment: device`` on a GPU: hand runs of two user-style scripts, and optionally a short study of one.

    python -m benchmarks.runners.augment_gpu OUT_DIR [--workloads vits,effnet] [--workers 8,14]
        [--study WORKLOAD --budget 5] [--tiny]

The scripts are ``benchmarks/workloads/zoo_augment.py``'s (a ViT-S/16 from timm and a torchvision
EfficientNet-B0, each with per-sample random augmentation in its Dataset). For each, in this one process and
one after another (the compiles after the first are warm), at the script's batch with the compute knobs of
a tuned config (bf16, torch.compile, fused optimizer):

- ``dataloader wN``: the transforms in the DataLoader workers (``augment: dataset``), N pinned persistent
  workers prefetching 2 batches each, for each N of ``--workers``: the best DataLoader config is the fastest;
- ``augment=device``: the items served as uint8 through 8 pinned workers, the transforms on the GPU;
- ``augment=device, data on device``: the same with the served items kept on the device (``loader: device``);
- ``ceiling``: the step alone, four augmented batches kept on the device and replayed (a step probe).

Each is one trial of autotune's own (``autotune.trial._execute.execute``) at ``--samples`` samples, timed in
its windows. The report (``OUT_DIR/augment-gpu.md``, the rows also in ``augment-gpu.json``) gives each run's
rate and the bar of issue 59: the device augmentation at least 1.5x the best DataLoader config and at least
80% of the ceiling. ``--study WORKLOAD --budget MINUTES`` then runs ``autotune tune`` on that script over
``gpu_default`` and records its pick, its verdict and whether the pick has ``augment=device``.
``--tiny`` runs at CPU sizes (small images, no compile) to check the runner; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[2]
TARGETS = {"vits": "benchmarks/workloads/zoo_augment.py:train_vits",
           "effnet": "benchmarks/workloads/zoo_augment.py:train_effnet"}
# The hand runs import the scripts as modules, once: their decoded images are made once per process.
MODULES = {name: "benchmarks.workloads.zoo_augment:" + target.rsplit(":", 1)[1] for name, target in TARGETS.items()}
BATCH = 256  # both scripts' own batch


def runs(workers: list[int], tiny: bool) -> list[tuple[str, dict[str, Any], Optional[str]]]:
    """(name, config knobs, probe) of each hand run, the ceiling last."""
    compute: dict[str, Any] = {"precision": "bf16", "batch_size": BATCH, "optimizer_impl": "fused"}
    if tiny:
        compute = {"precision": "fp32", "batch_size": 8}
    else:
        compute["compile"] = "default"
    loader = {"pin_memory": not tiny, "persistent_workers": True, "prefetch_factor": 2}
    out: list[tuple[str, dict[str, Any], Optional[str]]] = []
    for n in workers:
        out.append((f"dataloader w{n}", {**compute, **loader, "num_workers": n}, None))
    out.append(("augment=device", {**compute, **loader, "num_workers": min(8, max(workers)), "augment": "device"},
                None))
    out.append(("augment=device, data on device", {**compute, "loader": "device", "augment": "device"}, None))
    out.append(("ceiling (step, data on device)", {**compute, **loader, "num_workers": max(workers)}, "step"))
    return out


def hand_run(target: str, name: str, knobs: dict[str, Any], probe: Optional[str], samples: int) -> dict[str, Any]:
    import torch

    from autotune._config import Budget, TrialConfig
    from autotune.trial._execute import TrialSpec, execute

    config = TrialConfig(**knobs)
    budget = Budget(samples=samples, warmup_steps=15, windows=5)
    began = time.perf_counter()
    outcome = execute(TrialSpec(target, config, budget, seed=0, baseline_batch_size=config.global_batch_size,
                                probe=probe))
    wall = time.perf_counter() - began
    m = outcome.measurement
    row = {"run": name, "config": config.describe(), "status": outcome.status, "error": outcome.error,
           "throughput": m.throughput if m else 0.0, "spread": m.spread if m else None,
           "data_wait": m.data_wait_fraction if m else None, "peak_gib": m.peak_memory_gib if m else None,
           "compile_s": m.compile_seconds if m else None, "wall_s": round(wall, 1),
           "transforms": (m.extras or {}).get("augment_transforms") if m else None}
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    print(f"{target.split(':')[1]} {name}: {row['status']} {row['throughput']:,.0f}/s in {wall:.0f} s "
          f"{row['error']}", flush=True)
    return row


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The bar of issue 59 for one workload's rows."""
    loaders = [r for r in rows if r["run"].startswith("dataloader") and r["status"] == "ok"]
    best_loader = max(loaders, key=lambda r: r["throughput"], default=None)
    devices = [r for r in rows if r["run"].startswith("augment=device") and r["status"] == "ok"]
    best_device = max(devices, key=lambda r: r["throughput"], default=None)
    ceiling = next((r for r in rows if r["run"].startswith("ceiling") and r["status"] == "ok"), None)
    out: dict[str, Any] = {"best_dataloader": best_loader and best_loader["run"],
                           "best_device": best_device and best_device["run"]}
    if best_loader and best_device:
        out["speedup_over_dataloader"] = best_device["throughput"] / best_loader["throughput"]
    if ceiling and best_device:
        out["share_of_ceiling"] = best_device["throughput"] / ceiling["throughput"]
    out["meets_bar"] = bool(out.get("speedup_over_dataloader", 0) >= 1.5 and out.get("share_of_ceiling", 0) >= 0.8)
    return out


def study(target: str, minutes: float, out: Path, tiny: bool) -> dict[str, Any]:
    """``autotune tune`` on ``target`` over gpu_default for ``minutes``; its pick and verdict."""
    name = "augment-" + target.rsplit("_", 1)[-1]
    studies = out / "studies"
    command = [sys.executable, "-m", "autotune", "tune", target, "--budget", str(minutes), "--study", name,
               "--storage", f"sqlite:///{out / 'augment-studies.db'}", "--studies-dir", str(studies),
               "--no-progress", "--no-plots"]
    if tiny:
        command += ["--space", "cpu_default"]
    began = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - began
    (out / f"{name}.log").write_text(proc.stdout + proc.stderr)
    best_path = studies / name / "best_config.json"
    record: dict[str, Any] = {"command": " ".join(command[1:]), "returncode": proc.returncode, "wall_s": round(wall)}
    if best_path.is_file():
        best = json.loads(best_path.read_text())
        config = best.get("config") or {}
        record.update({"pick": config, "augment": config.get("augment"), "speedup": best.get("speedup"),
                       "verdict": best.get("verdict") or best.get("accuracy_check"),
                       "input_pipeline": best.get("input_pipeline")})
    record["tail"] = (proc.stdout + proc.stderr)[-3000:]
    print(f"study {name}: rc {proc.returncode} in {wall:.0f} s, pick augment={record.get('augment')}", flush=True)
    return record


def report(out: Path, results: dict[str, Any]) -> None:
    lines = ["# augment: device on a GPU", "", f"Device: {results['device']}; torch {results['torch']}, "
             f"torchvision {results['torchvision']}, timm {results['timm']}; {results['cores']} cores.", ""]
    for workload, data in results["workloads"].items():
        lines += [f"## {workload} (`{TARGETS[workload]}`)", "",
                  "| run | config | status | img/s | window spread | data wait | peak GiB | compile s | wall s |",
                  "|---|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in data["rows"]:
            spread = f"{r['spread']:.1%}" if r["spread"] is not None else ""
            wait = f"{r['data_wait']:.0%}" if r["data_wait"] is not None else ""
            peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else ""
            comp = f"{r['compile_s']:.0f}" if r["compile_s"] is not None else ""
            lines.append(f"| {r['run']} | `{r['config']}` | {r['status']} {r['error'][:80]} | {r['throughput']:,.0f} "
                         f"| {spread} | {wait} | {peak} | {comp} | {r['wall_s']:.0f} |")
        v = data["verdict"]
        lines += ["", f"Best DataLoader config: {v.get('best_dataloader')}; best device augmentation: "
                      f"{v.get('best_device')}; speed-up {v.get('speedup_over_dataloader', float('nan')):.2f}x "
                      f"(bar 1.5x), {v.get('share_of_ceiling', float('nan')):.0%} of the ceiling (bar 80%): "
                      f"{'meets' if v['meets_bar'] else 'misses'} the bar.", ""]
    if results.get("study"):
        s = results["study"]
        lines += ["## Study", "", f"`{s['command']}`: exit {s['returncode']} in {s['wall_s']} s; pick "
                  f"`{s.get('pick')}`, augment={s.get('augment')}, speed-up {s.get('speedup')}, verdict "
                  f"{s.get('verdict')}.", ""]
    (out / "augment-gpu.md").write_text("\n".join(lines) + "\n")
    (out / "augment-gpu.json").write_text(json.dumps(results, indent=2, default=str))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--workloads", default="vits,effnet")
    parser.add_argument("--workers", default="8,14", help="DataLoader worker counts of the CPU-augmenting runs")
    parser.add_argument("--samples", type=int, default=None, help="samples per hand run (default 80 batches)")
    parser.add_argument("--study", choices=sorted(TARGETS), default=None)
    parser.add_argument("--budget", type=float, default=5.0, help="the study's minutes")
    parser.add_argument("--no-hand", action="store_true", help="the study alone")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args(argv)
    if args.tiny:
        os.environ["AUGMENT_ZOO_TINY"] = "1"
    sys.path.insert(0, str(REPO))
    import torch
    import torchvision

    try:
        import timm
        timm_version = timm.__version__
    except ImportError:
        timm_version = "missing (torchvision's VisionTransformer at ViT-S/16 sizes instead)"
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({platform.processor()})"
    results: dict[str, Any] = {"device": device, "torch": torch.__version__, "torchvision": torchvision.__version__,
                               "timm": timm_version, "cores": len(os.sched_getaffinity(0)), "workloads": {}}
    workers = [int(w) for w in args.workers.split(",")]
    samples = args.samples or (8 * 40 if args.tiny else BATCH * 80)  # 15 warm-up steps, then 5 windows
    if not args.no_hand:
        for workload in args.workloads.split(","):
            rows = [hand_run(MODULES[workload], name, knobs, probe, samples)
                    for name, knobs, probe in runs(workers, args.tiny)]
            results["workloads"][workload] = {"rows": rows, "verdict": verdict(rows)}
            report(args.out, results)
    if args.study:
        results["study"] = study(TARGETS[args.study], args.budget, args.out, args.tiny)
    report(args.out, results)
    print((args.out / "augment-gpu.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
