"""Faults, round five: real processes, real files, real SQLite and a real PostgreSQL.

Each test names the fault it guards against; benchmarks/results/faults.md ("Round five") has the table.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import optuna
import pytest

from tests.test_scaleout import postgres_url  # noqa: F401 (a fixture)

HERE = Path(__file__).resolve().parent


def _autotune(*args: str, env: dict[str, str] | None = None, timeout: float = 300,
              cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autotune", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, cwd=cwd)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- 1: the dashboard's storage URL is in no argv ------------------------------------------------------------


@pytest.mark.parametrize("given", ["--storage", "AUTOTUNE_STORAGE"])
def test_the_dashboard_keeps_the_password_out_of_its_argv_and_environ(postgres_url, tmp_path, given):
    optuna.create_study(study_name="s", storage=postgres_url)
    url = postgres_url.replace("postgres@", "postgres:pwLEAK5@")  # trust auth ignores the password
    port = _free_port()
    args, env = (["--storage", url], {}) if given == "--storage" else ([], {"AUTOTUNE_STORAGE": url})
    dashboard = subprocess.Popen([sys.executable, "-m", "autotune", "dashboard", *args, "--port", str(port),
                                  "--studies-dir", str(tmp_path / "studies")],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
    try:
        deadline = time.monotonic() + 60
        while True:  # the page answers once the process it execs has opened the storage
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=10) as response:
                    assert b'"s"' in response.read()
                break
            except OSError:
                assert dashboard.poll() is None and time.monotonic() < deadline, dashboard.communicate()
                time.sleep(0.2)
        proc = Path(f"/proc/{dashboard.pid}")
        cmdline = (proc / "cmdline").read_bytes()
        assert b"_dashboard" in cmdline  # the process became the server
        assert b"LEAK5" not in cmdline, cmdline  # before: the whole URL, for every user's `ps`
        assert b"LEAK5" not in (proc / "environ").read_bytes()
    finally:
        dashboard.terminate()
        out, err = dashboard.communicate(timeout=30)
    assert "LEAK5" not in out + err
