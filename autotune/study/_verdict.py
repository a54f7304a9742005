"""The accuracy verdict: is a trial's training equivalent to fp32's, judged on its loss trajectory and metric.

Pure functions of recorded numbers, so they are tested on their own and replayed on stored studies.

The statistic is the mean training loss over the last quarter of the optimizer steps. The fp32 reference
runs (two or more seeds at the same global batch) give the seed-to-seed distribution of that statistic; a
trial is ``degraded`` when its statistic lies above the one-sided 95% prediction interval of that
distribution (Student's t with n - 1 degrees of freedom: the interval a new run of the reference would
fall in), widened to a floor: ``LOSS_FLOOR`` of the reference's final loss, and ``DROP_FLOOR`` of how far
its loss fell. Seeds that happen to agree closely must not make the check stricter than rounding: a
training that drives its loss near zero reaches a floor set by the precision (bf16 stopped at 0.04 where
fp32 reached 0.003 on an H200 run whose held-out accuracy was perfect), and a difference that small
against what the training learned is not harm. The user's metric, when
reported, is checked as before: a loss over ``max_accuracy_loss`` plus the metric's seed spread is
``degraded``. A non-finite loss, or a trial whose loss ends well above where it started (by
``DIVERGED_RISE``) while the reference learned, is ``diverged``; one that merely fails to learn is ``degraded``. With nothing to compare (no loss recorded, no metric), the verdict is
``unchecked``, never a pass.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Optional, Sequence

VERDICTS: tuple[str, ...] = ("equivalent", "degraded", "diverged", "unchecked")
INFEASIBLE_VERDICTS = frozenset({"degraded", "diverged"})
LOSS_FLOOR = 0.02  # of the reference's final loss: the smallest tolerance ...
DROP_FLOOR = 0.01  # ... or this share of how far the reference's loss fell, whichever is larger
LEARNED_FRACTION = 0.05  # a reference whose loss fell by less than this share of its start did not learn
SWAMPED_FRACTION = 0.5  # a tolerance above this share of the reference's drop cannot see harm
DIVERGED_RISE = 0.25  # a loss that ends this share above where it began, while fp32 learned, diverged
# One-sided 95% quantiles of Student's t by degrees of freedom (1-10); 1.645 beyond.
_T95 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833, 10: 1.812}


def t95(dof: int) -> float:
    """The one-sided 95% quantile of Student's t with ``dof`` degrees of freedom."""
    return _T95.get(dof, 1.645 if dof > 30 else 1.7)


@dataclass(frozen=True)
class LossSummary:
    """A loss trajectory reduced to what the verdict compares."""

    first: float  # mean of the first sixteenth of the points (at least one): where training started
    final: float  # mean over the last quarter of the points
    points: int
    finite: bool

    @classmethod
    def of(cls, losses: Sequence[float]) -> Optional["LossSummary"]:
        if not losses:
            return None
        finite = all(math.isfinite(v) for v in losses)
        head, tail = list(losses[:max(1, len(losses) // 16)]), list(losses[-max(1, len(losses) // 4):])
        return cls(first=statistics.fmean(head) if finite else math.nan,
                   final=statistics.fmean(tail) if finite else math.nan, points=len(losses), finite=finite)


@dataclass(frozen=True)
class ReferenceBand:
    """What the fp32 reference runs at one global batch reached, seed by seed."""

    firsts: tuple[float, ...] = ()
    finals: tuple[float, ...] = ()
    metrics: tuple[Optional[float], ...] = ()

    @classmethod
    def of(cls, runs: Sequence[tuple[Sequence[float], Optional[float]]]) -> "ReferenceBand":
        """From ``(losses, metric)`` of each reference seed; runs without a finite trajectory give no loss."""
        summaries = [LossSummary.of(losses) for losses, _ in runs]
        usable = [s for s in summaries if s is not None and s.finite]
        return cls(firsts=tuple(s.first for s in usable), finals=tuple(s.final for s in usable),
                   metrics=tuple(m for _, m in runs))

    @property
    def has_losses(self) -> bool:
        return bool(self.finals)

    @property
    def mean_final(self) -> float:
        return statistics.fmean(self.finals)

    @property
    def drop(self) -> float:
        """How far the reference's loss fell: first point to last quarter, averaged over seeds."""
        return statistics.fmean(self.firsts) - self.mean_final

    @property
    def tolerance(self) -> float:
        """How far above the references' mean a trial's final loss may lie."""
        floor = max(LOSS_FLOOR * abs(self.mean_final), DROP_FLOOR * max(self.drop, 0.0))
        if len(self.finals) < 2:
            return max(floor, 1e-12)
        n = len(self.finals)
        interval = t95(n - 1) * statistics.stdev(self.finals) * math.sqrt(1 + 1 / n)
        return max(interval, floor, 1e-12)

    @property
    def metric_values(self) -> list[float]:
        return [m for m in self.metrics if m is not None]

    @property
    def metric_band(self) -> float:
        values = self.metric_values
        return max(values) - min(values) if len(values) >= 2 else 0.0

    def loss_blind_reason(self) -> Optional[str]:
        """Why the loss comparison cannot tell harmed training from clean, if it cannot."""
        if not self.has_losses:
            return None
        start = statistics.fmean(self.firsts)
        if self.drop < LEARNED_FRACTION * abs(start):
            return (f"the fp32 reference's training loss barely fell ({start:.4g} to {self.mean_final:.4g}), so the "
                    "loss check cannot tell harmed training from clean")
        if self.tolerance > SWAMPED_FRACTION * self.drop:
            return (f"the seed-to-seed spread of the final loss (tolerance {self.tolerance:.4g}) is more than half of "
                    f"what the reference learned ({self.drop:.4g})")
        return None

    def metric_blind_reason(self, max_accuracy_loss: float) -> Optional[str]:
        """Why the metric comparison cannot resolve ``max_accuracy_loss``, if it cannot."""
        if len(self.metric_values) >= 2 and self.metric_band > max_accuracy_loss:
            return (f"the reference metric's seed spread ({self.metric_band:.4g}) exceeds the bound "
                    f"max_accuracy_loss={max_accuracy_loss:g}")
        return None

    def blind_reasons(self, max_accuracy_loss: float) -> list[str]:
        """Why this reference cannot tell a harmed config from a clean one, if it cannot."""
        reasons = [r for r in (self.loss_blind_reason(), self.metric_blind_reason(max_accuracy_loss)) if r]
        if not self.has_losses and not self.metric_values:
            reasons.append("the workload records no training loss and reports no metric")
        return reasons

    def is_blind(self, max_accuracy_loss: float) -> bool:
        """True when no part of the check can vouch: each part is absent or blind.

        One blind part (say, a metric whose seed spread exceeds the bound) leaves the verdict to the other.
        """
        loss_vouches = self.has_losses and self.loss_blind_reason() is None
        metric_vouches = bool(self.metric_values) and self.metric_blind_reason(max_accuracy_loss) is None
        return not (loss_vouches or metric_vouches)

    def to_dict(self) -> dict[str, Any]:
        return {"firsts": list(self.firsts), "finals": list(self.finals), "metrics": list(self.metrics)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ReferenceBand":
        return cls(firsts=tuple(data.get("firsts", ())), finals=tuple(data.get("finals", ())),
                   metrics=tuple(data.get("metrics", ())))


@dataclass(frozen=True)
class Verdict:
    """A trial's accuracy verdict with its one-sentence evidence.

    ``constraint`` is what the study's ``accuracy`` constraint stores: at most 0 when feasible. It is the
    largest excess over a check's bound, each in its own units (loss above its tolerance; metric loss
    above its bound), so a metric-only check stores what it always did: metric loss minus its bound.
    """

    label: str
    evidence: str
    accuracy_loss: float = 0.0  # in metric units (0 without a metric)
    constraint: float = -1.0

    @property
    def feasible(self) -> bool:
        return self.label not in INFEASIBLE_VERDICTS


def metric_loss(reference: Optional[float], metric: Optional[float], direction: str) -> Optional[float]:
    """How much worse ``metric`` is than ``reference`` (positive is worse), or None without both."""
    if reference is None or metric is None:
        return None
    return reference - metric if direction == "maximize" else metric - reference


def judge(losses: Sequence[float], metric: Optional[float], band: ReferenceBand, *, reference_metric: Optional[float],
          max_accuracy_loss: float, metric_direction: str = "maximize",
          baseline_metric: Optional[float] = None) -> Verdict:
    """Judge one trial against the fp32 references at its global batch.

    A check whose reference is blind (``ReferenceBand.loss_blind_reason``, ``metric_blind_reason``) can
    still find a trial degraded, far outside even its wide band, but cannot vouch for it: with no check
    left that can, the verdict is ``unchecked``, never ``equivalent``.

    Args:
        losses: The trial's training loss per optimizer step (or per bin of steps).
        metric: The trial's reported metric, if any.
        band: The fp32 references at the same global batch.
        reference_metric: The metric the trial's own-seed reference reached (the study's reference metric).
        max_accuracy_loss: The bound on the metric loss, in metric units.
        metric_direction: ``"maximize"`` for accuracy-like metrics, ``"minimize"`` for losses.
        baseline_metric: Under ``batch_policy: scale``, the metric of fp32 at the baseline's global batch: a
            reference at the trial's own global batch that reached far less learned less than the baseline
            did, so its metric cannot vouch for the trial.
    """
    trial = LossSummary.of(losses)
    parts: list[str] = []
    excesses: list[float] = []
    label = "equivalent"
    vouched = False
    if trial is not None and not trial.finite:
        return Verdict("diverged", "the training loss became non-finite", math.inf, 1.0)
    if trial is not None and band.has_losses:
        tol = band.tolerance
        excess = trial.final - band.mean_final
        excesses.append(excess - tol)
        seeds = len(band.finals)
        where = (f"final-quarter loss {trial.final:.4g} against fp32 {band.mean_final:.4g} "
                 f"({seeds} seed{'s' if seeds != 1 else ''}, tolerance +{tol:.3g})")
        if band.drop > tol and trial.final > trial.first * (1 + DIVERGED_RISE):
            return Verdict("diverged", f"{where}: it ended above its first loss {trial.first:.4g} while fp32 "
                           f"fell by {band.drop:.3g}", math.inf, 1.0)
        blind = band.loss_blind_reason()
        if excess > tol:
            label = "degraded"
            parts.append(f"{where}: {excess:+.3g} is outside the reference band")
        else:
            parts.append(f"{where}: within" + (f", but {blind}" if blind else ""))
            vouched = vouched or not blind
    elif trial is None:
        parts.append("no training loss was recorded")
    loss = metric_loss(reference_metric, metric, metric_direction)
    if loss is not None:
        threshold = max_accuracy_loss + band.metric_band
        excesses.append(loss - threshold)
        text = f"metric {metric:.4g} against fp32 {reference_metric:.4g} (loss {loss:+.3g}, bound {threshold:.3g})"
        blind = band.metric_blind_reason(max_accuracy_loss)
        below = metric_loss(baseline_metric, reference_metric, metric_direction)
        if blind is None and below is not None and below > threshold:
            blind = (f"fp32 at this global batch itself reached {reference_metric:.4g} against {baseline_metric:.4g} "
                     "at the baseline's, so it learned less than the baseline in this trial's length")
        if loss > threshold:
            label = "degraded"
            parts.append(text + ": over the bound")
        else:
            parts.append(text + ": within" + (f", but {blind}" if blind else ""))
            vouched = vouched or not blind
    if not excesses:
        return Verdict("unchecked", "; ".join(parts + ["no metric was reported: nothing to compare"]), 0.0, -1.0)
    if label == "equivalent" and not vouched:
        label = "unchecked"
    return Verdict(label, "; ".join(parts), loss or 0.0, max(excesses))
