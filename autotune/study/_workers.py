"""Which worker runs a trial, whether it is still alive, and Optuna heartbeats while a trial runs."""

from __future__ import annotations

import os
import socket
import threading
import time
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


LEASE_KEY = "heartbeat"  # trial user attribute: when its worker last renewed it (a journal's lease)


class _Heartbeat:
    """Records Optuna heartbeats for a running trial where the storage keeps them, else renews its lease
    (the ``heartbeat`` user attribute, wall-clock seconds) where the storage asks for one (a journal)."""

    def __init__(self, storage: Any, trial_id: int) -> None:
        self.storage, self.trial_id = storage, trial_id
        self.lease = hasattr(storage, "lease_interval")
        if self.lease:
            self.interval: Optional[float] = storage.lease_interval
        else:
            keeps = hasattr(storage, "record_heartbeat")
            self.interval = getattr(storage, "heartbeat_interval", None) if keeps else None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _beat(self) -> None:
        if self.lease:
            self.storage.set_trial_user_attr(self.trial_id, LEASE_KEY, round(time.time(), 3))
        else:
            self.storage.record_heartbeat(self.trial_id)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
            except Exception:
                return  # the trial was finished (another worker took it over) or the storage is gone

    def __enter__(self) -> "_Heartbeat":
        if self.interval:
            self._beat()
            self._thread = threading.Thread(target=self._loop, name="autotune-heartbeat", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


# A lease's timing on a storage that keeps neither heartbeats nor leases (an RDB storage opened without a
# grace period): the journal's defaults.
DEFAULT_LEASE_INTERVAL = 10.0
DEFAULT_LEASE_GRACE = 60.0


def lease_timing(storage: Any) -> tuple[float, float]:
    """How often a lease is renewed and after how long without a renewal it is stale, in seconds: a
    journal's lease, else the RDB storage's heartbeat, else the defaults."""
    storage = getattr(storage, "_backend", storage)  # Optuna wraps RDB storages in a cache
    if hasattr(storage, "lease_grace_period"):
        return float(storage.lease_interval), float(storage.lease_grace_period)
    interval, grace = getattr(storage, "heartbeat_interval", None), getattr(storage, "grace_period", None)
    if interval and grace:
        return float(interval), float(grace)
    return DEFAULT_LEASE_INTERVAL, DEFAULT_LEASE_GRACE


class LeaseWatch:
    """Judges leases of workers on other hosts: running trials on a storage without heartbeats, and the
    race's claim (``_confirm``) on any storage.

    A lease is stale when it (else the trial's start) is older than the grace period by the wall clock,
    and this process has itself seen it unrenewed for two renewal intervals: a worker whose clock runs
    behind still renews, so a skewed clock alone never takes a live worker's place.

    Args:
        storage: The study's storage; its timing is ``lease_timing``'s.
    """

    def __init__(self, storage: Any) -> None:
        self.interval, self.grace = lease_timing(storage)
        self._seen: dict[Any, tuple[float, float]] = {}  # what holds the lease -> (lease, monotonic first seen)

    def stale_for(self, trial: Any) -> Optional[float]:
        """Seconds since the trial's lease was renewed when it is stale, else None."""
        lease = trial.user_attrs.get(LEASE_KEY)
        if not isinstance(lease, (int, float)):
            if trial.datetime_start is None:
                return None
            lease = trial.datetime_start.timestamp()
        return self.stale_since(trial._trial_id, lease)

    def stale_since(self, holder: Any, lease: float) -> Optional[float]:
        """Seconds since ``holder``'s lease (wall-clock seconds) was renewed when it is stale, else None."""
        now = time.monotonic()
        seen = self._seen.get(holder)
        if seen is None or seen[0] != lease:
            self._seen[holder] = (lease, now)
            return None
        age = time.time() - lease
        if age > self.grace and now - seen[1] >= 2 * self.interval:
            return age
        return None


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
