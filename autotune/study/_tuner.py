"""The coordinator: creates, resumes or joins the study, then hands it to its parts.

The parts, one job each: ``References`` (the fp32 reference runs and the accuracy check),
``TrialLoop`` (ask, run, judge, tell) and the confirmation (``_confirm``). It never runs user code
itself: every run of ``train_fn`` happens in a trial process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import socket
import sys
import time
import warnings
from typing import Any, Callable, Iterator, Optional, Union

import optuna

from autotune import hardware as _hardware
from autotune._config import TORCH_LOADER_KNOBS, Measurement, Result, TrialConfig, script_baseline_differences
from autotune._errors import AutotuneError, SpaceError, StudyError
from autotune._records import BASELINE_SPEED_PENDING, COLOCATION, EARLIER_BASELINE, study_dir, summarize_study
from autotune._target import local_modules, target_digest, target_file, target_of
from autotune.search import _compile, _space
from autotune.hardware._mps import MpsSession, open_mps
from autotune.search._sampler import GuidedSampler
from autotune.study._budget import StudyClock
from autotune.study._confirm import confirm_long
from autotune.study._isolation import probe_in_trial_server, start_trial_server
from autotune.study._locks import file_lock
from autotune.study._loop import TrialLoop, diagnosis_attrs, measurement_attrs
from autotune.study._options import TunerOptions
from autotune.study._planner import FIRST_FASTER, PLAN, probes_why, seeds_first, step_levers
from autotune.study._progress import _Progress
from autotune.study._references import TRIAL_BUDGET, References, apply_trial_budget
from autotune.study._stored import load_references, reference_key, store_references
from autotune.study._results import _with_path, write_best_config
from autotune.study._runner import TrialRunner
from autotune.study._storage import check_scheme, mask_url, open_storage, study_exists
from autotune.study._workers import _device_identity, _worker_alive, _worker_id, register_worker

METRIC_NAMES = ["throughput", "accuracy_loss"]
# Study attributes that bracket its creation: "creating" (who, when) is written first, right after the
# study row; CREATION_DONE last, after every attribute and trial 0. A study with the first and not the
# last was left half-made (a full disk, a killed process): it is finished from the current options when
# it has no trials yet, else refused.
CREATING = "creating"
CREATION_DONE = "creation_done"
CREATION_WAIT_SECONDS = 120.0
SCRIPT_BATCH = "script_batch_adopted"  # the global batch adopted from the script's ctx.loader(batch_size=)
SCRIPT_BASELINE = "script_baseline_adopted"  # the knobs adopted from the script's own arguments (an adapter's)
TARGET_MODULES = "target_modules_sha256"  # of the user's modules the target imports: path -> sha256
TARGET_DIGEST = "target_sha256"  # of the target's source file when the study was created  # how long a live creator on this host is waited for
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
        name = self.options.study.study_name
        self.study_name = self.target.rpartition(":")[2] if name is None else name  # "" is refused, not defaulted
        study_dir(self.study_name, self.options.study.studies_dir)  # refuses a name that is no folder name
        self._resumed_trials = 0  # a resumed study reseeds its sampler, so it does not replay old proposals
        self._compile_plan: Optional[_compile.CompilePlan] = None
        self._baseline_source = ""  # where the baseline came from: the space's YAML, or baseline= (--baseline)
        self._script_knobs: dict[str, Any] = {}  # the baseline's knobs adopted from the script's own arguments
        self._batch_source = ""  # where the global batch came from: --batch-size, --baseline, the space, the script
        # References short of the seeds the loop runs after the first full trial: kept for reuse once whole.
        self._unstored_reference: Optional[dict[str, Any]] = None

    # -- setup -----------------------------------------------------------------------------------
    def _load_space(self, caps: Optional[_hardware.Capabilities]) -> _space.SearchSpace:
        space, defaults = self.options.search.space, self.options.search.default_spaces
        if not isinstance(space, _space.SearchSpace):
            space = _space.load_space(space if space is not None else defaults[1] if caps and caps.cuda else defaults[0])
        self._baseline_source = f"the space {space.name}"
        if self.options.search.processes_per_trial is not None:
            space = space.with_processes(self.options.search.processes_per_trial)
        stated = self._stated_baseline()
        if stated:
            space = space.with_baseline(stated)
            self._baseline_source = (f"--baseline {_space.format_baseline(stated)}, the other knobs from the space "
                                     f"{space.name}")
        policy = self.options.search.batch_policy
        if policy is None and self.options.accuracy.accuracy_reference == "batch":
            policy = "scale"  # the per-batch-size reference is what the scale policy does
        space = space.with_batch_policy(policy) if policy else space
        batch = self.options.search.batch_size
        if batch is not None and self._batch_settled(space) is None:
            return self._with_global_batch(space, batch, f"--batch-size {batch} (batch_size=)")
        self._batch_source = self._batch_settled(space) or f"the space {space.name}'s baseline"
        return space

    def _batch_settled(self, space: _space.SearchSpace) -> Optional[str]:
        """Who fixed the global batch before the script could say: ``--baseline batch_size=`` or the space's
        ``global_batch``; None when neither did."""
        if "batch_size" in self._stated_baseline():
            return f"--baseline batch_size={self._stated_baseline()['batch_size']}"
        if space.batch_policy == "fixed" and space.global_batch_stated:
            return f"global_batch: {space.global_batch} of the space {space.name}"
        return None

    def _with_global_batch(self, space: _space.SearchSpace, batch: int, source: str) -> _space.SearchSpace:
        """The space with ``batch`` as its baseline's global batch (and the study's, under ``fixed``).

        Raises:
            SpaceError: ``batch`` does not split evenly over the trial's ranks, or the space refuses it.
        """
        ranks = space.processes_per_trial
        if batch % ranks:
            raise SpaceError(f"{source}: the global batch {batch} does not split over {ranks} ranks per trial")
        self._batch_source = source
        return space.with_baseline({"batch_size": batch // ranks}, where=source)

    def _adopt_script_batch(self, space: _space.SearchSpace, reference: dict[str, Any]) -> Optional[_space.SearchSpace]:
        """The space at the batch the script passed to ``ctx.loader`` in the reference run, when nothing
        stated the global batch and it differs from the baseline's; else None (a stated one that differs
        is noted in the batch's source)."""
        script = _script_batch(reference)
        if script is None or script == space.baseline.global_batch_size:
            return None
        if self.options.search.batch_size is not None or self._batch_settled(space) is not None:
            self._batch_source += f" (the script's ctx.loader says batch_size={script}: the stated one is kept)"
            return None
        return self._with_global_batch(space, script, f"the script's ctx.loader(batch_size={script})")

    def _script_baseline(self, space: _space.SearchSpace,
                         reference: dict[str, Any]) -> Optional[tuple[_space.SearchSpace, bool]]:
        """The space whose baseline is what the script's own arguments train with (an adapter's trial records
        them as ``script_baseline``: a Trainer's ``TrainingArguments``), and whether the references must run
        again at it; None where they agree, nothing was recorded, or a baseline was stated (``--baseline``,
        the adapter's ``tune(args=...)``). So the route from the shell measures the baseline that the Python
        route states. The precision stays fp32 (the references are fp32), and the batch the space's: an
        adapter refuses a global batch other than its arguments' in one line naming ``--baseline``."""
        extras = (reference.get("reference_measurement") or {}).get("extras") or {}
        arguments, loader = extras.get("script_baseline"), extras.get("script_loader")
        arguments = arguments if isinstance(arguments, dict) else {}
        # The DataLoader the script passes to ctx.loader: what it loads with (an adapter's arguments win).
        declared = {**(loader if isinstance(loader, dict) else {}), **arguments}
        if not declared or self._stated_baseline():
            return None
        declared = {k: v for k, v in declared.items() if k not in ("precision", "batch_size")}
        differ = script_baseline_differences(declared, space.baseline)
        if not differ:
            return None
        where = "the script's own arguments" if set(differ) & set(arguments) else "the script's DataLoader"
        try:
            adopted = space.with_baseline(differ, where=where)
        except SpaceError as exc:
            print(f"autotune: warning: {exc}; the space's baseline is kept", file=sys.stderr, flush=True)
            return None
        self._script_knobs = differ
        self._baseline_source = f"{where} ({_space.format_baseline(differ)}), the other knobs from {self._baseline_source}"
        ran = TrialConfig.from_dict(reference["baseline_config"])  # reused references may have run at it already
        # The DataLoader's knobs change no step of ctx.loader's seeded order: the references stand, and the
        # baseline's speed is timed apart (References.rebase). An adapter's arguments run them again.
        reruns = set(script_baseline_differences(differ, ran)) - (set(TORCH_LOADER_KNOBS) - set(arguments))
        return adopted, bool(reruns)

    def _stored_script_baseline(self, storage: Any, space: _space.SearchSpace) -> _space.SearchSpace:
        """A resumed study keeps the baseline its reference adopted from the script's own arguments."""
        if not study_exists(storage, self.study_name) or self._stated_baseline():
            return space
        adopted = optuna.load_study(study_name=self.study_name, storage=storage).user_attrs.get(SCRIPT_BASELINE)
        if not isinstance(adopted, dict) or not adopted:
            return space
        return space.with_baseline(adopted, where="the script's own arguments")

    def _stored_script_batch(self, storage: Any, space: _space.SearchSpace) -> _space.SearchSpace:
        """A resumed study keeps the batch its reference adopted from the script."""
        if not study_exists(storage, self.study_name):
            return space
        adopted = optuna.load_study(study_name=self.study_name, storage=storage).user_attrs.get(SCRIPT_BATCH)
        if not isinstance(adopted, int) or self.options.search.batch_size is not None or self._batch_settled(space):
            return space
        return self._with_global_batch(space, adopted, f"the script's ctx.loader(batch_size={adopted})")

    def _stated_baseline(self) -> dict[str, Any]:
        """The baseline knobs the user stated (``baseline=``), checked; empty when none.

        Raises:
            SpaceError: an unknown knob or a value it cannot take.
        """
        stated = self.options.search.baseline
        if stated is None:
            return {}
        return _space.parse_baseline(stated) if isinstance(stated, str) else _space.check_baseline(stated)

    def _check_stated_baseline(self, space: _space.SearchSpace) -> None:
        """The probe may replace a baseline value that cannot run here; a stated one is refused instead."""
        for knob, value in self._stated_baseline().items():
            if getattr(space.baseline, knob) != value:
                key = _space.format_baseline({knob: value})
                why = space.removed.get(key, "not a value of this space")
                raise SpaceError(f"--baseline {key}: cannot run here ({why})")

    def _load_existing(self, storage: Any, space: _space.SearchSpace) -> Optional[optuna.Study]:
        """The study if it exists, after checking that it was made with this space and target."""
        if not study_exists(storage, self.study_name):
            return None
        study = self._wait_for_creation(storage)
        if not _creation_done(study):
            measured = [t.number for t in study.trials if t.user_attrs.get("role") != "reference"]
            if measured:
                raise StudyError(
                    f"study {self.study_name!r} was left half-made (its creation was interrupted) and has "
                    f"{len(measured)} trials since; delete it (optuna delete-study --study-name {self.study_name} "
                    "--storage URL) or use a new --study name"
                )
            return study  # half-made, with no trials: run() finishes it from the current options
        self._resumed_trials = len(study.trials)
        study = optuna.load_study(study_name=self.study_name, storage=storage, sampler=self._sampler())
        old = study.user_attrs.get("space")
        if old is not None and study.user_attrs.get("space_fingerprint") != space.fingerprint:
            changed = _space.describe_changes(old, space.to_dict()) or ["the definition"]
            raise StudyError(
                f"study {self.study_name!r} was created with another search space "
                f"(changed: {', '.join(changed)}); use a new --study name or the original space"
            )
        self._check_stored_rules(study)
        return study

    def _check_stored_rules(self, study: optuna.Study) -> None:
        """Refuse to resume a study made for another target or judged by other accuracy rules.

        Raises:
            StudyError: the target, ``--metric-direction`` or ``--max-accuracy-loss`` differ from the study's.
        """
        if study.user_attrs.get("space") is not None and study.user_attrs.get("target") not in (None, self.target):
            raise StudyError(
                f"study {self.study_name!r} tunes {study.user_attrs['target']}, not {self.target}; "
                "use a new --study name"
            )
        accuracy = self.options.accuracy
        for key, flag in (("metric_direction", "--metric-direction"), ("max_accuracy_loss", "--max-accuracy-loss")):
            stored, asked = study.user_attrs.get(key), getattr(accuracy, key)
            if stored is not None and stored != asked:
                # One study judged by two rules would mix feasible sets (a loss read as a gain, two bounds).
                raise StudyError(
                    f"study {self.study_name!r} was created with {flag} {stored}, not {asked}; resume it with "
                    f"{flag} {stored} or use a new --study name"
                )

    def _refuse_changed_rules_early(self) -> None:
        """``_check_stored_rules`` for a study that exists already, before the probe: a resume that would be
        refused is refused in a second, not after the trial server has started. Creates nothing."""
        opts = self.options
        if opts.study.storage:
            check_scheme(opts.study.storage)  # a storage no scheme here opens: one line before anything starts
        if opts.study.mode == "join":
            return
        try:
            storage, _ = open_storage(opts.study.storage, opts.study.studies_dir, create=False)
        except StudyError:
            return  # nothing stored yet, or a storage the regular open reports on
        if study_exists(storage, self.study_name):
            study = optuna.load_study(study_name=self.study_name, storage=storage)
            if _creation_done(study):
                self._check_stored_rules(study)

    def _warn_if_target_changed(self, study: optuna.Study) -> None:
        """One warning line when the target's source file differs from the one the study was created with."""
        stored, now = study.user_attrs.get(TARGET_DIGEST), target_digest(self.target)
        if stored and now and stored != now:
            print(f"autotune: warning: {target_file(self.target)} changed since study {self.study_name!r} was "
                  f"created (sha256 {stored[:12]} -> {now[:12]}): trials before and after measure different "
                  "code; use a new --study name to compare like with like", file=sys.stderr, flush=True)
        before = study.user_attrs.get(TARGET_MODULES)
        if isinstance(before, dict):
            after = local_modules(self.target)
            changed = sorted(name for name in set(before) | set(after) if before.get(name) != after.get(name))
            if changed:
                print(f"autotune: warning: module{'s' if len(changed) > 1 else ''} {', '.join(changed)} that "
                      f"{target_file(self.target)} imports changed since study {self.study_name!r} was created: "
                      "trials before and after measure different code; use a new --study name to compare like "
                      "with like", file=sys.stderr, flush=True)

    def _join(self, storage: Any) -> optuna.Study:
        if not study_exists(storage, self.study_name):
            raise StudyError(
                f"no study {self.study_name!r} to join; create it with `autotune tune ... --create-only` "
                "or start the first worker with `autotune tune`"
            )
        study = self._wait_for_creation(storage)
        if not _creation_done(study):
            raise StudyError(
                f"study {self.study_name!r} was left half-made (its creation was interrupted); finish it with "
                "`autotune tune ... --create-only` and the same --study and --storage"
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

    def _wait_for_creation(self, storage: Any) -> optuna.Study:
        """The study, once whoever is creating it has finished (or is found gone).

        A creator on this host is waited for while its process lives; one on another host for
        ``CREATION_WAIT_SECONDS`` after it began. Returns the study as it then is: complete, or half-made.
        """
        deadline = time.monotonic() + CREATION_WAIT_SECONDS
        while True:
            study = optuna.load_study(study_name=self.study_name, storage=storage)
            if _creation_done(study) or not _creator_busy(study.user_attrs.get(CREATING)):
                return study
            if time.monotonic() > deadline:
                return study
            time.sleep(0.5)

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
            # Another worker created it while this one ran the reference: join it once it is complete.
            study = self._wait_for_creation(storage)
            if _creation_done(study) or study.trials:
                return optuna.load_study(study_name=self.study_name, storage=storage, sampler=self._sampler())
        else:
            study.set_user_attr(CREATING, {"worker": _worker_id(), "started": time.time()})
        return self._finish_creation(study, space, caps, reference)

    def _finish_creation(self, study: optuna.Study, space: _space.SearchSpace, caps: _hardware.Capabilities,
                         reference: dict[str, Any]) -> optuna.Study:
        """Write a new (or half-made, trial-less) study's attributes and trial 0, then mark it done."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study.set_metric_names(METRIC_NAMES)
        accuracy = self.options.accuracy
        attrs = {
            "target": self.target,
            # The script's own arguments its trials ran with (the Python caller's own without script_args):
            # autotune train --study gives them to the real run.
            "script_args": list(self.options.trial.script_args) if self.options.trial.script_args is not None
            else sys.argv[1:],
            TARGET_DIGEST: target_digest(self.target),
            TARGET_MODULES: local_modules(self.target),
            "space_name": space.name,
            "baseline_source": f"{self._baseline_source}; the global batch from {self._batch_source}",
            "global_batch_source": self._batch_source,
            SCRIPT_BATCH: space.baseline.global_batch_size if self._batch_source.startswith("the script's") else None,
            SCRIPT_BASELINE: self._script_knobs or None,
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
        if not study.trials:  # a half-made study may have got as far as trial 0
            self._add_baseline_trial(study, space, reference)
        blind = self._references.blind_reasons(study)
        # "reasons" lists every blind part; "blind" is true only when no part can vouch.
        study.set_user_attr("accuracy_check", {"blind": self._references.is_blind(study), "reasons": blind})
        study.set_user_attr(CREATION_DONE, True)  # last: a study without it is half-made
        return study

    def _seeds_first(self, space: _space.SearchSpace) -> int:
        """The fp32 reference seeds that run before the study's first full trial (``_planner.seeds_first``):
        all of them where this run only creates the study, for the workers that join it."""
        repeats = self.options.accuracy.reference_repeats
        if self.options.study.mode == "create":
            return repeats
        return seeds_first(budgeted=self._clock.budgeted, repeats=repeats,
                           step_levers=step_levers({k: v.values for k, v in space.knobs.items()}))

    def _may_adopt_script_batch(self, space: _space.SearchSpace) -> bool:
        """Whether the script's ``ctx.loader(batch_size=)`` may set the baseline's batch (nothing stated it)."""
        return (self.options.study.mode != "join" and self.options.search.batch_size is None
                and self._batch_settled(space) is None)

    def _reference_loader(self, space: _space.SearchSpace, caps: _hardware.Capabilities) -> dict[str, Any]:
        """The DataLoader knobs the fp32 references run with (``AccuracyOptions.reference_loader``): the prior
        point's, or none (the baseline's)."""
        choice = self.options.accuracy.reference_loader
        if choice == "baseline" or (choice == "auto" and not caps.cuda):
            return {}
        prior = GuidedSampler(search_space=space.distributions(), priors=None if caps.cuda else CPU_PRIORS,
                              canonical=space.asked_params).prior_point()
        return {k: prior[k] for k in TORCH_LOADER_KNOBS if k in prior}

    def _reference_key(self, space: _space.SearchSpace, caps: _hardware.Capabilities) -> Optional[str]:
        """What determines the fp32 references, hashed (``_stored.reference_key``); None when the target's
        source cannot be read (then nothing is reused)."""
        loader = self._reference_loader(space, caps)
        return reference_key(target=self.target, baseline={**space.baseline.replace(precision="fp32").to_dict(),
                                                           **({"reference_loader": loader} if loader else {})},
                             budget=space.budget, seed=self.options.study.seed,
                             repeats=self.options.accuracy.reference_repeats,
                             adopt_script_batch=self._may_adopt_script_batch(space), caps=caps,
                             script_args=self.options.trial.script_args)

    def _stored_references(self, space: _space.SearchSpace, caps: _hardware.Capabilities, references: References,
                           ui: _Progress) -> Optional[dict[str, Any]]:
        """The fp32 references of an earlier study of the same target where nothing they depend on changed
        (``_stored``), with the length they trained; None when they must run (``--fresh-references`` too)."""
        key = self._reference_cache_key = self._reference_key(space, caps)
        stored = None
        if key is not None and not self.options.accuracy.fresh_references:
            stored = load_references(self.options.study.studies_dir, key)
        self._references_reused = stored[1] if stored is not None else None
        if stored is None:
            return None
        reference, origin = stored
        references.runner.budget = apply_trial_budget(references.runner.budget, reference.get(TRIAL_BUDGET))
        ui.say(f"  fp32 references reused from study {origin['study']!r} ({origin['created']}): the same target, "
               "modules, baseline, length, seeds, torch and device (--fresh-references runs them again)")
        return {**reference, "reference_seconds": 0.0, "references_reused": origin}

    def _store_references(self, reference: dict[str, Any]) -> None:
        """Keep the references for a later study of the same target (never fails the study)."""
        key = getattr(self, "_reference_cache_key", None)
        if key is None or reference.get("references_reused"):
            return
        if self._references.missing_seeds(reference):
            self._unstored_reference = reference
            return
        try:
            store_references(self.options.study.studies_dir, key, reference, study=self.study_name)
        except OSError as exc:
            print(f"autotune: warning: the references were not kept for reuse: {exc}", file=sys.stderr, flush=True)

    def _store_completed_references(self, study: optuna.Study) -> None:
        """References whose seeds after the first ran in the loop (``_planner.seeds_first``) are kept for a
        later study once the study holds them all, as the study now records them (never fails the study)."""
        reference = self._unstored_reference
        if reference is None or self._references.missing_seeds(study.user_attrs):
            return
        attrs = study.user_attrs
        self._unstored_reference = None
        self._store_references({**reference, **{k: attrs[k] for k in reference if k in attrs},
                                **({"baseline_speed": attrs["baseline_speed"]} if "baseline_speed" in attrs else {})})

    def _store_baseline_speed(self, study: optuna.Study) -> None:
        """The baseline's speed run that came after the first trial joins the stored references it belongs to,
        so a later study that reuses them runs none (never fails the study)."""
        key, attrs = getattr(self, "_reference_cache_key", None), study.user_attrs
        if key is None or attrs.get(BASELINE_SPEED_PENDING) is not False or "baseline_speed" not in attrs:
            return
        stored = load_references(self.options.study.studies_dir, key)
        if stored is None or not stored[0].get(BASELINE_SPEED_PENDING):
            return
        reference = {**stored[0], "baseline_speed": attrs["baseline_speed"], BASELINE_SPEED_PENDING: False,
                     "baseline_throughput": attrs["baseline_throughput"]}
        try:
            store_references(self.options.study.studies_dir, key, reference, study=stored[1]["study"])
        except OSError as exc:
            print(f"autotune: warning: the baseline's speed was not kept with the references: {exc}", file=sys.stderr,
                  flush=True)

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

    @staticmethod
    def _show_reference(study: optuna.Study, reference: dict[str, Any], ui: _Progress) -> None:
        """The reference run's line: trial 0 when the baseline is a point of the space, else unnumbered."""
        first = next((t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("role") == "reference"), None)
        baseline = TrialConfig.from_dict(study.user_attrs["baseline_config"])
        if first is not None:
            ui.end_trial(first, baseline)
            return
        ran = TrialConfig.from_dict(_reference_config(reference))
        rate = Measurement.from_dict(reference["reference_measurement"]).throughput
        what = (": the baseline, not a point of the space" if ran == baseline
                else f", as it ran; the baseline is {baseline.describe()}, its own speed timed apart; the baseline is "
                     "not a point of the space")
        ui.say(f"  {'-':<4} {'ref':<7} {rate:>10,.1f}/s  {ran.describe()}  [the fp32 reference run{what}]")

    def _stored_model_restriction(self, storage: Any, space: _space.SearchSpace) -> _space.SearchSpace:
        """A resumed study keeps what its reference run showed about the model (e.g. no 4-D activations)."""
        if not study_exists(storage, self.study_name):
            return space
        attrs = optuna.load_study(study_name=self.study_name, storage=storage).user_attrs
        # fp8 and compile_scope are newer than the records they read: a study whose space has them removed them
        # at creation exactly when this removes them again, and the predicted gain is no part of the stored space.
        space = _space.restrict_to_model(space, activations_4d=None, linear_layers=_linear_layers(attrs),
                                         repeated_blocks=_repeated_blocks(attrs))
        removed = attrs.get("removed_knobs") or {}
        if "channels_last=true" not in removed and "loader=device" not in removed and not _augment_facts(attrs):
            return space  # created before these rules, or nothing was removed for the model or its data
        return _space.restrict_to_model(space, activations_4d=_activations_4d(attrs),
                                        device_loader=_device_loader(attrs), **_augment_facts(attrs))

    def _add_baseline_trial(self, study: optuna.Study, space: _space.SearchSpace, reference: dict[str, Any]) -> None:
        """Record the first reference run as trial 0, so the untuned config competes like any other.

        Skipped when the baseline is not a point of the space (a value outside a knob's choices, or a
        fixed knob set otherwise), because the sampler could not place it among the other trials.
        """
        baseline = TrialConfig.from_dict(_reference_config(reference))
        asker = _BaselineAsker(baseline)
        if space.sample(asker) != baseline or asker.outside:
            return  # not a point of the space: the sampler could not place it
        distributions = space.distributions()
        asked = asker.params
        measurement = Measurement.from_dict(reference["reference_measurement"])
        user_attrs = measurement_attrs(measurement)
        verdict = self._references.judge(study, baseline, measurement)
        if reference.get("reference_wall_seconds"):
            user_attrs["wall_seconds"] = reference["reference_wall_seconds"]  # what a run of it costs (the race)
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
            cannot_run=space.cannot_run if space.combinations else None,
            seed=None if self.options.study.mode == "join" else seed + self._resumed_trials,
            whole_batch=space.global_batch // space.processes_per_trial if space.batch_policy == "fixed" else None,
            value_gains=space.predicted_gains,
        )

    # -- the run ---------------------------------------------------------------------------------
    def run(self) -> Result:
        """Run the study to its trial budget and return what it found.

        Nothing is created in the storage until the space validates, the target imports and the fp32
        reference has run, so bad input leaves no half-made study behind.
        """
        with contextlib.ExitStack() as cleanup:  # a daemon the study starts stops with it (Ctrl-C and errors too)
            return self._run(cleanup)

    def _open_mps(self, space: _space.SearchSpace, cleanup: contextlib.ExitStack
                  ) -> tuple[_space.SearchSpace, Optional[MpsSession]]:
        """The study's MPS session when the space measures ``mps=true``; where MPS cannot start, the space
        without ``mps=true`` (the reason recorded and said once), so co-location is measured time-sliced."""
        knob = space.knobs.get("mps")
        if knob is None or True not in knob.values:
            return space, None
        folder = study_dir(self.study_name, self.options.study.studies_dir).resolve()
        session, daemon = open_mps(self.options.study.mps, study_dir=folder)
        if daemon is not None:
            cleanup.callback(daemon.stop)
        if not session.available:
            why = f"MPS is not available ({session.reason}): co-located copies run time-sliced"
            print(f"autotune: {why}", file=sys.stderr, flush=True)
            return space.without("mps", True, why), None
        return space, session

    def _set_up(self, cleanup: contextlib.ExitStack) -> _Setup:
        """The study's setup: its clock, the machine probed (unless the options state its capabilities), the
        storage open, the space restricted to the machine (with its MPS session where it measures ``mps=true``),
        the trial runner and its fp32 references, and the study where it exists already (joined or resumed)."""
        started = time.monotonic()
        # This run's start: a race recorded before it is an earlier run's, raced again (``_confirm.race_due``). A
        # joining worker shares a run with the others, whose trials and race it cannot tell apart: it keeps none.
        since = (self.options.study.began or time.time()) if self.options.study.mode != "join" else None
        opts = self.options
        minutes = opts.search.budget_minutes
        clock = self._clock = StudyClock(budget_seconds=minutes * 60 if minutes else None, started=started)
        given: Optional[_space.SearchSpace] = None
        with clock.part("setup"):
            if opts.search.capabilities is None:
                self._refuse_changed_rules_early()
            if opts.study.mode != "join" and opts.search.space is not None:
                # Read before the probe: a malformed space, batch policy or stated baseline is one line in a
                # second, not after the trial server's torch import (a given space reads no capability).
                given = self._load_space(None)
        with clock.part("probe"):
            caps = self._caps = opts.search.capabilities or probe_in_trial_server(self.target,
                                                                                  script_args=opts.trial.script_args)
        setup_began = time.monotonic()
        storage, storage_label = open_storage(opts.study.storage, opts.study.studies_dir,
                                              grace_period=opts.study.grace_period)
        self._identity = _device_identity(caps)
        mode = opts.study.mode
        if mode == "join":
            study = self._join(storage)
            space = _space.parse_space(study.user_attrs["space"], where=f"study {self.study_name}", name=self.study_name)
            space = self._stored_model_restriction(storage, _space.restrict_to(space, caps))  # as its creator's
            space, mps = self._open_mps(space, cleanup)
            self._adopt_study_settings(study)
            opts = self.options
        else:
            space = _space.restrict_to(given if given is not None else self._load_space(caps), caps)
            if clock.budget_seconds is None and space.study_minutes:
                clock.budget_seconds = space.study_minutes * 60  # the space's default (the demo's)
            space, mps = self._open_mps(space, cleanup)
            self._check_stated_baseline(space)
            space = self._stored_script_batch(storage, space)
            space = self._stored_script_baseline(storage, space)
            space = self._stored_compile_plan(storage, space)
            space = self._stored_model_restriction(storage, space)
            study = self._load_existing(storage, space)
        studies_dir = opts.study.studies_dir
        runner = TrialRunner(target=self.target, logdir=study_dir(self.study_name, studies_dir) / "logs",
                             baseline=space.baseline, budget=space.budget, timeout=opts.trial.trial_timeout,
                             memory_limit_gib=opts.trial.memory_limit_gib,
                             compile_timeout=opts.trial.compile_deadline, mps=mps, script_args=opts.trial.script_args)
        if study is not None:  # a resume or a joining worker trains the length its references trained
            runner.budget = apply_trial_budget(runner.budget, study.user_attrs.get(TRIAL_BUDGET))
        references = self._references = References(options=opts.accuracy, runner=runner, seed=opts.study.seed,
                                                   clock=clock, loader=self._reference_loader(space, caps))
        # The trial server's start (a torch import: seconds) is setup, not the first reference run's wall time,
        # which the cost model reads as what a run of the baseline costs.
        start_trial_server()
        clock.add("setup", time.monotonic() - setup_began)
        return _Setup(started=started, since=since, options=opts, mode=mode, clock=clock, caps=caps,
                      storage=storage, storage_label=storage_label, space=space, runner=runner,
                      references=references, study=study)

    def _prepare_study(self, setup: _Setup, ui: _Progress) -> tuple[optuna.Study, _space.SearchSpace]:
        """The study ready for its trials and the space they search: where the study is new or half-made, the
        fp32 references run (or earlier ones are reused) and the study is created or finished from them."""
        clock, caps, runner, references = setup.clock, setup.caps, setup.runner, setup.references
        storage, storage_label, mode = setup.storage, setup.storage_label, setup.mode
        study, space = setup.study, setup.space
        if study is None or not _creation_done(study):
            with self._reference_lock(runner, ui) as locked:
                if locked and mode != "join":  # another process may have made the study while this one waited
                    space = self._stored_script_batch(storage, space)
                    space = self._stored_script_baseline(storage, space)
                    space = self._stored_compile_plan(storage, space)
                    space = self._stored_model_restriction(storage, space)
                    study = self._load_existing(storage, space)
                if study is None or not _creation_done(study):
                    with clock.part("setup"):  # reading a file: the split's references stay at 0 s
                        reference = self._stored_references(space, caps, references, ui)
                    with clock.part("references"):
                        if reference is None:
                            reference = references.baseline(
                                ui, adopt_script_batch=self._may_adopt_script_batch(space),
                                defer_speed=clock.budgeted, seeds=self._seeds_first(space))
                        adopted = self._adopt_script_batch(space, reference) if mode != "join" else None
                        if adopted is not None:  # the baseline is the script's batch
                            space = _space.restrict_to(adopted, caps)
                            runner.baseline = space.baseline
                            ran_at = TrialConfig.from_dict(reference["baseline_config"]).global_batch_size
                            if ran_at == space.baseline.global_batch_size:
                                ran = TrialConfig.from_dict(reference["baseline_config"])
                                if ran.batch_size == space.baseline.batch_size:  # the same run, as the space says it
                                    reference["baseline_config"] = references.fp32_baseline.to_dict()
                                ui.say(f"  the script trains at batch {ran_at} (ctx.loader): the baseline's "
                                       "batch, which its reference ran at")
                            else:  # the script read a length before ctx.loader: the batch could not change
                                ui.say(f"  the script trains at batch {space.baseline.global_batch_size} "
                                       "(ctx.loader): the baseline's batch; its reference runs again")
                                runner.budget = space.budget
                                reference = references.baseline(ui, defer_speed=clock.budgeted,
                                                                seeds=self._seeds_first(space))
                        declared = self._script_baseline(space, reference) if mode != "join" else None
                        if declared is not None:  # one baseline for one script, from the shell too
                            space, rerun = declared
                            runner.baseline = space.baseline
                            if rerun:
                                ui.say(f"  the script's own arguments train with {space.baseline.describe()}: the "
                                       "baseline; its fp32 references run again at it (--baseline states it "
                                       "before they run)")
                                runner.budget = space.budget
                                reference = references.baseline(ui, defer_speed=clock.budgeted,
                                                                seeds=self._seeds_first(space))
                            else:
                                reference = references.rebase(reference, ui, defer_speed=clock.budgeted)
                        self._store_references(reference)
                    # After the reference: a length in steps is converted at its measured rate, and the
                    # reference run shows which knobs cannot matter for this model.
                    space = self._plan_compiles(space, reference)
                    space = _space.restrict_to_model(space, activations_4d=_activations_4d(reference),
                                                     device_loader=_device_loader(reference),
                                                     **_augment_facts(reference),
                                                     linear_layers=_linear_layers(reference),
                                                     repeated_blocks=_repeated_blocks(reference))
                    with _storage_errors(storage_label, self.study_name), clock.part("setup"):
                        if study is None:
                            study = self._create(storage, space, caps, reference)
                        else:
                            study = self._finish_creation(study, space, caps, reference)
                    self._show_reference(study, reference, ui)
        return study, space

    def _run(self, cleanup: contextlib.ExitStack) -> Result:
        """Set the study up, run its trials and the race, then report what it found."""
        setup = self._set_up(cleanup)
        opts, clock, runner, storage_label = setup.options, setup.clock, setup.runner, setup.storage_label
        with _Progress(opts.study.progress, opts.search.n_trials, clock=clock) as ui:
            study, space = self._prepare_study(setup, ui)
            if setup.mode == "create":
                return summarize_study(study, storage_url=storage_label)
            with clock.part("setup"):
                study.sampler = self._sampler(space)
                self._warn_if_target_changed(study)
                self._warn_if_shared(study, setup.caps)
                start_trial_server()
            loop = TrialLoop(study=study, space=space, storage=setup.storage, runner=runner,
                             references=setup.references, n_trials=opts.search.n_trials, timeout=opts.search.timeout,
                             started=setup.started, prune_below=opts.search.prune_below, seed=opts.study.seed,
                             identity=self._identity, clock=clock, top_k=opts.confirm.top_k, confirm=opts.confirm,
                             since=setup.since)
            try:
                # The loop runs what the planner says, the race of the finalists last (in every mode that runs
                # trials: when several workers share the study, the last to finish claims it, see confirm_top_k).
                with clock.part("trials"):
                    loop.run(ui)
                raced = loop.raced
                study.set_user_attr(EARLIER_BASELINE, "" if raced else self._earlier_baseline(study, loop))
                self._store_completed_references(study)
                self._store_baseline_speed(study)
                with clock.part("race"):
                    if opts.confirm.confirm_samples:
                        if clock.budgeted:
                            ui.say("  --confirm-samples: not run under a budget (its length is not planned)")
                        else:
                            confirm_long(study, runner, opts.confirm, seed=opts.study.seed,
                                         metric_direction=opts.accuracy.metric_direction, ui=ui)
            except KeyboardInterrupt as exc:
                # Ctrl-C or SIGTERM: the best so far is written, marked unconfirmed, before the exit.
                self._write_unconfirmed(study, storage_label, loop, exc)
                raise
        with clock.part("report"):
            self._record_split(study, loop)  # for the study note, which the report writes (updated after it)
            from autotune.insight._report import annotate_study  # diagnoses, dashboard note, plots; never raises

            annotate_study(study, studies_dir=opts.study.studies_dir, plots=opts.study.plots)
            result = summarize_study(study, storage_url=storage_label)
        with clock.part("report"):
            why = "" if raced else self._why_unconfirmed(study, loop)
        self._record_split(study, loop)
        path = write_best_config(study, result, opts.study.studies_dir, unconfirmed=why)
        return _with_path(result, path)

    def _why_unconfirmed(self, study: optuna.Study, loop: TrialLoop) -> str:
        """Why no race confirmed the pick in this run ("" when an earlier run's race still stands)."""
        from autotune._records import CONFIRMATION

        confirmation = study.user_attrs.get(CONFIRMATION) or {}
        if confirmation and confirmation.get("winner") is not None:
            return ""
        return self._why_not_raced(study, loop)

    def _earlier_baseline(self, study: optuna.Study, loop: TrialLoop) -> str:
        """Why the speed-up of a run that raced nothing divides by baseline runs of an earlier run of the study
        ("" where it does not): the race recorded before this run began, or, with no race of the pick, the fp32
        references of an earlier run against a pick measured in this one. A speed-up is a ratio of runs measured
        side by side; the planner races them again on a resume (``_confirm.race_due``), and this says why not."""
        from autotune._records import CONFIRMATION, _best_record

        best = _best_record(study)
        if best is None:
            return ""
        confirmation = study.user_attrs.get(CONFIRMATION) or {}
        if confirmation.get("winner") is not None and int(confirmation["winner"]) == best.number:
            at = float(confirmation.get("at") or 0.0)
            what = "the race of an earlier run of this study"
        else:
            trials = study.get_trials(deepcopy=False)
            ended = [t.datetime_complete.timestamp() for t in trials
                     if t.user_attrs.get("role") == "reference" and t.datetime_complete is not None]
            mine = trials[best.number].datetime_start
            if loop.since is None or not ended or mine is None or mine.timestamp() < loop.since:
                return ""  # the pick and the baseline were measured in the same run
            at, what = max(ended), "the fp32 reference runs of an earlier run of this study"
        if loop.since is None or at >= loop.since:
            return ""
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(at)) if at else "before this one"
        return (f"the speed-up divides by the baseline's rate from {what} ({when}), not re-measured beside the "
                f"pick in this run: {self._why_not_raced(study, loop)}")

    def _why_not_raced(self, study: optuna.Study, loop: TrialLoop) -> str:
        """Why this run did not race the pick and the baseline."""
        from autotune.study._confirm import CLAIM, _entrants, _running_elsewhere

        if self.options.confirm.top_k < 1:
            return "--top-k 0: the pick and the baseline were not raced"
        entrants, _, signature = _entrants(study, self.options.confirm.top_k)
        if len(entrants) < 2:
            return "fewer than two feasible configs (the baseline counting as one) to race"
        claim = study.user_attrs.get(CLAIM) or {}
        if not claim.get("done") and claim.get("candidates") == signature \
                and claim.get("worker") not in (None, _worker_id()):
            holder = str(claim["worker"])
            if holder.startswith(f"{socket.gethostname()}:") and not _worker_alive(holder):
                return f"the race of these finalists was claimed by a process that is gone ({holder}); rerun to race"
            return f"another process ({holder}) holds the race of these finalists; it records the race"
        if _running_elsewhere(study):
            return "another process is still running a trial of this study; it races the finalists when it finishes"
        if loop.budget_note or self._clock.budgeted:
            return f"the budget left no time for the race ({max(0.0, self._clock.usable()):.0f} s left)"
        return "another worker holds the race"

    def _record_split(self, study: optuna.Study, loop: TrialLoop) -> None:
        """Store where this run's minutes went (study attribute ``time_split``; see ``_budget.time_split``)."""
        trials = study.get_trials(deepcopy=False)
        split = self._clock.split([trials[n].user_attrs for n in loop.ran if n < len(trials)])
        if loop.budget_note:
            split["budget_note"] = loop.budget_note
        reused = getattr(self, "_references_reused", None)
        if reused:  # this run's references came from an earlier study
            split["references_reused"] = reused
        attrs = study.user_attrs
        split["first_faster"] = attrs.get(FIRST_FASTER)
        if attrs.get("references_shortened"):
            split["references_shortened"] = attrs["references_shortened"]
        split["probes_why"] = probes_why(attrs.get(PLAN) or [], attrs.get("probes") or [])
        try:
            study.set_user_attr("time_split", split)
        except Exception as exc:  # the split must never cost the study its pick
            warnings.warn(f"the time split was not stored: {exc}", stacklevel=2)

    def _write_unconfirmed(self, study: Optional[optuna.Study], storage_label: str, loop: TrialLoop,
                           exc: BaseException) -> None:
        """On an interrupt after a finished trial: best_config.json with the best so far, marked unconfirmed."""
        from autotune._records import _best_record

        if study is None or _best_record(study) is None:
            return
        reason = getattr(exc, "reason", None) or type(exc).__name__
        try:
            self._record_split(study, loop)
            result = summarize_study(study, storage_url=storage_label)
            path = write_best_config(study, result, self.options.study.studies_dir,
                                     unconfirmed=f"interrupted by {reason} before the race confirmed it")
        except Exception as err:  # the interrupt is what the user asked for: it goes on, said once
            print(f"autotune: warning: the best so far was not written: {err}", file=sys.stderr, flush=True)
            return
        exc.best_config_path = str(path)  # type: ignore[attr-defined]

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


@dataclasses.dataclass(frozen=True)
class _Setup:
    """What a study's setup leaves for its run (``Tuner._set_up``); the study's creation and the run read it."""

    started: float  # time.monotonic() at the run's start: the clock's and the trial loop's
    since: Optional[float]  # this run's start for the race (time.time()); None for a joining worker
    options: TunerOptions  # as the setup left them: a joining worker adopts the study's
    mode: str
    clock: StudyClock
    caps: _hardware.Capabilities
    storage: Any
    storage_label: str
    space: _space.SearchSpace  # restricted to the machine, before the references say what the model rules out
    runner: TrialRunner  # it holds the MPS session, when the space measures mps=true
    references: References
    study: Optional[optuna.Study]  # a joined or resumed study (maybe half-made); None until created


def _script_batch(reference: dict[str, Any]) -> Optional[int]:
    """The global batch the script passed to ``ctx.loader`` in the reference run (None when it did not)."""
    value = ((reference.get("reference_measurement") or {}).get("extras") or {}).get("script_batch_size")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _activations_4d(reference: dict[str, Any]) -> Optional[bool]:
    """Whether the reference run's model has 4-D activations (None when it did not say)."""
    value = ((reference.get("reference_measurement") or {}).get("extras") or {}).get("activations_4d")
    return value if isinstance(value, bool) else None


def _linear_layers(reference: dict[str, Any]) -> Optional[list[list[int]]]:
    """The reference run's ``torch.nn.Linear`` shapes, ``[in, out, count]`` (None when it did not record them)."""
    value = ((reference.get("reference_measurement") or {}).get("extras") or {}).get("linear_layers")
    ok = isinstance(value, list) and all(isinstance(row, list) and len(row) == 3 and all(
        isinstance(x, int) and not isinstance(x, bool) for x in row) for row in value)
    return value if ok else None


def _repeated_blocks(reference: dict[str, Any]) -> Optional[list[str]]:
    """The reference run's groups of repeated blocks, described (None when it did not record them)."""
    value = ((reference.get("reference_measurement") or {}).get("extras") or {}).get("repeated_blocks")
    return value if isinstance(value, list) and all(isinstance(v, str) for v in value) else None


def _device_loader(reference: dict[str, Any]) -> Optional[str]:
    """What the reference run's ``ctx.loader`` found of ``loader=device`` for its dataset: "ok", why it cannot
    serve it (``NO_CTX_LOADER`` when the run built no ``ctx.loader``), or None when nothing was recorded."""
    extras = (reference.get("reference_measurement") or {}).get("extras") or {}
    value = extras.get("device_loader")
    if extras and not extras.get("loader_built"):
        return _space.NO_CTX_LOADER  # measured without ctx.loader: there is no dataset to serve
    return value if isinstance(value, str) else None


def _augment_facts(reference: dict[str, Any]) -> dict[str, str]:
    """What the reference run's ``ctx.loader`` found of ``augment=device`` (``device_augment``) and of keeping
    its items before their transforms on the device (``device_loader_augmented``): those it recorded."""
    extras = (reference.get("reference_measurement") or {}).get("extras") or {}
    return {k: extras[k] for k in ("device_augment", "device_loader_augmented") if isinstance(extras.get(k), str)}


def _creation_done(study: optuna.Study) -> bool:
    """Whether the study was completely created. Studies made before the marker existed count as
    complete when they hold the space and the reference (the last attributes those versions wrote)."""
    attrs = study.user_attrs
    if attrs.get(CREATION_DONE):
        return True
    return CREATING not in attrs and "space" in attrs and "reference_metrics" in attrs


def _creator_busy(creating: Any) -> bool:
    """Whether the process that began creating a study may still be at it."""
    if not isinstance(creating, dict):
        return False
    worker = str(creating.get("worker", ""))
    if worker.startswith(f"{socket.gethostname()}:"):
        return _worker_alive(worker)
    return time.time() - float(creating.get("started", 0.0)) < CREATION_WAIT_SECONDS


@contextlib.contextmanager
def _storage_errors(label: str, study_name: str) -> Iterator[None]:
    """A storage that fails while a study is being written (a full disk, a lost server): one line."""
    try:
        yield
    except AutotuneError:
        raise
    except Exception as exc:  # SQLAlchemy and the journal raise many types
        cause = getattr(exc, "orig", None) or exc.__cause__ or exc  # Optuna wraps the driver's error
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        raise StudyError(
            f"storage {label} failed while study {study_name!r} was being created ({mask_url(first)[:300]}); "
            "free the space or fix the server, then rerun the same command to finish it"
        ) from None


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


def _reference_config(reference: dict[str, Any]) -> dict[str, Any]:
    """The config the first fp32 reference ran: the baseline's, or with the references' own loader knobs."""
    return reference.get("reference_config") or reference["baseline_config"]
