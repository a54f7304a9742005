"""Replay every committed table with each strategy and write benchmarks/results/search.md.

    python -m benchmarks.tables.search_results --trials 30 --seeds 5 --noise 0.02

Checks the search-efficiency bar on each table: the guided strategy reaches 95% of the best within 15
trials (median) and 25 (worst); where random search needs a median of more than 10 trials, random needs
at least twice as many as guided. Not a test (the tests replay small tables); this takes a minute or two.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import optuna

from autotune.search._simulate import ReplayTable, simulate

TABLES = Path(__file__).parent


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--noise", type=float, default=0.02)
    parser.add_argument("--strategies", default="guided,guided-flat,tpe,random")
    parser.add_argument("--out", default="benchmarks/results/search.md")
    parser.add_argument("tables", nargs="*", help="default: every benchmarks/tables/*.jsonl")
    args = parser.parse_args()
    paths = [Path(p) for p in args.tables] or sorted(TABLES.glob("*.jsonl"))
    strategies = args.strategies.split(",")
    lines = [
        "# Search efficiency on recorded tables",
        "",
        f"- Date: {datetime.date.today()}; optuna {optuna.__version__}",
        f"- Command: `python -m benchmarks.tables.search_results --trials {args.trials} --seeds {args.seeds} "
        f"--noise {args.noise}` (each table as `autotune simulate TABLE --trials {args.trials} --seeds {args.seeds} "
        f"--noise {args.noise} --strategies {args.strategies}`)",
        "- *to 95%*: trials until the best config as the strategy sees it (noisy) truly reaches 95% of the table's "
        f"best, median and worst over the seeds; never = {args.trials + 1}. *fraction*: the top-3 pick's true "
        f"throughput over the best after {args.trials} trials (median). The out-of-memory rule applies to every "
        "strategy alike.",
        "- Bar: guided median <= 15 and worst <= 25; where random's median > 10, random >= 2x guided.",
        "",
        "| table | rows / space | best | " + " | ".join(f"{s} to 95% (med / worst) | {s} fraction" for s in strategies)
        + " | bar |",
        "|---|---|---|" + "---:|---:|" * len(strategies) + "---|",
    ]
    failures = 0
    for path in paths:
        table = ReplayTable.load(path)
        start = time.time()
        results = {s.strategy: s for s in simulate(table, strategies=strategies, trials=args.trials,
                                                   seeds=args.seeds, noise=args.noise)}
        guided, rand = results.get("guided"), results.get("random")
        ok = guided is not None and guided.trials_to_95_median <= 15 and guided.trials_to_95_worst <= 25
        if ok and rand is not None and rand.trials_to_95_median > 10:
            ok = rand.trials_to_95_median >= 2 * guided.trials_to_95_median
        failures += not ok
        best = table.best(0.01)
        cells = []
        for s in strategies:
            r = results[s]
            cells += [f"{r.trials_to_95_median:g} / {r.trials_to_95_worst}", f"{r.best_fraction_median:.3f}"]
        lines.append(f"| {table.name} | {len(table)} / {table.size} | {best.throughput:,.0f} | " + " | ".join(cells)
                     + f" | {'met' if ok else '**missed**'} |")
        print(lines[-1], f"({time.time() - start:.1f} s)", flush=True)
    lines += ["", f"{len(paths) - failures} of {len(paths)} tables meet the bar.", ""]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines))
    print(f"wrote {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
