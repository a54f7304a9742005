"""Decayed pairing: a trial that starts paired with the fp32 run at its seed and drifts as far from it as
another seed's run does is judged by the band, with the reason; a pairing that holds is judged as before.

On simulated trajectories and on losses measured on an H200 (``tests/verdict_h200_losses.py``).
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from autotune._config import Measurement
from autotune.study._verdict import (
    DECAYED_SHARE,
    ReferenceBand,
    fingerprints,
    judge,
    paired_difference,
    pairing_decay,
    wander,
)
from tests import verdict_h200_losses as h200

PRINTS = {"pairing.weights": [1.0, 2.0], "pairing.batch": [3.0, 4.0]}
STEPS = 96


def _measurement(losses) -> Measurement:
    return Measurement(throughput=1.0, window_throughputs=(1.0,), data_wait_fraction=0.0, peak_memory_gib=0.0,
                       warmup_seconds=0.0, first_step_seconds=0.0, compile_seconds=0.0, capture_seconds=0.0,
                       samples=1, steps=len(losses), step_time=0.0, losses=tuple(losses), extras=dict(PRINTS))


def _band(first, second) -> ReferenceBand:
    return ReferenceBand.of_measurements([_measurement(first), _measurement(second)])


def _judge(band: ReferenceBand, losses):
    return judge(list(losses), None, band, reference_metric=None, max_accuracy_loss=0.01,
                 pairing=fingerprints(PRINTS), precision="bf16")


def _state(rng: random.Random, start: float = 0.0) -> list[float]:
    """Where the weights have taken the loss: slow (AR 0.9), one path per trajectory of the weights."""
    value, out = start, []
    for _ in range(STEPS):
        value = 0.9 * value + rng.gauss(0.0, 0.01)
        out.append(value)
    return out


def _simulated(rng: random.Random, *, decay_at: int | None = None, shift: float = 0.0):
    """Two fp32 seeds and a trial at the first one's seed: ``(band, trial)``.

    Each seed has its own weights' path and its own data (per-step batch-content noise). The trial sees the
    first seed's batches. Paired (``decay_at`` None) it follows the first seed's path up to bf16's rounding.
    Chaotic, it follows it for ``decay_at`` steps and then takes a path of its own, as far from the first as
    another seed's. ``shift`` is a harm over the second half.
    """
    trend = [0.1 + 1.4 * 2.718281828 ** (-t / 12) for t in range(STEPS)]
    batches = [[rng.gauss(0.0, 0.02) for _ in range(STEPS)] for _ in range(2)]
    paths = [_state(rng), _state(rng)]
    first, second = ([a + b + c for a, b, c in zip(trend, p, n)] for p, n in zip(paths, batches))
    own = paths[0]
    if decay_at is not None:
        apart = _state(random.Random(rng.random()), paths[0][decay_at - 1])
        own = paths[0][:decay_at] + apart[:STEPS - decay_at]
    trial = [a + s + b + rng.gauss(0.0, 1e-4) + (shift if t >= STEPS // 2 else 0.0)
             for t, (a, s, b) in enumerate(zip(trend, own, batches[0]))]
    return _band(first, second), trial


def test_wander_leaves_out_a_steady_trend() -> None:
    reference = [1.0 - 0.01 * t for t in range(32)]
    assert wander([v + 0.002 * t for t, v in enumerate(reference)], reference) == pytest.approx(0.0, abs=1e-12)
    assert wander(reference[:10], reference[:10]) is None  # 5 points in the window: too few


def test_a_stable_pairing_holds_passes_clean_and_catches_a_shift() -> None:
    rng = random.Random(0)
    alarms = caught = 0
    for _ in range(50):
        band, clean = _simulated(rng)
        assert pairing_decay(band, clean) is None
        alarms += _judge(band, clean).label != "equivalent"
        band, harmed = _simulated(rng, shift=0.02)  # the size of one step's batch noise
        assert pairing_decay(band, harmed) is None  # a shift leaves the wander small
        verdict = _judge(band, harmed)
        caught += verdict.label == "degraded"
        assert verdict.evidence.startswith("paired") and "decayed" not in verdict.evidence
    assert alarms <= 1 and caught >= 48


def test_a_chaotic_pairing_decays_and_a_pass_falls_back_to_the_band() -> None:
    rng = random.Random(1)
    fell_back = 0
    for _ in range(50):
        band, trial = _simulated(rng, decay_at=4)
        assert pairing_decay(band, trial) is not None
        verdict = _judge(band, trial)
        if "not paired: pairing decayed:" in verdict.evidence:
            fell_back += 1
            assert verdict.evidence.startswith("final-quarter loss")
        else:  # above the margin: not shown equivalent, and the evidence says the pairing decayed
            assert verdict.label == "degraded" and "; pairing decayed:" in verdict.evidence
    assert fell_back >= 10  # about half land below the margin by the luck of the chaos


def test_the_chaotic_h200_trials_fall_back_with_the_reason() -> None:
    band = _band(h200.CHAOTIC_FP32_SEED0, h200.CHAOTIC_FP32_SEED1)
    shares = []
    for trial in (h200.CHAOTIC_BF16_COMPILED, h200.CHAOTIC_FP16_COMPILED, h200.CHAOTIC_BF16_EAGER):
        shares.append((wander(trial, band.paired) / band.seed_wander) ** 2)
        # Paired, each would pass within a margin of 0.047: two of them by landing 0.7 below fp32.
        assert paired_difference(trial, band.paired)[1] < band.paired_margin(0.01)
        verdict = _judge(band, trial)
        assert "; not paired: pairing decayed: over the last 30 steps the paired difference wanders" in verdict.evidence
        # The band, at two seeds on so chaotic a training, cannot vouch either.
        assert verdict.label == "unchecked", verdict.evidence
    assert min(shares) > 2 * DECAYED_SHARE  # 0.27 to 0.36


def test_the_stable_h200_pairing_holds() -> None:
    band = _band(h200.STABLE_TF32_SEED0, h200.STABLE_TF32_SEED1)
    trial = h200.STABLE_BF16
    assert (wander(trial, band.paired) / band.seed_wander) ** 2 < DECAYED_SHARE / 2  # 0.03
    verdict = _judge(band, trial)
    assert verdict.label == "equivalent" and verdict.evidence.startswith("paired"), verdict.evidence
    # A harm of 4% of the loss over the second half is a shift: still paired, and caught.
    harmed = [v + (0.04 if t >= len(trial) // 2 else 0.0) for t, v in enumerate(trial)]
    verdict = _judge(band, harmed)
    assert verdict.label == "degraded" and "decayed" not in verdict.evidence, verdict.evidence


def test_a_study_stored_before_the_decay_check_judges_as_before() -> None:
    band = _band(h200.CHAOTIC_FP32_SEED0, h200.CHAOTIC_FP32_SEED1)
    assert ReferenceBand.from_dict(band.to_dict()) == band
    stored = band.to_dict()
    del stored["seed_wander"]
    old = ReferenceBand.from_dict(stored)
    assert old.seed_wander is None and old == dataclasses.replace(band, seed_wander=None)
    verdict = _judge(old, h200.CHAOTIC_BF16_COMPILED)
    assert verdict.label == "equivalent" and verdict.evidence.startswith("paired"), verdict.evidence
