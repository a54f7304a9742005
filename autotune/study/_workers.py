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
