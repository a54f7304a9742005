"""Tune a Hugging Face ``transformers.Trainer`` job through its ``TrainingArguments``.

Your script keeps its ``TrainingArguments`` and a function that builds the ``Trainer`` from them; a trial
function hands both to ``run_trainer``::

    from autotune.integrations import transformers as tuned

    def train(ctx):                                   # one trial, in its own process
        tuned.run_trainer(ctx, build_trainer, ARGS)   # build_trainer(args) -> Trainer

    result = tuned.tune(train, args=ARGS, n_trials=20)
    print(tuned.training_arguments(result.best_config, ARGS))   # paste into TrainingArguments(...)

Each trial maps its ``TrialConfig`` onto ``TrainingArguments`` (``training_arguments``): the precision onto
``bf16``/``fp16``/``tf32``, the micro-batch onto ``per_device_train_batch_size`` with
``gradient_accumulation_steps`` keeping the global batch under ``batch_policy: fixed``, compile onto
``torch_compile``/``torch_compile_mode``, the loader knobs onto ``dataloader_*``, activation checkpointing onto
``activation_checkpointing`` (``gradient_checkpointing`` before transformers 5) and the optimizer
implementation onto ``optim``. A ``TrainerCallback`` puts the
Trainer's steps on the trial's clock (``ctx.step_clock``: the warm-up, then timed windows with a device
synchronisation at each end, the input wait inside them), and the loss of each optimizer step is recorded
on the device for the accuracy verdict. The eval metric comes from ``trainer.evaluate()`` after training.
"""

from __future__ import annotations

import dataclasses
import tempfile
from typing import Any, Callable, Mapping, Optional, Union

from autotune._config import ATTENTION_BACKENDS, Result, TrialConfig
from autotune._errors import KnobError, WorkloadError
from autotune.integrations import _common
from autotune.integrations._common import Unsupported
from autotune.search._space import SearchSpace

EXTRA = "transformers"
TRAINER = "transformers.Trainer"
DEFAULT_SPACE = "hf_trainer"
DEFAULT_METRIC = "eval_loss"
PRELOAD = ("transformers.trainer",)  # the Trainer and what it imports (accelerate): seconds per trial otherwise
# The optimizers whose implementation optimizer_impl chooses: optim= names both forms of torch's AdamW.
ADAMW = {"default": "adamw_torch", "fused": "adamw_torch_fused"}

UNSUPPORTED = (
    Unsupported("precision", ("fp8",), "the Trainer builds and compiles the model itself: autotune cannot "
                                       "convert its linear layers to torchao's float8 training"),
    Unsupported("cuda_graphs", (True,), "TrainingArguments has no CUDA Graphs argument: the Trainer runs its own "
                                        "step, which autotune cannot capture"),
    Unsupported("channels_last", (True,), "TrainingArguments has no memory-format argument"),
    Unsupported("attention", tuple(v for v in ATTENTION_BACKENDS if v != "auto"),
                "the attention kernel is the model's attn_implementation, chosen where the model is built"),
    Unsupported("optimizer_impl", ("foreach",), "optim= names no foreach AdamW (adamw_torch leaves torch's choice, "
                                                "adamw_torch_fused is the fused one)"),
    Unsupported("compile_scope", ("regions",), "the Trainer compiles the model whole (torch_compile): autotune "
                                               "cannot compile its blocks one by one"),
    Unsupported("loader", ("dali",), "the Trainer builds its own torch DataLoader"),
    Unsupported("loader", ("device",), "the Trainer builds its own torch DataLoader: its batches cannot be served from data kept on the device"),
)
# What every trial sets besides the config: the budget's length, and nothing the trials would all repeat
# without measuring it (evaluation, checkpoints, logging, reporting to trackers, a progress bar).
_TRIAL_ONLY = {
    "eval_strategy": "no",
    "save_strategy": "no",
    "logging_strategy": "no",
    "report_to": "none",
    "disable_tqdm": True,
    "dataloader_drop_last": True,  # every micro-batch full: each window's samples are exact
    "auto_find_batch_size": False,  # it would change the batch the trial measures
    "load_best_model_at_end": False,
    "push_to_hub": False,
    "eval_on_start": False,
}


def _optim_name(args: Any) -> str:
    optim = getattr(args, "optim", None) if args is not None else None
    return str(getattr(optim, "value", optim)) if optim is not None else ADAMW["fused"]


def _checkpointing_fields(args: Any) -> tuple[str, str]:
    """The names TrainingArguments gives activation checkpointing: ``activation_checkpointing`` from
    transformers 5.x on, whose old ``gradient_checkpointing`` alias a copy of resolved arguments ignores."""
    cls = type(args) if args is not None else None
    if cls is None:
        try:
            from transformers import TrainingArguments as cls
        except ImportError:
            pass
    fields = getattr(cls, "__dataclass_fields__", {})
    if "activation_checkpointing" in fields:
        return "activation_checkpointing", "activation_checkpointing_kwargs"
    return "gradient_checkpointing", "gradient_checkpointing_kwargs"


def training_arguments(config: TrialConfig, args: Any = None, *, cuda: Optional[bool] = None) -> dict[str, Any]:
    """The ``TrainingArguments`` overrides that apply ``config``: paste them into ``TrainingArguments(...)``.

    Args:
        config: A trial's config (``result.best_config``).
        args: Your ``TrainingArguments``, for its ``optim`` (``optimizer_impl`` picks between
            ``adamw_torch`` and ``adamw_torch_fused``; another optimizer is left as it is) and its
            ``torch_compile_backend``.
        cuda: Whether the job trains on CUDA (``tf32`` is a CUDA setting; on a CPU bf16 needs ``use_cpu``);
            ``None``: whether this machine has CUDA.

    The process-wide knobs (``cudnn_benchmark``, ``cpu_threads``, ``memory_fraction``) are no
    ``TrainingArguments``: ``with autotune.applied(config):`` sets them.

    Raises:
        KnobError: ``optimizer_impl`` is not ``default`` and ``args.optim`` is not torch's AdamW.
    """
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    workers = config.num_workers
    out: dict[str, Any] = {
        "bf16": config.precision == "bf16",
        "fp16": config.precision == "fp16",
        "per_device_train_batch_size": config.batch_size,
        "gradient_accumulation_steps": config.accumulation_steps,
        "torch_compile": config.compile != "off",
        "torch_compile_mode": config.compile if config.compile not in ("off", "default") else None,
        "dataloader_num_workers": workers,
        "dataloader_pin_memory": config.pin_memory,
        "dataloader_prefetch_factor": config.prefetch_factor if workers > 0 else None,
        "dataloader_persistent_workers": config.persistent_workers and workers > 0,
    }
    checkpointing, checkpointing_kwargs = _checkpointing_fields(args)
    out[checkpointing] = config.activation_checkpointing
    if cuda:
        out["tf32"] = config.precision != "fp32"  # autotune's TF32 rule: on for every precision but fp32
    else:
        out["use_cpu"] = True
    if config.compile == "off" and getattr(args, "torch_compile_backend", None):
        out["torch_compile_backend"] = None  # a backend alone turns torch_compile back on
    if config.activation_checkpointing:
        out[checkpointing_kwargs] = {"use_reentrant": False}  # as ctx.checkpoint does
    optim = _optim_name(args)
    if optim in ADAMW.values():
        out["optim"] = ADAMW.get(config.optimizer_impl, optim)
    elif config.optimizer_impl != "default":
        raise KnobError(f"optimizer_impl={config.optimizer_impl}: TrainingArguments optim={optim} has no such "
                        f"implementation (only {' and '.join(ADAMW.values())} do)")
    return out


def baseline(args: Any, *, cuda: Optional[bool] = None) -> dict[str, Any]:
    """The knob values your ``TrainingArguments`` train with: the study's untuned baseline.

    Its ``batch_size`` is your global batch (``per_device_train_batch_size x gradient_accumulation_steps``),
    which ``batch_policy: fixed`` then keeps in every trial.
    """
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "tf32" if args.tf32 else "fp32"
    workers = int(args.dataloader_num_workers)
    values: dict[str, Any] = {
        "precision": precision,
        "batch_size": int(args.per_device_train_batch_size) * int(args.gradient_accumulation_steps),
        "compile": (args.torch_compile_mode or "default") if args.torch_compile else "off",
        "num_workers": workers,
        "activation_checkpointing": bool(getattr(args, _checkpointing_fields(args)[0])),
        "optimizer_impl": "fused" if _optim_name(args) == ADAMW["fused"] else "default",
    }
    if cuda:
        values["pin_memory"] = bool(args.dataloader_pin_memory)  # it only matters for copies to a GPU
    if workers > 0:
        values["prefetch_factor"] = int(args.dataloader_prefetch_factor or 2)
        values["persistent_workers"] = bool(args.dataloader_persistent_workers)
    return values


def search_space(name_or_path: Union[str, Any, SearchSpace] = DEFAULT_SPACE, *, args: Any = None) -> SearchSpace:
    """The search space without the knobs the Trainer does not expose, each recorded with its reason in the
    study's ``removed_knobs``. With ``args`` whose ``optim`` is not torch's AdamW, ``optimizer_impl`` goes too."""
    unsupported = list(UNSUPPORTED)
    optim = _optim_name(args)
    if optim not in ADAMW.values():
        unsupported.append(Unsupported("optimizer_impl", ("foreach", "fused"),
                                       f"optim={optim} is not torch's AdamW, whose implementation the knob picks"))
    return _common.resolve_space(name_or_path, unsupported, trainer=TRAINER)


def tune(train_fn: Union[Callable[..., Any], str], *, args: Any = None,
         space: Union[str, Any, SearchSpace] = DEFAULT_SPACE, metric_direction: str = "minimize",
         **options: Any) -> Result:
    """Tune a trial function that calls ``run_trainer``: ``autotune.run`` with the Trainer's space
    (``search_space()``), the baseline of ``args`` (``baseline()``) and the eval loss minimised.

    Args:
        train_fn: The module-level ``train(ctx)`` that calls ``run_trainer``.
        args: Your ``TrainingArguments``: the untuned baseline (``baseline=`` overrides it).
        space: A built-in space name, a YAML path or a ``SearchSpace``.
        metric_direction: ``"maximize"`` when ``run_trainer``'s ``metric`` is an accuracy-like metric.
        **options: Any ``Tuner`` option (``n_trials``, ``study_name``, ``storage``, ...; the CLI's names, e.g.
            ``study``, ``trials``, are taken too), and ``summary=False`` to print no summary at the end.
    """
    stated = baseline(args) if args is not None else None
    return _common.tune(train_fn, space=search_space(space, args=args), baseline=stated,
                        metric_direction=metric_direction, options=options, preload=PRELOAD)


def run_trainer(ctx: Any, build_trainer: Callable[[Any], Any], args: Any = None, *,
                metric: Optional[str] = DEFAULT_METRIC) -> dict[str, float]:
    """Train your ``Trainer`` as one trial, with the trial's config applied through its arguments.

    Args:
        ctx: The trial's ``TrialContext``.
        build_trainer: Builds your ``Trainer``: called with ``args`` and the config's overrides applied (a
            ``TrainingArguments``), or without ``args`` with the overrides as a dict, to pass on as
            ``TrainingArguments(**yours, **overrides)``.
        args: Your ``TrainingArguments``.
        metric: The key of ``trainer.evaluate()`` reported as the trial's metric (it needs the Trainer's
            ``eval_dataset``); ``None``: no evaluation, the verdict rests on the training loss.

    Returns:
        What ``trainer.evaluate()`` returned (empty without ``metric``).

    Raises:
        MissingExtraError: transformers or accelerate is not installed.
        KnobError: a knob the Trainer cannot take, or a Trainer on several GPUs.
        WorkloadError: the Trainer did not get the overrides, its global batch is not the study's, or the
            metric is missing.
    """
    transformers = _common.require("transformers", extra=EXTRA, needed_by="autotune.integrations.transformers")
    _common.require("accelerate", extra=EXTRA, needed_by=TRAINER)
    config = ctx.config
    _common.refuse_unsupported(config, UNSUPPORTED, trainer=TRAINER)
    if args is not None and config.batch_policy == "fixed":
        yours = args.per_device_train_batch_size * args.gradient_accumulation_steps
        if yours != config.global_batch_size:
            raise WorkloadError(
                f"TrainingArguments train at a global batch of {yours} (per_device_train_batch_size "
                f"{args.per_device_train_batch_size} x gradient_accumulation_steps "
                f"{args.gradient_accumulation_steps}), "
                f"the study at {config.global_batch_size}: tune with args= (from the shell: --baseline "
                f"batch_size={yours}) so that batch_policy fixed keeps yours"
            )
    overrides = training_arguments(config, args, cuda=ctx.device.type == "cuda")
    meter = _common.StepMeter(ctx)
    with tempfile.TemporaryDirectory(prefix="autotune-trainer-") as output_dir:
        given = {**overrides, "seed": ctx.seed, **_length(meter)}
        if ctx.in_study:  # a trial: its budget's length, nothing it would repeat unmeasured, a throwaway folder
            given.update(_TRIAL_ONLY, output_dir=output_dir)
        trainer = build_trainer(dataclasses.replace(args, **given) if args is not None else dict(given))
        if not isinstance(trainer, transformers.Trainer):
            raise WorkloadError(f"build_trainer returned a {type(trainer).__name__}, not a transformers.Trainer")
        _check_arguments(trainer.args, given)
        if trainer.args.n_gpu > 1:
            raise KnobError(f"the Trainer would train on {trainer.args.n_gpu} GPUs (DataParallel); a trial measures "
                            "one device: make one visible (CUDA_VISIBLE_DEVICES)")
        ctx.record("training_arguments", overrides)
        if args is not None:  # what the script's own arguments train with: the summary compares the study's baseline
            ctx.record("script_baseline", baseline(args, cuda=ctx.device.type == "cuda"))
        saw = _Saw()
        trainer.add_callback(_callback(transformers, meter, saw))
        trainer.training_step = _metered_step(trainer.training_step, meter, saw)
        _common.probe_activation_dtype(trainer.model, ctx)
        # The real run evaluates and saves as the script's arguments say, outside the timed windows.
        untimed = {name: getattr(trainer, name) for name in ("evaluate", "_save_checkpoint") if meter.real_run}
        for name, method in untimed.items():
            setattr(trainer, name, _untimed(method, meter, "evaluation" if name == "evaluate" else "checkpoints"))
        try:
            trainer.train()
        finally:
            meter.close()
            for name in untimed:
                delattr(trainer, name)  # the class's own again: a last evaluation is no training's
        ctx.record("trainer_saw", {
            **_argument_record(trainer.args), **saw.loader, **meter.evidence(), "compiled": saw.compiled,
            "mixed_precision": str(trainer.accelerator.mixed_precision),
            "model_checkpointing": getattr(trainer.model, "is_gradient_checkpointing", None),
        })
        if metric is None:
            return {}
        if trainer.eval_dataset is None:
            raise WorkloadError(f"metric={metric!r} needs eval data: build the Trainer with eval_dataset=, or pass "
                                "metric=None to judge by the training loss alone")
        metrics = trainer.evaluate()
        if metric not in metrics:
            raise WorkloadError(f"trainer.evaluate() returned no {metric!r} (it returned {', '.join(sorted(metrics))})")
        ctx.report_metric(metrics[metric])
        ctx.record("eval_metrics", {k: v for k, v in metrics.items() if isinstance(v, (int, float))})
        return metrics


def _length(meter: _common.StepMeter) -> dict[str, Any]:
    """The Trainer's length: the trial's or the real run's optimizer steps, a real run's epochs (the Trainer
    counts them), or nothing in a context built by hand (the script's own arguments' length)."""
    if meter.optimizer_steps is not None:
        return {"max_steps": meter.optimizer_steps}
    if meter.epochs is not None:
        return {"num_train_epochs": meter.epochs, "max_steps": -1}
    return {}


def _untimed(method: Callable[..., Any], meter: _common.StepMeter, what: str) -> Callable[..., Any]:
    def untimed(*args: Any, **kwargs: Any) -> Any:
        with meter.untimed(what):
            return method(*args, **kwargs)

    return untimed


def _check_arguments(seen: Any, given: Mapping[str, Any]) -> None:
    """Every override reached the Trainer's arguments (a ``build_trainer`` that drops them measures nothing)."""
    lost = [f"{key}={value!r} (it has {getattr(seen, key, None)!r})" for key, value in given.items()
            if key not in ("output_dir", "report_to") and _value(getattr(seen, key, None)) != value]
    if lost:
        raise WorkloadError("the Trainer's TrainingArguments lack the trial's " + "; ".join(lost)
                            + ": build_trainer must build the Trainer with the arguments it is given")


def _value(value: Any) -> Any:
    return getattr(value, "value", value)  # TrainingArguments keeps some choices as str enums


_RECORDED = ("bf16", "fp16", "tf32", "per_device_train_batch_size", "gradient_accumulation_steps", "torch_compile",
             "torch_compile_mode", "dataloader_num_workers", "dataloader_pin_memory", "dataloader_prefetch_factor",
             "dataloader_persistent_workers", "optim", "max_steps")


def _argument_record(args: Any) -> dict[str, Any]:
    record = {key: _value(getattr(args, key, None)) for key in _RECORDED}
    record["activation_checkpointing"] = bool(getattr(args, _checkpointing_fields(args)[0]))
    return record


class _Saw:
    """What the trial saw of the Trainer at work: its DataLoader, the model its steps ran, a step's samples."""

    def __init__(self) -> None:
        self.loader: dict[str, Any] = {}
        self.compiled: Optional[bool] = None
        self.samples = 0


def _metered_step(step: Callable[..., Any], meter: _common.StepMeter, saw: _Saw) -> Callable[..., Any]:
    """``Trainer.training_step`` (the instance's, so a subclass's own is kept), reporting each micro-batch's
    samples and loss; the loss it returns is already divided by the accumulation."""
    import torch

    from autotune.trial._context import batch_length

    def training_step(model: Any, inputs: Any, *rest: Any, **kwargs: Any) -> Any:
        if saw.compiled is None:
            saw.compiled = isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
        saw.samples = batch_length(inputs)
        loss = step(model, inputs, *rest, **kwargs)
        meter.loss(loss)
        return loss

    return training_step


def _callback(transformers: Any, meter: _common.StepMeter, saw: _Saw) -> Any:
    class AutotuneClock(transformers.TrainerCallback):
        """Puts the Trainer's steps on the trial's clock (see ``StepMeter``)."""

        def on_train_begin(self, args: Any, state: Any, control: Any, train_dataloader: Any = None, **_: Any) -> None:
            if train_dataloader is not None:
                meter.epoch_length(_length_of(train_dataloader))
                sampler = getattr(train_dataloader, "batch_sampler", None)
                saw.loader = {
                    "loader_batch_size": getattr(sampler, "batch_size", None) or train_dataloader.batch_size,
                    "loader_num_workers": train_dataloader.num_workers,
                    "loader_pin_memory": train_dataloader.pin_memory,
                    "loader_prefetch_factor": train_dataloader.prefetch_factor,
                    "loader_persistent_workers": train_dataloader.persistent_workers,
                }
            meter.starts()

        def on_step_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            meter.fetched()  # the Trainer fetched this optimizer step's micro-batches before it

        def on_substep_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            meter.micro_step_ends(saw.samples, optimizer_stepped=False, next_batch_ready=True)

        def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            meter.micro_step_ends(saw.samples, optimizer_stepped=True)
            if meter.stop_asked:
                control.should_training_stop = True  # a Ctrl-C: the real run stops at this optimizer step

        def on_epoch_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            meter.epoch_ends()

    return AutotuneClock()


def _length_of(loader: Any) -> Optional[int]:
    try:
        return len(loader)
    except TypeError:  # an iterable dataset: a run of epochs cannot be counted ahead
        return None
