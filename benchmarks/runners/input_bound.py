"""An input-bound workload: a hand grid over the loader knobs, then a tuner study on the same workload.

    python -m benchmarks.runners.input_bound OUT_DIR [--images 8192] [--trials 9]

A small CNN (``benchmarks/workloads/jpeg.py``, model ``tiny``) trains on a folder of real JPEGs decoded by
PIL in DataLoader workers, so the GPU waits on the CPU. The grid crosses the loader knobs (workers,
pinning, then prefetch and persistent workers at the most workers) with two precisions, each config in
its own isolated trial at the study's budget. The study starts from the fp32, no-worker baseline over
``benchmarks/spaces/input_bound_h200.yaml`` (``gpu_default``'s knobs, a shorter budget). The report
(``OUT_DIR/input-bound.md``) gives both tables and the first study trial within 5% of the grid's best.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path

import optuna
from optuna.trial import TrialState

import autotune
from autotune import Budget
from autotune._api import load_study_result
from autotune._config import TrialConfig
from autotune.hardware import probe
from autotune.search._space import load_space
from autotune.study._isolation import run_isolated
from autotune.trial._execute import TrialSpec
from benchmarks.runners.accuracy_study import minutes_to_95
from benchmarks.workloads import make_jpegs

WORKLOAD = "benchmarks.workloads.jpeg:train"
SPACE = Path(__file__).resolve().parents[1] / "spaces" / "input_bound_h200.yaml"


def grid(max_workers: int) -> list[TrialConfig]:
    """The baseline, workers x pinning at bf16 (and fp32 at the most workers), then prefetch and persistence
    at the most workers, all at the fixed batch."""
    configs = [TrialConfig(precision="fp32", batch_size=64)]  # the baseline; no worker is ~20x slower
    configs += [TrialConfig(precision="fp32", batch_size=64, num_workers=max_workers, pin_memory=pin)
                for pin in (False, True)]
    configs += [TrialConfig(precision="bf16", batch_size=64, num_workers=w, pin_memory=pin)
                for w in sorted({4, 8, max_workers}) for pin in (False, True)]
    configs += [TrialConfig(precision="bf16", batch_size=64, num_workers=max_workers, pin_memory=True,
                            prefetch_factor=pf, persistent_workers=persist)
                for pf in (2, 4) for persist in (False, True) if (pf, persist) != (2, False)]
    return configs


def measure_grid(configs: list[TrialConfig], budget: Budget, logs: Path) -> list[tuple[TrialConfig, object]]:
    rows = []
    for i, config in enumerate(configs):
        outcome = run_isolated(TrialSpec(WORKLOAD, config, budget), workdir=logs / f"grid-{i}", timeout=300)
        rate = outcome.measurement.throughput if outcome.measurement else 0.0
        print(f"grid {i + 1}/{len(configs)} {config.describe()}: {outcome.status} {rate:,.0f}/s "
              f"in {outcome.wall_seconds:.0f} s", flush=True)
        rows.append((config, outcome))
    return rows


def grid_table(rows) -> tuple[list[str], float]:
    best = max((o.measurement.throughput for _, o in rows if o.measurement), default=0.0)
    lines = ["| config | status | img/s median | window spread | data wait | % of grid best | trial s |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for config, o in sorted(rows, key=lambda r: -(r[1].measurement.throughput if r[1].measurement else 0.0)):
        m = o.measurement
        if m is None:
            lines.append(f"| `{config.describe()}` | {o.status} | | | | | {o.wall_seconds:.0f} |")
            continue
        lines.append(f"| `{config.describe()}` | ok | {m.throughput:,.0f} | {m.spread:.1%} | "
                     f"{m.data_wait_fraction:.0%} | {m.throughput / best:.1%} | {o.wall_seconds:.0f} |")
    return lines, best


def study_table(study: optuna.Study, grid_best: float) -> tuple[list[str], int | None]:
    lines = ["| trial | config | status | img/s | % of grid best | data wait | diagnosis | verdict | trial s |",
             "|---:|---|---|---:|---:|---:|---|---|---:|"]
    first = None
    for t in sorted(study.get_trials(deepcopy=False), key=lambda t: t.number):
        a = t.user_attrs
        if "config" not in a:
            continue
        rate = a.get("throughput") or 0.0
        share = rate / grid_best if grid_best else 0.0
        ok = a.get("status") == "ok" and a.get("accuracy_verdict") not in ("degraded", "diverged")
        if first is None and ok and share >= 0.95:
            first = t.number
        wait = a.get("data_wait_fraction")
        lines.append(f"| {t.number} | `{TrialConfig.from_dict(a['config']).describe()}` | {a.get('status')} | "
                     f"{rate:,.0f} | {share:.1%} | {'' if wait is None else f'{wait:.0%}'} | "
                     f"{a.get('diagnosis', '')} | {a.get('accuracy_verdict', '')} | {a.get('wall_seconds') or 0:.0f} |")
    return lines, first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--images", type=int, default=8192)
    parser.add_argument("--trials", type=int, default=9, help="study trials, the fp32 baseline (#0) included")
    parser.add_argument("--max-workers", type=int, default=14)
    parser.add_argument("--skip-grid", action="store_true")
    parser.add_argument("--study-timeout", type=float, help="stop starting study trials after this many seconds")
    parser.add_argument("--samples", type=int, help="override the space's budget (a quick check on a CPU)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    root = args.out / "jpegs"
    if not root.exists():
        stats = make_jpegs.generate(str(root), images=args.images, classes=16, min_size=200, max_size=260,
                                    quality=90, seed=0, workers=None)
        print(f"wrote {stats['images']} JPEGs in {stats['seconds']:.0f} s", flush=True)
    os.environ.update(AUTOTUNE_JPEG_ROOT=str(root), AUTOTUNE_JPEG_MODEL="tiny", AUTOTUNE_JPEG_SIZE="112",
                      AUTOTUNE_JPEG_EVAL="256")
    space_path = SPACE
    if args.samples:
        import yaml

        doc = yaml.safe_load(SPACE.read_text())
        doc["budget"]["samples"] = args.samples
        space_path = args.out / SPACE.name
        space_path.write_text(yaml.safe_dump(doc))
    space = load_space(str(space_path))
    caps = probe()
    lines = [f"Date {datetime.date.today()}; {caps.gpu_name or 'CPU'} (driver {caps.driver or '-'}); torch {caps.torch}; "
             f"Python {platform.python_version()}; optuna {optuna.__version__}; {os.cpu_count()} CPU cores.",
             f"Workload `{WORKLOAD}` (model tiny, crop 112) on {args.images} JPEGs of 200-260 px; "
             f"{space.budget.samples} samples per trial, {space.budget.windows} timed windows.", ""]
    grid_best = 0.0
    if not args.skip_grid:
        rows = measure_grid(grid(args.max_workers), space.budget, args.out / "logs")
        table, grid_best = grid_table(rows)
        lines += ["### Hand grid (each config an isolated trial)", "", *table, ""]
    (args.out / "input-bound.md").write_text("\n".join(lines) + "\n")
    autotune.run(WORKLOAD, space=str(space_path), n_trials=args.trials, study_name="input-bound", timeout=args.study_timeout,
                 studies_dir=str(args.out / "studies"), progress=False)
    study, result = load_study_result("input-bound", studies_dir=str(args.out / "studies"))
    table, first = study_table(study, grid_best)
    lines += [f"### Study: `autotune.run` over `{SPACE.name}`, {args.trials} trials", "", *table, ""]
    if result.best is not None:
        lines.append(f"Recommended: #{result.best.number} `{result.best.config.describe()}` at "
                     f"{result.best.throughput:,.0f} img/s after the top-K re-measurement "
                     f"({result.best.throughput / grid_best:.1%} of the grid's best), {result.speedup:.2f}x the baseline."
                     if grid_best else f"Recommended: #{result.best.number}.")
    lines.append(f"First trial within 5% of the grid's best: {'#' + str(first) if first is not None else 'none'}.")
    to_95 = minutes_to_95(study, result)
    if to_95 is not None:
        lines.append(f"Minutes to 95% of the study's own pick: {to_95:.1f}.")
    (args.out / "input-bound.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
