"""How the GPU demo's training behaves at a few settings: does fp32 learn, do seeds agree, does bf16 stay paired?

    python -m benchmarks.runners.demo_dynamics OUT_DIR

For each setting (classes of ResNet-50's head, learning rate, label noise) it trains ResNet-50 on the demo's
data (``autotune.demo.synthetic_images``) for the demo's 60 optimizer steps at the global batch 512: TF32 at
seeds 0 and 1 (fp32's stand-in: a sixth of the time) and bf16 autocast at seed 0, eager, one process. It writes
``OUT_DIR/dynamics.json`` and prints, per setting, the final-quarter losses, the held-out accuracy, and how far
apart the trajectories are: ``|bf16 - tf32|`` at seed 0 (paired: same weights, same batches) against
``|seed 1 - seed 0|`` (another seed), by tens of steps. Pairing is worth something only while the first stays
well below the second.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torchvision
from torch import nn

from autotune.demo import GPU_NOISE, NUM_CLASSES, synthetic_images

SETTINGS = [  # (head classes, lr, label noise)
    (1000, 0.02, 0.2), (10, 0.02, 0.2), (10, 0.01, 0.2), (10, 0.005, 0.2)]
STEPS, BATCH, POOL = 60, 512, 8192


def train(classes: int, lr: float, label_noise: float, seed: int, precision: str) -> dict:
    torch.manual_seed(seed)
    model = torchvision.models.resnet50(num_classes=classes).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    images, labels = synthetic_images(POOL, 224, seed=seed, device="cuda", noise=GPU_NOISE, label_noise=label_noise)
    losses = []
    for step in range(STEPS):
        start = (step * BATCH) % (POOL - BATCH + 1)
        x, y = images[start:start + BATCH], labels[start:start + BATCH]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    test_x, test_y = synthetic_images(1024, 224, seed=10_000, device="cuda", noise=GPU_NOISE)
    model.eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
        accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
    del images
    torch.cuda.empty_cache()
    return {"losses": losses, "accuracy": accuracy}


def by_tens(a: list[float], b: list[float]) -> list[float]:
    return [round(statistics.fmean(abs(x - y) for x, y in zip(a[i:i + 10], b[i:i + 10])), 3) for i in range(0, STEPS, 10)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    assert NUM_CLASSES == 10
    rows = []
    for classes, lr, noise in SETTINGS:
        began = time.monotonic()
        runs = {name: train(classes, lr, noise, seed, precision)
                for name, seed, precision in (("tf32_s0", 0, "tf32"), ("tf32_s1", 1, "tf32"), ("bf16_s0", 0, "bf16"))}
        quarter = STEPS * 3 // 4
        row = {"classes": classes, "lr": lr, "label_noise": noise, "seconds": round(time.monotonic() - began, 1),
               "final_quarter": {k: round(statistics.fmean(v["losses"][quarter:]), 4) for k, v in runs.items()},
               "accuracy": {k: v["accuracy"] for k, v in runs.items()},
               "paired_by_tens": by_tens(runs["bf16_s0"]["losses"], runs["tf32_s0"]["losses"]),
               "seeds_by_tens": by_tens(runs["tf32_s1"]["losses"], runs["tf32_s0"]["losses"]),
               "curves": {k: [round(x, 4) for x in v["losses"]] for k, v in runs.items()}}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "curves"}), flush=True)
        (args.out / "dynamics.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
