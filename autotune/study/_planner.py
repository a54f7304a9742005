"""The order of a study: one place that owns its budget and says what runs next, and why.

A study's measurements are not worth the same per second. The planner orders them so that the one most
likely to change the pick runs first, and gives each fixed cost a share of the budget rather than all of it:

1. **References, within their share.** Under a budget the fp32 reference seeds together get
   ``REFERENCE_SHARE`` of it. A seed that would run longer trains fewer samples (``Budget.seconds``: its
   timed windows end inside the share), and every later run trains that many, so the verdict stays paired;
   the schedule a script reads (``ctx.optimizer_steps``) keeps the space's length. Under a budget the seeds
   after the first run right after the first full trial, before its verdict (``seeds_first``): they bound a
   verdict, not a run, and each costs a process and the script's build.
2. **The most likely big win next.** Until a full trial other than the reference has run, nothing is
   probed where the space moves the step's knobs too: the reference's step is fp32 and untuned, so a faster
   loader cannot show against it, and the sampler's first proposal (the prior point) is the likeliest answer.
   A space of loader knobs alone has no faster step to wait for: its reference is probed at once. Where
   the references ran with the prior point's loader, the baseline's own speed run (seconds of a process
   and a few windows, for the speed-up's denominator) waits until that first trial has run.
3. **Probes where they can change the decision.** A loader probe runs when the fastest feasible full trial
   waits on its input: then its step is faster than its loader, and a loader variant can win.
4. **Longer evidence for the decisive candidate.** Where the fastest full trial could not be judged on the
   shortened evidence the budget gave it (its verdict ``unchecked`` for that reason), whether it keeps
   accuracy decides the pick: it and the fp32 references train a longer length (``StudyView.extension``)
   before anything else is explored. Where that does not fit, it stays ``unchecked``, with the budget that
   would settle it.
5. **Trials while they fit**, each predicted by the cost model, the race's first two runs (the leader's and
   the baseline's, ``_confirm.race_seconds``) kept free (``admit``) once a full trial faster than the baseline
   exists (``StudyView.reserve``): before that there is nothing worth racing, and a reservation would only keep
   the likeliest answer from running; then the race, or the end. The probes' pick predicted beyond the race's
   reach (``StudyView.decisive_seconds``) needs only its own run and the baseline's kept free: raced, the
   finalists of now would be out of its reach.

``next_action`` is a pure function of a ``StudyView`` (a study's records and its clock), so its decisions are
tested on recorded studies without running a trial. ``TrialLoop`` acts on them and records each new one in
the study attribute ``PLAN``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

from optuna.trial import TrialState

from autotune._records import (BASELINE_SPEED_PENDING, CANNOT_RUN, FASTER_BY, OVER_BUDGET, SUPERSEDED,
                               _best_record, _budget_trials, _distinct_configs)
from autotune.search._cost import CostModel, samples_from_trials
from autotune.search._predict import AS_TRIAL, INPUT_BOUND, LOADER_KNOBS, MAX_LOADER_PROBES, loader_moves
from autotune.study._budget import MIN_RUN_S, StudyClock
from autotune.study._confirm import race_due

NOT_RUN = ("infeasible", CANNOT_RUN, OVER_BUDGET)  # statuses of trials answered without a run

# The share of a budgeted study that all its fp32 reference seeds may take together: the first full trial
# should start inside the first third of the budget, after the setup and the references.
REFERENCE_SHARE = 0.2
# Proposals in a row that the budget had no time for before the search ends: a cheaper config (no compile,
# say) may still fit after an expensive one did not.
OVER_BUDGET_LIMIT = 3
RULED_OUT_LIMIT = 200  # proposals in a row that cannot run here: the sampler has nothing else left
PLAN = "plan"  # study attribute: the planner's decisions, in order ({"at", "action", "reason"})
FIRST_FASTER = "first_faster"  # study attribute: the first feasible full trial faster than the baseline

REFERENCE, TRIAL, PROBE, STOP, EXTEND, RACE = "reference", "trial", "probe", "stop", "extend", "race"
BASELINE_SPEED = "baseline-speed"
RETRY_REASON = "a retry of a trial whose worker died runs in the place that trial took in the trial budget"
__all__ = ["BASELINE_SPEED", "EXTEND", "FIRST_FASTER", "OVER_BUDGET_LIMIT", "PLAN", "PROBE", "RACE", "REFERENCE",
           "REFERENCE_SHARE", "RETRY_REASON", "RULED_OUT_LIMIT",
           "SHORT_EVIDENCE", "STOP", "TRIAL", "Decision", "Extension", "StudyView", "admit", "extension_candidate",
           "extension_seconds", "faster_candidate", "first_faster", "full_length_budget", "next_action", "over_budget_reason",
           "probe_round_seconds", "probes_why", "race_due",
           "reference_seconds", "seeds_first", "step_levers", "view_of"]
# Trial attribute: the verdict is ``unchecked`` because the evidence the budget shortened could not tell (the
# pairing with fp32 decayed and the seeds' band sees no harm): its value is the fraction of the space's length
# the evidence had. ``EXTENDED``: the fraction the trial's longer evidence trained (``EXTEND``).
SHORT_EVIDENCE = "short_evidence"
EXTENDED = "extended_evidence"


@dataclass(frozen=True)
class Decision:
    """What runs next and why.

    Args:
        action: ``reference``, ``baseline-speed``, ``trial``, ``probe``, ``extend`` or ``stop``.
        reason: One sentence for the progress line, the study note and the ``PLAN`` record.
        seconds: A reference's time share, when the budget sets one; what an ``extend`` costs.
        trial: The trial an ``extend`` decision lengthens the evidence of.
        by_budget: A ``stop`` because the study's budget has no time for what would come next.
        references_after: A ``trial`` whose process is followed, before its verdict, by the fp32 reference
            seeds the study still lacks (``seeds_first``): they bound the verdict, not the run.
    """

    action: str
    reason: str
    seconds: Optional[float] = None
    trial: Optional[int] = None
    by_budget: bool = False
    references_after: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"action": self.action, "reason": self.reason}


@dataclass(frozen=True)
class Extension:
    """Longer evidence for the decisive candidate: the trial, and what a run of it and of the references at
    the longest length that fits costs.

    Args:
        trial: The candidate's trial number.
        throughput: Its trial's throughput.
        fraction: The share of the space's length its evidence trained.
        seconds: What its longer run and the fp32 references at that length are predicted to cost.
        length: The share of the space's length that run would train (at most 1).
    """

    trial: int
    throughput: float
    fraction: float
    seconds: float = math.inf
    length: float = 1.0


@dataclass(frozen=True)
class StudyView:
    """What the planner reads of a study: its records so far and its clock.

    Args:
        references_done: fp32 reference seeds run (or reused) so far, of ``reference_repeats``.
        reference_repeats: Seeds the accuracy check asks for.
        seeds_first: Of those, the seeds that run before the first full trial (``seeds_first``); None: all.
        seeds_seconds: What the seeds still to run cost (each a process of the first seed's): a trial they
            follow is admitted only where they fit too.
        full_trials: Finished full trials other than the reference run (any status).
        best: The attributes of the fastest feasible full trial so far (the reference run counts), or None.
        best_is_reference: Whether ``best`` is the reference run.
        step_levers: Whether the space moves knobs of the step (not only the loader's).
        probes: Whether the loop may probe (``--no-probes`` and trainers without ``ctx.loader`` may not).
        probed: Whether ``best``'s loader variants were probed already.
        device_next: Whether the space offers ``best`` the device-resident loader, untried: its probe round
            then runs it as the next full trial instead (``LoaderProbes.device_trial``).
        waiting: Trials queued (WAITING): one that the probes enqueued runs before anything else.
        retries: Of those, retries of trials whose worker died: each holds the place its trial took in the
            trial budget, so it runs even where the budget reads spent.
        finished: Trials that count toward the trial budget (a queued retry's place among them).
        n_trials: The trial budget.
        usable_seconds: Seconds left for runs (infinite without a budget).
        race_seconds: What the race is kept free for: the leader's run and the baseline's
            (``_confirm.race_seconds``).
        budget_seconds: The study's budget, None without one.
        baseline_speed_pending: The baseline's own speed run is still to come (the references ran with
            another loader, and the study left it for after the first full trial).
        decisive_seconds: Where the next queued trial is the probes' pick, predicted to outrun the best so
            far by more than the race's reach (``_confirm.OUT_OF_REACH``): its predicted seconds with one round
            of a race of it and the baseline. None otherwise.
        probe_seconds: What a probe round of ``best`` and the trial it queues are predicted to cost
            (``probe_round_seconds``): a round that cannot be followed by its trial is not run.
        exhausted: Every config of the space has been measured (or found unable to run here).
        stopped: Why the caller's run ends its search whatever the records say ("" while it goes on): its
            ``--timeout``, a sampler with nothing left, a trial stopped at the study's deadline.
        race_due: The finalists of now have not been raced, and this run has not tried to race them: when the
            search ends, the race runs before the study stops (``RACE``).
        over_budget_streak: The last proposals in a row recorded ``over_budget`` (not run: no time for them);
            ``last_over_budget`` is the newest one's reason.
        ruled_out_streak: The last proposals in a row answered without a run because they cannot run here (the
            memory rule, a pair of values the probe found unable to run together).
        faster_found: A feasible full trial (not a reference run) faster than the baseline exists: only then is
            the race's time kept free (``reserve``).
        extension: The fastest full trial, ``unchecked`` on evidence the budget shortened, not yet given
            longer evidence (``EXTEND``); None otherwise.
    """

    references_done: int = 0
    reference_repeats: int = 2
    seeds_first: Optional[int] = None
    seeds_seconds: float = 0.0
    full_trials: int = 0
    best: Optional[Mapping[str, Any]] = None
    best_is_reference: bool = True
    step_levers: bool = True
    probes: bool = True
    probed: bool = False
    device_next: bool = False
    waiting: int = 0
    retries: int = 0
    finished: int = 0
    n_trials: int = 30
    usable_seconds: float = math.inf
    race_seconds: float = 0.0
    budget_seconds: Optional[float] = None
    baseline_speed_pending: bool = False
    decisive_seconds: Optional[float] = None
    probe_seconds: float = 0.0
    exhausted: bool = False
    stopped: str = ""
    race_due: bool = False
    over_budget_streak: int = 0
    last_over_budget: str = ""
    ruled_out_streak: int = 0
    faster_found: bool = False
    extension: Optional[Extension] = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def reserve(self) -> float:
        """The seconds kept free for the race's first two runs, the leader's and the baseline's: none until a
        candidate faster than the baseline exists, for until then there is nothing worth racing."""
        return self.race_seconds if self.faster_found else 0.0


def reference_seconds(budget_seconds: Optional[float], repeats: int) -> Optional[float]:
    """One reference seed's time share of a budgeted study (None without a budget)."""
    if budget_seconds is None:
        return None
    return max(MIN_RUN_S, REFERENCE_SHARE * budget_seconds / max(1, repeats))


def seeds_first(*, budgeted: bool, repeats: int, step_levers: bool) -> int:
    """The fp32 reference seeds that run before the first full trial.

    Under a budget, where the space moves the step's knobs, only the first: the seeds after it bound a
    verdict, not a run, so they run right after the first full trial and before its verdict
    (``Decision.references_after``), and the likeliest answer starts a seed's process earlier (a script
    whose Dataset or model takes seconds to build pays that in every process). Without a budget, or with
    only the loader's knobs to tune (the reference itself is then probed first), all of them first.
    """
    return 1 if budgeted and step_levers and repeats > 1 else repeats


def full_length_budget(budget_seconds: float, repeats: int, missing_seconds: float) -> float:
    """The budget, in seconds, whose references' share trains every seed at the space's full length, given
    the seconds one shortened seed lacked: the share grows by what all seeds lack."""
    return budget_seconds + repeats * missing_seconds / REFERENCE_SHARE


def step_levers(knob_values: Mapping[str, Sequence[Any]]) -> bool:
    """Whether a space moves any knob besides the loader's (then the reference's step is not the fastest)."""
    return any(len(values) > 1 for knob, values in knob_values.items() if knob not in LOADER_KNOBS)


def _input_bound(attrs: Mapping[str, Any]) -> bool:
    return (attrs.get("data_wait_fraction") or 0.0) >= INPUT_BOUND


def _search_ended(view: StudyView) -> str:
    """Why the search is over whatever the budget says, or "": the trial budget is spent, every config of the
    space was measured, or the last proposals were all answered without a run (``OVER_BUDGET_LIMIT`` in a row
    that the budget had no time for, ``RULED_OUT_LIMIT`` that could not run here)."""
    if view.stopped:
        return view.stopped
    if view.finished >= view.n_trials:
        return f"the trial budget of {view.n_trials} is spent"
    if view.exhausted:
        return "every config of the space has been measured"
    if view.over_budget_streak >= OVER_BUDGET_LIMIT:
        return (f"the last {view.over_budget_streak} proposals did not fit the budget: "
                f"{view.last_over_budget or 'no time was left for them'}")
    if view.ruled_out_streak >= RULED_OUT_LIMIT:
        return f"the sampler's last {view.ruled_out_streak} proposals cannot run here: nothing else is left"
    return ""


def next_action(view: StudyView) -> Decision:
    """The next measurement of a study and the reason for it (see the module's order). Where the search ends,
    the race of the finalists runs first, if it is due (``StudyView.race_due``)."""
    decision = _next(view)
    if decision.action == STOP and view.race_due and view.references_done >= view.reference_repeats:
        return Decision(RACE, f"{decision.reason}: the finalists race, the leader and the baseline first in each "
                              "round", by_budget=decision.by_budget)
    return decision


def _next(view: StudyView) -> Decision:
    first = view.reference_repeats if view.seeds_first is None else view.seeds_first
    if first <= view.references_done < view.reference_repeats and view.full_trials == 0:
        # The seeds left bound a verdict, and no full trial awaits one: what comes after them comes now.
        after = _next(dataclasses.replace(view, references_done=view.reference_repeats))
        if after.action == TRIAL:
            return dataclasses.replace(
                after, references_after=True,
                reason=f"{after.reason}; the fp32 reference's seeds after the first run right after it, before "
                       "its verdict (they bound the verdict, not the run)")
        if after.action == STOP:
            return after
    if view.references_done < view.reference_repeats:
        seed = view.references_done + 1
        share = reference_seconds(view.budget_seconds, view.reference_repeats)
        why = f"fp32 reference seed {seed} of {view.reference_repeats}"
        if share is not None:
            why += (f", within its share of the budget ({share:.0f} s of {REFERENCE_SHARE:.0%} for the "
                    f"references): a longer run trains fewer samples, and so does every trial")
        return Decision(REFERENCE, why, seconds=share)
    ended = _search_ended(view)
    spent = bool(ended) and (not view.retries or bool(view.stopped))
    fits = view.usable_seconds >= MIN_RUN_S + view.reserve
    if view.baseline_speed_pending and (view.full_trials >= 1 or spent) and fits:
        return Decision(BASELINE_SPEED, "the baseline's own speed, with its own loader (the references ran with "
                                        "the prior point's): timed after the first full trial, not before it")
    if spent:
        return Decision(STOP, ended, by_budget=view.over_budget_streak >= OVER_BUDGET_LIMIT
                        and view.finished < view.n_trials)
    if not fits and not view.retries and view.decisive_seconds is not None \
            and view.usable_seconds >= view.decisive_seconds:
        # Raced, today's finalists would be out of its reach: the race that matters is its own against the
        # baseline, and one round of it reads the speed-up. Keeping the whole race would keep the slower answer.
        return Decision(TRIAL, f"the probes' pick is predicted far beyond the best so far: it runs in the race's "
                               f"place ({view.decisive_seconds:.0f} s with one round of its race against the "
                               f"baseline, of {max(0.0, view.usable_seconds):.0f} s left)")
    if not fits:
        if not view.faster_found:
            return Decision(STOP, f"the study's budget had {max(0.0, view.usable_seconds):.0f} s left, too little "
                                  f"for another run", by_budget=True)
        return Decision(STOP, f"the study's budget had {max(0.0, view.usable_seconds):.0f} s left, the race's "
                              f"first runs (the leader and the baseline) need {view.reserve:.0f} s", by_budget=True)
    if view.retries:
        return Decision(TRIAL, RETRY_REASON)
    extension = view.extension
    if extension is not None and extension.seconds + view.reserve <= view.usable_seconds:
        return Decision(EXTEND, f"trial #{extension.trial} is the fastest ({extension.throughput:,.0f}/s), but its "
                                f"evidence ({extension.fraction:.0%} of the length) could not tell whether it keeps "
                                f"accuracy: it and the fp32 references train {extension.length:.0%} of the length "
                                f"({extension.seconds:.0f} s) before anything else is explored",
                        seconds=extension.seconds, trial=extension.trial)
    if view.waiting:
        return Decision(TRIAL, "a queued trial runs next (the probes' pick, or a retry)")
    best = view.best
    if view.full_trials == 0 and view.step_levers:
        if best is not None and _input_bound(best):
            return Decision(TRIAL, f"the reference waits {best['data_wait_fraction']:.0%} on its input, but its "
                                   "step is fp32 and untuned: the most likely big win (the prior point) runs "
                                   "before any loader probe")
        return Decision(TRIAL, "the most likely big win first: the sampler's first proposal (the prior point)")
    if best is not None and _input_bound(best) and view.probes and not view.probed:
        if not best.get("extra:loader_built"):
            return Decision(TRIAL, f"the best so far waits {best['data_wait_fraction']:.0%} on its input, but its "
                                   "loader is not ctx.loader's, so no probe can isolate it: the walk moves the "
                                   "loader knobs by full trials")
        who = "the reference" if view.best_is_reference else f"trial #{best.get('number')}, the best so far,"
        if not view.device_next and view.probe_seconds + view.reserve > view.usable_seconds:
            return Decision(TRIAL, f"{who} waits {best['data_wait_fraction']:.0%} on its input, but a probe round "
                                   f"and the trial it would queue need about {view.probe_seconds:.0f} s, more than "
                                   f"the {max(0.0, view.usable_seconds - view.reserve):.0f} s left: the walk moves "
                                   "the loader knobs by full trials")
        if view.device_next:
            return Decision(PROBE, f"{who} waits {best['data_wait_fraction']:.0%} on its input and the space "
                                   "offers the device-resident loader: that variant runs as the next full trial, "
                                   "bounded by the step, not probed (its rate is far above any step's)")
        return Decision(PROBE, f"{who} waits {best['data_wait_fraction']:.0%} on its input: its step is faster "
                               "than its loader, so its loader variants are probed apart")
    if best is not None and _input_bound(best) and not view.probes:
        return Decision(TRIAL, "the best so far waits on its input; probes are off, so the walk moves the loader "
                               "knobs by full trials")
    return Decision(TRIAL, "the walk's next move from the best so far")


def view_of(study: Any, *, knobs: Mapping[str, Sequence[Any]], n_trials: int, clock: StudyClock, race: float = 0.0,
            probes: bool = True, probed: Callable[[Any], bool] = lambda record: False,
            device_next: Callable[[Any], bool] = lambda record: False,
            references_done: int = 2, reference_repeats: int = 2, seeds_before: Optional[int] = None,
            decisive: Callable[[Any], Optional[float]] = lambda trial: None,
            extend_cost: Optional[Callable[[Mapping[str, Any], float], float]] = None,
            budgeted: bool = False, space_size: Optional[int] = None, over_budget_streak: int = 0,
            last_over_budget: str = "", ruled_out_streak: int = 0, stopped: str = "", top_k: int = 0,
            race_tried: bool = False, since: Optional[float] = None) -> StudyView:
    """The planner's view of an Optuna study (a running one, or one recorded earlier).

    Args:
        knobs: The space's values per knob.
        clock: The study's clock (its budget and what is left of it).
        race: Seconds kept free for the race once a faster candidate exists (``_confirm.race_seconds``).
        probed: Whether the probes of a ``TrialRecord`` (the incumbent) ran already.
        device_next: Whether the incumbent's device-resident-loader variant is offered and untried.
        decisive: A queued trial's ``StudyView.decisive_seconds`` (None where it is no decisive pick).
        references_done, reference_repeats, seeds_before: The fp32 reference seeds run so far, asked for, and
            to run before the first full trial (``StudyView``).
        extend_cost: What longer evidence for a trial (its attributes) at a share of the space's length costs:
            its run and the fp32 references' at that length. None: no extension is planned (no budget).
        budgeted: The study has a budget: a probe round is priced (``probe_round_seconds``).
        space_size: The configs of the space, for ``exhausted`` (None: not known, never exhausted).
        over_budget_streak, last_over_budget, ruled_out_streak: The caller's run's counts of the proposals in a
            row answered without a run (``StudyView``): a run's own, so that a resume with a new budget starts
            afresh.
        stopped: See ``StudyView.stopped``.
        top_k: The race's finalists (0: no race).
        race_tried: This run raced already, or tried to (another worker's claim, no time for a run).
        since: When this run began (``time.time()``): a race recorded before it is an earlier run's
            (``race_due``). None: every race recorded counts as this run's (a whole-study replay).
    """
    trials = study.get_trials(deepcopy=False)
    best = _best_record(study)
    attrs = {**trials[best.number].user_attrs, "number": best.number} if best is not None else None
    full = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
            and t.user_attrs.get("role") != "reference" and "config" in t.user_attrs
            and t.user_attrs.get("status") not in NOT_RUN]
    waiting = sorted(study.get_trials(deepcopy=False, states=(TrialState.WAITING,)), key=lambda t: t.number)
    # Ours carry ``retry_of``; Optuna's heartbeat callback's, ``failed_trial`` among the system attributes.
    retries = sum(1 for t in waiting if "retry_of" in t.user_attrs or "failed_trial" in t.system_attrs)
    superseded = set(study.user_attrs.get(SUPERSEDED) or ())
    complete = [{**t.user_attrs, "number": t.number} for t in trials
                if t.state == TrialState.COMPLETE and t.number not in superseded]
    base_rate = float(study.user_attrs.get("baseline_throughput") or 0.0)
    faster = faster_candidate(complete, base_rate)
    reserve = race if faster is not None else 0.0
    extension = extension_candidate(complete, base_rate, usable_seconds=clock.usable() - reserve,
                                    cost=extend_cost) if extend_cost is not None else None
    return StudyView(
        references_done=references_done, reference_repeats=reference_repeats, seeds_first=seeds_before,
        seeds_seconds=max(0, reference_repeats - references_done)
        * float(study.user_attrs.get("reference_wall_seconds") or 0.0),
        full_trials=len(full), best=attrs,
        best_is_reference=attrs is not None and attrs.get("role") == "reference", step_levers=step_levers(knobs),
        probes=probes, probed=best is not None and probed(best), device_next=best is not None and device_next(best),
        waiting=len(waiting), retries=retries,
        finished=len(_budget_trials(study, (TrialState.COMPLETE, TrialState.PRUNED))) + retries, n_trials=n_trials,
        usable_seconds=clock.usable(), race_seconds=race, budget_seconds=clock.budget_seconds,
        baseline_speed_pending=bool(study.user_attrs.get(BASELINE_SPEED_PENDING)),
        decisive_seconds=decisive(waiting[0]) if waiting else None, faster_found=faster is not None,
        probe_seconds=(probe_round_seconds(study, best.config, best.throughput, knobs=knobs)
                       if budgeted and best is not None else 0.0),
        extension=extension, exhausted=space_size is not None and len(_distinct_configs(study)) >= space_size,
        over_budget_streak=over_budget_streak, last_over_budget=last_over_budget, ruled_out_streak=ruled_out_streak,
        stopped=stopped, race_due=not race_tried and race_due(study, top_k, since=since))


def probe_round_seconds(study: Any, config: Any, rate: Optional[float] = None, *,
                        knobs: Optional[Mapping[str, Sequence[Any]]] = None) -> float:
    """What a probe round of the incumbent ``config`` (at ``rate``, its trial's throughput) and the trial it
    queues are predicted to cost, from the study's cost model: the loader probe's process, whose variants
    (``loader_moves`` over the space's ``knobs``, at most ``MAX_LOADER_PROBES``) each iterate a trial's warm-up
    and windows at about the incumbent's rate (an input-bound incumbent runs at its loader's rate), the step
    probe (a process of the incumbent, its compile cached: at most its trial) and the queued trial (about the
    incumbent's)."""
    model = CostModel.fit(samples_from_trials(study.get_trials(deepcopy=False)))
    rate = rate or model.rate
    current = config.to_dict()
    variants = MAX_LOADER_PROBES
    if knobs is not None:  # distinct variants: a pair of moves can land where a single one did
        distinct = {repr(sorted({**current, **move}.items())) for move in loader_moves(knobs, current)}
        variants = min(variants, len(distinct))
    windows = model.samples / rate if rate and model.samples else 0.0  # one variant's warm-up and windows
    return model.overhead + variants * windows + 2 * model.predict(current, rate=rate)


def extension_seconds(study: Any, attrs: Mapping[str, Any], length: float, *, reference: Mapping[str, Any],
                      repeats: int, full_samples: int) -> float:
    """What longer evidence for a trial (its attributes) at ``length`` of the space's length (``full_samples``)
    is predicted to cost, from the study's cost model: its run, and ``repeats`` fp32 reference runs
    (``reference``: their config) at that length."""
    config = dict(attrs["config"])
    batch = int(config.get("global_batch") or config.get("batch_size") or 1)
    samples = max(batch, int(length * full_samples) // batch * batch)
    model = CostModel.fit(samples_from_trials(study.get_trials(deepcopy=False)))
    rates = study.user_attrs.get("reference_throughputs") or [study.user_attrs.get("baseline_throughput")]
    return (model.predict(config, rate=attrs.get("throughput") or None, samples=samples)
            + repeats * model.predict(dict(reference), rate=rates[0] or None, samples=samples))


def _judged_feasible(attrs: Mapping[str, Any]) -> bool:
    return (attrs.get("status") == "ok" and attrs.get("duplicate_of") is None
            and attrs.get("accuracy_verdict") in (None, "equivalent", "unchecked"))


def faster_candidate(trials: Sequence[Mapping[str, Any]], baseline_throughput: float) -> Optional[Mapping[str, Any]]:
    """The fastest feasible full trial (not a reference run) faster than the baseline, or None: what makes a
    race worth keeping time for."""
    found = [a for a in trials if a.get("role") != "reference" and _judged_feasible(a)
             and baseline_throughput > 0 and (a.get("throughput") or 0.0) > baseline_throughput]
    return max(found, key=lambda a: a.get("throughput") or 0.0) if found else None


# The lengths (shares of the space's) longer evidence is tried at, longest first: the first that fits runs.
EXTENSION_LENGTHS = (1.0, 0.75, 0.5)
# Longer evidence must train at least this many times the samples the candidate's did: less tells little more.
EXTENSION_GAIN = 1.5


def extension_candidate(trials: Sequence[Mapping[str, Any]], baseline_throughput: float, *, usable_seconds: float,
                        cost: Callable[[Mapping[str, Any], float], float]) -> Optional[Extension]:
    """The decisive accuracy question, if there is one: the fastest full trial faster than the baseline is
    ``unchecked`` because its shortened evidence could not tell (``SHORT_EVIDENCE``) and was not lengthened
    yet. Its ``Extension`` at the longest length of ``EXTENSION_LENGTHS`` that fits ``usable_seconds``
    (``seconds`` infinite where none does, so the planner does not run it)."""
    candidate = faster_candidate(trials, baseline_throughput)
    if candidate is None or candidate.get("accuracy_verdict") != "unchecked" or EXTENDED in candidate:
        return None
    fraction = candidate.get(SHORT_EVIDENCE)
    if not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        return None
    number, rate = int(candidate["number"]), float(candidate.get("throughput") or 0.0)
    for length in EXTENSION_LENGTHS:
        if length < EXTENSION_GAIN * fraction:
            break
        seconds = cost(candidate, length)
        if seconds <= usable_seconds:
            return Extension(trial=number, throughput=rate, fraction=fraction, seconds=seconds, length=length)
    return Extension(trial=number, throughput=rate, fraction=fraction)


def admit(view: StudyView, predicted_seconds: float, *, decisive_round: Optional[float] = None) -> str:
    """Why a proposed full trial is not run, or "": its predicted seconds and what the race needs kept free
    (``StudyView.reserve``; for the probes' decisive pick, one round of its own race against the baseline)
    must fit the seconds left."""
    reserve = view.reserve if decisive_round is None else min(view.reserve, decisive_round)
    return over_budget_reason(predicted_seconds, usable_seconds=view.usable_seconds, race_seconds=reserve,
                              seeds_seconds=view.seeds_seconds)


def over_budget_reason(predicted_seconds: float, *, usable_seconds: float, race_seconds: float,
                       seeds_seconds: float = 0.0) -> str:
    """Why a proposed full trial is not run (its predicted seconds, the reference seeds that follow it and the
    race do not fit), or ""."""
    if predicted_seconds + seeds_seconds + race_seconds <= usable_seconds:
        return ""
    seeds = f", the fp32 reference seeds after it {seeds_seconds:.0f} s" if seeds_seconds > 0 else ""
    race = f" and the race's first runs {race_seconds:.0f} s" if race_seconds > 0 else ""
    return (f"not run: the study's budget had {max(0.0, usable_seconds):.0f} s left, this trial needs about "
            f"{predicted_seconds:.0f} s{seeds}{race}")


def first_faster(trials: Sequence[Mapping[str, Any]], baseline_throughput: float,
                 baseline_config: Optional[Mapping[str, Any]] = None) -> Optional[dict[str, Any]]:
    """The first finished full trial (by number) that is feasible and faster than the baseline (by more than
    ``FASTER_BY``), as ``{"trial", "throughput", "speedup"}``; None when none is. A reference run counts where it
    ran another config than the baseline (``baseline_config``: the prior point's loader), for then it can be the
    pick."""
    for attrs in sorted(trials, key=lambda a: a.get("number", 0)):
        if attrs.get("role") == "reference" and (baseline_config is None or attrs.get("config") == baseline_config):
            continue
        if attrs.get("status") != "ok" or attrs.get("duplicate_of") is not None:
            continue
        if attrs.get("accuracy_verdict") not in (None, "equivalent", "unchecked"):
            continue
        rate = attrs.get("throughput") or 0.0
        if baseline_throughput > 0 and rate > FASTER_BY * baseline_throughput:
            return {"trial": attrs.get("number"), "throughput": rate, "speedup": round(rate / baseline_throughput, 3)}
    return None


def probes_why(plan: Sequence[Mapping[str, Any]], probes: Sequence[Mapping[str, Any]]) -> str:
    """Why the loader probes ran, or did not, in words, from the planner's decisions (``PLAN``)."""
    ran = [d for d in plan if d.get("action") == PROBE]
    if ran:
        runs = sum(1 for p in probes if p.get("kind") == "loader" and p.get("status") != AS_TRIAL)
        what = [f"{runs} loader configs"] if runs else []
        if any(p.get("status") == AS_TRIAL for p in probes):
            what.append("the device-resident loader as a full trial, not probed")
        return (f"{len(ran)} round{'s' if len(ran) != 1 else ''} ({' and '.join(what) or 'none measured'}); the first "
                f"because {ran[0]['reason']}")
    held = [d for d in plan if "probe" in str(d.get("reason", ""))]
    if held:
        return f"none ran: {held[-1]['reason']}"
    return f"none ran: no full trial waited on its input for {INPUT_BOUND:.0%} of its timed windows or more"
