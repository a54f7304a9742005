"""Applying knobs: global backend flags (put back afterwards), autocast, the capturable train step."""

from __future__ import annotations

import contextlib
import inspect
import math
import time
from typing import Any, Callable, Iterator, Optional

import torch

from autotune._config import TrialConfig
from autotune._errors import KnobError

AUTOCAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
GRAPH_WARMUP_STEPS = 3  # eager steps on a side stream before capture, as torch's docs prescribe


def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@contextlib.contextmanager
def applied(config: TrialConfig, device: Optional[torch.device] = None) -> Iterator[None]:
    """Set the process-wide flags a config asks for, and put every one of them back on exit.

    TF32 is on for every precision but ``fp32``, which means true fp32 (the accuracy reference).
    """
    device = device or pick_device()
    saved = {
        "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "threads": torch.get_num_threads(),
    }
    fraction_set = False
    try:
        tf32 = config.precision != "fp32"
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        torch.backends.cudnn.benchmark = config.cudnn_benchmark
        if config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)
        if config.memory_fraction < 1.0:
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


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def autocast(config: TrialConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """The autocast context for a config's precision (a no-op for fp32 and tf32)."""
    dtype = AUTOCAST_DTYPES.get(config.precision)
    if dtype is None:
        return contextlib.nullcontext()
    # A captured graph must not reuse weight casts cached at capture time (torch's CUDA Graphs docs).
    return torch.autocast(device_type=device.type, dtype=dtype, cache_enabled=not config.cuda_graphs)


def prepare_model(model: torch.nn.Module, config: TrialConfig, device: torch.device) -> torch.nn.Module:
    model = model.to(device)
    if config.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if config.compile != "off":
        mode = None if config.compile == "default" else config.compile
        model = torch.compile(model, mode=mode)
    return model


def optimizer_options(cls: type, config: TrialConfig, device: torch.device) -> dict[str, Any]:
    """Constructor options an optimizer needs for the config: capturable for graphs, fused for fp16 graphs."""
    accepted = inspect.signature(cls.__init__).parameters
    options: dict[str, Any] = {}
    if device.type == "cuda" and config.cuda_graphs:
        if "capturable" in accepted:
            options["capturable"] = True
        if config.precision == "fp16" and "fused" in accepted:
            # A fused optimizer takes the scaler's found_inf on the device, so the step never syncs.
            options["fused"] = True
    return options


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


class TrainStep:
    """One training step (forward, loss, backward, optimizer) with the config's precision applied.

    With ``config.accumulation_steps`` > 1 (``batch_policy: fixed`` and a micro-batch smaller than the
    global batch) each call is one micro-batch: its loss is divided by the accumulation count before the
    backward pass, gradients add up over the micro-batches, and the optimizer steps (through the
    GradScaler for fp16) once per global batch, so the gradient is the full batch's (BatchNorm statistics
    aside, which see micro-batches).

    With ``cuda_graphs`` the step is captured after a few eager warm-up steps on a side stream, and later
    calls copy the batch into static input buffers and replay it. Without accumulation one graph holds the
    whole step. With it, two graphs share one memory pool: the micro-step (forward and backward adding into
    the gradients) and the last micro-step of a global batch (the same, then the optimizer step and the
    gradients zeroed in place), replayed ``accumulation - 1`` times and once per global batch.

    With ``loss_capacity`` each call's loss is written into a device buffer (inside the graph too, through
    a device-side index), so the trial's loss trajectory costs no synchronisation and no extra launch per
    replay; it is read once, at the end.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[..., torch.Tensor],
        *,
        config: TrialConfig,
        device: torch.device,
        loss_capacity: int = 0,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.config = config
        self.device = device
        self.accumulation = config.accumulation_steps
        self.scaler: Optional[torch.amp.GradScaler] = None
        if config.precision == "fp16":
            if device.type != "cuda":
                raise KnobError("fp16 with GradScaler needs a CUDA device")
            self.scaler = torch.amp.GradScaler("cuda")
        self.use_graph = config.cuda_graphs
        if self.use_graph and device.type != "cuda":
            raise KnobError("cuda_graphs needs a CUDA device")
        if self.use_graph and self.scaler is not None and not getattr(optimizer, "_step_supports_amp_scaling", False):
            raise KnobError(
                "fp16 with CUDA Graphs needs an optimizer that takes the scale on the device, "
                "e.g. torch.optim.SGD(..., fused=True); ctx.optimizer(...) sets this for you"
            )
        if self.scaler is not None and getattr(optimizer, "_step_supports_amp_scaling", False):
            _zero_momentum(optimizer)
        self._skips = torch.zeros((), device=device, dtype=torch.float32)
        self.calls = 0
        self.last_loss: Optional[torch.Tensor] = None
        # One slot per call (micro-batch); calls past the capacity overwrite the last slot.
        self._loss_log = torch.full((loss_capacity,), math.nan, device=device) if loss_capacity > 0 else None
        self._loss_index = torch.zeros((), dtype=torch.long, device=device)
        self.graph: Optional[torch.cuda.CUDAGraph] = None  # the whole step, or the last micro-step
        self._micro_graph: Optional[torch.cuda.CUDAGraph] = None  # a micro-step that only accumulates
        self.graph_replays = 0
        self.capture_seconds = 0.0
        self._static: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._static_loss: Optional[torch.Tensor] = None
        self._static_micro_loss: Optional[torch.Tensor] = None
        self._stream: Optional[torch.cuda.Stream] = None
        # Eager warm-up ends on a global-batch boundary, so the graphs start a global batch.
        self._graph_warmup = -(-GRAPH_WARMUP_STEPS // self.accumulation) * self.accumulation

    def _backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one micro-batch; gradients add into ``.grad``. Returns the unscaled loss."""
        with autocast(self.config, self.device):
            loss = self.loss_fn(self.model(inputs), targets)
        scaled = loss / self.accumulation if self.accumulation > 1 else loss
        (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        if self._loss_log is not None:
            slot = self._loss_index.clamp(max=self._loss_log.numel() - 1).view(1)
            self._loss_log.index_copy_(0, slot, loss.detach().float().view(1))
            self._loss_index += 1
        return loss.detach()

    def _optimizer_step(self) -> None:
        if self.scaler is None:
            self.optimizer.step()
            return
        self.scaler.step(self.optimizer)
        # Count skipped steps on the device: no sync, and it works inside a captured graph.
        state = self.scaler._per_optimizer_states[id(self.optimizer)]
        for found_inf in state["found_inf_per_device"].values():
            self._skips += found_inf.to(self._skips.device)
        self.scaler.update()

    def _eager(self, inputs: torch.Tensor, targets: torch.Tensor, first: bool, last: bool) -> torch.Tensor:
        if first:
            self.optimizer.zero_grad(set_to_none=True)
        loss = self._backward(inputs, targets)
        if last:
            self._optimizer_step()
        return loss

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.last_loss = self._call(inputs, targets)
        return self.last_loss

    def _call(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        micro = self.calls % self.accumulation
        first, last = micro == 0, micro == self.accumulation - 1
        self.calls += 1
        if not self.use_graph:
            return self._eager(inputs, targets, first, last)
        if self._static is None:
            self._static = (inputs.clone(), targets.clone())
            self._stream = torch.cuda.Stream()
        static_in, static_tgt = self._static
        if inputs.shape != static_in.shape or targets.shape != static_tgt.shape:
            raise KnobError(
                f"CUDA Graphs need a fixed batch shape; got {tuple(inputs.shape)} after "
                f"{tuple(static_in.shape)} (use drop_last=True)"
            )
        static_in.copy_(inputs, non_blocking=True)
        static_tgt.copy_(targets, non_blocking=True)
        if self.graph is None and (self.calls <= self._graph_warmup or not first):
            assert self._stream is not None
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                loss = self._eager(static_in, static_tgt, first, last)
            torch.cuda.current_stream().wait_stream(self._stream)
            return loss
        if self.graph is None:
            self._capture(static_in, static_tgt)
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

    def _capture(self, static_in: torch.Tensor, static_tgt: torch.Tensor) -> None:
        torch.cuda.synchronize()
        start = time.perf_counter()
        # thread_local: the DataLoader's pin-memory thread keeps making CUDA calls (pinned allocations)
        # while the step is captured; in the default "global" mode those invalidate the capture, which
        # an H200 run showed as a cuda_fatal at batch 32 with 8 pinned workers.
        if self.accumulation == 1:
            self.graph = torch.cuda.CUDAGraph()
            self.optimizer.zero_grad(set_to_none=True)
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self._static_loss = self._backward(static_in, static_tgt)
                self._optimizer_step()
        else:
            # The gradients must be tensors that both graphs add into: zero the ones the warm-up made.
            self.optimizer.zero_grad(set_to_none=False)
            self._micro_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._micro_graph, capture_error_mode="thread_local"):
                self._static_micro_loss = self._backward(static_in, static_tgt)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=self._micro_graph.pool(), capture_error_mode="thread_local"):
                self._static_loss = self._backward(static_in, static_tgt)
                self._optimizer_step()
                self.optimizer.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start

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
