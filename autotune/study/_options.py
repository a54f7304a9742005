"""The tuner's options, grouped by what they govern. Each record validates itself.

``Tuner(train_fn, n_trials=30, top_k=0)`` takes the fields of every record as flat keywords; a
``TunerOptions`` built once can be passed instead (``Tuner(train_fn, options=...)``) and flat
keywords then override its fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import optuna

from autotune._config import BATCH_POLICIES
from autotune._records import DEFAULT_STUDIES_DIR
from autotune.hardware._mps import MPS_MODES

DEFAULT_MAX_ACCURACY_LOSS = 0.01
ACCURACY_REFERENCES = ("baseline", "batch")
MODES = ("tune", "create", "join")
COMPILE_TIMEOUT_SHARE = 0.5  # the default compile timeout, as a share of the trial timeout


@dataclass(frozen=True, kw_only=True)
class StudyOptions:
    """Which study, where it is stored, and how this process takes part in it.

    Args:
        study_name: Defaults to the function's name.
        storage: Any Optuna storage URL, or ``journal:PATH``; ``None`` is ``studies/autotune.db``.
        studies_dir: Where ``best_config.json`` and trial logs go.
        seed: Seed of the data order, the model initialisation and the sampler.
        mode: ``"tune"`` creates or resumes the study and runs trials; ``"create"`` only creates it
            (with the reference run) for workers to join; ``"join"`` joins an existing study as one
            more worker, taking the space and trial budget from the study.
        grace_period: On RDB storages, seconds without a heartbeat after which another worker's
            running trial is failed and its config retried once.
        progress: Show a progress bar.
        plots: Draw the plots (PNGs beside ``best_config.json`` and dashboard artifacts) at the end.
        mps: CUDA MPS for trials of ``mps=true`` (only when the space has that value): ``"auto"`` uses a
            running control daemon or starts one for the study (pipes and logs under its folder in
            ``studies_dir``, stopped when the study ends), else drops ``mps=true`` from the space with the
            reason; ``"on"`` fails where MPS cannot start; ``"off"`` drops ``mps=true``.
        began: When this run of the study began (``time.time()``); None: when ``Tuner.run`` began. A race of the
            finalists recorded before it was an earlier run's, under that run's load, and is run again beside
            the pick. A command that runs workers before its own run passes its start: their race is this run's.
    """

    study_name: Optional[str] = None
    storage: Optional[str] = None
    studies_dir: Union[str, Path] = DEFAULT_STUDIES_DIR
    seed: int = 0
    mode: str = "tune"
    grace_period: int = 60
    progress: bool = True
    plots: bool = True
    mps: str = "auto"
    began: Optional[float] = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError("mode must be 'tune', 'create' or 'join'")
        if self.mps not in MPS_MODES:
            raise ValueError(f"mps must be one of {', '.join(MPS_MODES)}, not {self.mps!r}")
        object.__setattr__(self, "studies_dir", Path(self.studies_dir))


@dataclass(frozen=True, kw_only=True)
class SearchOptions:
    """What is searched, for how long, and how the next config is chosen.

    Args:
        space: A ``SearchSpace``, a YAML path, or a built-in name; ``None`` picks one of
            ``default_spaces`` (CPU, GPU) by the machine.
        n_trials: Trials in the study, counted across every worker and every resume.
        timeout: Stop starting trials after this many seconds.
        budget_minutes: The whole study's minutes: references, trials, the race of the finalists and the
            report. Trials are proposed only while the next one, and the race after it, fit; each run's time
            limit is cut to the deadline; the study always ends with a pick written, saying how well it was
            confirmed. ``None``: no budget (``n_trials`` and ``timeout`` alone end the search).
        sampler: An Optuna sampler; defaults to ``GuidedSampler`` over the space (prior point, then a
            coordinate walk from the best config, with the out-of-memory rule).
        prune_below: Stop a trial after its first timed window when its throughput is below this fraction
            of the best first window so far on the same device (recorded as PRUNED with its partial measurement);
            ``None`` or 0 turns it off. Window-to-window spread is a few percent, so 0.5 only stops
            configs that could not come near the best.
        default_spaces: The built-in spaces for a CPU and for a GPU machine when ``space`` is ``None``.
        capabilities: What the machine can run; ``None`` probes it.
        batch_policy: ``"fixed"`` keeps the baseline's global batch in every trial (the batch knob is the
            micro-batch, gradients accumulate); ``"scale"`` lets the global batch follow the batch knob,
            judged against fp32 at each global batch. ``None`` keeps the space's (``fixed`` unless it says).
        train_minutes: How long the real training with the chosen config will run (minutes). With
            ``train_steps``, the declared training length: the ``max-autotune*`` compile modes stay in
            the space only when it pays for their compile (``autotune.search._compile``); undeclared, they
            are removed.
        train_steps: The same as optimizer steps at the baseline's batch size (converted to minutes at the
            fastest rate measured when the study is created).
        baseline: The untuned config as the user trains it, over the space's ``baseline:``: knob values
            (``{"batch_size": 32}``) or ``"batch_size=32,precision=fp32"``; knobs not named keep the
            space's. Under ``fixed`` its ``batch_size`` is also the global batch.
        batch_size: The global batch the script trains at (``--batch-size``): the baseline's batch and,
            under ``fixed``, the study's global batch, unless ``baseline`` names a ``batch_size`` or the
            space sets ``global_batch``. ``None``: a ``batch_size`` the script passes to ``ctx.loader`` is
            adopted after the reference run (which then runs again at it).
        processes_per_trial: Ranks of each trial (a DDP job: one GPU per rank, gloo on a CPU) over the space's
            ``processes_per_trial``; ``None`` keeps the space's (1 unless it says).
    """

    space: Any = None
    n_trials: int = 20
    timeout: Optional[float] = None
    budget_minutes: Optional[float] = None
    sampler: Optional[optuna.samplers.BaseSampler] = None
    prune_below: Optional[float] = 0.5
    default_spaces: tuple[str, str] = ("cpu_default", "gpu_default")
    capabilities: Any = None
    batch_policy: Optional[str] = None
    train_minutes: Optional[float] = None
    train_steps: Optional[int] = None
    baseline: Union[str, dict[str, Any], None] = None
    processes_per_trial: Optional[int] = None
    batch_size: Optional[int] = None

    def __post_init__(self) -> None:
        if self.batch_size is not None and (not isinstance(self.batch_size, int) or isinstance(self.batch_size, bool)
                                            or self.batch_size < 1):
            raise ValueError(f"batch_size must be a positive integer, not {self.batch_size!r}")
        if self.processes_per_trial is not None and (not isinstance(self.processes_per_trial, int)
                                                     or self.processes_per_trial < 1):
            raise ValueError(f"processes_per_trial must be a positive integer, not {self.processes_per_trial!r}")
        if self.baseline is not None and not isinstance(self.baseline, (str, dict)):
            raise ValueError("baseline must be knob values (a dict) or 'knob=value,...'")
        if self.batch_policy is not None and self.batch_policy not in BATCH_POLICIES:
            raise ValueError(f"batch_policy must be one of {', '.join(BATCH_POLICIES)}")
        if self.budget_minutes is not None and not 0 < self.budget_minutes < float("inf"):
            raise ValueError(f"budget_minutes must be a positive number of minutes, not {self.budget_minutes}")
        if self.n_trials < 1:
            raise ValueError("n_trials must be at least 1")
        if self.train_minutes is not None and self.train_steps is not None:
            raise ValueError("declare the training length once: train_minutes or train_steps")
        if (self.train_minutes is not None and not self.train_minutes > 0) or (
                self.train_steps is not None and self.train_steps < 1):
            raise ValueError("train_minutes and train_steps must be positive")
        if self.prune_below is not None and not 0 <= self.prune_below < 1:
            raise ValueError("prune_below must be a fraction in [0, 1)")
        object.__setattr__(self, "prune_below", self.prune_below or None)


REFERENCE_LOADERS = ("auto", "prior", "baseline")


@dataclass(frozen=True, kw_only=True)
class AccuracyOptions:
    """How a trial's accuracy is judged against fp32 reference runs.

    Args:
        max_accuracy_loss: A trial is infeasible when its accuracy loss exceeds this plus the
            reference noise band (metric units; 0.01 is one accuracy point).
        metric_direction: ``"maximize"`` for accuracy-like metrics, ``"minimize"`` for losses.
        accuracy_reference: Superseded by ``batch_policy``: ``"batch"`` (judge each trial against fp32
            at its own batch size) is what ``batch_policy="scale"`` does, and selects it when no policy
            is given; ``"baseline"`` leaves the policy to decide.
        reference_repeats: fp32 reference runs with different seeds, for the baseline and for each batch
            size in ``"batch"`` mode; two or more give each reference its noise band.
        fresh_references: Run the fp32 references even where an earlier study of the same target stored
            ones that nothing they depend on has changed since (``_stored``).
        reference_loader: The DataLoader knobs the fp32 references run with: ``"prior"``, the prior point's
            (a loader that keeps up with the step, so the references' steps are the step's, and the baseline's
            own speed is measured in a short run apart); ``"baseline"``, the baseline's; ``"auto"``, the
            prior's on a GPU and the baseline's on a CPU, whose cores a loader's workers take from the step.
    """

    max_accuracy_loss: float = DEFAULT_MAX_ACCURACY_LOSS
    metric_direction: str = "maximize"
    accuracy_reference: str = "baseline"
    reference_repeats: int = 2
    fresh_references: bool = False
    reference_loader: str = "auto"

    def __post_init__(self) -> None:
        if self.metric_direction not in ("maximize", "minimize"):
            raise ValueError("metric_direction must be 'maximize' or 'minimize'")
        if self.accuracy_reference not in ACCURACY_REFERENCES:
            raise ValueError(f"accuracy_reference must be one of {', '.join(ACCURACY_REFERENCES)}")
        if self.reference_loader not in REFERENCE_LOADERS:
            raise ValueError(f"reference_loader must be one of {', '.join(REFERENCE_LOADERS)}")
        if self.reference_repeats < 1:
            raise ValueError("reference_repeats must be at least 1")
        if not 0 <= self.max_accuracy_loss < float("inf"):  # nan too: it would leave every trial infeasible
            raise ValueError(f"max_accuracy_loss must be a finite number >= 0, not {self.max_accuracy_loss}")


@dataclass(frozen=True, kw_only=True)
class TrialOptions:
    """Limits of one trial process.

    Args:
        trial_timeout: Wall-clock seconds before a trial's process group is killed.
        memory_limit_gib: On CPU, address space a trial may add beyond its start (a device-memory
            stand-in that turns a too-large batch into an out-of-memory failure, not a host OOM kill).
        compile_timeout: Seconds a compiling trial may spend in torch.compile before its process group is
            killed and it ends as ``compile_timeout`` (that mode is then slow for this model, not broken).
            ``None`` is half of ``trial_timeout`` (300 s at the default): 5-7x the 40-64 s that cold
            default-mode compiles of ResNet-50 took on an H200, while a compile that would eat more than
            half of the trial's limit is stopped before it spends the rest. Compiles inside
            ``ctx.batches`` and any TorchDynamo compile (a hand-written loop, a recompile on a new shape)
            count; see ``autotune.trial._phase``.
        script_args: The script's own command-line arguments (``autotune tune main.py:train -- --emsize 64``):
            every trial process, and the probe that imports the script, has ``sys.argv`` set to the script's
            path followed by them before the script is imported. ``None``: trials get this process's own
            ``sys.argv`` (a script that calls ``autotune.run`` passes its own options on); the CLI gives ``[]``
            without ``--`` (its own arguments are no script's).
    """

    trial_timeout: float = 600.0
    memory_limit_gib: Optional[float] = None
    compile_timeout: Optional[float] = None
    script_args: Optional[tuple[str, ...]] = None

    def __post_init__(self) -> None:
        if self.script_args is not None:
            if isinstance(self.script_args, (str, bytes)):
                raise ValueError(f"script_args must be a list of arguments (e.g. ['--emsize', '64']), not the string "
                                 f"{self.script_args!r}: split it with shlex.split")
            object.__setattr__(self, "script_args", tuple(str(a) for a in self.script_args))
        if self.compile_timeout is not None and not 0 < self.compile_timeout < float("inf"):
            raise ValueError("compile_timeout must be positive and finite")
        if not 0 < self.trial_timeout < float("inf"):
            raise ValueError(f"trial_timeout must be positive and finite, not {self.trial_timeout}")

    @property
    def compile_deadline(self) -> float:
        """The compile timeout in force: the one given, else ``COMPILE_TIMEOUT_SHARE`` of the trial's."""
        return self.compile_timeout if self.compile_timeout is not None else COMPILE_TIMEOUT_SHARE * self.trial_timeout


@dataclass(frozen=True, kw_only=True)
class ConfirmOptions:
    """How the best config is confirmed before it is declared.

    Args:
        top_k: Race the top K feasible configs and the baseline in interleaved rounds, dropping a finalist
            once it is clearly slower, and pick by the median (``autotune.study._confirm``); 0 turns it off.
        confirm_rounds: The most rounds of the race: a tie is raced this long, a clear order ends sooner.
        confirm_samples: If set, train the best config and the reference this long and report both.
    """

    top_k: int = 3
    confirm_rounds: int = 3
    confirm_samples: Optional[int] = None


@dataclass(frozen=True, kw_only=True)
class TunerOptions:
    """Every option of a ``Tuner``, one record per concern."""

    study: StudyOptions = field(default_factory=StudyOptions)
    search: SearchOptions = field(default_factory=SearchOptions)
    accuracy: AccuracyOptions = field(default_factory=AccuracyOptions)
    trial: TrialOptions = field(default_factory=TrialOptions)
    confirm: ConfirmOptions = field(default_factory=ConfirmOptions)

    def __post_init__(self) -> None:
        from autotune.study._budget import MIN_RUN_S

        minutes = self.search.budget_minutes
        least = self.accuracy.reference_repeats * MIN_RUN_S  # each fp32 reference run gets at least MIN_RUN_S
        if minutes is not None and minutes * 60 < least:
            raise ValueError(f"budget_minutes (--budget) {minutes:g} is {minutes * 60:.1f} s, less than the "
                             f"{self.accuracy.reference_repeats} fp32 reference runs alone take ({MIN_RUN_S:g} s each "
                             f"at the least); give at least {least / 60:.2g} minutes")

    def with_keywords(self, **keywords: Any) -> "TunerOptions":
        """A copy with flat keywords (any record's field names) set on their records.

        Raises:
            TypeError: a keyword that no record has.
        """
        changes: dict[str, dict[str, Any]] = {}
        for given, value in keywords.items():
            name = CLI_NAMES.get(given, given)
            if name != given and name in keywords:
                raise TypeError(f"tuner option {given!r} is {name!r} by its other name: give one of them")
            group = _FIELD_GROUPS.get(name)
            if group is None:
                raise TypeError(unknown_option(given))
            changes.setdefault(group, {})[name] = value
        return dataclasses.replace(
            self, **{group: dataclasses.replace(getattr(self, group), **fields) for group, fields in changes.items()}
        )


_FIELD_GROUPS: dict[str, str] = {
    f.name: group.name
    for group in dataclasses.fields(TunerOptions)
    for f in dataclasses.fields(group.default_factory())  # type: ignore[misc]
}
# The CLI's names of the options whose Python keyword differs (``--study``, ``--trials``, ...): accepted too,
# so that ``autotune.run(train, study="x", trials=8)`` does what ``autotune tune --study x --trials 8`` does.
CLI_NAMES: dict[str, str] = {"study": "study_name", "trials": "n_trials", "budget": "budget_minutes",
                             "memory_limit": "memory_limit_gib", "nproc_per_trial": "processes_per_trial"}


def unknown_option(name: str) -> str:
    """One line for an option no record has, naming the nearest valid one."""
    import difflib

    names = sorted({*_FIELD_GROUPS, *CLI_NAMES})
    near = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
    hint = f"; did you mean {CLI_NAMES.get(near[0], near[0])!r}?" if near else ""
    return f"unknown tuner option {name!r}{hint} (the options: autotune.Tuner's, in docs/api.md)"
