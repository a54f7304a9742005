"""Confirming the best before it is declared: the top-K re-measurement, and an optional long run.

The top-K re-measurement alternates the K fastest configs and the baseline (A B C base, then
base C B A, ...), so the winner's median and the baseline's median are measured the same way, in the
same stretch of time, and the speed-up is their ratio. Several workers may share a study: the one that
finishes last claims the re-measurement with a study attribute, so it runs once per study.
"""

from __future__ import annotations

import socket
import statistics
import time
from typing import Any, Optional

import optuna
from optuna.trial import TrialState

from autotune._config import Budget, TrialConfig, TrialRecord
from autotune._records import CONFIRMATION, _best_record, _feasible
from autotune.study._options import ConfirmOptions
from autotune.study._progress import _Progress
from autotune.study._runner import TrialRunner
from autotune.study._workers import _worker_alive

CLAIM = "top_k_confirmation_claim"
# How long a claim settles before its worker reads it back (Fischer's mutual exclusion): longer than a
# storage write takes, so of two workers that claim at once both see the last claim written.
CLAIM_SETTLE_SECONDS = 2.0
BASELINE_KEY = "baseline"  # the baseline's key in the rounds when it is no trial of the space


def _candidates(study: optuna.Study, top_k: int) -> tuple[list[TrialRecord], Optional[TrialRecord], TrialConfig]:
    """The K fastest distinct feasible configs by their first run, and the baseline's trial (if it is one)."""
    feasible = _feasible(study)
    ranked: list[TrialRecord] = []
    for record in sorted(feasible, key=lambda r: -r.throughput):
        if record.config not in [r.config for r in ranked]:
            ranked.append(record)
    ranked = ranked[:top_k]
    baseline = TrialConfig.from_dict(study.user_attrs["baseline_config"])
    baseline_trial = next((r for r in ranked if r.config == baseline), None)
    baseline_trial = baseline_trial or next((r for r in feasible if r.config == baseline), None)
    return ranked, baseline_trial, baseline


def confirm_top_k(study: optuna.Study, runner: TrialRunner, options: ConfirmOptions, *, seed: int,
                  ui: _Progress, worker: str = "") -> bool:
    """Re-measure the top K configs and the baseline in alternation, so that drift or one lucky sample
    cannot crown one, and so that the speed-up compares medians measured the same way.

    Skipped when these configs were confirmed already (a resume that added nothing faster), when a trial
    is still running (its worker confirms when it finishes), or when another worker holds the claim.
    Returns whether it ran.
    """
    if options.top_k < 1:  # top-1 still alternates the pick with the baseline
        return False
    ranked, baseline_trial, baseline = _candidates(study, options.top_k)
    order = [(str(r.number), r.config) for r in ranked]
    if baseline_trial is None:
        order.append((BASELINE_KEY, baseline))
    elif baseline_trial.number not in [r.number for r in ranked]:
        order.append((str(baseline_trial.number), baseline))
    if len(order) < 2:
        return False
    signature = [r.number for r in ranked] + [baseline_trial.number if baseline_trial else None]
    previous = study.user_attrs.get(CONFIRMATION)
    if previous and previous.get("candidates") == signature:
        return False  # already confirmed these, e.g. on a resume with nothing new
    if _running_elsewhere(study):
        return False
    hold = len(order) * options.confirm_rounds * runner.timeout
    if not _claim(study, signature, worker, hold_seconds=hold):
        return False
    rounds: list[dict[str, Optional[float]]] = []
    for round_index in range(options.confirm_rounds):
        # Every other round runs backwards, so that a steady drift favours no position.
        sequence = order if round_index % 2 == 0 else order[::-1]
        rates: dict[str, Optional[float]] = {}
        for key, config in sequence:
            label = "the baseline" if key == BASELINE_KEY else f"#{key}"
            ui.status(f"top-{len(ranked)} confirmation with the baseline, round {round_index + 1}: {label}")
            outcome = runner.run(config, f"confirm-{key}-{round_index}", seed=seed)
            ok = outcome.ok and outcome.measurement is not None
            rates[key] = outcome.measurement.throughput if ok else None  # type: ignore[union-attr]
        rounds.append({key: rates[key] for key, _ in order})
    throughputs = {int(key): [r[key] for r in rounds if r[key] is not None] for key, _ in order if key != BASELINE_KEY}
    medians = {n: statistics.median(v) for n, v in throughputs.items() if v}
    base_key = BASELINE_KEY if baseline_trial is None else str(baseline_trial.number)
    base_rates = [r[base_key] for r in rounds]
    base_ok = [v for v in base_rates if v is not None]
    study.set_user_attr(CONFIRMATION, {
        "trials": [r.number for r in ranked],
        "candidates": signature,
        "throughputs": throughputs,
        "medians": medians,
        "winner": max(medians, key=lambda n: medians[n]) if medians else None,
        "rounds": rounds,  # per round, by trial number (or "baseline"); None where the run failed
        "baseline": {"trial": baseline_trial.number if baseline_trial else None, "throughputs": base_rates,
                     "median": statistics.median(base_ok) if base_ok else None},
        "worker": worker,
    })
    return True


def _running_elsewhere(study: optuna.Study) -> bool:
    """A trial still runs in a live worker: that worker reaches this point after it and confirms then."""
    host = socket.gethostname()
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker = trial.user_attrs.get("worker", "")
        if not worker.startswith(f"{host}:") or _worker_alive(worker):
            return True
    return False


def _claim_live(claim: dict[str, Any], hold_seconds: float) -> bool:
    worker = str(claim.get("worker", ""))
    if worker.startswith(f"{socket.gethostname()}:"):
        return _worker_alive(worker)
    return time.time() - float(claim.get("at", 0.0)) < hold_seconds  # another host: trust it for a while


def _claim(study: optuna.Study, signature: list[Optional[int]], worker: str, *, hold_seconds: float) -> bool:
    """Claim the re-measurement of these candidates for ``worker``: False when another live worker has.

    Optuna's storages have no compare-and-set, so this is Fischer's algorithm: check, write, wait longer
    than a write takes, read back. Of workers that claim at the same moment only the last writer keeps
    it; one that comes later sees the claim and leaves it.
    """
    claim = study.user_attrs.get(CLAIM)
    if (claim and claim.get("candidates") == signature and claim.get("worker") != worker
            and _claim_live(claim, hold_seconds)):
        return False
    study.set_user_attr(CLAIM, {"worker": worker, "candidates": signature, "at": time.time()})
    others = {t.user_attrs.get("worker") for t in study.get_trials(deepcopy=False)} - {worker, None}
    if not others:
        return True  # this process ran every trial: nobody else can be claiming
    time.sleep(CLAIM_SETTLE_SECONDS)
    claim = study.user_attrs.get(CLAIM) or {}
    return claim.get("worker") == worker and claim.get("candidates") == signature


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
