"""The fp8 runner for one GPU: its plan loads without a run, and its report says what the studies found."""

from __future__ import annotations

from pathlib import Path

from autotune import TrialConfig
from autotune.search._space import load_space
from benchmarks.runners import fp8_h200


def _trial(number: int, precision: str, rate: float, **extra) -> dict:
    config = TrialConfig(precision=precision, compile="default", cuda_graphs=True, attention="flash",
                         optimizer_impl="fused", global_batch=64).to_dict()
    return {"number": number, "role": "", "status": "ok", "config": config, "throughput": rate,
            "windows": [rate * 0.99, rate, rate * 1.01], "verdict": "equivalent", "error": None,
            "compile_seconds": 40.0, **extra}


def test_dry_writes_spaces_that_load_and_runs_nothing(tmp_path: Path, capsys) -> None:
    assert fp8_h200.main([str(tmp_path), "--dry"]) == 0
    gpt = load_space(tmp_path / "spaces" / "gpt_fp8.yaml")
    assert gpt.knobs["precision"].values == ("bf16", "fp8") and gpt.baseline.attention == "explicit"
    assert load_space(tmp_path / "spaces" / "narrow_fp8.yaml").size == 2
    assert "gpt: 2 configs" in capsys.readouterr().out
    assert not (tmp_path / "fp8-h200.md").exists()


def test_the_report_compares_fp8_with_bf16_round_by_round_and_says_whether_10x_is_reached() -> None:
    gpt = {"study": "gpt", "seconds": 200.0, "minutes": 4.1, "error": None, "baseline_throughput": 334.0,
           "removed": {"precision=fp8 with compile=off": "not in this space"},
           "trials": [_trial(0, "bf16", 3200.0),
                      _trial(1, "fp8", 3300.0, converted=["blocks.0.qkv", "blocks.0.fc"],
                             skipped={"in 512, out 512: small": ["blocks.0.proj"]})],
           "race": {"rounds": [{"0": 3200.0, "1": 3360.0, "baseline": 334.0},
                               {"0": 3210.0, "1": 3300.0, "baseline": 335.0}]},
           "best": {"config": _trial(1, "fp8", 0)["config"], "speedup": 9.95, "accuracy_verdict": "equivalent",
                    "speedup_spread": {"low": 9.85, "high": 10.06, "what": "per-round ratios"}}}
    narrow = {"study": "narrow", "seconds": 50.0, "error": None, "linear_layers": [[256, 1024, 6]],
              "removed": {"precision=fp8": "no linear layer passes the float8 size check"},
              "trials": [_trial(0, "bf16", 5000.0)]}
    forced = {"status": "ok", "throughput": 4000.0, "windows": [3990.0, 4000.0, 4010.0]}
    text = fp8_h200.render({"date": "d", "caps": {"cuda": True, "gpu_name": "GPU", "compute_capability": "9.0"},
                            "torchao": "0.18.0", "gpt": gpt, "narrow": narrow, "forced": forced, "seconds": 300})
    assert "**fp8 / bf16: 1.039x** (1.028x-1.050x, 2 round(s) of the race); verdicts equal" in text
    assert "Converted to float8 (2): blocks.0.qkv, blocks.0.fc." in text
    assert "Kept in bf16: in 512, out 512: small: blocks.0.proj." in text
    assert "Reaches 10x: **not settled**: 9.95x (9.85x-10.06x" in text
    assert "`precision=fp8` removed: no linear layer passes the float8 size check; fp8 trials run: 0." in text
    assert "**0.800x bf16** (0.790x-0.810x, single runs (window range)): the prediction holds." in text


def test_ten_x_is_said_either_way() -> None:
    assert fp8_h200.ten_x(None).startswith("not measured")
    assert fp8_h200.ten_x({"speedup": 10.4, "speedup_spread": {"low": 10.1, "high": 10.6}}).startswith("**yes**")
    assert fp8_h200.ten_x({"speedup": 9.6, "speedup_spread": {"low": 9.5, "high": 9.7}}).startswith("**no**")
