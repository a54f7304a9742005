"""Running one config as an isolated trial of this study: its spec, its log folder, its time limit."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from autotune._config import ALLOC_CONF_ENV, EXPANDABLE_SEGMENTS, Budget, TrialConfig, TrialOutcome, alloc_conf_with
from autotune._target import script_argv_env
from autotune.hardware._mps import MpsSession
from autotune.study._colocate import run_copies
from autotune.study._isolation import run_isolated
from autotune.trial._compile_cache import (CACHE_DIR_ENV, OWN_CACHE_ENV, SWITCHES, compile_cache_env,
                                           fallback_cache_folder)
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
        self._cache_fault = ""  # why the study's cache folder was last found unusable ("" while it is fine)
        self._cache_in_use: Optional[Path] = None  # the folder trials compile into; None: no cache at all

    def spec(self, config: TrialConfig, *, seed: int, budget: Optional[Budget] = None,
             prune_below: Optional[float] = None, probe: Optional[str] = None,
             loader_variants: Sequence[TrialConfig] = (), adopt_script_batch: bool = False) -> TrialSpec:
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
            adopt_script_batch=adopt_script_batch,
            env=self._env(config),
        )

    def _env(self, config: TrialConfig) -> Optional[dict[str, str]]:
        """The variables a trial gets on top of the coordinator's: the study's compile cache, MPS, and the
        allocator's expandable segments (set in the trial process before it initialises CUDA)."""
        env = self._cache_env() if config.compile != "off" else {}
        env.update(self._mps_env(config))
        if config.allocator == "expandable":
            env[ALLOC_CONF_ENV] = alloc_conf_with(os.environ.get(ALLOC_CONF_ENV, ""), EXPANDABLE_SEGMENTS)
        if self.script_args is not None:
            env.update(script_argv_env(self.script_args))  # the script's own arguments, as its sys.argv[1:]
        return env or None

    def _cache_env(self) -> dict[str, str]:
        """``compile_cache_env`` for the folder that works now: the study's own cache once checked, else its
        fallback (``fallback_cache_folder``), else the caches off. Its fault is the tuner's, never the
        config's: one line says what was done, once per fault."""
        env = compile_cache_env(self.compile_cache, os.environ)
        if CACHE_DIR_ENV not in env:
            return env  # the user's own cache folder: theirs to keep
        folder, why = fallback_cache_folder(self.compile_cache)
        if why != self._cache_fault or folder != self._cache_in_use:
            if why:
                then = (f"trials compile with the cache {folder} instead" if folder is not None
                        else "trials compile without a cache")
                print(f"autotune: warning: the study's compile cache is unusable: {why}; {then} (no config "
                      "is blamed for it)", file=sys.stderr, flush=True)
            elif self._cache_fault:
                print(f"autotune: the study's compile cache {folder} works again", file=sys.stderr, flush=True)
            self._cache_fault, self._cache_in_use = why, folder
        if folder is None:
            return {"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1", **{name: "0" for name in SWITCHES}}
        return {**compile_cache_env(folder, os.environ), OWN_CACHE_ENV: "1"}

    def note_discarded(self, outcome: TrialOutcome) -> None:
        """Say in one line when a trial discarded corrupt entries of the compile cache before it compiled."""
        count = (outcome.measurement.extras.get("compile_cache_discarded") if outcome.measurement else None)
        if count:
            print(f"autotune: warning: {count} corrupt entr{'ies' if count != 1 else 'y'} of the study's compile "
                  f"cache {self._cache_in_use} were discarded before a trial compiled; Inductor rebuilt them",
                  file=sys.stderr, flush=True)

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
            probe: Optional[str] = None, loader_variants: Sequence[TrialConfig] = (),
            adopt_script_batch: bool = False) -> TrialOutcome:
        """Run ``config`` with its log in ``logdir/workdir`` (``probe``: one side of it alone, see ``_probes``;
        ``loader_variants``: a loader probe's further configs, measured in the same process;
        ``adopt_script_batch``: see ``TrialContext``)."""
        spec = self.spec(config, seed=seed, budget=budget, prune_below=prune_below, probe=probe,
                         loader_variants=loader_variants, adopt_script_batch=adopt_script_batch)
        run = run_copies if config.processes_per_gpu > 1 else run_isolated
        # Absolute: a train_fn that changes directory (as many scripts do) must not move its own log and result.
        where = (self.logdir / workdir).absolute()
        outcome = run(spec, workdir=where, timeout=timeout or self.timeout, compile_timeout=self.compile_timeout)
        self.note_discarded(outcome)
        cache = (spec.env or {}).get(CACHE_DIR_ENV) if (spec.env or {}).get(OWN_CACHE_ENV) else None
        if cache and outcome.status in ("error", "crash"):
            # A cache entry is code Inductor runs, and a valid pickle passes every check: before the failure is
            # the config's, it runs once more on an empty cache. Passing there, the failure was the cache's.
            with tempfile.TemporaryDirectory(prefix="autotune-compile-cache-") as empty:
                clean = dataclasses.replace(spec, env={**(spec.env or {}), **compile_cache_env(Path(empty), {})})
                again = run(clean, workdir=where, timeout=timeout or self.timeout,
                            compile_timeout=self.compile_timeout)
            if again.status not in ("error", "crash"):
                aside = Path(cache).with_name(f"{Path(cache).name}-failed-{int(time.time())}")
                with contextlib.suppress(OSError):
                    os.replace(cache, aside)  # later trials build a cache of their own in its place
                print(f"autotune: warning: a trial of {config.describe()} failed with the study's compile cache "
                      f"{cache} ({outcome.error or outcome.status}) and passed on an empty one: the cache was at "
                      f"fault, not the config; it is moved to {aside.name}", file=sys.stderr, flush=True)
                outcome = again
        return outcome
