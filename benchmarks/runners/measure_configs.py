"""Measure named configs of a workload, each in its own isolated trial, and print a markdown table.

    python -m benchmarks.runners.measure_configs OUT.md WORKLOAD SAMPLES NAME=k:v,k:v ...

e.g. ``bf16-cl-256=precision:bf16,channels_last:true,batch_size:256``. Used for hand-measured
grids and key configs; the tuner's own search is ``benchmarks/runners/resnet50.py``.
"""

import datetime
import sys
from pathlib import Path

import yaml

from autotune import Budget, TrialConfig
from autotune.hardware import probe
from autotune.trial._execute import TrialSpec
from autotune.study._isolation import run_isolated


def parse(text: str) -> TrialConfig:
    values = {}
    for item in filter(None, text.split(",")):
        key, _, raw = item.partition(":")
        values[key] = yaml.safe_load(raw)
    return TrialConfig(**values)


def main(out: Path, workload: str, samples: int, cases: list[str]) -> None:
    caps = probe()
    lines = [
        f"Date: {datetime.date.today()}; GPU: {caps.gpu_name} (driver {caps.driver}); torch {caps.torch}; "
        f"workload {Path(workload.split(':')[0]).name}:{workload.split(':')[1]}; {samples} samples per trial.",
        "",
        "| name | config | status | img/s median | window spread | step ms | data wait | peak GiB | compile s | capture s | SM MHz mean | wall s |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for case in cases:
        name, _, spec = case.partition("=")
        config = parse(spec)
        budget = Budget(samples=samples, warmup_steps=10, windows=5)
        o = run_isolated(TrialSpec(workload, config, budget), workdir=out.parent / "logs" / name, timeout=400)
        m = o.measurement
        if m is None:
            lines.append(f"| {name} | {config.describe()} | {o.status}: {o.error[:80]} | | | | | | | | | {o.wall_seconds:.0f} |")
        else:
            lines.append(
                f"| {name} | {config.describe()} | ok | {m.throughput:,.0f} | {m.spread * 100:.1f}% | "
                f"{m.step_time * 1000:.1f} | {m.data_wait_fraction:.2f} | {m.peak_memory_gib:.1f} | "
                f"{m.compile_seconds:.1f} | {m.capture_seconds:.2f} | {m.extras.get('gpu.sm_clock_mhz.mean', '-')} | "
                f"{o.wall_seconds:.0f} |"
            )
        print(lines[-1], flush=True)
        out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4:])
