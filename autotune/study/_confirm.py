"""Confirming the best before it is declared: the top-K re-measurement, and an optional long run."""

from __future__ import annotations

import statistics
from typing import Any

import optuna

from autotune._config import Budget, TrialRecord
from autotune._records import _best_record, _feasible
from autotune.study._options import ConfirmOptions
from autotune.study._progress import _Progress
from autotune.study._runner import TrialRunner


def confirm_top_k(study: optuna.Study, runner: TrialRunner, options: ConfirmOptions, *, seed: int,
                  ui: _Progress) -> None:
    """Re-measure the top K configs in alternation so that drift or one lucky sample cannot crown one."""
    ranked: list[TrialRecord] = []
    for record in sorted(_feasible(study), key=lambda r: -r.throughput):
        if record.config not in [r.config for r in ranked]:
            ranked.append(record)
    ranked = ranked[: options.top_k]
    if len(ranked) < 2:
        return
    previous = study.user_attrs.get("top_k_confirmation")
    if previous and previous.get("trials") == [r.number for r in ranked]:
        return  # already confirmed these, e.g. on a resume with nothing new
    rates: dict[int, list[float]] = {r.number: [] for r in ranked}
    for round_index in range(options.confirm_rounds):
        for record in ranked:
            ui.status(f"top-{len(ranked)} confirmation round {round_index + 1}: #{record.number}")
            outcome = runner.run(record.config, f"confirm-{record.number}-{round_index}", seed=seed)
            if outcome.ok and outcome.measurement is not None:
                rates[record.number].append(outcome.measurement.throughput)
    medians = {n: statistics.median(v) for n, v in rates.items() if v}
    if not medians:
        return
    winner = max(medians, key=lambda n: medians[n])
    study.set_user_attr(
        "top_k_confirmation",
        {"trials": [r.number for r in ranked], "throughputs": rates, "medians": medians, "winner": winner},
    )


def confirm_long(study: optuna.Study, runner: TrialRunner, options: ConfirmOptions, *, seed: int,
                 metric_direction: str, ui: _Progress) -> None:
    """Train the best config and the fp32 reference for ``confirm_samples`` each and record both."""
    best = _best_record(study)
    if best is None:
        return
    budget = Budget(samples=options.confirm_samples or 0, warmup_steps=runner.budget.warmup_steps,
                    windows=runner.budget.windows)
    report: dict[str, Any] = {"samples": budget.samples}
    for role, config in (("reference", runner.baseline.replace(precision="fp32")), ("best", best.config)):
        ui.status(f"confirmation: {role} for {budget.samples} samples")
        outcome = runner.run(config, f"confirm-{role}", seed=seed, budget=budget,
                             timeout=runner.timeout * max(1.0, budget.samples / runner.budget.samples))
        report[role] = outcome.to_dict()
    ref_m = (report["reference"].get("measurement") or {}).get("metric")
    best_m = (report["best"].get("measurement") or {}).get("metric")
    if ref_m is not None and best_m is not None:
        report["accuracy_loss"] = ref_m - best_m if metric_direction == "maximize" else best_m - ref_m
    study.set_user_attr("confirmation", report)
