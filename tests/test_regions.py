"""Regional compilation (``compile_scope: regions``): finding repeated blocks, compiling them, the knob's
removal where a model has none, what a trial records, and the A/B runner's tiny mode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from autotune import TrialConfig
from autotune.search._space import NO_REPEATED_BLOCKS, parse_space, restrict_to_model
from autotune.study._results import _compile
from autotune.trial import _knobs
from autotune.trial._context import TrialContext
from autotune.trial._regions import RegionGroup, compile_regions, repeated_blocks
from benchmarks.runners import regional_compile
from benchmarks.tables.sweep import GPT, GPTShape

TINY = GPTShape(layers=3, d_model=16, heads=2, seq=8, vocab=32)


class _Stage(nn.Module):
    """A block whose width is its own: two stages of different widths share the class, not the structure."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


def test_repeated_blocks_are_found_in_a_transformer_and_in_resnet_stages() -> None:
    assert repeated_blocks(GPT(TINY)) == [RegionGroup("blocks", "_Block", (0, 1, 2))]
    torchvision = pytest.importorskip("torchvision")
    groups = repeated_blocks(torchvision.models.resnet18())
    # layer1's two blocks repeat; the other stages' first block downsamples: a second structure, compiled too.
    assert [g.describe() for g in groups] == ["layer1: 2 x BasicBlock", "layer2: 2 x BasicBlock, 2 structures",
                                              "layer3: 2 x BasicBlock, 2 structures",
                                              "layer4: 2 x BasicBlock, 2 structures"]


def test_a_model_without_repeats_has_no_blocks() -> None:
    leaves = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))  # layers, not blocks
    assert repeated_blocks(leaves) == []
    widths = nn.Sequential(_Stage(4), _Stage(8))  # one class, two structures, each once
    assert repeated_blocks(widths) == []


def _losses(model: nn.Module, steps: int = 4) -> list[float]:
    torch.manual_seed(1)
    ids = torch.randint(0, TINY.vocab, (4, TINY.seq + 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for _ in range(steps):
        logits = model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        out.append(loss.item())
    return out


def test_a_regional_compile_on_the_cpu_trains_as_eager_does() -> None:
    torch.manual_seed(0)
    eager = GPT(TINY)
    regional = GPT(TINY)
    regional.load_state_dict(eager.state_dict())
    config = TrialConfig(compile="default", compile_scope="regions")
    record: dict = {}
    prepared = _knobs.prepare_model(regional, config, torch.device("cpu"), record=record)
    assert prepared is regional  # the blocks are compiled in place; the model itself is not wrapped
    assert all(block._compiled_call_impl is not None for block in regional.blocks)
    assert record == {"compile.scope": "regions", "compile.regions": ["blocks: 3 x _Block"],
                      "compile.region_blocks": 3}
    expected, got = _losses(eager), _losses(regional)
    assert got[-1] < got[0]
    assert got == pytest.approx(expected, rel=1e-4, abs=1e-5)


def test_regions_on_a_model_without_blocks_compile_it_whole() -> None:
    record: dict = {}
    model = _knobs.prepare_model(nn.Sequential(nn.Linear(4, 4)), TrialConfig(compile="default",
                                 compile_scope="regions"), torch.device("cpu"), record=record)
    assert hasattr(model, "_orig_mod") and record == {"compile.scope": "model"}


def test_compile_regions_returns_nothing_to_compile_for_no_groups() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    assert compile_regions(model, None) == [] and model._compiled_call_impl is None


SPACE = {"knobs": {"compile": ["off", "default"], "compile_scope": ["model", "regions"]},
         "baseline": {"batch_size": 32}, "budget": {"samples": 512, "warmup_steps": 1, "windows": 3}}


def test_regions_leave_the_space_with_a_reason_where_the_model_has_no_repeated_blocks() -> None:
    space = parse_space(SPACE)
    gone = restrict_to_model(space, activations_4d=None, repeated_blocks=[])
    assert gone.knobs["compile_scope"].values == ("model",)
    assert gone.removed["compile_scope=regions"] == NO_REPEATED_BLOCKS
    kept = restrict_to_model(space, activations_4d=None, repeated_blocks=["blocks: 6 x _Block"])
    assert kept.knobs["compile_scope"].values == ("model", "regions") and not kept.removed
    assert restrict_to_model(space, activations_4d=None).knobs == space.knobs  # not recorded: nothing removed


def test_the_scope_is_not_asked_without_a_compile() -> None:
    space = parse_space(SPACE)
    assert space.asked_params({"compile": "off", "compile_scope": "regions"}) == {"compile": "off"}
    assert space.size == 3  # off, default x model, default x regions
    with pytest.raises(ValueError, match="compile_scope"):
        TrialConfig(compile_scope="layers")


def test_a_trial_records_its_scope_and_blocks_and_the_best_config_says_so() -> None:
    config = TrialConfig(compile="default", compile_scope="regions")
    ctx = TrialContext(config=config, device=torch.device("cpu"))
    ctx.model(GPT(TINY))
    assert ctx.extras["repeated_blocks"] == ["blocks: 3 x _Block"]
    assert ctx.extras["compile.scope"] == "regions" and ctx.extras["compile.regions"] == ["blocks: 3 x _Block"]
    attrs = {f"extra:{k}": v for k, v in ctx.extras.items()}
    doc = _compile(config, attrs)
    assert doc["scope"] == "regions" and doc["what"] == "block.compile() for each block of blocks: 3 x _Block"
    assert _compile(TrialConfig(compile="default"), {})["what"] == "model = torch.compile(model)"
    assert _compile(TrialConfig(), {}) is None
    assert "scope=regions" in config.describe()


def test_the_runner_in_tiny_mode_writes_both_scopes_of_both_models(tmp_path: Path) -> None:
    assert regional_compile.main([str(tmp_path), "--tiny"]) == 0
    result = json.loads((tmp_path / "regional-tiny.json").read_text())
    assert {(r["part"], r["scope"]) for r in result["runs"] if "error" not in r} == {
        (p, s) for p in ("gpt", "resnet50") for s in ("model", "regions")}, result["runs"]
    gpt = result["summary"]["gpt"]
    assert gpt["scopes"]["regions"]["regions"] == ["blocks: 2 x _Block"] and "keep_regions" in gpt
    assert "| gpt | regions |" in (tmp_path / "regional-tiny.md").read_text()
