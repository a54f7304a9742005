"""Two-rank DDP trials on a two-GPU host: ResNet-50 and the GPT-style LM tuned from default DDP settings.

    python -m benchmarks.runners.ddp_h200x2 --out benchmarks/results/ddp-h200x2.md --workdir ddp-run

Run it from the repository root (the workloads are named by their paths from there).

For each workload:

1. **One-GPU best.** A one-process study over the compute knobs (precision, batch, compile, channels_last,
   CUDA Graphs): the single-GPU config that two ranks have to scale.
2. **Two-rank study.** The same compute knobs plus the DDP knobs (``bucket_cap_mb``,
   ``gradient_as_bucket_view``, ``static_graph``, ``grad_compression``) with ``processes_per_trial: 2``,
   from the untuned baseline with torch's default DDP settings (25 MB buckets, gradients copied into the
   buckets, no static graph, fp32 all-reduce). Its own top-K confirmation gives the speed-up over that
   baseline.
3. **Alternation.** The pick, the pick with default DDP settings (what the DDP knobs alone bought) and the
   one-GPU best, measured again in turn (A B C, then C B A) for ``--rounds`` rounds; medians give the
   DDP knobs' speed-up and the scaling efficiency, 2-rank global samples/s over twice the one-GPU best.

Writes the markdown to ``--out`` and the raw numbers beside it (``.json``). ``--tiny`` swaps in tiny models
(``AUTOTUNE_BENCH_SIZE=tiny``: a small CNN for ResNet-50, ``GPT_TINY`` for the LM), tiny budgets and gloo on
the CPU, to check this script (``tests/test_ddp_runner.py``); its numbers mean nothing. Not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
from pathlib import Path
from typing import Any, Optional

from autotune import Result, TrialConfig, Tuner
from autotune._config import DDP_KNOBS
from autotune.search._space import SearchSpace, parse_space
from autotune.study._runner import TrialRunner

SIZE_ENV = "AUTOTUNE_BENCH_SIZE"
DDP_SPACE = {"bucket_cap_mb": [10, 25, 50, 100], "gradient_as_bucket_view": [False, True],
             "static_graph": [False, True], "grad_compression": ["none", "bf16"]}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """One model to tune: its target and its spaces for one GPU and for two ranks."""

    name: str
    target: str
    one_gpu: dict[str, Any]
    two_ranks: dict[str, Any]


def workloads(tiny: bool) -> list[Workload]:
    """ResNet-50 (``scale``: the batch knob is each rank's batch) and the LM (``fixed`` at 64 sequences)."""
    resnet, gpt = "benchmarks/workloads/resnet50.py:train_device", "benchmarks/workloads/gpt.py:train"
    if tiny:
        budget = {"samples": 256, "warmup_steps": 2, "windows": 3}
        compute = {"precision": ["fp32"], "batch_size": [8, 16]}
        return [
            Workload(name="resnet50", target=resnet,
                     one_gpu={"knobs": compute, "baseline": {"batch_size": 8}, "batch_policy": "scale",
                              "budget": budget},
                     two_ranks={"knobs": {**compute, "bucket_cap_mb": [1, 25], "grad_compression": ["none", "bf16"]},
                                "baseline": {"batch_size": 8}, "batch_policy": "scale", "budget": budget}),
            Workload(name="gpt", target=gpt,
                     one_gpu={"knobs": {"batch_size": [16, 32]}, "baseline": {"batch_size": 32}, "global_batch": 32,
                              "budget": budget},
                     two_ranks={"knobs": {"batch_size": [8, 16], "static_graph": [False, True]},
                                "baseline": {"batch_size": 16}, "global_batch": 32, "budget": budget}),
        ]
    compute = {"precision": ["fp32", "bf16"], "channels_last": [False, True], "compile": ["off", "default"]}
    lm = {"precision": ["fp32", "bf16"], "compile": ["off", "default"]}
    return [
        Workload(name="resnet50", target=resnet,
                 one_gpu={"knobs": {**compute, "batch_size": [64, 128, 256, 512], "cuda_graphs": [False, True]},
                          "baseline": {"batch_size": 64}, "batch_policy": "scale",
                          "budget": {"samples": 16384, "warmup_steps": 5, "windows": 3}},
                 two_ranks={"knobs": {**compute, "batch_size": [64, 128, 256, 512], **DDP_SPACE},
                            "baseline": {"batch_size": 64}, "batch_policy": "scale",
                            "budget": {"samples": 32768, "warmup_steps": 5, "windows": 3}}),
        Workload(name="gpt", target=gpt,
                 one_gpu={"knobs": {**lm, "batch_size": [8, 16, 32, 64], "cuda_graphs": [False, True]},
                          "baseline": {"batch_size": 64}, "global_batch": 64,
                          "budget": {"samples": 3072, "warmup_steps": 4, "windows": 3}},
                 # 32 sequences on each of 2 ranks is the global 64 without accumulation: the default DDP job.
                 two_ranks={"knobs": {**lm, "batch_size": [8, 16, 32], **DDP_SPACE},
                            "baseline": {"batch_size": 32}, "global_batch": 64,
                            "budget": {"samples": 3072, "warmup_steps": 4, "windows": 3}}),
    ]


def _study(workload: Workload, space: SearchSpace, name: str, workdir: Path, args: argparse.Namespace,
           processes: int) -> Result:
    tuner = Tuner(workload.target, space=space, processes_per_trial=processes, n_trials=args.trials,
                  capabilities=args.capabilities,
                  study_name=name, studies_dir=workdir / "studies", storage=f"sqlite:///{workdir / 'ddp.db'}",
                  top_k=0 if args.tiny else 3, confirm_rounds=1 if args.tiny else 2,
                  reference_repeats=1 if args.tiny else 2, max_accuracy_loss=args.max_accuracy_loss,
                  progress=not args.tiny)
    return tuner.run()


def default_ddp(config: TrialConfig) -> TrialConfig:
    """``config`` with torch's default DDP settings."""
    defaults = TrialConfig()
    return config.replace(**{knob: getattr(defaults, knob) for knob in DDP_KNOBS})


def alternate(runner: TrialRunner, configs: dict[str, TrialConfig], rounds: int,
              workdir: str) -> dict[str, list[float]]:
    """Each config measured ``rounds`` times in turn (forward, then backward): label -> throughputs."""
    rates: dict[str, list[float]] = {label: [] for label in configs}
    labels = list(configs)
    for r in range(rounds):
        for label in (labels if r % 2 == 0 else labels[::-1]):
            outcome = runner.run(configs[label], f"{workdir}/{label}-{r}", seed=0)
            if not outcome.ok or outcome.measurement is None:
                raise RuntimeError(f"{label} failed in round {r}: {outcome.status}: {outcome.error}")
            rates[label].append(outcome.measurement.throughput)
    return rates


def measure(workload: Workload, workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The one-GPU study, the two-rank study and their alternation, for one workload."""
    one_space = parse_space(workload.one_gpu, where=f"{workload.name}-1gpu", name=f"{workload.name}-1gpu")
    two_space = parse_space({**workload.two_ranks, "processes_per_trial": 2}, where=f"{workload.name}-2rank",
                            name=f"{workload.name}-2rank")
    one = _study(workload, one_space, f"{workload.name}-1gpu", workdir, args, 1)
    two = _study(workload, two_space, f"{workload.name}-2rank", workdir, args, 2)
    if one.best is None or two.best is None:
        raise RuntimeError(f"{workload.name}: a study found nothing feasible")
    pick = two.best.config
    runner = TrialRunner(target=workload.target, logdir=workdir / "studies" / f"{workload.name}-alternation",
                         baseline=two_space.baseline, budget=two_space.budget, timeout=600.0)
    configs = {"pick": pick, "pick_default_ddp": default_ddp(pick), "one_gpu_best": one.best.config}
    rates = alternate(runner, configs, args.rounds, "alt")
    medians = {label: statistics.median(values) for label, values in rates.items()}
    return {
        "workload": workload.name,
        "target": workload.target,
        "one_gpu": {"best": one.best.config.describe(), "throughput": one.best.throughput,
                    "baseline_throughput": one.baseline_throughput, "speedup": one.speedup, "verdict": one.verdict},
        "two_ranks": {"baseline": two.baseline.describe(), "baseline_throughput": two.baseline_throughput,
                      "best": pick.describe(), "throughput": two.best.throughput, "speedup": two.speedup,
                      "speedup_low": two.speedup_low, "speedup_high": two.speedup_high,
                      "speedup_basis": two.speedup_basis, "verdict": two.verdict,
                      "removed_knobs": two.removed_knobs},
        "alternation": {"rounds": args.rounds, "rates": rates, "medians": medians,
                        "configs": {label: c.describe() for label, c in configs.items()}},
        "ddp_knob_speedup": medians["pick"] / medians["pick_default_ddp"],
        "scaling_efficiency": medians["pick"] / (2 * medians["one_gpu_best"]),
    }


def _fmt_rate(value: Optional[float]) -> str:
    return f"{value:,.1f}" if value is not None else "-"


def report(rows: list[dict[str, Any]], *, tiny: bool, device: str) -> str:
    """The markdown of a run."""
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# DDP trials: two ranks on {device}", "",
             f"Run {when} by `python -m benchmarks.runners.ddp_h200x2`"
             + (" --tiny (tiny models: the numbers mean nothing)." if tiny else "."),
             "Throughput is global samples/s (every rank's samples over the slowest rank's seconds).", "",
             "| workload | one-GPU best | 2-rank baseline (default DDP) | 2-rank pick | pick vs baseline | "
             "pick vs pick with default DDP knobs | scaling efficiency |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        one, two, alt = row["one_gpu"], row["two_ranks"], row["alternation"]["medians"]
        lines.append(
            f"| {row['workload']} | `{one['best']}` {_fmt_rate(one['throughput'])}/s | `{two['baseline']}` "
            f"{_fmt_rate(two['baseline_throughput'])}/s | `{two['best']}` {_fmt_rate(two['throughput'])}/s | "
            f"{two['speedup']:.2f}x ({two['speedup_basis']}, {two['speedup_low']:.2f}x-{two['speedup_high']:.2f}x) | "
            f"{row['ddp_knob_speedup']:.3f}x ({_fmt_rate(alt['pick'])} vs {_fmt_rate(alt['pick_default_ddp'])}/s) | "
            f"{row['scaling_efficiency']:.1%} ({_fmt_rate(alt['pick'])} / 2 x {_fmt_rate(alt['one_gpu_best'])}/s) |")
    lines += ["", "The alternation's medians (the last two columns) come from "
              f"{rows[0]['alternation']['rounds'] if rows else 0} rounds of pick, pick with default DDP knobs and the "
              "one-GPU best measured in turn; the speed-up over the baseline is the two-rank study's own verdict.", ""]
    for row in rows:
        removed = row["two_ranks"]["removed_knobs"]
        if removed:
            lines.append(f"- {row['workload']}: removed before the search: "
                         + "; ".join(f"`{k}` ({why})" for k, why in sorted(removed.items())))
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="ddp-h200x2.md")
    parser.add_argument("--workdir", default="ddp-run")
    parser.add_argument("--trials", type=int, default=12, help="trials per study (default 12)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the final alternation (default 3)")
    parser.add_argument("--max-accuracy-loss", type=float, default=0.01)
    parser.add_argument("--workloads", default="resnet50,gpt")
    parser.add_argument("--tiny", action="store_true", help="tiny models and budgets: a CPU check of this script")
    args = parser.parse_args(argv)
    if args.tiny:
        os.environ[SIZE_ENV] = "tiny"  # trial processes take the coordinator's environment
        args.trials = min(args.trials, 2)
        args.rounds = min(args.rounds, 1)
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    import torch

    cuda = torch.cuda.is_available()
    device = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}" if cuda else "CPU (gloo)"
    from autotune.hardware import probe

    args.capabilities = probe()  # once for every study of the run (it runs each knob's kernels)
    chosen = set(args.workloads.split(","))
    rows = [measure(w, workdir, args) for w in workloads(args.tiny) if w.name in chosen]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report(rows, tiny=args.tiny, device=device))
    out.with_suffix(".json").write_text(json.dumps(rows, indent=2, default=str))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
