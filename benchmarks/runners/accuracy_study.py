"""Run one tuner study and write what its accuracy verdict decided, trial by trial.

    python -m benchmarks.runners.accuracy_study --target autotune.demo:train --space demo_gpu \
        --study demo-h200 --trials 8 --out OUT.md
    python -m benchmarks.runners.accuracy_study --report-only --study demo-h200 --out OUT.md

The table lists every trial with its config (micro-batch x accumulation = global batch), throughput,
accuracy verdict and its evidence, and the markdown ends with the recommendation against the fastest
config the verdict called equivalent (the issue's "within 5%" question). ``--batch-policy`` overrides the
space's. Rerunning with the same ``--study`` resumes it; ``--report-only`` writes the report alone.
"""

from __future__ import annotations

import argparse
import datetime
import platform
from pathlib import Path

import optuna
from optuna.trial import TrialState

import autotune
from autotune._api import load_study_result
from autotune._config import TrialConfig
from autotune.insight._accuracy import accuracy_lines
from autotune.study._references import judge_stored
from autotune.study._verdict import wander


def verdict_table(study: optuna.Study) -> list[str]:
    rows = ["| trial | config | samples/s | verdict | evidence |", "|---:|---|---:|---|---|"]
    for t in study.get_trials(deepcopy=False):
        a = t.user_attrs
        if "config" not in a or a.get("status") == "infeasible":
            continue
        config = TrialConfig.from_dict(a["config"]).describe()
        verdict = a.get("accuracy_verdict") or (a.get("status") if a.get("status") != "ok" else "")
        evidence = a.get("accuracy_evidence") or a.get("error") or a.get("pruned_reason") or ""
        rate = a.get("throughput") or 0.0
        rows.append(f"| {t.number} | `{config}` | {rate:,.1f} | {verdict} | {evidence[:220]} |")
    return rows


def rejudge(study: optuna.Study) -> list[str]:
    """Every measured trial judged again, from its stored trajectory and the stored reference bands, by the
    current verdict rules: what a study recorded under older rules reads under the new ones."""
    attrs = dict(study.user_attrs)
    band, curves = attrs.get("reference_band"), attrs.get("reference_curves") or []
    if band is not None and band.get("seed_wander") is None and len(curves) >= 2 and len(curves[0]) == len(curves[1]):
        # A study stored before the band kept the seeds' wander: the two seeds' stored curves give it.
        attrs["reference_band"] = {**band, "seed_wander": wander(curves[1], curves[0])}
    base = TrialConfig.from_dict(attrs["baseline_config"]).global_batch_size
    rows = ["| trial | config | as run | judged again | evidence (judged again) |", "|---:|---|---|---|---|"]
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        a = t.user_attrs
        if a.get("status") != "ok" or "config" not in a:
            continue
        config = TrialConfig.from_dict(a["config"])
        verdict = judge_stored(attrs, config, a.get("losses") or [], a.get("metric"), baseline_global_batch=base,
                               max_accuracy_loss=attrs.get("max_accuracy_loss", 0.01),
                               metric_direction=attrs.get("metric_direction", "maximize"),
                               loss_every=a.get("loss_every", 1),
                               extras={k[len("extra:"):]: v for k, v in a.items() if k.startswith("extra:")})
        rows.append(f"| {t.number} | `{config.describe()}` | {a.get('accuracy_verdict', '')} | {verdict.label} | "
                    f"{verdict.evidence[:220]} |")
    return rows


def fastest_equivalent(study: optuna.Study) -> tuple[int, float] | None:
    """The fastest single measurement the verdict called equivalent (trial number, samples/s)."""
    best = None
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        a = t.user_attrs
        if a.get("status") == "ok" and a.get("accuracy_verdict") == "equivalent" and "duplicate_of" not in a:
            if best is None or a["throughput"] > best[1]:
                best = (t.number, a["throughput"])
    return best


def minutes_to_95(study: optuna.Study, result: autotune.Result) -> float | None:
    """Minutes from the study's start (its reference runs included) until a trial reached 95% of the best."""
    if result.best is None:
        return None
    created = datetime.datetime.fromisoformat(study.user_attrs["created"])
    start = created - datetime.timedelta(seconds=float(study.user_attrs.get("reference_seconds") or 0.0))
    for t in sorted(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)), key=lambda t: t.number):
        if t.user_attrs.get("status") == "ok" and t.user_attrs.get("accuracy_verdict") != "degraded" \
                and t.user_attrs.get("throughput", 0.0) >= 0.95 * result.best.throughput and t.datetime_complete:
            end = t.datetime_complete.astimezone() if t.datetime_complete.tzinfo is None else t.datetime_complete
            return max(0.0, (end - start).total_seconds()) / 60
    return None


def report(study: optuna.Study, result: autotune.Result, args: argparse.Namespace) -> str:
    hw = study.user_attrs.get("hardware", {})
    lines = [
        f"## Study `{study.study_name}`: `{study.user_attrs.get('target')}`, space `{study.user_attrs.get('space_name')}`",
        "",
        f"Date {datetime.date.today()}; {hw.get('gpu_name') or 'CPU'} (driver {hw.get('driver') or '-'}); "
        f"torch {hw.get('torch')}; Python {hw.get('python') or platform.python_version()}; optuna {optuna.__version__}.",
        "",
        *[f"- {line}" for line in accuracy_lines(study, result.best.number if result.best else None)],
        "",
        *verdict_table(study),
        "",
    ]
    fastest = fastest_equivalent(study)
    if result.best is not None and fastest is not None:
        number, rate = fastest
        measured = ("after the top-K re-measurement" if study.user_attrs.get("top_k_confirmation")
                    else "a single measurement: the top-K re-measurement did not finish")
        lines.append(f"Recommended: trial #{result.best.number} `{result.best.config.describe()}` at "
                     f"{result.best.throughput:,.1f} samples/s ({measured}), "
                     f"{result.best.throughput / rate:.1%} of the fastest single measurement the verdict called "
                     f"equivalent (#{number}, {rate:,.1f}); baseline {result.baseline_throughput:,.1f}, "
                     f"{result.speedup:.2f}x.")
    to_95 = minutes_to_95(study, result)
    if to_95 is not None:
        lines.append(f"Minutes to 95% of the best: {to_95:.1f} (from the first reference run to the end of the first "
                     "trial within 5% of the recommended config's throughput).")
    plan = study.user_attrs.get("compile_break_even") or {}
    for mode, m in (plan.get("modes") or {}).items():
        lines.append(f"Compile mode `{mode}`: {'kept' if m['kept'] else 'removed'} ({m['reason']}).")
    timeouts = [t.number for t in study.get_trials(deepcopy=False) if t.user_attrs.get("status") == "compile_timeout"]
    lines.append(f"Trials lost to a compile timeout: {len(timeouts)}" + (f" ({timeouts})" if timeouts else "") + ".")
    rejected = [t for t in study.get_trials(deepcopy=False)
                if t.user_attrs.get("accuracy_verdict") in ("degraded", "diverged")]
    lines.append(f"Rejected by the verdict: {len(rejected)} trial(s)"
                 + (": " + ", ".join(f"#{t.number}" for t in rejected) if rejected else "") + ".")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="autotune.demo:train")
    parser.add_argument("--space", default="demo_gpu")
    parser.add_argument("--study", required=True)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--timeout", type=float)
    parser.add_argument("--trial-timeout", type=float, default=300.0)
    parser.add_argument("--batch-policy", choices=("fixed", "scale"))
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--confirm-rounds", type=int, default=2, help="rounds of the top-K re-measurement")
    parser.add_argument("--studies-dir", default="studies")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--storage", help="read the study from this storage (e.g. a copied SQLite file)")
    parser.add_argument("--rejudge", action="store_true",
                        help="with --report-only: add each trial judged again by the current verdict rules")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if not args.report_only:
        autotune.run(args.target, space=args.space, n_trials=args.trials, timeout=args.timeout,
                     study_name=args.study, trial_timeout=args.trial_timeout, batch_policy=args.batch_policy,
                     top_k=args.top_k, confirm_rounds=args.confirm_rounds, studies_dir=args.studies_dir, progress=False)
    study, result = load_study_result(args.study, storage=args.storage, studies_dir=args.studies_dir)
    text = report(study, result, args)
    if args.rejudge:
        text += "\nJudged again offline by the current verdict rules, from the stored trajectories and bands:\n\n"
        text += "\n".join(rejudge(study)) + "\n"
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
