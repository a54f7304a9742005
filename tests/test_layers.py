"""The package's layers: imports point down, never up, and never in a circle (function-level ones too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "autotune"

# Bottom to top. A module may import its own layer and the layers below it.
LAYERS = (
    ("records", ("autotune._config", "autotune._errors", "autotune._files", "autotune._target", "autotune._records")),
    ("hardware", ("autotune.hardware",)),
    ("trial", ("autotune.trial",)),
    ("search", ("autotune.search",)),
    ("insight", ("autotune.insight",)),
    ("study", ("autotune.study",)),
    ("integrations", ("autotune.integrations",)),
    ("top", ("autotune._api", "autotune.cli", "autotune.demo", "autotune.testing", "autotune.__main__", "autotune")),
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Every autotune module ``path`` imports, anywhere in the file (a ``from autotune.x import y``
    counts as ``autotune.x.y`` when that is a module, else as ``autotune.x``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("autotune"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("autotune"):
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if child in modules else node.module)
    return {m for m in found if m in modules}


def _layer(module: str) -> int:
    for index, (_, prefixes) in enumerate(LAYERS):
        # "autotune" itself is the top-level package only, not a prefix of every module.
        if any(module == p or (p != "autotune" and module.startswith(p + ".")) for p in prefixes):
            return index
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS")


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    # A package's __init__ re-exports its own modules; that is not an edge of the layering.
    return {name: {m for m in _imports(path, modules) if m != name} for name, path in modules.items()}


def test_every_module_has_a_layer() -> None:
    for module in _modules():
        _layer(module)


def test_imports_point_down() -> None:
    upward = [
        f"{module} ({LAYERS[_layer(module)][0]}) imports {target} ({LAYERS[_layer(target)][0]})"
        for module, targets in _graph().items()
        for target in targets
        if _layer(target) > _layer(module)
    ]
    assert not upward, "\n".join(upward)


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` as a path that ends where it starts, or ``[]``."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return []


def test_no_import_cycle() -> None:
    assert find_cycle(_graph()) == []


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"a"}}, ["a", "a"]),
    ],
)
def test_find_cycle_finds_cycles(graph: dict[str, set[str]], expected: list[str]) -> None:
    assert find_cycle(graph) == expected


def test_the_docs_architecture_table_names_every_module() -> None:
    import re

    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    section = page.split("## Architecture", 1)[1].split("\n## ", 1)[0]
    named: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = line.split("|")
        if line.startswith("| ") and "---" not in line and len(cells) > 3:
            # `autotune/_config.py`, `_errors.py`, `_sampler`: each backticked name, without folder or suffix
            named[cells[1].strip()] = {Path(n).stem for n in re.findall(r"`([^`]+)`", cells[2] + cells[3])}
    missing = [
        module for module, path in _modules().items()
        if not (path.parent != PACKAGE and path.stem in ("__init__", "__main__"))  # a sub-package's own files
        and path.stem not in named.get(LAYERS[_layer(module)][0], set())
    ]
    assert not missing, "docs/architecture.md's architecture table does not name: " + ", ".join(missing)
