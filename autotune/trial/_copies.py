"""One copy of a co-located trial (``processes_per_gpu`` > 1), from inside it: the start barrier and the
end of the timed phase, agreed with the other copies through files in the trial's folder.

The launcher (``autotune.study._colocate``) starts N copies of ``train_fn`` at once, each with its own seed,
and tells each where it stands through ``COPY_ENV`` / ``COPIES_ENV`` / ``COPY_SYNC_ENV``. So that every
copy is timed while all the others load the device too:

- after its warm-up each copy writes ``ready-<k>`` and waits until all N have (the start barrier), so no
  copy's first window runs while another still compiles or warms up;
- after its last window a copy writes ``timed-<k>`` (its timed span) and keeps training, untimed, until
  every copy has written one, so no copy's window runs while another has already stopped.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from autotune._errors import AutotuneError
from autotune._files import write_atomic

COPY_ENV = "AUTOTUNE_COPY"  # this copy's index, 0 .. N-1
COPIES_ENV = "AUTOTUNE_COPIES"  # N
COPY_SYNC_ENV = "AUTOTUNE_COPY_SYNC"  # the folder the copies meet in
BARRIER_ENV = "AUTOTUNE_COPY_BARRIER_SECONDS"  # how long a copy waits for the others at the start barrier
DEFAULT_BARRIER_SECONDS = 300.0
POLL_SECONDS = 0.002  # the barrier's resolution: the copies start their windows within this of each other
# Extras a copy hands to the launcher (read into ``CopyRun``, then dropped from the trial's measurement).
SPAN_EXTRAS = ("copy.timed_start", "copy.timed_end", "copy.busy_end", "copy.overtime_steps")


class CopyBarrierTimeout(AutotuneError):
    """The other copies of a co-located trial did not reach the start barrier in time."""


@dataclass
class CopySync:
    """Where this copy stands among the copies of its trial, and the files they agree through."""

    index: int
    count: int
    folder: Path
    barrier_seconds: float = DEFAULT_BARRIER_SECONDS
    _all_timed: bool = False

    def _marks(self, prefix: str) -> int:
        try:
            return sum(1 for name in os.listdir(self.folder) if name.startswith(prefix))
        except OSError:
            return 0

    def _write(self, name: str, data: dict) -> None:
        write_atomic(self.folder / name, json.dumps(data))  # a mark is complete when it is seen

    def arrive(self) -> float:
        """The start barrier: mark this copy ready and wait for every copy; returns the seconds waited.

        Raises:
            CopyBarrierTimeout: some copy was not ready within ``barrier_seconds``.
        """
        self.folder.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        self._write(f"ready-{self.index}", {"at": time.time()})
        while self._marks("ready-") < self.count:
            waited = time.monotonic() - start
            if waited > self.barrier_seconds:
                missing = [k for k in range(self.count) if not (self.folder / f"ready-{k}").exists()]
                raise CopyBarrierTimeout(
                    f"copy {self.index} of {self.count}: copies {', '.join(map(str, missing))} did not finish their "
                    f"warm-up within {self.barrier_seconds:.0f}s of this one (the start barrier of the timed windows)")
            time.sleep(POLL_SECONDS)
        return time.monotonic() - start

    def timed_done(self, start: float, end: float) -> None:
        """This copy's last window has ended (wall-clock span ``start`` .. ``end``)."""
        self._write(f"timed-{self.index}", {"start": start, "end": end})

    def all_timed(self) -> bool:
        """Every copy has finished its timed windows (then stays true)."""
        if not self._all_timed:
            self._all_timed = self._marks("timed-") >= self.count
        return self._all_timed


def copy_from_env(environ: Optional[dict[str, str]] = None) -> Optional[CopySync]:
    """This process's place among co-located copies, or None when it is not one of several."""
    env = os.environ if environ is None else environ
    count = int(env.get(COPIES_ENV, "1") or 1)
    if count <= 1 or COPY_SYNC_ENV not in env:
        return None
    return CopySync(index=int(env.get(COPY_ENV, "0")), count=count, folder=Path(env[COPY_SYNC_ENV]),
                    barrier_seconds=float(env.get(BARRIER_ENV, DEFAULT_BARRIER_SECONDS)))
