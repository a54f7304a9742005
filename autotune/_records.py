"""A stored study read back as typed records, and where a study's files live.

The one place that knows how trials are stored (their user attributes and constraints): the tuner reads
its own study through it while it runs, and ``autotune best``, ``load_best`` and the report afterwards.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import warnings
from pathlib import Path
from typing import Any, Optional

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune._config import Result, TrialConfig, TrialRecord
from autotune._errors import StudyError

DEFAULT_STUDIES_DIR = Path("studies")


MAX_STUDY_NAME = 200  # characters: the folder name, with room for a suffix, stays under 255 bytes
# Names under studies_dir that are not a study's folder: the dashboard's artifact store (a study there would
# share it), the default SQLite storage and its side files, the journal of --workers and its lock.
RESERVED_NAMES = frozenset({"artifacts", "autotune.db", "autotune.db-journal", "autotune.db-wal", "autotune.db-shm",
                            "autotune.journal", "autotune.journal.lock"})


def study_dir(study_name: str, studies_dir: Path = DEFAULT_STUDIES_DIR) -> Path:
    """The study's folder under ``studies_dir``: one per name, never outside it.

    A name with other characters than letters, digits, ``-``, ``_`` and ``.`` keeps a short hash of
    itself, so that ``x y`` and ``x_y`` do not share a folder (and overwrite each other's files).

    Raises:
        StudyError: the name is empty, ``.`` or ``..``, reserved (``RESERVED_NAMES``), holds a path separator, or
            is too long.
    """
    if study_name in RESERVED_NAMES:
        raise StudyError(f"study name {study_name!r}: {studies_dir}/{study_name} is autotune's own (the dashboard's "
                         "artifacts, the default storage); pick another name")
    if study_name in ("", ".", "..") or any(c in study_name for c in "/\\\0"):
        raise StudyError(f"study name {study_name[:60]!r}: it names a folder under {studies_dir}, so it must not be "
                         "empty, '.', '..' or hold '/' or '\\'")
    if len(study_name) > MAX_STUDY_NAME:
        raise StudyError(f"study name {study_name[:40]!r}...: {len(study_name)} characters; at most {MAX_STUDY_NAME}")
    safe = "".join(c if c.isascii() and (c.isalnum() or c in "-_.") else "_" for c in study_name)
    if safe != study_name:
        safe = f"{safe}-{hashlib.sha256(study_name.encode()).hexdigest()[:8]}"
    return studies_dir / safe



# Study attributes, with the batch size appended, of accuracy_reference="batch": the fp32 reference metric
# at that batch, the spread of its seeds (its noise band), or why its run failed.
BATCH_REFERENCE = "reference_metric:batch="
BATCH_REFERENCE_NOISE = "reference_noise:batch="
BATCH_REFERENCE_FAILED = "reference_failed:batch="
# The fp32 references' loss statistics and metrics (a ReferenceBand as a dict): at the baseline's global
# batch, and, under batch_policy scale, at each other global batch a trial used.
REFERENCE_BAND = "reference_band"
# Trial statuses of configs answered without a run (PRUNED, with the reason in ``pruned_reason``): the memory
# rule's, and those holding values that cannot run together here (``SearchSpace.cannot_run``).
CANNOT_RUN = "cannot_run"
OVER_BUDGET = "over_budget"  # proposed when the study's budget had no time left for it: not run
NOT_RUN = ("infeasible", CANNOT_RUN, OVER_BUDGET)
BATCH_REFERENCE_BAND = "reference_band:batch="


def batch_references(attrs: dict[str, Any]) -> dict[int, float]:
    """The fp32 reference metric per batch size that a study recorded, by batch size."""
    return _by_batch(attrs, BATCH_REFERENCE)


def batch_reference_noise(attrs: dict[str, Any]) -> dict[int, float]:
    """The noise band of each per-batch reference run with two or more seeds, by batch size."""
    return _by_batch(attrs, BATCH_REFERENCE_NOISE)


def reference_bands(attrs: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Every global batch's fp32 reference band a study recorded (the baseline's included), by global batch."""
    bands: dict[int, dict[str, Any]] = dict(_by_batch(attrs, BATCH_REFERENCE_BAND))
    baseline = attrs.get("baseline_config") or {}
    if REFERENCE_BAND in attrs and baseline:
        bands[int(baseline.get("global_batch") or baseline.get("batch_size", 0))] = attrs[REFERENCE_BAND]
    return bands


def _by_batch(attrs: dict[str, Any], prefix: str) -> dict[int, Any]:
    return {int(k[len(prefix):]): v for k, v in attrs.items() if k.startswith(prefix)}


def _record(trial: FrozenTrial) -> Optional[TrialRecord]:
    config = trial.user_attrs.get("config")
    if config is None or trial.values is None:
        return None
    feasible = all(v <= 0 for v in trial.constraints.values())
    return TrialRecord(
        number=trial.number,
        config=TrialConfig.from_dict(config),
        throughput=trial.values[0],
        accuracy_loss=trial.values[1],
        status=trial.user_attrs.get("status", "ok"),
        feasible=feasible,
        device=trial.user_attrs.get("device", ""),
    )


def _records(study: optuna.Study) -> list[TrialRecord]:
    out = []
    superseded = set(study.user_attrs.get(SUPERSEDED) or ())
    for trial in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if trial.number in superseded:
            continue
        record = _record(trial)
        if record is not None:
            out.append(record)
    return out


def _feasible(study: optuna.Study) -> list[TrialRecord]:
    return [r for r in _records(study) if r.feasible and r.status == "ok"]


CONFIRMATION = "top_k_confirmation"  # the study attribute of the top-K re-measurement (study/_confirm)
# A race (study/_confirm) calls the machine noisy where a finalist's own race runs differ by more than its
# NOISY_MACHINE, or any config's race median and its full trial by more than this (max / min - 1): a race run
# is shorter than a trial (about a second a window), so the two agree less closely than two race runs, yet a
# factor of 1.5 is no measurement error. The speed-up's range reads it too.
TRIAL_GAP = 0.5
# What "faster than the baseline" means for the first faster config: more than this many times its rate. Two runs
# of one config differ by a few percent (an H100 GPT-2's fp32 reference, run with two DataLoader workers, read
# 1.006x the baseline's own speed run), so a config within that is no faster config to report.
FASTER_BY = 1.05


def disagreement(rates: list[float]) -> float:
    """max / min - 1 of a config's runs (0 with fewer than two)."""
    rates = [r for r in rates if r]
    return max(rates) / min(rates) - 1.0 if len(rates) >= 2 and min(rates) > 0 else 0.0

# Study attribute: the baseline's own speed run is still to come (``study/_references``): under a budget it runs
# after the first full trial, and until then the references' rate stands in for the baseline's.
BASELINE_SPEED_PENDING = "baseline_speed_pending"
# Study attribute: the fp32 reference seeds its references hold so far. Under a budget the seeds after the
# first may run after the first full trial (``_planner.seeds_first``); a record without it holds them all.
REFERENCE_SEEDS = "reference_seeds"
COLOCATION = "colocation_warning"  # the study attribute of the shared-device warning (study/_workers)
# Study attribute: trials whose verdict a later run of the same config on longer evidence replaced
# (``study/_planner.EXTEND``): that run's trial stands for the config, and these no longer count.
SUPERSEDED = "superseded_trials"
# Study attribute: why this run's speed-up divides by baseline runs of an earlier run of the study ("" or absent
# when it does not): a speed-up is a ratio of runs measured side by side, so a resume races the pick and the
# baseline again (``study/_confirm.race_due``), and where it could not, the summary says so in one line.
EARLIER_BASELINE = "earlier_baseline"


def _best_record(study: optuna.Study) -> Optional[TrialRecord]:
    """The fastest feasible trial; after a top-K confirmation, its winner with its median.

    A confirmed median is never beaten by a single run: a config first measured after the confirmation
    (e.g. on a resume) becomes the best only once a new confirmation (which reruns over the new top K)
    crowns it.
    """
    return best_of(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)), study.user_attrs)


def best_of(trials: list[FrozenTrial], study_attrs: dict[str, Any]) -> Optional[TrialRecord]:
    """``_best_record`` from a study's trials and user attributes (what optuna-dashboard's server holds)."""
    superseded = set(study_attrs.get(SUPERSEDED) or ())
    records = [_record(t) for t in trials if t.state == TrialState.COMPLETE and t.number not in superseded]
    feasible = [r for r in records if r is not None and r.feasible and r.status == "ok"]
    confirmed = study_attrs.get(CONFIRMATION) or {}
    if confirmed.get("winner") is not None:
        winner = int(confirmed["winner"])
        medians = {int(k): v for k, v in confirmed["medians"].items()}
        for record in feasible:
            if record.number == winner:
                # A race that ended before the baseline ran beside the winner confirmed nothing: its short runs
                # do not replace the trial's own measurement (an H100 ViT-S/16's one race run read 1,530/s
                # where its trial read 2,162).
                return dataclasses.replace(record, throughput=medians[winner]) if _beside_baseline(confirmed) \
                    else record
    return max(feasible, key=lambda r: r.throughput, default=None)


def _beside_baseline(confirmed: dict[str, Any]) -> bool:
    """Whether a race record ran its winner and the baseline in one round."""
    base = (confirmed.get("baseline") or {}).get("trial")
    base_key, winner = "baseline" if base is None else str(base), str(confirmed.get("winner"))
    return any(r.get(winner) and r.get(base_key) for r in confirmed.get("rounds") or [])


def _distinct_configs(study: optuna.Study) -> set[str]:
    """The configs of the space that are done (configs that cannot run here are no part of its size)."""
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
    return {json.dumps(t.params, sort_keys=True) for t in done
            if t.user_attrs.get("status") not in (CANNOT_RUN, OVER_BUDGET)}


def _budget_trials(study: optuna.Study, states: tuple[TrialState, ...]) -> list[FrozenTrial]:
    """Trials that spend the budget: configs ruled out without a run (``NOT_RUN``) cost none and do not."""
    return [t for t in study.get_trials(deepcopy=False, states=states) if t.user_attrs.get("status") not in NOT_RUN]


@dataclasses.dataclass(frozen=True)
class _SpeedupEvidence:
    """The baseline throughput a speed-up divides by, and the spread of the ratio (see ``Result``)."""

    baseline_throughput: float
    low: float = math.nan
    high: float = math.nan
    basis: str = "single runs"
    rounds: int = 0
    noisy: float = 0.0  # the race's runs disagreed this much (max / min - 1) on a noisy machine
    noisy_reason: str = ""  # which runs disagreed, in words


def _baseline_throughput(study: optuna.Study) -> float:
    """The baseline's median from the top-K alternation when it took part, else its reference run, so
    that the speed-up compares medians measured the same way."""
    return _speedup_evidence(study, _best_record(study)).baseline_throughput


def _speedup_evidence(study: optuna.Study, best: Optional[TrialRecord]) -> _SpeedupEvidence:
    attrs = study.user_attrs
    confirmed = attrs.get(CONFIRMATION) or {}
    baseline = confirmed.get("baseline") or {}
    winner = confirmed.get("winner")
    if best is not None and winner is not None and int(winner) == best.number and baseline.get("median"):
        # Pair each round's winner run with the same round's baseline run: the spread of those ratios
        # is what the alternation says about the speed-up.
        import statistics


        key = str(best.number)
        pairs = [(r.get(key), b) for r, b in zip(confirmed.get("rounds", []), baseline["throughputs"])]
        ratios = [w / b for w, b in pairs if w and b]
        race = confirmed.get("race") or {}
        mine = [r.get(key) for r in confirmed.get("rounds", []) if r.get(key)]
        theirs = [b for b in baseline["throughputs"] if b]
        trials = confirmed.get("trial_throughputs") or {}
        base_key = "baseline" if baseline.get("trial") is None else str(baseline["trial"])
        own, base = trials.get(key), trials.get(base_key)
        if not _trials_of_race_run(study, confirmed, (key, base_key)):
            own = base = None  # an earlier run's trials are no pair beside this run's race: the race alone speaks
        # The full trials join the range whenever either one's race runs are more than TRIAL_GAP from it
        # (not only when that gap was the race's largest source of noise), and whenever the trials say slower
        # where the race says faster: a range never says "faster" where the pick's own trial ran slower.
        trials_join = bool(own and base) and (
            bool(race.get("noise_from_trials"))
            or any(runs and disagreement([statistics.median(runs), trial]) > TRIAL_GAP
                   for runs, trial in ((mine, own), (theirs, base)))
            or (own < base and min(ratios, default=math.inf) > 1.0))
        if race.get("noisy") or trials_join:
            # The machine's speed moved under the race (or away from the trials): any of the pick's runs against
            # any of the baseline's, with their full trials where those join.
            if trials_join:
                mine, theirs = [*mine, own], [*theirs, base]
            noise = float(race.get("noise", race.get("baseline_disagreement", 0.0)))
            if race.get("noisy"):
                reason = race.get("noisy_reason") or f"the baseline's own runs in the race differed by {noise:.0%}"
            else:
                noise = disagreement([min(ratios, default=own / base), own / base])
                reason = (f"the race's runs and the full trials disagreed: #{key}'s trial ran at {own:,.0f}/s "
                          f"against the baseline's {base:,.0f}/s")
            return _SpeedupEvidence(baseline["median"], min(mine) / max(theirs), max(mine) / min(theirs),
                                    "alternation", len(ratios), noisy=noise, noisy_reason=reason)
        return _SpeedupEvidence(baseline["median"], min(ratios, default=math.nan), max(ratios, default=math.nan),
                                "alternation", len(ratios))
    reference = attrs.get("baseline_throughput", math.nan)
    if best is None:
        return _SpeedupEvidence(reference)
    ratio = best.throughput / reference if reference and reference > 0 else math.nan
    baseline_config = attrs.get("baseline_config")
    if baseline_config is not None and best.config == TrialConfig.from_dict(baseline_config):
        return _SpeedupEvidence(reference, ratio, ratio)  # one config against itself: no spread to speak of
    mine = study.get_trials(deepcopy=False)[best.number].user_attrs.get("window_throughputs") or []
    # The baseline's own run: its speed run where the references ran with another loader (``_references``).
    theirs = (attrs.get("baseline_speed") or attrs.get("reference_measurement") or {}).get("window_throughputs") or []
    if not mine or not theirs or min(theirs) <= 0:
        return _SpeedupEvidence(reference, ratio, ratio)
    return _SpeedupEvidence(reference, min(mine) / max(theirs), max(mine) / min(theirs))


def _trials_of_race_run(study: optuna.Study, confirmed: dict[str, Any], keys: tuple[str, ...]) -> bool:
    """Whether the full trials of ``keys`` (trial numbers, or "baseline": its fp32 references, dated by the
    reference trial or else the study's first trial) were measured in the run of the study that raced them (its
    ``since``), so that their ratio joins the race's as runs of one run. A race without ``since`` (a joining
    worker's, or recorded before runs were told apart) keeps them."""
    since = confirmed.get("since")
    if since is None:
        return True
    trials = study.get_trials(deepcopy=False)
    for key in keys:
        if key.isdigit():
            began = trials[int(key)].datetime_start if int(key) < len(trials) else None
        else:  # the references ran in the run that made the study, before its first trial (when none is trial 0)
            references = [t for t in trials if t.user_attrs.get("role") == "reference"] or trials
            began = min((t.datetime_start for t in references if t.datetime_start is not None), default=None)
        if began is None or began.timestamp() < float(since):
            return False
    return True


def summarize_study(study: optuna.Study, *, storage_url: str = "") -> Result:
    """Read a study's best feasible config, baseline and Pareto set."""
    attrs = study.user_attrs
    if "baseline_config" not in attrs:
        raise StudyError(f"study {study.study_name!r} has no reference run yet; run `autotune tune` first")
    feasible_numbers = {r.number for r in _feasible(study)}
    pareto = tuple(
        r for r in (_record(t) for t in study.best_trials) if r is not None and r.number in feasible_numbers
    )
    per_device: dict[str, TrialRecord] = {}
    for record in _feasible(study):
        if record.device not in per_device or record.throughput > per_device[record.device].throughput:
            per_device[record.device] = record
    if len(per_device) > 1:
        warnings.warn(
            f"study {study.study_name!r} has trials from {len(per_device)} device models "
            f"({', '.join(sorted(per_device))}); their throughputs are not comparable, see best_per_device",
            stacklevel=2,
        )
    best = _best_record(study)
    evidence = _speedup_evidence(study, best)
    return Result(
        best_per_device=per_device if len(per_device) > 1 else {},
        study_name=study.study_name,
        storage=storage_url,
        best=best,
        baseline=TrialConfig.from_dict(attrs["baseline_config"]),
        baseline_throughput=evidence.baseline_throughput,
        speedup_low=evidence.low,
        speedup_high=evidence.high,
        speedup_basis=evidence.basis,
        speedup_rounds=evidence.rounds,
        noisy=evidence.noisy,
        noisy_reason=evidence.noisy_reason,
        colocation_warning=attrs.get(COLOCATION, ""),
        baseline_source=attrs.get("baseline_source", "") + (
            "; its own speed run did not fit the budget, so the fp32 reference's rate (with the prior point's "
            "loader, faster than its own) stands in for it: the speed-up is understated"
            if attrs.get(BASELINE_SPEED_PENDING) and evidence.basis != "alternation" else "")
        + (f"; {attrs[EARLIER_BASELINE]}" if attrs.get(EARLIER_BASELINE) else ""),
        reference_metric=attrs.get("reference_metric"),
        metric_noise=attrs.get("metric_noise", 0.0),
        pareto=tuple(sorted(pareto, key=lambda r: -r.throughput)),
        removed_knobs=dict(attrs.get("removed_knobs", {})),
        ruled_out_faster=_ruled_out_faster(study, evidence.baseline_throughput,
                                           best.throughput if best is not None else 0.0),
    )


def _ruled_out_faster(study: optuna.Study, baseline_throughput: float, pick_throughput: float = 0.0) -> str:
    """The full trials faster than the baseline and the pick (``pick_throughput``) that the accuracy verdict
    ruled out, in words ("" when none), with the evidence's length where the budget shortened it: a longer study
    trains longer evidence. A pick slower than such a trial is the answer on this evidence, not the workload's."""
    bar = max(baseline_throughput, pick_throughput)
    faster = [t for t in study.get_trials(deepcopy=False)
              if t.state == optuna.trial.TrialState.COMPLETE and t.user_attrs.get("role") != "reference"
              # study._verdict's INFEASIBLE_VERDICTS: records sit below the study layer and cannot import it
              and t.user_attrs.get("accuracy_verdict") in ("degraded", "diverged")
              and baseline_throughput > 0 and (t.user_attrs.get("throughput") or 0.0) > bar]
    if not faster:
        return ""
    ratios = sorted(t.user_attrs["throughput"] / baseline_throughput for t in faster)
    first = faster[0]
    text = (f"{len(faster)} full trial{'s' if len(faster) != 1 else ''} ran {ratios[0]:.1f}x"
            + (f"-{ratios[-1]:.1f}x" if len(ratios) > 1 else "") + " the baseline's throughput but the accuracy "
            f"verdict judged {'them' if len(faster) != 1 else 'it'} {first.user_attrs['accuracy_verdict']} (trial "
            f"#{first.number}: {first.user_attrs.get('accuracy_evidence', 'no evidence recorded')})")
    shortened = study.user_attrs.get("references_shortened")
    if isinstance(shortened, dict) and shortened.get("samples") and shortened.get("from_samples"):
        text += (f"; the evidence was shortened to {shortened['samples']:,} of {shortened['from_samples']:,} samples "
                 "by the budget: a larger --budget trains longer evidence")
        if shortened.get("full_length_budget_minutes"):
            text += f" (about --budget {shortened['full_length_budget_minutes']} trains the full length)"
    return text
