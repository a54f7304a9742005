"""Trials per hour with one worker per GPU against a single worker, on one study in a journal file.

    python -m benchmarks.runners.scaleout --trials 16 --out benchmarks/results/scaleout.md

Runs ``autotune tune ... --gpus 0`` and then ``--gpus all`` on the same workload, space and trial budget,
each in its own journal file. Trials per hour are counted over the trial phase: from the first trial's
start to the last trial's end (the fp32 reference runs once per study, before the workers start, and is
reported apart). Not a test.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import sys
import time
from pathlib import Path

import optuna
from optuna.trial import TrialState

from autotune.study._storage import open_storage

WORKLOAD = "benchmarks/workloads/resnet50.py:train_device"
SPACE = "benchmarks/spaces/scaleout.yaml"


def run_study(gpus: str, trials: int, workdir: Path, workload: str, space: str, cpu_workers: bool = False) -> dict:
    name = f"scaleout-{gpus.replace(',', '-')}"
    spread = ["--workers", "1" if gpus == "0" else gpus] if cpu_workers else ["--gpus", gpus]
    storage = f"journal:{workdir / (name + '.journal')}"
    command = [sys.executable, "-m", "autotune", "tune", workload, "--space", space, *spread,
               "--storage", storage, "--study", name, "--trials", str(trials), "--top-k", "0",
               "--prune-below", "0", "--max-accuracy-loss", "1", "--no-progress",
               "--studies-dir", str(workdir / "studies")]
    print("$", " ".join(command), flush=True)
    start = time.time()
    subprocess.run(command, check=True)
    wall = time.time() - start
    study = optuna.load_study(study_name=name, storage=open_storage(storage, workdir / "studies")[0])
    done = [t for t in study.trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
            and t.user_attrs.get("role") != "reference" and t.user_attrs.get("status") != "infeasible"]
    first = min(t.datetime_start for t in done)
    last = max(t.datetime_complete for t in done)
    phase = (last - first).total_seconds()
    per_gpu: dict[str, int] = {}
    for t in done:
        per_gpu[t.user_attrs.get("gpu_uuid", "?")[-8:]] = per_gpu.get(t.user_attrs.get("gpu_uuid", "?")[-8:], 0) + 1
    return {
        "gpus": gpus,
        "trials": len(done),
        "phase_s": phase,
        "wall_s": wall,
        "per_hour": len(done) / phase * 3600,
        "trial_wall_median": statistics.median(t.user_attrs.get("wall_seconds", 0.0) for t in done),
        "per_gpu": per_gpu,
        "best": max((t.values[0] for t in done if t.values and t.user_attrs.get("status") == "ok"), default=0.0),
        "failed": sum(t.user_attrs.get("status") not in ("ok", None) for t in done),
        "hardware": study.user_attrs.get("hardware", {}),
        "devices": sorted({t.user_attrs.get("gpu_name", "?") for t in done}),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--gpus", default="all", help="the many-worker run's --gpus (default all)")
    parser.add_argument("--workload", default=WORKLOAD)
    parser.add_argument("--space", default=SPACE)
    parser.add_argument("--workdir", default="scaleout-run")
    parser.add_argument("--out", default="scaleout.md")
    parser.add_argument("--cpu-workers", action="store_true",
                        help="a CPU check of this script: --workers 1 against --workers N (N given as --gpus)")
    args = parser.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    one = run_study("0", args.trials, workdir, args.workload, args.space, args.cpu_workers)
    many = run_study(args.gpus, args.trials, workdir, args.workload, args.space, args.cpu_workers)
    hw = one["hardware"]
    ratio = many["per_hour"] / one["per_hour"]
    lines = [
        "# Scale-out: one worker per GPU on one study (journal file)",
        "",
        f"- Date: {datetime.date.today()}; {hw.get('gpu_count')}x {hw.get('gpu_name')} (driver {hw.get('driver')}); "
        f"torch {hw.get('torch')}; {hw.get('cpu_count')} CPU cores",
        f"- Command: `python -m benchmarks.runners.scaleout --trials {args.trials} --gpus {args.gpus}`, which runs "
        f"`autotune tune {args.workload} --space {args.space} --gpus G --storage journal:... --trials {args.trials} "
        "--top-k 0 --prune-below 0` for G = 0 and then G = " + args.gpus,
        "- Trials per hour are counted from the first trial's start to the last trial's end; the fp32 reference "
        "runs once per study before the workers start (it is in the whole-run wall time).",
        "",
        "| workers (GPUs) | trials | trial phase | trials / hour | median trial wall | trials per GPU | whole run wall | best img/s |",
        "|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in (one, many):
        lines.append(
            f"| {r['gpus']} | {r['trials']} | {r['phase_s']:.0f} s | {r['per_hour']:,.0f} | {r['trial_wall_median']:.1f} s | "
            f"{', '.join(f'…{k}: {v}' for k, v in sorted(r['per_gpu'].items()))} | {r['wall_s']:.0f} s | {r['best']:,.0f} |"
        )
    lines += ["", f"**Trials per hour, {args.gpus} against one GPU: {ratio:.2f}x.**", ""]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
