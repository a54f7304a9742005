"""Confirming the best before it is declared: a race of the finalists, and an optional long run.

The race runs the K fastest configs and the baseline in interleaved rounds, the leader and the baseline first
(A base B C, then base A C B, ...), so that drift favours no position, and every comparison is between runs of
the same round. A sequential rule ends it as early as the evidence allows:

- a finalist slower than the leader by more than ``CLEARLY_SLOWER`` in each of at least two measurements
  (its search trial and the rounds so far) is dropped;
- the baseline runs in ``BASELINE_RUNS`` rounds, not in every one (it is the slowest config, so its runs
  cost most), and once more when its runs disagree by more than ``NOISY_MACHINE``;
- the race stops when one finalist is left and the baseline has its runs, or after ``confirm_rounds``
  rounds (a tie is raced to the end, then called by the medians and said to be within the noise), or when
  the study's budget has no time for the next run.

The baseline's runs disagreeing by more than ``NOISY_MACHINE`` marks the machine noisy, and so does a
finalist's runs disagreeing as much, or a config's race runs and its full trial differing by more than
``TRIAL_GAP``: the speed-up is then given as a range (``_records._speedup_evidence``), of every run of the
pick against every run of the baseline (their full trials too, when those disagreed with the race). What else loaded the machine during each run (the
load average, other processes on the GPU) is recorded beside the rates.

Several workers may share a study: the one that finishes last claims the race with a study attribute,
so it runs once per study.
"""

from __future__ import annotations

import math
import os
import socket
import statistics
import sys
import threading
import time
from typing import Any, Optional

import optuna
from optuna.trial import TrialState

from autotune._config import Budget, TrialConfig, TrialRecord
from autotune._records import CONFIRMATION, TRIAL_GAP, _best_record, _feasible, _trials_of_race_run, disagreement
from autotune.hardware import machine_load
from autotune.search._cost import CostModel, samples_from_trials
from autotune.study._budget import StudyClock
from autotune.study._options import ConfirmOptions
from autotune.study._progress import _Progress
from autotune.study._runner import TrialRunner
from autotune.study._workers import LEASE_KEY, LeaseWatch, _worker_alive, lease_timing

CLAIM = "top_k_confirmation_claim"
# How long a claim settles before its worker reads it back (Fischer's mutual exclusion): longer than a
# storage write takes, so of two workers that claim at once both see the last claim written.
CLAIM_SETTLE_SECONDS = 2.0
BASELINE_KEY = "baseline"  # the baseline's key in the rounds when it is no trial of the space
# A finalist this much slower than the leader in every measurement (two at least) is out of the race. Run
# to run, a steady workload's throughput moves by a few percent (benchmarks/results/*: 0.4-5%), so 10%
# in each of two independent measurements is not noise.
CLEARLY_SLOWER = 0.10
BASELINE_RUNS = 2  # the fewest baseline runs that show their own spread
# The baseline's runs differing by more than this (max / min - 1) say the machine's speed moved under the
# race: other jobs, throttling. Then the speed-up is a range, not a point.
NOISY_MACHINE = 0.20
# So do a finalist's own race runs differing by more than NOISY_MACHINE, or a config's race median and its full
# trial by more than TRIAL_GAP (``_records``, which the speed-up's range shares).
# A config whose trial ran more than this many times slower than the leader's trial is no finalist: two full
# trials that far apart are no measurement error (as TRIAL_GAP says), and its race run would cost a short budget
# a trial (on an H100, ConvNeXt-T's fp32 reference beside bf16 at 7x: 11 s of an 80 s reservation, 89 s left).
OUT_OF_REACH = 1 + TRIAL_GAP
# A race run measures speed alone (its config's accuracy was judged in its trial), so it trains only its
# warm-up and timed windows of about this many seconds each at the config's known rate, never longer than
# a trial. The slow fp32 baseline's runs shrink most: on the H200 demo, 8 s instead of 35 s.
RACE_WINDOW_SECONDS = 1.0
GRAPH_WARMUP_STEPS = 5  # the trial's warm-up under CUDA Graphs: eager steps, the capture, one replay


def race_budget(budget: Budget, config: TrialConfig, rate: float) -> Budget:
    """The budget of one race run of ``config`` (see ``RACE_WINDOW_SECONDS``); the trial's without a rate."""
    if not rate or rate <= 0:
        return budget
    return speed_budget(budget, config, max(1, math.ceil(RACE_WINDOW_SECONDS * rate / config.global_batch_size)))


def speed_budget(budget: Budget, config: TrialConfig, window_steps: int) -> Budget:
    """The budget of a speed-only run of ``config``: its warm-up, then timed windows of ``window_steps``
    optimizer steps each (a race run's, or the baseline's speed run apart from its references)."""
    accumulation = max(1, config.accumulation_steps)
    warmup = max(budget.warmup_steps, GRAPH_WARMUP_STEPS if config.cuda_graphs else 0)
    warmup_steps = -(-warmup // accumulation)  # optimizer steps
    samples = (warmup_steps + budget.windows * window_steps + 1) * config.global_batch_size
    return Budget(samples=min(budget.samples, samples), warmup_steps=budget.warmup_steps, windows=budget.windows)


def _candidates(study: optuna.Study, top_k: int) -> tuple[list[TrialRecord], Optional[TrialRecord], TrialConfig]:
    """The K fastest distinct feasible configs by their first run, less those out of reach (``OUT_OF_REACH``),
    and the baseline's trial (if it is one)."""
    feasible = _feasible(study)
    ranked: list[TrialRecord] = []
    for record in sorted(feasible, key=lambda r: -r.throughput):
        if record.config not in [r.config for r in ranked]:
            ranked.append(record)
    ranked = [r for r in ranked[:top_k] if r.throughput * OUT_OF_REACH >= ranked[0].throughput]
    baseline = TrialConfig.from_dict(study.user_attrs["baseline_config"])
    baseline_trial = next((r for r in ranked if r.config == baseline), None)
    baseline_trial = baseline_trial or next((r for r in feasible if r.config == baseline), None)
    return ranked, baseline_trial, baseline


def _entrants(study: optuna.Study, top_k: int) -> tuple[list[tuple[str, TrialConfig, float]], str, list[Optional[int]]]:
    """The race's entrants as (key, config, first-run rate), the baseline's key, and the signature."""
    ranked, baseline_trial, baseline = _candidates(study, top_k)
    entrants = [(str(r.number), r.config, r.throughput) for r in ranked]
    base_rate = float(study.user_attrs.get("baseline_throughput") or 0.0)
    if baseline_trial is None:
        entrants.append((BASELINE_KEY, baseline, base_rate))
    elif baseline_trial.number not in [r.number for r in ranked]:
        entrants.append((str(baseline_trial.number), baseline, baseline_trial.throughput))
    base_key = BASELINE_KEY if baseline_trial is None else str(baseline_trial.number)
    signature = [r.number for r in ranked] + [baseline_trial.number if baseline_trial else None]
    return entrants, base_key, signature


def run_seconds(study: optuna.Study, config: TrialConfig, rate: float, budget: Optional[Budget] = None, *,
                model: Optional[CostModel] = None) -> float:
    """Predicted wall seconds of one race run of ``config`` (its compile now a cached one); ``model``: the
    study's cost model when the caller has fitted it already."""
    model = model or CostModel.fit(samples_from_trials(study.get_trials(deepcopy=False)))
    samples = race_budget(budget, config, rate).samples if budget is not None else None
    return model.predict(config.to_dict(), rate=rate or None, samples=samples)


def race_seconds(study: optuna.Study, top_k: int, budget: Optional[Budget] = None) -> float:
    """What the race is kept free for while trials run: its first two runs, the leader's and the baseline's,
    the shortest race that reads the pick's speed-up from runs side by side. The race runs the other
    finalists, and further rounds, in what the budget has left then (``_Race.run``: each run that does not
    fit ends it). Keeping a whole round free (every finalist once) cost a short budget the trial that would
    have found a faster config: the finalists' runs are a check of the order, the pair is the answer. 0 when
    there is nothing to race."""
    if top_k < 1 or "baseline_config" not in study.user_attrs:
        return 0.0
    entrants, base_key, _ = _entrants(study, top_k)
    leader = next(((config, rate) for key, config, rate in entrants if key != base_key), None)  # fastest first
    return one_round_seconds(study, *leader, budget) if leader is not None else 0.0


def entrant_seconds(study: optuna.Study, top_k: int, budget: Optional[Budget] = None) -> tuple[dict[str, float], str]:
    """Each entrant's predicted seconds for one race run, by its key, and the baseline's key; none where there
    is nothing to race (fewer than two entrants)."""
    if top_k < 1 or "baseline_config" not in study.user_attrs:
        return {}, BASELINE_KEY
    entrants, base_key, _ = _entrants(study, top_k)
    if len(entrants) < 2:
        return {}, base_key
    model = CostModel.fit(samples_from_trials(study.get_trials(deepcopy=False)))
    return {key: run_seconds(study, config, rate, budget, model=model) for key, config, rate in entrants}, base_key


def one_round_seconds(study: optuna.Study, config: TrialConfig, rate: float, budget: Optional[Budget] = None, *,
                      model: Optional[CostModel] = None) -> float:
    """What one round of a race of ``config`` (at ``rate``) and the baseline alone is predicted to cost: the
    shortest race that still reads a speed-up, since each round runs the leader and the baseline first.
    ``model``: the study's cost model when the caller has fitted it already."""
    entrants, base_key, _ = _entrants(study, 1)
    base_config, base_rate = next((c, r) for key, c, r in entrants if key == base_key)
    model = model or CostModel.fit(samples_from_trials(study.get_trials(deepcopy=False)))
    return (run_seconds(study, config, rate, budget, model=model)
            + run_seconds(study, base_config, base_rate, budget, model=model))


def clearly_slower(ratios: list[float]) -> bool:
    """Whether a finalist's rates over the leader's (one per measurement) drop it from the race."""
    return len(ratios) >= 2 and all(r < 1.0 - CLEARLY_SLOWER for r in ratios)


def confirm_top_k(study: optuna.Study, runner: TrialRunner, options: ConfirmOptions, *, seed: int,
                  ui: _Progress, worker: str = "", clock: Optional[StudyClock] = None,
                  since: Optional[float] = None) -> bool:
    """Race the top K configs and the baseline (see the module's docstring), so that drift or one lucky
    sample cannot crown one, and so that the speed-up compares runs of the same rounds.

    ``since`` (when this run began) is recorded with the race: the full trials measured before it are an earlier
    run's, not side by side with the race's runs (``_records._speedup_evidence``).

    Skipped when the planner finds no race due (``race_due``: these configs were raced already in
    the run that began at ``since``), when a trial is still running (its worker races when it finishes), or
    when another worker holds the claim. Returns whether it ran.
    """

    if not race_due(study, options.top_k, since=since):  # top-1 still races the pick with the baseline
        return False
    entrants, base_key, signature = _entrants(study, options.top_k)
    if _running_elsewhere(study):
        return False
    if not _claim(study, signature, worker, ui=ui):
        return False
    race = _Race(study, entrants, base_key, options.confirm_rounds, since=since)
    with _ClaimLease(study, signature, worker):
        race.run(runner, seed=seed, ui=ui, clock=clock or StudyClock())
    if not race.rounds:
        return False  # the budget had no time for one run: nothing is recorded, a resume can race them
    study.set_user_attr(CONFIRMATION, {**race.record(signature, worker), "since": since})
    # The race is recorded: its claim is held no more (a resume that races these again takes it without a word).
    study.set_user_attr(CLAIM, {**(study.user_attrs.get(CLAIM) or {}), "done": True})
    return True


class _Race:
    """One race of finalists and the baseline; ``run`` races them, ``record`` is what the study keeps."""

    def __init__(self, study: optuna.Study, entrants: list[tuple[str, TrialConfig, float]], base_key: str,
                 max_rounds: int, since: Optional[float] = None) -> None:
        self.study = study
        self.since = since  # when this run began: full trials measured before it are an earlier run's
        self.entrants = entrants
        self.base_key = base_key
        self.max_rounds = max(1, max_rounds)
        self.first = {key: rate for key, _, rate in entrants}
        self.live = [key for key, _, _ in entrants if key != base_key]
        self.rounds: list[dict[str, Optional[float]]] = []
        self.loads: list[dict[str, Any]] = []
        self.energy: dict[str, list[float]] = {}  # joules per sample of each entrant's runs, where NVML counts them
        self.dropped: dict[str, str] = {}
        self.failures: dict[str, list[str]] = {}  # a finalist's failed race runs: "status: error" each
        self.ended = ""
        self.seconds = 0.0

    def _rates(self, key: str) -> list[float]:
        return [r[key] for r in self.rounds if r.get(key)]  # type: ignore[misc]

    def leader(self) -> Optional[str]:
        if not self.live:
            return None
        return max(self.live, key=lambda k: (statistics.median(self._rates(k)) if self._rates(k) else 0.0,
                                             self.first[k]))

    def _baseline_due(self) -> bool:
        runs = self._rates(self.base_key)
        if len(runs) < BASELINE_RUNS:
            return True
        # Disagreeing runs: one more says which was off, while rounds are left (it stays a range if not).
        return len(runs) == BASELINE_RUNS and disagreement(runs) > NOISY_MACHINE

    def _sequence(self, index: int) -> list[str]:
        # The leader and the baseline first: the speed-up is read from that pair, so a budget that ends the race
        # in its first round has measured it (the H100 demo's ran two finalists and no baseline). The next round
        # reverses both parts (A base B C, then base A C B), so a steady drift favours no entrant.
        lead = self.leader()
        pair = ([lead] if lead is not None else []) + ([self.base_key] if self._baseline_due() else [])
        rest = [k for k, _, _ in self.entrants if k in self.live and k not in pair]
        return pair + rest if index % 2 == 0 else pair[::-1] + rest[::-1]

    def _drop_slow(self) -> None:
        leader = self.leader()
        for key in list(self.live):
            if key == leader or key == self.base_key:
                continue
            ratios = [self.first[key] / self.first[leader]] if self.first[leader] else []  # type: ignore[index]
            ratios += [r[key] / r[leader] for r in self.rounds if r.get(key) and r.get(leader)]  # type: ignore[operator]
            if clearly_slower(ratios):
                self.live.remove(key)
                self.dropped[key] = (f"after round {len(self.rounds)}: slower than #{leader} by "
                                     f"{1 - max(ratios):.0%} or more in each of {len(ratios)} measurements")

    def _drop_failed(self, *, final: bool = False) -> None:
        """Drop a finalist whose race runs all failed: after two, or at the race's end after any. It has no
        race measurement to be judged by, and its failure is named (it ran in its trial, so it is flaky)."""
        for key in list(self.live):
            failures = self.failures.get(key, [])
            if key == self.base_key or self._rates(key) or not failures or (len(failures) < 2 and not final):
                continue
            self.live.remove(key)
            runs = f"each of its {len(failures)} race runs" if len(failures) > 1 else "its race run"
            self.dropped[key] = f"failed in {runs}: {failures[-1]}"

    def settled(self) -> bool:
        return len([k for k in self.live if k != self.base_key]) <= 1 and not self._baseline_due()

    def run(self, runner: TrialRunner, *, seed: int, ui: _Progress, clock: StudyClock) -> None:
        configs = {key: config for key, config, _ in self.entrants}
        started = time.monotonic()
        mine = {os.getpid()}
        for index in range(self.max_rounds):
            rates: dict[str, Optional[float]] = {}
            load: dict[str, Any] = {}
            for key in self._sequence(index):
                predicted = run_seconds(self.study, configs[key], self.first[key], runner.budget)
                if clock.budgeted and not clock.fits(predicted):
                    self.ended = (f"the budget: {clock.usable():.0f} s left, a run of "
                                  f"{'the baseline' if key == BASELINE_KEY else '#' + key} needs about {predicted:.0f} s")
                    break
                label = "the baseline" if key == BASELINE_KEY else f"#{key}"
                ui.status(f"race of {len(self.live)} finalist{'s' if len(self.live) != 1 else ''} and the "
                          f"baseline, round {index + 1}: {label}")
                before = machine_load(exclude_pids=mine)
                outcome = runner.run(configs[key], f"confirm-{key}-{index}", seed=seed,
                                     budget=race_budget(runner.budget, configs[key], self.first[key]),
                                     timeout=clock.cap(runner.timeout))
                ok = outcome.ok and outcome.measurement is not None
                rates[key] = outcome.measurement.throughput if ok else None  # type: ignore[union-attr]
                joules = outcome.measurement.extras.get("gpu.joules_per_sample") if ok else None  # type: ignore[union-attr]
                if joules is not None:
                    self.energy.setdefault(key, []).append(joules)
                if not ok:
                    self.failures.setdefault(key, []).append(
                        f"{outcome.status}: {outcome.error or 'no detail'}"[:300])
                load[key] = before
            if rates:
                self.rounds.append(rates)
                self.loads.append(load)
            if self.ended:
                break
            self._drop_failed()
            self._drop_slow()
            if self.settled():
                self.ended = "settled: " + ("one finalist left" if self.dropped or len(self.live) == 1
                                            else "the order held") + f" after {len(self.rounds)} rounds"
                break
        else:
            self._drop_failed(final=True)
            self.ended = f"{self.max_rounds} rounds, the most allowed" + (
                f"; #{', #'.join(self.live)} within {CLEARLY_SLOWER:.0%} of each other" if len(self.live) > 1 else "")
        self._drop_failed(final=True)
        self.seconds = time.monotonic() - started

    def _noise(self) -> tuple[float, str, bool]:
        """How far the race's own measurements disagree, past the thresholds (0 when they do not): the
        largest of each entrant's race runs among themselves (``NOISY_MACHINE``) and of its race median
        against its full trial (``TRIAL_GAP``) where that trial ran in this run (an earlier run's is no measure of
        this one's noise); the reason in words, and whether it is a trial's gap."""
        worst: tuple[float, str, bool] = (0.0, "", False)
        for key, _, _ in self.entrants:
            runs = self._rates(key)
            name = "the baseline" if key == self.base_key else f"#{key}"
            spread = disagreement(runs)
            if spread > NOISY_MACHINE and spread > worst[0]:
                worst = (spread, f"{name}'s own runs in the race differed by {spread:.0%}", False)
            trial = self.first.get(key) or 0.0
            if runs and trial > 0 and _trials_of_race_run(self.study, {"since": self.since}, (key,)):
                median = statistics.median(runs)
                gap = disagreement([median, trial])
                if gap > TRIAL_GAP and gap > worst[0]:
                    worst = (gap, f"{name}'s race runs (median {median:,.0f}/s) and its full trial ({trial:,.0f}/s) "
                                  f"differed by {gap:.0%}", True)
        return worst

    def record(self, signature: list[Optional[int]], worker: str) -> dict[str, Any]:
        keys = [k for k, _, _ in self.entrants]
        rounds = [{key: r.get(key) for key in keys} for r in self.rounds]
        throughputs = {int(k): self._rates(k) for k in keys if k != BASELINE_KEY}
        medians = {n: statistics.median(v) for n, v in throughputs.items() if v}
        eligible = {n: m for n, m in medians.items() if str(n) in self.live or str(n) == self.base_key}
        winner = max(eligible or medians, key=lambda n: (eligible or medians)[n]) if medians else None
        base_rates = [r.get(self.base_key) for r in rounds]
        base_ok = [v for v in base_rates if v]
        spread = disagreement(base_ok)
        noise, why, from_trials = self._noise()
        return {
            "trials": [n for n in signature[:-1] if n is not None],  # the finalists: the top K by first run
            "candidates": signature,
            "throughputs": throughputs,
            "medians": medians,
            "winner": winner,
            "rounds": rounds,  # per round, by trial number (or "baseline"); None where it failed or did not run
            "baseline": {"trial": None if self.base_key == BASELINE_KEY else int(self.base_key),
                         "throughputs": base_rates, "median": statistics.median(base_ok) if base_ok else None},
            "race": {"dropped": self.dropped, "ended": self.ended, "seconds": round(self.seconds, 3),
                     "runs": sum(1 for r in self.rounds for v in r.values() if v is not None),
                     "noisy": noise > 0, "baseline_disagreement": round(spread, 4),
                     "noise": round(noise, 4), "noisy_reason": why, "noise_from_trials": from_trials,
                     "load": self.loads, "joules_per_sample": self.energy},
            "trial_throughputs": {k: self.first[k] for k in keys},  # each entrant's full trial (or reference)
            "worker": worker,
            "at": time.time(),  # when it ended: a resume that began later races again (``race_due``)
        }


def _running_elsewhere(study: optuna.Study) -> bool:
    """A trial still runs in a live worker: that worker reaches this point after it and confirms then."""
    host = socket.gethostname()
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker = trial.user_attrs.get("worker", "")
        if not worker.startswith(f"{host}:") or _worker_alive(worker):
            return True
    return False


def _claim_stale(study: optuna.Study, claim: dict[str, Any]) -> str:
    """Why ``claim`` is held by no live worker any more ("" while its worker may still race).

    A worker on this host is judged by its process; one on another host by its lease (``LEASE_KEY`` in the
    claim, renewed while it races), as running trials are (``LeaseWatch``): older than the grace period,
    and seen unrenewed here for two renewal intervals.
    """
    worker = str(claim.get("worker", ""))
    if worker.startswith(f"{socket.gethostname()}:"):
        return "" if _worker_alive(worker) else f"worker {worker} is gone"
    watch = LeaseWatch(study._storage)
    lease = claim.get(LEASE_KEY, claim.get("at", 0.0))
    lease = float(lease) if isinstance(lease, (int, float)) else 0.0
    if time.time() - lease <= watch.grace:
        return ""
    watch.stale_since(CLAIM, lease)
    time.sleep(2 * watch.interval)
    if (study.user_attrs.get(CLAIM) or {}) != claim:
        return ""  # renewed, or claimed by another worker meanwhile
    age = watch.stale_since(CLAIM, lease)
    if age is None:
        return ""
    return f"worker {worker or '(unknown)'} renewed no lease for {age:.0f}s (grace period {watch.grace:g}s)"


def _claim(study: optuna.Study, signature: list[Optional[int]], worker: str, *, ui: Optional[_Progress] = None) -> bool:
    """Claim the re-measurement of these candidates for ``worker``: False when another live worker has.

    Optuna's storages have no compare-and-set, so this is Fischer's algorithm: check, write, wait longer
    than a write takes, read back. Of workers that claim at the same moment only the last writer keeps
    it; one that comes later sees the claim and leaves it, unless its worker is gone (``_claim_stale``):
    then it takes the claim over and says so in one line.
    """
    claim = study.user_attrs.get(CLAIM)
    if claim and not claim.get("done") and claim.get("candidates") == signature and claim.get("worker") != worker:
        stale = _claim_stale(study, claim)
        if not stale:
            return False
        line = f"autotune: taking over the race of the finalists: the claim's {stale}"
        if ui is not None and ui.shows():
            ui.say(line)
        else:
            print(line, file=sys.stderr, flush=True)
    now = time.time()
    study.set_user_attr(CLAIM, {"worker": worker, "candidates": signature, "at": now, LEASE_KEY: round(now, 3)})
    others = {t.user_attrs.get("worker") for t in study.get_trials(deepcopy=False)} - {worker, None}
    if not others and not claim:
        return True  # this process ran every trial: nobody else can be claiming
    time.sleep(CLAIM_SETTLE_SECONDS)
    claim = study.user_attrs.get(CLAIM) or {}
    return claim.get("worker") == worker and claim.get("candidates") == signature


class _ClaimLease:
    """Renews the claim's lease while its worker races, so that workers on other hosts see it alive."""

    def __init__(self, study: optuna.Study, signature: list[Optional[int]], worker: str) -> None:
        self.study, self.signature, self.worker = study, signature, worker
        self.interval, _ = lease_timing(study._storage)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="autotune-claim-lease", daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                claim = self.study.user_attrs.get(CLAIM) or {}
                if claim.get("worker") != self.worker:
                    return  # taken over while this worker was paused: its race result still records
                self.study.set_user_attr(CLAIM, {**claim, LEASE_KEY: round(time.time(), 3)})
            except Exception:  # noqa: BLE001 - the storage is gone; the race's own writes will say so
                return

    def __enter__(self) -> "_ClaimLease":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def confirm_long(study: optuna.Study, runner: TrialRunner, options: ConfirmOptions, *, seed: int,
                 metric_direction: str, ui: _Progress) -> None:
    """Train the best config and the fp32 reference for ``confirm_samples`` each and record both."""
    best = _best_record(study)
    if best is None:
        return
    budget = Budget(samples=options.confirm_samples or 0, warmup_steps=runner.budget.warmup_steps,
                    windows=runner.budget.windows)
    report: dict[str, Any] = {"samples": budget.samples}
    for role, config in (("reference", runner.baseline.replace(precision="fp32")), ("best", best.config)):
        ui.status(f"confirmation: {role} for {budget.samples} samples")
        outcome = runner.run(config, f"confirm-{role}", seed=seed, budget=budget,
                             timeout=runner.timeout * max(1.0, budget.samples / runner.budget.samples))
        report[role] = outcome.to_dict()
    ref_m = (report["reference"].get("measurement") or {}).get("metric")
    best_m = (report["best"].get("measurement") or {}).get("metric")
    if ref_m is not None and best_m is not None:
        report["accuracy_loss"] = ref_m - best_m if metric_direction == "maximize" else best_m - ref_m
    study.set_user_attr("confirmation", report)


def race_due(study: Any, top_k: int, *, since: Optional[float] = None) -> bool:
    """Whether the finalists of now, with the baseline, are two or more and were not raced already in this run.

    A race recorded before ``since`` (this run's start) measured its runs in an earlier run of the study, under
    whatever load that run had: a resume races the pick and the baseline again, so that the speed-up it states
    is a ratio of runs measured side by side now (``_records.EARLIER_BASELINE`` says why where it cannot).
    Without ``since``, finalists raced already are not raced again."""
    if top_k < 1 or "baseline_config" not in study.user_attrs:
        return False
    entrants, _, signature = _entrants(study, top_k)
    previous = study.user_attrs.get(CONFIRMATION) or {}
    earlier = since is not None and float(previous.get("at") or 0.0) < since
    return len(entrants) >= 2 and (previous.get("candidates") != signature or earlier)
