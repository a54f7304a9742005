"""The trial loop: ask for a config, rule it out or run it, judge it, tell the study; until the budget is spent."""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import math
import socket
import sys
import time
import warnings
from typing import Any, Optional

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune._config import (DEVICE_AUGMENT_REFUSAL, DEVICE_LOADER_REFUSAL, Colocation, Measurement, TrialConfig,
                              TrialOutcome, TrialRecord)
from autotune._records import BATCH_REFERENCE, CANNOT_RUN, OVER_BUDGET, _best_record, _budget_trials, _feasible
from autotune._errors import StudyError
from autotune.search._rules import infeasible_reason
from autotune.search._space import SearchSpace
from autotune.search._cost import CostModel, samples_from_trials
from autotune.study._budget import StudyClock
from autotune.study._confirm import OUT_OF_REACH, confirm_top_k, one_round_seconds, race_seconds
from autotune.study._options import ConfirmOptions
from autotune.study._planner import (BASELINE_SPEED, EXTEND, FIRST_FASTER, PLAN, PROBE, RACE, REFERENCE,
                                     SHORT_EVIDENCE, STOP, Decision, StudyView, admit, first_faster, next_action,
                                     seeds_first, step_levers, view_of)
from autotune.study._probes import (PREDICTED, PREDICTED_CONFIG, LoaderProbes, drop_queued_predictions,
                                    prediction_error)
from autotune.study._progress import _Progress
from autotune.study._references import References
from autotune.study._runner import TrialRunner
from autotune.study._signals import Interrupted, held_signals, interrupt_reason
from autotune.study._storage import storage_failure
from autotune.study._workers import LEASE_KEY, LeaseWatch, _Heartbeat, _worker_alive, _worker_id


# How bad a verdict is, for the worst of a co-located trial's copies.
VERDICT_SEVERITY = {"equivalent": 0, "unchecked": 1, "degraded": 2, "diverged": 3}
INFRA_LIMIT = 3  # infrastructure failures in a row that stop the run: the fault is not going away
PLAN_KEPT = 200  # the planner's decisions a study keeps (the newest)


def fail_heartbeat_stale(study: optuna.Study) -> None:
    """Optuna's ``fail_stale_trials``, with the reason recorded: a trial whose worker sent no heartbeat
    within the storage's grace period gets ``failure`` = ``stale: ...`` before it is failed, as a journal's
    trial without a lease does, then the storage's callback runs (it re-enqueues the config once)."""
    from optuna.storages._heartbeat import BaseHeartbeat, is_heartbeat_enabled

    storage = study._storage
    if not isinstance(storage, BaseHeartbeat) or not is_heartbeat_enabled(storage):
        return
    grace = getattr(getattr(storage, "_backend", storage), "grace_period", None)
    failed = []
    for trial_id in storage._get_stale_trial_ids(study._study_id):
        worker = storage.get_trial(trial_id).user_attrs.get("worker", "") or "(unknown)"
        try:
            storage.set_trial_user_attr(trial_id, "failure", f"stale: worker {worker} sent no heartbeat for "
                                        f"{grace}s (the grace period)")
            if storage.set_trial_state_values(trial_id, state=TrialState.FAIL):
                failed.append(trial_id)
        except optuna.exceptions.UpdateFinishedTrialError:
            pass  # another process failed it first
    callback = storage.get_heartbeat_stale_trial_callback()
    if callback is not None:
        for trial_id in failed:
            callback(study, copy.deepcopy(storage.get_trial(trial_id)))


def decisive_seconds(study: optuna.Study, attrs: dict[str, Any], budget: Any) -> Optional[tuple[float, float]]:
    """For the probes' pick (``attrs``: a queued or just-asked trial's) predicted to outrun the best so far by
    more than the race's reach (``OUT_OF_REACH``): its predicted seconds, and one round of its race against the
    baseline (``one_round_seconds``). None for any other trial."""
    predicted, config = attrs.get(PREDICTED), attrs.get(PREDICTED_CONFIG)
    best = _best_record(study) if predicted and config else None
    if best is None or predicted < OUT_OF_REACH * best.throughput:
        return None
    config = TrialConfig.from_dict(config)
    model = CostModel.fit(samples_from_trials(study.get_trials(deepcopy=False)))
    return model.predict(config.to_dict()), one_round_seconds(study, config, predicted, budget, model=model)


class TrialLoop:
    """Runs one worker's share of a study's trials.

    Args:
        study: The study, its sampler set.
        space: The space restricted to this machine.
        storage: The study's storage (heartbeats and stale-trial recovery write to it directly).
        runner: Runs configs in trial processes.
        references: The accuracy check.
        n_trials: The study's trial budget, across every worker.
        timeout: Stop starting trials this many seconds after ``started``.
        started: ``time.monotonic()`` when the run began.
        prune_below: See ``SearchOptions.prune_below``.
        seed: The trials' seed.
        identity: Hostname and device attributes recorded on each trial.
        clock: The study's clock: its deadline, when it has a budget, and the seconds of its parts.
        top_k: Finalists the race after the search will run (what it needs is kept free).
        confirm: How the race runs when the planner says so (``RACE``); None: this loop runs no race.
        probes: Probe the loader and the step apart when a trial waits on its input (``_probes``).
        since: ``time.time()`` when this run of the study began: a race recorded before it is an earlier
            run's, and the planner races the finalists again (``_confirm.race_due``). None: races recorded
            by any run count as this one's (a joining worker).
    """

    def __init__(self, *, study: optuna.Study, space: SearchSpace, storage: Any, runner: TrialRunner,
                 references: References, n_trials: int, timeout: Optional[float], started: float,
                 prune_below: Optional[float], seed: int, identity: dict[str, str],
                 clock: Optional[StudyClock] = None, top_k: int = 0, probes: bool = True,
                 confirm: Optional[ConfirmOptions] = None, since: Optional[float] = None) -> None:
        self.study = study
        self.space = space
        self.storage = storage
        self.runner = runner
        self.references = references
        self.n_trials = n_trials
        self.timeout = timeout
        self.started = started
        self.prune_below = prune_below
        self.seed = seed
        self.identity = identity
        self.clock = clock or StudyClock()
        self.top_k = top_k
        self.probes = LoaderProbes(study=study, space=space, runner=runner, clock=self.clock, seed=seed) if probes else None
        self.budget_note = ""  # why the budget ended the search, when it did
        self._probed: set[int] = set()  # incumbents whose probes this loop ran (or tried to: they may not fit)
        self.ran: list[int] = []  # trials this loop ran a process for (the time split reads their records)
        self.sampler_done = False
        self._implied = 0  # configs the last out-of-memory ruled out (_record_implied_oom), to report
        self._leases = LeaseWatch(storage) if hasattr(storage, "lease_grace_period") else None
        self._config: Optional[TrialConfig] = None  # the running trial's, for its record if it is interrupted
        self._outcome: Optional[TrialOutcome] = None
        self._infra_error = ""  # the last infrastructure failure's, for the line that stops the run
        self._view: Optional[StudyView] = None  # what the last decision read
        # Proposals in a row this run answered without a run, for the planner's stop rules (``StudyView``).
        self._ruled_out = self._over_budget = 0
        self._deadline_stop = ""  # a trial this run ran was stopped at the study's deadline: why
        self.confirm = confirm
        self._race_tried = False  # this run raced the finalists, or tried to (RACE)
        self.since = since  # this run's start: a race recorded before it is an earlier run's (race_due)
        self.raced = False  # and the race ran
        self._references_after = False  # the trial now running is followed by the seeds its verdict needs

    def run(self, ui: _Progress) -> None:
        """Run what the planner says next (``_planner.next_action``) until it says stop, or the timeout or
        the space is exhausted."""
        study, infra = self.study, 0
        ui.set_best(_best_record(study))
        ui.set_completed(self.finished_count())  # a resume, or trial 0 from the reference run
        while True:
            self._recover_stale()
            decision = self.decide()
            if decision.action in (STOP, RACE) and decision.by_budget:
                self.budget_note = self.budget_note or decision.reason
            if decision.action == STOP:
                break
            if decision.action == RACE:
                # The search is over here: what the probes queued and nobody ran goes off the queue first.
                self._drop_queued_predictions(ui)
                self._race_tried = True
                if self.confirm is not None:
                    with self.clock.part("race"):
                        self.raced = confirm_top_k(self.study, self.runner, self.confirm, seed=self.seed, ui=ui,
                                                   worker=_worker_id(), clock=self.clock, since=self.since)
                continue
            if decision.action == PROBE:
                self._probe(ui)
                continue
            if decision.action == EXTEND:
                assert decision.trial is not None
                with self.clock.part("extend"):  # the split counts it among the references
                    self.references.extend(self.study, decision.trial, self._view.extension, ui)  # type: ignore[union-attr]
                continue
            if decision.action == REFERENCE:  # seeds a study lacks, after its first full trial
                with self.clock.part("references_later"):  # the split counts it among the references
                    self.references.complete(self.study, ui)
                continue
            if decision.action == BASELINE_SPEED:
                with self.clock.part("baseline_speed"):  # the split counts it among the references
                    self.references.speed_run(self.study, ui)
                self.study.set_user_attr(FIRST_FASTER, None)  # noted against the references' rate: again
                self._note_first_faster()
                continue
            if self._view is not None and self._view.retries and self._view.finished >= self.n_trials:
                # Optuna runs the oldest queued trial first: a probes' pick queued before the retry would take
                # the retry's place, so it goes off the queue, saying why.
                self._drop_queued_predictions(ui, "the trial budget is spent; its last places go to the retries "
                                                  "of trials whose worker died")
            if self._live_count() >= self.n_trials:
                ui.status("waiting for the trials other workers are running")
                time.sleep(2.0)
                continue
            self._references_after = decision.references_after
            ended = self._run_one(ui)
            if ended == "ok":
                self._note_first_faster()
            infra = infra + 1 if ended == "infra" else 0
            if infra >= INFRA_LIMIT:
                # Not the last trial's: that is the failed one's retry, still waiting.
                raise StudyError(f"{infra} trials in a row failed outside the config ({self._infra_error}); fix "
                                 "that, then rerun the same command to resume")
            self._ruled_out = self._ruled_out + 1 if ended == "infeasible" else 0
            self._over_budget = self._over_budget + 1 if ended == OVER_BUDGET else 0
            if ended == "budget":  # a trial stopped at the deadline: nothing else can run
                self._deadline_stop = self.budget_note
        self._drop_queued_predictions(ui)

    def _drop_queued_predictions(self, ui: _Progress, why: str = "") -> None:
        """The search is over here: a trial the probes queued and nobody ran is taken off the queue, saying why."""
        why = why or self.budget_note or (f"the study's {self.n_trials} trials were done first"
                                          if self.finished_count() >= self.n_trials else "the search ended first")
        for number in drop_queued_predictions(self.study, why):
            ui.say(f"  trial {number}, queued by the probes, was not run: {why} (recorded FAIL, status not_run)")

    def view(self) -> StudyView:
        """The study's records and clock as the planner reads them."""
        repeats = self.references.options.reference_repeats
        knobs = {k: v.values for k, v in self.space.knobs.items()}
        return view_of(self.study, knobs=knobs, n_trials=self.n_trials,
                       clock=self.clock, probes=self.probes is not None,
                       race=race_seconds(self.study, self.top_k, self.runner.budget) if self.clock.budgeted else 0.0,
                       extend_cost=(lambda attrs, length: self.references.extension_seconds(self.study, attrs, length))
                       if self.clock.budgeted else None, budgeted=self.clock.budgeted, space_size=self.space.size,
                       over_budget_streak=self._over_budget, last_over_budget=self.budget_note,
                       ruled_out_streak=self._ruled_out, stopped=self._stopped(),
                       top_k=self.confirm.top_k if self.confirm is not None else 0, race_tried=self._race_tried,
                       since=self.since, probed=lambda best: best.number in self._probed or (
                           self.probes is not None and self.probes.probed(best.config)),
                       device_next=lambda best: self.probes is not None
                       and self.probes.device_variant(best.config) is not None,
                       references_done=repeats - self.references.missing_seeds(self.study.user_attrs),
                       reference_repeats=repeats, seeds_before=seeds_first(
                           budgeted=self.clock.budgeted, repeats=repeats, step_levers=step_levers(knobs)),
                       decisive=lambda trial: sum(self._decisive(trial) or ()) or None)

    def _stopped(self) -> str:
        """Why this run's search ends whatever the records say, or "" (``StudyView.stopped``)."""
        if self.sampler_done:
            return "the sampler has no config left to propose"
        if self.timeout is not None and time.monotonic() - self.started > self.timeout:
            return f"the search's --timeout of {self.timeout:g} s has passed"
        return self._deadline_stop

    def _decisive(self, trial: Any) -> Optional[tuple[float, float]]:
        """``decisive_seconds`` of a trial (queued, or just asked) under a budget; None without one."""
        return decisive_seconds(self.study, trial.user_attrs, self.runner.budget) if self.clock.budgeted else None

    def decide(self) -> Decision:
        """The planner's next action for this study, recorded in ``PLAN`` when it is a new one."""
        view = self._view = self.view()
        decision = next_action(view)
        record = {**decision.to_dict(), "at": round(self.clock.elapsed(), 1)}
        plan = self.study.user_attrs.get(PLAN) or []
        last = plan[-1] if plan else {}
        if (last.get("action"), last.get("reason")) != (decision.action, decision.reason):
            try:
                self.study.set_user_attr(PLAN, [*plan, record][-PLAN_KEPT:])
            except Exception as exc:  # the record must never cost the study its next run
                warnings.warn(f"the plan was not stored: {exc}", stacklevel=2)
        return decision

    def _probe(self, ui: _Progress) -> None:
        """Measure the incumbent's loader variants apart (``_probes``) and enqueue the one they predict
        fastest, instead of walking the loader knobs by full trials; the device-resident loader, where the
        space offers it, is enqueued first without a probe (``LoaderProbes.device_trial``)."""
        best = _best_record(self.study)
        assert best is not None and self.probes is not None
        wait = self.study.get_trials(deepcopy=False)[best.number].user_attrs.get("data_wait_fraction")
        if self.probes.device_trial(best.config, best.throughput, ui, incumbent_wait=wait) is not None:
            return  # not probed yet: where that trial does not win, its DataLoader variants are probed next
        self._probed.add(best.number)
        keep = self._view.reserve if self._view is not None else 0.0  # what the decision to probe read
        self.probes.run(best.config, best.throughput, ui, keep=keep, incumbent_wait=wait)

    def _note_first_faster(self) -> None:
        """Record when this study first measured a feasible config faster than the baseline (``FIRST_FASTER``)."""
        study = self.study
        if study.user_attrs.get(FIRST_FASTER):
            return
        trials = [{**t.user_attrs, "number": t.number} for t in study.get_trials(deepcopy=False)
                  if t.state == TrialState.COMPLETE]
        found = first_faster(trials, float(study.user_attrs.get("baseline_throughput") or 0.0),
                             study.user_attrs.get("baseline_config"))
        if found is not None:
            # When it was measured, which may be before now: the baseline's own speed can come after it.
            ended = study.trials[found["trial"]].datetime_complete
            ago = (datetime.datetime.now() - ended).total_seconds() if ended is not None else 0.0
            found["seconds"] = round(max(0.0, self.clock.elapsed() - ago), 1)
            found["budget_share"] = (round(found["seconds"] / self.clock.budget_seconds, 3)
                                     if self.clock.budget_seconds else None)
            study.set_user_attr(FIRST_FASTER, found)

    def _run_one(self, ui: _Progress) -> str:
        """Ask for one config and run it; returns how it ended ("infeasible" when the memory rule, or a
        combination of values that cannot run here, answered it without a run)."""
        study = self.study
        with warnings.catch_warnings(), held_signals() as held:
            # Optuna expects heartbeats from Study.optimize; this loop records them itself (_Heartbeat).
            warnings.filterwarnings("ignore", message="Heartbeat of storage", category=UserWarning)
            trial = study.ask()
        if held:  # a Ctrl-C or SIGTERM during ask: the trial exists, so it is recorded before stopping
            exc = Interrupted(held[0])
            self._end_unfinished(trial, None, None, exc)
            raise exc
        # Whatever stops this process from here on (Ctrl-C, SIGTERM, an error) leaves the trial recorded.
        self._config, self._outcome = None, None
        try:
            ended = self._run_asked(trial, ui)
        except optuna.exceptions.UpdateFinishedTrialError:
            # This worker was paused (SIGSTOP, a frozen VM) past the grace period: another worker failed
            # the trial as stale and runs its config again, so this result is dropped and the run goes on.
            print(f"autotune: warning: trial {trial.number} was taken over by another worker while this one "
                  "was not heartbeating (paused?); its result here is dropped", file=sys.stderr, flush=True)
            return "taken_over"
        except BaseException as exc:
            self._end_unfinished(trial, self._config, self._outcome or getattr(exc, "finished_outcome", None), exc)
            raise
        if ended is not None:
            return ended
        ui.end_trial(study.trials[trial.number])
        if self._implied:
            ui.say(f"  memory rule: {self._implied} config{'s' if self._implied != 1 else ''} that need more memory "
                   f"than #{trial.number} recorded as pruned, not run")
            self._implied = 0
        ui.set_completed(self.finished_count())
        ui.set_best(_best_record(study))
        ui.set_minutes(study)
        return study.trials[trial.number].user_attrs.get("status", "ok")

    def _run_asked(self, trial: optuna.Trial, ui: _Progress) -> Optional[str]:
        """The rest of ``_run_one``: how it ended when it ended without a run, else None."""
        study = self.study
        trial.set_user_attr("worker", _worker_id())
        for key, value in self.identity.items():
            trial.set_user_attr(key, value)
        config = self._config = self.space.sample(trial)
        surplus = self._surplus_reason(trial)
        if surplus:
            # Another worker took the last place in the budget, or is running this very config.
            trial.set_user_attr("failure", surplus)
            study.tell(trial, state=TrialState.FAIL)
            time.sleep(0.5)
            return "surplus"
        # A pair of values that the probe found cannot run together (each alone can), then the memory rule.
        cannot_run = self.space.cannot_run(config.to_dict())
        if cannot_run:
            self._prune_infeasible(trial, config, cannot_run, status=CANNOT_RUN)
            ui.ruled_out(trial.number, config, cannot_run)
            return "infeasible"
        reason = infeasible_reason(config.to_dict(), self._oom_configs())
        if reason:
            self._prune_infeasible(trial, config, reason)
            ui.ruled_out(trial.number, config, reason)
            return "infeasible"
        ui.start_trial(trial.number, config)
        duplicate = self._duplicate_of(trial)
        if duplicate is not None:
            # The sampler proposed a measured config again: reuse it rather than spend a run.
            trial.set_user_attr("duplicate_of", duplicate.number)
            self._copy(trial, duplicate)
            return None
        if self.clock.budgeted:
            decisive = self._decisive(trial)
            predicted = CostModel.fit(samples_from_trials(study.get_trials(deepcopy=False))).predict(config.to_dict())
            why = admit(self.view(), predicted, decisive_round=decisive[1] if decisive is not None else None)
            if why:
                self._prune_infeasible(trial, config, why, status=OVER_BUDGET)
                ui.ruled_out(trial.number, config, why)
                self.budget_note = why
                return OVER_BUDGET
        timeout = self.clock.cap(self.runner.timeout)
        with _Heartbeat(self.storage, trial._trial_id):
            outcome = self._outcome = self.runner.run(config, f"trial-{trial.number}", seed=self.seed,
                                                      prune_below=self._prune_threshold(), timeout=timeout)
            self.ran.append(trial.number)
            if outcome.status == "timeout" and timeout < self.runner.timeout:
                # The deadline stopped it, not the config: no verdict on the config, and the search ends.
                trial.set_user_attr("config", config.to_dict())
                trial.set_user_attr("failure", f"budget: stopped at the study's deadline after {timeout:.0f} s")
                study.tell(trial, state=TrialState.FAIL)
                self.budget_note = f"trial {trial.number} was stopped at the study's deadline"
                return "budget"
            # References run inside this trial's ask-to-tell, recorded so that they are not read as overhead:
            # fp32 at its global batch (the scale policy), and the seeds its verdict needs that the planner
            # left for after it (``Decision.references_after``).
            reference_seconds = self.references.at_batch(study, config, ui) if outcome.ok else 0.0
            if self._references_after and outcome.status != "infra":
                reference_seconds += self.references.complete(study, ui)
            if reference_seconds:
                trial.set_user_attr("reference_seconds", round(reference_seconds, 3))
        self._tell(trial, config, outcome)
        return None

    def _end_unfinished(self, trial: optuna.Trial, config: Optional[TrialConfig], finished: Optional[TrialOutcome],
                        exc: BaseException) -> None:
        """Never leave a trial RUNNING: record the result of a run that had finished, else FAIL with why
        (``interrupted: SIGINT (Ctrl-C)``, ``interrupted: SIGTERM``, ``aborted: ...``)."""
        def running() -> bool:
            return self.study._storage.get_trial(trial._trial_id).state == TrialState.RUNNING

        if not running():
            return
        if finished is not None and config is not None:
            try:
                self._tell(trial, config, finished)
            except Exception as err:  # the reason it is not kept goes with the FAIL below
                if storage_failure(err, None) is not None:
                    raise  # a full disk or a damaged file: the FAIL cannot be written either; a resume fails it
                warnings.warn(f"trial {trial.number}: its finished result was not recorded: {err}", stacklevel=2)
            if not running():
                return
        trial.set_user_attr("failure", interrupt_reason(exc))
        self.study.tell(trial, state=TrialState.FAIL)

    def _prune_threshold(self) -> Optional[float]:
        """The first-window rate under which the next trial is stopped: ``prune_below`` x the best first
        window so far. A trial is pruned on its first window, so it is compared with other first windows
        (each no faster than its trial's median): a workload whose first window starts slow after the
        warm-up prunes nothing for that alone."""
        if not self.prune_below:
            return None
        device = self.identity.get("device", "")
        trials = self.study.get_trials(deepcopy=False)

        def first_window(record: TrialRecord) -> float:
            windows = trials[record.number].user_attrs.get("window_throughputs") or ()
            return min(record.throughput, windows[0]) if windows else record.throughput

        rates = [first_window(r) for r in _feasible(self.study) if r.device in (device, "")]
        return self.prune_below * max(rates) if rates else None

    def _finish(self, trial: optuna.Trial, values: Any) -> None:
        try:
            self.study.tell(trial, values)
        except RuntimeError as exc:
            # Exhaustive samplers (grid, brute force) call study.stop() once every config is told; outside
            # study.optimize that raises after the trial is stored. It means: nothing left to try.
            if "Study.stop" not in str(exc):
                raise
            self.sampler_done = True

    def _surplus_reason(self, trial: optuna.Trial) -> str:
        live = _budget_trials(self.study, (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING))
        ahead = [t for t in live if t.number < trial.number]
        if len(ahead) >= self.n_trials:
            return "surplus: the trial budget was reached by other workers"
        for other in ahead:
            if other.state == TrialState.RUNNING and other.params == trial.params:
                return f"surplus: trial {other.number} is running the same config"
        return ""

    def _recover_stale(self) -> None:
        """Fail RUNNING trials whose worker is gone, and run each such config once more.

        A worker on this host is gone when its process no longer exists (a SIGKILLed tuner); workers on
        other hosts are judged by Optuna's heartbeat where the storage keeps one (RDB storages), else by
        the trial's lease (a journal: ``LeaseWatch``).
        """
        study = self.study
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            fail_heartbeat_stale(study)  # heartbeat storages; their callback re-enqueues
        host = socket.gethostname()
        for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            worker = trial.user_attrs.get("worker", "")
            if worker.startswith(f"{host}:"):
                if _worker_alive(worker):
                    continue
                why = f"stale: worker {worker} is gone"
            else:
                age = self._leases.stale_for(trial) if self._leases is not None else None
                if age is None:
                    continue
                why = (f"stale: worker {worker or '(unknown)'} renewed no lease for {age:.0f}s "
                       f"(grace period {self._leases.grace:g}s)")
            try:
                self.storage.set_trial_user_attr(trial._trial_id, "failure", why)
                self.storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL)
            except optuna.exceptions.UpdateFinishedTrialError:
                continue  # another process got there first
            if "retry_of" not in trial.user_attrs and trial.params:
                study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number})

    def _copy(self, trial: optuna.Trial, old: FrozenTrial) -> None:
        for key, value in old.user_attrs.items():
            if key not in ("duplicate_of", "retry_of", "worker", "role", LEASE_KEY):
                trial.set_user_attr(key, value)
        if old.state == TrialState.PRUNED:
            self.study.tell(trial, state=TrialState.PRUNED)
            return
        for key, value in old.constraints.items():
            trial.set_constraint(key, value)
        self._finish(trial, old.values)

    def _tell(self, trial: optuna.Trial, config: TrialConfig, outcome: TrialOutcome) -> None:
        study = self.study
        missing = self._missing_metric(config, outcome)
        if missing:
            outcome = dataclasses.replace(outcome, status="error", error=missing)
        trial.set_user_attr("config", config.to_dict())
        trial.set_user_attr("status", outcome.status)
        if outcome.status == "infra":
            self._tell_infra(trial, outcome)
            return
        trial.set_user_attr("wall_seconds", round(outcome.wall_seconds, 3))
        trial.set_user_attr("run_seconds", round(outcome.run_seconds, 3))
        if outcome.status == "pruned" and outcome.measurement is not None:
            for key, value in measurement_attrs(outcome.measurement).items():
                trial.set_user_attr(key, value)
            trial.set_user_attr("pruned_reason", outcome.error)
            self._record_diagnosis(trial, "PRUNED")
            study.tell(trial, state=TrialState.PRUNED)
            return
        if outcome.ok and outcome.measurement is not None:
            m = outcome.measurement
            if outcome.colocation is None:
                verdict = self.references.judge(study, config, m)
            else:  # every copy judged (copy 0 among them), the worst taken
                verdict = self._worst_copy(study, config, m, outcome.colocation)
                for key, value in colocation_attrs(outcome.colocation).items():
                    trial.set_user_attr(key, value)
            for key, value in measurement_attrs(m).items():
                trial.set_user_attr(key, value)
            trial.set_user_attr("throughput_spread", m.spread)
            error = prediction_error({**trial.user_attrs, "throughput": m.throughput, "status": "ok"})
            if error is not None:
                trial.set_user_attr("prediction_error", round(error, 4))
            trial.set_user_attr("accuracy_loss", verdict.accuracy_loss)
            record_verdict(trial, verdict.label, verdict.evidence)
            if verdict.short_evidence is not None:  # the planner may give it longer evidence (EXTEND)
                trial.set_user_attr(SHORT_EVIDENCE, round(verdict.short_evidence, 4))
            trial.set_constraint("failure", 0.0)
            trial.set_constraint("accuracy", verdict.constraint)
            self._record_diagnosis(trial, "COMPLETE")
            self._finish(trial, [m.throughput, verdict.accuracy_loss])
            return
        trial.set_user_attr("failure", outcome.status)
        trial.set_user_attr("error", outcome.error)
        trial.set_user_attr("stderr_tail", outcome.stderr_tail[-1500:])
        if outcome.signal:
            trial.set_user_attr("signal", outcome.signal)
        if outcome.status == "nan":
            record_verdict(trial, "diverged", f"the training loss or metric was not finite ({outcome.error})")
        if outcome.error.startswith(DEVICE_LOADER_REFUSAL):
            # The dataset cannot be kept on the device, whatever the other knobs: the walk drops the value.
            trial.set_user_attr("refused_value", {"knob": "loader", "value": "device"})
        if outcome.error.startswith(DEVICE_AUGMENT_REFUSAL):
            # Its transforms cannot run on the device (one is named), whatever the other knobs: likewise.
            trial.set_user_attr("refused_value", {"knob": "augment", "value": "device"})
        if outcome.status == "compile_timeout":
            # That compile mode is slow for this model, not the config broken (search/_compile reads these).
            trial.set_user_attr("compile_mode", config.compile)
            trial.set_user_attr("compile_timeout_seconds", self.runner.compile_timeout)
        for key in ("throughput", "data_wait_fraction", "peak_memory_gib"):
            trial.set_user_attr(key, 0.0)
        trial.set_user_attr("accuracy_loss", math.inf)
        # Infeasible, not FAIL: the sampler learns from infeasible trials and ignores failed ones.
        trial.set_constraint("failure", 1.0)
        trial.set_constraint("accuracy", 0.0)
        self._record_diagnosis(trial, "COMPLETE")
        self._finish(trial, [0.0, math.inf])
        if outcome.status == "oom":
            self._record_implied_oom(config, trial.number)

    def _worst_copy(self, study: optuna.Study, config: TrialConfig, m: Measurement, colocation: Colocation) -> Any:
        """The accuracy verdict of each copy (its own loss trajectory and metric); the trial's is the worst."""
        verdicts = [(self.references.judge(study, config, dataclasses.replace(m, losses=c.losses, metric=c.metric,
                                                                               loss_every=c.loss_every),
                                           same_seed=c.index == 0), c.index)
                    for c in colocation.copies]
        worst, index = max(verdicts, key=lambda pair: (VERDICT_SEVERITY.get(pair[0].label, 0), pair[0].constraint))
        seeds = " (copies past 0 train with other seeds: their loss trajectories are judged, not their metrics)"
        # The trial's metric loss and constraint are the largest of any copy's (copy 0's metric among them).
        return dataclasses.replace(worst, evidence=f"copy {index} of {colocation.count}, the worst of the copies"
                                                   f"{seeds}: {worst.evidence}",
                                   accuracy_loss=max(v.accuracy_loss for v, _ in verdicts),
                                   constraint=max(v.constraint for v, _ in verdicts))

    def _tell_infra(self, trial: optuna.Trial, outcome: TrialOutcome) -> None:
        """A trial whose surroundings failed: FAIL (no budget spent, nothing for the sampler or a duplicate to
        reuse), and its config once more, as for a dead worker."""
        trial.set_user_attr("failure", f"infra: {outcome.error}")
        self._infra_error = outcome.error
        trial.set_user_attr("error", outcome.error)
        trial.set_user_attr("stderr_tail", outcome.stderr_tail[-1500:])
        self.study.tell(trial, state=TrialState.FAIL)
        if "retry_of" not in trial.user_attrs and trial.params:
            self.study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number})

    def _missing_metric(self, config: TrialConfig, outcome: TrialOutcome) -> str:
        """Why a trial that ran to the end is an error for want of a metric the reference reported ("" if not)."""
        if not outcome.ok or outcome.measurement is None or outcome.measurement.metric is not None:
            return ""
        attrs = self.study.user_attrs
        reference = attrs.get(f"{BATCH_REFERENCE}{config.global_batch_size}", attrs.get("reference_metric"))
        if reference is None:
            return ""
        return (f"train_fn reported no metric (ctx.report_metric), though the fp32 reference reported "
                f"{reference:.4g}: its accuracy cannot be checked")

    def _record_diagnosis(self, trial: optuna.Trial, state: str) -> None:
        """Store what held this trial back on the trial itself, judged against the study so far (a
        finished trial takes no new attributes; the study-level ``diagnoses`` are revised at the end)."""
        current = {**trial.user_attrs, "number": trial.number, "state": state}
        for key, value in diagnosis_attrs(self.study, current).items():
            trial.set_user_attr(key, value)

    def _oom_configs(self) -> list[tuple[int, dict[str, Any]]]:
        return [
            (t.number, t.user_attrs["config"])
            for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if t.user_attrs.get("status") == "oom" and "config" in t.user_attrs
        ]

    def _prune_infeasible(self, trial: optuna.Trial, config: TrialConfig, reason: str, *,
                          status: str = "infeasible") -> None:
        """PRUNED without a run, with why; like every config not run, it does not count toward the budget."""
        trial.set_user_attr("config", config.to_dict())
        trial.set_user_attr("status", status)
        trial.set_user_attr("pruned_reason", reason)
        self.study.tell(trial, state=TrialState.PRUNED)

    def _record_implied_oom(self, failed: TrialConfig, number: int) -> None:
        """Record the configs an out-of-memory rules out as PRUNED trials with the reason, so the
        dashboard shows them and no sampler runs them: larger batches, and wider precisions, with the
        failed trial's other settings. They cost no run and do not count toward the trial budget."""
        space, study = self.space, self.study
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
                self._implied += 1
                study.add_trial(optuna.trial.create_trial(
                    state=TrialState.PRUNED,
                    params=asked,
                    distributions={k: distributions[k] for k in asked},
                    user_attrs={"config": candidate.to_dict(), "status": "infeasible", "pruned_reason": reason},
                ))

    def finished_count(self) -> int:
        # FAIL is left out: it only marks trials whose worker died, and each is retried once.
        return len(_budget_trials(self.study, (TrialState.COMPLETE, TrialState.PRUNED)))

    def _live_count(self) -> int:
        return len(_budget_trials(self.study, (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)))

    def _duplicate_of(self, trial: optuna.Trial) -> Optional[FrozenTrial]:
        for old in _budget_trials(self.study, (TrialState.COMPLETE, TrialState.PRUNED)):
            if old.number != trial.number and old.params == trial.params and "config" in old.user_attrs:
                return old
        return None


def record_verdict(trial: Any, label: str, evidence: str) -> None:
    """Store a trial's accuracy verdict and its one-sentence evidence as user attributes."""
    trial.set_user_attr("accuracy_verdict", label)
    trial.set_user_attr("accuracy_evidence", evidence)


def colocation_attrs(colocation: Colocation) -> dict[str, Any]:
    """A co-located trial's copies as trial user attributes: the whole record, and its figures flat."""
    return {"colocation": colocation.to_dict(), "copy_throughputs": [c.throughput for c in colocation.copies],
            "slowest_copy": colocation.slowest.index, "slowest_copy_throughput": colocation.slowest.throughput,
            "overlap": colocation.overlap, "timed_overlap": colocation.timed_overlap,
            "colocation_summary": colocation.summary}


def measurement_attrs(m: Measurement) -> dict[str, Any]:
    """A measurement as trial user attributes: its fields, and each extra as ``extra:<name>``."""
    attrs = {k: v for k, v in m.to_dict().items() if k != "extras"}
    attrs.update({f"extra:{k}": v for k, v in m.extras.items()})
    return attrs


def diagnosis_attrs(study: optuna.Study, current: dict[str, Any]) -> dict[str, str]:
    """``diagnosis`` and ``diagnosis_evidence`` for a trial about to be told, judged against the study."""
    from autotune.insight import _diagnose

    try:
        diagnosis = _diagnose.diagnose(current, [*_diagnose.measurements(study), current])
    except Exception as exc:  # a diagnosis must never cost a trial its result
        warnings.warn(f"no diagnosis for trial {current.get('number')}: {exc}", stacklevel=2)
        return {}
    return {"diagnosis": diagnosis.label, "diagnosis_evidence": diagnosis.evidence} if diagnosis else {}
