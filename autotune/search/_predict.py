"""A full trial's throughput predicted from its loader and its step, measured apart.

The model is tf.data's and DS-Analyzer's: a training loop runs no faster than its input pipeline nor than
its device step, so the prediction is ``min(loader rate, step rate)``, times a correction the study learns
from full trials (the median of measured / predicted): on an H200 the DataLoader configs ran 26-36% below
their prediction, since loading and stepping share one process (benchmarks/results/decomposed-h200.md).
The loader probes (``autotune.study._probes``) and ``autotune simulate`` share it.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional, Sequence, TypeVar

from autotune._config import SLOW_VARIANT_SHARE  # the trial layer measures by it, below this one

T = TypeVar("T")

__all__ = ["AS_TRIAL", "INPUT_BOUND", "LOADER_KNOBS", "MAX_LOADER_PROBES", "PredictionError", "SLOW_VARIANT_SHARE",
           "WORTH", "best_predicted", "correction_of", "loader_moves", "nearest_first", "predict",
           "prediction_error_summary", "step_ceiling"]

# When the loop probes, shared with the replay so that ``simulate`` measures what a study does.
INPUT_BOUND = 0.5  # share of a trial's timed windows spent waiting on input above which the loader is probed
WORTH = 1.05  # a variant predicted this much faster than the incumbent is worth a full trial
MAX_LOADER_PROBES = 12  # cheap, but a space with many loader values should not probe them all
AS_TRIAL = "as_trial"  # a loader probe record's status where its variant ran as a full trial, not probed
LOADER_KNOBS = ("loader", "augment", "num_workers", "pin_memory", "prefetch_factor", "persistent_workers")


def loader_moves(values: Mapping[str, Sequence[Any]], current: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """The loader probes' moves from ``current``, as the knobs to change: each other value of each loader knob
    in ``values`` (``LOADER_KNOBS`` order; numbers nearest first), then two knobs of the current backend at
    once, with a numeric knob only at its nearest values on either side.

    Loader knobs interact: more workers, each prefetching more batches, can run out of host memory or cores,
    so the workers can win only with less prefetch, a move neither wins alone (replayed in
    benchmarks/results/search.md, round 5). A probe costs a window, not a full trial, so the pairs are cheap.
    """
    knobs = [k for k in LOADER_KNOBS if k in values and k in current]
    for knob in knobs:
        for value in _by_distance(values[knob], current[knob]):
            yield {knob: value}
    # Not the backend: another backend's own knobs replace the DataLoader's, so a pair with it is its single.
    near = {k: _by_distance(values[k], current[k], nearest=True) for k in knobs if k != "loader"}
    for first, second in itertools.combinations(near, 2):
        for a, b in itertools.product(near[first], near[second]):
            yield {first: a, second: b}


def nearest_first(others: Sequence[Any], current: Any, *, downward: bool = False) -> list[Any]:
    """Numbers ``others`` by their distance from ``current`` on the ladder of values (not in absolute terms:
    batch sizes grow geometrically), the one above before the one below (below first with ``downward``)."""
    ladder = sorted({*others, current})
    here, sign = ladder.index(current), (1 if downward else -1)
    return sorted(others, key=lambda v: (abs(ladder.index(v) - here), sign * (ladder.index(v) - here)))


def _by_distance(values: Sequence[Any], current: Any, *, nearest: bool = False) -> list[Any]:
    """The other values of a knob; numbers nearest ``current`` first (``nearest``: only the one above and the
    one below). A far value is the likeliest to run far slower, and measured after a faster one it stops
    after its first window (``SLOW_VARIANT_SHARE``)."""
    others = [v for v in values if v != current]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in [*others, current]):
        return others
    if not nearest:
        return nearest_first(others, current)
    above = [v for v in others if v > current]
    below = [v for v in others if v < current]
    return ([min(above)] if above else []) + ([max(below)] if below else [])


def predict(loader_rate: Optional[float], step_rate: Optional[float], factor: float = 1.0) -> Optional[float]:
    """A full trial's samples/s from its loader's and its step's, measured apart."""
    rates = [r for r in (loader_rate, step_rate) if r]
    return min(rates) * factor if rates else None


def step_ceiling(throughput: Optional[float], data_wait_fraction: Optional[float]) -> Optional[float]:
    """The step's rate a full trial implies: its samples over the share of its time it did not wait on its
    input; None without a wait below 1. It can over-state the step, not under-state it: a device still busy
    with the last step while the host waits for the next batch counts as waiting. A variant predicted from it
    is checked by its own full trial, as every prediction is."""
    if not throughput or data_wait_fraction is None or not 0.0 <= data_wait_fraction < 1.0:
        return None
    return throughput / (1.0 - data_wait_fraction)


def best_predicted(candidates: Sequence[tuple[Optional[float], T]], step_rate: Optional[float], factor: float,
                   incumbent_rate: float) -> Optional[tuple[float, T]]:
    """Of ``(loader rate, variant)`` pairs, the variant ``predict`` rates fastest and its prediction, when that
    beats the incumbent by ``WORTH``; else None. A variant without a loader rate (its probe failed or ran out
    of time) is not predicted: the step's rate alone would promise it the step's speed."""
    best: Optional[tuple[float, T]] = None
    for loader_rate, variant in candidates:
        if not loader_rate:
            continue
        predicted = predict(loader_rate, step_rate, factor)
        if predicted is not None and (best is None or predicted > best[0]):
            best = (predicted, variant)
    return best if best is not None and best[0] >= WORTH * incumbent_rate else None


def correction_of(pairs: Sequence[tuple[float, float]]) -> float:
    """The median measured / predicted over ``(measured, predicted)`` pairs (1.0 with none)."""
    ratios = [measured / predicted for measured, predicted in pairs if measured and predicted]
    return statistics.median(ratios) if ratios else 1.0


@dataclass(frozen=True)
class PredictionError:
    """How far full trials fell from ``predict``: measured / predicted - 1 over ``rows`` configs.

    ``median``, ``low`` and ``high`` are of the raw prediction (the 10th and 90th percentiles for the range);
    ``corrected_median_abs`` is the median absolute error once the median ratio is applied, as a study
    applies its learned correction.
    """

    rows: int
    median: float
    low: float
    high: float
    correction: float
    corrected_median_abs: float

    def to_dict(self) -> dict[str, float]:
        return {"rows": self.rows, "median": round(self.median, 4), "p10": round(self.low, 4),
                "p90": round(self.high, 4), "correction": round(self.correction, 4),
                "corrected_median_abs": round(self.corrected_median_abs, 4)}

    def describe(self) -> str:
        return (f"probe prediction min(loader, step) over {self.rows} configs: measured / predicted - 1 "
                f"median {self.median:+.1%} (10th-90th percentile {self.low:+.1%} to {self.high:+.1%}); "
                f"with the learned correction x{self.correction:.2f}, median |error| {self.corrected_median_abs:.1%}")


def prediction_error_summary(pairs: Sequence[tuple[float, float]]) -> Optional[PredictionError]:
    """Summarise ``(measured, predicted)`` pairs; None without any."""
    usable = [(m, p) for m, p in pairs if m and p]
    if not usable:
        return None
    errors = sorted(m / p - 1.0 for m, p in usable)
    factor = correction_of(usable)
    corrected = [abs(m / (p * factor) - 1.0) for m, p in usable]

    def quantile(q: float) -> float:
        return errors[min(len(errors) - 1, int(q * len(errors)))]

    return PredictionError(rows=len(usable), median=statistics.median(errors), low=quantile(0.1),
                           high=quantile(0.9), correction=factor, corrected_median_abs=statistics.median(corrected))
