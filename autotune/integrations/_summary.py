"""The study's summary as ``autotune tune`` prints it, and as ``autotune.run`` and the trainer adapters'
``tune`` print it too (``summary=False`` turns it off): the table, the verdict, how it was confirmed, the
accuracy check, the arguments to paste and where the minutes went.

It lives in the integrations layer because it renders the trainer adapters' arguments to paste.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from autotune._config import NO_FASTER_CONFIG, Result, script_baseline_differences
from autotune._errors import printable

def _document(result: Any) -> dict[str, Any]:
    """The best_config.json the study wrote ({} when it cannot be read)."""
    try:
        return json.loads(Path(result.best_config_path).read_text()) if result.best_config_path else {}
    except (OSError, ValueError):
        return {}


def _confirmation(result: Any) -> dict[str, Any]:
    return _document(result).get("confirmed") or {}


def run_and_summarize(tuner: Any, *, summary: bool = True) -> Result:
    """``tuner.run()``, then the summary ``autotune tune`` prints (``summary=False``: none; a ``mode="create"``
    or ``"join"`` run prints none either, as ``autotune tune --create-only`` and ``autotune worker`` do not)."""
    result = tuner.run()
    options = tuner.options
    if summary and options.study.mode == "tune":
        print_summary(result, storage=options.study.storage, studies_dir=str(options.study.studies_dir),
                      top_k=options.confirm.top_k)
    return result


def _other_baseline(doc: dict[str, Any], baseline: Any) -> str:
    """The knobs, as ``knob=value,...``, where the script's own trainer arguments (recorded by the trial as
    ``script_baseline``) differ from the study's baseline; "" when they agree or were not recorded."""
    differ = script_baseline_differences((doc.get("measurement") or {}).get("extra:script_baseline") or {}, baseline)
    return ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in differ.items())


def _plural(count: Any, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def print_summary(result: Any, *, storage: Optional[str], studies_dir: str, top_k: int = 3) -> None:
    """Print what a study found, as ``autotune tune`` ends: one line per fact, so each can be searched.

    When nothing beat the baseline, every line says to keep it: the fastest other config is shown as
    measured, never as the one to apply.
    """
    from rich.table import Table

    from autotune.study._progress import make_console

    console = make_console()

    def say(text: str) -> None:
        console.print(text, highlight=False, soft_wrap=True)  # one line each, so it can be searched

    from rich.markup import escape  # paths, URLs and names are the user's text, not markup ("out[/red]")

    table = Table(title=f"autotune: study {escape(printable(result.study_name))}", show_header=True)
    table.add_column("")
    table.add_column("config")
    table.add_column("samples/s", justify="right")
    table.add_column("accuracy loss", justify="right")
    alternated = result.speedup_basis == "alternation"
    table.add_row("baseline", result.baseline.describe(), f"{result.baseline_throughput:,.1f}", "0 (reference)")
    if result.best is not None and not result.is_baseline:
        label = "best" if result.faster else "fastest other (not faster)"
        table.add_row(label, result.best.config.describe(), f"{result.best.throughput:,.1f}",
                      f"{result.best.accuracy_loss:+.4f}")
    table.caption = ("samples/s: medians of the race of the finalists, the baseline raced with them"
                     if alternated else "samples/s: single runs" + (" (--top-k 0)" if top_k < 1 else ""))
    console.print(table)
    if result.best is None:
        say("No feasible config was found" + (f": {escape(result.ruled_out_faster)}." if result.ruled_out_faster
                                               else "; see the trials' failures in the dashboard."))
    else:
        changed = [
            f"{k}: {getattr(result.baseline, k)} -> {v}"
            for k, v in result.best.config.to_dict().items()
            if getattr(result.baseline, k) != v
        ]
        if result.faster:
            say(f"Verdict: [bold]{result.verdict}[/bold] ({result.spread_text}).")
            say("Why it wins: it changes " + "; ".join(changed) + ".")
        else:
            say(f"Verdict: [bold]{NO_FASTER_CONFIG}[/bold]: {result.why_not_faster}; keep the baseline: train as "
                "your script does (best_config.json, load_best and the adapters give the baseline back).")
        confirmed = _confirmation(result)
        if confirmed.get("confirmed"):
            dropped = confirmed.get("dropped") or {}
            # A finalist that failed in the race says how; one that was slower is named only.
            named = [f"#{k}" + (f" ({escape(printable(why))})" if str(why).startswith("failed") else "")
                     for k, why in dropped.items()]
            say(f"Confirmed by a race: {_plural(confirmed.get('runs'), 'run')} in "
                f"{_plural(confirmed.get('rounds'), 'round')}, "
                f"{confirmed.get('seconds') or 0:.0f} s; ended: {confirmed.get('ended')}"
                + (f"; dropped {', '.join(named)}" if dropped else "") + ".")
        elif not result.is_baseline and top_k >= 1:
            # With --top-k 0 the user chose single runs: the caption says so, and no advice is due.
            say(f"Not confirmed: {confirmed.get('why')}; these numbers are single runs.")
        if result.baseline_source:
            say(f"Baseline {result.baseline.describe()}: from {result.baseline_source}.")
        if result.reference_metric is None:
            say("Reference metric: none (the workload reports no metric; the training loss alone is judged).")
        else:
            say(f"Reference metric {result.reference_metric:.4f}, noise band {result.metric_noise:.4f}.")
        chosen = result.best_config  # the baseline when nothing beat it: nothing below describes a slower one
        if chosen.processes_per_gpu > 1 or chosen.mps:
            say(f"Packing: {chosen.packing}; the samples/s are every process's together.")
        if chosen.loader != result.baseline.loader:
            say(f"Input pipeline: {escape(chosen.input_pipeline)}.")
        if chosen.precision == "fp8":
            say(f"Float8: {escape(chosen.float8_training)}.")
        if chosen.allocator != "default":
            say(f"Allocator: {escape(chosen.memory_allocator)}.")
        if result.ruled_out_faster:
            say(f"Faster, but ruled out: {escape(result.ruled_out_faster)}.")
        _say_accuracy(say, result)
        say(f"Energy: {(_document(result).get('energy') or {}).get('what', 'not measured')}.")
        if (_document(result).get("real_run") or {}).get("what"):
            say(f"The real run: {_document(result)['real_run']['what']}.")
        if result.faster:  # otherwise the advice is to keep the baseline
            _say_paste(say, result)
    other = _other_baseline(_document(result), result.baseline)
    if other:
        say(f"[yellow]Warning: the baseline is not what your script's arguments train with ({escape(other)}): the "
            f"speed-up is against another config; rerun with --baseline {escape(other)} (the adapter's "
            "tune(args=...) states it for you).[/yellow]")
    if result.colocation_warning:
        say(f"[yellow]Warning: {escape(result.colocation_warning)}.[/yellow]")
    if result.best_per_device:
        console.print("[yellow]Trials ran on different device models; the best of each:[/yellow]")
        for device, record in sorted(result.best_per_device.items()):
            console.print(f"  {device}: {record.throughput:,.1f}/s  {record.config.describe()} (trial #{record.number})")
    if result.removed_knobs:
        console.print("Removed before the search (capability probe, compile break-even, what the reference run "
                      "showed of the model): " + "; ".join(f"{k} ({v})" for k, v in result.removed_knobs.items()),
                      markup=False, highlight=False, soft_wrap=True)
    split = _document(result).get("time_split")
    if split:
        from autotune.insight._report import format_split, plan_lines

        say(f"Where the minutes went: {format_split(split)}.")
        for line in plan_lines(split, result):
            say(line)
    console.print(f"Best config written to {escape(str(result.best_config_path))}")
    import shlex

    from autotune.study._storage import default_storage_url, mask_url

    url = mask_url(storage or default_storage_url(Path(studies_dir)))
    # optuna-dashboard takes a journal file by its path (it guesses the storage from the file).
    direct = url[len("journal:"):] if url.startswith("journal:") else url
    # Quoted for the shell: the line is pasted, and a folder's space or $(...) must not split or run there.
    console.print(f"Review it: autotune dashboard --storage {escape(shlex.quote(url))}   (plain optuna-dashboard "
                  f"{escape(shlex.quote(direct))} "
                  "does not read the accuracy bound: it calls the Pareto front of all trials, infeasible ones "
                  "included, best)", soft_wrap=True)


def _say_accuracy(say: Any, result: Any) -> None:
    """The batch policy and the accuracy verdict of the best, as best_config.json records them."""
    try:
        doc = json.loads(Path(result.best_config_path).read_text()) if result.best_config_path else {}
    except (OSError, ValueError):
        return
    policy = doc.get("batch_policy") or {}
    if policy:
        text = (f"Batch policy {policy.get('policy')}: global batch {policy.get('global_batch')} = micro-batch "
                f"{policy.get('micro_batch')} x {policy.get('accumulation_steps')} accumulated")
        if policy.get("policy") == "scale" and policy.get("global_batch") != result.baseline.global_batch_size:
            text += (f"; it changes the optimisation (the baseline's global batch is "
                     f"{result.baseline.global_batch_size}): a short trial cannot verify warm-up or the schedule")
        say(text + ".")
    if doc.get("accuracy_verdict") and not doc.get("not_recommended"):
        say(f"Accuracy verdict: {doc['accuracy_verdict']}: {doc.get('accuracy_evidence', '')}.")
    check = doc.get("accuracy_check") or {}
    if check.get("blind"):
        say("[yellow]The accuracy check is blind here, so its verdict is not a pass: "
            + "; ".join(check.get("reasons") or []) + ".[/yellow]")
    elif check.get("reasons"):
        say("[yellow]Part of the accuracy check is blind (accuracy_check.partly_blind), so the verdict rests on "
            "the other part: "
            + "; ".join(check["reasons"]) + ".[/yellow]")


# The trainer adapters record the arguments each trial ran with (autotune.integrations): what to paste.
PASTE_EXTRAS = {"extra:training_arguments": "TrainingArguments", "extra:lightning_arguments": "Lightning"}


def _paste(doc: dict[str, Any]) -> Optional[tuple[str, Any]]:
    """The best trial's trainer arguments, as its adapter recorded them: (kind, arguments), or None."""
    if doc.get("keep_baseline"):
        return None  # nothing beat the baseline: the script's own arguments stay as they are
    measurement = doc.get("measurement") or {}
    return next(((kind, measurement[key]) for key, kind in PASTE_EXTRAS.items() if measurement.get(key)), None)


def _say_paste(say: Any, result: Any) -> None:
    try:
        doc = json.loads(Path(result.best_config_path).read_text()) if result.best_config_path else {}
    except (OSError, ValueError):
        return
    paste = _paste(doc)
    if paste is None:
        return
    from rich.markup import escape  # the arguments are Python text, not markup

    kind, arguments = paste
    if kind == "TrainingArguments":
        say("Paste into TrainingArguments(...): " + escape(", ".join(f"{k}={v!r}" for k, v in arguments.items())))
    else:
        from autotune.integrations._paste import LightningArguments

        lines = LightningArguments(**arguments).code().splitlines()
        say("Paste into the Lightning script: " + escape("; ".join(lines)))
