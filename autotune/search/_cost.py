"""What a trial costs in seconds, predicted from what the study has seen; pure functions over trial records.

A trial's seconds split into parts that differ in what they depend on:

- *overhead*: starting the trial process, building the model, warm-up, the windows' bookkeeping: about the
  same for every config of a study, so its median over the trials seen is the estimate;
- *compile*: zero without ``torch.compile``; the first compile of a model at given shapes and mode is
  fresh (tens of seconds to minutes), a later one at the same shapes and mode hits the study's inductor
  caches and costs a fraction of it (``compile_group`` names what is shared). Trials record whether their
  compile was ``cold`` or ``warm`` (``extra:compile_cache``); once a warm one is seen, the measured warm over
  cold ratio replaces the prior share (``CACHED_COMPILE_SHARE``);
- *capture*: the CUDA Graph capture of the whole step, when graphs are on;
- *steady*: the timed samples over the expected rate.

``CostModel.fit`` reads the study's trials (``user_attrs`` as the tuner records them: ``wall_seconds``,
``run_seconds``, ``compile_seconds``, ``capture_seconds``, ``samples``, ``throughput``,
``extra:compile_cache``) or a replay's rows in
the same form, and ``predict`` prices a candidate config. Until the study has seen a part, a documented
prior stands in (``PRIOR_*``).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

# Seconds of a trial besides its compile, capture and timed samples, before any trial is seen. The H200
# ResNet-50 study took 11-20 s per trial on top of the sweep's in-process time (benchmarks/tables/README.md).
PRIOR_OVERHEAD_S = 15.0
# A fresh compile per mode before the study has seen one (ResNet-50 on an H200: 38-43 s for "default";
# the max-autotune modes took 120-240 s). A seen mode rescales the others by the same ratio.
PRIOR_COMPILE_S: dict[str, float] = {
    "off": 0.0,
    "default": 40.0,
    "reduce-overhead": 45.0,
    "max-autotune-no-cudagraphs": 180.0,
    "max-autotune": 200.0,
}
# A compile at shapes and mode compiled before, over a fresh one: 6.1 and 6.3 s after 38-40 s on the H200.
# The prior until the study records a warm compile (``CostModel.fit`` then uses the measured ratio).
CACHED_COMPILE_SHARE = 0.16
PRIOR_CAPTURE_S = 1.0
# Knobs that change neither the compiled graph's shapes nor its mode: a compile is shared across them.
_NOT_COMPILED = frozenset({"precision", "cuda_graphs", "num_workers", "pin_memory", "prefetch_factor",
                           "persistent_workers", "loader", "dali_threads", "dali_prefetch", "cpu_threads",
                           "memory_fraction", "cudnn_benchmark", "optimizer_impl", "augment"})


# The precisions whose compiles share the caches, by the graph they trace. Autocast's half precisions trace one:
# fp16 after bf16 at the same shapes compiled in 6 s against 38-43 s fresh (H200 ResNet-50 study) and 6.3 s
# against 48 s (H100 demo). Full precision traces another: in that demo, tf32 after bf16 and fp16 missed every
# cache (52 s). fp32 and tf32 are kept apart until a study shows them sharing; fp8 converts the layers.
COMPILE_FAMILY = {"bf16": "autocast", "fp16": "autocast"}


def compile_group(params: Mapping[str, Any]) -> Optional[str]:
    """The shapes-and-mode key a compile is cached under, with the precision's ``COMPILE_FAMILY``; None
    without a compile."""
    mode = params.get("compile", "off")
    if mode in (None, "off"):
        return None
    key = {k: v for k, v in params.items() if k not in _NOT_COMPILED}
    if "precision" in params:
        key["precision"] = COMPILE_FAMILY.get(params["precision"], params["precision"])
    return json.dumps(key, sort_keys=True, default=str)


@dataclass(frozen=True)
class CostSample:
    """One trial's seconds as the cost model reads them.

    Attributes:
        number: Trial order (a compile group's first trial paid the fresh compile).
        params: The config.
        seconds: Wall seconds of the trial process; None when not recorded.
        compile_seconds: Of ``seconds``, the compile (0 without one).
        capture_seconds: Of ``seconds``, the CUDA Graph capture.
        samples: Samples trained, when recorded.
        throughput: Samples per second of the timed windows, when measured.
        compile_cache: How its compile met the inductor caches as the trial recorded it (``"cold"``,
            ``"warm"`` or ``"partial"``); None when not recorded (no compile, or an older record).
    """

    number: int
    params: dict[str, Any]
    seconds: Optional[float]
    compile_seconds: float = 0.0
    capture_seconds: float = 0.0
    samples: Optional[int] = None
    throughput: Optional[float] = None
    compile_cache: Optional[str] = None

    @property
    def steady_seconds(self) -> float:
        if self.samples and self.throughput:
            return self.samples / self.throughput
        return 0.0

    @property
    def overhead_seconds(self) -> Optional[float]:
        if self.seconds is None:
            return None
        return max(0.0, self.seconds - self.compile_seconds - self.capture_seconds - self.steady_seconds)


def _number(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def sample_from_attrs(number: int, params: Mapping[str, Any], attrs: Mapping[str, Any]) -> CostSample:
    """A trial's user attributes (as the tuner records them) as a ``CostSample``."""
    samples = _number(attrs.get("samples"))
    throughput = _number(attrs.get("throughput"))
    cache = attrs.get("extra:compile_cache")
    return CostSample(
        number=number,
        params=dict(attrs.get("config") or params),
        seconds=_number(attrs.get("wall_seconds")),
        compile_seconds=_number(attrs.get("compile_seconds")) or 0.0,
        capture_seconds=_number(attrs.get("capture_seconds")) or 0.0,
        samples=int(samples) if samples else None,
        throughput=throughput if throughput else None,
        compile_cache=cache if cache in ("cold", "warm", "partial") else None,
    )


def is_priced(attrs: Mapping[str, Any]) -> bool:
    """Whether a finished trial's attributes price anything: its wall seconds, or (the reference run
    recorded as a trial, which has no wall seconds of its own) its compile."""
    return "wall_seconds" in attrs or (attrs.get("role") == "reference" and bool(_number(attrs.get("compile_seconds"))))


def samples_from_trials(trials: Iterable[Any]) -> list[CostSample]:
    """Finished Optuna trials (COMPLETE or PRUNED, ``is_priced``) as cost samples."""
    out = []
    for t in trials:
        if getattr(t.state, "name", "") not in ("COMPLETE", "PRUNED") or not is_priced(t.user_attrs):
            continue
        out.append(sample_from_attrs(t.number, t.params, t.user_attrs))
    return out


@dataclass(frozen=True)
class CostModel:
    """Trial seconds predicted from the samples seen.

    Attributes:
        overhead: Median overhead seconds seen (``PRIOR_OVERHEAD_S`` before any).
        fresh_compile: Mode -> median fresh compile seconds seen.
        cached_compile: Compile group -> predicted compile seconds there: the least of the compiles after
            the first, or ``warm_share`` of the first.
        warm_share: A warm compile over the cold one of its group: the median measured where trials
            recorded both, else ``CACHED_COMPILE_SHARE``.
        capture: Median capture seconds seen with graphs on (``PRIOR_CAPTURE_S`` before any).
        samples: Median samples per trial seen (0 before any: steady time unknown).
        rate: Median throughput seen (None before any).
    """

    overhead: float = PRIOR_OVERHEAD_S
    fresh_compile: Optional[dict[str, float]] = None
    cached_compile: Optional[dict[str, float]] = None
    warm_share: float = CACHED_COMPILE_SHARE
    capture: float = PRIOR_CAPTURE_S
    samples: float = 0.0
    rate: Optional[float] = None

    @classmethod
    def fit(cls, samples: Iterable[CostSample]) -> "CostModel":
        seen = sorted(samples, key=lambda s: s.number)
        timed = [s for s in seen if s.seconds is not None]
        overheads = [s.overhead_seconds for s in timed if s.overhead_seconds is not None]
        fresh: dict[str, list[float]] = {}
        first: dict[str, float] = {}
        again: dict[str, list[float]] = {}
        ratios: list[float] = []
        for s in seen:  # the reference trial records its compile, not its wall seconds
            group = compile_group(s.params)
            if group is None or s.compile_seconds <= 0:
                continue
            # The trial's own record decides; without one, the group's first compile was the fresh one. A
            # group seen first warm (the cache outlived a resume) has no fresh compile in this study.
            cold = s.compile_cache == "cold" or (s.compile_cache is None and group not in first)
            if cold and group not in first:
                fresh.setdefault(s.params.get("compile", "off"), []).append(s.compile_seconds)
                first[group] = s.compile_seconds
                continue
            again.setdefault(group, []).append(s.compile_seconds)
            if s.compile_cache == "warm" and group in first:  # a partial hit is neither: left out of the ratio
                ratios.append(s.compile_seconds / first[group])
        share = statistics.median(ratios) if ratios else CACHED_COMPILE_SHARE
        # A compile at a seen group hits the caches: as measured there, else the share of its fresh compile.
        groups = first.keys() | again.keys()
        cached = {g: min(again[g]) if g in again else first[g] * share for g in groups}
        captures = [s.capture_seconds for s in timed if s.params.get("cuda_graphs") and s.capture_seconds > 0]
        counts = [s.samples for s in timed if s.samples]
        rates = [s.throughput for s in timed if s.throughput]
        return cls(
            overhead=statistics.median(overheads) if overheads else PRIOR_OVERHEAD_S,
            fresh_compile={mode: statistics.median(v) for mode, v in fresh.items()},
            cached_compile=cached,
            warm_share=share,
            capture=statistics.median(captures) if captures else PRIOR_CAPTURE_S,
            samples=float(statistics.median(counts)) if counts else 0.0,
            rate=statistics.median(rates) if rates else None,
        )

    def compile_seconds(self, params: Mapping[str, Any]) -> float:
        """Predicted compile seconds of a config: cached at seen shapes and mode, else fresh."""
        group = compile_group(params)
        if group is None:
            return 0.0
        cached = self.cached_compile or {}
        fresh = self.fresh_compile or {}
        mode = params.get("compile", "off")
        if group in cached:
            return cached[group]
        if mode in fresh:
            return fresh[mode]
        prior = PRIOR_COMPILE_S.get(mode, PRIOR_COMPILE_S["default"])
        ratios = [seconds / PRIOR_COMPILE_S[m] for m, seconds in fresh.items() if PRIOR_COMPILE_S.get(m)]
        # A model that compiles fast in one mode compiles fast in the others: scale the prior by what was seen.
        return prior * (statistics.median(ratios) if ratios else 1.0)

    def predict(self, params: Mapping[str, Any], rate: Optional[float] = None, *,
                samples: Optional[int] = None) -> float:
        """Predicted wall seconds of a trial of ``params``.

        Args:
            params: The candidate config.
            rate: Its expected throughput (the incumbent's, say); the median seen when None.
            samples: Samples it trains (a race run's shorter budget); the median seen when None.
        """
        seconds = self.overhead + self.compile_seconds(params)
        if params.get("cuda_graphs") and params.get("compile") not in ("reduce-overhead", "max-autotune"):
            seconds += self.capture
        rate = rate or self.rate
        samples = samples if samples is not None else self.samples
        if samples and rate:
            seconds += samples / rate
        return seconds


def seconds_spent(samples: Iterable[CostSample]) -> float:
    """Wall seconds of the trials recorded so far."""
    return sum(s.seconds or 0.0 for s in samples)
