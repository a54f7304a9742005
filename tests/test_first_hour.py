"""The first hour with a plain script: its own batch size is the baseline's, and a schedule is set from
the context (``ctx.optimizer_steps``), through a real study on the CPU."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest

from autotune.study._tuner import Tuner
from workloads import WORKLOADS

SPACE = """\
knobs:
  batch_size: [128, 256]
  cpu_threads: [null, 1]
budget: {samples: 2048, warmup_steps: 1, windows: 3}
"""


def _tuner(tmp_path: Path, caps, write_space, **options) -> Tuner:
    settings = dict(space=write_space(SPACE), n_trials=3, storage=f"sqlite:///{tmp_path}/studies.db",
                    studies_dir=tmp_path / "studies", progress=False, plots=False, capabilities=caps,
                    reference_repeats=1, trial_timeout=120, top_k=0, prune_below=None)
    settings.update(options)
    target = settings.pop("target", f"{WORKLOADS}:train_plain_script")
    return Tuner(target, **settings)


def _check_schedules(study: optuna.Study) -> None:
    """Every trial's cosine schedule took exactly the trial's optimizer steps and ended at its floor."""
    for trial in study.get_trials():
        schedule = trial.user_attrs["extra:schedule"]
        accumulation = 256 // schedule["batch_size"]
        assert schedule["optimizer_steps"] == 2048 // 256  # the same samples at the same global batch
        assert schedule["micro_steps"] == schedule["optimizer_steps"] * accumulation
        assert schedule["stepped"] == schedule["optimizer_steps"]
        assert schedule["last_lr"] == pytest.approx(0.0, abs=1e-12)  # cosine's eta_min, reached at T_max
        assert 1 <= schedule["warmup_steps"] < schedule["optimizer_steps"]


def test_the_scripts_batch_is_the_baseline_and_its_schedule_ends_where_it_should(tmp_path, cpu_caps,
                                                                                  write_space) -> None:
    result = _tuner(tmp_path, cpu_caps, write_space).run()
    study = optuna.load_study(study_name=result.study_name, storage=result.storage)
    attrs = study.user_attrs
    assert result.baseline.batch_size == 256 and result.baseline.global_batch_size == 256
    assert attrs["global_batch"] == 256 and attrs["batch_policy"] == "fixed"
    assert attrs["global_batch_source"] == "the script's ctx.loader(batch_size=256)"
    assert "the global batch from the script's ctx.loader(batch_size=256)" in result.baseline_source
    assert attrs["reference_measurement"]["extras"]["script_batch_size"] == 256
    assert all(t.user_attrs["config"]["global_batch"] == 256 for t in study.get_trials())
    _check_schedules(study)
    # A resume keeps the adopted batch (the same space), and runs no second reference.
    again = _tuner(tmp_path, cpu_caps, write_space, n_trials=4).run()
    assert again.baseline.global_batch_size == 256



def test_the_scripts_own_dataloader_is_the_baseline_and_its_references_run_once(tmp_path, cpu_caps,
                                                                                write_space) -> None:
    # The script loads with one persistent worker: a speed-up is over that, not over the space's 0 workers.
    # The references ran before the script's DataLoader was seen; a loader changes no step, so they stand,
    # and the baseline's own speed is timed apart.
    result = _tuner(tmp_path, cpu_caps, write_space, target=f"{WORKLOADS}:train_own_dataloader").run()
    study = optuna.load_study(study_name=result.study_name, storage=result.storage)
    attrs = study.user_attrs
    assert (result.baseline.num_workers, result.baseline.persistent_workers) == (1, True)
    assert result.baseline.global_batch_size == 256
    assert result.baseline_source.startswith("the script's DataLoader (num_workers=1,persistent_workers=true)")
    # Run once, before the DataLoader was seen (on a CPU the references load as the baseline does: run again
    # at it, they would have the worker).
    assert attrs["reference_config"]["num_workers"] == 0
    assert attrs["baseline_config"]["num_workers"] == 1 and attrs["baseline_speed"]["throughput"] > 0
    assert attrs["baseline_throughput"] == attrs["baseline_speed"]["throughput"]
    assert (tmp_path / "studies" / result.study_name / "logs" / "baseline-speed").is_dir()


def test_a_stated_batch_size_is_the_baseline_before_the_reference(tmp_path, cpu_caps, write_space) -> None:
    result = _tuner(tmp_path, cpu_caps, write_space, batch_size=256, n_trials=2).run()
    study = optuna.load_study(study_name=result.study_name, storage=result.storage)
    assert result.baseline.global_batch_size == 256 and study.user_attrs["global_batch"] == 256
    assert study.user_attrs["global_batch_source"] == "--batch-size 256 (batch_size=)"


def test_baseline_batch_size_wins_over_the_batch_size_option(tmp_path, cpu_caps, write_space) -> None:
    tuner = _tuner(tmp_path, cpu_caps, write_space, batch_size=256, baseline="batch_size=128")
    space = tuner._load_space(cpu_caps)
    assert space.baseline.global_batch_size == 128
    assert tuner._batch_source == "--baseline batch_size=128"


def test_the_batch_size_option_is_checked() -> None:
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        Tuner(f"{WORKLOADS}:train_plain_script", batch_size=0)


def test_the_reference_row_and_its_progress_line_say_the_run_as_it_ran(tmp_path, cpu_caps, write_space,
                                                                        monkeypatch, capsys) -> None:
    """The script passes batch 256 to ctx.loader and loads with one persistent worker. The progress line of the
    first reference named the space's batch before the script's was adopted, and the trial list's reference row
    ("workers=0", as it ran) was labelled the baseline beside a baseline of workers=1: each now says what ran."""
    from autotune.study._progress import _Progress

    statuses: list[str] = []
    shown = _Progress.status
    monkeypatch.setattr(_Progress, "status", lambda self, text: (statuses.append(text), shown(self, text)))
    result = _tuner(tmp_path, cpu_caps, write_space, target=f"{WORKLOADS}:train_own_dataloader", n_trials=1,
                    progress=True).run()
    printed = capsys.readouterr().out
    first = next(text for text in statuses if text.startswith("reference 1/1: "))
    assert first.startswith("reference 1/1: fp32 at the script's batch ") and " bs" not in first, first
    row = next(line for line in printed.splitlines() if " ref " in line and "/s  " in line)
    assert "workers=0" in row and "[the fp32 reference run, as it ran; the baseline is " in row, row
    assert f"the baseline is {result.baseline.describe()}, its own speed timed apart" in row, row
    assert "workers=1" in result.baseline.describe()
