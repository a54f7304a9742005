"""Knobs applied in this process on the CPU: autocast, channels_last, global flags and their restoration."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autotune import KnobError, TrialConfig, TrialContext, applied

CPU = torch.device("cpu")


@pytest.fixture
def global_flags():
    """Put the process-wide flags back even if a test (or the code under test) fails to."""
    saved = (torch.get_num_threads(), torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32,
             torch.backends.cudnn.allow_tf32)
    yield saved
    torch.set_num_threads(saved[0])
    torch.backends.cudnn.benchmark = saved[1]
    torch.backends.cuda.matmul.allow_tf32 = saved[2]
    torch.backends.cudnn.allow_tf32 = saved[3]


def conv_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 4))


def _one_step_recording(precision: str) -> dict:
    """Run one real train step and record the autocast state the forward pass and the loss saw."""
    seen: dict = {}
    ctx = TrialContext(config=TrialConfig(precision=precision, batch_size=8), device=CPU)
    model = ctx.model(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))

    def hook(module, inputs, output):
        seen["forward_autocast"] = torch.is_autocast_enabled("cpu")
        seen["forward_dtype"] = torch.get_autocast_dtype("cpu")
        seen["output_dtype"] = output.dtype

    model[0].register_forward_hook(hook)

    def loss_fn(outputs, targets):
        seen["loss_autocast"] = torch.is_autocast_enabled("cpu")
        seen["logits_dtype"] = outputs.dtype
        return nn.functional.cross_entropy(outputs.float(), targets)

    optimizer = ctx.optimizer(torch.optim.SGD, model.parameters(), lr=0.1)
    step = ctx.train_step(model, optimizer, loss_fn)
    loss = step(torch.randn(8, 16), torch.randint(0, 4, (8,)))
    seen["loss_dtype"] = loss.dtype
    seen["autocast_after"] = torch.is_autocast_enabled("cpu")
    return seen


def test_bf16_steps_run_under_bf16_autocast() -> None:
    seen = _one_step_recording("bf16")
    assert seen["forward_autocast"] and seen["loss_autocast"]
    assert seen["forward_dtype"] == torch.bfloat16
    assert seen["output_dtype"] == torch.bfloat16 and seen["logits_dtype"] == torch.bfloat16
    assert seen["autocast_after"] is False  # autocast covers the step only


@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_fp32_and_tf32_steps_run_without_autocast(precision: str) -> None:
    # get_autocast_dtype('cpu') reports bf16 even when autocast is off, so the decisive facts are that
    # autocast is disabled and that the activations come out in float32.
    seen = _one_step_recording(precision)
    assert seen["forward_autocast"] is False and seen["loss_autocast"] is False
    assert seen["output_dtype"] == torch.float32 and seen["logits_dtype"] == torch.float32
    assert seen["loss_dtype"] == torch.float32


def test_ctx_autocast_for_evaluation_follows_the_precision() -> None:
    x = torch.randn(4, 16)
    layer = nn.Linear(16, 4)
    with TrialContext(config=TrialConfig(precision="bf16"), device=CPU).autocast():
        assert layer(x).dtype == torch.bfloat16
    with TrialContext(config=TrialConfig(precision="fp32"), device=CPU).autocast():
        assert layer(x).dtype == torch.float32


@pytest.mark.parametrize("channels_last", [True, False])
def test_channels_last_model_and_batches(channels_last: bool) -> None:
    ctx = TrialContext(config=TrialConfig(channels_last=channels_last), device=CPU)
    model = ctx.model(conv_net())
    weight = model[0].weight
    assert weight.is_contiguous(memory_format=torch.channels_last) is channels_last
    images = ctx.to_device(torch.randn(2, 3, 8, 8))
    assert images.is_contiguous(memory_format=torch.channels_last) is channels_last
    assert model(images).shape == (2, 4)  # the model still runs on the converted batch
    labels = ctx.to_device(torch.arange(2))
    assert labels.dtype == torch.int64 and labels.is_contiguous()


def test_applied_sets_threads_inside_and_restores_them(global_flags) -> None:
    torch.set_num_threads(2)
    with applied(TrialConfig(cpu_threads=1), CPU):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with applied(TrialConfig(cpu_threads=None), CPU):
        assert torch.get_num_threads() == 2  # None leaves the count alone


def test_applied_sets_and_restores_backend_flags(global_flags) -> None:
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    with applied(TrialConfig(precision="bf16", cudnn_benchmark=True), CPU):
        assert torch.backends.cudnn.benchmark is True
        assert torch.backends.cuda.matmul.allow_tf32 is True  # TF32 is on for every precision but fp32
    assert torch.backends.cudnn.benchmark is False
    assert torch.backends.cuda.matmul.allow_tf32 is False

    torch.backends.cuda.matmul.allow_tf32 = True
    with applied(TrialConfig(precision="fp32"), CPU):
        assert torch.backends.cuda.matmul.allow_tf32 is False  # fp32 is true fp32, the reference
    assert torch.backends.cuda.matmul.allow_tf32 is True


def test_applied_restores_everything_when_the_block_raises(global_flags) -> None:
    torch.set_num_threads(2)
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    with pytest.raises(RuntimeError, match="the trial failed"):
        with applied(TrialConfig(precision="tf32", cudnn_benchmark=True, cpu_threads=1), CPU):
            assert torch.get_num_threads() == 1
            raise RuntimeError("the trial failed")
    assert torch.get_num_threads() == 2
    assert torch.backends.cudnn.benchmark is False
    assert torch.backends.cuda.matmul.allow_tf32 is False


def test_memory_fraction_needs_cuda_and_leaves_flags_as_they_were(global_flags) -> None:
    torch.set_num_threads(2)
    with pytest.raises(KnobError, match="memory_fraction"):
        with applied(TrialConfig(memory_fraction=0.5, cpu_threads=1), CPU):
            pytest.fail("the block must not run")
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize(
    "config, match",
    [(TrialConfig(cuda_graphs=True), "cuda_graphs needs a CUDA device"),
     (TrialConfig(precision="fp16"), "fp16 with GradScaler needs a CUDA device")],
    ids=["cuda_graphs", "fp16"],
)
def test_cuda_only_step_knobs_raise_knob_error_on_cpu(config: TrialConfig, match: str) -> None:
    ctx = TrialContext(config=config, device=CPU)
    model = ctx.model(nn.Linear(4, 2))
    optimizer = ctx.optimizer(torch.optim.SGD, model.parameters(), lr=0.1)
    with pytest.raises(KnobError, match=match):
        ctx.train_step(model, optimizer, nn.CrossEntropyLoss())


def test_optimizer_gets_no_cuda_options_on_cpu() -> None:
    ctx = TrialContext(config=TrialConfig(), device=CPU)
    optimizer = ctx.optimizer(torch.optim.SGD, nn.Linear(4, 2).parameters(), lr=0.5, momentum=0.9)
    assert optimizer.defaults["lr"] == 0.5 and optimizer.defaults["momentum"] == 0.9
    assert not optimizer.defaults.get("capturable") and not optimizer.defaults.get("fused")
