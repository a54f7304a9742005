"""Shortened evidence as a prefix of the schedule or as a whole shorter schedule: how the verdict reads each.

    python -m benchmarks.runners.schedule_evidence --seeds 20 --out benchmarks/results/schedule-evidence-cpu.md

Under a budget the references and every trial train fewer samples than the space's. They can train the start
of the space's schedule (a prefix: ``ctx.optimizer_steps`` keeps the space's length) or a whole schedule of the
shorter length (``ctx.optimizer_steps`` spans what they train). This runs ``benchmarks/workloads/planted.py``'s
OneCycle variants in this process through the real trial entry point, on the CPU, at a global batch of 64:
the space's length is ``SPACE_SAMPLES`` and the budget's a quarter of it. Per study seed and way: fp32
references at seeds s and s+1, and bf16 at seed s, of the clean model (a verdict other than ``equivalent`` or
``unchecked`` is a false alarm) and of the harmed one at three offsets (``equivalent`` is a miss). The verdict is
the study's (``judge``: paired at the seed, the band where the pairing decayed within the margin), with the
metric (held-out R²) and on the loss alone.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time
from collections import Counter
from pathlib import Path

import torch

from autotune._config import Budget, Measurement, TrialConfig
from autotune.study._verdict import ReferenceBand, fingerprints, judge
from autotune.trial._execute import TrialSpec, execute
from benchmarks.workloads import planted

GLOBAL = 64
SPACE_SAMPLES = 12288  # 192 steps
SHORT_SAMPLES = SPACE_SAMPLES // 4  # 48 steps: a quarter, as a 4-minute budget left ConvNeXt-T (60 of 240)
WAYS = {
    "prefix": Budget(samples=SHORT_SAMPLES, warmup_steps=2, windows=3, schedule_samples=SPACE_SAMPLES),
    "whole": Budget(samples=SHORT_SAMPLES, warmup_steps=2, windows=3),
    "full length": Budget(samples=SPACE_SAMPLES, warmup_steps=2, windows=3),
}
FP32 = TrialConfig(batch_size=GLOBAL, global_batch=GLOBAL)
MODELS = [("clean", "train_clean_onecycle", 0.0), ("harmed, offset 256", "train_harmed_onecycle", 256.0),
          ("harmed, offset 64", "train_harmed_onecycle", 64.0), ("harmed, offset 16", "train_harmed_onecycle", 16.0)]


def _run(fn: str, config: TrialConfig, budget: Budget, seed: int, offset: float) -> Measurement:
    os.environ["AUTOTUNE_PLANTED_OFFSET"] = str(offset)
    outcome = execute(TrialSpec(f"{planted.__file__}:{fn}", config, budget, seed=seed, baseline_batch_size=GLOBAL))
    if not outcome.ok:
        raise SystemExit(f"{fn} {config.describe()} seed {seed}: {outcome.status} {outcome.error}")
    return outcome.measurement


def _verdict(trial: Measurement, refs: list[Measurement], *, metric: bool) -> str:
    if not metric:
        refs = [Measurement.from_dict({**r.to_dict(), "metric": None}) for r in refs]
    band = ReferenceBand.of_measurements(refs)
    return judge(trial.losses, trial.metric if metric else None, band,
                 reference_metric=refs[0].metric, max_accuracy_loss=0.01,
                 loss_every=trial.loss_every, pairing=fingerprints(trial.extras), precision="bf16").label


def collect(seeds: int) -> dict[tuple[str, str], dict[str, Counter]]:
    counts: dict[tuple[str, str], dict[str, Counter]] = {}
    for seed in range(0, 2 * seeds, 2):
        for way, budget in WAYS.items():
            for name, fn, offset in MODELS:
                refs = [_run(fn, FP32, budget, seed + r, offset) for r in range(2)]
                trial = _run(fn, FP32.replace(precision="bf16"), budget, seed, offset)
                cell = counts.setdefault((name, way), {"metric": Counter(), "loss": Counter()})
                cell["metric"][_verdict(trial, refs, metric=True)] += 1
                cell["loss"][_verdict(trial, refs, metric=False)] += 1
    return counts


def _wrong(name: str, labels: Counter) -> int:
    if name == "clean":
        return labels["degraded"] + labels["diverged"]
    return labels["equivalent"]


def report(counts: dict[tuple[str, str], dict[str, Counter]], seeds: int, command: str, seconds: float) -> str:
    rows = ["| model | evidence | with the metric: verdicts | wrong | loss alone: verdicts | wrong |",
            "|---|---|---|---:|---|---:|"]
    for (name, way), cell in counts.items():
        words = {k: ", ".join(f"{label} {n}" for label, n in sorted(c.items())) for k, c in cell.items()}
        rows.append(f"| {name} | {way} | {words['metric']} | {_wrong(name, cell['metric'])} | {words['loss']} | "
                    f"{_wrong(name, cell['loss'])} |")
    return "\n".join([
        "# Shortened evidence: a prefix of the schedule or a whole shorter schedule (CPU)",
        "",
        f"Command: `{command}`. Date {datetime.date.today()}; {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores (shared with other jobs); torch {torch.__version__}; {seconds:,.0f} s. "
        f"{seeds} study seeds per row; OneCycle max_lr {planted.ONECYCLE_MAX_LR:g}; the space's length "
        f"{SPACE_SAMPLES:,} samples ({SPACE_SAMPLES // GLOBAL} steps), shortened to {SHORT_SAMPLES:,} "
        f"({SHORT_SAMPLES // GLOBAL} steps).",
        "",
        "'wrong': on the clean model, `degraded` or `diverged` (a false alarm); on a harmed one, `equivalent` (a "
        "miss). `unchecked` is neither: the check could not vouch.",
        "",
        *rows,
        "",
    ])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    began = time.perf_counter()
    counts = collect(args.seeds)
    command = f"python -m benchmarks.runners.schedule_evidence --seeds {args.seeds} --out {args.out}"
    text = report(counts, args.seeds, command, time.perf_counter() - began)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
