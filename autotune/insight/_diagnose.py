"""What held each trial back: input, kernel launches, compute, or memory capacity.

``diagnose`` is a pure function over plain measurements (a trial's user attributes as the tuner records
them, and those of the other trials of its study), so recorded studies can be replayed through it.
``annotate_trials`` classifies every finished trial of a live study and stores the result in the study.

The classes and the evidence each rests on:

- ``input-bound``: the step waited on the loader for a large share of the timed windows while the GPU
  was not kept busy (a wait that overlaps queued GPU work, at high utilisation, is compute-bound).
- ``launch-bound``: the GPU was busy only part of the time although no batch was waited for, so the
  host could not queue work fast enough. When the study has the same config with CUDA Graphs toggled,
  it must show graphs helping; if they do not, launches were not the limit and the trial is
  compute-bound. Kernel counts are not measured: the step time stands in for them.
- ``compute-bound``: the GPU was busy nearly all the time and nothing was waited for. Without GPU
  readings (a CPU study) this is what remains once the loader wait and the memory pattern are ruled
  out, and the label says that utilisation was not measured.
- ``memory-capacity-bound``: the trial ran out of memory, or it ran the largest batch that fit while
  the larger batches of the same precision and memory fraction ran out of memory.
- ``communication-bound``: a trial of several ranks (DDP) had its gradient all-reduce in flight for a
  large share of the timed windows (``extra:ddp.allreduce_share``, from CUDA events in the comm hook on
  GPUs, wall-clock on the CPU). When the study has the same per-rank config run as one process, the step
  must also have grown with the world size; if it did not, the all-reduce hid behind the backward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

INPUT_BOUND = "input-bound"
LAUNCH_BOUND = "launch-bound"
COMPUTE_BOUND = "compute-bound"
MEMORY_CAPACITY_BOUND = "memory-capacity-bound"
COMMUNICATION_BOUND = "communication-bound"
BOTTLENECKS = (INPUT_BOUND, LAUNCH_BOUND, COMPUTE_BOUND, MEMORY_CAPACITY_BOUND, COMMUNICATION_BOUND)

# A fifth of the timed windows spent waiting on the loader is more than any step overlap hides.
DATA_WAIT_HIGH = 0.2
# NVML utilisation is the share of time any kernel ran; below this the GPU sat idle between kernels.
UTIL_HIGH = 85.0
# CUDA Graphs "help" when the graph run of the same config is this much faster; window spread is a few %.
GRAPHS_HELP = 1.10
# The all-reduce in flight for this share of the timed windows: more than a backward pass overlaps away.
ALLREDUCE_SHARE_HIGH = 0.3
# The per-rank step of N ranks this much slower than the same per-rank config as one process: the
# communication showed in the step time (window spread is a few %).
STEP_GROWTH = 1.10
# Knobs that do not change a rank's own work: a one-process twin differs from a DDP trial only in them.
_RANK_FIELDS = ("processes_per_trial", "global_batch", "bucket_cap_mb", "gradient_as_bucket_view", "static_graph",
                "grad_compression")

# Below this mean NVML utilisation (or launch-bound) a GPU running one training process has room for more:
# packing several processes on it (processes_per_gpu, under MPS) can raise the work per GPU.
PACKING_UTIL = 50.0

# Study user attribute holding every trial's diagnosis (finished trials cannot take new attributes).
STUDY_ATTR = "diagnoses"


@dataclass(frozen=True)
class Diagnosis:
    """What held one trial back, and why autotune says so.

    Attributes:
        bottleneck: One of ``BOTTLENECKS``.
        evidence: One readable sentence with the numbers it rests on.
        numbers: The measurements behind it (only those that were measured).
        gpu_readings: Whether NVML readings were available; without them ``compute-bound`` is the
            class that remains, not a measured one.
    """

    bottleneck: str
    evidence: str
    numbers: dict[str, Any] = field(default_factory=dict)
    gpu_readings: bool = False

    @property
    def label(self) -> str:
        if self.bottleneck == COMPUTE_BOUND and not self.gpu_readings:
            return f"{COMPUTE_BOUND} (no GPU readings)"
        return self.bottleneck

    def to_dict(self) -> dict[str, Any]:
        return {"diagnosis": self.label, "bottleneck": self.bottleneck, "evidence": self.evidence,
                "numbers": dict(self.numbers), "gpu_readings": self.gpu_readings}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Diagnosis":
        return cls(bottleneck=data["bottleneck"], evidence=data["evidence"], numbers=dict(data.get("numbers", {})),
                   gpu_readings=bool(data.get("gpu_readings", False)))


def gpu_reading(m: Mapping[str, Any], name: str) -> Optional[Any]:
    """An NVML reading such as ``gpu_util_pct.mean``: the tuner stores extras as ``extra:gpu.*``."""
    for key in (f"extra:gpu.{name}", f"gpu.{name}"):
        if key in m:
            return m[key]
    return None


def _config(m: Mapping[str, Any]) -> dict[str, Any]:
    return dict(m.get("config") or {})


def _ran(m: Mapping[str, Any]) -> bool:
    # A trial pruned after its first window ran too (and fit in memory); its throughput is that window's.
    return m.get("status", "ok") in ("ok", "pruned") and (m.get("throughput") or 0) > 0


def _memory_group(config: Mapping[str, Any]) -> tuple[Any, Any]:
    # Memory per sample follows the precision; the memory fraction caps what is available.
    return config.get("precision", "fp32"), config.get("memory_fraction", 1.0)


def _graphs_twin(m: Mapping[str, Any], study: Sequence[Mapping[str, Any]]) -> Optional[Mapping[str, Any]]:
    """A measured trial of the same config with CUDA Graphs toggled."""
    config = _config(m)
    if not config:
        return None
    twin = {**config, "cuda_graphs": not config.get("cuda_graphs", False)}
    for other in study:
        if _ran(other) and _config(other) == twin:
            return other
    return None


def _one_rank_twin(m: Mapping[str, Any], study: Sequence[Mapping[str, Any]]) -> Optional[Mapping[str, Any]]:
    """A measured one-process trial with this trial's per-rank config (micro-batch and accumulation)."""
    config = _config(m)

    def per_rank(c: Mapping[str, Any]) -> dict[str, Any]:
        ranks = int(c.get("processes_per_trial", 1) or 1)
        batch = int(c.get("batch_size", 0) or 0)
        total = c.get("global_batch") or batch * ranks
        accumulation = total // (batch * ranks) if batch else 1
        return {**{k: v for k, v in c.items() if k not in _RANK_FIELDS}, "accumulation": accumulation}

    mine = per_rank(config)
    for other in study:
        oc = _config(other)
        if _ran(other) and int(oc.get("processes_per_trial", 1) or 1) == 1 and per_rank(oc) == mine:
            return other
    return None


def _communication(m: Mapping[str, Any], study: Sequence[Mapping[str, Any]],
                   numbers: dict[str, Any]) -> Optional[str]:
    """The evidence sentence when a DDP trial is communication-bound, else ``None``."""
    ranks = int(_config(m).get("processes_per_trial", 1) or 1)
    share = m.get("extra:ddp.allreduce_share", m.get("ddp.allreduce_share"))
    if ranks < 2 or share is None:
        return None
    numbers["allreduce_share"] = share
    numbers["ranks"] = ranks
    if share < ALLREDUCE_SHARE_HIGH:
        return None
    sentence = f"The gradient all-reduce of the {ranks} ranks was in flight for {share:.0%} of the timed windows"
    twin = _one_rank_twin(m, study)
    step, twin_step = m.get("step_time"), (twin or {}).get("step_time")
    if twin is not None and step and twin_step:
        growth = float(step) / float(twin_step)
        numbers["step_growth_vs_one_rank"] = round(growth, 3)
        if growth < STEP_GROWTH:
            return None  # it overlapped the backward pass: the step did not pay for it
        sentence += (f", and the step took {growth:.2f}x as long as the same per-rank config as one process "
                     f"({_which(twin)})")
    else:
        sentence += "; the study has no one-process run of the same per-rank config to show the step grew"
    return sentence + "."


def _larger_oom(m: Mapping[str, Any], study: Sequence[Mapping[str, Any]]) -> Optional[Mapping[str, Any]]:
    """The smallest measured out-of-memory batch above this trial's, when no larger batch of its memory
    group ran: this trial then ran the largest batch that fit."""
    config = _config(m)
    if "batch_size" not in config:
        return None
    group, batch = _memory_group(config), config["batch_size"]
    same = [o for o in study if _config(o) and _memory_group(_config(o)) == group]
    if any(_ran(o) and _config(o).get("batch_size", 0) > batch for o in same):
        return None
    ooms = [o for o in same if o.get("status") == "oom" and _config(o).get("batch_size", 0) > batch]
    return min(ooms, key=lambda o: _config(o)["batch_size"], default=None)


def _largest_fit(config: Mapping[str, Any], study: Sequence[Mapping[str, Any]]) -> Optional[int]:
    group = _memory_group(config)
    fits = [_config(o).get("batch_size", 0) for o in study if _ran(o) and _memory_group(_config(o)) == group]
    return max(fits, default=None)


def _number(m: Mapping[str, Any]) -> str:
    return f" (trial #{m['number']})" if "number" in m else ""


def _which(m: Mapping[str, Any]) -> str:
    return f"trial #{m['number']}" if "number" in m else "another trial"


def _group_text(config: Mapping[str, Any]) -> str:
    precision, fraction = _memory_group(config)
    return f"{precision}" + (f", memory fraction {fraction:g}" if fraction != 1.0 else "")


def diagnose(m: Mapping[str, Any], study: Sequence[Mapping[str, Any]] = ()) -> Optional[Diagnosis]:
    """Classify one trial from what it measured, with its study as context.

    Args:
        m: The trial's user attributes as the tuner records them (``status``, ``config``,
            ``throughput``, ``data_wait_fraction``, ``step_time``, NVML readings as ``extra:gpu.*``),
            optionally with ``number``.
        study: The same for every trial of the study (this one may be among them): the CUDA Graphs
            comparison and the out-of-memory pattern come from here.

    Returns:
        The diagnosis, or ``None`` when the trial measured nothing to classify (a crash, a timeout,
        a NaN, a trial pruned before its first window).
    """
    status = m.get("status", "ok")
    config = _config(m)
    if status == "infeasible":  # ruled out without a run by an out-of-memory of a smaller config
        reason = (m.get("pruned_reason") or "a smaller config ran out of memory").rstrip(".")
        return Diagnosis(MEMORY_CAPACITY_BOUND, f"Not run: {reason}.", {"batch_size": config.get("batch_size"),
                                                                        "measured": False})
    if status == "oom":
        fit = _largest_fit(config, study)
        numbers = {"batch_size": config.get("batch_size"), "precision": config.get("precision", "fp32"),
                   "largest_batch_that_fit": fit}
        sentence = f"Batch {config.get('batch_size')} ({_group_text(config)}) ran out of memory"
        sentence += f"; the largest batch of the same precision that fit was {fit}." if fit else "."
        return Diagnosis(MEMORY_CAPACITY_BOUND, sentence, numbers)
    if status not in ("ok", "pruned") or "data_wait_fraction" not in m or not m.get("throughput"):
        return None

    wait = float(m.get("data_wait_fraction") or 0.0)
    util = gpu_reading(m, "gpu_util_pct.mean")
    measured = util is not None
    numbers: dict[str, Any] = {"data_wait_fraction": round(wait, 3), "throughput": round(float(m["throughput"]), 1)}
    step_ms = float(m.get("step_time") or 0.0) * 1000
    if step_ms:
        numbers["step_ms"] = round(step_ms, 2)
    if measured:
        numbers["gpu_util_pct"] = util
        p5 = gpu_reading(m, "gpu_util_pct.p5")
        if p5 is not None:
            numbers["gpu_util_pct_p5"] = p5
    throttle = gpu_reading(m, "throttle_fraction")
    if throttle:
        numbers["throttle_fraction"] = throttle
        numbers["throttle_reasons"] = list(gpu_reading(m, "throttle_reasons") or [])
    rx = gpu_reading(m, "pcie_rx_mb_s.mean")
    if rx is not None:
        numbers["pcie_rx_mb_s"] = rx
    four_d = m.get("extra:activations_4d", m.get("activations_4d"))
    if isinstance(four_d, bool):
        numbers["activations_4d"] = four_d  # what the hints may suggest (channels_last needs 4-D activations)

    if wait >= DATA_WAIT_HIGH and measured and util >= UTIL_HIGH:
        # The host waited for batches while the GPU still ran the work queued before: loading overlapped
        # compute, and the GPU, not the loader, set the pace.
        sentence = (f"The GPU was busy {util:.0f}% of the time; the host waited on the loader for {wait:.0%} of the "
                    "timed windows, but that wait overlapped GPU work already queued, so the GPU set the pace")
        return Diagnosis(COMPUTE_BOUND, sentence + ".", numbers, measured)

    if wait >= DATA_WAIT_HIGH:
        parts = [f"The step waited on the loader for {wait:.0%} of the timed windows"]
        if measured:
            parts.append(f"the GPU was busy {util:.0f}% of the time")
        if rx is not None:
            parts.append(f"host-to-device PCIe traffic averaged {rx:,.0f} MB/s")
        return Diagnosis(INPUT_BOUND, "; ".join(parts) + ".", numbers, measured)

    communication = _communication(m, study, numbers)
    if communication is not None:
        return Diagnosis(COMMUNICATION_BOUND, communication, numbers, measured)

    oom = _larger_oom(m, study)
    if oom is not None and (not measured or util < UTIL_HIGH):
        numbers["oom_batch_size"] = _config(oom)["batch_size"]
        sentence = (f"Batch {config.get('batch_size')} is the largest that fit: batch {_config(oom)['batch_size']} "
                    f"({_group_text(config)}) ran out of memory{_number(oom)}")
        sentence += f"; the GPU was busy {util:.0f}% of the time." if measured else "; GPU utilisation was not measured."
        return Diagnosis(MEMORY_CAPACITY_BOUND, sentence, numbers, measured)

    if measured and util < UTIL_HIGH:
        sentence = f"The GPU was busy only {util:.0f}% of the time although the step waited on the loader for {wait:.0%}"
        sentence += f", at {step_ms:.1f} ms per step" if step_ms else ""
        twin = _graphs_twin(m, study)
        gain = None
        if twin is not None:
            with_graphs, without = (m, twin) if config.get("cuda_graphs") else (twin, m)
            gain = with_graphs["throughput"] / without["throughput"]
        if gain is not None and gain < GRAPHS_HELP:
            # Launch overhead is what CUDA Graphs remove; when they do not help, launches were not the limit,
            # and the utilisation reading (NVML averages over its own sample period) overstates the idle time.
            numbers["cuda_graphs_speedup"] = round(gain, 3)
            sentence = (f"Neither input ({wait:.0%} of the windows waiting on the loader) nor kernel launches (CUDA "
                        f"Graphs changed the same config only {gain:.2f}x, compared with {_which(twin)}) explain the "
                        f"{util:.0f}% utilisation reading, so the training step itself set the pace")
            return Diagnosis(COMPUTE_BOUND, sentence + ".", numbers, measured)
        if twin is None:
            sentence += "; the study has no run of the same config with CUDA Graphs toggled to confirm it"
        else:
            numbers["cuda_graphs_speedup"] = round(gain, 3)
            sentence += f"; CUDA Graphs made the same config {gain:.2f}x faster (compared with {_which(twin)})"
        return Diagnosis(LAUNCH_BOUND, sentence + ".", numbers, measured)

    if measured:
        sentence = f"The GPU was busy {util:.0f}% of the time and the step waited on the loader for only {wait:.0%}"
        if throttle:
            reasons = ", ".join(numbers["throttle_reasons"]) or "unnamed reasons"
            sentence += f"; clocks were held back in {throttle:.0%} of the samples ({reasons})"
        if oom is not None:
            sentence += f"; batch {_config(oom)['batch_size']} did not fit{_number(oom)}"
        return Diagnosis(COMPUTE_BOUND, sentence + ".", numbers, measured)

    sentence = (f"No GPU readings: the step waited on the loader for only {wait:.0%} of the timed windows and no "
                "larger batch ran out of memory, so the time went to the training step itself (utilisation was "
                "not measured).")
    return Diagnosis(COMPUTE_BOUND, sentence, numbers, measured)


def packing_hint(diagnosis: Diagnosis, config: Mapping[str, Any]) -> str:
    """When the GPU sat idle enough for co-location to pay (launch-bound, or measured busy under
    ``PACKING_UTIL``% with one process on it): the hint to pack processes, else ""."""
    if not diagnosis.gpu_readings or int(config.get("processes_per_gpu", 1)) > 1:
        return ""
    if diagnosis.bottleneck in (INPUT_BOUND, MEMORY_CAPACITY_BOUND, COMMUNICATION_BOUND):
        return ""  # the loader, memory or the all-reduce is the limit: more processes would share it
    util = diagnosis.numbers.get("gpu_util_pct")
    if diagnosis.bottleneck != LAUNCH_BOUND and (util is None or util >= PACKING_UTIL):
        return ""
    busy = f"busy {util:.0f}% of the time" if util is not None else "idle between kernels"
    return (f"The GPU was {busy} with one training process: several processes per GPU (processes_per_gpu: "
            "[1, 2, 4, 8] with mps: [false, true] in the space) can fill it, for more work per GPU.")


def next_step(diagnosis: Diagnosis, config: Mapping[str, Any]) -> str:
    """A next-step hint for a config with this diagnosis, skipping what the config already does."""
    hint = _next_step(diagnosis, config)
    packing = packing_hint(diagnosis, config)
    return f"{hint} {packing}" if packing else hint


def _next_step(diagnosis: Diagnosis, config: Mapping[str, Any]) -> str:
    c = dict(config)
    if diagnosis.bottleneck == INPUT_BOUND:
        workers = c.get("num_workers", 0)
        tips = []
        if c.get("loader") != "device":
            tips.append("loader: device to keep a small dataset with deterministic items on the device "
                        "(ctx.loader indexes its batches there)")
        tips.append("more DataLoader workers, up to the cores the process may use"
                    + (f" (it uses {workers})" if workers else " (it loads in the main process)"))
        if workers:
            tips.append("a larger prefetch_factor")
            if not c.get("persistent_workers"):
                tips.append("persistent_workers (no restart each epoch)")
        if not c.get("pin_memory"):
            tips.append("pinned memory")
        if c.get("loader") != "dali":
            tips.append("NVIDIA DALI (the `dali` extra) to decode and augment image data on the GPU")
        return f"{INPUT_BOUND}: try " + ", ".join(tips) + "."
    if diagnosis.bottleneck == LAUNCH_BOUND:
        tips = []
        if not c.get("cuda_graphs"):
            tips.append("CUDA Graphs (cuda_graphs: true)")
        if c.get("compile", "off") in ("off", "default", "max-autotune-no-cudagraphs"):
            tips.append("torch.compile to fuse kernels (mode reduce-overhead also captures graphs)")
        tips.append("a larger batch so each kernel does more work")
        return f"{LAUNCH_BOUND}: try " + ", ".join(tips) + "."
    if diagnosis.bottleneck == COMMUNICATION_BOUND:
        tips = []
        if c.get("grad_compression", "none") == "none":
            tips.append("bf16 gradient compression (grad_compression: bf16; the accuracy check judges it)")
        tips.append("another bucket_cap_mb (fewer, larger all-reduces, or earlier overlap)")
        if not c.get("gradient_as_bucket_view"):
            tips.append("gradient_as_bucket_view (no copy into the buckets)")
        if not c.get("static_graph"):
            tips.append("static_graph")
        tips.append("a larger micro-batch per rank, or accumulation (no_sync) so each all-reduce carries more work")
        return f"{COMMUNICATION_BOUND}: try " + ", ".join(tips) + "."
    if diagnosis.bottleneck == MEMORY_CAPACITY_BOUND:
        tips = []
        if c.get("precision", "fp32") in ("fp32", "tf32"):
            tips.append("bf16 autocast (half the activation memory)")
        if c.get("memory_fraction", 1.0) < 1.0:
            tips.append("a larger memory_fraction")
        tips.append("a smaller micro-batch with gradient accumulation, then larger batches as memory allows")
        if not c.get("activation_checkpointing"):
            tips.append("activation checkpointing to trade compute for memory (activation_checkpointing: true, "
                        "with ctx.checkpoint around the blocks)")
        return f"{MEMORY_CAPACITY_BOUND}: larger batches do not fit; try " + ", ".join(tips) + "."
    if not diagnosis.gpu_readings:
        return (f"{diagnosis.label}: on a CPU try cpu_threads and bf16; run the study on the target GPU "
                "for a measured diagnosis.")
    four_d = diagnosis.numbers.get("activations_4d")
    tips = []
    if c.get("precision", "fp32") in ("fp32", "tf32"):
        tips.append("bf16 autocast")
    if not c.get("channels_last") and four_d is not False:
        tips.append("channels_last")  # only a model with 4-D activations (convolutions) has a memory format
    if c.get("compile", "off") == "off":
        tips.append("torch.compile")
    if four_d is False:
        tips.append("a fused optimizer (fused=True)")  # without convolutions, the optimizer's many small kernels
    if tips:
        return f"{COMPUTE_BOUND}: the GPU is busy; less work per sample helps: try " + ", ".join(tips) + "."
    return (f"{COMPUTE_BOUND}: the GPU is busy with the cheapest precision and layout; what remains is a faster GPU "
            "or a smaller model.")


# -- live studies ----------------------------------------------------------------------------------
def measurements(study: Any) -> list[dict[str, Any]]:
    """Every COMPLETE or PRUNED trial of an Optuna study as a plain dict: its user attributes plus
    ``number`` and ``state``. The reference run recorded as trial 0 gets the NVML readings that the
    study kept with the reference measurement."""
    from optuna.trial import TrialState

    reference_extras = (study.user_attrs.get("reference_measurement") or {}).get("extras") or {}
    out = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
        m = dict(trial.user_attrs)
        if m.get("role") == "reference":
            for key, value in reference_extras.items():
                m.setdefault(f"extra:{key}", value)
        m["number"] = trial.number
        m["state"] = trial.state.name
        out.append(m)
    return out


def diagnose_study(study: Any) -> dict[int, Diagnosis]:
    """Classify every COMPLETE or PRUNED trial with the whole study as context; reads only."""
    ms = measurements(study)
    out = {}
    for m in ms:
        d = diagnose(m, ms)
        if d is not None:
            out[m["number"]] = d
    return out


def annotate_trials(study: Any) -> dict[int, Diagnosis]:
    """(Re)classify every COMPLETE or PRUNED trial and store the result in the study.

    Optuna does not let a finished trial take new user attributes, so the diagnoses go to the study's
    user attribute ``diagnoses``: ``{trial number: {"diagnosis", "bottleneck", "evidence", "numbers",
    "gpu_readings"}}``, rewritten whole each time, so a later trial can change an earlier verdict
    (a CUDA Graphs comparison, a larger batch that ran out of memory).
    """
    diagnoses = diagnose_study(study)
    study.set_user_attr(STUDY_ATTR, {str(n): d.to_dict() for n, d in sorted(diagnoses.items())})
    return diagnoses


def stored_diagnoses(study: Any) -> dict[int, Diagnosis]:
    """The diagnoses ``annotate_trials`` stored in the study."""
    return {int(n): Diagnosis.from_dict(d) for n, d in (study.user_attrs.get(STUDY_ATTR) or {}).items()}
