"""Naming the user's training function: the ``module:function`` a trial process imports it by."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from autotune._errors import WorkloadError


def target_of(fn: Callable[..., Any]) -> str:
    """The ``module:function`` or ``path.py:function`` a trial process can import ``fn`` from.

    Raises:
        WorkloadError: ``fn`` is a lambda, a closure or otherwise not importable by name.
    """
    name = getattr(fn, "__qualname__", "")
    module = getattr(fn, "__module__", None)
    if not name or "<" in name or "." in name or module is None:
        raise WorkloadError(
            f"train_fn must be a module-level function, got {getattr(fn, '__qualname__', fn)!r}; "
            "trials run in separate processes and import it by name"
        )
    if module == "__main__":
        path = getattr(sys.modules["__main__"], "__file__", None)
        if not path:
            raise WorkloadError("train_fn is defined in an interactive session; put it in a .py file")
        return f"{os.path.abspath(path)}:{name}"
    return f"{module}:{name}"


def target_file(target: str) -> Optional[Path]:
    """The source file ``target`` is defined in, found without running it (``None`` when not found)."""
    module_part = target.rpartition(":")[0]
    if module_part.endswith(".py") or os.sep in module_part:
        path = Path(module_part)
        return path if path.is_file() else None
    try:
        spec = importlib.util.find_spec(module_part)
    except (ImportError, ValueError):
        return None
    origin = getattr(spec, "origin", None) if spec else None
    return Path(origin) if origin and os.path.isfile(origin) else None


def target_digest(target: str) -> Optional[str]:
    """The SHA-256 of ``target``'s source file, so a resume can tell that the code changed."""
    path = target_file(target)
    if path is None:
        return None
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def load_target(target: str) -> Callable[..., Any]:
    """Import ``path/to/file.py:func`` or ``package.module:func``.

    Raises:
        WorkloadError: the file, module or function is missing.
    """
    module_part, sep, func_name = target.rpartition(":")
    if not sep or not module_part or not func_name:
        raise WorkloadError(f"{target}: expected PATH.py:FUNCTION or MODULE:FUNCTION")
    if module_part.endswith(".py") or os.sep in module_part:
        path = Path(module_part)
        if not path.is_file():
            raise WorkloadError(f"{target}: no such file {module_part}")
        mod_name = f"_autotune_workload_{path.stem}"
        spec = importlib.util.spec_from_file_location(mod_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        sys.path.insert(0, str(path.resolve().parent))
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_part)
        except ModuleNotFoundError as exc:
            raise WorkloadError(f"{target}: cannot import module {exc.name!r}") from None
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise WorkloadError(f"{target}: {module_part} has no function {func_name!r}")
    return fn
