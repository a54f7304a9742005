"""The capability probe, run for real in a child process, and what the coordinator does with it."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import torch

from autotune import AutotuneError, Tuner, WorkloadError
from autotune.hardware import Capabilities, GpuSampler, probe, throttle_reason_names
from autotune.hardware import visible_index as _visible_index
from autotune.testing import FakeNvml
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


def test_the_forked_probe_answers_as_the_subprocess_probe_and_leaves_torch_out_of_the_coordinator(
        probed: Capabilities) -> None:
    # A coordinator that has not imported torch (as `autotune tune` has not) probes through the trial server.
    code = ("import json, sys; from autotune.study._isolation import probe_in_trial_server; "
            "caps = probe_in_trial_server(None); "
            "print(json.dumps({'caps': caps.to_dict(), 'torch': 'torch' in sys.modules}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    answer = __import__("json").loads(proc.stdout.strip().splitlines()[-1])
    assert answer["torch"] is False  # the answer is plain data: unpickling it imported nothing
    assert Capabilities.from_dict(answer["caps"]) == probed


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
    Tuner(f"{WORKLOADS}:train_tiny", space=space, n_trials=1, storage=url, studies_dir=tmp_path, progress=False, plots=False,
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


# Five NVML samples as a busy GPU reports them: clocks, utilisation, memory, power, temperature, PCIe in
# KB/s each way, and the clock event reasons (0x1 idle is no throttle; 0x4 power cap, 0x20 thermal).
SCRIPTED = [
    {"sm_clock_mhz": 1980, "gpu_util_pct": 90, "mem_used_gib": 10.0, "power_w": 600.0, "temperature_c": 60,
     "pcie_tx_kb_s": 1000, "pcie_rx_kb_s": 20000, "clock_event_reasons": 0x1},
    {"sm_clock_mhz": 1980, "gpu_util_pct": 100, "mem_used_gib": 12.0, "power_w": 650.0, "temperature_c": 62,
     "pcie_tx_kb_s": 2000, "pcie_rx_kb_s": 30000, "clock_event_reasons": 0x0},
    {"sm_clock_mhz": 1800, "gpu_util_pct": 100, "mem_used_gib": 12.0, "power_w": 700.0, "temperature_c": 64,
     "pcie_tx_kb_s": 3000, "pcie_rx_kb_s": 40000, "clock_event_reasons": 0x4},
    {"sm_clock_mhz": 1750, "gpu_util_pct": 100, "mem_used_gib": 12.0, "power_w": 700.0, "temperature_c": 66,
     "pcie_tx_kb_s": 4000, "pcie_rx_kb_s": 50000, "clock_event_reasons": 0x4 | 0x20},
    {"sm_clock_mhz": 1980, "gpu_util_pct": 60, "mem_used_gib": 14.0, "power_w": 500.0, "temperature_c": 65,
     "pcie_tx_kb_s": 5000, "pcie_rx_kb_s": 60000, "clock_event_reasons": 0x1 | 0x10},
]


def sampled(fake: FakeNvml, n: int) -> GpuSampler:
    sampler = GpuSampler(nvml=fake)
    assert sampler.active
    for _ in range(n):
        sampler.sample_once()
    return sampler


def test_gpu_sampler_summarises_scripted_nvml_readings() -> None:
    summary = sampled(FakeNvml(SCRIPTED), len(SCRIPTED)).summary()
    assert summary["gpu.samples"] == 5
    assert summary["gpu.sm_clock_mhz.mean"] == pytest.approx(1898.0)
    assert summary["gpu.sm_clock_mhz.p5"] == pytest.approx(1760.0)  # linear between 1750 and 1800
    assert summary["gpu.sm_clock_mhz.p95"] == pytest.approx(1980.0)
    assert summary["gpu.gpu_util_pct.mean"] == pytest.approx(90.0)
    assert summary["gpu.gpu_util_pct.p5"] == pytest.approx(66.0)
    assert summary["gpu.mem_used_gib.mean"] == pytest.approx(12.0)
    assert summary["gpu.power_w.p95"] == pytest.approx(700.0)
    assert summary["gpu.temperature_c.mean"] == pytest.approx(63.4)
    # PCIe: NVML's KB/s become MB/s.
    assert summary["gpu.pcie_tx_mb_s.mean"] == pytest.approx(3.0)
    assert summary["gpu.pcie_rx_mb_s.mean"] == pytest.approx(40.0)
    assert summary["gpu.pcie_rx_mb_s.p5"] == pytest.approx(22.0)
    assert summary["gpu.pcie_rx_mb_s.p95"] == pytest.approx(58.0)
    # Three of five samples had a reason other than idle.
    assert summary["gpu.throttle_fraction"] == pytest.approx(0.6)
    assert summary["gpu.throttle_reasons"] == ["sw_power_cap", "sw_thermal_slowdown", "sync_boost"]


def test_gpu_sampler_falls_back_to_the_older_throttle_reasons_call() -> None:
    fake = FakeNvml(SCRIPTED, clocks_event_api=False)  # a driver before r535
    summary = sampled(fake, 3).summary()
    assert summary["gpu.throttle_fraction"] == pytest.approx(0.333)  # rounded like the other readings
    assert summary["gpu.throttle_reasons"] == ["sw_power_cap"]
    assert fake.count("nvmlDeviceGetCurrentClocksThrottleReasons") == 3
    assert fake.count("nvmlDeviceGetCurrentClocksEventReasons") == 0  # it raised before answering


def test_gpu_sampler_leaves_out_what_the_device_does_not_report() -> None:
    # PCIe counters and clock reasons are missing on some boards and vGPUs; the rest is still sampled.
    bare = [{k: v for k, v in r.items() if not k.startswith(("pcie", "clock"))} for r in SCRIPTED]
    fake = FakeNvml(bare)
    summary = sampled(fake, 4).summary()
    assert summary["gpu.samples"] == 4 and summary["gpu.gpu_util_pct.mean"] == pytest.approx(97.5)
    assert not any(k.startswith(("gpu.pcie", "gpu.throttle")) for k in summary)
    # Asked once each, then no more.
    assert fake.count("nvmlDeviceGetPcieThroughput[pcie_tx_kb_s]") == 1
    assert fake.count("nvmlDeviceGetCurrentClocksThrottleReasons") == 1


def test_gpu_sampler_thread_samples_until_stopped() -> None:
    sampler = GpuSampler(nvml=FakeNvml(SCRIPTED), interval=0.001)
    sampler.start()
    deadline = time.monotonic() + 10
    while len(sampler.samples["sm_clock_mhz"]) < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    sampler.stop()
    count = len(sampler.samples["sm_clock_mhz"])
    assert count >= 8
    summary = sampler.summary()
    assert summary["gpu.samples"] == count and len(sampler.throttled) == count
    assert summary["gpu.throttle_reasons"] == ["sw_power_cap", "sw_thermal_slowdown", "sync_boost"]
    time.sleep(0.05)
    assert len(sampler.samples["sm_clock_mhz"]) == count  # stopped means stopped


def test_gpu_sampler_with_an_unknown_device_index_samples_nothing() -> None:
    sampler = GpuSampler(index=3, nvml=FakeNvml(SCRIPTED, devices=1))
    assert not sampler.active
    sampler.start()
    sampler.stop()
    assert sampler.summary() == {}


@pytest.mark.parametrize(
    "mask, names",
    [(0x0, []), (0x1, []), (0x4, ["sw_power_cap"]), (0x1 | 0x8 | 0x40, ["hw_slowdown", "hw_thermal_slowdown"]),
     (0x800, ["0x800"])],
)
def test_throttle_reason_names(mask: int, names: list[str]) -> None:
    assert throttle_reason_names(mask) == names


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
def test_probe_counts_the_cores_this_process_may_use_not_the_host(tmp_path) -> None:
    # A job pinned with taskset (or a cgroup cpuset) gets fewer cores than the host has; the loader
    # knobs must be judged against those.
    code = "import os; os.sched_setaffinity(0, {0}); from autotune.hardware import probe; print(probe().cpu_count)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "1"


def test_capabilities_round_trip_the_attention_precisions_and_old_data_still_loads() -> None:
    import json

    caps = Capabilities(cuda=True, bf16=True, attention_precision_unavailable={
        "flash": {"fp32": "SDPA has no flash kernel for float32 on CUDA here", "tf32": "same"}})
    again = Capabilities.from_dict(json.loads(json.dumps(caps.to_dict())))
    assert again == caps and again.attention_precision_unavailable["flash"]["tf32"] == "same"
    old = caps.to_dict()
    del old["attention_precision_unavailable"]  # stored by a version without the field
    assert Capabilities.from_dict(old).attention_precision_unavailable == {}


@pytest.mark.parametrize(("versions", "expected"), [
    ({"torch": "2.14.1", "torchvision": "0.29.1"}, ""),
    ({"torch": "2.11.0+cu128", "torchvision": "0.26.0+cu128"}, ""),
    ({"torch": "2.6.0a0+git", "torchvision": "0.21.0a0"}, ""),  # nightlies and source builds
    ({"torch": "2.14.1", "torchaudio": "2.14.0"}, ""),
    ({"torch": "1.13.1", "torchvision": "0.14.1"}, ""),  # no pairing checked before torch 2
    ({"torch": "2.14.1"}, ""),  # no torchvision installed
    ({"torch": "2.14.1", "torchvision": "0.26.0"}, "pip install 'torchvision==0.29.*'"),
    ({"torch": "2.11.0", "torchaudio": "2.14.0"}, "pip install 'torchaudio==2.11.*'"),
])
def test_install_check_pairs_torch_with_its_companions(versions: dict, expected: str) -> None:
    from autotune.hardware import install_mismatch

    found = install_mismatch(versions)
    assert (expected in found) if expected else found == ""


def test_a_mismatched_torchvision_stops_the_probe_in_one_line() -> None:
    from autotune._errors import InstallError
    from autotune.hardware._machine import VERSIONS_ENV

    env = {**os.environ, VERSIONS_ENV: "torchvision=0.26.0"}  # stands in for the installed torchvision
    with pytest.raises(InstallError) as info:
        probe(env=env)
    message = str(info.value)
    assert "\n" not in message
    installed = __import__("importlib.metadata").metadata.version("torch")
    assert f"torch {installed} and torchvision 0.26.0 are not a matching pair" in message
    assert "built for torch 2.11" in message and "pip install 'torchvision==0." in message


def test_a_torchvision_whose_operators_do_not_load_stops_the_probe_with_the_fix(tmp_path: Path) -> None:
    # A torchvision of the matching version but another build (a CUDA one beside a CPU torch) imports with a
    # warning, and transformers then fails with "operator torchvision::nms does not exist". A library that
    # does not load stands in for it, first on the path.
    from autotune._errors import InstallError

    (tmp_path / "torchvision").mkdir()
    (tmp_path / "torchvision" / "__init__.py").write_text("")
    (tmp_path / "torchvision" / "_C.so").write_text("not a shared library")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    with pytest.raises(InstallError) as info:
        probe(env=env)
    message = str(info.value)
    assert "\n" not in message and "compiled operators do not load with torch" in message
    assert "operator torchvision::nms does not exist" in message and "pip install --force-reinstall 'torch==" in message
    # Both routes: PyTorch's index, and PyPI alone where that index cannot be reached (issue 60's CPU install).
    assert "--index-url https://download.pytorch.org/whl/" in message and "--index-url https://pypi.org/simple" in message


def test_the_cli_stops_on_a_mismatched_pair_in_one_line(tmp_path: Path) -> None:
    from autotune.hardware._machine import VERSIONS_ENV

    env = {**os.environ, VERSIONS_ENV: "torch=2.14.0,torchvision=0.26.0"}
    proc = subprocess.run([sys.executable, "-m", "autotune", "tune", f"{WORKLOADS}:train_tiny", "--studies-dir",
                           tmp_path / "studies", "--no-progress"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "torch 2.14.0 and torchvision 0.26.0 are not a matching pair" in lines[0], lines
    assert "pip install 'torchvision==0.29.*'" in lines[0]
