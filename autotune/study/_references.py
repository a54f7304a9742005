"""The fp32 reference runs and the accuracy check that judges every trial against them."""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator, Optional

import optuna

from autotune._config import TrialConfig, TrialOutcome
from autotune._errors import WorkloadError
from autotune._records import BATCH_REFERENCE, BATCH_REFERENCE_FAILED, BATCH_REFERENCE_NOISE
from autotune.study._options import AccuracyOptions
from autotune.study._progress import _Progress
from autotune.study._runner import TrialRunner


class References:
    """Runs the fp32 references of a study and judges trials' accuracy against them.

    Args:
        options: How accuracy is judged.
        runner: Runs configs of the study.
        seed: The study's seed; reference repeat ``r`` runs with ``seed + r``.
    """

    def __init__(self, *, options: AccuracyOptions, runner: TrialRunner, seed: int) -> None:
        self.options = options
        self.runner = runner
        self.seed = seed

    def baseline(self, ui: _Progress) -> dict[str, Any]:
        """Train the baseline in fp32 once per seed: baseline throughput, reference metric, noise band.

        Raises:
            WorkloadError: a reference run failed, so no trial could be judged.
        """
        baseline = self.runner.baseline.replace(precision="fp32")
        metrics, rates, first = [], [], None
        for workdir, outcome in self._fp32_runs(baseline, lambda repeat: f"reference-{repeat}", "", ui):
            if not outcome.ok or outcome.measurement is None:
                raise WorkloadError(
                    f"the fp32 reference run failed ({outcome.status}: {outcome.error or 'no detail'}); "
                    f"see {self.runner.logdir / workdir / 'trial.log'}"
                )
            metrics.append(outcome.measurement.metric)
            rates.append(outcome.measurement.throughput)
            first = first or outcome.measurement.to_dict()
        return {
            "baseline_config": baseline.to_dict(),
            "baseline_throughput": rates[0],
            "reference_metric": metrics[0],
            "reference_metrics": metrics,
            "reference_throughputs": rates,
            "reference_measurement": first,
            "metric_noise": noise_band(metrics),
        }

    def _fp32_runs(self, config: TrialConfig, workdir_of: Callable[[int], str], where: str,
                   ui: _Progress) -> Iterator[tuple[str, TrialOutcome]]:
        """Run ``config`` (an fp32 reference) once per reference seed, each an isolated trial in
        ``workdir_of(repeat)``; yields each run's workdir and outcome, so the caller may stop at a failure."""
        repeats = self.options.reference_repeats
        for repeat in range(repeats):
            seed = self.seed + repeat
            ui.status(f"reference{where} {repeat + 1}/{repeats}: {config.describe()} (seed {seed})")
            workdir = workdir_of(repeat)
            yield workdir, self.runner.run(config, workdir, seed=seed)

    def at_batch(self, study: optuna.Study, batch_size: int, ui: _Progress) -> float:
        """With ``accuracy_reference="batch"``: train the fp32 baseline at this batch size, once per seed of
        the baseline's reference, for the accuracy check of every trial at it; the seeds' spread is this
        batch's noise band (a large batch's short run can be far noisier than the baseline's). A failed run
        (say fp32 does not fit where bf16 did) is recorded, and those trials fall back to the baseline
        reference. Returns the seconds it took (0 when no run was needed)."""
        key, failed = f"{BATCH_REFERENCE}{batch_size}", f"{BATCH_REFERENCE_FAILED}{batch_size}"
        if (self.options.accuracy_reference != "batch" or batch_size == self.runner.baseline.batch_size
                or key in study.user_attrs or failed in study.user_attrs):
            return 0.0
        started = time.perf_counter()
        config = self.runner.baseline.replace(precision="fp32", batch_size=batch_size)
        metrics = []
        runs = self._fp32_runs(config, lambda repeat: f"reference-batch-{batch_size}/seed-{self.seed + repeat}",
                               f" at batch {batch_size}", ui)
        for _, outcome in runs:
            if not (outcome.ok and outcome.measurement is not None and outcome.measurement.metric is not None):
                study.set_user_attr(failed, f"{outcome.status}: {outcome.error}")
                return time.perf_counter() - started
            metrics.append(outcome.measurement.metric)
        study.set_user_attr(key, metrics[0])  # the trial's own seed, as for the baseline reference
        if len(metrics) >= 2:
            study.set_user_attr(f"{BATCH_REFERENCE_NOISE}{batch_size}", noise_band(metrics))
        return time.perf_counter() - started

    def threshold(self, study: optuna.Study, batch_size: int) -> float:
        """The accuracy loss a trial at this batch may have: the bound plus its reference's noise band."""
        return self.options.max_accuracy_loss + self._metric_noise(study, batch_size)

    def _metric_noise(self, study: optuna.Study, batch_size: int) -> float:
        """The noise band a trial at this batch is allowed: its batch reference's, else the baseline's."""
        return study.user_attrs.get(f"{BATCH_REFERENCE_NOISE}{batch_size}", study.user_attrs.get("metric_noise", 0.0))

    def accuracy_loss(self, study: optuna.Study, metric: Optional[float], batch_size: int) -> float:
        reference = study.user_attrs.get(f"{BATCH_REFERENCE}{batch_size}", study.user_attrs.get("reference_metric"))
        if reference is None or metric is None:
            return 0.0  # the workload reports no metric: accuracy is not checked (noted in the study)
        return reference - metric if self.options.metric_direction == "maximize" else metric - reference


def noise_band(metrics: list[Optional[float]]) -> float:
    """The spread of the metrics that reference seeds reached (0 with fewer than two)."""
    real = [m for m in metrics if m is not None]
    return (max(real) - min(real)) if len(real) >= 2 else 0.0
