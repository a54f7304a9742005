"""Co-located trials, from the coordinator's side: N copies of the training on one device at once.

A config with ``processes_per_gpu`` N > 1 runs N independent copies of ``train_fn``, each its own process
(``launch``: own process groups, all killed together), with seed + k and its files in ``copy<k>/`` (copy 0
in the trial's folder, as rank 0 of a DDP trial). The copies meet at a start barrier after their warm-up
and train on untimed until every copy has ended its windows (``autotune.trial._copies``), so each copy is
timed while all the others load the device. The trial's throughput is the sum of the copies'; each copy's
throughput, timed span and loss trajectory are kept in the outcome's ``Colocation``, with the overlap of
the timed spans that says how this was checked.
"""

from __future__ import annotations

import dataclasses
import shutil
import statistics
from pathlib import Path
from typing import Optional, Sequence

from autotune._config import Colocation, CopyRun, Measurement, TrialOutcome
from autotune.study._isolation import ProcessFiles, _ended, _tail, launch
from autotune.trial._copies import (
    BARRIER_ENV,
    COPIES_ENV,
    COPY_ENV,
    COPY_SYNC_ENV,
    DEFAULT_BARRIER_SECONDS,
    SPAN_EXTRAS,
)
from autotune.trial._execute import TrialSpec

SYNC_FOLDER = "copies-sync"  # in the trial's folder: the copies' ready and timed marks


def copy_files(workdir: Path, copies: int) -> list[ProcessFiles]:
    """Copy 0 writes in the trial's folder (as a one-process trial does), copy k in ``copy<k>/`` inside it."""
    return [ProcessFiles(folder=workdir if k == 0 else workdir / f"copy{k}") for k in range(copies)]


def copy_specs(spec: TrialSpec, sync: Path, *, barrier_seconds: float) -> list[TrialSpec]:
    """Each copy's spec: its own seed (the trial's + k), its place among the copies, no pruning (a copy's
    first window is a share of the trial's, not comparable to the best trial's aggregate)."""
    copies = spec.config.processes_per_gpu
    shared = {COPIES_ENV: str(copies), COPY_SYNC_ENV: str(sync), BARRIER_ENV: f"{barrier_seconds:g}"}
    return [dataclasses.replace(spec, seed=spec.seed + k, prune_below=None,
                                env={**(spec.env or {}), **shared, COPY_ENV: str(k)})
            for k in range(copies)]


def overlaps(copies: Sequence[CopyRun]) -> tuple[float, float]:
    """(overlap, timed_overlap) of the copies' spans (see ``Colocation``): the smallest, over the copies, share
    of a copy's timed span during which every copy was training / was inside its timed windows."""
    def smallest_share(ends: list[float]) -> float:
        start, end = max(c.timed_start for c in copies), min(ends)
        shares = [max(0.0, min(end, c.timed_end) - max(start, c.timed_start)) / (c.timed_end - c.timed_start)
                  for c in copies if c.timed_end > c.timed_start]
        return min(shares) if shares else 0.0

    return smallest_share([c.busy_end for c in copies]), smallest_share([c.timed_end for c in copies])


def _copy_run(index: int, m: Measurement) -> CopyRun:
    extras = m.extras
    end = float(extras.get("copy.timed_end", 0.0))
    return CopyRun(index=index, throughput=m.throughput, timed_start=float(extras.get("copy.timed_start", 0.0)),
                   timed_end=end, busy_end=float(extras.get("copy.busy_end", end)), losses=m.losses,
                   loss_every=m.loss_every, metric=m.metric, peak_memory_gib=m.peak_memory_gib,
                   overtime_steps=int(extras.get("copy.overtime_steps", 0)))


def combine(measurements: Sequence[Measurement], *, memory_fraction: float, mps: bool) -> tuple[Measurement, Colocation]:
    """The trial's measurement over its copies (throughput and samples summed, window by window; the slowest
    copy's step time; copy 0's loss trajectory and metric, each copy's in the ``Colocation``)."""
    runs = tuple(_copy_run(k, m) for k, m in enumerate(measurements))
    overlap, timed_overlap = overlaps(runs)
    colocation = Colocation(copies=runs, memory_fraction=memory_fraction, mps=mps, overlap=overlap,
                            timed_overlap=timed_overlap)
    first = measurements[0]
    windows = min(len(m.window_throughputs) for m in measurements)
    extras = {k: v for k, v in first.extras.items() if k not in SPAN_EXTRAS and k != "copy.barrier_wait_seconds"}
    extras.update({"colocation.copies": len(runs), "colocation.overlap": round(overlap, 4),
                   "colocation.timed_overlap": round(timed_overlap, 4),
                   "colocation.slowest_copy_throughput": colocation.slowest.throughput,
                   "colocation.barrier_wait_seconds": max(float(m.extras.get("copy.barrier_wait_seconds", 0.0))
                                                          for m in measurements)})
    aggregate = dataclasses.replace(
        first,
        throughput=colocation.aggregate,
        window_throughputs=tuple(sum(m.window_throughputs[w] for m in measurements) for w in range(windows)),
        step_time=max(m.step_time for m in measurements),
        data_wait_fraction=statistics.mean(m.data_wait_fraction for m in measurements),
        peak_memory_gib=max(m.peak_memory_gib for m in measurements),
        warmup_seconds=max(m.warmup_seconds for m in measurements),
        first_step_seconds=max(m.first_step_seconds for m in measurements),
        compile_seconds=max(m.compile_seconds for m in measurements),
        capture_seconds=max(m.capture_seconds for m in measurements),
        samples=sum(m.samples for m in measurements),
        scaler_skips=max(m.scaler_skips for m in measurements),
        extras=extras,
    )
    return aggregate, colocation


def run_copies(spec: TrialSpec, *, workdir: Path, timeout: float, compile_timeout: Optional[float] = None,
               barrier_seconds: Optional[float] = None) -> TrialOutcome:
    """Run the ``processes_per_gpu`` copies of one trial at once; their combined outcome, or the first copy's
    failure named (``copy 2 of 4: ...``) with every copy's process group killed.

    Args:
        spec: The trial (its seed is copy 0's).
        workdir: The trial's folder (copy k's files in ``workdir/copy<k>``).
        timeout: Seconds before every copy is killed.
        compile_timeout: See ``run_isolated``.
        barrier_seconds: How long a copy waits at the start barrier for the others (default: half the
            timeout, at most ``DEFAULT_BARRIER_SECONDS``).
    """
    config = spec.config
    copies = config.processes_per_gpu
    files = copy_files(workdir, copies)
    sync = workdir / SYNC_FOLDER
    try:
        for where in files:
            where.prepare()
        shutil.rmtree(sync, ignore_errors=True)
        sync.mkdir(parents=True)
    except OSError as exc:
        return TrialOutcome("infra", error=f"cannot prepare the trial's folder {workdir}: {exc.strerror or exc}")
    wait = barrier_seconds if barrier_seconds is not None else min(DEFAULT_BARRIER_SECONDS, timeout / 2)
    done = launch(copy_specs(spec, sync, barrier_seconds=wait), files, timeout=timeout,
                  compile_timeout=compile_timeout, stop_on_failure=True)
    wall = done.wall_seconds

    def who(index: int) -> str:
        return f"copy {index} of {copies}: "

    if done.compile_over is not None:
        index, mode, seconds = done.compile_over
        return TrialOutcome("compile_timeout", stderr_tail=_tail(files[index].log), wall_seconds=wall,
                            error=f"{who(index)}compile={mode} still compiling after {seconds:.0f}s "
                                  f"(compile timeout {compile_timeout:g}s; all {copies} copies killed)")
    if done.timed_out:
        late = next((end.index for end in done.ends if end.outcome is None), 0)
        return TrialOutcome("timeout", error=f"{who(late)}no result within {timeout:.0f}s (all {copies} copies killed)",
                            stderr_tail=_tail(files[late].log), wall_seconds=wall)
    failure = done.first_failure
    if failure is not None:
        outcome = _ended(failure, spec, wall)
        return dataclasses.replace(outcome, error=who(failure.index) + outcome.error, wall_seconds=wall)
    outcomes = [end.outcome for end in done.ends]
    measurements = [o.measurement for o in outcomes if o is not None and o.measurement is not None]
    if len(measurements) < copies:
        return TrialOutcome("error", error=f"only {len(measurements)} of {copies} copies reported a measurement",
                            wall_seconds=wall)
    aggregate, colocation = combine(measurements, memory_fraction=config.memory_fraction, mps=config.mps)
    return TrialOutcome("ok", aggregate, wall_seconds=wall, colocation=colocation,
                        run_seconds=max(o.run_seconds for o in outcomes if o is not None))
