"""The tuner's progress bar: trials done, the current config, the best so far, minutes spent and predicted."""

from __future__ import annotations

import os
from typing import Any, Optional

from optuna.trial import FrozenTrial

from autotune._config import TrialConfig, TrialRecord
from autotune._errors import printable
from autotune._records import NOT_RUN
from autotune.search._cost import CostModel, samples_from_trials, seconds_spent


def minutes_text(study: Any, total: int) -> str:
    """"4.2 min spent, ~11 min predicted": the trials' wall minutes so far, and those plus the trials left
    of ``total``, each priced by the cost model at the best config so far (``autotune.search._cost``)."""
    trials = study.get_trials(deepcopy=False)
    samples = samples_from_trials(trials)
    if not samples:
        return ""
    spent = seconds_spent(samples)
    done = sum(1 for t in trials if t.state.name in ("COMPLETE", "PRUNED") and t.user_attrs.get("role") != "reference"
               and t.user_attrs.get("status") not in NOT_RUN)
    ok = [t for t in trials if t.state.name == "COMPLETE" and t.user_attrs.get("status") == "ok" and t.values]
    best = max(ok, key=lambda t: t.values[0], default=None)
    config = dict(best.user_attrs.get("config") or best.params) if best is not None else {}
    rate = best.values[0] if best is not None else None
    left = max(0, total - done) * CostModel.fit(samples).predict(config, rate)
    return f"{spent / 60:.1f} min spent, ~{(spent + left) / 60:.0f} min predicted"


# Without a terminal rich would wrap at 80 columns, which breaks a line of a log or a pipe in the middle of a
# config; a wide console keeps each line whole (COLUMNS, when set, still wins).
WIDE_COLUMNS = 240


def make_console(**options: Any) -> Any:
    """A rich Console, WIDE_COLUMNS wide when its output is not a terminal and COLUMNS is not set."""
    from rich.console import Console

    console = Console(**options)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(width=WIDE_COLUMNS, **options)
    return console


class _Progress:
    """A rich progress bar: trial number, current config, best so far. Silent when disabled."""

    def __init__(self, enabled: bool, total: int, *, clock: Any = None) -> None:
        self.enabled = enabled
        self.total = total
        self.clock = clock  # a StudyClock: with a budget, the minutes left are shown
        self._progress: Any = None
        self._task: Any = None
        self._best = "best: -"
        self._minutes = ""

    def __enter__(self) -> "_Progress":
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("[bold]trial"),
                MofNCompleteColumn(),
                BarColumn(bar_width=20),
                TimeElapsedColumn(),
                TextColumn("{task.description}"),
                console=make_console(),
            )
            self._progress.__enter__()
            self._task = self._progress.add_task("starting", total=self.total)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)

    def status(self, text: str) -> None:
        if self._progress is not None:
            minutes = f" | {self._minutes}" if self._minutes else ""
            if self.clock is not None and self.clock.budgeted:
                minutes += f" | budget: {max(0.0, self.clock.left()) / 60:.1f} of {self.clock.budget_seconds / 60:g} min left"
            self._progress.update(self._task, description=f"{printable(text)} | {self._best}{minutes}")

    def set_best(self, record: Optional[TrialRecord]) -> None:
        if record is not None:
            self._best = f"best: {record.throughput:,.0f}/s (#{record.number})"

    def set_minutes(self, study: Any) -> None:
        """Show the minutes spent on the study's trials and the minutes predicted for the whole budget."""
        if self._progress is not None:
            self._minutes = minutes_text(study, self.total)

    def start_trial(self, number: int, config: TrialConfig) -> None:
        self.status(f"#{number} {config.describe()}")

    def shows(self) -> bool:
        """Whether a progress bar is shown (``say`` prints nothing without one)."""
        return self._progress is not None

    def say(self, text: str) -> None:
        """One line above the bar, printed as it is (no markup, no wrapping; control characters escaped: a
        trial's error text is the workload's)."""
        if self._progress is not None:
            self._progress.console.print(printable(text), markup=False, highlight=False, soft_wrap=True)

    def ruled_out(self, number: int, config: TrialConfig, reason: str) -> None:
        """The memory rule, or a combination that cannot run here, answered a proposed config without a run."""
        self.say(f"  #{number:<3} {'skipped':<7} {'':>12}  {config.describe()}  [{reason}; not run]")

    def end_trial(self, trial: FrozenTrial, baseline: Optional[TrialConfig] = None) -> None:
        """A finished trial's row; ``baseline``: the study's baseline, for the reference run's row, which shows the
        config as it ran (its references' loader can be another than the baseline's own, timed apart)."""
        if self._progress is None:
            return
        status = trial.user_attrs.get("status", "?")
        rate = trial.user_attrs.get("throughput", 0.0)
        config = TrialConfig.from_dict(trial.user_attrs["config"]).describe() if "config" in trial.user_attrs else ""
        note = ""
        if status == "ok" and trial.constraints.get("accuracy", 0.0) > 0:
            # Measured, but it lost more accuracy than allowed: it cannot be the best, whatever its speed. The
            # label names the part of the check that failed (the training loss, or the metric), not one that passed.
            note = f"  [accuracy {trial.user_attrs.get('accuracy_verdict') or 'over bound'}: {_failed_part(trial)}]"
        if status == "ok" and trial.user_attrs.get("colocation_summary"):
            note += f"  [{trial.user_attrs['colocation_summary']}]"
        if status not in ("ok", "pruned") and trial.user_attrs.get("error"):
            note += f"  [{trial.user_attrs['error'][:160]}]"  # what failed, in one line (the log has the rest)
        if trial.user_attrs.get("role") == "reference":
            status, note = "ref", "  [the fp32 reference run: the baseline]"
            ran = TrialConfig.from_dict(trial.user_attrs["config"]) if "config" in trial.user_attrs else None
            if baseline is not None and ran is not None and ran != baseline:
                note = (f"  [the fp32 reference run, as it ran; the baseline is {baseline.describe()}, its own "
                        "speed timed apart]")
        self.say(f"  #{trial.number:<3} {status:<7} {rate:>10,.1f}/s  {config}{note}")

    def set_completed(self, count: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=count)


def _failed_part(trial: FrozenTrial) -> str:
    """The parts of a trial's accuracy evidence that did not pass (its metric loss when none is recorded)."""
    parts = [p for p in str(trial.user_attrs.get("accuracy_evidence") or "").split("; ") if p and ": within" not in p]
    if not parts:
        return f"metric loss {trial.user_attrs.get('accuracy_loss', float('nan')):+.3f} over the bound"
    return "; ".join(parts)[:200]
