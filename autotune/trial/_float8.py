"""``precision: fp8``: which linear layers torchao's float8 training converts, and the conversion itself.

The size check is torchao's own for its tensorwise recipe (``_auto_filter_for_tensorwise`` in torchao 0.18),
which follows its H100 table of float8 against bf16 linear layers: float8 is 0.80x (slower) at
M, K, N = 1024, 2048, 1024 and 1.39x at 4096, 8192, 16384. A layer is converted when both of its dimensions
are multiples of 16 (what float8 matmuls take) and it is not small on both sides: ``in_features`` (K) at most
4096 and ``out_features`` (N) at most 1024 stay in bf16. The rule reads the weight alone: the tokens per
step (M) change with the batch, and the trial measures what they do.

Nothing here imports torch or torchao at module level, so the search layer can price fp8 from the shapes
the reference run recorded (``linear_shapes``) without either.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from autotune._errors import MissingExtraError

if TYPE_CHECKING:
    import torch

FLOAT8_MULTIPLE = 16  # float8 matmuls (torch._scaled_mm) take dimensions that are multiples of 16
SMALL_IN, SMALL_OUT = 4096, 1024  # a layer at most this wide on both sides stays in bf16
FP8_EXTRA = "precision=fp8 needs torchao (the fp8 extra): pip install 'autotune[fp8]'"


def layer_refusal(in_features: int, out_features: int) -> Optional[str]:
    """Why a linear layer of these features stays in bf16 under ``precision=fp8``; None: it is converted."""
    shape = f"in {in_features}, out {out_features}"
    if in_features % FLOAT8_MULTIPLE or out_features % FLOAT8_MULTIPLE:
        return f"{shape}: not both multiples of {FLOAT8_MULTIPLE}, which float8 matmuls need"
    if in_features <= SMALL_IN and out_features <= SMALL_OUT:
        return (f"{shape}: in <= {SMALL_IN} and out <= {SMALL_OUT}, where torchao's table shows float8 slower "
                "than bf16 (0.80x at M,K,N = 1024,2048,1024)")
    return None


def float8_filter(module: "torch.nn.Module", fqn: str = "") -> bool:
    """torchao's ``module_filter_fn`` for autotune's size check: whether to convert this module to float8.

    Use it in your own code as the study's trials did:
    ``torchao.float8.convert_to_float8_training(model, module_filter_fn=autotune.float8_filter)``.
    Only ``torch.nn.Linear`` layers are converted; see the module's docstring for the rule.
    """
    import torch

    return isinstance(module, torch.nn.Linear) and layer_refusal(module.in_features, module.out_features) is None


def linear_shapes(module: "torch.nn.Module") -> list[list[int]]:
    """The ``torch.nn.Linear`` layers of ``module`` as ``[in_features, out_features, count]``, largest first."""
    import torch

    counts: dict[tuple[int, int], int] = {}
    for layer in module.modules():
        if isinstance(layer, torch.nn.Linear):
            key = (layer.in_features, layer.out_features)
            counts[key] = counts.get(key, 0) + 1
    return [[k, n, c] for (k, n), c in sorted(counts.items(), key=lambda item: (-item[0][0] * item[0][1], item[0]))]


def convertible_share(shapes: list[list[int]]) -> float:
    """The share of the linear layers' matmul work (in x out per token, over every layer) that fp8 converts."""
    total = sum(k * n * c for k, n, c in shapes)
    converted = sum(k * n * c for k, n, c in shapes if layer_refusal(k, n) is None)
    return converted / total if total else 0.0


def no_conversion_reason(shapes: list[list[int]]) -> Optional[str]:
    """Why fp8 can gain nothing for a model with these linear layers (none passes the check), else None."""
    if not shapes:
        return ("the model has no torch.nn.Linear layer (ctx.model found none in the reference run): float8 "
                "training converts only linear layers")
    if convertible_share(shapes) > 0:
        return None
    layers = sum(c for _, _, c in shapes)
    k, n, _ = shapes[0]
    return (f"no linear layer passes the float8 size check (ctx.model found {layers} in the reference run; the "
            f"largest is {layer_refusal(k, n)}): float8 is predicted slower than bf16")


@dataclass(frozen=True, kw_only=True)
class Float8Plan:
    """Which linear layers of a model ``precision=fp8`` converts, and why the others stay in bf16."""

    converted: tuple[str, ...] = ()
    skipped: dict[str, tuple[str, ...]] = field(default_factory=dict)  # reason -> the layers' names

    def extras(self) -> dict[str, Any]:
        """The trial's record: ``fp8.converted`` (names) and ``fp8.skipped`` (reason -> names)."""
        return {"fp8.converted": list(self.converted), "fp8.skipped": {k: list(v) for k, v in self.skipped.items()}}


def plan(module: "torch.nn.Module") -> Float8Plan:
    """What ``float8_filter`` decides for each linear layer of ``module`` (named as ``named_modules`` does)."""
    import torch

    converted: list[str] = []
    skipped: dict[str, list[str]] = {}
    for name, layer in module.named_modules():
        if isinstance(layer, torch.nn.Linear):
            why = layer_refusal(layer.in_features, layer.out_features)
            if why is None:
                converted.append(name)
            else:
                skipped.setdefault(why, []).append(name)
    return Float8Plan(converted=tuple(converted), skipped={k: tuple(v) for k, v in skipped.items()})


def require_torchao() -> Any:
    """``torchao.float8``, imported.

    Raises:
        MissingExtraError: torchao is not installed (or its float8 module does not import).
    """
    try:
        import torchao.float8
    except ImportError as exc:
        raise MissingExtraError(f"{FP8_EXTRA} ({type(exc).__name__}: {exc})") from None
    return torchao.float8


def convert(module: "torch.nn.Module") -> tuple["torch.nn.Module", Float8Plan]:
    """``module`` with the layers ``float8_filter`` picks swapped for torchao's ``Float8Linear``, and the plan.

    Raises:
        MissingExtraError: torchao is not installed (or its float8 module does not import).
    """
    convert_to_float8_training = require_torchao().convert_to_float8_training
    decided = plan(module)
    # A root torch.nn.Linear is returned anew, not swapped in place.
    return convert_to_float8_training(module, module_filter_fn=float8_filter), decided
