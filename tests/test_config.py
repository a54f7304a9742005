"""Typed records: configs, budgets, measurements and outcomes survive the trips they make."""

from __future__ import annotations

import json
import dataclasses
import math

import pytest

from autotune import Budget, Measurement, Result, TrialConfig, TrialOutcome, TrialRecord


def _measurement(**changes) -> Measurement:
    fields = dict(
        throughput=200.0,
        window_throughputs=(100.0, 200.0, 400.0),
        step_time=0.1,
        data_wait_fraction=0.25,
        peak_memory_gib=1.5,
        warmup_seconds=2.0,
        first_step_seconds=1.0,
        compile_seconds=0.0,
        capture_seconds=0.0,
        samples=4096,
        steps=64,
        metric=0.9,
    )
    fields.update(changes)
    return Measurement(**fields)


def test_default_config_is_the_untuned_baseline() -> None:
    config = TrialConfig()
    assert (config.precision, config.batch_size, config.compile, config.num_workers) == ("fp32", 64, "off", 0)
    assert not config.channels_last and not config.cuda_graphs and not config.pin_memory
    assert config.cpu_threads is None and config.memory_fraction == 1.0


def test_config_round_trips_through_json() -> None:
    config = TrialConfig(precision="bf16", batch_size=256, channels_last=True, num_workers=2, cpu_threads=1)
    assert TrialConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_config_from_dict_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match="unknown config keys: colour"):
        TrialConfig.from_dict({**TrialConfig().to_dict(), "colour": "red"})


def test_config_describe_names_what_differs_from_the_defaults() -> None:
    assert TrialConfig().describe() == "fp32 bs64 workers=0"
    described = TrialConfig(
        precision="bf16", batch_size=256, channels_last=True, compile="default", cuda_graphs=True,
        num_workers=4, pin_memory=True, memory_fraction=0.5, cpu_threads=2,
    ).describe()
    assert described == "bf16 bs256 channels_last compile=default graphs workers=4 pinned memfrac=0.5 threads=2"
    # Loader configs that differ only in prefetch or persistence must not read alike; without workers
    # those knobs do nothing and are not named.
    loader = TrialConfig(num_workers=8, prefetch_factor=4, persistent_workers=True).describe()
    assert loader == "fp32 bs64 workers=8 prefetch=4 persistent"
    assert TrialConfig(prefetch_factor=4, persistent_workers=True).describe() == "fp32 bs64 workers=0"


@pytest.mark.parametrize("fields", [dict(samples=0), dict(warmup_steps=-1), dict(windows=2)])
def test_budget_rejects_impossible_values(fields) -> None:
    with pytest.raises(ValueError, match="budget needs"):
        Budget(**fields)


def test_budget_steps_and_minimum_samples() -> None:
    budget = Budget(samples=1000, warmup_steps=2, windows=3)
    assert budget.steps_for(64) == 15
    assert budget.min_samples_for(64) == 64 * 5


def test_measurement_spread_and_round_trip() -> None:
    m = _measurement()
    assert m.spread == pytest.approx((400.0 - 100.0) / 200.0)
    again = Measurement.from_dict(json.loads(json.dumps(m.to_dict())))
    assert again == m
    assert isinstance(again.window_throughputs, tuple)
    assert math.isnan(_measurement(window_throughputs=()).spread)


def test_outcome_round_trip_keeps_the_failure_evidence() -> None:
    ok = TrialOutcome("ok", _measurement(), wall_seconds=3.0)
    assert TrialOutcome.from_dict(json.loads(json.dumps(ok.to_dict()))) == ok
    assert ok.ok
    crash = TrialOutcome("crash", error="killed by SIGABRT", stderr_tail="tail", signal="SIGABRT")
    again = TrialOutcome.from_dict(json.loads(json.dumps(crash.to_dict())))
    assert again == crash and not again.ok and again.measurement is None


def test_result_speedup_is_best_over_baseline() -> None:
    best = TrialRecord(3, TrialConfig(batch_size=128), 300.0, 0.0, "ok", True)
    result = Result("s", "sqlite:///x.db", best, TrialConfig(), 100.0, 0.9, 0.0, (best,), {})
    assert result.speedup == pytest.approx(3.0)
    assert result.best_config == TrialConfig()  # no spread measured: not shown faster, so keep the baseline
    shown = dataclasses.replace(result, speedup_low=2.5, speedup_high=3.5)
    assert shown.faster and shown.best_config == TrialConfig(batch_size=128)
    empty = Result("s", "sqlite:///x.db", None, TrialConfig(), 100.0, 0.9, 0.0, (), {})
    assert math.isnan(empty.speedup) and empty.best_config is None
