"""Tune ResNet-50 on one GPU with autotune and report what the tuner found and what it cost.

    python -m benchmarks.resnet50 --trials 20 --timeout 900 --out benchmarks/results/resnet50-h200.md

Not a test. Prints and writes a markdown table: baseline and best throughput, speed-up, trials used,
wall time of the whole run, time to reach 95% of the final best, per-trial overhead, and the top-K
confirmation; the study's best_config.json lands in studies/<study>/.
"""

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import optuna

import autotune
from autotune._api import load_study_result

WORKLOADS = Path(__file__).with_name("resnet50_workload.py")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", choices=("device", "loader"), default="device")
    parser.add_argument("--space", default="resnet50_h200")
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--studies-dir", default="studies")
    parser.add_argument("--storage", default=None)
    parser.add_argument("--out", default="resnet50.md")
    parser.add_argument("--confirm-rounds", type=int, default=3)
    parser.add_argument("--trial-timeout", type=float, default=600.0)
    args = parser.parse_args()

    study_name = f"resnet50-{args.variant}-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    start = time.time()
    result = autotune.run(
        f"{WORKLOADS}:train_{args.variant}",
        space=args.space,
        n_trials=args.trials,
        timeout=args.timeout,
        study_name=study_name,
        storage=args.storage,
        studies_dir=args.studies_dir,
        top_k=3,
        confirm_rounds=args.confirm_rounds,
        trial_timeout=args.trial_timeout,
        progress=False,
    )
    wall = time.time() - start
    study, _ = load_study_result(study_name, storage=args.storage, studies_dir=args.studies_dir)
    print(report(study, result, wall, args))


def report(study: optuna.Study, result: autotune.Result, wall: float, args: argparse.Namespace) -> str:
    trials = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    created = min(t.datetime_start for t in trials)
    best = result.best
    t95 = None
    if best is not None:
        for t in sorted(trials, key=lambda t: t.datetime_complete):
            if t.user_attrs.get("status") == "ok" and t.values[0] >= 0.95 * best.throughput:
                t95 = (t.datetime_complete - created).total_seconds()
                break
    overheads = [
        (t.user_attrs["wall_seconds"] - t.user_attrs.get("run_seconds", 0.0)) / t.user_attrs["wall_seconds"]
        for t in trials if t.user_attrs.get("wall_seconds")
    ]
    hw = study.user_attrs["hardware"]
    lines = [
        f"# ResNet-50 on {hw['gpu_name']}: what autotune found",
        "",
        f"- Date: {datetime.date.today()}; GPU {hw['gpu_name']} (driver {hw['driver']}); torch {hw['torch']}",
        f"- Command: `python -m benchmarks.resnet50 --variant {args.variant} --space {args.space} --trials {args.trials}"
        + (f" --timeout {args.timeout:.0f}" if args.timeout else "")
        + f" --confirm-rounds {args.confirm_rounds} --trial-timeout {args.trial_timeout:.0f}`",
        f"- Study `{study.study_name}`; budget per trial: {study.user_attrs['space']['budget']}",
        "",
        "| quantity | value |",
        "|---|---|",
        f"| baseline (fp32, bs64, eager) | {result.baseline_throughput:,.0f} img/s |",
        f"| best found | {best.throughput:,.0f} img/s: `{best.config.describe()}` (trial #{best.number})" if best else "| best found | none |",
        f"| speed-up | {result.speedup:.2f}x |",
        f"| trials used | {len(trials)} (+{len(study.user_attrs.get('reference_metrics', []))} reference runs) |",
        f"| wall time of the whole run | {wall / 60:.1f} min |",
        f"| time to 95% of the final best | {t95 / 60:.1f} min |" if t95 is not None else "| time to 95% | n/a |",
        f"| per-trial overhead (process start, import, teardown) / trial wall | median {statistics.median(overheads) * 100:.1f}% |" if overheads else "",
        "",
        "| # | status | config | img/s | spread | compile s | wall s | accuracy loss |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for t in trials:
        a = t.user_attrs
        cfg = autotune.TrialConfig.from_dict(a["config"]).describe()
        lines.append(
            f"| {t.number} | {a.get('status')} | {cfg} | {t.values[0]:,.0f} | "
            f"{a.get('throughput_spread', float('nan')) * 100:.1f}% | {a.get('compile_seconds', 0):.1f} | "
            f"{a.get('wall_seconds', 0):.0f} | {t.values[1]:.3f} |"
        )
    confirmation = study.user_attrs.get("top_k_confirmation")
    if confirmation:
        lines += ["", "Top-K re-measurement in alternation (img/s per round, median):", ""]
        for number, values in confirmation["throughputs"].items():
            spread = (max(values) - min(values)) / statistics.median(values) * 100 if values else float("nan")
            lines.append(f"- trial #{number}: {', '.join(f'{v:,.0f}' for v in values)}; median "
                         f"{statistics.median(values):,.0f}; spread {spread:.1f}%")
    text = "\n".join(line for line in lines if line is not None) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    (Path(args.out).with_suffix(".json")).write_text(json.dumps(study.user_attrs, indent=2, default=str))
    return text


if __name__ == "__main__":
    main()
