"""Float8 training (``precision: fp8``) on one GPU: where it wins, where it must not be tried, and 10x.

    python -m benchmarks.runners.fp8_h200 OUT_DIR [--deadline 450] [--no-graphs] [--tiny] [--dry]

Three parts, each written to ``OUT_DIR/fp8-h200.md`` and ``OUT_DIR/fp8-h200.json`` as soon as it ends:

1. **The GPT-style example** (``examples/gpt_lm.py``, the shape of ``benchmarks/workloads/gpt.py``: 6 layers,
   d_model 512, 512 tokens, vocabulary 32,000) tuned from its fp32 explicit-attention baseline over the
   settings of its 9.65x pick (``benchmarks/results/lm-h200.md``: bs64, compile default, CUDA Graphs, flash
   attention, fused AdamW) with ``precision: [bf16, fp8]``. The race of the finalists runs both against the
   baseline in the same rounds: fp8 against bf16 is the per-round ratio, at their accuracy verdicts, with
   the layers fp8 converted and those it kept in bf16.
2. **10x.** The study's pick against the same baseline, with its spread: whether the example reaches 10x.
3. **Linear layers too small** (``benchmarks/workloads/gpt.py:train_narrow``, d_model 256: every linear
   layer below the size check). A study over ``precision: [bf16, fp8]``: the reference run's linear shapes
   remove fp8 with its reason, so no fp8 trial runs. Then, once, every layer forced to float8
   (``train_narrow_all_float8``, no size check) against the study's bf16 trial: whether the prediction
   holds.

The studies run through ``autotune.run`` (the probe's capabilities are shared), each under a budget that
fits ``--deadline`` seconds for the whole run, cold compiles included. ``--tiny`` runs the tiny shapes with
no compile and no graphs (a CPU check of the runner: fp8 is then removed for want of a GPU); ``--dry``
writes the spaces and the plan and runs nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import yaml

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = "examples/gpt_lm.py:train"  # from the repository's root, where ``python -m`` runs this
NARROW = "benchmarks.workloads.gpt:train_narrow"
NARROW_ALL_FLOAT8 = "benchmarks.workloads.gpt:train_narrow_all_float8"
TEN_X = 10.0
# Seconds of the deadline each part may plan with; the rest is the probe, the forced float8 run and writing.
SHARES = {"gpt": 0.62, "narrow": 0.2}


def gpt_space(*, graphs: bool, compile_mode: str) -> dict[str, Any]:
    """The example's space narrowed to its 9.65x pick, with bf16 and fp8 (the baseline is the space's own)."""
    return {
        "description": "examples/gpt_lm.py at its 9.65x pick (lm-h200.md), bf16 against fp8",
        "knobs": {"precision": ["bf16", "fp8"], "batch_size": [64], "compile": [compile_mode],
                  "cuda_graphs": [graphs], "attention": ["flash"], "optimizer_impl": ["fused"]},
        "batch_policy": "fixed", "global_batch": 64,
        "baseline": {"precision": "fp32", "batch_size": 64, "attention": "explicit"},
        "budget": {"samples": 2048, "warmup_steps": 4, "windows": 3},
    }


def narrow_space(*, compile_mode: str) -> dict[str, Any]:
    return {
        "description": "benchmarks/workloads/gpt.py:train_narrow (every linear layer below fp8's size check)",
        "knobs": {"precision": ["bf16", "fp8"], "batch_size": [64], "compile": [compile_mode]},
        "batch_policy": "fixed", "global_batch": 64,
        "baseline": {"precision": "fp32", "batch_size": 64},
        "budget": {"samples": 2048, "warmup_steps": 4, "windows": 3},
    }


def _trials(study: Any) -> list[dict[str, Any]]:
    out = []
    for t in study.trials:
        a = t.user_attrs
        out.append({"number": t.number, "state": t.state.name, "role": a.get("role", ""), "status": a.get("status"),
                    "config": a.get("config"), "throughput": a.get("throughput"),
                    "windows": a.get("window_throughputs"), "verdict": a.get("accuracy_verdict"),
                    "error": a.get("error") or a.get("pruned_reason"), "converted": a.get("extra:fp8.converted"),
                    "skipped": a.get("extra:fp8.skipped"), "compile_seconds": a.get("compile_seconds")})
    return out


def run_study(name: str, target: str, space: Path, out: Path, *, minutes: float, trials: int, top_k: int,
              caps: Any) -> dict[str, Any]:
    """One study through ``autotune.run``, and what the report reads of it."""
    import optuna

    import autotune

    began = time.monotonic()
    error = None
    try:
        autotune.run(target, space=str(space), study_name=name, studies_dir=out / "studies", n_trials=trials,
                     top_k=top_k, confirm_rounds=2, budget_minutes=minutes, prune_below=None, progress=False,
                     plots=False, capabilities=caps)
    except Exception as exc:  # the report says what failed; the next part still runs
        error = f"{type(exc).__name__}: {exc}".splitlines()[0]
    record: dict[str, Any] = {"study": name, "target": target, "seconds": round(time.monotonic() - began, 1),
                              "error": error, "minutes": round(minutes, 2)}
    try:
        study = optuna.load_study(study_name=name, storage=f"sqlite:///{out / 'studies' / 'autotune.db'}")
    except KeyError:
        return record
    attrs = study.user_attrs
    best = out / "studies" / name / "best_config.json"
    record.update({
        "removed": attrs.get("removed_knobs") or {},
        "baseline_throughput": attrs.get("baseline_throughput"),
        "linear_layers": ((attrs.get("reference_measurement") or {}).get("extras") or {}).get("linear_layers"),
        "trials": _trials(study),
        "race": attrs.get("top_k_confirmation"),
        "best": {k: v for k, v in json.loads(best.read_text()).items() if k != "target"} if best.exists() else None,
    })
    return record


def run_forced(out: Path, config: Any, budget: Any, timeout: float) -> dict[str, Any]:
    """``train_narrow_all_float8`` once, as an isolated trial."""
    from autotune.study._isolation import run_isolated
    from autotune.trial._execute import TrialSpec

    spec = TrialSpec(target=NARROW_ALL_FLOAT8, config=config, budget=budget, seed=0)
    outcome = run_isolated(spec, workdir=out / "logs" / "narrow-all-float8", timeout=timeout)
    m = outcome.measurement
    return {"status": outcome.status, "error": outcome.error, "throughput": m.throughput if m else None,
            "windows": list(m.window_throughputs) if m else None, "config": config.to_dict(),
            "wall_seconds": round(outcome.wall_seconds, 1)}


def _of(record: dict[str, Any], precision: str) -> Optional[dict[str, Any]]:
    """The study's completed trial of this precision (not the reference)."""
    return next((t for t in record.get("trials") or () if t["role"] != "reference" and t["config"]
                 and t["config"]["precision"] == precision and t["status"] == "ok"), None)


def _span(values: list[float]) -> str:
    return f"{min(values):.3f}x-{max(values):.3f}x" if values else "-"


def compare(record: dict[str, Any], a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """``a`` against ``b``: per-round ratios of the race where both ran in it, else their single runs (the
    slowest window of one against the fastest of the other, and the reverse)."""
    race = record.get("race") or {}
    rounds = [r[str(a["number"])] / r[str(b["number"])] for r in race.get("rounds") or ()
              if r.get(str(a["number"])) and r.get(str(b["number"]))]
    if rounds:
        return {"ratio": statistics.median(rounds), "low": min(rounds), "high": max(rounds),
                "basis": f"{len(rounds)} round(s) of the race"}
    wa, wb = a.get("windows") or [a["throughput"]], b.get("windows") or [b["throughput"]]
    return {"ratio": a["throughput"] / b["throughput"], "low": min(wa) / max(wb), "high": max(wa) / min(wb),
            "basis": "single runs (window range)"}


def ten_x(best: Optional[dict[str, Any]]) -> str:
    """Whether the pick reaches 10x its baseline, said either way."""
    if not best or not best.get("speedup"):
        return "not measured (the study found no feasible pick)"
    spread = best.get("speedup_spread") or {}
    low, high, speedup = spread.get("low"), spread.get("high"), best["speedup"]
    span = f"{speedup:.2f}x ({low:.2f}x-{high:.2f}x, {spread.get('what')})" if low and high else f"{speedup:.2f}x"
    if low and low >= TEN_X:
        return f"**yes**: {span}, the low end at or above 10x"
    if (high or speedup) < TEN_X:
        return f"**no**: {span}, below 10x"
    return f"**not settled**: {span}, 10x inside the spread"


def render(record: dict[str, Any]) -> str:
    """The markdown report of what has run so far."""
    caps = record.get("caps") or {}
    lines = ["# Float8 training (`precision: fp8`) and 10x on one GPU", "",
             f"Date {record.get('date')}; {caps.get('gpu_name') or 'CPU'} (compute capability "
             f"{caps.get('compute_capability') or '-'}); torch {caps.get('torch')}; torchao {record.get('torchao')}. "
             f"Command: `python -m benchmarks.runners.fp8_h200 OUT_DIR {' '.join(record.get('argv') or [])}`.", ""]
    if caps.get("fp8_unavailable") or not caps.get("cuda"):
        lines += [f"fp8 cannot run here: {caps.get('fp8_unavailable') or 'no CUDA device'}.", ""]
    gpt = record.get("gpt")
    if gpt:
        lines += _gpt_section(gpt)
    narrow = record.get("narrow")
    if narrow:
        lines += _narrow_section(narrow, record.get("forced"))
    lines += [f"Whole run: {record.get('seconds', 0):.0f} s."]
    return "\n".join(lines) + "\n"


def _trial_rows(record: dict[str, Any]) -> list[str]:
    from autotune._config import TrialConfig

    rows = ["| # | config | status | seq/s | verdict | compile s |", "|---|---|---|---:|---|---:|"]
    for t in record.get("trials") or ():
        config = TrialConfig.from_dict(t["config"]).describe() if t["config"] else "-"
        rate = f"{t['throughput']:,.1f}" if t["throughput"] else "-"
        seconds = f"{t['compile_seconds']:.0f}" if t.get("compile_seconds") else "-"
        status = t["status"] + (f" ({t['error'][:90]})" if t.get("error") and t["status"] != "ok" else "")
        rows.append(f"| {t['number']} | {config}{' (reference)' if t['role'] == 'reference' else ''} | {status} | "
                    f"{rate} | {t['verdict'] or '-'} | {seconds} |")
    return rows


def _gpt_section(gpt: dict[str, Any]) -> list[str]:
    lines = ["## 1. The GPT-style example: fp8 against bf16", "",
             f"Study `{gpt['study']}` ({gpt['seconds']:.0f} s, budget {gpt['minutes']} min)"
             + (f"; it failed: {gpt['error']}" if gpt.get("error") else "") + ".", ""]
    lines += _trial_rows(gpt) + [""]
    removed = {k: v for k, v in (gpt.get("removed") or {}).items() if "fp8" in k}
    lines += [f"- Removed: `{k}`: {v}" for k, v in removed.items()]
    bf16, fp8 = _of(gpt, "bf16"), _of(gpt, "fp8")
    if bf16 and fp8:
        c = compare(gpt, fp8, bf16)
        equal = "equal" if fp8["verdict"] == bf16["verdict"] else "**different**"
        lines.append(f"- **fp8 / bf16: {c['ratio']:.3f}x** ({_span([c['low'], c['high']])}, {c['basis']}); verdicts "
                     f"{equal}: fp8 `{fp8['verdict']}`, bf16 `{bf16['verdict']}`.")
        skipped = "; ".join(f"{why}: {', '.join(names)}" for why, names in (fp8.get("skipped") or {}).items())
        lines.append(f"- Converted to float8 ({len(fp8.get('converted') or [])}): "
                     f"{', '.join(fp8.get('converted') or []) or 'none'}.")
        lines.append(f"- Kept in bf16: {skipped or 'none'}. The LM head (`ln_f(x) @ tok.weight.t()`) is no "
                     "`nn.Linear`: it stays bf16.")
    else:
        lines.append(f"- fp8 against bf16: not measured (bf16 {'ran' if bf16 else 'did not run'}, "
                     f"fp8 {'ran' if fp8 else 'did not run'}).")
    lines += ["", "## 2. 10x over the fp32 explicit-attention baseline", ""]
    best = gpt.get("best") or {}
    pick = best.get("config")
    if pick:
        from autotune._config import TrialConfig

        lines.append(f"Pick: `{TrialConfig.from_dict(pick).describe()}`, verdict {best.get('accuracy_verdict')}, "
                     f"against the baseline's {gpt.get('baseline_throughput') or 0:,.1f} seq/s.")
    lines += [f"Reaches 10x: {ten_x(best)}.", ""]
    return lines


def _narrow_section(narrow: dict[str, Any], forced: Optional[dict[str, Any]]) -> list[str]:
    lines = ["## 3. Linear layers too small: fp8 predicted slower, not tried", "",
             f"Study `{narrow['study']}` ({narrow['seconds']:.0f} s)"
             + (f"; it failed: {narrow['error']}" if narrow.get("error") else "") + f". The reference run's linear "
             f"layers (`[in, out, count]`): {narrow.get('linear_layers')}.", ""]
    lines += _trial_rows(narrow) + [""]
    why = (narrow.get("removed") or {}).get("precision=fp8")
    tried = [t for t in narrow.get("trials") or () if t["config"] and t["config"]["precision"] == "fp8"]
    lines.append(f"- `precision=fp8` removed: {why or '**no**'}; fp8 trials run: {len(tried)}.")
    bf16 = _of(narrow, "bf16")
    if forced and forced.get("throughput") and bf16:
        c = compare({}, {**forced, "number": -1}, bf16)
        held = "holds" if c["high"] < 1 else ("does not hold" if c["low"] > 1 else "is inside the spread")
        lines.append(f"- Every layer forced to float8 (no size check, tried once): {forced['throughput']:,.1f} seq/s, "
                     f"**{c['ratio']:.3f}x bf16** ({_span([c['low'], c['high']])}, {c['basis']}): the prediction "
                     f"{held}.")
    elif forced:
        lines.append(f"- Every layer forced to float8: {forced.get('status')} ({forced.get('error') or 'no rate'}).")
    return lines + [""]


def _write(out: Path, record: dict[str, Any]) -> None:
    (out / "fp8-h200.json").write_text(json.dumps(record, indent=1, default=str))
    (out / "fp8-h200.md").write_text(render(record))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--deadline", type=float, default=450.0, help="seconds for the whole run")
    parser.add_argument("--no-graphs", action="store_true", help="the GPT configs without CUDA Graphs")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, no compile, no graphs (a CPU check)")
    parser.add_argument("--dry", action="store_true", help="write the spaces and the plan; run nothing")
    args = parser.parse_args(argv)
    started = time.monotonic()
    out = args.out.resolve()
    (out / "spaces").mkdir(parents=True, exist_ok=True)
    if args.tiny:
        os.environ.update(AUTOTUNE_BENCH_SIZE="tiny", GPT_LM_SIZE="tiny")  # the trial processes inherit them
    compile_mode = "off" if args.tiny else "default"
    spaces = {"gpt": out / "spaces" / "gpt_fp8.yaml", "narrow": out / "spaces" / "narrow_fp8.yaml"}
    spaces["gpt"].write_text(yaml.safe_dump(gpt_space(graphs=not (args.no_graphs or args.tiny),
                                                      compile_mode=compile_mode), sort_keys=False))
    spaces["narrow"].write_text(yaml.safe_dump(narrow_space(compile_mode=compile_mode), sort_keys=False))
    from autotune.search._space import load_space

    loaded = {name: load_space(path) for name, path in spaces.items()}  # refused here, not minutes in
    minutes = {name: args.deadline * share / 60 for name, share in SHARES.items()}
    if args.dry:
        for name, space in loaded.items():
            print(f"{name}: {space.size} configs, baseline {space.baseline.describe()}, {minutes[name]:.1f} min")
        return 0
    from autotune._config import Budget, TrialConfig
    from autotune.hardware import probe
    from autotune.hardware._machine import installed_versions

    caps = probe()
    record: dict[str, Any] = {"date": datetime.date.today().isoformat(), "caps": caps.to_dict(),
                              "torchao": installed_versions(["torchao"]).get("torchao", "not installed"),
                              "argv": [a for a in (argv if argv is not None else sys.argv[1:]) if a != str(args.out)]}

    def left() -> float:
        return args.deadline - (time.monotonic() - started)

    def save() -> None:
        record["seconds"] = time.monotonic() - started
        _write(out, record)

    save()
    record["gpt"] = run_study("gpt", EXAMPLE, spaces["gpt"], out, minutes=min(minutes["gpt"], left() / 60 * 0.75),
                              trials=2, top_k=2, caps=caps)
    save()
    print(render(record), flush=True)
    record["narrow"] = run_study("narrow", NARROW, spaces["narrow"], out, trials=1, top_k=0, caps=caps,
                                 minutes=min(minutes["narrow"], max(0.5, left() / 60 * 0.6)))
    save()
    if left() > 45:
        config = TrialConfig(precision="bf16", batch_size=64, compile=compile_mode, global_batch=64)
        budget = Budget(samples=2048, warmup_steps=4, windows=3)
        record["forced"] = run_forced(out, config, budget, timeout=left() - 10)
    else:
        record["forced"] = {"status": "skipped", "error": f"{left():.0f} s left of the deadline"}
    save()
    print(render(record), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
