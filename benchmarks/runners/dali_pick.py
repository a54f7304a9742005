"""The tuner's pick on a JPEG folder against synthetic data at the same compute config.

    AUTOTUNE_JPEG_ROOT=studies/jpegs python -m benchmarks.runners.dali_pick --study dali-tune \
        --storage sqlite:///studies/dali.db

Loads the study's best config, runs ``jpeg_workload.py:train_synthetic`` at that config (batches already
on the device, the same budget, an isolated trial), and prints how close the picked input pipeline came
to feeding the GPU fully: the question the DALI issue asks (within 5%). Not a test.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from autotune import Budget, TrialConfig
from autotune._api import load_study_result
from autotune.trial._execute import TrialSpec
from autotune.study._isolation import run_isolated
from benchmarks.runners.dali_h200 import WORKLOAD


@dataclass(frozen=True)
class PickCheck:
    """The study's best on real JPEGs and the same compute config on device-resident data."""

    config: TrialConfig
    picked: float
    synthetic: float

    @property
    def fraction(self) -> float:
        return self.picked / self.synthetic

    def markdown(self) -> str:
        verdict = "within" if self.fraction >= 0.95 else "not within"
        return (f"| picked config | `{self.config.describe()}` |\n"
                f"| its throughput on the JPEG folder (the study's best) | {self.picked:,.0f} img/s |\n"
                f"| the same compute config on synthetic device data | {self.synthetic:,.0f} img/s |\n"
                f"| picked / synthetic | **{self.fraction:.1%}** ({verdict} 5%) |\n")


def check(study_name: str, *, storage: str, logs: Path, trial_timeout: float = 300.0) -> PickCheck:
    """Measure the best config's compute ceiling; the JPEG environment variables must be set."""
    study, result = load_study_result(study_name, storage=storage)
    if result.best is None:
        raise SystemExit(f"study {study_name!r} has no feasible trial")
    budget = Budget(**study.user_attrs["space"]["budget"])
    baseline = TrialConfig.from_dict(study.user_attrs["baseline_config"])
    spec = TrialSpec(f"{WORKLOAD}:train_synthetic", result.best.config, budget,
                     baseline_batch_size=baseline.batch_size)
    outcome = run_isolated(spec, workdir=logs, timeout=trial_timeout)
    if outcome.measurement is None:
        raise SystemExit(f"the synthetic run failed: {outcome.status}: {outcome.error}")
    return PickCheck(result.best.config, result.best.throughput, outcome.measurement.throughput)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study", required=True)
    parser.add_argument("--storage", required=True)
    parser.add_argument("--logs", default="studies/dali_pick")
    parser.add_argument("--trial-timeout", type=float, default=300.0)
    args = parser.parse_args()
    print(check(args.study, storage=args.storage, logs=Path(args.logs), trial_timeout=args.trial_timeout).markdown())


if __name__ == "__main__":
    main()
