"""The study's on-disk compile cache, from inside a trial process: switching it on, and what a compile got from it.

The coordinator points every trial at one Inductor cache per study (``compile_cache_env``), so a trial that
compiles a graph an earlier trial compiled (same shapes and mode, a loader knob changed, say) loads the
compiled code instead of generating and building it again. The trial records how its compile met that cache
from TorchDynamo's counters: ``cold`` (nothing hit), ``warm`` (everything hit) or ``partial``.

The cache is the tuner's own file, so a fault of it is never the config's: the coordinator checks the folder
before each compiling trial (``cache_folder_fault``) and falls back to another one, and a trial discards the
entries that fail their checks before it compiles (``discard_corrupt_entries``): Inductor runs a generated
module it finds under its name without reading it again, so a damaged one would be executed as code.

What the cache trusts: its entries are code (Python modules, shared objects, pickles), which Inductor runs
as the user when a key matches. No check can tell a valid but crafted pickle from Inductor's own, so the
folder must be one only the user can write: the study's is made so (mode 700), and one that belongs to
another user or that others can write is refused like a broken one. A trial that fails with the cache on
runs once more on an empty one before its failure is the config's (``TrialRunner.run``).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Mapping, Optional

CACHE_DIR_ENV = "TORCHINDUCTOR_CACHE_DIR"
TRITON_CACHE_ENV = "TRITON_CACHE_DIR"
# Inductor's switches for the FX-graph cache and the AOTAutograd cache, with the config each one forces.
SWITCHES = {
    "TORCHINDUCTOR_FX_GRAPH_CACHE": ("torch._inductor.config", "fx_graph_cache"),
    "TORCHINDUCTOR_AUTOGRAD_CACHE": ("torch._functorch.config", "enable_autograd_cache"),
}
# TorchDynamo's counters (group, name) of cache hits and misses; names absent from a torch version count 0.
HIT_COUNTERS = (("inductor", "fxgraph_cache_hit"), ("aot_autograd", "autograd_cache_hit"))
MISS_COUNTERS = (("inductor", "fxgraph_cache_miss"), ("aot_autograd", "autograd_cache_miss"))
OTHER_COUNTERS = (("inductor", "fxgraph_cache_bypass"), ("aot_autograd", "autograd_cache_bypass"),
                  ("aot_autograd", "autograd_cache_guard_miss"))
# Set by the coordinator when the cache folder is the study's own (not the user's): only then may a trial
# delete entries in it.
OWN_CACHE_ENV = "AUTOTUNE_OWN_COMPILE_CACHE"
# The cache's pickled entries (a pickle of protocol 2 or more starts with this byte), and its shared objects.
PICKLED_FOLDERS = ("fxgraph", "aotautograd")
ELF_MAGIC = b"\x7fELF"


def compile_cache_env(folder: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables that point a trial at the study's cache ``folder``, less those the user set.

    Args:
        folder: The study's cache folder (``<studies_dir>/<study>/compile_cache``).
        environ: The coordinator's environment, which the trial inherits.
    """
    env = {CACHE_DIR_ENV: str(folder), TRITON_CACHE_ENV: str(folder / "triton"),
           **{name: "1" for name in SWITCHES}}
    user_dir = environ.get(CACHE_DIR_ENV)
    utils = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    if user_dir is not None and utils is not None and os.path.abspath(user_dir) == os.path.abspath(utils.default_cache_dir()):
        # Not the user's: Inductor writes its default back into the environment on first use (importing
        # torch._dynamo does, and building any torch.optim optimizer imports it).
        user_dir = None
    return {k: v for k, v in env.items() if (user_dir if k == CACHE_DIR_ENV else environ.get(k)) is None}


def cache_folder_fault(folder: Path) -> str:
    """Why ``folder`` cannot serve as a compile cache ("" when it can): it is created if missing, and a file
    is written in it and in each of its existing subfolders (Inductor writes locks and entries there).

    Args:
        folder: The cache folder; no torch import is needed to check it.
    """
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except FileExistsError:
        return f"{folder} is not a folder"
    except OSError as exc:
        return f"cannot create {folder}: {exc.strerror or exc}"
    if not folder.is_dir() or folder.is_symlink():
        return f"{folder} is not a folder"
    # Inductor imports and unpickles what it finds here: whoever else can write the folder can run code in
    # every trial. It must be this user's, and closed to the others (a folder it made is so from the start).
    info = folder.stat()
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        return f"{folder} belongs to another user (uid {info.st_uid}), who could put code in it"
    if info.st_mode & 0o022:
        return f"{folder} can be written by other users (mode {info.st_mode & 0o777:o}), who could put code in it"
    try:
        places = [folder, *(p for p in folder.iterdir() if not p.name.startswith("."))]
        for place in places:
            if not place.is_dir():
                continue
            with tempfile.TemporaryFile(dir=place, prefix=".autotune-check-") as fh:
                fh.write(b"x")
                fh.flush()
                os.fsync(fh.fileno())  # a full disk shows here, not only at close
    except OSError as exc:
        return f"cannot write in {place} ({exc.strerror or exc})"  # the folder: a probe's name changes each time
    return ""


def fallback_cache_folder(folder: Path) -> tuple[Optional[Path], str]:
    """The folder to use in place of the unusable ``folder``, and why it is unusable.

    A sibling ``compile_cache-fallback`` (kept for resumes), else a fresh temporary folder; ``None`` when
    neither can be written: trials then compile without a cache.
    """
    why = cache_folder_fault(folder)
    if not why:
        return folder, ""
    sibling = folder.with_name(folder.name + "-fallback")
    if not cache_folder_fault(sibling):
        return sibling, why
    try:
        fresh = Path(tempfile.mkdtemp(prefix="autotune-compile-cache-"))
    except OSError:
        return None, why
    return (fresh, why) if not cache_folder_fault(fresh) else (None, why)


def discard_corrupt_entries(folder: Path) -> list[str]:
    """Delete the entries of the cache ``folder`` that fail their checks, and return their paths.

    A generated module (``<2 chars>/<key>.py``) must hash to its own name, as Inductor named it; a shared
    object must be an ELF file; an FX-graph or AOTAutograd entry must be a pickle. Inductor regenerates
    what is missing. Triton's own cache (``triton/``) is left to Triton. Run in the trial, before it compiles.
    """
    try:
        from torch._inductor.codecache import code_hash
    except ImportError:
        return []
    discarded = []
    for root, dirs, files in os.walk(folder):
        here = Path(root)
        if here == folder:
            dirs[:] = [d for d in dirs if d != "triton"]
        pickled = here != folder and here.relative_to(folder).parts[0] in PICKLED_FOLDERS
        for name in files:
            if name.startswith("."):
                continue  # a write in progress (Inductor writes to a dot file, then renames)
            path = here / name
            try:
                if name.endswith(".py") and here.parent == folder and len(name) > 4 and name[1:3] == here.name:
                    bad = code_hash(path.read_text(encoding="utf-8", errors="replace").strip()) != name[:-3]
                elif name.endswith(".so"):
                    with open(path, "rb") as fh:
                        bad = fh.read(4) != ELF_MAGIC
                elif pickled:
                    with open(path, "rb") as fh:
                        bad = fh.read(1) != b"\x80"
                else:
                    continue
                if bad:
                    path.unlink()
                    discarded.append(str(path))
            except OSError:
                continue  # gone meanwhile, or unreadable: the coordinator's folder check covers the rest
    return discarded


def apply_switches() -> None:
    """Give Inductor's configs the cache switches of this process's environment.

    The trial server imported them (with ``torch._dynamo``) before the trial's environment was set, and
    they read their variables at import: a variable the trial got since is applied here, before any compile.
    """
    for env, (module, name) in SWITCHES.items():
        config = sys.modules.get(module)
        value = os.environ.get(env)
        if config is not None and value in ("0", "1"):
            setattr(config, name, value == "1")


def compile_cache_record() -> dict[str, Any]:
    """How this process's compiles met the caches so far, as measurement extras.

    ``compile_cache_hits`` and ``compile_cache_misses`` sum the FX-graph and AOTAutograd caches' counters;
    ``compile_cache`` is ``cold`` without a hit (caches off count so too), ``warm`` with hits and no miss,
    else ``partial``; ``compile_cache_counters`` keeps every counter read. Empty without TorchDynamo.
    """
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return {}
    read = {f"{group}.{name}": int(counters.get(group, {}).get(name, 0))
            for group, name in HIT_COUNTERS + MISS_COUNTERS + OTHER_COUNTERS}
    hits = sum(read[f"{g}.{n}"] for g, n in HIT_COUNTERS)
    misses = sum(read[f"{g}.{n}"] for g, n in MISS_COUNTERS)
    state = "cold" if hits == 0 else "warm" if misses == 0 else "partial"
    return {"compile_cache": state, "compile_cache_hits": hits, "compile_cache_misses": misses,
            "compile_cache_counters": {k: v for k, v in read.items() if v}}
