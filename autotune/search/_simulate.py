"""Offline replay: run search strategies against a table of recorded measurements instead of training.

A table is JSON Lines, one config a line::

    {"params": {"precision": "bf16", "batch_size": 256}, "status": "ok", "throughput": 4717.2,
     "peak_memory_gib": 11.0, "accuracy_loss": 0.001, "trial_seconds": 52.0, "compile_seconds": 38.0,
     "data_wait_fraction": 0.01}

(``trial_seconds``, ``compile_seconds`` and ``data_wait_fraction`` are optional.) The space is the set of distinct values of each param; a config absent from the table counts as ``error``.
Each strategy runs as an ordinary in-memory Optuna study, so what is compared is exactly what a real study
would do, minus the training. Scoring:

- *trials to 95%*: the first trial after which the best config *as the strategy sees it* (the highest
  noisy throughput among feasible trials) truly reaches 95% of the table's best feasible throughput; a run
  that never gets there counts as ``trials + 1``;
- *best fraction*: after the last trial, the top-K feasible configs are re-measured in alternation
  (fresh noise) and the one with the best median is the pick; its true throughput over the table's best;
- *minutes to 95%*: the seconds of the trials up to that one, where the table records ``trial_seconds``
  (``trial_seconds`` of a row is its first compile at its shapes and mode; a later trial in the same compile
  group pays ``CACHED_COMPILE_SHARE`` of ``compile_seconds``; a row without seconds, or a config absent from
  the table, costs the median of the rows' seconds without their compile). A run that never reaches 95%
  counts its total minutes plus one median trial.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import statistics
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import optuna
from optuna.distributions import CategoricalDistribution

from autotune._config import COMPILE_MODES_WITH_GRAPHS, TrialConfig
from autotune._errors import TableError
from autotune.search._cost import CACHED_COMPILE_SHARE, compile_group
from autotune.search._predict import (INPUT_BOUND, LOADER_KNOBS, MAX_LOADER_PROBES, SLOW_VARIANT_SHARE, WORTH,
                                      PredictionError, best_predicted, correction_of, loader_moves, predict,
                                      prediction_error_summary, step_ceiling)
from autotune.search._rules import infeasible_reason
from autotune.search._sampler import GuidedSampler

STATUSES = ("ok", "oom", "error")
# Other tables' words for the statuses: a run that failed reads as ``error``.
STATUS_WORDS = {"failed": "error", "fail": "error", "failure": "error", "crashed": "error", "crash": "error",
                "timeout": "error", "timed_out": "error", "infeasible": "error", "pruned": "error",
                "out_of_memory": "oom", "out-of-memory": "oom", "success": "ok", "complete": "ok", "completed": "ok",
                # this project's own trial statuses, as an exported study records them
                "nan": "error", "compile_timeout": "error", "interrupted": "error", "over_budget": "error",
                "not_run": "error", "infra": "error"}
# The fields of a row that diagnose its bottleneck rather than measure it: ``without_diagnosis`` drops them.
DIAGNOSIS_FIELDS = ("data_wait_fraction", "loader_rate", "step_rate")
# A loader variant that stops after its first timed window pays this share of its samples: one of a default
# budget's three windows (its warm-up is not counted apart).
ONE_WINDOW = 1 / 3
DEFAULT_STRATEGIES = ("guided", "guided-flat", "tpe", "random")


def asked_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """The params a real study asks for to reach ``params``: as ``SearchSpace.sample`` does, a compile mode
    that captures CUDA Graphs itself leaves ``cuda_graphs`` unasked (it runs with graphs off)."""
    if params.get("compile") in COMPILE_MODES_WITH_GRAPHS:
        return {k: v for k, v in params.items() if k != "cuda_graphs"}
    return dict(params)


def _ask(trial: optuna.Trial, table: ReplayTable) -> dict[str, Any]:
    """Ask a trial for a config of the table as a real study would (``asked_params``); the config that
    then runs, with ``cuda_graphs`` off where it was not asked and the table has that value."""
    names = [n for n in table.names if n != "cuda_graphs"] + [n for n in table.names if n == "cuda_graphs"]
    params: dict[str, Any] = {}
    for name in names:
        if name == "cuda_graphs" and "cuda_graphs" not in asked_params({**params, name: True}):
            if False in table.values[name]:
                params[name] = False
                continue
        params[name] = trial.suggest_categorical(name, table.values[name])
    return {n: params[n] for n in table.names}


@dataclass(frozen=True)
class TableRow:
    """One recorded config."""

    params: dict[str, Any]
    status: str
    throughput: Optional[float] = None
    peak_memory_gib: Optional[float] = None
    accuracy_loss: Optional[float] = None
    trial_seconds: Optional[float] = None  # a trial of this config, its first compile at these shapes included
    compile_seconds: Optional[float] = None  # of which the fresh compile
    data_wait_fraction: Optional[float] = None  # share of the timed windows spent waiting for input
    loader_rate: Optional[float] = None  # a loader probe's samples/s for this config, when recorded
    step_rate: Optional[float] = None  # a step probe's samples/s, when recorded
    # A process's start and the script's build before its first step (part of ``trial_seconds``), for a
    # whole study's replay (``study/_replay``): every process of the config pays it.
    build_seconds: Optional[float] = None
    # The verdict this config earns on evidence of at least a share of the space's length, by share
    # ({0.5: "equivalent"}: ``unchecked`` below half the length, ``equivalent`` from it); None: its
    # ``accuracy_loss`` decides at any length.
    verdict_at: Optional[dict[float, str]] = None


def _key(params: Mapping[str, Any]) -> str:
    return json.dumps(dict(params), sort_keys=True, default=str)


def _no_constant(name: str) -> Any:
    """JSON's non-standard ``Infinity``, ``-Infinity`` and ``NaN``: no measurement a table records."""
    raise ValueError(f"{name} is not a measurement (a table's numbers are finite)")


class ReplayTable:
    """Recorded measurements, looked up by config.

    Args:
        rows: The table's rows; every row must name the same params.
        name: A label for reports.
    """

    def __init__(self, rows: Sequence[TableRow], *, name: str = "table") -> None:
        if not rows:
            raise TableError(f"{name}: the table has no rows")
        self.name = name
        self.names = tuple(rows[0].params)
        self._rows: dict[str, TableRow] = {}
        # Distinct values per param in first-seen order, keyed by their JSON text: a dict keeps loading
        # linear in the rows (a list's membership test made 40k rows take 14 s).
        values: dict[str, dict[str, Any]] = {n: {} for n in self.names}
        names = set(self.names)
        for row in rows:
            if set(row.params) != names:
                raise TableError(f"{name}: row {row.params} does not name the params {', '.join(self.names)}")
            self._rows[_key(row.params)] = row
            for n in self.names:
                values[n].setdefault(json.dumps(row.params[n], sort_keys=True), row.params[n])
        self.values = {n: _sorted(list(v.values())) for n, v in values.items()}
        # A whole study's settings, from a line {"study": {...}} (``study/_replay``): the baseline's params,
        # the space's samples, the setup's seconds, a process's build seconds where a row records none.
        self.study: dict[str, Any] = {}

    @classmethod
    def load(cls, path: Union[str, Path]) -> "ReplayTable":
        """Read a JSON Lines table, naming the line of the first malformed entry.

        Raises:
            TableError: the file is missing, or a line is not a valid row.
        """
        path = Path(path)
        if not path.is_file():
            raise TableError(f"no table at {path}")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise TableError(f"{path}: not UTF-8 text (byte {exc.start}); a table is JSON Lines") from None
        rows, seen, study = [], set(), {}
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                data = json.loads(line, parse_constant=_no_constant)
                if isinstance(data, dict) and set(data) == {"study"}:  # the whole study's settings
                    if not isinstance(data["study"], dict):
                        raise ValueError("'study' is an object of the study's settings")
                    study = data["study"]
                    continue
                rows.append(_parse_row(data))
            except RecursionError:
                raise TableError(f"{path}:{number}: nested too deeply") from None
            except (ValueError, TypeError, KeyError) as exc:
                raise TableError(f"{path}:{number}: {str(exc)[:300]}") from None
            key = _key(rows[-1].params)
            if key in seen:
                raise TableError(f"{path}:{number}: the config {rows[-1].params} appears twice")
            seen.add(key)
        table = cls(rows, name=path.stem)
        table.study = study
        return table

    def without_diagnosis(self) -> "ReplayTable":
        """The same table with the diagnosis fields removed (``DIAGNOSIS_FIELDS``: the input wait and the probes'
        rates), as a study records when its ``train_fn`` times its own loop or the probes cannot run."""
        rows = [dataclasses.replace(row, **{f: None for f in DIAGNOSIS_FIELDS}) for row in self._rows.values()]
        table = ReplayTable(rows, name=self.name)
        table.study = self.study
        return table

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def size(self) -> int:
        """Configs in the space (the table may leave some out)."""
        return math.prod(len(v) for v in self.values.values())

    def lookup(self, params: Mapping[str, Any]) -> TableRow:
        """The recorded row; a config absent from the table is an ``error``."""
        return self._rows.get(_key({n: params[n] for n in self.names})) or TableRow(dict(params), "error")

    def feasible(self, row: TableRow, max_accuracy_loss: float) -> bool:
        return row.status == "ok" and (row.accuracy_loss or 0.0) <= max_accuracy_loss

    def best(self, max_accuracy_loss: float = math.inf) -> TableRow:
        """The fastest feasible row."""
        rows = [r for r in self._rows.values() if self.feasible(r, max_accuracy_loss)]
        if not rows:
            raise TableError(f"{self.name}: no feasible row")
        return max(rows, key=lambda r: r.throughput or 0.0)

    def distributions(self) -> dict[str, CategoricalDistribution]:
        return {n: CategoricalDistribution(v) for n, v in self.values.items()}

    @property
    def has_seconds(self) -> bool:
        """Whether any row records ``trial_seconds`` (else minutes are not reported)."""
        return any(r.trial_seconds is not None for r in self._rows.values())

    def prediction_error(self) -> Optional[PredictionError]:
        """How far each measured row falls from the probes' prediction, over the rows that record both rates."""
        return prediction_error_summary([(r.throughput, predict(r.loader_rate, r.step_rate) or 0.0)
                                         for r in self._rows.values()
                                         if r.status == "ok" and r.throughput and r.loader_rate and r.step_rate])

    def fallback_seconds(self) -> float:
        """What a trial without recorded seconds costs: the median row's seconds without its compile."""
        bases = [r.trial_seconds - (r.compile_seconds or 0.0) for r in self._rows.values() if r.trial_seconds]
        return statistics.median(bases) if bases else 0.0


# The fields of a row that measure its config (``TableRow``'s and the evidence tables keep beside them), and
# the bookkeeping of Optuna's ``trials_dataframe()``: in a row with no ``params`` object, every other field
# is a knob.
MEASUREMENT_FIELDS = frozenset({
    "status", "state", "throughput", "value", "error", "peak_memory_gib", "accuracy_loss", "trial_seconds",
    "compile_seconds", "data_wait_fraction", "loader_rate", "step_rate", "window_throughputs", "step_ms",
    "warmup_s", "compile_s", "scaler_skips", "sm_clock_mhz", "power_w", "seconds", "number", "datetime_start",
    "datetime_complete", "duration", "values", "metric", "build_seconds", "verdict_at", "role",
})
VERDICT_WORDS = ("equivalent", "unchecked", "degraded", "diverged")
OPTUNA_PREFIXES = ("params_", "user_attrs_", "system_attrs_", "constraints")
CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(TrialConfig))


def _params_of(data: dict[str, Any]) -> Any:
    """A row's config: its ``params`` (or ``config``) object; else the ``params_*`` columns of Optuna's
    ``trials_dataframe()``; else every field that is not a measurement (a flat row)."""
    if "params" in data or "config" in data:
        return data["params"] if "params" in data else data["config"]
    prefixed = {k[len("params_"):]: v for k, v in data.items() if k.startswith("params_")}
    if prefixed:
        return prefixed
    # A fraction (0.93) is a reading (a GPU's utilisation, a loss), not a knob's value, unless it names a knob
    # of this project (memory_fraction): as a knob it would make every row a config of its own.
    return {k: v for k, v in data.items() if k not in MEASUREMENT_FIELDS and not k.startswith(OPTUNA_PREFIXES)
            and (not isinstance(v, float) or k in CONFIG_FIELDS)}


def _field(data: dict[str, Any], name: str) -> Any:
    """A measurement field, or as Optuna's ``trials_dataframe()`` names a trial's user attribute."""
    value = data.get(name)
    return value if value is not None else data.get(f"user_attrs_{name}")


def _parse_row(data: Any) -> TableRow:
    if not isinstance(data, dict):
        raise ValueError("a row is a JSON object")
    params = _params_of(data)
    if not isinstance(params, dict) or not params:
        raise ValueError("'params' must be a non-empty object (or the row's own fields name the config)")
    # Optuna's objective value where the row records no throughput: a study's value is its throughput.
    throughput = _field(data, "throughput")
    throughput = throughput if throughput is not None else data.get("value")
    measured = isinstance(throughput, (int, float)) and not isinstance(throughput, bool) and throughput > 0
    status = _field(data, "status")
    status = _status(status if status is not None else data.get("state"), measured)
    if status == "ok" and not measured:
        raise ValueError("an 'ok' row needs a positive throughput")
    if status != "ok":
        throughput = None  # a failed run's partial rate (some tables keep one) is no measurement of the config
    seconds = {}
    for name in ("trial_seconds", "compile_seconds", "data_wait_fraction", "loader_rate", "step_rate"):
        value = _field(data, name)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0):
            raise ValueError(f"{name} must be a number >= 0")
        if name == "data_wait_fraction" and value is not None and value > 1:
            raise ValueError(f"data_wait_fraction is a share of the timed windows, 0 to 1, not {value}")
        seconds[name] = float(value) if value is not None else None
    build = _field(data, "build_seconds")
    if build is not None and (not isinstance(build, (int, float)) or isinstance(build, bool) or build < 0):
        raise ValueError("build_seconds must be a number >= 0")
    return TableRow(
        params=params,
        status=status,
        throughput=float(throughput) if throughput is not None else None,
        peak_memory_gib=_field(data, "peak_memory_gib"),
        accuracy_loss=_field(data, "accuracy_loss"),
        build_seconds=float(build) if build is not None else None,
        verdict_at=_verdicts(_field(data, "verdict_at")),
        **seconds,
    )


def _verdicts(value: Any) -> Optional[dict[float, str]]:
    """``verdict_at`` of a row: shares of the length (0 to 1, as text keys) to verdicts."""
    if value is None:
        return None
    if not isinstance(value, dict) or not value:
        raise ValueError("verdict_at is an object of shares of the length (0 to 1) to verdicts")
    out = {}
    for share, verdict in value.items():
        try:
            number = float(share)
        except (TypeError, ValueError):
            raise ValueError(f"verdict_at: {share!r} is no share of the length (0 to 1)") from None
        if not 0 <= number <= 1 or verdict not in VERDICT_WORDS:
            raise ValueError(f"verdict_at: {share!r}: {verdict!r} needs a share 0 to 1 and one of "
                             f"{', '.join(VERDICT_WORDS)}")
        out[number] = verdict
    return dict(sorted(out.items()))


def _status(recorded: Any, measured: bool) -> str:
    """A row's status in ``STATUSES``: as recorded (any case, other tables' words as ``STATUS_WORDS`` reads them),
    or, where the table records none, ``ok`` for a positive throughput and ``error`` without."""
    if recorded is None:
        return "ok" if measured else "error"
    status = str(recorded).strip().lower()
    status = STATUS_WORDS.get(status, status)
    if status not in STATUSES:
        raise ValueError(f"status {recorded!r} is not one of {', '.join(STATUSES)} (nor {', '.join(STATUS_WORDS)})")
    return status


def _sorted(values: list[Any]) -> list[Any]:
    try:
        return sorted(values, key=lambda v: (v is None, v))
    except TypeError:
        return values


# -- strategies --------------------------------------------------------------------------------------
def make_sampler(strategy: str, table: ReplayTable, seed: int) -> optuna.samplers.BaseSampler:
    """An Optuna sampler by strategy name: ``guided`` (autotune's), ``tpe`` (Optuna's default TPE, which
    in Optuna 5 is already multivariate with a constant liar), ``random``, and ``guided-flat``, the guided
    walk without its domain priors (an ablation)."""
    if strategy == "guided":
        return GuidedSampler(search_space=table.distributions(), seed=seed, canonical=asked_params)
    if strategy == "guided-flat":  # ablation: the same walk without the domain priors
        return GuidedSampler(search_space=table.distributions(), seed=seed, default_priors=False,
                             canonical=asked_params)
    if strategy == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if strategy == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise TableError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")


STRATEGIES = ("guided", "guided-flat", "tpe", "random")


# -- one replayed study ------------------------------------------------------------------------------
class NoisyLookup:
    """Throughput lookups with multiplicative noise uniform in ±``noise``, from a seeded generator."""

    def __init__(self, table: ReplayTable, *, noise: float, seed: int) -> None:
        if not 0 <= noise < 1:
            raise ValueError("noise must be in [0, 1)")
        self.table, self.noise, self._rng = table, noise, random.Random(seed)

    def measure(self, params: Mapping[str, Any]) -> tuple[TableRow, Optional[float]]:
        row = self.table.lookup(params)
        if row.status != "ok" or row.throughput is None:
            return row, None
        return row, row.throughput * self._rng.uniform(1 - self.noise, 1 + self.noise)


@dataclass(frozen=True)
class ReplayRun:
    """What one strategy did with one seed."""

    strategy: str
    seed: int
    trials: int
    trials_to_95: int  # trials + 1 when never reached
    best_fraction: float  # true throughput of the top-K pick over the table's best
    incumbent_fractions: tuple[float, ...]  # true fraction of the apparent best after each trial
    pruned_by_rule: int  # proposals the memory rule answered without a run
    measured: tuple[dict[str, Any], ...] = ()  # the configs looked up, in trial order
    seconds: tuple[float, ...] = ()  # what each trial cost, where the table records seconds
    minutes_to_95: Optional[float] = None  # None when the table records no seconds


class TrialClock:
    """What each replayed trial costs: the row's seconds, with a compile at shapes and mode already
    compiled in this run charged at ``CACHED_COMPILE_SHARE`` of its fresh compile."""

    def __init__(self, table: ReplayTable) -> None:
        self.table, self._compiled, self._fallback = table, set(), table.fallback_seconds()

    def charge(self, params: Mapping[str, Any], row: TableRow) -> tuple[float, float]:
        """(trial seconds, compile seconds) of running ``params`` now."""
        if row.trial_seconds is None:
            return self._fallback, 0.0
        compile_s = row.compile_seconds or 0.0
        group = compile_group(params)
        if group is not None and group in self._compiled:
            cached = compile_s * CACHED_COMPILE_SHARE
            return row.trial_seconds - compile_s + cached, cached
        if group is not None and compile_s > 0:
            self._compiled.add(group)
        return row.trial_seconds, compile_s


class ReplayProbes:
    """The loop's loader probes (``autotune.study._probes``) against a table whose rows record the rates the
    probes would measure (``loader_rate``, ``step_rate``): when the incumbent waits on its input at least
    ``INPUT_BOUND`` of its windows, each loader variant is probed (with the replay's noise), then its step where
    some variant's loader could be worth a trial (else its row's ``step_ceiling`` stands in), and the variant
    ``best_predicted`` names is the next full trial. Probes are not trials; their seconds count.

    The loader variants of one incumbent run in one probe process, as the loop runs them: the process's start
    and build are paid once, and each variant its samples at its loader's rate. Both parts come from the
    table (``_cost_parts``: a least-squares line of a row's seconds without the compile against
    1 / throughput: its intercept is what a process pays whatever it runs, its slope the samples a trial
    runs); a variant that stops after its first window (``SLOW_VARIANT_SHARE``) pays ``ONE_WINDOW`` of its
    samples. A step probe costs the incumbent's row with its compile cached (its graph already ran).
    """

    def __init__(self, table: ReplayTable, lookup: "NoisyLookup", seed: int) -> None:
        self.table, self.lookup, self._rng = table, lookup, random.Random(seed)
        self._done: dict[str, Optional[float]] = {}
        self.pairs: list[tuple[float, float]] = []  # (measured, predicted) of the full trials probes chose
        self.bounds: set[str] = set()  # keys of the trials chosen on a step's ceiling: bounds, not predictions
        self.process_seconds, self.samples = _cost_parts(table)

    @classmethod
    def usable(cls, table: ReplayTable) -> bool:
        return any(k in table.names for k in LOADER_KNOBS) and any(
            r.loader_rate and r.step_rate for r in table._rows.values())

    def _rate(self, kind: str, params: Mapping[str, Any]) -> tuple[Optional[float], float]:
        """(rate, seconds) of one probe alone; a probe already run costs nothing and returns its rate. A
        loader probe's seconds are its windows only (``choose`` adds the process once)."""
        key = kind + ":" + _key(params)
        row = self.table.lookup(params)
        if key in self._done:
            return self._done[key], 0.0
        rate = row.loader_rate if kind == "loader" else row.step_rate
        noise = self.lookup.noise
        rate = rate * self._rng.uniform(1 - noise, 1 + noise) if rate and row.status == "ok" else None
        self._done[key] = rate
        if kind == "loader":
            return rate, self.samples / row.loader_rate if row.loader_rate else 0.0
        base = (row.trial_seconds or 0.0) - (row.compile_seconds or 0.0)
        return rate, base + (row.compile_seconds or 0.0) * CACHED_COMPILE_SHARE

    def choose(self, incumbent: Mapping[str, Any], observed: float,
               measured: set[str]) -> tuple[Optional[tuple[float, dict[str, Any]]], float]:
        """((predicted, config) to run next or None, probe seconds) for an input-bound incumbent."""
        variants: list[dict[str, Any]] = []
        for move in loader_moves(self.table.values, incumbent):
            variant = {**incumbent, **move}
            if variant not in variants:
                variants.append(variant)
        variants = [v for v in variants[:MAX_LOADER_PROBES] if _key(v) not in measured]
        if not variants:
            return None, 0.0
        # As the loop does (``LoaderProbes.device_trial``): the device-resident loader is the next full trial,
        # not probed, bounded by the step; a bound from the ceiling corrects no later prediction.
        device = next((v for v in variants if v.get("loader") == "device" and "loader:" + _key(v) not in self._done),
                      None)
        known = self._done.get("step:" + _key(incumbent))
        bound = known or step_ceiling(observed, self.table.lookup(incumbent).data_wait_fraction)
        if device is not None and bound:
            self._done["loader:" + _key(device)] = None
            if not known:
                self.bounds.add(_key(device))
            return (bound * correction_of(self.pairs), device), 0.0
        candidates, windows, fastest, seconds = [], 0.0, 0.0, 0.0
        for variant in variants:
            rate, cost = self._rate("loader", variant)
            candidates.append((rate, variant))
            if rate and rate < SLOW_VARIANT_SHARE * fastest:
                cost *= ONE_WINDOW  # it stopped after its first window
            windows += cost
            fastest = max(fastest, rate or 0.0)
        if windows:
            seconds += self.process_seconds + windows  # one process for every variant not probed before
        factor = correction_of(self.pairs)
        # As the loop does: the step probe after the loaders, only where a loader could be worth a trial;
        # the incumbent's own row bounds the step where it measures nothing.
        step_rate = None
        if fastest and fastest * factor >= WORTH * observed:
            step_rate, spent = self._rate("step", incumbent)
            seconds += spent
        step_rate = step_rate or step_ceiling(observed, self.table.lookup(incumbent).data_wait_fraction)
        return best_predicted(candidates, step_rate, factor, observed), seconds


def _cost_parts(table: ReplayTable) -> tuple[float, float]:
    """(seconds a trial process pays whatever it runs, samples a trial runs) of a table: the intercept and
    slope of a least-squares line of each ok row's seconds without its compile against 1 / throughput."""
    points = [(1.0 / r.throughput, r.trial_seconds - (r.compile_seconds or 0.0)) for r in table._rows.values()
              if r.status == "ok" and r.throughput and r.trial_seconds is not None]
    if len(points) < 2:
        return table.fallback_seconds(), 0.0
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread > 0 else 0.0
    slope = max(0.0, slope)
    return max(0.0, mean_y - slope * mean_x), slope


def replay(
    table: ReplayTable,
    strategy: str,
    *,
    trials: int = 30,
    seed: int = 0,
    noise: float = 0.0,
    top_k: int = 3,
    confirm_rounds: int = 2,
    max_accuracy_loss: float = 0.01,
    memory_rule: bool = True,
    sampler: Optional[optuna.samplers.BaseSampler] = None,
    probes: bool = False,
) -> ReplayRun:
    """Run one strategy for ``trials`` trials against the table, as an in-memory Optuna study.

    Args:
        memory_rule: Answer proposals the out-of-memory rule rules out as PRUNED without a lookup, and
            without spending a trial (as the tuner does). Applies to every strategy alike.
        probes: Probe the loader and the step apart when the incumbent waits on its input, as the loop does
            (``ReplayProbes``; where the table records the probes' rates). Applies to every strategy alike.
    """
    lookup = NoisyLookup(table, noise=noise, seed=seed + 7919)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study = optuna.create_study(direction="maximize", sampler=sampler or make_sampler(strategy, table, seed))
    best_true = table.best(max_accuracy_loss).throughput or 0.0
    ooms: list[tuple[int, dict[str, Any]]] = []
    seen: list[tuple[float, float, dict[str, Any]]] = []  # (observed, true, params) of feasible trials
    fractions: list[float] = []
    measured: list[dict[str, Any]] = []
    clock, costs = TrialClock(table), []
    prober = ReplayProbes(table, lookup, seed + 104_729) if probes and ReplayProbes.usable(table) else None
    incumbent: Optional[tuple[float, dict[str, Any]]] = None  # (observed, params) of the best feasible trial
    predicted: Optional[float] = None  # of the trial the probes enqueued
    probe_seconds = 0.0  # charged to the next trial
    reached, pruned, asked = trials + 1, 0, 0
    while len(fractions) < trials and asked < trials * 50:
        asked += 1
        if prober is not None and predicted is None and incumbent is not None:
            row = table.lookup(incumbent[1])
            if (row.data_wait_fraction or 0.0) >= INPUT_BOUND:
                choice, spent = prober.choose(incumbent[1], incumbent[0], {_key(p) for p in measured})
                probe_seconds += spent
                if choice is not None:
                    predicted = choice[0]
                    study.enqueue_trial(asked_params(choice[1]))
        trial = study.ask()
        params = _ask(trial, table)
        reason = infeasible_reason(params, ooms) if memory_rule else None
        if reason:
            trial.set_user_attr("status", "infeasible")
            trial.set_user_attr("pruned_reason", reason)
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            pruned += 1
            predicted = None
            continue
        row, observed = lookup.measure(params)
        measured.append(params)
        feasible = observed is not None and table.feasible(row, max_accuracy_loss)
        seconds, compile_s = clock.charge(params, row)
        costs.append(seconds + probe_seconds)
        probe_seconds = 0.0
        if predicted is not None:
            if prober is not None and observed is not None and row.status == "ok" and _key(params) not in prober.bounds:
                prober.pairs.append((observed, predicted))
            predicted = None
        trial.set_user_attr("status", row.status)
        if table.has_seconds:  # what a real study records, so the sampler's cost model reads the same
            trial.set_user_attr("wall_seconds", seconds)
            trial.set_user_attr("compile_seconds", compile_s)
        if observed is not None:
            trial.set_user_attr("throughput", observed)
            if row.data_wait_fraction is not None:
                trial.set_user_attr("data_wait_fraction", row.data_wait_fraction)
        trial.set_constraint("failure", 0.0 if feasible else 1.0)
        if row.status == "oom":
            ooms.append((trial.number, params))
        study.tell(trial, observed if observed is not None else 0.0)
        if feasible:
            seen.append((observed, row.throughput or 0.0, params))
            if incumbent is None or observed > incumbent[0]:
                incumbent = (observed, params)
        apparent = max(seen, key=lambda s: s[0])[1] if seen else 0.0
        fractions.append(apparent / best_true if best_true else 0.0)
        if reached > trials and fractions[-1] >= 0.95:
            reached = len(fractions)
    minutes = None
    if table.has_seconds:
        spent = costs[:reached] if reached <= trials else costs + [statistics.median(costs) if costs else 0.0]
        minutes = sum(spent) / 60
    return ReplayRun(
        strategy=strategy,
        seed=seed,
        trials=len(fractions),
        trials_to_95=reached,
        best_fraction=_top_k_pick(seen, lookup, top_k, confirm_rounds) / best_true if best_true else 0.0,
        incumbent_fractions=tuple(fractions),
        pruned_by_rule=pruned,
        measured=tuple(measured),
        seconds=tuple(costs) if table.has_seconds else (),
        minutes_to_95=minutes,
    )


def _top_k_pick(seen: list[tuple[float, float, dict[str, Any]]], lookup: NoisyLookup, top_k: int, rounds: int) -> float:
    """True throughput of the config a top-K confirmation crowns (as the tuner does: A B C A B C ...)."""
    ranked: list[tuple[float, float, dict[str, Any]]] = []
    for entry in sorted(seen, key=lambda s: -s[0]):
        if all(entry[2] != r[2] for r in ranked):
            ranked.append(entry)
    ranked = ranked[: max(1, top_k)]
    if not ranked:
        return 0.0
    if len(ranked) == 1 or rounds < 1:
        return ranked[0][1]
    rates: list[list[float]] = [[] for _ in ranked]
    for _ in range(rounds):
        for i, (_, _, params) in enumerate(ranked):
            rates[i].append(lookup.measure(params)[1] or 0.0)
    winner = max(range(len(ranked)), key=lambda i: statistics.median(rates[i]))
    return ranked[winner][1]


@dataclass(frozen=True)
class StrategySummary:
    """One strategy over several seeds."""

    strategy: str
    trials_to_95_median: float
    trials_to_95_worst: int
    best_fraction_median: float
    runs: tuple[ReplayRun, ...]
    minutes_to_95_median: Optional[float] = None  # None when the table records no trial seconds
    minutes_to_95_worst: Optional[float] = None

    def to_dict(self) -> dict[str, Any]:
        def minutes(value: Optional[float]) -> Optional[float]:
            return None if value is None else round(value, 2)

        return {
            "strategy": self.strategy,
            "trials_to_95_median": self.trials_to_95_median,
            "trials_to_95_worst": self.trials_to_95_worst,
            "minutes_to_95_median": minutes(self.minutes_to_95_median),
            "minutes_to_95_worst": minutes(self.minutes_to_95_worst),
            "best_fraction_median": round(self.best_fraction_median, 4),
            "trials_to_95": [r.trials_to_95 for r in self.runs],
            "minutes_to_95": [minutes(r.minutes_to_95) for r in self.runs],
            "pruned_by_rule": [r.pruned_by_rule for r in self.runs],
        }


def simulate(
    table: Union[ReplayTable, str, Path],
    *,
    strategies: Sequence[str] = DEFAULT_STRATEGIES,
    trials: int = 30,
    seeds: int = 5,
    noise: float = 0.0,
    top_k: int = 3,
    max_accuracy_loss: float = 0.01,
    on_run: Optional[Callable[[ReplayRun], None]] = None,
    probes: bool = False,
) -> list[StrategySummary]:
    """Replay every strategy with seeds ``0 .. seeds-1`` and summarise each (``probes``: as ``replay``)."""
    if trials < 1 or seeds < 1:
        raise TableError("trials and seeds must be at least 1")
    if not isinstance(table, ReplayTable):
        table = ReplayTable.load(table)
    for strategy in strategies:
        if strategy not in STRATEGIES:
            raise TableError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    out = []
    for strategy in strategies:
        runs = []
        for seed in range(seeds):
            run = replay(table, strategy, trials=trials, seed=seed, noise=noise, top_k=top_k,
                         max_accuracy_loss=max_accuracy_loss, probes=probes)
            runs.append(run)
            if on_run:
                on_run(run)
        minutes = [r.minutes_to_95 for r in runs if r.minutes_to_95 is not None]
        out.append(StrategySummary(
            strategy=strategy,
            trials_to_95_median=statistics.median(r.trials_to_95 for r in runs),
            trials_to_95_worst=max(r.trials_to_95 for r in runs),
            best_fraction_median=statistics.median(r.best_fraction for r in runs),
            runs=tuple(runs),
            minutes_to_95_median=statistics.median(minutes) if minutes else None,
            minutes_to_95_worst=max(minutes) if minutes else None,
        ))
    return out


def summaries_document(table: ReplayTable, summaries: Sequence[StrategySummary], **settings: Any) -> dict[str, Any]:
    """The JSON that ``autotune simulate --json`` prints."""
    best = table.best(settings.get("max_accuracy_loss", math.inf))
    error = table.prediction_error()
    return {
        "table": table.name,
        "rows": len(table),
        "space_size": table.size,
        "best": {"params": best.params, "throughput": best.throughput},
        "seconds": "recorded" if table.has_seconds else "none: the table records no trial_seconds, so minutes are null",
        "probe_prediction": error.to_dict() if error else None,
        **settings,
        "results": [s.to_dict() for s in summaries],
    }



# -- the replay workload: a train_fn for real studies on recorded tables ------------------------------
REPLAY_TABLE_ENV = "AUTOTUNE_REPLAY_TABLE"
REPLAY_NOISE_ENV = "AUTOTUNE_REPLAY_NOISE"
REPLAY_SCRIPT_ENV = "AUTOTUNE_REPLAY_SCRIPT"
REPLAY_TIME_SCALE_ENV = "AUTOTUNE_REPLAY_TIME_SCALE"


def replay_env(table: Union[str, Path], *, noise: float = 0.0,
               script: Optional[Mapping[str, Sequence[float]]] = None,
               state_dir: Optional[Union[str, Path]] = None, time_scale: float = 0.0) -> dict[str, str]:
    """Environment for ``replay_train``: the table, the noise, and scripted throughput factors.

    Args:
        script: ``{json of a config's table params (sorted keys): [factor, factor, ...]}``; the n-th run
            of that config is multiplied by the n-th factor (1.0 once they run out), across processes.
        state_dir: Where the scripted factors' consumption is counted (required with ``script``).
        time_scale: Spend this share of a row's ``compile_seconds`` as the trial's compile, for real, and
            the timed windows in full (0: no time passes), so a real study's clock and cost model see them.
    """
    env = {REPLAY_TABLE_ENV: str(table), REPLAY_NOISE_ENV: str(noise), REPLAY_TIME_SCALE_ENV: str(time_scale)}
    if script:
        if state_dir is None:
            raise ValueError("a script needs a state_dir")
        path = Path(state_dir) / "replay-script.json"
        path.write_text(json.dumps({k: list(v) for k, v in script.items()}))
        env[REPLAY_SCRIPT_ENV] = str(path)
    return env


def config_key(params: Mapping[str, Any]) -> str:
    """How a config is named in a replay script."""
    return _key(params)


def _scripted_factor(key: str) -> Optional[float]:
    import os

    path = os.environ.get(REPLAY_SCRIPT_ENV)
    if not path:
        return None
    factors = json.loads(Path(path).read_text()).get(key)
    if not factors:
        return None
    import hashlib

    counter = Path(path).with_name("replay-count-" + hashlib.sha256(key.encode()).hexdigest()[:16] + ".log")
    fd = os.open(counter, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, b".")
    finally:
        os.close(fd)
    runs = counter.stat().st_size
    return factors[runs - 1] if runs <= len(factors) else 1.0


def replay_train(ctx: Any) -> None:
    """A ``train_fn`` that replays the table named by ``AUTOTUNE_REPLAY_TABLE`` instead of training.

    A row's status becomes the trial's: ``oom`` raises MemoryError, ``error`` a RuntimeError, and ``ok``
    records the budget's windows at the table's throughput (times the noise or scripted factor) and
    reports ``1 - accuracy_loss`` as the metric. A row's ``data_wait_fraction`` becomes the windows' input
    wait; with ``AUTOTUNE_REPLAY_TIME_SCALE`` set, that share of its ``compile_seconds`` is slept as the
    first step of a compiled config, and the windows are slept in full. Hopeless-trial pruning and every tuner path run as real.
    """
    import os
    import time

    table = ReplayTable.load(os.environ[REPLAY_TABLE_ENV])
    config = ctx.config.to_dict()
    params = {n: config[n] for n in table.names}
    row = table.lookup(params)
    if row.status == "oom":
        raise MemoryError(f"replayed: out of memory at {params}")
    if row.status != "ok" or row.throughput is None:
        raise RuntimeError(f"replayed: {params} failed in the table")
    factor = _scripted_factor(_key(params))
    if factor is None:
        noise = float(os.environ.get(REPLAY_NOISE_ENV, "0") or 0)
        factor = random.Random(os.urandom(8)).uniform(1 - noise, 1 + noise)
    rate = row.throughput * factor
    steps = max(1, ctx.budget.samples // ctx.config.batch_size // ctx.budget.windows) if ctx.budget else 1
    samples = steps * ctx.config.batch_size
    scale = float(os.environ.get(REPLAY_TIME_SCALE_ENV, "0") or 0)
    if scale and row.compile_seconds and ctx.config.compile != "off":
        begin = time.perf_counter()
        time.sleep(scale * row.compile_seconds)
        ctx.recorder.first_step_seconds = time.perf_counter() - begin + samples / rate / steps
    wait = min(1.0, row.data_wait_fraction or 0.0)
    for _ in range(ctx.budget.windows if ctx.budget else 1):
        if scale:
            time.sleep(samples / rate)  # the window itself, in full: the clock then sees the samples' time
        ctx.record_window(samples, samples / rate, steps=steps, data_wait_seconds=wait * samples / rate)
    ctx.report_metric(1.0 - (row.accuracy_loss or 0.0))
