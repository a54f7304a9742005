"""Tune ResNet-50 on one GPU with autotune and report what the tuner found and what it cost.

    python -m benchmarks.runners.resnet50 --space gpu_default --trials 30 --timeout 1200 --trial-timeout 150 \
        --study r50 --out benchmarks/results/resnet50-h200.md

Not a test. Prints and writes a markdown table: baseline and best throughput, speed-up, trials used,
wall time of the whole run, time to reach 95% of the final best, per-trial overhead, the compile time of
the best config and the training length at which it pays off, the top-K confirmation, and the best config
repeated ``--repeat`` times as isolated trials with its spread; the study's best_config.json lands in
studies/<study>/. Rerunning with the same ``--study`` resumes it (e.g. when one call may not run longer
than a few minutes), and the report covers the whole study; ``--timeout`` then counts per call.
"""

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path
from typing import Optional

import optuna

import autotune
from autotune._api import load_study_result
from autotune.trial._execute import TrialSpec
from autotune.study._isolation import run_isolated

WORKLOADS = Path(__file__).resolve().parents[1] / "workloads" / "resnet50.py"


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
    parser.add_argument("--study", help="study name; an existing one is resumed")
    parser.add_argument("--repeat", type=int, default=3, help="isolated reruns of the best config (0: none)")
    parser.add_argument("--report-only", action="store_true", help="report on --study without running trials")
    parser.add_argument("--accuracy-reference", choices=("baseline", "batch"), default="baseline")
    args = parser.parse_args()

    study_name = args.study or f"resnet50-{args.variant}-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    start = time.time()
    if args.report_only:
        study, result = load_study_result(study_name, storage=args.storage, studies_dir=args.studies_dir)
        print(report(study, result, float("nan"), args, repeats(study, result, args)))
        return
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
        accuracy_reference=args.accuracy_reference,
        trial_timeout=args.trial_timeout,
        progress=False,
    )
    wall = time.time() - start
    study, _ = load_study_result(study_name, storage=args.storage, studies_dir=args.studies_dir)
    # A run resumed over several calls: the report adds up every call's tuner wall time.
    study.set_user_attr("benchmark_calls", study.user_attrs.get("benchmark_calls", []) + [
        {"started": datetime.datetime.fromtimestamp(start).isoformat(timespec="seconds"), "seconds": round(wall, 1),
         "timeout": args.timeout, "confirm_rounds": args.confirm_rounds}])
    print(report(study, result, wall, args, repeats(study, result, args)))


def repeats(study: optuna.Study, result: autotune.Result, args: argparse.Namespace) -> list[dict]:
    """The best config (and, if it compiles, its eager twin for the break-even) as fresh isolated trials."""
    best = result.best
    if best is None or args.repeat < 1:
        return []
    space = autotune.load_space(args.space)
    runs = [("best", best.config)] * args.repeat
    if best.config.compile != "off":
        runs.append(("eager twin", best.config.replace(compile="off")))
    out = []
    for i, (role, config) in enumerate(runs):
        spec = TrialSpec(f"{WORKLOADS}:train_{args.variant}", config, space.budget,
                         baseline_batch_size=space.baseline.batch_size)
        o = run_isolated(spec, workdir=Path(args.studies_dir) / study.study_name / "repeats" / str(i),
                         timeout=args.trial_timeout)
        m = o.measurement
        out.append({"role": role, "config": config.describe(), "status": o.status,
                    "throughput": m.throughput if m else None, "spread": m.spread if m else None,
                    "compile_seconds": m.compile_seconds if m else None,
                    "sm_clock": m.extras.get("gpu.sm_clock_mhz.mean") if m else None})
        print(out[-1], flush=True)
    return out


def _break_even(best_rate: float, compile_s: float, eager_rate: float) -> str:
    if not (best_rate and eager_rate) or best_rate <= eager_rate:
        return "compile does not pay off: the eager twin is as fast"
    saved_per_sample = 1 / eager_rate - 1 / best_rate
    samples = compile_s / saved_per_sample
    return (f"{compile_s:.0f} s of compile pays off after {samples:,.0f} samples "
            f"({samples / best_rate / 60:.1f} min of training at {best_rate:,.0f} img/s)")


def _break_even_lines(study: optuna.Study, best_number: int, reruns: list[dict], best_rate: float,
                      eager_rate: float) -> list[str]:
    """Break-even of the best config's compile, and of a compile on a cold inductor cache.

    Inductor caches kernels on disk across trials, so the best config's own compile may be cheap because
    an earlier trial compiled much the same graph; the study's first compile is the cold-cache figure.
    """
    own = max([study.trials[best_number].user_attrs.get("compile_seconds", 0.0)]
              + [(r["compile_seconds"] or 0.0) for r in reruns if r["role"] == "best"])
    lines = [f"- break-even: {_break_even(best_rate, own, eager_rate)} (this config's own compile in the study)"]
    compiled = [t for t in study.trials if t.params.get("compile", "off") != "off"
                and t.user_attrs.get("compile_seconds", 0.0) > 0]
    if compiled and compiled[0].number != best_number:
        cold = compiled[0].user_attrs["compile_seconds"]
        lines.append(f"- break-even on a cold compile cache: {_break_even(best_rate, cold, eager_rate)} "
                     f"(the study's first compile, trial #{compiled[0].number})")
    return lines


def _calls_line(calls: list[dict]) -> Optional[str]:
    if not calls:
        return None
    total = sum(c["seconds"] for c in calls)
    parts = ", ".join(f"{c['seconds'] / 60:.1f} min (--timeout {c['timeout']}, --confirm-rounds {c['confirm_rounds']})"
                      for c in calls)
    return f"| tuner wall time, all calls of this study | {total / 60:.1f} min: {parts} |"


def report(study: optuna.Study, result: autotune.Result, wall: float, args: argparse.Namespace,
           reruns: list[dict]) -> str:
    trials = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    created = min(t.datetime_start for t in trials)
    span = (max(t.datetime_complete for t in trials) - created).total_seconds()
    best = result.best
    t95 = None
    if best is not None:
        for t in sorted(trials, key=lambda t: t.datetime_complete):
            if t.user_attrs.get("status") == "ok" and t.values[0] >= 0.95 * best.throughput:
                t95 = (t.datetime_complete - created).total_seconds()
                break
    # Everything in a trial's life (ask to tell) that is not train_fn running: sampling, storage, the
    # trial process's start and teardown, loading the target. A per-batch fp32 reference that ran inside
    # the ask-to-tell (--accuracy-reference batch) is a reference run, reported on its own line.
    def trial_wall(t: optuna.trial.FrozenTrial) -> float:
        ask_to_tell = (t.datetime_complete - t.datetime_start).total_seconds()
        return ask_to_tell - t.user_attrs.get("reference_seconds", 0.0)

    overheads = [
        1 - t.user_attrs["run_seconds"] / trial_wall(t)
        for t in trials if t.user_attrs.get("run_seconds") and t.datetime_complete and t.datetime_start
        and "duplicate_of" not in t.user_attrs and trial_wall(t) > 0
    ]
    batch_reference_seconds = [t.user_attrs["reference_seconds"] for t in trials if "reference_seconds" in t.user_attrs]
    hw = study.user_attrs["hardware"]
    lines = [
        f"# ResNet-50 on {hw['gpu_name']}: what autotune found",
        "",
        f"- Date: {datetime.date.today()}; GPU {hw['gpu_name']} (driver {hw['driver']}); torch {hw['torch']}",
        (f"- Command: `python -m benchmarks.runners.resnet50 --study {study.study_name} --report-only --repeat {args.repeat}` "
         "(the tuning calls are listed under the tuner's wall time)" if args.report_only else
         f"- Command: `python -m benchmarks.runners.resnet50 --variant {args.variant} --space {args.space} --trials {args.trials}"
         + (f" --timeout {args.timeout:.0f}" if args.timeout else "")
         + f" --confirm-rounds {args.confirm_rounds} --trial-timeout {args.trial_timeout:.0f}"
         + f" --accuracy-reference {study.user_attrs.get('accuracy_reference', 'baseline')}`"),
        f"- Study `{study.study_name}`; budget per trial: {study.user_attrs['space']['budget']}",
        "",
        "| quantity | value |",
        "|---|---|",
        f"| baseline (fp32, bs64, eager) | {result.baseline_throughput:,.0f} img/s |",
        f"| best found | {best.throughput:,.0f} img/s: `{best.config.describe()}` (trial #{best.number}) |" if best else "| best found | none |",
        f"| speed-up | {result.speedup:.2f}x |",
        f"| trials used | {len(trials)} (+{len(study.user_attrs.get('reference_metrics', []))} reference runs) |",
        f"| wall time of the whole run (this call) | {wall / 60:.1f} min |" if wall == wall else None,
        _calls_line(study.user_attrs.get("benchmark_calls", [])),
        f"| study span, first trial start to last trial end | {span / 60:.1f} min |",
        f"| time to 95% of the final best | {t95 / 60:.1f} min |" if t95 is not None else "| time to 95% | n/a |",
        f"| per-trial overhead (sampling, storage, process start and teardown) / trial wall, ask to tell | median {statistics.median(overheads) * 100:.1f}%, max {max(overheads) * 100:.1f}% |" if overheads else None,
        f"| fp32 references at the trials' batch sizes (--accuracy-reference batch) | {len(batch_reference_seconds)} batch "
        f"sizes, one run per seed each, {sum(batch_reference_seconds) / 60:.1f} min |" if batch_reference_seconds else None,
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
    if reruns:
        rates = [r["throughput"] for r in reruns if r["role"] == "best" and r["throughput"]]
        lines += ["", f"The best config again, {len(rates)} isolated trials (img/s, window spread, SM MHz):", ""]
        for r in reruns:
            rate = f"{r['throughput']:,.0f}" if r["throughput"] else r["status"]
            spread = f"{r['spread'] * 100:.1f}%" if r["spread"] is not None else "-"
            lines.append(f"- {r['role']}: `{r['config']}`: {rate}; spread {spread}; SM {r['sm_clock'] or '-'} MHz")
        if len(rates) >= 2:
            lines.append(f"- repeat spread (max - min) / median: "
                         f"{(max(rates) - min(rates)) / statistics.median(rates) * 100:.2f}%")
        twin = next((r for r in reruns if r["role"] == "eager twin" and r["throughput"]), None)
        if twin and rates and best:
            lines += _break_even_lines(study, best.number, reruns, statistics.median(rates), twin["throughput"])
    text = "\n".join(line for line in lines if line is not None) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    (Path(args.out).with_suffix(".json")).write_text(json.dumps(study.user_attrs, indent=2, default=str))
    return text


if __name__ == "__main__":
    main()
