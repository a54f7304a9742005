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
