"""What a failed config tells about configs not yet run: the memory-infeasibility rule.

Device memory grows with the batch size and with wider activations, so a config that ran out of memory
at batch B rules out every config that needs at least as much memory: the same device-side settings with
a batch of B or more, a precision at least as wide, and no more memory allowed to the process. Knobs that
only act on the host (loader workers, pinning, threads) do not change device memory and are ignored, and
so is gradient accumulation: memory follows the micro-batch, however many are accumulated per step.
Activation checkpointing lowers memory (the wrapped blocks keep no activations for the backward pass), so a
config without it needs at least what the same config with it ran out of, never the other way round. The
same holds for the allocator's expandable segments, which waste less memory to fragmentation: an
out-of-memory with the default allocator leaves the expandable one its chance, not the other way round.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

HOST_SIDE_KNOBS = frozenset({"num_workers", "pin_memory", "prefetch_factor", "persistent_workers", "cpu_threads"})
# Device memory follows the micro-batch (batch_size), not how many of them are accumulated per step.
_ACCUMULATION_FIELDS = frozenset({"batch_policy", "global_batch"})
# Bytes per activation element, as an order: fp32 and tf32 keep fp32 activations, fp16 and bf16 halve them;
# fp8 keeps bf16 activations (its float8 copies are made for each matmul).
_PRECISION_WIDTH = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 2}


def needs_at_least(candidate: Mapping[str, Any], failed: Mapping[str, Any]) -> bool:
    """Whether ``candidate`` needs at least the device memory that ``failed`` ran out of.

    Args:
        candidate: A config as a knob -> value mapping.
        failed: A config that ran out of memory, in the same form.
    """
    for knob in set(candidate) | set(failed):
        if knob in HOST_SIDE_KNOBS or knob in _ACCUMULATION_FIELDS:
            continue
        mine, theirs = candidate.get(knob), failed.get(knob)
        if knob == "batch_size":
            if mine is None or theirs is None or mine < theirs:
                return False
        elif knob == "precision" and mine in _PRECISION_WIDTH and theirs in _PRECISION_WIDTH:
            if _PRECISION_WIDTH[mine] < _PRECISION_WIDTH[theirs]:
                return False
        elif knob == "activation_checkpointing":
            if bool(mine) and not bool(theirs):  # checkpointing frees what the failed run kept: it may fit
                return False
        elif knob == "allocator":
            if mine == "expandable" and theirs != "expandable":  # less fragmentation than the failed run: it may fit
                return False
        elif knob == "memory_fraction" and mine is not None and theirs is not None:
            if mine > theirs:  # more memory allowed: it may fit
                return False
        elif mine != theirs:
            return False
    return True


def infeasible_reason(candidate: Mapping[str, Any], failures: Iterable[tuple[int, Mapping[str, Any]]]) -> Optional[str]:
    """Why ``candidate`` cannot fit, given ``(trial number, config)`` pairs that ran out of memory; else None."""
    for number, failed in failures:
        if needs_at_least(candidate, failed):
            return (
                f"infeasible: needs at least the memory of trial {number} "
                f"({_describe(failed)}), which ran out of memory"
            )
    return None


def _describe(config: Mapping[str, Any]) -> str:
    keys = [k for k in ("precision", "batch_size", "channels_last", "compile", "cuda_graphs", "activation_checkpointing")
            if k in config]
    return ", ".join(f"{k}={config[k]}" for k in keys) or "same settings"
