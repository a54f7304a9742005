"""What a study found, for people: the dashboard note, plots as artifacts, and ``report.html``.

``annotate_study`` runs at the end of every ``Tuner.run``: it classifies the trials (``_diagnose``),
writes a study note for optuna-dashboard, and attaches the plots to the study with Optuna's artifact
store under ``studies/artifacts`` (where ``autotune dashboard`` serves them from). It never fails a
study: without optuna-dashboard or matplotlib it leaves out what needs them and says so.

``write_report`` (``autotune report STUDY``) writes ``studies/<study>/report.html`` with interactive
plotly figures (optuna.visualization) and the same plots as PNGs (optuna.visualization.matplotlib).
"""

from __future__ import annotations

import html
import os
import json
import math
import re
import shlex
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune._config import NO_FASTER_CONFIG, TrialConfig
from autotune._files import atomic_path, write_atomic
from autotune.insight._accuracy import accuracy_lines, matplotlib_loss_curves, plotly_loss_curves
from autotune.insight._diagnose import Diagnosis, annotate_trials, diagnose_study, gpu_reading, next_step
from autotune._errors import ReportError
from autotune._records import CONFIRMATION, FASTER_BY, batch_reference_noise, batch_references
from autotune._records import DEFAULT_STUDIES_DIR, study_dir

ARTIFACTS_DIR = "artifacts"  # under studies_dir; `autotune dashboard` passes the same --artifact-dir
NOTE_HEADING = "## autotune:"  # notes that start with it are autotune's to rewrite; others are left alone
MIN_TRIALS_FOR_IMPORTANCE = 4  # completed trials; fewer give importances that mean nothing

# name -> (title, what it shows); the PNG of each is <name>.png next to report.html.
PLOTS = {
    "throughput_by_knob": ("Throughput per knob value",
                           "completed trials, coloured by trial number; the PNG also shows the infeasible ones (a "
                           "failure counts as 0) in grey; bars: the slowest to the fastest timed window"),
    "pareto_front": ("Throughput vs accuracy loss: the Pareto front",
                     "infeasible trials (a failure, or beyond the accuracy bound) in grey; bars: the slowest to the "
                     "fastest timed window"),
    "importances": ("Knob importances for throughput", "PED-ANOVA (optuna.importance)"),
    "history": ("History", "throughput by trial number; out-of-memory, other failures and pruned trials marked; "
                           "bars: the slowest to the fastest timed window"),
    "loss_curves": ("Training loss against the fp32 reference band",
                    "each trial's loss trajectory, coloured by its accuracy verdict, over the band of the fp32 seeds "
                    "at its global batch"),
}
ARTIFACT_FILES = tuple(f"{name}.png" for name in PLOTS)
THROUGHPUT_LABEL = "throughput (samples/s)"
ACCURACY_LOSS_LABEL = "accuracy loss (metric units)"
# Optuna colours trials by number on scales that start at white, which draws trial 0 (the reference run)
# white on white: these start at a visible shade.
VISIBLE_BLUES = ((0.0, "rgb(158,202,225)"), (1.0, "rgb(8,48,107)"))
VISIBLE_REDS = ((0.0, "rgb(252,146,114)"), (1.0, "rgb(103,0,13)"))
ERROR_BAR_COLOR = "#777777"


@dataclass(frozen=True)
class Annotation:
    """What ``annotate_study`` did.

    Attributes:
        diagnoses: Trial number -> diagnosis.
        next_step: The hint for the best config ("" when nothing is feasible).
        note: Whether the study note was written.
        artifacts: File names attached to the study.
        skipped: What was left out, and why.
    """

    diagnoses: dict[int, Diagnosis]
    next_step: str = ""
    note: bool = False
    artifacts: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()


@dataclass(frozen=True)
class Report:
    """The files ``write_report`` wrote, and the plots it could not draw (name -> why)."""

    html: Path
    pngs: dict[str, Path] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


# -- reading the study ---------------------------------------------------------------------------------
def _throughput(trial: FrozenTrial) -> float:
    return trial.values[0]


def _pareto_targets(trial: FrozenTrial) -> tuple[float, float]:
    loss = trial.values[1]
    return trial.values[0], loss if math.isfinite(loss) else math.nan  # a failure's loss is inf


def _window_range(trial: FrozenTrial) -> tuple[float, float]:
    """How far the trial's slowest timed window lies below its throughput and its fastest above it
    ((0, 0) without windows, e.g. a failure)."""
    windows = [w for w in trial.user_attrs.get("window_throughputs") or ()
               if isinstance(w, (int, float)) and math.isfinite(w)]
    if not windows or not trial.values:
        return 0.0, 0.0
    value = trial.values[0]
    return max(0.0, value - min(windows)), max(0.0, max(windows) - value)


def _rows(study: optuna.Study) -> list[FrozenTrial]:
    return study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))


def _describe(trial: FrozenTrial) -> str:
    config = trial.user_attrs.get("config")
    return TrialConfig.from_dict(config).describe() if config else json.dumps(trial.params)


def _result(study: optuna.Study) -> Any:
    from autotune._records import summarize_study

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # several device models: the summary says so itself
        return summarize_study(study)


def summary_lines(study: optuna.Study, diagnoses: dict[int, Diagnosis]) -> list[str]:
    """The study in a few lines (markdown): baseline, best, speed-up, accuracy check, what the probe
    removed, diagnoses and the next step."""
    attrs = study.user_attrs
    result = _result(study)
    alternated = result.speedup_basis == "alternation"
    how = "its median in the top-K alternation" if alternated else "the fp32 reference run"
    source = f" It comes from {result.baseline_source}." if result.baseline_source else ""
    lines = [f"Baseline: `{result.baseline.describe()}` at {result.baseline_throughput:,.1f} samples/s ({how}).{source}"]
    best = result.best
    if best is None:
        lines.append("Best: no feasible config was found" + (f": {result.ruled_out_faster}." if result.ruled_out_faster
                                                              else "."))
    else:
        how = "its median in the same alternation" if alternated else "a single run"
        label = "Best" if result.faster or result.is_baseline else "Fastest other config (not recommended)"
        text = f"{label}: `{best.config.describe()}` at {best.throughput:,.1f} samples/s (trial #{best.number}, {how}); "
        if result.faster:
            text += f"verdict: {result.verdict} ({result.spread_text})."
        else:
            text += f"verdict: {NO_FASTER_CONFIG}: {result.why_not_faster}; keep the baseline."
        lines.append(text)
        if result.ruled_out_faster:
            lines.append(f"Faster, but ruled out: {result.ruled_out_faster}.")
    if best is not None:
        energy = energy_record(study.trials[best.number].user_attrs, cuda=bool((attrs.get("hardware") or {}).get("cuda")))
        lines.append(f"Energy of the best: {energy['what']}.")
    if result.colocation_warning:
        lines.append(f"**Warning:** {result.colocation_warning}.")
    reference = attrs.get("reference_metric")
    if reference is None:
        lines.append("Accuracy check: the workload reports no metric, so accuracy was not checked.")
    else:
        bound = attrs.get("max_accuracy_loss", 0.01)
        noise = attrs.get("metric_noise", 0.0)
        text = (f"Accuracy check: reference metric {reference:.4f} ({attrs.get('metric_direction', 'maximize')}), "
                f"noise band {noise:.4f}; a trial may lose up to {bound:g} beyond the noise band")
        if attrs.get("accuracy_reference") == "batch" or attrs.get("batch_policy") == "scale":
            per_batch = sorted(batch_references(attrs).items())
            noise_at = batch_reference_noise(attrs)
            text += "; each trial is judged against fp32 at its own batch size"
            if per_batch:
                text += " (" + ", ".join(f"batch {b}: {v:.4f}" + (f", noise band {noise_at[b]:.4f}" if b in noise_at else "")
                                         for b, v in per_batch) + ")"
        if best is not None:
            text += f"; the best loses {best.accuracy_loss:+.4f}"
        confirmation = attrs.get("confirmation") or {}
        if "accuracy_loss" in confirmation:
            text += f"; over {confirmation['samples']:,} samples it loses {confirmation['accuracy_loss']:+.4f}"
        lines.append(text + ".")
    lines.extend(accuracy_lines(study, best.number if best is not None else None))
    errors = [(t.number, t.user_attrs["prediction_error"]) for t in study.get_trials(deepcopy=False)
              if isinstance(t.user_attrs.get("prediction_error"), (int, float))]
    if errors:
        probes = attrs.get("probes") or []
        lines.append(f"Probes: {sum(p.get('kind') == 'loader' for p in probes)} loader and "
                     f"{sum(p.get('kind') == 'step' for p in probes)} step probes; predicted full trials "
                     + ", ".join(f"#{n} {e:+.0%}" for n, e in errors) + " (measured against predicted).")
    race = race_line(attrs.get(CONFIRMATION) or {})
    if race:
        lines.append(race)
    if attrs.get("time_split"):
        lines.append(f"Where the minutes went: {format_split(attrs['time_split'])}.")
        lines.extend(plan_lines(attrs["time_split"], result))
    removed = attrs.get("removed_knobs") or {}
    if removed:
        lines.append("Removed by the capability probe: " + "; ".join(f"`{k}` ({v})" for k, v in removed.items()) + ".")
    else:
        lines.append("Removed by the capability probe: nothing.")
    rows = _rows(study)
    statuses = Counter(t.user_attrs.get("status", "ok") for t in rows)
    counts = ", ".join(f"{n} {s}" for s, n in sorted(statuses.items()))
    lines.append(f"Trials: {len(rows)} finished ({counts}).")
    if diagnoses:
        labels = Counter(d.label for d in diagnoses.values())
        lines.append("Diagnoses: " + ", ".join(f"{n} {label}" for label, n in labels.most_common()) + ".")
    hint = best_hint(study, diagnoses, result)
    if hint:
        d = diagnoses[best.number]
        lines.append(f"The best config is **{d.label}**: {d.evidence} Next step: {hint}")
    return lines


def energy_record(attrs: Mapping[str, Any], *, cuda: bool) -> dict[str, Any]:
    """A trial's energy per sample from its NVML energy counter (``extra:gpu.joules_per_sample``, over its
    timed windows), or why it was not measured: ``{"joules_per_sample", "energy_j", "what"}``."""
    per_sample = attrs.get("extra:gpu.joules_per_sample")
    if isinstance(per_sample, (int, float)):
        return {"joules_per_sample": per_sample, "energy_j": attrs.get("extra:gpu.energy_j"),
                "what": f"{per_sample:.4g} J/sample over the timed windows (NVML energy counter)"}
    why = ("no GPU (the CPU has no energy counter autotune reads)" if not cuda
           else "the GPU's driver gives no energy counter (NVML nvmlDeviceGetTotalEnergyConsumption)")
    return {"joules_per_sample": None, "energy_j": None, "what": f"not measured: {why}"}


def race_line(race_record: dict[str, Any]) -> str:
    """The race of the finalists in one line ("" when none ran)."""
    race = race_record.get("race") or {}
    if not race:
        return ""
    dropped = race.get("dropped") or {}
    text = (f"Race of the finalists: {race.get('runs')} runs in {len(race_record.get('rounds', []))} rounds, "
            f"{race.get('seconds') or 0:.0f} s; ended: {race.get('ended')}")
    if dropped:
        text += "; dropped " + "; ".join(f"#{k} ({why})" for k, why in dropped.items())
    if race.get("noisy"):
        text += "; a noisy machine: " + (race.get("noisy_reason")
                                         or f"the baseline's runs differed by {race.get('baseline_disagreement', 0):.0%}")
    return text + "."


def format_split(split: Mapping[str, Any]) -> str:
    """``"312 s: references 95 s (30%), compile 80 s (26%), ..."`` for the summary and the study note."""
    wall = float(split.get("wall") or 0.0)
    named = {"references": "references", "compile": "compile", "warmup": "warm-up", "timed": "timed windows",
             "race": "re-measurement", "probes": "loader and step probes",
             "trial_process": "trial processes (start, build, exit)",
             "coordinator": "coordinator (sampler, storage, verdicts)", "probe": "probe", "report": "report"}
    shown = [f"{label} {split['parts'].get(key, 0.0):.0f} s ({split['shares'].get(key, 0.0):.0%})"
             for key, label in named.items() if split["parts"].get(key, 0.0) >= 0.5]
    budget = split.get("budget")
    head = f"{wall:.0f} s" + (f" of a {budget / 60:g}-minute budget" if budget else "")
    tail = f"; unaccounted {split['unaccounted']:.1f} s" if abs(split.get("unaccounted", 0.0)) >= 0.5 else ""
    return f"{head}: " + ", ".join(shown) + tail


def plan_lines(split: Mapping[str, Any], result: Any = None) -> list[str]:
    """What the study's order did with its minutes (from the split: see ``Tuner._record_split``): when the
    first faster config was measured, references reused or shortened, and why probes ran or did not.

    The first faster config is a full trial's own run against the baseline's reference, noted when it was
    measured; the verdict (``result``, the study's ``Result``) may rest on other runs (the race's, side by side).
    The line never contradicts it: a ratio the verdict does not hold is left out, and where no trial's own run
    beat the baseline's but the verdict says faster, the line says which runs did."""
    lines = []
    first, budget = split.get("first_faster"), split.get("budget")
    faster = result is not None and result.faster
    if isinstance(first, dict) and first.get("seconds") is not None:
        share = f", {first['seconds'] / budget:.0%} of the budget" if budget else ""
        ratio = float(first.get("speedup") or 0.0)
        held = result is None or (faster and result.speedup_low - 0.005 <= ratio <= result.speedup_high + 0.005)
        text = f"First faster config: trial #{first.get('trial')}" + (f" at {ratio:.2f}x" if held else "")
        text += f", measured {first['seconds']:.0f} s into the study{share}"
        if not held and faster:
            text += (f" (its own run against the baseline's; the verdict, {result.verdict}, is from "
                     f"{result.spread_text})")
        elif not held:
            text += f" (its own run against the baseline's, which the verdict did not bear out: {result.verdict})"
        lines.append(text + ".")
    elif "first_faster" in split:
        if faster:
            lines.append(f"First faster config: no feasible full trial's own run beat the baseline's by more than "
                         f"{FASTER_BY - 1:.0%}; the pick's speed-up ({result.verdict}) is from {result.spread_text}.")
        else:
            lines.append(f"First faster config: no feasible full trial's own run beat the baseline's by more than "
                         f"{FASTER_BY - 1:.0%}.")
    reused = split.get("references_reused")
    if isinstance(reused, dict):
        lines.append(f"References: reused from study {reused.get('study')!r} ({reused.get('created')}), 0 s.")
    shortened = split.get("references_shortened")
    if isinstance(shortened, dict) and shortened.get("samples"):
        lines.append(f"Shortened evidence: the fp32 references and every trial trained {shortened['samples']:,} of "
                     f"the space's {shortened.get('from_samples', 0):,} samples (the references' share of the budget), "
                     "the schedule spanning the full length; the verdicts stay paired.")
    if split.get("probes_why"):
        lines.append(f"Probes: {split['probes_why']}.")
    return lines


def best_hint(study: optuna.Study, diagnoses: dict[int, Diagnosis], result: Any = None) -> str:
    """The next-step hint for the study's best config ("" when there is none or it was not diagnosed)."""
    result = result or _result(study)
    if result.best is None or result.best.number not in diagnoses:
        return ""
    return next_step(diagnoses[result.best.number], result.best.config.to_dict())


def note_markdown(study: optuna.Study, diagnoses: dict[int, Diagnosis]) -> str:
    lines = summary_lines(study, diagnoses)
    return "\n".join([f"{NOTE_HEADING} {study.study_name}", "", *[f"- {line}" for line in lines], "",
                      DASHBOARD_BEST, "",
                      f"Plots: the Artifacts section ({', '.join(ARTIFACT_FILES)}); the full report: "
                      f"`autotune report {shlex.quote(study.study_name)}`.", ""])


# The dashboard's "Best Trial" and autotune's best, in the study note (study/_dashboard says how).
DASHBOARD_BEST = (
    "Best Trial: served by `autotune dashboard`, it is autotune's best above (the fastest trial within the "
    "accuracy bound, or the winner of the top-K re-measurement), and trials beyond the bound or failed are "
    "infeasible (grey). The history's best line follows single runs, so after a top-K re-measurement it can "
    "end at another trial than the winner by median. Plain `optuna-dashboard` reads no accuracy bound: it "
    "badges the Pareto front of all trials, infeasible ones included.")


def trial_note(diagnosis: Diagnosis) -> str:
    numbers = ", ".join(f"{k} {v}" for k, v in diagnosis.numbers.items() if v is not None)
    return f"{NOTE_HEADING} {diagnosis.label}\n\n{diagnosis.evidence}\n\n{numbers}\n"


def diagnosis_table_markdown(study: optuna.Study, diagnoses: dict[int, Diagnosis]) -> str:
    """Every finished trial with its diagnosis, as a markdown table."""
    out = ["| # | state | status | config | samples/s | accuracy loss | data wait | GPU util | diagnosis | evidence |",
           "|---:|---|---|---|---:|---:|---:|---:|---|---|"]
    for row in _table_rows(study, diagnoses):
        out.append("| " + " | ".join(str(v).replace("|", "/") for v in row) + " |")
    return "\n".join(out) + "\n"


def _table_rows(study: optuna.Study, diagnoses: dict[int, Diagnosis]) -> list[list[str]]:
    rows = []
    for t in _rows(study):
        a = t.user_attrs
        d = diagnoses.get(t.number)
        util = gpu_reading(a, "gpu_util_pct.mean")
        rate = t.values[0] if t.values else a.get("throughput")
        loss = t.values[1] if t.values else None
        status = a.get("status", "ok")
        if t.state == TrialState.PRUNED and a.get("pruned_reason"):
            status = f"{status}: {a['pruned_reason']}"
        if a.get("colocation_summary"):
            status = f"{status}: {a['colocation_summary']}"  # the copies, the slowest, how they overlapped
        rows.append([
            str(t.number), t.state.name, status, _describe(t),
            f"{rate:,.1f}" if rate else "", f"{loss:+.4f}" if loss is not None and math.isfinite(loss) else "",
            f"{a['data_wait_fraction']:.0%}" if "data_wait_fraction" in a and rate else "",
            f"{util:.0f}%" if util is not None else "not measured",
            d.label if d else "", d.evidence if d else "",
        ])
    return rows


# -- plots -------------------------------------------------------------------------------------------
def _plotly_figures(study: optuna.Study) -> tuple[dict[str, Any], dict[str, str]]:
    from optuna import visualization as vis

    builders: dict[str, Callable[[], Any]] = {
        "throughput_by_knob": lambda: _plotly_spread(
            study, vis.plot_slice(study, target=_throughput, target_name=THROUGHPUT_LABEL), "y"),
        "pareto_front": lambda: _plotly_spread(
            study, vis.plot_pareto_front(study, target_names=list(_axis_names(study)), targets=_pareto_targets), "x"),
        "importances": lambda: vis.plot_param_importances(study, target=_throughput, target_name="throughput"),
        "history": lambda: _plotly_history(study),
        "loss_curves": lambda: plotly_loss_curves(study),
    }
    return _build(study, builders)


def _metric_names(study: optuna.Study) -> tuple[str, str]:
    names = study.metric_names or ["throughput", "accuracy_loss"]
    return names[0], names[1]


def _axis_names(study: optuna.Study) -> tuple[str, str]:
    """The objectives' names with their units, for the axes."""
    units = {"throughput": THROUGHPUT_LABEL, "accuracy_loss": ACCURACY_LOSS_LABEL}
    return tuple(units.get(name, name) for name in _metric_names(study))  # type: ignore[return-value]


def _numbers(values: Any) -> Optional[list[int]]:
    """Trial numbers, when a trace's marker colours are those (Optuna colours by trial number)."""
    if values is None or isinstance(values, str):
        return None
    values = list(values)
    if not values or not all(isinstance(v, (int, float)) and float(v).is_integer() for v in values):
        return None
    return [int(v) for v in values]


def _plotly_spread(study: optuna.Study, fig: Any, axis: str, *, numbers_from_x: bool = False,
                   traces: Optional[list[Any]] = None) -> Any:
    """Error bars from each trial's timed windows on the throughput ``axis`` ("x" or "y"), and colour scales
    that draw trial 0 visibly, on every trace whose points are trials."""
    by_number = {t.number: t for t in study.get_trials(deepcopy=False)}
    for trace in fig.data if traces is None else traces:
        if getattr(trace, "type", "") != "scatter":
            continue
        scale = trace.marker.colorscale
        if scale and not numbers_from_x:
            trace.marker.colorscale = VISIBLE_REDS if "255,245,240" in str(scale[0][1]) else VISIBLE_BLUES
            trace.marker.line = {"width": 1, "color": "#444444"}
        numbers = _numbers(trace.x) if numbers_from_x else _numbers(trace.marker.color)
        if numbers is None or not all(n in by_number for n in numbers):
            continue
        below, above = zip(*(_window_range(by_number[n]) for n in numbers))
        bars = {"type": "data", "symmetric": False, "array": list(above), "arrayminus": list(below),
                "color": ERROR_BAR_COLOR, "thickness": 1, "width": 3}
        trace.update(error_y=bars) if axis == "y" else trace.update(error_x=bars)
    return fig


def _build(study: optuna.Study, builders: dict[str, Callable[[], Any]]) -> tuple[dict[str, Any], dict[str, str]]:
    figures, skipped = {}, {}
    completed = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    for name, build in builders.items():
        if not completed:
            skipped[name] = "no completed trial"
            continue
        if name == "importances" and (len(completed) < MIN_TRIALS_FOR_IMPORTANCE or not _varied_params(completed)):
            skipped[name] = (f"importances need at least {MIN_TRIALS_FOR_IMPORTANCE} completed trials that differ in "
                             f"a knob; the study has {len(completed)}")
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # experimental-API and non-finite-value notices
                figures[name] = build()
        except Exception as exc:  # a plot that cannot be drawn must not cost the others
            skipped[name] = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return figures, skipped


def _varied_params(trials: list[FrozenTrial]) -> bool:
    names = {k for t in trials for k in t.params}
    return any(len({json.dumps(t.params.get(k)) for t in trials}) > 1 for k in names)


def _marked(study: optuna.Study) -> dict[str, list[tuple[int, float, str]]]:
    """History markers: (trial number, throughput shown, hover text) for failures and pruned trials."""
    marks: dict[str, list[tuple[int, float, str]]] = {"out of memory": [], "other failure": [], "pruned": []}
    for t in _rows(study):
        a = t.user_attrs
        status = a.get("status", "ok")
        if t.state == TrialState.PRUNED:
            rate = a.get("throughput") or 0.0
            marks["pruned"].append((t.number, rate, f"#{t.number} {status}: {a.get('pruned_reason', '')}"))
        elif status == "oom":
            marks["out of memory"].append((t.number, 0.0, f"#{t.number} oom: {_describe(t)}"))
        elif status != "ok":
            marks["other failure"].append((t.number, 0.0, f"#{t.number} {status}: {a.get('error', '')[:120]}"))
    return marks


MARKERS = {"out of memory": ("x", "#d62728"), "other failure": ("D", "#9467bd"), "pruned": ("v", "#ff7f0e")}
PLOTLY_SYMBOLS = {"x": "x", "D": "diamond", "v": "triangle-down"}


def _plotly_history(study: optuna.Study) -> Any:
    from optuna import visualization as vis

    fig = vis.plot_optimization_history(study, target=_throughput, target_name=THROUGHPUT_LABEL)
    main = [trace for trace in fig.data if trace.name == THROUGHPUT_LABEL]
    for trace in main:
        trace.marker.line = {"width": 1, "color": "#444444"}
    _plotly_spread(study, fig, "y", numbers_from_x=True, traces=main)
    fig.update_yaxes(title_text=THROUGHPUT_LABEL)
    for label, points in _marked(study).items():
        if points:
            symbol, color = MARKERS[label]
            fig.add_scatter(x=[p[0] for p in points], y=[p[1] for p in points], mode="markers", name=label,
                            text=[p[2] for p in points], hoverinfo="text",
                            marker={"symbol": PLOTLY_SYMBOLS[symbol], "size": 12, "color": color})
    return fig


def write_pngs(study: optuna.Study, out_dir: Path) -> tuple[dict[str, Path], dict[str, str]]:
    """Draw the plots with optuna.visualization.matplotlib into ``out_dir/<name>.png``.

    Each PNG keeps the texts drawn on it (titles, axis and tick labels, legends) in its ``Description``
    metadata, so what a plot shows can be checked without looking at it.

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as mvis

    def history() -> Any:
        ax = mvis.plot_optimization_history(study, target=_throughput, target_name=THROUGHPUT_LABEL)
        _matplotlib_spread(study, ax, "y", by="x")  # before the markers, whose points are no measurements
        for label, points in _marked(study).items():
            if points:
                marker, color = MARKERS[label]
                ax.scatter([p[0] for p in points], [p[1] for p in points], marker=marker, color=color, s=60,
                           label=label, zorder=3)
        ax.legend(loc="best")
        return ax

    builders: dict[str, Callable[[], Any]] = {
        "throughput_by_knob": lambda: _matplotlib_spread(
            study, mvis.plot_slice(study, target=_throughput, target_name=THROUGHPUT_LABEL), "y", by="colour"),
        "pareto_front": lambda: _matplotlib_spread(
            study, mvis.plot_pareto_front(study, target_names=list(_axis_names(study)), targets=_pareto_targets),
            "x", by="value"),
        "importances": lambda: mvis.plot_param_importances(study, target=_throughput, target_name="throughput"),
        "history": history,
        "loss_curves": lambda: matplotlib_loss_curves(study),
    }
    before = set(plt.get_fignums())
    try:
        axes, skipped = _build(study, builders)
        out_dir.mkdir(parents=True, exist_ok=True)
        paths = {}
        for name, ax in axes.items():
            fig = (ax.flat[0] if hasattr(ax, "flat") else ax).figure
            fig.set_size_inches(max(fig.get_size_inches()[0], 8), max(fig.get_size_inches()[1], 5))
            fig.suptitle(f"{study.study_name}: {PLOTS[name][0]}")
            path = out_dir / f"{name}.png"
            with atomic_path(path) as tmp:  # a symlink planted at the PNG is replaced, never written through
                fig.savefig(tmp, dpi=100, bbox_inches="tight", format="png")
                _set_png_text(tmp, Title=PLOTS[name][0], Description=_figure_text(fig))  # drawn: all labels exist
            paths[name] = path
    finally:
        for number in set(plt.get_fignums()) - before:  # also those of a plot that failed half-way
            plt.close(number)
    return paths, skipped


def _matplotlib_spread(study: optuna.Study, ax: Any, axis: str, *, by: str) -> Any:
    """Error bars from each trial's timed windows on the throughput ``axis``, and a colour map that draws
    trial 0 visibly, on the scatter points of ``ax`` (one axes or an array of them).

    ``by`` says how a point names its trial: ``colour`` (Optuna's colour array is the trial number), ``x``
    (the x position is), or ``value`` (its throughput is a trial's value: the Pareto front).
    """
    import numpy as np
    from matplotlib.collections import PathCollection
    from matplotlib.colors import LinearSegmentedColormap

    trials = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.values]
    by_number = {t.number: t for t in trials}
    by_value = {t.values[0]: t for t in trials}
    visible = LinearSegmentedColormap.from_list("visible_blues", [(158 / 255, 202 / 255, 225 / 255), (8 / 255, 48 / 255, 107 / 255)])
    for one in (ax.flat if hasattr(ax, "flat") else [ax]):
        for points in [c for c in one.collections if isinstance(c, PathCollection)]:
            offsets = np.asarray(points.get_offsets())
            if not len(offsets):
                continue
            colours = points.get_array()
            if by == "colour":
                if colours is None:
                    continue
                points.set_cmap(visible)
                points.set_edgecolor("#444444")
                points.set_linewidth(0.5)
                found = [by_number.get(int(n)) for n in colours]
            elif by == "x":
                found = [by_number.get(int(x)) if float(x).is_integer() else None for x in offsets[:, 0]]
            else:
                found = [by_value.get(float(x)) for x in offsets[:, 0]]
            if any(t is None for t in found):
                continue
            below, above = (list(v) for v in zip(*(_window_range(t) for t in found)))
            bars = {"yerr" if axis == "y" else "xerr": [below, above]}
            one.errorbar(offsets[:, 0], offsets[:, 1], fmt="none", ecolor=ERROR_BAR_COLOR, elinewidth=1, capsize=2,
                         zorder=1, **bars)
    return ax


def _set_png_text(path: Path, **text: str) -> None:
    from PIL import Image, PngImagePlugin  # pillow comes with matplotlib

    info = PngImagePlugin.PngInfo()
    for key, value in text.items():
        info.add_itxt(key, value)
    with Image.open(path) as image:
        image.load()
    image.save(path, format="PNG", pnginfo=info)


def _figure_text(fig: Any) -> str:
    texts = [t.get_text() for t in fig.texts]  # the suptitle among them
    for ax in fig.axes:
        texts += [ax.get_title(), ax.get_xlabel(), ax.get_ylabel()]
        texts += [t.get_text() for t in ax.get_xticklabels() + ax.get_yticklabels()]
        legend = ax.get_legend()
        if legend is not None:
            texts += [t.get_text() for t in legend.get_texts()]
    return "\n".join(t for t in texts if t)


# -- the dashboard -------------------------------------------------------------------------------------
class _TrialRef:
    """What optuna_dashboard.save_note reads from a trial (storage, study, id): a finished trial cannot
    be reopened as an ``optuna.Trial`` without asking the sampler again."""

    def __init__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self.study = study
        self.storage = study._storage
        self._trial_id = trial._trial_id


def _save_note(target: Any, body: str) -> bool:
    from optuna_dashboard import get_note, save_note

    current = get_note(target)
    if current == body:
        return True
    if current.strip() and not current.startswith(NOTE_HEADING):
        return False  # someone wrote this note by hand: keep it
    save_note(target, body)
    return True


def study_artifacts(study: optuna.Study) -> list[dict[str, Any]]:
    """The study's artifacts (id, filename, mimetype), skipping those deleted in the dashboard, which
    leaves a null in their place."""
    out = []
    for key, value in study._storage.get_study_system_attrs(study._study_id).items():
        if key.startswith("artifacts:"):
            meta = json.loads(value)
            if meta is not None:
                out.append(meta)
    return out


def upload_plots(study: optuna.Study, paths: dict[str, Path], studies_dir: Path) -> list[str]:
    """Attach the PNGs to the study, replacing the versions attached before."""
    from optuna.artifacts import FileSystemArtifactStore, upload_artifact
    from optuna.artifacts.exceptions import ArtifactNotFound

    root = Path(studies_dir) / ARTIFACTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    store = FileSystemArtifactStore(root)
    names = {p.name for p in paths.values()}
    for meta in study_artifacts(study):
        if meta["filename"] in names:
            try:
                store.remove(meta["artifact_id"])
            except ArtifactNotFound:
                pass
            # How optuna-dashboard itself deletes an artifact: its metadata becomes null.
            study._storage.set_study_system_attr(study._study_id, f"artifacts:{meta['artifact_id']}", json.dumps(None))
    for path in paths.values():
        upload_artifact(study_or_trial=study, file_path=str(path), artifact_store=store)
    return sorted(names)


def annotate_study(study: optuna.Study, *, studies_dir: Union[str, Path] = DEFAULT_STUDIES_DIR,
                   plots: bool = True) -> Annotation:
    """Diagnose every trial, write the dashboard notes and attach the plots; never raises.

    Stores the diagnoses in the study (``annotate_trials``) and the best config's next-step hint as the
    study user attribute ``next_step``; writes the study note and one note per diagnosed trial
    (optuna-dashboard's note API; notes edited by hand are left alone); draws the plots into
    ``studies/<study>/`` and attaches them to the study in ``studies/artifacts`` (unless ``plots`` is off).
    """
    skipped: list[str] = []
    try:
        diagnoses = annotate_trials(study)
    except Exception as exc:
        warnings.warn(f"autotune: could not diagnose study {study.study_name!r}: {exc}", stacklevel=2)
        return Annotation({}, skipped=(f"diagnosis: {exc}",))
    hint = ""
    try:
        hint = best_hint(study, diagnoses)
        study.set_user_attr("next_step", hint)
    except Exception as exc:  # e.g. a study without a reference run
        skipped.append(f"next step: {exc}")
    note = False
    try:
        import optuna_dashboard  # noqa: F401
    except ImportError:
        skipped.append("notes: optuna-dashboard is not installed (pip install 'autotune[dashboard]')")
    else:
        try:
            note = _save_note(study, note_markdown(study, diagnoses))
            by_number = {t.number: t for t in _rows(study)}
            for number, d in diagnoses.items():
                _save_note(_TrialRef(study, by_number[number]), trial_note(d))
        except Exception as exc:
            skipped.append(f"notes: {type(exc).__name__}: {exc}")
    artifacts: list[str] = []
    if not plots:
        return Annotation(diagnoses, hint, note, (), tuple(skipped))
    try:
        paths, not_drawn = write_pngs(study, study_dir(study.study_name, Path(studies_dir)))
        skipped += [f"{name}.png: {why}" for name, why in not_drawn.items()]
        artifacts = upload_plots(study, paths, Path(studies_dir))
    except ImportError as exc:
        skipped.append(f"plots: {exc.name} is not installed (pip install 'autotune[plots]')")
    except Exception as exc:
        skipped.append(f"plots: {type(exc).__name__}: {exc}")
    return Annotation(diagnoses, hint, note, tuple(artifacts), tuple(skipped))


# -- report.html ---------------------------------------------------------------------------------------
def write_report(study: optuna.Study, *, studies_dir: Union[str, Path] = DEFAULT_STUDIES_DIR,
                 out_dir: Optional[Path] = None) -> Report:
    """Write ``report.html`` and the PNGs into ``out_dir`` (default ``studies/<study>/``).

    The diagnoses are computed afresh and not stored (``annotate_study`` stores them).

    Raises:
        ReportError: plotly or matplotlib is not installed.
    """
    try:
        import matplotlib  # noqa: F401
        import plotly  # noqa: F401
    except ImportError as exc:
        raise ReportError(f"the report needs {exc.name}: pip install 'autotune[plots]'") from None
    out = Path(out_dir) if out_dir is not None else study_dir(study.study_name, Path(studies_dir))
    out.mkdir(parents=True, exist_ok=True)
    diagnoses = diagnose_study(study)
    pngs, png_skipped = write_pngs(study, out)
    figures, skipped = _plotly_figures(study)
    sections = []
    plotlyjs: Union[bool, str] = True  # embedded once, so the report opens on a machine without internet
    for name, (title, what) in PLOTS.items():
        body = f"<p class=what>{html.escape(what)}</p>"
        if name in figures:
            body += figures[name].to_html(full_html=False, include_plotlyjs=plotlyjs, default_width="100%")
            plotlyjs = False
        else:
            body += f"<p class=skipped>Not drawn: {html.escape(skipped.get(name, 'unknown'))}</p>"
        if name in pngs:
            body += f'<p><a href="{pngs[name].name}">{pngs[name].name}</a></p>'
        sections.append(f"<h2>{html.escape(title)}</h2>\n{body}")
    header = ["#", "state", "status", "config", "samples/s", "accuracy loss", "data wait", "GPU util", "diagnosis",
              "evidence"]
    table = "<table><tr>" + "".join(f"<th>{h}</th>" for h in header) + "</tr>\n"
    for row in _table_rows(study, diagnoses):
        table += "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>\n"
    table += "</table>"
    summary = "".join(f"<li>{_inline(line)}</li>" for line in summary_lines(study, diagnoses))
    names = ", ".join(_metric_names(study))
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>autotune report: {html.escape(study.study_name)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1400px}} table{{border-collapse:collapse;font-size:90%}}
td,th{{border:1px solid #ccc;padding:3px 6px;vertical-align:top}} .what{{color:#555}} .skipped{{color:#a00}}</style>
</head><body>
<h1>autotune report: {html.escape(study.study_name)}</h1>
<p>Objectives: {html.escape(names)}. Target: <code>{html.escape(_shown_target(str(study.user_attrs.get("target", ""))))}</code>.</p>
<ul>{summary}</ul>
{chr(10).join(sections)}
<h2>Diagnosis</h2>
<p class=what>What held each trial back, from its loader wait, NVML readings where there are any, the same config
with CUDA Graphs toggled, and which batch sizes ran out of memory.</p>
{table}
</body></html>
"""
    path = out / "report.html"
    write_atomic(path, page)  # a symlink planted at report.html is replaced, never written through
    return Report(path, pngs, {**png_skipped, **skipped})


def _shown_target(target: str) -> str:
    """A ``path.py:func`` target relative to the working folder when it lies inside it (a report is read
    beside the project, and a shared one should not carry the machine's folders)."""
    path, sep, func = target.rpartition(":")
    if not sep or not path.endswith(".py") or not os.path.isabs(path):
        return target
    try:
        return f"{Path(path).relative_to(Path.cwd())}:{func}"
    except ValueError:
        return target


def _inline(markdown: str) -> str:
    text = html.escape(markdown)
    text = re.sub(r"`([^`]+)`", r"<code>\1</code>", text)
    return re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", text)
