"""Search spaces: load and validate YAML, filter by capability, sample a TrialConfig from an Optuna trial."""

from __future__ import annotations

import math

import dataclasses
import functools
import hashlib
import importlib.resources
import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import yaml

from autotune._config import (
    ALLOCATORS,
    ATTENTION_BACKENDS,
    AUGMENTS,
    BATCH_POLICIES,
    COMPILE_MODES,
    COMPILE_MODES_WITH_GRAPHS,
    COMPILE_SCOPES,
    DALI_LOADER_KNOBS,
    DDP_KNOBS,
    DEVICE_DATA_SHARE,
    GRAD_COMPRESSIONS,
    LOADER_KNOBS,
    LOADERS,
    OPTIMIZER_IMPLS,
    PRECISIONS,
    STUDY_FIELDS,
    TORCH_LOADER_KNOBS,
    Budget,
    TrialConfig,
    _check_value,
    config_value_problem,
)
from autotune._errors import SpaceError
from autotune.trial import _float8

_LATER_KNOBS = frozenset({"attention", "optimizer_impl", "activation_checkpointing", "processes_per_gpu", "mps",
                          "allocator", "compile_scope", "augment", *DDP_KNOBS})
KNOBS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(TrialConfig) if f.name not in STUDY_FIELDS)
# The fewest optimizer steps a trial may take: its loss trajectory's last quarter must hold some.
MIN_OPTIMIZER_STEPS = 8
_ENUMERATION_LIMIT = 100_000  # configs; above it ``SearchSpace.size`` is the nominal product


def _ask_order() -> tuple[str, ...]:
    # The loader is asked before either loader's knobs, so that the other loader's knobs can be skipped.
    order = [k for k in KNOBS if k != "loader"]
    order.insert(order.index(TORCH_LOADER_KNOBS[0]), "loader")
    return tuple(order)


_ASK_ORDER = _ask_order()
_TOP_LEVEL_KEYS = {"description", "knobs", "baseline", "budget", "batch_policy", "global_batch", "processes_per_trial",
                   "study_minutes", "device_data_share"}
# Every loader's own knobs: a config asks only those of its loader.
_ALL_LOADER_KNOBS = frozenset(k for knobs in LOADER_KNOBS.values() for k in knobs)


@dataclass(frozen=True)
class Knob:
    """One searchable knob: a list of choices, or an integer/float range."""

    name: str
    choices: Optional[tuple[Any, ...]] = None
    low: Optional[float] = None
    high: Optional[float] = None
    step: Optional[float] = None

    @property
    def values(self) -> tuple[Any, ...]:
        """Every value the knob can take (ranges are expanded)."""
        if self.choices is not None:
            return self.choices
        assert self.low is not None and self.high is not None and self.step is not None
        out, v = [], self.low
        while v <= self.high + 1e-9:
            out.append(v)
            v += self.step
        return tuple(out)

    @property
    def fixed(self) -> bool:
        return len(self.values) == 1

    def to_dict(self) -> dict[str, Any]:
        if self.choices is not None:
            return {"choices": list(self.choices)}
        return {"low": self.low, "high": self.high, "step": self.step}


@dataclass(frozen=True)
class Combination:
    """Knob values that each can run, but not together (e.g. an attention kernel in one precision), and why."""

    values: tuple[tuple[str, Any], ...]  # (knob, value) pairs, in the order they are named
    reason: str

    @property
    def key(self) -> str:
        """How ``SearchSpace.removed`` names it: ``attention=flash with precision=fp32``."""
        return " with ".join(f"{knob}={_fmt(value)}" for knob, value in self.values)


@dataclass(frozen=True)
class SearchSpace:
    """A validated search space. Knobs not listed keep the baseline's value.

    The baseline carries the batch policy: under ``fixed`` its ``global_batch`` is every trial's global
    batch and the ``batch_size`` knob is the micro-batch; under ``scale`` the knob is the global batch.
    """

    name: str
    knobs: dict[str, Knob]
    baseline: TrialConfig = TrialConfig()
    budget: Budget = Budget()
    description: str = ""
    removed: dict[str, str] = field(default_factory=dict)  # "knob=value" -> why the probe removed it
    declared_batch_sizes: Optional[Knob] = None  # the batch knob as written, before the policy trimmed it
    global_batch_stated: bool = False  # the YAML set global_batch (else it follows the baseline batch x ranks)
    # The YAML states neither global_batch nor baseline.batch_size: the batch is the script's to state
    # (--batch-size, ctx.loader), and the micro-batches and the budget are checked against it once it does.
    batch_placeholder: bool = False
    # Values the probe kept that cannot run together; each is also in ``removed`` under its key.
    combinations: tuple[Combination, ...] = ()
    # The whole study's default budget in minutes (``study_minutes:``), when the space declares one; a
    # budget the user gives wins. Not part of the fingerprint: it says how long to search, not what.
    study_minutes: Optional[float] = None
    # A (knob, value)'s predicted share of its best case, from what the reference run showed of the model
    # (``restrict_to_model``): precision=fp8 gains only on the linear work it converts. The guided walk
    # scales that move's expected gain by it. Not part of the fingerprint.
    predicted_gains: dict[tuple[str, Any], float] = field(default_factory=dict)

    @property
    def batch_policy(self) -> str:
        return self.baseline.batch_policy

    @property
    def global_batch(self) -> int:
        """Under ``fixed``, every trial's global batch; under ``scale``, the baseline's."""
        return self.baseline.global_batch_size

    @property
    def device_data_share(self) -> float:
        """The share of device memory (host memory on the CPU) that ``loader: device`` may fill with the data."""
        return self.baseline.device_data_share

    @property
    def processes_per_trial(self) -> int:
        """Ranks of each trial: above 1 a trial is a DDP job (``batch_size`` is then each rank's micro-batch)."""
        return self.baseline.processes_per_trial

    def to_dict(self) -> dict[str, Any]:
        """The user-facing definition (without probe removals), used for the fingerprint."""
        defaults = TrialConfig()
        # Knobs added after studies were stored count only where set, so those studies keep their fingerprint.
        baseline = {k: v for k, v in self.baseline.to_dict().items()
                    if k not in STUDY_FIELDS and not (k in _LATER_KNOBS and v == getattr(defaults, k))}
        knobs = dict(self.knobs)
        if self.declared_batch_sizes is not None:
            knobs["batch_size"] = self.declared_batch_sizes  # as written: the policy may have trimmed it
        data: dict[str, Any] = {
            "knobs": {k: v.to_dict() for k, v in sorted(knobs.items())},
            "baseline": baseline,
            "budget": {k: getattr(self.budget, k) for k in Budget.SPACE_FIELDS},
            "batch_policy": self.batch_policy,
        }
        if self.batch_policy == "fixed":
            data["global_batch"] = self.global_batch
        if self.processes_per_trial > 1:  # only where set, so one-process studies keep their fingerprint
            data["processes_per_trial"] = self.processes_per_trial
        if self.device_data_share != DEVICE_DATA_SHARE:  # likewise
            data["device_data_share"] = self.device_data_share
        return data

    def with_batch_policy(self, policy: str, *, where: Optional[str] = None) -> "SearchSpace":
        """This space under another batch policy (``fixed`` keeps the baseline's batch as the global batch).

        Raises:
            SpaceError: the policy is unknown, or a micro-batch does not divide the global batch.
        """
        if policy == self.batch_policy:
            return self
        global_batch = self.baseline.batch_size * self.processes_per_trial if policy == "fixed" else None
        return _with_policy(self, policy, global_batch, where or self.name)

    def with_processes(self, processes: int, *, where: Optional[str] = None) -> "SearchSpace":
        """This space with ``processes`` ranks per trial. The baseline's ``batch_size`` stays each rank's
        batch, so under ``fixed`` the global batch becomes batch x ranks (the default DDP job) unless the
        space sets ``global_batch``.

        Raises:
            SpaceError: not a positive integer, or a micro-batch x ranks that does not divide the global batch.
        """
        where = where or self.name
        _check_processes(processes, where)
        if processes == self.processes_per_trial:
            return self
        space = dataclasses.replace(self, baseline=self.baseline.replace(
            processes_per_trial=processes, global_batch=None, batch_policy="scale"))
        stated = self.global_batch if self.batch_policy == "fixed" and self.global_batch_stated else None
        space = _with_policy(space, self.batch_policy, stated, where)
        _check_budget(space, where)
        _check_packing(space.knobs, space.baseline, where)
        return space

    @property
    def fraction_stated(self) -> bool:
        """The space sets ``memory_fraction`` itself (a knob, or a baseline below 1); otherwise each of N
        co-located copies gets 1/N."""
        return "memory_fraction" in self.knobs or self.baseline.memory_fraction < 1.0

    def with_baseline(self, values: dict[str, Any], *, where: str = "--baseline") -> "SearchSpace":
        """This space with some of its baseline's knobs set otherwise (checked as ``baseline:`` in YAML is).

        Under ``fixed`` a ``batch_size`` given here is also the global batch, the space's ``global_batch``
        included: the baseline is the training that the user runs, and ``fixed`` keeps its global batch.

        Raises:
            SpaceError: an unknown knob, a value the knob cannot take, or one the batch policy refuses,
                in one line that starts with ``where``.
        """
        values = check_baseline(values, where=where)
        if not values:
            return self
        base = {k: v for k, v in self.baseline.to_dict().items() if k not in STUDY_FIELDS}
        base.update(values)
        space = dataclasses.replace(self, baseline=TrialConfig(**base, batch_policy="scale",
                                                               device_data_share=self.device_data_share))
        if self.batch_policy == "scale":
            return _with_policy(space, "scale", None, where)
        stated = values["batch_size"] * self.processes_per_trial if "batch_size" in values else self.global_batch
        # The script's batch (--batch-size, --baseline, ctx.loader): micro-batches that do not divide it are left out.
        placeholder = self.batch_placeholder and "batch_size" not in values
        space = _with_policy(space, "fixed", stated, where, strict=False, placeholder=placeholder)
        if self.batch_placeholder and not placeholder:
            _check_budget(space, where)  # checked at last against the batch the script trains at
        return dataclasses.replace(space, batch_placeholder=placeholder)

    @property
    def fingerprint(self) -> str:
        blob = json.dumps(self.to_dict(), sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @functools.cached_property
    def size(self) -> int:
        """Distinct configs: knobs that cannot matter for a config (prefetch without workers, the other
        loader's knobs, graphs under a compile mode that captures its own) do not multiply it, and configs
        holding values that cannot run together here (``combinations``) are not counted."""
        nominal = 1
        for knob in self.knobs.values():
            nominal *= len(knob.values)
        if nominal > _ENUMERATION_LIMIT:
            return nominal  # an upper bound; enumerating would cost more than it tells
        names = list(self.knobs)
        asked = (self.asked_params(dict(zip(names, values)))
                 for values in itertools.product(*(self.knobs[n].values for n in names)))
        distinct = {json.dumps(params, sort_keys=True, default=str) for params in asked
                    if not (self.combinations and self.cannot_run(params))}
        return len(distinct)

    def without(self, knob: str, value: Any, reason: str) -> "SearchSpace":
        """This space with one value of one knob removed, recording why."""
        spec = self.knobs.get(knob)
        if spec is None or value not in spec.values:
            return self
        remaining = tuple(v for v in spec.values if v != value)
        knobs = dict(self.knobs)
        removed = dict(self.removed)
        removed[f"{knob}={_fmt(value)}"] = reason
        baseline = self.baseline
        if remaining:
            knobs[knob] = Knob(knob, choices=remaining)
        else:
            del knobs[knob]
        if getattr(baseline, knob) == value:
            fallback = remaining[0] if remaining else getattr(TrialConfig(), knob)
            baseline = baseline.replace(**{knob: fallback})
        return dataclasses.replace(self, knobs=knobs, removed=removed, baseline=baseline)

    def with_combination(self, combination: Combination) -> "SearchSpace":
        """This space with one more combination that cannot run, recorded in ``removed`` too."""
        if combination in self.combinations:
            return self
        return dataclasses.replace(self, combinations=(*self.combinations, combination),
                                   removed={**self.removed, combination.key: combination.reason})

    def cannot_run(self, values: Mapping[str, Any]) -> Optional[str]:
        """Why a config cannot run here (it holds a recorded combination), else None.

        ``values`` is a full config (``TrialConfig.to_dict()``) or a trial's params: a knob it lacks takes
        the value that sampling these params gives it (the baseline's where the knob is not searched).
        """
        full: Optional[TrialConfig] = None
        for combination in self.combinations:
            for knob, value in combination.values:
                if knob in values:
                    actual = values[knob]
                else:
                    full = full or self.sample(_DictAsker(dict(values)))
                    actual = getattr(full, knob)
                if actual != value:
                    break
            else:
                return combination.reason
        return None

    def max_batch_size(self) -> int:
        spec = self.knobs.get("batch_size")
        return max(spec.values) if spec else self.baseline.batch_size

    def sample(self, trial: Any) -> TrialConfig:
        """Ask an Optuna trial for one config. Knobs that cannot matter for a value are not asked."""
        chosen: dict[str, Any] = {}
        for name in _ASK_ORDER:
            spec = self.knobs.get(name)
            if spec is None or spec.fixed:
                chosen[name] = spec.values[0] if spec else getattr(self.baseline, name)
                continue
            if name == "compile_scope" and chosen.get("compile") == "off":
                chosen[name] = getattr(TrialConfig(), name)  # nothing is compiled: the scope cannot matter
                continue
            if name == "cuda_graphs" and chosen.get("compile") in COMPILE_MODES_WITH_GRAPHS:
                chosen[name] = False  # the compile mode captures graphs itself
                continue
            if name == "optimizer_impl" and chosen.get("precision") == "fp16" and chosen.get("cuda_graphs"):
                # fp16 in a graph needs the fused step (the scaler's check stays on the device): ctx.optimizer
                # makes "default" fused there, and foreach cannot run.
                chosen[name] = "default"
                continue
            if name in ("prefetch_factor", "persistent_workers") and chosen.get("num_workers") == 0:
                chosen[name] = getattr(TrialConfig(), name)
                continue
            if name in _ALL_LOADER_KNOBS and name not in LOADER_KNOBS.get(chosen.get("loader"), TORCH_LOADER_KNOBS):
                chosen[name] = getattr(TrialConfig(), name)  # another loader's knob cannot matter
                continue
            if spec.choices is not None:
                chosen[name] = trial.suggest_categorical(name, list(spec.choices))
            elif name == "memory_fraction":
                chosen[name] = trial.suggest_float(name, spec.low, spec.high, step=spec.step)
            else:
                chosen[name] = trial.suggest_int(name, int(spec.low), int(spec.high), step=int(spec.step))
        if chosen["processes_per_gpu"] > 1 and not self.fraction_stated:
            chosen["memory_fraction"] = 1.0 / chosen["processes_per_gpu"]  # each copy its share of the device
        policy = self.batch_policy
        return TrialConfig(**chosen, batch_policy=policy, global_batch=self.global_batch if policy == "fixed" else None,
                           processes_per_trial=self.processes_per_trial, device_data_share=self.device_data_share)

    def asked_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """The params a trial asks for to reach this config: knobs that cannot matter for it are not asked."""
        asker = _DictAsker(params)
        self.sample(asker)
        return asker.asked

    def distributions(self) -> dict[str, Any]:
        """The Optuna distribution of each searchable knob (for enqueueing and replay)."""
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

        out: dict[str, Any] = {}
        for name, spec in self.knobs.items():
            if spec.fixed:
                continue
            if spec.choices is not None:
                out[name] = CategoricalDistribution(list(spec.choices))
            elif name == "memory_fraction":
                out[name] = FloatDistribution(spec.low, spec.high, step=spec.step)
            else:
                out[name] = IntDistribution(int(spec.low), int(spec.high), step=int(spec.step))
        return out


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


_RANGE_KNOBS = ("batch_size", "num_workers", "prefetch_factor", "cpu_threads", "memory_fraction", "bucket_cap_mb",
                *DALI_LOADER_KNOBS)
# A number YAML 1.2 reads that PyYAML's 1.1 resolver leaves a string: 1e-7, 1E5, 5e2 (1.1 wants "1.0e-7").
_YAML12_NUMBER = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")


def _number(text: str) -> Any:
    """A numeric string as the number YAML 1.2 reads (an integer when it is written as one), else the string."""
    if not _YAML12_NUMBER.fullmatch(text.strip()):
        return text
    value = float(text)
    return int(value) if value.is_integer() and "." not in text else value


def _normalise(knob: str, value: Any) -> Any:
    # YAML 1.1 reads a bare `off` as false; for compile it means "off".
    if knob == "compile" and value is False:
        return "off"
    if knob in _RANGE_KNOBS and isinstance(value, str):
        value = _number(value)
    if knob == "memory_fraction" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def check_baseline(values: dict[str, Any], *, where: str = "--baseline") -> dict[str, Any]:
    """Baseline knob values, normalised as the YAML's are.

    Raises:
        SpaceError: an unknown knob or a value it cannot take, in one line that starts with ``where``.
    """
    out: dict[str, Any] = {}
    for knob, value in values.items():
        if knob not in KNOBS:
            raise SpaceError(f"{where}: {knob}: unknown knob (known: {', '.join(KNOBS)})")
        value = _normalise(knob, value)
        problem = _check_value(knob, value) or _baseline_problem(knob, value)
        if problem:
            raise SpaceError(f"{where}: {knob}: {problem}")
        out[knob] = value
    return out


def _baseline_problem(knob: str, value: Any) -> str:
    """Why a value the knob can take is no baseline's ("" when it is one): the baseline's runs are the
    fp32 accuracy references and its throughput, so a baseline at another precision would be printed as
    stated while fp32 ran."""
    if knob == "precision" and value != "fp32":
        return (f"{value}: the baseline trains in fp32 (its runs are the accuracy references and the speed-up's "
                f"denominator); a baseline at another precision is not supported: keep precision=fp32 here and "
                f"list {value} among the precision knob's values to measure it (docs/knobs.md, \"A baseline in "
                f"fp32 only\", says why)")
    return ""


def parse_baseline(text: str, *, where: str = "--baseline") -> dict[str, Any]:
    """``batch_size=32,precision=fp32`` as baseline knob values; each value is read as YAML reads it
    (``true``, ``null``, ``32``, ``off``).

    Raises:
        SpaceError: a malformed pair, a knob named twice, an unknown knob or a value it cannot take.
    """
    values: dict[str, Any] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        knob, sep, raw = (s.strip() for s in item.partition("="))
        if not sep or not knob or not raw:
            raise SpaceError(f"{where}: {item!r} is not knob=value (e.g. --baseline batch_size=32,precision=fp32)")
        if knob in values:
            raise SpaceError(f"{where}: {knob} is given twice")
        try:
            values[knob] = load_yaml(raw)
        except yaml.YAMLError:
            values[knob] = raw
    if not values:
        raise SpaceError(f"{where}: no knob=value given (e.g. --baseline batch_size=32,precision=fp32)")
    return check_baseline(values, where=where)


def format_baseline(values: dict[str, Any]) -> str:
    """Baseline knob values as ``--baseline`` takes them."""
    return ",".join(f"{k}={'null' if v is None else _fmt(v)}" for k, v in values.items())


def _parse_knob(where: str, name: str, raw: Any) -> Knob:
    if isinstance(raw, dict):
        unknown = sorted(set(raw) - {"choices", "low", "high", "step"})
        if unknown:
            raise SpaceError(f"{where}: knobs.{name}: unknown key {unknown[0]!r} (use choices, or low/high/step)")
        if "choices" in raw:
            raw = raw["choices"]
        else:
            return _parse_range(where, name, raw)
    values = raw if isinstance(raw, list) else [raw]
    if not values:
        raise SpaceError(f"{where}: knobs.{name}: empty choices")
    values = [_normalise(name, v) for v in values]
    for v in values:
        problem = _check_value(name, v)
        if problem:
            raise SpaceError(f"{where}: knobs.{name}: {problem}")
    if len(set(map(repr, values))) != len(values):
        raise SpaceError(f"{where}: knobs.{name}: duplicate choices")
    return Knob(name, choices=tuple(values))


MAX_RANGE_VALUES = 10_000  # values one range knob may expand to


def _parse_range(where: str, name: str, raw: dict[str, Any]) -> Knob:
    if name not in _RANGE_KNOBS:
        raise SpaceError(f"{where}: knobs.{name}: a range needs a numeric knob; give choices instead")
    if "low" not in raw or "high" not in raw:
        raise SpaceError(f"{where}: knobs.{name}: a range needs both low and high")
    low, high = _normalise(name, raw["low"]), _normalise(name, raw["high"])
    default_step = 8 if name == "batch_size" else (0.1 if name == "memory_fraction" else 1)
    step = _normalise(name, raw.get("step", default_step))
    for key, v in (("low", low), ("high", high)):
        problem = _check_value(name, v)
        if problem:
            raise SpaceError(f"{where}: knobs.{name}.{key}: {problem}")
    if low > high:
        raise SpaceError(f"{where}: knobs.{name}: low {low} > high {high}")
    if not isinstance(step, (int, float)) or isinstance(step, bool) or step <= 0:
        raise SpaceError(f"{where}: knobs.{name}.step: {step!r} is not a positive number")
    if name == "batch_size":
        # A range proposes Tensor Core multiples; other sizes can be listed as choices.
        for key, v in (("low", low), ("step", step)):
            if v % 8:
                raise SpaceError(f"{where}: knobs.batch_size.{key}: {v} is not a multiple of 8 (a range of batch sizes "
                                 "proposes Tensor Core multiples; list other sizes as choices, e.g. [10, 20])")
    count = math.floor((high - low) / step + 1e-9) + 1 if math.isfinite((high - low) / step) else math.inf
    if count > MAX_RANGE_VALUES:
        # Every value of a range is expanded (the space's size, restriction, the sampler's grid).
        raise SpaceError(f"{where}: knobs.{name}: {low} to {high} in steps of {step:g} is {count:,} values; at most "
                         f"{MAX_RANGE_VALUES:,} (use a coarser step or list the choices)")
    return Knob(name, low=low, high=high, step=step)


def parse_space(data: Any, *, where: str = "<space>", name: Optional[str] = None) -> SearchSpace:
    """Validate a parsed YAML document into a SearchSpace.

    Raises:
        SpaceError: one line naming ``where`` and the offending key.
    """
    if not isinstance(data, dict):
        raise SpaceError(f"{where}: expected a mapping with a 'knobs' key")
    unknown = sorted(set(data) - _TOP_LEVEL_KEYS)
    if unknown:
        raise SpaceError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(_TOP_LEVEL_KEYS))})")
    raw_knobs = data.get("knobs")
    if not isinstance(raw_knobs, dict) or not raw_knobs:
        raise SpaceError(f"{where}: 'knobs' must be a non-empty mapping")
    knobs: dict[str, Knob] = {}
    for knob_name, raw in raw_knobs.items():
        if knob_name not in KNOBS:
            raise SpaceError(f"{where}: knobs.{knob_name}: unknown knob (known: {', '.join(KNOBS)})")
        knobs[knob_name] = _parse_knob(where, knob_name, raw)

    raw_baseline = data.get("baseline") or {}
    if not isinstance(raw_baseline, dict):
        raise SpaceError(f"{where}: 'baseline' must be a mapping of knob values")
    base_values: dict[str, Any] = {}
    for knob_name, value in raw_baseline.items():
        if knob_name not in KNOBS:
            raise SpaceError(f"{where}: baseline.{knob_name}: unknown knob")
        value = _normalise(knob_name, value)
        if not (knob_name == "cpu_threads" and value is None):
            problem = _check_value(knob_name, value) or _baseline_problem(knob_name, value)
            if problem:
                raise SpaceError(f"{where}: baseline.{knob_name}: {problem}")
        base_values[knob_name] = value
    policy = data.get("batch_policy", "fixed")
    if policy not in BATCH_POLICIES:
        raise SpaceError(f"{where}: batch_policy: {policy!r} is not one of {', '.join(BATCH_POLICIES)}")
    global_batch = data.get("global_batch")
    if global_batch is not None:
        if not isinstance(global_batch, int) or isinstance(global_batch, bool) or global_batch <= 0:
            raise SpaceError(f"{where}: global_batch: {global_batch!r} is not a positive integer")
        if policy != "fixed":
            raise SpaceError(f"{where}: global_batch goes with batch_policy fixed (under scale the batch_size knob "
                             "is the global batch)")

    processes = data.get("processes_per_trial", 1)
    _check_processes(processes, where)
    share = data.get("device_data_share", DEVICE_DATA_SHARE)
    if not isinstance(share, (int, float)) or isinstance(share, bool) or not 0 < share <= 1:
        raise SpaceError(f"{where}: device_data_share: {share!r} is not a fraction in (0, 1]")
    copies = base_values.get("processes_per_gpu", 1)
    if copies > 1 and "memory_fraction" not in base_values:
        base_values["memory_fraction"] = 1.0 / copies
    _check_packing(knobs, TrialConfig(processes_per_trial=processes), where,
                   copies=copies, fraction=base_values.get("memory_fraction"))

    raw_budget = data.get("budget") or {}
    if not isinstance(raw_budget, dict):
        raise SpaceError(f"{where}: 'budget' must be a mapping")
    budget_fields = set(Budget.SPACE_FIELDS)  # a run's time share and schedule are the study's to set
    for key, value in raw_budget.items():
        if key not in budget_fields:
            raise SpaceError(f"{where}: budget.{key}: unknown key (known: {', '.join(sorted(budget_fields))})")
        if not isinstance(value, int) or isinstance(value, bool):
            raise SpaceError(f"{where}: budget.{key}: {value!r} is not an integer")
    try:
        budget = Budget(**raw_budget)
    except ValueError as exc:
        raise SpaceError(f"{where}: budget: {exc}") from None

    minutes = data.get("study_minutes")
    if minutes is not None and (isinstance(minutes, bool) or not isinstance(minutes, (int, float))
                                or not 0 < minutes < float("inf")):
        raise SpaceError(f"{where}: study_minutes: {minutes!r} is not a positive number of minutes")
    space = SearchSpace(
        name=name or where,
        study_minutes=float(minutes) if minutes is not None else None,
        knobs=knobs,
        baseline=TrialConfig(**base_values, batch_policy="scale", processes_per_trial=processes,
                             device_data_share=float(share)),
        budget=budget,
        description=str(data.get("description", "")),
        global_batch_stated=global_batch is not None,
    )
    # A space that states neither its global batch nor its baseline's batch leaves it to the script: its
    # micro-batches are checked against the default only leniently (left out, not refused).
    placeholder = global_batch is None and "batch_size" not in base_values
    space = _with_policy(space, policy, global_batch, where, strict=not placeholder, placeholder=placeholder)
    if not placeholder or space.batch_policy == "scale":  # under scale the batch values are what trials run
        _check_budget(space, where)
    return dataclasses.replace(space, batch_placeholder=placeholder)


def _check_budget(space: SearchSpace, where: str) -> None:
    budget, largest, processes = space.budget, space.max_batch_size(), space.processes_per_trial
    if budget.samples < budget.min_samples_for(largest * processes):
        ranks = f" x {processes} ranks" if processes > 1 else ""
        raise SpaceError(
            f"{where}: budget.samples: {budget.samples} is too few for batch {largest}{ranks} "
            f"(needs {budget.min_samples_for(largest * processes)} = batch{ranks} x (warmup_steps + windows))"
        )


def _check_packing(knobs: dict[str, Knob], baseline: TrialConfig, where: str, *, copies: Optional[int] = None,
                   fraction: Optional[float] = None) -> None:
    """Co-located copies (``processes_per_gpu``) must fit the device and cannot be DDP jobs.

    Raises:
        SpaceError: N x memory_fraction > 1 for some pair of values, or copies with processes_per_trial > 1.
    """
    counts = knobs["processes_per_gpu"].values if "processes_per_gpu" in knobs else (copies or baseline.processes_per_gpu,)
    ranks = baseline.processes_per_trial
    if ranks > 1 and max(counts) > 1:
        raise SpaceError(f"{where}: processes_per_gpu {max(counts)} with processes_per_trial {ranks}: a DDP trial "
                         "already runs one rank per GPU, and co-located copies of a DDP job are not supported (tune "
                         "one or the other)")
    if "memory_fraction" in knobs:
        fractions = knobs["memory_fraction"].values
    else:
        stated = fraction if fraction is not None else baseline.memory_fraction
        fractions = (stated,) if stated < 1.0 else ()  # 1.0 unstated: each copy gets 1/N
    for n in counts:
        for f in fractions:
            if n * f > 1 + 1e-9:
                raise SpaceError(
                    f"{where}: knobs.processes_per_gpu: {n} copies x memory_fraction {f:g} is more than the whole "
                    f"device (N x fraction > 1); list fractions of at most 1/{n}, or leave memory_fraction out so "
                    "that each copy gets 1/N")


def _check_processes(processes: Any, where: str) -> None:
    if not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
        raise SpaceError(f"{where}: processes_per_trial: {processes!r} is not a positive integer")


def _with_policy(space: SearchSpace, policy: str, global_batch: Optional[int], where: str, *,
                 strict: bool = True, placeholder: bool = False) -> SearchSpace:
    """Set the batch policy on the space's baseline, checking the micro-batches against the global batch.

    ``strict``: a micro-batch that does not divide the global batch is an error (the space contradicts
    itself); otherwise (the global batch is the script's, stated after the space was written) it is left
    out, with the reason recorded, as a micro-batch above the global batch is. ``placeholder``: the global
    batch is only the default until the script states its own, so the budget is checked against that one.
    """
    if policy not in BATCH_POLICIES:
        raise SpaceError(f"{where}: batch_policy: {policy!r} is not one of {', '.join(BATCH_POLICIES)}")
    base = space.baseline
    declared = space.declared_batch_sizes or space.knobs.get("batch_size")
    knobs = {k: v for k, v in space.knobs.items() if k != "batch_size"}
    removed = {k: v for k, v in space.removed.items() if not k.startswith("batch_size=")}
    if policy == "scale":
        if declared is not None:
            knobs["batch_size"] = declared
        return dataclasses.replace(space, knobs=knobs, removed=removed, declared_batch_sizes=declared,
                                   baseline=base.replace(batch_policy="scale", global_batch=None))
    # Every rank takes a micro-batch per micro-step: per-rank micro-batch x accumulation x ranks = global batch.
    ranks = base.processes_per_trial
    per_rank = f" x {ranks} ranks" if ranks > 1 else ""
    total = global_batch or base.batch_size * ranks
    if total % (base.batch_size * ranks):
        raise SpaceError(f"{where}: baseline.batch_size: {base.batch_size}{per_rank} does not divide the global batch "
                         f"{total} (batch_policy fixed)")
    for value in declared.values if declared else ():
        if value * ranks <= total and total % (value * ranks) and strict:
            raise SpaceError(
                f"{where}: knobs.batch_size: {value}{per_rank} does not divide the global batch {total} (batch_policy "
                f"fixed accumulates micro-batches into it); list divisors of {total // ranks}, set global_batch, or "
                "use batch_policy: scale"
            )
    if space.budget.samples // total < MIN_OPTIMIZER_STEPS and not placeholder:
        raise SpaceError(
            f"{where}: budget.samples: {space.budget.samples} gives fewer than {MIN_OPTIMIZER_STEPS} optimizer "
            f"steps at the global batch {total}"
        )
    if declared is not None:
        micro = tuple(v for v in declared.values if v * ranks <= total and not total % (v * ranks))
        above = [_fmt(v) for v in declared.values if v * ranks > total]
        if above:
            over = per_rank.replace(" x ", " over ")
            removed[f"batch_size={','.join(above)}"] = (f"above the global batch {total}{over} (batch_policy fixed: the "
                                                        "batch knob is the micro-batch; batch_policy scale lets it grow)")
        apart = [_fmt(v) for v in declared.values if v * ranks <= total and total % (v * ranks)]
        if apart:
            removed[f"batch_size={','.join(apart)}"] = (f"does not divide the global batch {total}{per_rank} (batch_policy "
                                                        "fixed accumulates micro-batches into it)")
        if micro:
            knobs["batch_size"] = Knob("batch_size", choices=micro)
    return dataclasses.replace(space, knobs=knobs, removed=removed, declared_batch_sizes=declared,
                               baseline=base.replace(batch_policy="fixed", global_batch=total))


def _builtin_spaces_dir() -> Path:
    """Where the built-in spaces are: package data of an installed wheel (``autotune/search_spaces``), else
    the top-level ``search_spaces/`` of the source checkout that this package was imported from (an
    editable install, or the checkout on ``PYTHONPATH``)."""
    packaged = importlib.resources.files("autotune") / "search_spaces"
    if isinstance(packaged, Path) and packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[2] / "search_spaces"


SPACES_DIR = _builtin_spaces_dir()


def space_path(name_or_path: Union[str, Path]) -> Path:
    """Resolve a space given as a file path or as a name in ``search_spaces/``."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        return path
    return SPACES_DIR / f"{name_or_path}.yaml"


class _NoAliasLoader(yaml.SafeLoader):
    """PyYAML's safe loader without aliases: an alias (``*name``) repeats a node without repeating its text,
    so a file of a few hundred bytes can nest aliases into billions of values (an alias bomb) that the
    loader builds, and an error message prints, before anything else can check them."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, f"found an alias (*{str(event.anchor)[:40]}); aliases are not "
                                              "accepted: write the value out", event.start_mark)
        return super().compose_node(parent, index)


def load_yaml(text: str) -> Any:
    """``yaml.safe_load(text)``, refusing aliases (``_NoAliasLoader``) and nesting too deep to build.

    Raises:
        yaml.YAMLError: the text does not parse, holds an alias, or nests too deeply.
    """
    try:
        return yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506 - a SafeLoader
    except RecursionError:
        raise yaml.MarkedYAMLError(problem="nested too deeply") from None


def load_space(name_or_path: Union[str, Path]) -> SearchSpace:
    """Load and validate a YAML search space.

    Raises:
        SpaceError: the file is missing, does not parse, or does not validate.
    """
    path = space_path(name_or_path)
    where = str(name_or_path) if not Path(name_or_path).exists() else str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise SpaceError(f"{where}: not UTF-8 text (byte {exc.start}); a search space is YAML") from None
    except FileNotFoundError:
        known = ", ".join(p.stem for p in sorted(SPACES_DIR.glob("*.yaml")))
        raise SpaceError(f"{where}: no such search space (built in: {known})") from None
    except OSError as exc:
        raise SpaceError(f"{where}: {exc.strerror}") from None
    try:
        data = load_yaml(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise SpaceError(f"{where}: does not parse{at}: {problem}") from None
    return parse_space(data, where=where, name=path.stem)


def builtin_spaces() -> list[Path]:
    """The built-in space files, sorted; empty when the installation lacks them."""
    return sorted(SPACES_DIR.glob("*.yaml"))


def describe_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Name what differs between two ``SearchSpace.to_dict()`` results, e.g. ``knobs.batch_size``."""
    changes = [key for key in ("batch_policy", "global_batch") if old.get(key) != new.get(key)]
    for section in ("knobs", "baseline", "budget"):
        a, b = old.get(section, {}), new.get(section, {})
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                changes.append(f"{section}.{key}")
    return changes


def restrict_to(space: SearchSpace, caps: Any) -> SearchSpace:
    """Remove every knob value the machine cannot run, recording why (the capability probe).

    Args:
        space: A validated space.
        caps: The machine's ``Capabilities``.
    """
    removals: list[tuple[str, Any, str]] = []
    if not caps.cuda:
        why = "no CUDA device"
        removals += [
            ("precision", "tf32", f"{why}: TF32 is a CUDA Tensor Core mode"),
            ("precision", "fp16", f"{why}: fp16 with GradScaler is CUDA-only here"),
            ("cuda_graphs", True, f"{why}: CUDA Graphs need CUDA"),
            ("cudnn_benchmark", True, f"{why}: cuDNN needs CUDA"),
            ("pin_memory", True, f"{why}: pinned memory only helps host-to-device copies"),
        ]
        spec = space.knobs.get("memory_fraction")
        for value in spec.values if spec else ():
            if value < 1.0:
                removals.append(("memory_fraction", value, f"{why}: the memory fraction caps the CUDA allocator"))
        for mode in COMPILE_MODES_WITH_GRAPHS:
            removals.append(("compile", mode, f"{why}: mode {mode} relies on CUDA Graphs"))
        removals.append(("mps", True, f"{why}: CUDA MPS shares a GPU between processes; co-located copies "
                                      "(processes_per_gpu) share the CPU's cores instead"))
        removals.append(("precision", "fp8", f"{why}: float8 matmuls need a GPU of compute capability 8.9 or "
                                             "newer (Ada, Hopper)"))
        removals.append(("allocator", "expandable", f"{why}: expandable segments are a setting of the CUDA "
                                                    "caching allocator"))
    else:
        if not caps.bf16:
            removals.append(("precision", "bf16", f"{caps.gpu_name} has no bf16 support"))
        if getattr(caps, "fp8_unavailable", ""):
            removals.append(("precision", "fp8", caps.fp8_unavailable))
    if not caps.compile:
        for mode in COMPILE_MODES[1:]:
            removals.append(("compile", mode, caps.compile_reason))
    for value, why in sorted(caps.attention_unavailable.items()):
        removals.append(("attention", value, why))
    for value, why in sorted(caps.optimizer_impl_unavailable.items()):
        removals.append(("optimizer_impl", value, why))
    if caps.checkpointing_unavailable:
        removals.append(("activation_checkpointing", True, caps.checkpointing_unavailable))
    if not caps.dali:
        # Without a GPU DALI still runs (CPU-only mode), so only a missing or broken install removes it.
        why = (caps.extras or {}).get("dali_reason") or "nvidia.dali is not importable"
        removals.append(("loader", "dali", f"{why} (install the `dali` extra: pip install -e '.[dali]')"))
    spec = space.knobs.get("cpu_threads")
    if caps.cpu_count > 0:  # 0: not probed
        for value in spec.values if spec else ():
            if value is not None and value > caps.cpu_count:
                removals.append(("cpu_threads", value, f"this process may use {caps.cpu_count} cores (its CPU "
                                 f"affinity): more compute threads than cores cannot run in parallel"))
    removals += _process_removals(space, caps)
    for knob, value, why in removals:
        space = space.without(knob, value, why)
    space = _restrict_combinations(space, "attention", "precision",
                                   getattr(caps, "attention_precision_unavailable", None) or {})
    return _restrict_combinations(space, "precision", "compile", {"fp8": {"off": FP8_NEEDS_COMPILE}})


# Why fp8 is not paired with compile=off. Pairing the two as values that cannot run together, rather than
# letting fp8 compile on its own, keeps the compile knob saying what the trial compiled (the cost model and
# the compile deadline read it), and eager float8 is no config anyone should adopt: unfused, its scaling
# and casts cost more than the float8 matmuls save. Where only compile=off is left (no compiler here), fp8
# goes as a value, with this reason.
FP8_NEEDS_COMPILE = ("float8 training needs torch.compile (torchao fuses its scaling and casts there; eager "
                     "float8 is slower than bf16)")


def _values_here(space: SearchSpace, knob: str) -> tuple[Any, ...]:
    """The values a knob takes in this space's trials: its choices, or the baseline's where it is not searched."""
    spec = space.knobs.get(knob)
    return spec.values if spec is not None else (getattr(space.baseline, knob),)


def _restrict_combinations(space: SearchSpace, first: str, second: str,
                           unavailable: Mapping[str, Mapping[str, str]]) -> SearchSpace:
    """Record each (``first`` value, ``second`` value) pair of ``unavailable`` that the space can pair.

    A ``first`` value that no ``second`` value of the space can run with goes as a value instead.

    Raises:
        SpaceError: the baseline, or its fp32 form that the accuracy reference trains, is such a pair.
    """
    seconds = _values_here(space, second)
    for value, whys in sorted(unavailable.items()):
        if value not in _values_here(space, first):
            continue
        bad = [other for other in seconds if other in whys]
        if bad and len(bad) == len(seconds) and first in space.knobs:
            space = space.without(first, value, "; ".join(dict.fromkeys(whys[other] for other in bad)))
            continue
        for other in bad:
            space = space.with_combination(Combination(values=((first, value), (second, other)), reason=whys[other]))
    reference = space.baseline.replace(precision="fp32")
    for config, what in ((space.baseline, "the baseline"), (reference, "the fp32 reference (the baseline in fp32)")):
        pair = ((first, getattr(config, first)), (second, getattr(config, second)))
        why = unavailable.get(pair[0][1], {}).get(pair[1][1])
        if why:
            key = Combination(values=pair, reason=why).key
            raise SpaceError(f"{space.name}: {what} pairs {key}, which cannot run here ({why}), so the reference "
                             f"run could not run; set another {first} or {second} in the baseline")
    return space


def _process_removals(space: SearchSpace, caps: Any) -> list[tuple[str, Any, str]]:
    """DDP knob values that cannot matter (one process per trial) or cannot run (graphs across ranks).

    Raises:
        SpaceError: a trial needs more GPUs than this process sees.
    """
    processes = space.processes_per_trial
    defaults = TrialConfig()
    if processes == 1:
        why = "one process per trial: there is no gradient all-reduce for it to change (set processes_per_trial)"
        return [(knob, value, why) for knob in DDP_KNOBS if knob in space.knobs
                for value in space.knobs[knob].values if value != getattr(defaults, knob)]
    if caps.cuda and 0 < caps.gpu_count < processes:
        raise SpaceError(f"{space.name}: processes_per_trial {processes} needs {processes} GPUs (one per rank); "
                         f"this process sees {caps.gpu_count}")
    return [("cuda_graphs", True, f"{processes} processes per trial: a captured step of a DDP model is not supported "
                                  "here (DDP's bucket rebuild and all-reduce run outside the capture)")]


# How the reason starts when the reference run's dataset cannot be served from the device (``restrict_to_model``).
DEVICE_LOADER_REFUSED = "the reference run's dataset cannot be kept on the device"
# How the reason starts when augment=device cannot run the reference run's transforms (``restrict_to_model``).
DEVICE_AUGMENT_REFUSED = "the reference run's transforms cannot run on the device"
# Why loader=device goes when the reference run built no ``ctx.loader`` (its data comes another way).
NO_CTX_LOADER = "the script builds no ctx.loader (loader=device serves the dataset given to ctx.loader)"
# Why channels_last goes when the reference run shows no layer with 4-D activations (see ``restrict_to_model``).
NO_4D_ACTIVATIONS = ("the model has no 4-D activations (ctx.model found no Conv2d, BatchNorm2d or pooling "
                     "layer in the reference run): the memory format changes nothing")

# Why compile_scope=regions goes when the reference run shows no repeated blocks (see ``restrict_to_model``).
NO_REPEATED_BLOCKS = ("the model has no repeated blocks (ctx.model found no nn.ModuleList or nn.Sequential "
                      "holding two blocks of one class and structure): there is no block to compile once and reuse")


def restrict_to_model(space: SearchSpace, *, activations_4d: Optional[bool],
                      device_loader: Optional[str] = None,
                      linear_layers: Optional[list[list[int]]] = None,
                      repeated_blocks: Optional[list[str]] = None,
                      device_augment: Optional[str] = None,
                      device_loader_augmented: Optional[str] = None) -> SearchSpace:
    """Remove the knob values that cannot matter for this model, or cannot run for its data, recording why.

    ``activations_4d`` is what the reference run recorded (``ctx.model`` looks for image layers; None when
    the workload did not call it). Without 4-D activations there is no memory format to change, so
    ``channels_last=true`` goes, unless the baseline itself uses it. ``device_loader`` is what the
    reference run's ``ctx.loader`` found of its dataset: ``"ok"``, or why ``loader=device`` cannot serve it
    (random augmentation, too large, no length); then ``loader=device`` goes (None: not known).
    ``linear_layers`` are the model's ``torch.nn.Linear`` shapes (``[in, out, count]``, None: not recorded):
    where none passes fp8's size check, ``precision=fp8`` goes (unless the baseline uses it); otherwise
    its predicted gain is the share of the linear work it converts (``predicted_gains``).
    ``repeated_blocks`` are the model's groups of repeated blocks (``autotune.trial._regions``; None: not
    recorded): where there is none, ``compile_scope=regions`` goes (unless the baseline uses it).
    ``device_augment`` is what the reference run's ``ctx.loader`` found of ``augment=device``: ``"ok"``, or
    why its transforms cannot run on the device (the transform named); then ``augment=device`` goes.
    ``device_loader_augmented`` says whether the items before their transforms could be kept on the
    device: where only they can (random augmentation in the dataset), ``loader=device`` stays, paired
    with ``augment=device`` alone.
    """
    if device_augment and device_augment != "ok" and space.baseline.augment != "device":
        space = space.without("augment", "device", f"{DEVICE_AUGMENT_REFUSED}: {device_augment}")
    if repeated_blocks == [] and space.baseline.compile_scope != "regions":
        space = space.without("compile_scope", "regions", NO_REPEATED_BLOCKS)
    if activations_4d is False and not space.baseline.channels_last:
        space = space.without("channels_last", True, NO_4D_ACTIVATIONS)
    if device_loader and device_loader != "ok" and space.baseline.loader != "device":
        why = f"{DEVICE_LOADER_REFUSED}: {device_loader}"
        if device_loader_augmented == "ok" and "device" in _values_here(space, "augment") \
                and "device" in _values_here(space, "loader"):
            # Its items before their transforms can be kept there: loader=device runs with augment=device only.
            space = space.with_combination(Combination(
                values=(("loader", "device"), ("augment", "dataset")),
                reason=f"{why} (its items before their transforms can be, with augment=device)"))
        else:
            space = space.without("loader", "device", why)
    if linear_layers is not None and "fp8" in _values_here(space, "precision"):
        why = _float8.no_conversion_reason(linear_layers)
        if why and space.baseline.precision != "fp8":
            space = space.without("precision", "fp8", why)
        elif not why:
            gains = {**space.predicted_gains, ("precision", "fp8"): _float8.convertible_share(linear_layers)}
            space = dataclasses.replace(space, predicted_gains=gains)
    return space


class _DictAsker:
    """Answers a space's questions from a mapping (the baseline's value for knobs it lacks)."""

    def __init__(self, params: dict[str, Any]) -> None:
        self.params = params
        self.asked: dict[str, Any] = {}

    def _answer(self, name: str) -> Any:
        value = self.params.get(name, getattr(TrialConfig(), name))
        self.asked[name] = value
        return value

    def suggest_categorical(self, name: str, choices: list[Any]) -> Any:
        return self._answer(name)

    def suggest_int(self, name: str, low: int, high: int, step: int = 1) -> Any:
        return self._answer(name)

    def suggest_float(self, name: str, low: float, high: float, step: Optional[float] = None) -> Any:
        return self._answer(name)
