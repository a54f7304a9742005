"""Workloads for tests/test_faults_five.py."""

from __future__ import annotations

import os

from scale_workloads import train


def train_changes_directory(ctx) -> None:
    """``train``, after moving into a folder of its own, as many scripts do (``os.chdir`` to their data)."""
    os.makedirs("elsewhere", exist_ok=True)
    os.chdir("elsewhere")
    train(ctx)
