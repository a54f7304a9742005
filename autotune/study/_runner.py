"""Running one config as an isolated trial of this study: its spec, its log folder, its time limit."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence

from autotune._config import ALLOC_CONF_ENV, EXPANDABLE_SEGMENTS, Budget, TrialConfig, TrialOutcome, alloc_conf_with
from autotune._target import script_argv_env
from autotune.hardware._mps import MpsSession
from autotune.study._colocate import run_copies
from autotune.study._isolation import run_isolated
from autotune.trial._compile_cache import compile_cache_env
from autotune.trial._execute import TrialSpec


class TrialRunner:
    """Runs configs of one study's target, each in a fresh process under the trial limits.

    Args:
        target: The ``module:function`` or ``path.py:function`` to run.
        logdir: The study's log folder; each run gets a subfolder. Its sibling ``compile_cache`` is the
            study's Inductor cache, which every trial shares (unless the user set its variables).
        baseline: The space's baseline config (its global batch is what ``ctx.lr_scale`` divides by).
        budget: The space's per-trial budget.
        timeout: Wall-clock seconds before a trial's process group is killed.
        memory_limit_gib: On CPU, address space a trial may add (see ``TrialOptions``).
        compile_timeout: Seconds a trial may spend in torch.compile (see ``TrialOptions``); ``None``: no limit
            but the trial's.
        mps: The study's MPS session when its space has ``mps=true``: trials of ``mps=true`` connect to its
            daemon, every other trial is kept off MPS explicitly (an empty pipe directory), so the same
            packing is measured both ways. ``None``: trials keep the environment as it is.
        script_args: The script's own arguments, each trial's ``sys.argv[1:]`` (``TrialOptions.script_args``).
    """

    def __init__(self, *, target: str, logdir: Path, baseline: TrialConfig, budget: Budget, timeout: float,
                 memory_limit_gib: Optional[float] = None, compile_timeout: Optional[float] = None,
                 mps: Optional[MpsSession] = None, script_args: Optional[Sequence[str]] = None) -> None:
        self.target = target
        self.script_args = script_args
        self.logdir = logdir
        self.baseline = baseline
        self.budget = budget
        self.timeout = timeout
        self.memory_limit_gib = memory_limit_gib
        self.compile_timeout = compile_timeout
        self.mps = mps

    def spec(self, config: TrialConfig, *, seed: int, budget: Optional[Budget] = None,
             prune_below: Optional[float] = None, probe: Optional[str] = None,
             loader_variants: Sequence[TrialConfig] = ()) -> TrialSpec:
        return TrialSpec(
            target=self.target,
            config=config,
            budget=budget or self.budget,
            seed=seed,
            baseline_batch_size=self.baseline.global_batch_size,
            memory_limit_gib=self.memory_limit_gib,
            prune_below=prune_below,
            probe=probe,
            loader_variants=tuple(loader_variants),
            env=self._env(config),
        )

    def _env(self, config: TrialConfig) -> Optional[dict[str, str]]:
        """The variables a trial gets on top of the coordinator's: the study's compile cache, MPS, and the
        allocator's expandable segments (set in the trial process before it initialises CUDA)."""
        env = compile_cache_env(self.compile_cache, os.environ) if config.compile != "off" else {}
        env.update(self._mps_env(config))
        if config.allocator == "expandable":
            env[ALLOC_CONF_ENV] = alloc_conf_with(os.environ.get(ALLOC_CONF_ENV, ""), EXPANDABLE_SEGMENTS)
        if self.script_args is not None:
            env.update(script_argv_env(self.script_args))  # the script's own arguments, as its sys.argv[1:]
        return env or None

    @property
    def compile_cache(self) -> Path:
        """The study's Inductor cache folder: a trial compiles warm what an earlier one compiled."""
        return (self.logdir.parent / "compile_cache").absolute()  # trials may run in another directory

    def _mps_env(self, config: TrialConfig) -> dict[str, str]:
        if self.mps is None:
            return {}
        return self.mps.client_env(enabled=config.mps, no_mps_dir=self.logdir.parent / "mps" / "off")

    def run(self, config: TrialConfig, workdir: str, *, seed: int, budget: Optional[Budget] = None,
            prune_below: Optional[float] = None, timeout: Optional[float] = None,
            probe: Optional[str] = None, loader_variants: Sequence[TrialConfig] = ()) -> TrialOutcome:
        """Run ``config`` with its log in ``logdir/workdir`` (``probe``: one side of it alone, see ``_probes``;
        ``loader_variants``: a loader probe's further configs, measured in the same process)."""
        spec = self.spec(config, seed=seed, budget=budget, prune_below=prune_below, probe=probe,
                         loader_variants=loader_variants)
        run = run_copies if config.processes_per_gpu > 1 else run_isolated
        return run(spec, workdir=self.logdir / workdir, timeout=timeout or self.timeout,
                   compile_timeout=self.compile_timeout)
