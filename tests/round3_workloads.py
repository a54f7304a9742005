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


FILL_ENV = "AUTOTUNE_TEST_FILL"  # a file on a small file system: the first trial off the baseline fills it


def train_fills_the_disk(ctx) -> None:
    """``scale_workloads.train``; the first trial off the baseline's batch size (16) first fills the file
    system of ``FILL_ENV``'s path, as another program would."""
    path = Path(os.environ.get(FILL_ENV) or "/nonexistent/unset")
    if os.environ.get(FILL_ENV) and ctx.config.batch_size != 16 and not path.exists():
        with open(path, "wb") as fh:
            try:
                while True:
                    fh.write(b"\0" * 65536)
                    fh.flush()
            except OSError:
                pass
    train(ctx)
