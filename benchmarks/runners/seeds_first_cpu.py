"""When the first full trial starts, with the fp32 seeds after the first run before it or after it, in real
CPU studies of a script whose every process pays a slow build (``benchmarks/workloads/slow_build.py``).

    python -m benchmarks.runners.seeds_first_cpu [--repeats 3] [--budget 1.5]

Each study is a real ``Tuner`` run under ``--budget`` minutes over a small CPU space (the optimizer's
implementation and the DataLoader's workers), in a fresh studies folder. *all first* runs every fp32 seed
before the first full trial, as the planner did before ``_planner.seeds_first``; *deferred* is the planner
now. Each row gives, for the first full trial (the prior point): when the planner decided it, on the study's
own clock (``plan``) and as a share of the budget; and the references' part of the study's time split. Prints
a markdown table of the medians and the ranges over ``--repeats`` studies of each, interleaved.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[2]
SPACE = """\
knobs:
  optimizer_impl: [default, foreach]
  num_workers: [0, 1]
baseline: {batch_size: 64}
global_batch: 64
budget: {samples: 20480, warmup_steps: 2, windows: 3}
"""


def one_study(folder: Path, *, budget: float, defer: bool) -> dict[str, Any]:
    """One study; what its first full trial and its references took."""
    import optuna

    from autotune import Tuner
    from autotune.study import _loop, _tuner

    originals = _tuner.seeds_first, _loop.seeds_first
    if not defer:  # the order before: every seed before the first full trial
        def every_seed(*, budgeted: bool, repeats: int, step_levers: bool) -> int:
            return repeats

        _tuner.seeds_first = _loop.seeds_first = every_seed
    (folder / "space.yaml").write_text(SPACE)
    storage = f"sqlite:///{folder}/s.db"
    started = time.time()
    try:
        Tuner(f"{REPO / 'benchmarks/workloads/slow_build.py'}:train", space=folder / "space.yaml", n_trials=4,
              storage=storage, studies_dir=folder / "studies", progress=False, plots=False, study_name="s",
              budget_minutes=budget).run()
    finally:
        _tuner.seeds_first, _loop.seeds_first = originals
    study = optuna.load_study(study_name="s", storage=storage)
    # When the planner decided the first full trial, on the study's own clock (its first "trial" decision).
    start = next((d["at"] for d in study.user_attrs.get("plan") or [] if d.get("action") == "trial"), None)
    split = study.user_attrs.get("time_split") or {}
    return {"first_start_s": start, "first_share": start / (budget * 60) if start is not None else None,
            "references_s": (split.get("parts") or {}).get("references"), "wall_s": round(time.time() - started, 1),
            "seeds": study.user_attrs.get("reference_seeds", 2)}


def _cell(values: list[Optional[float]], fmt: str) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget", type=float, default=1.5, help="minutes")
    args = parser.parse_args(argv)
    rows: dict[str, list[dict[str, Any]]] = {"all first": [], "deferred": []}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            for name in rows:  # interleaved, so a slow spell of the machine falls on both
                folder = Path(scratch) / f"{name.replace(' ', '-')}-{repeat}"
                folder.mkdir()
                rows[name].append(one_study(folder, budget=args.budget, defer=name == "deferred"))
                print(f"{name} #{repeat}: {rows[name][-1]}", file=sys.stderr, flush=True)
    print(f"| seeds before the first full trial | first full trial decided at (s, study clock) | share of the "
          f"{args.budget:g}-minute budget | references (s) |")
    print("|---|---:|---:|---:|")
    for name, runs in rows.items():
        print(f"| {name} | {_cell([r['first_start_s'] for r in runs], '.1f')} | "
              f"{_cell([r['first_share'] * 100 if r['first_share'] is not None else None for r in runs], '.0f')}% | "
              f"{_cell([r['references_s'] for r in runs], '.1f')} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
