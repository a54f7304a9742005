"""Which worker runs a trial, whether it is still alive, and Optuna heartbeats while a trial runs."""

from __future__ import annotations

import os
import socket
import threading
from typing import Any, Optional

from autotune import hardware as _hardware


def _process_start(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _worker_id() -> str:
    """host:pid:process-start-time, so a reused pid is not taken for the same worker."""
    return f"{socket.gethostname()}:{os.getpid()}:{_process_start(os.getpid())}"


def _worker_alive(worker: str) -> bool:
    _, pid, start = worker.rsplit(":", 2)
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError):
        return True
    return not start or _process_start(int(pid)) == start


class _Heartbeat:
    """Records Optuna heartbeats for a running trial where the storage keeps them."""

    def __init__(self, storage: Any, trial_id: int) -> None:
        self.storage, self.trial_id = storage, trial_id
        self.interval = getattr(storage, "heartbeat_interval", None) if hasattr(storage, "record_heartbeat") else None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.storage.record_heartbeat(self.trial_id)
            except Exception:
                return

    def __enter__(self) -> "_Heartbeat":
        if self.interval:
            self.storage.record_heartbeat(self.trial_id)
            self._thread = threading.Thread(target=self._loop, name="autotune-heartbeat", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def _device_identity(caps: _hardware.Capabilities) -> dict[str, str]:
    """Which host and device this worker's trials run on, so different GPUs are never compared as equals."""
    identity = {"hostname": socket.gethostname()}
    if caps.cuda:
        nvml = _hardware.nvml_identity(_hardware.visible_index(0))
        identity["gpu_name"] = nvml.get("gpu_name", caps.gpu_name)
        identity["gpu_uuid"] = nvml.get("gpu_uuid", "")
        identity["device"] = identity["gpu_name"]
    else:
        identity["device"] = f"cpu ({caps.cpu_count} cores)"
    return identity


WORKER_PREFIX = "worker:"  # study attribute per worker process: the device and cores it measures on
# Set by `autotune tune --workers/--gpus` for the workers it starts: it has warned about sharing itself.
SHARING_CHECKED_ENV = "AUTOTUNE_SHARING_CHECKED"


def _measured_on(caps: _hardware.Capabilities, identity: dict[str, str]) -> dict[str, Any]:
    """What this worker's trials measure on: its GPU (by UUID, else by what CUDA_VISIBLE_DEVICES shows
    it) or, without one, the CPU cores the process may run on."""
    gpu = ""
    if caps.cuda:
        gpu = identity.get("gpu_uuid") or f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}"
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = list(range(os.cpu_count() or 1))
    return {"host": socket.gethostname(), "gpu": gpu, "cpus": cpus}


def _ranges(cpus: list[int]) -> str:
    out: list[str] = []
    for cpu in cpus:
        if out and int(out[-1].rpartition("-")[2]) == cpu - 1:
            out[-1] = f"{out[-1].partition('-')[0]}-{cpu}"
        else:
            out.append(str(cpu))
    return ",".join(out)


def _shared(mine: dict[str, Any], other: dict[str, Any]) -> str:
    """What two workers on one host both measure on ("" when nothing)."""
    if mine["gpu"] or other.get("gpu"):
        return f"GPU {mine['gpu']}" if mine["gpu"] == other.get("gpu") else ""
    common = sorted(set(mine["cpus"]) & set(other.get("cpus", [])))
    return f"CPU cores {_ranges(common)}" if common else ""


def register_worker(study: Any, caps: _hardware.Capabilities, identity: dict[str, str]) -> str:
    """Record what this worker measures on; return a warning when live workers on this host share it.

    Two workers on one GPU, or on the same cores of a CPU host, slow each other's trials, so their
    throughputs say as much about the other worker as about the config. Returns "" when nothing is shared.
    """
    me = _worker_id()
    mine = _measured_on(caps, identity)
    study.set_user_attr(WORKER_PREFIX + me, mine)
    if os.environ.get(SHARING_CHECKED_ENV):
        return ""
    sharing, what = [me], ""
    for key, other in study.user_attrs.items():
        worker = key[len(WORKER_PREFIX):]
        if not key.startswith(WORKER_PREFIX) or worker == me or not isinstance(other, dict):
            continue
        if other.get("host") != mine["host"] or not _worker_alive(worker):
            continue
        shared = _shared(mine, other)
        if shared:
            sharing.append(worker)
            what = what or shared
    if not what:
        return ""
    pids = ", ".join(sorted(w.rsplit(":", 2)[1] for w in sharing))
    hint = "its own GPU (--gpus, CUDA_VISIBLE_DEVICES)" if mine["gpu"] else "its own cores (taskset -c), or its own host"
    return (f"{len(sharing)} workers (pids {pids}) on host {mine['host']} measure on the same {what}: their trials "
            f"slow each other, so their throughputs are not comparable; give each worker {hint}")
