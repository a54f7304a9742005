"""The per-trial context handed to ``train_fn``: the sampled config plus helpers that apply each knob."""

from __future__ import annotations

import contextlib
import json
import itertools
import math
import statistics
import time
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch

from autotune.trial import _augment, _copies, _distributed, _float8, _images, _knobs, _phase, _regions, _resident
from autotune._config import SLOW_VARIANT_SHARE, Budget, Measurement, TrialConfig, bin_means
from autotune._errors import KnobError, WorkloadError
from autotune._files import write_atomic
from autotune.trial._compile_cache import compile_cache_record
from autotune.trial._images import IMAGENET_MEAN, IMAGENET_STD, ImageSource
from autotune.trial._measure import BlockSeconds, Window, WindowRecorder, summarize, synchronize


# Layers with 4-D (N, C, H, W) activations: the ones channels_last changes.
_IMAGE_LAYERS = (torch.nn.Conv2d, torch.nn.ConvTranspose2d, torch.nn.BatchNorm2d, torch.nn.MaxPool2d,
                 torch.nn.AvgPool2d, torch.nn.AdaptiveAvgPool2d)
MAX_TRAJECTORY = 512  # points of a trial's stored loss trajectory; longer ones are averaged into bins
LOSS_SLACK = 16  # loss slots past the planned steps, for a train_fn that steps a little more
# A run with a time share measures its step time over this many steps of its first window, then shortens
# its windows to the share, keeping SHORTEN_RESERVE of what is left for the evaluation and the exit.
SHORTEN_PROBE_STEPS = 4
SHORTEN_RESERVE = 0.1


def has_4d_activations(module: torch.nn.Module) -> bool:
    """Whether ``module`` has layers with (N, C, H, W) activations, the ones channels_last changes."""
    return any(isinstance(m, _IMAGE_LAYERS) for m in module.modules())


class NonFiniteLoss(ArithmeticError):
    """The training loss became NaN or inf."""


class TrialPruned(Exception):
    """Raised inside a trial stopped early as hopeless; the partial measurement is kept."""


class ProbeDone(Exception):
    """Raised inside a loader probe once its windows are measured: the rest of ``train_fn`` is not run."""


PROBE_KINDS = ("loader", "step")
# Why augment=device's items cannot be kept on the device when its images differ in size (they are padded per batch).
SEVERAL_SIZES = "its images before their transforms differ in size: a dataset on the device needs one"
# A step probe keeps this many real batches on the device and replays them: enough to vary the inputs
# a little, few enough that fetching them is a small part of the probe.
STEP_PROBE_BATCHES = 4


class TrialContext:
    """What ``train_fn(ctx)`` gets: ``ctx.config`` and helpers that apply it.

    The same helpers work outside a study, to train with the best config: ``autotune train`` (or
    ``autotune.train``) gives ``train_fn`` a context with a ``run``, and ``batches`` yields the run's whole
    length, epoch after epoch, calling the hooks of ``on_epoch_end`` between epochs. A context built with
    ``TrialContext(config=autotune.load_best(...))``, with neither a budget nor a run, yields one epoch.

    Args:
        config: The knobs to apply.
        budget: Trial length and timing; ``None`` outside a study (no timing, one epoch per ``batches``).
        seed: Seed for the data order and the user's initialisation (``ctx.seed``).
        baseline_batch_size: The baseline's global batch, for ``lr_scale``.
        device: Defaults to CUDA when available.
        prune_below: Stop the trial after its first timed window when that window's throughput is below
            this (samples/s); set by the tuner from the best trial so far.
        adopt_script_batch: A study's first reference run, or a real run of the baseline with no study: a
            ``batch_size`` the script passes to ``ctx.loader`` becomes this run's batch, when nothing the
            script read yet depended on the batch, so the reference need not run again at it
            (``extras["batch_adopted"]``); in a real run, its DataLoader's workers and pinning too.
        run: A real run's length and clock (``autotune.trial._run.RealRun``), under ``autotune train``.
        started: When the trial process started (``time.perf_counter``): a share of a study's budget
            (``Budget.seconds``) counts from it, the script's import and build included. Now, where None.
    """

    def __init__(
        self,
        *,
        config: TrialConfig,
        budget: Optional[Budget] = None,
        seed: int = 0,
        baseline_batch_size: Optional[int] = None,
        device: Optional[torch.device] = None,
        prune_below: Optional[float] = None,
        probe: Optional[str] = None,
        loader_variants: Sequence[TrialConfig] = (),
        adopt_script_batch: bool = False,
        run: Any = None,
        partial_path: Optional[str] = None,
        started: Optional[float] = None,
    ) -> None:
        self.config = config
        self.run = run
        self._epoch = 0  # epochs of ctx.batches' loader done
        self._epoch_hooks: list[Callable[[int], Any]] = []  # outside a study and a run: after the one epoch
        # A probe measures one side of the trial apart (see ``autotune.study._probes``): "loader" iterates
        # the input pipeline alone and ends at ctx.loader; "step" replays a few batches through the step.
        self.probe = probe
        # A loader probe's further configs (other loader knobs, the same batch): each is built on the same
        # dataset and measured in turn in this one process, so many loader configs cost one process.
        self.loader_variants = tuple(loader_variants)
        self._partial_path = partial_path  # where a loader probe keeps what it measured so far
        self.prune_below = prune_below
        self.budget = budget
        self.seed = seed
        self.baseline_batch_size = baseline_batch_size or config.global_batch_size
        self.device = device or _knobs.pick_device()
        self.metric: Optional[float] = None
        self.extras: dict[str, Any] = {}
        self._world_size = _distributed.world_size()
        self._rank = _distributed.rank()
        self.recorder = WindowRecorder(self.device, distributed=self.world_size > 1)
        self._comm_timers: list[_distributed.CommTimer] = []
        self._steps_done = 0
        self._samples_done = 0
        self._train_steps: list[_knobs.TrainStep] = []
        self._recorded_losses: list[torch.Tensor] = []  # ctx.record_loss, for hand-written loops
        # One of several co-located copies of a study's trial (processes_per_gpu > 1), else None.
        self._copy = _copies.copy_from_env() if budget is not None else None
        self._planned_steps: Optional[int] = None  # set when a copy trains on past its budget: losses stop there
        self._epoch_steps: Optional[int] = None  # batches of one epoch of the last ctx.loader
        # A run's time share (Budget.seconds) counts from here: from the trial process's start (``started``,
        # on ``time.perf_counter``) where it is given, so the script's import and build are inside the share.
        self._created = started if started is not None else time.perf_counter()
        # Whether the script read a length that depends on the batch (then the batch can no longer change).
        self._length_read = False
        # The reference run may train at the batch the script passes to ctx.loader (adopt_script_batch).
        self.adopt_script_batch = adopt_script_batch
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    # -- knobs ---------------------------------------------------------------------------------
    @property
    def in_study(self) -> bool:
        """This run is one of a study's (a trial, a reference run, a probe): it trains for its budget, not for
        your whole run. False for a context you build yourself to train with the best config."""
        return self.budget is not None

    @property
    def world_size(self) -> int:
        """Ranks of this trial (``processes_per_trial``); 1 for a one-process trial."""
        return self._world_size

    @property
    def rank(self) -> int:
        """This process's rank; 0 in a one-process trial. Rank 0's measurement and metric are the trial's."""
        return self._rank

    @property
    def copy_index(self) -> int:
        """This copy's index among a co-located trial's ``processes_per_gpu`` copies (its seed is the
        trial's seed + the index); 0 otherwise."""
        return self._copy.index if self._copy is not None else 0

    @property
    def lr_scale(self) -> float:
        """Global batch / the baseline's global batch: multiply your learning rate by it (linear scaling).

        Under ``batch_policy: fixed`` it is 1: every trial trains at the baseline's global batch.
        """
        return self.config.global_batch_size / self.baseline_batch_size

    @property
    def lr_scale_sqrt(self) -> float:
        """The square-root scaling rule (often used with Adam-style optimizers): ``sqrt(lr_scale)``."""
        return math.sqrt(self.lr_scale)

    def model(self, module: torch.nn.Module) -> torch.nn.Module:
        """Move to the device, apply float8 training (``precision=fp8``), channels_last and torch.compile as
        configured. Under fp8 the trial records which linear layers were converted (``fp8.converted``) and
        why the others were not (``fp8.skipped``).

        Raises:
            MissingExtraError: ``precision=fp8`` without torchao.
        """
        # Whether channels_last can matter (image layers), what fp8 could convert, and whether
        # compile_scope=regions has blocks to compile: the search reads all three. Of the first model only
        # (a train_fn may call ctx.model more than once), each walk of the modules done once.
        if "activations_4d" not in self.extras:
            self.extras["activations_4d"] = has_4d_activations(module)
            self.extras["linear_layers"] = _float8.linear_shapes(module)
            self.extras["repeated_blocks"] = [g.describe() for g in _regions.repeated_blocks(module)]
        if "pairing.weights" not in self.extras:
            # The verdict pairs this trial with the fp32 reference at its seed: same initial weights is
            # half of what that needs. Two sums, once per trial, before any knob touches the module.
            self.extras["pairing.weights"] = tensor_fingerprint([p.detach() for p in module.parameters()])
        if self.probe == "loader":
            return module  # a loader probe never steps the model: no device copy, no compile
        return _knobs.prepare_model(module, self.config, self.device, record=self.extras)

    def ddp(self, model: torch.nn.Module) -> torch.nn.Module:
        """Wrap the model (from ``ctx.model``) for a trial of several ranks: ``DistributedDataParallel`` with
        ``bucket_cap_mb``, ``gradient_as_bucket_view``, ``static_graph`` and ``grad_compression`` (``bf16``
        registers torch's bf16 compression comm hook). ``ctx.train_step`` then runs the micro-steps that only
        accumulate under ``no_sync()``. A compiled model is compiled around the DDP module instead. With one
        process per trial the model is returned as it is.

        Raises:
            KnobError: the model is already in DDP.
        """
        if self.world_size == 1:
            return model
        timer = _distributed.CommTimer(self.device)
        self._comm_timers.append(timer)
        wrapped = _distributed.wrap(model, self.config, self.device, timer)
        self.extras["ddp.world_size"] = self.world_size
        return wrapped

    def optimizer(self, cls: type, params: Iterable[Any], **kwargs: Any) -> torch.optim.Optimizer:
        """Build ``cls(params, **kwargs)`` with what the config needs: ``foreach=True`` or ``fused=True`` as
        ``optimizer_impl`` says (``default`` leaves torch's choice), capturable for CUDA Graphs, fused for fp16
        inside a graph.

        Raises:
            KnobError: ``cls`` has no such implementation, or ``kwargs`` already choose one.
        """
        options = _knobs.optimizer_options(cls, self.config, self.device, given=kwargs)
        return cls(params, **{**options, **kwargs})

    def checkpoint(self, module: torch.nn.Module) -> torch.nn.Module:
        """Wrap a block (a transformer layer, a stage) for activation checkpointing, as the
        ``activation_checkpointing`` knob says: when it is on, the block's activations are not kept for the
        backward pass but recomputed there (``torch.utils.checkpoint``, ``use_reentrant=False``), trading
        compute for memory. When it is off the module is returned as it is. The module keeps its
        parameters and state_dict keys either way."""
        return _knobs.checkpointed(module) if self.config.activation_checkpointing else module

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """Attention as the ``attention`` knob says, with the arguments of
        ``torch.nn.functional.scaled_dot_product_attention`` (``attn_mask``, ``dropout_p``, ``is_causal``,
        ``scale``): ``explicit`` writes it out (``softmax(q k^T * scale) v``), every other value calls SDPA,
        whose backend ``train_step`` and ``autocast`` pin. A model that calls SDPA itself gets the backend
        too, but not ``explicit``."""
        if self.config.attention == "explicit":
            return _knobs.explicit_attention(query, key, value, **kwargs)
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, **kwargs)

    def loader(self, dataset: Any, *, shuffle: bool = True, transform: Any = None, **kwargs: Any) -> Iterable[Any]:
        """A DataLoader with the config's batch size, workers, pinning and prefetching.

        ``dataset`` may also be the script's own ``torch.utils.data.DataLoader``: it is rebuilt with the
        trial's loader knobs (workers, pinning, prefetching, persistent workers), keeping its dataset,
        ``collate_fn``, ``drop_last`` and ``worker_init_fn``. Its shuffle (a ``RandomSampler``) becomes the
        seeded order below, a sequential one stays sequential, any other sampler is kept as it is.

        A ``batch_size`` the script passes (here, or its DataLoader's) is the batch it trains at: the trial
        still loads at the config's batch, and the reference run records it (``script_batch_size``) so the
        study adopts it as the baseline's global batch unless the space or ``--baseline`` says otherwise.
        Likewise a DataLoader's workers, pinning, prefetching and persistence are what the script loads with
        (``script_loader``): the study's baseline takes them, so a speed-up is over the script as written.

        The data order depends only on ``ctx.seed``, never on the batch size, so every trial sees the
        same samples in the same order. Incomplete last batches are dropped (static shapes). In a trial of
        several ranks each rank reads its own share of every epoch's order (every ``world_size``-th sample).

        With ``loader=device`` the whole dataset is collated (``collate_fn`` or the default collate) and
        copied to the device once, and each batch is indexed there: the same samples in the same order as
        the DataLoader's, element by element. A study's trial that loads in this process (no workers)
        also checks whether its dataset could be served so, and records the answer (``device_loader``).

        ``transform`` declares the transforms of a dataset that holds none (torchvision's keep theirs in
        ``dataset.transform``, which is found there): it is applied to each item's first field. With
        ``augment=device`` the items are served before their transforms (the image as a tensor, uint8 from a
        PIL image) and the same transforms run on each batch on the device, each sample with its own draw
        (``autotune.trial._augment``); the batches come out on the device. The study's trial that loads in
        this process records whether its dataset could be served so (``device_augment``).

        Raises:
            KnobError: ``shuffle`` with an IterableDataset; ``loader=device`` for a dataset it cannot keep
                (random augmentation, no ``__len__``, an IterableDataset, too large for
                ``device_data_share``), with the reason; a DataLoader with its own ``batch_sampler``;
                ``augment=device`` for transforms it cannot run on the device (the first one named).
        """
        cfg = self.config
        sampler = None
        if isinstance(dataset, torch.utils.data.DataLoader):
            # What the script loads with as written: the study's baseline is the script, its loader included.
            self.extras["script_loader"] = _loader_knobs_of(dataset, cuda=self.device.type == "cuda")
            if self.run is not None and self.adopt_script_batch:  # a real run of the script as written
                self._train_with(self.config.replace(**self.extras["script_loader"]))
            dataset, shuffle, sampler, kept = _adopt_loader(dataset)
            kwargs = {**kept, **kwargs}
        script_batch = kwargs.pop("batch_size", None)
        if script_batch is not None:
            self.extras["script_batch_size"] = int(script_batch) * self.world_size
            self._adopt_batch(int(script_batch))
        cfg = self.config
        options: dict[str, Any] = {"batch_size": cfg.batch_size, "drop_last": True}
        if sampler is not None:
            options["sampler"] = sampler
        elif isinstance(dataset, torch.utils.data.IterableDataset):
            if shuffle and cfg.loader != "device":  # loader=device refuses it with its own reason
                raise KnobError("ctx.loader cannot shuffle an IterableDataset (it has no indices): pass shuffle=False")
        else:
            options["sampler"] = DataOrder(len(dataset), seed=self.seed, shuffle=shuffle, rank=self.rank,
                                           world_size=self.world_size)
        self.extras["loader_built"] = True  # ctx.loader is in use: the loop may probe the loader apart
        if self.probe == "loader":
            self._probe_loaders(dataset, options, kwargs, transform)  # raises ProbeDone
        options = self._loader_options(cfg, options, kwargs)
        if self.budget is not None and cfg.loader != "device" and options["num_workers"] == 0:
            # Items are read in this process anyway, so a few more reads fork no worker with open handles.
            share = cfg.device_data_share
            written = _augment.Transformed(dataset, transform) if transform is not None else dataset
            self.extras["device_loader"] = _resident.refusal(written, share=share, device=self.device) or "ok"
            self._check_augment(dataset, transform, options)
        loader = self._serve(dataset, options, cfg, transform)
        with contextlib.suppress(TypeError):
            self._epoch_steps = len(loader)
        return loader

    def _serve(self, dataset: Any, options: dict[str, Any], cfg: TrialConfig, transform: Any = None, *,
               variant: bool = False) -> Iterable[Any]:
        """The loader of ``cfg`` over ``dataset`` with the DataLoader arguments ``options``: the transforms on
        the device under ``augment=device``, the (served) items on the device under ``loader=device``, else a
        DataLoader. ``variant``: a loader probe's further config, which records nothing of its own."""
        planned = None
        if cfg.augment == "device":
            try:
                planned = _augment.plan(dataset, transform, collate_fn=options.get("collate_fn"))
            except _augment.Unsupported as exc:
                raise KnobError(f"augment=device: {exc}") from None  # the study reads it as DEVICE_AUGMENT_REFUSAL
            dataset = planned.served
            if cfg.loader != "device":
                options = {**options, "collate_fn": planned.collate}  # stacks the images, or pads several sizes
            elif not planned.one_size:
                raise KnobError(f"loader=device: {SEVERAL_SIZES}")
        elif transform is not None:
            dataset = _augment.Transformed(dataset, transform)
        if cfg.loader == "device":
            loader: Iterable[Any] = self._device_loader(dataset, options, cfg if variant else None)
        else:
            loader = torch.utils.data.DataLoader(dataset, **options)
        if planned is None:
            return loader
        # One stream of draws per rank: ranks of one trial augment their shares differently, as workers would.
        pipeline = _augment.compile_pipeline(planned.transform, planned.chw, integer=planned.integer,
                                             seed=self.seed * 1_000_003 + self.rank, device=self.device)
        if not variant:
            self.extras["augment_transforms"] = planned.names
        return _augment.AugmentedLoader(loader, pipeline, planned.path, self.device)

    def _check_augment(self, dataset: Any, transform: Any, options: dict[str, Any]) -> None:
        """Record whether ``augment=device`` could serve ``dataset`` (``device_augment``: "ok" or why not, the
        transform it cannot run named) and, where the dataset as written cannot be kept on the device, whether
        its items before their transforms could (``device_loader_augmented``)."""
        try:
            planned = _augment.plan(dataset, transform, collate_fn=options.get("collate_fn"))
        except _augment.Unsupported as exc:
            self.extras["device_augment"] = str(exc)
            return
        self.extras["device_augment"] = "ok"
        self.extras["augment_transforms"] = planned.names
        if self.extras.get("device_loader") != "ok":
            share = self.config.device_data_share
            self.extras["device_loader_augmented"] = SEVERAL_SIZES if not planned.one_size else \
                _resident.refusal(planned.served, share=share, device=self.device) or "ok"

    def _adopt_batch(self, script_batch: int) -> None:
        """Under ``adopt_script_batch``: train at the script's per-rank ``batch_size`` from here on, when the
        config differs and nothing read so far depends on the batch (a length, a step clock, a loss buffer
        too small for the steps at the smaller batch); else the study runs the reference again at it."""
        cfg = self.config
        if not self.adopt_script_batch or (self.budget is None and self.run is None) or script_batch <= 0:
            return
        adopted = cfg.replace(batch_size=script_batch, global_batch=None)
        if adopted.global_batch_size == cfg.global_batch_size or self._length_read or cfg.accumulation_steps != 1:
            return
        if self.run is not None and self.run.total_micro is not None:
            return
        if self.budget is not None:
            steps = self.budget.samples // adopted.global_batch_size + LOSS_SLACK
            if not all(step.ensure_loss_capacity(steps) for step in self._train_steps):
                return
        if self.baseline_batch_size == cfg.global_batch_size:
            self.baseline_batch_size = adopted.global_batch_size  # the reference is the baseline: lr_scale stays 1
        self._train_with(adopted)
        self.extras["batch_adopted"] = adopted.global_batch_size

    def _train_with(self, config: TrialConfig) -> None:
        """Train with ``config`` from here on; a real run's length and clock read it too."""
        self.config = config
        if self.run is not None:
            self.run.config = config

    def _deadline(self) -> Optional[float]:
        """When this run's time share ends (``Budget.seconds``, on ``time.perf_counter``), or None."""
        # Ranks would each shorten by their own clock (and disagree on the steps): only one-process runs.
        if self.budget is None or self.budget.seconds is None or self._copy is not None or self.probe \
                or self.world_size > 1:
            return None
        return self._created + self.budget.seconds

    def _loader_options(self, cfg: TrialConfig, options: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The DataLoader's arguments under ``cfg``'s loader knobs (the script's own ``kwargs`` win)."""
        out = {**options, "num_workers": cfg.num_workers, "pin_memory": cfg.pin_memory and self.device.type == "cuda"}
        if cfg.num_workers > 0:
            out["prefetch_factor"] = cfg.prefetch_factor
            out["persistent_workers"] = cfg.persistent_workers
        out.update(kwargs)
        return out

    def _probe_loaders(self, dataset: Any, options: dict[str, Any], kwargs: dict[str, Any],
                       transform: Any = None) -> None:
        """A loader probe: the config's loader, then each of ``loader_variants``, built on the dataset and
        iterated alone (``_measure_loader``). The config's windows are the probe's measurement; each
        variant's median window rate, or why it could not be built, goes to ``extras``. A variant whose first
        window runs below ``SLOW_VARIANT_SHARE`` of the fastest before it stops there. Raises ProbeDone."""
        rates: list[Optional[float]] = []
        errors: list[Optional[str]] = []
        windows: list[int] = []  # each variant's timed windows (1: it stopped as too slow)
        first: tuple[float, int] = (0.0, 0)
        fastest = 0.0
        for index, cfg in enumerate((self.config, *self.loader_variants)):
            # Each at its own batch: under batch_policy scale the batch is a lever of the loader too.
            built = self._loader_options(cfg, {**options, "batch_size": cfg.batch_size}, kwargs)
            recorder = self.recorder if index == 0 else WindowRecorder(self.device)
            try:
                loader = self._serve(dataset, built, cfg, transform, variant=bool(index))
                self._measure_loader(loader, cfg, recorder, stop_below=SLOW_VARIANT_SHARE * fastest if index else None)
            except Exception as exc:  # noqa: BLE001 - one variant's fault (a refusal, a worker's crash) is its own
                if index == 0:
                    raise
                rates.append(None)
                errors.append(f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
                windows.append(0)
                self._keep_partial(first, rates, errors, windows)
                continue
            finally:
                loader = None  # its workers end before the next variant's start
            rate = statistics.median(w.throughput for w in recorder.windows)
            fastest = max(fastest, rate)
            if index:
                rates.append(rate)
                errors.append(None)
                windows.append(len(recorder.windows))
            else:
                first = (rate, len(recorder.windows))
            self._keep_partial(first, rates, errors, windows)
        self.extras["probe"] = "loader"
        if self.loader_variants:
            self.extras["loader_rates"] = rates
            self.extras["loader_errors"] = errors
            self.extras["loader_windows"] = windows
        raise ProbeDone("the loader probe measured its windows")

    def _keep_partial(self, first: tuple[float, int], rates: list[Optional[float]], errors: list[Optional[str]],
                      windows: list[int]) -> None:
        """Write what the loader probe measured so far: a probe killed at its deadline loses only the config
        it was measuring (the coordinator reads it with ``read_partial``)."""
        if self._partial_path is None:
            return
        data = {"rates": [first[0], *rates], "errors": [None, *errors], "windows": [first[1], *windows]}
        try:
            write_atomic(self._partial_path, json.dumps(data))
        except OSError:
            pass  # a full disk costs the partial record only; the result is written apart

    def _measure_loader(self, loader: Iterable[Any], cfg: TrialConfig, recorder: WindowRecorder,
                        stop_below: Optional[float] = None) -> None:
        """The trial's warm-up and timed windows of batches from ``loader`` alone (no model step, no device
        copy), recorded in ``recorder``; only the first when its rate is below ``stop_below``."""
        steps, warmup, window_steps = self._plan()
        # Past the workers' start and their first prefetch, so the windows see the steady rate.
        warmup = max(warmup, 2 + cfg.num_workers * (cfg.prefetch_factor or 2))
        iterator = iter(loader)

        def fetch() -> Any:
            nonlocal iterator
            try:
                return next(iterator)
            except StopIteration:
                iterator = iter(loader)
                return next(iterator)

        for _ in range(max(1, warmup)):
            fetch()
        for _ in range(self.budget.windows if self.budget else 3):
            recorder.begin_window()
            for _ in range(window_steps):
                began = time.perf_counter()
                samples = batch_length(fetch())
                recorder.add(samples, time.perf_counter() - began)
            if recorder.end_window().throughput < (stop_below or 0.0):
                break
        del iterator

    def _device_loader(self, dataset: Any, options: dict[str, Any],
                       cfg: Optional[TrialConfig] = None) -> _resident.DeviceLoader:
        """``loader=device``: the dataset on the device, batched as the DataLoader of ``options`` would."""
        share = (cfg or self.config).device_data_share
        refused = _resident.refusal(dataset, share=share, device=self.device)
        if refused:
            raise KnobError(f"loader=device: {refused}")  # the study reads it as DEVICE_LOADER_REFUSAL
        batches = options.get("batch_sampler") or torch.utils.data.BatchSampler(
            options["sampler"], options["batch_size"], options["drop_last"])
        collate = options.get("collate_fn") or torch.utils.data.default_collate
        served = _resident.build(dataset, batch_sampler=batches, collate_fn=collate, device=self.device, share=share)
        if cfg is None:  # the trial's own loader, not a probe's variant
            self.extras["input_backend"] = "device"
            self.extras["device_data_gib"] = round(served.nbytes / 2**30, 4)
        return served

    def image_loader(
        self,
        source: ImageSource,
        *,
        size: int = 224,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        shuffle: bool = True,
    ) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        """Training batches from an image folder (``root/<class>/<image>``) or a list of ``(path, label)``.

        The backend is ``config.loader``: ``torch`` decodes with PIL in ``ctx.loader`` workers (so the
        worker, pinning and prefetch knobs apply) and normalises on the device; ``dali`` runs an NVIDIA
        DALI pipeline with ``dali_threads`` and ``dali_prefetch`` (on the GPU, or CPU-only without one).
        Both apply a random resized crop to ``size``, a random horizontal flip and ``(x - mean) / std``,
        and yield ``(images, labels)`` on the device: images ``(N, 3, size, size)`` in the precision's
        input dtype, channels_last when configured; labels int64. Incomplete batches are dropped. In a
        distributed job (``RANK``/``WORLD_SIZE`` or ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``) each process
        reads its own shard.

        Raises:
            WorkloadError: the source holds no image.
            KnobError: the shard holds fewer images than one batch, or ``loader=dali`` without DALI.
        """
        cfg = self.config
        listing = _images.list_images(source)
        shard = _images.shard_from_env()
        start, end = shard.bounds(len(listing.samples))
        if end - start < cfg.batch_size:
            where = f" in shard {shard.index} of {shard.count}" if shard.count > 1 else ""
            raise KnobError(
                f"the image source has {end - start} images{where}, fewer than one batch of {cfg.batch_size} "
                "(incomplete batches are dropped)"
            )
        dtype = _images.input_dtype(cfg.precision)
        if cfg.loader == "dali":
            from autotune.trial import _dali

            self.extras["input_backend"] = "dali-gpu" if self.device.type == "cuda" else "dali-cpu"
            return _dali.build(listing, config=cfg, device=self.device, seed=self.seed, size=size, mean=mean,
                               std=std, shuffle=shuffle, shard=shard, dtype=dtype)
        self.extras["input_backend"] = "torch"
        samples = _images.shard_samples(listing, shard, seed=self.seed, shuffle=shuffle)
        loader = self.loader(_images.ImageFolderDataset(samples, size), shuffle=shuffle)
        return _images.DeviceImages(loader, device=self.device, dtype=dtype, channels_last=cfg.channels_last,
                                    mean=mean, std=std, non_blocking=loader.pin_memory)

    def train_step(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Optional[Callable[..., torch.Tensor]] = None,
        *,
        clip_grad_norm: Optional[float] = None,
        scheduler: Any = None,
    ) -> _knobs.TrainStep:
        """A callable step with autocast, the attention backend, GradScaler, gradient accumulation
        (``config.accumulation_steps`` micro-batches per optimizer step) and CUDA Graphs applied. In a
        study it also records the training loss of every step for the accuracy verdict.

        ``step(inputs, targets)`` takes its loss from ``loss_fn(model(inputs), targets)``; without a
        ``loss_fn`` it calls ``model(inputs, targets)``, a model that computes its own loss. ``step(batch)``
        calls ``model(**batch)`` for a dict (``model(*batch)`` for a tuple) and takes ``loss_fn(outputs,
        batch)``, or without a ``loss_fn`` the model's own. A model's own loss is ``outputs["loss"]`` of a
        mapping, the one scalar tensor of a tuple (``(logits, loss)``), or ``outputs.loss``.

        Args:
            model: The model (from ``ctx.model``).
            optimizer: Its optimizer (from ``ctx.optimizer``).
            loss_fn: ``loss_fn(outputs, targets)`` or ``loss_fn(outputs, batch)``; None: the model's own loss.
            clip_grad_norm: Clip the gradient of each optimizer step to this total norm, on the device
                (captured with the step under CUDA Graphs).
            scheduler: An LR scheduler of ``optimizer``, stepped after every optimizer step. Under CUDA
                Graphs the learning rates become device tensors that it fills between replays.

        Raises:
            KnobError: the config cannot run here, or the scheduler's optimizer cannot take a tensor LR
                inside a graph (the message names why).
        """
        capacity = self._plan()[0] + LOSS_SLACK if self.budget is not None else 0
        step = _knobs.TrainStep(model, optimizer, loss_fn, config=self.config, device=self.device,
                                loss_capacity=capacity, clip_grad_norm=clip_grad_norm, scheduler=scheduler)
        self._train_steps.append(step)
        return step

    def autocast(self) -> Any:
        """The config's autocast context and attention backend, for evaluation code. The object can be kept
        and entered again and again (``ctx_ = ctx.autocast()`` once, ``with ctx_:`` in every evaluation), as
        scripts keep their ``torch.autocast``."""
        return _Reentered(lambda: _knobs.forward_context(self.config, self.device))

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """Copy a batch tensor to the device (asynchronously when pinned), channels_last for images."""
        tensor = tensor.to(self.device, non_blocking=self.config.pin_memory)
        if self.config.channels_last and tensor.dim() == 4 and tensor.is_floating_point():
            tensor = tensor.contiguous(memory_format=torch.channels_last)
        return tensor

    # -- epochs ----------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """Epochs of ``ctx.batches``' loader done so far: inside an ``on_epoch_end`` hook, the one that just
        ended counts. A study's trial trains a few seconds, so its epochs are not the real run's."""
        return self.run.epoch if self.run is not None else self._epoch

    def on_epoch_end(self, hook: Callable[[int], Any]) -> None:
        """Call ``hook(epoch)`` (0-based) after each epoch of ``ctx.batches``: the script's evaluation and
        checkpointing, as it would run them between epochs. Under ``autotune train`` the hook runs outside
        the timed windows; a study's trial never calls it (its samples are not epochs of the real run), so
        the study measures the training steps alone. Register it before the loop."""
        if self.run is not None:
            self.run.hooks.append(hook)
        else:
            self._epoch_hooks.append(hook)

    def on_step_end(self, hook: Callable[[int], Any], *, every: int, what: str = "evaluation") -> None:
        """Call ``hook(step)`` after every ``every``-th optimizer step of the real run (``autotune train``):
        an evaluation or a checkpoint every N steps, as nanoGPT's ``eval_interval``. It runs outside the timed
        windows, its seconds reported beside the delivered throughput under ``what``. A study's trial never
        calls it (a trial's steps are not the real run's). Register it before the loop.

        Raises:
            ValueError: ``every`` is not a positive whole number.
        """
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"every must be a positive number of optimizer steps, not {every!r}")
        if self.run is not None:
            self.run.step_hooks.append((every, what, hook))

    def epochs(self, epochs: Iterable[int]) -> Iterator[int]:
        """The script's own epoch loop (``for epoch in ctx.epochs(range(args.start_epoch, args.epochs)):``),
        with ``ctx.batches(loader)`` inside it: in a study's trial, one pass (the trial's budget, whatever
        its epochs); under ``autotune train``, one epoch of the loader per pass, as long as the run's length
        (``--epochs``, ``--steps``, ``--minutes``) lasts, numbered on from the script's own past its last; in a
        context built by hand, the script's epochs as they are. The script's work between epochs (validation,
        an epoch schedule's ``step()``, checkpoints) then runs outside the timed windows."""
        if self.budget is not None:
            yield next(iter(epochs))
            return
        if self.run is None:
            yield from epochs
            return
        run = self.run
        run.epoch_at_a_time = True
        last = None
        for last in epochs:
            if run.finished:
                return
            yield last
            run.count_between_epochs()
        while not run.finished:  # the run is longer than the script's own epochs: on, numbered on
            last, before = (last + 1) if isinstance(last, int) else 0, run.micro
            yield last
            run.count_between_epochs()
            if run.micro == before:  # the pass trained nothing (no ctx.batches in it): no more passes
                return

    @contextlib.contextmanager
    def untimed(self, what: str = "evaluation") -> Iterator[None]:
        """Keep the block's time out of the throughput: work inside the training loop that is not training
        (``if it % 250 == 0: with ctx.untimed("evaluation"): estimate_loss()``). Under ``autotune train`` the
        timed window closes before it and its seconds are reported under ``what``; in a study's trial the
        window's clock stops while it runs. Either way the device finishes the queued training work first."""
        if self.run is not None:
            with self.run.untimed(what):
                yield
            return
        if not self.recorder.in_window:
            yield
            return
        block = BlockSeconds(self.device)
        try:
            with block:
                yield
        finally:
            self.recorder.exclude(block.seconds)
            self.extras[f"untimed.{what}"] = round(self.extras.get(f"untimed.{what}", 0.0) + block.seconds, 6)

    # -- measured iteration ----------------------------------------------------------------------
    def _plan(self) -> tuple[int, int, int]:
        """Steps (micro-batches) in all, warm-up steps, and steps per timed window. With accumulation each
        is a whole number of global batches where it can be, so every window holds the same optimizer steps."""
        assert self.budget is not None
        accumulation = self.config.accumulation_steps
        steps = self.budget.samples // self.config.global_batch_size * accumulation
        warmup = self.budget.warmup_steps
        if self.config.cuda_graphs:
            warmup = max(warmup, _knobs.GRAPH_WARMUP_STEPS + 2)  # eager warm-up, capture, one replay
        warmup = -(-warmup // accumulation) * accumulation
        window_steps = (steps - warmup) // self.budget.windows
        if window_steps >= accumulation:
            window_steps -= window_steps % accumulation
        if window_steps < 1:
            raise KnobError(
                f"budget of {self.budget.samples} samples leaves no timed window at batch "
                f"{self.config.batch_size} after {warmup} warm-up steps"
            )
        return steps, warmup, window_steps

    @property
    def micro_steps(self) -> int:
        """Micro-batches this trial's schedule spans: ``optimizer_steps x config.accumulation_steps``.

        Every run of a study spans the same samples. Under a short budget a study may train fewer of them
        than its schedule spans (``Budget.schedule_samples``): ``ctx.batches`` stops there, the schedule
        does not change. Outside a study, one epoch of the last ``ctx.loader``.

        Raises:
            KnobError: outside a study before any ``ctx.loader``, or the budget leaves no timed window.
        """
        if self.budget is not None:
            self._length_read = True
            scheduled = self.budget.scheduled // self.config.global_batch_size * self.config.accumulation_steps
            return max(self._plan()[0], scheduled)
        if self.run is not None:
            return self.run.plan(self._epoch_steps)
        if self._epoch_steps is None:
            raise KnobError("ctx.micro_steps outside a study counts one epoch of ctx.loader: build it first")
        return self._epoch_steps

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps this trial takes (``ctx.batches`` with ``ctx.train_step``): the ``T_max`` of a
        cosine schedule, the ``total_steps`` of OneCycle. Every trial of a study trains on the same samples,
        so a larger batch takes fewer steps. Under ``autotune train``, the whole run's (a run of epochs
        knows it once ``ctx.loader`` is built). Outside both, one epoch of the last ``ctx.loader``.

        Raises:
            KnobError: outside a study before any ``ctx.loader``, or the budget leaves no timed window.
        """
        return self.micro_steps // self.config.accumulation_steps

    @property
    def warmup_steps(self) -> int:
        """Optimizer steps of the trial's untimed warm-up (compile, cuDNN tuning, graph capture); under
        ``autotune train`` the real run's, which its delivered throughput leaves out; 0 outside both. A
        schedule's own warm-up is the script's choice: this says which steps are not measured.

        Raises:
            KnobError: the budget leaves no timed window.
        """
        if self.run is not None:
            return self.run.warmup_micro // self.config.accumulation_steps
        if self.budget is None:
            return 0
        self._length_read = True
        return self._plan()[1] // self.config.accumulation_steps

    def step_clock(self) -> Any:
        """The budget's warm-up and timed windows for a loop that autotune does not drive (a trainer's).

        ``ctx.batches`` runs on the same clock; ``autotune.integrations`` feed it from a trainer's callbacks.
        Under ``autotune train`` it is the real run's clock (``_run.RunClock``: the run's length, windows and
        hooks); in a context built by hand with neither, a clock that times nothing and leaves the trainer's
        own length (``UntimedClock``).

        Raises:
            KnobError: the budget leaves no timed window.
        """
        if self.run is not None:
            return self.run.step_clock()
        if self.budget is None:
            return UntimedClock()
        self._length_read = True
        return StepClock(self)

    def batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        """Yield device batches: warm-up steps, then the timed windows, until the budget is spent.

        The loader is restarted as often as needed. Under ``autotune train`` it yields the run's length
        (``ctx.optimizer_steps`` optimizer steps), restarting the loader every epoch and running the
        ``on_epoch_end`` hooks between epochs; after a Ctrl-C it ends at the next optimizer step. Outside
        both it yields one epoch, untimed.

        A DataLoader with workers from ``ctx.loader`` (or ``image_loader``'s torch path) is also restarted
        halfway through the warm-up, at the same place in the same sample order. Its workers keep
        decoding while the first steps are slow (compile, cuDNN benchmarking, graph capture), so by the
        end of the warm-up they have a backlog of ``num_workers x prefetch_factor`` batches. Timed
        windows served from that backlog would clock a loader-bound config at its compute speed. The
        restart drops the backlog, and the pipeline's cold start falls in the rest of the warm-up.
        """
        if self.run is not None:
            yield from self.run.batches(self, loader)
            self._epoch = self.run.epoch
            return
        if self.budget is None:
            for batch in loader:
                yield self._move(batch)
            self._epoch += 1
            for hook in self._epoch_hooks:
                hook(self._epoch - 1)
            return
        clock = StepClock(self, deadline=self._deadline())
        if self.probe == "step":
            # A step probe: a few real batches kept on the device and replayed, so no step waits on the loader.
            source = iter(loader)
            kept = [self._move(b) for b in itertools.islice(source, STEP_PROBE_BATCHES)]
            del source  # its workers stop: nothing else is read from the loader
            if not kept:
                raise KnobError(f"the loader yields no batch of {self.config.batch_size}")
            self.extras["probe"] = "step"
            self.extras["probe_batches"] = len(kept)
            loader = _Replay(kept)
        iterator = iter(loader)
        order = _resumable_order(loader)
        restart_at = clock.warmup // 2 if clock.warmup >= 2 and order is not None else None
        epoch_samples = 0
        step = 0
        try:
            # A co-located copy trains on past its budget (untimed) until every copy has ended its windows.
            while not clock.done:
                if step == restart_at:
                    assert order is not None
                    order.resume_at(epoch_samples)  # same samples, same order: only the backlog is dropped
                    iterator = iter(loader)
                clock.begin()
                try:
                    batch = next(iterator)
                except StopIteration:
                    iterator = iter(loader)
                    epoch_samples = 0
                    self._epoch += 1
                    batch = next(iterator, None)
                    if batch is None:
                        raise KnobError(
                            f"the loader yields no batch of {self.config.batch_size} (is the dataset smaller than "
                            "the batch? ctx.loader drops incomplete batches)"
                        ) from None
                batch = self._move(batch) if self.probe != "step" else batch
                if step < self.config.accumulation_steps:
                    self._fingerprint_batch(batch, step)
                clock.fetched()
                yield batch
                samples = batch_length(batch)
                epoch_samples += samples
                clock.end(samples)
                step += 1
        finally:
            clock.close()
        self._check_finite()

    def _fingerprint_batch(self, batch: Any, step: int) -> None:
        """Add one micro-batch of the first global batch to ``extras["pairing.batch"]``: per tensor, its sum
        and sum of squares, which do not depend on how the global batch is split into micro-batches. The
        verdict compares them with the fp32 reference's at the same seed (same samples, same order)."""
        sums = tensor_fingerprint(_tensors(batch))
        if step == 0 or "pairing.batch" not in self.extras:
            self.extras["pairing.batch"] = sums
        elif len(sums) == len(self.extras["pairing.batch"]):
            self.extras["pairing.batch"] = [a + b for a, b in zip(self.extras["pairing.batch"], sums)]

    def _gpu_sampler(self) -> Any:
        if self.device.type != "cuda":
            return None
        from autotune.hardware import GpuSampler

        sampler = GpuSampler(index=self.device.index or 0)
        return sampler if sampler.active else None

    def _move(self, batch: Any) -> Any:
        if isinstance(batch, torch.Tensor):
            return self.to_device(batch)
        if isinstance(batch, (list, tuple)):
            return type(batch)(self._move(b) for b in batch)
        if isinstance(batch, dict):
            return {k: self._move(v) for k, v in batch.items()}
        return batch

    def record_loss(self, loss: Any) -> None:
        """For hand-written loops: record the training loss of one optimizer step (a tensor stays on the
        device, so this does not synchronise)."""
        value = loss.detach().float().reshape(()) if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
        if self.run is not None:
            self.run.record_loss(value)
            return
        self._recorded_losses.append(value.clone())

    def _loss_trajectory(self) -> tuple[list[float], int]:
        """The training loss per optimizer step, binned to at most ``MAX_TRAJECTORY`` points, and the bin size."""
        if self._recorded_losses:
            losses = torch.stack([v.to("cpu") for v in self._recorded_losses]).tolist()
        else:
            losses = next((t for t in (s.loss_trajectory() for s in self._train_steps) if t), [])
        if self._planned_steps is not None:
            # A copy that trained on untimed for the others: its trajectory is the budget's, like every trial's.
            losses = losses[:self._planned_steps // self.config.accumulation_steps]
        return bin_means(losses, MAX_TRAJECTORY)

    def _check_finite(self) -> None:
        recorded = self._recorded_losses[-1] if self._recorded_losses else None
        if recorded is not None and self.config.precision != "fp16" and not bool(torch.isfinite(recorded)):
            # fp16 is left to its scaler, which skips non-finite steps by design (as below)
            raise NonFiniteLoss(f"training loss is {recorded.item()} at step {self._steps_done}")
        for step in self._train_steps:
            if step.scaler is not None:
                continue  # the scaler skips non-finite steps by design; skips are counted instead
            loss = step.last_loss
            if loss is not None and not bool(torch.isfinite(loss).all()):
                raise NonFiniteLoss(f"training loss is {loss.float().item()} at step {self._steps_done}")

    # -- manual reporting ----------------------------------------------------------------------
    def record_window(self, samples: int, seconds: float, *, steps: int = 1, data_wait_seconds: float = 0.0) -> None:
        """For hand-written loops: report one timed window (synchronise the device before timing)."""
        if seconds <= 0 or samples <= 0:
            raise ValueError("a window needs samples > 0 and seconds > 0")
        self.recorder.record(Window(seconds, steps, samples, data_wait_seconds))
        self._samples_done += samples
        self._steps_done += steps
        if len(self.recorder.windows) == 1:
            self._check_hopeless(None)

    def _stop_sampling(self, sampler: Any) -> None:
        """End the NVML sampling of the timed windows and keep its summary with the measurement."""
        if sampler is not None:
            sampler.stop()
            self.extras.update(sampler.summary())
            timed = sum(w.samples for w in self.recorder.windows)
            if "gpu.energy_j" in self.extras and timed > 0:  # the counter spans exactly the timed windows
                self.extras["gpu.joules_per_sample"] = round(self.extras["gpu.energy_j"] / timed, 6)

    def _check_hopeless(self, sampler: Any) -> None:
        rate = self.recorder.windows[0].throughput
        if self.prune_below is not None and rate < self.prune_below:
            self._stop_sampling(sampler)
            raise TrialPruned(
                f"pruned: first window ran at {rate:,.1f} samples/s, below {self.prune_below:,.1f} "
                "(the pruning fraction of the best first window so far)"
            )

    def report_metric(self, value: float) -> None:
        """Report the evaluation metric (accuracy, or a loss if the study minimises the metric)."""
        value = float(value)
        if not math.isfinite(value):
            raise NonFiniteLoss(f"evaluation metric is {value}")
        self.metric = value
        if self.run is not None:
            self.run.add_metric(value)  # each evaluation of a real run is kept, the best shown

    def record(self, key: str, value: Any) -> None:
        """Keep a JSON-serialisable value with the trial's measurement (shown in the dashboard).

        Raises:
            WorkloadError: ``value`` is not JSON-serialisable.
        """
        try:
            json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise WorkloadError(f"ctx.record({key!r}, ...): the value is not JSON-serialisable ({exc})") from None
        self.extras[key] = value

    def measurement(self) -> Measurement:
        """Summarise what this trial measured (called by autotune after ``train_fn`` returns)."""
        skips = sum(s.scaler_skips for s in self._train_steps)
        losses, every = self._loss_trajectory()
        if self._train_steps and skips > 0.5 * max(1, self._steps_done):
            raise NonFiniteLoss(f"the fp16 scaler skipped {skips} of {self._steps_done} steps as non-finite")
        if self.world_size > 1:
            self._record_ranks()
            losses = _distributed.mean_across_ranks(losses, self.device)  # the job's loss, not rank 0's shard
        if self.config.compile != "off":
            self.extras.update(compile_cache_record())  # whether the study's compile cache made it warm
        return summarize(
            self.recorder,
            total_samples=self._samples_done * self.world_size,
            total_steps=self._steps_done,
            compiled=self.config.compile != "off",
            capture_seconds=sum(s.capture_seconds for s in self._train_steps),
            metric=self.metric,
            scaler_skips=skips,
            graph_replays=sum(s.graph_replays for s in self._train_steps),
            extras=self.extras,
            losses=losses,
            loss_every=every,
        )

    def _record_ranks(self) -> None:
        """What the DDP knobs did, with the measurement: the all-reduce's share of the timed windows and
        the micro-steps run under ``no_sync()``."""
        timed = sum(w.seconds for w in self.recorder.windows)
        comm = sum(t.seconds for t in self._comm_timers)
        self.extras["ddp.world_size"] = self.world_size
        if self._comm_timers and timed > 0:
            self.extras["ddp.allreduce_seconds"] = round(comm, 6)
            self.extras["ddp.allreduce_share"] = round(min(1.0, comm / timed), 4)
            self.extras["ddp.allreduce_timer"] = "cuda-events" if self.device.type == "cuda" else "wall-clock"
        self.extras["ddp.no_sync_steps"] = sum(s.no_sync_steps for s in self._train_steps)


class StepClock:
    """The timed windows of one trial over its steps (micro-batches), whoever drives the loop.

    Each step is ``begin()`` before it fetches its batch, ``fetched()`` once the batch is on the device, and
    ``end(samples)`` after the step's work was queued. Over ``steps`` steps it keeps the budget's plan: the
    warm-up (whose first step runs on the compile clock when the config compiles), then ``windows`` timed
    windows of ``window_steps`` steps, each opened and closed with a device synchronisation, with the input
    wait of every step inside it; after the first window the trial may be pruned, and the loss is checked
    at every window's end. Steps after the last window still train (the loss trajectory), untimed.

    ``ctx.batches`` drives it from its own loop; the trainer adapters (``autotune.integrations``) from a
    trainer's callbacks, so a trainer's start-up before its first step and the evaluation after its last are
    never inside a window.
    """

    def __init__(self, ctx: TrialContext, *, deadline: Optional[float] = None) -> None:
        self.ctx = ctx
        self.steps, self.warmup, self.window_steps = ctx._plan()
        assert ctx.budget is not None
        self.timed_end = self.warmup + self.window_steps * ctx.budget.windows
        # With a deadline (a run's share of a study's budget) the windows are shortened to end inside it,
        # once the first steps of the first window have measured the step time (_shorten_to_deadline).
        self.deadline = deadline
        self._shorten_at = self.warmup + max(1, min(SHORTEN_PROBE_STEPS, self.window_steps // 4)) \
            if deadline is not None else None
        self.step = 0  # steps ended so far
        self._sampler = ctx._gpu_sampler()
        self._stalls = _DeviceInputWait(ctx.device)
        self._start: Optional[float] = None
        self._fetch = 0.0
        self._mark: Any = None
        self._wait = 0.0
        self._compiling: Optional[contextlib.AbstractContextManager] = None
        self._copy = ctx._copy
        self._timed_start = 0.0
        self.overtime_steps = 0  # steps a co-located copy trained past its budget, untimed

    @property
    def done(self) -> bool:
        """Every step of the budget has ended (and, for a co-located copy, every copy's timed windows)."""
        if self.step < self.steps:
            return False
        if self._copy is not None and not self._copy.all_timed():
            return False
        if self._copy is not None:
            self.ctx.extras["copy.busy_end"] = time.time()
            self.ctx.extras["copy.overtime_steps"] = self.overtime_steps
        return True

    def begin(self) -> None:
        """The next step starts: a timed window opens first when one is due, then the step fetches its batch."""
        step, recorder = self.step, self.ctx.recorder
        if self._start is None:
            self._start = time.perf_counter()
        if step == self.warmup and self._copy is not None:
            synchronize(self.ctx.device)  # the warm-up's queued work is done before this copy says it is ready
            self.ctx.extras["copy.barrier_wait_seconds"] = round(self._copy.arrive(), 4)
        if self.warmup <= step < self.timed_end and (step - self.warmup) % self.window_steps == 0:
            recorder.begin_window()
            if step == self.warmup:
                self._timed_start = time.time()
            for timer in self.ctx._comm_timers:
                timer.begin_window()
            if self._sampler is not None and step == self.warmup:
                self._sampler.start()
        self._fetch = time.perf_counter()
        self._mark = self._stalls.begin() if recorder.in_window else None

    def fetched(self) -> float:
        """The step has its batch on the device; returns the seconds it waited for it."""
        self._wait = time.perf_counter() - self._fetch
        self._stalls.end(self._mark, self._wait)
        self._mark = None
        if self.step == 0 and self.ctx.config.compile != "off":
            # The first compiled step compiles: it runs on the compile clock (the compile deadline).
            self._compiling = _phase.compiling()
            self._compiling.__enter__()
        return self._wait

    def end(self, samples: int) -> None:
        """The step's work is queued: count its samples, and close the warm-up or a window when it ends here.

        Raises:
            NonFiniteLoss: the loss is not finite at a window's end.
            TrialPruned: the first window ran below the pruning threshold.
        """
        ctx, step, recorder = self.ctx, self.step, self.ctx.recorder
        if self._compiling is not None:
            synchronize(ctx.device)
            self._leave_compile_clock()
        self.step += 1
        if step >= self.steps:  # a copy training on for the others: not part of its measurement
            self.overtime_steps += 1
            ctx._planned_steps = self.steps
            return
        ctx._steps_done += 1
        ctx._samples_done += samples
        if recorder.in_window:
            recorder.add(samples, self._wait)
        assert self._start is not None, "StepClock.end() without begin()"
        if step == 0:
            synchronize(ctx.device)
            recorder.first_step_seconds = time.perf_counter() - self._start
        if step + 1 == self.warmup:
            synchronize(ctx.device)
            recorder.warmup_seconds = time.perf_counter() - self._start
        if step + 1 == self._shorten_at:
            self._shorten_to_deadline()
        if self.warmup < step + 1 <= self.timed_end and (step + 1 - self.warmup) % self.window_steps == 0:
            window = recorder.end_window()
            for timer in ctx._comm_timers:
                timer.end_window()
            window.data_wait_seconds += self._stalls.collect()
            if step + 1 == self.timed_end:
                ctx._stop_sampling(self._sampler)
                if self._copy is not None:
                    ended = time.time()
                    ctx.extras.update({"copy.timed_start": self._timed_start, "copy.timed_end": ended,
                                       "copy.busy_end": ended})
                    self._copy.timed_done(self._timed_start, ended)
            ctx._check_finite()
            if len(recorder.windows) == 1:
                ctx._check_hopeless(self._sampler)

    def _shorten_to_deadline(self) -> None:
        """Shorten every timed window so that the run ends inside its deadline, at the step time measured
        over the first steps of the first window. Nothing is cut when the planned steps fit; a window keeps
        at least one step past those already run. Records the trained length (``extras["shortened"]``)."""
        ctx, assert_deadline = self.ctx, self.deadline
        assert assert_deadline is not None and ctx.budget is not None
        synchronize(ctx.device)
        now = time.perf_counter()
        done = self.step - self.warmup
        started = ctx.recorder._start
        step_time = (now - started) / done if done and started is not None else 0.0
        if step_time <= 0:
            return
        windows, accumulation = ctx.budget.windows, ctx.config.accumulation_steps
        # The evaluation after the loop and the process's exit are not known yet: keep a tenth back.
        affordable = int(((assert_deadline - now) * (1 - SHORTEN_RESERVE) / step_time + done) // windows)
        window = max(done + 1, min(self.window_steps, affordable))
        window = -(-window // accumulation) * accumulation  # whole optimizer steps in every window
        if window >= self.window_steps:
            return
        planned = self.steps
        self.window_steps = window
        self.timed_end = self.warmup + window * windows
        self.steps = self.timed_end
        trained = self.steps // accumulation * ctx.config.global_batch_size
        ctx.extras["shortened"] = {"samples": trained, "from_samples": planned // accumulation
                                   * ctx.config.global_batch_size, "seconds": ctx.budget.seconds,
                                   # what the full length would have added, at the measured step time
                                   "missing_seconds": round((planned - self.steps) * step_time, 1)}

    def close(self) -> None:
        """The loop ended, or failed: a first step still on the compile clock leaves it."""
        self._leave_compile_clock()

    def _leave_compile_clock(self) -> None:
        if self._compiling is not None:
            compiling, self._compiling = self._compiling, None
            compiling.__exit__(None, None, None)


class DataOrder(torch.utils.data.Sampler):
    """The sample order of ``ctx.loader``: fixed by the seed and the epoch, never by the batch size.

    Each ``iter()`` starts the next epoch, shuffled afresh, unless ``resume_at`` asked to continue the
    current one: then the next ``iter()`` yields the rest of it, so a DataLoader can be restarted
    without changing which samples a trial sees.

    Args:
        n: Dataset length.
        seed: The trial's seed.
        shuffle: A new permutation each epoch; otherwise ``0 .. n-1``.
        rank: This rank, of ``world_size``: it yields every ``world_size``-th sample of the order from its
            own offset (the same permutation on every rank, so the ranks' shares never overlap).
        world_size: Ranks that share the data.
    """

    def __init__(self, n: int, *, seed: int, shuffle: bool, rank: int = 0, world_size: int = 1) -> None:
        self.n = n
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self.epoch = -1
        self._resume: Optional[int] = None

    def __len__(self) -> int:
        return self.n // self.world_size

    def resume_at(self, consumed: int) -> None:
        """Make the next ``iter()`` continue this epoch after its first ``consumed`` samples."""
        self._resume = consumed

    def __iter__(self) -> Iterator[int]:
        if self._resume is None or self.epoch < 0:
            self.epoch, skip = self.epoch + 1, 0
        else:
            skip = self._resume
        self._resume = None
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            order = torch.randperm(self.n, generator=generator).tolist()
        else:
            order = list(range(self.n))
        mine = order[self.rank:self.n // self.world_size * self.world_size:self.world_size]
        return iter(mine[skip:])


def _adopt_loader(loader: torch.utils.data.DataLoader) -> tuple[Any, bool, Any, dict[str, Any]]:
    """What ``ctx.loader`` keeps of a script's DataLoader: its dataset, whether it shuffles, a sampler of
    its own (None for a random or sequential one, which become ``DataOrder``) and the options it keeps.

    Raises:
        KnobError: the DataLoader batches with its own ``batch_sampler`` (the batch is the trial's knob).
    """
    if loader.batch_size is None or not isinstance(loader.batch_sampler, torch.utils.data.BatchSampler):
        raise KnobError("ctx.loader(DataLoader): a DataLoader with its own batch_sampler cannot take the trial's "
                        "batch size; pass its dataset and collate_fn instead")
    source = loader.sampler
    sampler = None
    shuffle = isinstance(source, torch.utils.data.RandomSampler)
    plain = shuffle or isinstance(source, torch.utils.data.SequentialSampler)
    if not plain and not isinstance(loader.dataset, torch.utils.data.IterableDataset):
        sampler = source  # the script's own order, kept
    kept: dict[str, Any] = {"batch_size": loader.batch_size, "drop_last": loader.drop_last}
    if loader.collate_fn is not torch.utils.data.default_collate:
        kept["collate_fn"] = loader.collate_fn
    if loader.worker_init_fn is not None:
        kept["worker_init_fn"] = loader.worker_init_fn
    return loader.dataset, shuffle, sampler, kept


def _loader_knobs_of(loader: torch.utils.data.DataLoader, *, cuda: bool) -> dict[str, Any]:
    """The DataLoader knobs a script's own DataLoader sets (``TORCH_LOADER_KNOBS``): what its script loads with.
    Pinning only on CUDA, where it does something; prefetching and persistence only with workers."""
    knobs: dict[str, Any] = {"num_workers": int(loader.num_workers)}
    if cuda:
        knobs["pin_memory"] = bool(loader.pin_memory)
    if loader.num_workers > 0:
        knobs["persistent_workers"] = bool(loader.persistent_workers)
        if loader.prefetch_factor is not None:
            knobs["prefetch_factor"] = int(loader.prefetch_factor)
    return knobs


def _resumable_order(source: Any) -> Optional[DataOrder]:
    """The ``DataOrder`` of a DataLoader with workers behind ``source`` (``ctx.loader``, ``image_loader``'s torch path).

    A loader built some other way is not restarted: its order could not be kept.
    """
    for candidate in (source, getattr(source, "loader", None)):
        if (isinstance(candidate, torch.utils.data.DataLoader) and candidate.num_workers > 0
                and isinstance(candidate.sampler, DataOrder)):
            return candidate.sampler
    return None


class _DeviceInputWait:
    """The device's side of the input wait on CUDA, from events around each fetch in a timed window.

    The host's clock around ``next()`` misses an asynchronous (pinned) host-to-device copy, and the device
    work an input pipeline queues, which the stream then runs before the step's kernels. Events recorded
    around the fetch see them; each step counts the longer of the two views. The events are read when the
    window ends, after its synchronisation, so measuring adds no synchronisation of its own.
    """

    def __init__(self, device: torch.device) -> None:
        self.active = device.type == "cuda"
        self._pending: list[tuple[float, Any, Any]] = []

    def begin(self) -> Any:
        if not self.active:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def end(self, start: Any, host_seconds: float) -> None:
        if start is None:
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._pending.append((host_seconds, start, event))

    def collect(self) -> float:
        """Seconds to add to the window's host-measured wait (the device must have been synchronised)."""
        extra = sum(max(0.0, start.elapsed_time(end) / 1000.0 - host) for host, start, end in self._pending)
        self._pending.clear()
        return extra


class _Reentered:
    """A context manager that can be entered again and again: each ``with`` enters a fresh one of ``make()``."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make
        self._open: list[Any] = []

    def __enter__(self) -> Any:
        manager = self.make()
        self._open.append(manager)
        return manager.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self._open.pop().__exit__(*exc)


def batch_length(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (in nested lists, tuples and dicts)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        try:
            return batch_length(item)
        except TypeError:
            continue
    raise TypeError(f"cannot tell the batch size of a {type(batch).__name__}")


class _Replay:
    """Batches already on the device, yielded in turn for as long as a step probe asks."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[Any]:
        return itertools.cycle(self.batches)


def _tensors(batch: Any) -> list[torch.Tensor]:
    """The tensors of a batch (a tensor, or lists, tuples and dicts of them), in a fixed order."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, (list, tuple)):
        return [t for b in batch for t in _tensors(b)]
    if isinstance(batch, dict):
        return [t for k in sorted(batch, key=str) for t in _tensors(batch[k])]
    return []


def tensor_fingerprint(tensors: list[torch.Tensor]) -> list[float]:
    """Per tensor, its sum and sum of squares in float64: equal for equal contents up to summation order."""
    values: list[float] = []
    for t in tensors:
        if t.is_complex():
            continue
        # Accumulating in float64 without a float64 copy of a large floating-point tensor.
        d = t.detach() if t.is_floating_point() else t.detach().to(torch.float64)
        values += [float(d.sum(dtype=torch.float64)), float(torch.linalg.vector_norm(d, dtype=torch.float64)) ** 2]
    return values


class UntimedClock:
    """The clock of a context built by hand (no study, no ``autotune train``): it times nothing, and its
    length is None, so a trainer keeps the length its own arguments give."""

    steps: Optional[int] = None
    epochs: Optional[int] = None
    done = False

    def epoch_length(self, micro_batches: int) -> None:
        pass

    def begin(self) -> None:
        pass

    def fetched(self) -> float:
        return 0.0

    def end(self, samples: int) -> None:
        pass

    def epoch_ends(self) -> None:
        pass

    def untimed(self, what: str) -> Any:
        return contextlib.nullcontext()

    def close(self) -> None:
        pass
