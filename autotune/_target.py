"""Naming the user's training function: the ``module:function`` a trial process imports it by."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

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


MAX_LOCAL_MODULES = 200  # the most of the user's own modules hashed for one target


def _module_root(target: str, path: Path) -> Path:
    """The folder the target's imports resolve from: a file's own folder, or the sys.path entry that holds
    a module's package."""
    module_part = target.rpartition(":")[0]
    if module_part.endswith(".py") or os.sep in module_part:
        return path.resolve().parent
    depth = module_part.count(".") + (1 if path.name == "__init__.py" else 0)
    return path.resolve().parents[depth]


def _imported(path: Path, root: Path) -> list[Path]:
    """The files under ``root`` that ``path``'s import statements name (found without running anything)."""
    import ast

    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return []
    names: list[tuple[Path, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(root, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = root if not node.level else path.parent.parents[node.level - 2] if node.level > 1 else path.parent
            module = node.module or ""
            names += [(base, module)] if module else []
            names += [(base, f"{module}.{alias.name}".strip(".")) for alias in node.names]
    found = []
    for base, name in names:
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):  # a.b.c runs a/__init__.py and a/b/__init__.py too
            stem = base.joinpath(*parts[:depth])
            for candidate in (stem.with_name(stem.name + ".py"), stem / "__init__.py"):
                if candidate.is_file():
                    found.append(candidate.resolve())
    return found


def local_modules(target: str) -> dict[str, str]:
    """The SHA-256 of each of the user's own modules that ``target``'s file imports, directly or through
    another of them, by path relative to the folder imports resolve from.

    Only import statements are read (nothing runs): a module imported under a name built at run time, or
    from outside that folder (site-packages, the standard library, another checkout on sys.path), is not
    in it. The target's own file is ``target_digest``'s.
    """
    path = target_file(target)
    if path is None:
        return {}
    root = _module_root(target, path)
    if {"site-packages", "dist-packages"} & set(root.parts):
        return {}  # an installed package: its version names its code
    own = path.resolve()
    seen: dict[Path, str] = {}
    todo = _imported(own, root)
    while todo and len(seen) < MAX_LOCAL_MODULES:
        module = todo.pop()
        if module in seen or module == own or root not in module.parents:
            continue
        try:
            seen[module] = hashlib.sha256(module.read_bytes()).hexdigest()
        except OSError:
            continue
        todo += _imported(module, root)
    return {str(m.relative_to(root)): digest for m, digest in sorted(seen.items())}


# The script's own arguments (a JSON list) in a trial or probe process: ``load_target`` makes them its
# ``sys.argv[1:]`` before the import, so a script that parses them (argparse, at import or in train) gets them.
SCRIPT_ARGV_ENV = "AUTOTUNE_SCRIPT_ARGV"


def script_argv_env(script_args: Any) -> dict[str, str]:
    """The variable that gives a trial process ``script_args`` as its ``sys.argv[1:]``."""
    return {SCRIPT_ARGV_ENV: json.dumps([str(a) for a in script_args])}


class ScriptArgumentsError(WorkloadError):
    """The script's own ``argparse`` refused the arguments it was given (``ScriptArgv``)."""


class ScriptArgv:
    """``sys.argv`` as the script sees it while autotune imports and runs it: the script's path (or module),
    then ``args``; with ``args`` None, ``sys.argv`` is left as it is (a Python caller's own).

    Inside, an ``argparse`` error of the script is raised as one ``ScriptArgumentsError`` line in the script's
    own words (``main.py: error: unrecognized arguments: --lr``) instead of its usage block and exit code 2.
    Both are put back on exit.
    """

    def __init__(self, target: str, args: Optional[Sequence[str]]) -> None:
        self.target = target
        self.args = None if args is None else [str(a) for a in args]
        self._saved: Optional[list[str]] = None
        self._error: Any = None

    def __enter__(self) -> "ScriptArgv":
        import argparse

        given = self.args
        if given is not None:
            self._saved = list(sys.argv)
            module_part = self.target.rpartition(":")[0]
            sys.argv = [module_part or (sys.argv[0] if sys.argv else ""), *given]

        def error(parser: argparse.ArgumentParser, message: str) -> Any:
            shown = "none" if not given else " ".join(given)
            raise ScriptArgumentsError(f"{parser.prog}: error: {message} (the script's own arguments: {shown}; "
                                       "they go after --)")

        self._error = argparse.ArgumentParser.error
        argparse.ArgumentParser.error = error  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        import argparse

        argparse.ArgumentParser.error = self._error  # type: ignore[method-assign]
        if self._saved is not None:
            sys.argv = self._saved


def load_target(target: str) -> Callable[..., Any]:
    """Import ``path/to/file.py:func`` or ``package.module:func``.

    In a trial or probe process (``SCRIPT_ARGV_ENV`` set), ``sys.argv`` becomes the script's path (or module)
    followed by the arguments the study was given for it (``autotune tune main.py:train -- --emsize 64``).

    Raises:
        WorkloadError: the file, module or function is missing.
    """
    module_part, sep, func_name = target.rpartition(":")
    if not sep or not module_part or not func_name:
        raise WorkloadError(f"{target}: expected PATH.py:FUNCTION or MODULE:FUNCTION")
    if SCRIPT_ARGV_ENV in os.environ:
        try:
            args = [str(a) for a in json.loads(os.environ[SCRIPT_ARGV_ENV])]
        except (ValueError, TypeError):
            raise WorkloadError(f"{SCRIPT_ARGV_ENV}: not a JSON list of arguments") from None
        sys.argv = [module_part, *args]
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


def import_failure(target: str, exc: BaseException) -> str:
    """One line saying what importing ``target`` raised, and the line of the user's file it came from."""
    if isinstance(exc, SystemExit):
        return f"{target}: importing it called sys.exit({exc.code!r}); guard the script part with " \
               "if __name__ == '__main__':"
    where = ""
    own = target_file(target)
    folder = own.resolve().parent if own is not None else None
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = Path(frame.filename)
        # The innermost frame in the user's own files, not in a library they call or in importlib.
        if folder is not None and path.is_file() and folder in path.resolve().parents and "site-packages" \
                not in path.parts:
            where = f" ({path.name}, line {frame.lineno})"
            break
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{target}: importing it raised {type(exc).__name__}: {message}{where}"


def load_target_or_say_why(target: str) -> Callable[..., Any]:
    """``load_target``, where anything the user's module raises at import becomes one ``WorkloadError`` line.

    Raises:
        WorkloadError: the file, module or function is missing, or importing it raised.
    """
    try:
        return load_target(target)
    except WorkloadError:
        raise
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's module, whatever it raised
        raise WorkloadError(import_failure(target, exc)) from None
