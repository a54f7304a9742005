"""A real training run inside ``train_fn``: its length, and what ``ctx.batches`` does under ``autotune train``.

A study's trial trains a fixed number of samples and times a few windows of it. A real run trains as long
as the user asked (epochs, optimizer steps or samples), restarts the loader at every epoch, calls the
script's end-of-epoch hooks and every-N-steps hooks (evaluation, checkpoints), and times the training steps
in windows of about ``WINDOW_SECONDS`` each. The hooks, and whatever the script runs inside
``ctx.untimed(...)`` (an evaluation inside its loop), are kept outside the windows and timed apart by what
they are (``RealRun.untimed_seconds``), so the delivered throughput is the training steps' alone.

``RealRun`` keeps all of it; the study layer (``autotune.study._train``) builds one, runs ``train_fn`` with it
and writes out what it measured. ``RunClock`` feeds the same run from a trainer's callbacks (the adapters of
``autotune.integrations``, through ``ctx.step_clock()``).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from autotune._config import TrialConfig
from autotune._errors import KnobError
from autotune.trial import _knobs
from autotune.trial._context import NonFiniteLoss, batch_length
from autotune.trial._measure import BlockSeconds, Window, synchronize

WINDOW_SECONDS = 1.0  # a timed window closes at the first optimizer-step boundary past this
WARMUP_STEPS = 5  # micro-batches before the first window, as a study's default budget (compile, cuDNN tuning)
MAX_POINTS = 512  # points of the run's stored loss curve: the optimizer steps are averaged into bins


@dataclass(frozen=True, kw_only=True)
class RunLength:
    """How long a real run trains: exactly one of ``epochs``, ``steps`` (optimizer steps) or ``samples``.

    Raises:
        ValueError: none or several are given, or one is not positive.
    """

    epochs: Optional[int] = None
    steps: Optional[int] = None
    samples: Optional[int] = None

    def __post_init__(self) -> None:
        given = [v for v in (self.epochs, self.steps, self.samples) if v is not None]
        if len(given) != 1:
            raise ValueError("a run's length is exactly one of epochs, steps or samples")
        if given[0] < 1:
            raise ValueError(f"a run's length must be positive, not {given[0]}")

    def describe(self) -> str:
        if self.epochs is not None:
            return f"{self.epochs} epoch{'s' if self.epochs != 1 else ''}"
        if self.steps is not None:
            return f"{self.steps:,} optimizer steps"
        return f"{self.samples:,} samples"

    def to_dict(self) -> dict[str, Optional[int]]:
        return {"epochs": self.epochs, "steps": self.steps, "samples": self.samples}


@dataclass(frozen=True)
class RunStatus:
    """Where a run is, for its progress line."""

    step: int  # optimizer steps done
    total_steps: Optional[int]  # None until the loader's length is known (an epoch run before ctx.batches)
    epoch: int  # epochs done
    samples: int
    seconds: float  # since the first batch
    rate: Optional[float]  # samples/s of the last timed window
    loss: Optional[float]  # mean training loss of the last window's steps
    best_metric: Optional[float]
    seconds_left: Optional[float]


class RealRun:
    """The length, clock, loss curve, metrics and stop flag of one real run (``TrialContext(run=...)``).

    Args:
        length: How long to train.
        config: The run's config (its accumulation, CUDA Graphs and compile set the untimed warm-up).
        device: Where it trains (windows are closed with a device synchronisation).
        metric_direction: ``maximize`` or ``minimize``: which reported metric is the best so far.
        on_progress: Called with a ``RunStatus`` at every window's end and every epoch's end.
    """

    def __init__(self, length: RunLength, *, config: TrialConfig, device: torch.device,
                 metric_direction: str = "maximize", on_progress: Optional[Callable[[RunStatus], None]] = None) -> None:
        self.length = length
        self.config = config
        self.device = device
        self.metric_direction = metric_direction
        self.on_progress = on_progress
        self.accumulation = config.accumulation_steps
        warmup = WARMUP_STEPS
        if config.cuda_graphs:
            warmup = max(warmup, _knobs.GRAPH_WARMUP_STEPS + 2)  # eager warm-up, capture, one replay
        self.warmup_micro = -(-warmup // self.accumulation) * self.accumulation
        self.hooks: list[Callable[[int], Any]] = []
        self.saves: list[Callable[[int], Any]] = []  # autotune's own between epochs (train.json): no script's time
        self.step_hooks: list[tuple[int, str, Callable[[int], Any]]] = []  # (every N optimizer steps, what, hook)
        self.untimed_seconds: dict[str, float] = {}  # seconds outside the windows by what ran: "evaluation", ...
        # The device's energy counter, joules since the run started (None where it is not read): read where
        # each window opens and closes, so the steady state's joules per sample leave the warm-up's out.
        self.energy: Optional[Callable[[], Optional[float]]] = None
        self.window_joules: Optional[float] = None
        self.warmup_joules: Optional[float] = None  # up to the first window: model building, compile, capture
        self.warmup_samples: Optional[int] = None  # samples trained before the first window opened
        self._window_energy: Optional[float] = None
        self._paused = False
        # ctx.epochs: the script loops over epochs itself, so ctx.batches yields one epoch per call
        self.epoch_at_a_time = False
        self._untimed_at_end = 0.0
        self._pass_ended: Optional[float] = None
        self.windows: list[Window] = []
        self.metrics: list[dict[str, Any]] = []  # each report_metric: its epoch, optimizer step and value
        self.epoch = 0  # epochs done
        self.micro = 0  # micro-batches done
        self.samples = 0
        self.stop_reason: Optional[str] = None  # why the run stopped before its length (Ctrl-C)
        self.started: Optional[float] = None  # perf_counter of the first batch
        self.ended: Optional[float] = None
        self.hook_seconds = 0.0
        self.epoch_micro: Optional[int] = None  # micro-batches per epoch of the loader
        self.total_micro: Optional[int] = None
        self.loss_every = 1
        self._sums: Optional[torch.Tensor] = None  # per bin of optimizer steps: the sum of its micro-batch losses
        self._counts: list[int] = []
        self._window_start: Optional[float] = None
        self._window_micro = 0
        self._window_samples = 0
        self._window_wait = 0.0
        self._window_first_bin = 0
        self._last_loss: Optional[float] = None

    # -- the length --------------------------------------------------------------------------
    def plan(self, epoch_micro: Optional[int]) -> int:
        """Micro-batches of the whole run, given an epoch's (None when the loader has no length).

        Raises:
            KnobError: ``epochs`` with a loader of no length, or a length shorter than one optimizer step.
        """
        if epoch_micro is not None:
            self.epoch_micro = epoch_micro
        if self.total_micro is not None:
            return self.total_micro
        a, global_batch = self.accumulation, self.config.global_batch_size
        if self.length.steps is not None:
            total = self.length.steps * a
        elif self.length.samples is not None:
            total = self.length.samples // global_batch * a
        else:
            if self.epoch_micro is None:
                raise KnobError("a run of epochs needs to know an epoch's length: build the loader with ctx.loader "
                                "(before asking ctx.optimizer_steps), or give the length in steps")
            total = self.length.epochs * self.epoch_micro // a * a  # whole optimizer steps only
        if total < a:
            raise KnobError(f"a run of {self.length.describe()} is shorter than one optimizer step "
                            f"(global batch {global_batch})")
        self.total_micro = total
        steps = total // a
        self.loss_every = max(1, -(-steps // MAX_POINTS))
        self._counts = [0] * -(-steps // self.loss_every)
        if self.started is not None:
            self._curve()  # a trainer's run of epochs learns its length after it started
        return total

    @property
    def optimizer_steps(self) -> int:
        return self.plan(None) // self.accumulation

    @property
    def finished(self) -> bool:
        """The run's length is trained, or a stop was asked for and an optimizer step just ended."""
        if self.stop_reason is not None and self.micro % self.accumulation == 0:
            return True
        return self.total_micro is not None and self.micro >= self.total_micro

    def step_clock(self) -> "RunClock":
        """This run's clock for a loop that a trainer drives (``ctx.step_clock()`` under ``autotune train``)."""
        return RunClock(self)

    @property
    def interrupted(self) -> bool:
        return self.stop_reason is not None

    def request_stop(self, reason: str) -> None:
        """Stop at the next optimizer-step boundary: ``ctx.batches`` ends there, the script's code after its
        loop (a last evaluation, a checkpoint) runs as usual."""
        self.stop_reason = self.stop_reason or reason

    # -- the loop ----------------------------------------------------------------------------
    def batches(self, ctx: Any, loader: Iterable[Any]) -> Iterator[Any]:
        """``ctx.batches`` of a real run: every batch of the run's length, epoch after epoch."""
        try:
            epoch_micro: Optional[int] = len(loader)  # type: ignore[arg-type]
        except TypeError:
            epoch_micro = None
        total = self.plan(epoch_micro)
        self.begin_run()
        iterator = iter(loader)
        in_epoch = 0
        try:
            while self.micro < total:
                if self.micro % self.accumulation == 0 and self.stop_reason is not None:
                    break
                fetch = self.before_fetch()
                try:
                    batch = next(iterator)
                except StopIteration:
                    if in_epoch == 0:
                        raise KnobError(f"the loader yields no batch of {self.config.batch_size} (is the dataset "
                                        "smaller than the batch? ctx.loader drops incomplete batches)") from None
                    self._end_epoch(ctx)
                    if self.epoch_at_a_time:
                        return
                    iterator, in_epoch = iter(loader), 0
                    continue
                batch = ctx._move(batch)
                if self.micro < self.accumulation:
                    ctx._fingerprint_batch(batch, self.micro)
                self.fetched(fetch)
                calls = self._calls(ctx)
                yield batch
                self._add_step_loss(ctx, calls)
                in_epoch += 1
                self.after_step(_batch_length(batch))
                if self.epoch_micro is not None and in_epoch == self.epoch_micro:
                    self._end_epoch(ctx)
                    if self.epoch_at_a_time:
                        return
                    iterator, in_epoch = iter(loader), 0
        finally:
            self.end_run()

    # -- one micro-batch, whoever drives the loop (ctx.batches, or a trainer through RunClock) ------------
    def begin_run(self) -> None:
        """The first batch is about to be fetched: the run's clock and its loss curve start."""
        self.started = self.started or time.perf_counter()
        self._curve()

    def _curve(self) -> None:
        """The loss curve's bins on the device, once the run's length is known."""
        if self._sums is None and self.total_micro is not None:
            self._sums = torch.zeros(len(self._counts), device=self.device, dtype=torch.float32)

    def before_fetch(self) -> float:
        """A micro-batch starts: a timed window opens first when one is due (at the end of the warm-up, else at
        an optimizer-step boundary after a window closed). Returns when its fetch began."""
        if not self._paused and (self.micro == self.warmup_micro or (
                self.micro > self.warmup_micro and self._window_start is None
                and self.micro % self.accumulation == 0)):
            self._open_window()
        return time.perf_counter()

    def fetched(self, began: float) -> None:
        """The micro-batch is on the device: its wait counts in the window."""
        if self._window_start is not None:
            self._window_wait += time.perf_counter() - began

    def after_step(self, samples: int) -> None:
        """A micro-batch's work is queued: count it, close the window at an optimizer step past
        ``WINDOW_SECONDS``, and run the every-N-steps hooks that fall on this optimizer step, untimed."""
        self.micro += 1
        self.samples += samples
        if self._window_start is not None:
            self._window_micro += 1
            self._window_samples += samples
            if self.micro % self.accumulation == 0 and time.perf_counter() - self._window_start >= WINDOW_SECONDS:
                self._close_window()
        if self.micro % self.accumulation == 0:
            step = self.micro // self.accumulation
            due = [(what, hook) for every, what, hook in self.step_hooks if step % every == 0]
            for what, hook in due:
                with self.untimed(what):
                    hook(step)

    def end_run(self) -> None:
        """The loop ended (or failed): the open window closes, the device's queued work is done."""
        if self._window_start is not None:
            self._close_window(report=False)
        synchronize(self.device)
        self.ended = self._pass_ended = time.perf_counter()
        self._untimed_at_end = sum(self.untimed_seconds.values())

    def count_between_epochs(self) -> None:
        """``ctx.epochs``' next pass starts: the script's own work since the last pass ended (its validation,
        checkpoint, epoch schedule), outside every window, counts as "between epochs", less what it already
        counted under a name of its own (``ctx.untimed``)."""
        if self._pass_ended is None:
            return
        named = sum(self.untimed_seconds.values()) - self._untimed_at_end
        seconds = max(0.0, time.perf_counter() - self._pass_ended - named)
        self.untimed_seconds["between epochs"] = self.untimed_seconds.get("between epochs", 0.0) + seconds
        self.hook_seconds += seconds
        self._pass_ended = None

    @contextlib.contextmanager
    def untimed(self, what: str) -> Iterator[None]:
        """Run the block outside the timed windows: the open window closes first (after the device finished
        the training work queued before it), the block's seconds count under ``what``, and the next window
        opens at the next optimizer step. Nested blocks count in the outer one."""
        if self._paused:
            yield
            return
        if self._window_start is not None:
            self._close_window(report=False)
        self._paused = True
        block = BlockSeconds(self.device)
        try:
            with block:
                yield
        finally:
            self._paused = False
            self.untimed_seconds[what] = self.untimed_seconds.get(what, 0.0) + block.seconds
            self.hook_seconds += block.seconds

    def _end_epoch(self, ctx: Any) -> None:
        """An epoch ended: close the window, run the script's hooks untimed, report progress."""
        if self._window_start is not None:
            self._close_window(report=False)
        self.epoch += 1
        if self.hooks:
            with self.untimed("end-of-epoch hooks"):
                for hook in self.hooks:
                    hook(self.epoch - 1)
        for save in self.saves:
            save(self.epoch - 1)
        self._report()

    def _calls(self, ctx: Any) -> int:
        steps = ctx._train_steps
        return steps[-1].calls if steps else 0

    def _add_step_loss(self, ctx: Any, calls_before: int) -> None:
        steps = ctx._train_steps
        if not steps or steps[-1].calls == calls_before or steps[-1].last_loss is None:
            return  # the loop did not step through ctx.train_step (ctx.record_loss records its loss)
        self._add(steps[-1].last_loss, self.micro // self.accumulation, weight=1)

    def record_loss(self, value: torch.Tensor) -> None:
        """A hand-written loop's loss of its current optimizer step (``ctx.record_loss`` inside the loop: the
        batch just yielded is not counted yet)."""
        step = min(self.micro, max(0, (self.total_micro or 1) - 1)) // self.accumulation
        self._add(value.to(self.device), step, weight=self.accumulation)

    def _add(self, loss: torch.Tensor, step: int, *, weight: int) -> None:
        if self._sums is None:
            return
        index = min(step // self.loss_every, len(self._counts) - 1)
        self._sums[index] += loss.detach().float().reshape(()) * weight  # stays on the device: no sync
        self._counts[index] += weight

    def _open_window(self) -> None:
        synchronize(self.device)
        reading = self.energy() if self.energy is not None else None
        if self.warmup_samples is None:
            self.warmup_samples = self.samples
            self.warmup_joules = reading
        self._window_energy = reading
        self._window_start = time.perf_counter()
        self._window_micro = self._window_samples = 0
        self._window_wait = 0.0
        self._window_first_bin = min((self.micro // self.accumulation) // self.loss_every, len(self._counts) - 1)

    def _close_window(self, *, report: bool = True) -> None:
        synchronize(self.device)
        assert self._window_start is not None
        seconds = time.perf_counter() - self._window_start
        self._window_start = None
        reading = self.energy() if self.energy is not None and self._window_energy is not None else None
        if self._window_micro > 0 and seconds > 0:
            self.windows.append(Window(seconds, self._window_micro, self._window_samples, self._window_wait))
            if reading is not None and self._window_energy is not None:
                self.window_joules = (self.window_joules or 0.0) + max(0.0, reading - self._window_energy)
        last = min(max(0, (self.micro - 1) // self.accumulation) // self.loss_every, len(self._counts) - 1)
        if self._sums is not None and self._counts and self._counts[last]:
            self._last_loss = float(self._sums[last]) / self._counts[last]  # synchronised already
            if not math.isfinite(self._last_loss) and self.config.precision != "fp16":
                raise NonFiniteLoss(f"training loss is {self._last_loss} at optimizer step "
                                    f"{self.micro // self.accumulation}")
        if report:
            self._report()

    # -- what it measured ----------------------------------------------------------------------
    def add_metric(self, value: float) -> None:
        self.metrics.append({"epoch": self.epoch, "step": self.micro // self.accumulation, "value": value})

    @property
    def best_metric(self) -> Optional[float]:
        values = [m["value"] for m in self.metrics]
        if not values:
            return None
        return max(values) if self.metric_direction == "maximize" else min(values)

    def losses(self) -> list[float]:
        """The training loss curve: the mean loss of each bin of ``loss_every`` optimizer steps that trained."""
        if self._sums is None:
            return []
        sums = self._sums.cpu().tolist()
        return [s / c for s, c in zip(sums, self._counts) if c > 0]

    @property
    def timed_seconds(self) -> float:
        return sum(w.seconds for w in self.windows)

    @property
    def timed_samples(self) -> int:
        return sum(w.samples for w in self.windows)

    @property
    def throughput(self) -> Optional[float]:
        """Samples/s over every timed window together: the training steps' rate, warm-up and hooks apart."""
        return self.timed_samples / self.timed_seconds if self.timed_seconds > 0 else None

    def window_rates(self) -> list[float]:
        return [w.throughput for w in self.windows]

    def spread(self) -> Optional[tuple[float, float]]:
        """The 10th and 90th percentiles of the windows' rates (the extremes with fewer than 10 windows)."""
        rates = sorted(self.window_rates())
        if not rates:
            return None
        if len(rates) < 10:
            return rates[0], rates[-1]
        deciles = statistics.quantiles(rates, n=10)
        return deciles[0], deciles[-1]

    @property
    def seconds(self) -> float:
        if self.started is None:
            return 0.0
        return (self.ended or time.perf_counter()) - self.started

    def status(self) -> RunStatus:
        total = self.total_micro // self.accumulation if self.total_micro is not None else None
        rate = self.windows[-1].throughput if self.windows else None
        left = None
        if self.total_micro is not None and self.windows:
            recent = self.windows[-5:]
            micro_per_second = sum(w.steps for w in recent) / sum(w.seconds for w in recent)
            left = (self.total_micro - self.micro) / micro_per_second
            if self.epoch and self.hook_seconds and self.epoch_micro:
                left += self.hook_seconds / self.epoch * (self.total_micro - self.micro) / self.epoch_micro
        return RunStatus(step=self.micro // self.accumulation, total_steps=total, epoch=self.epoch,
                         samples=self.samples, seconds=self.seconds, rate=rate, loss=self._last_loss,
                         best_metric=self.best_metric, seconds_left=left)

    def _report(self) -> None:
        if self.on_progress is not None:
            self.on_progress(self.status())


class RunClock:
    """A real run's clock for a loop that a trainer drives (``ctx.step_clock()`` under ``autotune train``).

    The same calls as a study's ``StepClock``, from the adapters' ``StepMeter``: ``begin()`` before a
    micro-batch fetches its batch, ``fetched()`` once it has it, ``end(samples)`` after its work was queued.
    They drive the run's warm-up, timed windows and every-N-steps hooks as ``ctx.batches`` does. The trainer
    counts epochs itself: ``epoch_length(n)`` tells a run of epochs how many micro-batches one has, and
    ``epoch_ends()`` closes the window there (a trainer's end-of-epoch evaluation and checkpoints are not
    training). ``untimed(what)`` keeps a trainer's evaluation or saving out of the windows.

    Args:
        run: The real run.
    """

    def __init__(self, run: RealRun) -> None:
        self.run = run
        self._fetch = 0.0
        self.steps  # noqa: B018 - plans the run now where its length is known (not a run of epochs)
        run.begin_run()

    @property
    def steps(self) -> Optional[int]:
        """Micro-batches of the whole run; None for a run of epochs until ``epoch_length`` is known."""
        if self.run.total_micro is None and self.run.length.epochs is not None and self.run.epoch_micro is None:
            return None
        return self.run.plan(None)

    @property
    def epochs(self) -> Optional[int]:
        """The run's length in epochs, when it was given so (the trainer then counts them)."""
        return self.run.length.epochs

    def epoch_length(self, micro_batches: int) -> None:
        self.run.plan(micro_batches)

    @property
    def done(self) -> bool:
        """The run's length is trained, or a stop was asked for and an optimizer step just ended."""
        self.steps  # noqa: B018 - plans the run where its length became known
        return self.run.finished

    def begin(self) -> None:
        self._fetch = self.run.before_fetch()

    def fetched(self) -> float:
        self.run.fetched(self._fetch)
        return time.perf_counter() - self._fetch

    def end(self, samples: int) -> None:
        self.run.after_step(samples)

    def epoch_ends(self) -> None:
        run = self.run
        if run._window_start is not None:
            run._close_window(report=False)
        run.epoch += 1
        for save in run.saves:  # what the run measured so far, kept (train.json) as after ctx.batches' epochs
            save(run.epoch - 1)
        run._report()

    def untimed(self, what: str) -> Any:
        return self.run.untimed(what)

    def close(self) -> None:
        self.run.end_run()


def _batch_length(batch: Any) -> int:
    return batch_length(batch)
