"""Workloads for tests/test_faults_three.py: a trial that writes down the environment it was given."""

from __future__ import annotations

import os
from pathlib import Path

from scale_workloads import train

ENVDIR_ENV = "AUTOTUNE_TEST_ENVDIR"


def train_writes_its_environment(ctx) -> None:
    """``scale_workloads.train``, after writing this process's environment (os.environ and the kernel's copy)."""
    folder = Path(os.environ[ENVDIR_ENV])
    seen = Path("/proc/self/environ").read_bytes() + b"\n" + "\n".join(f"{k}={v}" for k, v in os.environ.items()).encode()
    (folder / f"{os.getpid()}.env").write_bytes(seen)
    train(ctx)

