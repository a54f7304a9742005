"""Whole studies replayed on every whole-study table, before and after the planner's rules (planner.md).

    python -m benchmarks.tables.planner_results [--seeds 10] [--noise 0.02] [--budgets 3,4,5]

Each table ``benchmarks/tables/study_*.jsonl`` is replayed as ``autotune simulate TABLE --budget MINUTES
--seeds K --noise F [--rules before]`` would, and printed as markdown: per table and budget, the median and
worst ``pick_share`` over the seeds, the median share of the budget at which the first faster trial started
(``never`` where none did), and the pick's verdict (the most common over the seeds).
"""

from __future__ import annotations

import argparse
import collections
import statistics
from pathlib import Path
from typing import Optional, Sequence

from autotune.search._simulate import ReplayTable
from autotune.study._replay import replay_studies

HERE = Path(__file__).resolve().parent


def cell(document: dict) -> tuple[str, float, float, Optional[float]]:
    verdicts = collections.Counter(run["pick_verdict"] for run in document["runs"])
    first = document["first_faster_budget_share_median"]
    text = (f"{document['pick_share_median']:.3f} / {document['pick_share_worst']:.3f} / "
            f"{'never' if first is None else f'{first:.0%}'} / {verdicts.most_common(1)[0][0]}")
    return text, document["pick_share_median"], document["pick_share_worst"], first


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--noise", type=float, default=0.02)
    parser.add_argument("--budgets", default="3,4,5")
    args = parser.parse_args(argv)
    budgets = [float(b) for b in args.budgets.split(",")]
    summary: dict[tuple[str, float], list[tuple[float, float, Optional[float]]]] = collections.defaultdict(list)
    print("| table | rules | " + " | ".join(f"`--budget {b:g}`" for b in budgets) + " |")
    print("|---|---|" + "---|" * len(budgets))
    for path in sorted(HERE.glob("study_*.jsonl")):
        table = ReplayTable.load(path)
        for rules in ("before", "current"):
            cells = []
            for budget in budgets:
                document = replay_studies(table, budget_minutes=budget, seeds=args.seeds, noise=args.noise,
                                          rules=rules)
                text, median, worst, first = cell(document)
                cells.append(text)
                summary[(rules, budget)].append((median, worst, first))
            print(f"| {table.name.removeprefix('study_')} | {rules} | " + " | ".join(cells) + " |")
    print()
    print("| rules | budget | median of the tables' median pick_share | worst table's median | worst seed of any "
          "table | tables whose first faster trial started within 30% (median) |")
    print("|---|---:|---:|---:|---:|---:|")
    for (rules, budget), rows in sorted(summary.items()):
        medians = [m for m, _, _ in rows]
        within = sum(1 for _, _, f in rows if f is not None and f <= 0.30)
        print(f"| {rules} | {budget:g} | {statistics.median(medians):.3f} | {min(medians):.3f} | "
              f"{min(w for _, w, _ in rows):.3f} | {within} of {len(rows)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
