"""torch DataLoader workers against DALI threads on a JPEG folder: loader alone, training, and the ceiling.

    python -m benchmarks.workloads.make_jpegs /data/jpegs --images 12800 --classes 100
    python -m benchmarks.runners.dali_h200 --root /data/jpegs --out benchmarks/results/dali-h200.md

For each torch worker count (``--workers``, default 4, 8, 14) and each DALI thread count (``--threads``,
default 2, 4, 8), at one compute config (``--precision bf16 --batch-size 256``, channels_last, eager),
each measured in its own isolated trial process:

- *loader alone*: ``benchmarks/workloads/jpeg.py:loader_only``, the loader iterated without a model
  (decode, augmentation, the copy to the device), images/s;
- *training*: ``jpeg_workload.py:train``, ResNet-50 fed by that loader, images/s and its data-wait
  fraction;
- once, *synthetic*: ``jpeg_workload.py:train_synthetic``, the same model on batches already on the
  device, the most any loader could reach.

Writes a markdown table and names the backend with the highest training throughput. Not a test.
``--tiny`` runs the same on a CPU in a minute (tiny CNN, 32-pixel crops, workers 1 and 2, threads 1 and 2),
to check the script without a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from autotune import Budget, TrialConfig, TrialOutcome
from autotune.hardware import probe
from autotune.trial._images import list_images
from autotune.trial._execute import TrialSpec
from autotune.study._isolation import run_isolated

WORKLOAD = str(Path(__file__).resolve().parents[1] / "workloads" / "jpeg.py")


@dataclass(frozen=True)
class Row:
    """One loader setting, measured alone and under training."""

    backend: str
    knob: str
    config: TrialConfig
    alone: TrialOutcome
    training: TrialOutcome


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _rate(outcome: Optional[TrialOutcome]) -> str:
    if outcome is None:
        return "-"
    if outcome.measurement is None:
        return f"{outcome.status}: {outcome.error[:60]}"
    return f"{outcome.measurement.throughput:,.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, help="JPEG folder (benchmarks/workloads/make_jpegs.py)")
    parser.add_argument("--out", default="dali-h200.md")
    parser.add_argument("--logs", default="studies/dali_h200", help="each trial's log and result")
    parser.add_argument("--workers", type=_ints, default=None, help="torch DataLoader workers, e.g. 4,8,14")
    parser.add_argument("--threads", type=_ints, default=None, help="DALI threads, e.g. 2,4,8")
    parser.add_argument("--dali-prefetch", type=int, default=2)
    parser.add_argument("--precision", default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--samples", type=int, default=None, help="samples per trial, warm-up included")
    parser.add_argument("--warmup", type=int, default=10, help="warm-up steps per trial")
    parser.add_argument("--trial-timeout", type=float, default=300.0)
    parser.add_argument("--tiny", action="store_true", help="tiny CNN on 32-pixel crops: a CPU check of the script")
    args = parser.parse_args()

    tiny = args.tiny
    workers = args.workers or ([1, 2] if tiny else [4, 8, 14])
    threads = args.threads or ([1, 2] if tiny else [2, 4, 8])
    batch = args.batch_size or (16 if tiny else 256)
    # 120 steps of 256 = 30,720 images (2.4 epochs of a 12,800-image folder, epoch restarts included):
    # 10 warm-up steps, then 3 windows of 36 steps. A window must span a few rounds of the workers'
    # output (14 workers deliver their batches nearly together); with 40-step trials the torch loader
    # read as fast as the GPU while it could feed it at two thirds of that (benchmarks/results/dali-h200.md).
    samples = args.samples or batch * (16 if tiny else 120)
    budget = Budget(samples=samples, warmup_steps=1 if tiny else args.warmup, windows=3)
    env = {"AUTOTUNE_JPEG_ROOT": str(Path(args.root).resolve()), "AUTOTUNE_JPEG_MODEL": "tiny" if tiny else "resnet50",
           "AUTOTUNE_JPEG_SIZE": "32" if tiny else "224", "AUTOTUNE_JPEG_EVAL": "64" if tiny else "512"}
    base = TrialConfig(precision=args.precision or ("fp32" if tiny else "bf16"), batch_size=batch,
                       channels_last=not tiny, cudnn_benchmark=not tiny)
    images = len(list_images(args.root).samples)
    out = Path(args.out)
    logs = Path(args.logs)
    caps = probe()
    started = time.perf_counter()

    def run(func: str, config: TrialConfig, name: str) -> TrialOutcome:
        spec = TrialSpec(f"{WORKLOAD}:{func}", config, budget, baseline_batch_size=batch, env=env)
        outcome = run_isolated(spec, workdir=logs / name, timeout=args.trial_timeout)
        print(f"{name}: {_rate(outcome)} img/s ({outcome.wall_seconds:.0f} s)", flush=True)
        return outcome

    synthetic = run("train_synthetic", base, "synthetic")
    rows: list[Row] = []
    for n in workers:
        config = base.replace(loader="torch", num_workers=n, pin_memory=caps.cuda, persistent_workers=n > 0)
        rows.append(Row("torch", f"workers={n}", config, run("loader_only", config, f"torch-{n}-alone"),
                        run("train", config, f"torch-{n}-train")))
    for n in threads:
        config = base.replace(loader="dali", dali_threads=n, dali_prefetch=args.dali_prefetch)
        rows.append(Row("dali", f"threads={n}", config, run("loader_only", config, f"dali-{n}-alone"),
                        run("train", config, f"dali-{n}-train")))
    wall = time.perf_counter() - started
    text = report(rows, synthetic, caps=caps, base=base, budget=budget, images=images, root=args.root, wall=wall,
                  tiny=tiny)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)


def report(rows: list[Row], synthetic: TrialOutcome, *, caps, base: TrialConfig, budget: Budget, images: int,
           root: str, wall: float, tiny: bool) -> str:
    """The markdown table, with the winner by training throughput."""
    ceiling = synthetic.measurement.throughput if synthetic.measurement else None
    device = caps.device_label
    dali = caps.extras.get("dali_version") or caps.extras.get("dali_reason", "?")
    lines = [
        f"# torch DataLoader vs DALI on JPEGs{' (tiny CPU check)' if tiny else ''}",
        "",
        f"Date: {datetime.date.today()}; device: {device}{f' with {caps.cpu_count} CPU cores' if caps.cuda else ''}; "
        f"torch {caps.torch}; "
        f"DALI {dali}. Data: {images} JPEGs in `{Path(root).name}` (benchmarks/workloads/make_jpegs.py). Model: "
        f"{'tiny CNN, 32-pixel crops' if tiny else 'ResNet-50, 224-pixel crops'}; compute config "
        f"{base.precision}, batch {base.batch_size}, {'channels_last' if base.channels_last else 'NCHW'}, eager. "
        f"Each cell is one isolated trial: {budget.samples} images, {budget.warmup_steps} warm-up steps, "
        f"median of {budget.windows} timed windows. Whole run {wall:.0f} s.",
        "",
        f"Synthetic data on the device (the compute ceiling): {_rate(synthetic)} img/s.",
        "",
        "| backend | setting | loader alone img/s | training img/s | training data wait | training / synthetic |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        m = row.training.measurement
        wait = f"{m.data_wait_fraction:.0%}" if m else "-"
        share = f"{m.throughput / ceiling:.0%}" if m and ceiling else "-"
        lines.append(f"| {row.backend} | {row.knob} | {_rate(row.alone)} | {_rate(row.training)} | {wait} | {share} |")
    measured = [r for r in rows if r.training.measurement]
    if measured:
        best = max(measured, key=lambda r: r.training.measurement.throughput)  # type: ignore[union-attr]
        per_backend = {}
        for r in measured:
            rate = r.training.measurement.throughput  # type: ignore[union-attr]
            per_backend[r.backend] = max(per_backend.get(r.backend, 0.0), rate)
        lines += ["", f"Highest training throughput: **{best.backend}** ({best.knob}), "
                  f"{best.training.measurement.throughput:,.0f} img/s; best per backend: "  # type: ignore[union-attr]
                  + ", ".join(f"{k} {v:,.0f}" for k, v in sorted(per_backend.items())) + "."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
