"""Trials are not minutes: the guided search's order replayed with an estimated cost per trial.

    python -m benchmarks.tables.search_cost

For each committed table, replays the guided sampler as shipped (compile tried first) and with compile
tried last (``off`` first), and estimates the minutes until 95% of the best; then the knob order as
shipped (batch before precision) against precision first, until 99% of the best with a simple cost model of an
H200 ResNet-50 trial: 65 s for a config whose compiled graph is new (compile plus measurement), 25 s when
only CUDA Graphs or compile mode changed on a graph already compiled (the inductor cache), 12 s eager.
The model is a rough guide taken from `resnet50-h200-best-config.md`, not a measurement of each table.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import optuna

from autotune.search._sampler import DEFAULT_KNOB_ORDER, GuidedSampler
from autotune.search._simulate import ReplayTable, replay

NEW_COMPILE_S, CACHED_COMPILE_S, EAGER_S = 65.0, 25.0, 12.0
PRECISION_FIRST = ("precision", "batch_size", *(k for k in DEFAULT_KNOB_ORDER if k not in ("precision", "batch_size")))
COMPILE_LAST = {"compile": ("off", "default", "max-autotune-no-cudagraphs", "max-autotune", "reduce-overhead")}


def minutes(configs: list[dict]) -> float:
    compiled, total = set(), 0.0
    for params in configs:
        graph = tuple(sorted((k, v) for k, v in params.items() if k not in ("cuda_graphs", "compile")))
        if params.get("compile", "off") != "off":
            total += CACHED_COMPILE_S if graph in compiled else NEW_COMPILE_S
            compiled.add(graph)
        else:
            total += EAGER_S
    return total / 60


def trials_to(table: ReplayTable, fraction: float, **options) -> tuple[int, float]:
    """Replay the guided order once; the trial whose config truly reaches ``fraction`` of the best (31: never)."""
    seed = options.pop("seed")
    run = replay(table, "guided", trials=30, seed=seed, noise=0.02,
                 sampler=GuidedSampler(search_space=table.distributions(), seed=seed, **options))
    best = table.best(0.01).throughput
    rows = [table.lookup(p) for p in run.measured]
    reached = next((i + 1 for i, r in enumerate(rows)
                    if r.status == "ok" and table.feasible(r, 0.01) and r.throughput >= fraction * best), 31)
    return reached, minutes(list(run.measured[:reached]))


def compare(title: str, fraction: float, variants: dict[str, dict]) -> None:
    names = list(variants)
    print(f"{title}\n\n| table | " + " | ".join(f"{n}: trials to {fraction:.0%} (median / worst) | est. minutes"
                                             for n in names) + " |")
    print("|---|" + "---:|---:|" * len(names))
    for path in sorted(Path(__file__).parent.glob("*.jsonl")):
        table = ReplayTable.load(path)
        cells = []
        for options in variants.values():
            runs = [trials_to(table, fraction, seed=seed, **options) for seed in range(5)]
            trials = [n for n, _ in runs]
            cells += [f"{statistics.median(trials):g} / {max(trials)}", f"{statistics.median([m for _, m in runs]):.1f}"]
        print(f"| {table.name} | " + " | ".join(cells) + " |")
    print()


def main() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    compare("Compile tried first or last", 0.95, {"compile first (shipped)": {}, "compile last": {"priors": COMPILE_LAST}})
    compare("Batch or precision first", 0.99,
            {"batch first (shipped)": {}, "precision first": {"knob_order": PRECISION_FIRST}})
    compare("Batch sizes past a slower one deferred or tried nearest first", 0.99,
            {"deferred (shipped)": {}, "nearest first": {"defer_past_slower": False}})


if __name__ == "__main__":
    main()
