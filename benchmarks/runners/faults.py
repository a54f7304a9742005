"""Faults in real trial processes, each followed by a normal trial, for benchmarks/results/faults.md.

    python -m benchmarks.runners.faults cpu OUT.md    # on any machine
    python -m benchmarks.runners.faults gpu OUT.md    # on a GPU host

A workload is a module of ``benchmarks/workloads/`` with a normal ``train`` and one function per fault;
the runner records how each fault was classified and what the next normal trial measured.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from autotune import Budget, TrialConfig
from autotune.study._isolation import run_isolated
from autotune.trial._execute import TrialSpec

WORKLOADS = Path(__file__).resolve().parent.parent / "workloads"


@dataclass(frozen=True)
class FaultWorkload:
    """One workload's faults and the settings of its normal trial."""

    module: Path
    faults: tuple[str, ...]
    config: TrialConfig
    budget: Budget
    fault_timeout: float
    normal_timeout: float
    describe: Callable[[Budget], str]


def _cpu_setting(budget: Budget) -> str:
    return (f"CPU, {os.cpu_count()} cores; Python {platform.python_version()}. Normal trial: a two-layer MLP, "
            f"batch 64, one loader worker, {budget.samples:,} samples, median of 3 windows; fault trials have a 15 s limit.")


def _gpu_setting(budget: Budget) -> str:
    from autotune.hardware import probe

    caps = probe()
    return (f"{caps.gpu_name} (driver {caps.driver}); torch {caps.torch}. "
            f"Normal trial: ResNet-50 bf16 channels_last bs64, {budget.samples} samples, median of 3 windows.")


KINDS = {
    "cpu": FaultWorkload(
        module=WORKLOADS / "cpu_faults.py",
        faults=("oom_torch", "oom_cuda_message", "oom_cudnn_message", "segfault", "abort", "hang",
                "loader_worker_hang", "nan"),
        config=TrialConfig(batch_size=64, num_workers=1),
        budget=Budget(samples=32768, warmup_steps=4, windows=3),
        fault_timeout=15, normal_timeout=60, describe=_cpu_setting,
    ),
    "gpu": FaultWorkload(
        module=WORKLOADS / "gpu_faults.py",
        faults=("oom", "illegal_address", "device_assert"),
        config=TrialConfig(precision="bf16", channels_last=True),
        budget=Budget(samples=64 * 40, warmup_steps=8, windows=3),
        fault_timeout=120, normal_timeout=120, describe=_gpu_setting,
    ),
}


def main(kind: str, out: Path) -> None:
    if kind not in KINDS:
        raise SystemExit(f"workload must be one of {', '.join(KINDS)}, not {kind!r}")
    w = KINDS[kind]

    def run(fn: str, tag: str, timeout: float):
        return run_isolated(TrialSpec(f"{w.module}:{fn}", w.config, w.budget), workdir=out.parent / "logs" / tag,
                            timeout=timeout)

    fresh = run("train", "fresh", w.normal_timeout)
    fresh_rate = fresh.measurement.throughput if fresh.measurement else 0.0
    spread = f"{fresh.measurement.spread * 100:.0f}%" if fresh.measurement else ""
    rows = [f"| (fresh trial) | {fresh.status} | | {fresh_rate:,.0f} | | {spread} |"]
    for fault in w.faults:
        o = run(fault, fault, w.fault_timeout)
        after = run("train", f"after-{fault}", w.normal_timeout)
        rate = after.measurement.throughput if after.measurement else 0.0
        fatal = [line for line in o.stderr_tail.splitlines() if line.startswith("Fatal Python error")]
        detail = f"{o.error}; log: {fatal[0]}" if o.signal and fatal else o.error
        vs = f"{rate / fresh_rate * 100 - 100:+.1f}%" if fresh_rate else ""
        after_spread = f"{after.measurement.spread * 100:.0f}%" if after.measurement else ""
        rows.append(f"| {fault} | {o.status} | {detail[:110]} | {rate:,.0f} ({after.status}) | {vs} | {after_spread} |")
        print(rows[-1], flush=True)
    text = "\n".join([
        f"Date {datetime.date.today()}; {w.describe(w.budget)}",
        "",
        "| fault | recorded class | error (one line) | next trial samples/s (status) | vs fresh | next trial's window spread |",
        "|---|---|---|---:|---:|---:|",
        *rows,
    ]) + "\n"
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python -m benchmarks.runners.faults cpu|gpu OUT.md")
    main(sys.argv[1], Path(sys.argv[2]))
