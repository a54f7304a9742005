"""The answer first: user-style model-zoo scripts under a short budget, and a second study of each.

    python -m benchmarks.runners.answer_first_h200 OUT_DIR RUN [RUN ...] [--studies DIR]

A RUN is ``WORKLOAD:MINUTES[:STUDY]``; WORKLOAD is ``convnext`` (``benchmarks/workloads/zoo_convnext.py``,
torchvision ConvNeXt-Tiny), ``vit`` (``benchmarks/workloads/zoo_vit.py``, timm ViT-B/32), ``effnet``
(``zoo_effnet.py``, torchvision EfficientNet-B0), all with CPU augmentation in the Dataset, or ``bert``
(``zoo_bert.py``, a transformers BERT-base classifier on token sequences masked in the Dataset), tuned over ``gpu_default`` as a new user would (``autotune tune FILE:train
--budget MINUTES``). Every run of one workload shares one studies folder, so a second study of it finds the
first's fp32 references (``--studies``: where those folders go, default OUT_DIR; the study database is
copied to ``OUT_DIR/<workload>.db`` after each run). Each run is timed from outside and writes ``OUT_DIR/<study>.json``: the command,
the wall time, the pick, when the first faster config was measured, the plan's decisions, the time split and
the trials.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.runners.budget_h200 import trials

REPO = Path(__file__).resolve().parents[2]
TARGETS = {name: f"benchmarks/workloads/zoo_{name}.py:train" for name in ("convnext", "vit", "effnet", "bert")}


def study_attrs(db: Path, study: str, keys: tuple[str, ...]) -> dict[str, Any]:
    import sqlite3

    if not db.exists():
        return {}
    with sqlite3.connect(db) as con:
        rows = con.execute("select a.key, a.value_json from study_user_attributes a join studies s using (study_id) "
                           "where s.study_name = ?", (study,)).fetchall()
    return {k: json.loads(v) for k, v in rows if k in keys}


def run(spec: str, out: Path, root: Path) -> dict[str, Any]:
    workload, minutes, *rest = spec.split(":")
    study = rest[0] if rest else f"{workload}-b{minutes}"
    studies = root / f"studies-{workload}"
    command = [sys.executable, "-m", "autotune", "tune", TARGETS[workload], "--space", "gpu_default", "--study", study,
               "--budget", minutes, "--trials", "40", "--studies-dir", str(studies), "--no-progress"]
    began = time.monotonic()
    proc = subprocess.run(command, cwd=REPO, env=dict(os.environ), capture_output=True, text=True)
    wall = time.monotonic() - began
    best_path = studies / study / "best_config.json"
    best = json.loads(best_path.read_text()) if best_path.exists() else {}
    record = {
        "run": spec,
        "command": " ".join(["python3 -m autotune", *command[3:]]).replace(str(root), "STUDIES"),
        "wall_seconds": round(wall, 1),
        "returncode": proc.returncode,
        "stdout_tail": proc.stdout.splitlines()[-24:],
        "stderr_tail": proc.stderr.splitlines()[-6:],
        "pick": {k: best.get(k) for k in ("config", "throughput", "speedup", "verdict", "speedup_spread", "baseline",
                                          "confirmed", "time_split", "accuracy_verdict", "time_to_first_faster",
                                          "evidence_length")},
        "study": study_attrs(studies / "autotune.db", study, ("plan", "probes", "first_faster", "trial_budget",
                                                              "references_shortened", "references_reused",
                                                              "baseline_speed", "reference_config",
                                                              "baseline_throughput")),
        "trials": trials(studies / "autotune.db", study),
    }
    for probe in record["study"].get("probes") or []:
        probe.pop("extras", None)
    (out / f"{study}.json").write_text(json.dumps(record, indent=1, default=str))
    if (studies / "autotune.db").exists():
        shutil.copy(studies / "autotune.db", out / f"{workload}.db")
    print(f"{study}: {wall:.0f} s, exit {proc.returncode}, pick {best.get('throughput')} "
          f"({best.get('speedup')}x), first faster {best.get('time_to_first_faster')}", flush=True)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--studies", type=Path)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for spec in args.runs:
        run(spec, args.out, args.studies or args.out)


if __name__ == "__main__":
    main()
