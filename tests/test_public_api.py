"""The promises to users, pinned: the names ``autotune`` exports, the CLI's commands and options, and the
keys of ``best_config.json``. A change here is a change users see."""

from __future__ import annotations

import argparse
import math
from typing import Any

import optuna
import pytest

import autotune
from autotune.cli import build_parser
from autotune._records import summarize_study
from autotune.study._results import best_config_document

PUBLIC_NAMES = [
    "AutotuneError", "Budget", "Diagnosis", "GuidedSampler", "KnobError", "Measurement", "MissingExtraError",
    "NonFiniteLoss",
    "ReplayTable", "ReportError", "Result", "SearchSpace", "SpaceError", "StudyError", "TableError", "TrialConfig",
    "TrialContext", "TrialOutcome", "TrialRecord", "TrainResult", "TrainRun", "Tuner", "WorkloadError", "annotate_study", "annotate_trials",
    "applied", "diagnose", "float8_filter", "load_best", "load_space", "load_study_result", "run", "simulate", "train", "write_report",
]

COMMANDS = {
    "tune": {"target", "--space", "--trials", "--timeout", "--study", "--storage", "--max-accuracy-loss",
             "--metric-direction", "--accuracy-reference", "--trial-timeout", "--memory-limit", "--confirm-samples",
             "--top-k", "--prune-below", "--seed", "--studies-dir", "--no-progress", "--no-plots", "--grace-period",
             "--workers", "--create-only", "--baseline", "--nproc-per-trial", "--mps"},
    "worker": {"target", "--study", "--storage", "--no-plots"},
    "demo": {"--baseline"},
    "best": {"study"},
    "report": {"study"},
    "spaces": set(),
    "simulate": {"table"},
    "train": {"target", "--study", "--config", "--epochs", "--steps", "--minutes", "--compare", "--seed", "--out",
              "--studies-dir", "--metric-direction", "--max-accuracy-loss", "--no-progress"},
    "dashboard": set(),
}

# The knobs a space names and best_config.json's "config" holds.
CONFIG_FIELDS = [
    "precision", "batch_size", "channels_last", "compile", "cuda_graphs", "cudnn_benchmark", "num_workers",
    "pin_memory", "prefetch_factor", "persistent_workers", "memory_fraction", "cpu_threads", "loader",
    "dali_threads", "dali_prefetch", "attention", "optimizer_impl", "activation_checkpointing", "bucket_cap_mb",
    "gradient_as_bucket_view", "static_graph", "grad_compression", "batch_policy", "global_batch",
    "processes_per_trial", "processes_per_gpu", "mps", "allocator", "device_data_share", "compile_scope",
    "augment",
]
# What a train_fn calls on its TrialContext.
CONTEXT_HELPERS = {
    "model", "optimizer", "loader", "image_loader", "train_step", "attention", "checkpoint", "autocast",
    "to_device", "batches", "record_loss", "record_window", "report_metric", "record", "lr_scale", "lr_scale_sqrt",
    "measurement", "step_clock", "ddp", "world_size", "rank", "copy_index", "epoch", "on_epoch_end",
    "optimizer_steps", "warmup_steps", "micro_steps", "on_step_end", "untimed", "epochs",
}
TRAIN_STEP_OPTIONS = {"model", "optimizer", "loss_fn", "clip_grad_norm", "scheduler"}

BEST_CONFIG_KEYS = {
    "study", "target", "config", "trial", "throughput", "speedup", "accuracy_loss", "baseline", "reference_metric",
    "metric_noise", "measurement", "removed_knobs", "fingerprint", "confirmation", "written",
    "batch_policy", "accuracy_verdict", "accuracy_evidence", "accuracy_check",
    "faster", "verdict", "speedup_spread", "colocation_warning", "packing", "input_pipeline", "confirmed", "time_split",
    "float8", "allocator", "compile", "time_to_first_faster", "evidence_length", "energy", "real_run",
    "keep_baseline", "not_recommended", "why_none", "ruled_out_faster", "script_args",
}


def test_public_names_are_exactly_these_and_resolve() -> None:
    assert sorted(autotune.__all__) == sorted(PUBLIC_NAMES)
    for name in PUBLIC_NAMES:
        assert getattr(autotune, name) is not None


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_cli_commands_keep_their_options(command: str) -> None:
    sub = _subcommands(build_parser())
    assert set(sub) == set(COMMANDS)
    names = {opt for a in sub[command]._actions for opt in (a.option_strings or [a.dest])}
    missing = COMMANDS[command] - names
    assert not missing, f"autotune {command} lost {sorted(missing)}"


def test_best_config_document_keeps_its_keys() -> None:
    study = optuna.create_study(directions=["maximize", "minimize"])
    baseline = autotune.TrialConfig()
    for key, value in {"baseline_config": baseline.to_dict(), "baseline_throughput": 100.0,
                       "reference_metric": 0.9, "metric_noise": 0.0, "target": "m:f"}.items():
        study.set_user_attr(key, value)
    study.add_trial(optuna.trial.create_trial(
        params={}, distributions={}, values=[250.0, 0.0],
        user_attrs={"config": baseline.replace(batch_size=128).to_dict(), "status": "ok"},
        system_attrs={"constraints:failure": 0.0, "constraints:accuracy": -0.01},
    ))
    result = summarize_study(study)
    document = best_config_document(study, result)
    assert set(document) == BEST_CONFIG_KEYS
    assert document["config"]["batch_size"] == 128
    assert math.isclose(document["speedup"], 2.5)


def test_config_fields_and_context_helpers_are_kept() -> None:
    import dataclasses
    import inspect

    assert [f.name for f in dataclasses.fields(autotune.TrialConfig)] == CONFIG_FIELDS
    public = {name for name in dir(autotune.TrialContext) if not name.startswith("_")}
    assert CONTEXT_HELPERS <= public, sorted(CONTEXT_HELPERS - public)
    assert set(inspect.signature(autotune.TrialContext.train_step).parameters) - {"self"} == TRAIN_STEP_OPTIONS


def _study_with_shortened_references(samples: int, full_length_minutes: int) -> tuple[optuna.Study, Any]:
    """A study whose baseline ran at 100 samples/s and whose references the budget shortened to ``samples``."""
    study = optuna.create_study(directions=["maximize", "minimize"])
    baseline = autotune.TrialConfig()
    for key, value in {"baseline_config": baseline.to_dict(), "baseline_throughput": 100.0, "target": "m:f",
                       "references_shortened": {"samples": samples, "from_samples": 30720, "seconds": 24.0,
                                                  "full_length_budget_minutes": full_length_minutes}}.items():
        study.set_user_attr(key, value)
    return study, baseline


def test_a_study_whose_faster_trials_the_verdict_ruled_out_says_so_and_how_long_its_evidence_was() -> None:
    """Nothing feasible, but two trials ran 5x and 6x the baseline and were judged degraded on evidence the
    budget shortened: the result, the summary and best_config.json say that, not only "nothing feasible"."""
    study, baseline = _study_with_shortened_references(7680, 12)
    for rate in (500.0, 600.0):
        study.add_trial(optuna.trial.create_trial(
            params={}, distributions={}, values=[rate, 0.0],
            user_attrs={"config": baseline.replace(precision="bf16").to_dict(), "status": "ok", "throughput": rate,
                        "accuracy_verdict": "degraded", "accuracy_evidence": "loss higher by +0.07"},
            system_attrs={"constraints:failure": 0.0, "constraints:accuracy": 0.05},
        ))
    result = summarize_study(study)
    assert result.best is None
    why = result.why_not_faster
    assert "2 full trials ran 5.0x-6.0x the baseline's throughput" in why and "degraded" in why, why
    assert "trial #0: loss higher by +0.07" in why and "7,680 of 30,720 samples" in why and "about --budget 12 trains the full length" in why
    assert best_config_document(study, result)["why_none"] == why


def test_a_pick_slower_than_a_trial_the_verdict_ruled_out_names_that_trial_and_its_evidence(capsys, tmp_path) -> None:
    """A pick at 1.3x (a loader change) while the prior point ran 10x and was judged degraded on evidence the
    budget shortened: the summary, the report and best_config.json say so beside the pick. Trials slower than
    the pick are not named."""
    from autotune.insight._report import summary_lines
    from autotune.integrations._summary import print_summary

    study, baseline = _study_with_shortened_references(6400, 15)
    trials = [(130.0, baseline.replace(num_workers=8), "equivalent", "within"),
              (1000.0, baseline.replace(precision="bf16"), "degraded", "loss higher by +0.0135"),
              (120.0, baseline.replace(precision="fp16"), "degraded", "loss higher by +0.2")]
    for rate, config, verdict, evidence in trials:
        study.add_trial(optuna.trial.create_trial(
            params={}, distributions={}, values=[rate, 0.0],
            user_attrs={"config": config.to_dict(), "status": "ok", "throughput": rate,
                        "accuracy_verdict": verdict, "accuracy_evidence": evidence},
            system_attrs={"constraints:failure": 0.0 if verdict == "equivalent" else 1.0,
                          "constraints:accuracy": 0.0 if verdict == "equivalent" else 0.05},
        ))
    result = summarize_study(study)
    assert result.best is not None and result.best.number == 0
    note = result.ruled_out_faster
    assert note.startswith("1 full trial ran 10.0x the baseline's throughput") and "trial #1" in note, note
    assert "6,400 of 30,720 samples" in note and "about --budget 15 trains the full length" in note, note
    assert "trial #2" not in note
    document = best_config_document(study, result)
    assert document["ruled_out_faster"] == note and document["why_none"] is None
    assert any(line == f"Faster, but ruled out: {note}." for line in summary_lines(study, {}))
    print_summary(result, storage=None, studies_dir=str(tmp_path))
    assert "Faster, but ruled out: 1 full trial ran 10.0x" in " ".join(capsys.readouterr().out.split())
