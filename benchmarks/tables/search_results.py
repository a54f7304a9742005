"""Replay every committed table with each strategy and write benchmarks/results/search.md.

    python -m benchmarks.tables.search_results --trials 30 --seeds 20 --noise 0.02

Checks the search-efficiency bar on each table: the guided strategy's median minutes to 95% of the best
is at most half of random's and of TPE's, and its median trials to 95% is at most 10. A table without
``trial_seconds`` is judged on trials alone (said in the table). Not a test; this takes about a minute.
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
READING = "## Reading it"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--seeds", type=int, default=20)
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
        "- *trials*: trials until the best config as the strategy sees it (noisy) truly reaches 95% of the table's "
        f"best, median / worst over the seeds; never = {args.trials + 1}. *minutes*: the trials' seconds up to "
        "that trial, from the table's `trial_seconds` (a compile at shapes and mode already compiled in the run "
        "costs 16% of its fresh compile), median / worst; never = all trials' minutes plus one median trial. "
        f"*fraction*: the top-3 pick's true throughput over the best after {args.trials} trials (median). The "
        "out-of-memory rule applies to every strategy alike.",
        "- Bar: guided's median minutes <= half of random's and of tpe's, and guided's median trials <= 10.",
        "",
        "| table | rows / space | best | " + " | ".join(f"{s} trials | {s} minutes | {s} fraction" for s in strategies)
        + " | bar |",
        "|---|---|---|" + "---:|---:|---:|" * len(strategies) + "---|",
    ]
    failures = 0
    for path in paths:
        table = ReplayTable.load(path)
        start = time.time()
        results = {s.strategy: s for s in simulate(table, strategies=strategies, trials=args.trials,
                                                   seeds=args.seeds, noise=args.noise)}
        guided = results.get("guided")
        ok = guided is not None and guided.trials_to_95_median <= 10
        verdict = "met"
        if ok and table.has_seconds:
            for other in ("random", "tpe"):
                rival = results.get(other)
                if rival is not None and (guided.minutes_to_95_median or 0) > 0.5 * (rival.minutes_to_95_median or 0):
                    ok = False
        elif ok:
            verdict = "met (trials only: no seconds)"
        failures += not ok
        best = table.best(0.01)
        cells = []
        for s in strategies:
            r = results[s]
            minutes = (f"{r.minutes_to_95_median:.1f} / {r.minutes_to_95_worst:.1f}"
                       if r.minutes_to_95_median is not None and r.minutes_to_95_worst is not None else "-")
            cells += [f"{r.trials_to_95_median:g} / {r.trials_to_95_worst}", minutes, f"{r.best_fraction_median:.3f}"]
        lines.append(f"| {table.name} | {len(table)} / {table.size} | {best.throughput:,.0f} | " + " | ".join(cells)
                     + f" | {verdict if ok else '**missed**'} |")
        print(lines[-1], f"({time.time() - start:.1f} s)", flush=True)
    lines += ["", f"{len(paths) - failures} of {len(paths)} tables meet the bar.", ""]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # The hand-written reading of the numbers, from "## Reading it" on, is kept across regenerations.
    old = out.read_text() if out.is_file() else ""
    kept = old[old.index(READING):] if READING in old else ""
    out.write_text("\n".join(lines) + ("\n" + kept if kept else ""))
    print(f"wrote {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
