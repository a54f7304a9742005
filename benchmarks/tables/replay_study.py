"""A real tuner study on a recorded table: the replay workload stands in for training.

    python -m benchmarks.tables.replay_study benchmarks/tables/synthetic_oom_heavy.jsonl --trials 15

Everything but the training is real: the Optuna study in SQLite, GuidedSampler, one process per trial,
the out-of-memory rule, hopeless-trial pruning and the top-K re-measurement. The capability record claims
the GPU the table was recorded on, so no knob value is removed for want of one. Prints a markdown table of
the trials, with the PRUNED ones and their reasons. Not a test.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import optuna
import yaml

from autotune import Tuner
from autotune.hardware import Capabilities
from autotune.search._simulate import ReplayTable, replay_env

TARGET = "autotune.search._simulate:replay_train"


def space_yaml(table: ReplayTable, baseline: dict) -> dict:
    return {
        "description": f"The knobs and values of the recorded table {table.name}.",
        "knobs": {name: list(values) for name, values in table.values.items()},
        "baseline": baseline,
        "budget": {"samples": 8192, "warmup_steps": 0, "windows": 3},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("table")
    parser.add_argument("--trials", type=int, default=15)
    parser.add_argument("--noise", type=float, default=0.02)
    parser.add_argument("--baseline", default='{"precision": "fp32", "batch_size": 32}',
                        help="YAML mapping of the baseline (must be an ok row of the table)")
    args = parser.parse_args()
    table = ReplayTable.load(args.table)
    work = Path(tempfile.mkdtemp(prefix="replay-study-"))
    space = work / "space.yaml"
    space.write_text(yaml.safe_dump(space_yaml(table, yaml.safe_load(args.baseline))))
    os.environ.update(replay_env(args.table, noise=args.noise))
    caps = Capabilities(cuda=True, bf16=True, gpu_name="recorded", gpu_count=1, compile=True, cpu_count=os.cpu_count() or 1)
    url = f"sqlite:///{work}/study.db"
    result = Tuner(TARGET, space=space, n_trials=args.trials, storage=url, studies_dir=work / "studies",
                   study_name=table.name, capabilities=caps, progress=False, reference_repeats=1,
                   max_accuracy_loss=1.0).run()
    study = optuna.load_study(study_name=table.name, storage=url)
    print(f"Real study on `{table.name}` ({args.trials} trials, noise ±{args.noise:g}); "
          f"table best {table.best().throughput:,.1f}; study best {result.best.throughput:,.1f} "
          f"`{result.best.config.describe()}`\n")
    print("| # | state | status | config | throughput | reason |")
    print("|---:|---|---|---|---:|---|")
    for t in study.trials:
        a = t.user_attrs
        config = ", ".join(f"{k}={a.get('config', {}).get(k)}" for k in table.names)
        rate = a.get("throughput")
        print(f"| {t.number} | {t.state.name} | {a.get('status', '')} | {config} | "
              f"{'' if rate is None else f'{rate:,.1f}'} | {a.get('pruned_reason', a.get('error', '')) or ''} |")


if __name__ == "__main__":
    main()
