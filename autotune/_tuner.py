"""The coordinator: creates or resumes the study, runs the reference, the trials and emits the best config.

It never runs user code itself: every run of ``train_fn`` happens in a trial process.
"""

from __future__ import annotations

import datetime
import json
import math
import socket
import statistics
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune import _hardware, _space
from autotune._config import Budget, Measurement, Result, TrialConfig, TrialOutcome, TrialRecord
from autotune._errors import StudyError, WorkloadError
from autotune._isolation import TrialSpec, run_isolated, start_trial_server, target_of
from autotune._rules import infeasible_reason
from autotune._sampler import GuidedSampler
from autotune._progress import _Progress
from autotune._results import (
    BATCH_REFERENCE,
    BATCH_REFERENCE_FAILED,
    BATCH_REFERENCE_NOISE,
    _best_record,
    _budget_trials,
    _distinct_configs,
    _feasible,
    _with_path,
    summarize_study,
    write_best_config,
)
from autotune._storage import DEFAULT_STUDIES_DIR, open_storage, study_dir, study_exists
from autotune._workers import _device_identity, _Heartbeat, _worker_alive, _worker_id

METRIC_NAMES = ["throughput", "accuracy_loss"]
# Where a CPU run starts: bf16 is slower than fp32 on CPUs without bf16 matrix units, and compiling
# costs minutes on a few cores, so both are tried as moves rather than assumed.
CPU_PRIORS = {"precision": ("fp32", "bf16"), "compile": ("off", "default")}
DEFAULT_MAX_ACCURACY_LOSS = 0.01
ACCURACY_REFERENCES = ("baseline", "batch")


class Tuner:
    """Find the fastest config of a training function whose accuracy stays within bounds.

    Args:
        train_fn: A module-level function ``train_fn(ctx)``, or its ``path.py:func`` / ``module:func``.
        space: A ``SearchSpace``, a YAML path, or a built-in name; ``None`` picks one of
            ``default_spaces`` (CPU, GPU) by the machine.
        n_trials: Trials in the study, counted across every worker and every resume.
        timeout: Stop starting trials after this many seconds.
        study_name: Defaults to the function's name.
        storage: Any Optuna storage URL, or ``journal:PATH``; ``None`` is ``studies/autotune.db``.
        max_accuracy_loss: A trial is infeasible when its accuracy loss exceeds this plus the
            reference noise band (metric units; 0.01 is one accuracy point).
        metric_direction: ``"maximize"`` for accuracy-like metrics, ``"minimize"`` for losses.
        accuracy_reference: ``"baseline"`` judges every trial against the fp32 baseline; ``"batch"``
            against an fp32 run of the baseline at the trial's own batch size (run once per batch size
            and seed, when first needed), so the check isolates what precision, compile and graphs do from
            what fewer optimizer steps do in a short trial.
        reference_repeats: fp32 reference runs with different seeds, for the baseline and for each batch
            size in ``"batch"`` mode; two or more give each reference its noise band.
        trial_timeout: Wall-clock seconds before a trial's process group is killed.
        memory_limit_gib: On CPU, address space a trial may add beyond its start (a device-memory
            stand-in that turns a too-large batch into an out-of-memory failure, not a host OOM kill).
        confirm_samples: If set, train the best config and the reference this long and report both.
        top_k: Before declaring the best, re-measure the top K feasible configs in alternation
            (A B C A B C ...) for ``confirm_rounds`` rounds and pick by the median; 0 or 1 turns it off.
        confirm_rounds: Rounds of the top-K re-measurement.
        studies_dir: Where ``best_config.json`` and trial logs go.
        seed: Seed of the data order, the model initialisation and the sampler.
        sampler: An Optuna sampler; defaults to ``GuidedSampler`` over the space (prior point, then a
            coordinate walk from the best config, with the out-of-memory rule).
        prune_below: Stop a trial after its first timed window when its throughput is below this fraction
            of the best so far on the same device (recorded as PRUNED with its partial measurement);
            ``None`` or 0 turns it off. Window-to-window spread is a few percent, so 0.5 only stops
            configs that could not come near the best.
        progress: Show a progress bar.
        grace_period: On RDB storages, seconds without a heartbeat after which another worker's
            running trial is failed and its config retried once.
        mode: ``"tune"`` creates or resumes the study and runs trials; ``"create"`` only creates it
            (with the reference run) for workers to join; ``"join"`` joins an existing study as one
            more worker, taking the space and trial budget from the study.
    """

    def __init__(
        self,
        train_fn: Union[Callable[..., Any], str],
        *,
        space: Union[_space.SearchSpace, str, Path, None] = None,
        n_trials: int = 20,
        timeout: Optional[float] = None,
        study_name: Optional[str] = None,
        storage: Optional[str] = None,
        max_accuracy_loss: float = DEFAULT_MAX_ACCURACY_LOSS,
        metric_direction: str = "maximize",
        accuracy_reference: str = "baseline",
        reference_repeats: int = 2,
        trial_timeout: float = 600.0,
        memory_limit_gib: Optional[float] = None,
        confirm_samples: Optional[int] = None,
        top_k: int = 3,
        confirm_rounds: int = 2,
        studies_dir: Union[str, Path] = DEFAULT_STUDIES_DIR,
        seed: int = 0,
        sampler: Optional[optuna.samplers.BaseSampler] = None,
        progress: bool = True,
        capabilities: Optional[_hardware.Capabilities] = None,
        default_spaces: tuple[str, str] = ("cpu_default", "gpu_default"),
        mode: str = "tune",
        grace_period: int = 60,
        prune_below: Optional[float] = 0.5,
    ) -> None:
        self.target = train_fn if isinstance(train_fn, str) else target_of(train_fn)
        if n_trials < 1:
            raise ValueError("n_trials must be at least 1")
        if metric_direction not in ("maximize", "minimize"):
            raise ValueError("metric_direction must be 'maximize' or 'minimize'")
        if accuracy_reference not in ACCURACY_REFERENCES:
            raise ValueError(f"accuracy_reference must be one of {', '.join(ACCURACY_REFERENCES)}")
        if reference_repeats < 1:
            raise ValueError("reference_repeats must be at least 1")
        if max_accuracy_loss < 0:
            raise ValueError("max_accuracy_loss must be >= 0")
        self.space_arg = space
        self.n_trials = n_trials
        self.timeout = timeout
        self.study_name = study_name or self.target.rpartition(":")[2]
        self.storage_url = storage
        self.max_accuracy_loss = max_accuracy_loss
        self.metric_direction = metric_direction
        self.accuracy_reference = accuracy_reference
        self.reference_repeats = reference_repeats
        self.trial_timeout = trial_timeout
        self.memory_limit_gib = memory_limit_gib
        self.confirm_samples = confirm_samples
        self.top_k = top_k
        self.confirm_rounds = confirm_rounds
        self.studies_dir = Path(studies_dir)
        self.seed = seed
        self.sampler = sampler
        self.progress = progress
        self.capabilities = capabilities
        self.default_spaces = default_spaces
        self._resumed_trials = 0  # a resumed study reseeds its sampler, so it does not replay old proposals
        if mode not in ("tune", "create", "join"):
            raise ValueError("mode must be 'tune', 'create' or 'join'")
        self.mode = mode
        self.grace_period = grace_period
        if prune_below is not None and not 0 <= prune_below < 1:
            raise ValueError("prune_below must be a fraction in [0, 1)")
        self.prune_below = prune_below or None

    # -- setup -----------------------------------------------------------------------------------
    def _load_space(self, caps: _hardware.Capabilities) -> _space.SearchSpace:
        if isinstance(self.space_arg, _space.SearchSpace):
            return self.space_arg
        if self.space_arg is None:
            return _space.load_space(self.default_spaces[1] if caps.cuda else self.default_spaces[0])
        return _space.load_space(self.space_arg)

    def _load_existing(self, storage: Any, space: _space.SearchSpace) -> Optional[optuna.Study]:
        """The study if it exists, after checking that it was made with this space and target."""
        if not study_exists(storage, self.study_name):
            return None
        self._resumed_trials = len(optuna.load_study(study_name=self.study_name, storage=storage).trials)
        study = optuna.load_study(study_name=self.study_name, storage=storage, sampler=self._sampler())
        old = study.user_attrs.get("space")
        if old is not None and study.user_attrs.get("space_fingerprint") != space.fingerprint:
            changed = _space.describe_changes(old, space.to_dict()) or ["the definition"]
            raise StudyError(
                f"study {self.study_name!r} was created with another search space "
                f"(changed: {', '.join(changed)}); use a new --study name or the original space"
            )
        if old is not None and study.user_attrs.get("target") not in (None, self.target):
            raise StudyError(
                f"study {self.study_name!r} tunes {study.user_attrs['target']}, not {self.target}; "
                "use a new --study name"
            )
        return study

    def _join(self) -> optuna.Study:
        if not study_exists(self._storage, self.study_name):
            raise StudyError(
                f"no study {self.study_name!r} to join; create it with `autotune tune ... --create-only` "
                "or start the first worker with `autotune tune`"
            )
        study = optuna.load_study(study_name=self.study_name, storage=self._storage, sampler=self._sampler())
        if "space" not in study.user_attrs:
            raise StudyError(f"study {self.study_name!r} was not created by autotune")
        if study.user_attrs.get("target") not in (None, self.target):
            raise StudyError(f"study {self.study_name!r} tunes {study.user_attrs['target']}, not {self.target}")
        return study

    def _create(self, storage: Any, space: _space.SearchSpace, caps: _hardware.Capabilities,
                reference: dict[str, Any]) -> optuna.Study:
        try:
            study = optuna.create_study(
                study_name=self.study_name,
                storage=storage,
                directions=["maximize", "minimize"],
                sampler=self._sampler(),
            )
        except optuna.exceptions.DuplicatedStudyError:
            # Another worker created it while this one ran the reference: join it.
            return optuna.load_study(study_name=self.study_name, storage=storage, sampler=self._sampler())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study.set_metric_names(METRIC_NAMES)
        attrs = {
            "target": self.target,
            "space_name": space.name,
            "space": space.to_dict(),
            "space_fingerprint": space.fingerprint,
            "removed_knobs": space.removed,
            "hardware": caps.to_dict(),
            "metric_direction": self.metric_direction,
            "max_accuracy_loss": self.max_accuracy_loss,
            "accuracy_reference": self.accuracy_reference,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "n_trials": self.n_trials,
            "prune_below": self.prune_below,
            **reference,
        }
        for key, value in attrs.items():
            study.set_user_attr(key, value)
        self._add_baseline_trial(study, space, reference)
        return study

    def _add_baseline_trial(self, study: optuna.Study, space: _space.SearchSpace, reference: dict[str, Any]) -> None:
        """Record the first reference run as trial 0, so the untuned config competes like any other.

        Skipped when the baseline is not a point of the space (a value outside a knob's choices, or a
        fixed knob set otherwise), because the sampler could not place it among the other trials.
        """
        baseline = TrialConfig.from_dict(reference["baseline_config"])
        asker = _BaselineAsker(baseline)
        if space.sample(asker) != baseline or asker.outside:
            return  # not a point of the space: the sampler could not place it
        distributions = space.distributions()
        asked = asker.params
        measurement = Measurement.from_dict(reference["reference_measurement"])
        user_attrs = _measurement_attrs(measurement)
        user_attrs.update(config=baseline.to_dict(), status="ok", accuracy_loss=0.0, role="reference", worker=_worker_id(),
                          throughput_spread=measurement.spread, **self._identity)
        user_attrs.update(_diagnosis_attrs(study, {**user_attrs, "number": len(study.trials), "state": "COMPLETE"}))
        threshold = self.max_accuracy_loss + reference["metric_noise"]
        study.add_trial(optuna.trial.create_trial(
            params=asked,
            distributions={k: distributions[k] for k in asked},
            values=[measurement.throughput, 0.0],
            user_attrs=user_attrs,
            system_attrs={"constraints:failure": 0.0, "constraints:accuracy": -threshold},
        ))

    def _sampler(self, space: Optional[_space.SearchSpace] = None) -> optuna.samplers.BaseSampler:
        """The user's sampler, else GuidedSampler over the space (a placeholder until the space is known)."""
        if self.sampler is not None:
            return self.sampler
        if space is None:
            return optuna.samplers.RandomSampler(seed=self.seed)
        return GuidedSampler(
            search_space=space.distributions(),
            priors=None if self._caps.cuda else CPU_PRIORS,
            canonical=space.asked_params,
            seed=None if self.mode == "join" else self.seed + self._resumed_trials,
        )

    def _spec(self, config: TrialConfig, budget: Budget, seed: int, baseline: TrialConfig,
              prune_below: Optional[float] = None) -> TrialSpec:
        return TrialSpec(
            target=self.target,
            config=config,
            budget=budget,
            seed=seed,
            baseline_batch_size=baseline.batch_size,
            memory_limit_gib=self.memory_limit_gib,
            prune_below=prune_below,
        )

    # -- reference -------------------------------------------------------------------------------
    def _reference(self, space: _space.SearchSpace, ui: "_Progress") -> dict[str, Any]:
        """Train the baseline in fp32 once per seed: baseline throughput, reference metric, noise band.

        Raises:
            WorkloadError: a reference run failed, so no trial could be judged.
        """
        baseline = space.baseline.replace(precision="fp32")
        metrics, rates, first = [], [], None
        runs = self._fp32_runs(space, baseline, lambda repeat: self._logdir() / f"reference-{repeat}", "", ui)
        for workdir, outcome in runs:
            if not outcome.ok or outcome.measurement is None:
                raise WorkloadError(
                    f"the fp32 reference run failed ({outcome.status}: {outcome.error or 'no detail'}); "
                    f"see {workdir / 'trial.log'}"
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
            "metric_noise": _noise_band(metrics),
        }

    def _fp32_runs(self, space: _space.SearchSpace, config: TrialConfig, workdir_of: Callable[[int], Path],
                   where: str, ui: "_Progress") -> Iterator[tuple[Path, TrialOutcome]]:
        """Run ``config`` (an fp32 reference) once per reference seed, each an isolated trial in
        ``workdir_of(repeat)``; yields each run's workdir and outcome, so the caller may stop at a failure."""
        for repeat in range(self.reference_repeats):
            seed = self.seed + repeat
            ui.status(f"reference{where} {repeat + 1}/{self.reference_repeats}: {config.describe()} (seed {seed})")
            workdir = workdir_of(repeat)
            yield workdir, run_isolated(self._spec(config, space.budget, seed, space.baseline), workdir=workdir,
                                        timeout=self.trial_timeout)

    # -- trials ----------------------------------------------------------------------------------
    def _logdir(self) -> Path:
        return study_dir(self.study_name, self.studies_dir) / "logs"

    def _batch_reference(self, study: optuna.Study, space: _space.SearchSpace, batch_size: int,
                         ui: "_Progress") -> float:
        """With ``accuracy_reference="batch"``: train the fp32 baseline at this batch size, once per seed of
        the baseline's reference, for the accuracy check of every trial at it; the seeds' spread is this
        batch's noise band (a large batch's short run can be far noisier than the baseline's). A failed run
        (say fp32 does not fit where bf16 did) is recorded, and those trials fall back to the baseline
        reference. Returns the seconds it took (0 when no run was needed)."""
        key, failed = f"{BATCH_REFERENCE}{batch_size}", f"{BATCH_REFERENCE_FAILED}{batch_size}"
        if (self.accuracy_reference != "batch" or batch_size == space.baseline.batch_size
                or key in study.user_attrs or failed in study.user_attrs):
            return 0.0
        started = time.perf_counter()
        config = space.baseline.replace(precision="fp32", batch_size=batch_size)
        metrics = []
        logdir = self._logdir() / f"reference-batch-{batch_size}"
        runs = self._fp32_runs(space, config, lambda repeat: logdir / f"seed-{self.seed + repeat}", f" at batch {batch_size}", ui)
        for _, outcome in runs:
            if not (outcome.ok and outcome.measurement is not None and outcome.measurement.metric is not None):
                study.set_user_attr(failed, f"{outcome.status}: {outcome.error}")
                return time.perf_counter() - started
            metrics.append(outcome.measurement.metric)
        study.set_user_attr(key, metrics[0])  # the trial's own seed, as for the baseline reference
        if len(metrics) >= 2:
            study.set_user_attr(f"{BATCH_REFERENCE_NOISE}{batch_size}", _noise_band(metrics))
        return time.perf_counter() - started

    def _metric_noise(self, study: optuna.Study, batch_size: int) -> float:
        """The noise band a trial at this batch is allowed: its batch reference's, else the baseline's."""
        return study.user_attrs.get(f"{BATCH_REFERENCE_NOISE}{batch_size}", study.user_attrs.get("metric_noise", 0.0))

    def _accuracy_loss(self, study: optuna.Study, metric: Optional[float], batch_size: int) -> float:
        reference = study.user_attrs.get(f"{BATCH_REFERENCE}{batch_size}", study.user_attrs.get("reference_metric"))
        if reference is None or metric is None:
            return 0.0  # the workload reports no metric: accuracy is not checked (noted in the study)
        loss = reference - metric if self.metric_direction == "maximize" else metric - reference
        return loss

    def _tell(self, study: optuna.Study, trial: optuna.Trial, config: TrialConfig, outcome: TrialOutcome) -> None:
        threshold = self.max_accuracy_loss + self._metric_noise(study, config.batch_size)
        trial.set_user_attr("config", config.to_dict())
        trial.set_user_attr("status", outcome.status)
        trial.set_user_attr("wall_seconds", round(outcome.wall_seconds, 3))
        trial.set_user_attr("run_seconds", round(outcome.run_seconds, 3))
        if outcome.status == "pruned" and outcome.measurement is not None:
            for key, value in _measurement_attrs(outcome.measurement).items():
                trial.set_user_attr(key, value)
            trial.set_user_attr("pruned_reason", outcome.error)
            self._record_diagnosis(study, trial, "PRUNED")
            study.tell(trial, state=TrialState.PRUNED)
            return
        if outcome.ok and outcome.measurement is not None:
            m = outcome.measurement
            loss = self._accuracy_loss(study, m.metric, config.batch_size)
            for key, value in _measurement_attrs(m).items():
                trial.set_user_attr(key, value)
            trial.set_user_attr("throughput_spread", m.spread)
            trial.set_user_attr("accuracy_loss", loss)
            trial.set_constraint("failure", 0.0)
            trial.set_constraint("accuracy", loss - threshold)
            self._record_diagnosis(study, trial, "COMPLETE")
            self._finish(study, trial, [m.throughput, loss])
            return
        trial.set_user_attr("failure", outcome.status)
        trial.set_user_attr("error", outcome.error)
        trial.set_user_attr("stderr_tail", outcome.stderr_tail[-1500:])
        if outcome.signal:
            trial.set_user_attr("signal", outcome.signal)
        for key in ("throughput", "data_wait_fraction", "peak_memory_gib"):
            trial.set_user_attr(key, 0.0)
        trial.set_user_attr("accuracy_loss", math.inf)
        # Infeasible, not FAIL: the sampler learns from infeasible trials and ignores failed ones.
        trial.set_constraint("failure", 1.0)
        trial.set_constraint("accuracy", 0.0)
        self._record_diagnosis(study, trial, "COMPLETE")
        self._finish(study, trial, [0.0, math.inf])
        if outcome.status == "oom":
            self._record_implied_oom(study, config, trial.number)

    @staticmethod
    def _record_diagnosis(study: optuna.Study, trial: optuna.Trial, state: str) -> None:
        """Store what held this trial back on the trial itself, judged against the study so far (a
        finished trial takes no new attributes; the study-level ``diagnoses`` are revised at the end)."""
        current = {**trial.user_attrs, "number": trial.number, "state": state}
        for key, value in _diagnosis_attrs(study, current).items():
            trial.set_user_attr(key, value)

    def _oom_configs(self, study: optuna.Study) -> list[tuple[int, dict[str, Any]]]:
        return [
            (t.number, t.user_attrs["config"])
            for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if t.user_attrs.get("status") == "oom" and "config" in t.user_attrs
        ]

    def _prune_infeasible(self, study: optuna.Study, trial: optuna.Trial, config: TrialConfig, reason: str) -> None:
        trial.set_user_attr("config", config.to_dict())
        trial.set_user_attr("status", "infeasible")
        trial.set_user_attr("pruned_reason", reason)
        study.tell(trial, state=TrialState.PRUNED)

    def _record_implied_oom(self, study: optuna.Study, failed: TrialConfig, number: int) -> None:
        """Record the configs an out-of-memory rules out as PRUNED trials with the reason, so the
        dashboard shows them and no sampler runs them: larger batches, and wider precisions, with the
        failed trial's other settings. They cost no run and do not count toward the trial budget."""
        space = self._space
        batches = [b for b in (space.knobs["batch_size"].values if "batch_size" in space.knobs else ()) if b > failed.batch_size]
        precisions = space.knobs["precision"].values if "precision" in space.knobs else (failed.precision,)
        taken = {json.dumps(t.params, sort_keys=True) for t in study.get_trials(deepcopy=False)}
        distributions = space.distributions()
        ooms = [(number, failed.to_dict())]
        for batch in [failed.batch_size, *batches]:
            for precision in precisions:
                candidate = failed.replace(batch_size=batch, precision=precision)
                if candidate == failed:
                    continue
                reason = infeasible_reason(candidate.to_dict(), ooms)
                asked = space.asked_params(candidate.to_dict())  # only searchable knobs are asked
                if reason is None or json.dumps(asked, sort_keys=True) in taken:
                    continue
                study.add_trial(optuna.trial.create_trial(
                    state=TrialState.PRUNED,
                    params=asked,
                    distributions={k: distributions[k] for k in asked},
                    user_attrs={"config": candidate.to_dict(), "status": "infeasible", "pruned_reason": reason},
                ))

    def _finished_counts(self, study: optuna.Study) -> int:
        # FAIL is left out: it only marks trials whose worker died, and each is retried once.
        return len(_budget_trials(study, (TrialState.COMPLETE, TrialState.PRUNED)))

    def _live_counts(self, study: optuna.Study) -> int:
        return len(_budget_trials(study, (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)))

    def _duplicate_of(self, study: optuna.Study, trial: optuna.Trial) -> Optional[FrozenTrial]:
        for old in _budget_trials(study, (TrialState.COMPLETE, TrialState.PRUNED)):
            if old.number != trial.number and old.params == trial.params and "config" in old.user_attrs:
                return old
        return None

    def run(self) -> Result:
        """Run the study to its trial budget and return what it found.

        Nothing is created in the storage until the space validates, the target imports and the fp32
        reference has run, so bad input leaves no half-made study behind.
        """
        started = time.monotonic()
        caps = self._caps = self.capabilities or _hardware.probe(target=self.target)
        self._storage, storage_label = open_storage(self.storage_url, self.studies_dir, grace_period=self.grace_period)
        self._identity = _device_identity(caps)
        if self.mode == "join":
            study = self._join()
            space = _space.parse_space(study.user_attrs["space"], where=f"study {self.study_name}", name=self.study_name)
            space = _space.restrict_to(space, caps)
            # A worker judges trials by the study's settings, not by its own defaults.
            self.n_trials = int(study.user_attrs.get("n_trials", self.n_trials))
            self.max_accuracy_loss = study.user_attrs.get("max_accuracy_loss", self.max_accuracy_loss)
            self.metric_direction = study.user_attrs.get("metric_direction", self.metric_direction)
            self.accuracy_reference = study.user_attrs.get("accuracy_reference", self.accuracy_reference)
            self.prune_below = study.user_attrs.get("prune_below", self.prune_below)
        else:
            space = _space.restrict_to(self._load_space(caps), caps)
            study = self._load_existing(self._storage, space)
        self._space = space
        with _Progress(self.progress, self.n_trials) as ui:
            if study is None or "reference_metrics" not in study.user_attrs:
                reference = self._reference(space, ui)
                if study is None:
                    study = self._create(self._storage, space, caps, reference)
                else:
                    for key, value in reference.items():
                        study.set_user_attr(key, value)
            if self.mode == "create":
                return summarize_study(study, storage_url=storage_label)
            study.sampler = self._sampler(space)
            start_trial_server()
            ui.set_best(_best_record(study))
            ui.set_completed(self._finished_counts(study))  # a resume, or trial 0 from the reference run
            self._sampler_done = False
            ruled_out = 0
            while not self._sampler_done:
                self._recover_stale(study)
                if self._finished_counts(study) >= self.n_trials:
                    break
                if self.timeout is not None and time.monotonic() - started > self.timeout:
                    break
                if self._live_counts(study) >= self.n_trials:
                    ui.status("waiting for the trials other workers are running")
                    time.sleep(2.0)
                    continue
                if len(_distinct_configs(study)) >= space.size:
                    ui.status("every config of the space has been measured")
                    break
                if self._run_one(study, space, ui) == "infeasible":
                    ruled_out += 1
                    if ruled_out >= 200:  # the sampler keeps proposing what cannot fit: nothing left
                        break
                else:
                    ruled_out = 0
            if self.top_k > 1 and self.mode == "tune":
                self._confirm_top_k(study, space, ui)
            if self.confirm_samples:
                self._confirm(study, space, ui)
        from autotune._report import annotate_study  # diagnoses, dashboard note, plots; never raises

        annotate_study(study, studies_dir=self.studies_dir)
        result = summarize_study(study, storage_url=storage_label)
        path = write_best_config(study, result, self.studies_dir)
        return _with_path(result, path)

    def _run_one(self, study: optuna.Study, space: _space.SearchSpace, ui: "_Progress") -> str:
        """Ask for one config and run it; returns how it ended ("infeasible" when the memory rule
        answered it without a run)."""
        with warnings.catch_warnings():
            # Optuna expects heartbeats from Study.optimize; this loop records them itself (_Heartbeat).
            warnings.filterwarnings("ignore", message="Heartbeat of storage", category=UserWarning)
            trial = study.ask()
        trial.set_user_attr("worker", _worker_id())
        for key, value in self._identity.items():
            trial.set_user_attr(key, value)
        config = space.sample(trial)
        surplus = self._surplus_reason(study, trial)
        if surplus:
            # Another worker took the last place in the budget, or is running this very config.
            trial.set_user_attr("failure", surplus)
            study.tell(trial, state=TrialState.FAIL)
            time.sleep(0.5)
            return "surplus"
        reason = infeasible_reason(config.to_dict(), self._oom_configs(study))
        if reason:
            self._prune_infeasible(study, trial, config, reason)
            return "infeasible"
        ui.start_trial(trial.number, config)
        duplicate = self._duplicate_of(study, trial)
        try:
            if duplicate is not None:
                # The sampler proposed a measured config again: reuse it rather than spend a run.
                trial.set_user_attr("duplicate_of", duplicate.number)
                self._copy(study, trial, duplicate)
            else:
                with _Heartbeat(self._storage, trial._trial_id):
                    outcome = run_isolated(
                        self._spec(config, space.budget, self.seed, space.baseline, self._prune_threshold(study)),
                        workdir=self._logdir() / f"trial-{trial.number}",
                        timeout=self.trial_timeout,
                    )
                    if outcome.ok:
                        # Runs inside this trial's ask-to-tell; recorded so that it is not read as overhead.
                        reference_seconds = self._batch_reference(study, space, config.batch_size, ui)
                        if reference_seconds:
                            trial.set_user_attr("reference_seconds", round(reference_seconds, 3))
                self._tell(study, trial, config, outcome)
        except BaseException:
            if study._storage.get_trial(trial._trial_id).state == TrialState.RUNNING:
                study.tell(trial, state=TrialState.FAIL)  # never leave a trial RUNNING
            raise
        ui.end_trial(study.trials[trial.number])
        ui.set_completed(self._finished_counts(study))
        ui.set_best(_best_record(study))
        return study.trials[trial.number].user_attrs.get("status", "ok")

    def _prune_threshold(self, study: optuna.Study) -> Optional[float]:
        if not self.prune_below:
            return None
        device = self._identity.get("device", "")
        rates = [r.throughput for r in _feasible(study) if r.device in (device, "")]
        return self.prune_below * max(rates) if rates else None

    def _finish(self, study: optuna.Study, trial: optuna.Trial, values: Any) -> None:
        try:
            study.tell(trial, values)
        except RuntimeError as exc:
            # Exhaustive samplers (grid, brute force) call study.stop() once every config is told; outside
            # study.optimize that raises after the trial is stored. It means: nothing left to try.
            if "Study.stop" not in str(exc):
                raise
            self._sampler_done = True

    def _surplus_reason(self, study: optuna.Study, trial: optuna.Trial) -> str:
        live = _budget_trials(study, (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING))
        ahead = [t for t in live if t.number < trial.number]
        if len(ahead) >= self.n_trials:
            return "surplus: the trial budget was reached by other workers"
        for other in ahead:
            if other.state == TrialState.RUNNING and other.params == trial.params:
                return f"surplus: trial {other.number} is running the same config"
        return ""

    def _recover_stale(self, study: optuna.Study) -> None:
        """Fail RUNNING trials whose worker is gone, and run each such config once more.

        A worker on this host is gone when its process no longer exists (a SIGKILLed tuner); workers on
        other hosts are judged by Optuna's heartbeat where the storage keeps one (RDB storages).
        """
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)  # heartbeat storages; their callback re-enqueues
        host = socket.gethostname()
        for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            worker = trial.user_attrs.get("worker", "")
            if not worker.startswith(f"{host}:") or _worker_alive(worker):
                continue
            try:
                self._storage.set_trial_user_attr(trial._trial_id, "failure", f"stale: worker {worker} is gone")
                self._storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL)
            except optuna.exceptions.UpdateFinishedTrialError:
                continue  # another process got there first
            if "retry_of" not in trial.user_attrs and trial.params:
                study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number})

    def _copy(self, study: optuna.Study, trial: optuna.Trial, old: FrozenTrial) -> None:
        for key, value in old.user_attrs.items():
            if key not in ("duplicate_of", "retry_of", "worker", "role"):
                trial.set_user_attr(key, value)
        if old.state == TrialState.PRUNED:
            study.tell(trial, state=TrialState.PRUNED)
            return
        for key, value in old.constraints.items():
            trial.set_constraint(key, value)
        self._finish(study, trial, old.values)

    def _confirm_top_k(self, study: optuna.Study, space: _space.SearchSpace, ui: "_Progress") -> None:
        """Re-measure the top K configs in alternation so that drift or one lucky sample cannot crown one."""
        ranked: list[TrialRecord] = []
        for record in sorted(_feasible(study), key=lambda r: -r.throughput):
            if record.config not in [r.config for r in ranked]:
                ranked.append(record)
        ranked = ranked[: self.top_k]
        if len(ranked) < 2:
            return
        previous = study.user_attrs.get("top_k_confirmation")
        if previous and previous.get("trials") == [r.number for r in ranked]:
            return  # already confirmed these, e.g. on a resume with nothing new
        rates: dict[int, list[float]] = {r.number: [] for r in ranked}
        for round_index in range(self.confirm_rounds):
            for record in ranked:
                ui.status(f"top-{len(ranked)} confirmation round {round_index + 1}: #{record.number}")
                outcome = run_isolated(
                    self._spec(record.config, space.budget, self.seed, space.baseline),
                    workdir=self._logdir() / f"confirm-{record.number}-{round_index}",
                    timeout=self.trial_timeout,
                )
                if outcome.ok and outcome.measurement is not None:
                    rates[record.number].append(outcome.measurement.throughput)
        medians = {n: statistics.median(v) for n, v in rates.items() if v}
        if not medians:
            return
        winner = max(medians, key=lambda n: medians[n])
        study.set_user_attr(
            "top_k_confirmation",
            {"trials": [r.number for r in ranked], "throughputs": rates, "medians": medians, "winner": winner},
        )

    def _confirm(self, study: optuna.Study, space: _space.SearchSpace, ui: "_Progress") -> None:
        best = _best_record(study)
        if best is None:
            return
        budget = Budget(samples=self.confirm_samples or 0, warmup_steps=space.budget.warmup_steps,
                        windows=space.budget.windows)
        report: dict[str, Any] = {"samples": budget.samples}
        for role, config in (("reference", space.baseline.replace(precision="fp32")), ("best", best.config)):
            ui.status(f"confirmation: {role} for {budget.samples} samples")
            outcome = run_isolated(
                self._spec(config, budget, self.seed, space.baseline),
                workdir=self._logdir() / f"confirm-{role}",
                timeout=self.trial_timeout * max(1.0, budget.samples / space.budget.samples),
            )
            report[role] = outcome.to_dict()
        ref_m = (report["reference"].get("measurement") or {}).get("metric")
        best_m = (report["best"].get("measurement") or {}).get("metric")
        if ref_m is not None and best_m is not None:
            report["accuracy_loss"] = ref_m - best_m if self.metric_direction == "maximize" else best_m - ref_m
        study.set_user_attr("confirmation", report)


def _noise_band(metrics: list[Optional[float]]) -> float:
    """The spread of the metrics that reference seeds reached (0 with fewer than two)."""
    real = [m for m in metrics if m is not None]
    return (max(real) - min(real)) if len(real) >= 2 else 0.0


def _measurement_attrs(m: Measurement) -> dict[str, Any]:
    """A measurement as trial user attributes: its fields, and each extra as ``extra:<name>``."""
    attrs = {k: v for k, v in m.to_dict().items() if k != "extras"}
    attrs.update({f"extra:{k}": v for k, v in m.extras.items()})
    return attrs


def _diagnosis_attrs(study: optuna.Study, current: dict[str, Any]) -> dict[str, str]:
    """``diagnosis`` and ``diagnosis_evidence`` for a trial about to be told, judged against the study."""
    from autotune import _diagnose

    try:
        diagnosis = _diagnose.diagnose(current, [*_diagnose.measurements(study), current])
    except Exception as exc:  # a diagnosis must never cost a trial its result
        warnings.warn(f"no diagnosis for trial {current.get('number')}: {exc}", stacklevel=2)
        return {}
    return {"diagnosis": diagnosis.label, "diagnosis_evidence": diagnosis.evidence} if diagnosis else {}


class _BaselineAsker:
    """Answers a space's questions with the baseline's values, noting any the space does not contain."""

    def __init__(self, baseline: TrialConfig) -> None:
        self.baseline = baseline
        self.params: dict[str, Any] = {}
        self.outside = False

    def _answer(self, name: str, inside: bool) -> Any:
        value = getattr(self.baseline, name)
        self.params[name] = value
        self.outside = self.outside or not inside
        return value

    def suggest_categorical(self, name: str, choices: list[Any]) -> Any:
        return self._answer(name, getattr(self.baseline, name) in choices)

    def suggest_int(self, name: str, low: int, high: int, step: int = 1) -> Any:
        value = getattr(self.baseline, name)
        return self._answer(name, isinstance(value, int) and low <= value <= high and (value - low) % step == 0)

    def suggest_float(self, name: str, low: float, high: float, step: Optional[float] = None) -> Any:
        value = getattr(self.baseline, name)
        on_grid = step is None or abs(round((value - low) / step) * step - (value - low)) < 1e-9
        return self._answer(name, isinstance(value, float) and low <= value <= high and on_grid)
