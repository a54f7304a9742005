"""Measure a grid of training configs of one workload, all in one process, into a JSON Lines table.

    python -m benchmarks.tables.sweep resnet50 --out benchmarks/tables/resnet50_h200.jsonl --max-seconds 480
    python -m benchmarks.tables.sweep gpt --out benchmarks/tables/gpt_h200.jsonl --max-seconds 420
    python -m benchmarks.tables.sweep gpt --out gpt_tiny.jsonl --tiny --grid precision=fp32 batch_size=4

Data collection for ``autotune simulate``, not tuning: every config of the grid is measured, one after the
other, without process isolation. Each line is appended and flushed as soon as its config is measured, and
a rerun skips the configs already in the file, so a killed or time-limited run loses at most one config.
The format and the tables are described in README.md beside this file.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import gc
import itertools
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from autotune.trial import _knobs
from autotune._config import COMPILE_MODES, PRECISIONS, TrialConfig

# The precisions the committed tables swept; fp8 came later and needs torchao and large linear layers.
SWEPT_PRECISIONS = tuple(p for p in PRECISIONS if p != "fp8")
from autotune.trial._context import NonFiniteLoss
from autotune.trial._execute import classify_exception

Params = dict[str, Any]
Batch = tuple[torch.Tensor, torch.Tensor]

_FIELDS = {f.name: f for f in dataclasses.fields(TrialConfig)}
# The data already sits on the device, so the loader knobs (workers, pinning, ...) have nothing to act on.
MODEL_KNOBS = (
    "precision", "batch_size", "channels_last", "compile", "cuda_graphs", "cudnn_benchmark", "memory_fraction",
)
POOL_BATCHES = 2  # distinct batches the steps cycle through
COMPILED_WARMUP_STEPS = 4  # the first step compiles forward and backward; the next ones must not
ERROR_CHARS = 300


# -- workloads ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """A model, its synthetic device-resident data and optimizer, and the grids a sweep measures.

    Attributes:
        name: CLI name.
        unit: What one sample (the unit of ``throughput``) is.
        knobs: TrialConfig knobs a grid may vary for this workload.
        grid: Default grid, knob -> values, in the order the params of a line are written.
        compile_only: Compiled configs are measured only where every listed knob has a listed value
            (``None``: everywhere). Compiling costs tens of seconds per point, so the default spends it
            where compilation matters.
        tiny_grid: Default grid of ``--tiny`` (tiny models; runs on a CPU in seconds).
        build: ``build(tiny)`` returns the model on the CPU.
        batches: ``batches(config, tiny, device)`` returns the batches the steps cycle through.
        loss_fn: ``loss_fn(outputs, targets)``.
        optimizer: Optimizer class, built with autotune's capturable/fused options for the config.
        optimizer_kwargs: Its hyper-parameters.
        extras: ``extras(throughput, tiny)``: extra fields of an ok line.
    """

    name: str
    unit: str
    knobs: tuple[str, ...]
    grid: dict[str, list[Any]]
    compile_only: Optional[dict[str, list[Any]]]
    tiny_grid: dict[str, list[Any]]
    build: Callable[[bool], nn.Module]
    batches: Callable[[TrialConfig, bool, torch.device], list[Batch]]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    optimizer: type
    optimizer_kwargs: dict[str, Any]
    extras: Callable[[float, bool], dict[str, Any]] = lambda throughput, tiny: {}


def _generator(device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(0)


def _resnet(tiny: bool) -> nn.Module:
    import torchvision
    from torchvision.models import resnet

    if tiny:
        return resnet.ResNet(resnet.BasicBlock, [1, 1, 1, 1], num_classes=10)
    return torchvision.models.resnet50(num_classes=1000)


def _images(config: TrialConfig, tiny: bool, device: torch.device) -> list[Batch]:
    size, classes = (32, 10) if tiny else (224, 1000)
    gen = _generator(device)
    out = []
    for _ in range(POOL_BATCHES):
        x = torch.randn(config.batch_size, 3, size, size, device=device, generator=gen)
        if config.channels_last:  # as ctx.to_device hands images to a channels_last model
            x = x.contiguous(memory_format=torch.channels_last)
        out.append((x, torch.randint(0, classes, (config.batch_size,), device=device, generator=gen)))
    return out


@dataclass(frozen=True)
class GPTShape:
    """Size of the decoder-only language model."""

    layers: int
    d_model: int
    heads: int
    seq: int
    vocab: int


GPT_FULL = GPTShape(layers=6, d_model=512, heads=8, seq=512, vocab=32000)
GPT_TINY = GPTShape(layers=2, d_model=64, heads=2, seq=64, vocab=512)


class _Block(nn.Module):
    """Pre-norm transformer block: causal self-attention (SDPA) and a GELU MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d, bias=False)
        self.out = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A small GPT-style language model; the output head shares the token embedding."""

    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.tok = nn.Embedding(shape.vocab, shape.d_model)
        self.pos = nn.Parameter(torch.zeros(shape.seq, shape.d_model))
        self.blocks = nn.Sequential(*(_Block(shape.d_model, shape.heads) for _ in range(shape.layers)))
        self.ln_f = nn.LayerNorm(shape.d_model)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.tok(ids) + self.pos[: ids.shape[1]])
        return self.ln_f(x) @ self.tok.weight.t()


def _gpt(tiny: bool) -> nn.Module:
    return GPT(GPT_TINY if tiny else GPT_FULL)


def _tokens(config: TrialConfig, tiny: bool, device: torch.device) -> list[Batch]:
    shape = GPT_TINY if tiny else GPT_FULL
    gen = _generator(device)
    out = []
    for _ in range(POOL_BATCHES):
        ids = torch.randint(0, shape.vocab, (config.batch_size, shape.seq + 1), device=device, generator=gen)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _gpt_extras(throughput: float, tiny: bool) -> dict[str, Any]:
    return {"tokens_per_s": round(throughput * (GPT_TINY if tiny else GPT_FULL).seq, 1)}


_BOOLS = [False, True]
WORKLOADS: dict[str, Workload] = {
    "resnet50": Workload(
        name="resnet50",
        unit="images",
        knobs=MODEL_KNOBS,
        grid={
            "precision": list(SWEPT_PRECISIONS),
            "channels_last": _BOOLS,
            "batch_size": [64, 128, 256, 512],
            "cuda_graphs": _BOOLS,
            "compile": ["off", "default"],
        },
        compile_only={"precision": ["fp16", "bf16"], "channels_last": [True], "batch_size": [128, 256, 512]},
        tiny_grid={
            "precision": ["fp32", "bf16", "fp16"],
            "channels_last": _BOOLS,
            "batch_size": [8, 16],
            "cuda_graphs": _BOOLS,
            "compile": ["off"],
        },
        build=_resnet,
        batches=_images,
        loss_fn=nn.CrossEntropyLoss(),
        optimizer=torch.optim.SGD,
        optimizer_kwargs={"lr": 0.02, "momentum": 0.9},
    ),
    "gpt": Workload(
        name="gpt",
        unit="sequences",
        knobs=tuple(k for k in MODEL_KNOBS if k != "channels_last"),
        grid={
            "precision": list(SWEPT_PRECISIONS),
            "batch_size": [8, 16, 32, 64],
            "cuda_graphs": _BOOLS,
            "compile": ["off", "default"],
        },
        compile_only={"precision": ["fp16", "bf16"]},
        tiny_grid={
            "precision": ["fp32", "bf16", "fp16"],
            "batch_size": [4, 8],
            "cuda_graphs": _BOOLS,
            "compile": ["off"],
        },
        build=_gpt,
        batches=_tokens,
        loss_fn=_lm_loss,
        optimizer=torch.optim.AdamW,
        optimizer_kwargs={"lr": 3e-4, "weight_decay": 0.1},
        extras=_gpt_extras,
    ),
}


# -- grid ---------------------------------------------------------------------------------------------
def parse_value(knob: str, raw: str) -> Any:
    """Parse one grid value with the type of the TrialConfig field ``knob``.

    Raises:
        ValueError: not a value of that knob.
    """
    default = _FIELDS[knob].default
    text = raw.strip()
    if isinstance(default, bool):
        if text.lower() not in ("true", "false"):
            raise ValueError(f"{knob}: {raw!r} is not true or false")
        return text.lower() == "true"
    if isinstance(default, int):
        return int(text)
    if isinstance(default, float):
        return float(text)
    if knob == "precision" and text not in PRECISIONS:
        raise ValueError(f"precision: {raw!r} is not one of {', '.join(PRECISIONS)}")
    if knob == "compile" and text not in COMPILE_MODES:
        raise ValueError(f"compile: {raw!r} is not one of {', '.join(COMPILE_MODES)}")
    return text


def parse_assignments(items: Sequence[str], knobs: Sequence[str]) -> dict[str, list[Any]]:
    """Parse ``KNOB=V1,V2`` items into knob -> values.

    Raises:
        ValueError: a malformed item, a knob outside ``knobs``, or no value.
    """
    out: dict[str, list[Any]] = {}
    for item in items:
        knob, sep, raw = item.partition("=")
        if not sep or knob not in knobs:
            raise ValueError(f"{item!r}: expected KNOB=V1,V2,... with KNOB one of {', '.join(knobs)}")
        values = [parse_value(knob, v) for v in raw.split(",") if v.strip()]
        if not values:
            raise ValueError(f"{item!r}: no value")
        out[knob] = list(dict.fromkeys(values))
    return out


def _group_key(params: Params) -> str:
    """Configs that differ only in ``cuda_graphs`` share one compiled model."""
    return json.dumps({k: v for k, v in params.items() if k != "cuda_graphs"}, sort_keys=True)


def plan(grid: dict[str, list[Any]], compile_only: Optional[dict[str, list[Any]]]) -> list[Params]:
    """The configs of a grid, in the order they are measured.

    Compiled configs come first, the two ``cuda_graphs`` variants of one compiled model next to each other,
    then the eager ones: a run cut short by ``--max-seconds`` then loses cheap eager configs at its end,
    which a rerun measures in seconds, rather than a compile.
    """
    configs = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
    if compile_only is not None:
        configs = [
            p
            for p in configs
            if p.get("compile", "off") == "off"
            or all(p.get(k, _FIELDS[k].default) in values for k, values in compile_only.items())
        ]
    first_of_group: dict[str, int] = {}
    for i, p in enumerate(configs):
        first_of_group.setdefault(_group_key(p), i)
    order = {id(p): i for i, p in enumerate(configs)}
    return sorted(
        configs,
        key=lambda p: (p.get("compile", "off") == "off", first_of_group[_group_key(p)], order[id(p)]),
    )


# -- table file --------------------------------------------------------------------------------------
def config_key(params: Params) -> str:
    """Canonical identity of a config in a table."""
    return json.dumps(params, sort_keys=True)


def load_done(path: Path) -> set[str]:
    """Keys of the configs already in the table at ``path``.

    A line that does not parse (a run killed mid-write) is dropped from the file, so appending goes on
    from a clean line boundary.
    """
    if not path.exists():
        return set()
    text = path.read_text()
    kept, done = [], set()
    for line in text.splitlines():
        try:
            row = json.loads(line)
            done.add(config_key(row["params"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
        kept.append(line + "\n")
    if "".join(kept) != text:
        print(f"{path}: dropped {len(text.splitlines()) - len(kept)} unreadable line(s)", flush=True)
        path.write_text("".join(kept))
    return done


def append_row(path: Path, row: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


# -- measuring ---------------------------------------------------------------------------------------
def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class Sweeper:
    """Measures configs of one workload in this process.

    Args:
        workload: What to train.
        tiny: Tiny model and inputs.
        device: Where to train.
        window_seconds: Target length of a timed window (at least one step).
        windows: Timed windows per config; throughput is their median.
        warmup_steps: Untimed steps before the windows (more when compiled or captured).
    """

    def __init__(
        self,
        workload: Workload,
        *,
        tiny: bool,
        device: torch.device,
        window_seconds: float,
        windows: int = 3,
        warmup_steps: int = 3,
    ) -> None:
        self.workload = workload
        self.tiny = tiny
        self.device = device
        self.window_seconds = window_seconds
        self.windows = windows
        self.warmup_steps = warmup_steps
        self.broken = False  # the CUDA context is unusable; the process must end
        torch.manual_seed(0)
        # Built once on the CPU and copied for each config: every config starts from the same weights, and
        # the device's peak memory counts only the config being measured.
        self.template = workload.build(tiny)
        self._group: Optional[str] = None
        self._group_model: Optional[nn.Module] = None

    def drop_compiled(self) -> None:
        """Forget the compiled model kept for the next ``cuda_graphs`` variant."""
        if self._group is None:
            return
        self._group = self._group_model = None
        torch._dynamo.reset()
        _free(self.device)

    def _model(self, params: Params, config: TrialConfig) -> nn.Module:
        """A fresh copy of the template, or the compiled model of the config's other graphs variant."""
        key = _group_key(params) if config.compile != "off" else None
        if self._group != key:
            self.drop_compiled()
        if key is None:
            return _knobs.prepare_model(copy.deepcopy(self.template), config, self.device)
        if self._group_model is None:
            self._group_model = _knobs.prepare_model(copy.deepcopy(self.template), config, self.device)
            self._group = key
        return self._group_model

    def measure(self, params: Params) -> dict[str, Any]:
        """Measure one config and return its table line; failures become ``oom`` or ``error`` lines."""
        start = time.perf_counter()
        row: dict[str, Any] = {"params": params, "status": "ok", "throughput": None}
        try:
            config = TrialConfig(**params)
            with _knobs.applied(config, self.device):
                row.update(self._measure(params, config))
        except Exception as exc:  # noqa: BLE001 - every failure is data for the table
            failure = classify_exception(exc)
            row["status"] = "oom" if failure == "oom" else "error"
            lines = str(exc).strip().splitlines()
            detail = f"{type(exc).__name__}: {lines[0] if lines else ''}"
            row["error"] = (detail if failure in ("oom", "error") else f"{failure}: {detail}")[:ERROR_CHARS]
            self.broken = failure == "cuda_fatal"
        if row["status"] != "ok":
            # What failed (a compile that ran out of memory, a broken capture) is not worth reusing.
            self.drop_compiled()
            self.broken = self.broken or not self._device_ok()
        _free(self.device)
        row["seconds"] = round(time.perf_counter() - start, 2)
        return row

    def _device_ok(self) -> bool:
        if self.device.type != "cuda":
            return True
        try:
            torch.ones(1, device=self.device).add_(1)
            torch.cuda.synchronize(self.device)
            return True
        except Exception:  # noqa: BLE001
            return False

    def _measure(self, params: Params, config: TrialConfig) -> dict[str, Any]:
        device, workload = self.device, self.workload
        if config.compile == "off" or self._group != _group_key(params):
            self.drop_compiled()  # before the reset, so that the peak does not count a model no longer used
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        model = self._model(params, config)
        options = _knobs.optimizer_options(workload.optimizer, config, device)
        optimizer = workload.optimizer(model.parameters(), **{**options, **workload.optimizer_kwargs})
        step = _knobs.TrainStep(model, optimizer, workload.loss_fn, config=config, device=device)
        batches = workload.batches(config, self.tiny, device)
        calls = 0

        def timed(steps: int) -> float:
            nonlocal calls
            _synchronize(device)
            begin = time.perf_counter()
            for _ in range(steps):
                inputs, targets = batches[calls % len(batches)]
                step(inputs, targets)
                calls += 1
            _synchronize(device)
            return time.perf_counter() - begin

        compiled = config.compile != "off"
        warmup = max(self.warmup_steps, COMPILED_WARMUP_STEPS if compiled else 1)
        if config.cuda_graphs:
            # Eager steps on a side stream, the capture, then at least one replay (two when compiled).
            warmup = max(warmup, _knobs.GRAPH_WARMUP_STEPS + (3 if compiled else 2))
        begin = time.perf_counter()
        first = last = timed(1)
        for _ in range(warmup - 1):
            last = timed(1)
        warmup_seconds = time.perf_counter() - begin
        per_window = max(1, round(self.window_seconds / max(last, 1e-6)))

        sampler = _gpu_sampler(device)
        if sampler is not None:
            sampler.start()
        seconds = [timed(per_window) for _ in range(self.windows)]
        if sampler is not None:
            sampler.stop()
        _check_finite(step, calls)

        rates = [per_window * config.batch_size / s for s in seconds]
        throughput = statistics.median(rates)
        step_seconds = statistics.median(seconds) / per_window
        out: dict[str, Any] = {"throughput": round(throughput, 1)}
        if device.type == "cuda":
            out["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
        out["window_throughputs"] = [round(r, 1) for r in rates]
        out["step_ms"] = round(step_seconds * 1000, 3)
        out["warmup_s"] = round(warmup_seconds, 2)
        if compiled:
            out["compile_s"] = round(max(0.0, first - step_seconds), 2)
        if config.cuda_graphs:
            out["capture_s"] = round(step.capture_seconds, 3)
        if step.scaler is not None:
            out["scaler_skips"] = step.scaler_skips
        if sampler is not None:
            summary = sampler.summary()
            for name in ("sm_clock_mhz", "power_w"):
                if f"gpu.{name}.mean" in summary:
                    out[name] = summary[f"gpu.{name}.mean"]
        out.update(workload.extras(throughput, self.tiny))
        return out


def _check_finite(step: _knobs.TrainStep, calls: int) -> None:
    """Fail as autotune's trials do: a non-finite loss, or an fp16 scaler that skipped most steps."""
    if step.scaler is not None:
        skips = step.scaler_skips
        if skips > 0.5 * calls:
            raise NonFiniteLoss(f"the fp16 scaler skipped {skips} of {calls} steps as non-finite")
        return
    loss = step.last_loss
    if loss is not None and not bool(torch.isfinite(loss).all()):
        raise NonFiniteLoss(f"training loss is {loss.float().item()} after {calls} steps")


def _gpu_sampler(device: torch.device) -> Any:
    if device.type != "cuda":
        return None
    from autotune.hardware import GpuSampler

    sampler = GpuSampler(index=device.index or 0)
    return sampler if sampler.active else None


def environment(device: torch.device) -> str:
    """One line naming what measured the table, for its README."""
    parts = [f"date {datetime.date.today()}", f"torch {torch.__version__}", f"python {platform.python_version()}"]
    if device.type == "cuda":
        parts.insert(1, f"GPU {torch.cuda.get_device_name(device)}")
        parts.insert(2, f"CUDA {torch.version.cuda}")
        try:
            import pynvml

            pynvml.nvmlInit()
            parts.insert(2, f"driver {pynvml.nvmlSystemGetDriverVersion()}")
        except Exception:  # noqa: BLE001 - the driver version is a nicety
            pass
    else:
        parts.insert(1, f"CPU ({platform.processor() or platform.machine()})")
    parts.append(f"{len(os.sched_getaffinity(0))} CPU cores")
    return "; ".join(parts)


def describe(params: Params) -> str:
    return " ".join(f"{k}={'T' if v is True else 'F' if v is False else v}" for k, v in params.items())


# -- CLI ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.tables.sweep",
        description="Measure a grid of training configs into a JSON Lines table (appends; resumes).",
    )
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("--out", required=True, help="the table (JSON Lines); appended to, configs in it are skipped")
    parser.add_argument("--tiny", action="store_true", help="tiny model and grid (a CPU runs it in seconds)")
    parser.add_argument(
        "--grid", nargs="+", default=[], metavar="KNOB=V1,V2",
        help="replace the default values of these knobs, e.g. precision=bf16,fp16 batch_size=256",
    )
    parser.add_argument(
        "--compile-only", nargs="+", default=None, metavar="KNOB=V1,V2",
        help="measure compiled configs only where these knobs have these values ('all': everywhere); "
        "default: the workload's choice (none with --tiny)",
    )
    parser.add_argument(
        "--max-seconds", type=float, default=None,
        help="start no new config this many seconds after the sweep started (imports aside)",
    )
    parser.add_argument("--window-seconds", type=float, default=None, help="timed window (0.4 s; 0.1 with --tiny)")
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the sweep; 0 when it ended cleanly (done or stopped by --max-seconds), 1 otherwise."""
    started = time.monotonic()
    parser = build_parser()
    args = parser.parse_args(argv)
    workload = WORKLOADS[args.workload]
    try:
        grid = dict(workload.tiny_grid if args.tiny else workload.grid)
        grid.update(parse_assignments(args.grid, workload.knobs))
        if args.compile_only is None:
            compile_only = None if args.tiny else workload.compile_only
        elif args.compile_only == ["all"]:
            compile_only = None
        else:
            compile_only = parse_assignments(args.compile_only, workload.knobs)
    except ValueError as exc:
        parser.error(str(exc))
    if args.windows < 3:
        parser.error("--windows must be at least 3")
    device = torch.device(args.device) if args.device else _knobs.pick_device()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    configs = plan(grid, compile_only)
    done = load_done(out)
    todo = [p for p in configs if config_key(p) not in done]
    unit = {"images": "img", "sequences": "seq"}.get(workload.unit, workload.unit)
    print(f"# {workload.name}{' (tiny)' if args.tiny else ''}: {environment(device)}", flush=True)
    print(f"# {len(configs)} configs in the grid, {len(configs) - len(todo)} already in {out}", flush=True)

    sweeper = Sweeper(
        workload,
        tiny=args.tiny,
        device=device,
        window_seconds=args.window_seconds or (0.1 if args.tiny else 0.4),
        windows=args.windows,
        warmup_steps=args.warmup_steps,
    )
    measured = 0
    # One process sees several batch sizes; a trial sees one, so shapes stay static as they would there.
    saved_dynamic = torch._dynamo.config.automatic_dynamic_shapes
    torch._dynamo.config.automatic_dynamic_shapes = False
    try:
        for i, params in enumerate(todo, 1):
            elapsed = time.monotonic() - started
            if args.max_seconds is not None and elapsed > args.max_seconds:
                print(f"# stopped at {elapsed:.0f} s (--max-seconds): {len(todo) - measured} configs left, "
                      "rerun to resume", flush=True)
                break
            row = sweeper.measure(params)
            append_row(out, row)
            measured += 1
            if row["status"] == "ok":
                result = f"{row['throughput']:>10,.1f} {unit}/s"
            else:
                result = f"{'':>10} {row.get('error', '')[:80]}"
            peak = f" peak {row['peak_memory_gib']:.1f} GiB" if "peak_memory_gib" in row else ""
            print(f"{i:>4}/{len(todo)} {row['status']:<5} {result}{peak} ({row['seconds']:.1f} s) {describe(params)}",
                  flush=True)
            if sweeper.broken:
                print("# the CUDA context is unusable: stopping; rerun to resume in a fresh process", flush=True)
                return 1
    finally:
        sweeper.drop_compiled()
        torch._dynamo.config.automatic_dynamic_shapes = saved_dynamic
    print(f"# measured {measured} configs in {time.monotonic() - started:.0f} s; {out} has "
          f"{len(done) + measured} of {len(configs)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
