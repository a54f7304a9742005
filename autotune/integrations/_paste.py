"""The arguments a trainer adapter gives back to paste, as a record of their own: the summary renders them
without importing the adapter (``autotune.integrations.lightning`` re-exports ``LightningArguments``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional


@dataclass(frozen=True)
class LightningArguments:
    """A config as Lightning takes it: what to paste into your script.

    Args:
        trainer: ``Trainer(**trainer)``: precision, accumulate_grad_batches, benchmark.
        dataloader: The training ``DataLoader``'s batch_size, num_workers, pin_memory, prefetch_factor,
            persistent_workers.
        compile: ``torch.compile`` mode for the module (``"default"``: no mode), or ``None``: eager.
        channels_last: ``module.to(memory_format=torch.channels_last)`` before ``fit``.
        float32_matmul_precision: ``torch.set_float32_matmul_precision(...)`` on CUDA: ``"highest"`` (true
            fp32) or ``"high"`` (TF32); ``None`` on a CPU.
    """

    trainer: dict[str, Any] = field(default_factory=dict)
    dataloader: dict[str, Any] = field(default_factory=dict)
    compile: Optional[str] = None
    channels_last: bool = False
    float32_matmul_precision: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        return {"trainer": dict(self.trainer), "dataloader": dict(self.dataloader), "compile": self.compile,
                "channels_last": self.channels_last, "float32_matmul_precision": self.float32_matmul_precision}

    def code(self) -> str:
        """The lines to paste, in the order a script runs them."""
        lines = []
        if self.float32_matmul_precision:
            lines.append(f"torch.set_float32_matmul_precision({self.float32_matmul_precision!r})")
        if self.channels_last:
            lines.append("model = model.to(memory_format=torch.channels_last)")
        if self.compile:
            mode = "" if self.compile == "default" else f", mode={self.compile!r}"
            lines.append(f"model = torch.compile(model{mode})")
        lines.append("DataLoader(dataset, " + _kwargs(self.dataloader) + ")")
        lines.append("Trainer(" + _kwargs(self.trainer) + ")")
        return "\n".join(lines)


def _kwargs(values: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in values.items())
