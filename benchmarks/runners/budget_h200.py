"""Studies under a time budget: the wall time, the pick, how it was confirmed and where the minutes went.

    python -m benchmarks.runners.budget_h200 OUT_DIR WORKLOAD [WORKLOAD ...] [--budget MINUTES]

Each workload runs as a user would run it, through the ``autotune`` command in a fresh process, timed from
outside (process start to exit). ``demo`` is ``autotune demo`` with its defaults (the space's own budget);
the others run ``autotune tune ... --budget MINUTES``:

- ``resnet50``: ``benchmarks/workloads/resnet50.py:train_device`` over ``gpu_default``;
- ``lm``: ``examples/gpt_lm.py:train`` over ``search_spaces/example_gpt_lm.yaml``;
- ``input``: the input-bound small CNN on real JPEGs (``benchmarks/workloads/jpeg.py``, model tiny, crop
  112) over ``benchmarks/spaces/input_bound_h200.yaml``; its JPEGs are written first, outside the timing;
- ``lm-scale`` and ``lm-fixed``: the small LM with its sequences in host memory behind a map-style Dataset
  (``benchmarks/workloads/colocation.py:train_lm_host``) over ``gpu_default``, under ``--batch-policy scale``
  and under the default ``fixed``. Its hand grid: ``benchmarks/runners/measure_configs.py`` on the same target.

For each it writes ``OUT_DIR/<workload>.json``: the command, the wall seconds, the exit code, the output's
last lines, and ``best_config.json``'s pick, confirmation and time split; and the study's trials (config,
status, throughput, wall, compile seconds, compile cache) so that a loader-only trial's compile can be set
beside the first cold one.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
WORKLOADS: dict[str, list[str]] = {
    "demo": ["demo"],
    "resnet50": ["tune", "benchmarks/workloads/resnet50.py:train_device", "--space", "gpu_default", "--study", "resnet50"],
    "lm": ["tune", "examples/gpt_lm.py:train", "--space", "search_spaces/example_gpt_lm.yaml", "--study", "lm"],
    # The reference run compiles cold; the one other config changes a loader knob only, so it compiles warm.
    "cachepair": ["tune", "benchmarks/workloads/resnet50.py:train_loader", "--space", "benchmarks/spaces/compile_cache_pair.yaml",
                  "--study", "cachepair", "--trials", "2", "--top-k", "0"],
    "input": ["tune", "benchmarks.workloads.jpeg:train", "--space", "benchmarks/spaces/input_bound_h200.yaml",
              "--study", "input-bound"],
    # The small LM whose sequences sit in host memory behind a map-style Dataset (the levers issue): under
    # `scale` the batch is a lever of its loader; under `fixed` the default space's `loader: device` lifts it.
    "lm-scale": ["tune", "benchmarks.workloads.colocation:train_lm_host", "--space", "gpu_default",
                 "--batch-policy", "scale", "--study", "lm-scale"],
    "lm-fixed": ["tune", "benchmarks.workloads.colocation:train_lm_host", "--space", "gpu_default",
                 "--study", "lm-fixed"],
}


def trials(db: Path, study: str) -> list[dict[str, Any]]:
    """Each trial's config, state and the attributes the split and the compile cache are read from."""
    if not db.exists():
        return []
    keys = ("status", "throughput", "wall_seconds", "compile_seconds", "role", "extra:compile_cache",
            "extra:compile_cache_hits", "extra:compile_cache_misses", "config", "pruned_reason", "failure")
    out: list[dict[str, Any]] = []
    with sqlite3.connect(db) as con:
        rows = con.execute("select t.trial_id, t.number, t.state from trials t join studies s using (study_id) "
                           "where s.study_name = ? order by t.number", (study,)).fetchall()
        for trial_id, number, state in rows:
            attrs = dict(con.execute("select key, value_json from trial_user_attributes where trial_id = ?",
                                     (trial_id,)).fetchall())
            out.append({"number": number, "state": state,
                        **{k: json.loads(attrs[k]) for k in keys if k in attrs}})
    return out


def run(name: str, out: Path, budget: float) -> dict[str, Any]:
    studies = out / f"studies-{name}"
    command = [sys.executable, "-m", "autotune", *WORKLOADS[name], "--studies-dir", str(studies), "--no-progress"]
    if name not in ("demo", "cachepair"):
        command += ["--budget", f"{budget:g}", "--trials", "40"]
    env = dict(os.environ)
    if name == "input":
        root = out / "jpegs"
        if not root.exists():
            from benchmarks.workloads import make_jpegs

            make_jpegs.generate(str(root), images=8192, classes=16, min_size=200, max_size=260, quality=90, seed=0,
                                workers=None)
        env.update(AUTOTUNE_JPEG_ROOT=str(root), AUTOTUNE_JPEG_MODEL="tiny", AUTOTUNE_JPEG_SIZE="112",
                   AUTOTUNE_JPEG_EVAL="256")
    began = time.monotonic()
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.monotonic() - began
    study = "demo" if name == "demo" else WORKLOADS[name][WORKLOADS[name].index("--study") + 1]
    best_path = studies / study / "best_config.json"
    best = json.loads(best_path.read_text()) if best_path.exists() else {}
    record = {
        "workload": name,
        "command": " ".join(["python3 -m autotune", *command[3:]]).replace(str(out), "OUT"),
        "wall_seconds": round(wall, 1),
        "returncode": proc.returncode,
        "stdout_tail": proc.stdout.splitlines()[-14:],
        "stderr_tail": proc.stderr.splitlines()[-6:],
        "pick": {k: best.get(k) for k in ("config", "throughput", "speedup", "verdict", "speedup_spread", "baseline",
                                          "confirmed", "time_split", "accuracy_verdict")},
        "trials": trials(studies / "autotune.db", study),
    }
    (out / f"{name}.json").write_text(json.dumps(record, indent=1, default=str))
    print(f"{name}: {wall:.0f} s, exit {proc.returncode}, pick {best.get('config') and best.get('throughput')}",
          flush=True)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("workloads", nargs="+", choices=sorted(WORKLOADS))
    parser.add_argument("--budget", type=float, default=5.0, help="minutes per study (not for the demo)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.workloads:
        run(name, args.out, args.budget)


if __name__ == "__main__":
    main()
