"""The config tables of benchmarks/tables: the committed ones follow the format, the synthetic generator is
deterministic, and the measuring sweep writes valid lines and resumes (tiny models, on the CPU)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest

from autotune._config import COMPILE_MODES, PRECISIONS, TrialConfig

TABLES_DIR = Path(__file__).resolve().parent.parent / "benchmarks" / "tables"
KNOBS = {f.name: f.default for f in dataclasses.fields(TrialConfig)}
STATUSES = {"ok", "oom", "error"}


def check_table(lines: list[dict[str, Any]]) -> None:
    """Assert the table format of benchmarks/tables/README.md."""
    assert lines, "empty table"
    if set(lines[0]) == {"study"}:  # a whole study's settings, for autotune simulate --budget
        assert isinstance(lines[0]["study"], dict), lines[0]
        lines = lines[1:]
    keys = set(lines[0]["params"])
    seen = set()
    for n, line in enumerate(lines, 1):
        where = f"line {n}: {line}"
        assert set(line) >= {"params", "status", "throughput"}, where
        params = line["params"]
        assert set(params) == keys, where
        assert keys <= set(KNOBS), where
        for knob, value in params.items():
            default = KNOBS[knob]
            if isinstance(default, bool):
                assert isinstance(value, bool), where
            elif isinstance(default, int):
                assert isinstance(value, int) and not isinstance(value, bool) and value >= 0, where
            elif isinstance(default, float):
                assert isinstance(value, (int, float)) and not isinstance(value, bool), where
        if "precision" in params:
            assert params["precision"] in PRECISIONS, where
        if "compile" in params:
            assert params["compile"] in COMPILE_MODES, where
        if "batch_size" in params:
            assert params["batch_size"] > 0, where
        key = json.dumps(params, sort_keys=True)
        assert key not in seen, f"duplicate config, {where}"
        seen.add(key)
        assert line["status"] in STATUSES, where
        if line["status"] == "ok":
            assert isinstance(line["throughput"], (int, float)) and math.isfinite(line["throughput"]), where
            assert line["throughput"] > 0, where
        else:
            assert line["throughput"] is None, where
        if line.get("peak_memory_gib") is not None:
            assert isinstance(line["peak_memory_gib"], (int, float)) and line["peak_memory_gib"] >= 0, where
        if line.get("accuracy_loss") is not None:
            assert isinstance(line["accuracy_loss"], (int, float)) and math.isfinite(line["accuracy_loss"]), where
        if line["status"] == "error":
            assert isinstance(line.get("error", ""), str), where


def read_table(path: Path) -> list[dict[str, Any]]:
    text = path.read_text()
    assert text.endswith("\n"), f"{path.name}: last line is not terminated"
    return [json.loads(line) for line in text.splitlines()]


COMMITTED = sorted(TABLES_DIR.glob("*.jsonl"))


def test_there_are_committed_tables() -> None:
    assert {p.stem for p in COMMITTED} >= {
        "synthetic_input_bound",
        "synthetic_compute_bound",
        "synthetic_oom_heavy",
        "synthetic_large",
    }


@pytest.mark.parametrize("path", COMMITTED, ids=[p.name for p in COMMITTED])
def test_committed_table_follows_the_format(path: Path) -> None:
    lines = read_table(path)
    check_table(lines)
    assert 1 <= len(lines) <= 3000
    assert any(line.get("status") == "ok" for line in lines)


# -- synthetic ------------------------------------------------------------------------------------------
def test_synthetic_tables_are_deterministic_and_committed_as_generated() -> None:
    from benchmarks.tables import synthetic

    for name in synthetic.TABLES:
        lines = synthetic.generate(name, seed=0)
        assert synthetic.generate(name, seed=0) == lines
        assert synthetic.generate(name, seed=1) != lines
        check_table(lines)
        assert 50 <= len(lines) <= 3000
        assert sum(line["status"] == "error" for line in lines) >= 1
        committed = TABLES_DIR / f"{name}.jsonl"
        assert committed.read_text() == synthetic.dumps(lines), (
            f"{committed.name} differs from the generator: python -m benchmarks.tables.synthetic {name}"
        )


def test_synthetic_incompatible_and_memory_rules() -> None:
    from benchmarks.tables import synthetic

    lines = synthetic.generate("synthetic_compute_bound")
    for line in lines:
        p = line["params"]
        if p["compile"] == "max-autotune" and p["cuda_graphs"]:
            assert line["status"] == "error"
    oom = synthetic.generate("synthetic_oom_heavy")
    largest = max(line["params"]["batch_size"] for line in oom)
    assert all(line["status"] == "oom" for line in oom if line["params"]["batch_size"] == largest)
    best = synthetic.best(oom)
    assert best is not None and best["peak_memory_gib"] > 0.85 * synthetic.TABLES["synthetic_oom_heavy"].capacity_gib


def test_synthetic_cli_writes_the_named_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.tables import synthetic

    assert synthetic.main(["--out-dir", str(tmp_path), "--seed", "3", "synthetic_input_bound"]) == 0
    written = tmp_path / "synthetic_input_bound.jsonl"
    assert written.read_text() == synthetic.dumps(synthetic.generate("synthetic_input_bound", seed=3))
    assert "best:" in capsys.readouterr().out


# -- sweep ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("workload", "grid"),
    [
        ("resnet50", ["precision=fp32,fp16", "channels_last=true", "batch_size=8", "cuda_graphs=false"]),
        ("gpt", ["precision=fp32,bf16", "batch_size=4", "cuda_graphs=false"]),
    ],
)
def test_sweep_tiny_writes_valid_lines_and_resumes(
    workload: str, grid: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.tables import sweep

    out = tmp_path / "table.jsonl"
    argv = [workload, "--out", str(out), "--tiny", "--device", "cpu", "--window-seconds", "0.05", "--warmup-steps", "1",
            "--grid", *grid]
    assert sweep.main(argv) == 0
    lines = read_table(out)
    check_table(lines)
    assert len(lines) == 2
    printed = capsys.readouterr().out
    assert printed.count("/2 ") == 2  # one line per config
    by_precision = {line["params"]["precision"]: line for line in lines}
    ok = by_precision["fp32"]
    assert ok["status"] == "ok" and ok["throughput"] > 0 and len(ok["window_throughputs"]) == 3
    if workload == "gpt":
        # throughput is rounded to 0.1 sequence/s, tokens_per_s is computed before rounding
        seq = sweep.GPT_TINY.seq
        assert ok["tokens_per_s"] == pytest.approx(ok["throughput"] * seq, abs=0.05 * seq + 0.1)
        assert by_precision["bf16"]["status"] == "ok"
    else:  # fp16 needs GradScaler, which needs CUDA: an error line, not a crash
        assert by_precision["fp16"]["status"] == "error" and "CUDA" in by_precision["fp16"]["error"]

    # A run killed mid-write leaves a partial line; the rerun drops it and measures nothing twice.
    with out.open("a") as f:
        f.write('{"params": {"precision": "fp')
    assert sweep.main(argv) == 0
    assert read_table(out) == lines


def test_sweep_max_seconds_stops_before_the_next_config(tmp_path: Path) -> None:
    from benchmarks.tables import sweep

    out = tmp_path / "table.jsonl"
    assert sweep.main(["gpt", "--out", str(out), "--tiny", "--device", "cpu", "--max-seconds", "0"]) == 0
    assert not out.exists() or out.read_text() == ""


def test_sweep_grid_parsing_and_compile_filter() -> None:
    from benchmarks.tables import sweep

    knobs = sweep.WORKLOADS["resnet50"].knobs
    parsed = sweep.parse_assignments(["compile=off,default", "channels_last=true", "batch_size=64,128"], knobs)
    assert parsed == {"compile": ["off", "default"], "channels_last": [True], "batch_size": [64, 128]}
    with pytest.raises(ValueError):
        sweep.parse_assignments(["num_workers=4"], knobs)  # the data is on the device: no loader knobs
    with pytest.raises(ValueError):
        sweep.parse_assignments(["precision=fp4"], knobs)  # not a precision

    w = sweep.WORKLOADS["resnet50"]
    configs = sweep.plan(w.grid, w.compile_only)
    compiled = [p for p in configs if p["compile"] != "off"]
    assert len(configs) == 64 + 12 and len(compiled) == 12  # 6 compiled models, with and without graphs
    assert configs[: len(compiled)] == compiled  # compiles first; a time limit cuts cheap eager configs
    for a, b in zip(compiled[::2], compiled[1::2]):  # the graphs variants of one compiled model are adjacent
        assert {**a, "cuda_graphs": None} == {**b, "cuda_graphs": None}
    gpt = sweep.WORKLOADS["gpt"]
    assert len(sweep.plan(gpt.grid, gpt.compile_only)) == 32 + 16
