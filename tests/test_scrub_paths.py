"""The scrubber that takes a machine's paths out of a result before it is committed."""

from __future__ import annotations

import json
from pathlib import Path

import optuna

from benchmarks.runners.scrub_paths import main


def test_paths_leave_a_study_file_and_a_json_and_the_study_still_loads(tmp_path: Path) -> None:
    checkout = "/somewhere/checkout/"
    db = tmp_path / "study.db"
    study = optuna.create_study(study_name="s", storage=f"sqlite:///{db}")
    study.set_user_attr("target", f"{checkout}examples/x.py:train")
    trial = study.ask()
    trial.set_user_attr("stderr_tail", f'File "{checkout}autotune/trial/_knobs.py", line 1')
    study.tell(trial, 1.0)
    report = tmp_path / "run.json"
    report.write_text(json.dumps({"log": "written to /scratch/run/studies/best_config.json"}))

    assert main([str(db), str(report), "--replace", f"{checkout}=", "--replace", "/scratch/run=WORKDIR"]) == 0
    assert checkout.encode() not in db.read_bytes()  # vacuumed: no free page keeps the old text
    loaded = optuna.load_study(study_name="s", storage=f"sqlite:///{db}")
    assert loaded.user_attrs["target"] == "examples/x.py:train"
    assert loaded.trials[0].user_attrs["stderr_tail"] == 'File "autotune/trial/_knobs.py", line 1'
    assert json.loads(report.read_text())["log"] == "written to WORKDIR/studies/best_config.json"
