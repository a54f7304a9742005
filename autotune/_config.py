"""Typed records that cross process and storage boundaries: configs, budgets, measurements, results."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Optional

# "fp8": bf16 autocast plus torchao's float8 training on the linear layers that its size check converts
# (autotune/trial/_float8.py); it needs torch.compile for the fused casts, and a GPU of compute capability 8.9+.
Precision = Literal["fp32", "tf32", "fp16", "bf16", "fp8"]
PRECISIONS: tuple[str, ...] = ("fp32", "tf32", "fp16", "bf16", "fp8")
COMPILE_MODES: tuple[str, ...] = (
    "off",
    "default",
    "reduce-overhead",
    "max-autotune",
    "max-autotune-no-cudagraphs",
)
# What a compile covers: the whole model, or each of its repeated blocks (a transformer's layers, a ResNet
# stage's blocks: compiled once and reused) with the rest eager; see autotune/trial/_regions.py.
COMPILE_SCOPES: tuple[str, ...] = ("model", "regions")
# torch.compile modes that capture CUDA Graphs themselves, which a whole-step capture cannot wrap.
COMPILE_MODES_WITH_GRAPHS: frozenset[str] = frozenset({"reduce-overhead", "max-autotune"})
# "dali": NVIDIA DALI decodes and augments (on the GPU when there is one); see autotune/_dali.py.
# "device": a small map-style dataset with deterministic items is copied to the device once and its batches
# are indexed there, in the DataLoader's order (see autotune/trial/_resident.py).
LOADERS: tuple[str, ...] = ("torch", "dali", "device")
# Where a dataset's torchvision transforms run: in the dataset's __getitem__ on the CPU (as the script wrote
# it), or on the device, batch-wise with a per-sample random draw (see autotune/trial/_augment.py).
AUGMENTS: tuple[str, ...] = ("dataset", "device")
# How a trial's error starts when augment=device cannot serve its dataset (a KnobError).
DEVICE_AUGMENT_REFUSAL = "KnobError: augment=device: "
# Knobs that only matter for one loader: the space does not ask them for the others.
TORCH_LOADER_KNOBS: tuple[str, ...] = ("num_workers", "pin_memory", "prefetch_factor", "persistent_workers")
DALI_LOADER_KNOBS: tuple[str, ...] = ("dali_threads", "dali_prefetch")
LOADER_KNOBS: dict[str, tuple[str, ...]] = {"torch": TORCH_LOADER_KNOBS, "dali": DALI_LOADER_KNOBS, "device": ()}
# How a trial's error starts when loader=device refused its dataset (a KnobError); the walk drops the value.
DEVICE_LOADER_REFUSAL = "KnobError: loader=device: "
# The share of device memory (host memory on the CPU) that loader=device may fill with the dataset: the
# model, its activations and the optimizer state need the rest.
DEVICE_DATA_SHARE = 0.25
# The attention kernel: "auto" leaves the choice to torch; flash, efficient (memory-efficient), cudnn and math
# pin one backend of torch.nn.functional.scaled_dot_product_attention (torch.nn.attention.sdpa_kernel);
# "explicit" is attention written out (matmul, mask, softmax, matmul) by ctx.attention, the untuned form.
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "flash", "efficient", "cudnn", "math", "explicit")
# How the optimizer steps: torch's default choice, one foreach kernel per op over all tensors, or fused kernels.
OPTIMIZER_IMPLS: tuple[str, ...] = ("default", "foreach", "fused")
# How a DDP trial all-reduces its gradients: in their own dtype, or compressed to bf16 by a comm hook.
GRAD_COMPRESSIONS: tuple[str, ...] = ("none", "bf16")
# The CUDA caching allocator of the trial process: as configured, or with expandable segments, which cut the
# fragmentation that can make a larger micro-batch run out of memory. Set through ALLOC_CONF_ENV before
# CUDA initialises, in the trial process only.
ALLOCATORS: tuple[str, ...] = ("default", "expandable")
ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE_SEGMENTS = "expandable_segments:True"
# Knobs of ctx.ddp: they change the gradient all-reduce, so with one process per trial they cannot matter.
DDP_KNOBS: tuple[str, ...] = ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph", "grad_compression")

# compile_timeout: torch.compile ran past its own deadline (the compile mode is slow for this model, not broken).
# infra: the trial's surroundings failed (its log folder vanished or was unwritable, the trial server died),
# not the config: it is retried, and never reused as the result of a duplicate.
Status = Literal["ok", "pruned", "oom", "timeout", "compile_timeout", "crash", "cuda_fatal", "nan", "error", "infra"]

# "fixed": every trial trains at the study's global batch, the batch_size knob is the micro-batch and
# gradients are accumulated over global / micro micro-batches, so every trial takes the same optimizer
# steps on the same samples. "scale": the batch_size knob is the global batch (no accumulation), the user's
# learning-rate rule follows it (ctx.lr_scale), and each trial is judged against fp32 at its own global batch.
BATCH_POLICIES: tuple[str, ...] = ("fixed", "scale")
# TrialConfig fields a study sets for every trial rather than searching.
STUDY_FIELDS: tuple[str, ...] = ("batch_policy", "global_batch", "processes_per_trial", "device_data_share")


# In one loader probe, a variant whose first window runs below this share of the fastest variant measured
# before it stops there: it cannot be the pick, and a slow loader would take the longest of all to measure.
SLOW_VARIANT_SHARE = 0.5

@dataclass(frozen=True)
class TrialConfig:
    """One point of the search space: every knob autotune sets for a trial.

    The defaults are the untuned baseline: fp32 with TF32 off, batch 64, eager, one loader process.
    """

    precision: Precision = "fp32"
    batch_size: int = 64
    channels_last: bool = False
    compile: str = "off"
    cuda_graphs: bool = False
    cudnn_benchmark: bool = False
    num_workers: int = 0
    pin_memory: bool = False
    prefetch_factor: int = 2
    persistent_workers: bool = False
    memory_fraction: float = 1.0
    cpu_threads: Optional[int] = None
    loader: str = "torch"
    dali_threads: int = 4  # DALI CPU worker threads (loader=dali)
    dali_prefetch: int = 2  # DALI prefetch queue depth in batches (loader=dali)
    attention: str = "auto"  # SDPA backend inside ctx.train_step (see ATTENTION_BACKENDS)
    optimizer_impl: str = "default"  # applied by ctx.optimizer (see OPTIMIZER_IMPLS)
    activation_checkpointing: bool = False  # recompute the blocks wrapped by ctx.checkpoint in the backward
    bucket_cap_mb: int = 25  # DDP gradient bucket size (torch's default), applied by ctx.ddp
    gradient_as_bucket_view: bool = False  # DDP: gradients are views into the all-reduce buckets (no copy)
    static_graph: bool = False  # DDP: the graph is the same every step (lets DDP skip per-step bookkeeping)
    grad_compression: str = "none"  # DDP comm hook (see GRAD_COMPRESSIONS)
    batch_policy: str = "fixed"
    global_batch: Optional[int] = None  # samples per optimizer step over every rank; None: no accumulation
    processes_per_trial: int = 1  # ranks of one trial (a DDP job); batch_size is each rank's micro-batch
    processes_per_gpu: int = 1  # independent copies of the training trained at once on one device (co-location)
    mps: bool = False  # the copies run as clients of the CUDA MPS daemon (else time-sliced)
    allocator: str = "default"  # the CUDA caching allocator's segments (see ALLOCATORS)
    device_data_share: float = DEVICE_DATA_SHARE  # loader=device: the memory share the dataset may fill
    # New fields go last: the order is public (positional construction, tests/test_public_api.py).
    compile_scope: str = "model"  # what ctx.model compiles (see COMPILE_SCOPES); no effect under compile=off
    augment: str = "dataset"  # where ctx.loader's dataset's transforms run (see AUGMENTS)

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_BACKENDS)}, not {self.attention!r}")
        if self.optimizer_impl not in OPTIMIZER_IMPLS:
            raise ValueError(f"optimizer_impl must be one of {', '.join(OPTIMIZER_IMPLS)}, not {self.optimizer_impl!r}")
        if not isinstance(self.activation_checkpointing, bool):
            raise ValueError(f"activation_checkpointing must be true or false, not {self.activation_checkpointing!r}")
        if self.compile_scope not in COMPILE_SCOPES:
            raise ValueError(f"compile_scope must be one of {', '.join(COMPILE_SCOPES)}, not {self.compile_scope!r}")
        if self.augment not in AUGMENTS:
            raise ValueError(f"augment must be one of {', '.join(AUGMENTS)}, not {self.augment!r}")
        if self.allocator not in ALLOCATORS:
            raise ValueError(f"allocator must be one of {', '.join(ALLOCATORS)}, not {self.allocator!r}")
        if self.batch_policy not in BATCH_POLICIES:
            raise ValueError(f"batch_policy must be one of {', '.join(BATCH_POLICIES)}, not {self.batch_policy!r}")
        if self.grad_compression not in GRAD_COMPRESSIONS:
            raise ValueError(f"grad_compression must be one of {', '.join(GRAD_COMPRESSIONS)}, "
                             f"not {self.grad_compression!r}")
        for name in ("gradient_as_bucket_view", "static_graph"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, not {getattr(self, name)!r}")
        if not isinstance(self.mps, bool):
            raise ValueError(f"mps must be true or false, not {self.mps!r}")
        for name in ("bucket_cap_mb", "processes_per_trial", "processes_per_gpu"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, not {value!r}")
        if not isinstance(self.device_data_share, (int, float)) or isinstance(self.device_data_share, bool) \
                or not 0 < self.device_data_share <= 1:
            raise ValueError(f"device_data_share must be a fraction in (0, 1], not {self.device_data_share!r}")
        if self.processes_per_gpu > 1 and self.processes_per_trial > 1:
            raise ValueError(f"processes_per_gpu {self.processes_per_gpu} with processes_per_trial "
                             f"{self.processes_per_trial}: a DDP trial already puts one rank on each GPU, and "
                             "co-located copies of a DDP job are not supported")
        if self.processes_per_gpu * self.memory_fraction > 1 + 1e-9:
            raise ValueError(f"{self.processes_per_gpu} processes per GPU x memory_fraction {self.memory_fraction:g} "
                             "is more than the whole device")
        step = self.batch_size * self.processes_per_trial  # samples of one micro-step over every rank
        if self.global_batch is not None and (self.global_batch < step or self.global_batch % step):
            ranks = f" x {self.processes_per_trial} ranks" if self.processes_per_trial > 1 else ""
            raise ValueError(
                f"micro-batch {self.batch_size}{ranks} does not divide the global batch {self.global_batch}")

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step, over every rank."""
        return self.global_batch or self.batch_size * self.processes_per_trial

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches (of ``batch_size`` on each rank) whose gradients are accumulated into one optimizer
        step: per-rank micro-batch x accumulation x ranks = the global batch."""
        return self.global_batch_size // (self.batch_size * self.processes_per_trial)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrialConfig":
        """The config a mapping (a file's, a stored trial's) names, each value checked against its knob's values.

        Raises:
            ValueError: not a mapping, an unknown key, or a value its knob does not take; one short line.
        """
        if not isinstance(data, dict):
            raise ValueError(f"a config maps knob names to values; this is a {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k)[:40] for k in set(data) - known)
        if unknown:
            raise ValueError(f"unknown config keys: {', '.join(unknown[:5])}" + (" ..." if len(unknown) > 5 else ""))
        for name, value in data.items():
            problem = config_value_problem(name, value)
            if problem is not None:
                raise ValueError(f"{name}: {problem}")
        return cls(**data)

    def replace(self, **changes: Any) -> "TrialConfig":
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """A short human summary, e.g. ``bf16 bs256 channels_last compile=default graphs``.

        A micro-batch that accumulates reads ``bs64x8`` (global batch 512).
        """
        parts = [self.precision, f"bs{self.batch_size}"]
        if self.accumulation_steps > 1:
            parts[-1] += f"x{self.accumulation_steps}"  # micro-batch x accumulation = the global batch
        if self.channels_last:
            parts.append("channels_last")
        if self.compile != "off":
            parts.append(f"compile={self.compile}")
            if self.compile_scope != "model":
                parts.append(f"scope={self.compile_scope}")
        if self.cuda_graphs:
            parts.append("graphs")
        if self.attention != "auto":
            parts.append(f"attention={self.attention}")
        if self.optimizer_impl != "default":
            parts.append(f"optimizer={self.optimizer_impl}")
        if self.activation_checkpointing:
            parts.append("checkpointing")
        if self.allocator != "default":
            parts.append(f"allocator={self.allocator}")
        if self.processes_per_trial > 1:
            parts.append(f"ranks={self.processes_per_trial}")
            defaults = TrialConfig()
            if self.bucket_cap_mb != defaults.bucket_cap_mb:
                parts.append(f"bucket={self.bucket_cap_mb}MB")
            if self.gradient_as_bucket_view:
                parts.append("grad_view")
            if self.static_graph:
                parts.append("static_graph")
            if self.grad_compression != "none":
                parts.append(f"compress={self.grad_compression}")
        if self.processes_per_gpu > 1:
            parts.append(f"x{self.processes_per_gpu}/gpu" + (" mps" if self.mps else ""))
        elif self.mps:
            parts.append("mps")
        if self.loader == "dali":
            parts.append(f"dali threads={self.dali_threads} prefetch={self.dali_prefetch}")
        elif self.loader == "device":
            parts.append("data on device")
        else:
            parts.append(f"workers={self.num_workers}")
            if self.pin_memory:
                parts.append("pinned")
            if self.num_workers > 0 and self.prefetch_factor != 2:  # 2 is the DataLoader's default
                parts.append(f"prefetch={self.prefetch_factor}")
            if self.num_workers > 0 and self.persistent_workers:
                parts.append("persistent")
        if self.augment != "dataset":
            parts.append(f"augment={self.augment}")
        if self.memory_fraction < 1.0:
            parts.append(f"memfrac={self.memory_fraction:.3g}")
        if self.cpu_threads is not None:
            parts.append(f"threads={self.cpu_threads}")
        return " ".join(parts)

    @property
    def input_pipeline(self) -> str:
        """What the loader knobs mean for the user's own training code, in words (best_config.json)."""
        if self.augment == "device":
            return f"{self._loader_words}; {self.augmentation}"
        return self._loader_words

    @property
    def augmentation(self) -> str:
        """What ``augment`` asks of the user's own training code, in words (best_config.json)."""
        if self.augment != "device":
            return ("augment=dataset: the dataset's transforms run in its __getitem__, on the CPU, as the script "
                    "wrote it")
        return ("augment=device: serve the items before their transforms (set the dataset's transform to "
                "v2.PILToTensor() or none, so each image is a uint8 tensor) and run the same transforms on each "
                "batch on the GPU, each sample with its own random draw (crop box, flip, jitter factors) from a "
                "generator seeded by your seed; ctx.loader does both, for the torchvision transforms it "
                "recognises (RandomResizedCrop, RandomCrop, RandomHorizontalFlip, ColorJitter, Normalize, "
                "ToDtype, Resize, CenterCrop)")

    @property
    def _loader_words(self) -> str:
        if self.loader == "device":
            return ("loader=device: copy the whole dataset to the device once (collate every item, move the "
                    "tensors) and take each batch by indexing it there with a seeded permutation per epoch; "
                    "ctx.loader does this for you. It needs a map-style dataset with deterministic items (no "
                    "random augmentation) that fits in "
                    f"{self.device_data_share:.0%} of the device's memory; no DataLoader workers are used")
        if self.loader == "dali":
            return (f"loader=dali: an NVIDIA DALI pipeline with {self.dali_threads} threads and a prefetch queue "
                    f"of {self.dali_prefetch} batches (ctx.image_loader builds it)")
        persistent = ", persistent" if self.num_workers > 0 and self.persistent_workers else ""
        prefetch = f", prefetch_factor={self.prefetch_factor}" if self.num_workers > 0 else ""
        return (f"loader=torch: a DataLoader with num_workers={self.num_workers}, pin_memory={self.pin_memory}"
                f"{prefetch}{persistent}")

    @property
    def float8_training(self) -> str:
        """What ``precision=fp8`` asks of the user's own training code, in words ("" for other precisions)."""
        if self.precision != "fp8":
            return ""
        return ("precision=fp8: convert the model's linear layers with torchao before compiling it: "
                "torchao.float8.convert_to_float8_training(model, module_filter_fn=autotune.float8_filter), "
                "then model = torch.compile(model), and run forward and loss under torch.autocast('cuda', "
                "dtype=torch.bfloat16); ctx.model and ctx.train_step do all three. The filter converts a layer "
                "whose in and out features are multiples of 16 and not both small (in <= 4096 and out <= 1024, "
                "where torchao's table shows float8 slower than bf16); needs the fp8 extra (torchao)")

    @property
    def memory_allocator(self) -> str:
        """What the ``allocator`` knob asks of the user's own training code, in words."""
        if self.allocator == "expandable":
            return (f"allocator=expandable: start the training process with {ALLOC_CONF_ENV}={EXPANDABLE_SEGMENTS} "
                    "(before CUDA initialises; autotune.applied(config) sets it when CUDA has not yet)")
        return f"allocator=default: PyTorch's CUDA caching allocator as the environment configures it ({ALLOC_CONF_ENV})"

    @property
    def packing(self) -> str:
        """How the config packs the device, in words (for best_config.json and ``autotune best``)."""
        share = f"each capped at {self.memory_fraction:.3g} of the GPU's memory" if self.memory_fraction < 1.0 \
            else "no memory cap"
        if self.processes_per_gpu == 1:
            mps = ", as a CUDA MPS client" if self.mps else ""
            return f"one training process per GPU ({share}{mps})"
        mps = "under CUDA MPS (kernels of the processes run concurrently)" if self.mps \
            else "without MPS (the GPU time-slices between the processes)"
        return (f"{self.processes_per_gpu} independent training processes per GPU, {share} "
                f"(torch.cuda.set_per_process_memory_fraction), {mps}")


@dataclass(frozen=True)
class Budget:
    """How long each trial trains: the same number of samples for every config.

    Args:
        samples: Training samples per trial, warm-up included, so that accuracy is comparable.
        warmup_steps: Steps before timing starts (compile, graph capture and cache warm-up happen here).
        windows: Timed windows after warm-up; throughput is their median.
    """

    samples: int = 8192
    warmup_steps: int = 5
    windows: int = 3
    # Set by the study, never by a space (see SPACE_FIELDS). ``seconds``: a run's share of a study's budget,
    # counted from the trial process's start; ``ctx.batches`` shortens the timed windows (and so the
    # samples trained) to end inside it, and records the length it trained. ``schedule_samples``: the length
    # ``ctx.optimizer_steps`` reports when runs train fewer ``samples`` than that (every run after a
    # shortened reference), so a schedule spans the same steps in every run and the trajectories stay paired.
    seconds: Optional[float] = None
    schedule_samples: Optional[int] = None

    SPACE_FIELDS: ClassVar[tuple[str, ...]] = ("samples", "warmup_steps", "windows")

    def __post_init__(self) -> None:
        if self.samples <= 0 or self.warmup_steps < 0 or self.windows < 3:
            raise ValueError("budget needs samples > 0, warmup_steps >= 0 and windows >= 3")
        if self.seconds is not None and self.seconds <= 0:
            raise ValueError("budget.seconds must be positive")
        if self.schedule_samples is not None and self.schedule_samples < self.samples:
            raise ValueError("budget.schedule_samples must be at least its samples")

    @property
    def scheduled(self) -> int:
        """The samples a run's schedule spans (``ctx.optimizer_steps``): ``schedule_samples``, else ``samples``."""
        return self.schedule_samples or self.samples

    def steps_for(self, batch_size: int) -> int:
        return self.samples // batch_size

    def min_samples_for(self, batch_size: int) -> int:
        return batch_size * (self.warmup_steps + self.windows)


@dataclass(frozen=True)
class Measurement:
    """What one trial measured. Throughput is steady-state only: warm-up, compile and capture are apart."""

    throughput: float  # samples per second, median of the timed windows
    window_throughputs: tuple[float, ...]
    step_time: float  # seconds per step, median
    data_wait_fraction: float  # share of the timed windows spent waiting on the loader
    peak_memory_gib: float  # device allocator peak on CUDA, process peak RSS on CPU
    warmup_seconds: float
    first_step_seconds: float
    compile_seconds: float  # first step minus a steady step, when torch.compile is on
    capture_seconds: float  # CUDA Graph capture of the whole step
    samples: int
    steps: int
    metric: Optional[float] = None
    scaler_skips: int = 0
    graph_replays: int = 0
    extras: dict[str, Any] = field(default_factory=dict)
    # Training loss per optimizer step (the mean of its micro-batches), averaged over bins of ``loss_every``
    # steps when the trial took more steps than a trajectory keeps; non-finite values are kept as they are.
    losses: tuple[float, ...] = ()
    loss_every: int = 1

    @property
    def spread(self) -> float:
        """(max - min) / median of the window throughputs."""
        if not self.window_throughputs or self.throughput <= 0:
            return math.nan
        return (max(self.window_throughputs) - min(self.window_throughputs)) / self.throughput

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["window_throughputs"] = list(self.window_throughputs)
        data["losses"] = list(self.losses)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Measurement":
        data = dict(data)
        data["window_throughputs"] = tuple(data.get("window_throughputs", ()))
        data["losses"] = tuple(data.get("losses", ()))
        return cls(**data)


@dataclass(frozen=True, kw_only=True)
class CopyRun:
    """One copy of a co-located trial (``processes_per_gpu`` > 1): what it measured and when it was timed.

    ``timed_start``/``timed_end`` are wall-clock times (``time.time()``) of its first window's start and its
    last window's end; ``busy_end`` is when it stopped training (it trains on, untimed, until every copy has
    finished its windows).
    """

    index: int
    throughput: float
    timed_start: float
    timed_end: float
    busy_end: float
    losses: tuple[float, ...] = ()
    loss_every: int = 1
    metric: Optional[float] = None
    peak_memory_gib: float = 0.0
    overtime_steps: int = 0

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["losses"] = list(self.losses)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CopyRun":
        return cls(**{**data, "losses": tuple(data.get("losses", ()))})


@dataclass(frozen=True, kw_only=True)
class Colocation:
    """The copies of one co-located trial, and how well their timed windows overlapped.

    ``overlap`` is the smallest, over the copies, share of a copy's timed span during which every copy was
    training (inside its timed windows, or training on untimed after them): 1 means no copy was timed while
    another had started late or stopped. ``timed_overlap`` is stricter: the share during which every copy was
    inside its own timed windows (below 1 when the copies' windows end at different times).
    """

    copies: tuple[CopyRun, ...]
    memory_fraction: float
    mps: bool
    overlap: float
    timed_overlap: float

    @property
    def count(self) -> int:
        return len(self.copies)

    @property
    def aggregate(self) -> float:
        """Samples per second of every copy together: the trial's objective."""
        return sum(c.throughput for c in self.copies)

    @property
    def slowest(self) -> CopyRun:
        return min(self.copies, key=lambda c: c.throughput)

    @property
    def summary(self) -> str:
        """One line: the copies, the slowest, the overlap (the progress line and the report)."""
        mps = "MPS" if self.mps else "no MPS"
        return (f"{self.count} copies ({mps}), slowest copy {self.slowest.index} at {self.slowest.throughput:,.1f}/s, "
                f"overlap {self.overlap:.0%} (timed windows {self.timed_overlap:.0%})")

    def to_dict(self) -> dict[str, Any]:
        return {"copies": [c.to_dict() for c in self.copies], "memory_fraction": self.memory_fraction,
                "mps": self.mps, "overlap": self.overlap, "timed_overlap": self.timed_overlap}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Colocation":
        return cls(copies=tuple(CopyRun.from_dict(c) for c in data["copies"]), memory_fraction=data["memory_fraction"],
                   mps=data["mps"], overlap=data["overlap"], timed_overlap=data["timed_overlap"])


@dataclass(frozen=True)
class TrialOutcome:
    """A trial process's result: a measurement, or the class of its failure with the evidence."""

    status: Status
    measurement: Optional[Measurement] = None
    error: str = ""  # one line
    stderr_tail: str = ""
    signal: Optional[str] = None
    wall_seconds: float = 0.0  # the trial process from start to reaped, as the coordinator sees it
    run_seconds: float = 0.0  # inside the process: loading train_fn and running it
    colocation: Optional[Colocation] = None  # the copies of a trial of processes_per_gpu > 1

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "measurement": self.measurement.to_dict() if self.measurement else None,
            "error": self.error,
            "stderr_tail": self.stderr_tail,
            "signal": self.signal,
            "wall_seconds": self.wall_seconds,
            "run_seconds": self.run_seconds,
            "colocation": self.colocation.to_dict() if self.colocation else None,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrialOutcome":
        m = data.get("measurement")
        return cls(
            status=data["status"],
            measurement=Measurement.from_dict(m) if m else None,
            error=data.get("error", ""),
            stderr_tail=data.get("stderr_tail", ""),
            signal=data.get("signal"),
            wall_seconds=data.get("wall_seconds", 0.0),
            run_seconds=data.get("run_seconds", 0.0),
            colocation=Colocation.from_dict(data["colocation"]) if data.get("colocation") else None,
        )


@dataclass(frozen=True)
class TrialRecord:
    """One finished trial as the result reports it."""

    number: int
    config: TrialConfig
    throughput: float
    accuracy_loss: float
    status: str
    feasible: bool
    device: str = ""  # which GPU model (or CPU) measured it


# The one wording for "nothing measurably beat the baseline", in the CLI, the study note and best_config.json.
NO_FASTER_CONFIG = "no faster config found"
# How a speed-up was measured: both sides in one top-K alternation, or each from its own single run.
SPEEDUP_BASES: tuple[str, ...] = ("alternation", "single runs")


@dataclass(frozen=True)
class Result:
    """What a study found: the best feasible config, how it compares, and the Pareto set.

    The speed-up is ``best.throughput / baseline_throughput``. With ``speedup_basis == "alternation"``
    both are medians of the same top-K alternation (the baseline takes part in it) and
    ``speedup_low``/``speedup_high`` are the lowest and highest per-round ratios (winner's run over the
    baseline's run in the same round). With ``"single runs"`` both come from one run each and the spread
    is the ratio of their slowest and fastest timed windows (``min(best) / max(baseline)`` to
    ``max(best) / min(baseline)``). ``faster`` holds only when the pick is not the baseline and even the
    low end of the spread is above 1.
    """

    study_name: str
    storage: str
    best: Optional[TrialRecord]
    baseline: TrialConfig
    baseline_throughput: float
    reference_metric: Optional[float]
    metric_noise: float
    pareto: tuple[TrialRecord, ...]
    removed_knobs: dict[str, str]
    best_config_path: Optional[str] = None
    best_per_device: dict[str, TrialRecord] = field(default_factory=dict)  # when workers differ in GPU model
    speedup_low: float = math.nan
    speedup_high: float = math.nan
    speedup_basis: str = "single runs"
    speedup_rounds: int = 0  # paired rounds behind the spread ("alternation"), 0 for single runs
    colocation_warning: str = ""  # workers of this study measured on the same device or cores
    baseline_source: str = ""  # where the baseline came from: the space's YAML, or --baseline (baseline=)
    # The race's runs disagreed by this much (max / min - 1): the baseline's or a finalist's among themselves,
    # or a config's race runs against its full trial. A noisy machine, whose speed-up is a range from the
    # slowest to the fastest pairing. 0: not noisy. ``noisy_reason`` says which runs, in words.
    noisy: float = 0.0
    noisy_reason: str = ""
    # Full trials measured faster than the baseline and the pick that the accuracy verdict ruled out, in words
    # ("" when none): why a study found nothing feasible, or why its pick is slower than a config it measured.
    ruled_out_faster: str = ""

    @property
    def best_config(self) -> Optional[TrialConfig]:
        """The config to train with: the pick when it is ``faster``, else the baseline (keep it; a config
        measured slower, or inside the spread, is never recommended); None when nothing feasible was found."""
        if self.best is None:
            return None
        return self.best.config if self.faster else self.baseline

    @property
    def keep_baseline(self) -> bool:
        """Something feasible was measured, and nothing beat the baseline: train as the script does."""
        return self.best is not None and not self.faster

    @property
    def speedup(self) -> float:
        if not self.best or self.baseline_throughput <= 0:
            return math.nan
        return self.best.throughput / self.baseline_throughput

    @property
    def is_baseline(self) -> bool:
        """The pick is the baseline config itself."""
        return self.best is not None and self.best.config == self.baseline

    @property
    def faster(self) -> bool:
        """A config other than the baseline beat it by more than the measured spread."""
        return self.best is not None and not self.is_baseline and self.speedup_low > 1.0

    @property
    def verdict(self) -> str:
        """``"1.42x faster than the baseline"`` (``"1.2x to 1.6x faster ..."`` on a noisy machine), or
        ``NO_FASTER_CONFIG``."""
        if not self.faster:
            return NO_FASTER_CONFIG
        if self.noisy:  # a range, not a point: ``spread_text`` says why (the machine was noisy)
            return f"{self.speedup_low:.2f}x to {self.speedup_high:.2f}x faster than the baseline"
        return f"{self.speedup:.2f}x faster than the baseline"

    @property
    def spread_text(self) -> str:
        """What the speed-up's spread is and how it was measured, e.g. for the CLI and the study note."""
        if self.is_baseline:
            return "the pick is the baseline itself"
        if self.best is None or math.isnan(self.speedup_low):
            return "no spread was measured"
        span = f"{self.speedup_low:.2f}x-{self.speedup_high:.2f}x"
        if self.speedup_basis == "alternation":
            rounds = f"{self.speedup_rounds} round{'s' if self.speedup_rounds != 1 else ''}"
            if self.noisy:
                why = self.noisy_reason or f"the baseline's own runs in the race differed by {self.noisy:.0%}"
                # A faster pick's verdict gives the range itself ("1.2x to 1.6x faster"): said once.
                span = "" if self.faster else f" {span}"
                return (f"the machine was noisy: {why}, so the speed-up is the range{span} of every run of the "
                        f"pick against every run of the baseline ({rounds})")
            return f"per-round ratios {span} over {rounds} of the race of the finalists with the baseline"
        return f"from single runs, not measured again: their timed windows give {span}"

    @property
    def why_not_faster(self) -> str:
        """Why ``faster`` is false ("" when it is true)."""
        if self.faster:
            return ""
        if self.best is None:
            return "nothing feasible was found" + (f": {self.ruled_out_faster}" if self.ruled_out_faster else "")
        if self.is_baseline:
            return "the pick is the baseline itself"
        if math.isnan(self.speedup_low):
            return f"its {self.speedup:.2f}x has no measured spread to judge it by"
        if self.speedup <= 1.0:
            return f"it measured {self.speedup:.2f}x the baseline's throughput ({self.spread_text})"
        return f"its {self.speedup:.2f}x is inside the measured spread ({self.spread_text})"


def script_baseline_differences(declared: dict[str, Any], baseline: TrialConfig) -> dict[str, Any]:
    """The knobs where what a script's own arguments train with (``declared``, recorded by an adapter's trial
    as ``script_baseline``) differ from ``baseline``, the batch as the global batch; empty when they agree."""
    differ = {k: v for k, v in declared.items() if hasattr(baseline, k) and k != "batch_size" and getattr(baseline, k) != v}
    if declared.get("batch_size") and declared["batch_size"] != baseline.global_batch_size:
        differ = {"batch_size": declared["batch_size"], **differ}
    return differ


def alloc_conf_with(current: str, setting: str) -> str:
    """``PYTORCH_CUDA_ALLOC_CONF``'s value ``current`` with ``setting`` (``key:value``) in place of its key's entry."""
    key = setting.partition(":")[0]
    kept = [part for part in current.split(",") if part.strip() and part.partition(":")[0].strip() != key]
    return ",".join([*kept, setting])


def bin_means(values: list[float], points: int) -> tuple[list[float], int]:
    """``values`` averaged over consecutive bins so that at most ``points`` remain, and the bin size."""
    every = max(1, -(-len(values) // points))
    if every == 1:
        return list(values), 1
    return [sum(values[i:i + every]) / len(values[i:i + every]) for i in range(0, len(values), every)], every


def dumps(data: Any) -> str:
    """Canonical JSON (sorted keys) used for fingerprints and files."""
    return json.dumps(data, sort_keys=True, indent=2, default=str)


_BOOL_KNOBS = ("channels_last", "cuda_graphs", "cudnn_benchmark", "pin_memory", "persistent_workers",
               "activation_checkpointing", "gradient_as_bucket_view", "static_graph", "mps")
_CHOICE_KNOBS = {"precision": PRECISIONS, "compile": COMPILE_MODES, "compile_scope": COMPILE_SCOPES,
                 "loader": LOADERS, "attention": ATTENTION_BACKENDS, "optimizer_impl": OPTIMIZER_IMPLS,
                 "grad_compression": GRAD_COMPRESSIONS, "allocator": ALLOCATORS, "augment": AUGMENTS}


def _check_value(knob: str, value: Any) -> Optional[str]:
    if knob in _BOOL_KNOBS:
        return None if isinstance(value, bool) else f"{value!r} is not true or false"
    if knob in _CHOICE_KNOBS:
        known = _CHOICE_KNOBS[knob]
        return None if value in known else f"{value!r} is not one of {', '.join(known)}"
    if knob == "memory_fraction":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1
        return None if ok else f"{value!r} is not a fraction in (0, 1]"
    if knob == "cpu_threads" and value is None:
        return None  # null: torch's default thread count
    if not isinstance(value, int) or isinstance(value, bool):
        return f"{value!r} is not an integer"
    if knob == "batch_size":
        # Any batch the script trains at, on any device: the Tensor Core multiples of 8 are what a range of
        # batch sizes proposes (``_parse_range``), not a rule for the baseline or for sizes listed by hand.
        return None if value > 0 else f"{value} is not a positive integer"
    if knob == "num_workers":
        return None if value >= 0 else f"{value} is negative"
    if knob in ("prefetch_factor", "cpu_threads", "dali_threads", "dali_prefetch", "bucket_cap_mb", "processes_per_gpu"):
        return None if value >= 1 else f"{value} is below 1"
    raise AssertionError(knob)


def config_value_problem(name: str, value: Any) -> Optional[str]:
    """Why ``value`` is not a value of the TrialConfig field ``name`` (one short phrase), or None.

    A config read from a file (``best_config.json``, ``autotune train --config``, a replay table) is checked
    here before it trains: a mistyped precision such as ``"bf-16"`` would otherwise train fp32 under its label.
    The fields a study sets (``STUDY_FIELDS``) but ``global_batch`` are checked by ``TrialConfig`` itself.
    """
    if value is not None and not isinstance(value, (str, int, float, bool)):
        return f"is a {type(value).__name__}, not a single value"
    if name == "global_batch":
        ok = value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0)
        return None if ok else f"{_short(value)} is not a positive integer"
    if name not in _VALUE_KNOBS:
        return None
    try:
        problem = _check_value(name, value)
    except AssertionError:  # a knob the space's checks do not know yet: TrialConfig checks its own
        return None
    if problem is not None and len(problem) > 160:
        problem = _short(value) + problem[len(repr(value)):]
    return problem


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text):,} characters)"


# The knobs whose values a config read from a file is checked against: every field but those a study sets.
_VALUE_KNOBS = frozenset(f.name for f in dataclasses.fields(TrialConfig) if f.name not in STUDY_FIELDS)
