"""CPU faults in real trial processes, each followed by a normal trial, for benchmarks/results/faults.md.

    python -m benchmarks.cpu_faults OUT.md
"""

import datetime
import os
import platform
import sys
from pathlib import Path

from autotune import Budget, TrialConfig
from autotune.trial._execute import TrialSpec
from autotune.study._isolation import run_isolated

HERE = Path(__file__).parent
WORKLOADS = HERE / "cpu_fault_workloads.py"
FAULTS = ["oom_torch", "oom_cuda_message", "oom_cudnn_message", "segfault", "abort", "hang", "loader_worker_hang", "nan"]


def main(out: Path) -> None:
    budget = Budget(samples=32768, warmup_steps=4, windows=3)
    config = TrialConfig(batch_size=64, num_workers=1)

    def run(fn: str, tag: str, timeout: float = 60):
        return run_isolated(TrialSpec(f"{WORKLOADS}:{fn}", config, budget), workdir=out.parent / "logs" / tag,
                            timeout=timeout)

    fresh = run("train", "fresh").measurement
    rows = [f"| (fresh trial) | ok | | {fresh.throughput:,.0f} | | {fresh.spread * 100:.0f}% |"]
    for fault in FAULTS:
        o = run(fault, fault, timeout=15)
        after = run("train", f"after-{fault}")
        m = after.measurement
        fatal = [line for line in o.stderr_tail.splitlines() if line.startswith("Fatal Python error")]
        detail = f"{o.error}; log: {fatal[0]}" if o.signal and fatal else o.error
        rows.append(f"| {fault} | {o.status} | {detail[:110]} | {m.throughput:,.0f} ({after.status}) | "
                    f"{m.throughput / fresh.throughput * 100 - 100:+.1f}% | {m.spread * 100:.0f}% |")
        print(rows[-1], flush=True)
    text = "\n".join([
        f"Date {datetime.date.today()}; CPU, {os.cpu_count()} cores; Python {platform.python_version()}. "
        "Normal trial: a two-layer MLP, batch 64, one loader worker, 32,768 samples, median of 3 windows; "
        "fault trials have a 15 s limit.",
        "",
        "| fault | recorded class | error | next trial samples/s (status) | vs fresh | next trial's window spread |",
        "|---|---|---|---:|---:|---:|",
        *rows,
    ]) + "\n"
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
