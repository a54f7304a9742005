"""Add ``trial_seconds`` and ``compile_seconds`` to the H200 sweep tables from their recorded fields.

    python -m benchmarks.tables.trial_seconds benchmarks/tables/resnet50_h200.jsonl benchmarks/tables/gpt_h200.jsonl

The sweep measured every config inside one process, reusing a compiled model across the two
``cuda_graphs`` variants and the inductor caches across configs, so its ``seconds`` (build, warm-up,
compile and windows of one config) is not what a tuner trial pays. A trial runs in its own process:

- ``compile_seconds``: the fresh compile of the row's compile group (shapes and mode,
  ``autotune.search._cost.compile_group``): the largest ``compile_s`` the sweep recorded in that group,
  which is the one that compiled from cold; 0 without a compile;
- ``trial_seconds = PROCESS_START_S + (seconds - compile_s) + compile_seconds``: the sweep's time without
  its own (possibly cached) compile, plus the fresh compile, plus the trial process's start.

``PROCESS_START_S`` is the median, over the three trials of the H200 ResNet-50 tuner study
(``benchmarks/results/resnet50-h200.md``) whose config the sweep also measured, of the trial's wall
seconds minus its compile minus the sweep's ``seconds - compile_s`` for the same config: 19.6, 11.5 and
13.3 s. Rerunning the script rewrites the two fields from the same inputs (idempotent).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from autotune.search._cost import compile_group

PROCESS_START_S = 13.3


def with_seconds(rows: list[dict]) -> list[dict]:
    """The rows with ``trial_seconds`` and ``compile_seconds`` derived as the module doc says."""
    fresh: dict[str, float] = {}
    for row in rows:
        group = compile_group(row["params"])
        if group is not None and row.get("compile_s") is not None:
            fresh[group] = max(fresh.get(group, 0.0), row["compile_s"])
    out = []
    for row in rows:
        row = dict(row)
        group = compile_group(row["params"])
        compile_seconds = fresh.get(group, 0.0) if group is not None else 0.0
        own = row.get("compile_s") or 0.0
        row["compile_seconds"] = round(compile_seconds, 2)
        row["trial_seconds"] = round(PROCESS_START_S + row["seconds"] - own + compile_seconds, 2)
        out.append(row)
    return out


def main(argv: list[str]) -> int:
    for name in argv:
        path = Path(name)
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        rows = with_seconds(rows)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        seconds = sorted(r["trial_seconds"] for r in rows)
        print(f"{path.name}: {len(rows)} rows, trial seconds {seconds[0]:.1f} to {seconds[-1]:.1f} "
              f"(median {seconds[len(seconds) // 2]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
