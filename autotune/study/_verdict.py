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

When the trial is paired with the fp32 reference at its own seed (same initial weights, same batches in
the same order: ``pairing_failure`` checks it), the loss is judged step by step instead of against the
band: the paired difference over the last ``PAIRED_WINDOW`` of the points, averaged in ``PAIRED_BLOCKS``
blocks (neighbouring steps are correlated; block means much less), must have its one-sided 95% upper
bound below a margin (``paired_margin``). That sees harm far below the seed-to-seed spread. Where the
pairing does not hold, the band judges, and the evidence says why. A pairing can also hold at the start and
decay: on a chaotic training a clean config's trajectory wanders from its twin's as far as another seed's
does (``pairing_decay``). Its paired difference then carries a seed-sized offset that the block means do not
see, so a pass within the small margin proves nothing and the band judges; a difference above the margin is
still not shown equivalent. docs/accuracy-verdict.md explains it.
"""

from __future__ import annotations

import math
import statistics
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

VERDICTS: tuple[str, ...] = ("equivalent", "degraded", "diverged", "unchecked")
INFEASIBLE_VERDICTS = frozenset({"degraded", "diverged"})
LOSS_FLOOR = 0.02  # of the reference's final loss: the smallest tolerance ...
DROP_FLOOR = 0.01  # ... or this share of how far the reference's loss fell, whichever is larger
LEARNED_FRACTION = 0.05  # a reference whose loss fell by less than this share of its start did not learn
SWAMPED_FRACTION = 0.5  # a tolerance above this share of the reference's drop cannot see harm
DIVERGED_RISE = 0.25  # a loss that ends this share above where it began, while fp32 learned, diverged
PAIRED_WINDOW = 0.5  # the paired test judges the last half of the loss points: the training's outcome
PAIRED_BLOCKS = 8  # block means of the paired difference: few enough that neighbouring blocks are near independent
PAIRED_SHARE = 0.1  # the margin: a tenth of how far a change of seed moves fp32's loss, paired the same way ...
PAIRED_FLOOR = 0.025  # ... or this share of the reference's loss (max_accuracy_loss when larger): bf16 rounding alone
# moved the planted workload's paired loss by up to 1.9% of it (benchmarks/results/accuracy-cpu.md)
PAIRED_DROP_FLOOR = 0.001  # ... or this share of how far the reference's loss fell: a tenth of the band's DROP_FLOOR,
# as the paired margin is a tenth of the seeds' drift. It binds only on a loss driven near zero (under 4% of what
# it learned), where the precision sets the floor: an H200 ResNet-50 memorising its pool ended at fp32 0.0002 and
# bf16 0.0004 out of 3.4 learned, with both seeds' held-out accuracy 1.0 (benchmarks/results/accuracy-h200.md).
MIN_PAIRED_POINTS = 8  # fewer points in the window cannot give block means
DECAYED_SHARE = 0.1  # a pairing that leaves this share of the seeds' per-step variance in the paired difference has
# decayed: a held one cancels nearly all of it (clean CPU twins left at most 0.3%, a stable H200 ResNet-50 3%;
# clean chaotic H200 runs 27% to 102%). Seed differences also hold batch-content noise that paired ones never
# do, so a decayed pairing can show well under 100%: the share flags decay early rather than waiting for that.
FINGERPRINT_RTOL = 1e-6  # float64 sums of the same numbers in another order agree far closer than this
FIRST_LOSS_RTOL = 1e-3  # an fp32 trial's first loss against the reference's: same weights, same batch
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
    # The first seed's trajectory at its stored resolution and its fingerprints (``ctx`` extras
    # ``pairing.*``), for the paired test of a trial at that seed; the second seed's paired difference from
    # it (``paired_difference``'s mean) sets the margin. Empty for a study from before paired checks.
    paired: tuple[float, ...] = ()
    paired_every: int = 1
    pairing: dict[str, list[float]] = field(default_factory=dict)
    drift: Optional[float] = None
    # How far the second seed's paired difference wanders around its own linear trend over the window (its
    # ``wander``): the scale a decayed pairing reaches. None for a study from before decay checks: no check.
    seed_wander: Optional[float] = None

    @classmethod
    def of(cls, runs: Sequence[tuple[Sequence[float], Optional[float]]]) -> "ReferenceBand":
        """From ``(losses, metric)`` of each reference seed; runs without a finite trajectory give no loss."""
        summaries = [LossSummary.of(losses) for losses, _ in runs]
        usable = [s for s in summaries if s is not None and s.finite]
        return cls(firsts=tuple(s.first for s in usable), finals=tuple(s.final for s in usable),
                   metrics=tuple(m for _, m in runs))

    @classmethod
    def of_measurements(cls, measurements: Sequence[Any]) -> "ReferenceBand":
        """From the reference seeds' ``Measurement``s, first seed first: the band, and what pairing needs."""
        band = cls.of([(m.losses, m.metric) for m in measurements])
        first = measurements[0] if measurements else None
        if first is None or not first.losses or not all(math.isfinite(v) for v in first.losses):
            return band
        drift = seed_wander = None
        if len(measurements) >= 2 and len(measurements[1].losses) == len(first.losses):
            paired = paired_difference(measurements[1].losses, first.losses)
            drift = paired[0] if paired is not None and math.isfinite(paired[0]) else None
            seed_wander = wander(measurements[1].losses, first.losses) if drift is not None else None
        return dataclasses.replace(band, paired=tuple(first.losses), paired_every=first.loss_every,
                                   pairing=fingerprints(first.extras), drift=drift, seed_wander=seed_wander)

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

    def loss_blind_reason(self, paired_margin: Optional[float] = None) -> Optional[str]:
        """Why the loss comparison cannot tell harmed training from clean, if it cannot.

        Args:
            paired_margin: The paired test's margin when it judges; else the band's tolerance is weighed.
        """
        if not self.has_losses:
            return None
        start = statistics.fmean(self.firsts)
        if self.drop < LEARNED_FRACTION * abs(start):
            moved = "rose" if self.mean_final > start else "barely fell"  # "barely fell (7.013 to 8.006)" was said
            return (f"the fp32 reference's training loss {moved} ({start:.4g} to {self.mean_final:.4g}), so the "
                    "loss check cannot tell harmed training from clean")
        if paired_margin is not None:
            if paired_margin > SWAMPED_FRACTION * self.drop:
                return (f"the paired test's margin ({paired_margin:.4g}) is more than half of what the reference "
                        f"learned ({self.drop:.4g})")
            return None
        if self.tolerance > SWAMPED_FRACTION * self.drop:
            return (f"the seed-to-seed spread of the final loss (tolerance {self.tolerance:.4g}) is more than half of "
                    f"what the reference learned ({self.drop:.4g})")
        return None

    def _study_loss_blind_reason(self, max_accuracy_loss: float) -> Optional[str]:
        # A trial at the references' seed is paired when they stored a trajectory; the band is the fallback.
        return self.loss_blind_reason(self.paired_margin(max_accuracy_loss) if self.paired else None)

    def metric_blind_reason(self, max_accuracy_loss: float) -> Optional[str]:
        """Why the metric comparison cannot resolve ``max_accuracy_loss``, if it cannot."""
        values = self.metric_values
        if len(values) >= 2 and self.metric_band == 0.0:
            # Seeds that land on the same value (accuracy 1.0 on an easy task) show a metric at its
            # ceiling: a harmed config reaches it too, so agreeing with it proves nothing.
            return (f"every fp32 reference seed reached the same metric ({values[0]:.4g}): a saturated metric "
                    "cannot tell a harmed config from a clean one unless the harm pulls it down")
        if len(values) >= 2 and self.metric_band > max_accuracy_loss:
            return (f"the reference metric's seed spread ({self.metric_band:.4g}) exceeds the bound "
                    f"max_accuracy_loss={max_accuracy_loss:g}")
        return None

    def blind_reasons(self, max_accuracy_loss: float) -> list[str]:
        """Why this reference cannot tell a harmed config from a clean one, if it cannot."""
        reasons = [r for r in (self._study_loss_blind_reason(max_accuracy_loss),
                               self.metric_blind_reason(max_accuracy_loss)) if r]
        if not self.has_losses and not self.metric_values:
            reasons.append("the workload records no training loss and reports no metric")
        return reasons

    def is_blind(self, max_accuracy_loss: float) -> bool:
        """True when no part of the check can vouch: each part is absent or blind.

        One blind part (say, a metric whose seed spread exceeds the bound) leaves the verdict to the other.
        """
        loss_vouches = self.has_losses and self._study_loss_blind_reason(max_accuracy_loss) is None
        metric_vouches = bool(self.metric_values) and self.metric_blind_reason(max_accuracy_loss) is None
        return not (loss_vouches or metric_vouches)

    def to_dict(self) -> dict[str, Any]:
        return {"firsts": list(self.firsts), "finals": list(self.finals), "metrics": list(self.metrics),
                "paired": list(self.paired), "paired_every": self.paired_every, "pairing": dict(self.pairing),
                "drift": self.drift, "seed_wander": self.seed_wander}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ReferenceBand":
        return cls(firsts=tuple(data.get("firsts", ())), finals=tuple(data.get("finals", ())),
                   metrics=tuple(data.get("metrics", ())), paired=tuple(data.get("paired", ())),
                   paired_every=int(data.get("paired_every", 1)), pairing=dict(data.get("pairing") or {}),
                   drift=data.get("drift"), seed_wander=data.get("seed_wander"))

    def paired_margin(self, max_accuracy_loss: float) -> float:
        """How far above the same-seed reference a trial's window-mean loss may lie.

        A tenth of the second seed's paired drift: on a loss still falling steeply a change of seed moves
        the trajectory far, and so may a harmless change of rounding. At least ``max_accuracy_loss`` (read
        as a share of the loss) or ``PAIRED_FLOOR`` of the reference's window loss, so seeds that agree
        closely do not make the test stricter than rounding. At least ``PAIRED_DROP_FLOOR`` of how far the
        reference's loss fell: on a loss driven near zero a share of the loss is stricter than rounding too.
        """
        window = self.paired[-_window(len(self.paired)):]
        level = abs(statistics.fmean(window)) if window else 0.0
        drift = PAIRED_SHARE * abs(self.drift) if self.drift is not None else 0.0
        learned = PAIRED_DROP_FLOOR * max(self.drop, 0.0) if self.has_losses else 0.0
        return max(drift, max(max_accuracy_loss, PAIRED_FLOOR) * level, learned, 1e-12)

    def paired_margin_floored(self, max_accuracy_loss: float) -> bool:
        """True when the margin is set by what fp32 learned: its loss is near zero, where precision sets the floor."""
        if not self.has_losses or self.drop <= 0:
            return False
        return self.paired_margin(max_accuracy_loss) <= PAIRED_DROP_FLOOR * self.drop


def fingerprints(extras: dict[str, Any]) -> dict[str, list[float]]:
    """The pairing fingerprints a trial recorded (``pairing.weights``, ``pairing.batch``), by name."""
    return {k.split(".", 1)[1]: list(v) for k, v in (extras or {}).items() if k.startswith("pairing.")}


def _window(points: int) -> int:
    return max(1, int(points * PAIRED_WINDOW))


def _window_differences(losses: Sequence[float], reference: Sequence[float]) -> Optional[list[float]]:
    """``losses - reference`` over the last ``PAIRED_WINDOW`` of the points; None below ``MIN_PAIRED_POINTS``."""
    n = _window(len(losses))
    if n < MIN_PAIRED_POINTS or len(losses) != len(reference):
        return None
    return [a - b for a, b in zip(losses[-n:], reference[-n:])]


def paired_difference(losses: Sequence[float], reference: Sequence[float]) -> Optional[tuple[float, float, int]]:
    """The mean of ``losses - reference`` over the last ``PAIRED_WINDOW`` of the points, its one-sided 95%
    upper bound from ``PAIRED_BLOCKS`` block means (Student's t), and the points it spans; None when the
    window holds fewer than ``MIN_PAIRED_POINTS``."""
    diffs = _window_differences(losses, reference)
    if diffs is None:
        return None
    n = len(diffs)
    blocks = min(PAIRED_BLOCKS, n)
    size = n // blocks
    # The first n % blocks points are left out so every block has the same length.
    means = [statistics.fmean(diffs[n - (i + 1) * size:n - i * size]) for i in range(blocks)]
    mean = statistics.fmean(means)
    upper = mean + t95(blocks - 1) * statistics.stdev(means) / math.sqrt(blocks)
    return mean, upper, n


def wander(losses: Sequence[float], reference: Sequence[float]) -> Optional[float]:
    """How far ``losses - reference`` fluctuates over the paired window: the standard deviation of its
    residuals around a least-squares line. None with fewer than ``MIN_PAIRED_POINTS`` in the window.

    A steady trend is left out: a difference that shrinks as two close runs converge, or grows as a harm
    accumulates, is not the step-to-step wandering of trajectories that have come apart.
    """
    diffs = _window_differences(losses, reference)
    if diffs is None:
        return None
    n = len(diffs)
    slope, intercept = statistics.linear_regression(range(n), diffs)
    return math.sqrt(sum((d - intercept - slope * t) ** 2 for t, d in enumerate(diffs)) / (n - 2))


def pairing_decay(band: ReferenceBand, losses: Sequence[float], loss_every: int = 1) -> Optional[str]:
    """Why a trial's pairing with the fp32 run at its seed decayed by the window, or None while it holds.

    Paired trajectories start together; on a chaotic training a clean config's drifts from its twin's as
    far as another seed's within a few steps. Its paired difference then wanders like the seeds' (second
    minus first, over the same window), and its mean carries an offset of that size which the block means do
    not see, so the small paired margin no longer means anything. Decayed: the paired difference's
    ``wander`` holds more than ``DECAYED_SHARE`` of the seeds' variance. A harm that is a shift leaves the
    wander small. Without the seeds' wander (a study from before this check, one seed), None.
    """
    if not band.seed_wander or not math.isfinite(band.seed_wander):
        return None
    own = wander(losses, band.paired)
    if own is None:
        return None
    share = (own / band.seed_wander) ** 2
    if share <= DECAYED_SHARE:
        return None
    return (f"pairing decayed: over the last {_window(len(losses)) * loss_every} steps the paired difference "
            f"wanders by {own:.3g} around its trend, {share:.0%} of the variance between two fp32 seeds' "
            f"({band.seed_wander:.3g}; at most {DECAYED_SHARE:.0%} while paired), so the trajectories have come "
            "about as far apart as another seed's")


def _differ(a: Sequence[float], b: Sequence[float]) -> bool:
    if len(a) != len(b):
        return True
    scale = max([abs(v) for v in (*a, *b)] or [0.0])
    return any(abs(x - y) > FINGERPRINT_RTOL * max(scale, 1e-12) for x, y in zip(a, b))


def pairing_failure(band: ReferenceBand, losses: Sequence[float], loss_every: int,
                    pairing: Optional[dict[str, list[float]]], precision: str = "fp32") -> Optional[str]:
    """Why the trial's steps cannot be paired with the fp32 reference's at its seed, or None when they can.

    Pairing needs the same initial weights and the same samples in the same order: the fingerprints of
    both (``ctx.model``, the first global batch of ``ctx.batches``) must agree, the trajectories must have
    the same points, and an fp32 trial's first loss must equal the reference's (a low-precision one's may
    differ by its rounding, or by the very harm being looked for).
    """
    if not band.paired:
        return "no same-seed fp32 trajectory was stored with the references"
    if pairing is None:
        return "the run is at another seed than the fp32 reference's"
    if len(losses) != len(band.paired) or loss_every != band.paired_every:
        return (f"its loss trajectory has {len(losses)} points of {loss_every} step(s) against the reference's "
                f"{len(band.paired)} of {band.paired_every}")
    if "batch" not in pairing or "batch" not in band.pairing:
        return "no fingerprint of the first batch was recorded (the loop does not use ctx.batches)"
    if _differ(pairing["batch"], band.pairing["batch"]):
        return ("its first global batch differs from the fp32 reference's at the same seed (an unseeded loader "
                "or random augmentation?)")
    if "weights" in pairing and "weights" in band.pairing and _differ(pairing["weights"], band.pairing["weights"]):
        return "its initial weights differ from the fp32 reference's at the same seed (an unseeded initialisation?)"
    first, reference = losses[0], band.paired[0]
    if precision == "fp32" and abs(first - reference) > FIRST_LOSS_RTOL * max(abs(reference), 1e-12):
        return f"its first loss {first:.6g} differs from the fp32 reference's {reference:.6g} at the same seed"
    if _window(len(losses)) < MIN_PAIRED_POINTS:
        return f"its {len(losses)} loss points are too few for block means"
    return None


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
    # ``unchecked`` because evidence the budget shortened could not tell: the share of the length it had.
    short_evidence: Optional[float] = None

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
          baseline_metric: Optional[float] = None, loss_every: int = 1,
          pairing: Optional[dict[str, list[float]]] = None, precision: str = "fp32",
          shortened: Optional[float] = None) -> Verdict:
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
        loss_every: The optimizer steps per point of ``losses``.
        pairing: The trial's fingerprints (``fingerprints`` of its extras) when it ran at the seed of the
            first reference; None for another seed. Paired, the loss is judged step by step.
        precision: The trial's precision: an fp32 trial's first loss must match the reference's exactly.
        shortened: The share of the space's length the evidence trained, where a study's budget shortened it
            (None at the full length). A decayed pairing whose difference is above the margin, on such
            evidence, while the seeds' band sees no harm, cannot tell: the verdict is ``unchecked`` (with
            ``short_evidence``), not ``degraded``, and longer evidence can settle it (``_planner.EXTEND``). At
            the full length the same evidence stays ``degraded``: it is all the space asks for.
    """
    trial = LossSummary.of(losses)
    parts: list[str] = []
    excesses: list[float] = []
    label = "equivalent"
    vouched = False
    undecided: Optional[float] = None  # the share of the length of shortened evidence that could not tell
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
        unpaired = pairing_failure(band, losses, loss_every, pairing, precision)
        paired = paired_difference(losses, band.paired) if unpaired is None else None
        decayed = pairing_decay(band, losses, loss_every) if paired is not None else None
        margin = band.paired_margin(max_accuracy_loss)
        if paired is not None and decayed and paired[1] <= margin:
            # A pass within the small margin proves nothing once the trajectories came apart: the band judges.
            paired, unpaired = None, decayed
        if paired is not None:
            excesses.pop()  # the paired test replaces the band
            mean, upper, points = paired
            excesses.append(upper - margin)
            blind = band.loss_blind_reason(margin)
            floored = (f", {PAIRED_DROP_FLOOR:.1%} of what fp32 learned ({band.drop:.3g}): its loss ended near zero "
                       f"({band.mean_final:.3g}), where the precision sets the floor"
                       if band.paired_margin_floored(max_accuracy_loss) else "")
            where = (f"paired with the fp32 run at its seed, loss higher by {mean:+.3g} over the last "
                     f"{points * loss_every} steps (95% upper bound {upper:.3g} {'>' if upper > margin else '<='} "
                     f"margin {margin:.3g}{floored})")
            if upper > margin and decayed and shortened is not None and excess <= tol:
                # Shortened, decayed and inside the seeds' band: this length cannot tell chaos from harm.
                excesses[-1] = excess - tol
                undecided = shortened
                parts.append(f"{where}; {decayed}; within the seeds' band on evidence shortened to {shortened:.0%} "
                             "of the length, which cannot tell: longer evidence settles it")
            elif upper > margin:
                # Decayed, a difference above the margin may be chaos as much as harm, but it is not shown
                # equivalent either, and the band cannot clear it: a harm that adds noise decays the pairing
                # too (bf16 at the planted offset 256), and the band missed it at 5 of 20 seeds.
                label = "degraded"
                parts.append(f"{where}; {decayed}" if decayed else where)
            else:
                parts.append(f"{where}: within" + (f", but {blind}" if blind else ""))
                vouched = vouched or not blind
        else:
            blind = band.loss_blind_reason()
            where += f"; not paired: {unpaired}" if unpaired else ""
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
    elif reference_metric is not None and metric is None:
        # The loss alone cannot vouch for a trial whose metric went missing: the code path that skipped
        # report_metric may be the one that harms it.
        parts.append(f"no metric was reported, though the fp32 reference reported {reference_metric:.4g}")
        vouched = False
    if not excesses:
        return Verdict("unchecked", "; ".join(parts + ["no metric was reported: nothing to compare"]), 0.0, -1.0)
    if label == "equivalent" and undecided is not None:
        return Verdict("unchecked", "; ".join(parts), loss or 0.0, min(0.0, max(excesses)), short_evidence=undecided)
    if label == "equivalent" and not vouched:
        label = "unchecked"
    return Verdict(label, "; ".join(parts), loss or 0.0, max(excesses))
