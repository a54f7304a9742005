"""Helpers for testing code that uses autotune without the hardware it measures.

``FakeNvml`` stands in for the ``pynvml`` module in ``GpuSampler(nvml=...)``, answering from scripted
readings, so the NVML summaries can be tested on a machine without a GPU. ``replay_train`` is a
``train_fn`` that replays a recorded table (``replay_env`` sets it up, ``config_key`` names a config in a
scripted-noise table), so a real study runs on recorded measurements.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Mapping, Sequence

from autotune.search._simulate import config_key, replay_env, replay_train

__all__ = ["FakeNvml", "config_key", "replay_env", "replay_train"]


class FakeNvml:
    """The subset of ``pynvml`` that ``GpuSampler`` calls, answering from scripted readings.

    The n-th call of each function answers from ``readings[n]`` (the last reading once they run out).
    A key missing from a reading makes its function raise ``NVMLError`` as an unsupported query does.

    Args:
        readings: One mapping per sample, with any of ``sm_clock_mhz``, ``gpu_util_pct``,
            ``mem_used_gib``, ``power_w``, ``temperature_c``, ``pcie_tx_kb_s``, ``pcie_rx_kb_s``
            (NVML reports PCIe throughput in KB/s), ``clock_event_reasons`` (NVML's bit mask) and
            ``energy_mj`` (the energy counter, millijoules since the driver loaded).
        clocks_event_api: ``False`` acts as a driver older than r535, which only has
            ``nvmlDeviceGetCurrentClocksThrottleReasons``.
        devices: How many GPUs ``nvmlDeviceGetHandleByIndex`` knows.
    """

    NVML_CLOCK_SM = 1
    NVML_TEMPERATURE_GPU = 0
    NVML_PCIE_UTIL_TX_BYTES = 0
    NVML_PCIE_UTIL_RX_BYTES = 1

    class NVMLError(Exception):
        """What pynvml raises; the real one has a subclass per NVML return code."""

    def __init__(self, readings: Sequence[Mapping[str, Any]], *, clocks_event_api: bool = True,
                 devices: int = 1) -> None:
        if not readings:
            raise ValueError("FakeNvml needs at least one reading")
        self.readings = [dict(r) for r in readings]
        self.clocks_event_api = clocks_event_api
        self.devices = devices
        self.calls: dict[str, int] = {}
        self.initialised = False

    def _next(self, function: str, key: str) -> Any:
        n = self.calls.get(function, 0)
        self.calls[function] = n + 1
        reading = self.readings[min(n, len(self.readings) - 1)]
        if key not in reading:
            raise self.NVMLError(f"{function}: not supported")
        return reading[key]

    def nvmlInit(self) -> None:
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.initialised = False

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        if not 0 <= index < self.devices:
            raise self.NVMLError(f"no GPU at index {index}")
        return SimpleNamespace(index=index)

    def nvmlDeviceGetClockInfo(self, handle: Any, clock: int) -> int:
        return self._next("nvmlDeviceGetClockInfo", "sm_clock_mhz")

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        return SimpleNamespace(gpu=self._next("nvmlDeviceGetUtilizationRates", "gpu_util_pct"), memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        used = int(self._next("nvmlDeviceGetMemoryInfo", "mem_used_gib") * 2**30)
        return SimpleNamespace(used=used, total=used, free=0)

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return int(self._next("nvmlDeviceGetPowerUsage", "power_w") * 1000)  # milliwatts

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        return self._next("nvmlDeviceGetTemperature", "temperature_c")

    def nvmlDeviceGetPcieThroughput(self, handle: Any, counter: int) -> int:
        key = "pcie_tx_kb_s" if counter == self.NVML_PCIE_UTIL_TX_BYTES else "pcie_rx_kb_s"
        return self._next(f"nvmlDeviceGetPcieThroughput[{key}]", key)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        if not self.clocks_event_api:
            raise self.NVMLError("nvmlDeviceGetCurrentClocksEventReasons: function not found")
        return self._next("nvmlDeviceGetCurrentClocksEventReasons", "clock_event_reasons")

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any) -> int:
        return self._next("nvmlDeviceGetCurrentClocksThrottleReasons", "clock_event_reasons")

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:
        return int(self._next("nvmlDeviceGetTotalEnergyConsumption", "energy_mj"))  # millijoules

    def count(self, function: str) -> int:
        """How many times ``function`` was called."""
        return self.calls.get(function, 0)
