"""What the machine can run, and who it is. The only module that imports ``pynvml``.

The probe runs in a child process (``python -m autotune.hardware``) so that the coordinator never
creates a CUDA context of its own.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from autotune._errors import AutotuneError, InstallError


@dataclass(frozen=True)
class Capabilities:
    """What this machine can run, and its hardware/software fingerprint."""

    cuda: bool
    bf16: bool
    gpu_name: str = ""
    gpu_uuid: str = ""
    gpu_count: int = 0
    gpu_memory_gib: float = 0.0
    driver: str = ""
    cuda_version: str = ""
    torch: str = ""
    torchvision: str = ""
    python: str = ""
    hostname: str = ""
    cpu_count: int = 0
    compile: bool = True
    compile_reason: str = ""
    dali: bool = False
    extras: dict[str, Any] = field(default_factory=dict)
    # Knob values that failed a real run here, with why (the probe ran each; absent: not probed, kept).
    attention_unavailable: dict[str, str] = field(default_factory=dict)
    optimizer_impl_unavailable: dict[str, str] = field(default_factory=dict)
    checkpointing_unavailable: str = ""
    # SDPA backends that run here, but not in every precision: backend -> precision -> why (the trials that
    # pair them cannot run; the search space records each pair as a combination, not a value, to leave out).
    attention_precision_unavailable: dict[str, dict[str, str]] = field(default_factory=dict)
    compute_capability: str = ""  # the first GPU's, e.g. "9.0"; "" without CUDA
    # Why precision=fp8 cannot run on this GPU ("" where it can, or where there is no GPU: the space says why).
    fp8_unavailable: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Capabilities":
        return cls(**data)

    @property
    def device_label(self) -> str:
        return self.gpu_name if self.cuda else f"CPU ({self.cpu_count} cores)"


def nvml_identity(index: int = 0) -> dict[str, str]:
    """GPU name, UUID and driver from NVML; empty where NVML is missing or there is no GPU."""
    try:
        import pynvml
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
    except Exception:  # NVML raises its own error types when no driver is loaded
        return {}
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)

        def text(value: Any) -> str:
            return value.decode() if isinstance(value, bytes) else str(value)

        return {
            "gpu_name": text(pynvml.nvmlDeviceGetName(handle)),
            "gpu_uuid": text(pynvml.nvmlDeviceGetUUID(handle)),
            "driver": text(pynvml.nvmlSystemGetDriverVersion()),
        }
    except Exception:
        return {}
    finally:
        pynvml.nvmlShutdown()


def machine_load(*, exclude_pids: Iterable[int] = ()) -> dict[str, Any]:
    """What else loads the machine now: the 1-minute load average and the processes on each GPU (NVML)
    other than ``exclude_pids``. Cheap enough to read around every run of a race (milliseconds)."""
    load: dict[str, Any] = {"load_1min": round(os.getloadavg()[0], 2), "cpus": usable_cpus()}
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no pynvml, no driver: the load average alone
        return load
    try:
        mine = set(exclude_pids)
        others = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            for proc in (list(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
                         + list(pynvml.nvmlDeviceGetGraphicsRunningProcesses(handle))):
                if proc.pid not in mine:
                    others.append({"gpu": index, "pid": proc.pid,
                                   "memory_mib": round((proc.usedGpuMemory or 0) / 2**20, 1)})
        load["gpu_processes"] = others
    except Exception:
        pass
    finally:
        pynvml.nvmlShutdown()
    return load


# "torch=2.14.0,torchvision=0.26.0": stands in for the installed versions that the install check reads (tests).
VERSIONS_ENV = "AUTOTUNE_VERSIONS"
# Packages built against one torch release: name -> the torch minor version its own minor version goes with.
TORCH_COMPANIONS: dict[str, tuple[int, Callable[[int], int]]] = {
    "torchvision": (0, lambda minor: minor - 15),  # torchvision 0.N goes with torch 2.(N-15): 0.29 with 2.14
    "torchaudio": (2, lambda minor: minor),  # torchaudio 2.N goes with torch 2.N
}


def installed_versions(names: Iterable[str]) -> dict[str, str]:
    """The installed versions of ``names`` (those installed), as ``VERSIONS_ENV`` may override them."""
    found: dict[str, str] = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    for item in filter(None, os.environ.get(VERSIONS_ENV, "").split(",")):
        name, _, version = item.partition("=")
        found[name.strip()] = version.strip()
    return found


def _major_minor(version: str) -> Optional[tuple[int, int]]:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def install_mismatch(versions: Optional[dict[str, str]] = None) -> str:
    """Why torch and an installed companion (torchvision, torchaudio) are no matching pair, in one line with
    the fix; "" when they match, or where no pairing is known (torch 1.x, an unreadable version).

    Args:
        versions: Package name -> version; ``None`` reads the installed ones (``installed_versions``).
    """
    versions = installed_versions(["torch", *TORCH_COMPANIONS]) if versions is None else versions
    torch_version = _major_minor(versions.get("torch", ""))
    if torch_version is None or torch_version[0] != 2:
        return ""
    for name, (major, torch_minor) in TORCH_COMPANIONS.items():
        theirs = _major_minor(versions.get(name, ""))
        if theirs is None or theirs[0] != major or torch_minor(theirs[1]) == torch_version[1]:
            continue
        wanted = torch_version[1] + (15 if name == "torchvision" else 0)
        return (f"torch {versions['torch']} and {name} {versions[name]} are not a matching pair ({name} "
                f"{major}.{theirs[1]} is built for torch 2.{torch_minor(theirs[1])}); install the {name} of this "
                f"torch: pip install '{name}=={major}.{wanted}.*' (or reinstall torch and {name} together)")
    return ""


def torchvision_ops_failure() -> str:
    """Why torchvision's compiled operators do not load beside this torch, in one line with the fix; "" when
    they load or torchvision is not installed.

    A matching version pair can still be two builds (a CUDA torchvision beside a CPU torch, as a fallback
    package index installs them): torchvision then imports with a warning, and a library that uses its
    operators (transformers does) fails later with ``operator torchvision::nms does not exist``.
    """
    import importlib.machinery
    import importlib.util

    try:
        spec = importlib.util.find_spec("torchvision")
    except (ImportError, ValueError):
        return ""
    if spec is None or not spec.submodule_search_locations:
        return ""
    folder = Path(next(iter(spec.submodule_search_locations)))
    libraries = sorted(p for suffix in importlib.machinery.EXTENSION_SUFFIXES for p in folder.glob(f"_C*{suffix}"))
    if not libraries:
        return ""
    import torch

    try:
        torch.ops.load_library(str(libraries[0]))
    except Exception as exc:  # OSError (an undefined symbol, a missing CUDA library), RuntimeError
        versions = installed_versions(["torch", "torchvision"])
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        index = "cpu" if torch.version.cuda is None else "cu" + str(torch.version.cuda).replace(".", "")
        pair = (f"'torch=={versions.get('torch', torch.__version__).split('+')[0]}' "
                f"'torchvision=={versions.get('torchvision', '?').split('+')[0]}'")
        return (f"torchvision {versions.get('torchvision', '?')}'s compiled operators do not load with torch "
                f"{versions.get('torch', torch.__version__)} ({why}): they are builds for different devices or "
                "releases (a CUDA torchvision beside a CPU torch, as a fallback package index installs them), and "
                "libraries that use torchvision (transformers) fail with 'operator torchvision::nms does not "
                f"exist'; reinstall both from one index: pip install --force-reinstall {pair} --index-url "
                f"https://download.pytorch.org/whl/{index}, or where that index cannot be reached, from PyPI alone "
                f"(its CUDA builds, which run on a CPU too; about 6 GB installed): pip install --force-reinstall "
                f"{pair} --index-url https://pypi.org/simple")
    return ""


def check_install(versions: Optional[dict[str, str]] = None) -> None:
    """Stop when torch and an installed companion are no matching pair (see ``install_mismatch``).

    Raises:
        InstallError: the pair, both versions and the fix, in one line.
    """
    mismatch = install_mismatch(versions)
    if mismatch:
        raise InstallError(mismatch)


def _probe_here() -> Capabilities:
    import torch

    # The installed version, read without importing torchvision (seconds, paid by every study's probe).
    try:
        tv = importlib.metadata.version("torchvision")
    except importlib.metadata.PackageNotFoundError:
        tv = ""
    cuda = torch.cuda.is_available()
    info: dict[str, Any] = {}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        info = {
            "gpu_name": props.name,
            "gpu_count": torch.cuda.device_count(),
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "cuda_version": torch.version.cuda or "",
            "compute_capability": f"{props.major}.{props.minor}",
            "fp8_unavailable": float8_unavailable((props.major, props.minor), props.name),
        }
        info.update(nvml_identity(0))
    bf16 = bool(torch.cuda.is_bf16_supported()) if cuda else True
    compile_ok, compile_reason = True, ""
    if sys.platform == "win32":
        compile_ok, compile_reason = False, "torch.compile is not supported on Windows"
    elif not cuda:
        import shutil

        if not (shutil.which("cc") or shutil.which("gcc") or shutil.which("g++")):
            compile_ok, compile_reason = False, "torch.compile on CPU needs a C++ compiler and none was found"
    return Capabilities(
        cuda=cuda,
        bf16=bf16,
        torch=str(torch.__version__),  # a plain str: torch.__version__ is a TorchVersion
        torchvision=tv,
        python=platform.python_version(),
        hostname=socket.gethostname(),
        cpu_count=usable_cpus(),
        compile=compile_ok,
        compile_reason=compile_reason,
        **_probe_dali(),
        **info,
        **_probe_kernels(torch.device("cuda" if cuda else "cpu")),
    )


# The SDPA backend behind each value of the attention knob ("auto" and "explicit" always run).
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                 "math": "MATH"}


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


# The precision knob's values whose trials feed SDPA each dtype (tf32 computes in float32 tensors).
DTYPE_PRECISIONS = {"float32": ("fp32", "tf32"), "bfloat16": ("bf16", "fp8"), "float16": ("fp16",)}


def sdpa_unavailable(device: Any) -> dict[str, str]:
    """The attention knob's SDPA backends that cannot run causal attention forward and backward here, with why.

    Each backend is tried in float32, bfloat16 and float16 (flash and cuDNN take only the half types on
    CUDA); one that runs in none of them is unavailable. One that runs in some is kept, and the precisions
    it cannot take are in ``sdpa_precision_unavailable``.
    """
    return sdpa_probe(device)[0]


def sdpa_precision_unavailable(device: Any) -> dict[str, dict[str, str]]:
    """For each SDPA backend that runs here in some dtype, the precision values it cannot run in, with why."""
    return sdpa_probe(device)[1]


def sdpa_probe(device: Any) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """``(sdpa_unavailable, sdpa_precision_unavailable)`` from one pass over the backends and dtypes."""
    import warnings

    import torch
    from torch.nn import functional as F

    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return {v: f"torch {torch.__version__} has no torch.nn.attention.sdpa_kernel" for v in SDPA_BACKENDS}, {}
    out: dict[str, str] = {}
    partial: dict[str, dict[str, str]] = {}
    where = device.type.upper()
    for value, member in SDPA_BACKENDS.items():
        backend = getattr(SDPBackend, member, None)
        if backend is None:
            out[value] = f"torch {torch.__version__} has no SDPBackend.{member}"
            continue
        problems: dict[str, str] = {}  # dtype name -> torch's first line
        for name in DTYPE_PRECISIONS:
            q = torch.randn(1, 2, 16, 64, device=device, dtype=getattr(torch, name), requires_grad=True)
            try:
                with warnings.catch_warnings(), sdpa_kernel(backend):
                    warnings.simplefilter("ignore")  # torch warns why each kernel declined before it raises
                    F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
            except RuntimeError as exc:
                problems[name] = _first_line(exc).split(". ")[0].rstrip(".")
        if len(problems) == len(DTYPE_PRECISIONS):
            out[value] = f"SDPA has no {value} kernel on {where} here (torch: {next(iter(problems.values()))})"
        elif problems:
            partial[value] = {precision: f"SDPA has no {value} kernel for {name} on {where} here (torch: {why})"
                              for name, why in problems.items() for precision in DTYPE_PRECISIONS[name]}
    return out, partial


def optimizer_impl_unavailable(device: Any) -> dict[str, str]:
    """The optimizer_impl values a torch.optim.AdamW step cannot run with here, with why."""
    import torch

    out = {}
    for value in ("foreach", "fused"):
        param = torch.nn.Parameter(torch.randn(8, device=device))
        param.grad = torch.randn(8, device=device)
        try:
            torch.optim.AdamW([param], lr=1e-3, **{value: True}).step()
        except (RuntimeError, ValueError, TypeError) as exc:
            out[value] = f"torch.optim.AdamW({value}=True) does not step on {device.type.upper()} here: {_first_line(exc)}"
    return out


def checkpointing_unavailable(device: Any) -> str:
    """Why torch.utils.checkpoint (use_reentrant=False) cannot recompute a layer here; "" when it can."""
    import torch
    from torch.utils.checkpoint import checkpoint

    layer = torch.nn.Linear(8, 8).to(device)
    try:
        checkpoint(layer, torch.randn(2, 8, device=device, requires_grad=True), use_reentrant=False).sum().backward()
    except (RuntimeError, TypeError) as exc:
        return f"torch.utils.checkpoint failed here: {_first_line(exc)}"
    return ""


def _probe_kernels(device: Any) -> dict[str, Any]:
    attention, attention_precision = sdpa_probe(device)
    return {"attention_unavailable": attention, "attention_precision_unavailable": attention_precision,
            "optimizer_impl_unavailable": optimizer_impl_unavailable(device),
            "checkpointing_unavailable": checkpointing_unavailable(device)}


FP8_CAPABILITY = (8, 9)  # float8 Tensor Cores: Ada (8.9), Hopper (9.0) and newer


def float8_unavailable(capability: tuple[int, int], gpu_name: str) -> str:
    """Why ``precision=fp8`` cannot run on a GPU of this compute capability here; "" when it can."""
    if capability < FP8_CAPABILITY:
        need = ".".join(map(str, FP8_CAPABILITY))
        return (f"{gpu_name} is compute capability {capability[0]}.{capability[1]}: float8 matmuls need {need} "
                "or newer (Ada, Hopper)")
    try:
        import torchao.float8  # noqa: F401 - convert_to_float8_training lives here
    except Exception as exc:  # a broken install fails with whatever its extensions raise
        why = "torchao is not installed" if isinstance(exc, ModuleNotFoundError) and exc.name == "torchao" \
            else f"importing torchao.float8 failed: {type(exc).__name__}: {exc}".splitlines()[0]
        return f"{why} (install the `fp8` extra: pip install -e '.[fp8]')"
    return ""


def dali_availability() -> tuple[bool, str]:
    """``(True, version)`` when ``nvidia.dali`` and its PyTorch plugin import, else ``(False, why)``."""
    import importlib.util

    try:
        found = importlib.util.find_spec("nvidia.dali") is not None
    except ModuleNotFoundError:  # no "nvidia" namespace at all
        found = False
    if not found:
        return False, "nvidia.dali is not installed"
    try:
        import nvidia.dali
        import nvidia.dali.plugin.pytorch  # noqa: F401 - the iterator lives here
    except Exception as exc:  # a broken install fails with whatever its native libraries raise
        return False, f"importing nvidia.dali failed: {type(exc).__name__}: {exc}".splitlines()[0]
    return True, str(getattr(nvidia.dali, "__version__", ""))


def _probe_dali() -> dict[str, Any]:
    """Whether ``nvidia.dali`` imports here (a wheel can be present and still fail to load), and why not."""
    ok, detail = dali_availability()
    return {"dali": ok, "extras": {"dali_version" if ok else "dali_reason": detail}}


def usable_cpus() -> int:
    """Cores this process may run on: a job pinned with taskset or a cgroup cpuset sees its share, not the host's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


_PROBE_MARK = "autotune-probe-answer: "


def probe(*, target: Optional[str] = None, timeout: float = 300.0, env: Optional[dict[str, str]] = None) -> Capabilities:
    """Probe the machine in a child process, and check there that ``target`` imports.

    Raises:
        WorkloadError: ``target`` cannot be imported.
        InstallError: torch and an installed companion (torchvision) are no matching pair.
        AutotuneError: the child could not import torch or did not answer.
    """
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "autotune.hardware", *([target] if target else [])],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired:
        raise AutotuneError(f"the hardware probe did not answer within {timeout:.0f}s") from None
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise AutotuneError(f"the hardware probe failed: {tail}")
    lines = [line[len(_PROBE_MARK):] for line in proc.stdout.splitlines() if line.startswith(_PROBE_MARK)]
    if not lines:
        tail = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or ["no output"])[-1]
        raise no_answer_error(target, tail)
    return capabilities_from_answer(json.loads(lines[-1]))


def no_answer_error(target: Optional[str], tail: str) -> AutotuneError:
    """The error of a probe process that ended without answering, with the last line it printed."""
    return AutotuneError(f"the hardware probe gave no answer (did {target or 'it'} exit at import?): {tail[:300]}")


def capabilities_from_answer(answer: dict[str, Any]) -> Capabilities:
    """The probe's answer as a record.

    Raises:
        InstallError: the answer says torch and a companion are no matching pair.
        WorkloadError: the answer says the target did not import.
    """
    from autotune._errors import WorkloadError

    if answer.get("install_error"):
        raise InstallError(answer["install_error"])
    if answer.get("target_error"):
        raise WorkloadError(answer["target_error"])
    return Capabilities.from_dict(answer["capabilities"])


def probe_answer(target: Optional[str]) -> dict[str, Any]:
    """Probe this process's machine and import ``target`` here: what a probe process answers (JSON-able)."""
    answer: dict[str, Any] = {"capabilities": _probe_here().to_dict()}
    mismatch = install_mismatch() or torchvision_ops_failure()
    if mismatch:
        answer["install_error"] = mismatch
        return answer
    if target:
        from autotune._target import load_target_or_say_why

        try:
            load_target_or_say_why(target)
        except AutotuneError as exc:
            answer["target_error"] = str(exc)
    return answer


def probe_into(connection: Any, target: Optional[str], log_path: str, environ: Optional[dict[str, str]] = None,
               cwd: Optional[str] = None) -> None:
    """The body of a probe process forked from the trial server: the answer goes back through ``connection``.

    What the user's module prints at import goes to ``log_path``, not to the coordinator's terminal. With
    ``environ`` and ``cwd`` (the coordinator's), the target is imported in them, as a trial imports it.
    """
    if environ is not None:
        os.environ.clear()
        os.environ.update({k: v for k, v in environ.items() if k != "AUTOTUNE_TRIAL_CWD"})
    if cwd:
        try:
            os.chdir(cwd)
        except OSError:
            pass  # the target's own path then says what is missing
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    # As JSON text, as the subprocess probe answers: a pickled answer could carry torch objects (torch's
    # version string is one), and unpickling them would import torch into the coordinator (seconds).
    connection.send(json.dumps(probe_answer(target)))
    connection.close()
    sys.stdout.flush()
    sys.stderr.flush()


def _main(argv: list[str]) -> None:
    answer = probe_answer(argv[0] if argv else None)
    # On a line of its own, marked: the user's module may have printed, with or without a newline.
    sys.stdout.write("\n" + _PROBE_MARK + json.dumps(answer) + "\n")
    sys.stdout.flush()


class GpuSampler:
    """Samples NVML readings in a background thread while the timed windows run.

    ``summary()`` gives mean, p5 and p95 of each reading (PCIe throughput in MB/s each way among them),
    the fraction of samples in which the clocks were held back for a reason other than idling, and the
    names of those reasons. A reading the device does not support is left out. Without NVML or a GPU
    it samples nothing.

    Args:
        index: NVML device index (the first visible GPU by default).
        interval: Seconds between samples.
        nvml: An object with pynvml's functions; defaults to the ``pynvml`` module.
    """

    READINGS = ("sm_clock_mhz", "gpu_util_pct", "mem_used_gib", "power_w", "temperature_c", "pcie_tx_mb_s",
                "pcie_rx_mb_s")

    def __init__(self, *, index: int = 0, interval: float = 0.1, nvml: Any = None) -> None:
        import threading

        self.interval = interval
        self.samples: dict[str, list[float]] = {k: [] for k in self.READINGS}
        self.throttled: list[bool] = []  # per sample: any clock event reason other than idle
        self.throttle_reasons: set[str] = set()
        self._pcie = True
        self._reasons: Any = "unknown"  # the reasons function this driver has; None when neither works
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._nvml = nvml
        self._handle: Any = None
        if self._nvml is None:
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
            except Exception:  # no library or no driver: sample nothing
                self._nvml = None
        if self._nvml is not None:
            try:
                self._handle = self._nvml.nvmlDeviceGetHandleByIndex(visible_index(index))
            except Exception:
                self._nvml = None

        self.energy = EnergyMeter(index=index, nvml=self._nvml) if self._nvml is not None else None

    @property
    def active(self) -> bool:
        return self._nvml is not None

    def sample_once(self) -> None:
        nv, h = self._nvml, self._handle
        self.samples["sm_clock_mhz"].append(float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)))
        self.samples["gpu_util_pct"].append(float(nv.nvmlDeviceGetUtilizationRates(h).gpu))
        self.samples["mem_used_gib"].append(nv.nvmlDeviceGetMemoryInfo(h).used / 2**30)
        self.samples["power_w"].append(nv.nvmlDeviceGetPowerUsage(h) / 1000.0)
        self.samples["temperature_c"].append(float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)))
        if self._pcie:
            try:  # KB/s over NVML's own 20 ms window; not supported on some boards and vGPUs
                tx = nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_TX_BYTES)
                rx = nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_RX_BYTES)
            except Exception:
                self._pcie = False
            else:
                self.samples["pcie_tx_mb_s"].append(tx / 1000.0)
                self.samples["pcie_rx_mb_s"].append(rx / 1000.0)
        reasons = self._clock_event_reasons()
        if reasons is not None:
            names = throttle_reason_names(reasons)
            self.throttled.append(bool(names))
            self.throttle_reasons.update(names)

    def _clock_event_reasons(self) -> Optional[int]:
        # Drivers before r535 only have the older name, "ThrottleReasons", for the same bit mask.
        nv, h = self._nvml, self._handle
        if self._reasons == "unknown":
            self._reasons = None
            for name in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
                try:
                    value = int(getattr(nv, name)(h))
                except Exception:
                    continue
                self._reasons = getattr(nv, name)
                return value
            return None
        if self._reasons is None:
            return None
        try:
            return int(self._reasons(h))
        except Exception:
            self._reasons = None
            return None

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample_once()
            except Exception:
                return
            self._stop.wait(self.interval)

    def start(self) -> None:
        import threading

        if not self.active or self._thread is not None:
            return
        if self.energy is not None:
            self.energy.start()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="autotune-nvml", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            if self.energy is not None:
                self.energy.stop()

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, values in self.samples.items():
            if not values:
                continue
            ordered = sorted(values)
            out[f"gpu.{name}.mean"] = round(sum(values) / len(values), 2)
            out[f"gpu.{name}.p5"] = round(_percentile(ordered, 5), 2)
            out[f"gpu.{name}.p95"] = round(_percentile(ordered, 95), 2)
        if self.samples["sm_clock_mhz"]:
            out["gpu.samples"] = len(self.samples["sm_clock_mhz"])
        if self.throttled:
            out["gpu.throttle_fraction"] = round(sum(self.throttled) / len(self.throttled), 3)
            out["gpu.throttle_reasons"] = sorted(self.throttle_reasons)
        if self.energy is not None and self.energy.joules is not None:
            out["gpu.energy_j"] = round(self.energy.joules, 3)
        return out


ENERGY_NOT_MEASURED = "not measured"


class EnergyMeter:
    """The GPU's energy counter (``nvmlDeviceGetTotalEnergyConsumption``, millijoules since the driver loaded)
    read at ``start()`` and ``stop()``: ``joules`` is what the device drew in between. It only reads: no power
    setting is changed. Without NVML, a GPU or the counter (boards before Volta), ``joules`` stays None and
    ``why`` says so.

    Args:
        index: CUDA device index (mapped to NVML's through ``CUDA_VISIBLE_DEVICES``).
        nvml: An object with pynvml's functions, already initialised; defaults to the ``pynvml`` module.
    """

    def __init__(self, *, index: int = 0, nvml: Any = None) -> None:
        self.joules: Optional[float] = None
        self.why = f"{ENERGY_NOT_MEASURED}: no NVML (no GPU or no driver)"
        self._nvml = nvml
        self._handle: Any = None
        self._start: Optional[int] = None
        if self._nvml is None:
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
            except Exception:  # no library or no driver: measure nothing
                return
        try:
            self._handle = self._nvml.nvmlDeviceGetHandleByIndex(visible_index(index))
        except Exception:
            self._nvml = None
            self.why = f"{ENERGY_NOT_MEASURED}: NVML knows no GPU {index}"

    @property
    def active(self) -> bool:
        return self._handle is not None

    def _read(self) -> Optional[int]:
        try:
            return int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))
        except Exception:  # not supported on this board or driver
            self.why = f"{ENERGY_NOT_MEASURED}: this GPU's driver gives no energy counter"
            self._handle = None
            return None

    def start(self) -> None:
        self.joules = None
        self._start = self._read() if self.active else None

    def reading(self) -> Optional[float]:
        """Joules since ``start()`` so far, the counter left running (None when not measured)."""
        if self._start is None or not self.active:
            return None
        now = self._read()
        return None if now is None else max(0, now - self._start) / 1000.0

    def stop(self) -> Optional[float]:
        """Joules since ``start()`` (None when not measured)."""
        if self._start is not None and self.active:
            end = self._read()
            if end is not None:
                self.joules = max(0, end - self._start) / 1000.0
        self._start = None
        return self.joules


# NVML's clock event (throttle) reason bits; 0x1 (GPU idle) is not a throttle.
THROTTLE_REASONS = {
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
    0x200: "board_limit",
    0x400: "reliability",
}


def throttle_reason_names(mask: int) -> list[str]:
    """The names of the non-idle reasons set in an NVML clock event reason mask (unknown bits in hex)."""
    names = []
    bit = 0x2
    while bit <= mask:
        if mask & bit:
            names.append(THROTTLE_REASONS.get(bit, hex(bit)))
        bit <<= 1
    return names


def _percentile(ordered: list[float], pct: float) -> float:
    k = (len(ordered) - 1) * pct / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def visible_index(index: int) -> int:
    # NVML numbers every GPU on the host; CUDA_VISIBLE_DEVICES renumbers them for torch.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    parts = [p.strip() for p in visible.split(",") if p.strip()]
    if parts and index < len(parts) and parts[index].isdigit():
        return int(parts[index])
    return index
