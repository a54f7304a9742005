"""Writing a file whole or not at all (``autotune._files``)."""

from __future__ import annotations

import os
import stat

import pytest

from autotune._files import write_atomic


def test_a_write_replaces_the_file_whole_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "result.json"
    write_atomic(path, '{"old": 1}')
    write_atomic(str(path), '{"new": 2}')  # a str path as the trial processes pass it
    assert path.read_text() == '{"new": 2}' and os.listdir(tmp_path) == ["result.json"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # readable as a plain write would leave it


def test_a_write_that_fails_keeps_the_old_file_and_removes_its_temporary_one(tmp_path):
    path = tmp_path / "best_config.json"
    write_atomic(path, "old")
    with pytest.raises(TypeError):
        write_atomic(path, b"not text")  # fails mid-write, as a full disk would
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["best_config.json"]
    with pytest.raises(OSError):
        write_atomic(tmp_path / "missing" / "x.json", "text")  # no folder: one OSError, nothing left behind
