"""``precision: fp8`` and ``allocator: expandable``: the size check, the conversion on the CPU, the space's
removals with their reasons, how to apply both, and a CPU study that removes both before its search."""

from __future__ import annotations

import dataclasses

import json
import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import torch
from torch import nn

import autotune
from autotune import KnobError, MissingExtraError, TrialConfig, TrialContext, applied
from autotune._config import ALLOC_CONF_ENV, alloc_conf_with
from autotune.cli import best_summary
from autotune.hardware._machine import Capabilities, float8_unavailable
from autotune.search._space import FP8_NEEDS_COMPILE, parse_space, restrict_to, restrict_to_model
from autotune.study._runner import TrialRunner
from autotune.trial import _float8
from workloads import WORKLOADS

CPU = torch.device("cpu")
HOPPER = Capabilities(cuda=True, bf16=True, gpu_count=1, gpu_name="GPU", compute_capability="9.0")
SPACE = {"knobs": {"precision": ["fp32", "bf16", "fp8"], "compile": ["off", "default"],
                   "allocator": ["default", "expandable"], "batch_size": [32, 64]},
         "budget": {"samples": 2048, "warmup_steps": 1, "windows": 3}}


class Mixed(nn.Module):
    """Large linear layers (converted) beside small ones and one whose width is no multiple of 16 (kept)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 2048)  # out > 1024: converted
        self.wide = nn.Linear(2048, 4096)  # converted
        self.down = nn.Linear(4096, 512)  # in <= 4096 and out <= 1024: kept in bf16
        self.head = nn.Linear(512, 10)  # 10 is no multiple of 16: kept

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.down(torch.relu(self.wide(torch.relu(self.up(x)))))))


def test_the_size_check_follows_torchaos_table() -> None:
    assert "torchao's table shows float8 slower" in _float8.layer_refusal(2048, 1024)  # 0.80x at 1024,2048,1024
    assert _float8.layer_refusal(8192, 16384) is None  # 1.39x at 4096,8192,16384
    assert _float8.layer_refusal(4096, 1024) is not None and _float8.layer_refusal(4112, 1024) is None
    assert _float8.layer_refusal(512, 1040) is None  # out > 1024 alone is enough
    assert "multiples of 16" in _float8.layer_refusal(8200, 16384)


def test_the_filter_decides_as_torchaos_own_auto_filter() -> None:
    recipe_filter = getattr(pytest.importorskip("torchao.float8"), "_auto_filter_for_recipe", None)
    if recipe_filter is None:
        pytest.skip("this torchao has no _auto_filter_for_recipe to compare with")
    auto = recipe_filter("tensorwise", [])
    shapes = [(k, n) for k in (8, 512, 1024, 2048, 4096, 4112, 8192) for n in (10, 512, 1024, 1040, 2048, 16384)]
    for k, n in shapes:
        layer = nn.Linear(k, n, bias=False, device="meta")
        assert autotune.float8_filter(layer, "x") == auto(layer, "x"), (k, n)
    assert not autotune.float8_filter(nn.Conv2d(2048, 2048, 1), "conv")


def test_the_plan_names_converted_and_skipped_layers_with_reasons() -> None:
    decided = _float8.plan(Mixed())
    assert decided.converted == ("up", "wide")
    assert sorted(name for names in decided.skipped.values() for name in names) == ["down", "head"]
    reasons = {name: why for why, names in decided.skipped.items() for name in names}
    assert reasons["down"].startswith("in 4096, out 512: in <= 4096 and out <= 1024")
    assert reasons["head"].startswith("in 512, out 10: not both multiples of 16")


def test_ctx_model_converts_the_large_layers_and_trains_on_the_cpu() -> None:
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear

    ctx = TrialContext(config=TrialConfig(precision="fp8", batch_size=8), device=CPU)
    model = ctx.model(Mixed())
    assert isinstance(model.up, Float8Linear) and isinstance(model.wide, Float8Linear)
    assert type(model.down) is nn.Linear and type(model.head) is nn.Linear
    assert ctx.extras["fp8.converted"] == ["up", "wide"]
    assert sorted(n for names in ctx.extras["fp8.skipped"].values() for n in names) == ["down", "head"]
    assert ctx.extras["linear_layers"] == [[2048, 4096, 1], [4096, 512, 1], [64, 2048, 1], [512, 10, 1]]
    step = ctx.train_step(model, torch.optim.SGD(model.parameters(), lr=0.01), nn.CrossEntropyLoss())
    loss = step(torch.randn(8, 64), torch.randint(0, 10, (8,)))
    assert torch.isfinite(loss) and model.up.weight.grad is not None


def test_the_convertible_share_and_why_nothing_converts() -> None:
    shapes = _float8.linear_shapes(Mixed())
    share = _float8.convertible_share(shapes)
    assert share == pytest.approx((64 * 2048 + 2048 * 4096) / (64 * 2048 + 2048 * 4096 + 4096 * 512 + 512 * 10))
    assert _float8.no_conversion_reason(shapes) is None
    small = _float8.linear_shapes(nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512), nn.Linear(512, 10)))
    assert small == [[512, 512, 2], [512, 10, 1]] and _float8.convertible_share(small) == 0.0
    why = _float8.no_conversion_reason(small)
    assert why.startswith("no linear layer passes the float8 size check (ctx.model found 3")
    assert "predicted slower than bf16" in why
    assert "no torch.nn.Linear layer" in _float8.no_conversion_reason([])


def test_the_model_rule_drops_fp8_where_nothing_converts_and_prices_it_elsewhere() -> None:
    space = restrict_to(parse_space(SPACE), HOPPER)
    small = restrict_to_model(space, activations_4d=False, linear_layers=[[512, 512, 24], [512, 10, 1]])
    assert small.knobs["precision"].values == ("fp32", "bf16")
    assert "predicted slower than bf16" in small.removed["precision=fp8"]
    cnn = restrict_to_model(space, activations_4d=True, linear_layers=[])
    assert "no torch.nn.Linear layer" in cnn.removed["precision=fp8"]
    large = restrict_to_model(space, activations_4d=False, linear_layers=_float8.linear_shapes(Mixed()))
    assert "fp8" in large.knobs["precision"].values
    assert large.predicted_gains[("precision", "fp8")] == pytest.approx(
        _float8.convertible_share(_float8.linear_shapes(Mixed())))
    unknown = restrict_to_model(space, activations_4d=None)  # no record: nothing known, nothing changes
    assert unknown.knobs == space.knobs and not unknown.predicted_gains
    # A stated baseline is fp32 (space.with_baseline refuses another precision); the rule still spares one.
    fp8_baseline = dataclasses.replace(space, baseline=space.baseline.replace(precision="fp8", compile="default"))
    kept = restrict_to_model(fp8_baseline, activations_4d=None,
                             linear_layers=[[512, 10, 1]])
    assert "fp8" in kept.knobs["precision"].values  # the baseline's own precision stays


def test_fp8_and_the_allocator_are_removed_on_a_cpu_with_reasons(cpu_caps) -> None:
    space = restrict_to(parse_space(SPACE), cpu_caps)
    assert space.knobs["precision"].values == ("fp32", "bf16") and space.knobs["allocator"].values == ("default",)
    assert space.removed["precision=fp8"].startswith("no CUDA device: float8 matmuls need")
    assert space.removed["allocator=expandable"].startswith("no CUDA device: expandable segments")


def test_fp8_goes_below_compute_capability_8_9_and_without_torchao() -> None:
    assert "compute capability 8.0: float8 matmuls need 8.9" in float8_unavailable((8, 0), "A100")
    ampere = Capabilities(cuda=True, bf16=True, gpu_name="A100", fp8_unavailable=float8_unavailable((8, 0), "A100"))
    assert "compute capability 8.0" in restrict_to(parse_space(SPACE), ampere).removed["precision=fp8"]
    missing = Capabilities(cuda=True, bf16=True, fp8_unavailable="torchao is not installed (install the `fp8` extra)")
    assert "fp8" not in restrict_to(parse_space(SPACE), missing).knobs["precision"].values
    if _torchao_imports():
        assert float8_unavailable((9, 0), "H200") == ""


def _torchao_imports() -> bool:
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return False
    return True


def test_fp8_is_never_paired_with_compile_off() -> None:
    space = restrict_to(parse_space(SPACE), HOPPER)
    assert space.removed["precision=fp8 with compile=off"] == FP8_NEEDS_COMPILE
    assert space.cannot_run({"precision": "fp8", "compile": "off"}) == FP8_NEEDS_COMPILE
    assert space.cannot_run({"precision": "fp8", "compile": "default"}) is None
    no_compiler = Capabilities(cuda=True, bf16=True, compile=False, compile_reason="no compiler")
    eager = restrict_to(parse_space(SPACE), no_compiler)  # only compile=off is left: fp8 goes as a value
    assert "fp8" not in eager.knobs["precision"].values and eager.removed["precision=fp8"] == FP8_NEEDS_COMPILE


def test_applied_refuses_the_allocator_on_a_cpu_and_fp8_without_torchao(monkeypatch) -> None:
    monkeypatch.delenv(ALLOC_CONF_ENV, raising=False)
    with pytest.raises(KnobError, match="allocator=expandable needs a CUDA device"):
        with applied(TrialConfig(allocator="expandable"), CPU):
            pytest.fail("the block must not run")
    assert ALLOC_CONF_ENV not in os.environ  # put back as it was
    monkeypatch.setitem(sys.modules, "torchao", None)  # as if it were not installed
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'autotune\[fp8\]'"):
        with applied(TrialConfig(precision="fp8", compile="default"), CPU):
            pytest.fail("the block must not run")


def test_how_to_apply_carries_both() -> None:
    config = TrialConfig(precision="fp8", compile="default", allocator="expandable")
    assert "convert_to_float8_training(model, module_filter_fn=autotune.float8_filter)" in config.float8_training
    assert "torch.compile" in config.float8_training and "bfloat16" in config.float8_training
    assert f"{ALLOC_CONF_ENV}=expandable_segments:True" in config.memory_allocator
    assert TrialConfig().float8_training == "" and "allocator=default" in TrialConfig().memory_allocator
    assert config.describe() == "fp8 bs64 compile=default allocator=expandable workers=0"
    doc = {"study": "s", "trial": 3, "verdict": "1.20x faster than the baseline", "speedup": 1.2,
           "config": config.to_dict(), "baseline": {"config": TrialConfig().to_dict()},
           "float8": {"what": config.float8_training, "converted": ["up", "wide"], "skipped": {}},
           "allocator": {"allocator": "expandable", "env": {ALLOC_CONF_ENV: "expandable_segments:True"},
                         "what": config.memory_allocator}}
    lines = best_summary(doc, Path("best_config.json"))
    assert any(line.startswith("Float8: precision=fp8: convert") and "converted 2 layers: up, wide" in line
               for line in lines)
    assert any(line.startswith("Allocator: allocator=expandable: start the training process with") for line in lines)


def test_the_allocator_reaches_the_trial_process_only(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(ALLOC_CONF_ENV, "max_split_size_mb:128,expandable_segments:False")
    runner = TrialRunner(target="x:y", logdir=tmp_path, baseline=TrialConfig(), budget=autotune.Budget(), timeout=60)
    env = runner.spec(TrialConfig(allocator="expandable"), seed=0).env
    assert env == {ALLOC_CONF_ENV: "max_split_size_mb:128,expandable_segments:True"}
    assert runner.spec(TrialConfig(), seed=0).env is None  # the default allocator: the environment as it is
    assert os.environ[ALLOC_CONF_ENV] == "max_split_size_mb:128,expandable_segments:False"
    assert alloc_conf_with("", "expandable_segments:True") == "expandable_segments:True"


def test_a_cpu_study_removes_fp8_and_the_allocator_before_its_search(tmp_path: Path) -> None:
    """Through ``autotune tune`` and the real probe: both go with their reasons, said before the search."""
    space = tmp_path / "space.yaml"
    space.write_text("knobs:\n  precision: [fp32, fp8]\n  compile: [off]\n  allocator: [default, expandable]\n"
                     "  cpu_threads: [null, 1]\nbudget: {samples: 512, warmup_steps: 1, windows: 3}\n")
    args = ["tune", f"{WORKLOADS}:train_tiny", "--space", space, "--trials", 1, "--top-k", 0, "--prune-below", 0,
            "--no-progress", "--no-plots", "--studies-dir", tmp_path / "studies"]
    proc = subprocess.run([sys.executable, "-m", "autotune", *map(str, args)], cwd=tmp_path,
                          env={**os.environ, "COLUMNS": "400"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    study = optuna.load_study(study_name="train_tiny", storage=f"sqlite:///{tmp_path}/studies/autotune.db")
    removed = study.user_attrs["removed_knobs"]
    assert removed["precision=fp8"].startswith("no CUDA device: float8 matmuls need")
    assert removed["allocator=expandable"].startswith("no CUDA device: expandable segments")
    (said,) = [line for line in proc.stdout.splitlines() if line.startswith("Removed before the search")]
    assert "precision=fp8 (no CUDA device" in said and "allocator=expandable (no CUDA device" in said
    assert all(t.user_attrs["config"]["precision"] == "fp32" and t.user_attrs["config"]["allocator"] == "default"
               for t in study.trials)
    assert study.user_attrs["reference_measurement"]["extras"]["linear_layers"] == [[16, 32, 1], [32, 4, 1]]
    doc = json.loads((tmp_path / "studies" / "train_tiny" / "best_config.json").read_text())
    assert doc["float8"] is None and doc["allocator"]["env"] is None
