"""The GPT-style LM example on one GPU: which kernels the new knobs ran, a hand grid, and a tuner study.

    python -m benchmarks.runners.lm_h200 --out benchmarks/results/lm-h200.md --workdir /scratch/lm-h200

1. **Kernels.** For every value of ``attention`` one training step of ``examples/gpt_lm.py`` runs under
   torch.profiler; the SDPA op that dispatched (``aten::_scaled_dot_product_flash_attention``,
   ``..._efficient_attention``, ``..._cudnn_attention``, ``..._attention_math``, none for ``explicit``) must
   be the one the value names, and the attention kernels seen on the GPU are listed beside it. The same for
   ``optimizer_impl`` (fused / foreach ops), ``activation_checkpointing`` (the block's forward runs twice),
   and, on CUDA, a captured step with clipping, an LR schedule and accumulation replayed under
   ``torch.cuda.set_sync_debug_mode("error")`` (no host synchronisation), and checkpointing inside a graph.
2. **Hand grid.** A few configs measured in this process (no isolation) with the space's budget, from the
   fp32, explicit-attention baseline; ``--grid long`` measures the ``max-autotune*`` compile modes (minutes of
   compile each) and a doubled global batch beside the default mode instead.
3. **Tuner study.** ``autotune tune examples/gpt_lm.py:train`` on the space, with a wall-clock limit so
   that the whole run ends within ``--deadline`` seconds (the top-K confirmation runs after it).

Writes the markdown to ``--out`` and the raw numbers beside it (``.json``); exits 1 when a kernel check
failed. ``--tiny`` runs the tiny model on whatever device there is (the tests run it on a CPU).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "gpt_lm.py"
SPACE = REPO / "search_spaces" / "example_gpt_lm.yaml"

# The aten op each SDPA backend dispatches to (CUDA name; the CPU flash kernel adds "_for_cpu").
SDPA_OPS = {
    "flash": ("_scaled_dot_product_flash_attention",),
    "efficient": ("_scaled_dot_product_efficient_attention", "_efficient_attention_forward"),
    "cudnn": ("_scaled_dot_product_cudnn_attention",),
    "math": ("_scaled_dot_product_attention_math",),
}
# Substrings of GPU kernel names that belong to an attention implementation (evidence, not the assertion).
KERNEL_HINTS = ("flash", "fmha", "efficient", "cudnn", "sdpa", "attention", "softmax")


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("gpt_lm_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def backend_of(ops: set[str]) -> str:
    """Which attention ran, from the aten ops a step dispatched: an SDPA backend, or explicit."""
    ran = [name for name, needles in SDPA_OPS.items() if any(n in op for op in ops for n in needles)]
    if ran:
        return "+".join(ran)
    return "sdpa (unknown backend)" if any("scaled_dot_product" in op for op in ops) else "explicit"


def _profile(fn: Callable[[], Any], device: Any) -> tuple[set[str], set[str]]:
    """(aten op names, GPU kernel names) of one call."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    ops, kernels = set(), set()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.add(event.name)
        else:
            ops.add(event.name)
    return ops, kernels


def _step_setup(gpt: Any, config: Any, device: Any, **step_kwargs: Any) -> tuple[Any, Any, Callable[[], Any]]:
    """A context, the example's model and a callable that trains it one step on a fixed batch."""
    import torch
    from autotune.trial._context import TrialContext

    ctx = TrialContext(config=config, device=device)
    model = ctx.model(gpt.GPT(gpt.shape(), attention=ctx.attention, wrap=ctx.checkpoint))
    optimizer = ctx.optimizer(torch.optim.AdamW, model.parameters(), lr=gpt.shape().lr)
    step = ctx.train_step(model, optimizer, **step_kwargs)
    pool = gpt.streams(config.batch_size, gpt.shape(), seed=0, device=device)
    batch = next(iter(gpt.Sequences(pool, config.batch_size)))
    return ctx, model, lambda: step(batch)


def _line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160].replace("|", "/")


def _profiled_step(gpt: Any, config: Any, device: Any) -> tuple[set[str], set[str]]:
    """One warm-up step, then the ops and kernels of the next one."""
    from autotune.trial._knobs import applied

    with applied(config, device):
        _, _, one = _step_setup(gpt, config, device)
        one()
        return _profile(one, device)


def kernel_checks(gpt: Any, caps: Any, device: Any) -> list[dict[str, Any]]:
    """Part 1: one row per check, with ``ok`` False where the knob did not do what it says."""
    import torch
    from autotune._config import ATTENTION_BACKENDS, TrialConfig
    from autotune.trial._knobs import applied

    half = "bf16" if device.type == "cuda" else "fp32"  # flash and cuDNN take half precision on CUDA
    rows: list[dict[str, Any]] = []
    for value in ATTENTION_BACKENDS:
        config = TrialConfig(precision=half, batch_size=8, attention=value)
        row: dict[str, Any] = {"check": f"attention={value}", "config": config.describe()}
        if value in caps.attention_unavailable:
            rows.append({**row, "ok": True, "ran": "removed by the probe", "evidence": caps.attention_unavailable[value]})
            continue
        try:
            ops, kernels = _profiled_step(gpt, config, device)
        except Exception as exc:  # a kernel that fails past the probe is a finding: report it and go on
            rows.append({**row, "ok": False, "ran": type(exc).__name__, "evidence": _line(exc)})
            continue
        ran = backend_of(ops)
        ok = ran == value or value == "auto"
        attention_kernels = sorted(k for k in kernels if any(h in k.lower() for h in KERNEL_HINTS))
        rows.append({**row, "ok": ok, "ran": ran,
                     "evidence": "; ".join(k[:80] for k in attention_kernels[:3]) or "(no GPU kernels)"})
    for impl, needle in (("foreach", "aten::_foreach_"), ("fused", "aten::_fused_adamw_")):
        config = TrialConfig(precision=half, batch_size=8, optimizer_impl=impl)
        if impl in caps.optimizer_impl_unavailable:
            rows.append({"check": f"optimizer_impl={impl}", "config": config.describe(), "ok": True,
                         "ran": "removed by the probe", "evidence": caps.optimizer_impl_unavailable[impl]})
            continue
        try:
            ops, _ = _profiled_step(gpt, config, device)
        except Exception as exc:
            rows.append({"check": f"optimizer_impl={impl}", "config": config.describe(), "ok": False,
                         "ran": type(exc).__name__, "evidence": _line(exc)})
            continue
        found = sorted(op for op in ops if op.startswith(needle))
        rows.append({"check": f"optimizer_impl={impl}", "config": config.describe(), "ok": bool(found),
                     "ran": ", ".join(found[:3]) or "not seen", "evidence": ""})
    config = TrialConfig(precision=half, batch_size=8, activation_checkpointing=True)
    calls: list[int] = []
    with applied(config, device):
        _, model, one = _step_setup(gpt, config, device)
        model.blocks[0].qkv.register_forward_hook(lambda *_: calls.append(1))
        one()
    rows.append({"check": "activation_checkpointing=true", "config": config.describe(), "ok": len(calls) == 2,
                 "ran": f"block forward ran {len(calls)}x per step", "evidence": type(model.blocks[0]).__name__})
    if device.type == "cuda":
        rows.append(_graph_check(gpt, device, TrialConfig(precision="bf16", batch_size=4, global_batch=8,
                                                          cuda_graphs=True, attention="flash")))
        rows.append(_graph_check(gpt, device, TrialConfig(precision="bf16", batch_size=8, cuda_graphs=True,
                                                          activation_checkpointing=True)))
        rows.append(_graph_check(gpt, device, TrialConfig(precision="fp16", batch_size=8, cuda_graphs=True)))
    return rows


def _graph_check(gpt: Any, device: Any, config: Any) -> dict[str, Any]:
    """A captured step with clipping and a schedule: replays with no host sync, and the LR follows the schedule."""
    import torch
    from autotune.trial._context import TrialContext
    from autotune.trial._knobs import applied

    row: dict[str, Any] = {"check": "graphs + clip_grad_norm + scheduler", "config": config.describe()}
    try:
        with applied(config, device):
            ctx = TrialContext(config=config, device=device)
            model = ctx.model(gpt.GPT(gpt.shape(), attention=ctx.attention, wrap=ctx.checkpoint))
            optimizer = ctx.optimizer(torch.optim.AdamW, model.parameters(), lr=1e-3)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.9 ** s)
            step = ctx.train_step(model, optimizer, clip_grad_norm=1.0, scheduler=scheduler)
            pool = gpt.streams(config.batch_size * 2, gpt.shape(), seed=0, device=device)
            batches = list(gpt.Sequences(pool, config.batch_size))
            calls = 0
            while step.graph is None or calls < 2 * (config.accumulation_steps + 6):
                step(batches[calls % len(batches)])
                calls += 1
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                for i in range(4 * config.accumulation_steps):
                    step(batches[i % len(batches)])
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
            lr = float(optimizer.param_groups[0]["lr"])
            want = 1e-3 * 0.9 ** step.optimizer_steps
            ok = step.graph_replays > 0 and abs(lr - want) < 1e-9 + 1e-6 * want and bool(torch.isfinite(step.last_loss))
            return {**row, "ok": ok, "ran": f"{step.graph_replays} replays, no sync in {4 * config.accumulation_steps}",
                    "evidence": f"lr {lr:.3g} (scheduled {want:.3g}), grad norm {float(step.grad_norm):.3g}"}
    except Exception as exc:  # a failure is the finding: report it, do not stop the run
        return {**row, "ok": False, "ran": type(exc).__name__, "evidence": _line(exc)}


GRID = [  # the hand grid, from the baseline; a config the machine cannot run is skipped with the reason
    {"precision": "fp32", "attention": "explicit"},
    {"precision": "fp32", "attention": "auto"},
    {"precision": "tf32", "attention": "auto"},
    {"precision": "bf16", "attention": "explicit"},
    {"precision": "bf16", "attention": "auto"},
    {"precision": "bf16", "attention": "flash"},
    {"precision": "bf16", "attention": "cudnn"},
    {"precision": "bf16", "attention": "flash", "cuda_graphs": True, "optimizer_impl": "fused"},
    {"precision": "bf16", "attention": "auto", "compile": "default"},
    {"precision": "bf16", "attention": "auto", "compile": "default", "cuda_graphs": True, "optimizer_impl": "fused"},
    {"precision": "bf16", "attention": "flash", "compile": "default", "cuda_graphs": True, "optimizer_impl": "fused",
     "batch_size": 32},
]
LONG_GRID = [  # the expensive compile modes, which only a declared long training pays for, beside the default
    {"precision": "fp32", "attention": "explicit"},
    {"precision": "bf16", "attention": "auto", "compile": "default", "cuda_graphs": True, "optimizer_impl": "fused"},
    # a data point outside the space: twice the global batch (a different optimisation, so not a candidate)
    {"precision": "bf16", "attention": "auto", "compile": "default", "cuda_graphs": True, "optimizer_impl": "fused",
     "batch_size": 128, "global_batch": 128, "batch_policy": "scale"},
    {"precision": "bf16", "attention": "auto", "compile": "max-autotune-no-cudagraphs", "cuda_graphs": True,
     "optimizer_impl": "fused"},
    {"precision": "bf16", "attention": "auto", "compile": "max-autotune", "optimizer_impl": "fused"},
]
TINY_GRID = [  # a CPU: no graphs, fp32 (bf16 has no fast CPU kernels here), no compile (minutes on few cores)
    {"precision": "fp32", "attention": "explicit"},
    {"precision": "fp32", "attention": "auto"},
    {"precision": "fp32", "attention": "flash", "optimizer_impl": "fused", "activation_checkpointing": True,
     "batch_size": 16},
]


def grid(gpt: Any, space: Any, caps: Any, device: Any, cells: list[dict[str, Any]],
         context: Optional[Callable[..., Any]] = None) -> list[dict[str, Any]]:
    """Part 2: each cell measured in this process with the space's budget (``context`` builds each cell's
    trial context; by default a ``TrialContext``)."""
    import torch
    from autotune.trial._context import TrialContext
    from autotune.trial._knobs import applied

    rows = []
    for cell in cells:
        config = space.baseline.replace(**cell)
        skip = _cannot_run(config, caps)
        if skip:
            rows.append({"config": config.describe(), "status": f"skipped: {skip}"})
            continue
        torch._dynamo.reset()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        ctx = (context or TrialContext)(config=config, budget=space.budget, device=device)
        cell_started = time.perf_counter()
        try:
            with applied(config, device):
                gpt.train(ctx)
            m = ctx.measurement()
        except Exception as exc:  # an out-of-memory or kernel failure is a grid result
            rows.append({"config": config.describe(), "status": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"})
            continue
        rows.append({"config": config.describe(), "status": "ok", "throughput": m.throughput,
                     "tokens_per_s": m.throughput * gpt.shape().seq, "peak_memory_gib": m.peak_memory_gib,
                     "spread": m.spread, "final_loss": m.losses[-1] if m.losses else None, "metric": m.metric})
        print(f"grid: {config.describe()}: {m.throughput:,.1f} seq/s (spread {m.spread:.1%}; cell "
              f"{time.perf_counter() - cell_started:.0f} s, compile included)", flush=True)
    return rows


def _cannot_run(config: Any, caps: Any) -> str:
    if not caps.cuda and (config.cuda_graphs or config.precision in ("tf32", "fp16")):
        return "needs CUDA"
    if config.attention in caps.attention_unavailable:
        return caps.attention_unavailable[config.attention]
    if config.optimizer_impl in caps.optimizer_impl_unavailable:
        return caps.optimizer_impl_unavailable[config.optimizer_impl]
    if config.compile != "off" and not caps.compile:
        return caps.compile_reason
    return ""


def study(args: argparse.Namespace, work: Path, timeout: float, env: dict[str, str]) -> dict[str, Any]:
    """Part 3: ``autotune tune`` on the example, then what it found."""
    import optuna

    studies = work / "studies"
    command = [sys.executable, "-m", "autotune", "tune", f"{EXAMPLE}:train", "--space", str(args.space),
               "--study", "lm", "--trials", str(args.trials), "--timeout", str(int(timeout)), "--top-k",
               str(args.top_k), "--trial-timeout", str(args.trial_timeout), "--studies-dir", str(studies),
               "--no-progress"]
    if args.train_minutes is not None:
        command += ["--train-minutes", f"{args.train_minutes:g}"]
    started = time.monotonic()
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    seconds = time.monotonic() - started
    (work / "tune.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1], "seconds": seconds}
    best = json.loads((studies / "lm" / "best_config.json").read_text())
    loaded = optuna.load_study(study_name="lm", storage=f"sqlite:///{studies}/autotune.db")
    trials = []
    for t in loaded.trials:
        a = t.user_attrs
        trials.append({"number": t.number, "state": t.state.name, "status": a.get("status"),
                       "config": a.get("config"), "throughput": a.get("throughput"),
                       "verdict": a.get("accuracy_verdict"), "role": a.get("role", "")})
    return {"best": best, "trials": trials, "seconds": seconds, "command": _shown(command[1:], work),
            "summary": proc.stdout.strip().splitlines()[-12:]}


def _shown(command: list[str], work: Path) -> str:
    """The command as the report prints it: paths relative to the repository and to ``--workdir``."""
    def short(arg: str) -> str:
        path, sep, rest = arg.partition(":")  # a target is PATH:FUNC; any other argument has no ":"
        if not path.startswith("/"):
            return arg
        for root, label in ((work, "WORKDIR/"), (REPO, "")):
            try:
                return label + str(Path(path).relative_to(root)) + sep + rest
            except ValueError:
                continue
        return arg
    return " ".join(short(a) for a in command)


def _describe(config: Optional[dict[str, Any]]) -> str:
    from autotune._config import TrialConfig

    return TrialConfig.from_dict(config).describe() if config else "-"


def report(caps: Any, space: Any, seq: int, checks: list, cells: list, found: dict, seconds: float) -> str:
    lines = [
        "# GPT-style LM example: kernels, hand grid and tuner study",
        "",
        f"Date: {datetime.date.today()}; device: {caps.device_label} (driver {caps.driver or '-'}); torch {caps.torch}, "
        f"CUDA {caps.cuda_version or '-'}. `examples/gpt_lm.py` ({os.environ.get('GPT_LM_SIZE', 'small')}, "
        f"{seq} tokens per sequence), space `{space.name}`: global batch {space.global_batch}, "
        f"{space.budget.samples} sequences = {space.budget.samples * seq:,} tokens per trial. "
        f"Whole run: {seconds:.0f} s.",
        "",
        "## 1. Which kernel each knob ran",
        "",
        "| check | config | ran | as asked | evidence (GPU kernels, reasons) |",
        "|---|---|---|---|---|",
    ]
    for r in checks:
        lines.append(f"| {r['check']} | {r['config']} | {r['ran']} | {'yes' if r['ok'] else '**NO**'} | "
                     f"{str(r['evidence']).replace('|', '/')} |")
    base = next((c.get("throughput") for c in cells if c.get("status") == "ok"), None)
    lines += ["", "## 2. Hand grid (in one process, the space's budget)", "",
              "| config | seq/s | tokens/s | x first row | peak GiB | window spread | final loss | metric |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for c in cells:
        if c.get("status") != "ok":
            lines.append(f"| {c['config']} | {c['status']} | | | | | | |")
            continue
        ratio = f"{c['throughput'] / base:.2f}x" if base else "-"
        loss = f"{c['final_loss']:.3f}" if c.get("final_loss") is not None else "-"
        metric = f"{c['metric']:.4f}" if c.get("metric") is not None else "-"
        lines.append(f"| {c['config']} | {c['throughput']:,.1f} | {c['tokens_per_s']:,.0f} | {ratio} | "
                     f"{c['peak_memory_gib']:.2f} | {c['spread'] * 100:.1f}% | {loss} | {metric} |")
    grid_best = max((c for c in cells if c.get("status") == "ok"), key=lambda c: c["throughput"], default=None)
    lines += ["", "## 3. Tuner study", ""]
    if "error" in found:
        lines.append(f"The study failed: {found['error']}")
        return "\n".join(lines) + "\n"
    best = found["best"]
    speedup = best.get("speedup")
    lines += [
        f"`autotune {found['command'].split(' ', 2)[-1]}` ({found['seconds']:.0f} s)",
        "",
        f"- Baseline: {_describe((best.get('baseline') or {}).get('config'))}, "
        f"{(best.get('baseline') or {}).get('throughput') or 0:,.1f} seq/s.",
        f"- Best: {_describe(best.get('config'))}, {best.get('throughput') or 0:,.1f} seq/s "
        f"({(best.get('throughput') or 0) * seq:,.0f} tokens/s); verdict: {best.get('verdict')}; "
        f"accuracy verdict: {best.get('accuracy_verdict')}.",
        f"- Speed-up {speedup:.2f}x ({(best.get('speedup_spread') or {}).get('what', '')}); "
        f"at least 10x: {'yes' if speedup and speedup >= 10 else 'no'}."
        if isinstance(speedup, (int, float)) else "- No speed-up measured.",
    ]
    if grid_best is not None:
        lines.append(f"- Grid best beside it: {grid_best['config']}, {grid_best['throughput']:,.1f} seq/s "
                     f"({grid_best['throughput'] / base:.2f}x the grid's first row).")
    lines += ["", "| trial | state | status | config | seq/s | accuracy verdict |", "|---:|---|---|---|---:|---|"]
    for t in found["trials"]:
        rate = f"{t['throughput']:,.1f}" if isinstance(t.get("throughput"), (int, float)) else "-"
        role = f" ({t['role']})" if t.get("role") else ""
        lines.append(f"| {t['number']} | {t['state']}{role} | {t['status']} | {_describe(t['config'])} | {rate} | "
                     f"{t.get('verdict') or '-'} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="markdown file to write")
    parser.add_argument("--workdir", type=Path, required=True, help="study storage and logs")
    parser.add_argument("--space", type=Path, default=SPACE)
    parser.add_argument("--tiny", action="store_true", help="the tiny model (a CPU test)")
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--trial-timeout", type=int, default=150)
    parser.add_argument("--deadline", type=float, default=420.0, help="seconds for the whole run")
    parser.add_argument("--confirm-reserve", type=float, default=120.0,
                        help="seconds kept for the top-K confirmation after the study's trials")
    parser.add_argument("--grid", choices=("default", "long"), default="default",
                        help="the hand grid: the usual cells, or the expensive compile modes beside the default one")
    parser.add_argument("--train-minutes", type=float, default=None,
                        help="the training length declared to the study (lets max-autotune compiles pay off)")
    parser.add_argument("--skip", choices=("kernels", "grid", "study"), action="append", default=[])
    args = parser.parse_args(argv)
    started = time.monotonic()
    if args.tiny:
        os.environ["GPT_LM_SIZE"] = "tiny"
    import torch
    from autotune.hardware import probe
    from autotune.search._space import load_space, restrict_to

    caps = probe()
    space = restrict_to(load_space(args.space), caps)
    device = torch.device("cuda" if caps.cuda else "cpu")
    gpt = _example()
    seq = gpt.shape().seq
    checks = kernel_checks(gpt, caps, device) if "kernels" not in args.skip else []
    cells = TINY_GRID if args.tiny else {"default": GRID, "long": LONG_GRID}[args.grid]
    cells = grid(gpt, space, caps, device, cells) if "grid" not in args.skip else []
    args.workdir.mkdir(parents=True, exist_ok=True)
    found: dict[str, Any] = {"error": "skipped"}
    if "study" not in args.skip:
        timeout = max(30.0, args.deadline - (time.monotonic() - started) - args.confirm_reserve)
        found = study(args, args.workdir, timeout, dict(os.environ))
    text = report(caps, space, seq, checks, cells, found, time.monotonic() - started)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps({"checks": checks, "grid": cells, "study": found},
                                                        indent=2, default=str))
    print(text)
    failed = [r["check"] for r in checks if not r["ok"]]
    if failed:
        print(f"kernel checks failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
