"""Bottleneck diagnosis replayed on plain measurements, and stored in a real SQLite study.

The GPU trials below are shaped like what the tuner records (user attributes, NVML readings as
``extra:gpu.*``). Throughputs, step times and data waits follow benchmarks/results/resnet50-h200-preliminary.md
where that file has them (fp32 bs64 833 img/s at 76.8 ms; bf16 channels_last bs256 4,678 img/s, with CUDA
Graphs 4,767); the utilisation and throttle readings are chosen to sit on either side of the thresholds.
"""

from __future__ import annotations

import optuna
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from autotune.insight._diagnose import (
    COMPUTE_BOUND,
    DATA_WAIT_HIGH,
    INPUT_BOUND,
    LAUNCH_BOUND,
    MEMORY_CAPACITY_BOUND,
    UTIL_HIGH,
    Diagnosis,
    annotate_trials,
    diagnose,
    next_step,
    stored_diagnoses,
)

BASE = {"precision": "fp32", "batch_size": 64, "channels_last": False, "compile": "off", "cuda_graphs": False,
        "num_workers": 0, "pin_memory": False, "memory_fraction": 1.0}


def cfg(**changes) -> dict:
    return {**BASE, **changes}


def gpu(util: float, *, p5: float = None, throttle: float = 0.0, reasons=(), rx: float = 900.0) -> dict:
    readings = {"extra:gpu.gpu_util_pct.mean": util, "extra:gpu.gpu_util_pct.p5": util - 5 if p5 is None else p5,
                "extra:gpu.sm_clock_mhz.mean": 1980.0, "extra:gpu.pcie_rx_mb_s.mean": rx, "extra:gpu.samples": 40}
    if throttle:
        readings.update({"extra:gpu.throttle_fraction": throttle, "extra:gpu.throttle_reasons": list(reasons)})
    return readings


def ok(number: int, config: dict, throughput: float, *, wait: float, step: float, readings: dict = None) -> dict:
    return {"number": number, "status": "ok", "config": config, "throughput": throughput, "data_wait_fraction": wait,
            "step_time": step, **(readings or {})}


# One replayed ResNet-50 study on an H200.
REFERENCE = ok(0, cfg(), 833.0, wait=0.0, step=0.0768, readings=gpu(97.0))
LOADER_W0 = ok(1, cfg(precision="bf16", batch_size=256, channels_last=True), 2650.0, wait=0.46, step=0.0966,
               readings=gpu(52.0, rx=4100.0))
BF16_256 = ok(2, cfg(precision="bf16", batch_size=256, channels_last=True, num_workers=8, pin_memory=True), 4678.0,
              wait=0.0, step=0.0547, readings=gpu(98.0, throttle=0.3, reasons=["sw_power_cap"]))
BF16_256_GRAPHS = ok(3, cfg(precision="bf16", batch_size=256, channels_last=True, num_workers=8, pin_memory=True,
                            cuda_graphs=True), 4767.0, wait=0.0, step=0.0537, readings=gpu(99.0))
SMALL = ok(4, cfg(precision="bf16", batch_size=32, channels_last=True, num_workers=8, pin_memory=True), 2100.0,
           wait=0.01, step=0.0152, readings=gpu(61.0))
SMALL_GRAPHS = ok(5, cfg(precision="bf16", batch_size=32, channels_last=True, num_workers=8, pin_memory=True,
                         cuda_graphs=True), 2950.0, wait=0.01, step=0.0108, readings=gpu(90.0))
FP32_512 = ok(6, cfg(batch_size=512), 845.0, wait=0.0, step=0.606, readings=gpu(80.0))
FP32_1024_OOM = {"number": 7, "status": "oom", "config": cfg(batch_size=1024), "throughput": 0.0,
                 "data_wait_fraction": 0.0, "error": "torch.OutOfMemoryError: CUDA out of memory"}
STUDY = [REFERENCE, LOADER_W0, BF16_256, BF16_256_GRAPHS, SMALL, SMALL_GRAPHS, FP32_512, FP32_1024_OOM]


def test_input_bound_when_the_step_waits_on_the_loader() -> None:
    d = diagnose(LOADER_W0, STUDY)
    assert d.bottleneck == INPUT_BOUND and d.label == INPUT_BOUND and d.gpu_readings
    assert "46% of the timed windows" in d.evidence and "busy 52%" in d.evidence and "4,100 MB/s" in d.evidence
    assert d.numbers["data_wait_fraction"] == 0.46 and d.numbers["gpu_util_pct"] == 52.0
    hint = next_step(d, LOADER_W0["config"])
    assert hint.startswith("input-bound: try") and "DALI" in hint and "main process" in hint and "pinned" in hint
    # Workers already in use and pinned: the hint says how many and does not suggest pinning again.
    pinned = next_step(d, {**LOADER_W0["config"], "num_workers": 8, "pin_memory": True})
    assert "it uses 8" in pinned and "pinned" not in pinned


def test_launch_bound_confirmed_by_the_cuda_graphs_twin() -> None:
    d = diagnose(SMALL, STUDY)
    assert d.bottleneck == LAUNCH_BOUND
    assert d.numbers["cuda_graphs_speedup"] == pytest.approx(2950 / 2100, abs=1e-3)
    assert "busy only 61%" in d.evidence and "15.2 ms per step" in d.evidence
    assert "CUDA Graphs made the same config 1.40x faster (compared with trial #5)" in d.evidence
    # The twin itself, with graphs on and 90% busy, is compute-bound.
    assert diagnose(SMALL_GRAPHS, STUDY).bottleneck == COMPUTE_BOUND
    assert "CUDA Graphs (cuda_graphs: true)" in next_step(d, SMALL["config"])
    assert "cuda_graphs: true" not in next_step(d, SMALL_GRAPHS["config"])  # it has them already


def test_launch_bound_says_what_the_study_cannot_confirm() -> None:
    alone = diagnose(SMALL, [s for s in STUDY if s is not SMALL_GRAPHS])
    assert alone.bottleneck == LAUNCH_BOUND and "cuda_graphs_speedup" not in alone.numbers
    assert "no run of the same config with CUDA Graphs toggled" in alone.evidence
    # When the graphs twin shows no gain, launches were not the limit: the low reading is not launch-bound.
    no_gain = {**SMALL_GRAPHS, "throughput": 2150.0}
    weak = diagnose(SMALL, [SMALL, no_gain])
    assert weak.bottleneck == COMPUTE_BOUND and weak.numbers["cuda_graphs_speedup"] < 1.1
    assert "Neither input" in weak.evidence and "kernel launches" in weak.evidence


def test_a_loader_wait_that_overlaps_a_busy_gpu_is_compute_bound() -> None:
    # Recorded on the H200 (benchmarks/results/observe): fp32 bs64 with no loader worker waited 66% of the
    # windows on the loader while the GPU was 95% busy, at 786 img/s against 833 on GPU-side data.
    h200 = ok(0, cfg(), 785.9, wait=0.66, step=0.0814, readings=gpu(95.3))
    d = diagnose(h200)
    assert d.bottleneck == COMPUTE_BOUND and "overlapped" in d.evidence
    starved = ok(1, cfg(precision="bf16", batch_size=256), 3843.4, wait=0.54, step=0.0666, readings=gpu(77.4))
    assert diagnose(starved).bottleneck == INPUT_BOUND


def test_compute_bound_with_throttling_and_the_recorded_graphs_gain() -> None:
    d = diagnose(BF16_256, STUDY)
    assert d.bottleneck == COMPUTE_BOUND and d.label == COMPUTE_BOUND and d.gpu_readings
    assert "busy 98%" in d.evidence and "30% of the samples (sw_power_cap)" in d.evidence
    assert d.numbers["throttle_reasons"] == ["sw_power_cap"]
    assert d.numbers["data_wait_fraction"] == 0.0
    assert "compute-bound" in next_step(d, BF16_256["config"]) and "torch.compile" in next_step(d, BF16_256["config"])
    assert diagnose(REFERENCE, STUDY).bottleneck == COMPUTE_BOUND  # 97% busy at batch 64
    done = next_step(d, {**BF16_256["config"], "compile": "default"})
    assert "faster GPU" in done


def test_memory_capacity_bound_from_the_out_of_memory_pattern() -> None:
    oom = diagnose(FP32_1024_OOM, STUDY)
    assert oom.bottleneck == MEMORY_CAPACITY_BOUND
    assert oom.evidence == "Batch 1024 (fp32) ran out of memory; the largest batch of the same precision that fit was 512."
    largest = diagnose(FP32_512, STUDY)  # 80% busy at the largest fp32 batch that fit
    assert largest.bottleneck == MEMORY_CAPACITY_BOUND and largest.numbers["oom_batch_size"] == 1024
    assert "largest that fit: batch 1024 (fp32) ran out of memory (trial #7)" in largest.evidence
    assert "bf16 autocast" in next_step(largest, FP32_512["config"])
    # A smaller fp32 batch is not at the limit; the bf16 trials are another memory group.
    assert diagnose(REFERENCE, STUDY).bottleneck != MEMORY_CAPACITY_BOUND
    assert diagnose(BF16_256, STUDY).bottleneck == COMPUTE_BOUND
    # An out-of-memory under a smaller memory fraction says nothing about the full-memory trials.
    capped = {**FP32_1024_OOM, "number": 8, "config": cfg(batch_size=1024, memory_fraction=0.1)}
    assert diagnose(FP32_512, [FP32_512, capped]).bottleneck != MEMORY_CAPACITY_BOUND
    assert "memory fraction 0.1" in diagnose(capped, [FP32_512, capped]).evidence


def test_cpu_study_is_classified_from_what_was_measured() -> None:
    # A CPU study has no NVML readings: data wait and the out-of-memory pattern are all there is.
    cpu = [ok(0, cfg(), 1800.0, wait=0.05, step=0.035), ok(1, cfg(batch_size=128), 3300.0, wait=0.08, step=0.039),
           {"number": 2, "status": "oom", "config": cfg(batch_size=256), "throughput": 0.0, "data_wait_fraction": 0.0},
           ok(3, cfg(num_workers=1), 900.0, wait=DATA_WAIT_HIGH + 0.3, step=0.07)]
    plain = diagnose(cpu[0], cpu)
    assert plain.bottleneck == COMPUTE_BOUND and not plain.gpu_readings
    assert plain.label == "compute-bound (no GPU readings)"
    assert "utilisation was not measured" in plain.evidence and "busy" not in plain.evidence
    assert not any(k.startswith("gpu") for k in plain.numbers)
    assert "measured diagnosis" in next_step(plain, cpu[0]["config"])
    limit = diagnose(cpu[1], cpu)
    assert limit.bottleneck == MEMORY_CAPACITY_BOUND and "GPU utilisation was not measured" in limit.evidence
    assert diagnose(cpu[2], cpu).bottleneck == MEMORY_CAPACITY_BOUND
    waiting = diagnose(cpu[3], cpu)
    assert waiting.label == INPUT_BOUND and waiting.evidence == "The step waited on the loader for 50% of the timed windows."


@pytest.mark.parametrize("status", ["timeout", "crash", "cuda_fatal", "nan", "error"])
def test_failures_without_a_measurement_are_not_classified(status: str) -> None:
    failed = {"number": 9, "status": status, "config": cfg(), "throughput": 0.0, "data_wait_fraction": 0.0}
    assert diagnose(failed, STUDY + [failed]) is None


def test_pruned_trials_are_classified_from_their_partial_measurement() -> None:
    pruned = {**LOADER_W0, "number": 10, "status": "pruned", "pruned_reason": "pruned: first window ran at 900/s"}
    assert diagnose(pruned, STUDY).bottleneck == INPUT_BOUND
    early = {"number": 11, "status": "pruned", "config": cfg(), "pruned_reason": "stopped before any window"}
    assert diagnose(early, STUDY) is None
    ruled_out = {"number": 12, "status": "infeasible", "config": cfg(batch_size=2048),
                 "pruned_reason": "batch 1024 ran out of memory at fp32 (trial 7)"}
    d = diagnose(ruled_out, STUDY)
    assert d.bottleneck == MEMORY_CAPACITY_BOUND and d.numbers["measured"] is False
    assert d.evidence == "Not run: batch 1024 ran out of memory at fp32 (trial 7)."
    # A trial pruned after its first window did run: it fit in memory.
    pruned_512 = {**FP32_512, "number": 13, "status": "pruned"}
    assert "that fit was 512" in diagnose(FP32_1024_OOM, [pruned_512, FP32_1024_OOM]).evidence


def test_thresholds_decide_at_their_edges() -> None:
    at = ok(0, cfg(), 1000.0, wait=DATA_WAIT_HIGH, step=0.05, readings=gpu(UTIL_HIGH - 1))
    assert diagnose(at).bottleneck == INPUT_BOUND
    assert diagnose({**at, "extra:gpu.gpu_util_pct.mean": UTIL_HIGH}).bottleneck == COMPUTE_BOUND
    below = ok(0, cfg(), 1000.0, wait=DATA_WAIT_HIGH - 0.01, step=0.05, readings=gpu(UTIL_HIGH))
    assert diagnose(below).bottleneck == COMPUTE_BOUND
    assert diagnose({**below, "extra:gpu.gpu_util_pct.mean": UTIL_HIGH - 1}).bottleneck == LAUNCH_BOUND


def test_annotate_trials_stores_every_diagnosis_in_a_sqlite_study(tmp_path) -> None:
    study = optuna.create_study(study_name="replayed", storage=f"sqlite:///{tmp_path}/replay.db",
                                directions=["maximize", "minimize"])
    distributions = {"batch_size": CategoricalDistribution([32, 64, 256, 512, 1024]),
                     "cuda_graphs": CategoricalDistribution([False, True])}
    # The reference run keeps its NVML readings with the study, not on trial 0 (as the tuner records it).
    reference = {k: v for k, v in REFERENCE.items() if not k.startswith("extra:")} | {"role": "reference"}
    study.set_user_attr("reference_measurement", {"extras": {k[len("extra:"):]: v for k, v in REFERENCE.items()
                                                             if k.startswith("extra:")}})
    for m in [reference, SMALL, FP32_1024_OOM]:
        attrs = {k: v for k, v in m.items() if k != "number"}
        params = {"batch_size": m["config"]["batch_size"], "cuda_graphs": m["config"]["cuda_graphs"]}
        values = [m["throughput"], 0.0 if m["status"] == "ok" else float("inf")]
        study.add_trial(optuna.trial.create_trial(params=params, distributions=distributions, values=values,
                                                  user_attrs=attrs))
    study.add_trial(optuna.trial.create_trial(state=TrialState.PRUNED, params={"batch_size": 512, "cuda_graphs": False},
                                              distributions=distributions,
                                              user_attrs={"status": "pruned", "config": cfg(batch_size=512)}))

    first = annotate_trials(study)
    assert set(first) == {0, 1, 2}  # the pruned trial measured nothing
    assert first[0].bottleneck == COMPUTE_BOUND and first[0].gpu_readings  # readings from the study
    assert first[1].bottleneck == LAUNCH_BOUND and "no run of the same config" in first[1].evidence
    reopened = optuna.load_study(study_name="replayed", storage=f"sqlite:///{tmp_path}/replay.db")
    stored = reopened.user_attrs["diagnoses"]
    assert stored["2"]["diagnosis"] == MEMORY_CAPACITY_BOUND and stored["1"]["bottleneck"] == LAUNCH_BOUND
    assert stored_diagnoses(reopened) == first

    # A later trial changes an earlier verdict: the whole study is the context.
    attrs = {k: v for k, v in SMALL_GRAPHS.items() if k != "number"}
    study.add_trial(optuna.trial.create_trial(params={"batch_size": 32, "cuda_graphs": True},
                                              distributions=distributions, values=[SMALL_GRAPHS["throughput"], 0.0],
                                              user_attrs=attrs))
    second = annotate_trials(study)
    assert "compared with trial #4" in second[1].evidence
    assert stored_diagnoses(optuna.load_study(study_name="replayed", storage=f"sqlite:///{tmp_path}/replay.db"))[1] == second[1]


def test_diagnosis_round_trips_through_a_dict() -> None:
    d = diagnose(BF16_256, STUDY)
    assert Diagnosis.from_dict(d.to_dict()) == d
    assert d.to_dict()["diagnosis"] == d.label
