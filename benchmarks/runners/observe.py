"""A short ResNet-50 study with the NVML monitor on, then its report and the diagnosis of every trial.

    python -m benchmarks.runners.observe OUT_DIR            # one GPU: 8 eager trials, under 6 minutes on an H200
    python -m benchmarks.runners.observe OUT_DIR --tiny     # the demo's small CNN on the CPU: the script end to end

Not a test. The trials are enqueued, not sampled, so that the study has the cases the diagnosis tells
apart: the loader workload with no worker (input-bound), bf16 channels_last batch 256 with 8 pinned
workers (compute-bound), a small batch with and without CUDA Graphs (launch-bound, and the comparison
that confirms it), and a big fp32 batch under a 5% memory fraction (out of memory) beside a small one
that fits (memory-capacity-bound). Trials are short (6,144 samples), so the accuracy check is switched
off by default (--max-accuracy-loss 1): the point here is what held each trial back.

OUT_DIR gets report.html and its PNGs, diagnosis.md (the summary, the diagnosis table and every trial's
NVML readings) and observe.db, a copy of the study's SQLite database.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

import optuna

from autotune import ReportError, TrialConfig, Tuner, load_space
from autotune.insight._diagnose import diagnose_study, gpu_reading
from autotune.insight._report import diagnosis_table_markdown, summary_lines, write_report

HERE = Path(__file__).resolve().parent
GPU_TARGET = f"{HERE.parent / 'workloads' / 'resnet50.py'}:train_loader"
TINY_TARGET = "autotune.demo:train"

# Each entry changes the space's baseline (fp32 bs64, no worker, eager); the reference run is trial 0.
GPU_TRIALS = [
    {"precision": "bf16", "batch_size": 256, "channels_last": True},  # loads in the main process: input-bound
    {"precision": "bf16", "batch_size": 256, "channels_last": True, "num_workers": 8, "pin_memory": True},
    {"precision": "bf16", "batch_size": 256, "channels_last": True, "num_workers": 8, "pin_memory": True,
     "cuda_graphs": True},
    {"precision": "bf16", "batch_size": 32, "channels_last": True, "num_workers": 8, "pin_memory": True},
    {"precision": "bf16", "batch_size": 32, "channels_last": True, "num_workers": 8, "pin_memory": True,
     "cuda_graphs": True},
    {"batch_size": 512, "num_workers": 8, "pin_memory": True, "memory_fraction": 0.05},  # out of memory
    {"batch_size": 32, "num_workers": 8, "pin_memory": True, "memory_fraction": 0.05},  # fits under the cap
]
TINY_TRIALS = [
    {"batch_size": 128},
    {"batch_size": 64, "num_workers": 1},
    {"batch_size": 32, "channels_last": True},
]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--tiny", action="store_true", help="the demo's small CNN and a 12-config space (CPU)")
    parser.add_argument("--studies-dir", type=Path, default=Path("studies"))
    parser.add_argument("--timeout", type=float, default=300.0, help="start no trial after this many seconds")
    parser.add_argument("--trial-timeout", type=float, default=240.0)
    parser.add_argument("--max-accuracy-loss", type=float, default=1.0)
    args = parser.parse_args(argv)
    if args.tiny:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the demo trains ResNet-50 when it sees a GPU; tiny means CPU

    space = load_space(HERE / ("observe_tiny.yaml" if args.tiny else "observe_resnet50.yaml"))
    target = TINY_TARGET if args.tiny else GPU_TARGET
    trials = TINY_TRIALS if args.tiny else GPU_TRIALS
    name = f"observe-{'tiny' if args.tiny else 'resnet50'}-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    storage = f"sqlite:///{args.studies_dir / 'observe.db'}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    options: dict[str, Any] = dict(
        space=space, study_name=name, storage=storage, studies_dir=args.studies_dir, n_trials=1 + len(trials),
        reference_repeats=1, top_k=0,
        trial_timeout=args.trial_timeout, max_accuracy_loss=args.max_accuracy_loss, progress=False,
        prune_below=0.0,  # every trial runs its whole budget, so each is diagnosed from full windows
    )
    started = time.monotonic()
    Tuner(target, mode="create", **options).run()  # the study and its fp32 reference run (trial 0)
    study = optuna.load_study(study_name=name, storage=storage)
    for changes in trials:
        config = space.baseline.replace(**changes)
        study.enqueue_trial(space.asked_params(config.to_dict()))
    remaining = max(1.0, args.timeout - (time.monotonic() - started))
    Tuner(target, timeout=remaining, **options).run()
    wall = time.monotonic() - started

    study = optuna.load_study(study_name=name, storage=storage)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    try:
        report = write_report(study, studies_dir=args.studies_dir, out_dir=args.out_dir)
        written = f"{report.html}, {len(report.pngs)} PNGs"
    except ReportError as exc:  # e.g. a GPU host without plotly/matplotlib: `autotune report` on the copy later
        written = f"no report ({exc})"
    markdown = args.out_dir / "diagnosis.md"
    markdown.write_text(document(study, wall, args))
    with sqlite3.connect(args.studies_dir / "observe.db") as source, sqlite3.connect(args.out_dir / "observe.db") as copy:
        source.backup(copy)  # consistent even with the WAL the tuner keeps
    print(markdown.read_text())
    print(f"wrote {written}, {markdown} and {args.out_dir / 'observe.db'} "
          f"(study {name}, {wall / 60:.1f} min)")
    return 0


def document(study: optuna.Study, wall: float, args: argparse.Namespace) -> str:
    hw = study.user_attrs.get("hardware", {})
    device = hw.get("gpu_name") or f"CPU ({hw.get('cpu_count')} cores)"
    diagnoses = diagnose_study(study)
    lines = [
        f"# What held each trial back: {'the demo CNN' if args.tiny else 'ResNet-50'} on {device}",
        "",
        f"- Date {datetime.date.today()}; {device}" + (f", driver {hw['driver']}" if hw.get("driver") else "")
        + f"; torch {hw.get('torch', '?')}",
        f"- Command: `python -m benchmarks.runners.observe {args.out_dir}{' --tiny' if args.tiny else ''}`; study "
        f"`{study.study_name}` (copy: `observe.db`); {len(study.trials)} trials in {wall / 60:.1f} min",
        f"- Budget per trial: {study.user_attrs['space']['budget']}; one fp32 reference run (no noise band); "
        f"accuracy bound {study.user_attrs.get('max_accuracy_loss')}",
        "",
        *[f"- {line}" for line in summary_lines(study, diagnoses)],
        "",
        "## Diagnosis",
        "",
        diagnosis_table_markdown(study, diagnoses),
        "## NVML readings during the timed windows",
        "",
        "| # | config | util mean % | util p5 % | SM MHz | power W | PCIe RX MB/s | PCIe TX MB/s | throttled | reasons |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    reference_extras = (study.user_attrs.get("reference_measurement") or {}).get("extras") or {}
    for t in study.get_trials(deepcopy=False):
        a = dict(t.user_attrs)
        if a.get("role") == "reference":
            a.update({f"extra:{k}": v for k, v in reference_extras.items()})
        if "config" not in a:
            continue
        cells = [gpu_reading(a, k) for k in ("gpu_util_pct.mean", "gpu_util_pct.p5", "sm_clock_mhz.mean", "power_w.mean",
                                             "pcie_rx_mb_s.mean", "pcie_tx_mb_s.mean", "throttle_fraction")]
        reasons = ", ".join(gpu_reading(a, "throttle_reasons") or [])
        shown = " | ".join("" if c is None else f"{c:,.2f}" if isinstance(c, float) else str(c) for c in cells)
        lines.append(f"| {t.number} | {TrialConfig.from_dict(a['config']).describe()} | {shown} | {reasons} |")
    if not any(gpu_reading(t.user_attrs, "samples") for t in study.trials) and not reference_extras:
        lines += ["", "No NVML readings: the trials ran without a GPU."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # trial processes start from a forkserver, which re-imports the main module
    sys.exit(main(sys.argv[1:]))
