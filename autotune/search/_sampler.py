"""GuidedSampler: a problem-aware Optuna sampler for discrete training-knob spaces.

The knobs that make training fast are few, discrete and mostly separable, and domain knowledge says
where to start (bf16 or fp16, channels_last, a large batch, compiled, graphs). So instead of sampling at
random until a model forms, the sampler:

1. proposes a *prior point* first: every knob at its most promising value, the batch at the upper median;
   under ``batch_policy: fixed`` the prior takes the micro-batch equal to the global batch (no accumulation)
   where a run at that micro-batch or a larger one fitted (the fp32 reference usually did), else its first
   move is that micro-batch, unless an out-of-memory at that micro-batch or a smaller one was recorded:
   accumulation is the fallback for memory, and otherwise only adds steps;
2. then walks coordinate neighbours of the incumbent (the fastest feasible config so far), one knob at a
   time in order of expected impact (precision, batch, compile, ...), moving whenever a neighbour wins;
3. skips a value when a measured pair that differs only in that knob shows it clearly worse (more than
   ``skip_margin``) or missing the accuracy bound, since knob effects are close to separable; a
   value that crashed there (an error, a timeout) waits with the deferred values instead (rule 6), since a
   crash may be the config's or chance's; a value that crashed twice is clearly worse, and rule 8 drops it
   where it never ran;
4. never proposes a config the memory rule rules out (a larger batch than one that ran out of memory), nor
   one that ``cannot_run`` names a reason for (values that cannot run together here);
5. lets the incumbent's bottleneck choose the knobs tried first (``BOTTLENECK_KNOBS``): its stored
   diagnosis (user attr ``diagnosis``), else its share of time waiting for input, else (a step that does
   not wait for input) the shape of its step time against the batch on its line: a fixed cost of at least
   ``LAUNCH_SHARE`` of the step is launch-bound, near-constant time per sample (``COMPUTE_SHARE``)
   compute-bound; a bottleneck can also put a knob's values first (``BOTTLENECK_VALUES``: compute-bound,
   the max-autotune compile modes). Knobs that cannot help it wait: the input-pipeline knobs while the
   step does not wait for input, the compute knobs while it does, channels_last where the model has no
   4-D activations;
   within a tier, moves are ranked by expected gain; the predicted seconds (``_cost``) only order moves
   of near-equal gain (``NEAR_TIE``), so a costly move that can win (a max-autotune compile) does not wait
   behind several cheap ones that rarely do; a value whose gain the model predicts (``value_gains``: fp8
   gains only on the linear work it converts) has its gain scaled by it; a knob measured flat on two lines
   waits with the knobs that cannot help, but for its values that no trial has run;
   where nothing recorded the incumbent's bottleneck (no diagnosis, no input wait: a ``train_fn`` that times
   its own loop, an older table), the batch line does not make the input knobs wait (a loader's cost per
   sample or per batch draws the same line as the step's), and the step's knobs and the input pipeline's
   are ranked apart, so each group's first knob is among the first moves; and once two or more of the step's
   own knobs were measured and none moves the rate (``_step_flat``), the incumbent reads as input-bound; while
   input-bound and no trial has lifted the rate past the first one's noise (``_stalled``), the loader's
   knobs are tried in pairs right after their single moves: they share the host's cores and memory;
6. on a numeric knob (batch, workers), defers the values that lie past a measured value slower than the
   incumbent, as seen from the incumbent: throughput along one knob is close to unimodal, so after batch
   256 < 384 < 512 the walk tries the next knob before batch 192 and 128;
7. once no neighbour is left, tries the deferred values, then two-knob moves (among the first tier's knobs,
   the ones measured flat alone included: a knob can matter beside another that shares a resource with it),
   then untried configs at random;
8. steers away from failures: when the prior point fails (not out of memory), it reverts half of the
   knobs where the prior differs from the reference run, then the other half, so a fault tied to one value
   costs at most two trials; once a repair runs, the reverted knobs go back to the prior's values one at
   a time, first among the moves (``_restores``), until each has run once; a value that failed twice and
   never ran is not proposed again by the walk, nor one that a trial said cannot run this workload
   (``refused_value``: ``loader=device`` refused its data);
9. proposes the allocator's expandable segments (``MEMORY_ONLY``) only where memory binds: a micro-batch
   larger than the incumbent's ran out of memory (then first, at the smallest such batch), or the
   incumbent's diagnosis says memory-capacity-bound; that first retry of the larger batch also takes the
   memory savers the space has (``MEMORY_SAVERS``: activation checkpointing, CUDA Graphs and cuDNN
   benchmark off), all at once: the walk can take them back one by one once the batch fits;
10. before the single-knob moves, tries the winners of separate lines together (``_combined``): an additive
   model of log-throughput, one effect per knob value, ridge-fitted to every feasible trial, names the knobs
   whose measured value beats the incumbent's by ``COMBINE_MARGIN`` (trials far slower than the fastest,
   ``COMBINE_FLOOR``, are left out: effects do not add up across regimes); the incumbent with all of them switched
   is the next move (one is enough: the workers the loader probes found at the reference's config, joined to
   the prior point's precision and batch). Knob effects are close to separable, so values that won on
   different lines (a batch on one, pinning on another) rarely need a walk of single moves to meet.
11. steers away from an accuracy miss: a precision that keeps less of fp32's arithmetic (``PRECISION_RANK``)
   than one that missed the accuracy bound at the same other knobs is not proposed (it would miss too); and
   where the prior point missed the bound under ``batch_policy: fixed`` and nothing but the reference
   passed, its precision is the likeliest cause, so the walk first tries the prior with each precision that
   keeps as much or more, nearest first (bf16 missed: fp16, tf32, then fp32), before the whole-batch move
   and the single moves, each of which would miss the same way.

Its state is the study's trials, nothing else, so it resumes, and several workers share one study:
running trials count as taken. Studies stay ordinary Optuna studies.
"""

from __future__ import annotations

import collections
import itertools
import json
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import numpy as np
import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import FrozenTrial, TrialState

from autotune.search._cost import CostModel, CostSample, is_priced, sample_from_attrs
from autotune.search._compile import slow_compile_modes
from autotune.search._predict import nearest_first
from autotune.search._rules import infeasible_reason

# Most promising value first. Numeric knobs without a prior start at the upper median of their values.
DEFAULT_PRIORS: dict[str, tuple[Any, ...]] = {
    # fp8 after bf16: its gain is the model's (value_gains), and it is no start: it needs a compile and torchao.
    "precision": ("bf16", "fp8", "fp16", "tf32", "fp32"),
    "channels_last": (True, False),
    "compile": ("default", "off", "max-autotune-no-cudagraphs", "max-autotune", "reduce-overhead"),
    # The whole model first: its graph fuses across the blocks and compiles the loss with them; the repeated
    # blocks one by one compile in less time (benchmarks/results/regional-compile.md).
    "compile_scope": ("model", "regions"),
    "cuda_graphs": (True, False),
    "cudnn_benchmark": (True, False),
    "pin_memory": (True, False),
    "persistent_workers": (True, False),
    # The DataLoader first: it runs anything. Where the step waits on it, the walk tries the loader first
    # (BOTTLENECK_KNOBS), and serving the data from the device removes the wait altogether.
    "loader": ("torch", "device", "dali"),
    # The dataset's own transforms first, as the script wrote them: moving them to the device pays only where
    # the step waits on the workers' augmentation.
    "augment": ("dataset", "device"),
    # torch's own pick first; then the fused kernels, fastest where they run; explicit attention last.
    "attention": ("auto", "flash", "cudnn", "efficient", "math", "explicit"),
    "optimizer_impl": ("fused", "foreach", "default"),
    "activation_checkpointing": (False, True),  # recomputing costs time; it pays only where memory binds
    # DDP: no copy into the buckets, and no per-step graph bookkeeping, cost nothing; compressing the
    # gradients changes their numbers, so full precision goes first.
    "gradient_as_bucket_view": (True, False),
    "static_graph": (True, False),
    "grad_compression": ("none", "bf16"),
    "allocator": ("default", "expandable"),
}
# Largest expected effect first: a coordinate walk that settles these early wastes fewest trials.
# Batch before precision: from a bf16 start the other precisions are rarely better and, with compile on,
# each costs a fresh compile before it can be judged (three such trials took 3.2 minutes in the H200
# ResNet-50 run). Replayed on every committed table, batch-first reaches 99% of the best in as few or
# fewer trials (benchmarks/results/search.md).
DEFAULT_KNOB_ORDER: tuple[str, ...] = (
    "batch_size",
    "precision",
    "compile",
    "compile_scope",
    "attention",
    "channels_last",
    "cuda_graphs",
    "optimizer_impl",
    "grad_compression",
    "bucket_cap_mb",
    "gradient_as_bucket_view",
    "static_graph",
    "loader",
    "augment",
    "dali_threads",
    "dali_prefetch",
    "num_workers",
    "pin_memory",
    "prefetch_factor",
    "persistent_workers",
    "cudnn_benchmark",
    "memory_fraction",
    "cpu_threads",
    "activation_checkpointing",
    "allocator",
)
_TAKEN = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING, TrialState.WAITING)
INPUT_KNOBS = frozenset({"num_workers", "pin_memory", "prefetch_factor", "persistent_workers", "loader",
                         "dali_threads", "dali_prefetch", "augment"})
COMPUTE_KNOBS = frozenset({"precision", "compile", "compile_scope", "channels_last", "cuda_graphs", "cudnn_benchmark",
                           "attention", "optimizer_impl", "activation_checkpointing"})
# The bottleneck labels of autotune.insight (the search layer reads the stored strings, not that module).
INPUT_BOUND, LAUNCH_BOUND, COMPUTE_BOUND, MEMORY_BOUND, COMMUNICATION_BOUND = (
    "input-bound", "launch-bound", "compute-bound", "memory-capacity-bound", "communication-bound")
# What can help each bottleneck, most likely first. Input: the loader backend, the biggest lever (data
# already on the device waits for nothing; DALI decodes on the GPU), then the DataLoader's own knobs (the
# space bounds the workers to what the host has). Launches: fewer, larger launches. Compute: less work per sample, then a batch that
# uses the units better. Memory capacity: the batch (the one that fits), then a narrower precision.
BOTTLENECK_KNOBS: dict[str, tuple[str, ...]] = {
    INPUT_BOUND: ("loader", "num_workers", "prefetch_factor", "pin_memory", "persistent_workers",
                  "dali_threads", "dali_prefetch"),
    LAUNCH_BOUND: ("cuda_graphs", "compile", "optimizer_impl", "batch_size"),
    COMPUTE_BOUND: ("precision", "compile", "attention", "channels_last", "batch_size"),
    MEMORY_BOUND: ("batch_size", "precision", "activation_checkpointing", "allocator"),
    # Communication: fewer bytes, fewer or better-overlapped buckets, then more compute per all-reduce.
    COMMUNICATION_BOUND: ("grad_compression", "bucket_cap_mb", "gradient_as_bucket_view", "static_graph", "batch_size"),
}
# The knobs that cannot help a bottleneck: they wait until every other move is done.
BOTTLENECK_WAITS: dict[str, frozenset[str]] = {
    INPUT_BOUND: COMPUTE_KNOBS,
    LAUNCH_BOUND: INPUT_KNOBS,
    COMPUTE_BOUND: INPUT_KNOBS,
    MEMORY_BOUND: INPUT_KNOBS,
    COMMUNICATION_BOUND: INPUT_KNOBS,
}
# Without a stored diagnosis (replayed tables): waiting this share of the windows is input-bound, as the
# diagnosis calls it (insight's DATA_WAIT_HIGH).
INPUT_WAIT_HIGH = 0.2
# Without a stored diagnosis, the step time against the batch on the incumbent's line: a step whose fixed
# cost (time at batch 0 of a line fitted through the measured batches) is at least this share of its time
# is launch-bound (a larger batch barely costs more), at most this share compute-bound (time per sample
# is near-constant). In between, no label: the walk's default order.
LAUNCH_SHARE = 0.5
COMPUTE_SHARE = 0.3
# A bottleneck's preferred values of a knob, tried before the priors' order: compute-bound, the fused
# max-autotune kernels are the compile lever (a slower compile, which the cost model would otherwise defer).
BOTTLENECK_VALUES: dict[str, dict[str, tuple[Any, ...]]] = {
    COMPUTE_BOUND: {"compile": ("max-autotune-no-cudagraphs", "max-autotune")},
}
# Expected gain of a move to a value the priors rank below the incumbent's on a knob whose prior is a speed
# order (bf16 to fp32, graphs on to off): such moves rarely win, and reusing the compiled shapes makes them
# look cheap, so without this they go before the moves that can win (a larger batch, a faster mode).
DOWN_PRIOR_SHARE = 0.25
# The knobs whose prior is a speed order on the device. Not compile (its "off" comes second because it
# always runs, and it is the faster one on a small launch-bound model), attention ("auto" is torch's pick),
# nor the host-side knobs (pinning and persistent workers trade host cores and memory, which can bind).
SPEED_ORDERED = frozenset({"precision", "channels_last", "cuda_graphs", "cudnn_benchmark", "optimizer_impl",
                           "activation_checkpointing"})
# Moves whose expected gain is at least this share of the best one left are near-ties: the cheaper goes first.
NEAR_TIE = 0.75
# Rule 10's combined move: a knob value switches when its effect on log-throughput beats the incumbent's by
# this much (about 2%: above the noise of one measurement); the ridge keeps effects seen once small; fewer
# feasible trials than the minimum say nothing about separate effects. Chosen among five settings on the
# family (benchmarks/results/search.md, round 3), then checked on fresh replay seeds.
COMBINE_MARGIN = 0.02
COMBINE_RIDGE = 0.1
COMBINE_MIN_TRIALS = 3
# Rule 10 fits only the trials at least this share of the fastest one's throughput.
COMBINE_FLOOR = 0.2
# A value that failed this many times and never ran is not proposed again by the walk.
FAILS_TO_DROP = 2
# How much of fp32's arithmetic a precision keeps: a precision that missed the accuracy bound makes every lower
# one miss too (rule 11). bf16 and fp16 rank alike: fp16 keeps more significand, bf16 more range, and either
# can miss where the other passes.
PRECISION_RANK = {"fp8": 0, "bf16": 1, "fp16": 1, "tf32": 2, "fp32": 3}
# Values that help only where memory binds, proposed only then (rule 9 of the module doc): elsewhere expandable
# segments change nothing a trial could measure, and a study would pay a trial for each incumbent to learn so.
MEMORY_ONLY = frozenset({("allocator", "expandable")})
# Values that need less device memory than their alternatives, at some speed: recomputed activations, no
# graph-private memory pool, no cuDNN autotuning workspace. After an out-of-memory at a larger batch than the
# incumbent's, the incumbent is retried there with all of them at once (``_roomier``): the batch is often the
# larger lever, and the walk can then take back the savers one by one.
MEMORY_SAVERS = frozenset({("activation_checkpointing", True), ("cuda_graphs", False), ("cudnn_benchmark", False)})


@dataclass(frozen=True)
class _Seen:
    """One trial as the sampler reads it."""

    number: int
    params: dict[str, Any]
    value: Optional[float]  # throughput when measured (a pruned trial's partial one too)
    feasible: bool
    oom: bool
    reference: bool
    data_wait: Optional[float] = None  # share of the timed windows spent waiting for input, when measured
    diagnosis: Optional[str] = None  # the stored bottleneck label, when the trial was diagnosed
    activations_4d: Optional[bool] = None  # whether the model has 4-D activations, when recorded
    failed: bool = False  # it ran and failed for a reason other than memory (a crash, an error, a timeout)
    cost: Optional[CostSample] = None  # its seconds, when recorded
    slow_compile: Optional[str] = None  # the compile mode that ran past the compile deadline
    refused: Optional[tuple[str, Any]] = None  # (knob, value) that refused the workload (loader=device's data)


class GuidedSampler(optuna.samplers.BaseSampler):
    """Prior point, then a coordinate walk from the incumbent with the memory rule; see the module doc.

    Args:
        search_space: The distribution of each knob the study asks for.
        priors: Preferred value order per knob; merged over ``DEFAULT_PRIORS``.
        default_priors: Start from ``DEFAULT_PRIORS``; False keeps only ``priors`` (an ablation: the
            walk then starts from each knob's first value, or the upper median of numbers).
        knob_order: Order in which knobs are varied; knobs not listed follow in search-space order.
        skip_margin: A value measured this much slower (as a fraction) than the incumbent's value of the
            same knob, everything else equal, is not tried again at a new incumbent.
        canonical: Maps a full config to the params a trial would actually ask (a space may skip knobs that
            cannot matter, e.g. prefetch without workers), so that "already tried" compares like with like.
        seed: Seed of the random fallback.
        input_idle: While the incumbent waited for input less than this share of its windows, the
            input-pipeline knobs are tried only after every other move.
        defer_past_slower: Try numeric values past a slower one on the incumbent's line only after the
            other single-knob moves (False: nearest first, whatever was seen; an ablation).
        cannot_run: Why a config cannot run here, else None (``SearchSpace.cannot_run``); it is given the
            asked params (the searched knobs), so it must fill in the knobs a space does not search.
        whole_batch: Under ``batch_policy: fixed``, the batch knob's value that takes no accumulation (the
            global batch; over the ranks of a DDP trial, its share of each rank): the walk's first move
            (None: no such rule).
        value_gains: A (knob, value)'s predicted share of its best case (``SearchSpace.predicted_gains``):
            its moves' expected gain is scaled by it.
    """

    def __init__(
        self,
        *,
        search_space: Mapping[str, BaseDistribution],
        priors: Optional[Mapping[str, Sequence[Any]]] = None,
        default_priors: bool = True,
        knob_order: Sequence[str] = DEFAULT_KNOB_ORDER,
        skip_margin: float = 0.10,
        canonical: Optional[Callable[[dict[str, Any]], dict[str, Any]]] = None,
        seed: Optional[int] = None,
        input_idle: float = 0.02,
        defer_past_slower: bool = True,
        cannot_run: Optional[Callable[[dict[str, Any]], Optional[str]]] = None,
        whole_batch: Optional[int] = None,
        value_gains: Optional[Mapping[tuple[str, Any], float]] = None,
    ) -> None:
        if not 0 <= skip_margin < 1:
            raise ValueError("skip_margin must be in [0, 1)")
        self._space = dict(search_space)
        self._values = {name: _values_of(dist) for name, dist in self._space.items()}
        self._priors = {**(DEFAULT_PRIORS if default_priors else {}), **dict(priors or {})}
        ordered = [k for k in knob_order if k in self._space]
        self._order = ordered + [k for k in self._space if k not in ordered]
        self._skip_margin = skip_margin
        self._canonical = canonical or (lambda params: params)
        self._seed = seed
        self._input_idle = input_idle
        self._defer_past_slower = defer_past_slower
        self._cannot_run = cannot_run or (lambda params: None)
        self._whole_batch_value = whole_batch
        self._value_gains = dict(value_gains or {})
        self._fallback = optuna.samplers.RandomSampler(seed=seed)

    # -- Optuna's sampler interface -------------------------------------------------------------
    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return dict(self._space)

    def sample_relative(
        self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        if not search_space:
            return {}
        proposal = self.propose(self._read(study, exclude=trial.number), trial.number)
        return proposal or {}

    def sample_independent(
        self, study: optuna.Study, trial: FrozenTrial, param_name: str, param_distribution: BaseDistribution
    ) -> Any:
        return self._fallback.sample_independent(study, trial, param_name, param_distribution)

    def reseed_rng(self) -> None:
        self._fallback.reseed_rng()

    # -- the strategy ---------------------------------------------------------------------------
    def prior_point(self) -> dict[str, Any]:
        """Every knob at its most promising value."""
        point = {}
        for name, values in self._values.items():
            preferred = [v for v in self._priors.get(name, ()) if v in values]
            if preferred:
                point[name] = preferred[0]
            elif name == "memory_fraction" or not all(_is_number(v) for v in values):
                point[name] = max(values) if name == "memory_fraction" else values[0]
            else:
                ordered = sorted(values)
                point[name] = ordered[len(ordered) // 2]  # upper median: big enough to matter, likely to fit
        return point

    def propose(self, seen: list[_Seen], number: int = 0) -> Optional[dict[str, Any]]:
        """The next config to try given the trials seen, or None when every config is taken."""
        taken = {self._key(s.params) for s in seen}
        ooms = [(s.number, s.params) for s in seen if s.oom]
        dropped = self._dropped(seen)
        gated = set(MEMORY_ONLY)  # opened below, once the incumbent is known, where memory binds
        misses = self._accuracy_misses(seen)
        below = {(self._rest_key(s.params, "precision"), s.params["precision"]) for s in misses}

        def fresh(candidate: dict[str, Any], *, allow_dropped: bool = False) -> bool:
            asked = self._asked(candidate)
            if self._key(asked) in taken or infeasible_reason(asked, ooms) is not None:
                return False
            if below and "precision" in asked:
                rest = self._rest_key(asked, "precision")
                if any(at == rest and _less_precise(asked["precision"], missed) for at, missed in below):
                    return False  # rule 11: less precise than a precision that missed the bound at the same knobs
            if self._cannot_run(asked) is not None or any((k, v) in gated for k, v in asked.items()):
                return False
            return allow_dropped or not any((k, v) in dropped for k, v in asked.items())

        prior = self.prior_point()
        if self._whole_batch_fits(seen):
            prior["batch_size"] = self._whole_batch_value
        if fresh(prior):
            return prior
        for candidate in self._repairs(seen, prior):
            if fresh(candidate):
                return candidate
        anchor, failed_anchor, best = self._anchor(seen, prior, dropped)
        roomier = self._roomier(seen, anchor, best)
        if roomier is not None:
            gated.clear()
        for candidate in self._restores(seen, prior, anchor, best):
            if fresh(candidate):
                return candidate
        for candidate in self._precision_repairs(misses, anchor, failed_anchor):
            if fresh(candidate):
                return candidate
        whole = self._whole_batch(seen, anchor)
        if whole is not None and fresh(whole):
            return whole
        worse, crashed = self._clearly_worse(seen)
        label = self._bottleneck_of(seen, best)
        first, later = self._tiers(seen, best, label)
        # A knob measured flat on two lines waits with the knobs that cannot help: on a plateau the noise moves
        # the incumbent, and each new one would otherwise retry it before the pairs of the knobs that matter.
        flat = self._barely_matters(seen)
        paired = first  # a knob flat alone can still matter beside another (a shared resource: cores, host memory)
        first, later = [k for k in first if k not in flat], [k for k in first if k in flat] + later
        # Flat is what the measured values showed: a value of a flat knob that no trial has run (a smaller batch
        # where only larger ones were measured) has shown nothing, and stays with the first tier's moves.
        ran = {(k, self._key([v])) for s in seen if s.value is not None for k, v in s.params.items()}
        flat_first = [k for k in paired if k in flat]
        prefer = BOTTLENECK_VALUES.get(label or "", {})
        deferred = self._past_slower(seen, anchor, best)
        # A value that crashed once at another incumbent is not condemned everywhere: a crash may be the config's
        # or chance's. It waits with the deferred values; a second crash makes it clearly worse (``_clearly_worse``).
        deferred += [(name, value) for name, value, other in sorted(crashed, key=str)
                     if anchor.get(name) == other and (name, value) not in deferred]
        priced = [s.cost for s in seen if s.cost is not None]
        # Nothing timed yet (replay without seconds, or the reference's compile alone): gain alone.
        cost = CostModel.fit(priced) if any(c.seconds is not None for c in priced) else None

        def ranked(knobs: Sequence[str]) -> list[dict[str, Any]]:
            return self._ranked(self._neighbours(anchor, failed_anchor, worse, knobs, deferred, prefer), anchor,
                                knobs, seen, cost, best, prefer)

        # Input-bound, and nothing has lifted the rate since the first config: the loader's knobs share the host
        # (its cores, its memory for the queued batches), so where none of them alone moves the rate, they are
        # tried in pairs before the other knobs' single moves.
        loader = [k for k in paired if k in INPUT_KNOBS] if label == INPUT_BOUND and self._stalled(seen) else []
        moves = itertools.chain(
            [roomier] if roomier else [],
            self._combined(seen, anchor, worse, dropped),
            ranked([k for k in first if k in loader]),
            self._pair_moves(anchor, worse, loader, deferred),
            ranked(first),
            (c for c in ranked(flat_first) if (moved := _moved(c, anchor, flat_first)) and
             (moved, self._key([c[moved]])) not in ran),
            ({**anchor, name: value} for name, value in deferred if name in first),
            self._pair_moves(anchor, worse, paired, deferred),
            ranked(later),
            ({**anchor, name: value} for name, value in deferred if name in later),
        )
        for candidate in moves:
            if fresh(candidate):
                return candidate
        rng = random.Random(None if self._seed is None else self._seed * 100_003 + number)
        for attempt in range(2000):
            candidate = {name: rng.choice(values) for name, values in self._values.items()}
            if fresh(candidate, allow_dropped=attempt >= 1000):  # dropped values only once little else is left
                return candidate
        return None

    def _precision_repairs(self, misses: list[_Seen], anchor: dict[str, Any], failed: bool) -> list[dict[str, Any]]:
        """Where the prior point missed the accuracy bound and nothing but the reference passed (``failed``):
        the prior with each precision that keeps as much or more of fp32's arithmetic, nearest first (rule 11).
        Its precision is the likeliest cause, and every other move at it would miss the same way."""
        # Only under ``fixed`` (a whole batch is known): every config trains the baseline's global batch, so the
        # precision is what changes the numerics. Under ``scale`` a larger batch misses as often (the replayed
        # family's accuracy models), and a precision repair there held the walk in fp32 for ten trials.
        if not failed or self._whole_batch_value is None or "precision" not in anchor \
                or anchor["precision"] not in {s.params["precision"] for s in misses}:
            return []
        rank = PRECISION_RANK.get(anchor["precision"], 0)
        ladder = [v for v in self._value_order("precision", anchor["precision"]) if PRECISION_RANK.get(v, -1) >= rank]
        return [{**anchor, "precision": v} for v in sorted(ladder, key=lambda v: PRECISION_RANK[v])]

    @staticmethod
    def _accuracy_misses(seen: list[_Seen]) -> list[_Seen]:
        """Trials that ran and missed the accuracy bound (measured, not feasible, not a fault), with a precision."""
        return [s for s in seen if "precision" in s.params and s.value is not None and not s.feasible
                and not s.oom and not s.failed and not s.reference]

    def _whole_batch_fits(self, seen: list[_Seen]) -> bool:
        """Under ``fixed``, whether a run at the whole global batch as one micro-batch, or a larger one, fitted
        in memory and none at it or below ran out: then accumulation would only add steps."""
        whole = self._whole_batch_value
        if whole is None or whole not in self._values.get("batch_size", ()):
            return False
        batches = [(s.params.get("batch_size"), s) for s in seen if s.params.get("batch_size") is not None]
        if any(s.oom and batch <= whole for batch, s in batches):
            return False
        return any(batch >= whole and not s.oom and s.value is not None for batch, s in batches)

    def _whole_batch(self, seen: list[_Seen], anchor: dict[str, Any]) -> Optional[dict[str, Any]]:
        """Under ``fixed``, the incumbent at the micro-batch equal to the global batch, while no trial but the
        reference has run there and no out-of-memory at that micro-batch or a smaller one was recorded."""
        whole = self._whole_batch_value
        if whole is None or whole not in self._values.get("batch_size", ()) or anchor.get("batch_size") == whole:
            return None
        for s in seen:
            batch = s.params.get("batch_size")
            if batch is None:
                continue
            if s.oom and batch <= whole:
                return None  # memory binds: accumulation is what lets the global batch fit
            if batch == whole and not s.reference and (s.value is not None or s.failed):
                return None  # tried: the walk goes on as for any knob
        return {**anchor, "batch_size": whole}

    def _roomier(self, seen: list[_Seen], anchor: dict[str, Any], best: Optional[_Seen]) -> Optional[dict[str, Any]]:
        """Where memory binds (``MEMORY_ONLY``'s rule), the move that tries its values: the incumbent with them
        and the ``MEMORY_SAVERS`` at the smallest micro-batch above its own that ran out of memory ({} when only
        the diagnosis says memory-capacity-bound: the values are then single-knob moves like any other); None
        elsewhere."""
        values = {k: v for k, v in MEMORY_ONLY if v in self._values.get(k, ())}
        savers = {k: v for k, v in MEMORY_SAVERS if v in self._values.get(k, ()) and anchor.get(k) != v}
        if not values and not savers:
            return None
        batch = anchor.get("batch_size")
        larger = sorted(s.params["batch_size"] for s in seen if s.oom and isinstance(batch, int)
                        and s.params.get("batch_size", 0) > batch)
        if larger:
            return {**anchor, **values, **savers, "batch_size": larger[0]}
        if not values:
            return None
        memory_bound = best is not None and _bottleneck(best.diagnosis) == MEMORY_BOUND
        return {} if memory_bound else None

    def _bottleneck_of(self, seen: list[_Seen], best: Optional[_Seen]) -> Optional[str]:
        """The incumbent's bottleneck: its stored diagnosis, else its input wait, else the shape of its step
        time against the batch (``_batch_bound``); None when nothing says."""
        if best is None:
            return None
        label = _bottleneck(best.diagnosis)
        if label is None and best.data_wait is not None and best.data_wait >= INPUT_WAIT_HIGH:
            label = INPUT_BOUND
        if label is not None or (best.data_wait or 0.0) >= self._input_idle:
            return label  # a step that waits for input at all: its time against the batch is the loader's too
        if _undiagnosed(best) and self._step_flat(seen):
            return INPUT_BOUND
        return self._batch_bound(seen, best)

    def _step_flat(self, seen: list[_Seen]) -> bool:
        """Whether two or more of the step's knobs (``COMPUTE_KNOBS``) were measured in pairs that differ only in
        that knob, none ``skip_margin`` apart and their median within a third of it: nothing the step does moves
        the rate, so something outside the step binds it, the input pipeline where the space has its knobs. The
        median, not every pair: one noisy pair of two measurements must not hide a plateau."""
        if not any(k in self._space for k in INPUT_KNOBS):
            return False
        ratios = [self._line_ratios(seen, name) for name in self._order if name in COMPUTE_KNOBS]
        pairs = sorted(r for values in ratios for r in values)
        if sum(1 for values in ratios if values) < 2 or pairs[-1] >= 1 + self._skip_margin:
            return False
        return pairs[(len(pairs) - 1) // 2] < 1 + self._skip_margin / 3

    def _stalled(self, seen: list[_Seen]) -> bool:
        """Whether no feasible trial has beaten the study's first (the reference aside) by a third of
        ``skip_margin``: every move so far read within the noise of where the walk started."""
        ran = [s for s in seen if s.feasible and s.value and not s.reference]
        if not ran:
            return False
        start = min(ran, key=lambda s: s.number)
        return max(s.value or 0.0 for s in ran) < (1 + self._skip_margin / 3) * (start.value or 0.0)

    def _batch_bound(self, seen: list[_Seen], best: _Seen) -> Optional[str]:
        """Launch- or compute-bound from the step time against the batch on the incumbent's line (every other
        knob as the incumbent's): the fixed share of the incumbent's step in a least-squares line through
        them, with step time = batch / throughput."""
        if "batch_size" not in best.params or best.value is None:
            return None
        rest = self._rest_key(best.params, "batch_size")
        points = [(float(s.params["batch_size"]), s.params["batch_size"] / s.value) for s in seen
                  if s.value and s.feasible and "batch_size" in s.params and _is_number(s.params["batch_size"])
                  and self._rest_key(s.params, "batch_size") == rest]
        if len({b for b, _ in points}) < 2:
            return None
        mean_b = sum(b for b, _ in points) / len(points)
        mean_t = sum(t for _, t in points) / len(points)
        slope = sum((b - mean_b) * (t - mean_t) for b, t in points) / sum((b - mean_b) ** 2 for b, _ in points)
        step = best.params["batch_size"] / best.value
        fixed = (mean_t - slope * mean_b) / step
        if fixed >= LAUNCH_SHARE:
            return LAUNCH_BOUND
        # Near zero either way (noise); far below zero, time per sample grows with the batch: not compute.
        return COMPUTE_BOUND if abs(fixed) <= COMPUTE_SHARE else None

    def _tiers(self, seen: list[_Seen], best: Optional[_Seen], label: Optional[str]) -> tuple[list[str], list[str]]:
        """(knobs tried first, knobs that wait), from the incumbent's bottleneck ``label``."""
        waits: frozenset[str] = frozenset()
        if label is None and best is not None and best.data_wait is not None and best.data_wait < self._input_idle:
            waits = INPUT_KNOBS  # a step that does not wait for input cannot be sped up by the loader
        if label is not None:
            waits = BOTTLENECK_WAITS[label]
            if _undiagnosed(best):
                # Read off the batch line alone: a loader's cost per sample or per batch draws the same line
                # as the step's, so without an input wait nothing says the loader cannot help.
                waits = waits - INPUT_KNOBS
        if any(s.activations_4d is False for s in seen):
            waits = waits | {"channels_last"}  # no 4-D activations: the memory format changes nothing
        head = [k for k in BOTTLENECK_KNOBS.get(label or "", ()) if k in self._space and k not in waits]
        first = head + [k for k in self._order if k not in head and k not in waits]
        return first, [k for k in self._order if k not in first]

    def _ranked(self, candidates: Iterator[dict[str, Any]], anchor: dict[str, Any], knobs: Sequence[str],
                seen: list[_Seen], cost: Optional[CostModel], best: Optional[_Seen],
                prefer: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
        """Single-knob moves by expected gain; among near-ties (``NEAR_TIE``) by gain per predicted second.

        The expected gain is a prior: 1 / (1 + the knob's rank in ``knobs``), halved for each value of the
        knob nearer the incumbent, and quartered where measured pairs show the knob barely matters, or show
        the value slower than the incumbent's (at another point: the same point is the clearly-worse rule),
        or where the priors rank the value below the incumbent's on a knob whose prior is a speed order
        (``SPEED_ORDERED``; not on the levers the incumbent's diagnosis names).
        """
        flat = self._barely_matters(seen)
        slower = self._measured_slower(seen)
        extra = {"compile": best.cost.params["compile"]} if (
            best is not None and best.cost is not None and "compile" in best.cost.params
            and "compile" not in self._space) else {}
        rate = best.value if best is not None else None
        # The knobs the incumbent's diagnosis names as its levers are tried in that order, prior or not.
        levers = BOTTLENECK_KNOBS.get(_bottleneck(best.diagnosis) or "", ()) if best is not None else ()
        # Without a diagnosis the step's and the input pipeline's knobs are ranked apart: each group's first knob
        # is a first move, so the loader is tried within the first trials even where nothing says it binds.
        ranks = _group_ranks(knobs) if _undiagnosed(best) else {k: i for i, k in enumerate(knobs)}
        scored = []
        for i, candidate in enumerate(candidates):
            name = _moved(candidate, anchor, knobs)
            if name is None:
                continue
            order = self._value_order(name, anchor[name], prefer=prefer.get(name, ()))
            gain = 0.5 ** order.index(candidate[name]) / (1 + ranks[name])
            gain *= self._value_gains.get((name, candidate[name]), 1.0)
            # The priors among this space's values: a value the space lacks (fp8) does not move the others' ranks.
            prior = [v for v in self._priors.get(name, ()) if v in self._values[name]]
            # Of more than two values, the one right after the top one is its peer (fp16 beside bf16); lower
            # down there is none (from fp16, tf32 is a step down).
            peer = 1 if len(self._values[name]) > 2 and prior[:1] == [anchor[name]] else 0
            if name in SPEED_ORDERED and name not in levers and anchor[name] in prior and candidate[name] in prior and (
                    prior.index(candidate[name]) > prior.index(anchor[name]) + peer):
                gain *= DOWN_PRIOR_SHARE  # a slower value than the incumbent's by the priors: a check, not a lever
            if name in flat:
                gain *= 0.25
            if (name, self._key([candidate[name]]), self._key([anchor[name]])) in slower:
                gain *= 0.25  # a pair elsewhere measured this value slower than the incumbent's
            seconds = max(1e-3, cost.predict({**extra, **candidate}, rate)) if cost is not None else 1.0
            scored.append((gain, seconds, i, candidate))
        # By gain; the predicted seconds count only among moves within NEAR_TIE of the best gain left (there by
        # gain per second): a costly move that can win must not wait behind several cheap ones that rarely do.
        scored.sort(key=lambda t: (-t[0], t[2]))
        out: list[dict[str, Any]] = []
        while scored:
            tier = [t for t in scored if t[0] >= NEAR_TIE * scored[0][0]]
            scored = scored[len(tier):]
            out += [c for _, _, _, c in sorted(tier, key=lambda t: (-t[0] / t[1], t[2]))]
        return out

    def _lines(self, seen: list[_Seen], name: str) -> list[list[_Seen]]:
        """The measured trials in groups that differ only in knob ``name`` (lines along that knob)."""
        groups: dict[str, list[_Seen]] = {}
        for s in seen:
            if s.value and name in s.params:
                groups.setdefault(self._rest_key(s.params, name), []).append(s)
        return list(groups.values())

    def _measured_slower(self, seen: list[_Seen]) -> set[tuple[str, str, str]]:
        """(knob, value, other) keyed by ``_key([...])`` where a measured pair differing only in that knob
        shows ``value`` slower than ``other``."""
        out = set()
        for name in self._order:
            for members in self._lines(seen, name):
                for a, b in itertools.permutations(members, 2):
                    if a.params[name] != b.params[name] and (a.value or 0) < (b.value or 0):
                        out.add((name, self._key([a.params[name]]), self._key([b.params[name]])))
        return out

    def _line_ratios(self, seen: list[_Seen], name: str) -> list[float]:
        """For each line along knob ``name`` with two measured trials or more: its fastest over its slowest."""
        lines = [[float(s.value or 0.0) for s in line] for line in self._lines(seen, name)]
        return [max(v) / min(v) for v in lines if len(v) > 1]

    def _barely_matters(self, seen: list[_Seen]) -> set[str]:
        """Knobs whose measured pairs (differing only in that knob), on two lines or more, are all within a
        few percent: one pair at one incumbent is not enough to judge a knob."""
        out = set()
        for name in self._order:
            pairs = self._line_ratios(seen, name)
            if len(pairs) >= 2 and max(pairs) < 1 + self._skip_margin / 3:
                out.add(name)
        return out

    def _dropped(self, seen: list[_Seen]) -> set[tuple[str, Any]]:
        """(knob, value) that failed ``FAILS_TO_DROP`` times and never ran: the walk moves away from it."""
        fails = self._crashes(seen)
        ran = {(k, self._key([v])) for s in seen if s.value is not None for k, v in s.params.items()}
        out = set()
        for s in seen:
            if s.slow_compile is not None:
                out.add(("compile", s.slow_compile))  # slow for this model: one deadline is enough to say so
            if s.refused is not None:
                out.add(s.refused)  # the value said why it cannot run this workload: no second try
            for k, v in s.params.items():
                item = (k, self._key([v]))
                if fails.get(item, 0) >= FAILS_TO_DROP and item not in ran:
                    out.add((k, v))
        return out

    def _repairs(self, seen: list[_Seen], prior: dict[str, Any]) -> list[dict[str, Any]]:
        """When the prior point failed (not out of memory) and nothing else ran: revert half of the knobs
        where it differs from the reference run, then the other half, then all. One faulty value is then
        in at most one more failing trial."""
        asked = self._asked(prior)
        start = next((s for s in seen if self._key(s.params) == self._key(asked)), None)
        if start is None or not start.failed or any(s.value is not None and not s.reference for s in seen):
            return []
        return self._halves(seen, prior)

    def _halves(self, seen: list[_Seen], prior: dict[str, Any]) -> list[dict[str, Any]]:
        """The prior with the later half, the earlier half, then all of the knobs where it differs from the
        reference run reverted to the reference's values."""
        asked = self._asked(prior)
        reference = next((s.params for s in seen if s.reference and s.value is not None), {})
        safe = {k: reference.get(k, (self._value_order(k, prior[k]) or [prior[k]])[0]) for k in asked}
        differ = [k for k in self._order if k in asked and safe[k] != prior[k]]
        if not differ:
            return []
        cut = len(differ) // 2
        halves = [differ[cut:], differ[:cut], differ]
        return [{**prior, **{k: safe[k] for k in half}} for half in halves if half]

    def _restores(self, seen: list[_Seen], prior: dict[str, Any], anchor: dict[str, Any],
                  best: Optional[_Seen]) -> list[dict[str, Any]]:
        """After the prior point failed (not out of memory) and a repair of it ran: the incumbent with each
        reverted knob back at the prior's value, one at a time, in the walk's order, until each has run once.
        A repair reverts half the knobs at once; the fault is usually one value, and the others were the
        priors' best."""
        asked = self._asked(prior)
        start = next((s for s in seen if self._key(s.params) == self._key(asked)), None)
        if start is None or not start.failed or best is None or best.reference:
            return []
        # A knob is back once any trial but the reference has run with its prior value.
        back = {k for s in seen if s.value is not None and not s.reference for k in asked
                if s.params.get(k) == prior[k]}
        return [{**anchor, k: prior[k]} for k in self._order if k in asked and k not in back]

    def _anchor(self, seen: list[_Seen], prior: dict[str, Any],
                dropped: set[tuple[str, Any]]) -> tuple[dict[str, Any], bool, Optional[_Seen]]:
        """The incumbent to move from (and its trial); the failed prior point while only the reference
        run succeeded, with the values that keep failing moved away from."""
        feasible = [s for s in seen if s.feasible and s.value is not None]
        if not any(not s.reference for s in feasible):
            reference = next((s.params for s in seen if s.reference and s.value is not None), {})
            moved = {}
            for k, v in prior.items():
                if (k, v) in dropped:
                    options = [o for o in self._value_order(k, v) if (k, o) not in dropped]
                    moved[k] = reference.get(k, options[0] if options else v)
            return {**prior, **moved}, True, None
        best = max(feasible, key=lambda s: (s.value, -s.number))
        return {**prior, **best.params}, False, best

    def _neighbours(self, anchor: dict[str, Any], failed: bool, worse: set[tuple[str, Any, Any]],
                    knobs: Sequence[str], deferred: list[tuple[str, Any]],
                    prefer: Mapping[str, Sequence[Any]]) -> Iterator[dict[str, Any]]:
        for name in knobs:
            current = anchor[name]
            for value in self._value_order(name, current, downward=failed, prefer=prefer.get(name, ())):
                if (name, value, current) not in worse and (name, value) not in deferred:
                    yield {**anchor, name: value}

    def _combined(self, seen: list[_Seen], anchor: dict[str, Any], worse: set[tuple[str, Any, Any]],
                  dropped: set[tuple[str, Any]]) -> list[dict[str, Any]]:
        """The incumbent with every knob switched whose measured effect beats its value by ``COMBINE_MARGIN``
        (rule 10); nothing where none does. Effects: ridge regression (``COMBINE_RIDGE``) of the
        centred log-throughput of the feasible trials (within ``COMBINE_FLOOR`` of the fastest) on one indicator
        per knob value; a value never measured has no effect to read, and one that is clearly worse than the
        incumbent's, or dropped, is not chosen."""
        data = [s for s in seen if s.feasible and s.value and s.value > 0]
        # A trial many times slower than the fastest ran in another regime (no workers: the step waits for every
        # batch), where effects do not add up; in the fit the ridge leaks its residual into every value it ran
        # with, and on a plateau that leak alone made values measured slower read as winners.
        top = max((s.value or 0.0 for s in data), default=0.0)
        data = [s for s in data if (s.value or 0.0) >= COMBINE_FLOOR * top]
        knobs = [k for k in self._order if k in anchor]
        columns: dict[tuple[str, str], int] = {}
        for s in data:
            for k in knobs:
                if k in s.params:
                    columns.setdefault((k, self._key([s.params[k]])), len(columns))
        if len(data) < COMBINE_MIN_TRIALS:
            return []
        x = np.zeros((len(data), len(columns)))
        for row, s in enumerate(data):
            for k in knobs:
                if k in s.params:
                    x[row, columns[(k, self._key([s.params[k]]))]] = 1.0
        y = np.log([s.value for s in data])
        effect = np.linalg.solve(x.T @ x + COMBINE_RIDGE * np.eye(len(columns)), x.T @ (y - y.mean()))
        switches = {}
        for k in knobs:
            here = columns.get((k, self._key([anchor[k]])))
            if here is None:
                continue
            gains = [(effect[i] - effect[here], v) for v in self._values[k] if v != anchor[k]
                     for i in [columns.get((k, self._key([v])))]
                     if i is not None and (k, v, anchor[k]) not in worse and (k, v) not in dropped]
            gain, value = max(gains, key=lambda g: g[0], default=(0.0, None))
            if gain > COMBINE_MARGIN:
                switches[k] = value
        return [{**anchor, **switches}] if switches else []

    def _pair_moves(self, anchor: dict[str, Any], worse: set[tuple[str, Any, Any]],
                    knobs: Sequence[str], deferred: list[tuple[str, Any]]) -> Iterator[dict[str, Any]]:
        for i, first in enumerate(knobs):
            for second in knobs[i + 1:]:
                for a in self._value_order(first, anchor[first]):
                    if (first, a, anchor[first]) in worse or (first, a) in deferred:
                        continue
                    for b in self._value_order(second, anchor[second]):
                        if (second, b, anchor[second]) not in worse and (second, b) not in deferred:
                            yield {**anchor, first: a, second: b}

    def _past_slower(self, seen: list[_Seen], anchor: dict[str, Any], best: Optional[_Seen]) -> list[tuple[str, Any]]:
        """(knob, value) for numeric values beyond a value measured slower than the incumbent on the same
        line (every other knob as the incumbent's), nearest first."""
        if not self._defer_past_slower or best is None or best.value is None:
            return []
        asked = self._asked(anchor)
        out = []
        for name in self._order:
            values = self._values[name]
            current = anchor.get(name)
            if name not in asked or not (_is_number(current) and all(_is_number(v) for v in values)):
                continue
            rest = self._rest_key(asked, name)
            slower = [s.params[name] for s in seen
                      if s.value is not None and s.value < best.value and name in s.params
                      and self._rest_key(s.params, name) == rest]
            for value in self._value_order(name, current):
                if any(min(value, current) < u < max(value, current) for u in slower):
                    out.append((name, value))
        return out

    def _value_order(self, name: str, current: Any, *, downward: bool = False,
                     prefer: Sequence[Any] = ()) -> list[Any]:
        """The other values of a knob: ``prefer`` (the bottleneck's values, ``BOTTLENECK_VALUES``), then the
        priors; numbers nearest first (up before down, or down first when moving away from a config that
        failed, e.g. a smaller batch after an out-of-memory)."""
        values = [v for v in self._values[name] if v != current]
        preferred = list(dict.fromkeys(v for v in (*prefer, *self._priors.get(name, ())) if v in values))
        if preferred:
            return preferred + [v for v in values if v not in preferred]
        if not (_is_number(current) and all(_is_number(v) for v in values)):
            return values
        return nearest_first(values, current, downward=downward)

    def _crashes(self, seen: list[_Seen]) -> collections.Counter[tuple[str, str]]:
        """How many trials (not the reference) crashed with each (knob, ``_key([value])``)."""
        return collections.Counter((k, self._key([v])) for s in seen if s.failed and not s.reference
                                   for k, v in s.params.items())

    def _clearly_worse(self, seen: list[_Seen]) -> tuple[set[tuple[str, Any, Any]], set[tuple[str, Any, Any]]]:
        """(knob, value, other value) where a measured pair differing only in that knob shows ``value``
        clearly slower than ``other`` or missing the accuracy bound while ``other`` ran; and, apart, where it
        only shows ``value`` crashing (an error, a timeout: not out of memory), while the value has crashed
        fewer than ``FAILS_TO_DROP`` times in the study: a value that keeps crashing, at a combination the walk
        keeps meeting, is worse like a slow one."""
        crashes = self._crashes(seen)
        out: set[tuple[str, Any, Any]] = set()
        crashed: set[tuple[str, Any, Any]] = set()
        done = [s for s in seen if s.value is not None or not s.feasible]
        for name in self._order:
            groups: dict[str, list[_Seen]] = {}
            for s in done:
                if name in s.params:
                    groups.setdefault(self._rest_key(s.params, name), []).append(s)
            for members in groups.values():
                for a in members:
                    for b in members:
                        if a.params[name] == b.params[name] or not (b.feasible and b.value):
                            continue
                        slower = a.value is not None and a.value < (1 - self._skip_margin) * b.value
                        if slower or (not a.feasible and not a.oom):
                            once = a.failed and not slower and crashes[(name, self._key([a.params[name]]))] < FAILS_TO_DROP
                            (crashed if once else out).add((name, a.params[name], b.params[name]))
        return out, crashed - out

    # -- reading the study ----------------------------------------------------------------------
    def _asked(self, params: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in self._canonical(dict(params)).items() if k in self._space}

    @staticmethod
    def _key(params: Mapping[str, Any]) -> str:
        return json.dumps(params, sort_keys=True, default=str)

    @classmethod
    def _rest_key(cls, params: Mapping[str, Any], name: str) -> str:
        """The key of a config with one knob left out: configs on one line along that knob share it."""
        return cls._key({k: v for k, v in params.items() if k != name})

    def _read(self, study: optuna.Study, *, exclude: int) -> list[_Seen]:
        return [seen_trial(t, self._space) for t in study._get_trials(deepcopy=False, states=_TAKEN, use_cache=True)
                if t.number != exclude]


def seen_trial(trial: FrozenTrial, space: Mapping[str, BaseDistribution]) -> _Seen:
    """How a trial informs the search: its params, throughput, feasibility and whether it ran out of memory."""
    params = {k: v for k, v in trial.params.items() if k in space}
    status = trial.user_attrs.get("status", "ok")
    value: Optional[float] = None
    feasible = False
    wait = trial.user_attrs.get("data_wait_fraction")
    if trial.state == TrialState.COMPLETE and trial.values:
        feasible = status == "ok" and all(c <= 0 for c in trial.constraints.values())
        value = trial.values[0] if status == "ok" else None
    elif trial.state == TrialState.PRUNED:
        partial = trial.user_attrs.get("throughput")
        value = float(partial) if partial else None  # stopped early as hopeless: measured, and slow
    attrs = trial.user_attrs
    config = attrs.get("config") or {}
    four_d = attrs.get("extra:activations_4d")
    finished = trial.state in (TrialState.COMPLETE, TrialState.PRUNED)
    cost_params = {**({"compile": config["compile"]} if "compile" in config else {}), **params}
    return _Seen(
        number=trial.number,
        params=params,
        value=value,
        feasible=feasible,
        oom=status in ("oom", "infeasible"),  # "infeasible": ruled out by an earlier out-of-memory
        reference=attrs.get("role") == "reference",
        data_wait=float(wait) if isinstance(wait, (int, float)) and status == "ok" else None,
        diagnosis=attrs.get("diagnosis") if isinstance(attrs.get("diagnosis"), str) else None,
        activations_4d=four_d if isinstance(four_d, bool) else None,
        failed=trial.state == TrialState.COMPLETE and status not in ("ok", "oom", "infeasible", "pruned"),
        cost=sample_from_attrs(trial.number, cost_params, {**attrs, "config": cost_params})
        if finished and is_priced(attrs) else None,
        slow_compile=next(iter(slow_compile_modes([attrs])), None),
        refused=_refused(attrs.get("refused_value")),
    )


def _moved(candidate: Mapping[str, Any], anchor: Mapping[str, Any], knobs: Sequence[str]) -> Optional[str]:
    """The knob of ``knobs`` that a single move ``candidate`` changes from ``anchor``, else None."""
    return next((k for k in knobs if candidate.get(k) != anchor.get(k)), None)


def _less_precise(value: Any, than: Any) -> bool:
    """Whether precision ``value`` keeps less of fp32's arithmetic than ``than`` (``PRECISION_RANK``)."""
    rank, other = PRECISION_RANK.get(value), PRECISION_RANK.get(than)
    return rank is not None and other is not None and rank < other


def _undiagnosed(best: Optional[_Seen]) -> bool:
    """Whether the incumbent ran and nothing recorded its bottleneck: no diagnosis and no input wait (a
    ``train_fn`` that times its own loop, a table of an older format)."""
    return best is not None and best.diagnosis is None and best.data_wait is None


def _group_ranks(knobs: Sequence[str]) -> dict[str, int]:
    """Each knob's rank among the knobs of its group, in the order of ``knobs``: the input pipeline's
    (``INPUT_KNOBS``) or the step's."""
    groups = {"input": [k for k in knobs if k in INPUT_KNOBS], "step": [k for k in knobs if k not in INPUT_KNOBS]}
    return {k: i for members in groups.values() for i, k in enumerate(members)}


def _refused(value: Any) -> Optional[tuple[str, Any]]:
    """The (knob, value) of a trial's ``refused_value`` attribute, when it holds one."""
    if isinstance(value, dict) and isinstance(value.get("knob"), str) and "value" in value:
        return value["knob"], value["value"]
    return None


def _bottleneck(label: Optional[str]) -> Optional[str]:
    """The bottleneck of a stored diagnosis label ("compute-bound (no GPU readings)" is compute-bound)."""
    if not label:
        return None
    return next((b for b in BOTTLENECK_KNOBS if label == b or label.startswith(b + " ")), None)


def _values_of(distribution: BaseDistribution) -> list[Any]:
    if isinstance(distribution, CategoricalDistribution):
        return list(distribution.choices)
    if isinstance(distribution, IntDistribution):
        return list(range(distribution.low, distribution.high + 1, distribution.step))
    if isinstance(distribution, FloatDistribution):
        if distribution.step is None:
            return [distribution.low, (distribution.low + distribution.high) / 2, distribution.high]
        count = int(round((distribution.high - distribution.low) / distribution.step)) + 1
        return [round(distribution.low + i * distribution.step, 12) for i in range(count)]
    raise TypeError(f"GuidedSampler cannot enumerate {type(distribution).__name__}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
