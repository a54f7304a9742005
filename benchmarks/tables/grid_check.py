"""How close the tuner came to an exhaustive coarse grid measured by hand.

    python -m benchmarks.tables.grid_check --study r50 --storage sqlite:///studies/autotune.db \
        --grid gpu0=grid-gpu0.jsonl --grid gpu1=grid-gpu1.jsonl --tuner-gpu gpu0 --out grid.md

The grid tables come from ``benchmarks.tables.sweep`` (one warm process per GPU, time-bounded windows);
the study from ``benchmarks.runners.resnet50``. Two comparisons, both printed:

- same method: the grid's own measurement of the tuner's best config against the grid's best, on the
  tuner's GPU (only when the tuner's best is a grid point);
- across methods: the tuner's measurement of its best (an isolated trial) against the grid's best.

Also: the first trial whose throughput reached 95% of the grid's best, and the grid itself as a table.
Not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any, Optional

import optuna

from autotune import TrialConfig
from autotune._records import summarize_study

GRID_KNOBS = ("precision", "channels_last", "batch_size", "cuda_graphs", "compile")
GRID_BATCHES = (128, 256, 512)  # the coarse grid; a sweep table may hold other batch sizes too


def grid_key(params: dict[str, Any]) -> tuple:
    return tuple(params.get(k) for k in GRID_KNOBS)


def load_grid(path: Path) -> dict[tuple, dict[str, Any]]:
    rows = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if row["params"].get("batch_size") in GRID_BATCHES:
                rows[grid_key(row["params"])] = row
    return rows


def _rate(row: Optional[dict[str, Any]]) -> str:
    if row is None:
        return "-"
    return f"{row['throughput']:,.0f}" if row["status"] == "ok" else row["status"]


def grid_table(grids: dict[str, dict[tuple, dict[str, Any]]], tuner_gpu: str) -> list[str]:
    """One row per precision x layout x batch, one column per graphs x compile; each cell names its GPU."""
    lines = ["| precision | channels_last | batch | eager | eager + graphs | compile | compile + graphs |",
             "|---|---|---:|---:|---:|---:|---:|"]
    merged: dict[tuple, tuple[str, dict]] = {}
    for gpu, rows in grids.items():
        for key, row in rows.items():
            # A cell measured on the tuner's GPU wins over the same cell from another GPU.
            if key not in merged or gpu == tuner_gpu:
                merged[key] = (gpu, row)
    for precision in ("fp32", "tf32", "fp16", "bf16"):
        for cl in (False, True):
            for batch in GRID_BATCHES:
                cells = []
                for compile_mode in ("off", "default"):
                    for graphs in (False, True):
                        gpu, row = merged.get((precision, cl, batch, graphs, compile_mode), ("", None))
                        mark = "" if gpu in ("", tuner_gpu) else f" ({gpu})"
                        cells.append(_rate(row) + mark)
                if any(c != "-" for c in cells):
                    lines.append(f"| {precision} | {'yes' if cl else 'no'} | {batch} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study", required=True)
    parser.add_argument("--storage", required=True)
    parser.add_argument("--grid", action="append", required=True, metavar="GPU=TABLE.jsonl")
    parser.add_argument("--tuner-gpu", required=True, help="the GPU label the tuner ran on")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    grids = {}
    for item in args.grid:
        gpu, _, path = item.partition("=")
        grids[gpu] = load_grid(Path(path))
    study = optuna.load_study(study_name=args.study, storage=args.storage)
    result = summarize_study(study)
    best = result.best
    if best is None:
        raise SystemExit("the study has no feasible trial")

    ok = [(gpu, key, row) for gpu, rows in grids.items() for key, row in rows.items() if row["status"] == "ok"]
    best_gpu, best_key, best_row = max(ok, key=lambda item: item[2]["throughput"])
    tuner_key = grid_key(best.config.to_dict())
    on_grid = grids[args.tuner_gpu].get(tuner_key)
    same_card_best = max((r for k, r in grids[args.tuner_gpu].items() if r["status"] == "ok"),
                         key=lambda r: r["throughput"])

    trials = sorted((t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE
                     and t.user_attrs.get("status") == "ok" and t.user_attrs.get("role") != "reference"),
                    key=lambda t: t.number)
    reached = next((t for t in trials if t.values[0] >= 0.95 * best_row["throughput"]), None)
    best_at = next((t for t in trials if t.number == best.number), None)

    describe = lambda key: TrialConfig(**dict(zip(GRID_KNOBS, key)), cudnn_benchmark=True).describe()  # noqa: E731
    counts = {gpu: sum(r["status"] == "ok" for r in rows.values()) for gpu, rows in grids.items()}
    lines = [
        "| quantity | value |",
        "|---|---|",
        f"| grid cells measured | {len({key for _, key, _ in ok})} distinct of 96; {sum(counts.values())} measurements "
        f"({', '.join(f'{g}: {n}' for g, n in counts.items())}) |",
        f"| grid best | {best_row['throughput']:,.0f} img/s: `{describe(best_key)}` ({best_gpu}; window spread "
        f"{_spread(best_row):.1f}%) |",
        f"| grid best on the tuner's GPU ({args.tuner_gpu}) | {same_card_best['throughput']:,.0f} img/s: "
        f"`{describe(grid_key(same_card_best['params']))}` |",
        f"| tuner's best (isolated trial) | {best.throughput:,.0f} img/s: `{best.config.describe()}` (trial #{best.number}) |",
    ]
    if on_grid is not None and on_grid["status"] == "ok":
        lines.append(f"| same method: the grid's measurement of the tuner's best / grid best on {args.tuner_gpu} | "
                     f"{on_grid['throughput']:,.0f} / {same_card_best['throughput']:,.0f} = "
                     f"**{on_grid['throughput'] / same_card_best['throughput'] * 100:.1f}%** |")
    else:
        lines.append("| same method | the tuner's best is not a grid point |")
    lines += [
        f"| across methods: tuner's best / grid best | {best.throughput:,.0f} / {best_row['throughput']:,.0f} = "
        f"**{best.throughput / best_row['throughput'] * 100:.1f}%** |",
        "| first trial at >= 95% of the grid best | "
        + (f"#{reached.number} ({reached.values[0]:,.0f} img/s)" if reached else "none") + " |",
        f"| trial that found the tuner's best | #{best.number}"
        + (f" of {len(trials)} tuner trials" if best_at else "") + " |",
        "",
        "The grid (img/s, median of 3 windows; a cell from another GPU is marked with it):",
        "",
        *grid_table(grids, args.tuner_gpu),
    ]
    text = "\n".join(lines) + "\n"
    Path(args.out).write_text(text)
    print(text)


def _spread(row: dict[str, Any]) -> float:
    windows = row.get("window_throughputs") or [row["throughput"]]
    return (max(windows) - min(windows)) / statistics.median(windows) * 100


if __name__ == "__main__":
    main()
