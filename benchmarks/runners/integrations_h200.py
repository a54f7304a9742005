"""The trainer adapters on one GPU: the Hugging Face and Lightning examples, each tuned from its own arguments.

    python -m benchmarks.runners.integrations_h200 --out benchmarks/results/integrations-h200.md --workdir /scratch/int

For each adapter the runner tunes the example as its ``__main__`` does (``tune(train, args=ARGS)`` for
``examples/hf_trainer.py``, ``tune(train, trainer=TRAINER, loader=...)`` for ``examples/lightning_cnn.py``),
with a trial count and a wall-clock limit that fit ``--deadline``, and records the baseline (the example's
untuned arguments), the pick, the speed-up with its spread, every trial's verdict, and the arguments to paste.

Writes the markdown to ``--out`` and the raw numbers beside it (``.json``). ``--tiny`` runs both examples at
their CPU sizes with two trials each (the tests run it on a CPU).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = {"transformers": REPO / "examples" / "hf_trainer.py", "lightning": REPO / "examples" / "lightning_cnn.py"}


def _example(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def tune_example(adapter: str, *, work: Path, trials: int, timeout: float, top_k: int, confirm_rounds: int,
                 trial_timeout: float) -> dict[str, Any]:
    """Tune one example from its own arguments; what the study found, as plain data."""
    import optuna

    module = _example(EXAMPLES[adapter])
    options = {"n_trials": trials, "timeout": timeout, "study_name": adapter, "studies_dir": str(work / "studies"),
               "top_k": top_k, "confirm_rounds": confirm_rounds, "trial_timeout": trial_timeout, "plots": False, "progress": False}
    started = time.monotonic()
    try:
        if adapter == "transformers":
            result = module.tuned.tune(f"{EXAMPLES[adapter]}:train", args=module.ARGS, **options)
            paste = (json.dumps(module.tuned.training_arguments(result.best_config, module.ARGS), indent=1)
                     if result.best_config is not None else "-")
        else:
            result = module.tuned.tune(f"{EXAMPLES[adapter]}:train", trainer=module.TRAINER,
                                       loader=module.Images().train_dataloader(), **options)
            paste = module.tuned.trainer_arguments(result.best_config).code() if result.best_config is not None else "-"
    except Exception as exc:  # a failed study is the finding: report it, do not stop the other adapter
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                "seconds": time.monotonic() - started}
    seconds = time.monotonic() - started
    loaded = optuna.load_study(study_name=adapter, storage=result.storage)
    rows = []
    for t in loaded.trials:
        a = t.user_attrs
        rows.append({"number": t.number, "state": t.state.name, "status": a.get("status"), "role": a.get("role", ""),
                     "config": a.get("config"), "throughput": a.get("throughput"),
                     "verdict": a.get("accuracy_verdict"), "error": a.get("error")})
    best = result.best
    return {"seconds": seconds, "baseline": result.baseline.describe(), "baseline_source": result.baseline_source,
            "baseline_throughput": result.baseline_throughput,
            "best": best.config.describe() if best is not None else None,
            "best_throughput": best.throughput if best is not None else None,
            "best_verdict": next((r["verdict"] for r in rows if best is not None and r["number"] == best.number), None),
            "speedup": result.speedup if best is not None else None, "speedup_low": result.speedup_low,
            "speedup_high": result.speedup_high, "speedup_basis": result.speedup_basis,
            "speedup_rounds": result.speedup_rounds, "verdict": result.verdict, "paste": paste,
            "removed_knobs": dict(result.removed_knobs), "trials": rows}


def _describe(config: Optional[dict[str, Any]]) -> str:
    from autotune._config import TrialConfig

    return TrialConfig.from_dict(config).describe() if config else "-"


def report(caps: Any, found: dict[str, dict[str, Any]], argv: list[str], seconds: float) -> str:
    lines = [
        "# The trainer adapters on one GPU: Hugging Face Trainer and Lightning",
        "",
        "Command (the runner writes this file and the `.json` beside it):",
        "",
        "```",
        "python3 -m benchmarks.runners.integrations_h200 " + " ".join(argv),
        "```",
        "",
        f"Date: {datetime.date.today()}; device: {caps.device_label} (driver {caps.driver or '-'}); torch {caps.torch}, "
        f"CUDA {caps.cuda_version or '-'}. Whole run: {seconds:.0f} s.",
    ]
    titles = {"transformers": "Hugging Face `Trainer`: `examples/hf_trainer.py` (GPT-2 from a local config)",
              "lightning": "Lightning `Trainer`: `examples/lightning_cnn.py` (a small CNN)"}
    for adapter, f in found.items():
        lines += ["", f"## {titles[adapter]}", ""]
        if "error" in f:
            lines.append(f"The study failed after {f['seconds']:.0f} s: {f['error']}")
            continue
        speedup = f.get("speedup")
        spread = (f"per-round ratios {f['speedup_low']:.2f}x-{f['speedup_high']:.2f}x over {f['speedup_rounds']} rounds"
                  if f["speedup_basis"] == "alternation" else
                  f"single measurements; window spread {f['speedup_low']:.2f}x-{f['speedup_high']:.2f}x")
        lines += [
            f"- Study: {len(f['trials'])} trials in {f['seconds']:.0f} s.",
            f"- Baseline ({f['baseline_source']}): {f['baseline']}, {f['baseline_throughput']:,.1f} samples/s.",
            f"- Pick: {f['best'] or '-'}, {f['best_throughput'] or 0:,.1f} samples/s, accuracy verdict "
            f"{f['best_verdict'] or '-'}.",
            f"- Speed-up: {speedup:.2f}x ({spread})." if isinstance(speedup, (int, float)) else "- No speed-up measured.",
            f"- Verdict: {f['verdict']}",
            "- Left out of the space: " + ("; ".join(f"`{k}`: {v}" for k, v in f["removed_knobs"].items()) or "nothing"),
            "",
            "Arguments to paste:",
            "",
            "```",
            f["paste"],
            "```",
            "",
            "| trial | state | status | config | samples/s | accuracy verdict |",
            "|---:|---|---|---|---:|---|",
        ]
        for t in f["trials"]:
            rate = f"{t['throughput']:,.1f}" if isinstance(t.get("throughput"), (int, float)) else "-"
            role = f" ({t['role']})" if t.get("role") else ""
            status = t["status"] or "-"
            if t.get("error") and status not in ("ok", "pruned"):
                status += f": {str(t['error'])[:80]}"
            lines.append(f"| {t['number']} | {t['state']}{role} | {status} | {_describe(t['config'])} | {rate} | "
                         f"{t.get('verdict') or '-'} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="markdown file to write")
    parser.add_argument("--workdir", type=Path, required=True, help="study storage and logs")
    parser.add_argument("--adapter", choices=tuple(EXAMPLES), action="append", default=None,
                        help="which adapters (default: both)")
    parser.add_argument("--tiny", action="store_true", help="the examples' CPU sizes, two trials each (a test)")
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--top-k", type=int, default=1)
    parser.add_argument("--confirm-rounds", type=int, default=1, help="rounds of the top-K alternation")
    parser.add_argument("--trial-timeout", type=float, default=150.0)
    parser.add_argument("--deadline", type=float, default=480.0, help="seconds for the whole run")
    parser.add_argument("--confirm-reserve", type=float, default=60.0,
                        help="seconds kept per adapter for the top-K confirmation after its trials")
    shown = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    started = time.monotonic()
    adapters = args.adapter or list(EXAMPLES)
    if args.tiny:
        os.environ["HF_TRAINER_SIZE"] = "tiny"
        os.environ.setdefault("LIGHTNING_CNN_SAMPLES", "1024")
        args.trials = min(args.trials, 3)
        args.top_k = 0
    from autotune.hardware import probe

    caps = probe()
    args.workdir.mkdir(parents=True, exist_ok=True)
    found: dict[str, dict[str, Any]] = {}
    for i, adapter in enumerate(adapters):
        left = args.deadline - (time.monotonic() - started)
        share = left / (len(adapters) - i)  # what is left, split over the adapters still to run
        timeout = max(20.0, share - args.confirm_reserve)
        found[adapter] = tune_example(adapter, work=args.workdir, trials=args.trials, timeout=timeout,
                                      top_k=args.top_k, confirm_rounds=args.confirm_rounds, trial_timeout=args.trial_timeout)
        print(f"{adapter}: {found[adapter].get('best') or found[adapter].get('error')}", flush=True)
    text = report(caps, found, [_relative(a, args.workdir) for a in shown], time.monotonic() - started)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps(found, indent=2, default=str))
    return 0 if all("error" not in f for f in found.values()) else 1


def _relative(arg: str, work: Path) -> str:
    """A command-line argument as the report shows it: no path of the machine it ran on."""
    if arg.startswith("/"):
        try:
            inside = str(Path(arg).relative_to(work.resolve()))
            return "WORKDIR" if inside == "." else "WORKDIR/" + inside
        except ValueError:
            return Path(arg).name
    return arg


if __name__ == "__main__":
    sys.exit(main())
