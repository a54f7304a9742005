"""Regional compilation A/B: the whole model compiled against its repeated blocks compiled one by one.

    python -m benchmarks.runners.regional_compile OUT_DIR [--deadline 280] [--runs 3] [--cpu | --tiny]

Two models, each under ``compile_scope: model`` and ``compile_scope: regions`` (``autotune/trial/_regions.py``),
through the product's own code (``prepare_model`` and ``TrainStep``, so ``model`` compiles the forward pass
with the loss, as a trial does):

1. **GPT** (``benchmarks/tables/sweep.py:GPT``, the example's shape: 6 layers, d_model 512, 512 tokens,
   vocabulary 32,000), bf16, batch 32, ``compile: default``; its 6 layers are one repeated block.
2. **ResNet-50** (torchvision) at 224 px, bf16, channels_last, batch 128, ``compile: default``; its 16
   Bottlenecks are 8 graphs (each stage's first block downsamples).

Each measurement runs in a fresh process with a fresh Inductor cache (``TORCHINDUCTOR_CACHE_DIR``,
``TRITON_CACHE_DIR``), so every compile is cold: ``compile_seconds`` is the first training step less a
steady step; the steady rate is the median of a few timed windows after a short warm-up. Runs alternate
the order of the two scopes. Each round measures both scopes of each model; after the first, a model's pair
runs only while its first pair's seconds still fit ``--deadline``, and a measurement still running at the
deadline is cut. ``OUT_DIR/regional-h200.json`` and ``.md`` are written after each model's pair.

``--cpu`` runs small shapes on the CPU in fp32 with one compute thread (GPT: 4 layers, d_model 128, 128
tokens; ResNet-50 at 64 px, batch 8), the measurement of ``benchmarks/results/regional-compile.md``, into
``regional-cpu.*``. ``--tiny`` checks the runner in seconds: tiny shapes, one round, and Dynamo with its
``eager`` backend (no Inductor).

On an H200 the defaults fit one round (four cold compiles of 30-60 s, each in its own process) in about
4 minutes; ``--deadline 600`` leaves room for a second.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[2]
SCOPES = ("model", "regions")


@dataclass(frozen=True)
class Part:
    """One model of the A/B and how it trains."""

    name: str
    model: str  # gpt or resnet50
    batch: int
    size: int  # tokens (GPT) or image side (ResNet)
    precision: str
    channels_last: bool
    warmup: int  # steps after the first (compiling) one, before timing
    windows: int
    steps: int  # per timed window
    layers: int = 6
    d_model: int = 512
    vocab: int = 32000
    threads: Optional[int] = None  # torch's compute threads (None: torch's default)


PARTS = {
    "gpu": (Part("gpt", "gpt", 32, 512, "bf16", False, 5, 5, 10),
            Part("resnet50", "resnet50", 128, 224, "bf16", True, 5, 5, 10)),
    # One compute thread on a shared CPU: spinning OpenMP threads of a busy host make a window 10x slower.
    "cpu": (Part("gpt", "gpt", 8, 128, "fp32", False, 2, 5, 3, layers=4, d_model=128, vocab=2048, threads=1),
            Part("resnet50", "resnet50", 8, 64, "fp32", False, 2, 5, 3, threads=1)),
    "tiny": (Part("gpt", "gpt", 8, 32, "fp32", False, 1, 2, 2, layers=2, d_model=32, vocab=128),
             Part("resnet50", "resnet50", 2, 32, "fp32", False, 1, 2, 1)),
}


def _build(part: Part, device: Any) -> tuple[Any, Any, Any]:
    """The model, one synthetic batch (inputs, targets) on the device, and the loss function."""
    import torch
    from torch.nn import functional as F

    gen = torch.Generator().manual_seed(0)
    if part.model == "gpt":
        from benchmarks.tables.sweep import GPT, GPTShape

        shape = GPTShape(layers=part.layers, d_model=part.d_model, heads=max(2, part.d_model // 64), seq=part.size,
                         vocab=part.vocab)
        ids = torch.randint(0, part.vocab, (part.batch, part.size + 1), generator=gen)
        batch = (ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device))

        def loss_fn(logits: Any, targets: Any) -> Any:
            return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

        return GPT(shape), batch, loss_fn
    import torchvision

    images = torch.randn(part.batch, 3, part.size, part.size, generator=gen)
    if part.channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (part.batch,), generator=gen)
    return torchvision.models.resnet50(), (images.to(device), labels.to(device)), F.cross_entropy


def measure_one(part: Part, scope: str, *, tiny: bool) -> dict[str, Any]:
    """Train ``part`` under ``scope`` in this process: the cold compile's seconds and the steady rate."""
    import torch

    from autotune import TrialConfig
    from autotune.trial import _knobs
    from autotune.trial._compile_cache import apply_switches, compile_cache_record

    if tiny:  # checks the runner, not Inductor: Dynamo traces and runs its graphs eagerly
        compile_fn = torch.compile
        torch.compile = lambda *a, **k: compile_fn(*a, **{**k, "backend": "eager", "mode": None})
    apply_switches()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model, batch, loss_fn = _build(part, device)
    config = TrialConfig(precision=part.precision, batch_size=part.batch, channels_last=part.channels_last,
                         compile="default", compile_scope=scope, cpu_threads=part.threads)
    record: dict[str, Any] = {}

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    with _knobs.applied(config, device):
        model = _knobs.prepare_model(model, config, device, record=record)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        step = _knobs.TrainStep(model, optimizer, loss_fn, config=config, device=device)
        sync()
        started = time.perf_counter()
        first_loss = float(step(*batch))
        first = time.perf_counter() - started
        for _ in range(part.warmup):
            step(*batch)
        sync()
        rates = []
        for _ in range(part.windows):
            started = time.perf_counter()
            for _ in range(part.steps):
                step(*batch)
            sync()
            rates.append(part.steps * part.batch / (time.perf_counter() - started))
        last_loss = float(step.last_loss)
    rate = statistics.median(rates)
    return {"part": part.name, "scope": scope, "first_step_seconds": round(first, 3),
            "compile_seconds": round(max(0.0, first - part.batch / rate), 3),
            "samples_per_s": round(rate, 2), "best_window": round(max(rates), 2),
            "windows": [round(r, 2) for r in rates],
            "first_loss": round(first_loss, 4), "last_loss": round(last_loss, 4),
            "compiled_loss": step.compiled_loss, **record,
            **{k: v for k, v in compile_cache_record().items() if k != "compile_cache_counters"},
            "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None}


def _child(part: Part, scope: str, kind: str, cache: Path, timeout: float) -> dict[str, Any]:
    """``measure_one`` in a fresh process with its own empty Inductor cache."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(cache / "triton"),
           "TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    # The GPU mode is the default: it has no flag of its own.
    command = [sys.executable, "-m", "benchmarks.runners.regional_compile", "-", "--one", part.name, scope,
               *([f"--{kind}"] if kind != "gpu" else [])]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        return {"part": part.name, "scope": scope, "error": f"ran past {timeout:.0f}s (the deadline)",
                "wall_seconds": round(time.perf_counter() - started, 1)}
    wall = round(time.perf_counter() - started, 1)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"part": part.name, "scope": scope, "error": " | ".join(tail) or f"exit {done.returncode}",
                "wall_seconds": wall}
    return {**json.loads(lines[-1]), "wall_seconds": wall}


def _spread(values: list[float]) -> Optional[float]:
    """(max - min) / median, the run-to-run spread; None for fewer than two values."""
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else None


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per part and scope: median and range of compile seconds and rates; regions over model; the verdict.

    The verdict keeps regions for a part when its median compile is shorter beyond the compiles' noise (the
    larger run-to-run spread of the two scopes, at least 5%) and its median rate is within the rates' noise
    of the whole model's (likewise, at least 2%).
    """
    out: dict[str, Any] = {}
    for part in dict.fromkeys(r["part"] for r in runs):
        sides: dict[str, Any] = {}
        for scope in SCOPES:
            ok = [r for r in runs if r["part"] == part and r["scope"] == scope and "error" not in r]
            if not ok:
                continue
            compiles = [r["compile_seconds"] for r in ok]
            rates = [r["samples_per_s"] for r in ok]
            bests = [r.get("best_window", r["samples_per_s"]) for r in ok]
            sides[scope] = {"runs": len(ok), "compile_seconds": statistics.median(compiles),
                            "compile_range": [min(compiles), max(compiles)], "compile_spread": _spread(compiles),
                            "samples_per_s": statistics.median(rates), "rate_range": [min(rates), max(rates)],
                            "rate_spread": _spread(rates), "best_window": statistics.median(bests),
                            "regions": ok[0].get("compile.regions", [])}
        entry: dict[str, Any] = {"scopes": sides}
        if len(sides) == 2:
            model, regions = sides["model"], sides["regions"]
            noise = max([0.02] + [s for s in (model["rate_spread"], regions["rate_spread"]) if s is not None])
            compile_noise = max([0.05] + [s for s in (model["compile_spread"], regions["compile_spread"])
                                          if s is not None])
            compile_ratio = regions["compile_seconds"] / model["compile_seconds"] if model["compile_seconds"] else None
            rate_ratio = regions["samples_per_s"] / model["samples_per_s"]
            faster_compile = compile_ratio is not None and compile_ratio < 1.0 - compile_noise
            equal_speed = rate_ratio >= 1.0 - noise
            entry.update({"compile_ratio": compile_ratio, "rate_ratio": rate_ratio, "noise": noise,
                          "compile_noise": compile_noise,
                          "keep_regions": faster_compile and equal_speed,
                          "why": (f"compile x{compile_ratio:.2f}" if compile_ratio is not None else "no compile")
                          + f" (noise {compile_noise:.0%}), rate x{rate_ratio:.3f} (noise {noise:.1%}): "
                          + ("shorter compile at equal speed" if faster_compile and equal_speed else
                             "the compile is not shorter" if not faster_compile else
                             "slower than the whole model beyond the noise")})
        out[part] = entry
    return out


def _markdown(result: dict[str, Any]) -> str:
    lines = [f"# Regional compilation A/B ({result['kind']})", "",
             f"`{result['command']}`, {result['date']}, {result['device']}, torch {result['torch']}.", "",
             "| model | scope | runs | compile s (median) | compile range | samples/s (median) | rate range | "
             "best window (median) | blocks compiled |", "|---|---|---|---|---|---|---|---|---|"]
    for part, entry in result["summary"].items():
        for scope, side in entry["scopes"].items():
            lo, hi = side["compile_range"]
            rlo, rhi = side["rate_range"]
            lines.append(f"| {part} | {scope} | {side['runs']} | {side['compile_seconds']:.1f} | {lo:.1f}-{hi:.1f} | "
                         f"{side['samples_per_s']:,.1f} | {rlo:,.1f}-{rhi:,.1f} | {side['best_window']:,.1f} | "
                         f"{'; '.join(side['regions']) or 'whole model'} |")
    lines += ["", "| model | compile regions/model | rate regions/model | noise | keep regions |",
              "|---|---|---|---|---|"]
    for part, entry in result["summary"].items():
        if "rate_ratio" in entry:
            ratio = f"{entry['compile_ratio']:.2f}" if entry["compile_ratio"] is not None else "-"
            lines.append(f"| {part} | {ratio} | {entry['rate_ratio']:.3f} | {entry['noise']:.1%} | "
                         f"{'yes' if entry['keep_regions'] else 'no'}: {entry['why']} |")
    errors = [r for r in result["runs"] if "error" in r]
    if errors or result["skipped"]:
        lines += ["", "Not measured:"]
        lines += [f"- {r['part']} {r['scope']}: {r['error']}" for r in errors]
        lines += [f"- {s}" for s in result["skipped"]]
    lines += ["", f"Total {result['seconds']:.0f} s; each measurement in a fresh process with an empty Inductor cache."]
    return "\n".join(lines) + "\n"


def _device() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for regional-<kind>.json and .md ('-' with --one)")
    parser.add_argument("--deadline", type=float, default=280.0, help="seconds for the whole run")
    parser.add_argument("--runs", type=int, default=3, help="rounds of the A/B (the deadline may cut them)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--cpu", action="store_true", help="small shapes on the CPU")
    group.add_argument("--tiny", action="store_true", help="check the runner: tiny shapes, Dynamo without Inductor")
    parser.add_argument("--one", nargs=2, metavar=("PART", "SCOPE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    kind = "tiny" if args.tiny else "cpu" if args.cpu else "gpu"
    parts = {p.name: p for p in PARTS[kind]}
    if args.one:
        print(json.dumps(measure_one(parts[args.one[0]], args.one[1], tiny=args.tiny)), flush=True)
        return 0
    import torch

    started = time.perf_counter()
    runs_wanted = 1 if args.tiny else args.runs
    args.out.mkdir(parents=True, exist_ok=True)
    name = "regional-h200" if kind == "gpu" else f"regional-{kind}"
    result: dict[str, Any] = {
        "kind": kind, "command": "python -m benchmarks.runners.regional_compile " + " ".join(argv or sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "device": _device(),
        "torch": torch.__version__, "parts": {p.name: p.__dict__ for p in parts.values()}, "runs": [], "skipped": []}
    pair_seconds: dict[str, float] = {}  # each part's first round, both scopes: what a later round needs
    with tempfile.TemporaryDirectory(prefix="regional-cache-") as caches:
        for round_ in range(1, runs_wanted + 1):
            for part in parts.values():
                left = args.deadline - (time.perf_counter() - started)
                if round_ > 1 and left < 1.1 * pair_seconds.get(part.name, 0.0):
                    result["skipped"].append(f"round {round_} {part.name}: {left:.0f}s left, its pair took "
                                             f"{pair_seconds[part.name]:.0f}s")
                    continue
                order = SCOPES if round_ % 2 else SCOPES[::-1]  # alternate which scope goes first
                for scope in order:
                    left = args.deadline - (time.perf_counter() - started)
                    cache = Path(caches) / f"{part.name}-{scope}-{round_}"
                    run = _child(part, scope, kind, cache, left)
                    run["round"] = round_
                    result["runs"].append(run)
                    if round_ == 1:
                        pair_seconds[part.name] = pair_seconds.get(part.name, 0.0) + run["wall_seconds"]
                    print(json.dumps(run), flush=True)
                result["summary"] = summarize(result["runs"])
                result["seconds"] = time.perf_counter() - started
                (args.out / f"{name}.json").write_text(json.dumps(result, indent=1))
                (args.out / f"{name}.md").write_text(_markdown(result))
    print(_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
