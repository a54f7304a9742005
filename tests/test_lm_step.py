"""ctx.train_step for language models, and the attention, optimizer_impl and activation_checkpointing knobs.

Each knob's test asserts that it took effect in what ran (the profiler's ops, recomputed forwards), not
only that the config carries it.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from autotune._config import Budget, TrialConfig
from autotune._errors import KnobError, SpaceError, WorkloadError
from autotune.hardware._machine import Capabilities, checkpointing_unavailable, optimizer_impl_unavailable, sdpa_unavailable
from autotune.search._rules import needs_at_least
from autotune.search._space import parse_space, restrict_to
from autotune.trial._context import TrialContext
from autotune.trial._knobs import graph_safe_lr

CPU = torch.device("cpu")


@dataclass
class Output:
    logits: torch.Tensor
    loss: Optional[torch.Tensor] = None


class TinyLM(nn.Module):
    """Embedding, one attention layer through ``attend``, a head; returns its loss when given labels."""

    def __init__(self, attend=F.scaled_dot_product_attention, wrap=lambda m: m, vocab: int = 32, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.attend = attend
        self.block = wrap(Mixer(d, attend))
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None) -> Output:
        logits = self.head(self.block(self.emb(input_ids)))
        loss = None if labels is None else F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return Output(logits, loss)


class Mixer(nn.Module):
    def __init__(self, d: int, attend) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.attend = attend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)  # one head
        return x + self.attend(q, k, v, is_causal=True).squeeze(1)


def _batch(n: int = 8, t: int = 12, vocab: int = 32, seed: int = 0) -> dict:
    ids = torch.randint(0, vocab, (n, t + 1), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


def _ctx(**knobs) -> TrialContext:
    return TrialContext(config=TrialConfig(**{"batch_size": 8, **knobs}), device=CPU)


def _ops(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}


# -- train_step: batches, loss, clipping, scheduler -------------------------------------------------
def test_a_dict_batch_trains_on_the_models_own_loss() -> None:
    torch.manual_seed(0)
    model = TinyLM()
    reference = copy.deepcopy(model)
    ctx = _ctx()
    step = ctx.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    batch = _batch()
    loss = step(batch)
    expected = reference(**batch).loss
    assert torch.allclose(loss, expected.detach())
    expected.backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * p.grad
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_a_tuple_batch_takes_a_callable_loss_of_outputs_and_batch() -> None:
    torch.manual_seed(0)
    model = TinyLM()
    seen = []

    def loss_fn(outputs, batch):
        seen.append(len(batch))
        ids, labels = batch
        return F.cross_entropy(outputs.logits.flatten(0, 1), labels.flatten())

    step = _ctx().train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn)
    b = _batch()
    step((b["input_ids"], b["labels"]))  # model(*batch): the labels go in too, and the callable wins
    assert seen == [2]


def test_a_model_without_a_loss_and_no_loss_fn_is_named_plainly() -> None:
    model = TinyLM()
    step = _ctx().train_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(WorkloadError, match="no loss tensor"):
        step({"input_ids": _batch()["input_ids"]})


def test_the_image_loop_still_takes_inputs_and_targets() -> None:
    model = nn.Linear(4, 3)
    step = _ctx().train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    loss = step(torch.randn(8, 4), torch.randint(0, 3, (8,)))
    assert loss.shape == () and math.isfinite(loss.item())


@pytest.mark.parametrize("compile_loss", [True, False])
def test_under_compile_the_forward_and_the_loss_are_one_graph_that_returns_the_loss_alone(compile_loss: bool) -> None:
    # A real inductor compile on the CPU. Compiling the module alone makes the logits a graph output beside
    # the loss, whose unused gradient the backward pass then fills with zeros (0.6 ms a step for a GPT-style
    # LM's 32,000-way logits on an H200, lm-ceiling-h200.md); one graph for the forward and the loss
    # returns the loss alone.
    from autotune.trial._knobs import TrainStep

    torch.manual_seed(0)
    eager_model = TinyLM()
    model = copy.deepcopy(eager_model)
    config = TrialConfig(batch_size=8, compile="default")
    ctx = TrialContext(config=config, device=CPU)
    compiled = ctx.model(model)
    step = TrainStep(compiled, torch.optim.SGD(compiled.parameters(), lr=0.1), config=config, device=CPU,
                     compile_loss=compile_loss)
    eager = _ctx().train_step(eager_model, torch.optim.SGD(eager_model.parameters(), lr=0.1))
    assert step.compiled_loss is compile_loss
    for seed in range(3):
        batch = _batch(seed=seed)
        assert torch.allclose(step(batch), eager(batch), atol=1e-5)
    for a, b in zip(model.parameters(), eager_model.parameters()):
        assert torch.allclose(a, b, atol=1e-5)
    loss = step._loss((_batch(),))
    assert loss.grad_fn.name() == "CompiledFunctionBackward"
    # The compiled graph's outputs that need a gradient: the loss alone, or the logits beside it.
    assert len(loss.grad_fn._input_metadata) == (1 if compile_loss else 2)
    # The module stays compiled for the user's own calls (evaluation), as ctx.model returned it.
    assert compiled(**_batch()).logits.shape == (8, 12, 32)


def test_an_uncompiled_model_is_called_as_it_is() -> None:
    model = TinyLM()
    step = _ctx().train_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert step.compiled_loss is False


def _clipped_update(config: TrialConfig, clip: float) -> tuple[list[torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    model = TinyLM()
    before = [p.detach().clone() for p in model.parameters()]
    ctx = TrialContext(config=config, device=CPU)
    step = ctx.train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), clip_grad_norm=clip)
    batch = _batch(n=16)
    for start in range(0, 16, config.batch_size):
        step({k: v[start:start + config.batch_size] for k, v in batch.items()})
    return [b - p.detach() for b, p in zip(before, model.parameters())], step.grad_norm


def test_clip_grad_norm_clips_the_global_batch_gradient_on_the_device() -> None:
    deltas, norm = _clipped_update(TrialConfig(batch_size=16), clip=0.05)
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(d) for d in deltas]))
    assert norm.device.type == "cpu" and norm.item() > 0.05  # the norm before clipping, kept as a tensor
    assert total.item() == pytest.approx(0.05, rel=1e-4)  # SGD at lr 1: the update is the clipped gradient
    # Accumulated micro-batches are clipped once, as the full batch's gradient.
    accumulated, acc_norm = _clipped_update(TrialConfig(batch_size=4, global_batch=16), clip=0.05)
    assert acc_norm.item() == pytest.approx(norm.item(), rel=1e-4)
    for a, b in zip(deltas, accumulated):
        assert torch.allclose(a, b, atol=1e-6)
    with pytest.raises(ValueError, match="positive"):
        _ctx().train_step(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1), clip_grad_norm=0)


def test_the_scheduler_steps_once_per_optimizer_step_with_accumulation() -> None:
    torch.manual_seed(0)
    model = TinyLM()
    budget = Budget(samples=128, warmup_steps=1, windows=3)
    ctx = TrialContext(config=TrialConfig(batch_size=4, global_batch=16), budget=budget, device=CPU)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    lrs = []
    optimizer.register_step_post_hook(lambda opt, *_: lrs.append(opt.param_groups[0]["lr"]))
    step = ctx.train_step(model, optimizer, scheduler=scheduler)
    data = _batch(n=64)
    batches = [{k: v[i:i + 4] for k, v in data.items()} for i in range(0, 64, 4)]
    for batch in ctx.batches(batches):
        step(batch)
    assert step.optimizer_steps == 128 // 16 == len(lrs)
    assert lrs == pytest.approx([1e-3 / (1 + s) for s in range(8)])  # the LR of each step, as scheduled
    assert len(ctx.measurement().losses) == 8


def test_a_tensor_lr_filled_by_the_scheduler_is_what_the_step_reads() -> None:
    # graph_safe_lr gives the optimizer a 0-dim LR tensor, which a captured graph reads at every replay;
    # the scheduler must fill that tensor in place. Checked eagerly with fused AdamW (no GPU here).
    def run(tensor_lr: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Linear(4, 4)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 ** s)
        if tensor_lr:
            graph_safe_lr(optimizer, CPU)
            lr = optimizer.param_groups[0]["lr"]
            assert isinstance(lr, torch.Tensor) and lr.dim() == 0
        for _ in range(4):
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
        if tensor_lr:
            assert optimizer.param_groups[0]["lr"] is lr and lr.item() == pytest.approx(1e-2 * 0.5 ** 4)
        return [p.detach() for p in model.parameters()]

    for a, b in zip(run(False), run(True)):
        assert torch.allclose(a, b)


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),  # reads a tensor LR on the host unless fused
    lambda ps: torch.optim.RMSprop(ps, lr=0.1),
])
def test_a_scheduler_whose_optimizer_cannot_read_a_tensor_lr_in_a_graph_is_refused(make) -> None:
    with pytest.raises(KnobError, match="reads its learning rate on the host"):
        graph_safe_lr(make(nn.Linear(2, 2).parameters()), CPU)


# -- attention ---------------------------------------------------------------------------------------
ATTENTION_OPS = {
    "math": "aten::_scaled_dot_product_attention_math",
    "flash": "aten::_scaled_dot_product_flash_attention_for_cpu",
}


@pytest.mark.parametrize("attention", ["auto", "flash", "math", "explicit"])
def test_the_attention_knob_picks_the_kernel_that_runs(attention: str) -> None:
    if attention in sdpa_unavailable(CPU):
        pytest.skip(f"{attention} does not run on this CPU")
    torch.manual_seed(0)
    ctx = _ctx(attention=attention)
    model = TinyLM(attend=ctx.attention)
    step = ctx.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ops = _ops(lambda: step(_batch()))
    sdpa = {op for op in ops if "scaled_dot_product" in op}
    if attention == "explicit":
        assert not sdpa and "aten::softmax" in ops
    elif attention == "auto":
        assert "aten::scaled_dot_product_attention" in ops
    else:
        assert ATTENTION_OPS[attention] in ops and not (set(ATTENTION_OPS.values()) - {ATTENTION_OPS[attention]}) & ops
    # Evaluation under ctx.autocast() runs the same kernel.
    with torch.no_grad():
        eval_ops = _ops(lambda: _in(ctx.autocast(), lambda: model(_batch()["input_ids"])))
    if attention in ATTENTION_OPS:
        assert ATTENTION_OPS[attention] in eval_ops


def _in(context, fn):
    with context:
        return fn()


def test_explicit_attention_computes_what_sdpa_computes() -> None:
    q, k, v = (torch.randn(2, 3, 10, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    ctx = _ctx(attention="explicit")
    mask = torch.rand(10, 10, generator=torch.Generator().manual_seed(5)) > 0.3
    mask |= torch.eye(10, dtype=torch.bool)
    for kwargs in ({"is_causal": True}, {}, {"attn_mask": mask}, {"scale": 0.5}):
        assert torch.allclose(ctx.attention(q, k, v, **kwargs), F.scaled_dot_product_attention(q, k, v, **kwargs),
                              atol=1e-5)


def test_the_probe_keeps_exactly_the_backends_that_run() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    removed = sdpa_unavailable(CPU)
    assert "math" not in removed  # the reference kernel runs everywhere
    members = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
               "math": "MATH"}
    q = torch.randn(1, 2, 16, 64, requires_grad=True)
    for value, member in members.items():
        try:
            with sdpa_kernel(getattr(SDPBackend, member)):
                F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
            runs = True
        except RuntimeError:
            runs = False
        assert runs == (value not in removed), (value, removed.get(value))
    space = parse_space({"knobs": {"attention": ["auto", "flash", "efficient", "cudnn", "math", "explicit"]}})
    restricted = restrict_to(space, Capabilities(cuda=False, bf16=True, attention_unavailable=removed))
    assert set(restricted.knobs["attention"].values) == {"auto", "flash", "efficient", "cudnn", "math",
                                                         "explicit"} - set(removed)
    for value in removed:
        assert "no " + value + " kernel" in restricted.removed[f"attention={value}"]


# -- optimizer_impl ----------------------------------------------------------------------------------
@pytest.mark.parametrize("impl, present, absent", [
    ("default", set(), {"aten::_fused_adamw_", "aten::_foreach_mul_"}),  # on a CPU torch loops per tensor
    ("foreach", {"aten::_foreach_mul_"}, {"aten::_fused_adamw_"}),
    ("fused", {"aten::_fused_adamw_"}, set()),
])
def test_optimizer_impl_picks_the_implementation_that_steps(impl: str, present: set, absent: set) -> None:
    if impl in optimizer_impl_unavailable(CPU):
        pytest.skip(f"{impl} AdamW does not run on this CPU")
    model = nn.Linear(8, 8)
    optimizer = _ctx(optimizer_impl=impl).optimizer(torch.optim.AdamW, model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    ops = _ops(optimizer.step)
    assert present <= ops and not absent & ops, sorted(o for o in ops if "_f" in o)


def test_optimizer_impl_refuses_an_optimizer_without_it_or_a_conflicting_call() -> None:
    params = list(nn.Linear(2, 2).parameters())
    with pytest.raises(KnobError, match="LBFGS takes no fused= option"):
        _ctx(optimizer_impl="fused").optimizer(torch.optim.LBFGS, params)
    with pytest.raises(KnobError, match="already passes foreach=True"):
        _ctx(optimizer_impl="fused").optimizer(torch.optim.AdamW, params, foreach=True)


def test_fp16_with_graphs_does_not_ask_optimizer_impl() -> None:
    space = parse_space({"knobs": {"precision": ["fp16", "bf16"], "cuda_graphs": [False, True],
                                   "optimizer_impl": ["default", "foreach", "fused"]}})
    assert "optimizer_impl" not in space.asked_params({"precision": "fp16", "cuda_graphs": True,
                                                       "optimizer_impl": "foreach"})
    assert space.asked_params({"precision": "bf16", "cuda_graphs": True, "optimizer_impl": "foreach"})[
        "optimizer_impl"] == "foreach"


# -- activation checkpointing ------------------------------------------------------------------------
@pytest.mark.parametrize("on", [False, True])
def test_checkpointing_recomputes_the_wrapped_block_in_the_backward(on: bool) -> None:
    torch.manual_seed(0)
    ctx = _ctx(activation_checkpointing=on)
    model = TinyLM(wrap=ctx.checkpoint)
    plain = TinyLM()
    plain.load_state_dict(model.state_dict())  # same keys either way
    calls = []
    model.block.qkv.register_forward_hook(lambda *_: calls.append(1))
    step = ctx.train_step(model, torch.optim.SGD(model.parameters(), lr=0.0))
    step(_batch())
    assert len(calls) == (2 if on else 1)  # the forward, and with checkpointing its recomputation
    assert isinstance(model.block, Mixer) and type(model.block).__name__ == ("CheckpointedMixer" if on else "Mixer")
    plain(**_batch()).loss.backward()
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name
    assert type(copy.deepcopy(model).block) is type(model.block)  # a copy stays checkpointed
    calls.clear()
    with torch.no_grad():
        model(_batch()["input_ids"])
    assert len(calls) == 1  # without gradients there is nothing to recompute


def test_checkpointing_and_the_other_probes_pass_here() -> None:
    assert checkpointing_unavailable(CPU) == ""
    space = parse_space({"knobs": {"activation_checkpointing": [False, True]}})
    removed = restrict_to(space, Capabilities(cuda=False, bf16=True, checkpointing_unavailable="broken"))
    assert removed.knobs["activation_checkpointing"].values == (False,)
    assert removed.removed["activation_checkpointing=true"] == "broken"


def test_the_memory_rule_knows_checkpointing_lowers_memory() -> None:
    failed = {"precision": "bf16", "batch_size": 64, "activation_checkpointing": True}
    assert needs_at_least({**failed, "activation_checkpointing": False}, failed)  # keeps more: also out of memory
    assert not needs_at_least({**failed, "activation_checkpointing": True, "batch_size": 32}, failed)
    failed_plain = {**failed, "activation_checkpointing": False}
    assert not needs_at_least({**failed_plain, "activation_checkpointing": True}, failed_plain)  # may fit
    assert needs_at_least({**failed_plain, "batch_size": 128}, failed_plain)


# -- config and YAML ---------------------------------------------------------------------------------
def test_new_fields_validate_in_the_config_and_the_space() -> None:
    config = TrialConfig(attention="flash", optimizer_impl="fused", activation_checkpointing=True)
    assert TrialConfig.from_dict(config.to_dict()) == config
    assert "attention=flash" in config.describe() and "optimizer=fused" in config.describe()
    assert "checkpointing" in config.describe()
    for bad in ({"attention": "fast"}, {"optimizer_impl": "turbo"}, {"activation_checkpointing": "yes"}):
        with pytest.raises(ValueError):
            TrialConfig(**bad)
    for knobs, where in (({"attention": ["auto", "fast"]}, "knobs.attention"),
                         ({"optimizer_impl": ["fused", "x"]}, "knobs.optimizer_impl"),
                         ({"activation_checkpointing": ["yes"]}, "knobs.activation_checkpointing")):
        with pytest.raises(SpaceError, match=where):
            parse_space({"knobs": knobs})
    space = parse_space({"knobs": {"attention": ["explicit", "flash"]}, "baseline": {"attention": "explicit"}})
    assert space.baseline.attention == "explicit"


def test_spaces_without_the_new_knobs_keep_their_stored_fingerprints() -> None:
    # The fingerprints before the attention, optimizer_impl and activation_checkpointing knobs existed: a
    # study stored then must resume, not be refused as a changed space.
    from autotune.search._space import load_space, parse_space

    # cpu_default as it was then (it has since gained the loader knob, a change of the space itself).
    cpu_default = parse_space({
        "description": "Default space for training on CPU. Knobs a CPU cannot use are left out.",
        "knobs": {"precision": ["fp32", "bf16"], "batch_size": [16, 32, 64, 128, 256],
                  "channels_last": [False, True], "compile": ["off", "default"], "num_workers": [0, 1, 2, 4],
                  "persistent_workers": [False, True], "cpu_threads": [None, 1, 2, 4, 8]},
        "baseline": {"precision": "fp32", "batch_size": 64},
        "budget": {"samples": 8192, "warmup_steps": 3, "windows": 3}}, name="cpu_default")
    assert cpu_default.fingerprint == "8034e2c740f12c8d"
    assert load_space("example_cifar_cnn").fingerprint == "fa197fe222216081"
    assert load_space("example_gpt_lm").to_dict()["baseline"]["attention"] == "explicit"


def test_the_probe_records_the_precisions_a_kept_backend_cannot_run_in() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from autotune.hardware._machine import DTYPE_PRECISIONS, SDPA_BACKENDS, _probe_kernels, sdpa_probe

    removed, partial = sdpa_probe(CPU)
    assert isinstance(partial, dict) and not set(partial) & set(removed)
    for value, member in SDPA_BACKENDS.items():
        if value in removed:
            continue
        for dtype, precisions in DTYPE_PRECISIONS.items():
            q = torch.randn(1, 2, 16, 64, dtype=getattr(torch, dtype), requires_grad=True)
            try:
                with sdpa_kernel(getattr(SDPBackend, member)):
                    F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
                runs = True
            except RuntimeError:
                runs = False
            for precision in precisions:
                assert runs == (precision not in partial.get(value, {})), (value, precision, partial)
    # The probe's answer carries it, as JSON.
    kernels = _probe_kernels(CPU)
    assert kernels["attention_precision_unavailable"] == partial and kernels["attention_unavailable"] == removed
