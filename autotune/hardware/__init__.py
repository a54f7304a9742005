"""The hardware layer: what the machine can run and who it is, and NVML readings during a trial.

``_machine`` is the only module of autotune that imports ``pynvml``.
"""

from autotune.hardware._machine import (
    Capabilities,
    GpuSampler,
    dali_availability,
    nvml_identity,
    probe,
    throttle_reason_names,
    usable_cpus,
    visible_index,
)

__all__ = [
    "Capabilities",
    "GpuSampler",
    "dali_availability",
    "nvml_identity",
    "probe",
    "throttle_reason_names",
    "usable_cpus",
    "visible_index",
]
