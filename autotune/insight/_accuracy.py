"""What the accuracy check did in a study, in words: the batch policy, the verdicts, whether it was blind,
and what it cost. Read from the study's attributes; pure, so notes, reports and the CLI say the same."""

from __future__ import annotations

import datetime
from collections import Counter
from typing import Any, Optional

import optuna
from optuna.trial import TrialState

VERDICT_ORDER = ("equivalent", "degraded", "diverged", "unchecked")


def batch_policy_line(attrs: dict[str, Any]) -> str:
    policy = attrs.get("batch_policy")
    if policy == "fixed":
        total = attrs.get("global_batch")
        return (f"Batch policy: fixed. Every trial trains at the global batch {total} (the batch knob is the "
                "micro-batch and gradients accumulate), so each takes the same optimizer steps on the same samples "
                "as the fp32 reference.")
    if policy == "scale":
        return ("Batch policy: scale. The global batch follows the batch knob and each trial is judged against fp32 "
                "at its own global batch. A config at another global batch than the baseline's changes the "
                "optimisation: a short trial cannot verify learning-rate warm-up, the schedule or a full run's final "
                "accuracy.")
    return "Batch policy: not recorded (a study from before batch policies)."


def verdict_counts(study: optuna.Study) -> Counter:
    return Counter(t.user_attrs["accuracy_verdict"] for t in study.get_trials(deepcopy=False)
                   if "accuracy_verdict" in t.user_attrs)


def blind_reasons(attrs: dict[str, Any]) -> list[str]:
    return list((attrs.get("accuracy_check") or {}).get("reasons") or [])


def check_seconds(study: optuna.Study) -> float:
    """Seconds spent on fp32 reference runs: the baseline's and, under scale, each global batch's."""
    trials = study.get_trials(deepcopy=False)
    return float(study.user_attrs.get("reference_seconds") or 0.0) + sum(
        float(t.user_attrs.get("reference_seconds") or 0.0) for t in trials)


def study_seconds(study: optuna.Study) -> Optional[float]:
    """Wall seconds from the study's creation to its last finished trial, when both are known."""
    created = study.user_attrs.get("created")
    ends = [t.datetime_complete for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
            if t.datetime_complete is not None]
    if not created or not ends:
        return None
    start = datetime.datetime.fromisoformat(created)
    end = max(ends)
    if end.tzinfo is None:
        end = end.astimezone()  # Optuna stores local naive times
    # The reference runs happen before the study is created, so they are added to its span.
    return max(0.0, (end - start).total_seconds()) + float(study.user_attrs.get("reference_seconds") or 0.0)


def accuracy_lines(study: optuna.Study, best_number: Optional[int]) -> list[str]:
    """The accuracy check in a few markdown lines: policy, verdicts, the best's evidence, blindness, cost."""
    attrs = study.user_attrs
    lines = [batch_policy_line(attrs)]
    counts = verdict_counts(study)
    if counts:
        text = ", ".join(f"{counts[v]} {v}" for v in VERDICT_ORDER if counts[v])
        seeds = len((attrs.get("reference_band") or {}).get("finals") or attrs.get("reference_metrics") or [])
        band = attrs.get("reference_band") or {}
        loss = (f"training loss paired step by step with the fp32 run at the trial's seed, or where that pairing "
                f"fails its final quarter against {seeds} fp32 seed(s)" if band.get("paired") else
                f"final-quarter training loss against {seeds} fp32 seed(s)")
        lines.append(f"Accuracy verdicts ({loss} at the same global batch, and the metric when reported): {text}.")
    if best_number is not None:
        best = study.trials[best_number].user_attrs
        if "accuracy_verdict" in best:
            lines.append(f"The best is **{best['accuracy_verdict']}**: {best.get('accuracy_evidence', '')}.")
    reasons = blind_reasons(attrs)
    if reasons and (attrs.get("accuracy_check") or {}).get("blind", True):
        lines.append("**The accuracy check is blind here**, so its verdicts are not a pass: " + "; ".join(reasons) + ".")
    elif reasons:
        lines.append("Part of the accuracy check is blind, so the verdicts rest on the other part: "
                     + "; ".join(reasons) + ".")
    split = attrs.get("time_split")
    if isinstance(split, dict) and split.get("wall"):
        # One source for these figures: the split that "Where the minutes went" states (this run's), not a span
        # of every run's timestamps beside it (the report said 269 s of 6.1 min where the summary said 347 s of
        # 809 s).
        spent, wall = float((split.get("parts") or {}).get("references") or 0.0), float(split["wall"])
        lines.append(f"Accuracy check cost: {spent:,.0f} s of fp32 reference runs, {spent / wall:.0%} of this "
                     f"run's {wall:,.0f} s (the references of where the minutes went).")
        return lines
    spent, total = check_seconds(study), study_seconds(study)
    if spent and total:
        lines.append(f"Accuracy check cost: {spent:,.0f} s of fp32 reference runs, {spent / total:.0%} of the "
                     f"study's {total / 60:,.1f} min.")
    return lines


# -- the loss-curve plot ----------------------------------------------------------------------------
VERDICT_COLOURS = {"equivalent": "#2ca02c", "degraded": "#d62728", "diverged": "#9467bd", "unchecked": "#7f7f7f"}
_GRID = 64  # points on the normalised progress axis


def _resample(curve: list[float]) -> list[float]:
    """A curve on ``_GRID`` points of progress (0 to 1), by nearest point, so runs of any length compare."""
    n = len(curve)
    return [curve[min(n - 1, int((i + 0.5) / _GRID * n))] for i in range(_GRID)]


def loss_curve_groups(study: optuna.Study) -> dict[int, dict[str, Any]]:
    """Per global batch: the fp32 reference curves and each ran trial's curve with its verdict.

    Raises:
        ValueError: no loss trajectory was recorded (nothing to draw).
    """
    attrs = study.user_attrs
    baseline = attrs.get("baseline_config") or {}
    groups: dict[int, dict[str, Any]] = {}
    base_batch = int(baseline.get("global_batch") or baseline.get("batch_size") or 0)
    curves = {base_batch: attrs.get("reference_curves") or []}
    for key, value in attrs.items():
        if key.startswith("reference_curves:batch="):
            curves[int(key.rsplit("=", 1)[1])] = value
    for batch, refs in curves.items():
        refs = [c for c in refs if c]
        if refs:
            groups[batch] = {"references": [_resample(c) for c in refs], "trials": []}
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        a = t.user_attrs
        losses, config = a.get("losses") or [], a.get("config") or {}
        batch = int(config.get("global_batch") or config.get("batch_size") or 0)
        if losses and a.get("role") != "reference" and batch in groups:
            groups[batch]["trials"].append((t.number, a.get("accuracy_verdict", "unchecked"), _resample(losses)))
    if not groups:
        raise ValueError("no loss trajectory was recorded (the workload does not use ctx.train_step or ctx.record_loss)")
    return groups


def _band(references: list[list[float]]) -> tuple[list[float], list[float]]:
    return [min(c[i] for c in references) for i in range(_GRID)], [max(c[i] for c in references) for i in range(_GRID)]


def plotly_loss_curves(study: optuna.Study) -> Any:
    from plotly.subplots import make_subplots

    groups = loss_curve_groups(study)
    fig = make_subplots(rows=1, cols=len(groups), subplot_titles=[f"global batch {b}" for b in sorted(groups)])
    x = [(i + 0.5) / _GRID for i in range(_GRID)]
    for col, batch in enumerate(sorted(groups), start=1):
        low, high = _band(groups[batch]["references"])
        fig.add_scatter(x=x + x[::-1], y=high + low[::-1], fill="toself", fillcolor="rgba(31,119,180,0.25)",
                        line={"width": 0}, name="fp32 reference seeds", showlegend=col == 1, row=1, col=col)
        for number, verdict, curve in groups[batch]["trials"]:
            fig.add_scatter(x=x, y=curve, mode="lines", name=f"#{number} {verdict}", row=1, col=col,
                            line={"color": VERDICT_COLOURS.get(verdict, "#7f7f7f"), "width": 1})
    fig.update_xaxes(title_text="progress through the trial (optimizer steps, normalised)")
    fig.update_yaxes(title_text="training loss")
    return fig


def matplotlib_loss_curves(study: optuna.Study) -> Any:
    import matplotlib.pyplot as plt

    groups = loss_curve_groups(study)
    fig, axes = plt.subplots(1, len(groups), squeeze=False, figsize=(max(8, 5 * len(groups)), 5))
    x = [(i + 0.5) / _GRID for i in range(_GRID)]
    for ax, batch in zip(axes.flat, sorted(groups)):
        low, high = _band(groups[batch]["references"])
        ax.fill_between(x, low, high, color="#1f77b4", alpha=0.3, label="fp32 reference seeds")
        seen = set()
        for _, verdict, curve in groups[batch]["trials"]:
            ax.plot(x, curve, color=VERDICT_COLOURS.get(verdict, "#7f7f7f"), linewidth=1,
                    label=verdict if verdict not in seen else None)
            seen.add(verdict)
        ax.set_title(f"global batch {batch}")
        ax.set_xlabel("progress through the trial (optimizer steps, normalised)")
        ax.set_ylabel("training loss")
        ax.legend(loc="best")
    return axes
