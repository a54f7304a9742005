"""Trials are not minutes: the guided search's order replayed with an estimated cost per trial.

    python -m benchmarks.search_cost

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

from autotune._sampler import DEFAULT_KNOB_ORDER, GuidedSampler
from autotune._simulate import ReplayTable, replay

NEW_COMPILE_S, CACHED_COMPILE_S, EAGER_S = 65.0, 25.0, 12.0
PRECISION_FIRST = ("precision", "batch_size") + tuple(k for k in DEFAULT_KNOB_ORDER if k not in ("precision", "batch_size"))
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


def main() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    print("| table | compile first: trials to 95% (median) | est. minutes | compile last: trials | est. minutes |")
    print("|---|---:|---:|---:|---:|")
    for path in sorted(Path(__file__).with_name("tables").glob("*.jsonl")):
        table = ReplayTable.load(path)
        cells = []
        for priors in (None, COMPILE_LAST):
            trials, spent = [], []
            for seed in range(5):
                sampler = GuidedSampler(search_space=table.distributions(), seed=seed, priors=priors)
                run = replay(table, "guided", trials=30, seed=seed, noise=0.02, sampler=sampler)
                trials.append(run.trials_to_95)
                spent.append(minutes(list(run.measured[: run.trials_to_95])))
            cells += [f"{statistics.median(trials):g}", f"{statistics.median(spent):.1f}"]
        print(f"| {table.name} | " + " | ".join(cells) + " |")

    print()
    print("| table | batch first (shipped): trials to 99% (median / worst) | est. minutes | precision first: trials | est. minutes |")
    print("|---|---:|---:|---:|---:|")
    for path in sorted(Path(__file__).with_name("tables").glob("*.jsonl")):
        table = ReplayTable.load(path)
        best = table.best(0.01).throughput
        cells = []
        for order in (DEFAULT_KNOB_ORDER, PRECISION_FIRST):
            trials, spent = [], []
            for seed in range(5):
                sampler = GuidedSampler(search_space=table.distributions(), seed=seed, knob_order=order)
                run = replay(table, "guided", trials=30, seed=seed, noise=0.02, sampler=sampler)
                rows = [table.lookup(p) for p in run.measured]
                reached = next((i + 1 for i, r in enumerate(rows) if r.status == "ok" and table.feasible(r, 0.01)
                                and r.throughput >= 0.99 * best), len(rows) + 1)
                trials.append(reached)
                spent.append(minutes(list(run.measured[:reached])))
            cells += [f"{statistics.median(trials):g} / {max(trials)}", f"{statistics.median(spent):.1f}"]
        print(f"| {table.name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
