"""The coordinator: creates, resumes or joins the study, then hands it to its parts.

The parts, one job each: ``References`` (the fp32 reference runs and the accuracy check),
``TrialLoop`` (ask, run, judge, tell) and the confirmation (``_confirm``). It never runs user code
itself: every run of ``train_fn`` happens in a trial process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import sys
import time
import warnings
from typing import Any, Callable, Iterator, Optional, Union

import optuna

from autotune import hardware as _hardware
from autotune._config import Measurement, Result, TrialConfig
from autotune._errors import StudyError
from autotune._records import COLOCATION, study_dir, summarize_study
from autotune._target import target_of
from autotune.search import _compile, _space
from autotune.search._sampler import GuidedSampler
from autotune.study._confirm import confirm_long, confirm_top_k
from autotune.study._isolation import start_trial_server
from autotune.study._locks import file_lock
from autotune.study._loop import TrialLoop, diagnosis_attrs, measurement_attrs
from autotune.study._options import TunerOptions
from autotune.study._progress import _Progress
from autotune.study._references import References
from autotune.study._results import _with_path, write_best_config
from autotune.study._runner import TrialRunner
from autotune.study._storage import open_storage, study_exists
from autotune.study._workers import _device_identity, _worker_id, register_worker

METRIC_NAMES = ["throughput", "accuracy_loss"]
# Where a CPU run starts: bf16 is slower than fp32 on CPUs without bf16 matrix units, and compiling
# costs minutes on a few cores, so both are tried as moves rather than assumed.
CPU_PRIORS = {"precision": ("fp32", "bf16"), "compile": ("off", "default")}


class Tuner:
    """Find the fastest config of a training function whose accuracy stays within bounds.

    Args:
        train_fn: A module-level function ``train_fn(ctx)``, or its ``path.py:func`` / ``module:func``.
        options: Every option, grouped (``TunerOptions``); defaults throughout when ``None``.
        **keywords: Any field of the option records by name (``n_trials=30``, ``top_k=0``,
            ``storage=...``); they override ``options``. See ``StudyOptions``, ``SearchOptions``,
            ``AccuracyOptions``, ``TrialOptions`` and ``ConfirmOptions``.

    Raises:
        ValueError: an option out of range.
        TypeError: an option no record has.
        WorkloadError: ``train_fn`` cannot be named for a trial process (a lambda, a closure).
    """

    def __init__(self, train_fn: Union[Callable[..., Any], str], *, options: Optional[TunerOptions] = None,
                 **keywords: Any) -> None:
        self.target = train_fn if isinstance(train_fn, str) else target_of(train_fn)
        self.options = (options or TunerOptions()).with_keywords(**keywords)
        self.study_name = self.options.study.study_name or self.target.rpartition(":")[2]
        self._resumed_trials = 0  # a resumed study reseeds its sampler, so it does not replay old proposals
        self._compile_plan: Optional[_compile.CompilePlan] = None

    # -- setup -----------------------------------------------------------------------------------
    def _load_space(self, caps: _hardware.Capabilities) -> _space.SearchSpace:
        space, defaults = self.options.search.space, self.options.search.default_spaces
        if not isinstance(space, _space.SearchSpace):
            space = _space.load_space(space if space is not None else defaults[1] if caps.cuda else defaults[0])
        policy = self.options.search.batch_policy
        if policy is None and self.options.accuracy.accuracy_reference == "batch":
            policy = "scale"  # the per-batch-size reference is what the scale policy does
        return space.with_batch_policy(policy) if policy else space

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

    def _join(self, storage: Any) -> optuna.Study:
        if not study_exists(storage, self.study_name):
            raise StudyError(
                f"no study {self.study_name!r} to join; create it with `autotune tune ... --create-only` "
                "or start the first worker with `autotune tune`"
            )
        study = optuna.load_study(study_name=self.study_name, storage=storage, sampler=self._sampler())
        if "space" not in study.user_attrs:
            raise StudyError(f"study {self.study_name!r} was not created by autotune")
        if study.user_attrs.get("target") not in (None, self.target):
            raise StudyError(f"study {self.study_name!r} tunes {study.user_attrs['target']}, not {self.target}")
        return study

    def _adopt_study_settings(self, study: optuna.Study) -> None:
        """A joining worker judges trials by the study's settings, not by its own defaults."""
        attrs, opts = study.user_attrs, self.options
        accuracy = opts.accuracy
        self.options = dataclasses.replace(
            opts,
            confirm=dataclasses.replace(opts.confirm, top_k=int(attrs.get("top_k", opts.confirm.top_k)),
                                        confirm_rounds=int(attrs.get("confirm_rounds", opts.confirm.confirm_rounds))),
            search=dataclasses.replace(opts.search, n_trials=int(attrs.get("n_trials", opts.search.n_trials)),
                                       prune_below=attrs.get("prune_below", opts.search.prune_below)),
            accuracy=dataclasses.replace(
                accuracy,
                max_accuracy_loss=attrs.get("max_accuracy_loss", accuracy.max_accuracy_loss),
                metric_direction=attrs.get("metric_direction", accuracy.metric_direction),
                accuracy_reference=attrs.get("accuracy_reference", accuracy.accuracy_reference),
            ),
        )

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
        accuracy = self.options.accuracy
        attrs = {
            "target": self.target,
            "space_name": space.name,
            "space": space.to_dict(),
            "space_fingerprint": space.fingerprint,
            "removed_knobs": space.removed,
            "hardware": caps.to_dict(),
            "metric_direction": accuracy.metric_direction,
            "max_accuracy_loss": accuracy.max_accuracy_loss,
            "accuracy_reference": accuracy.accuracy_reference,
            "batch_policy": space.batch_policy,
            "global_batch": space.global_batch if space.batch_policy == "fixed" else None,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "n_trials": self.options.search.n_trials,
            "prune_below": self.options.search.prune_below,
            "train_minutes": self.options.search.train_minutes,
            "train_steps": self.options.search.train_steps,
            "compile_break_even": self._compile_plan.to_dict() if self._compile_plan else None,
            "compile_timeout_seconds": self.options.trial.compile_deadline,
            # A worker that joins runs the top-K confirmation when it finishes last, with these settings.
            "top_k": self.options.confirm.top_k,
            "confirm_rounds": self.options.confirm.confirm_rounds,
            **reference,
        }
        for key, value in attrs.items():
            study.set_user_attr(key, value)
        self._add_baseline_trial(study, space, reference)
        return study

    def _plan_compiles(self, space: _space.SearchSpace, reference: dict[str, Any]) -> _space.SearchSpace:
        """Leave out the ``max-autotune*`` modes that the declared training length does not pay for."""
        search, measured = self.options.search, reference["reference_measurement"]
        baseline = TrialConfig.from_dict(reference["baseline_config"])
        self._compile_plan = _compile.plan_expensive_compiles(
            space, _compile.TrainingLength(minutes=search.train_minutes, steps=search.train_steps),
            samples_per_second=float(measured["throughput"]),
            default_compile_seconds=measured.get("compile_seconds") if baseline.compile == "default" else None,
        )
        return _compile.restrict_expensive_compiles(space, self._compile_plan)

    def _stored_compile_plan(self, storage: Any, space: _space.SearchSpace) -> _space.SearchSpace:
        """A resumed study keeps the expensive-compile decision it was created with (its space is that one)."""
        if not study_exists(storage, self.study_name):
            return space
        stored = optuna.load_study(study_name=self.study_name, storage=storage).user_attrs.get("compile_break_even")
        if not stored:
            return space
        return _compile.restrict_expensive_compiles(space, _compile.CompilePlan.from_dict(stored))

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
        user_attrs = measurement_attrs(measurement)
        verdict = self._references.judge(study, baseline, measurement)
        user_attrs.update(config=baseline.to_dict(), status="ok", accuracy_loss=0.0, role="reference", worker=_worker_id(),
                          throughput_spread=measurement.spread, accuracy_verdict=verdict.label,
                          accuracy_evidence=f"the fp32 reference run itself (seed {self.options.study.seed}): "
                                            f"{verdict.evidence}",
                          **self._identity)
        user_attrs.update(diagnosis_attrs(study, {**user_attrs, "number": len(study.trials), "state": "COMPLETE"}))
        study.add_trial(optuna.trial.create_trial(
            params=asked,
            distributions={k: distributions[k] for k in asked},
            values=[measurement.throughput, 0.0],
            user_attrs=user_attrs,
            system_attrs={"constraints:failure": 0.0, "constraints:accuracy": verdict.constraint},
        ))

    def _sampler(self, space: Optional[_space.SearchSpace] = None) -> optuna.samplers.BaseSampler:
        """The user's sampler, else GuidedSampler over the space (a placeholder until the space is known)."""
        seed = self.options.study.seed
        if self.options.search.sampler is not None:
            return self.options.search.sampler
        if space is None:
            return optuna.samplers.RandomSampler(seed=seed)
        return GuidedSampler(
            search_space=space.distributions(),
            priors=None if self._caps.cuda else CPU_PRIORS,
            canonical=space.asked_params,
            seed=None if self.options.study.mode == "join" else seed + self._resumed_trials,
        )

    # -- the run ---------------------------------------------------------------------------------
    def run(self) -> Result:
        """Run the study to its trial budget and return what it found.

        Nothing is created in the storage until the space validates, the target imports and the fp32
        reference has run, so bad input leaves no half-made study behind.
        """
        started = time.monotonic()
        opts = self.options
        caps = self._caps = opts.search.capabilities or _hardware.probe(target=self.target)
        storage, storage_label = open_storage(opts.study.storage, opts.study.studies_dir,
                                              grace_period=opts.study.grace_period)
        self._identity = _device_identity(caps)
        mode = opts.study.mode
        if mode == "join":
            study = self._join(storage)
            space = _space.parse_space(study.user_attrs["space"], where=f"study {self.study_name}", name=self.study_name)
            space = _space.restrict_to(space, caps)
            self._adopt_study_settings(study)
            opts = self.options
        else:
            space = _space.restrict_to(self._load_space(caps), caps)
            space = self._stored_compile_plan(storage, space)
            study = self._load_existing(storage, space)
        studies_dir = opts.study.studies_dir
        runner = TrialRunner(target=self.target, logdir=study_dir(self.study_name, studies_dir) / "logs",
                             baseline=space.baseline, budget=space.budget, timeout=opts.trial.trial_timeout,
                             memory_limit_gib=opts.trial.memory_limit_gib,
                             compile_timeout=opts.trial.compile_deadline)
        references = self._references = References(options=opts.accuracy, runner=runner, seed=opts.study.seed)
        with _Progress(opts.study.progress, opts.search.n_trials) as ui:
            if study is None or "reference_metrics" not in study.user_attrs:
                with self._reference_lock(runner, ui) as locked:
                    if locked and mode != "join":  # another process may have made the study while this one waited
                        space = self._stored_compile_plan(storage, space)
                        study = self._load_existing(storage, space)
                    if study is None or "reference_metrics" not in study.user_attrs:
                        reference = references.baseline(ui)
                        if study is None:
                            # After the reference: a length in steps is converted at its measured rate.
                            space = self._plan_compiles(space, reference)
                            study = self._create(storage, space, caps, reference)
                        else:
                            for key, value in reference.items():
                                study.set_user_attr(key, value)
                        blind = references.blind_reasons(study)
                        # "reasons" lists every blind part; "blind" is true only when no part can vouch.
                        study.set_user_attr("accuracy_check",
                                            {"blind": references.is_blind(study), "reasons": blind})
            if mode == "create":
                return summarize_study(study, storage_url=storage_label)
            study.sampler = self._sampler(space)
            self._warn_if_shared(study, caps)
            start_trial_server()
            TrialLoop(study=study, space=space, storage=storage, runner=runner, references=references,
                      n_trials=opts.search.n_trials, timeout=opts.search.timeout, started=started,
                      prune_below=opts.search.prune_below, seed=opts.study.seed, identity=self._identity).run(ui)
            # In every mode that runs trials: when several workers share the study, the last to finish
            # claims it (see confirm_top_k), so it runs once per study, after the trial budget is spent.
            confirm_top_k(study, runner, opts.confirm, seed=opts.study.seed, ui=ui, worker=_worker_id())
            if opts.confirm.confirm_samples:
                confirm_long(study, runner, opts.confirm, seed=opts.study.seed,
                             metric_direction=opts.accuracy.metric_direction, ui=ui)
        from autotune.insight._report import annotate_study  # diagnoses, dashboard note, plots; never raises

        annotate_study(study, studies_dir=studies_dir)
        result = summarize_study(study, storage_url=storage_label)
        path = write_best_config(study, result, studies_dir)
        return _with_path(result, path)

    @contextlib.contextmanager
    def _reference_lock(self, runner: TrialRunner, ui: _Progress) -> Iterator[bool]:
        """One process of this host at a time runs a study's reference (they would share its log folders).

        Yields whether the lock was taken (then the study is read again: the holder may have created it).
        """
        def waiting() -> None:
            ui.status("waiting for another process to run this study's reference")

        # Beside logs/, not in it: logs/ holds one folder per run.
        with file_lock(runner.logdir.parent / ".reference.lock", on_wait=waiting) as locked:
            yield locked

    def _warn_if_shared(self, study: optuna.Study, caps: _hardware.Capabilities) -> None:
        """One warning line (and the study attribute) when live workers on this host share a device or cores."""
        line = register_worker(study, caps, self._identity)
        if line and study.user_attrs.get(COLOCATION) != line:  # a worker that sees the same says it once
            study.set_user_attr(COLOCATION, line)
            print(f"autotune: warning: {line}", file=sys.stderr, flush=True)


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
