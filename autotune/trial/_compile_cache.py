"""The study's on-disk compile cache, from inside a trial process: switching it on, and what a compile got from it.

The coordinator points every trial at one Inductor cache per study (``compile_cache_env``), so a trial that
compiles a graph an earlier trial compiled (same shapes and mode, a loader knob changed, say) loads the
compiled code instead of generating and building it again. The trial records how its compile met that cache
from TorchDynamo's counters: ``cold`` (nothing hit), ``warm`` (everything hit) or ``partial``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Mapping

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
