"""The generated table family (benchmarks/tables/family.py) is deterministic, and the guided walk's median
trials to 95% of the best on a handful of its tables stays within a stated bound."""

from __future__ import annotations

import statistics

import optuna

from autotune.search._simulate import replay
from benchmarks.tables import family

# Measured 2026-12-02 on the family's first 8 tables (benchmarks/results/search.md): median 4 trials. The
# bound leaves room for the ±2% noise; a change to the walk that pushes it past 6 is a regression.
FAMILY_MEDIAN_BOUND = 6


def test_family_tables_are_deterministic_and_cover_every_bottleneck() -> None:
    small = family.lines(1)  # 192 configs: launch-bound, with out-of-memory and failing lines
    assert family.lines(1) == small and family.lines(2) != small
    assert {line["status"] for line in small} == {"ok", "oom", "error"}
    kinds = {family.profile(seed).description.split(": ")[1] for seed in range(8)}
    assert kinds == {"input-bound", "launch-bound", "compute-bound", "memory-bound"}


def test_guided_walk_median_trials_to_95_on_the_family() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    trials = [replay(family.table(seed), "guided", trials=30, seed=0, noise=0.02).trials_to_95
              for seed in range(8)]  # family.seeds(8): every one of them has a feasible best
    assert statistics.median(trials) <= FAMILY_MEDIAN_BOUND, trials


def test_without_row_noise_only_the_throughputs_change() -> None:
    noisy, clean = family.lines(1), family.lines(1, row_noise=False)
    assert [(a["params"], a["status"]) for a in noisy] == [(b["params"], b["status"]) for b in clean]
    assert [a.get("accuracy_loss") for a in noisy] == [b.get("accuracy_loss") for b in clean]
    assert [a["throughput"] for a in noisy] != [b["throughput"] for b in clean]


def test_the_oracle_reads_the_noise_that_lifts_the_best_row() -> None:
    from benchmarks.tables import family_oracle

    hard = family_oracle.oracle(48)  # input-bound: a plateau of near-equal configs at the most workers
    assert hard["lift"] > 1.03 and hard["plateau"] > 50 and 0 < hard["share"] < 0.5 and hard["rank"] >= 1
    # By the model's order, a config whose row reaches 95% of the best row comes within the first few.
    assert all(family_oracle.oracle(seed)["rank"] <= 12 for seed in family.seeds(8))


def test_with_the_loops_probes_the_former_tail_reaches_95_of_the_true_best_within_12_trials() -> None:
    # The tables where the walk's tail was (search.md, rounds 3-5), scored against each table's model, with
    # the replay's ±2% drawn afresh per measurement. family-16 needs a pair of loader knobs (more workers
    # only with less prefetch): before the probes tried pairs, 3 of its 10 runs took 13-14 trials.
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    worst = {}
    for seed in (16, 44, 45, 48):
        table = family.table(seed, row_noise=False)
        worst[table.name] = max(replay(table, "guided", trials=30, seed=s, noise=0.02, probes=True).trials_to_95
                                for s in range(10))
    assert max(worst.values()) <= 12, worst
