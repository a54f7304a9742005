"""ResNet-50 on synthetic device data, recording evidence that each knob was really in effect."""

import torch
import torchvision
from torch import nn

from autotune.demo import _DeviceBatches, synthetic_images


def train(ctx) -> None:
    torch.manual_seed(ctx.seed)
    net = torchvision.models.resnet50(num_classes=1000)
    seen: dict = {}

    def hook(module, inputs, output):
        seen.setdefault("fc_output_dtype", str(output.dtype))

    net.fc.register_forward_hook(hook)
    model = ctx.model(net)
    images, labels = synthetic_images(max(512, 2 * ctx.config.batch_size), 224, seed=ctx.seed, device="cuda")
    optimizer = ctx.optimizer(torch.optim.SGD, model.parameters(), lr=0.02, momentum=0.9)
    step = ctx.train_step(model, optimizer, nn.CrossEntropyLoss())
    losses = []
    for x, y in ctx.batches(_DeviceBatches(images, labels, ctx.config.batch_size)):
        losses.append(step(x, y).float().clone())
    ctx.record("loss_first_last", [round(losses[0].item(), 3), round(losses[-1].item(), 3)])
    ctx.record("fc_output_dtype", seen.get("fc_output_dtype"))
    ctx.record("input_channels_last", x.is_contiguous(memory_format=torch.channels_last))
    ctx.record("matmul_allow_tf32", torch.backends.cuda.matmul.allow_tf32)
    ctx.record("cudnn_benchmark", torch.backends.cudnn.benchmark)
    ctx.record("optimizer_fused", bool(optimizer.defaults.get("fused")))
    if step.scaler is not None:
        ctx.record("scaler_scale", float(step.scaler.get_scale()))
    if ctx.config.memory_fraction < 1.0:
        total = torch.cuda.get_device_properties(0).total_memory
        want = int(total * min(1.0, ctx.config.memory_fraction + 0.05))
        try:
            blob = torch.empty(want, dtype=torch.uint8, device="cuda")
            del blob
            ctx.record("allocation_beyond_fraction", "allowed")
        except torch.OutOfMemoryError:
            ctx.record("allocation_beyond_fraction", "refused (OutOfMemoryError)")
    ctx.report_metric(float(torch.isfinite(step.last_loss).item()))
