"""Replay strategies on the generated table family (``family.py``) and summarise trials and minutes to 95%.

    python -m benchmarks.tables.family_search [--count 50] [--first-seed 0] [--seeds 3] [--trials 30]
        [--noise 0.02] [--jobs 2] [--no-row-noise] [--probes] [--no-diagnosis]

Prints one line per table (median / worst trials and median minutes to 95% of each strategy) and the
family's summary: the median over every run, the worst run, and how many tables meet the per-table targets
(guided's median trials <= 5, worst <= 12, median minutes <= half of TPE's and of random's). Not a test.
``--first-seed 1000`` replays a held-out family; ``--no-row-noise`` the same tables without the per-row noise
baked into them, so 95% is of the model's best rather than of a line that noise lifted (the replay's own
``--noise`` still applies); ``--probes`` with the loop's loader probes (``ReplayProbes``) for every strategy.
The issue's bar is read with both, as a study runs (benchmarks/results/search.md, round 5).
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from typing import Any, Optional, Sequence

from autotune.search._simulate import simulate
from benchmarks.tables import family

MEDIAN_TARGET, WORST_TARGET, MINUTES_SHARE = 5, 12, 0.5


def measure(seed: int, strategies: Sequence[str], seeds: int, trials: int, noise: float,
            row_noise: bool = True, probes: bool = False, diagnosis: bool = True) -> dict[str, Any]:
    """Per strategy on table ``family-<seed>``: trials and minutes to 95% of every replay seed (``diagnosis``
    False: the table without its diagnosis fields, ``ReplayTable.without_diagnosis``)."""
    table = family.table(seed, row_noise=row_noise)
    if not diagnosis:
        table = table.without_diagnosis()
    out: dict[str, Any] = {"table": table.name, "kind": family.profile(seed).description.split(": ")[1],
                           "size": table.size}
    for summary in simulate(table, strategies=strategies, trials=trials, seeds=seeds, noise=noise, probes=probes):
        out[summary.strategy] = {"trials": [r.trials_to_95 for r in summary.runs],
                                 "fraction": [r.best_fraction for r in summary.runs],
                                 "minutes": [r.minutes_to_95 or 0.0 for r in summary.runs]}
    return out


def _job(args: tuple[int, Sequence[str], int, int, float, bool, bool, bool]) -> dict[str, Any]:
    return measure(*args)


def run(count: int = 50, strategies: Sequence[str] = ("guided", "tpe", "random"), seeds: int = 3,
        trials: int = 30, noise: float = 0.02, jobs: int = 1, first_seed: int = 0,
        row_noise: bool = True, probes: bool = False, diagnosis: bool = True) -> list[dict[str, Any]]:
    """``measure`` on the family's ``count`` tables from ``first_seed``, ``jobs`` at a time."""
    work = [(seed, tuple(strategies), seeds, trials, noise, row_noise, probes, diagnosis)
            for seed in family.seeds(count, first_seed)]
    if jobs <= 1:
        return [_job(w) for w in work]
    with multiprocessing.Pool(jobs) as pool:
        return pool.map(_job, work)


def meets(row: dict[str, Any]) -> Optional[bool]:
    """Whether guided meets the per-table targets on ``row`` (None without TPE and random beside it)."""
    guided = row["guided"]
    ok = statistics.median(guided["trials"]) <= MEDIAN_TARGET and max(guided["trials"]) <= WORST_TARGET
    for rival in ("tpe", "random"):
        if rival not in row:
            return None
        ok = ok and statistics.median(guided["minutes"]) <= MINUTES_SHARE * statistics.median(row[rival]["minutes"])
    return ok


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tables.family_search", description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=50)
    parser.add_argument("--first-seed", type=int, default=0, help="1000: the held-out family")
    parser.add_argument("--no-row-noise", action="store_true", help="tables without their per-row noise")
    parser.add_argument("--probes", action="store_true", help="the loop's loader probes while input-bound")
    parser.add_argument("--no-diagnosis", action="store_true",
                        help="tables without data_wait_fraction and the probes' rates")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--noise", type=float, default=0.02)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--strategies", default="guided,tpe,random")
    args = parser.parse_args(argv)
    strategies = args.strategies.split(",")
    start = time.time()
    rows = run(args.count, strategies, args.seeds, args.trials, args.noise, args.jobs, args.first_seed,
               not args.no_row_noise, args.probes, not args.no_diagnosis)
    print("| table | kind | space | " + " | ".join(f"{s} trials | {s} minutes" for s in strategies) + " | targets |")
    print("|---|---|---:|" + "---:|---:|" * len(strategies) + "---|")
    for row in rows:
        cells = [f"{statistics.median(row[s]['trials']):g} / {max(row[s]['trials'])} | "
                 f"{statistics.median(row[s]['minutes']):.1f}" for s in strategies]
        verdict = meets(row)
        print(f"| {row['table']} | {row['kind']} | {row['size']} | " + " | ".join(cells)
              + f" | {'-' if verdict is None else 'met' if verdict else 'missed'} |")
    print()
    for s in strategies:
        every = [t for row in rows for t in row[s]["trials"]]
        medians = [statistics.median(row[s]["trials"]) for row in rows]
        minutes = [statistics.median(row[s]["minutes"]) for row in rows]
        print(f"{s}: trials median {statistics.median(every):g} (of table medians: {statistics.median(medians):g}, "
              f"worst table median {max(medians):g}), worst run {max(every)}, runs past {WORST_TARGET}: "
              f"{sum(1 for t in every if t > WORST_TARGET)} of {len(every)}, tables with median <= {MEDIAN_TARGET}: "
              f"{sum(1 for m in medians if m <= MEDIAN_TARGET)}, worst <= {WORST_TARGET}: "
              f"{sum(1 for row in rows if max(row[s]['trials']) <= WORST_TARGET)}; minutes median of table medians "
              f"{statistics.median(minutes):.1f}, total {sum(minutes):.0f}; fraction after {args.trials}: median "
              f"{statistics.median(f for row in rows for f in row[s]['fraction']):.3f}, worst "
              f"{min(f for row in rows for f in row[s]['fraction']):.3f}")
    verdicts = [meets(row) for row in rows]
    print(f"tables meeting the targets: {sum(1 for v in verdicts if v)} of {len(rows)} ({time.time() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
