"""The trainer adapters end to end on the CPU: a real ``transformers.Trainer`` study and a real Lightning study
of the examples, three trials each (the fp32 reference and two enqueued configs), in real trial processes.

Each trial must show that its knobs reached the trainer (the dtype its first layer computed in, the micro-batch
and accumulation it stepped with, the DataLoader's workers, the compiled model), that the global batch stayed
the study's, and that none of the trainer's start-up or evaluation (a deliberate sleep in each) fell inside
a timed window.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import subprocess
import sys
from pathlib import Path

import optuna
import pytest

from autotune import Budget, MissingExtraError, TrialConfig, load_best
from autotune.cli import main, print_summary
from autotune.hardware import Capabilities
from autotune.integrations import _common
from autotune.integrations import lightning as tuned_lightning
from autotune.integrations import transformers as tuned_transformers
from autotune.study import _isolation
from autotune.study._isolation import preload_in_trial_server

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CAPS = Capabilities(cuda=False, bf16=True, cpu_count=2, compile=True, hostname="test-host", torch="test")
# A global batch of 16 in 8 optimizer steps: micro-batches of 16, or of 8 accumulated twice.
BUDGET = "budget: {samples: 128, warmup_steps: 1, windows: 3}\nbatch_policy: fixed\nglobal_batch: 16\n"
HF_SPACE = """\
knobs:
  precision: [fp32, bf16]
  batch_size: [8, 16]
  compile: [off, default]
  num_workers: [0, 1, 2]
  persistent_workers: [false, true]
  cuda_graphs: [false, true]  # the Trainer cannot take it: the adapter's space leaves it out, saying why
baseline: {precision: fp32, batch_size: 16}
""" + BUDGET
LIGHTNING_SPACE = """\
knobs:
  precision: [fp32, bf16]
  batch_size: [8, 16]
  channels_last: [false, true]
  compile: [off, default]
  num_workers: [0, 1, 2]
  persistent_workers: [false, true]
baseline: {precision: fp32, batch_size: 16}
""" + BUDGET
# Beside the fp32 reference (micro-batch 16, no workers, eager): every knob away from it in one of two trials.
HF_TRIALS = [
    {"precision": "bf16", "batch_size": 16, "compile": "off", "num_workers": 1, "persistent_workers": False},
    {"precision": "fp32", "batch_size": 8, "compile": "default", "num_workers": 2, "persistent_workers": True},
]
LIGHTNING_TRIALS = [
    {"precision": "bf16", "batch_size": 16, "channels_last": True, "compile": "off", "num_workers": 1,
     "persistent_workers": False},
    {"precision": "fp32", "batch_size": 8, "channels_last": False, "compile": "default", "num_workers": 2,
     "persistent_workers": True},
]


def _study(tmp: Path, tune, target: str, space_text: str, trials: list[dict], **adapter) -> tuple[optuna.Study, object]:
    """The reference, then the enqueued trials, through the adapter's ``tune``."""
    space = tmp / "space.yaml"
    space.write_text(space_text)
    url = f"sqlite:///{tmp}/studies.db"
    options = dict(space=space, storage=url, studies_dir=tmp / "studies", progress=False, capabilities=CAPS,
                   reference_repeats=1, trial_timeout=240, top_k=0, study_name="adapter", prune_below=None,
                   **adapter)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCH_COMPILE_DISABLE", "1")  # see the workloads: compiling would take minutes here
        tune(target, n_trials=1, mode="create", **options)  # the study and its fp32 reference
        study = optuna.load_study(study_name="adapter", storage=url)
        for params in trials:
            study.enqueue_trial(params)
        with contextlib.redirect_stdout(io.StringIO()) as said:  # the adapter's tune prints the CLI's summary
            result = tune(target, n_trials=1 + len(trials), **options)
    SAID[target] = said.getvalue()
    return optuna.load_study(study_name="adapter", storage=url), result


SAID: dict[str, str] = {}  # what each adapter's tune printed, by target


@pytest.fixture(scope="module", autouse=True)
def _trial_server_imports_both_trainers():
    # Each adapter's tune() has the trial server import its library; both at once start the server once.
    # Afterwards the server goes back to its usual imports, so other tests' restarts of it stay quick.
    before = list(_isolation._PRELOAD)
    preload_in_trial_server(*tuned_transformers.PRELOAD, *tuned_lightning.PRELOAD)
    yield
    _isolation._PRELOAD[:] = before
    if _isolation._CONTEXT is not None and _isolation._CONTEXT.get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver._forkserver._stop()
        _isolation._CONTEXT.set_forkserver_preload(list(before))


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory):
    import integration_hf

    study, result = _study(tmp_path_factory.mktemp("hf"), tuned_transformers.tune, f"{integration_hf.WORKLOAD}:train",
                           HF_SPACE, HF_TRIALS, args=integration_hf.ARGS)
    return study, result, integration_hf


@pytest.fixture(scope="module")
def lightning(tmp_path_factory: pytest.TempPathFactory):
    import integration_lightning

    study, result = _study(tmp_path_factory.mktemp("lightning"), tuned_lightning.tune,
                           f"{integration_lightning.WORKLOAD}:train", LIGHTNING_SPACE, LIGHTNING_TRIALS,
                           trainer=integration_lightning.TRAINER, loader=integration_lightning.loader())
    return study, result, integration_lightning


def _ran(study: optuna.Study) -> list[tuple[TrialConfig, dict]]:
    trials = study.get_trials()
    assert [t.user_attrs.get("status") for t in trials] == ["ok"] * 3, \
        [(t.user_attrs.get("status"), t.user_attrs.get("error")) for t in trials]
    return [(TrialConfig.from_dict(t.user_attrs["config"]), t.user_attrs) for t in trials]


def _assert_windows_hold_no_sleep(attrs: dict, workload) -> None:
    """The timed windows lie between the start-up's sleep and the evaluation's: the two sleeps (and no other,
    such as the evaluations the user's arguments ask for during training) are all the workload slept."""
    slept, windows = attrs["extra:slept"], attrs["extra:windows"]
    assert len(slept) == 2 and all(end - start >= workload.SLEEP for start, end in slept)
    assert len(windows) == 3
    started, evaluated = slept
    assert started[1] <= windows[0][0] and windows[-1][1] <= evaluated[0], (slept, windows)


def _window_plan(config: TrialConfig) -> tuple[int, int, int]:
    from autotune.trial._context import TrialContext

    return TrialContext(config=config, budget=Budget(samples=128, warmup_steps=1, windows=3))._plan()


def test_a_trainer_study_applies_every_knob_through_training_arguments(hf) -> None:
    study, result, workload = hf
    ran = _ran(study)
    assert {(c.precision, c.accumulation_steps, c.num_workers, c.compile) for c, _ in ran} == {
        ("fp32", 1, 0, "off"), ("bf16", 1, 1, "off"), ("fp32", 2, 2, "default")}
    assert ran[0][1]["role"] == "reference"
    for config, attrs in ran:
        saw = attrs["extra:trainer_saw"]
        bf16 = config.precision == "bf16"
        assert (saw["bf16"], saw["fp16"], saw["mixed_precision"]) == (bf16, False, "bf16" if bf16 else "no")
        if config.compile == "off":  # the first Linear's output under the Trainer's autocast
            assert attrs["extra:activation_dtype"] == ("bfloat16" if bf16 else "float32")
        # The micro-batch and its accumulation, as the Trainer stepped them; the global batch is the study's.
        assert (saw["per_device_train_batch_size"], saw["gradient_accumulation_steps"]) == (
            config.batch_size, config.accumulation_steps)
        assert saw["micro_batch"] == [config.batch_size] and saw["loader_batch_size"] == config.batch_size
        assert saw["micro_steps_per_optimizer_step"] == [config.accumulation_steps]
        assert saw["samples_per_optimizer_step"] == [16] and saw["max_steps"] == 8
        assert (saw["loader_num_workers"], saw["loader_persistent_workers"]) == (
            config.num_workers, config.persistent_workers)
        assert saw["torch_compile"] == saw["compiled"] == (config.compile != "off")
        pasted = tuned_transformers.training_arguments(config, workload.ARGS, cuda=False)
        assert attrs["extra:training_arguments"] == pasted
        # Every planned step was timed or warmed up, and the loss of each of the 8 optimizer steps recorded.
        steps, _, _ = _window_plan(config)
        assert attrs["steps"] == steps and len(attrs["losses"]) == 8
        _assert_windows_hold_no_sleep(attrs, workload)
        # The eval loss from trainer.evaluate(), which ran the user's compute_metrics (it slept).
        assert math.isfinite(attrs["metric"]) and attrs["metric"] == attrs["extra:eval_metrics"]["eval_loss"]
        assert attrs["extra:eval_metrics"]["eval_sleeps"] == 1.0
    assert study.user_attrs["metric_direction"] == "minimize"
    assert result.best_config is not None


def test_the_trainer_space_records_what_training_arguments_cannot_take(hf) -> None:
    study, _, _ = hf
    removed = study.user_attrs["removed_knobs"]
    assert "TrainingArguments has no CUDA Graphs argument" in removed["cuda_graphs=true"]
    for key in ("channels_last=true", "optimizer_impl=foreach", "loader=dali"):
        assert removed[key].startswith("transformers.Trainer: ")
    # The baseline is the user's TrainingArguments: fp32, their batch of 16, the eager AdamW they named.
    baseline = study.user_attrs["baseline_config"]
    assert (baseline["precision"], baseline["batch_size"], baseline["optimizer_impl"]) == ("fp32", 16, "default")


@pytest.mark.parametrize("function", ["train_with_overrides", "train_ignoring_the_overrides"])
def test_a_build_function_gets_the_overrides_and_must_use_them(function: str) -> None:
    import integration_hf

    from autotune.trial._execute import TrialSpec, execute

    config = TrialConfig(precision="bf16", batch_size=8, activation_checkpointing=True, global_batch=16)
    outcome = execute(TrialSpec(target=f"{integration_hf.WORKLOAD}:{function}", config=config,
                                budget=Budget(samples=128, warmup_steps=1, windows=3), baseline_batch_size=16))
    if function == "train_with_overrides":  # the dict form: run_trainer(ctx, build) without args
        assert outcome.status == "ok", outcome.error
        saw = outcome.measurement.extras["trainer_saw"]
        assert (saw["bf16"], saw["per_device_train_batch_size"], saw["gradient_accumulation_steps"]) == (True, 8, 2)
        assert saw["activation_checkpointing"] is saw["model_checkpointing"] is True  # the model recomputes
        assert outcome.measurement.metric is None and len(outcome.measurement.losses) == 8
    else:  # a Trainer built from other arguments would measure a config that was never applied
        assert outcome.status == "error"
        assert "WorkloadError: the Trainer's TrainingArguments lack the trial's bf16=True" in outcome.error


def test_a_lightning_study_applies_every_knob_to_the_trainer_loader_and_module(lightning) -> None:
    study, result, workload = lightning
    ran = _ran(study)
    assert {(c.precision, c.accumulation_steps, c.num_workers, c.compile, c.channels_last) for c, _ in ran} == {
        ("fp32", 1, 0, "off", False), ("bf16", 1, 1, "off", True), ("fp32", 2, 2, "default", False)}
    for config, attrs in ran:
        saw = attrs["extra:trainer_saw"]
        assert saw["precision"] == tuned_lightning.PRECISIONS[config.precision]
        if config.compile == "off":
            assert attrs["extra:activation_dtype"] == ("bfloat16" if config.precision == "bf16" else "float32")
        assert saw["accumulate_grad_batches"] == config.accumulation_steps
        assert saw["micro_batch"] == [config.batch_size] and saw["loader_batch_size"] == config.batch_size
        assert saw["micro_steps_per_optimizer_step"] == [config.accumulation_steps]
        assert saw["samples_per_optimizer_step"] == [16] and saw["max_steps"] == 8
        assert (saw["loader_num_workers"], saw["loader_persistent_workers"]) == (
            config.num_workers, config.persistent_workers)
        assert saw["compiled"] == (config.compile != "off")
        assert saw["channels_last"] == config.channels_last
        # Validation, a logger and checkpoints are not part of a trial: the callbacks that need them are left out.
        assert saw["callbacks_left_out"] == ["EarlyStopping", "LearningRateMonitor", "ModelCheckpoint"]
        assert attrs["extra:lightning_arguments"] == tuned_lightning.trainer_arguments(config, cuda=False).to_dict()
        steps, _, _ = _window_plan(config)
        assert attrs["steps"] == steps and len(attrs["losses"]) == 8
        _assert_windows_hold_no_sleep(attrs, workload)
        assert 0.0 <= attrs["metric"] <= 1.0 and attrs["metric"] == attrs["extra:eval_metrics"]["val_acc"]
    removed = study.user_attrs["removed_knobs"]
    for key in ("cuda_graphs=true", "optimizer_impl=foreach,fused", "activation_checkpointing=true"):
        assert removed[key].startswith("lightning.Trainer: ")
    assert study.user_attrs["metric_direction"] == "maximize"
    assert result.best_config is not None


def test_autotune_best_prints_the_arguments_to_paste(hf, lightning, capsys: pytest.CaptureFixture) -> None:
    for (study, result, _), kind, extra in ((hf, "TrainingArguments", "extra:training_arguments"),
                                           (lightning, "Lightning", "extra:lightning_arguments")):
        studies = Path(result.best_config_path).parent.parent
        assert main(["best", "adapter", "--studies-dir", str(studies), "--format", "json",
                     "--storage", f"sqlite:///{studies.parent}/studies.db"]) == 0
        doc = json.loads(capsys.readouterr().out)
        # What to paste is the pick's arguments; when nothing beat the baseline, nothing is (keep it).
        assert doc.get("paste") == (None if doc["keep_baseline"] else {kind: study.trials[doc["trial"]].user_attrs[extra]})
        assert main(["best", "adapter", "--studies-dir", str(studies),
                     "--storage", f"sqlite:///{studies.parent}/studies.db"]) == 0
        assert (f"Or paste into {kind}: " in capsys.readouterr().out) == result.faster  # the default text too
        # and `autotune tune`'s summary says it after the verdict, when the verdict is to change the config
        print_summary(result, storage=f"sqlite:///{studies.parent}/studies.db", studies_dir=str(studies), top_k=0)
        out = capsys.readouterr().out
        said = {"TrainingArguments": "Paste into TrainingArguments(...): ",
                "Lightning": "Paste into the Lightning script: "}[kind]
        assert (said in out) == result.faster, out
        if result.faster:
            # best_config.json sorts its keys: the Trainer line reads Trainer(accumulate_grad_batches=..., precision=...)
            assert ("per_device_train_batch_size=" if kind == "TrainingArguments" else "; Trainer(") in out
            assert kind == "TrainingArguments" or "precision=" in out.split("; Trainer(", 1)[1]


def test_the_adapters_tune_prints_the_clis_summary_and_keeps_a_baseline_nothing_beat(hf, lightning) -> None:
    for (study, result, workload) in (hf, lightning):
        said = SAID[f"{workload.WORKLOAD}:train"]
        assert "Verdict: " in said and "Where the minutes went: " in said and "Best config written to " in said
        assert ("Paste into " in said) == result.faster  # nothing slower, nor inside the noise, to paste
    # tune(args=ARGS) states the arguments' baseline: the summary finds no other one to warn of.
    assert "the baseline is not what your script's arguments train with" not in SAID[f"{hf[2].WORKLOAD}:train"]
    study, result, workload = hf
    arguments = tuned_transformers.training_arguments(result.best_config, workload.ARGS, cuda=False)
    if not result.faster:  # the baseline kept: the arguments are the script's own
        assert result.best_config == result.baseline
        assert arguments["per_device_train_batch_size"] == workload.ARGS.per_device_train_batch_size
        assert arguments["dataloader_num_workers"] == workload.ARGS.dataloader_num_workers
    with pytest.raises(TypeError, match="did you mean 'study_name'"):
        tuned_transformers.tune(f"{workload.WORKLOAD}:train", args=workload.ARGS, study_nme="x")


def test_a_trainer_study_where_nothing_beat_the_baseline_offers_nothing_slower_on_any_route(
        tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture) -> None:
    """A real Trainer whose only other config (two DataLoader workers) is measured clearly slower, as the
    issue's 0.44x config was: the summary, ``autotune best`` (text and JSON), ``best_config.json``,
    ``load_best``, ``Result.best_config`` and ``training_arguments`` all keep the script's own arguments."""
    import integration_hf

    target = f"{integration_hf.WORKLOAD}:train_slow_in_workers"
    workers = {"precision": "fp32", "batch_size": 16, "compile": "off", "num_workers": 2, "persistent_workers": False}
    study, result = _study(tmp_path_factory.mktemp("hf-slower"), tuned_transformers.tune, target, HF_SPACE, [workers],
                           args=integration_hf.ARGS)
    slower = next(t for t in study.trials if t.params.get("num_workers") == 2 and t.user_attrs.get("status") == "ok")
    assert slower.user_attrs["throughput"] < 0.8 * result.baseline_throughput, slower.user_attrs["throughput"]
    assert not result.faster and result.keep_baseline and result.best_config == result.baseline
    arguments = tuned_transformers.training_arguments(result.best_config, integration_hf.ARGS, cuda=False)
    assert arguments["dataloader_num_workers"] == integration_hf.ARGS.dataloader_num_workers == 0
    assert arguments["per_device_train_batch_size"] == integration_hf.ARGS.per_device_train_batch_size
    said = SAID[target]
    assert "keep the baseline" in said and "Paste into " not in said, said
    studies = Path(result.best_config_path).parent.parent
    storage = f"sqlite:///{studies.parent}/studies.db"
    assert main(["best", "adapter", "--studies-dir", str(studies), "--storage", storage]) == 0
    out = capsys.readouterr().out
    assert "keep the baseline" in out and "paste into" not in out.lower() and "dataloader_num_workers=2" not in out, out
    assert main(["best", "adapter", "--studies-dir", str(studies), "--storage", storage, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["keep_baseline"] and doc.get("paste") is None
    saved = json.loads(Path(result.best_config_path).read_text())
    assert saved["keep_baseline"] and saved["faster"] is False
    assert load_best(result.best_config_path) == result.baseline


def test_from_the_shell_a_trainer_script_gets_the_baseline_its_own_arguments_state(tmp_path: Path, capsys,
                                                                                   monkeypatch) -> None:
    """One baseline for one script: from the shell, the study's baseline is what the script's TrainingArguments
    train with (one DataLoader worker here, where the space's baseline has none), as ``tune(args=...)`` states
    it from Python; the references run at it, and the summary has no other baseline to warn of. A resume keeps
    it."""
    import integration_hf

    space = tmp_path / "space.yaml"
    space.write_text(HF_SPACE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    monkeypatch.setenv("COLUMNS", "400")
    args = ["tune", f"{integration_hf.WORKLOAD}:train_own_arguments", "--space", str(space), "--study", "own",
            "--top-k", "0", "--prune-below", "0", "--no-plots", "--studies-dir", str(tmp_path / "studies")]
    assert main([*args, "--trials", "1"]) == 0
    out = capsys.readouterr().out
    python_route = tuned_transformers.baseline(integration_hf.OWN_ARGS, cuda=False)
    doc = json.loads((tmp_path / "studies" / "own" / "best_config.json").read_text())
    baseline = TrialConfig.from_dict(doc["baseline"]["config"])
    assert all(getattr(baseline, k) == v for k, v in python_route.items()), (baseline, python_route)
    assert baseline.num_workers == 1
    study = optuna.load_study(study_name="own", storage=f"sqlite:///{tmp_path}/studies/autotune.db")
    reference = next(t for t in study.trials if t.user_attrs.get("role") == "reference")
    assert reference.user_attrs["config"]["num_workers"] == 1  # the references ran at the script's arguments
    assert "Baseline fp32 bs16 workers=1: from the script's own arguments (num_workers=1)" in out, out
    assert "is not what your script's arguments train with" not in out
    assert main([*args, "--trials", "2"]) == 0  # a resume: the same baseline, no reference runs again
    capsys.readouterr()
    study = optuna.load_study(study_name="own", storage=f"sqlite:///{tmp_path}/studies/autotune.db")
    assert TrialConfig.from_dict(study.user_attrs["baseline_config"]).num_workers == 1
    assert len([t for t in study.trials if t.user_attrs.get("role") == "reference"]) == 1


def test_the_pasteable_arguments_of_a_config() -> None:
    config = TrialConfig(precision="bf16", batch_size=16, compile="max-autotune", num_workers=4, pin_memory=True,
                         persistent_workers=True, activation_checkpointing=True, optimizer_impl="fused",
                         global_batch=64)
    assert tuned_transformers.training_arguments(config, cuda=True) == {
        "bf16": True, "fp16": False, "tf32": True, "per_device_train_batch_size": 16, "gradient_accumulation_steps": 4,
        "torch_compile": True, "torch_compile_mode": "max-autotune", "dataloader_num_workers": 4,
        "dataloader_pin_memory": True, "dataloader_prefetch_factor": 2, "dataloader_persistent_workers": True,
        "activation_checkpointing": True, "activation_checkpointing_kwargs": {"use_reentrant": False},
        "optim": "adamw_torch_fused"}  # transformers 5 names (before it, gradient_checkpointing)
    arguments = tuned_lightning.trainer_arguments(config.replace(activation_checkpointing=False,
                                                                 optimizer_impl="default"), cuda=True)
    assert arguments.trainer == {"precision": "bf16-mixed", "accumulate_grad_batches": 4, "benchmark": False}
    assert arguments.code().splitlines() == [
        "torch.set_float32_matmul_precision('high')",
        "model = torch.compile(model, mode='max-autotune')",
        "DataLoader(dataset, batch_size=16, num_workers=4, pin_memory=True, prefetch_factor=2, "
        "persistent_workers=True)",
        "Trainer(precision='bf16-mixed', accumulate_grad_batches=4, benchmark=False)",
    ]


def test_the_adapters_import_their_library_only_when_used_and_name_the_extra_when_missing() -> None:
    with pytest.raises(MissingExtraError, match=r"the 'transformers' extra: pip install 'autotune\[transformers\]'"):
        _common.require("a_library_that_is_not_installed", extra="transformers", needed_by="the test")
    code = """if True:
        import sys
        import autotune.integrations.lightning, autotune.integrations.transformers
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("transformers", "lightning", "accelerate")))
        sys.modules["lightning.pytorch"] = None  # as if the extra were not installed
        from autotune.integrations import lightning
        try:
            lightning.run_trainer(None, None)
        except Exception as exc:
            print(f"{type(exc).__name__}: {exc}")
    """
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    imported, error = proc.stdout.splitlines()
    assert imported == "[]"
    assert error.startswith("MissingExtraError: autotune.integrations.lightning needs lightning.pytorch")
    assert error.endswith("pip install 'autotune[lightning]'")
