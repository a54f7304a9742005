"""What the trainer adapters share: the lazy import of an extra, the knobs a trainer cannot take (left out
of its space with the reason recorded), and the meter that puts a trainer's steps on the trial's clock."""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from autotune._config import Result, TrialConfig
from autotune._errors import KnobError, MissingExtraError
from autotune.search._space import SearchSpace, load_space
from autotune.study._isolation import preload_in_trial_server
from autotune.study._tuner import Tuner


def require(module: str, *, extra: str, needed_by: str) -> ModuleType:
    """Import an optional library, or say in one line which extra installs it.

    Raises:
        MissingExtraError: ``module`` does not import.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(
            f"{needed_by} needs {module}, which does not import here ({exc}); install the {extra!r} extra: "
            f"pip install 'autotune[{extra}]'"
        ) from None


@dataclass(frozen=True)
class Unsupported:
    """Values of a knob that a trainer cannot take, and why (what the space records as removed).

    Args:
        knob: The ``TrialConfig`` field.
        values: Its values that cannot reach the trainer; the other values can.
        reason: Why, in the words of ``removed_knobs``.
    """

    knob: str
    values: tuple[Any, ...]
    reason: str

    @property
    def key(self) -> str:
        """The ``removed_knobs`` key, ``knob=value,value``."""
        return f"{self.knob}=" + ",".join(_fmt(v) for v in self.values)


def _fmt(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def without_unsupported(space: SearchSpace, unsupported: Sequence[Unsupported], *, trainer: str) -> SearchSpace:
    """``space`` without the values a trainer cannot take, each recorded in ``removed`` with its reason.

    A value the space lists goes as the capability probe's removals do (``SearchSpace.without``); a knob the
    space does not search is recorded all the same, so the study says why it was left out.
    """
    for item in unsupported:
        reason = f"{trainer}: {item.reason}"
        for value in item.values:
            space = space.without(item.knob, value, reason)
        if getattr(space.baseline, item.knob) in item.values:
            default = getattr(TrialConfig(), item.knob)
            space = dataclasses.replace(space, baseline=space.baseline.replace(**{item.knob: default}))
        if not any(key.startswith(f"{item.knob}=") for key in space.removed):
            space = dataclasses.replace(space, removed={**space.removed, item.key: reason})
    return space


def refuse_unsupported(config: TrialConfig, unsupported: Sequence[Unsupported], *, trainer: str) -> None:
    """Refuse a config with a value the trainer cannot take (a space that was not the adapter's).

    Raises:
        KnobError: naming the knob and why.
    """
    for item in unsupported:
        value = getattr(config, item.knob)
        if value in item.values:
            raise KnobError(f"{item.knob}={_fmt(value)}: {trainer}: {item.reason}")


def resolve_space(space: Union[str, Any, SearchSpace], unsupported: Sequence[Unsupported], *,
                  trainer: str) -> SearchSpace:
    """A space (a built-in name, a YAML path or a ``SearchSpace``) without what the trainer cannot take."""
    loaded = space if isinstance(space, SearchSpace) else load_space(space)
    return without_unsupported(loaded, unsupported, trainer=trainer)


def tune(train_fn: Union[Callable[..., Any], str], *, space: SearchSpace, baseline: Optional[Mapping[str, Any]],
         metric_direction: str, options: dict[str, Any], preload: Sequence[str] = ()) -> Result:
    """Run a study of ``train_fn`` with the adapter's space and the user's baseline (options are ``Tuner``'s).

    ``preload``: the trainer library's modules, which the trial server imports once for every trial (they
    import without touching CUDA; importing them costs a trial seconds). ``options["summary"]`` (default
    True) prints the summary ``autotune tune`` prints.
    """
    from autotune.integrations._summary import run_and_summarize

    preload_in_trial_server(*preload)
    summary = options.pop("summary", True)
    if baseline and "baseline" not in options:
        options["baseline"] = dict(baseline)
    options.setdefault("metric_direction", metric_direction)
    return run_and_summarize(Tuner(train_fn, space=space, **options), summary=summary)


class StepMeter:
    """A trainer's micro-batch steps on the trial's ``StepClock`` (under ``autotune train``, the real run's
    ``RunClock``), with the loss of each optimizer step.

    A trainer's callbacks report, in order: ``starts()`` once before the first step fetches its batch,
    ``fetched()`` when a step has its batch, ``loss(value)`` for each micro-batch's loss as the trainer
    returns it (already divided by the accumulation, so a global batch's micro-losses add up to its mean
    loss), and ``micro_step_ends(samples)`` after each micro-batch's work was queued (for the last one of a
    global batch, after the optimizer step). The next step's fetch starts there, so a trainer's start-up
    before ``starts()`` and whatever it does after its last step (evaluation, saving) are never timed.

    In a real run the trainer also evaluates and saves while it trains, as its own arguments say: the
    adapters run that inside ``untimed(what)``, and report the end of each epoch (``epoch_ends()``). A run
    given in epochs leaves the count to the trainer (``optimizer_steps`` None, ``epochs`` the run's), which
    tells the meter an epoch's micro-batches once its DataLoader exists (``epoch_length(n)``).

    Args:
        ctx: The trial's context (``ctx.step_clock()`` times the budget's windows on it).
    """

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.clock = ctx.step_clock()
        self.accumulation = ctx.config.accumulation_steps
        steps = self.clock.steps
        # None: the trainer's own length (a run of epochs, or a context built by hand with neither a study
        # nor autotune train's run).
        self.optimizer_steps: Optional[int] = steps // self.accumulation if steps is not None else None
        self.epochs: Optional[int] = getattr(self.clock, "epochs", None)
        self.real_run = getattr(ctx, "run", None) is not None
        self._closed = False
        self._loss: Any = None
        self._micro = 0
        self._global_samples = 0
        self.micro_batches: set[int] = set()  # samples per micro-batch, as the trainer ran them
        self.global_batches: set[int] = set()  # samples per optimizer step
        self.micro_steps_per_optimizer_step: set[int] = set()

    def starts(self) -> None:
        self.clock.begin()

    def fetched(self) -> None:
        self.clock.fetched()

    def loss(self, value: Any) -> None:
        value = value.detach().float().reshape(())
        self._loss = value if self._loss is None else self._loss + value

    def micro_step_ends(self, samples: int, *, optimizer_stepped: bool, next_batch_ready: bool = False) -> None:
        """One micro-batch is done; ``optimizer_stepped`` when the optimizer stepped after it (as the trainer
        says), ``next_batch_ready`` when the trainer had already fetched the next micro-batch."""
        self._micro += 1
        self._global_samples += samples
        self.micro_batches.add(samples)
        if optimizer_stepped:
            if self._loss is not None:
                self.ctx.record_loss(self._loss)  # on the device: no synchronisation
            self.global_batches.add(self._global_samples)
            self.micro_steps_per_optimizer_step.add(self._micro)
            self._loss, self._micro, self._global_samples = None, 0, 0
        self.clock.end(samples)
        if not self.clock.done:
            self.clock.begin()
            if next_batch_ready:
                self.clock.fetched()

    def epoch_length(self, micro_batches: Optional[int]) -> None:
        """A run of epochs: the micro-batches of one epoch of the trainer's DataLoader."""
        if micro_batches and hasattr(self.clock, "epoch_length"):
            self.clock.epoch_length(int(micro_batches))

    def epoch_ends(self) -> None:
        """The trainer ended an epoch: its end-of-epoch work (evaluation, checkpoints) is not training."""
        if hasattr(self.clock, "epoch_ends") and not self._closed:
            self.clock.epoch_ends()

    def untimed(self, what: str) -> Any:
        """A context that keeps the trainer's own work (``evaluation``, ``checkpoints``) out of the windows and
        reports its seconds beside the throughput; nothing once the training ended (a last evaluation after it
        is outside every window anyway) and nothing in a study's trial, which never evaluates while it trains."""
        import contextlib

        if self._closed or not hasattr(self.clock, "untimed"):
            return contextlib.nullcontext()
        return self.clock.untimed(what)

    @property
    def stop_asked(self) -> bool:
        """A Ctrl-C asked the real run to stop: the trainer stops at this optimizer step."""
        run = getattr(self.ctx, "run", None)
        return run is not None and run.interrupted

    def close(self) -> None:
        self._closed = True
        self.clock.close()

    def evidence(self) -> dict[str, Any]:
        """What the meter saw of the batches, for the trial's record."""
        return {
            "micro_batch": sorted(self.micro_batches),
            "micro_steps_per_optimizer_step": sorted(self.micro_steps_per_optimizer_step),
            "samples_per_optimizer_step": sorted(self.global_batches),
        }


def probe_activation_dtype(model: Any, ctx: Any) -> None:
    """Record the dtype that the model's first Linear or convolution computes in, in its first training
    forward pass (``activation_dtype``): what the trainer's autocast really did.

    Not under torch.compile: removing the hook afterwards would make the compiled model recompile.
    """
    import torch

    if ctx.config.compile != "off":
        return
    layers = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
    layer = next((m for m in model.modules() if isinstance(m, layers)), None)
    if layer is None:
        return

    def hook(module: Any, inputs: Any, output: Any) -> None:
        if module.training and torch.is_grad_enabled() and isinstance(output, torch.Tensor):
            ctx.record("activation_dtype", str(output.dtype).removeprefix("torch."))
            handle.remove()

    handle = layer.register_forward_hook(hook)

