"""Workloads for tests/test_faults_five.py."""

from __future__ import annotations

import os

from scale_workloads import train


def train_changes_directory(ctx) -> None:
    """``train``, after moving into a folder of its own, as many scripts do (``os.chdir`` to their data)."""
    os.makedirs("elsewhere", exist_ok=True)
    os.chdir("elsewhere")
    train(ctx)


def train_prints_a_lot(ctx) -> None:
    """``train``, after printing 12 MB to its stdout (numbered lines, the last one ``LAST LINE``)."""
    import sys

    line = "x" * 99 + "\n"
    for _ in range(12 * 10_000):
        sys.stdout.write(line)
    print("LAST LINE", flush=True)
    train(ctx)


POISON = "POISON"  # a file in the compile cache's fxgraph/ that stands for a crafted entry


def train_fails_on_a_poisoned_cache(ctx) -> None:
    """A loop that compiles nothing, and raises, as Inductor's use of a crafted entry ends a trial, when the
    compile cache it is pointed at holds ``fxgraph/POISON``."""
    from workloads import dataset

    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if cache and os.path.exists(os.path.join(cache, "fxgraph", POISON)):
        raise RuntimeError("BackendCompilerFailed: a crafted cache entry was loaded")
    total = 0.0
    for inputs, _ in ctx.batches(ctx.loader(dataset(256, seed=ctx.seed))):
        total += float(inputs.sum())
    ctx.report_metric(1.0)


LEFT_ENV = "AUTOTUNE_TEST_LEFT"  # the file a workload writes the pids it leaves behind to


def train_leaves_a_session(ctx) -> None:
    """``train``, with a child started in a session of its own (out of reach of a group kill) and a
    grandchild whose parent exits at once (reparented away from the trial), both left running."""
    import subprocess
    import sys

    sleeper = [sys.executable, "-c", "import time; time.sleep(1000)"]
    own = subprocess.Popen(sleeper, start_new_session=True)
    orphaner = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
                                 f"print(subprocess.Popen({sleeper!r}, start_new_session=True, stdout=subprocess.DEVNULL).pid)"],
                                stdout=subprocess.PIPE, text=True)
    orphan = int(orphaner.communicate()[0])
    with open(os.environ[LEFT_ENV], "a") as fh:
        fh.write(f"{own.pid}\n{orphan}\n")
    train(ctx)
