"""Whole studies replayed through the planner, charged at a recorded table's costs.

``autotune simulate TABLE --budget MINUTES`` runs a study without training: the fp32 references, the
trials, the probes, longer evidence for the decisive candidate and the race of the finalists, in the order
``_planner.next_action`` gives, each charged on a virtual clock at what the table says it costs. The
decisions come from the same function the live loop calls (``view_of`` then ``next_action``, over an
Optuna study that holds the records a live study holds), and the race is the live one (``_confirm._Race``)
run against the table, so a rule is tried on whole studies of many workloads before a GPU sees it.

What a run costs, from a row (``search._simulate.TableRow``): ``build_seconds`` (a process's start and the
script's build before its first step; the study's ``build_seconds`` where the row has none),
``compile_seconds`` (fresh the first time in its compile group, ``CACHED_COMPILE_SHARE`` of it after), and
the rest of ``trial_seconds`` for training the space's full length, scaled by the share of it a run trains.
A race run trains its warm-up and short windows (``_confirm.race_budget``) at the row's throughput.

The references train within their share of the budget (``_planner.reference_seconds``), counted from the
process's start, so a slow build shortens their training rather than the study's other parts; every later
run trains that share of the length. A trial's verdict is the row's at that share (``verdict_at``), or its
``accuracy_loss`` against the bound.

The table's first line may hold the study's settings: ``{"study": {"baseline": {...params...}, "samples":
12800, "setup_seconds": 20, "build_seconds": 8}}``. Without a baseline, the slowest feasible fp32 row is.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import optuna
from optuna.trial import TrialState

from autotune._config import TORCH_LOADER_KNOBS, Budget, Measurement, TrialConfig, TrialOutcome
from autotune._errors import TableError
from autotune._records import (BASELINE_SPEED_PENDING, CONFIRMATION, FASTER_BY, REFERENCE_SEEDS, SUPERSEDED,
                               _best_record)
from autotune.search._cost import CACHED_COMPILE_SHARE, CostModel, compile_group, samples_from_trials
from autotune.search._rules import infeasible_reason
from autotune.search._sampler import GuidedSampler
from autotune.search._simulate import (CONFIG_FIELDS, NoisyLookup, ReplayProbes, ReplayTable, TableRow, _ask, _key,
                                      make_sampler)
from autotune.study._budget import MIN_RUN_S, StudyClock
from autotune.study._confirm import BASELINE_RUNS, _entrants, _Race, entrant_seconds, race_seconds, speed_budget
from autotune.study._planner import (BASELINE_SPEED, EXTEND, EXTENDED, PROBE, RACE, REFERENCE,
                                     SHORT_EVIDENCE, STOP, Decision, admit, extension_seconds, next_action,
                                     seeds_first, step_levers, view_of)
from autotune.study._loop import decisive_seconds
from autotune.study._probes import MAX_LOADER_PROBES, PREDICTED, PREDICTED_CONFIG
from autotune.study._progress import _Progress
from autotune.study._references import SPEED_WINDOW_STEPS

__all__ = ["StudyReplay", "replay_study", "replay_studies"]

DEFAULT_SAMPLES = 12_800  # the space's length where the table does not say
DEFAULT_SETUP_S = 15.0  # the study's setup (capability probe, trial server) where the table does not say
RACE_ROUNDS = 3


@dataclass(frozen=True)
class StudyReplay:
    """One study replayed.

    Attributes:
        pick: The pick's params (None where nothing feasible was found).
        pick_share: The pick's throughput in the table over the table's best feasible one.
        pick_verdict: The verdict the study gave the pick.
        first_faster_start_s: When the first full trial that turned out feasible and faster than the baseline
            started, in seconds from the study's start (None: never).
        seconds: The study's wall time on the replay's clock.
        split: Seconds by part (setup, references, trials, probes, extend, race).
        plan: The planner's decisions in order ({"at", "action", "reason"}).
        trials: The trials' params, status, throughput and verdict, in order.
    """

    table: str
    budget_minutes: float
    seed: int
    pick: Optional[dict[str, Any]]
    pick_share: float
    pick_verdict: str
    first_faster_start_s: Optional[float]
    seconds: float
    split: dict[str, float]
    plan: tuple[dict[str, Any], ...] = ()
    trials: tuple[dict[str, Any], ...] = field(default=(), repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"table": self.table, "budget_minutes": self.budget_minutes, "seed": self.seed, "pick": self.pick,
                "pick_share": round(self.pick_share, 4), "pick_verdict": self.pick_verdict,
                "first_faster_start_s": None if self.first_faster_start_s is None
                else round(self.first_faster_start_s, 1),
                "seconds": round(self.seconds, 1), "split": {k: round(v, 1) for k, v in self.split.items()},
                "plan": list(self.plan), "trials": list(self.trials)}


class _Costs:
    """What each run of a table's configs costs, and what it measures."""

    def __init__(self, table: ReplayTable, *, noise: float, seed: int) -> None:
        self.table = table
        settings = table.study
        self.samples = int(settings.get("samples") or DEFAULT_SAMPLES)
        self.setup = float(settings.get("setup_seconds", DEFAULT_SETUP_S))
        self.build = float(settings.get("build_seconds") or 0.0)
        self.noise = noise
        self.rng = random.Random(seed + 7919)
        self.compiled: set[str] = set()

    def row(self, params: Mapping[str, Any]) -> TableRow:
        return self.table.lookup(params)

    def build_of(self, row: TableRow) -> float:
        return row.build_seconds if row.build_seconds is not None else self.build

    def compile_of(self, params: Mapping[str, Any], row: TableRow) -> float:
        fresh = row.compile_seconds or 0.0
        group = compile_group(params)
        if not fresh or group is None:
            return fresh
        if group in self.compiled:
            return fresh * CACHED_COMPILE_SHARE
        self.compiled.add(group)
        return fresh

    def training(self, row: TableRow) -> float:
        """Seconds the row's run spends training the space's full length."""
        if row.trial_seconds is not None:
            return max(0.0, row.trial_seconds - self.build_of(row) - (row.compile_seconds or 0.0))
        return self.samples / row.throughput if row.throughput else 0.0

    def observe(self, row: TableRow) -> Optional[float]:
        if row.status != "ok" or not row.throughput:
            return None
        return row.throughput * max(0.05, 1.0 + self.rng.gauss(0.0, self.noise)) if self.noise else row.throughput


def verdict_at(row: TableRow, share: float, max_accuracy_loss: float) -> str:
    """The verdict a row's config earns on evidence of ``share`` of the length (``TableRow.verdict_at``)."""
    if row.verdict_at:
        earned = [v for s, v in row.verdict_at.items() if s <= share + 1e-9]
        return earned[-1] if earned else "unchecked"
    return "equivalent" if (row.accuracy_loss or 0.0) <= max_accuracy_loss else "degraded"


def _baseline_row(table: ReplayTable) -> TableRow:
    stated = table.study.get("baseline")
    if isinstance(stated, dict):
        row = table.lookup({**stated})
        if row.status != "ok":
            raise TableError(f"{table.name}: the study's baseline {stated} has no ok row")
        return row
    rows = [r for r in table._rows.values() if r.status == "ok" and r.params.get("precision", "fp32") == "fp32"]
    if not rows:
        raise TableError(f"{table.name}: no ok fp32 row to be the baseline; name one in the study line")
    return min(rows, key=lambda r: r.throughput or 0.0)


def _config(params: Mapping[str, Any]) -> dict[str, Any]:
    """A row's params as a trial's recorded config (the knobs ``TrialConfig`` knows)."""
    try:
        return TrialConfig.from_dict({k: v for k, v in params.items() if k in CONFIG_FIELDS}).to_dict()
    except (TypeError, ValueError) as exc:
        raise TableError(f"the table's config {dict(params)} is no config of this project: {exc}") from None


class _Runner:
    """Runs the race's configs against the table on the replay's clock (``_confirm._Race`` calls ``run``)."""

    def __init__(self, replay: "_Replay") -> None:
        self.replay = replay
        self.budget = replay.budget
        self.timeout = math.inf

    def run(self, config: TrialConfig, workdir: str, *, seed: int, budget: Optional[Budget] = None,
            timeout: float = math.inf, **_: Any) -> TrialOutcome:
        costs, params = self.replay.costs, self.replay.params_of(config)
        row = costs.row(params)
        samples = (budget or self.budget).samples
        rate = costs.observe(row)
        seconds = costs.build_of(row) + costs.compile_of(params, row) + (samples / row.throughput
                                                                        if row.throughput else 0.0)
        self.replay.charge(min(seconds, timeout))
        if rate is None or seconds > timeout:
            return TrialOutcome("error", error="the table records no run of it", wall_seconds=seconds)
        return TrialOutcome("ok", _measurement(rate, samples), wall_seconds=seconds)


def _race_before(study: optuna.Study, top_k: int, budget: Optional[Budget] = None) -> float:
    """The race's reservation under the rules before (for ``rules="before"``): every finalist once, the leader
    once more and the baseline ``BASELINE_RUNS`` times, where ``race_seconds`` now keeps the leader's run and the
    baseline's."""
    costs, base_key = entrant_seconds(study, top_k, budget)
    finalists = [seconds for key, seconds in costs.items() if key != base_key]
    return sum(finalists) + max(finalists, default=0.0) + BASELINE_RUNS * costs.get(base_key, 0.0)


def _probe_round_before(study: optuna.Study, config: Mapping[str, Any]) -> float:
    """A probe round's price under the rules before (for ``rules="before"``): a second a loader variant, where
    ``probe_round_seconds`` now prices each at a trial's samples at the incumbent's rate."""
    model = CostModel.fit(samples_from_trials(study.get_trials(deepcopy=False)))
    return model.overhead + MAX_LOADER_PROBES * 1.0 + 2 * model.predict(dict(config))


def _measurement(rate: float, samples: int) -> Measurement:
    return Measurement(throughput=rate, window_throughputs=(rate,) * 3, step_time=0.0, data_wait_fraction=0.0,
                       peak_memory_gib=0.0, warmup_seconds=0.0, first_step_seconds=0.0, compile_seconds=0.0,
                       capture_seconds=0.0, samples=samples, steps=0)


class _Replay:
    """One study replayed (see the module)."""

    def __init__(self, table: ReplayTable, *, budget_minutes: float, seed: int, noise: float, top_k: int,
                 n_trials: int, repeats: int, max_accuracy_loss: float, rules: str) -> None:
        self.table, self.seed, self.top_k, self.n_trials, self.repeats = table, seed, top_k, n_trials, repeats
        self.max_loss, self.legacy = max_accuracy_loss, rules == "before"
        self.costs = _Costs(table, noise=noise, seed=seed)
        self.now = 0.0
        self.clock = StudyClock(budget_seconds=budget_minutes * 60, started=0.0, now=lambda: self.now)
        self.budget = Budget(samples=self.costs.samples)
        self.share = 1.0  # of the space's length every run trains (the references' share may shorten it)
        self.base_row = _baseline_row(table)
        self.names = tuple(table.names)
        # As the tuner: the references run with the prior point's DataLoader knobs, and the baseline's own
        # speed is timed apart, after the first full trial (``BASELINE_SPEED``).
        prior = GuidedSampler(search_space=table.distributions()).prior_point()
        loader = {k: prior[k] for k in TORCH_LOADER_KNOBS if k in prior and k in self.names}
        row = table.lookup({**self.base_row.params, **loader})
        self.reference_row = row if row.status == "ok" else self.base_row
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            self.study = optuna.create_study(directions=["maximize", "minimize"],
                                             sampler=make_sampler("guided", table, seed))
        self.references = 0
        lookup = NoisyLookup(table, noise=noise, seed=seed + 7919)
        self.prober = ReplayProbes(table, lookup, seed + 104_729) if ReplayProbes.usable(table) else None
        self.started: dict[int, float] = {}  # trial number -> when its run started
        self.probed: set[int] = set()
        self.ooms: list[tuple[int, dict[str, Any]]] = []
        self.plan: list[dict[str, Any]] = []
        # Proposals in a row answered without a run, for the planner's stop rules (as the loop counts them).
        self.over_budget = self.ruled_out = 0
        self.over_budget_note = ""
        self.race_tried = False

    # -- the clock -------------------------------------------------------------------------------
    def charge(self, seconds: float) -> None:
        self.now += max(0.0, seconds)

    def params_of(self, config: TrialConfig) -> dict[str, Any]:
        """The table's params of a recorded config: a trial's own (a table's knobs need not all be this
        project's), else the config's values of the table's knobs."""
        values = config.to_dict()
        for trial in self.study.get_trials(deepcopy=False):
            if trial.user_attrs.get("config") == values and set(trial.params) == set(self.names):
                return dict(trial.params)
        return {n: values.get(n) for n in self.names}

    # -- the loop --------------------------------------------------------------------------------
    def view(self) -> Any:
        race = (_race_before if self.legacy else race_seconds)(self.study, self.top_k, self.budget)
        view = view_of(self.study, knobs=self.table.values, n_trials=self.n_trials, clock=self.clock,
                       race=race,
                       probes=self.prober is not None, probed=lambda best: best.number in self.probed,
                       device_next=self.device_next,
                       references_done=int(self.study.user_attrs.get(REFERENCE_SEEDS, self.references)),
                       reference_repeats=self.repeats, seeds_before=None if self.legacy else seeds_first(
                           budgeted=True, repeats=self.repeats, step_levers=step_levers(self.table.values)),
                       extend_cost=self.extension_seconds, budgeted=True,
                       decisive=lambda trial: sum(decisive_seconds(self.study, trial.user_attrs, self.budget) or ())
                       or None, space_size=self.table.size, over_budget_streak=self.over_budget,
                       last_over_budget=self.over_budget_note, ruled_out_streak=self.ruled_out, top_k=self.top_k,
                       race_tried=self.race_tried)
        if self.legacy:  # the rules before: the race always reserved, no longer evidence, a second a probe variant
            probe = _probe_round_before(self.study, view.best["config"]) if view.probe_seconds else 0.0
            view = dataclasses.replace(view, faster_found=True, extension=None, probe_seconds=probe)
        return view

    def decide(self) -> Decision:
        decision = next_action(self.view())
        self.plan.append({**decision.to_dict(), "at": round(self.now, 1)})
        return decision

    def run(self) -> None:
        self.charge(self.costs.setup)
        self.clock.add("setup", self.costs.setup)
        while True:
            decision = self.decide()
            if decision.action == STOP:
                break
            with self.clock.part(decision.action if decision.action != "trial" else "trials"):
                if decision.action == RACE:
                    self.race_tried = True
                    self.race()
                elif decision.action == REFERENCE:
                    self.reference(decision)
                elif decision.action == EXTEND:
                    self.extend(decision)
                elif decision.action == PROBE:
                    self.probe()
                elif decision.action == BASELINE_SPEED:
                    self.baseline_speed()
                else:
                    ended = self.trial()
                    self.over_budget = self.over_budget + 1 if ended == "over_budget" else 0
                    self.ruled_out = self.ruled_out + 1 if ended == "infeasible" else 0
            if decision.references_after and ended not in ("infeasible", "duplicate", "over_budget"):
                # The seeds its verdict needs, as the live loop runs them before the verdict: the table's
                # verdict does not depend on them, and no decision comes in between.
                with self.clock.part(REFERENCE):
                    self.reference(decision)

    def device_next(self, best: Any) -> bool:
        """As ``LoaderProbes.device_variant``: the table offers the incumbent the device-resident loader, untried."""
        if "device" not in self.table.values.get("loader", ()):
            return False
        variant = {**self.params_of(best.config), "loader": "device"}
        return self.costs.row(variant).status != "error" and not self.tried(variant)

    def tried(self, params: Mapping[str, Any]) -> bool:
        return any(t.params == dict(params) for t in self.study.get_trials(deepcopy=False)
                   if t.state in (TrialState.COMPLETE, TrialState.WAITING, TrialState.PRUNED))

    def baseline_speed(self) -> None:
        """The baseline's own speed run: a process and a few short windows (``References.speed_run``)."""
        row = self.base_row
        samples = speed_budget(self.budget, TrialConfig.from_dict(_config(row.params)), SPEED_WINDOW_STEPS).samples
        self.charge(self.costs.build_of(row) + (samples / row.throughput if row.throughput else 0.0))
        self.study.set_user_attr("baseline_throughput", self.costs.observe(row) or 0.0)
        self.study.set_user_attr(BASELINE_SPEED_PENDING, False)

    def probe(self) -> None:
        """A probe round for the input-bound incumbent (``search._simulate.ReplayProbes``, as the loop's
        ``LoaderProbes``): its pick is queued as the next trial, with the prediction the loop records."""
        best = _best_record(self.study)
        assert best is not None and self.prober is not None
        incumbent = self.params_of(best.config)
        measured = {_key(t.params) for t in self.study.get_trials(deepcopy=False) if "config" in t.user_attrs}
        choice, seconds = self.prober.choose(incumbent, best.throughput, measured)
        self.charge(seconds)
        if choice is not None and not self.tried(choice[1]):
            predicted, params = choice
            self.study.enqueue_trial({n: params[n] for n in self.names}, user_attrs={
                PREDICTED: predicted, PREDICTED_CONFIG: _config(params)})
        if choice is None or choice[1].get("loader") != "device":
            self.probed.add(best.number)

    def reference(self, decision: Decision) -> None:
        row = self.reference_row
        build, training = self.costs.build_of(row), self.costs.training(row)
        if self.references == 0 and decision.seconds is not None:
            # The share counts from the process's start (before, from the context's creation, after the build).
            room = decision.seconds if self.legacy else decision.seconds - build
            self.share = min(1.0, max(room, MIN_RUN_S) / training) if training else 1.0
        self.charge(build + self.share * training)
        self.references += 1
        if self.references == 1:  # as the tuner: the study and its trial 0 come from the first seed
            self.record_reference()
        self.study.set_user_attr(REFERENCE_SEEDS, self.references)  # as the study records them

    def record_reference(self) -> None:
        row = self.reference_row
        config = _config(row.params)
        rate = row.throughput or 0.0
        self.study.set_user_attr("baseline_config", _config(self.base_row.params))
        self.study.set_user_attr("baseline_throughput", rate)
        self.study.set_user_attr("reference_wall_seconds",
                                 self.costs.build_of(row) + self.share * self.costs.training(row))
        if row is not self.base_row:
            self.study.set_user_attr("reference_config", config)
            self.study.set_user_attr(BASELINE_SPEED_PENDING, True)
        self.budget = Budget(samples=max(1, int(self.share * self.costs.samples)))
        if self.share < 1.0:
            self.study.set_user_attr("references_shortened", {"samples": self.budget.samples,
                                                              "from_samples": self.costs.samples})
        attrs = {"config": config, "status": "ok", "role": "reference", "throughput": rate, "extra:loader_built": True,
                 "data_wait_fraction": row.data_wait_fraction or 0.0,
                 "accuracy_verdict": "equivalent", "accuracy_loss": 0.0, "samples": self.budget.samples,
                 "wall_seconds": self.costs.build_of(row) + self.share * self.costs.training(row)}
        self.add_trial(row.params, [rate, 0.0], attrs, feasible=True)

    def add_trial(self, params: Mapping[str, Any], values: Sequence[float], attrs: dict[str, Any], *,
                  feasible: bool, state: TrialState = TrialState.COMPLETE) -> int:
        distributions = self.table.distributions()
        trial = optuna.trial.create_trial(
            params={n: params[n] for n in self.names}, distributions={n: distributions[n] for n in self.names},
            values=list(values) if state == TrialState.COMPLETE else None, user_attrs=attrs, state=state,
            system_attrs={"constraints:failure": 0.0, "constraints:accuracy": -1.0 if feasible else 1.0})
        self.study.add_trial(trial)
        return len(self.study.trials) - 1

    def trial(self) -> str:
        trial = self.study.ask()
        params = _ask(trial, self.table)
        config = _config(params)
        reason = infeasible_reason(params, self.ooms)
        if reason:
            return self._prune(trial, config, "infeasible", reason)
        measured = [t for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                    if t.params == params and t.user_attrs.get("role") != "reference"]
        if measured:  # the sampler proposed a measured config again: its record is copied, no run
            old = measured[0]
            trial.set_user_attr("duplicate_of", old.number)
            for key, value in old.user_attrs.items():
                trial.set_user_attr(key, value)
            self.study.tell(trial, old.values)
            return "duplicate"
        predicted = CostModel.fit(samples_from_trials(self.study.get_trials(deepcopy=False))).predict(config)
        why = admit(self.view(), predicted)
        if why:
            self.over_budget_note = why
            return self._prune(trial, config, "over_budget", why)
        row = self.costs.row(params)
        self.started[trial.number] = self.now
        compile_s = self.costs.compile_of(params, row)
        seconds = self.costs.build_of(row) + compile_s + self.share * self.costs.training(row)
        self.charge(min(seconds, max(0.0, self.clock.left())))
        trial.set_user_attr("config", config)
        trial.set_user_attr("status", row.status)
        trial.set_user_attr("extra:loader_built", True)  # a script that builds its loader with ctx.loader
        trial.set_user_attr("wall_seconds", round(seconds, 3))
        trial.set_user_attr("compile_seconds", round(compile_s, 3))
        trial.set_user_attr("samples", self.budget.samples)
        observed = self.costs.observe(row)
        if observed is None:
            if row.status == "oom":
                self.ooms.append((trial.number, params))
            trial.set_user_attr("throughput", 0.0)
            trial.set_constraint("failure", 1.0)
            trial.set_constraint("accuracy", 0.0)
            self.study.tell(trial, [0.0, math.inf])
            return row.status
        verdict = verdict_at(row, self.share, self.max_loss)
        if verdict == "unchecked" and self.share < 1.0:
            if self.legacy:  # the verdict before: a decayed pairing above its margin read as harm
                verdict = "degraded"
            else:
                trial.set_user_attr(SHORT_EVIDENCE, round(self.share, 4))
        self._judged(trial, verdict, observed, row)
        return "ok"

    def _judged(self, trial: Any, verdict: str, observed: float, row: TableRow) -> None:
        feasible = verdict in ("equivalent", "unchecked")
        trial.set_user_attr("throughput", observed)
        trial.set_user_attr("data_wait_fraction", row.data_wait_fraction or 0.0)
        trial.set_user_attr("accuracy_verdict", verdict)
        trial.set_user_attr("accuracy_loss", 0.0 if feasible else 1.0)
        trial.set_constraint("failure", 0.0)
        trial.set_constraint("accuracy", -1.0 if feasible else 1.0)
        self.study.tell(trial, [observed, 0.0 if feasible else 1.0])

    def _prune(self, trial: Any, config: dict[str, Any], status: str, reason: str) -> str:
        trial.set_user_attr("config", config)
        trial.set_user_attr("status", status)
        trial.set_user_attr("pruned_reason", reason)
        self.study.tell(trial, state=TrialState.PRUNED)
        return status

    def extension_seconds(self, attrs: Mapping[str, Any], length: float) -> float:
        """As the live study plans it (``_planner.extension_seconds``); the run is charged at the table's."""
        return extension_seconds(self.study, attrs, length, reference=_config(self.reference_row.params),
                                 repeats=self.repeats, full_samples=self.costs.samples)

    def charged_extension(self, params: Mapping[str, Any], length: float) -> float:
        """What longer evidence costs in the table: the candidate's run and the references' at ``length``."""
        row, reference = self.costs.row(params), self.reference_row
        candidate = self.costs.build_of(row) + self.costs.compile_of(params, row) + length * self.costs.training(row)
        return candidate + self.repeats * (self.costs.build_of(reference)
                                           + length * self.costs.training(reference))

    def extend(self, decision: Decision) -> None:
        """The candidate and the references at a longer length; the candidate's trial is superseded by a
        trial of the same config that records the verdict of that length."""
        view = self.view()
        extension = view.extension
        assert extension is not None and decision.trial is not None
        old = self.study.trials[decision.trial]
        params = dict(old.params)
        row = self.costs.row(params)
        self.charge(self.charged_extension(params, extension.length))
        verdict = verdict_at(row, extension.length, self.max_loss)
        attrs = {**old.user_attrs, "accuracy_verdict": verdict, EXTENDED: extension.length,
                 "extension_of": decision.trial, "samples": int(extension.length * self.costs.samples)}
        attrs.pop(SHORT_EVIDENCE, None)
        if verdict == "unchecked" and extension.length < 1.0:
            attrs[SHORT_EVIDENCE] = extension.length
        feasible = verdict in ("equivalent", "unchecked")
        self.add_trial(params, [old.values[0], 0.0 if feasible else 1.0], attrs, feasible=feasible)
        self.study.set_user_attr(SUPERSEDED, [*(self.study.user_attrs.get(SUPERSEDED) or []), decision.trial])

    def race(self) -> None:
        """The live race (``_confirm._Race``) of the finalists of now, run against the table."""
        entrants, base_key, signature = _entrants(self.study, self.top_k)
        race = _Race(self.study, entrants, base_key, RACE_ROUNDS)
        with _Progress(False, self.n_trials, clock=self.clock) as ui:
            race.run(_Runner(self), seed=self.seed, ui=ui, clock=self.clock)
        if race.rounds:
            self.study.set_user_attr(CONFIRMATION, race.record(signature, "replay"))

    # -- the outcome -----------------------------------------------------------------------------
    def result(self, budget_minutes: float) -> StudyReplay:
        best_true = self.table_best()
        record = _best_record(self.study)
        pick, share, verdict = None, 0.0, "none"
        if record is not None:
            trial = self.study.trials[record.number]
            pick = dict(trial.params)
            true = self.costs.row(pick).throughput or 0.0
            share = true / best_true if best_true else 0.0
            verdict = trial.user_attrs.get("accuracy_verdict", "equivalent")
        base = self.base_row.throughput or 0.0
        first = None
        for number, began in sorted(self.started.items()):
            attrs = self.study.trials[number].user_attrs
            row = self.costs.row(dict(self.study.trials[number].params))
            if attrs.get("status") == "ok" and (row.throughput or 0.0) > FASTER_BY * base \
                    and verdict_at(row, 1.0, self.max_loss) == "equivalent":
                first = began
                break
        trials = tuple({"number": t.number, "params": dict(t.params), "status": t.user_attrs.get("status"),
                        "throughput": t.user_attrs.get("throughput"), "verdict": t.user_attrs.get("accuracy_verdict"),
                        "role": t.user_attrs.get("role")} for t in self.study.trials)
        split = {k: v for k, v in self.clock.seconds.items()}
        return StudyReplay(table=self.table.name, budget_minutes=budget_minutes, seed=self.seed, pick=pick,
                           pick_share=share, pick_verdict=verdict, first_faster_start_s=first, seconds=self.now,
                           split=split, plan=tuple(self.plan), trials=trials)

    def table_best(self) -> float:
        rows = [r for r in self.table._rows.values()
                if r.status == "ok" and verdict_at(r, 1.0, self.max_loss) == "equivalent"]
        return max((r.throughput or 0.0 for r in rows), default=0.0)


def replay_study(table: ReplayTable, *, budget_minutes: float, seed: int = 0, noise: float = 0.02, top_k: int = 3,
                 n_trials: int = 40, reference_repeats: int = 2, max_accuracy_loss: float = 0.01,
                 rules: str = "current") -> StudyReplay:
    """Replay one whole study of ``table`` under ``budget_minutes`` (see the module).

    Args:
        noise: Each run's throughput is the row's times 1 + N(0, noise), drawn from ``seed``.
        rules: ``current``, or ``before``: the race's whole time reserved (two rounds) from the start, the
            references' share counted after the script's build, and no longer evidence (a shortened verdict
            that could not tell reads ``degraded``), for a before-and-after comparison through the same planner.
    """
    if budget_minutes <= 0:
        raise TableError("--budget must be a positive number of minutes")
    if rules not in ("current", "before"):
        raise TableError(f"unknown rules {rules!r}: current or before")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    replay = _Replay(table, budget_minutes=budget_minutes, seed=seed, noise=noise, top_k=top_k, n_trials=n_trials,
                     repeats=reference_repeats, max_accuracy_loss=max_accuracy_loss, rules=rules)
    replay.run()
    return replay.result(budget_minutes)


def replay_studies(table: ReplayTable, *, budget_minutes: float, seeds: int = 5, **keywords: Any) -> dict[str, Any]:
    """``replay_study`` for seeds ``0 .. seeds-1``, with the median and worst ``pick_share`` and the median
    share of the budget at which the first faster trial started (``autotune simulate --budget --json``)."""
    runs = [replay_study(table, budget_minutes=budget_minutes, seed=seed, **keywords) for seed in range(seeds)]
    shares = [r.pick_share for r in runs]
    starts = [r.first_faster_start_s / (budget_minutes * 60) if r.first_faster_start_s is not None else math.inf
              for r in runs]
    return {"table": table.name, "budget_minutes": budget_minutes, "seeds": seeds,
            "pick_share_median": round(statistics.median(shares), 4), "pick_share_worst": round(min(shares), 4),
            "first_faster_budget_share_median": round(statistics.median(starts), 3)
            if math.isfinite(statistics.median(starts)) else None,
            "first_faster_budget_share_worst": round(max(starts), 3) if math.isfinite(max(starts)) else None,
            "runs": [r.to_dict() for r in runs]}
