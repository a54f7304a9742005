"""The study's promise checked at full length: tune, then ``autotune train --compare`` for 10x a trial's samples.

    python -m benchmarks.runners.train_h200 --out benchmarks/results/train-h200.md --workdir /scratch/train-h200

For each of three workloads (ResNet-50 on synthetic images kept on the GPU, the GPT-style LM on synthetic
streams, and the input-bound JPEG folder decoded by PIL in DataLoader workers):

1. **Study.** ``autotune tune WORKLOAD --space SPACE --trials N`` through the CLI, as a user runs it.
2. **Real run.** ``autotune train WORKLOAD --study NAME --steps S --compare``: the baseline, then the pick,
   each for ``--multiple`` (default 10) times a trial's samples (``S`` optimizer steps of the pick's global
   batch), in fresh processes.
3. **Report.** From each ``train.json``: the delivered and promised throughput of the pick and the
   baseline and their ratio (the goal is within +-5%), the speed-up at full length against the study's,
   the accuracy verdict of the pick's loss curve against the baseline's over the whole run, joules per
   sample of both and the energy ratio beside the speed-up; a PNG of the two loss curves per workload.

Writes the markdown to ``--out``, the raw ``train.json`` of each workload beside it (``train-h200-<name>.json``)
and the curves (``train-h200-<name>.png``). ``--tiny`` runs small models and short studies on whatever
device there is (a check of the runner on a CPU; the numbers mean nothing there). ``--only`` picks workloads.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[2]
SPACES = REPO / "benchmarks" / "spaces"


def workloads(tiny: bool) -> dict[str, dict[str, Any]]:
    """Name -> target, space (None: the default space of the device) and environment of each workload."""
    jpeg_env = {"AUTOTUNE_JPEG_MODEL": "tiny", "AUTOTUNE_JPEG_SIZE": "112", "AUTOTUNE_JPEG_EVAL": "256"}
    return {
        "resnet50": {"target": "benchmarks.workloads.resnet50:train_device", "space": None, "env": {},
                     "what": "ResNet-50 on 2,048 synthetic 224 px images kept on the GPU (a fifth of the labels "
                             "noisy), `gpu_default`'s space"},
        "gpt": {"target": "benchmarks.workloads.gpt:train", "space": SPACES / "gpt_h200.yaml", "env": {},
                "what": "the GPT-style LM on synthetic token streams (`benchmarks/spaces/gpt_h200.yaml`)"},
        "input-bound": {"target": "benchmarks.workloads.jpeg:train", "space": SPACES / "input_bound_h200.yaml",
                        "env": jpeg_env, "jpegs": True,
                        "what": "a small CNN on a folder of real JPEGs decoded by PIL in DataLoader workers, crop "
                                "112 (`benchmarks/spaces/input_bound_h200.yaml`)"},
    }


def _run(command: list[str], env: dict[str, str], log: Path) -> int:
    """Run a CLI command from the repository's root, its output teed into ``log``; its exit code."""
    print("$ " + " ".join(command), flush=True)
    started = time.monotonic()
    with log.open("w") as fh:
        proc = subprocess.run(command, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, text=True)
    print(f"  exit {proc.returncode} after {time.monotonic() - started:.0f} s (log {log})", flush=True)
    return proc.returncode


def _space_for(spec: dict[str, Any], args: argparse.Namespace, workdir: Path) -> Optional[Path]:
    """The workload's space; under ``--tiny`` (or ``--samples``) a copy with a short budget."""
    import yaml

    from autotune.search._space import load_space

    if not (args.tiny or args.samples):
        return spec["space"]
    import torch

    source = spec["space"] or ("gpu_default" if torch.cuda.is_available() else "cpu_default")
    doc = yaml.safe_load(Path(source).read_text()) if spec["space"] else load_space(source).to_dict()
    doc.setdefault("budget", {})["samples"] = args.samples or 2048
    path = workdir / f"space-{Path(str(source)).stem}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def trial_samples(studies: Path, study: str) -> int:
    """The samples one trial of the study trained (its space's budget)."""
    import optuna

    storage = f"sqlite:///{studies / 'autotune.db'}"
    attrs = optuna.load_study(study_name=study, storage=storage).user_attrs
    return int(attrs["space"]["budget"]["samples"])


def measure(name: str, spec: dict[str, Any], args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    studies = workdir / "studies"
    env = {**os.environ, **spec["env"], "COLUMNS": "200"}
    if args.tiny:
        env["AUTOTUNE_BENCH_SIZE"] = "tiny"
    if spec.get("jpegs"):
        from benchmarks.workloads import make_jpegs

        root = workdir / "jpegs"
        if not root.exists():
            make_jpegs.generate(str(root), images=512 if args.tiny else args.images, classes=16, min_size=200,
                                max_size=260, quality=90, seed=0, workers=None)
        env["AUTOTUNE_JPEG_ROOT"] = str(root)
    study = f"train-{name}"
    tune = [sys.executable, "-m", "autotune", "tune", spec["target"], "--study", study, "--trials", str(args.trials),
            "--studies-dir", str(studies), "--no-progress", "--no-plots"]
    space = _space_for(spec, args, workdir)
    if space is not None:
        tune += ["--space", str(space)]
    if args.study_timeout:
        tune += ["--timeout", str(args.study_timeout)]
    out: dict[str, Any] = {"name": name, "what": spec["what"], "tune": " ".join(tune[2:])}
    if _run(tune, env, workdir / f"tune-{name}.log") != 0:
        out["error"] = f"the study failed: see tune-{name}.log"
        return out
    best = json.loads((studies / study / "best_config.json").read_text())
    if best.get("config") is None:
        out["error"] = "the study found no feasible config"
        return out
    samples = trial_samples(studies, study)
    global_batch = best["config"].get("global_batch") or best["config"]["batch_size"]
    steps = max(1, args.multiple * samples // global_batch)
    train = [sys.executable, "-m", "autotune", "train", spec["target"], "--study", study, "--studies-dir", str(studies),
             "--steps", str(steps), "--compare", "--no-progress", "--out", str(workdir / name)]
    out.update(train=" ".join(train[2:]), trial_samples=samples, steps=steps, run_samples=steps * global_batch)
    code = _run(train, env, workdir / f"train-{name}.log")
    path = workdir / name / "train.json"
    if not path.is_file():
        out["error"] = f"autotune train wrote no train.json (exit {code}): see train-{name}.log"
        return out
    out["doc"] = json.loads(path.read_text())
    out["best"] = {k: best.get(k) for k in ("verdict", "speedup", "speedup_spread", "accuracy_verdict", "energy")}
    out["best_measurement"] = {k: (best.get("measurement") or {}).get(k)
                               for k in ("data_wait_fraction", "window_throughputs", "extra:gpu.sm_clock_mhz.mean",
                                         "extra:gpu.power_w.mean")}
    return out


def _rate(value: Any) -> str:
    return f"{value:,.0f}" if isinstance(value, (int, float)) else "n/a"


def _ratio(value: Any, digits: int = 3) -> str:
    return f"{value:.{digits}f}x" if isinstance(value, (int, float)) else "n/a"


def _joules(run: dict[str, Any], unit: str = "") -> str:
    value = run.get("joules_per_sample")
    return f"{value:.4g}{unit}" if isinstance(value, (int, float)) else (run.get("energy_note") or "not measured")


def plot_curves(doc: dict[str, Any], path: Path, title: str) -> Optional[Path]:
    """The baseline's and the pick's loss curves over the run's optimizer steps (None without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, run in doc["runs"].items():
        every = run.get("loss_every") or 1
        losses = run.get("losses") or []
        ax.plot([(i + 1) * every for i in range(len(losses))], losses,
                label=f"{label}: {_describe(run['config'])}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (bin mean)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _describe(config: dict[str, Any]) -> str:
    from autotune._config import TrialConfig

    return TrialConfig.from_dict(config).describe()


def report(rows: list[dict[str, Any]], args: argparse.Namespace, out: Path) -> str:
    from autotune.hardware import probe

    caps = probe()
    lines = [
        "# The study's promise at full length (H200)",
        "",
        f"Command: `python -m benchmarks.runners.train_h200 {' '.join(sys.argv[1:])}`; "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {caps.device_label}, torch {caps.torch}, "
        f"Python {platform.python_version()}.",
        "",
        f"Each workload: a study of {args.trials} trials, then `autotune train --compare` of the baseline and the "
        f"pick for {args.multiple}x a trial's samples, one after the other. Delivered throughput is the run's "
        "timed windows together (warm-up and end-of-epoch hooks apart); promised is the study's figure for the "
        "same config (the pick's: its race median or its trial; the baseline's: the study's). Ratio ranges: "
        "the run's window p10-p90 over the study trial's window extremes. Energy: NVML's energy counter over "
        "the whole run, per training sample.",
        "",
        "| workload | config | promised samples/s | delivered samples/s | ratio (range) | J/sample |",
        "|---|---|---:|---:|---:|---:|",
    ]
    details: list[str] = []
    for row in rows:
        if "doc" not in row:
            lines.append(f"| {row['name']} | {row.get('error')} | | | | |")
            continue
        doc, runs = row["doc"], row["doc"]["runs"]
        promise = doc.get("promise") or {}
        for label in ("baseline", "pick"):
            run = runs.get(label)
            if run is None:
                continue
            check = promise if label == "pick" else doc.get("promise_baseline") or {}
            promised, ratio = check.get("promised"), check.get("ratio")
            span = f" ({_ratio(check.get('ratio_low'))}-{_ratio(check.get('ratio_high'))})" if ratio is not None else ""
            lines.append(f"| {row['name']} | {label}: `{_describe(run['config'])}` | {_rate(promised)} | "
                         f"{_rate(run.get('throughput'))} | {_ratio(ratio)}{span} | {_joules(run)} |")
        comparison = doc.get("comparison") or {}
        pick, base = runs.get("pick") or {}, runs.get("baseline") or {}
        energy = (pick["joules_per_sample"] / base["joules_per_sample"]
                  if pick.get("joules_per_sample") and base.get("joules_per_sample") else None)
        png = plot_curves(doc, out.parent / f"{out.stem}-{row['name']}.png", row["name"])
        (out.parent / f"{out.stem}-{row['name']}.json").write_text(json.dumps(row, indent=2, default=str))
        details += [
            "", f"## {row['name']}", "", row["what"] + ".", "",
            f"- Study: `{row['tune']}`; its verdict: {row['best'].get('verdict')}"
            f" ({_ratio(row['best'].get('speedup'), 2)}), accuracy {row['best'].get('accuracy_verdict')}.",
            f"- Real run: `{row['train']}`: {row['steps']:,} optimizer steps, {row['run_samples']:,} samples "
            f"({row['run_samples'] / row['trial_samples']:.1f}x a trial's {row['trial_samples']:,}).",
            f"- Promise: {promise.get('what')}.",
            f"- Speed: {comparison.get('speed_what', 'n/a')}.",
            f"- Accuracy: {comparison.get('accuracy_what', 'n/a')}.",
            f"- Energy: pick {_joules(pick, ' J/sample')}, baseline {_joules(base, ' J/sample')}"
            + (f": {energy:.2f}x the baseline's energy per sample beside a {_ratio(comparison.get('speedup'), 2)} "
               "speed-up." if energy else "."),
            f"- Wall time: baseline {base.get('wall_seconds', 0):.0f} s, pick {pick.get('wall_seconds', 0):.0f} s.",
        ]
        if png is not None:
            details += ["", f"![{row['name']}: loss curves]({png.name})"]
        for label, check in (("pick", promise), ("baseline", doc.get("promise_baseline") or {})):
            if check.get("holds") is False:
                run = runs[label]
                wait = run.get("data_wait_fraction")
                study_wait = (row.get("best_measurement") or {}).get("data_wait_fraction") if label == "pick" else None
                details.append(
                    f"- **{label}: delivered outside +-5% of the promise** ({_ratio(check.get('ratio'))}). Measured beside "
                    f"it: data wait {wait:.1%} of the timed windows" if isinstance(wait, (int, float)) else
                    f"- **{label}: delivered outside +-5% of the promise** ({_ratio(check.get('ratio'))})")
                if isinstance(study_wait, (int, float)):
                    details[-1] += f" (the study's trial: {study_wait:.1%})"
                details[-1] += (f"; {len(run.get('window_throughputs') or [])} windows from "
                                f"{_rate(min(run.get('window_throughputs') or [0]))} to "
                                f"{_rate(max(run.get('window_throughputs') or [0]))} samples/s. The reason: see the logs "
                                "and write it here.")
    return "\n".join(lines + details) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "train-h200.md")
    parser.add_argument("--workdir", type=Path, required=True, help="studies, logs, JPEGs (kept between runs)")
    parser.add_argument("--trials", type=int, default=16, help="trials of each study (default 16)")
    parser.add_argument("--multiple", type=int, default=10, help="the real run's samples over a trial's (default 10)")
    parser.add_argument("--study-timeout", type=float, help="each study's --timeout, seconds")
    parser.add_argument("--images", type=int, default=8192, help="JPEGs of the input-bound workload (default 8192)")
    parser.add_argument("--samples", type=int, help="override each space's trial samples (a quick check)")
    parser.add_argument("--only", help="comma-separated workloads: resnet50, gpt, input-bound")
    parser.add_argument("--tiny", action="store_true", help="small models, 2,048-sample trials: a check on a CPU")
    parser.add_argument("--fresh", action="store_true", help="delete the workdir's studies first")
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.fresh:
        shutil.rmtree(args.workdir / "studies", ignore_errors=True)
    chosen = workloads(args.tiny)
    names = args.only.split(",") if args.only else list(chosen)
    unknown = [n for n in names if n not in chosen]
    if unknown:
        parser.error(f"unknown workloads: {', '.join(unknown)} (known: {', '.join(chosen)})")
    rows = [measure(name, chosen[name], args, args.workdir) for name in names]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report(rows, args, args.out))
    print(f"wrote {args.out}", flush=True)
    return 0 if all("doc" in row for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
