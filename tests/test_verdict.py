"""The accuracy verdict: gradient accumulation, the statistics, and planted harm in real trainings."""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
from torch import nn

from autotune._config import Budget, TrialConfig
from autotune.study._verdict import LossSummary, ReferenceBand, judge, t95
from autotune.trial._context import TrialContext
from autotune.trial._execute import TrialSpec, execute
from benchmarks.workloads import planted

PLANTED = planted.__file__
CPU = torch.device("cpu")


def _grads_after(config: TrialConfig, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """Gradients after one global batch through ctx.train_step, fed micro-batch by micro-batch."""
    model = copy.deepcopy(model)
    ctx = TrialContext(config=config, device=CPU)
    step = ctx.train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), nn.CrossEntropyLoss())
    for start in range(0, len(x), config.batch_size):
        step(x[start:start + config.batch_size], y[start:start + config.batch_size])
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("micro", [8, 16, 32])
def test_accumulated_micro_batches_give_the_full_batch_gradient(micro: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 5))  # no BatchNorm
    x, y = torch.randn(64, 12), torch.randint(0, 5, (64,))
    full = _grads_after(TrialConfig(batch_size=64), model, x, y)
    accumulated = _grads_after(TrialConfig(batch_size=micro, global_batch=64), model, x, y)
    for a, b in zip(full, accumulated):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_accumulation_steps_the_optimizer_once_per_global_batch() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    budget = Budget(samples=512, warmup_steps=1, windows=3)
    ctx = TrialContext(config=TrialConfig(batch_size=16, global_batch=64), budget=budget, device=CPU)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = []
    optimizer.register_step_post_hook(lambda *_: steps.append(1))
    step = ctx.train_step(model, optimizer, nn.MSELoss())
    data = torch.utils.data.TensorDataset(torch.randn(256, 4), torch.randn(256, 1))
    for x, y in ctx.batches(ctx.loader(data)):
        step(x, y)
    assert len(steps) == 512 // 64  # one optimizer step per global batch, every sample used once per step
    m = ctx.measurement()
    assert len(m.losses) == 512 // 64 and all(math.isfinite(v) for v in m.losses)
    assert ctx.lr_scale == 1.0  # fixed policy: the global batch is the baseline's


def test_loss_summary_and_the_prediction_interval() -> None:
    summary = LossSummary.of([4.0, 3.0, 2.0, 1.0, 1.0, 1.0, 0.5, 0.5])
    assert summary.first == 4.0 and summary.final == 0.5 and summary.finite
    band = ReferenceBand(firsts=(4.0, 4.2), finals=(0.50, 0.52), metrics=(0.9, 0.91))
    sd = math.sqrt(((0.50 - 0.51) ** 2 + (0.52 - 0.51) ** 2) / 1)
    assert band.tolerance == pytest.approx(t95(1) * sd * math.sqrt(1.5))
    assert band.metric_band == pytest.approx(0.01)
    assert not band.blind_reasons(0.02)
    inside = judge([4.0] + [0.55] * 8, 0.905, band, reference_metric=0.9, max_accuracy_loss=0.02)
    assert inside.label == "equivalent" and inside.constraint <= 0
    worse = judge([4.0] + [0.8] * 8, 0.905, band, reference_metric=0.9, max_accuracy_loss=0.02)
    assert worse.label == "degraded" and worse.constraint > 0 and "outside the reference band" in worse.evidence
    metric_only = judge([], 0.85, band, reference_metric=0.9, max_accuracy_loss=0.02)
    assert metric_only.label == "degraded" and metric_only.constraint == pytest.approx(0.05 - 0.03)


def test_non_finite_or_rising_losses_diverge_and_nothing_to_compare_is_unchecked() -> None:
    band = ReferenceBand(firsts=(2.0, 2.0), finals=(0.4, 0.42))
    assert judge([2.0, float("nan"), 1.0], None, band, reference_metric=None, max_accuracy_loss=0.01).label == "diverged"
    assert judge([2.0, 3.0, 5.0, 9.0], None, band, reference_metric=None, max_accuracy_loss=0.01).label == "diverged"
    # Failing to learn is harm, not divergence.
    assert judge([2.0, 2.1, 1.9, 2.05], None, band, reference_metric=None, max_accuracy_loss=0.01).label == "degraded"
    unchecked = judge([], None, ReferenceBand(), reference_metric=None, max_accuracy_loss=0.01)
    assert unchecked.label == "unchecked" and unchecked.feasible


def test_a_reference_that_did_not_learn_or_whose_seeds_disagree_is_blind() -> None:
    flat = ReferenceBand(firsts=(2.30, 2.31), finals=(2.29, 2.30), metrics=(0.10, 0.11))
    assert any("barely fell" in r for r in flat.blind_reasons(0.01))
    noisy_metric = ReferenceBand(firsts=(2.3, 2.3), finals=(0.5, 0.5), metrics=(0.094, 0.047))
    assert any("exceeds the bound" in r for r in noisy_metric.blind_reasons(0.01))
    assert ReferenceBand().blind_reasons(0.01) == ["the workload records no training loss and reports no metric"]


def test_the_check_is_blind_only_when_no_part_can_vouch() -> None:
    # A metric whose seeds disagree beyond the bound, with a loss that fell cleanly: the loss vouches.
    noisy_metric = ReferenceBand(firsts=(2.3, 2.3), finals=(0.5, 0.51), metrics=(0.94, 1.0))
    assert noisy_metric.blind_reasons(0.01) and not noisy_metric.is_blind(0.01)
    # The same metric without losses: nothing vouches.
    assert ReferenceBand(metrics=(0.94, 1.0)).is_blind(0.01)
    # A loss that barely fell, with a tight metric: the metric vouches.
    flat_loss = ReferenceBand(firsts=(2.30, 2.31), finals=(2.29, 2.30), metrics=(0.90, 0.901))
    assert flat_loss.blind_reasons(0.01) and not flat_loss.is_blind(0.01)
    # Both parts blind, or nothing recorded at all.
    assert ReferenceBand(firsts=(2.30, 2.31), finals=(2.29, 2.30), metrics=(0.9, 1.0)).is_blind(0.01)
    assert ReferenceBand().is_blind(0.01)


BUDGET = Budget(samples=6144, warmup_steps=2, windows=3)
GLOBAL = 64


def _run(fn: str, config: TrialConfig, seed: int):
    outcome = execute(TrialSpec(f"{PLANTED}:{fn}", config, BUDGET, seed=seed, baseline_batch_size=GLOBAL))
    assert outcome.ok, outcome.error
    return outcome.measurement


def _verdict(fn: str, config: TrialConfig, seed: int, references: list) -> str:
    band = ReferenceBand.of([(m.losses, m.metric) for m in references])
    m = _run(fn, config, seed)
    return judge(m.losses, m.metric, band, reference_metric=references[0].metric, max_accuracy_loss=0.01).label


SEEDS = range(5)
FP32 = TrialConfig(batch_size=GLOBAL, global_batch=GLOBAL)


@pytest.fixture(scope="module")
def references() -> dict[tuple[str, int], list]:
    """fp32 references, two seeds each, of both models at every study seed (the offset is exact in fp32)."""
    os.environ.pop("AUTOTUNE_PLANTED_OFFSET", None)
    return {(fn, seed): [_run(fn, FP32, seed + r) for r in range(2)]
            for fn in ("train_harmed", "train_clean") for seed in SEEDS}


@pytest.mark.parametrize("seed", SEEDS)
def test_planted_harm_is_degraded_at_every_seed(references, seed: int) -> None:
    assert _verdict("train_harmed", FP32.replace(precision="bf16"), seed, references[("train_harmed", seed)]) == "degraded"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("precision, micro", [("bf16", 64), ("bf16", 16), ("fp32", 16)])
def test_clean_twins_are_equivalent_at_every_seed_and_micro_batch(references, seed: int, precision: str,
                                                                   micro: int) -> None:
    config = FP32.replace(precision=precision, batch_size=micro)
    assert _verdict("train_clean", config, seed, references[("train_clean", seed)]) == "equivalent"


def test_a_blind_check_cannot_vouch_but_can_still_find_harm() -> None:
    swamped = ReferenceBand(firsts=(2.0, 2.0), finals=(0.5, 1.4), metrics=(0.9, 0.905))  # tolerance > half the drop
    assert swamped.loss_blind_reason() is not None
    quiet = judge([2.0] + [0.9] * 8, None, swamped, reference_metric=None, max_accuracy_loss=0.01)
    assert quiet.label == "unchecked" and "but the seed-to-seed spread" in quiet.evidence and quiet.feasible
    # A working metric check vouches where the loss check is blind ...
    assert judge([2.0] + [0.9] * 8, 0.9, swamped, reference_metric=0.9, max_accuracy_loss=0.01).label == "equivalent"
    # ... and far outside even the wide band is still harm.
    assert judge([2.0] + [1.95] * 8, 0.6, swamped, reference_metric=0.9, max_accuracy_loss=0.01).label == "degraded"


def test_under_scale_a_reference_that_learned_less_than_the_baseline_cannot_vouch() -> None:
    band = ReferenceBand(metrics=(0.09, 0.092))  # fp32 at this global batch, at chance; the baseline reached 1.0
    at_chance = judge([], 0.09, band, reference_metric=0.09, max_accuracy_loss=0.01, baseline_metric=1.0)
    assert at_chance.label == "unchecked" and "learned less than the baseline" in at_chance.evidence
    learned = judge([], 0.995, ReferenceBand(metrics=(1.0, 0.995)), reference_metric=1.0, max_accuracy_loss=0.01,
                    baseline_metric=1.0)
    assert learned.label == "equivalent"
