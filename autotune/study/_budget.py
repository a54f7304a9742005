"""The study's minutes: a deadline for the whole study, and where its seconds went.

``StudyClock`` is the one clock of a study run. It knows the deadline (``budget_minutes``, or none), caps
each trial process's time limit so that no run can carry the study past it, and keeps the seconds of each
part of the study (the probe, the references, the trials, the race of the finalists, the report) as
measured, so that the time split adds up to the wall time from measurements rather than by construction:
what no part measured stays visible as ``unaccounted``.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional

# Seconds kept back at the end of a budgeted study for what follows the race: the diagnosis, the plots and
# best_config.json (2-3 s on a 2-core CPU with plots, 2-5 s on the H200 host). A short budget keeps back its
# share, so that a one-minute budget is not a quarter reserve.
FINISH_RESERVE_S = 10.0
FINISH_RESERVE_SHARE = 0.04
# A trial process is never given less than this: below it, nothing but its start-up would run.
MIN_RUN_S = 5.0
# The parts of a study, in the order the split lists them. ``trials`` is split further by what each trial
# process measured of itself (compile, warm-up, timed windows, the rest of the process).
PARTS = ("probe", "setup", "references", "trials", "race", "report")


@dataclass
class StudyClock:
    """The deadline of one study run and the measured seconds of its parts.

    Args:
        budget_seconds: The whole study's budget; ``None`` means no deadline.
        started: ``time.monotonic()`` when the run began.
    """

    budget_seconds: Optional[float] = None
    started: float = field(default_factory=time.monotonic)
    seconds: dict[str, float] = field(default_factory=dict)
    # The clock it reads: the machine's, or a replay's (``study/_replay``), whose seconds are charged.
    now: Callable[[], float] = field(default=time.monotonic, repr=False, compare=False)

    @property
    def budgeted(self) -> bool:
        return self.budget_seconds is not None

    def elapsed(self) -> float:
        return self.now() - self.started

    def left(self) -> float:
        """Seconds to the deadline (infinite without a budget)."""
        if self.budget_seconds is None:
            return float("inf")
        return self.budget_seconds - self.elapsed()

    def usable(self) -> float:
        """Seconds left for runs: the deadline less what the end of the study needs."""
        if self.budget_seconds is None:
            return float("inf")
        return self.left() - min(FINISH_RESERVE_S, max(2.0, FINISH_RESERVE_SHARE * self.budget_seconds))

    def cap(self, timeout: float, *, keep: float = 0.0) -> float:
        """A run's time limit, cut so that it ends ``keep`` seconds before the usable time runs out."""
        if self.budget_seconds is None:
            return timeout
        return max(MIN_RUN_S, min(timeout, self.usable() - keep))

    def capped(self, timeout: float, *, keep: float = 0.0) -> bool:
        """Whether ``cap`` cuts this timeout (then a run ended by it was stopped by the budget)."""
        return self.cap(timeout, keep=keep) < timeout

    def fits(self, seconds: float, *, keep: float = 0.0) -> bool:
        """Whether a run predicted to take ``seconds`` ends before the usable time, ``keep`` held back."""
        return seconds + keep <= self.usable()

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Add the seconds spent inside the block to the part ``name``."""
        begin = self.now()
        try:
            yield
        finally:
            self.add(name, self.now() - begin)

    def split(self, trial_attrs: Iterable[Mapping[str, Any]] = ()) -> dict[str, Any]:
        """Where the minutes went: see ``time_split``."""
        return time_split(self.seconds, self.elapsed(), trial_attrs, budget_seconds=self.budget_seconds)


def trial_parts(attrs: Mapping[str, Any]) -> dict[str, float]:
    """One trial process's seconds as it measured them: compile, warm-up (besides the compile and the graph
    capture), timed windows, and the rest of its wall time (process start, model build, evaluation, exit)."""
    def number(key: str) -> float:
        value = attrs.get(key)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0

    wall = number("wall_seconds")
    compile_s = number("compile_seconds")
    capture = number("capture_seconds")
    warmup = max(0.0, number("warmup_seconds") - compile_s - capture)
    timed = number("extra:timed_seconds")  # 0 for a trial from before it was recorded: then process time
    inside = compile_s + capture + warmup + timed
    if inside > wall > 0:  # a trial's own clocks and the coordinator's differ by milliseconds
        scale = wall / inside
        compile_s, capture, warmup, timed = (x * scale for x in (compile_s, capture, warmup, timed))
    return {"compile": compile_s + capture, "warmup": warmup, "timed": timed,
            "process": max(0.0, wall - compile_s - capture - warmup - timed)}


def time_split(seconds: Mapping[str, float], wall: float, trial_attrs: Iterable[Mapping[str, Any]] = (), *,
               budget_seconds: Optional[float] = None) -> dict[str, Any]:
    """The study's wall time split into what the issue of a long wait asks about.

    ``references``, ``race`` (the re-measurement of the finalists), ``probe`` and ``report`` are the
    coordinator's clocks around them; the race, the probes, a later baseline speed run and longer evidence
    (``extend``) run inside the trials' part and are taken out of it. The trials part is split by each trial's own record into
    ``compile``, ``warmup``, ``timed`` and ``trial_process``; what the coordinator spent between trial
    processes (the sampler, the storage, the accuracy verdict) is ``coordinator``. ``unaccounted`` is the
    wall time that no clock saw (it should stay near zero; a large one is a hole in the accounting).

    Returns:
        ``{"wall": s, "parts": {name: s}, "shares": {name: fraction}, "unaccounted": s, "budget": s|None}``.
    """
    attrs = list(trial_attrs)
    runs = [trial_parts(a) for a in attrs]
    trial_wall = sum(float(a.get("wall_seconds") or 0.0) for a in attrs)
    # A trial's fp32 references run inside its ask-to-tell: at its global batch (the scale policy), and the
    # seeds the planner left for after the first full trial.
    batch_references = sum(float(a.get("reference_seconds") or 0.0) for a in attrs)
    # The baseline's own speed run, when it came after the first trial, longer evidence for a candidate (its
    # references and its run) and the seeds a resumed study lacked: references, run inside the trials' part.
    later = seconds.get("baseline_speed", 0.0) + seconds.get("extend", 0.0) + seconds.get("references_later", 0.0)
    parts = {
        "references": seconds.get("references", 0.0) + batch_references + later,
        "compile": sum(r["compile"] for r in runs),
        "warmup": sum(r["warmup"] for r in runs),
        "timed": sum(r["timed"] for r in runs),
        "trial_process": sum(r["process"] for r in runs),
        "probes": seconds.get("probes", 0.0),  # loader and step probes, run inside the trials' part
        "coordinator": max(0.0, seconds.get("trials", 0.0) - trial_wall - batch_references - later
                           - seconds.get("probes", 0.0) - seconds.get("race", 0.0))
        + seconds.get("setup", 0.0),
        "race": seconds.get("race", 0.0),
        "probe": seconds.get("probe", 0.0),
        "report": seconds.get("report", 0.0),
    }
    accounted = sum(parts.values())
    parts = {k: round(v, 3) for k, v in parts.items()}
    return {
        "wall": round(wall, 3),
        "parts": parts,
        "shares": {k: round(v / wall, 4) if wall > 0 else 0.0 for k, v in parts.items()},
        "unaccounted": round(wall - accounted, 3),
        "budget": budget_seconds,
    }
