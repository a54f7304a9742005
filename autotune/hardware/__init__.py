"""The hardware layer: what the machine can run and who it is, and NVML readings during a trial
(``GpuSampler``; ``EnergyMeter`` reads the energy counter).

``_machine`` is the only module of autotune that imports ``pynvml``.
"""

from autotune.hardware._machine import (
    ENERGY_NOT_MEASURED,
    Capabilities,
    EnergyMeter,
    GpuSampler,
    check_install,
    dali_availability,
    install_mismatch,
    machine_load,
    nvml_identity,
    probe,
    throttle_reason_names,
    usable_cpus,
    visible_index,
)
from autotune.hardware._mps import MPS_MODES, MpsDaemon, MpsSession, find_running_daemon, open_mps

__all__ = [
    "MPS_MODES",
    "ENERGY_NOT_MEASURED",
    "Capabilities",
    "EnergyMeter",
    "GpuSampler",
    "check_install",
    "MpsDaemon",
    "MpsSession",
    "dali_availability",
    "install_mismatch",
    "machine_load",
    "find_running_daemon",
    "nvml_identity",
    "open_mps",
    "probe",
    "throttle_reason_names",
    "usable_cpus",
    "visible_index",
]
