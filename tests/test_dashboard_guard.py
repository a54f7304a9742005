"""``autotune dashboard`` (a real server on a free port) is read-only by default and answers only to its own
Host names: a web page must not rename, delete or tell trials of a study a tuner is running."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import optuna
import pytest
from optuna.trial import TrialState

from autotune.study._dashboard import allowed_hosts
from autotune.study._storage import open_storage
from processes import stop

pytest.importorskip("optuna_dashboard")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _request(port: int, method: str, path: str, body: Optional[dict] = None,
             host: Optional[str] = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        headers = {"Host": host or f"127.0.0.1:{port}"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        conn.request(method, path, body=data, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


@contextmanager
def _dashboard(storage: str, studies: Path, *extra: str) -> Iterator[int]:
    port = _free_port()
    log = studies.parent / f"dashboard-{port}.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "autotune", "dashboard", "--storage", storage, "--port",
                                 str(port), "--studies-dir", str(studies), *extra], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if _request(port, "GET", "/api/studies")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the dashboard did not answer within 60 s: " + log.read_text()
            time.sleep(0.3)
        yield port
    finally:
        stop(proc)


def _study(storage: str) -> tuple[int, int]:
    """A study with one finished and one running trial (as a tuner leaves it mid-run): (study id, running trial id)."""
    study = optuna.create_study(study_name="live", storage=storage, directions=["maximize", "minimize"])
    study.add_trial(optuna.trial.create_trial(params={}, distributions={}, values=[100.0, 0.0]))
    running = study.ask()
    return study._study_id, running._trial_id


EDITS = [
    ("POST", "/api/studies/{study}/rename", {"study_name": "renamed"}),
    ("POST", "/api/trials/{trial}/tell", {"state": "Complete", "values": [1.0, 0.0]}),
    ("PUT", "/api/studies/{study}/note", {"version": 0, "body": "hello"}),
    ("POST", "/api/trials/{trial}/user-attrs", {"user_attrs": {"x": 1}}),
    ("DELETE", "/api/studies/{study}", {}),
]


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_the_dashboard_is_read_only_by_default(tmp_path: Path, kind: str) -> None:
    studies = tmp_path / "studies"
    studies.mkdir()
    url = f"sqlite:///{studies / 'autotune.db'}" if kind == "sqlite" else f"journal:{studies / 'autotune.journal'}"
    storage, _ = open_storage(url, studies)
    study_id, trial_id = _study(storage)
    with _dashboard(url, studies) as port:
        status, body = _request(port, "GET", "/api/studies")
        assert status == 200 and [s["study_name"] for s in json.loads(body)["study_summaries"]] == ["live"]
        assert _request(port, "GET", f"/api/studies/{study_id}")[0] == 200
        assert _request(port, "HEAD", "/")[0] in (200, 302, 303)
        for method, path, payload in EDITS:
            status, body = _request(port, method, path.format(study=study_id, trial=trial_id), payload)
            assert status == 403, (method, path, status, body)
            assert b"read-only" in body and b"--allow-edits" in body
    study = optuna.load_study(study_name="live", storage=storage)  # nothing changed
    assert [t.state for t in study.trials] == [TrialState.COMPLETE, TrialState.RUNNING]
    assert "x" not in study.trials[1].user_attrs


def test_allow_edits_lets_the_page_change_studies(tmp_path: Path) -> None:
    studies = tmp_path / "studies"
    studies.mkdir()
    url = f"sqlite:///{studies / 'autotune.db'}"
    study_id, trial_id = _study(url)
    with _dashboard(url, studies, "--allow-edits") as port:
        assert _request(port, "POST", f"/api/trials/{trial_id}/tell", {"state": "Fail"})[0] == 204
        status, body = _request(port, "POST", f"/api/studies/{study_id}/rename", {"study_name": "renamed"})
        assert status == 201, body
        renamed = json.loads(body)["study_id"]
        assert _request(port, "DELETE", f"/api/studies/{renamed}", {})[0] == 204
        # Edits allowed are still for this machine's own pages only.
        assert _request(port, "GET", "/api/studies", host=f"rebound.example:{port}")[0] == 403
    assert optuna.get_all_study_summaries(url) == []


def test_a_foreign_host_header_is_refused(tmp_path: Path) -> None:
    # A page of a site whose DNS name points at 127.0.0.1 (DNS rebinding) sends its own name as Host.
    studies = tmp_path / "studies"
    studies.mkdir()
    url = f"sqlite:///{studies / 'autotune.db'}"
    _study(url)
    with _dashboard(url, studies) as port:
        for host in (f"rebound.example:{port}", f"127.0.0.1.nip.io:{port}", "127.0.0.1:1", " ", "localhost"):
            status, body = _request(port, "GET", "/api/studies", host=host)
            assert status == 403 and b"not this dashboard's address" in body, (host, status, body)
        for own in (f"localhost:{port}", f"LOCALHOST:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"):
            assert _request(port, "GET", "/api/studies", host=own)[0] == 200, own


def test_allowed_hosts() -> None:
    assert allowed_hosts("127.0.0.1", 8080) == {"127.0.0.1:8080", "localhost:8080", "[::1]:8080"}
    assert allowed_hosts("::1", 80) == {"[::1]:80", "[::1]", "localhost:80", "localhost", "127.0.0.1:80", "127.0.0.1"}
    assert "192.168.1.5:8080" in allowed_hosts("192.168.1.5", 8080)
    assert socket.gethostname().lower() + ":8080" in allowed_hosts("0.0.0.0", 8080)
    assert not any(name.startswith(("0.0.0.0", "[::]")) for name in allowed_hosts("::", 8080))
