"""End to end in a browser: ``autotune dashboard`` (a real subprocess) serving a real study, rendered by
headless Chromium. Screenshots go to $AUTOTUNE_TEST_ARTIFACTS (default tests/artifacts/).

Needs Debian's ``chromium`` package; without it the test is skipped, unless AUTOTUNE_REQUIRE_BROWSER=1
(as in CI), where a missing browser is a failure.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import optuna
import pytest

from autotune import Tuner
from autotune.hardware import Capabilities
from autotune.insight._report import study_artifacts
from workloads import WORKLOADS

ARTIFACTS = Path(os.environ.get("AUTOTUNE_TEST_ARTIFACTS") or Path(__file__).resolve().parent / "artifacts")
STUDY = "browser-e2e"
SPACE = "knobs:\n  cpu_threads: [null, 1]\nbudget: {samples: 512, warmup_steps: 1, windows: 3}\n"


@pytest.fixture(scope="module")
def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        reason = "no chromium binary on PATH (Debian: apt-get install chromium)"
        if os.environ.get("AUTOTUNE_REQUIRE_BROWSER") == "1":
            pytest.fail(f"{reason}, and AUTOTUNE_REQUIRE_BROWSER=1 requires the browser test")
        pytest.skip(f"{reason}; set AUTOTUNE_REQUIRE_BROWSER=1 to make this a failure")
    return found


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory, chromium):
    """A real study of two trials, and `autotune dashboard` serving it on a free port."""
    tmp = tmp_path_factory.mktemp("browser")
    (tmp / "space.yaml").write_text(SPACE)
    url, studies = f"sqlite:///{tmp}/studies.db", tmp / "studies"
    caps = Capabilities(cuda=False, bf16=True, cpu_count=2, compile=True, hostname="test-host", torch="test")
    Tuner(f"{WORKLOADS}:train_tiny", space=tmp / "space.yaml", n_trials=2, storage=url, studies_dir=studies,
          progress=False, capabilities=caps, reference_repeats=1, top_k=0, study_name=STUDY, prune_below=None).run()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = (tmp / "dashboard.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "autotune", "dashboard", "--storage", url, "--studies-dir",
                             str(studies), "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp / "dashboard.log").read_text()
            try:
                with urllib.request.urlopen(f"{base}/api/studies", timeout=5) as response:
                    summaries = json.load(response)["study_summaries"]
                break
            except OSError:
                assert time.monotonic() < deadline, "the dashboard did not answer within 60 s"
                time.sleep(0.3)
        (study_id,) = [s["study_id"] for s in summaries if s["study_name"] == STUDY]
        yield {"base": base, "id": study_id, "url": url, "tmp": tmp}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def render(chromium: str, url: str, screenshot: Path, profile: Path) -> str:
    """The page's visible text once the single-page app has rendered, and its screenshot."""
    screenshot.parent.mkdir(parents=True, exist_ok=True)
    screenshot.unlink(missing_ok=True)
    proc = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         f"--user-data-dir={profile}", "--virtual-time-budget=15000", "--window-size=1400,1000",
         f"--screenshot={screenshot}", "--dump-dom", url],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = re.sub(r"<script.*?</script>|<style.*?</style>", " ", proc.stdout, flags=re.S)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", text)))


def test_dashboard_shows_the_study_its_trials_notes_and_plots(chromium, dashboard) -> None:
    study = optuna.load_study(study_name=STUDY, storage=dashboard["url"])
    trials = study.get_trials()
    diagnoses = study.user_attrs["diagnoses"]
    assert len(trials) == 2 and set(diagnoses) == {"0", "1"}
    page = f"{dashboard['base']}/dashboard/studies/{dashboard['id']}"
    profile = dashboard["tmp"] / "chromium-profile"

    overview = render(chromium, page, ARTIFACTS / "dashboard-study.png", profile)
    assert STUDY in overview
    assert "Objective X: throughput" in overview and "Objective Y: accuracy_loss" in overview
    assert "Study Artifacts" in overview
    attached = sorted(a["filename"] for a in study_artifacts(study))
    # 2 trials: no importances; the loss curves against the fp32 band are there (train_tiny records its loss)
    assert attached == ["history.png", "loss_curves.png", "pareto_front.png", "throughput_by_knob.png"]
    for name in attached:  # listed by the dashboard from studies/artifacts
        assert name in overview, name

    listed = render(chromium, f"{page}/trials", ARTIFACTS / "dashboard-trials.png", profile)
    assert f"{len(trials)} Trials" in listed
    for trial in trials:
        assert f"Trial {trial.number}" in listed
    first = diagnoses["0"]  # the trial note of the trial on show
    assert f"autotune: {first['diagnosis']}" in listed and first["evidence"] in listed
    assert "throughput" in listed and "data_wait_fraction" in listed

    note = render(chromium, f"{page}/note", ARTIFACTS / "dashboard-note.png", profile)
    assert f"autotune: {STUDY}" in note and "Baseline:" in note and "Accuracy check:" in note
    assert "Batch policy: fixed" in note and "Accuracy verdicts" in note
