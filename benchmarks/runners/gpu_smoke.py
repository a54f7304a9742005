"""GPU smoke test: one isolated trial per knob, with evidence that the knob was in effect.

    python -m benchmarks.runners.gpu_smoke OUT_DIR

Writes OUT_DIR/smoke.md (a markdown table) and OUT_DIR/smoke.json. Not a timed test.
"""

import datetime
import json
import sys
from pathlib import Path

from autotune import Budget, TrialConfig
from autotune.hardware import probe
from autotune.trial._execute import TrialSpec
from autotune.study._isolation import run_isolated

WORKLOAD = str(Path(__file__).resolve().parents[1] / "workloads" / "smoke.py") + ":train"
BASE = TrialConfig(batch_size=64)
CASES = {
    "fp32 (TF32 off)": BASE,
    "tf32": BASE.replace(precision="tf32"),
    "bf16": BASE.replace(precision="bf16"),
    "fp16 + GradScaler": BASE.replace(precision="fp16"),
    "CUDA Graphs (fp32)": BASE.replace(cuda_graphs=True),
    "CUDA Graphs + bf16 + channels_last": BASE.replace(cuda_graphs=True, precision="bf16", channels_last=True),
    "CUDA Graphs + fp16 + GradScaler": BASE.replace(cuda_graphs=True, precision="fp16"),
    "memory fraction 0.5": BASE.replace(memory_fraction=0.5),
    "cudnn.benchmark": BASE.replace(cudnn_benchmark=True),
}


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    caps = probe()
    budget = Budget(samples=64 * 40, warmup_steps=8, windows=3)
    rows, raw = [], {}
    for name, config in CASES.items():
        outcome = run_isolated(TrialSpec(WORKLOAD, config, budget), workdir=out / "logs" / name.replace(" ", "_"),
                               timeout=300)
        raw[name] = outcome.to_dict()
        m = outcome.measurement
        if m is None:
            rows.append(f"| {name} | {config.describe()} | {outcome.status}: {outcome.error} | | | |")
            continue
        evidence = dict(m.extras, graph_replays=m.graph_replays, scaler_skips=m.scaler_skips)
        if m.capture_seconds:
            evidence["capture_seconds"] = round(m.capture_seconds, 3)
        rows.append(
            f"| {name} | {config.describe()} | {outcome.status} | {m.throughput:,.0f} | {m.spread * 100:.1f}% | "
            + ", ".join(f"{k}={v}" for k, v in evidence.items()) + " |"
        )
        print(rows[-1], flush=True)
    header = [
        f"Date: {datetime.date.today()}; GPU: {caps.gpu_name} (driver {caps.driver}); torch {caps.torch}, "
        f"CUDA {caps.cuda_version}; ResNet-50, batch 64, {budget.samples} samples per trial, "
        f"{budget.warmup_steps} warm-up steps, median of {budget.windows} windows.",
        "",
        "| case | config | status | img/s (median) | window spread | evidence |",
        "|---|---|---|---:|---:|---|",
    ]
    (out / "smoke.md").write_text("\n".join(header + rows) + "\n")
    (out / "smoke.json").write_text(json.dumps({"capabilities": caps.to_dict(), "cases": raw}, indent=2))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
