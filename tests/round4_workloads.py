"""Workloads for tests/test_faults_four.py."""

from __future__ import annotations

import torch

from workloads import dataset


def _tiny(x: torch.Tensor) -> torch.Tensor:
    return (x.sin() * 2 + 1).sum(dim=1)


def train_compiles_a_function(ctx) -> None:
    """The cheapest real Inductor compile (one elementwise kernel, no backward) inside ``ctx.batches``:
    14 s cold on a 2-core CPU, about 1 s warm from the study's cache."""
    fn = torch.compile(_tiny) if ctx.config.compile != "off" else _tiny
    total = 0.0
    with torch.no_grad():
        for inputs, _ in ctx.batches(ctx.loader(dataset(256, seed=ctx.seed))):
            total += float(fn(inputs).sum())
    ctx.report_metric(1.0)


# "<num_workers>:<folder>[:raise]": that config segfaults (or raises) from its 2nd run on
CRASH_ENV = "AUTOTUNE_TEST_CRASH_WORKERS"


def replay_crashes_from_its_second_run(ctx) -> None:
    """``replay_train``, except that the config of ``CRASH_ENV``'s worker count is killed by SIGSEGV in each
    run after its first (its trial): a finalist that crashes in every race run."""
    import os
    import signal
    from pathlib import Path

    from autotune.search._simulate import replay_train

    workers, _, rest = os.environ.get(CRASH_ENV, "").partition(":")
    folder, _, how = rest.partition(":")
    if workers and ctx.config.num_workers == int(workers):
        counter = Path(folder) / "crash-runs"
        runs = int(counter.read_text()) + 1 if counter.exists() else 1
        counter.write_text(str(runs))
        if runs >= 2 and how == "raise":
            raise RuntimeError("this config fails from its second run on")
        if runs >= 2:
            os.kill(os.getpid(), signal.SIGSEGV)
    replay_train(ctx)


ANCESTORS_ENV = "AUTOTUNE_TEST_ANCESTORS"  # a folder: each trial writes what its ancestors' /proc/PID/environ shows


def train_reads_its_ancestors_environ(ctx) -> None:
    """``scale_workloads.train``, after writing the /proc/PID/environ of this trial and of each process above it
    (the trial server, the worker, the tuner that started the workers), as any process of the user can."""
    import os
    from pathlib import Path

    from scale_workloads import train

    seen, pid = [], os.getpid()
    for _ in range(5):
        try:
            seen.append(Path(f"/proc/{pid}/environ").read_bytes())
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        if pid <= 1:
            break
    (Path(os.environ[ANCESTORS_ENV]) / f"{os.getpid()}.environ").write_bytes(b"\n".join(seen))
    train(ctx)
