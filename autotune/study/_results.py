"""What a study writes out: ``best_config.json``."""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from pathlib import Path
from typing import Any, Optional

import optuna

from autotune._config import ALLOC_CONF_ENV, EXPANDABLE_SEGMENTS, Result, TrialConfig, dumps
from autotune._files import write_atomic
from autotune._records import CONFIRMATION, study_dir
from autotune.insight._report import energy_record


def best_config_document(study: optuna.Study, result: Result, unconfirmed: str = "", *,
                         written: Optional[str] = None) -> dict[str, Any]:
    """What ``best_config.json`` holds; ``unconfirmed`` says why this run did not race the pick ("" if it did).

    ``written`` is when the file was written (ISO 8601, UTC): now for a file being written, the file's own
    for one read back (``written_at``), None where no file was written.
    """
    best = result.best
    trial = study.trials[best.number] if best else None
    measurement = {k: v for k, v in (trial.user_attrs.items() if trial else []) if k not in ("config",)}
    # What to train with: the pick when it is faster, else the baseline (a slower config is never offered).
    chosen = result.best_config or result.baseline
    # The chosen config's own trial records (what it compiled, converted, packed): none for a baseline kept.
    chosen_attrs = trial.user_attrs if trial and (result.faster or result.is_baseline) else {}
    return {
        "study": study.study_name,
        "target": study.user_attrs.get("target"),
        "script_args": study.user_attrs.get("script_args"),  # the script's own arguments: autotune train's default
        "config": result.best_config.to_dict() if result.best_config else None,
        "keep_baseline": result.keep_baseline,
        # The fastest config measured, when it is not the one to train with (slower, or inside the spread).
        "not_recommended": ({"config": best.config.to_dict(), "trial": best.number, "why": result.why_not_faster}
                            if best and result.keep_baseline and not result.is_baseline else None),
        "trial": best.number if best else None,
        "throughput": best.throughput if best else None,
        "speedup": None if not best or math.isnan(result.speedup) else result.speedup,
        # "speedup" is the measured ratio; "faster" says whether it clears its spread (else the verdict is
        # NO_FASTER_CONFIG and no speed-up is claimed).
        "faster": result.faster,
        "verdict": result.verdict,
        # Where nothing feasible was found: the faster trials the accuracy verdict ruled out, and why.
        "why_none": result.why_not_faster if best is None else None,
        # Where a pick exists: the faster trials the accuracy verdict ruled out, how long their evidence was.
        "ruled_out_faster": (result.ruled_out_faster or None) if best is not None else None,
        "speedup_spread": {"low": _number(result.speedup_low), "high": _number(result.speedup_high),
                           "basis": result.speedup_basis, "rounds": result.speedup_rounds,
                           "what": result.spread_text},
        "colocation_warning": result.colocation_warning or None,
        "accuracy_loss": best.accuracy_loss if best else None,
        "baseline": {"config": result.baseline.to_dict(), "throughput": result.baseline_throughput,
                     "source": result.baseline_source or None},
        "reference_metric": result.reference_metric,
        "metric_noise": result.metric_noise,
        "measurement": measurement,
        "removed_knobs": result.removed_knobs,
        "fingerprint": study.user_attrs.get("hardware", {}),
        "confirmation": study.user_attrs.get("confirmation"),
        "batch_policy": _batch_policy(chosen, study.user_attrs),
        "packing": _packing(chosen, chosen_attrs, cuda=bool((study.user_attrs.get("hardware") or {}).get("cuda"))),
        # What the loader knobs ask of the user's own training code (loader=device: data kept on the device).
        "input_pipeline": chosen.input_pipeline,
        # What precision=fp8 and the allocator knob ask of the user's own code, and what the trial converted.
        "float8": _float8(chosen, chosen_attrs),
        "allocator": _allocator(chosen),
        # Under compile: what the trial compiled (the whole model, or its repeated blocks one by one).
        "compile": _compile(chosen, chosen_attrs),
        "accuracy_verdict": trial.user_attrs.get("accuracy_verdict") if trial else None,
        "accuracy_evidence": trial.user_attrs.get("accuracy_evidence") if trial else None,
        "accuracy_check": _accuracy_check(study.user_attrs.get("accuracy_check")),
        "confirmed": confirmation_status(study, result, unconfirmed),
        "time_split": study.user_attrs.get("time_split"),
        # The order of the study: when a faster config was first measured, and how long its evidence is.
        "time_to_first_faster": study.user_attrs.get("first_faster"),
        "evidence_length": _evidence_length(study.user_attrs),
        # Joules per sample of the best's timed windows (NVML's energy counter), or why not measured.
        # With --train-minutes/--train-steps declared: what the pick means for the real run's time.
        "real_run": real_run_estimate(study.user_attrs, result),
        "energy": energy_record(trial.user_attrs if trial else {},
                                cuda=bool((study.user_attrs.get("hardware") or {}).get("cuda"))),
        "written": written,
    }


def real_run_estimate(attrs: dict[str, Any], result: Result) -> Optional[dict[str, Any]]:
    """The declared real training (``train_steps`` at the baseline's global batch, or ``train_minutes`` with the
    pick) in time with the baseline and with the pick, the range from the speed-up's spread; None undeclared.

    "N steps take X with the baseline and Y with the pick": the same samples at each one's throughput.
    """
    steps, minutes = attrs.get("train_steps"), attrs.get("train_minutes")
    best, base_rate = result.best, result.baseline_throughput
    if (steps is None and minutes is None) or best is None or not base_rate or not best.throughput:
        return None
    batch = result.baseline.global_batch_size
    speedup = best.throughput / base_rate
    low = result.speedup_low if not math.isnan(result.speedup_low) else speedup
    high = result.speedup_high if not math.isnan(result.speedup_high) else speedup
    if steps is not None:
        samples = int(steps) * batch
        baseline_s = samples / base_rate
        pick_s, pick_lo, pick_hi = baseline_s / speedup, baseline_s / high, baseline_s / low
        base_lo = base_hi = baseline_s
        what = (f"{int(steps):,} steps ({samples:,} samples at the baseline's global batch {batch}) take "
                f"{_span(baseline_s)} with the baseline and {_span(pick_s)} with the pick "
                f"({_span(pick_lo)}-{_span(pick_hi)} from the speed-up's spread {low:.2f}x-{high:.2f}x)")
    else:
        pick_s = pick_lo = pick_hi = float(minutes) * 60
        samples = int(pick_s * best.throughput)
        baseline_s, base_lo, base_hi = pick_s * speedup, pick_s * low, pick_s * high
        what = (f"{samples // batch:,} steps ({samples:,} samples, the declared {float(minutes):g} minutes with the pick) "
                f"take {_span(baseline_s)} with the baseline ({_span(base_lo)}-{_span(base_hi)} from the speed-up's "
                f"spread {low:.2f}x-{high:.2f}x) and {_span(pick_s)} with the pick")
    return {"steps": samples // batch, "samples": samples, "baseline_seconds": baseline_s,
            "baseline_seconds_low": base_lo, "baseline_seconds_high": base_hi, "pick_seconds": pick_s,
            "pick_seconds_low": pick_lo, "pick_seconds_high": pick_hi, "what": what}


def _span(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def written_at(path: Path) -> Optional[str]:
    """When ``best_config.json`` at ``path`` was written (its ``written`` field), or None without one."""
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("written")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def confirmation_status(study: optuna.Study, result: Result, unconfirmed: str = "") -> dict[str, Any]:
    """How well the pick was confirmed: by a race (its rounds, runs, spread, how it ended), or not, and why."""
    race_record = study.user_attrs.get(CONFIRMATION) or {}
    best = result.best
    if unconfirmed or best is None or race_record.get("winner") is None or int(race_record["winner"]) != best.number:
        return {"confirmed": False,
                "why": unconfirmed or ("nothing feasible was found" if best is None else "the pick was not raced"),
                "basis": result.speedup_basis}
    race = race_record.get("race") or {}
    if result.speedup_basis != "alternation":
        # The pick won the race without a run of the baseline beside one of its own: its speed-up is still
        # the single runs', so it is not called confirmed (the CLI's caption says single runs too).
        rounds = len(race_record.get("rounds", []))
        return {"confirmed": False, "basis": result.speedup_basis,
                "why": f"the race ended after {race.get('runs')} run(s) in {rounds} round(s), before the baseline "
                       "ran beside the pick: the speed-up is from single runs"
                       + (f" ({race['ended']})" if race.get("ended") else ""),
                "rounds": rounds, "runs": race.get("runs"), "ended": race.get("ended")}
    return {"confirmed": True, "rounds": len(race_record.get("rounds", [])), "runs": race.get("runs"),
            "ended": race.get("ended"), "dropped": race.get("dropped"), "noisy": bool(race.get("noisy")),
            "spread": {"low": _number(result.speedup_low), "high": _number(result.speedup_high)},
            "seconds": race.get("seconds")}


def _accuracy_check(check: Optional[dict[str, Any]]) -> dict[str, Any]:
    """The study's accuracy check: ``blind`` (no part of it can see a loss), ``partly_blind`` (one part cannot,
    the verdict rests on the other) and the reasons."""
    check = dict(check or {"blind": None, "reasons": []})
    check["partly_blind"] = not check.get("blind") and bool(check.get("reasons"))
    return check


def _batch_policy(config: Any, attrs: dict[str, Any]) -> dict[str, Any]:
    """Which batch policy the study used, and the config's global batch, micro-batch and accumulation."""
    return {
        "policy": attrs.get("batch_policy", config.batch_policy),
        "global_batch": config.global_batch_size,
        "micro_batch": config.batch_size,
        "accumulation_steps": config.accumulation_steps,
    }


def _packing(config: Any, attrs: dict[str, Any], *, cuda: bool = True) -> dict[str, Any]:
    """How the config packs a GPU: processes per GPU, each one's memory fraction, MPS, in words too, and how
    the co-located copies were measured (their overlap) when they were. A study without CUDA packs the CPU."""
    what = config.packing if cuda else (
        "one training process (no GPU)" if config.processes_per_gpu == 1
        else f"{config.processes_per_gpu} independent training processes sharing the CPU's cores (no GPU)")
    packing: dict[str, Any] = {"processes_per_gpu": config.processes_per_gpu, "memory_fraction": config.memory_fraction,
                               "mps": config.mps, "what": what}
    if attrs.get("colocation_summary"):
        packing["measured"] = attrs["colocation_summary"]
        packing["copy_throughputs"] = attrs.get("copy_throughputs")
    return packing


def _float8(config: TrialConfig, attrs: dict[str, Any]) -> Optional[dict[str, Any]]:
    """Under ``precision=fp8``: how to apply it, and which linear layers the trial converted or left (why)."""
    if config.precision != "fp8":
        return None
    return {"what": config.float8_training, "converted": attrs.get("extra:fp8.converted"),
            "skipped": attrs.get("extra:fp8.skipped")}


def _compile(config: TrialConfig, attrs: dict[str, Any]) -> Optional[dict[str, Any]]:
    """Under ``compile``: the mode, the scope the trial ran (``regions`` falls back to the whole model when
    it found no repeated block) and the blocks it compiled one by one."""
    if config.compile == "off":
        return None
    scope = attrs.get("extra:compile.scope", config.compile_scope)
    mode = "" if config.compile == "default" else f"mode={config.compile!r}"
    what = (f"block.compile({mode}) for each block of {', '.join(attrs.get('extra:compile.regions') or [])}"
            if scope == "regions" else f"model = torch.compile(model{', ' + mode if mode else ''})")
    return {"mode": config.compile, "scope": scope, "regions": attrs.get("extra:compile.regions"), "what": what}


def _allocator(config: TrialConfig) -> dict[str, Any]:
    """The allocator knob's value, the environment it needs (None: none) and what it means, in words."""
    env = {ALLOC_CONF_ENV: EXPANDABLE_SEGMENTS} if config.allocator == "expandable" else None
    return {"allocator": config.allocator, "env": env, "what": config.memory_allocator}


def _evidence_length(attrs: dict[str, Any]) -> dict[str, Any]:
    """The samples every run trained, and whether the references' share of the budget shortened them."""
    shortened = attrs.get("references_shortened")
    trained = (attrs.get("trial_budget") or {}).get("samples")
    if isinstance(shortened, dict) and shortened.get("samples"):
        return {"samples": shortened["samples"], "space_samples": shortened.get("from_samples"), "shortened": True,
                "why": "the fp32 references trained within their share of the budget; every trial trained as many "
                       "samples, its schedule spanning the space's length, so the verdicts stay paired"}
    return {"samples": trained, "shortened": False}


def _number(value: float) -> Any:
    return None if math.isnan(value) else value


def write_best_config(study: optuna.Study, result: Result, studies_dir: Path, *, unconfirmed: str = "") -> Path:
    """Write ``studies/<study>/best_config.json`` atomically (``unconfirmed``: see ``best_config_document``)."""
    path = study_dir(study.study_name, studies_dir) / "best_config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = dumps(best_config_document(study, result, unconfirmed, written=_now())) + "\n"
    try:
        write_atomic(path, text)  # two writers (workers finishing together) never share a temporary file
    except OSError as exc:
        if exc.filename is None:  # a write on a full disk names no file: name it, so the one line does
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise
    return path


def _with_path(result: Result, path: Path) -> Result:
    return dataclasses.replace(result, best_config_path=str(path))
