"""Synthetic config tables from an analytic performance model, for testing search strategies offline.

    python -m benchmarks.tables.synthetic [--seed 0] [--out-dir benchmarks/tables] [NAME ...]

Writes ``<NAME>.jsonl`` for each table (all by default) in the format of README.md beside this file, and
prints each table's size and best config. The same seed gives byte-identical files.

The model, in short (README.md has the details and the numbers of each table):

- GPU time of a step = batch * per-sample time + a fixed optimizer time. The per-sample time has a
  tensor-core part (convolutions, GEMMs), sped up by low precision and channels_last (in fp16/bf16 only),
  and less efficient at small batch, and a memory-bound part (norms, activations), sped up less by low
  precision and fused by torch.compile. Compiled code adds a fixed cost per step, so it can lose at small
  batch.
- CPU time of a step = kernel launches (fewer when compiled, almost none when the whole step is a replayed
  CUDA Graph) plus, with fp16 in eager steps, the GradScaler's host sync. The step takes the longer of the
  two plus a little of the shorter one (overlap is imperfect).
- The input pipeline, where the table has loader knobs: DataLoader workers decode on the CPU cores; threads
  beyond the cores left over slow every thread down (contention), so the most workers is not the fastest;
  prefetching hides decode jitter but costs host memory; without ``persistent_workers`` the workers restart
  every epoch; pageable host-to-device copies are synchronous, pinned ones overlap. Throughput is a smooth
  minimum of the compute and input rates; with ``num_workers=0`` loading and compute run in series.
- Peak memory = static (weights, gradients, optimizer) + batch * activation memory (less in low precision
  and when compiled) + workspaces (cuDNN benchmark, the CUDA Graph pool). Above the capacity: ``oom``.
- Measurement noise is log-normal per config, from an RNG seeded by (table, seed, config). A few configs
  fail at random with plausible errors; incompatible combinations always fail.
- What a trial costs (``trial_seconds``, ``compile_seconds``): the trial process's start, building the
  model, a fresh compile per mode (``Profile.compile_s`` for ``default``, times ``COMPILE_COST``), the graph
  capture, starting the workers, and the trial's samples at the config's rate. A failure pays the start
  and half its compile; an out-of-memory the start and its compile (it fails in the first step).
- ``data_wait_fraction`` (tables with a loader): the share of the step spent waiting for input, as the
  tuner measures it: the decode time over the step with ``num_workers=0``, else ``1 - rate / compute rate``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

Params = dict[str, Any]
LOW_PRECISION = ("fp16", "bf16")


@dataclass(frozen=True)
class Loader:
    """The host input pipeline of a table (times in ms, sizes in MB).

    Attributes:
        cores: CPU cores of the host.
        reserved_cores: Cores the rest of the host needs (OS, driver, logging threads).
        decode_ms: CPU time to decode and augment one sample on one core.
        sample_mb: Bytes of one decoded sample sent to the GPU.
        pageable_gbps: Host-to-device bandwidth from pageable memory (a synchronous copy).
        contention: Slow-down of every thread per thread beyond the cores left over.
        turbo_droop: Clock lost per busy core (all-core turbo is lower than single-core).
        jitter: Share of time a worker stalls (slow files, GC) when nothing is queued to hide it.
        host_queue_gib: Host memory for prefetched batches before paging slows everything down.
        epoch_samples: Samples per epoch (workers restart each epoch unless persistent).
        worker_start_s: Seconds to start the workers at each epoch.
    """

    cores: int = 16
    reserved_cores: float = 2.0
    decode_ms: float = 4.0
    sample_mb: float = 0.15
    pageable_gbps: float = 6.0
    contention: float = 0.12
    turbo_droop: float = 0.012
    jitter: float = 0.15
    host_queue_gib: float = 2.0
    epoch_samples: int = 50_000
    worker_start_s: float = 1.0


@dataclass(frozen=True)
class Profile:
    """The workload, GPU and host one synthetic table models (times in ms, memory in GiB).

    Attributes:
        description: One line for the README.
        grid: Knob -> values; the table holds every config of this grid.
        matmul_ms: Tensor-core-able GPU time per sample in fp32 (TF32 off) at large batch.
        elementwise_ms: Memory-bound GPU time per sample in fp32.
        half_batch: Batch at which small-batch inefficiency doubles the tensor-core time per sample.
        optimizer_ms: GPU time of the optimizer step.
        matmul_speedup: Tensor-core speed-up over fp32 by precision.
        elementwise_speedup: Memory-bound speed-up over fp32 by precision.
        channels_last_low: Tensor-core speed-up of channels_last in fp16/bf16.
        channels_last_high: The same in fp32/tf32 (below 1: NHWC kernels are slower there).
        cudnn_benchmark_gain: Tensor-core speed-up of cuDNN autotuning.
        launch_ms: CPU time to launch the kernels of an eager step.
        compile_call_ms: CPU cost per call of a compiled model (guards, runtime wrappers), unless replayed.
        compile_fixed_ms: GPU cost per step of compiled code (layout copies at graph boundaries).
        scaler_sync_ms: Host sync of fp16's GradScaler in an eager step.
        capacity_gib: GPU memory.
        static_gib: Weights, gradients and optimizer state.
        activation_gib: Activation memory per sample in fp32.
        loader: The input pipeline; ``None`` when the data is already on the GPU.
        noise: Sigma of the log-normal measurement noise.
        error_rate: Chance that a config fails at random.
        accuracy: Whether lines carry a modelled ``accuracy_loss``.
        compile_s: Seconds of a fresh ``compile: default`` of the model (other modes: ``COMPILE_COST``).
        build_s: Seconds to build the model and its optimizer in a trial process.
        batch_accuracy_cost: Accuracy lost per doubling of the batch over 64 (fewer steps per epoch).
    """

    description: str
    grid: dict[str, list[Any]]
    matmul_ms: float = 1.0
    elementwise_ms: float = 0.22
    half_batch: float = 16.0
    optimizer_ms: float = 3.0
    matmul_speedup: dict[str, float] = field(
        default_factory=lambda: {"fp32": 1.0, "tf32": 2.6, "fp16": 5.0, "bf16": 5.0}
    )
    elementwise_speedup: dict[str, float] = field(
        default_factory=lambda: {"fp32": 1.0, "tf32": 1.0, "fp16": 1.9, "bf16": 1.9}
    )
    channels_last_low: float = 1.5
    channels_last_high: float = 0.97
    cudnn_benchmark_gain: float = 1.08
    launch_ms: float = 10.0
    compile_call_ms: float = 1.5
    compile_fixed_ms: float = 1.0
    scaler_sync_ms: float = 1.0
    capacity_gib: float = 80.0
    static_gib: float = 0.5
    activation_gib: float = 0.095
    loader: Optional[Loader] = None
    noise: float = 0.015
    error_rate: float = 0.01
    accuracy: bool = False
    compile_s: float = 40.0
    build_s: float = 3.0
    batch_accuracy_cost: float = 0.003


# torch.compile mode -> (tensor-core time, memory-bound time, kernel launches, activation memory) factors.
COMPILE_EFFECTS: dict[str, tuple[float, float, float, float]] = {
    "off": (1.0, 1.0, 1.0, 1.0),
    "default": (1.0, 0.5, 0.4, 0.85),
    "max-autotune-no-cudagraphs": (0.93, 0.48, 0.4, 0.85),
    # Captures forward and backward in its own CUDA Graphs; the optimizer's launches remain.
    "max-autotune": (0.93, 0.48, 0.12, 0.9),
}
# Fresh compile seconds per mode over "default" (the H200 max-autotune compiles took 3-6x as long).
COMPILE_COST = {"off": 0.0, "default": 1.0, "max-autotune-no-cudagraphs": 4.0, "max-autotune": 4.5}
PROCESS_START_S = 13.3  # as derived for the H200 tables (benchmarks/tables/trial_seconds.py)
CAPTURE_S = 0.5
WORKER_START_S = 0.15  # per DataLoader worker, once per trial
TRIAL_SAMPLES = 4096  # warm-up and timed windows of one trial
OPTIMIZER_LAUNCH_MS = 0.4
REPLAY_MS = 0.05
GRAPH_POOL_GIB = 0.25
GRAPH_POOL_SHARE = 0.06  # of the activation memory, kept by the graph's private pool
CUDNN_WORKSPACE_GIB = 0.5
OVERLAP_LOSS = 0.1  # share of the shorter of CPU and GPU time that is not hidden
SMOOTH_MIN_POWER = 8.0  # the loader and the GPU rarely both run flat out near the balance point
PRESSURE_EDGE = 0.97  # above this share of capacity the allocator frees and retries
PRESSURE_SLOWDOWN = 0.96

TABLES: dict[str, Profile] = {
    "synthetic_input_bound": Profile(
        description="a small CNN fed by a PIL-decoding DataLoader on a 16-core host: decoding limits every "
        "config, so the best need more workers and precision and compile barely matter",
        grid={
            "precision": ["fp32", "bf16"],
            "batch_size": [64, 128, 256],
            "compile": ["off", "default", "max-autotune-no-cudagraphs"],
            "num_workers": [0, 2, 4, 6, 8, 10, 12, 14, 16],
            "pin_memory": [False, True],
            "prefetch_factor": [2, 4],
            "persistent_workers": [False, True],
        },
        matmul_ms=0.06,
        elementwise_ms=0.03,
        optimizer_ms=0.5,
        launch_ms=3.0,
        compile_s=25.0,
        static_gib=0.1,
        activation_gib=0.01,
        loader=Loader(decode_ms=6.0),
    ),
    "synthetic_compute_bound": Profile(
        description="ResNet-50-like vision model with the data already on the GPU; fp16 kernels a little "
        "faster than bf16 on this GPU; compiled code has a fixed per-step cost",
        grid={
            "precision": ["fp32", "tf32", "fp16", "bf16"],
            "batch_size": [32, 64, 128, 256, 512],
            "channels_last": [False, True],
            "compile": ["off", "default", "max-autotune-no-cudagraphs", "max-autotune"],
            "cuda_graphs": [False, True],
            "cudnn_benchmark": [False, True],
        },
        matmul_speedup={"fp32": 1.0, "tf32": 2.6, "fp16": 5.4, "bf16": 5.0},
        half_batch=24.0,
        launch_ms=12.0,
        compile_call_ms=3.0,
        compile_fixed_ms=2.5,
    ),
    "synthetic_oom_heavy": Profile(
        description="a larger vision model on a 24 GiB GPU: most large batches run out of memory",
        grid={
            "precision": ["fp32", "tf32", "fp16", "bf16"],
            "batch_size": [32, 64, 96, 128, 160, 192, 224, 256, 320, 384],
            "channels_last": [False, True],
            "compile": ["off", "default"],
            "cuda_graphs": [False, True],
        },
        matmul_ms=2.0,
        elementwise_ms=0.4,
        half_batch=48.0,
        optimizer_ms=6.0,
        launch_ms=14.0,
        capacity_gib=24.0,
        static_gib=1.6,
        activation_gib=0.2,
    ),
    "synthetic_large": Profile(
        description="ResNet-50-like vision model on a 40 GiB GPU and a 16-core host, 8 knobs; the input "
        "pipeline and the GPU are close to balanced at the top; lines carry a modelled accuracy_loss",
        grid={
            "precision": ["fp32", "tf32", "fp16", "bf16"],
            "batch_size": [64, 128, 256, 512],
            "channels_last": [False, True],
            "compile": ["off", "default", "max-autotune-no-cudagraphs"],
            "cuda_graphs": [False, True],
            "cudnn_benchmark": [False, True],
            "num_workers": [6, 12, 16],
            "pin_memory": [False, True],
        },
        capacity_gib=40.0,
        loader=Loader(decode_ms=1.8, epoch_samples=1_281_167),
        accuracy=True,
    ),
}

DEFAULTS: Params = {
    "precision": "fp32",
    "batch_size": 64,
    "channels_last": False,
    "compile": "off",
    "cuda_graphs": False,
    "cudnn_benchmark": False,
    "num_workers": 0,
    "pin_memory": False,
    "prefetch_factor": 2,
    "persistent_workers": False,
}


@dataclass(frozen=True)
class Outcome:
    """What the model predicts for one config, before noise and random failures."""

    status: str
    throughput: Optional[float] = None
    peak_memory_gib: Optional[float] = None
    bound: Optional[str] = None  # "compute" or "input"
    error: Optional[str] = None
    data_wait_fraction: Optional[float] = None  # tables with a loader
    # What the probes would measure apart (tables with a loader): the loader iterated alone, and the step
    # replaying batches already on the device, with no workers beside it and no host copy.
    loader_rate: Optional[float] = None
    step_rate: Optional[float] = None


def peak_memory(profile: Profile, c: Params) -> float:
    """Peak GPU memory (GiB) of config ``c``."""
    low = c["precision"] in LOW_PRECISION
    activations = c["batch_size"] * profile.activation_gib * (0.55 if low else 1.0)
    activations *= COMPILE_EFFECTS[c["compile"]][3]
    peak = profile.static_gib + activations
    if c["cudnn_benchmark"]:
        peak += CUDNN_WORKSPACE_GIB
    if c["cuda_graphs"]:
        peak += GRAPH_POOL_GIB + GRAPH_POOL_SHARE * activations
    return peak


def step_times(profile: Profile, c: Params) -> tuple[float, float]:
    """(GPU ms, CPU ms) of one training step of config ``c``, input pipeline aside."""
    precision, batch, mode = c["precision"], c["batch_size"], c["compile"]
    low = precision in LOW_PRECISION
    mm_factor, el_factor, launch_factor, _ = COMPILE_EFFECTS[mode]
    matmul = profile.matmul_ms / profile.matmul_speedup[precision] * mm_factor
    if c["channels_last"]:
        matmul /= profile.channels_last_low if low else profile.channels_last_high
    if c["cudnn_benchmark"]:
        matmul /= profile.cudnn_benchmark_gain
    matmul *= 1.0 + profile.half_batch / batch
    elementwise = profile.elementwise_ms / profile.elementwise_speedup[precision] * el_factor
    gpu = batch * (matmul + elementwise) + profile.optimizer_ms
    if mode != "off":
        gpu += profile.compile_fixed_ms
    if c["cuda_graphs"]:
        cpu = REPLAY_MS
    else:
        cpu = profile.launch_ms * launch_factor + OPTIMIZER_LAUNCH_MS
        if mode != "off":
            cpu += profile.compile_call_ms
    return gpu, cpu


def model(profile: Profile, c: Params) -> Outcome:
    """The modelled outcome of config ``c`` (every knob present, defaults filled in)."""
    if c["compile"] == "max-autotune" and c["cuda_graphs"]:
        return Outcome("error", error="KnobError: compile=max-autotune captures CUDA Graphs itself; "
                       "a whole-step capture cannot wrap it")
    peak = peak_memory(profile, c)
    if peak > profile.capacity_gib:
        return Outcome("oom", error="OutOfMemoryError: CUDA out of memory")
    gpu, cpu = step_times(profile, c)
    batch, loader = c["batch_size"], profile.loader
    alone = _step_rate(profile, c, gpu, cpu, peak)  # the step probe's rate: nothing else on the host
    workers = c["num_workers"]
    input_rate = math.inf
    if loader is not None:
        threads = workers + 1 + (0.5 if c["pin_memory"] else 0.0)  # workers, the training loop, the pin thread
        excess = max(0.0, threads - (loader.cores - loader.reserved_cores))
        slowdown = 1.0 + loader.contention * excess
        cpu *= slowdown  # the training loop competes for the same cores
        if not c["pin_memory"]:
            gpu += batch * loader.sample_mb / loader.pageable_gbps  # MB / (GB/s) = ms, synchronous
        if workers > 0:
            busy = min(workers, loader.cores)
            input_rate = workers * 1000.0 / loader.decode_ms * (1.0 - loader.turbo_droop * busy) / slowdown
            queued = workers * c["prefetch_factor"]
            input_rate *= 1.0 - loader.jitter * 4.0 / (4.0 + queued)
            if queued * batch * loader.sample_mb / 1024 > loader.host_queue_gib:
                input_rate *= 0.8
            if not c["persistent_workers"]:
                restart_s = loader.worker_start_s * (1.0 + 0.05 * workers)
                input_rate = 1.0 / (1.0 / input_rate + restart_s / loader.epoch_samples)
    step = max(gpu, cpu) + OVERLAP_LOSS * min(gpu, cpu)
    if c["precision"] == "fp16" and not c["cuda_graphs"]:
        # The scaler's inf check waits for the GPU every step, so the CPU cannot run ahead.
        step += profile.scaler_sync_ms + 0.4 * min(gpu, cpu)
    compute_rate = batch * 1000.0 / step
    if peak > PRESSURE_EDGE * profile.capacity_gib:
        compute_rate *= PRESSURE_SLOWDOWN
    if loader is not None and workers == 0:
        # The training loop decodes the batch itself, in series with the step.
        decode = batch * loader.decode_ms
        compute_ms = batch * 1000.0 / compute_rate
        rate = batch * 1000.0 / (compute_ms + decode)
        return Outcome("ok", rate, peak, "input" if decode > step else "compute", None, decode / (compute_ms + decode),
                       loader_rate=1000.0 / loader.decode_ms, step_rate=alone)
    if math.isinf(input_rate):
        return Outcome("ok", compute_rate, peak, "compute")
    rate = (compute_rate**-SMOOTH_MIN_POWER + input_rate**-SMOOTH_MIN_POWER) ** (-1.0 / SMOOTH_MIN_POWER)
    return Outcome("ok", rate, peak, "input" if input_rate < compute_rate else "compute", None,
                   max(0.0, 1.0 - rate / compute_rate), loader_rate=input_rate, step_rate=alone)


def _step_rate(profile: Profile, c: Params, gpu: float, cpu: float, peak: float) -> float:
    """Samples/s of the step alone (``step_times`` before the loader's contention and host copy)."""
    step = max(gpu, cpu) + OVERLAP_LOSS * min(gpu, cpu)
    if c["precision"] == "fp16" and not c["cuda_graphs"]:
        step += profile.scaler_sync_ms + 0.4 * min(gpu, cpu)
    rate = c["batch_size"] * 1000.0 / step
    return rate * PRESSURE_SLOWDOWN if peak > PRESSURE_EDGE * profile.capacity_gib else rate


def trial_cost(profile: Profile, c: Params, status: str, rate: Optional[float]) -> tuple[float, float]:
    """(trial seconds, fresh compile seconds) of one trial of config ``c``: see the module doc."""
    compile_s = profile.compile_s * COMPILE_COST[c["compile"]]
    seconds = PROCESS_START_S + profile.build_s
    if status == "error":
        return seconds + compile_s / 2, compile_s / 2
    seconds += compile_s + c["num_workers"] * WORKER_START_S
    if status == "ok" and rate:
        seconds += TRIAL_SAMPLES / rate + (CAPTURE_S if c["cuda_graphs"] else 0.0)
    return seconds, compile_s


def accuracy_loss(c: Params, rng: random.Random, seed_noise: float, batch_cost: float = 0.003) -> float:
    """Modelled accuracy loss: low precision costs a little; large batches (fewer steps) cost more."""
    base = {"fp32": 0.0, "tf32": 0.0005, "fp16": 0.0015, "bf16": 0.002}[c["precision"]]
    return base + batch_cost * math.log2(c["batch_size"] / 64) + seed_noise + rng.gauss(0.0, 0.0003)


def _random_error(c: Params, rng: random.Random) -> str:
    choices = ["RuntimeError: cuDNN error: CUDNN_STATUS_EXECUTION_FAILED"]
    if c.get("compile", "off") != "off":
        choices.append("BackendCompilerFailed: backend='inductor' raised: CompilationError: at 12:4")
    if c.get("precision") == "fp16":
        choices.append("nan: NonFiniteLoss: the fp16 scaler skipped 27 of 40 steps as non-finite")
    if c.get("num_workers", 0) > 0:
        choices.append("RuntimeError: DataLoader worker (pid 4121) is killed by signal: Bus error.")
    return rng.choice(choices)


def config_key(params: Params) -> str:
    return json.dumps(params, sort_keys=True)


def generate(name: str, seed: int = 0, profile: Optional[Profile] = None, *,
             row_noise: bool = True) -> list[dict[str, Any]]:
    """The lines of table ``name``: every config of its grid, in grid order.

    Args:
        profile: The model to generate from (default: ``TABLES[name]``; the generated family passes its own).
        row_noise: Bake the profile's measurement noise into each row's throughput; False records the model's
            own throughput (a diagnostic: every other draw, failures and accuracy included, is the same).
    """
    profile = profile or TABLES[name]
    grid = profile.grid
    lines = []
    for values in itertools.product(*grid.values()):
        params = dict(zip(grid, values))
        c = {**DEFAULTS, **params}
        # Per-config RNG: a config's noise does not depend on which other configs the grid holds.
        rng = random.Random(f"{name}:{seed}:{config_key(params)}")
        out = model(profile, c)
        line: dict[str, Any] = {"params": params, "status": out.status, "throughput": None}
        if out.status == "ok" and rng.random() < profile.error_rate:
            out = Outcome("error", error=_random_error(c, rng))
            line["status"] = "error"
        if out.status == "ok":
            assert out.throughput is not None and out.peak_memory_gib is not None
            factor = math.exp(rng.gauss(0.0, profile.noise))  # drawn either way: the later draws stay the same
            line["throughput"] = round(out.throughput * (factor if row_noise else 1.0), 1)
            line["peak_memory_gib"] = round(out.peak_memory_gib * (1.0 + rng.gauss(0.0, 0.005)), 3)
            if profile.accuracy:
                # Accuracy noise is the seed's, shared by configs that train the same arithmetic.
                shared = random.Random(f"{name}:{seed}:{c['precision']}:{c['batch_size']}")
                line["accuracy_loss"] = round(
                    accuracy_loss(c, rng, shared.gauss(0.0, 0.0015), profile.batch_accuracy_cost), 4)
            if profile.loader is not None:
                line["bound"] = out.bound
                line["data_wait_fraction"] = round(out.data_wait_fraction or 0.0, 3)
                # The model's own rates, no noise drawn (the later draws stay the same).
                line["loader_rate"] = round(out.loader_rate, 1) if out.loader_rate else None
                line["step_rate"] = round(out.step_rate, 1) if out.step_rate else None
        else:
            line["error"] = out.error
        seconds, compile_s = trial_cost(profile, c, line["status"], line["throughput"])
        line["trial_seconds"] = round(seconds, 2)
        line["compile_seconds"] = round(compile_s, 2)
        lines.append(line)
    return lines


def dumps(lines: Sequence[dict[str, Any]]) -> str:
    return "".join(json.dumps(line) + "\n" for line in lines)


def best(lines: Sequence[dict[str, Any]], max_accuracy_loss: Optional[float] = None) -> Optional[dict[str, Any]]:
    """The fastest ok line (within ``max_accuracy_loss`` when given)."""
    ok = [
        line
        for line in lines
        if line["status"] == "ok"
        and (max_accuracy_loss is None or line.get("accuracy_loss", 0.0) <= max_accuracy_loss)
    ]
    return max(ok, key=lambda line: line["throughput"]) if ok else None


def summary(name: str, lines: Sequence[dict[str, Any]]) -> str:
    """Size, status counts and best config of a table, one line each."""
    counts = {s: sum(1 for line in lines if line["status"] == s) for s in ("ok", "oom", "error")}
    top = best(lines)
    text = [f"{name}: {len(lines)} configs ({', '.join(f'{v} {k}' for k, v in counts.items())})"]
    if top is not None:
        text.append(f"  best: {top['params']} -> {top['throughput']} samples/s, {top['peak_memory_gib']} GiB")
    if any("accuracy_loss" in line for line in lines):
        feasible = best(lines, 0.01)
        if feasible is not None:
            text.append(
                f"  best with accuracy_loss <= 0.01: {feasible['params']} -> {feasible['throughput']} samples/s"
            )
    return "\n".join(text)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tables.synthetic", description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"tables to write (default all: {', '.join(TABLES)})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=str(Path(__file__).parent))
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(TABLES))
    if unknown:
        parser.error(f"unknown table(s): {', '.join(unknown)}; known: {', '.join(TABLES)}")
    for name in args.names or list(TABLES):
        lines = generate(name, args.seed)
        path = Path(args.out_dir) / f"{name}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dumps(lines))
        print(summary(name, lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
