"""``autotune train``: the real run's length, its schedule, Ctrl-C, the comparison's verdict and its energy.

The runs are real trainings of the tiny workloads on the CPU: in this process (``autotune.train``, the CLI's
``main``; Ctrl-C is a real SIGINT the workload sends itself), or for ``--compare`` in the command's own
processes. The energy counter is ``autotune.testing.FakeNvml``'s, in a real study's trial too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import autotune
from autotune import TrialConfig
from autotune.study._train import Promise, compare_runs, promise_check, run_once
from autotune.testing import FakeNvml
from autotune.trial._run import RunLength
from benchmarks.workloads import planted
from train_workloads import TRAIN_WORKLOADS

ROOT = Path(__file__).resolve().parent.parent
# One thread: on a shared 2-core machine two threads per tiny step are many times slower than one.
ONE_THREAD = TrialConfig(cpu_threads=1)
# Micro-batch 16 accumulated twice: an optimizer step is 32 samples, an epoch of 256 samples is 8 of them.
ACCUMULATED = ONE_THREAD.replace(batch_size=16, global_batch=32)


def _config_file(tmp_path: Path, config: TrialConfig, *, throughput: float | None = None,
                 baseline: TrialConfig | None = None) -> Path:
    """A best_config.json as a study writes it, with the fields autotune train reads."""
    doc = {"study": None, "config": config.to_dict(), "throughput": throughput,
           "measurement": {"window_throughputs": [throughput * 0.9, throughput, throughput * 1.1]} if throughput else {},
           "baseline": {"config": (baseline or TrialConfig()).to_dict(), "throughput": None}}
    path = tmp_path / "best_config.json"
    path.write_text(json.dumps(doc))
    return path


def _train(tmp_path: Path, **length):
    path = _config_file(tmp_path, ACCUMULATED, throughput=600.0)
    result = autotune.train(f"{TRAIN_WORKLOADS}:train_scheduled", config=path, out=tmp_path, progress=False,
                            say=lambda _: None, **length)
    run = result.runs["pick"]
    assert run.status == "ok", run.error
    return run, [m["value"] for m in run.metrics]


@pytest.mark.parametrize("length, steps, epochs", [
    ({"steps": 11}, 11, 1),       # 11 steps of 8 per epoch: one epoch's hook, then 3 steps into the second
    ({"epochs": 3}, 24, 3),       # 3 x 8
    ({"minutes": 0.01}, 11, 1),   # 0.6 s at the promised 600 samples/s: 360 samples, 11 steps of 32
])
def test_the_run_takes_its_length_in_optimizer_steps_and_the_cosine_schedule_ends_at_its_minimum(
        tmp_path: Path, length: dict, steps: int, epochs: int) -> None:
    run, reported = _train(tmp_path, **length)
    taken, last_lr, t_max, *hooks = reported
    assert taken == steps == t_max == run.optimizer_steps == run.steps_done
    assert run.samples == steps * 32 and run.epochs_done == epochs
    assert last_lr == pytest.approx(0.0, abs=1e-12)  # CosineAnnealingLR(T_max=ctx.optimizer_steps) at its eta_min
    assert hooks == [1000 * (e + 1) + (e + 1) for e in range(epochs)]  # hook(epoch) with ctx.epoch counting it
    assert len(run.losses) == steps and run.loss_every == 1
    written = json.loads((tmp_path / "train.json").read_text())
    assert written["runs"]["pick"]["steps_done"] == steps and written["promise"]["promised"] == 600.0



def test_with_no_study_nor_config_the_run_trains_the_script_as_written_its_batch_and_loader(tmp_path: Path) -> None:
    result = autotune.train(f"{TRAIN_WORKLOADS}:train_at_batch_24", epochs=2, out=tmp_path, progress=False,
                            say=lambda _: None)
    run = result.runs["baseline"]
    assert run.status == "ok", run.error
    first_batch, taken, last_lr = [m["value"] for m in run.metrics]
    assert first_batch == 24 and run.config.global_batch_size == 24  # not the default config's 64
    assert taken == run.steps_done == 20 and run.samples == 480  # 2 epochs of 240 samples, 10 steps each
    assert last_lr == pytest.approx(0.0, abs=1e-12)  # the schedule spans the steps at the script's batch
    # With a config, the config's batch is the one trained: the script's batch_size does not override it.
    path = _config_file(tmp_path, ONE_THREAD.replace(batch_size=16))
    run = autotune.train(f"{TRAIN_WORKLOADS}:train_at_batch_24", config=path, epochs=1, out=tmp_path, progress=False,
                         say=lambda _: None).runs["pick"]
    assert run.metrics[0]["value"] == 16 and run.steps_done == 15
    # The script's own DataLoader (one persistent worker) is the script as written: its workers come too.
    run = autotune.train(f"{TRAIN_WORKLOADS}:train_own_dataloader", epochs=1, out=tmp_path, progress=False,
                         say=lambda _: None).runs["baseline"]
    assert run.status == "ok", run.error
    assert (run.config.global_batch_size, run.config.num_workers, run.config.persistent_workers) == (24, 1, True)
    assert run.metrics[0]["value"] == 1 and run.steps_done == 10  # the workers the loader it trained with had


def test_minutes_without_a_measured_throughput_is_an_error_before_anything_trains(tmp_path: Path, capsys) -> None:
    from autotune.cli import main

    assert main(["train", f"{TRAIN_WORKLOADS}:train_scheduled", "--minutes", "1", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("autotune: error: --minutes needs the throughput the study measured") and "\n" not in err
    assert not (tmp_path / "train.json").exists()


def test_ctrl_c_stops_at_an_optimizer_step_runs_the_code_after_the_loop_and_writes_what_was_measured(
        tmp_path: Path, capsys) -> None:
    from autotune.cli import main

    path = _config_file(tmp_path, ONE_THREAD)
    before = signal.getsignal(signal.SIGINT)  # Python's own handler, or SIG_IGN where a background shell started us
    # The workload sends itself SIGINT after 20 steps of a run a million steps long.
    code = main(["train", f"{TRAIN_WORKLOADS}:train_until_stopped", "--steps", "1000000", "--config", str(path),
                 "--out", str(tmp_path), "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 130, err
    assert "SIGINT: stopping at the next optimizer step" in err
    doc = json.loads((tmp_path / "train.json").read_text())
    run = doc["runs"]["pick"]
    assert doc["interrupted"] is True and run["status"] == "interrupted"
    assert run["steps_done"] == 20 and run["samples"] == 20 * 64  # it stopped at the step it was asked in
    assert run["metrics"][-1]["value"] == 20  # the code after the loop ran
    # The curve's bins are sized for the planned million steps (512 points): the 20 steps fill the first.
    assert run["loss_every"] == -(-1_000_000 // 512) and len(run["losses"]) == 1 and run["throughput"] > 0
    assert "Interrupted" in out and "train.json" in out
    assert signal.getsignal(signal.SIGINT) is before  # the handler was put back


FP32 = ONE_THREAD.replace(batch_size=64)
BF16 = FP32.replace(precision="bf16")


def test_compare_says_the_pick_drifts_on_planted_harm(tmp_path: Path) -> None:
    """bf16 through the planted offset loses the hidden activations: its curve leaves fp32's (paired), and
    ``autotune train --compare`` says so."""
    length = RunLength(steps=96)
    fn = planted.train_harmed
    baseline = run_once(fn, FP32, length, label="baseline")
    pick = run_once(fn, BF16, length, label="pick")
    comparison = compare_runs(pick, baseline)
    assert comparison["accuracy"] == "drifts", comparison["evidence"]
    assert comparison["evidence"].startswith("paired") and "contradicts" in comparison["accuracy_what"]
    # The same through the command a user runs.
    path = _config_file(tmp_path, BF16, throughput=5000.0, baseline=FP32)
    proc = subprocess.run([sys.executable, "-m", "autotune", "train", f"{planted.__file__}:train_harmed",
                           "--config", str(path), "--steps", "96", "--compare", "--out", str(tmp_path),
                           "--no-progress"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    said = json.loads((tmp_path / "train.json").read_text())["comparison"]
    assert said["accuracy"] == "drifts" and said["accuracy"] == comparison["accuracy"], said["evidence"]
    assert "Accuracy: " in proc.stdout and "drift" in proc.stdout.split("Accuracy: ", 1)[1].splitlines()[0], proc.stdout


def test_compare_runs_both_configs_and_says_the_pick_holds_on_a_clean_workload(tmp_path: Path) -> None:
    """The pick packs two co-located copies (seeds 0 and 1): their samples and rates add up, copy 0's curve
    (seed 0, as the baseline's) is judged."""
    path = _config_file(tmp_path, BF16.replace(processes_per_gpu=2, memory_fraction=0.5), throughput=5000.0, baseline=FP32)
    proc = subprocess.run([sys.executable, "-m", "autotune", "train", f"{planted.__file__}:train_clean",
                           "--config", str(path), "--steps", "96", "--compare", "--out", str(tmp_path),
                           "--no-progress"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((tmp_path / "train.json").read_text())
    assert set(doc["runs"]) == {"baseline", "pick"}
    for run in doc["runs"].values():
        assert run["steps_done"] == 96 and len(run["losses"]) == 96
    pick = doc["runs"]["pick"]
    assert pick["samples"] == 2 * 96 * 64 and pick["extras"]["copy_statuses"] == ["ok", "ok"]
    assert pick["throughput"] == pytest.approx(sum(pick["extras"]["copy_throughputs"]))
    comparison = doc["comparison"]
    assert comparison["accuracy"] == "holds", comparison["evidence"]
    assert comparison["evidence"].startswith("paired")
    assert comparison["speedup"] > 0 and comparison["speedup_low"] <= comparison["speedup"] <= comparison["speedup_high"]
    assert "Accuracy: the pick's training holds" in proc.stdout and "Speed: the pick ran at" in proc.stdout
    assert "Loss curves, the mean of each quarter of the run: baseline " in proc.stdout


def test_the_promise_is_a_ratio_with_its_range_and_a_contradiction_is_said() -> None:
    run = run_once(planted.train_clean, FP32, RunLength(steps=40), label="pick")
    assert run.throughput and run.throughput_low <= run.throughput <= run.throughput_high
    kept = promise_check(run, Promise(throughput=run.throughput, low=run.throughput * 0.98,
                                      high=run.throughput * 1.02, source="study s"))
    assert kept["holds"] is True and kept["ratio"] == pytest.approx(1.0)
    broken = promise_check(run, Promise(throughput=run.throughput * 10, source="study s"))
    assert broken["holds"] is False and broken["ratio"] == pytest.approx(0.1)
    assert "slower than the study measured" in broken["what"] and "contradicts" in broken["what"]


def test_a_run_records_joules_per_sample_from_the_energy_counter_and_says_not_measured_without() -> None:
    # The counter in millijoules: read at the start (1,000 J) and the end (1,640 J).
    nvml = FakeNvml([{"energy_mj": 1_000_000}, {"energy_mj": 1_640_000}])
    measured = run_once(planted.train_clean, FP32, RunLength(steps=10), nvml=nvml)
    assert measured.energy_j == pytest.approx(640.0)
    assert measured.joules_per_sample == pytest.approx(640.0 / 640)  # 10 steps of 64 samples
    unsupported = run_once(planted.train_clean, FP32, RunLength(steps=10), nvml=FakeNvml([{}]))
    assert unsupported.joules_per_sample is None and unsupported.energy_note.startswith("not measured")
    cpu = run_once(planted.train_clean, FP32, RunLength(steps=10))
    assert cpu.joules_per_sample is None and cpu.energy_note.startswith("not measured: no GPU")


def test_a_trial_best_config_and_the_report_carry_joules_per_sample_from_a_stand_in_nvml(
        tmp_path: Path, write_space, cpu_caps) -> None:
    import optuna

    from autotune import Tuner
    from autotune.insight._report import summary_lines

    space = write_space("knobs:\n  batch_size: [64]\n  cpu_threads: [1]\nbudget: {samples: 2048, warmup_steps: 1, windows: 3}\n")
    url = f"sqlite:///{tmp_path}/energy.db"
    result = Tuner(f"{TRAIN_WORKLOADS}:train_fake_energy", space=space, n_trials=1, storage=url, studies_dir=tmp_path,
                   progress=False, plots=False, reference_repeats=1, top_k=0, study_name="energy",
                   capabilities=cpu_caps).run()
    study = optuna.load_study(study_name="energy", storage=url)
    attrs = study.trials[result.best.number].user_attrs
    assert attrs["extra:gpu.energy_j"] == pytest.approx(512.0)  # the counter's two readings, 512 J apart
    per_sample = attrs["extra:gpu.joules_per_sample"]
    # Over the timed windows' samples: fewer than the trial's (its warm-up is not timed), at least 3 batches.
    assert 512.0 / attrs["samples"] < per_sample <= 512.0 / (3 * 64)
    energy = json.loads(Path(result.best_config_path).read_text())["energy"]
    assert energy["joules_per_sample"] == per_sample and energy["what"].startswith(f"{per_sample:.4g} J/sample")
    assert f"Energy of the best: {per_sample:.4g} J/sample over the timed windows" in "\n".join(summary_lines(study, {}))


def test_energy_not_measured_says_why() -> None:
    from autotune.insight._report import energy_record

    assert energy_record({}, cuda=False)["what"].startswith("not measured: no GPU")
    assert "gives no energy counter" in energy_record({"extra:gpu.energy_j": None}, cuda=True)["what"]
    assert energy_record({}, cuda=False)["joules_per_sample"] is None


def _result(speedup_low: float, speedup_high: float):
    from autotune._config import Result, TrialRecord

    best = TrialRecord(number=3, config=TrialConfig(batch_size=64, precision="bf16"), throughput=2000.0,
                       accuracy_loss=0.0, status="ok", feasible=True)
    return Result(study_name="s", storage="sqlite://", best=best, baseline=TrialConfig(batch_size=64),
                  baseline_throughput=1000.0, reference_metric=None, metric_noise=0.0, pareto=(best,),
                  removed_knobs={}, speedup_low=speedup_low, speedup_high=speedup_high)


def test_a_declared_real_run_is_said_in_time_with_the_baseline_and_the_pick_with_the_spread() -> None:
    from autotune.study._results import real_run_estimate

    assert real_run_estimate({}, _result(1.8, 2.2)) is None  # nothing declared: nothing said
    # 10,000 steps of 64 samples: 640 s with the baseline at 1,000/s, 320 s with the pick at 2x (1.8x-2.2x).
    steps = real_run_estimate({"train_steps": 10_000}, _result(1.8, 2.2))
    assert steps["baseline_seconds"] == pytest.approx(640.0) and steps["pick_seconds"] == pytest.approx(320.0)
    assert steps["pick_seconds_low"] == pytest.approx(640 / 2.2) and steps["pick_seconds_high"] == pytest.approx(640 / 1.8)
    assert steps["what"].startswith("10,000 steps (640,000 samples at the baseline's global batch 64) take "
                                    "10.7 min with the baseline and 5.3 min with the pick (4.8 min-5.9 min")
    # 30 minutes with the pick at 2,000/s: 3.6 M samples, which the baseline trains in 60 min (54-66).
    minutes = real_run_estimate({"train_minutes": 30}, _result(1.8, 2.2))
    assert minutes["samples"] == 3_600_000 and minutes["steps"] == 3_600_000 // 64
    assert minutes["baseline_seconds"] == pytest.approx(3600.0)
    assert (minutes["baseline_seconds_low"], minutes["baseline_seconds_high"]) == pytest.approx((3240.0, 3960.0))
    assert "take 60.0 min with the baseline (54.0 min-66.0 min from the speed-up's spread 1.80x-2.20x)" in minutes["what"]


def test_a_hand_written_loop_and_a_dataset_on_the_device_train_the_run_s_length() -> None:
    import torch
    from torch import nn

    from workloads import dataset, tiny_model, train_tiny

    def hand_written(ctx) -> None:
        model = ctx.model(tiny_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in ctx.batches(ctx.loader(dataset(256))):
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ctx.record_loss(loss)

    run = run_once(hand_written, ONE_THREAD.replace(batch_size=32), RunLength(steps=20))
    assert run.status == "ok" and run.steps_done == 20 and len(run.losses) == 20  # one point per step
    # loader=device: the dataset kept on the device, still epochs of it (1,024 samples, 32 batches of 32).
    run = run_once(train_tiny, ONE_THREAD.replace(batch_size=32, loader="device"), RunLength(epochs=2))
    assert run.status == "ok", run.error
    assert (run.steps_done, run.optimizer_steps, run.epochs_done) == (64, 64, 2)
