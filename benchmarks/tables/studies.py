"""Whole-study tables: each workload measured on a GPU, as a table a whole study is replayed on.

    python -m benchmarks.tables.studies [--out-dir DIR] [NAME ...]

Writes ``study_<NAME>.jsonl`` (default: beside this file) for ``autotune simulate TABLE --budget MINUTES``
(``autotune/study/_replay.py``): a first line with the study's settings (its baseline, the space's length in
samples, the setup's seconds, a process's build seconds), then one row per config of the workload's grid,
each with its throughput, its ``trial_seconds`` (build, fresh compile and the full length at its rate), its
``compile_seconds``, ``build_seconds``, ``data_wait_fraction`` and the verdict it earns by evidence length
(``verdict_at``).

Two of the tables are the recorded H200 sweeps (``gpt_h200``, ``resnet50_h200``) with a study line added:
their baseline, and a process's start of 13.3 s (``trial_seconds.py``). The others are modelled, each from
what the committed GPU records measured of it (named in ``source``): the fp32 step and the best step with the
data on the device, the per-worker rate of its DataLoader (the rate a loader-bound trial reached over its
workers), the script's own workers and batch, the build before its first step (process start, imports, the
dataset's construction) and a fresh compile. A config's rate is the smooth minimum of its step and its
loader; precision, compile, CUDA Graphs and channels_last scale the step by the recorded factors. A row's
verdict by length is what the records say of that precision on that workload: a model trained on random
augmentation has no pairing to lean on, so its low precision is ``unchecked`` below the length at which
its seeds' band can tell (modelled as half the space's length); ConvNeXt-T's was ``unchecked`` at 29% of its
length; the demo's bf16 was judged degraded on its metric.
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

HERE = Path(__file__).resolve().parent
PROCESS_START_S = 13.3  # the H200 tuner study's trial-process start (trial_seconds.py)
WARMUP_S = 2.0  # warm-up steps and the first window's ramp of a trial
WORKER_START_S = 0.15  # per DataLoader worker, once per process
COMPILE_COST = {"off": 0.0, "default": 1.0, "max-autotune-no-cudagraphs": 4.0}  # fresh compile over default's
SMOOTH = 8.0  # smooth-minimum power of the step's and the loader's rates


@dataclass(frozen=True)
class Workload:
    """One workload's recorded rates and costs (rates in samples/s, times in seconds)."""

    source: str
    step_fp32: float  # the fp32 eager step with its input free
    low_precision: float  # bf16's step over fp32's, eager
    compile: float  # compile: default's step over eager's (max-autotune-no-cudagraphs: 3% more)
    graphs: float  # CUDA Graphs' step over without, compiled
    channels_last: Optional[float]  # its step gain in low precision; None: not a knob (no 4-D activations)
    worker_rate: Optional[float]  # samples/s one DataLoader worker makes; None: the data is on the device
    script_workers: int
    build: float
    compile_s: float
    samples: int
    setup: float = 15.0
    cores: int = 16
    device_loader: bool = False  # the space offers the device-resident loader (no random augmentation)
    fp16: float = 1.02  # fp16's step over bf16's
    verdict: dict[str, dict[str, str]] = field(default_factory=dict)  # precision -> verdict_at


WORKLOADS: dict[str, Workload] = {
    "vit_s16_aug": Workload(
        source="issue 57's H100 runs of a timm ViT-S/16 (Dataset built item by item in Python, flips and crops): "
               "fp32 with 8 workers 1,172 img/s (1.14x), bf16 trials 4.2-4.7x, bf16+compile+8 workers 3,968 by "
               "hand, the same step with the data on the device 7,015; references 97 s of a 4-minute budget",
        step_fp32=1_230, low_precision=4.0, compile=1.46, graphs=1.02, channels_last=None, worker_rate=500,
        script_workers=4, build=24.0, compile_s=40.0, samples=38_400,
        verdict={"bf16": {"0.5": "equivalent"}, "fp16": {"0.5": "equivalent"}}),
    "effnet_b0": Workload(
        source="issue 57's H100 run of torchvision EfficientNet-B0 (augmentation in the Dataset, 8 pinned "
               "persistent workers): pick 3,806 img/s at 2.84x, compile 81 s",
        step_fp32=1_400, low_precision=1.9, compile=1.35, graphs=1.05, channels_last=1.12, worker_rate=560,
        script_workers=8, build=12.0, compile_s=81.0, samples=51_200),
    "vit_b32": Workload(
        source="answer-first-h200/dec06-h100-d (H100): fp32 with 8 pinned workers 1,355 img/s (24 s a trial); bf16 "
               "channels_last compile graphs with 8 workers 1,678-3,045 waiting 98%, with the data on the device "
               "7,660 (6,144 eager), fp16 8,839; a fresh compile 22-30 s",
        step_fp32=1_400, low_precision=4.4, compile=1.25, graphs=1.0, channels_last=1.0, worker_rate=260,
        script_workers=8, build=10.0, compile_s=26.0, samples=12_800, device_loader=True, fp16=1.15),
    "convnext_t": Workload(
        source="answer-first-h200/dec06-h100-c (H100): fp32 with 8 pinned workers 401 img/s; bf16 channels_last "
               "compile graphs 3,438 with 8 workers (fp16 3,351), 3,752 with the data on the device; a fresh "
               "compile 42-71 s; its verdict unchecked on 8,960 of 30,720 samples",
        step_fp32=401, low_precision=6.3, compile=1.2, graphs=1.08, channels_last=1.15, worker_rate=470,
        script_workers=8, build=12.0, compile_s=45.0, samples=30_720, device_loader=True, fp16=0.975,
        verdict={"bf16": {"1.0": "equivalent"}, "fp16": {"1.0": "equivalent"}}),
    "demo": Workload(
        source="budget-h200.md and answer-first-h200.md (H200 and H100): demo baseline 874 img/s, pick fp16 "
               "channels_last compile graphs 5,971-7,162 img/s; its bf16 prior point judged degraded on its "
               "metric",
        step_fp32=1_000, low_precision=3.3, compile=1.45, graphs=1.25, channels_last=1.25, worker_rate=None,
        script_workers=0, build=10.0, compile_s=30.0, samples=40_960,
        verdict={"bf16": {"0": "degraded"}}),
    "nanogpt": Workload(
        source="issue 57's H100 run of nanoGPT (shakespeare_char): fp16 compile graphs 11,171 seq/s at 5.79x; "
               "11,199 by hand",
        step_fp32=2_200, low_precision=3.2, compile=1.4, graphs=1.15, channels_last=None, worker_rate=None,
        script_workers=0, build=8.0, compile_s=32.0, samples=64_000),
}
# Tables beside this file (README.md): the two H200 sweeps, and the PIL-decoding CNN's modelled table.
RECORDED = {"gpt_h200": {"precision": "fp32", "batch_size": 8, "cuda_graphs": False, "compile": "off"},
            "resnet50_h200": None, "synthetic_input_bound": None}


def rate(w: Workload, c: dict[str, Any]) -> tuple[float, float, Optional[float], float]:
    """(throughput, the share of it spent waiting for input, its loader's rate alone (None: no loader to
    probe), its step's rate alone) of a config: what a trial and the loader and step probes measure."""
    low = c["precision"] != "fp32"
    step = w.step_fp32 * (w.low_precision * (w.fp16 if c["precision"] == "fp16" else 1.0) if low else 1.0)
    if c["compile"] != "off":
        step *= w.compile * (1.03 if c["compile"] == "max-autotune-no-cudagraphs" else 1.0)
        step *= w.graphs if c["cuda_graphs"] else 1.0
    elif c["cuda_graphs"]:
        step *= 1.0 + (w.graphs - 1.0) / 2  # eager graphs remove launches, not the unfused kernels
    if low and c.get("channels_last") and w.channels_last:
        step *= w.channels_last
    if w.worker_rate is None or c.get("loader") == "device":
        return step, 0.0, None, step
    workers = c["num_workers"]
    usable = w.cores - 2
    made = w.worker_rate * min(workers, usable) * (usable / workers if workers > usable else 1.0) ** 0.5
    made *= 1.05 if c["pin_memory"] else 1.0
    if workers == 0:  # loading and the step in series
        throughput = 1.0 / (1.0 / step + 1.0 / w.worker_rate)
        return throughput, 1.0 - throughput / step, w.worker_rate, step
    throughput = (step ** -SMOOTH + made ** -SMOOTH) ** (-1.0 / SMOOTH)
    return throughput, max(0.0, 1.0 - throughput / step), made, step


def grid(w: Workload) -> dict[str, list[Any]]:
    knobs: dict[str, list[Any]] = {"precision": ["fp32", "bf16", "fp16"],
                                   "compile": ["off", "default", "max-autotune-no-cudagraphs"],
                                   "cuda_graphs": [False, True]}
    if w.channels_last is not None:
        knobs["channels_last"] = [False, True]
    if w.worker_rate is not None:
        knobs["num_workers"] = sorted({w.script_workers, 8, 12, 16})
        knobs["pin_memory"] = [False, True]
    if w.device_loader:
        knobs["loader"] = ["torch", "device"]
    return knobs


def rows(name: str, w: Workload) -> list[dict[str, Any]]:
    knobs = grid(w)
    baseline = {k: v[0] for k, v in knobs.items()}
    if "num_workers" in knobs:
        baseline["num_workers"] = w.script_workers
    out: list[dict[str, Any]] = [{"study": {"baseline": baseline, "samples": w.samples, "setup_seconds": w.setup,
                                            "build_seconds": w.build, "source": w.source}}]
    for values in itertools.product(*knobs.values()):
        c = dict(zip(knobs, values))
        throughput, wait, loader_rate, step_rate = rate(w, c)
        compile_s = w.compile_s * COMPILE_COST[c["compile"]]
        seconds = w.build + compile_s + WARMUP_S + WORKER_START_S * c.get("num_workers", 0) + w.samples / throughput
        row: dict[str, Any] = {"params": c, "status": "ok", "throughput": round(throughput, 1),
                               "trial_seconds": round(seconds, 1), "compile_seconds": round(compile_s, 1),
                               "build_seconds": w.build, "data_wait_fraction": round(wait, 3),
                               "step_rate": round(step_rate, 1)}
        if loader_rate is not None:
            row["loader_rate"] = round(loader_rate, 1)
        if c["precision"] in w.verdict:
            row["verdict_at"] = w.verdict[c["precision"]]
        out.append(row)
    return out


def recorded(name: str, baseline: Optional[dict[str, Any]]) -> list[dict[str, Any]]:
    """A recorded sweep with a study line: its process start as each row's build."""
    lines = [json.loads(line) for line in (HERE / f"{name}.jsonl").read_text().splitlines() if line.strip()]
    if baseline is None:  # the slowest fp32 row
        fp32 = [r for r in lines if r.get("status") == "ok" and r["params"].get("precision") == "fp32"]
        baseline = min(fp32, key=lambda r: r["throughput"])["params"]
    study = {"baseline": baseline, "setup_seconds": 15.0, "build_seconds": PROCESS_START_S,
             "source": f"{name}.jsonl beside this file; a process's start of {PROCESS_START_S} s"}
    return [{"study": study}] + [{**r, "build_seconds": PROCESS_START_S} for r in lines]


def tables() -> dict[str, list[dict[str, Any]]]:
    out = {name: recorded(name, baseline) for name, baseline in RECORDED.items()}
    out.update({name: rows(name, w) for name, w in WORKLOADS.items()})
    return out


def write(out_dir: Path, names: Sequence[str] = ()) -> list[Path]:
    paths = []
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, lines in tables().items():
        if names and name not in names:
            continue
        path = out_dir / f"study_{name}.jsonl"
        path.write_text("".join(json.dumps(line, sort_keys=True) + "\n" for line in lines))
        paths.append(path)
    return paths


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=HERE)
    parser.add_argument("names", nargs="*")
    args = parser.parse_args(argv)
    for path in write(args.out_dir, args.names):
        print(path.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
