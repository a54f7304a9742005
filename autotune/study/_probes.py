"""Measuring the input pipeline and the device step apart, and predicting a full trial from both.

A full trial measures the loader and the model together, so tuning the loader by full trials compiles and
runs a model that mostly waits. When a trial waits on its input (``INPUT_BOUND``), the loop instead probes:

- a *loader probe* of the loader variants of the incumbent (each other value of each loader knob, then two
  knobs at once: ``loader_moves``): the user's ``train_fn`` runs once up to ``ctx.loader``, which builds each
  variant's loader on the same dataset in turn and iterates it alone for the trial's warm-up and windows, with
  no model step, no compile and no device work (``trial/_context``); a variant whose first window runs below
  ``SLOW_VARIANT_SHARE`` of the fastest before it stops there. One process for all of them: a probe process's
  start and the script up to its loader cost more than a variant's windows, so probes in separate processes
  cost more than the full trials they save (benchmarks/results/search.md). They run one after another, not
  beside the step probe: a loader variant with workers would measure the cores the step probe's launches also
  use;
- one *step probe* of the incumbent: a few real batches kept on the device and replayed through the same
  step, so no step waits on the loader.

A variant's throughput is predicted as ``min(loader rate, step rate) x correction`` (tf.data's and
DS-Analyzer's model: the slower side sets the pace), where the correction is the median of measured /
predicted over the full trials predicted so far (1 before any). The best predicted variant, if it beats the
incumbent by more than ``WORTH``, is enqueued as the next full trial; that trial keeps its prediction, and
the error is recorded beside its measurement. Probes never make a headline number: the speed-up comes from
full trials, and a probe's loss trajectory feeds no verdict.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Optional, Sequence

import optuna
from optuna.trial import TrialState

from autotune._config import TrialConfig
from autotune._records import OVER_BUDGET
from autotune.search._predict import (AS_TRIAL, INPUT_BOUND, LOADER_KNOBS, MAX_LOADER_PROBES, WORTH, best_predicted,
                                       correction_of, loader_moves, nearest_first, predict, step_ceiling)
from autotune.search._rules import infeasible_reason
from autotune.search._space import SearchSpace
from autotune.study._budget import MIN_RUN_S, StudyClock
from autotune.study._isolation import read_partial
from autotune.study._progress import _Progress
from autotune.study._runner import TrialRunner

PROBES = "probes"  # study attribute: every probe run (kind, config, rate, seconds)
PREDICTED = "predicted_throughput"  # trial attribute of a trial enqueued from probes
PREDICTED_CONFIG = "predicted_config"  # and the config it was predicted for (read before the trial is asked)
PREDICTED_BASIS = "predicted_basis"  # what bounded the prediction; CEILING_BASIS: a bound, not a prediction
CEILING_BASIS = "step_ceiling"
__all__ = ["AS_TRIAL", "CEILING_BASIS", "INPUT_BOUND", "LOADER_KNOBS", "MAX_LOADER_PROBES", "PREDICTED",
           "PREDICTED_BASIS", "PROBES", "WORTH", "LoaderProbes",
           "batch_variants", "correction", "loader_variants", "predict", "prediction_error"]


def loader_variants(space: SearchSpace, config: TrialConfig) -> list[TrialConfig]:
    """The incumbent with its loader knobs moved (``loader_moves``: one knob to each of its other values, the
    most likely levers first, then two at once), runnable here, at most ``MAX_LOADER_PROBES``."""
    values = {knob: spec.values for knob, spec in space.knobs.items()}
    variants: list[TrialConfig] = []
    # Keyed by what a trial would run: prefetch and persistence mean nothing without workers, so a move of
    # them at zero workers is the config it started from.
    runs = {_key_of(space.asked_params(config.to_dict()))}
    for move in loader_moves(values, config.to_dict()):
        candidate = _within_space(space, config.replace(**move))
        key = _key_of(space.asked_params(candidate.to_dict()))
        if key in runs or space.cannot_run(candidate.to_dict()):
            continue
        runs.add(key)
        variants.append(candidate)
        if len(variants) == MAX_LOADER_PROBES:
            break
    return variants


def batch_variants(space: SearchSpace, config: TrialConfig,
                   ooms: Sequence[tuple[int, Mapping[str, Any]]] = ()) -> list[TrialConfig]:
    """Under ``batch_policy: scale``, the incumbent at each larger batch of the space, nearest first, that can
    run here and that no out-of-memory rules out (``ooms``: trial number and params); else none.

    A loader's cost is partly per batch (a collate, a worker's round trip), so its rate grows with the batch:
    where the batch may change, it is a lever of the loader as much as of the step. A smaller batch is not
    one: it can only add per-batch costs."""
    spec = space.knobs.get("batch_size")
    if space.batch_policy != "scale" or spec is None:
        return []
    out = []
    for batch in nearest_first([b for b in spec.values if b > config.batch_size], config.batch_size):
        candidate = config.replace(batch_size=batch)
        asked = space.asked_params(candidate.to_dict())
        if not space.cannot_run(candidate.to_dict()) and infeasible_reason(asked, ooms) is None:
            out.append(candidate)
    return out


def _within_space(space: SearchSpace, config: TrialConfig) -> TrialConfig:
    """``config`` with every knob it newly asks (another loader's own knobs) at a value of the space: the
    baseline's where the space has it, else the knob's first."""
    fixes = {}
    for name, value in space.asked_params(config.to_dict()).items():
        spec = space.knobs.get(name)
        if spec is not None and value not in spec.values:
            base = getattr(space.baseline, name)
            fixes[name] = base if base in spec.values else spec.values[0]
    return config.replace(**fixes) if fixes else config


def correction(study: optuna.Study) -> float:
    """Median measured / predicted over the full trials that had a prediction (1.0 before any); a bound from
    a step's ceiling (``CEILING_BASIS``) is no prediction, so it is not read."""
    return correction_of([(t.user_attrs["throughput"], t.user_attrs[PREDICTED]) for t in study.get_trials(deepcopy=False)
                          if t.user_attrs.get(PREDICTED) and t.user_attrs.get("status") == "ok"
                          and t.user_attrs.get("throughput") and t.user_attrs.get(PREDICTED_BASIS) != CEILING_BASIS])


def _key(config: TrialConfig) -> str:
    return _key_of(config.to_dict())


def _key_of(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True, default=str)


def drop_queued_predictions(study: optuna.Study, reason: str) -> list[int]:
    """Take the trials the probes queued (``predicted_from: probes``) that are still WAITING off the queue,
    each recorded FAIL with ``status: not_run`` and ``failure: "not run: <reason>"``; returns their numbers.

    Called when the search ends in this process: a queued prediction would otherwise stay WAITING for good
    (a resume with the same budget runs no trial). Another worker that claims one first keeps it.
    """
    storage = study._storage
    dropped = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
        if trial.user_attrs.get("predicted_from") != "probes":
            continue
        try:
            if not storage.set_trial_state_values(trial._trial_id, state=TrialState.RUNNING):
                continue  # claimed meanwhile by another worker, which runs it
        except (RuntimeError, optuna.exceptions.UpdateFinishedTrialError):
            continue
        storage.set_trial_user_attr(trial._trial_id, "status", "not_run")
        storage.set_trial_user_attr(trial._trial_id, "failure", f"not run: {reason}")
        storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL)
        dropped.append(trial.number)
    return dropped


class LoaderProbes:
    """Runs the probes of one input-bound incumbent and enqueues the variant they predict best.

    Args:
        study: The study (probes are stored in its ``PROBES`` attribute).
        space: The space restricted to this machine.
        runner: Runs the probe processes.
        clock: The study's clock (each probe fits or is skipped; their seconds are the ``probes`` part).
        seed: The trials' seed.
    """

    def __init__(self, *, study: optuna.Study, space: SearchSpace, runner: TrialRunner, clock: StudyClock,
                 seed: int) -> None:
        self.study = study
        self.space = space
        self.runner = runner
        self.clock = clock
        self.seed = seed

    def _done(self) -> dict[str, dict[str, Any]]:
        return {f"{p['kind']}:{p['config_key']}": p for p in self.study.user_attrs.get(PROBES, [])}

    def _record(self, records: list[dict[str, Any]]) -> None:
        self.study.set_user_attr(PROBES, [*self.study.user_attrs.get(PROBES, []), *records])

    def _fits(self, keep: float) -> bool:
        return not self.clock.budgeted or self.clock.fits(MIN_RUN_S, keep=keep)

    def _step(self, config: TrialConfig, ui: _Progress, keep: float) -> Optional[float]:
        """The step probe of ``config``: its step replayed on a few batches kept on the device."""
        done = self._done().get(f"step:{_key(config)}")
        if done is not None:
            return done["rate"]
        if not self._fits(keep):
            return None
        ui.status(f"step probe: {config.describe()}")
        with self.clock.part("probes"):
            outcome = self.runner.run(config, f"probe-step-{len(self._done())}", seed=self.seed, probe="step",
                                      timeout=self.clock.cap(self.runner.timeout, keep=keep))
        measurement = outcome.measurement
        rate = measurement.throughput if outcome.ok and measurement is not None else None
        self._record([{"kind": "step", "config": config.to_dict(), "config_key": _key(config), "rate": rate,
                       "seconds": round(outcome.wall_seconds, 3), "status": outcome.status,
                       "data_wait_fraction": measurement.data_wait_fraction if measurement else None,
                       "steps": measurement.steps if measurement else None,
                       "extras": dict(measurement.extras) if measurement else {}}])
        ui.say(f"  probe   step    {rate or 0:>10,.1f}/s  {config.describe()}"
               + ("" if outcome.ok else f"  [{outcome.status}: {outcome.error[:120]}]"))
        return rate

    def _loaders(self, configs: list[TrialConfig], ui: _Progress, keep: float,
                 enough: Optional[float] = None) -> list[Optional[float]]:
        """The loader rate of each of ``configs``: those not probed yet in one process per kind of loader, one
        after another on the same dataset (the first is the process's config, the others its
        ``loader_variants``), so many loader configs cost one process's start and one run of ``train_fn`` up
        to ``ctx.loader``.

        A device-resident loader runs first, in a process of its own: where it feeds at least ``enough`` (the
        step's own rate), the loader no longer binds and no DataLoader variant can be predicted faster, so
        they are not probed (on an H100 ViT-B/32, 12 of them took 115 s of a 5-minute study that then picked
        the device loader). It first fills device memory with the whole dataset, which on a dataset that
        augments each item on the CPU can outlast its process's time limit, and a timed-out process reports
        none of its rates: under a budget it gets half the time left to the probes, so the DataLoader's
        variants, in their own process, keep the rest."""
        done = self._done()
        pending = [c for c in configs if f"loader:{_key(c)}" not in done]
        device, torch_group = [c for c in pending if c.loader != "torch"], [c for c in pending if c.loader == "torch"]
        if device and self._fits(keep):
            share = max(MIN_RUN_S, (self.clock.usable() - keep) / 2) if self.clock.budgeted and torch_group else None
            self._loader_group(device, ui, keep, limit=share)
            rates = [r for r in self._rates(device) if r]
            if enough and torch_group and rates and max(rates) >= enough:
                ui.say(f"  probes: the device-resident loader feeds {max(rates):,.0f}/s, at least the step's "
                       f"{enough:,.0f}/s: no DataLoader variant can be predicted faster, so none is probed")
                torch_group = []
        if torch_group and self._fits(keep):
            self._loader_group(torch_group, ui, keep)
        return self._rates(configs)

    def _rates(self, configs: list[TrialConfig]) -> list[Optional[float]]:
        """Each config's recorded loader rate (None where it was not probed or its probe measured none)."""
        done = self._done()
        return [done[f"loader:{_key(c)}"]["rate"] if f"loader:{_key(c)}" in done else None for c in configs]

    def _loader_group(self, pending: list[TrialConfig], ui: _Progress, keep: float,
                      limit: Optional[float] = None) -> None:
        """One loader-probe process over ``pending`` (see ``_loaders``), within ``limit`` seconds where given;
        records each config's rate. A process killed at its deadline keeps the rates of the configs it
        finished (``read_partial``): only the one it was measuring, and those after it, are lost."""
        done = self._done()
        ui.status(f"loader probe: {len(pending)} loader configs of {pending[0].describe()}")
        timeout = self.clock.cap(self.runner.timeout, keep=keep)
        workdir = f"probe-loader-{len(done)}"
        with self.clock.part("probes"):
            outcome = self.runner.run(pending[0], workdir, seed=self.seed, probe="loader",
                                      loader_variants=pending[1:],
                                      timeout=min(timeout, limit) if limit is not None else timeout)
        measurement = outcome.measurement
        extras = dict(measurement.extras) if outcome.ok and measurement is not None else {}
        if outcome.ok:
            rates = [measurement.throughput if measurement else None,
                     *(extras.get("loader_rates") or [None] * (len(pending) - 1))]
            errors = [None, *(extras.get("loader_errors") or [None] * (len(pending) - 1))]
            windows = [len(measurement.window_throughputs) if measurement else 0,
                       *(extras.get("loader_windows") or [0] * (len(pending) - 1))]
        else:
            partial = read_partial(self.runner.logdir / workdir) or {}
            finished = len(partial.get("rates") or [])
            lost = f"{outcome.status}: {outcome.error}"
            rates = [*(partial.get("rates") or []), *[None] * (len(pending) - finished)]
            errors = [*(partial.get("errors") or []), *[lost] * (len(pending) - finished)]
            windows = [*(partial.get("windows") or []), *[0] * (len(pending) - finished)]
        seconds = round(outcome.wall_seconds / len(pending), 3)  # the process's seconds, shared
        records = []
        for config, rate, error, timed in zip(pending, rates, errors, windows):
            records.append({"kind": "loader", "config": config.to_dict(), "config_key": _key(config),
                            "rate": rate, "seconds": seconds, "batched": len(pending), "windows": timed,
                            "status": "ok" if rate is not None else outcome.status if not outcome.ok else "error",
                            "error": error, "data_wait_fraction": None,
                            "steps": measurement.steps if measurement else None, "extras": {}})
            ui.say(f"  probe   loader  {rate or 0:>10,.1f}/s  {config.describe()}"
                   + (f"  [{error[:120]}]" if error else ""))
        records[0].update({"data_wait_fraction": measurement.data_wait_fraction if measurement else None,
                           "extras": {k: v for k, v in extras.items()
                                      if k not in ("loader_rates", "loader_errors", "loader_windows")}})
        self._record(records)

    def device_trial(self, incumbent: TrialConfig, incumbent_rate: float, ui: _Progress, *,
                     incumbent_wait: Optional[float] = None) -> Optional[TrialConfig]:
        """Enqueue the incumbent with the device-resident loader as the next full trial, not probed first,
        where the space offers it (the reference run found the dataset fit to keep on the device) and no
        trial or probe has tried it. Returns it, or None.

        That loader indexes batches already in device memory, so its rate is far above any step (1.9 M img/s
        where a ViT-B/32 step ran 8,800), and the only thing its probe could learn is whether it runs. Its
        probe costs a process and the dataset's fill all the same, and under a short budget it timed out
        with nothing measured while the full trial it stood in for would have fit (an H100 ViT-B/32,
        ``benchmarks/results/answer-first-h200.md``). Predicted at the step's rate: a step probe's where one
        ran, else the incumbent's ``step_ceiling``; a prediction from the ceiling is a bound
        (``CEILING_BASIS``), which the correction of later predictions does not read."""
        done = self._done()
        device = self.device_variant(incumbent)
        known = (done.get(f"step:{_key(incumbent)}") or {}).get("rate")
        bound = known or step_ceiling(incumbent_rate, incumbent_wait)
        if device is None or not bound:
            return None
        predicted = bound * correction(self.study)
        self._record([{"kind": "loader", "config": device.to_dict(), "config_key": _key(device), "rate": None,
                       "seconds": 0.0, "batched": 1, "windows": 0, "status": AS_TRIAL,
                       "error": None, "data_wait_fraction": None, "steps": None, "extras": {}}])
        basis = "step_probe" if known else CEILING_BASIS
        self.study.enqueue_trial(self.space.asked_params(device.to_dict()),
                                 user_attrs={PREDICTED: round(predicted, 3), "predicted_from": "probes",
                                             PREDICTED_BASIS: basis, PREDICTED_CONFIG: device.to_dict()})
        step = (f"the step probe's {known:,.0f}/s" if known else
                f"the step's ceiling from the incumbent's trial, {incumbent_rate:,.0f}/s over the "
                f"{1 - (incumbent_wait or 0.0):.0%} of its time it did not wait")
        ui.say(f"  probes: the device-resident loader serves each batch from device memory, so the input stops "
               f"binding: its full trial is next, not a probe of it (bounded by {step})")
        return device

    def device_variant(self, incumbent: TrialConfig) -> Optional[TrialConfig]:
        """The incumbent with the device-resident loader, where the space offers it and no trial or probe
        has tried it; else None."""
        done = self._done()
        return next((v for v in loader_variants(self.space, incumbent) if v.loader == "device"
                     and f"loader:{_key(v)}" not in done and not self._tried(v)), None)

    def run(self, incumbent: TrialConfig, incumbent_rate: float, ui: _Progress, *, keep: float = 0.0,
            incumbent_wait: Optional[float] = None) -> Optional[TrialConfig]:
        """Probe the incumbent's loader variants and its step; enqueue the best predicted variant.

        The loader's variants run first: the incumbent waits on its input (``incumbent_wait``, its trial's
        data-wait fraction), so they decide. The step's rate only caps what a variant can deliver, and the
        incumbent's own trial bounds it already (``step_ceiling``), while a compiled step's probe compiles again
        in a process of its own: run first under a budget, it took the probes' time and timed out, and no
        loader variant was measured (an H100 ConvNeXt-T study, ``benchmarks/results/answer-first-h200.md``).
        So the step probe runs after them, where some variant's loader could be worth a trial and time is
        left; where it does not run or measures nothing, the ceiling stands in.

        Returns the enqueued config, or None (no variant predicted worth a full trial, or no time)."""
        batches = [v for v in batch_variants(self.space, incumbent, self._ooms()) if not self._measured(v)]
        variants = [v for v in loader_variants(self.space, incumbent) if not self._measured(v)]
        if not variants and not batches:
            return None
        factor = correction(self.study)
        ceiling = step_ceiling(incumbent_rate, incumbent_wait)
        known = self._done().get(f"step:{_key(incumbent)}")
        # One process: the loader at the larger batches first (under scale), then its own knobs' variants.
        # Under scale the batch is a lever of the step too: a device loader feeding the incumbent's step does
        # not say the larger batches' loaders are idle, so those are probed whatever it feeds.
        enough = (known or {}).get("rate") or ceiling
        rates = self._loaders([*batches, *variants], ui, keep, enough=None if batches else enough)
        batch_rates, loader_rates = rates[:len(batches)], rates[len(batches):]
        fastest = max((r for r in rates if r), default=None)
        step_rate = None
        if fastest and predict(fastest, None, factor) >= WORTH * incumbent_rate:
            step_rate = self._step(incumbent, ui, keep)
            if step_rate is None and ceiling:
                ui.say(f"  probes: no step probe measured the incumbent's step; its own trial bounds it at "
                       f"{ceiling:,.0f}/s ({incumbent_rate:,.0f}/s over the {1 - incumbent_wait:.0%} of its time "
                       "it did not wait on its input)")
        step_rate = step_rate or ceiling
        best = best_predicted(list(zip(loader_rates, variants)), step_rate, factor, incumbent_rate)
        batch_best = self._best_batch(list(zip(batch_rates, batches)), step_rate, factor, incumbent_rate, ui, keep)
        if batch_best is not None and (best is None or batch_best[0] >= best[0]):
            best = batch_best  # the batch moves first when its predicted gain is at least the loader knobs'
        if best is None:
            return None
        predicted, variant = best
        self.study.enqueue_trial(self.space.asked_params(variant.to_dict()),
                                 user_attrs={PREDICTED: round(predicted, 3), "predicted_from": "probes",
                                             PREDICTED_CONFIG: variant.to_dict()})
        ui.say(f"  probes predict {predicted:,.1f}/s for {variant.describe()} (loader and step measured apart; "
               f"correction x{factor:.2f}): its full trial is next")
        return variant

    def probed(self, config: TrialConfig) -> bool:
        """Whether ``config``'s probes ran already (its step probe, or its variants' loader probes, are stored),
        or none is left to run."""
        done = self._done()
        if f"step:{_key(config)}" in done:
            return True
        return not [v for v in (*loader_variants(self.space, config), *batch_variants(self.space, config, self._ooms()))
                    if not self._measured(v) and f"loader:{_key(v)}" not in done]

    def _best_batch(self, candidates: list[tuple[Optional[float], TrialConfig]], step_rate: Optional[float],
                    factor: float, incumbent_rate: float, ui: _Progress, keep: float
                    ) -> Optional[tuple[float, TrialConfig]]:
        """Of the incumbent at larger batches, the one ``predict`` rates fastest from its loader's rate and
        the step's rate at that batch, when it beats the incumbent by ``WORTH``. The step probe runs at the
        batch whose loader is fastest, and only where the loader there would be worth a trial: the
        incumbent's step rate is no bound on the step's at another batch."""
        ranked = sorted(((r, c) for r, c in candidates if r), key=lambda rc: -rc[0])
        if not ranked or predict(ranked[0][0], None, factor) < WORTH * incumbent_rate:
            return None
        rate, config = ranked[0]
        at_batch = self._step(config, ui, keep)
        return best_predicted([(rate, config)], at_batch or step_rate, factor, incumbent_rate)

    def _ooms(self) -> list[tuple[int, dict[str, Any]]]:
        """(number, params) of the trials that ran out of memory, for the memory rule."""
        return [(t.number, t.params) for t in self.study.get_trials(deepcopy=False)
                if t.user_attrs.get("status") == "oom"]

    def _tried(self, config: TrialConfig) -> bool:
        """Whether a trial of ``config`` ran, or is running (whatever its outcome; not one the budget left
        unrun)."""
        key = self.space.asked_params(config.to_dict())
        return any(t.params == key for t in self.study.get_trials(deepcopy=False)
                   if t.user_attrs.get("status") not in (OVER_BUDGET, "not_run"))

    def _measured(self, config: TrialConfig) -> bool:
        key = self.space.asked_params(config.to_dict())
        return any(t.params == key for t in self.study.get_trials(deepcopy=False) if t.state.name == "COMPLETE")


def prediction_error(attrs: dict[str, Any]) -> Optional[float]:
    """measured / predicted - 1 of a full trial enqueued from probes (None for any other trial)."""
    predicted, measured = attrs.get(PREDICTED), attrs.get("throughput")
    if not predicted or not measured or attrs.get("status") != "ok":
        return None
    return measured / predicted - 1.0
