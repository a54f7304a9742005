"""fp32 references kept for later studies of the same target.

A second study of a target (a changed space, a larger budget) would otherwise spend its first minutes
training the same fp32 baseline again. A study's references are stored under
``<studies dir>/.references/<key>.json``, keyed by everything that determines them: the target and the
SHA-256 of its file and of the user's modules it imports, the script's own arguments and the folder trials
run in, the fp32 baseline config (its global batch with it), the per-run length, the seeds, torch's version
and the device. Any change in the key runs them again,
and ``--fresh-references`` (``fresh_references=``) always does. What the key cannot see (data files the
script reads, environment variables) is the user's to flag with ``--fresh-references``.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Optional, Sequence

from autotune import hardware as _hardware
from autotune._config import Budget
from autotune._files import write_atomic
from autotune._target import local_modules, target_digest, target_file

FOLDER = ".references"
VERSION = 1  # of the stored record: a record of another version is not read
__all__ = ["load_references", "reference_key", "store_references"]


def reference_key(*, target: str, baseline: dict[str, Any], budget: Budget, seed: int, repeats: int,
                  adopt_script_batch: bool, caps: _hardware.Capabilities,
                  script_args: Optional[Sequence[str]] = None) -> Optional[str]:
    """The SHA-256 of what determines a study's fp32 references; None when the target's file is unknown."""
    path, digest = target_file(target), target_digest(target)
    if path is None or digest is None:
        return None
    fields = {
        "version": VERSION,
        "target": target.rpartition(":")[2],
        "file": str(path.resolve()),
        "sha256": digest,
        "modules": local_modules(target),
        "baseline": baseline,
        "budget": {k: getattr(budget, k) for k in Budget.SPACE_FIELDS},
        "seed": seed,
        "repeats": repeats,
        "adopt_script_batch": adopt_script_batch,
        "torch": caps.torch,
        "device": caps.gpu_name or "cpu",
        "cuda": caps.cuda_version,
        # The script's own arguments and the folder trials run in (relative data paths resolve there).
        "script_args": list(script_args) if script_args is not None else None,
        "cwd": os.getcwd(),
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


def _path(studies_dir: Any, key: str) -> Path:
    return Path(studies_dir) / FOLDER / f"{key}.json"


def load_references(studies_dir: Any, key: str) -> Optional[tuple[dict[str, Any], dict[str, Any]]]:
    """The stored references of ``key`` and where they came from (``{"study", "created"}``); None when none
    are stored, or the record cannot be read (then they run again)."""
    try:
        record = json.loads(_path(studies_dir, key).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("version") != VERSION or not isinstance(record.get("reference"), dict):
        return None
    reference = record["reference"]
    if "baseline_config" not in reference or "reference_measurement" not in reference:
        return None
    return reference, {"study": str(record.get("study", "")), "created": str(record.get("created", ""))}


def store_references(studies_dir: Any, key: str, reference: dict[str, Any], *, study: str) -> Path:
    """Write a study's references under ``key`` atomically (a crash leaves the old record or none).

    Raises:
        OSError: the folder cannot be written.
    """
    path = _path(studies_dir, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    record = {"version": VERSION, "study": study, "created": created, "reference": reference}
    write_atomic(path, json.dumps(record))
    return path
