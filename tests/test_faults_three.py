"""Faults, round three: real processes, real storages (SQLite, journal files, PostgreSQL), real signals.

Each test names the fault it guards against; benchmarks/results/faults.md ("Round three") has the table.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from round3_workloads import ENVDIR_ENV
from tests.test_scaleout import postgres_url  # noqa: F401 (a fixture)

HERE = Path(__file__).resolve().parent
WORKLOADS = HERE / "round3_workloads.py"


def _autotune(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autotune", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


# -- the password ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, secret", [
    ("postgresql://root:pa ssLEAK1@db:5432/x", "LEAK1"),  # a raw space
    ("cannot open storage postgresql://u:a b@/LEAK2@db/x: refused", "LEAK2"),  # a space, then "@/"
    ("postgresql://u:ab@/LEAK3@db/x and sqlite:///a.db", "LEAK3"),
    ("first line\npostgresql://u:pw LEAK4@db/x\nlast line user@example", "LEAK4"),
])
def test_mask_url_hides_passwords_with_spaces_and_raw_at_signs(text, secret):
    from autotune.study._storage import mask_url

    masked = mask_url(text)
    assert secret not in masked and ":***@db" in masked


def test_the_url_comes_from_the_environment_or_a_file_and_no_trial_sees_it(postgres_url, tmp_path):
    from scale_workloads import SPACE

    url = postgres_url.replace("postgres@", "postgres:pa ssLEAK5@")  # trust auth ignores the password
    (tmp_path / "space.yaml").write_text(SPACE)
    envdir = tmp_path / "env"
    envdir.mkdir()
    studies = str(tmp_path / "studies")
    proc = _autotune("tune", f"{WORKLOADS}:train_writes_its_environment", "--space", str(tmp_path / "space.yaml"),
                     "--study", "s", "--trials", "3", "--workers", "2", "--studies-dir", studies, "--no-progress",
                     "--no-plots", "--prune-below", "0", "--top-k", "0",
                     env={"AUTOTUNE_STORAGE": url, ENVDIR_ENV: str(envdir)})
    assert proc.returncode == 0, proc.stderr
    assert "LEAK5" not in proc.stdout + proc.stderr
    seen = sorted(envdir.glob("*.env"))
    assert len(seen) >= 3  # the coordinator's reference trial and the workers' trials
    assert not [p.name for p in seen if b"LEAK5" in p.read_bytes() or b"AUTOTUNE_STORAGE" in p.read_bytes()]
    done = [t for t in optuna.load_study(study_name="s", storage=postgres_url).trials if t.state == TrialState.COMPLETE]
    assert len(done) >= 3

    (tmp_path / "url").write_text(url + "\n")
    for how, env in ((["--storage-file", str(tmp_path / "url")], {}), ([], {"AUTOTUNE_STORAGE": url})):
        best = _autotune("best", "s", "--studies-dir", studies, *how, env=env, timeout=120)
        assert best.returncode == 0 and '"batch_size"' in best.stdout, best.stderr
    missing = _autotune("best", "s", "--storage-file", str(tmp_path / "nope"), timeout=120)
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1 and "--storage-file" in missing.stderr
