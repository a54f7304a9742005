"""Does scaling the learning rate with the batch let a large batch pass a short accuracy check? On a CPU.

    python -m benchmarks.runners.lr_scaling_cpu 64 0.02 --noise 3.0      # batch, learning rate: 1.000
    python -m benchmarks.runners.lr_scaling_cpu 512 0.16 --noise 3.0     # 0.234
    python -m benchmarks.runners.lr_scaling_cpu 512 0.02 --noise 3.0     # 0.785
    python -m benchmarks.runners.lr_scaling_cpu 512 0.02                 # 0.994 (noise 1.0, the workload's now)

The ResNet-50 benchmark workload (`benchmarks/workloads/resnet50.py:train_device`) in plain PyTorch at 64 px, so a
2-core CPU runs it in about 10-15 minutes a line: the same synthetic task, SGD with momentum, fp32, the
30,720 samples of a `gpu_default` trial, accuracy on 512 held-out images. Not a test.
"""

import argparse
import time

import torch
import torchvision
from torch import nn

from autotune.demo import synthetic_images


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("batch", type=int)
    parser.add_argument("lr", type=float)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--samples", type=int, default=30_720)
    parser.add_argument("--noise", type=float, default=1.0, help="pixel noise of the synthetic task")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = torchvision.models.resnet50(num_classes=1000).to(memory_format=torch.channels_last)
    images, labels = synthetic_images(max(2048, 2 * args.batch), args.size, seed=0, noise=args.noise)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    steps = args.samples // args.batch
    started = time.time()
    for step in range(steps):
        start = (step * args.batch) % (len(images) - args.batch + 1)
        x = images[start:start + args.batch].contiguous(memory_format=torch.channels_last)
        loss = loss_fn(model(x), labels[start:start + args.batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    test_x, test_y = synthetic_images(512, args.size, seed=10_000, noise=args.noise)
    model.eval()
    with torch.no_grad():
        accuracy = (model(test_x.contiguous(memory_format=torch.channels_last)).argmax(1) == test_y).float().mean().item()
    print(f"batch {args.batch} lr {args.lr} steps {steps}: final loss {loss.item():.3f}, accuracy {accuracy:.3f} "
          f"({time.time() - started:.0f} s, {args.size} px, noise {args.noise})")


if __name__ == "__main__":
    main()
