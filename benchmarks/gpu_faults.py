"""GPU faults in real trial processes, each followed by a normal trial on the same GPU.

    python -m benchmarks.gpu_faults OUT.md
"""

import datetime
import sys
from pathlib import Path

from autotune import Budget, TrialConfig
from autotune.hardware import probe
from autotune.trial._execute import TrialSpec
from autotune.study._isolation import run_isolated

HERE = Path(__file__).parent
NORMAL = f"{HERE / 'fault_workloads.py'}:train"
FAULTS = ["oom", "illegal_address", "device_assert"]


def main(out: Path) -> None:
    caps = probe()
    budget = Budget(samples=64 * 40, warmup_steps=8, windows=3)
    config = TrialConfig(precision="bf16", channels_last=True)

    def normal(tag: str):
        o = run_isolated(TrialSpec(NORMAL, config, budget), workdir=out.parent / "logs" / tag, timeout=120)
        return o.status, (o.measurement.throughput if o.measurement else 0.0)

    fresh_status, fresh = normal("fresh")
    rows = [f"| (fresh trial) | {fresh_status} | | {fresh:,.0f} | |"]
    for fault in FAULTS:
        o = run_isolated(TrialSpec(f"{HERE / 'fault_workloads.py'}:{fault}", config, budget),
                         workdir=out.parent / "logs" / fault, timeout=120)
        status, rate = normal(f"after-{fault}")
        rows.append(f"| {fault} | {o.status} | {o.error[:90]} | {rate:,.0f} ({status}) | {rate / fresh * 100 - 100:+.1f}% |")
        print(rows[-1], flush=True)
    text = "\n".join([
        f"Date {datetime.date.today()}; {caps.gpu_name} (driver {caps.driver}); torch {caps.torch}. "
        f"Normal trial: ResNet-50 bf16 channels_last bs64, {budget.samples} samples, median of 3 windows.",
        "",
        "| fault | recorded class | error (one line) | next trial img/s (status) | vs fresh |",
        "|---|---|---|---:|---:|",
        *rows,
    ]) + "\n"
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
