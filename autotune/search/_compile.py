"""What compiles cost a study: slow compile modes, and whether an expensive mode can pay for its compile.

Two rules, both pure functions of what the study recorded:

- A trial that ran past the compile deadline (status ``compile_timeout``) marks its compile mode slow
  for this model, not the config broken: ``slow_compile_modes`` names those modes, so a sampler can skip
  them for the rest of the study.
- An expensive mode (``max-autotune*``) is only worth a trial when the real training is long enough to
  pay for its compile at its gain: the break-even is ``compile_seconds / (1 - rate_without / rate_with)``
  seconds of training (``compile_break_even``). Before a study measures anything, ``plan_expensive_compiles``
  predicts it from a prior compile cost and a prior gain, and the modes whose break-even the declared
  training length (``--train-minutes`` / ``--train-steps``) does not reach leave the space, with the
  reason recorded like the capability probe's removals.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

from autotune.search._space import SearchSpace

EXPENSIVE_COMPILE_MODES: tuple[str, ...] = ("max-autotune-no-cudagraphs", "max-autotune")
# Prior compile cost of a max-autotune mode before the study measured any compile: on an H200, first
# max-autotune-no-cudagraphs compiles of ResNet-50 took 120-240 s and more (3 of 4 ran into the trial limit).
PRIOR_COMPILE_SECONDS = 300.0
# With a measured default-mode compile: max-autotune benchmarks kernel choices on top of the same
# lowering, so it is priced at this multiple of it (the same H200 runs: 38-64 s default, 120-240+ s).
PRIOR_COMPILE_RATIO = 5.0
# Prior rate_with / rate_without of max-autotune over the default mode: a few percent on steps whose time
# is mostly library GEMMs and convolutions; taken low, so the rule keeps the mode only for long trainings.
PRIOR_GAIN = 1.05


def compile_break_even(compile_seconds: float, rate_with: float, rate_without: float) -> float:
    """Seconds of training (at ``rate_without``) after which a compile that brings ``rate_with`` has paid off.

    Training ``T`` seconds' worth of samples without the compile takes ``T``; with it,
    ``compile_seconds + T * rate_without / rate_with``. They are equal at
    ``T = compile_seconds / (1 - rate_without / rate_with)``.

    Args:
        compile_seconds: What the compile costs (its excess over the alternative's compile, if any).
        rate_with: Samples per second with the compiled mode.
        rate_without: Samples per second of the alternative.

    Returns:
        The break-even in seconds; ``inf`` when the mode is not faster, 0 when the compile is free.
    """
    if compile_seconds <= 0:
        return 0.0
    if not (rate_with > 0 and rate_without > 0) or rate_with <= rate_without:
        return math.inf
    return compile_seconds / (1.0 - rate_without / rate_with)


def slow_compile_modes(trials: Iterable[Any]) -> dict[str, str]:
    """Compile modes that ran past the compile deadline in a study, each with the reason to skip it.

    Args:
        trials: Optuna ``FrozenTrial``s (or their ``user_attrs`` mappings).

    Returns:
        ``{mode: reason}``, e.g. ``{"max-autotune": "trial 4: compile=max-autotune still compiling after
        301s (compile timeout 300s)"}``; the first such trial of each mode names it.
    """
    slow: dict[str, str] = {}
    for trial in trials:
        attrs: Mapping[str, Any] = trial if isinstance(trial, Mapping) else getattr(trial, "user_attrs", {})
        if attrs.get("failure") != "compile_timeout" and attrs.get("status") != "compile_timeout":
            continue
        mode = attrs.get("compile_mode") or (attrs.get("config") or {}).get("compile")
        if not mode or mode in slow:
            continue
        number = getattr(trial, "number", None)
        where = f"trial {number}: " if isinstance(number, int) and number >= 0 else ""
        limit = attrs.get("compile_timeout_seconds")
        slow[mode] = where + (attrs.get("error") or f"compile={mode} ran past the {limit}s compile timeout")
    return slow


@dataclass(frozen=True)
class TrainingLength:
    """How long the real training will run, as the user declared it (at most one of the two).

    Args:
        minutes: Wall-clock minutes of training.
        steps: Optimizer steps at the baseline's batch size.
    """

    minutes: Optional[float] = None
    steps: Optional[int] = None

    @property
    def declared(self) -> bool:
        return self.minutes is not None or self.steps is not None

    def seconds(self, *, samples_per_second: float, batch_size: int) -> Optional[float]:
        """The length in seconds; steps are converted at ``samples_per_second``. ``None`` if undeclared."""
        if self.minutes is not None:
            return 60.0 * self.minutes
        if self.steps is not None and samples_per_second > 0:
            return self.steps * batch_size / samples_per_second
        return None

    def describe(self) -> str:
        if self.minutes is not None:
            return f"{self.minutes:g} min"
        if self.steps is not None:
            return f"{self.steps} steps"
        return "no training length"


@dataclass(frozen=True)
class ModeBreakEven:
    """The predicted break-even of one expensive mode, and whether the declared training reaches it."""

    mode: str
    compile_seconds: float  # predicted
    gain: float  # predicted rate_with / rate_without
    break_even_seconds: float
    kept: bool
    reason: str


@dataclass(frozen=True)
class CompilePlan:
    """Which expensive compile modes a study keeps, and why: stored on the study as ``compile_break_even``."""

    declared: str
    train_seconds: Optional[float]
    modes: tuple[ModeBreakEven, ...] = ()

    @property
    def removed(self) -> dict[str, str]:
        """``{"compile=<mode>": reason}`` for the modes left out, as ``SearchSpace.removed`` keys them."""
        return {f"compile={m.mode}": m.reason for m in self.modes if not m.kept}

    def to_dict(self) -> dict[str, Any]:
        return {
            "rule": "an expensive compile mode is tried when the training length >= compile_seconds / "
                    "(1 - rate_without / rate_with)",
            "declared": self.declared,
            "train_seconds": self.train_seconds,
            "modes": {m.mode: {"compile_seconds": m.compile_seconds, "gain": m.gain,
                               "break_even_seconds": m.break_even_seconds, "kept": m.kept, "reason": m.reason}
                      for m in self.modes},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CompilePlan":
        modes = tuple(ModeBreakEven(mode=mode, **fields) for mode, fields in (data.get("modes") or {}).items())
        return cls(declared=data.get("declared", ""), train_seconds=data.get("train_seconds"), modes=modes)


def predicted_compile_seconds(default_compile_seconds: Optional[float] = None) -> float:
    """A max-autotune compile's predicted cost: ``PRIOR_COMPILE_RATIO`` x a measured default compile, else the prior."""
    if default_compile_seconds is not None and default_compile_seconds > 0:
        return PRIOR_COMPILE_RATIO * default_compile_seconds
    return PRIOR_COMPILE_SECONDS


def plan_expensive_compiles(space: SearchSpace, length: TrainingLength, *, samples_per_second: float,
                            default_compile_seconds: Optional[float] = None) -> CompilePlan:
    """Decide, before measuring, which ``max-autotune*`` modes of the space the declared training pays for.

    Each mode's break-even is ``compile_break_even`` with the predicted compile (its whole compile, not
    just its excess over the default mode's: the conservative side) and ``PRIOR_GAIN``. A mode stays when
    the training is at least that long. The baseline's own mode always stays.

    Args:
        space: The space after the capability probe.
        length: The declared training length.
        samples_per_second: The fastest rate measured so far (the fp32 baseline when a study is created),
            to convert steps to seconds; a tuned config runs faster, so steps over-count the minutes.
        default_compile_seconds: The longest default-mode compile the study measured, if any.
    """
    spec = space.knobs.get("compile")
    present = [m for m in EXPENSIVE_COMPILE_MODES if spec is not None and m in spec.values]
    seconds = length.seconds(samples_per_second=samples_per_second, batch_size=space.baseline.batch_size)
    declared = length.describe()
    if length.steps is not None and seconds is not None:
        declared += f" at batch {space.baseline.batch_size} (~{seconds / 60:.1f} min at {samples_per_second:,.1f} samples/s)"
    compile_seconds = predicted_compile_seconds(default_compile_seconds)
    modes = []
    for mode in present:
        break_even = compile_break_even(compile_seconds, PRIOR_GAIN, 1.0)
        cost = (f"its compile (~{compile_seconds:.0f} s predicted) pays off after ~{break_even / 60:.0f} min of "
                f"training at a {PRIOR_GAIN - 1:.0%} gain")
        if mode == space.baseline.compile:
            kept, reason = True, "the baseline's own compile mode"
        elif seconds is None:
            kept, reason = False, f"{cost}; no training length declared (--train-minutes or --train-steps)"
        elif seconds < break_even:
            kept, reason = False, f"{cost}; the declared {declared} is shorter"
        else:
            kept, reason = True, f"{cost}; the declared {declared} is longer"
        modes.append(ModeBreakEven(mode, compile_seconds, PRIOR_GAIN, break_even, kept, reason))
    return CompilePlan(declared=declared, train_seconds=seconds, modes=tuple(modes))


def restrict_expensive_compiles(space: SearchSpace, plan: CompilePlan) -> SearchSpace:
    """The space without the compile modes the plan left out, each with its reason in ``space.removed``."""
    for mode in plan.modes:
        if not mode.kept:
            space = space.without("compile", mode.mode, mode.reason)
    return space
