"""Tune a Lightning ``Trainer`` job: a ``LightningModule``, its ``LightningDataModule`` and the Trainer's arguments.

Your script keeps its module, its DataModule and the keyword arguments it gives ``Trainer(...)``; a trial
function hands them to ``run_trainer``::

    from autotune.integrations import lightning as tuned

    def train(ctx):                                   # one trial, in its own process
        tuned.run_trainer(ctx, CNN(), Images(), trainer=TRAINER, metric="val_acc")

    result = tuned.tune(train, trainer=TRAINER, loader=Images().train_dataloader(), n_trials=20)
    print(tuned.trainer_arguments(result.best_config).code())   # what to paste

Each trial maps its ``TrialConfig`` onto Lightning (``trainer_arguments``): the precision onto
``precision="bf16-mixed"`` and the like, the accumulation that keeps the global batch (``batch_policy:
fixed``) onto ``accumulate_grad_batches``, cuDNN benchmarking onto ``benchmark``; the micro-batch and the
loader knobs onto the DataModule's training DataLoader (rebuilt from yours with them, in a sample order
fixed by the trial's seed); compile and channels_last onto the module (``torch.compile``, the memory
format). A ``Callback`` puts the Trainer's steps on the trial's clock (``ctx.step_clock``) and records the
loss of each optimizer step; the metric comes from ``trainer.validate()`` after training.
"""

from __future__ import annotations

import tempfile
from typing import Any, Callable, Mapping, Optional, Union

from autotune._config import ATTENTION_BACKENDS, Result, TrialConfig
from autotune._errors import WorkloadError
from autotune.integrations import _common
from autotune.integrations._common import Unsupported
from autotune.integrations._paste import LightningArguments, _kwargs  # noqa: F401 (re-exported)
from autotune.search._space import SearchSpace

EXTRA = "lightning"
TRAINER = "lightning.Trainer"
DEFAULT_SPACE = "lightning"
PRELOAD = ("lightning.pytorch",)  # Lightning and torchmetrics: seconds per trial otherwise
PRECISIONS = {"fp32": "32-true", "tf32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}
# Lightning's precision values, as a Trainer takes them, by autotune precision (TF32 is a matmul setting).
_PRECISION_OF = {"32": "fp32", "32-true": "fp32", "bf16-mixed": "bf16", "bf16": "bf16", "16-mixed": "fp16",
                 "16": "fp16"}

UNSUPPORTED = (
    Unsupported("precision", ("fp8",), "the LightningModule builds and compiles its model itself: autotune "
                                       "cannot convert its linear layers to torchao's float8 training"),
    Unsupported("cuda_graphs", (True,), "the Trainer has no CUDA Graphs argument: it runs its own step, which "
                                        "autotune cannot capture"),
    Unsupported("attention", tuple(v for v in ATTENTION_BACKENDS if v != "auto"),
                "the attention kernel is the LightningModule's own code"),
    Unsupported("optimizer_impl", ("foreach", "fused"), "the optimizer is built by the LightningModule's "
                                                        "configure_optimizers"),
    Unsupported("activation_checkpointing", (True,), "checkpointing is the LightningModule's own code"),
    Unsupported("compile_scope", ("regions",), "run_trainer compiles the LightningModule whole, as the Trainer "
                                               "calls it"),
    Unsupported("loader", ("dali",), "the DataModule builds a torch DataLoader"),
    Unsupported("loader", ("device",), "the DataModule builds a torch DataLoader: its batches cannot be served from data kept on the device"),
)
# What every trial sets besides the config: the budget's length on one device, and nothing the trials
# would all repeat without measuring it (validation, checkpoints, loggers, progress bars).
_TRIAL_ONLY = {
    "max_epochs": -1,
    "min_epochs": None,
    "min_steps": None,
    "max_time": None,
    "limit_val_batches": 0.0,
    "num_sanity_val_steps": 0,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "devices": 1,
}
# The callbacks a trial leaves out: they need validation, a logger or checkpoints, which a trial does not run.
_LEFT_OUT = ("Checkpoint", "EarlyStopping", "LearningRateMonitor", "ProgressBar", "ModelSummary")


def trainer_arguments(config: TrialConfig, *, cuda: Optional[bool] = None) -> LightningArguments:
    """The Lightning arguments that apply ``config`` (``result.best_config``).

    Args:
        cuda: Whether the job trains on CUDA (TF32 is a CUDA setting); ``None``: whether this machine has it.

    The process-wide knobs (``cpu_threads``, ``memory_fraction``) are no Lightning arguments:
    ``with autotune.applied(config):`` sets them.
    """
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    workers = config.num_workers
    loader: dict[str, Any] = {"batch_size": config.batch_size, "num_workers": workers,
                              "pin_memory": config.pin_memory}
    if workers > 0:
        loader.update(prefetch_factor=config.prefetch_factor, persistent_workers=config.persistent_workers)
    return LightningArguments(
        trainer={"precision": PRECISIONS[config.precision], "accumulate_grad_batches": config.accumulation_steps,
                 "benchmark": config.cudnn_benchmark},
        dataloader=loader,
        compile=None if config.compile == "off" else config.compile,
        channels_last=config.channels_last,
        # autotune's TF32 rule: on for every precision but fp32
        float32_matmul_precision=("highest" if config.precision == "fp32" else "high") if cuda else None,
    )


def baseline(trainer: Optional[Mapping[str, Any]] = None, loader: Any = None, *,
             cuda: Optional[bool] = None) -> dict[str, Any]:
    """The knob values your Trainer arguments and training DataLoader train with: the study's untuned baseline.

    Its ``batch_size`` is your global batch (the loader's batch size x ``accumulate_grad_batches``), which
    ``batch_policy: fixed`` then keeps in every trial.

    Raises:
        WorkloadError: a precision autotune has no knob value for.
    """
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    trainer = dict(trainer or {})
    raw = str(trainer.get("precision", "32-true"))
    if raw not in _PRECISION_OF:
        raise WorkloadError(f"Trainer precision={raw!r} has no autotune precision (known: {', '.join(_PRECISION_OF)})")
    values: dict[str, Any] = {"precision": _PRECISION_OF[raw], "cudnn_benchmark": bool(trainer.get("benchmark"))
                              and cuda}
    accumulation = int(trainer.get("accumulate_grad_batches", 1))
    if loader is not None:
        workers = int(loader.num_workers)
        values.update(batch_size=int(loader.batch_size) * accumulation, num_workers=workers)
        if cuda:
            values["pin_memory"] = bool(loader.pin_memory)
        if workers > 0:
            values.update(prefetch_factor=int(loader.prefetch_factor or 2),
                          persistent_workers=bool(loader.persistent_workers))
    return values


def search_space(name_or_path: Union[str, Any, SearchSpace] = DEFAULT_SPACE) -> SearchSpace:
    """The search space without the knobs a Lightning Trainer job does not expose, each recorded with its
    reason in the study's ``removed_knobs``."""
    return _common.resolve_space(name_or_path, UNSUPPORTED, trainer=TRAINER)


def tune(train_fn: Union[Callable[..., Any], str], *, trainer: Optional[Mapping[str, Any]] = None,
         loader: Any = None, space: Union[str, Any, SearchSpace] = DEFAULT_SPACE,
         metric_direction: str = "maximize", **options: Any) -> Result:
    """Tune a trial function that calls ``run_trainer``: ``autotune.run`` with the Lightning space
    (``search_space()``) and the baseline of your Trainer arguments and training DataLoader (``baseline()``).

    Args:
        train_fn: The module-level ``train(ctx)`` that calls ``run_trainer``.
        trainer: Your ``Trainer`` keyword arguments.
        loader: Your training DataLoader (e.g. ``datamodule.train_dataloader()``), for the batch and loader
            knobs of the baseline.
        space: A built-in space name, a YAML path or a ``SearchSpace``.
        metric_direction: ``"minimize"`` when ``run_trainer``'s ``metric`` is a loss.
        **options: Any ``Tuner`` option (``n_trials``, ``study_name``, ``storage``, ...; the CLI's names, e.g.
            ``study``, ``trials``, are taken too), and ``summary=False`` to print no summary at the end.
    """
    stated = baseline(trainer, loader) if trainer is not None or loader is not None else None
    return _common.tune(train_fn, space=search_space(space), baseline=stated, metric_direction=metric_direction,
                        options=options, preload=PRELOAD)


def run_trainer(ctx: Any, model: Any, datamodule: Any = None, *, trainer: Optional[Mapping[str, Any]] = None,
                metric: Optional[str] = None) -> dict[str, float]:
    """Fit your module as one trial, with the trial's config applied to the Trainer, the loader and the module.

    Args:
        ctx: The trial's ``TrialContext``.
        model: Your ``LightningModule`` (built in the trial: each trial starts from the same weights at a seed).
        datamodule: Your ``LightningDataModule``; ``None``: the module's own ``train_dataloader``.
        trainer: Your ``Trainer`` keyword arguments (the trial's override the knobs and the length).
        metric: A metric your validation logs (``self.log("val_acc", ...)``), reported as the trial's metric
            from ``trainer.validate()`` after training; ``None``: no validation, the verdict rests on the
            training loss.

    Returns:
        The metrics ``trainer.validate()`` returned (empty without ``metric``).

    Raises:
        MissingExtraError: lightning is not installed.
        KnobError: a knob a Lightning job cannot take here.
        WorkloadError: the loader's global batch is not the study's, a custom batch sampler, or the metric
            is missing.
    """
    import torch

    lightning = _common.require("lightning.pytorch", extra=EXTRA, needed_by="autotune.integrations.lightning")
    config = ctx.config
    _common.refuse_unsupported(config, UNSUPPORTED, trainer=TRAINER)
    arguments = trainer_arguments(config, cuda=ctx.device.type == "cuda")
    yours = dict(trainer or {})
    meter = _common.StepMeter(ctx)
    saw: dict[str, Any] = {}
    source = datamodule if datamodule is not None else model
    source.train_dataloader = _trial_loader(source.train_dataloader, ctx, yours, saw)
    ctx.extras.setdefault("activations_4d", _has_4d_activations(model))
    if config.channels_last:
        model = model.to(memory_format=torch.channels_last)
    _common.probe_activation_dtype(model, ctx)
    fitted = model if config.compile == "off" else torch.compile(
        model, mode=None if config.compile == "default" else config.compile)
    # A trial leaves out what it would repeat unmeasured; the real run keeps every callback of the script.
    kept = [cb for cb in _as_list(yours.get("callbacks"))
            if not ctx.in_study or not any(base.__name__ in _LEFT_OUT for base in type(cb).__mro__)]
    left_out = sorted(type(cb).__name__ for cb in _as_list(yours.get("callbacks")) if cb not in kept)
    with tempfile.TemporaryDirectory(prefix="autotune-trainer-") as root:
        kwargs = {**yours, **arguments.trainer, **_length(meter),
                  "accelerator": "gpu" if ctx.device.type == "cuda" else "cpu", "devices": 1,
                  "callbacks": [*kept, _callback(lightning, meter)]}
        if ctx.in_study:  # a trial: its budget's length, no validation, checkpoints nor loggers, a throwaway folder
            kwargs.update({**_TRIAL_ONLY, "max_steps": meter.optimizer_steps, "default_root_dir": root})
        run = lightning.Trainer(**kwargs)
        ctx.record("lightning_arguments", arguments.to_dict())
        try:
            run.fit(fitted, datamodule=datamodule)
        finally:
            meter.close()
        ctx.record("trainer_saw", {
            "precision": str(run.precision), "accumulate_grad_batches": run.accumulate_grad_batches,
            "max_steps": run.max_steps, "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "compiled": getattr(model, "_compiler_ctx", None) is not None,
            "channels_last": _weights_channels_last(model), "callbacks_left_out": left_out,
            **saw, **meter.evidence(),
        })
        if metric is None:
            return {}
        if ctx.in_study:
            run.limit_val_batches = yours.get("limit_val_batches", 1.0)  # the trial's fit ran none
        results = run.validate(model, datamodule=datamodule, verbose=False)
        metrics = {k: float(v) for result in results for k, v in result.items()}
        if metric not in metrics:
            logged = ", ".join(sorted(metrics)) or "nothing"
            raise WorkloadError(f"trainer.validate() logged no {metric!r} (it logged {logged}): log it in "
                                "validation_step with self.log")
        ctx.report_metric(metrics[metric])
        ctx.record("eval_metrics", metrics)
        return metrics


def _length(meter: _common.StepMeter) -> dict[str, Any]:
    """The Trainer's length in a real run: its optimizer steps, or its epochs (the Trainer counts them); in
    a context built by hand, the script's own arguments' length."""
    if meter.optimizer_steps is not None:
        return {"max_steps": meter.optimizer_steps, "max_epochs": -1}
    if meter.epochs is not None:
        return {"max_epochs": meter.epochs, "max_steps": -1}
    return {}


def _as_list(callbacks: Any) -> list[Any]:
    if callbacks is None:
        return []
    return list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]


def _has_4d_activations(model: Any) -> bool:
    from autotune.trial._context import has_4d_activations

    return has_4d_activations(model)


def _weights_channels_last(model: Any) -> Optional[bool]:
    """Whether the first 4-D weight is in channels_last (None: the model has none)."""
    import torch

    weight = next((p for p in model.parameters() if p.dim() == 4), None)
    return None if weight is None else weight.is_contiguous(memory_format=torch.channels_last)


def _trial_loader(make: Callable[[], Any], ctx: Any, yours: Mapping[str, Any],
                  saw: dict[str, Any]) -> Callable[[], Any]:
    """The DataModule's ``train_dataloader``, its DataLoader rebuilt by ``ctx.loader`` with the trial's batch
    size and loader knobs: same dataset, collate and worker functions; a shuffled loader in the order of
    ``ctx.seed`` (the same samples at every batch size), a sequential one in order, another sampler kept."""
    import torch

    def train_dataloader() -> Any:
        loader = make()
        if not isinstance(loader, torch.utils.data.DataLoader):
            raise WorkloadError(f"train_dataloader returned a {type(loader).__name__}; a trial sets the batch size "
                                "and loader knobs on a torch DataLoader")
        config = ctx.config
        batch_size = loader.batch_size
        if batch_size is None:
            raise WorkloadError("the training DataLoader has a custom batch_sampler: a trial cannot set its batch size")
        accumulation = int(yours.get("accumulate_grad_batches", 1))
        if config.batch_policy == "fixed" and batch_size * accumulation != config.global_batch_size:
            raise WorkloadError(
                f"the training DataLoader (batch_size {batch_size}) and accumulate_grad_batches {accumulation} train "
                f"at a global batch of {batch_size * accumulation}, the study at {config.global_batch_size}: tune with "
                f"loader= and trainer= (from the shell: --baseline batch_size={batch_size * accumulation}) so that "
                "batch_policy fixed keeps yours"
            )
        options: dict[str, Any] = {"collate_fn": loader.collate_fn, "worker_init_fn": loader.worker_init_fn}
        iterable = isinstance(loader.dataset, torch.utils.data.IterableDataset)
        sampler = loader.sampler
        shuffle = isinstance(sampler, torch.utils.data.RandomSampler)
        plain = (torch.utils.data.RandomSampler, torch.utils.data.SequentialSampler)
        if not iterable and not isinstance(sampler, plain):
            options["sampler"] = sampler  # the user's own order (weighted, grouped): kept as it is
        rebuilt = ctx.loader(loader.dataset, shuffle=shuffle and not iterable, **options)
        saw.update(loader_batch_size=rebuilt.batch_size, loader_num_workers=rebuilt.num_workers,
                   loader_pin_memory=rebuilt.pin_memory, loader_prefetch_factor=rebuilt.prefetch_factor,
                   loader_persistent_workers=rebuilt.persistent_workers)
        return rebuilt

    return train_dataloader


def _callback(lightning: Any, meter: _common.StepMeter) -> Any:
    class AutotuneClock(lightning.Callback):
        """Puts the Trainer's steps on the trial's clock (see ``StepMeter``)."""

        optimizer_steps: Optional[int] = None
        evaluating: Any = None

        def on_train_start(self, trainer: Any, module: Any) -> None:
            meter.epoch_length(trainer.num_training_batches)  # a run of epochs: an epoch's micro-batches

        def on_validation_start(self, trainer: Any, module: Any) -> None:
            if getattr(trainer.state, "fn", None) == "fit":  # the real run validates inside fit, as the script's
                # arguments say (TrainerFn is a str enum)
                self.evaluating = meter.untimed("evaluation")
                self.evaluating.__enter__()

        def on_validation_end(self, trainer: Any, module: Any) -> None:
            if self.evaluating is not None:
                evaluating, self.evaluating = self.evaluating, None
                evaluating.__exit__(None, None, None)

        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            meter.epoch_ends()

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            if self.optimizer_steps is None:
                # The clock starts at the first batch: the module's and the other callbacks' on_train_start
                # and on_train_epoch_start (which Lightning calls after this callback's) are start-up.
                self.optimizer_steps = trainer.global_step
                meter.starts()
            meter.fetched()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            from autotune.trial._context import batch_length

            loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
            if loss is not None and hasattr(loss, "detach"):
                meter.loss(loss)  # Lightning divides it by accumulate_grad_batches, as it backpropagates it
            # The optimizer stepped when the global step moved (also at an epoch's end with fewer micro-batches).
            stepped = trainer.global_step > (self.optimizer_steps or 0)
            self.optimizer_steps = trainer.global_step
            meter.micro_step_ends(batch_length(batch), optimizer_stepped=stepped)
            if stepped and meter.stop_asked:
                trainer.should_stop = True  # a Ctrl-C: the real run stops at this optimizer step

    return AutotuneClock()
