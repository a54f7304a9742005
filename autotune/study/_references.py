"""The fp32 reference runs and the accuracy verdict that judges every trial against them.

Under ``batch_policy: fixed`` every trial trains at the baseline's global batch, so one set of references
(one run per seed) serves the whole study. Under ``scale`` a trial at another global batch is judged
against fp32 at that global batch, run once per seed when first needed. A reference whose global batch
does not fit in memory runs at a micro-batch that does, with gradient accumulation: same optimization.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Mapping, Optional, Sequence

import optuna

from autotune._config import TORCH_LOADER_KNOBS, Budget, Measurement, TrialConfig, TrialOutcome, bin_means
from autotune._errors import StudyError, WorkloadError
from autotune._records import (
    SUPERSEDED,
    BASELINE_SPEED_PENDING,
    BATCH_REFERENCE,
    BATCH_REFERENCE_BAND,
    BATCH_REFERENCE_FAILED,
    BATCH_REFERENCE_NOISE,
    REFERENCE_BAND,
    REFERENCE_SEEDS,
)
from autotune.study._options import AccuracyOptions
from autotune.study._budget import StudyClock
from autotune.study._confirm import speed_budget
from autotune.study._planner import (EXTENDED, SHORT_EVIDENCE, Extension, extension_seconds, full_length_budget,
                                     reference_seconds)
from autotune.study._progress import _Progress
from autotune.study._runner import TrialRunner
from autotune.study._verdict import ReferenceBand, Verdict, fingerprints, judge

CURVE_POINTS = 128  # points of each reference loss curve kept for the dashboard's plot
SPEED_WINDOW_STEPS = 2  # optimizer steps in each timed window of the baseline's speed run
TRIAL_BUDGET = "trial_budget"  # study attribute: the length every run trains (the references' shortened one)


def trial_budget_record(budget: Budget) -> dict[str, Any]:
    """What a study stores of its runs' length, for a resume or a joining worker (``apply_trial_budget``)."""
    return {"samples": budget.samples, "schedule_samples": budget.schedule_samples}


def apply_trial_budget(budget: Budget, stored: Any) -> Budget:
    """``budget`` at the length a study stored (``trial_budget_record``); unchanged when none was stored."""
    if not isinstance(stored, dict) or not isinstance(stored.get("samples"), int):
        return budget
    schedule = stored.get("schedule_samples")
    return dataclasses.replace(budget, samples=stored["samples"], seconds=None,
                               schedule_samples=schedule if isinstance(schedule, int) else None)


class References:
    """Runs the fp32 references of a study and judges trials' accuracy against them.

    Args:
        options: How accuracy is judged.
        runner: Runs configs of the study; its baseline carries the batch policy.
        seed: The study's seed; reference repeat ``r`` runs with ``seed + r``.
        clock: The study's clock: under a budget, each reference run's time limit is cut to its deadline.
    """

    def __init__(self, *, options: AccuracyOptions, runner: TrialRunner, seed: int,
                 clock: Optional[StudyClock] = None, loader: Optional[dict[str, Any]] = None) -> None:
        self.options = options
        self.runner = runner
        self.seed = seed
        self.clock = clock or StudyClock()
        self.loader = dict(loader or {})

    @property
    def _baseline(self) -> TrialConfig:
        return self.runner.baseline.replace(precision="fp32")

    @property
    def fp32_baseline(self) -> TrialConfig:
        """The baseline in fp32: what the speed-up divides by."""
        return self._baseline

    def _reference_of(self, config: TrialConfig) -> TrialConfig:
        """The config an fp32 reference runs for ``config`` (fp32): its DataLoader's knobs ``loader``'s.

        Loader knobs change no step a script trains through ``ctx.loader`` (its order is seeded), only how
        fast the steps come, so the references run with a loader that keeps up (the prior point's): within
        their share of a budget they then train as many samples as the step allows, not as the baseline's
        loader allows, and the prior point's batches are the references' even where a Dataset draws its
        augmentation from the global generator. The baseline's own speed is measured apart
        (``_baseline_speed``).
        """
        if not self.loader or config.loader != "torch":
            return config
        return config.replace(**{k: v for k, v in self.loader.items() if k in TORCH_LOADER_KNOBS})

    def baseline(self, ui: _Progress, *, adopt_script_batch: bool = False, defer_speed: bool = False,
                 seeds: Optional[int] = None) -> dict[str, Any]:
        """Train the baseline in fp32 once per seed: baseline throughput, the reference band and metric.

        Under a budget the first seed trains within its share (``_planner.reference_seconds``): when it
        trains fewer samples than the space's, the runner's budget becomes that length for every later run
        (``trial_budget``), the schedule's length kept, so every trajectory is paired with the references'.

        Args:
            adopt_script_batch: The first seed trains at the batch the script passes to ``ctx.loader`` (when
                it can: ``TrialContext``), and the later seeds at it too.
            defer_speed: Leave the baseline's own speed run for later (``speed_run``): the references' rate
                stands in for the baseline's until it runs, and ``BASELINE_SPEED_PENDING`` says so.
            seeds: The seeds to run now (``_planner.seeds_first``; None: all): ``complete`` runs the others
                later, and ``REFERENCE_SEEDS`` says how many the record holds.

        Raises:
            WorkloadError: a reference run failed, so no trial could be judged.
        """
        started = time.perf_counter()
        share = reference_seconds(self.clock.budget_seconds, self.options.reference_repeats)
        config, runs = self._runs(self._reference_of(self._baseline), "reference", "", ui, first_seconds=share,
                                  adopt_script_batch=adopt_script_batch, seeds=seeds)
        measurements = [self._checked(workdir, outcome) for workdir, outcome in runs]
        metrics = [m.metric for m in measurements]
        band = ReferenceBand.of_measurements(measurements)  # the first seed's full trajectory, for pairing
        return {
            **self._baseline_of(config, measurements[0].throughput, ui, defer_speed=defer_speed),
            "reference_metric": metrics[0],
            "reference_metrics": metrics,
            "reference_throughputs": [m.throughput for m in measurements],
            "reference_measurement": measurements[0].to_dict(),
            "metric_noise": band.metric_band,
            REFERENCE_BAND: band.to_dict(),
            "reference_curves": [_curve(m) for m in measurements],
            "reference_seconds": round(time.perf_counter() - started, 3),
            "reference_wall_seconds": round(runs[0][1].wall_seconds, 3),  # the first run's process, for the cost model
            TRIAL_BUDGET: trial_budget_record(self.runner.budget),
            "references_shortened": self._shortened(measurements[0].extras.get("shortened")),
            REFERENCE_SEEDS: len(measurements),
            "reference_ran": config.to_dict(),
        }

    def _checked(self, workdir: str, outcome: TrialOutcome) -> Measurement:
        """A reference seed's measurement.

        Raises:
            StudyError: the budget stopped it before it finished.
            WorkloadError: it failed, so no trial could be judged.
        """
        if outcome.status == "timeout" and self.clock.budgeted and outcome.wall_seconds < self.runner.timeout - 1:
            raise StudyError(
                f"the study's budget of {self.clock.budget_seconds / 60:g} minutes is too short: the fp32 "
                f"reference run did not finish in the {outcome.wall_seconds:.0f} s left to it; give a larger "
                f"--budget (budget_minutes=), or a space whose budget.samples is smaller than its "
                f"{self.runner.budget.samples:,} (the samples every run trains, the references' included)"
            )
        if not outcome.ok or outcome.measurement is None:
            raise WorkloadError(
                f"the fp32 reference run failed ({outcome.status}: {outcome.error or 'no detail'}); "
                f"see {self.runner.logdir / workdir / 'trial.log'}"
            )
        return outcome.measurement

    def missing_seeds(self, attrs: Mapping[str, Any]) -> int:
        """The fp32 reference seeds a references record lacks (``baseline()``'s, or a study's attributes): those
        run after the first full trial (``complete``)."""
        held = attrs.get(REFERENCE_SEEDS)
        repeats = self.options.reference_repeats
        return max(0, repeats - held) if isinstance(held, int) and not isinstance(held, bool) else 0

    def complete(self, study: optuna.Study, ui: _Progress) -> float:
        """Run the fp32 reference seeds the study's references lack (``_planner.seeds_first`` left them for
        after the first full trial), at the config and the length the first seed ran, and record the band of
        all of them, so every verdict from here on is judged against it. Returns the seconds it took (0 where
        none lacked).

        Raises:
            StudyError: the budget stopped a seed before it finished.
            WorkloadError: a seed failed.
        """
        if not self.missing_seeds(study.user_attrs):
            return 0.0
        started = time.perf_counter()
        attrs = study.user_attrs
        config = TrialConfig.from_dict(attrs.get("reference_ran") or attrs.get("reference_config")
                                       or attrs["baseline_config"])
        first = Measurement.from_dict(attrs["reference_measurement"])
        repeats = self.options.reference_repeats
        measurements = [first]
        for repeat in range(1, repeats):  # only the first seed's measurement is kept whole: the rest run here
            seed = self.seed + repeat
            ui.status(f"reference {repeat + 1}/{repeats}: {_described(config, False)} (seed {seed}), after the "
                      "first full trial and before its verdict")
            workdir = f"reference-{repeat}"
            outcome = self.runner.run(config, workdir, seed=seed, timeout=self.clock.cap(self.runner.timeout))
            measurements.append(self._checked(workdir, outcome))
        if not self.missing_seeds(study.user_attrs):
            return time.perf_counter() - started  # another worker recorded them meanwhile: its record stands
        band = ReferenceBand.of_measurements(measurements)
        seconds = time.perf_counter() - started
        updates = {
            "reference_metrics": [m.metric for m in measurements],
            "reference_throughputs": [m.throughput for m in measurements],
            "metric_noise": band.metric_band,
            REFERENCE_BAND: band.to_dict(),
            "reference_curves": [_curve(m) for m in measurements],
            "reference_seconds": round(float(attrs.get("reference_seconds") or 0.0) + seconds, 3),
        }
        for key, value in updates.items():
            study.set_user_attr(key, value)
        study.set_user_attr("accuracy_check", {"blind": self.is_blind(study), "reasons": self.blind_reasons(study)})
        study.set_user_attr(REFERENCE_SEEDS, len(measurements))  # last: the band is whole once it says so
        which = "seed 2" if repeats == 2 else f"seeds 2-{repeats}"
        ui.say(f"  fp32 reference {which} ran after the first full trial, before its verdict ({seconds:.0f} s)")
        return seconds

    def _baseline_of(self, config: TrialConfig, reference_rate: float, ui: _Progress, *,
                     defer_speed: bool) -> dict[str, Any]:
        """The baseline the references at ``config`` ran for, and its speed: the references' own rate, or a
        speed run of its own loader (``_baseline_speed``), now or (``defer_speed``) pending."""
        baseline = self._own_loader(config)
        pending = defer_speed and baseline != config
        baseline, speed = (baseline, None) if pending else self._baseline_speed(config, ui)
        return {
            "baseline_config": baseline.to_dict(),
            **({"reference_config": config.to_dict(), "baseline_speed": speed} if speed else {}),
            **({"reference_config": config.to_dict(), BASELINE_SPEED_PENDING: True} if pending else {}),
            "baseline_throughput": speed["throughput"] if speed else reference_rate,
        }

    def rebase(self, reference: dict[str, Any], ui: _Progress, *, defer_speed: bool = False) -> dict[str, Any]:
        """``reference`` (a ``baseline()`` record) for the runner's baseline now, whose DataLoader knobs changed
        after the references ran (the script's own loader): the references stand, since a loader changes no
        step, and the baseline's own speed is timed apart (``_baseline_of``). Unchanged where the record's
        baseline is already that one (references reused with their speed run)."""
        config = TrialConfig.from_dict(reference.get("reference_config") or reference["baseline_config"])
        if self._own_loader(config) == TrialConfig.from_dict(reference["baseline_config"]):
            return reference
        kept = {k: v for k, v in reference.items()
                if k not in ("reference_config", "baseline_speed", BASELINE_SPEED_PENDING)}
        rate = (reference.get("reference_throughputs") or [reference.get("baseline_throughput")])[0]
        return {**kept, **self._baseline_of(config, rate, ui, defer_speed=defer_speed)}

    def _shortened(self, shortened: Any) -> Any:
        """The first seed's shortened length, with the budget that would have trained the full length."""
        budget = self.clock.budget_seconds
        if not isinstance(shortened, dict) or budget is None or not shortened.get("missing_seconds"):
            return shortened
        full = full_length_budget(budget, self.options.reference_repeats, shortened["missing_seconds"])
        return {**shortened, "full_length_budget_minutes": math.ceil(full / 60)}

    def _own_loader(self, ran: TrialConfig) -> TrialConfig:
        """``ran`` (a reference's config) with the baseline's own DataLoader knobs."""
        return ran.replace(**{k: getattr(self._baseline, k) for k in TORCH_LOADER_KNOBS})

    def speed_run(self, study: optuna.Study, ui: _Progress) -> None:
        """The baseline's own speed run that ``baseline(defer_speed=True)`` left for later: its rate becomes the
        study's ``baseline_throughput``.

        Raises:
            WorkloadError: the speed run failed.
        """
        attrs = study.user_attrs
        if not attrs.get(BASELINE_SPEED_PENDING) or "reference_config" not in attrs:
            return
        _, speed = self._baseline_speed(TrialConfig.from_dict(attrs["reference_config"]), ui)
        if speed is not None:
            study.set_user_attr("baseline_speed", speed)
            study.set_user_attr("baseline_throughput", speed["throughput"])
        study.set_user_attr(BASELINE_SPEED_PENDING, False)

    def _baseline_speed(self, ran: TrialConfig, ui: _Progress) -> tuple[TrialConfig, Optional[dict[str, Any]]]:
        """The baseline that the references ran for, and its own speed when they ran with another loader
        (``_reference_of``): a short speed-only run of it (warm-up and timed windows, as a race run), or
        None where its loader is the references'. The run is made whether or not the script builds a
        ``ctx.loader``: an adapter hands the knobs to its trainer's own DataLoader, so no run can tell that
        they changed nothing.

        Raises:
            WorkloadError: the baseline's speed run failed where its reference ran.
        """
        baseline = self._own_loader(ran)
        if baseline == ran:
            return baseline, None
        ui.status(f"the baseline's own speed: {baseline.describe()} (its loader; the references ran with "
                  f"{_loader_words(ran)})")
        # Windows of a few steps each: a speed run, not evidence (the race measures it again, interleaved); the
        # schedule spans the references' length, as in every other run.
        budget = dataclasses.replace(speed_budget(self.runner.budget, baseline, SPEED_WINDOW_STEPS),
                                     schedule_samples=self.runner.budget.scheduled)
        started = time.perf_counter()
        outcome = self.runner.run(baseline, "baseline-speed", seed=self.seed, budget=budget,
                                  timeout=self.clock.cap(self.runner.timeout))
        if not outcome.ok or outcome.measurement is None:
            raise WorkloadError(
                f"the baseline's speed run failed ({outcome.status}: {outcome.error or 'no detail'}) where its fp32 "
                f"reference with {_loader_words(ran)} ran; see {self.runner.logdir / 'baseline-speed' / 'trial.log'}")
        m, seconds = outcome.measurement, time.perf_counter() - started
        ui.say(f"  the fp32 references ran with {_loader_words(ran)} (the prior point's loader: their steps come as "
               f"fast as the step allows); the baseline's own speed, {m.throughput:,.1f}/s, timed apart in "
               f"{seconds:.0f} s")
        return baseline, {"throughput": m.throughput, "spread": m.spread,
                          "window_throughputs": list(m.window_throughputs),
                          "data_wait_fraction": m.data_wait_fraction, "samples": budget.samples,
                          "seconds": round(seconds, 3), "wall_seconds": round(outcome.wall_seconds, 3)}

    def _runs(self, config: TrialConfig, workdir: str, where: str, ui: _Progress, *,
              first_seconds: Optional[float] = None, adopt_script_batch: bool = False,
              seeds: Optional[int] = None) -> tuple[TrialConfig, list[tuple[str, TrialOutcome]]]:
        """Run an fp32 reference once per seed. When the first seed runs out of memory, its global batch is
        split into micro-batches (half, then a quarter, ...) until one fits; every seed then uses that.
        Stops at the first failed seed. Returns the config that ran and each seed's workdir and outcome.

        ``first_seconds``: the first seed's time share; ``adopt_script_batch``, ``seeds``: see ``baseline``."""
        repeats = self.options.reference_repeats
        count = repeats if seeds is None else max(1, min(seeds, repeats))
        done: list[tuple[str, TrialOutcome]] = []
        split = False  # whether an out-of-memory split the global batch into smaller micro-batches
        for repeat in range(count):
            seed = self.seed + repeat
            while True:
                what = _described(config, adopt_script_batch and not done)
                ui.status(f"reference{where} {repeat + 1}/{repeats}: {what} (seed {seed})")
                name = f"{workdir}-{repeat}" + (f"-micro{config.batch_size}" if split else "")
                first = not done
                budget = dataclasses.replace(self.runner.budget, seconds=first_seconds) \
                    if first and first_seconds is not None else None
                outcome = self.runner.run(config, name, seed=seed, budget=budget,
                                          timeout=self.clock.cap(self.runner.timeout),
                                          adopt_script_batch=adopt_script_batch and first)
                smaller = _half_micro_batch(config) if outcome.status == "oom" and not done else None
                if smaller is None:
                    break
                config, split = smaller, True
            done.append((name, outcome))
            if not outcome.ok:
                break
            if len(done) == 1 and outcome.measurement is not None:
                config = self._after_first_seed(config, outcome.measurement.extras)
        return config, done

    def _after_first_seed(self, config: TrialConfig, extras: dict[str, Any]) -> TrialConfig:
        """The config and the runner's budget for every run after the first seed: at the batch the first
        seed adopted from the script, and the length it trained when its share shortened it."""
        adopted = extras.get("batch_adopted")
        if isinstance(adopted, int) and adopted > 0 and adopted != config.global_batch_size:
            # Under ``fixed`` the script's batch is the global batch too, as the space's baseline states it once
            # it adopts the script's batch: the reference config must equal that point to be trial 0.
            config = config.replace(batch_size=adopted // config.processes_per_trial,
                                    global_batch=adopted if config.batch_policy == "fixed" else None)
        shortened = extras.get("shortened")
        if isinstance(shortened, dict) and isinstance(shortened.get("samples"), int):
            budget = self.runner.budget
            self.runner.budget = dataclasses.replace(budget, samples=shortened["samples"], seconds=None,
                                                     schedule_samples=budget.scheduled)
        return config

    def at_batch(self, study: optuna.Study, config: TrialConfig, ui: _Progress) -> float:
        """Under ``batch_policy: scale``: train fp32 at this trial's global batch, once per seed, for the
        verdict of every trial at it (a large batch's short run can be far noisier than the baseline's). A
        failed run is recorded, and those trials fall back to the baseline's references with a note.
        Returns the seconds it took (0 when no run was needed)."""
        batch = config.global_batch_size
        key, failed = f"{BATCH_REFERENCE}{batch}", f"{BATCH_REFERENCE_FAILED}{batch}"
        if (batch == self._baseline.global_batch_size or key in study.user_attrs or failed in study.user_attrs
                or f"{BATCH_REFERENCE_BAND}{batch}" in study.user_attrs):
            return 0.0
        started = time.perf_counter()
        reference = self._reference_of(self._baseline.replace(batch_size=batch, global_batch=None))
        _, runs = self._runs(reference, f"reference-batch-{batch}/seed", f" at global batch {batch}", ui)
        measurements = [o.measurement for _, o in runs if o.ok and o.measurement is not None]
        if len(measurements) < len(runs) or not measurements:
            bad = runs[-1][1]
            study.set_user_attr(failed, f"{bad.status}: {bad.error}")
            return time.perf_counter() - started
        band = ReferenceBand.of_measurements(measurements)
        study.set_user_attr(f"{BATCH_REFERENCE_BAND}{batch}", band.to_dict())
        study.set_user_attr(f"reference_curves:batch={batch}", [_curve(m) for m in measurements])
        if measurements[0].metric is not None:
            study.set_user_attr(key, measurements[0].metric)  # the trial's own seed, as for the baseline
            if len(measurements) >= 2:
                study.set_user_attr(f"{BATCH_REFERENCE_NOISE}{batch}", band.metric_band)
        return time.perf_counter() - started

    def judge(self, study: optuna.Study, config: TrialConfig, measurement: Measurement, *,
              same_seed: bool = True) -> Verdict:
        """The accuracy verdict of a trial that ran to the end.

        Args:
            same_seed: The run used the study's seed. A co-located copy past the first trains with another
                seed, for which no fp32 reference metric exists: only its loss trajectory is judged (the
                reference band spans seeds; a metric is compared with the same seed's).
        """
        return judge_stored(study.user_attrs, config, measurement.losses, measurement.metric,
                            baseline_global_batch=self._baseline.global_batch_size,
                            max_accuracy_loss=self.options.max_accuracy_loss,
                            metric_direction=self.options.metric_direction, metric_reference=same_seed,
                            loss_every=measurement.loss_every, extras=measurement.extras)

    def _full_samples(self, study: optuna.Study) -> int:
        """The space's length: what the references trained before their share shortened them."""
        shortened = study.user_attrs.get("references_shortened")
        full = shortened.get("from_samples") if isinstance(shortened, dict) else None
        return int(full) if isinstance(full, (int, float)) and full > 0 else self.runner.budget.samples

    def _extended_samples(self, study: optuna.Study, config: TrialConfig, length: float) -> int:
        batch = config.global_batch_size
        return max(batch, int(length * self._full_samples(study)) // batch * batch)

    def extension_seconds(self, study: optuna.Study, attrs: Any, length: float) -> float:
        """``_planner.extension_seconds`` of a trial (its attributes) at ``length`` of the space's length."""
        return extension_seconds(study, attrs, length, reference=self._reference_of(self._baseline).to_dict(),
                                 repeats=self.options.reference_repeats, full_samples=self._full_samples(study))

    def extend(self, study: optuna.Study, number: int, extension: Extension, ui: _Progress) -> None:
        """Longer evidence for trial ``number``, whose shortened evidence could not tell (``_planner.EXTEND``):
        the fp32 references and its config train ``extension.length`` of the space's length, and it is
        judged against them. A trial of the same config records that run and its verdict, and the old one is
        superseded (``SUPERSEDED``), so the study's pick reads the longer evidence, whatever it says."""
        old = study.trials[number]
        config = TrialConfig.from_dict(old.user_attrs["config"])
        samples = self._extended_samples(study, config, extension.length)
        full = self._full_samples(study)
        saved = self.runner.budget
        self.runner.budget = dataclasses.replace(saved, samples=samples, seconds=None)
        why, measurements, outcome = "", [], None
        try:
            _, runs = self._runs(self._reference_of(self._baseline), f"reference-extended-{number}",
                                 f" on longer evidence ({samples:,} samples)", ui)
            measurements = [o.measurement for _, o in runs if o.ok and o.measurement is not None]
            if len(measurements) < len(runs) or not measurements:
                why = f"its fp32 reference failed ({runs[-1][1].status}: {runs[-1][1].error or 'no detail'})"
            else:
                ui.status(f"longer evidence: #{number} {config.describe()} ({samples:,} samples)")
                outcome = self.runner.run(config, f"extended-{number}", seed=self.seed,
                                          timeout=self.clock.cap(self.runner.timeout))
                if not outcome.ok or outcome.measurement is None:
                    why = f"its run failed ({outcome.status}: {outcome.error or 'no detail'})"
        finally:
            self.runner.budget = saved
        attrs = {**old.user_attrs, EXTENDED: round(samples / full, 4), "extension_of": number,
                 "extended_samples": samples}
        attrs.pop(SHORT_EVIDENCE, None)
        values, feasible = list(old.values), True
        if why:
            attrs["accuracy_evidence"] = f"{old.user_attrs.get('accuracy_evidence', '')}; longer evidence: {why}"
        else:
            assert outcome is not None and outcome.measurement is not None
            m, band = outcome.measurement, ReferenceBand.of_measurements(measurements)
            judged = {**study.user_attrs, REFERENCE_BAND: band.to_dict(), "reference_metric": measurements[0].metric,
                      "references_shortened": {"samples": samples, "from_samples": full} if samples < full else None}
            verdict = judge_stored(judged, config, m.losses, m.metric,
                                   baseline_global_batch=self._baseline.global_batch_size,
                                   max_accuracy_loss=self.options.max_accuracy_loss,
                                   metric_direction=self.options.metric_direction, loss_every=m.loss_every,
                                   extras=m.extras)
            attrs.update(accuracy_verdict=verdict.label, accuracy_loss=verdict.accuracy_loss,
                         accuracy_evidence=f"on longer evidence ({samples:,} of {full:,} samples): {verdict.evidence}")
            if verdict.short_evidence is not None:
                attrs[SHORT_EVIDENCE] = round(verdict.short_evidence, 4)
            values, feasible = [old.values[0], verdict.accuracy_loss], verdict.feasible
            ui.say(f"  longer evidence for #{number}: {verdict.label} ({samples:,} of {full:,} samples)")
        study.add_trial(optuna.trial.create_trial(
            params=old.params, distributions=old.distributions, values=values, user_attrs=attrs,
            system_attrs={**old.system_attrs, "constraints:failure": 0.0,
                          "constraints:accuracy": -1.0 if feasible else 1.0}))
        study.set_user_attr(SUPERSEDED, [*(study.user_attrs.get(SUPERSEDED) or []), number])

    def blind_reasons(self, study: optuna.Study) -> list[str]:
        """Why the study's accuracy check cannot see harm, if it cannot (from the baseline's references)."""
        return _stored_band(study.user_attrs).blind_reasons(self.options.max_accuracy_loss)

    def is_blind(self, study: optuna.Study) -> bool:
        """True when no part of the study's accuracy check can vouch for a config."""
        return _stored_band(study.user_attrs).is_blind(self.options.max_accuracy_loss)


def judge_stored(attrs: dict[str, Any], config: TrialConfig, losses: Sequence[float], metric: Optional[float], *,
                 baseline_global_batch: int, max_accuracy_loss: float, metric_direction: str,
                 metric_reference: bool = True, loss_every: int = 1,
                 extras: Optional[dict[str, Any]] = None) -> Verdict:
    """Judge a trial at ``config``'s global batch against the references a study stored (``attrs``): its own
    global batch's when recorded, else the baseline's, with a note saying so. A pure function of stored
    numbers, so a finished study can be judged again by the current rules.

    A run at the references' seed (``metric_reference``) at their global batch is paired with the first
    seed's trajectory through the fingerprints in its ``extras``; any other is judged against the band.
    """
    batch = config.global_batch_size
    own = attrs.get(f"{BATCH_REFERENCE_BAND}{batch}")
    note = ""
    if own is not None:
        band, reference_metric = ReferenceBand.from_dict(own), attrs.get(f"{BATCH_REFERENCE}{batch}")
    else:
        band, reference_metric = _stored_band(attrs), attrs.get("reference_metric")
        if batch != baseline_global_batch:
            why = attrs.get(f"{BATCH_REFERENCE_FAILED}{batch}")
            note = (f"judged against fp32 at the baseline's global batch {baseline_global_batch}"
                    + (f" (the reference at {batch} failed: {why})" if why else ""))
    own_batch = own is not None and batch != baseline_global_batch
    if not metric_reference:  # another seed than the references': its loss trajectory alone is judged
        reference_metric = metric = None
    # Against another global batch's references the steps are not the same: no pairing.
    same_steps = metric_reference and (own is not None or batch == baseline_global_batch)
    verdict = judge(losses, metric, band, reference_metric=reference_metric, max_accuracy_loss=max_accuracy_loss,
                    metric_direction=metric_direction,
                    baseline_metric=attrs.get("reference_metric") if own_batch else None, loss_every=loss_every,
                    pairing=fingerprints(extras or {}) if same_steps else None, precision=config.precision,
                    shortened=evidence_share(attrs))
    if note:
        return Verdict(verdict.label, f"{verdict.evidence} ({note})", verdict.accuracy_loss, verdict.constraint)
    return verdict


def evidence_share(attrs: dict[str, Any]) -> Optional[float]:
    """The share of the space's length the references (and so every trial) trained, where the budget shortened
    them; None at the full length."""
    shortened = attrs.get("references_shortened")
    if not isinstance(shortened, dict):
        return None
    samples, full = shortened.get("samples"), shortened.get("from_samples")
    if not isinstance(samples, (int, float)) or not isinstance(full, (int, float)) or not 0 < samples < full:
        return None
    return samples / full


def _stored_band(attrs: dict[str, Any]) -> ReferenceBand:
    if REFERENCE_BAND in attrs:
        return ReferenceBand.from_dict(attrs[REFERENCE_BAND])
    # A study made before loss trajectories were recorded: its metrics alone.
    return ReferenceBand(metrics=tuple(attrs.get("reference_metrics") or ()))


def _described(config: TrialConfig, script_batch: bool) -> str:
    """``config`` in words; ``script_batch``: the run adopts the batch the script passes to ctx.loader, which is
    not known before it runs, so the space's batch (``bs64``) would name a batch it may not use."""
    text = config.describe()
    if not script_batch:
        return text
    parts = text.split(" ")
    parts[1] = "at the script's batch"  # describe() puts the batch second: bs64, or bs64x8 when accumulating
    return " ".join(parts)


def _half_micro_batch(config: TrialConfig) -> Optional[TrialConfig]:
    """The same global batch in micro-batches half as large, when such a micro-batch exists."""
    half = config.batch_size // 2
    total = config.global_batch_size
    if half < 8 or half % 8 or total % half:
        return None
    return config.replace(batch_size=half, global_batch=total)


def _loader_words(config: TrialConfig) -> str:
    return f"{config.num_workers} workers" + (", pinned memory" if config.pin_memory else "")


def _curve(m: Measurement) -> list[float]:
    """A reference's loss trajectory thinned to ``CURVE_POINTS`` for the plot."""
    return [round(v, 6) for v in bin_means(list(m.losses), CURVE_POINTS)[0]]
