"""GPU fault workloads: each trains ResNet-50 a few steps like the smoke workload, then faults."""

import torch

from benchmarks.workloads import smoke as smoke_workload


def oom(ctx) -> None:
    # A real allocator failure: far more than the card has.
    torch.empty(int(1.5 * torch.cuda.get_device_properties(0).total_memory), dtype=torch.uint8, device="cuda")


def illegal_address(ctx) -> None:
    import triton
    import triton.language as tl

    @triton.jit
    def store_far(ptr):
        tl.store(ptr + (1 << 40), 1.0)  # far outside any allocation: an illegal address, not a bounds check

    x = torch.zeros(16, device="cuda")
    store_far[(1,)](x)
    torch.cuda.synchronize()


def device_assert(ctx) -> None:
    x = torch.zeros(16, device="cuda")
    x[torch.tensor([1 << 30], device="cuda")] = 1.0
    torch.cuda.synchronize()


train = smoke_workload.train
