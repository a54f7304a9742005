"""Applying knobs: global backend flags (put back afterwards), autocast, the capturable train step."""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import time
from typing import Any, Callable, Iterator, Mapping, Optional

import torch

from autotune._config import ALLOC_CONF_ENV, EXPANDABLE_SEGMENTS, TrialConfig, alloc_conf_with
from autotune._errors import KnobError, WorkloadError
from autotune.hardware._machine import SDPA_BACKENDS
from autotune.trial import _float8, _regions
from autotune.trial._distributed import find_ddp

# fp8 computes in bf16 outside its converted linear layers (and inside them, what float8 does not cover).
AUTOCAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.bfloat16}
GRAPH_WARMUP_STEPS = 3  # eager steps on a side stream before capture, as torch's docs prescribe


def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@contextlib.contextmanager
def applied(config: TrialConfig, device: Optional[torch.device] = None) -> Iterator[None]:
    """Set the process-wide flags a config asks for, and put every one of them back on exit.

    TF32 is on for every precision but ``fp32``, which means true fp32 (the accuracy reference). A
    ``memory_fraction`` below 1 caps this process's CUDA allocator
    (``torch.cuda.set_per_process_memory_fraction``): inside each of ``processes_per_gpu`` co-located
    processes it gives the copy its share of the device (1/N unless the space set the fraction).

    The input pipeline is not a flag: build it with ``TrialContext(config=config).loader(dataset)``, which
    applies the loader knobs. For ``loader=device`` that copies the whole dataset to the device once and
    indexes each batch there (no DataLoader workers); ``config.input_pipeline`` says it in words.

    ``allocator=expandable`` gives the CUDA caching allocator expandable segments: it sets
    ``PYTORCH_CUDA_ALLOC_CONF`` (``expandable_segments:True``, beside the entries already there) when CUDA
    has not initialised yet, and also tells an allocator that has (or whose torch read the variable at
    import) where torch lets it; the allocator keeps the setting for the rest of the process, the variable
    is put back. ``precision=fp8`` needs torchao (checked here, so it fails before training
    starts); the model's conversion is ``TrialContext.model``'s, or in your own code
    ``torchao.float8.convert_to_float8_training(model, module_filter_fn=autotune.float8_filter)`` before
    ``torch.compile``, as ``config.float8_training`` says.

    Raises:
        KnobError: ``memory_fraction`` < 1 or ``allocator=expandable`` without a CUDA device.
        MissingExtraError: ``precision=fp8`` without torchao.
    """
    device = device or pick_device()
    saved = {
        "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "threads": torch.get_num_threads(),
    }
    fraction_set = False
    saved_conf = os.environ.get(ALLOC_CONF_ENV)
    if config.precision == "fp8":
        _float8.require_torchao()
    try:
        if config.allocator == "expandable":
            _expand_segments(device)
        tf32 = config.precision != "fp32"
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        torch.backends.cudnn.benchmark = config.cudnn_benchmark
        if config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)
        if config.memory_fraction < 1.0 and not (device.type != "cuda" and config.processes_per_gpu > 1):
            # Co-located copies on the CPU (processes_per_gpu) keep their 1/N share as a record: no allocator cap.
            if device.type != "cuda":
                raise KnobError("memory_fraction < 1 needs a CUDA device")
            torch.cuda.set_per_process_memory_fraction(config.memory_fraction, _index(device))
            fraction_set = True
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved["matmul_tf32"]
        torch.backends.cudnn.allow_tf32 = saved["cudnn_tf32"]
        torch.backends.cudnn.benchmark = saved["cudnn_benchmark"]
        torch.set_num_threads(saved["threads"])
        if fraction_set:
            torch.cuda.set_per_process_memory_fraction(1.0, _index(device))
        if saved_conf is None:
            os.environ.pop(ALLOC_CONF_ENV, None)
        else:
            os.environ[ALLOC_CONF_ENV] = saved_conf


def _expand_segments(device: torch.device) -> None:
    """Expandable segments for this process's CUDA caching allocator (see ``applied``).

    Raises:
        KnobError: the device is not CUDA.
    """
    if device.type != "cuda":
        raise KnobError(f"allocator=expandable needs a CUDA device ({ALLOC_CONF_ENV} configures the CUDA "
                        "caching allocator)")
    os.environ[ALLOC_CONF_ENV] = alloc_conf_with(os.environ.get(ALLOC_CONF_ENV, ""), EXPANDABLE_SEGMENTS)
    # torch may have read the variable at import (a trial process is forked from a server that imported torch):
    # its runtime setter reaches the allocator either way. Private in every release so far; newer releases
    # deprecate torch.cuda.memory's name for torch._C's.
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or \
        getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setter is not None:
        setter(EXPANDABLE_SEGMENTS)
    elif torch.cuda.is_initialized():
        raise KnobError(f"allocator=expandable: CUDA is already initialised and torch {torch.__version__} has no "
                        f"runtime allocator setting; start the process with {ALLOC_CONF_ENV}={EXPANDABLE_SEGMENTS}")


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def autocast(config: TrialConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """The autocast context for a config's precision (a no-op for fp32 and tf32)."""
    dtype = AUTOCAST_DTYPES.get(config.precision)
    if dtype is None:
        return contextlib.nullcontext()
    # A captured graph must not reuse weight casts cached at capture time (torch's CUDA Graphs docs).
    return torch.autocast(device_type=device.type, dtype=dtype, cache_enabled=not config.cuda_graphs)


def attention_kernels(config: TrialConfig) -> contextlib.AbstractContextManager:
    """The SDPA backend the config pins (``torch.nn.attention.sdpa_kernel``); a no-op for auto and explicit."""
    member = SDPA_BACKENDS.get(config.attention)
    if member is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(getattr(SDPBackend, member))


def explicit_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Attention written out as ``softmax(q k^T * scale + mask) v``: what SDPA computes, with the scores
    materialised (``scaled_dot_product_attention``'s arguments and result)."""
    scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    scores = (query @ key.transpose(-2, -1)) * scale
    if is_causal:
        keep = torch.ones(query.size(-2), key.size(-2), dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    weights = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        weights = torch.nn.functional.dropout(weights, p=dropout_p)
    return weights.to(value.dtype) @ value


@contextlib.contextmanager
def forward_context(config: TrialConfig, device: torch.device) -> Iterator[None]:
    """The attention backend and the autocast of a config, for forward passes outside the train step."""
    with attention_kernels(config), autocast(config, device):
        yield


_CHECKPOINTED: dict[type, type] = {}


def checkpointed(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with its forward recomputed in the backward pass (``torch.utils.checkpoint``,
    ``use_reentrant=False``) whenever gradients are on.

    The module's class is swapped for a subclass whose ``forward`` checkpoints the original one, so the
    module keeps its parameters, state_dict keys, hooks and ``isinstance`` checks, and a deepcopy stays
    checkpointed.
    """
    cls = type(module)
    if cls in _CHECKPOINTED.values():
        return module
    sub = _CHECKPOINTED.get(cls)
    if sub is None:
        def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            inner = super(sub, self).forward
            if not torch.is_grad_enabled():
                return inner(*args, **kwargs)
            from torch.utils.checkpoint import checkpoint

            return checkpoint(inner, *args, use_reentrant=False, **kwargs)

        sub = type(f"Checkpointed{cls.__name__}", (cls,), {"forward": forward, "__module__": cls.__module__})
        _CHECKPOINTED[cls] = sub
    module.__class__ = sub
    return module


def prepare_model(model: torch.nn.Module, config: TrialConfig, device: torch.device, *,
                  record: Optional[dict[str, Any]] = None) -> torch.nn.Module:
    """``model`` on the device with the config's float8 conversion, memory format and compile.

    ``compile_scope=regions`` compiles each repeated block (``autotune.trial._regions``) instead of the whole
    model; ``record`` gets the scope that ran (``compile.scope``) and the blocks compiled (``compile.regions``).
    A model without repeated blocks is compiled whole.

    Under ``precision=fp8`` the linear layers that ``autotune.float8_filter`` picks become torchao's
    ``Float8Linear`` before the compile (which fuses their casts); ``record`` gets which ones, and why the
    others were not (``fp8.converted``, ``fp8.skipped``).

    Raises:
        MissingExtraError: ``precision=fp8`` without torchao.
    """
    model = model.to(device)
    if config.precision == "fp8":
        model, decided = _float8.convert(model)
        if record is not None:
            record.update(decided.extras())
    if config.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if config.compile != "off":
        mode = None if config.compile == "default" else config.compile
        groups = _regions.compile_regions(model, mode) if config.compile_scope == "regions" else []
        if record is not None:
            record["compile.scope"] = "regions" if groups else "model"
            if groups:
                record.update(_regions.regions_record(groups))
        if not groups:  # compile_scope=model, or a model without repeated blocks: compile it whole
            model = torch.compile(model, mode=mode)
    return model


def optimizer_options(cls: type, config: TrialConfig, device: torch.device,
                      given: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """Constructor options an optimizer needs for the config: ``optimizer_impl`` (foreach or fused),
    capturable for graphs, fused for fp16 graphs.

    Raises:
        KnobError: ``cls`` takes no option for the configured implementation, ``given`` (the caller's own
            keyword arguments) already chooses one, or foreach is asked for where only fused can run.
    """
    accepted = inspect.signature(cls.__init__).parameters
    options: dict[str, Any] = {}
    graphs = device.type == "cuda" and config.cuda_graphs
    impl = config.optimizer_impl
    if impl != "default":
        if impl not in accepted:
            raise KnobError(f"optimizer_impl={impl}: {cls.__name__} takes no {impl}= option")
        chosen = sorted(k for k in ("foreach", "fused") if (given or {}).get(k))
        if chosen:
            raise KnobError(f"optimizer_impl={impl}: the call already passes {chosen[0]}=True; "
                            "leave the implementation to the knob")
        options[impl] = True
    if graphs:
        if "capturable" in accepted:
            options["capturable"] = True
        if config.precision == "fp16" and "fused" in accepted:
            # A fused optimizer takes the scaler's found_inf on the device, so the step never syncs.
            if impl == "foreach":
                raise KnobError("optimizer_impl=foreach: fp16 with CUDA Graphs needs the fused step (the scaler's "
                                "inf check stays on the device)")
            options["fused"] = True
    return options


def _tensor_lr_in_graph(optimizer: torch.optim.Optimizer, group: Mapping[str, Any]) -> bool:
    """Whether the optimizer's step reads a tensor learning rate on the device (so a graph sees it change)."""
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return bool(group.get("capturable") or group.get("fused"))
    if isinstance(optimizer, torch.optim.SGD):
        return bool(group.get("fused"))
    return False


def graph_safe_lr(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Give every param group a learning rate on the device, which a scheduler fills in place.

    A captured graph keeps the Python numbers it was captured with, so a float LR that a scheduler changes
    would stay at its first value in every replay. A 0-dim device tensor is read by the replayed step, and
    torch's LR schedulers write a tensor LR with ``fill_``, which needs no synchronisation.

    Raises:
        KnobError: the optimizer reads its LR on the host during the step (no tensor LR in a graph).
    """
    for index, group in enumerate(optimizer.param_groups):
        if not _tensor_lr_in_graph(optimizer, group):
            raise KnobError(
                f"cuda_graphs with scheduler=: {type(optimizer).__name__} (param group {index}) reads its learning "
                "rate on the host during the step, so the captured graph would keep the first one; use Adam or "
                "AdamW with capturable=True or fused=True (ctx.optimizer sets capturable under cuda_graphs), SGD "
                "with fused=True, or turn cuda_graphs off"
            )
        lr = group["lr"]
        if not isinstance(lr, torch.Tensor) or lr.device.type != device.type:
            group["lr"] = torch.tensor(float(lr), dtype=torch.float32, device=device)


def _zero_momentum(optimizer: torch.optim.Optimizer) -> None:
    """Start SGD momentum at zero instead of letting the first step create it.

    A fused SGD step that the scaler skips (inf gradients, usual in the first fp16 steps) returns
    before it writes its freshly allocated, uninitialised momentum buffer, and later steps then read
    garbage. With zero dampening, zeros followed by ``buf = m * buf + grad`` equals torch's first-step
    ``buf = grad``, so the result is the same arithmetic.
    """
    if not isinstance(optimizer, torch.optim.SGD):
        return
    for group in optimizer.param_groups:
        if group.get("momentum", 0) and not group.get("dampening", 0):
            for param in group["params"]:
                state = optimizer.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def model_loss(model: torch.nn.Module, loss_fn: Optional[Callable[..., torch.Tensor]],
               args: tuple[Any, ...]) -> torch.Tensor:
    """The forward pass and the loss of one ``TrainStep`` call (see its two call forms)."""
    if len(args) == 2:
        inputs, targets = args
        if loss_fn is not None:
            return loss_fn(model(inputs), targets)
        return own_loss(model(inputs, targets))  # a model that computes its loss from the targets (nanoGPT's)
    (batch,) = args
    if isinstance(batch, Mapping):
        outputs = model(**batch)
    elif isinstance(batch, (list, tuple)):
        outputs = model(*batch)
    else:
        outputs = model(batch)
    if loss_fn is not None:
        return loss_fn(outputs, batch)
    return own_loss(outputs)


def own_loss(outputs: Any) -> torch.Tensor:
    """The loss a model returned with its outputs: ``outputs["loss"]`` of a mapping (a Hugging Face
    ``ModelOutput`` is one), the one scalar tensor of a tuple or list (nanoGPT's ``(logits, loss)``, a
    Hugging Face model's ``(loss, logits, ...)`` with ``return_dict=False``), else ``outputs.loss``.

    Raises:
        WorkloadError: no loss tensor among them, or a tuple with several scalars (which is the loss is a guess).
    """
    if isinstance(outputs, Mapping):
        loss = outputs.get("loss")
    elif isinstance(outputs, (list, tuple)) and not hasattr(outputs, "loss"):
        scalars = [o for o in outputs if isinstance(o, torch.Tensor) and o.dim() == 0 and o.is_floating_point()]
        if len(scalars) > 1:
            raise WorkloadError(f"the model returned a {type(outputs).__name__} with {len(scalars)} scalar tensors: "
                                "which one is the loss is a guess; pass loss_fn=fn(outputs, targets) to ctx.train_step")
        loss = scalars[0] if scalars else None
    else:
        loss = getattr(outputs, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise WorkloadError(
            f"the model's output ({type(outputs).__name__}) has no loss tensor (outputs.loss, outputs['loss'] or a "
            "scalar in a tuple): pass the targets the model needs (step(inputs, targets) calls model(inputs, "
            "targets), step(batch) model(**batch)), or a loss_fn to ctx.train_step"
        )
    return loss


def _compiled_loss(model: torch.nn.Module, config: TrialConfig, enabled: bool) -> Optional[Callable[..., Any]]:
    """``model_loss`` compiled as one graph over the uncompiled module, for a model that ``ctx.model``
    compiled: the graph then returns the loss alone. Compiling only the module makes every output of its
    forward (an LM's logits beside its loss) a graph output, whose unused gradient is materialised as zeros
    in the backward pass; here those outputs stay inside the graph, and the loss fuses with the last layers.
    None (the module is called as it is) for an uncompiled model, a DDP model, or ``enabled`` false."""
    inner = getattr(model, "_orig_mod", None)
    if not enabled or config.compile == "off" or not isinstance(inner, torch.nn.Module) or find_ddp(model) is not None:
        return None
    mode = None if config.compile == "default" else config.compile
    compiled = torch.compile(model_loss, mode=mode)
    return lambda loss_fn, args: compiled(inner, loss_fn, args)


class TrainStep:
    """One training step (forward, loss, backward, optimizer) with the config's precision applied.

    Two ways to call it:

    - ``step(inputs, targets)``: the loss is ``loss_fn(model(inputs), targets)`` (the image loop); without a
      ``loss_fn`` the model computes its own from the targets: ``model(inputs, targets)`` (``own_loss``).
    - ``step(batch)``: the model is called as ``model(**batch)`` for a dict, ``model(*batch)`` for a tuple
      or list, else ``model(batch)``; the loss is ``loss_fn(outputs, batch)`` when a ``loss_fn`` is given,
      else the model's own (``own_loss``): ``outputs.loss``, ``outputs["loss"]`` or the scalar of a tuple.

    With ``config.accumulation_steps`` > 1 (``batch_policy: fixed`` and a micro-batch smaller than the
    global batch) each call is one micro-batch: its loss is divided by the accumulation count before the
    backward pass, gradients add up over the micro-batches, and the optimizer steps (through the
    GradScaler for fp16) once per global batch, so the gradient is the full batch's (BatchNorm statistics
    aside, which see micro-batches).

    ``clip_grad_norm`` clips the global batch's gradient to that total norm before each optimizer step
    (after the GradScaler's unscale for fp16). It runs on the device, with no synchronisation, so it is
    captured into the graph with the step; ``grad_norm`` holds the norm before clipping as a device tensor.
    ``scheduler`` (an LR scheduler of ``optimizer``) is stepped after every optimizer step.

    With ``cuda_graphs`` the step is captured after a few eager warm-up steps on a side stream, and later
    calls copy the batch into static input buffers and replay it. Without accumulation one graph holds the
    whole step. With it, two graphs share one memory pool: the micro-step (forward and backward adding into
    the gradients) and the last micro-step of a global batch (the same, then the optimizer step and the
    gradients zeroed in place), replayed ``accumulation - 1`` times and once per global batch. A scheduler
    is stepped outside the graph, between replays: the learning rates become device tensors that it fills
    in place and the replayed step reads (``graph_safe_lr``).

    When ``ctx.model`` compiled the model (``compile`` not ``off``), the forward pass and the loss are
    compiled together as one graph that returns only the loss (``compiled_loss`` true; ``compile_loss=False``
    calls the compiled module instead, as a hand-written loop does). A DDP model keeps its compiled module.

    With ``loss_capacity`` each call's loss is written into a device buffer (inside the graph too, through
    a device-side index), so the trial's loss trajectory costs no synchronisation and no extra launch per
    replay; it is read once, at the end.

    Raises:
        KnobError: a knob that cannot run as configured (fp16 or graphs without CUDA; a scheduler whose
            optimizer cannot read a tensor LR inside a graph).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Optional[Callable[..., torch.Tensor]] = None,
        *,
        config: TrialConfig,
        device: torch.device,
        loss_capacity: int = 0,
        clip_grad_norm: Optional[float] = None,
        scheduler: Any = None,
        compile_loss: bool = True,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.config = config
        self.device = device
        self.accumulation = config.accumulation_steps
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise ValueError(f"clip_grad_norm must be a positive norm, not {clip_grad_norm!r}")
        self.clip_grad_norm = clip_grad_norm
        self.scheduler = scheduler
        self.grad_norm: Optional[torch.Tensor] = None
        self._params = [p for group in optimizer.param_groups for p in group["params"]] if clip_grad_norm else []
        self.scaler: Optional[torch.amp.GradScaler] = None
        if config.precision == "fp16":
            if device.type != "cuda":
                raise KnobError("fp16 with GradScaler needs a CUDA device")
            self.scaler = torch.amp.GradScaler("cuda")
        self.use_graph = config.cuda_graphs
        if self.use_graph and device.type != "cuda":
            raise KnobError("cuda_graphs needs a CUDA device")
        self._ddp = find_ddp(model)  # from ctx.ddp: micro-steps that only accumulate run under no_sync()
        self._compiled_loss = _compiled_loss(model, config, compile_loss)
        self.compiled_loss = self._compiled_loss is not None
        self.no_sync_steps = 0
        self._ddp_synced = False  # a backward of the DDP model has all-reduced
        if self.use_graph and self._ddp is not None:
            raise KnobError("cuda_graphs with a DDP model (ctx.ddp): a captured step of several ranks is not supported")
        if self.use_graph and self.scaler is not None and not getattr(optimizer, "_step_supports_amp_scaling", False):
            raise KnobError(
                "fp16 with CUDA Graphs needs an optimizer that takes the scale on the device, "
                "e.g. torch.optim.SGD(..., fused=True); ctx.optimizer(...) sets this for you"
            )
        if self.use_graph and scheduler is not None:
            graph_safe_lr(optimizer, device)
        if self.scaler is not None and getattr(optimizer, "_step_supports_amp_scaling", False):
            _zero_momentum(optimizer)
        self._skips = torch.zeros((), device=device, dtype=torch.float32)
        self.calls = 0
        self.optimizer_steps = 0
        self.last_loss: Optional[torch.Tensor] = None
        # One slot per call (micro-batch); calls past the capacity overwrite the last slot.
        self._loss_log = torch.full((loss_capacity,), math.nan, device=device) if loss_capacity > 0 else None
        self._loss_index = torch.zeros((), dtype=torch.long, device=device)
        self.graph: Optional[torch.cuda.CUDAGraph] = None  # the whole step, or the last micro-step
        self._micro_graph: Optional[torch.cuda.CUDAGraph] = None  # a micro-step that only accumulates
        self.graph_replays = 0
        self.capture_seconds = 0.0
        self._static: Optional[tuple[Any, ...]] = None  # the call's arguments, tensors as static buffers
        self._static_layout: Any = None
        self._static_loss: Optional[torch.Tensor] = None
        self._static_micro_loss: Optional[torch.Tensor] = None
        self._stream: Optional[torch.cuda.Stream] = None
        # Eager warm-up ends on a global-batch boundary, so the graphs start a global batch.
        self._graph_warmup = -(-GRAPH_WARMUP_STEPS // self.accumulation) * self.accumulation

    def ensure_loss_capacity(self, calls: int) -> bool:
        """Grow the loss buffer to ``calls`` slots before the first call (the batch became smaller, so there
        are more steps); returns whether it holds them now."""
        if self._loss_log is None or self._loss_log.numel() >= calls:
            return True
        if self.calls:
            return False
        self._loss_log = torch.full((calls,), math.nan, device=self._loss_log.device)
        return True

    def _loss(self, args: tuple[Any, ...]) -> torch.Tensor:
        if self._compiled_loss is not None:
            return self._compiled_loss(self.loss_fn, args)
        return model_loss(self.model, self.loss_fn, args)

    def _backward(self, args: tuple[Any, ...], sync: bool = True) -> torch.Tensor:
        """Forward and backward of one micro-batch; gradients add into ``.grad``. Returns the unscaled loss.

        With a DDP model and ``sync`` false (a micro-step that only accumulates) both run under
        ``no_sync()``: the gradients stay local until the global batch's last micro-step all-reduces them.
        """
        # DDP's static graph is recorded in its first backward, which must all-reduce; syncing one
        # accumulating micro-step costs an all-reduce but not correctness (the mean is linear).
        local = self._ddp is not None and not sync and (self._ddp_synced or not self._ddp.static_graph)
        if local:
            self.no_sync_steps += 1
        elif self._ddp is not None:
            self._ddp_synced = True
        # The backward pass re-runs the forward of checkpointed blocks: it must see the same attention kernel.
        with (self._ddp.no_sync() if local else contextlib.nullcontext()), attention_kernels(self.config):
            with autocast(self.config, self.device):
                loss = self._loss(args)
            scaled = loss / self.accumulation if self.accumulation > 1 else loss
            (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        if self._loss_log is not None:
            slot = self._loss_index.clamp(max=self._loss_log.numel() - 1).view(1)
            self._loss_log.index_copy_(0, slot, loss.detach().float().view(1))
            self._loss_index += 1
        return loss.detach()

    def _optimizer_step(self) -> None:
        if self.clip_grad_norm is not None:
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)  # clip the true gradient; the step then takes it unscaled
            # No error_if_nonfinite: that check would synchronise. A skipped fp16 step ignores the result.
            self.grad_norm = torch.nn.utils.clip_grad_norm_(self._params, self.clip_grad_norm)
        if self.scaler is None:
            self.optimizer.step()
            return
        self.scaler.step(self.optimizer)
        # Count skipped steps on the device: no sync, and it works inside a captured graph.
        state = self.scaler._per_optimizer_states[id(self.optimizer)]
        for found_inf in state["found_inf_per_device"].values():
            self._skips += found_inf.to(self._skips.device)
        self.scaler.update()

    def _eager(self, args: tuple[Any, ...], first: bool, last: bool) -> torch.Tensor:
        if first:
            self.optimizer.zero_grad(set_to_none=True)
        loss = self._backward(args, sync=last)
        if last:
            self._optimizer_step()
        return loss

    def __call__(self, *args: Any) -> torch.Tensor:
        if len(args) not in (1, 2):
            raise TypeError(f"call step(inputs, targets) or step(batch), not with {len(args)} arguments")
        self.last_loss = self._call(args)
        return self.last_loss

    def _call(self, args: tuple[Any, ...]) -> torch.Tensor:
        micro = self.calls % self.accumulation
        first, last = micro == 0, micro == self.accumulation - 1
        self.calls += 1
        loss = self._graph_call(args, first, last) if self.use_graph else self._eager(args, first, last)
        if last:
            self.optimizer_steps += 1
            if self.scheduler is not None:
                self.scheduler.step()  # outside any graph: a tensor LR is filled in place, read by the next replay
        return loss

    def _graph_call(self, args: tuple[Any, ...], first: bool, last: bool) -> torch.Tensor:
        layout = _layout(args)
        if self._static is None:
            self._static = _clone_tensors(args)
            self._static_layout = layout
            self._stream = torch.cuda.Stream()
        if layout != self._static_layout:
            raise KnobError(
                f"CUDA Graphs need a fixed batch shape; got {_describe_layout(layout)} after "
                f"{_describe_layout(self._static_layout)} (use drop_last=True)"
            )
        for static, given in zip(_tensors(self._static), _tensors(args)):
            static.copy_(given, non_blocking=True)
        if self.graph is None and (self.calls <= self._graph_warmup or not first):
            assert self._stream is not None
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                loss = self._eager(self._static, first, last)
            torch.cuda.current_stream().wait_stream(self._stream)
            return loss
        if self.graph is None:
            self._capture(self._static)
        if last:
            assert self.graph is not None and self._static_loss is not None
            self.graph.replay()
            loss = self._static_loss
        else:
            assert self._micro_graph is not None and self._static_micro_loss is not None
            self._micro_graph.replay()
            loss = self._static_micro_loss
        self.graph_replays += 1
        return loss

    def _capture(self, static: tuple[Any, ...]) -> None:
        torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            self._capture_graphs(static)
        except RuntimeError as exc:
            if self.config.activation_checkpointing and "graph capture" in str(exc):
                raise KnobError(
                    "activation_checkpointing with cuda_graphs: torch.utils.checkpoint could not run inside the "
                    f"graph capture in torch {torch.__version__} ({str(exc).splitlines()[0]})"
                ) from exc
            raise
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start

    def _capture_graphs(self, static: tuple[Any, ...]) -> None:
        # thread_local: the DataLoader's pin-memory thread keeps making CUDA calls (pinned allocations)
        # while the step is captured; in the default "global" mode those invalidate the capture, which
        # an H200 run showed as a cuda_fatal at batch 32 with 8 pinned workers.
        if self.accumulation == 1:
            self.graph = torch.cuda.CUDAGraph()
            self.optimizer.zero_grad(set_to_none=True)
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self._static_loss = self._backward(static)
                self._optimizer_step()
        else:
            # The gradients must be tensors that both graphs add into: zero the ones the warm-up made.
            self.optimizer.zero_grad(set_to_none=False)
            self._micro_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._micro_graph, capture_error_mode="thread_local"):
                self._static_micro_loss = self._backward(static)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=self._micro_graph.pool(), capture_error_mode="thread_local"):
                self._static_loss = self._backward(static)
                self._optimizer_step()
                self.optimizer.zero_grad(set_to_none=False)

    def loss_trajectory(self) -> list[float]:
        """The training loss per optimizer step: the mean of its micro-batches (one sync, at the end)."""
        if self._loss_log is None or not self.calls:
            return []
        values = self._loss_log[: min(self.calls, self._loss_log.numel())].cpu().tolist()
        a = self.accumulation
        return [sum(values[i:i + a]) / a for i in range(0, len(values) // a * a, a)]

    @property
    def scaler_skips(self) -> int:
        return int(self._skips.item())


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors of a batch (nested tuples, lists and dicts), in a fixed order."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, Mapping):
        return [t for key in tree for t in _tensors(tree[key])]
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in _tensors(item)]
    return []


def _clone_tensors(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, Mapping):
        return {key: _clone_tensors(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_clone_tensors(item) for item in tree)
    return tree


def _layout(tree: Any) -> Any:
    """A batch's structure with each tensor as (shape, dtype): what a graph's static inputs fix."""
    if isinstance(tree, torch.Tensor):
        return (tuple(tree.shape), tree.dtype)
    if isinstance(tree, Mapping):
        return tuple((key, _layout(value)) for key, value in tree.items())
    if isinstance(tree, (list, tuple)):
        return tuple(_layout(item) for item in tree)
    return ("value", tree)  # a non-tensor argument is captured as it was


def _describe_layout(layout: Any) -> str:
    shapes = []

    def walk(node: Any) -> None:
        if isinstance(node, tuple) and len(node) == 2 and isinstance(node[1], torch.dtype):
            shapes.append(str(node[0]))
        elif isinstance(node, tuple):
            for item in node:
                walk(item)

    walk(layout)
    return ", ".join(shapes) or "no tensors"
