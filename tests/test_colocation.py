"""Co-located trials on the CPU: N copies of the training at once (processes_per_gpu), real processes.

One small study is shared across assertions (module-scoped): its N=2 trial gives the aggregate, the copies'
records, their seeds and files, and the overlap. A failing copy, a late copy, the validation, the MPS
session's environment and a study killed while its copies run are checked on their own. MPS itself is
GPU-only evidence (``benchmarks/runners/colocation_h200.py``); here the stand-in control program of
``tests/fake_mps`` plays the daemon.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import optuna
import pytest

from autotune import Budget, SpaceError, TrialConfig, Tuner
from autotune.hardware import Capabilities
from autotune.hardware._mps import MpsSession
from autotune.insight._diagnose import Diagnosis, LAUNCH_BOUND, COMPUTE_BOUND, next_step
from autotune.search._space import parse_space, restrict_to
from autotune.study._colocate import run_copies
from autotune.study._isolation import start_trial_server
from autotune.study._runner import TrialRunner
from autotune.trial._execute import TrialSpec
from copy_workloads import COPY_WORKLOADS, PIDDIR_ENV
from processes import alive, survivors

REPO = Path(__file__).resolve().parents[1]
FAKE_MPS = Path(__file__).parent / "fake_mps"
BUDGET = Budget(samples=2048, warmup_steps=2, windows=3)
CPU = Capabilities(cuda=False, bf16=False, compile=True, dali=True, cpu_count=2)


def _pids(folder: Path) -> list[int]:
    return [int(p) for f in sorted(folder.glob("copy*.pids")) for p in f.read_text().split()]


# -- a study ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("coloc-study")
    space = parse_space({"knobs": {"batch_size": [32], "processes_per_gpu": [1, 2], "mps": [False, True]},
                         "baseline": {"batch_size": 32},
                         "budget": {"samples": 2048, "warmup_steps": 2, "windows": 3}}, where="coloc.yaml", name="coloc")
    tuner = Tuner(f"{COPY_WORKLOADS}:train_copy", space=space, n_trials=2, top_k=0, reference_repeats=1,
                  prune_below=None, studies_dir=root, storage=f"sqlite:///{root}/s.db", progress=False,
                  plots=False, capabilities=CPU)
    result = tuner.run()
    loaded = optuna.load_study(study_name=result.study_name, storage=result.storage)
    packed = next(t for t in loaded.trials if (t.user_attrs.get("config") or {}).get("processes_per_gpu") == 2)
    return root, result, loaded, packed


def test_a_trial_of_two_copies_sums_their_throughput(study) -> None:
    _, _, _, packed = study
    attrs = packed.user_attrs
    assert attrs["status"] == "ok", attrs.get("error", "") + attrs.get("stderr_tail", "")
    copies = attrs["copy_throughputs"]
    assert len(copies) == 2 and all(rate > 0 for rate in copies)
    assert math.isclose(packed.values[0], sum(copies), rel_tol=1e-9)
    assert math.isclose(attrs["throughput"], sum(copies), rel_tol=1e-9)
    assert attrs["slowest_copy_throughput"] == min(copies)
    assert attrs["config"]["memory_fraction"] == 0.5  # 1/N: the space does not set memory_fraction
    assert attrs["samples"] == 2 * BUDGET.samples  # every copy's budget, not the overtime
    record = attrs["colocation"]
    assert [c["index"] for c in record["copies"]] == [0, 1] and record["mps"] is False
    assert all(len(c["losses"]) == BUDGET.samples // 32 for c in record["copies"])  # the budget's steps only


def test_the_copies_overlap_over_their_timed_windows(study) -> None:
    _, _, _, packed = study
    attrs = packed.user_attrs
    assert attrs["overlap"] >= 0.95, attrs["colocation"]  # every copy trained through each one's timed span
    assert 0 < attrs["timed_overlap"] <= attrs["overlap"]
    for copy in attrs["colocation"]["copies"]:
        assert copy["timed_start"] < copy["timed_end"] <= copy["busy_end"]
    starts = [c["timed_start"] for c in attrs["colocation"]["copies"]]
    assert max(starts) - min(starts) < 0.25  # the start barrier released them together
    assert "overlap" in attrs["colocation_summary"] and "2 copies" in attrs["colocation_summary"]


def test_each_copy_has_its_seed_files_and_share_of_the_cores(study) -> None:
    root, result, _, packed = study
    trial_dir = root / result.study_name / "logs" / f"trial-{packed.number}"
    copy0 = json.loads((trial_dir / "result.json").read_text())["measurement"]["extras"]
    copy1 = json.loads((trial_dir / "copy1" / "result.json").read_text())["measurement"]["extras"]
    assert (copy0["test.copy"], copy1["test.copy"]) == (0, 1)
    assert copy1["test.seed"] == copy0["test.seed"] + 1
    assert copy0["test.threads"] == copy1["test.threads"] == 1  # 2 cores over 2 copies
    assert (trial_dir / "copy1" / "trial.log").exists()


def test_each_copy_is_judged_and_the_trial_takes_the_worst(study) -> None:
    _, _, _, packed = study
    assert packed.user_attrs["accuracy_evidence"].startswith("copy ")
    assert "of 2, the worst of the copies" in packed.user_attrs["accuracy_evidence"]


def test_mps_goes_on_the_cpu_with_its_reason(study) -> None:
    _, result, loaded, _ = study
    assert "no CUDA device" in result.removed_knobs["mps=true"]
    assert all(not (t.user_attrs.get("config") or {}).get("mps") for t in loaded.trials)


def test_best_states_the_packing(study, capsys) -> None:
    from autotune import cli

    root, result, _, _ = study
    doc = json.loads(Path(result.best_config_path).read_text())
    config = TrialConfig.from_dict(doc["config"])
    assert doc["packing"]["processes_per_gpu"] == config.processes_per_gpu
    assert "(no GPU)" in doc["packing"]["what"] and "per GPU" not in doc["packing"]["what"]  # a CPU study
    assert cli.main(["best", result.study_name, "--storage", result.storage, "--studies-dir", str(root)]) == 0
    out = capsys.readouterr()
    assert ("Packing: " in out.out) == (config.processes_per_gpu > 1) and "per GPU" not in out.out
    args = ["best", result.study_name, "--storage", result.storage, "--studies-dir", str(root), "--format", "json"]
    assert cli.main(args) == 0
    assert json.loads(capsys.readouterr().out)["packing"] == doc["packing"]


# -- copies that fail --------------------------------------------------------------------------------
def test_a_failing_copy_fails_the_trial_by_name_and_leaves_no_process(tmp_path: Path) -> None:
    piddir = tmp_path / "pids"
    piddir.mkdir()
    config = TrialConfig(batch_size=32, processes_per_gpu=3, memory_fraction=1 / 3)
    spec = TrialSpec(target=f"{COPY_WORKLOADS}:fail_on_copy_1", config=config, budget=BUDGET,
                     env={PIDDIR_ENV: str(piddir)})
    outcome = run_copies(spec, workdir=tmp_path / "trial", timeout=120)
    assert outcome.status == "error"
    assert outcome.error.startswith("copy 1 of 3: ValueError: copy one broke on purpose"), outcome.error
    assert "copy one broke on purpose" in outcome.stderr_tail  # copy 1's log
    pids = _pids(piddir)
    assert len(pids) == 6, pids  # each copy and the child it started
    assert not survivors(pids)


def test_a_copy_late_for_the_barrier_fails_clearly(tmp_path: Path) -> None:
    start_trial_server()
    config = TrialConfig(batch_size=32, processes_per_gpu=2, memory_fraction=0.5)
    spec = TrialSpec(target=f"{COPY_WORKLOADS}:late_copy_1", config=config, budget=BUDGET)
    start = time.monotonic()
    outcome = run_copies(spec, workdir=tmp_path, timeout=120, barrier_seconds=2)
    assert outcome.status == "error"
    assert outcome.error.startswith("copy 0 of 2: CopyBarrierTimeout: copy 0 of 2: copies 1 did not finish their "
                                    "warm-up within 2s"), outcome.error
    assert time.monotonic() - start < 25  # copy 1, asleep, was killed with the trial


# -- validation ------------------------------------------------------------------------------------
def _space(knobs: dict, **top):
    return parse_space({"knobs": {"batch_size": [32], **knobs}, "baseline": {"batch_size": 32},
                        "budget": {"samples": 2048}, **top}, where="s.yaml")


def test_more_than_the_whole_device_is_refused() -> None:
    with pytest.raises(SpaceError, match=r"4 copies x memory_fraction 0.5 is more than the whole device"):
        _space({"processes_per_gpu": [1, 4], "memory_fraction": [0.25, 0.5]})
    with pytest.raises(ValueError, match="more than the whole device"):
        TrialConfig(processes_per_gpu=2, memory_fraction=0.75)
    assert _space({"processes_per_gpu": [2, 4], "memory_fraction": [0.25]}).fraction_stated


def test_copies_of_a_ddp_trial_are_refused() -> None:
    with pytest.raises(SpaceError, match="processes_per_gpu 2 with processes_per_trial 2: a DDP trial"):
        _space({"processes_per_gpu": [1, 2]}, processes_per_trial=2)
    with pytest.raises(SpaceError, match="processes_per_gpu 2 with processes_per_trial 2"):
        _space({"processes_per_gpu": [1, 2]}).with_processes(2)
    with pytest.raises(ValueError, match="co-located copies of a DDP job are not supported"):
        TrialConfig(processes_per_gpu=2, memory_fraction=0.5, processes_per_trial=2)


def test_copies_get_one_nth_of_the_memory_and_old_spaces_keep_their_fingerprint() -> None:
    class Last:
        def suggest_categorical(self, name, choices):
            return choices[-1]

    space = _space({"processes_per_gpu": [1, 2, 4], "mps": [False, True]})
    config = space.sample(Last())
    assert (config.processes_per_gpu, config.memory_fraction, config.mps) == (4, 0.25, True)
    assert "x4/gpu mps" in config.describe()
    plain = _space({})
    assert "processes_per_gpu" not in plain.to_dict()["baseline"] and "mps" not in plain.to_dict()["baseline"]
    assert plain.fingerprint == parse_space({"knobs": {"batch_size": [32]}, "baseline": {"batch_size": 32},
                                             "budget": {"samples": 2048}}, where="other.yaml").fingerprint
    assert TrialConfig().packing == "one training process per GPU (no memory cap)"
    assert restrict_to(space, CPU).knobs["mps"].values == (False,)


def test_mps_trials_get_the_daemon_and_the_others_are_kept_off(tmp_path: Path) -> None:
    session = MpsSession(pipe_dir=tmp_path / "pipe", log_dir=tmp_path / "log", owned=True)
    runner = TrialRunner(target="m:f", logdir=tmp_path / "logs", baseline=TrialConfig(), budget=BUDGET, timeout=10,
                         mps=session)
    on = runner.spec(TrialConfig(processes_per_gpu=2, memory_fraction=0.5, mps=True), seed=0)
    off = runner.spec(TrialConfig(processes_per_gpu=2, memory_fraction=0.5), seed=0)
    assert on.env["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "pipe")
    assert off.env["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "mps" / "off")
    assert (tmp_path / "mps" / "off").is_dir() and not list((tmp_path / "mps" / "off").iterdir())
    plain = TrialRunner(target="m:f", logdir=tmp_path / "logs", baseline=TrialConfig(), budget=BUDGET, timeout=10)
    assert plain.spec(TrialConfig(), seed=0).env is None


def test_the_diagnosis_hints_at_packing_an_idle_gpu() -> None:
    idle = Diagnosis(LAUNCH_BOUND, "...", {"gpu_util_pct": 30.0}, gpu_readings=True)
    assert "processes_per_gpu" in next_step(idle, {"processes_per_gpu": 1})
    assert "processes_per_gpu" not in next_step(idle, {"processes_per_gpu": 4})
    busy = Diagnosis(COMPUTE_BOUND, "...", {"gpu_util_pct": 97.0}, gpu_readings=True)
    assert "processes_per_gpu" not in next_step(busy, {})
    blind = Diagnosis(COMPUTE_BOUND, "...", {}, gpu_readings=False)
    assert "processes_per_gpu" not in next_step(blind, {})


# -- a killed study ------------------------------------------------------------------------------------
COORDINATOR = textwrap.dedent("""
    import sys
    from autotune import Tuner
    from autotune.hardware import Capabilities
    from autotune.search._space import parse_space

    root = sys.argv[1]
    space = parse_space({"knobs": {"batch_size": [32], "processes_per_gpu": [2], "mps": [True]},
                         "baseline": {"batch_size": 32, "processes_per_gpu": 2, "mps": True},
                         "budget": {"samples": 8192, "warmup_steps": 2, "windows": 3}}, where="k.yaml", name="killed")
    # A GPU machine as far as the space goes, so mps=true stays and the study starts its daemon; the trials
    # themselves run on the CPU.
    caps = Capabilities(cuda=True, bf16=True, gpu_count=1, compile=True, dali=True, cpu_count=2)
    if __name__ == "__main__":
        from autotune.study import _signals

        _signals.install()  # as the CLI does: SIGTERM ends the trial and the study, which stops its daemon
        Tuner(sys.argv[2], study_name="killed", space=space, n_trials=3, top_k=0, reference_repeats=1, prune_below=None,
              studies_dir=root, storage=f"sqlite:///{root}/s.db", progress=False, plots=False,
              capabilities=caps).run()
""")


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_killed_study_leaves_no_copy_and_no_daemon(tmp_path: Path, how: signal.Signals) -> None:
    script = tmp_path / "coordinator.py"
    script.write_text(COORDINATOR)
    piddir = tmp_path / "pids"
    piddir.mkdir()
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}", PIDDIR_ENV: str(piddir),
           "PATH": f"{FAKE_MPS}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("CUDA_MPS_PIPE_DIRECTORY", None)
    coordinator = subprocess.Popen([sys.executable, str(script), str(tmp_path), f"{COPY_WORKLOADS}:slow_copy"],
                                   env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        pipe = tmp_path / "killed" / "mps" / "pipe"
        deadline = time.monotonic() + 90
        while len(list(piddir.glob("copy*.pids"))) < 2 and coordinator.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert coordinator.poll() is None, coordinator.stdout.read()
        assert len(list(piddir.glob("copy*.pids"))) == 2, "the copies did not start"
        daemon = int((pipe / "nvidia-cuda-mps-control.pid").read_text())
        assert alive(daemon)
        # The mps=true copies are the daemon's clients.
        assert [(piddir / f"copy{k}.mps").read_text() for k in (0, 1)] == [str(pipe)] * 2
        time.sleep(1.0)
        coordinator.send_signal(how)
        coordinator.wait(30)
    finally:
        if coordinator.poll() is None:
            coordinator.kill()
    pids = _pids(piddir)
    assert len(pids) == 4
    assert not survivors(pids + [daemon], seconds=20)
    assert not (pipe / "control").exists()


def test_the_mps_option_reaches_the_tuner_and_is_checked() -> None:
    from autotune import cli

    args = cli.build_parser().parse_args(["tune", "examples/train.py:train", "--mps", "off"])
    assert cli._tuner(args, "examples/train.py:train").options.study.mps == "off"
    assert Tuner("examples/train.py:train").options.study.mps == "auto"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["tune", "examples/train.py:train", "--mps", "maybe"])
    with pytest.raises(ValueError, match="mps must be one of auto, on, off"):
        Tuner("examples/train.py:train", mps="maybe")
