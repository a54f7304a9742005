"""The capability probe, run for real in a child process, and what the coordinator does with it."""

from __future__ import annotations

import os
import platform
import socket
from pathlib import Path

import optuna
import pytest
import torch

from autotune import AutotuneError, Tuner, WorkloadError
from autotune._hardware import Capabilities, GpuSampler, _visible_index, probe
from workloads import WORKLOADS


@pytest.fixture(scope="module")
def probed() -> Capabilities:
    return probe()


def test_probe_describes_this_machine(probed: Capabilities) -> None:
    assert probed.cuda == torch.cuda.is_available()
    assert probed.torch == torch.__version__
    assert probed.python == platform.python_version()
    assert probed.hostname == socket.gethostname()
    assert probed.cpu_count == (os.cpu_count() or 1)
    if not probed.cuda:
        assert probed.bf16 is True and probed.gpu_count == 0 and probed.gpu_name == ""
        assert probed.device_label == f"CPU ({probed.cpu_count} cores)"
    assert Capabilities.from_dict(probed.to_dict()) == probed


def test_probe_that_does_not_answer_in_time_is_one_error() -> None:
    with pytest.raises(AutotuneError, match="did not answer within"):
        probe(timeout=0.01)


def test_probe_checks_that_the_target_imports(tmp_path: Path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom at import')\n")
    with pytest.raises(WorkloadError, match="importing it raised RuntimeError: boom at import") as info:
        probe(target=f"{broken}:train")
    assert str(broken) in str(info.value) and "\n" not in str(info.value)


def test_tuner_probes_the_machine_when_not_told(tmp_path: Path, probed: Capabilities, write_space) -> None:
    space = write_space("knobs:\n  channels_last: [false, true]\nbudget: {samples: 512, warmup_steps: 1, windows: 3}\n")
    url = f"sqlite:///{tmp_path}/probe.db"
    Tuner(f"{WORKLOADS}:train_tiny", space=space, n_trials=1, storage=url, studies_dir=tmp_path, progress=False,
          reference_repeats=1, top_k=0, study_name="probed").run()
    hardware = optuna.load_study(study_name="probed", storage=url).user_attrs["hardware"]
    assert hardware == probed.to_dict()


def test_gpu_sampler_without_a_gpu_samples_nothing() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    sampler = GpuSampler(interval=0.01)
    assert not sampler.active
    sampler.start()
    sampler.stop()
    assert sampler.summary() == {}


@pytest.mark.parametrize(
    "visible, index, expected",
    [("", 0, 0), ("", 2, 2), ("3,1", 0, 3), ("3,1", 1, 1), ("3", 1, 1), ("GPU-8c1f", 0, 0)],
)
def test_visible_index_maps_cuda_numbering_to_nvml(monkeypatch, visible: str, index: int, expected: int) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert _visible_index(index) == expected
