"""The real run: ``train_fn`` trained for its full length with a config, and the study's promise checked.

``autotune train FILE:FN`` (``autotune.train``) takes the config from a ``best_config.json``, a study or the
baseline, and the length from ``epochs``, ``steps`` or ``minutes``. The same ``train_fn`` the study
measured runs as written: ``ctx.batches`` yields the whole run, ``ctx.optimizer_steps`` is its length, the
script's ``on_epoch_end`` hooks evaluate and checkpoint between epochs (outside the timed windows).

At the end it states what the run delivered against what the study measured for the same config (a ratio
with its spread), keeps the loss curve, and with ``compare`` runs the baseline and the pick for the same
samples, one after the other in fresh processes, and judges the pick's curve against the baseline's with
the accuracy verdict (``_verdict.judge``). Everything lands in ``train.json``, written after each run and
on a Ctrl-C, which stops a run at its next optimizer step and keeps what it measured.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import contextlib
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional, Sequence, Union

from autotune._config import TrialConfig, dumps
from autotune._errors import AutotuneError, KnobError, StudyError, WorkloadError
from autotune._files import write_atomic
from autotune._records import DEFAULT_STUDIES_DIR, study_dir
from autotune._target import ScriptArgumentsError, ScriptArgv, load_target_or_say_why, target_of
from autotune.study._verdict import ReferenceBand, fingerprints, judge

PROMISE_TOLERANCE = 0.05  # delivered within +-5% of the study's throughput keeps its promise
PROGRESS_SECONDS = 10.0  # a progress line at most this often when the output is not a terminal
RESULT_FILE = "train.json"
VERDICT_WORDS = {"equivalent": "holds", "degraded": "drifts", "diverged": "drifts", "unchecked": "cannot be judged"}


@dataclass(frozen=True, kw_only=True)
class Promise:
    """What the study measured for a config: its throughput and the spread of its timed windows."""

    throughput: Optional[float] = None
    low: Optional[float] = None
    high: Optional[float] = None
    joules_per_sample: Optional[float] = None
    source: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class TrainPlan:
    """The configs a real run can train with and what the study promised for each.

    ``pick`` is None where no study or file gave one (the run trains the baseline).
    """

    pick: Optional[TrialConfig]
    baseline: TrialConfig
    pick_promise: Promise = field(default_factory=Promise)
    baseline_promise: Promise = field(default_factory=Promise)
    study: Optional[str] = None
    source: str = "the baseline (no study, no config given)"
    target: Optional[str] = None
    script_args: Optional[tuple[str, ...]] = None  # the script's own arguments the study tuned it with

    @property
    def config(self) -> TrialConfig:
        return self.pick or self.baseline

    @property
    def promise(self) -> Promise:
        return self.pick_promise if self.pick is not None else self.baseline_promise


def _promise(throughput: Any, windows: Any, joules: Any, source: str) -> Promise:
    rates = [float(w) for w in (windows or []) if isinstance(w, (int, float)) and w > 0]
    rate = float(throughput) if isinstance(throughput, (int, float)) and throughput > 0 else None
    return Promise(throughput=rate, low=min(rates) if rates else None, high=max(rates) if rates else None,
                   joules_per_sample=joules if isinstance(joules, (int, float)) else None, source=source)


def plan_from_document(doc: dict[str, Any], source: str) -> TrainPlan:
    """The plan a ``best_config.json`` (or a bare config mapping) gives.

    Raises:
        StudyError: the document holds no config.
    """
    if "config" not in doc and "baseline" not in doc:
        try:
            return TrainPlan(pick=TrialConfig.from_dict(doc), baseline=TrialConfig(), source=source)
        except (TypeError, ValueError) as exc:
            raise StudyError(f"{source}: neither a best_config.json nor a config ({exc})") from None
    base = doc.get("baseline") or {}
    measurement = doc.get("measurement") or {}
    if not isinstance(base, dict) or not isinstance(measurement, dict):
        raise StudyError(f"{source}: not a best_config.json (its baseline and measurement are mappings)")
    try:  # every value against its knob's: a mistyped "bf-16" would train fp32 under that label
        baseline = TrialConfig.from_dict(base["config"]) if base.get("config") else TrialConfig()
        pick = TrialConfig.from_dict(doc["config"]) if doc.get("config") else None
    except (TypeError, ValueError) as exc:
        raise StudyError(f"{source}: not a config autotune can train ({exc})") from None
    study = doc.get("study")
    pick_promise = _promise(doc.get("throughput"), measurement.get("window_throughputs"),
                            measurement.get("extra:gpu.joules_per_sample"),
                            f"study {study}, trial #{doc.get('trial')}" if study else source)
    baseline_promise = _promise(base.get("throughput"), None, None, f"study {study}'s baseline" if study else source)
    recorded = doc.get("script_args")
    script_args = tuple(str(a) for a in recorded) if isinstance(recorded, list) else None
    return TrainPlan(pick=pick, baseline=baseline, pick_promise=pick_promise, baseline_promise=baseline_promise,
                     study=study, source=source, target=doc.get("target"), script_args=script_args)


def load_plan(*, config: Union[str, Path, None] = None, study: Optional[str] = None,
              studies_dir: Union[str, Path] = DEFAULT_STUDIES_DIR) -> TrainPlan:
    """The plan from ``config`` (a ``best_config.json`` or a config file), a study's ``best_config.json``, or
    the baseline when neither is given.

    Raises:
        StudyError: both are given, or the file is missing or unreadable.
    """
    if config is not None and study is not None:
        raise StudyError("give either a config file or a study, not both")
    if config is None and study is None:
        return TrainPlan(pick=None, baseline=TrialConfig())
    path = Path(config) if config is not None else study_dir(str(study), Path(studies_dir)) / "best_config.json"
    if not path.is_file():
        raise StudyError(f"{path}: no such file" + ("" if config is not None else
                                                     f" (has study {study!r} finished under {studies_dir}?)"))
    import yaml

    from autotune.search._space import load_yaml

    try:
        text = path.read_text(encoding="utf-8")
        doc = load_yaml(text) if path.suffix in (".yaml", ".yml") else json.loads(text)  # no alias bomb
    except RecursionError:
        raise StudyError(f"{path}: cannot read it (nested too deeply)") from None
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise StudyError(f"{path}: cannot read it ({' '.join(str(exc).split())[:200]})") from None
    if not isinstance(doc, dict):
        raise StudyError(f"{path}: not a best_config.json or a config mapping")
    return plan_from_document(doc, str(path))


# -- one run ---------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class TrainRun:
    """What one real run measured."""

    label: str  # "pick" or "baseline"
    config: TrialConfig
    length: dict[str, Optional[int]]
    status: str  # "ok", "interrupted", "nan", "oom", "error"; "running" in a file written between epochs,
    # "crashed" when its process died after one
    error: Optional[str] = None
    optimizer_steps: int = 0  # the run's planned optimizer steps (ctx.optimizer_steps)
    steps_done: int = 0
    samples: int = 0
    epochs_done: int = 0
    seconds: float = 0.0  # first batch to last, hooks included
    wall_seconds: float = 0.0  # the whole train_fn, model building and the final evaluation included
    hook_seconds: float = 0.0  # outside the windows in the loop: hooks, ctx.untimed blocks, a trainer's evaluation
    untimed_seconds: dict[str, float] = field(default_factory=dict)  # hook_seconds by what ran ("evaluation")
    throughput: Optional[float] = None  # timed windows together: the training steps' rate
    throughput_low: Optional[float] = None  # the windows' 10th and 90th percentiles
    throughput_high: Optional[float] = None
    wall_throughput: Optional[float] = None  # samples over the whole train_fn
    window_throughputs: tuple[float, ...] = ()
    data_wait_fraction: Optional[float] = None  # share of the timed windows spent waiting on the loader
    losses: tuple[float, ...] = ()
    loss_every: int = 1
    metrics: tuple[dict[str, Any], ...] = ()
    metric: Optional[float] = None  # the last one reported
    best_metric: Optional[float] = None
    energy_j: Optional[float] = None
    joules_per_sample: Optional[float] = None  # the whole run's: start-up, compile and evaluation included
    steady_joules_per_sample: Optional[float] = None  # over the timed windows: the training steps' own
    one_time_joules: Optional[float] = None  # up to the first window, beyond its samples at the steady rate
    energy_note: str = ""
    extras: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["config"] = self.config.to_dict()
        data["window_throughputs"] = list(self.window_throughputs)
        data["losses"] = list(self.losses)
        data["metrics"] = list(self.metrics)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainRun":
        data = dict(data)
        data["config"] = TrialConfig.from_dict(data["config"])
        for key in ("window_throughputs", "losses", "metrics"):
            data[key] = tuple(data.get(key) or ())
        return cls(**{k: v for k, v in data.items() if k in {f.name for f in dataclasses.fields(cls)}})


def _check_runnable(config: TrialConfig) -> None:
    if config.processes_per_trial > 1:
        raise KnobError(f"autotune train runs one process per training; the config asks for processes_per_trial="
                        f"{config.processes_per_trial} (a DDP job): start it with torchrun instead")
    if config.mps:
        raise KnobError("autotune train does not start CUDA MPS: the config's copies run as MPS clients (mps=true); "
                        "start the daemon (nvidia-cuda-mps-control -d) and run the copies yourself, or train "
                        "with mps=false")


def run_once(fn: Callable[..., Any], config: TrialConfig, length: Any, *, label: str = "pick", seed: int = 0,
             baseline_batch_size: Optional[int] = None, metric_direction: str = "maximize",
             progress: Optional[Callable[[Any], None]] = None, on_start: Optional[Callable[[Any], None]] = None,
             checkpoint: Optional[Callable[["TrainRun"], None]] = None, nvml: Any = None,
             adopt_script_batch: bool = False) -> TrainRun:
    """Train ``fn`` once in this process with ``config`` for ``length`` (a ``RunLength``).

    A Ctrl-C (SIGINT) or SIGTERM stops the run at its next optimizer step; a second one interrupts at once.
    Either way the run's measurement is returned. ``on_start`` gets the ``RealRun`` before ``fn`` starts
    (its stop flag); ``checkpoint`` gets the run as measured so far at every epoch's end. ``nvml`` stands in
    for ``pynvml`` (``autotune.testing.FakeNvml``): the energy counter is read through it, on a CPU too.
    ``adopt_script_batch``: the run trains at the ``batch_size`` the script passes to ``ctx.loader`` (the
    baseline with no study: the script as it is written).
    """
    import torch

    from autotune.hardware import EnergyMeter
    from autotune.trial import _knobs
    from autotune.trial._context import NonFiniteLoss, TrialContext
    from autotune.trial._execute import classify_exception
    from autotune.trial._run import RealRun

    _check_runnable(config)
    device = _knobs.pick_device()
    run = RealRun(length, config=config, device=device, metric_direction=metric_direction, on_progress=progress)
    energy = EnergyMeter(index=device.index or 0, nvml=nvml) if device.type == "cuda" or nvml is not None else None
    status, error = "ok", None
    ctx: Any = None
    started = time.perf_counter()
    if on_start is not None:
        on_start(run)
    if checkpoint is not None:
        run.saves.append(lambda _epoch: checkpoint(_measured(run, ctx, label, length, "running",
                                                             None, started, energy, in_progress=True)))
    if energy is not None:
        energy.start()
        if energy.active:
            run.energy = energy.reading
    try:
        torch.manual_seed(seed)
        with _knobs.applied(config, device):
            ctx = TrialContext(config=config, seed=seed, baseline_batch_size=baseline_batch_size, device=device,
                               run=run, adopt_script_batch=adopt_script_batch)
            returned = fn(ctx)
            if isinstance(returned, (int, float)) and not isinstance(returned, bool) and ctx.metric is None:
                ctx.report_metric(returned)
    except KeyboardInterrupt:
        run.request_stop("a second interrupt")
    except NonFiniteLoss as exc:
        status, error = "nan", str(exc)
    except AutotuneError:
        raise
    except Exception as exc:  # noqa: BLE001 - a crash still leaves what was measured
        status = "oom" if classify_exception(exc) == "oom" else "error"
        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:500]
    if energy is not None:
        energy.stop()
    if status == "ok" and run.interrupted:
        status = "interrupted"
    return _measured(run, ctx, label, length, status, error, started, energy)


def _measured(run: Any, ctx: Any, label: str, length: Any, status: str, error: Optional[str],
              started: float, energy: Any, *, in_progress: bool = False) -> TrainRun:
    spread = run.spread()
    try:
        planned = run.optimizer_steps
    except KnobError:
        planned = 0
    joules = energy.joules if energy is not None and not in_progress else None
    if energy is None:
        note = "not measured: no GPU (the CPU has no energy counter autotune reads)"
    elif in_progress:
        note = "measured at the end of the run"
    else:
        note = "" if joules is not None else energy.why
    wall = time.perf_counter() - started
    extras = {k: v for k, v in (ctx.extras.items() if ctx is not None else ()) if k.startswith("pairing.")}
    steady = (run.window_joules / run.timed_samples if run.window_joules is not None and run.timed_samples
              else None)
    one_time = (max(0.0, run.warmup_joules - steady * (run.warmup_samples or 0))
                if steady is not None and run.warmup_joules is not None else None)
    return TrainRun(
        label=label, config=run.config, length=length.to_dict(), status=status, error=error, optimizer_steps=planned,
        steps_done=run.micro // run.accumulation, samples=run.samples, epochs_done=run.epoch,
        seconds=round(run.seconds, 4), wall_seconds=round(wall, 4), hook_seconds=round(run.hook_seconds, 4),
        untimed_seconds={k: round(v, 4) for k, v in run.untimed_seconds.items()},
        throughput=run.throughput, throughput_low=spread[0] if spread else None,
        throughput_high=spread[1] if spread else None,
        wall_throughput=run.samples / wall if wall > 0 and run.samples else None,
        window_throughputs=tuple(round(r, 3) for r in run.window_rates()), losses=tuple(run.losses()),
        data_wait_fraction=(sum(w.data_wait_seconds for w in run.windows) / run.timed_seconds
                            if run.timed_seconds > 0 else None),
        loss_every=run.loss_every, metrics=tuple(run.metrics), metric=run.metrics[-1]["value"] if run.metrics else None,
        best_metric=run.best_metric, energy_j=joules,
        joules_per_sample=joules / run.samples if joules is not None and run.samples else None,
        steady_joules_per_sample=steady, one_time_joules=one_time, energy_note=note, extras=extras)


# -- the promise -------------------------------------------------------------------------------------
def promise_check(run: TrainRun, promise: Promise) -> dict[str, Any]:
    """The run's delivered throughput against the study's for the same config, as a ratio with its range.

    The range divides the run's windows' 10th-90th percentiles by the study's windows' extremes; the
    promise holds when the ratio is within ``PROMISE_TOLERANCE`` of 1 or its range reaches 1.
    """
    out: dict[str, Any] = {"delivered": run.throughput, "delivered_low": run.throughput_low,
                           "delivered_high": run.throughput_high, "promised": promise.throughput,
                           "promised_low": promise.low, "promised_high": promise.high, "source": promise.source}
    if run.throughput is None or promise.throughput is None:
        out.update(ratio=None, holds=None, what=(
            "no promise to check: no study measured this config" if promise.throughput is None
            else "no promise to check: the run ended before its first timed window"))
        return out
    ratio = run.throughput / promise.throughput
    low = (run.throughput_low or run.throughput) / (promise.high or promise.throughput)
    high = (run.throughput_high or run.throughput) / (promise.low or promise.throughput)
    holds = abs(ratio - 1) <= PROMISE_TOLERANCE or low <= 1 <= high
    out.update(ratio=ratio, ratio_low=low, ratio_high=high, holds=holds)
    text = (f"delivered {run.throughput:,.1f} samples/s against the {promise.throughput:,.1f} the study measured "
            f"({promise.source}): {ratio:.3f}x (range {low:.3f}x-{high:.3f}x)")
    if not holds:
        text += (f"; the real run is {'slower' if ratio < 1 else 'faster'} than the study measured, by "
                 f"{abs(ratio - 1):.0%}: it contradicts the study's figure")
    out["what"] = text
    return out


def compare_runs(pick: TrainRun, baseline: TrainRun, *, study_speedup: Optional[float] = None,
                 max_accuracy_loss: float = 0.01, metric_direction: str = "maximize") -> dict[str, Any]:
    """The pick against the baseline at the same length: speed-up with its range, and the accuracy verdict of
    the pick's loss curve against the baseline's (``_verdict.judge``: paired where both saw the same
    batches from the same weights), said in one word: ``holds`` or ``drifts``."""
    out: dict[str, Any] = {}
    if pick.throughput and baseline.throughput:
        speedup = pick.throughput / baseline.throughput
        low = (pick.throughput_low or pick.throughput) / (baseline.throughput_high or baseline.throughput)
        high = (pick.throughput_high or pick.throughput) / (baseline.throughput_low or baseline.throughput)
        out.update(speedup=speedup, speedup_low=low, speedup_high=high)
        what = f"the pick ran at {speedup:.2f}x the baseline (range {low:.2f}x-{high:.2f}x)"
        if pick.wall_seconds and baseline.wall_seconds:
            out["wall_speedup"] = baseline.wall_seconds / pick.wall_seconds
            what += f"; {out['wall_speedup']:.2f}x in wall time, evaluation and start-up included"
        if study_speedup is not None:
            what += f"; the study measured {study_speedup:.2f}x"
            if high < 1 <= study_speedup or (study_speedup > 1 and high < study_speedup * (1 - PROMISE_TOLERANCE)):
                what += (": the real run contradicts the study, the pick is " +
                         ("slower than the baseline" if high < 1 else "less faster than the study measured"))
        out["speed_what"] = what
    reference = SimpleNamespace(losses=list(baseline.losses), metric=baseline.metric, loss_every=baseline.loss_every,
                                extras=baseline.extras)
    band = ReferenceBand.of_measurements([reference]) if baseline.losses else ReferenceBand()
    verdict = judge(list(pick.losses), pick.metric, band, reference_metric=baseline.metric,
                    max_accuracy_loss=max_accuracy_loss, metric_direction=metric_direction,
                    loss_every=pick.loss_every, pairing=fingerprints(pick.extras), precision=pick.config.precision)
    word = VERDICT_WORDS[verdict.label]
    out.update(verdict=verdict.label, accuracy=word, evidence=verdict.evidence,
               accuracy_what=f"the pick's training {word} against the baseline's over the whole run "
                             f"({pick.steps_done:,} steps): {verdict.label}: {verdict.evidence}")
    if verdict.label in ("degraded", "diverged"):
        out["accuracy_what"] += "; the real run contradicts the study's accuracy verdict"
    return out


# -- progress and signals ----------------------------------------------------------------------------
class _ProgressLine:
    """One progress line on stderr: in place on a terminal, every ``PROGRESS_SECONDS`` otherwise."""

    def __init__(self, label: str, enabled: bool = True) -> None:
        self.label = label
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self._last = 0.0

    def __call__(self, status: Any) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not self.tty and now - self._last < PROGRESS_SECONDS:
            return
        self._last = now
        total = f"/{status.total_steps:,}" if status.total_steps else ""
        parts = [f"{self.label}: step {status.step:,}{total}", f"epoch {status.epoch}"]
        parts.append(f"{status.rate:,.1f} samples/s" if status.rate else "warming up")
        if status.loss is not None:
            parts.append(f"loss {status.loss:.4g}")
        if status.seconds_left is not None:
            parts.append(f"{_duration(status.seconds_left)} left")
        if status.best_metric is not None:
            parts.append(f"best metric {status.best_metric:.4g}")
        line = "  ".join(parts)
        print(("\r\033[K" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.enabled and self.tty:
            print(file=sys.stderr, flush=True)


def _duration(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


class _StopOnSignal:
    """SIGINT and SIGTERM call ``stop(reason)`` once; a second one raises KeyboardInterrupt. Restores on exit."""

    def __init__(self, stop: Callable[[str], None]) -> None:
        self.stop = stop
        self.count = 0
        self._saved: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        self.count += 1
        name = signal.Signals(signum).name
        if self.count > 1:
            raise KeyboardInterrupt(name)
        print(f"\nautotune train: {name}: stopping at the next optimizer step (again to stop at once)",
              file=sys.stderr, flush=True)
        self.stop(name)

    def __enter__(self) -> "_StopOnSignal":
        import threading

        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._saved[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._saved.items():
            signal.signal(signum, handler)


# -- the command -------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class TrainResult:
    """What ``autotune train`` ran and found: its runs, the promise checked, the comparison, the file."""

    runs: dict[str, TrainRun]
    promise: dict[str, Any]
    comparison: Optional[dict[str, Any]]
    path: Optional[Path]
    interrupted: bool
    lines: tuple[str, ...] = ()


def resolve_length(plan: TrainPlan, *, epochs: Optional[int], steps: Optional[int], minutes: Optional[float],
                   compare: bool) -> Any:
    """The run's ``RunLength``: ``minutes`` become samples at the study's throughput for the config, so that
    ``ctx.optimizer_steps`` is known before the run; in a comparison, steps become the pick's samples, so
    both configs train the same samples.

    Raises:
        StudyError: none or several lengths, or ``minutes`` with no measured throughput for the config.
    """
    from autotune.trial._run import RunLength

    given = [name for name, value in (("epochs", epochs), ("steps", steps), ("minutes", minutes)) if value is not None]
    if len(given) != 1:
        raise StudyError("give the run's length as exactly one of --epochs, --steps or --minutes"
                         + (f" (got {', '.join(given)})" if given else ""))
    try:
        if minutes is not None:
            rate = plan.promise.throughput
            if rate is None:
                raise StudyError("--minutes needs the throughput the study measured for this config (--study NAME, "
                                 "or --config with its best_config.json); give --steps or --epochs instead")
            return RunLength(samples=max(1, int(minutes * 60 * rate)))
        if steps is not None and compare:
            return RunLength(samples=steps * plan.config.global_batch_size)
        return RunLength(epochs=epochs, steps=steps)
    except ValueError as exc:
        raise StudyError(str(exc)) from None


def train(train_fn: Union[Callable[..., Any], str], *, config: Union[str, Path, None] = None,
          study: Optional[str] = None, epochs: Optional[int] = None, steps: Optional[int] = None,
          minutes: Optional[float] = None, compare: bool = False, seed: int = 0,
          studies_dir: Union[str, Path] = DEFAULT_STUDIES_DIR, out: Union[str, Path, None] = None,
          metric_direction: str = "maximize", max_accuracy_loss: float = 0.01, progress: bool = True,
          args: Optional[Sequence[str]] = None, say: Callable[[str], None] = print) -> TrainResult:
    """Train ``train_fn`` for real with the study's pick (or ``config``, or the baseline) and check the promise.

    Args:
        train_fn: The function the study tuned, or its ``FILE.py:FN`` / ``module:FN``.
        config: A ``best_config.json`` (or a config file) to train with.
        study: A study whose ``best_config.json`` (under ``studies_dir``) to train with.
        epochs: Train this many epochs of ``ctx.loader``; or
        steps: this many optimizer steps; or
        minutes: as many samples as the study's throughput for the config trains in this many minutes.
        compare: Train the baseline too, for the same samples, and compare speed and loss curves.
        seed: ``ctx.seed``; 0 is the seed of the study's first fp32 reference.
        out: Folder of ``train.json``; default the study's folder (``studies/<study>``), else ``studies/train``.
        metric_direction: Whether a higher reported metric is better (``maximize``) or lower.
        max_accuracy_loss: The verdict's bound on the metric's loss, as in the study.
        progress: Show the progress line.
        args: The script's own arguments, its ``sys.argv[1:]`` while it is imported and trains (``autotune
            train FILE:FN ... -- ARGS``); None: those the study was tuned with (``best_config.json``'s
            ``script_args``), else the calling process's own ``sys.argv[1:]``.
        say: Where the closing lines go.

    Raises:
        StudyError: a config that cannot be read, or a length that cannot be resolved.
        WorkloadError: ``train_fn`` cannot be imported, or the script's ``argparse`` refused its arguments.
        KnobError: a config ``autotune train`` cannot run (a DDP job, or copies under CUDA MPS).
    """
    if isinstance(args, (str, bytes)):
        raise ValueError(f"args must be a list of arguments (e.g. ['--lr', '0.1']), not the string {args!r}: "
                         "split it with shlex.split")
    plan = load_plan(config=config, study=study, studies_dir=studies_dir)
    script_args = [str(a) for a in args] if args is not None else (
        list(plan.script_args) if plan.script_args is not None else None)
    if compare and plan.pick is None:
        raise StudyError("--compare needs a pick to compare with the baseline: give --study or --config")
    length = resolve_length(plan, epochs=epochs, steps=steps, minutes=minutes, compare=compare)
    for cfg in (plan.config, plan.baseline) if compare else (plan.config,):
        _check_runnable(cfg)  # before anything trains
    if metric_direction not in ("maximize", "minimize"):
        raise ValueError(f"metric_direction must be 'maximize' or 'minimize', not {metric_direction!r}")
    folder = Path(out) if out is not None else (study_dir(plan.study, Path(studies_dir)) if plan.study
                                                  else Path(studies_dir) / "train")
    folder = folder.absolute()  # before the script runs: one that changes directory must not move train.json
    path = folder / RESULT_FILE
    try:  # an earlier run that did not finish (interrupted, or its process died) is kept, not overwritten
        earlier = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, ValueError, RecursionError):
        earlier = {}  # torn by a kill mid-write: unfinished too
    if earlier is not None and (not isinstance(earlier, dict) or earlier.get("interrupted") or not earlier.get("ended")):
        started = str(earlier.get("started", "")) if isinstance(earlier, dict) else ""
        stamp = "".join(c for c in started if c.isdigit() or c == "T")[:15]  # 20261206T224011
        kept = path.with_name(f"train-unfinished-{stamp or int(path.stat().st_mtime)}.json")
        os.replace(path, kept)
        say(f"The earlier run's {RESULT_FILE} did not finish; kept as {kept}")
    target = train_fn if isinstance(train_fn, str) else None
    argv = ScriptArgv(target or "", script_args)  # sys.argv as the script sees it, in this process
    runs: dict[str, TrainRun] = {}
    doc: dict[str, Any] = {"study": plan.study, "source": plan.source, "length": length.to_dict(),
                           "script_args": script_args if script_args is not None else sys.argv[1:],
                           "requested": {"epochs": epochs, "steps": steps, "minutes": minutes}, "seed": seed,
                           "started": _now(), "runs": {}}

    def save(partial: Optional[TrainRun] = None) -> None:
        if partial is not None:
            doc["runs"][partial.label] = partial.to_dict()
        _write(path, doc)

    interrupted = False
    if not compare and plan.config.processes_per_gpu == 1:
        label = "pick" if plan.pick is not None else "baseline"
        line = _ProgressLine(label, progress)
        stopper: dict[str, Any] = {}
        with argv, _StopOnSignal(lambda reason: stopper["run"].request_stop(reason)):
            fn = train_fn if not isinstance(train_fn, str) else load_target_or_say_why(train_fn)
            result = run_once(fn, plan.config, length, label=label, seed=seed,
                              baseline_batch_size=plan.baseline.global_batch_size, metric_direction=metric_direction,
                              progress=line, on_start=lambda r: stopper.__setitem__("run", r), checkpoint=save,
                              adopt_script_batch=config is None and study is None)
        line.done()
        runs[label] = result
        interrupted = result.status == "interrupted"
    else:
        # A comparison's runs import the target in their own processes: this one stays free of torch.
        target = target or target_of(train_fn)  # type: ignore[arg-type]
        single = (("pick" if plan.pick is not None else "baseline", plan.config),)
        for label, cfg in (("baseline", plan.baseline), ("pick", plan.config)) if compare else single:
            result = _run_child(target, cfg, length, label=label, seed=seed, folder=folder,
                                baseline_batch_size=plan.baseline.global_batch_size,
                                metric_direction=metric_direction, progress=progress,
                                script_args=doc["script_args"])
            if result.extras.get("script_arguments_refused"):
                raise ScriptArgumentsError(str(result.error))  # the script's own argparse: before anything trains
            runs[label] = result
            save(result)
            if result.status == "interrupted":
                interrupted = True
                break
    main_run = runs.get("pick") or runs.get("baseline")
    assert main_run is not None
    check = promise_check(main_run, plan.promise if main_run.label == "pick" or plan.pick is None
                          else plan.baseline_promise)
    doc["promise"] = check
    if compare and "baseline" in runs and main_run.label == "pick":
        doc["promise_baseline"] = promise_check(runs["baseline"], plan.baseline_promise)
    comparison = None
    if compare and "pick" in runs and "baseline" in runs:
        speedup = None
        if plan.pick_promise.throughput and plan.baseline_promise.throughput:
            speedup = plan.pick_promise.throughput / plan.baseline_promise.throughput
        comparison = compare_runs(runs["pick"], runs["baseline"], study_speedup=speedup,
                                  max_accuracy_loss=max_accuracy_loss, metric_direction=metric_direction)
        doc["comparison"] = comparison
    doc["interrupted"] = interrupted
    doc["ended"] = _now()
    doc["runs"] = {k: v.to_dict() for k, v in runs.items()}
    _write(path, doc)
    lines = _closing_lines(runs, check, comparison, path, interrupted)
    for text in lines:
        say(text)
    return TrainResult(runs=runs, promise=check, comparison=comparison, path=path, interrupted=interrupted,
                       lines=tuple(lines))


def _closing_lines(runs: dict[str, TrainRun], check: dict[str, Any], comparison: Optional[dict[str, Any]],
                   path: Path, interrupted: bool) -> list[str]:
    lines = []
    for label, run in runs.items():
        rate = f"delivered {run.throughput:,.1f} samples/s while training" if run.throughput else "no timed window"
        apart = ", ".join(f"{_duration(seconds)} in {what}" for what, seconds in run.untimed_seconds.items()
                          if seconds >= 0.05)
        text = (f"{label} ({run.config.describe()}): {run.status}, {run.steps_done:,} of {run.optimizer_steps:,} "
                f"optimizer steps, {run.samples:,} samples, {run.epochs_done} epochs in {_duration(run.wall_seconds)}; "
                f"{rate}" + (f" ({apart}, outside it)" if apart else ""))
        if run.losses:
            text += f"; final loss {run.losses[-1]:.4g}"
        if run.best_metric is not None:
            text += f"; best metric {run.best_metric:.4g}"
        text += "; energy " + _energy_words(run)
        if run.error:
            text += f"; {run.error}"
        lines.append(text)
    lines.append("Promise: " + check["what"] + ".")
    if comparison is not None:
        if comparison.get("speed_what"):
            lines.append("Speed: " + comparison["speed_what"] + ".")
        lines.append("Accuracy: " + comparison["accuracy_what"] + ".")
        quarters = [f"{label} " + ", ".join(f"{v:.4g}" for v in _quarters(runs[label].losses))
                    for label in ("baseline", "pick") if runs[label].losses]
        if quarters:
            lines.append("Loss curves, the mean of each quarter of the run: "
                         + "; ".join(quarters) + f" (every point in {path.name}).")
        pick, base = runs["pick"], runs["baseline"]
        if pick.steady_joules_per_sample is not None and base.steady_joules_per_sample is not None:
            lines.append(f"Energy: {pick.steady_joules_per_sample / base.steady_joules_per_sample:.2f}x the "
                         "baseline's joules per sample while training; one-time "
                         f"{pick.one_time_joules or 0:,.0f} J against {base.one_time_joules or 0:,.0f} J (start-up, "
                         "compile, warm-up).")
        elif pick.joules_per_sample is not None and base.joules_per_sample is not None:
            lines.append(f"Energy: {pick.joules_per_sample / base.joules_per_sample:.2f}x the baseline's joules "
                         "per sample over the whole run, start-up and compile included.")
    if interrupted:
        lines.append("Interrupted: the run stopped at an optimizer step; what it measured is kept.")
    lines.append(f"Written to {path}")
    return lines


def _energy_words(run: TrainRun) -> str:
    """A run's energy: the steady state's joules per sample, the one-time joules apart, the whole run's."""
    if run.steady_joules_per_sample is not None:
        text = f"{run.steady_joules_per_sample:.4g} J/sample while training"
        if run.one_time_joules is not None:
            text += f", {run.one_time_joules:,.0f} J one-time"
        if run.joules_per_sample is not None:
            text += f" ({run.joules_per_sample:.4g} J/sample over the whole run)"
        return text
    if run.joules_per_sample is not None:
        return f"{run.joules_per_sample:.4g} J/sample over the whole run"
    return run.energy_note or "not measured"


def _quarters(losses: tuple[float, ...]) -> list[float]:
    """The curve's mean over each quarter of its points."""
    n = len(losses)
    bounds = [round(n * q / 4) for q in range(5)]
    return [sum(losses[a:b]) / (b - a) for a, b in zip(bounds, bounds[1:]) if b > a]


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _write(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, dumps(_finite(doc)) + "\n")


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


# -- a run in its own process (--compare) ------------------------------------------------------------
def _run_child(target: str, config: TrialConfig, length: Any, *, label: str, seed: int, folder: Path,
               baseline_batch_size: int, metric_direction: str, progress: bool,
               script_args: Sequence[str] = ()) -> TrainRun:
    """The run in fresh processes forked from the trial server (torch already imported, CUDA untouched), each
    in its own session: a Ctrl-C reaches them once, forwarded from here; a second one ends them at once.

    A config of ``processes_per_gpu`` N trains N independent copies at once on the device, copy i at seed
    ``seed + i`` (as a study's co-located trial): the run is their aggregate (``_aggregate``).
    """
    from autotune.study._isolation import _mp_context

    folder.mkdir(parents=True, exist_ok=True)
    copies = config.processes_per_gpu
    children, paths = [], []
    for index in range(copies):
        name = label if copies == 1 else f"{label}-copy{index}"
        path = folder / f".train-{name}.json"
        path.unlink(missing_ok=True)
        spec = {"target": target, "config": config.to_dict(), "length": length.to_dict(), "label": name,
                "seed": seed + index, "baseline_batch_size": baseline_batch_size, "metric_direction": metric_direction,
                "progress": progress and index == 0, "result": str(path), "copies": copies,
                "script_args": list(script_args)}
        children.append(_mp_context().Process(target=_child_entry, args=(json.dumps(spec), dict(os.environ))))
        paths.append(path)
    forwarded = {"count": 0}

    def forward(signum: int, frame: Any) -> None:
        forwarded["count"] += 1
        for child in children:
            if child.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signal.SIGINT if forwarded["count"] == 1 else signal.SIGKILL)

    saved = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for child in children:
            child.start()
        for child in children:
            child.join()
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
    runs = []
    for child, path in zip(children, paths):
        try:
            run = TrainRun.from_dict(json.loads(path.read_text(encoding="utf-8")))
            if run.status == "running":  # its process died after an epoch: what it measured until then
                run = dataclasses.replace(run, status="crashed",
                                          error=f"its process died (exit code {child.exitcode}) during the run")
            runs.append(run)
        except (OSError, ValueError) as exc:
            raise AutotuneError(f"the {label} run's process ended (exit code {child.exitcode}) without its result "
                                f"({exc})") from None
        finally:
            path.unlink(missing_ok=True)
    run = _aggregate(label, runs) if copies > 1 else runs[0]
    if forwarded["count"] and run.status == "ok":
        run = dataclasses.replace(run, status="interrupted")
    return run


STATUS_ORDER = ("crashed", "error", "oom", "nan", "interrupted", "ok")  # the aggregate of copies has the worst status


def _aggregate(label: str, runs: list[TrainRun]) -> TrainRun:
    """Co-located copies as one run: their samples and throughputs summed (the device's delivered rate, as a
    study's co-located trial counts it), copy 0's loss curve, metrics and pairing (it trains at the run's
    seed), the device's energy (every copy read the same counter: the largest reading) over all samples."""
    first = runs[0]
    status = min((r.status for r in runs), key=lambda s: STATUS_ORDER.index(s) if s in STATUS_ORDER else 0)
    total = sum(r.samples for r in runs)

    def summed(name: str) -> Optional[float]:
        values = [getattr(r, name) for r in runs]
        return sum(values) if all(v is not None for v in values) else None

    energies = [r.energy_j for r in runs if r.energy_j is not None]
    energy = max(energies) if energies else None
    wall = max(r.wall_seconds for r in runs)
    return dataclasses.replace(
        first, label=label, status=status, error=next((r.error for r in runs if r.error), None), samples=total,
        seconds=max(r.seconds for r in runs), wall_seconds=wall, throughput=summed("throughput"),
        throughput_low=summed("throughput_low"), throughput_high=summed("throughput_high"),
        wall_throughput=total / wall if wall > 0 else None, energy_j=energy,
        joules_per_sample=energy / total if energy is not None and total else None,
        steady_joules_per_sample=None, one_time_joules=None,  # each copy's windows read the shared counter
        extras={**first.extras, "copies": len(runs), "copy_throughputs": [r.throughput for r in runs],
                "copy_statuses": [r.status for r in runs]})


def _child_entry(text: str, environ: dict[str, str]) -> None:
    """The forked child of ``_run_child``: its own session, the coordinator's environment, one run."""
    import multiprocessing

    os.setsid()  # a Ctrl-C at the terminal reaches the coordinator only, which forwards it once
    os.environ.clear()
    os.environ.update(environ)
    if sys.platform.startswith("linux"):
        multiprocessing.set_start_method("fork", force=True)  # the script's DataLoader workers, as in a trial
    code = _child_main(text)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _child_main(text: str) -> int:
    """One run of ``_run_child``'s spec, its result written where the spec says."""
    from autotune.trial._run import RunLength

    spec = json.loads(text)
    config = TrialConfig.from_dict(spec["config"])
    if spec.get("copies", 1) > 1 and config.cpu_threads is None:
        import torch

        from autotune.hardware import usable_cpus

        if not torch.cuda.is_available():  # co-located copies on the CPU share its cores, as a study's do
            torch.set_num_threads(max(1, usable_cpus() // spec["copies"]))
    length = RunLength(**spec["length"])
    line = _ProgressLine(spec["label"], spec["progress"])
    stopper: dict[str, Any] = {}
    try:
        with ScriptArgv(spec["target"], spec.get("script_args", [])), \
                _StopOnSignal(lambda reason: stopper["run"].request_stop(reason)):
            fn = load_target_or_say_why(spec["target"])
            run = run_once(fn, config, length, label=spec["label"], seed=spec["seed"],
                           baseline_batch_size=spec["baseline_batch_size"], metric_direction=spec["metric_direction"],
                           progress=line, on_start=lambda r: stopper.__setitem__("run", r),
                           checkpoint=lambda partial: _write_json(Path(spec["result"]), partial.to_dict()))
    except (AutotuneError, WorkloadError) as exc:
        run = TrainRun(label=spec["label"], config=config, length=length.to_dict(), status="error", error=str(exc),
                       extras={"script_arguments_refused": True} if isinstance(exc, ScriptArgumentsError) else {})
    line.done()
    _write_json(Path(spec["result"]), run.to_dict())
    return 0


def _write_json(path: Path, data: dict[str, Any]) -> None:
    write_atomic(path, json.dumps(_finite(data)))
