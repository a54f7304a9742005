"""Co-location on one GPU: several training processes of a small model per GPU, with and without CUDA MPS.

    PYTHONPATH=$PWD python3 -m benchmarks.runners.colocation_h200 --out benchmarks/results/colocation-h200.md \\
        --workdir /scratch/coloc --deadline 450

Run it from the repository root (the workloads are named by their paths from there); on the GPU host, with
the optuna wheels installed into a folder on ``PYTHONPATH`` (see the GPU host's notes). For each workload of
``benchmarks/workloads/colocation.py`` (a tiny transformer LM, 2 layers, d_model 128, 64 tokens; a small CNN
on 32 x 32 images):

1. **Study.** A tuner study over ``precision``, ``batch_size``, ``processes_per_gpu: [1, 2, 4, 8]`` and
   ``mps: [false, true]`` (the study starts its own MPS daemon, or uses a running one, and stops what it
   started), from the untuned baseline (fp32, one process), with a wall-clock limit so that the run ends
   within ``--deadline``.
2. **Reruns.** The pick, the pick with MPS toggled (the same N measured both ways) and the pick as one
   process (N = 1, the whole device, no MPS) are measured again in turn for ``--rounds`` rounds under a
   daemon of the runner's own: the pick's spread over its reruns, the aggregate speed-up over one process,
   and the co-located copies' overlap figures.

At the start and the end it lists the ``nvidia-cuda-mps-control`` / ``nvidia-cuda-mps-server`` processes
(from ``/proc``) and reads the GPU's compute mode: no daemon may be left, and the mode must not change.
Writes the markdown to ``--out`` and the raw numbers beside it (``.json``); exits 1 when a daemon was left.
``--tiny`` swaps in tiny models and budgets (``AUTOTUNE_BENCH_SIZE=tiny``) to check this script on a CPU
(``tests/test_colocation_runner.py``); its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

SIZE_ENV = "AUTOTUNE_BENCH_SIZE"
MPS_NAMES = ("nvidia-cuda-mps-control", "nvidia-cuda-mps-server")
COMMAND = "PYTHONPATH=$PWD python3 -m benchmarks.runners.colocation_h200"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """One model to pack: its target, its space, and what one sample is."""

    name: str
    target: str
    space: dict[str, Any]
    unit: str = "samples"
    per_sample: int = 1  # units per sample (tokens per sequence for the LM)


def workloads(tiny: bool) -> list[Workload]:
    """The tiny LM and the small CNN, each with ``processes_per_gpu`` and ``mps`` in its space."""
    packing = {"processes_per_gpu": [1, 2] if tiny else [1, 2, 4, 8], "mps": [False, True]}
    if tiny:
        budget = {"samples": 256, "warmup_steps": 2, "windows": 3}
        common = {"knobs": {"precision": ["fp32"], "batch_size": [16], **packing},
                  "baseline": {"batch_size": 16}, "budget": budget}
        return [Workload(name="lm", target="benchmarks/workloads/colocation.py:train_lm", space=common,
                         unit="tokens", per_sample=16),
                Workload(name="cnn", target="benchmarks/workloads/colocation.py:train_cnn", space=common,
                         unit="images")]
    compute = {"precision": ["fp32", "bf16"], "batch_size": [128, 256], **packing}
    return [
        Workload(name="lm", target="benchmarks/workloads/colocation.py:train_lm", unit="tokens", per_sample=64,
                 space={"knobs": compute, "baseline": {"batch_size": 256}, "global_batch": 256,
                        "budget": {"samples": 16384, "warmup_steps": 5, "windows": 3}}),
        Workload(name="cnn", target="benchmarks/workloads/colocation.py:train_cnn", unit="images",
                 space={"knobs": compute, "baseline": {"batch_size": 256}, "global_batch": 256,
                        "budget": {"samples": 32768, "warmup_steps": 5, "windows": 3}}),
    ]


def mps_processes() -> list[dict[str, Any]]:
    """Every process of the MPS daemon on this host (its control program and servers), from ``/proc``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()  # at most 15 characters: "nvidia-cuda-mps" for both
            argv0 = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        name = os.path.basename(argv0)
        if name in MPS_NAMES or (comm and any(n.startswith(comm) for n in MPS_NAMES) and len(comm) == 15):
            found.append({"pid": int(entry.name), "name": name or comm})
    return found


def compute_mode() -> str:
    """The GPU's compute mode as nvidia-smi reports it ("" without nvidia-smi)."""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=compute_mode", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _trials(result: Any) -> list[dict[str, Any]]:
    """The study's measured trials: config, status, aggregate throughput, the copies and their overlap."""
    import optuna

    study = optuna.load_study(study_name=result.study_name, storage=result.storage)
    rows = []
    for t in study.trials:
        attrs = t.user_attrs
        if "config" not in attrs or attrs.get("status") == "infeasible":
            continue
        rows.append({"number": t.number, "config": attrs["config"], "status": attrs.get("status"),
                     "throughput": attrs.get("throughput", 0.0), "copy_throughputs": attrs.get("copy_throughputs"),
                     "overlap": attrs.get("overlap"), "timed_overlap": attrs.get("timed_overlap"),
                     "accuracy_verdict": attrs.get("accuracy_verdict"), "error": attrs.get("error", ""),
                     "gpu_util": attrs.get("extra:gpu.gpu_util_pct.mean")})
    return rows


def study(workload: Workload, workdir: Path, args: argparse.Namespace, timeout: float) -> Any:
    from autotune import Tuner
    from autotune.search._space import parse_space

    space = parse_space(workload.space, where=workload.name, name=workload.name)
    tuner = Tuner(workload.target, space=space, n_trials=args.trials, timeout=timeout, capabilities=args.capabilities,
                  study_name=workload.name, studies_dir=workdir / "studies", storage=f"sqlite:///{workdir / 'coloc.db'}",
                  top_k=0 if args.tiny else 2, confirm_rounds=1, reference_repeats=1 if args.tiny else 2,
                  trial_timeout=args.trial_timeout, prune_below=None, progress=not args.tiny, plots=False,
                  mps=args.mps)
    return tuner.run()


def rerun(workload: Workload, pick: Any, workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The pick, the pick with MPS toggled and the pick as one process, in turn, under the runner's own daemon."""
    from autotune.hardware._mps import open_mps
    from autotune.search._space import parse_space
    from autotune.study._runner import TrialRunner

    space = parse_space(workload.space, where=workload.name, name=workload.name)
    session, daemon = open_mps(args.mps, study_dir=workdir / f"rerun-{workload.name}")
    try:
        runner = TrialRunner(target=workload.target, logdir=workdir / "studies" / f"{workload.name}-reruns",
                             baseline=space.baseline, budget=space.budget, timeout=args.trial_timeout,
                             mps=session if session.available else None)
        configs = {"pick": pick,
                   "one_process": pick.replace(processes_per_gpu=1, memory_fraction=1.0, mps=False)}
        if session.available:
            configs["pick_mps_toggled"] = pick.replace(mps=not pick.mps)
        labels = list(configs)
        runs: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
        for r in range(args.rounds):
            for label in (labels if r % 2 == 0 else labels[::-1]):
                outcome = runner.run(configs[label], f"{label}-{r}", seed=0)
                run: dict[str, Any] = {"status": outcome.status, "error": outcome.error}
                if outcome.ok and outcome.measurement is not None:
                    run["throughput"] = outcome.measurement.throughput
                if outcome.colocation is not None:
                    run.update(copies=[c.throughput for c in outcome.colocation.copies],
                               overlap=outcome.colocation.overlap, timed_overlap=outcome.colocation.timed_overlap)
                runs[label].append(run)
    finally:
        if daemon is not None:
            daemon.stop()
    rates = {label: [r["throughput"] for r in rs if "throughput" in r] for label, rs in runs.items()}
    medians = {label: statistics.median(v) if v else None for label, v in rates.items()}
    pick_rates = rates["pick"]
    spread = (max(pick_rates) - min(pick_rates)) / statistics.median(pick_rates) if len(pick_rates) > 1 else None
    return {"configs": {label: c.describe() for label, c in configs.items()}, "runs": runs, "rates": rates,
            "medians": medians, "pick_spread": spread, "mps": session.available,
            "mps_reason": session.reason, "mps_owned": session.owned,
            "speedup_vs_one_process": (medians["pick"] / medians["one_process"]
                                       if medians["pick"] and medians["one_process"] else None)}


def measure(workload: Workload, workdir: Path, args: argparse.Namespace, budget_seconds: float) -> dict[str, Any]:
    started = time.monotonic()
    reserve = 15.0 if args.tiny else args.rerun_reserve
    result = study(workload, workdir, args, timeout=max(20.0, budget_seconds - reserve))
    if result.best is None:
        return {"workload": workload.name, "error": "the study found nothing feasible", "trials": _trials(result)}
    pick = result.best.config
    reruns = rerun(workload, pick, workdir, args)
    return {
        "workload": workload.name, "target": workload.target, "unit": workload.unit, "per_sample": workload.per_sample,
        "baseline": result.baseline.describe(), "baseline_throughput": result.baseline_throughput,
        "pick": pick.describe(), "pick_config": pick.to_dict(), "packing": pick.packing,
        "throughput": result.best.throughput, "speedup_vs_baseline": result.speedup, "verdict": result.verdict,
        "removed_knobs": result.removed_knobs, "trials": _trials(result), "reruns": reruns,
        "seconds": round(time.monotonic() - started, 1),
    }


def _rate(value: Optional[float], per: int = 1) -> str:
    if value is None:
        return "-"
    value *= per
    return f"{value / 1e6:.2f}M" if value >= 1e6 else f"{value:,.0f}"


def _pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.0%}"


def report(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The markdown of a run."""
    lines = [f"# Co-location: several training processes per GPU on {meta['device']}", "",
             f"Run {meta['date']}: `{meta['command']}`" + (" (tiny models: the numbers mean nothing)." if meta["tiny"]
                                                         else "."),
             f"torch {meta['torch']}, driver {meta['driver'] or '-'}, {meta['seconds']:.0f} s in all.", "",
             "Throughput is aggregate: every copy's samples/s summed (each copy timed while every other copy "
             "trained, see the overlap columns).", ""]
    lines += ["## Picks", "",
              "| workload | baseline | pick | packing | pick vs baseline (study) | pick vs one process (reruns) | "
              "pick's spread over reruns |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['workload']} | - | {row['error']} | | | | |")
            continue
        per, unit, rr = row["per_sample"], row["unit"], row["reruns"]
        speed = rr["speedup_vs_one_process"]
        lines.append(
            f"| {row['workload']} | `{row['baseline']}` {_rate(row['baseline_throughput'], per)} {unit}/s | "
            f"`{row['pick']}` {_rate(row['throughput'], per)} {unit}/s | {row['packing']} | "
            f"{row['speedup_vs_baseline']:.2f}x ({row['verdict']}) | "
            f"{'-' if speed is None else f'{speed:.2f}x'} | {_pct(rr['pick_spread'])} over {len(rr['rates']['pick'])} |")
    for row in rows:
        if "error" in row:
            continue
        per, unit, rr = row["per_sample"], row["unit"], row["reruns"]
        lines += ["", f"## {row['workload']}: reruns", "",
                  "Measured in turn (forward, then backward) under "
                  + ("an MPS daemon" + (" the runner started" if rr["mps_owned"] else " already running")
                     if rr["mps"] else f"no MPS ({rr['mps_reason']})") + ".", "",
                  f"| config | runs ({unit}/s) | median | copies' overlap (timed windows) |", "|---|---|---|---|"]
        for label, described in rr["configs"].items():
            runs = rr["runs"][label]
            overlaps = [f"{r['overlap']:.0%} ({r['timed_overlap']:.0%})" for r in runs if "overlap" in r]
            failed = [f"{r['status']}: {r['error']}" for r in runs if "throughput" not in r]
            lines.append(f"| {label}: `{described}` | {', '.join(_rate(v, per) for v in rr['rates'][label])}"
                         + (f"; failed: {'; '.join(failed)}" if failed else "")
                         + f" | {_rate(rr['medians'][label], per)} | {', '.join(overlaps) or '-'} |")
        lines += ["", f"## {row['workload']}: the study's trials", "",
                  f"| # | config | status | aggregate {unit}/s | copies | overlap (timed windows) | accuracy | GPU busy |",
                  "|---|---|---|---|---|---|---|---|"]
        from autotune import TrialConfig

        for t in sorted(row["trials"], key=lambda t: -(t["throughput"] or 0)):
            copies = ", ".join(_rate(v, per) for v in t["copy_throughputs"] or [])
            overlap = f"{t['overlap']:.0%} ({t['timed_overlap']:.0%})" if t["overlap"] is not None else "-"
            util = f"{t['gpu_util']:.0f}%" if isinstance(t["gpu_util"], (int, float)) else "-"
            status = t["status"] if t["status"] == "ok" else f"{t['status']}: {t['error'][:80]}"
            lines.append(f"| {t['number']} | `{TrialConfig.from_dict(t['config']).describe()}` | {status} | "
                         f"{_rate(t['throughput'], per)} | {copies or '-'} | {overlap} | {t['accuracy_verdict'] or '-'} "
                         f"| {util} |")
        if row["removed_knobs"]:
            lines.append("")
            lines.append("Removed before the search: " + "; ".join(f"`{k}` ({why})" for k, why in
                                                                  sorted(row["removed_knobs"].items())))
    left = meta["mps_after"]
    lines += ["", "## MPS daemon and compute mode", "",
              f"- MPS processes before the run: {meta['mps_before'] or 'none'}; after: {left or 'none'}"
              + (" (the daemon is gone)." if not left else " (LEFT BEHIND)."),
              f"- Compute mode before: {meta['compute_mode_before'] or '-'}; after: {meta['compute_mode_after'] or '-'}.",
              "", "How the overlap was checked: each copy waits at a start barrier after its warm-up and trains on, "
              "untimed, until every copy has ended its timed windows; each records its timed span (wall clock). "
              "`overlap` is the smallest share of a copy's timed span during which every copy was training; the "
              "figure in brackets is the share during which every copy was inside its own timed windows."]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("colocation-h200.md"))
    parser.add_argument("--workdir", type=Path, default=Path("coloc-run"))
    parser.add_argument("--deadline", type=float, default=450.0, help="seconds for the whole run (default 450)")
    parser.add_argument("--trials", type=int, default=14, help="trials per study (default 14)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of reruns (default 3)")
    parser.add_argument("--trial-timeout", type=float, default=120.0)
    parser.add_argument("--rerun-reserve", type=float, default=75.0,
                        help="seconds of each workload's share kept for its reruns and confirmation (default 75)")
    parser.add_argument("--mps", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--workloads", default="lm,cnn")
    parser.add_argument("--tiny", action="store_true", help="tiny models and budgets: a CPU check of this script")
    args = parser.parse_args(argv)
    started = time.monotonic()
    if args.tiny:
        os.environ[SIZE_ENV] = "tiny"  # trial processes take the coordinator's environment
        args.trials = min(args.trials, 2)
        args.rounds = min(args.rounds, 2)
    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    import torch

    from autotune.hardware import probe

    mps_before = mps_processes()
    mode_before = compute_mode()
    args.capabilities = caps = probe()  # once for every study of the run
    device = caps.gpu_name if caps.cuda else f"CPU ({caps.cpu_count} cores)"
    chosen = [w for w in workloads(args.tiny) if w.name in args.workloads.split(",")]
    rows = []
    for i, workload in enumerate(chosen):
        left = args.deadline - (time.monotonic() - started)
        rows.append(measure(workload, workdir, args, left / (len(chosen) - i)))
    time.sleep(0.5)  # a daemon's servers exit a moment after its control program
    before = {p["pid"] for p in mps_before}
    mps_after = [p for p in mps_processes() if p["pid"] not in before]
    meta = {"device": device, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": f"{COMMAND} {_shown(argv if argv is not None else sys.argv[1:], args)}", "tiny": args.tiny,
            "torch": torch.__version__, "driver": caps.driver, "seconds": time.monotonic() - started,
            "mps_before": mps_before, "mps_after": mps_after, "compute_mode_before": mode_before,
            "compute_mode_after": compute_mode()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    text = report(rows, meta)
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "workloads": rows}, indent=2, default=str))
    print(text)
    if mps_after:
        print(f"MPS processes left behind: {mps_after}", file=sys.stderr)
    return 1 if mps_after else 0


def _shown(argv: list[str], args: argparse.Namespace) -> str:
    """The command line as the report prints it: ``--out`` by its file name, ``--workdir`` as WORKDIR, so that
    no path of the machine it ran on is recorded."""
    named = {str(args.out): args.out.name, str(args.workdir): "WORKDIR"}
    return " ".join(named.get(a, a) for a in argv)


if __name__ == "__main__":
    raise SystemExit(main())
