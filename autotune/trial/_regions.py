"""Regional compilation: compile a model's repeated blocks one by one instead of the whole model.

A transformer's layers, or a ResNet stage's blocks, are instances of one class with the same structure.
Compiled whole, the model is one graph in which Dynamo traces and Inductor lowers every layer again;
compiled block by block (``block.compile()``, torch's "regional compilation" recipe), the blocks share the
code object and the guards, so the first block's graph is compiled once and reused by the others. What is
outside the blocks (an embedding, a stem, a head, the loss) then runs eagerly.

``repeated_blocks`` finds the blocks generally: children of ``nn.ModuleList`` or ``nn.Sequential``
containers, of a class of which at least two blocks have the same structure (the same submodule classes
and parameter shapes). ``compile_regions`` compiles every block of such a class (a stage's first block,
which downsamples, is one more graph of the same code).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn


@dataclass(frozen=True)
class RegionGroup:
    """The children of one container that are compiled regionally, all of one class.

    Args:
        path: The container's qualified name in the model (``blocks``, ``layer2``).
        block_class: The children's class name.
        indices: The positions of the compiled children in the container.
        structures: How many distinct structures they have (each is one graph; 1 for a transformer's layers,
            2 for a ResNet stage whose first block downsamples).
    """

    path: str
    block_class: str
    indices: tuple[int, ...]
    structures: int = 1

    def describe(self) -> str:
        """E.g. ``blocks: 6 x _Block`` or ``layer2: 4 x Bottleneck, 2 structures``."""
        extra = f", {self.structures} structures" if self.structures > 1 else ""
        return f"{self.path or '<model>'}: {len(self.indices)} x {self.block_class}{extra}"


def _structure(module: nn.Module) -> tuple[Any, ...]:
    """What two blocks must share to reuse one graph: submodule names and classes, parameter and buffer shapes."""
    return tuple(
        (name, type(sub).__qualname__,
         tuple((p, tuple(t.shape), t.dtype) for p, t in sub.named_parameters(recurse=False)),
         tuple((b, tuple(t.shape), t.dtype) for b, t in sub.named_buffers(recurse=False) if t is not None))
        for name, sub in module.named_modules()
    )


def repeated_blocks(model: nn.Module) -> list[RegionGroup]:
    """The groups of repeated blocks of ``model``, in module order.

    A block is a child with children of its own (not a leaf layer such as ``nn.Linear``) of an
    ``nn.ModuleList`` or ``nn.Sequential``. A block class repeats when two of its blocks anywhere in the
    model have the same structure; every block of that class is then compiled (one of another structure,
    such as a ResNet stage's first block, compiles its own graph of the same code). Blocks inside a
    compiled block compile with it.
    """
    blocks: list[tuple[str, int, nn.Module]] = []
    for path, container in model.named_modules():
        if isinstance(container, (nn.ModuleList, nn.Sequential)):
            blocks += [(path, i, child) for i, child in enumerate(container) if next(child.children(), None)]
    counts: dict[tuple[type, tuple[Any, ...]], int] = {}
    for _, _, block in blocks:
        key = (type(block), _structure(block))
        counts[key] = counts.get(key, 0) + 1
    repeated = {cls for (cls, _), n in counts.items() if n >= 2}
    groups: dict[tuple[str, type], list[int]] = {}
    taken: list[str] = []
    for path, index, block in blocks:
        name = f"{path}.{index}" if path else str(index)
        if type(block) not in repeated or any(name.startswith(t + ".") for t in taken):
            continue
        taken.append(name)
        groups.setdefault((path, type(block)), []).append(index)
    out = []
    for (path, cls), indices in groups.items():
        container = model.get_submodule(path) if path else model
        shapes = {_structure(container[i]) for i in indices}
        out.append(RegionGroup(path, cls.__name__, tuple(indices), len(shapes)))
    return out


def _raise_recompile_limit(graphs: int) -> None:
    """Let Dynamo keep a graph per distinct block structure (train and eval) of the blocks' shared code."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), 2 * graphs))


def compile_regions(model: nn.Module, mode: Optional[str], *, groups: Optional[list[RegionGroup]] = None,
                    **options: Any) -> list[RegionGroup]:
    """Compile the repeated blocks of ``model`` in place (``block.compile(mode=mode)``), static shapes.

    Args:
        model: The model, on its device, after any conversion that must precede the compile (float8).
        mode: The ``torch.compile`` mode (None for the default).
        groups: The groups to compile; ``repeated_blocks(model)`` when None.
        options: More ``torch.compile`` options (``backend``).

    Returns:
        The groups compiled; empty when the model has none (nothing was compiled).
    """
    groups = repeated_blocks(model) if groups is None else groups
    structures = set()
    for group in groups:
        container = model.get_submodule(group.path) if group.path else model
        for index in group.indices:
            block = container[index]
            structures.add((type(block), _structure(block)))
            # dynamic=False: blocks of a class whose shapes differ (ResNet stages) each get a static graph,
            # where Dynamo would otherwise mark the changing sizes dynamic after the second one.
            block.compile(mode=mode, dynamic=False, **options)
    if structures:
        _raise_recompile_limit(len(structures))
    return groups


def regions_record(groups: list[RegionGroup]) -> dict[str, Any]:
    """What a trial records of its regional compile (``compile.regions``, ``compile.region_blocks``)."""
    return {"compile.regions": [g.describe() for g in groups],
            "compile.region_blocks": sum(len(g.indices) for g in groups)}
