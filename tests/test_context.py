"""TrialContext in this process on the CPU: the loader, the data order, budgeted batches and reporting."""

from __future__ import annotations

import statistics
import time

import pytest
import torch
from torch import nn

import workloads
from autotune import Budget, KnobError, NonFiniteLoss, TrialConfig, TrialContext

CPU = torch.device("cpu")


def _indices(n: int) -> torch.utils.data.TensorDataset:
    """A dataset whose samples are their own index, so the data order can be read off the batches."""
    return torch.utils.data.TensorDataset(torch.arange(n), torch.arange(n) % 2)


def _samples_seen(ctx: TrialContext, loader) -> list[int]:
    seen: list[int] = []
    for inputs, _ in ctx.batches(loader):
        seen.extend(inputs.tolist())
    return seen


def _step(ctx: TrialContext):
    model = ctx.model(workloads.tiny_model())
    optimizer = ctx.optimizer(torch.optim.SGD, model.parameters(), lr=0.05)
    return ctx.train_step(model, optimizer, nn.CrossEntropyLoss())


def test_loader_with_workers_has_the_configured_options() -> None:
    config = TrialConfig(batch_size=32, num_workers=2, pin_memory=True, prefetch_factor=4, persistent_workers=True)
    ctx = TrialContext(config=config, device=CPU)
    loader = ctx.loader(workloads.dataset(256))
    assert loader.batch_size == 32
    assert loader.num_workers == 2
    assert loader.pin_memory is False  # pinning only helps host-to-device copies; there is no device here
    assert loader.prefetch_factor == 4
    assert loader.persistent_workers is True
    assert loader.drop_last is True
    batches = list(loader)  # the options are valid together: the workers really run
    assert len(batches) == 8 and all(len(x) == 32 for x, _ in batches)


def test_loader_without_workers_leaves_worker_options_out() -> None:
    config = TrialConfig(batch_size=16, num_workers=0, prefetch_factor=4, persistent_workers=True)
    loader = TrialContext(config=config, device=CPU).loader(workloads.dataset(100))
    assert loader.num_workers == 0
    assert loader.prefetch_factor is None
    assert loader.persistent_workers is False
    assert len(list(loader)) == 6  # 100 // 16: the incomplete last batch is dropped


def test_loader_keyword_arguments_override() -> None:
    ctx = TrialContext(config=TrialConfig(batch_size=16), device=CPU)
    loader = ctx.loader(_indices(64), shuffle=False, drop_last=False)
    assert torch.cat([x for x, _ in loader]).tolist() == list(range(64))


def test_data_order_depends_on_the_seed_not_the_batch_size() -> None:
    def epoch(batch_size: int, seed: int) -> list[int]:
        ctx = TrialContext(config=TrialConfig(batch_size=batch_size), seed=seed, device=CPU)
        return torch.cat([x for x, _ in ctx.loader(_indices(128))]).tolist()

    assert epoch(8, seed=3) == epoch(32, seed=3)
    assert sorted(epoch(8, seed=3)) == list(range(128))
    assert epoch(8, seed=3) != list(range(128))  # shuffled
    assert epoch(8, seed=3) != epoch(8, seed=4)


def test_budgeted_batches_see_the_same_samples_at_every_batch_size() -> None:
    # 192 samples over a 96-sample dataset: the loader restarts, and the second epoch matches too.
    budget = Budget(samples=192, warmup_steps=1, windows=3)

    def seen(batch_size: int) -> list[int]:
        ctx = TrialContext(config=TrialConfig(batch_size=batch_size), budget=budget, seed=7, device=CPU)
        return _samples_seen(ctx, ctx.loader(_indices(96)))

    small, large = seen(8), seen(32)
    assert len(small) == len(large) == 192
    assert small == large
    assert small[:96] != small[96:]  # each epoch is shuffled afresh


@pytest.mark.parametrize(
    "batch_size, samples, warmup, windows",
    [(32, 640, 2, 3), (16, 700, 1, 4), (64, 1024, 0, 3)],
)
def test_budget_sets_steps_windows_and_median_throughput(batch_size, samples, warmup, windows) -> None:
    budget = Budget(samples=samples, warmup_steps=warmup, windows=windows)
    ctx = TrialContext(config=TrialConfig(batch_size=batch_size), budget=budget, device=CPU)
    step = _step(ctx)
    steps = 0
    for inputs, targets in ctx.batches(ctx.loader(workloads.dataset(512))):
        assert inputs.shape[0] == batch_size
        step(inputs, targets)
        steps += 1
    assert steps == samples // batch_size
    windows_seen = ctx.recorder.windows
    assert len(windows_seen) == windows
    per_window = (samples // batch_size - warmup) // windows
    assert [w.steps for w in windows_seen] == [per_window] * windows
    assert [w.samples for w in windows_seen] == [per_window * batch_size] * windows

    m = ctx.measurement()
    rates = [w.samples / w.seconds for w in windows_seen]
    assert m.throughput == statistics.median(rates)
    assert list(m.window_throughputs) == rates
    assert m.steps == steps and m.samples == steps * batch_size
    assert 0.0 <= m.data_wait_fraction <= 1.0
    assert m.first_step_seconds > 0
    if warmup:
        assert m.warmup_seconds >= m.first_step_seconds
    assert m.peak_memory_gib > 0
    assert m.metric is None and m.compile_seconds == 0.0


def test_budget_too_small_for_the_batch_raises_knob_error() -> None:
    ctx = TrialContext(config=TrialConfig(batch_size=64), budget=Budget(samples=256, warmup_steps=2, windows=3),
                       device=CPU)
    with pytest.raises(KnobError, match="leaves no timed window at batch 64"):
        next(ctx.batches(ctx.loader(workloads.dataset(512))))


def test_without_a_budget_batches_is_one_untimed_epoch() -> None:
    ctx = TrialContext(config=TrialConfig(batch_size=32), device=CPU)
    batches = list(ctx.batches(ctx.loader(workloads.dataset(100))))
    assert len(batches) == 3
    assert ctx.recorder.windows == []
    with pytest.raises(ValueError, match="no timed window"):
        ctx.measurement()


def test_batches_of_dicts_are_counted_by_their_first_tensor() -> None:
    class Dicts(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict:
            return {"x": torch.full((3,), float(i)), "y": i}

    ctx = TrialContext(config=TrialConfig(batch_size=8), budget=Budget(samples=64, warmup_steps=1, windows=3),
                       device=CPU)
    batches = list(ctx.batches(ctx.loader(Dicts())))
    assert all(isinstance(b, dict) and b["x"].shape == (8, 3) for b in batches)
    assert ctx.measurement().samples == 64


@pytest.mark.parametrize("batch_size, baseline, scale", [(256, 64, 4.0), (32, 64, 0.5), (128, None, 1.0)])
def test_lr_scale_is_batch_over_baseline_batch(batch_size, baseline, scale) -> None:
    ctx = TrialContext(config=TrialConfig(batch_size=batch_size), baseline_batch_size=baseline, device=CPU)
    assert ctx.lr_scale == scale


def test_manual_windows_and_metric() -> None:
    ctx = TrialContext(config=TrialConfig(), budget=Budget(), device=CPU)
    ctx.record_window(100, 0.5, steps=2, data_wait_seconds=0.1)   # 200/s
    ctx.record_window(100, 1.0, steps=2, data_wait_seconds=0.1)   # 100/s
    ctx.record_window(100, 0.25, steps=2, data_wait_seconds=0.1)  # 400/s
    ctx.report_metric(0.93)
    m = ctx.measurement()
    assert m.throughput == pytest.approx(200.0)
    assert m.window_throughputs == pytest.approx((200.0, 100.0, 400.0))
    assert m.step_time == pytest.approx(0.25)  # median of 0.25, 0.5 and 0.125 s per step
    assert m.data_wait_fraction == pytest.approx(0.3 / 1.75)
    assert m.metric == 0.93
    assert (m.samples, m.steps) == (300, 6)


@pytest.mark.parametrize("samples, seconds", [(0, 1.0), (10, 0.0), (10, -1.0)])
def test_record_window_rejects_empty_windows(samples, seconds) -> None:
    ctx = TrialContext(config=TrialConfig(), device=CPU)
    with pytest.raises(ValueError, match="a window needs"):
        ctx.record_window(samples, seconds)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_metric_raises(value) -> None:
    ctx = TrialContext(config=TrialConfig(), device=CPU)
    with pytest.raises(NonFiniteLoss, match="evaluation metric"):
        ctx.report_metric(value)
    assert ctx.metric is None


def test_nan_loss_raises_non_finite_loss() -> None:
    ctx = TrialContext(config=TrialConfig(batch_size=32), budget=Budget(samples=512, warmup_steps=1, windows=3),
                       device=CPU)
    with pytest.raises(NonFiniteLoss, match="training loss is nan"):
        workloads.nan_loss(ctx)
    assert isinstance(NonFiniteLoss("x"), ArithmeticError)


def test_nan_appearing_late_is_caught_at_the_end() -> None:
    # The loss turns NaN after the last timed window; the final check still sees it.
    budget = Budget(samples=32 * 13, warmup_steps=0, windows=3)  # 13 steps: the windows end after step 12
    ctx = TrialContext(config=TrialConfig(batch_size=32), budget=budget, device=CPU)
    model = ctx.model(workloads.tiny_model())
    calls = {"n": 0}

    def loss_fn(outputs, targets):
        calls["n"] += 1
        loss = nn.functional.cross_entropy(outputs, targets)
        return loss * float("nan") if calls["n"] == 13 else loss

    step = ctx.train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), loss_fn)
    with pytest.raises(NonFiniteLoss):
        for inputs, targets in ctx.batches(ctx.loader(workloads.dataset(512))):
            step(inputs, targets)
    assert calls["n"] == 13
    assert len(ctx.recorder.windows) == 3


def test_a_loader_with_no_full_batch_is_reported_plainly() -> None:
    ctx = TrialContext(config=TrialConfig(batch_size=64), budget=Budget(samples=1024, warmup_steps=1, windows=3),
                       device=CPU)
    with pytest.raises(Exception) as info:
        list(ctx.batches(ctx.loader(workloads.dataset(40))))
    assert "StopIteration" not in str(info.value)
    assert "64" in str(info.value)


class _SlowItems(torch.utils.data.Dataset):
    """Each item takes ``seconds`` to produce, as a JPEG decode would (asleep, so it needs no free core)."""

    def __init__(self, n: int, seconds: float) -> None:
        self.n, self.seconds = n, seconds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        time.sleep(self.seconds)
        return torch.tensor(i), torch.tensor(i % 2)


@pytest.mark.parametrize("persistent", [False, True])
def test_a_backlog_built_during_slow_warmup_steps_is_not_timed(persistent: bool) -> None:
    # 4 workers x 8 items x 10 ms: the loader makes at most 400 samples/s, in bursts of 4 batches. The
    # first step sleeps 1 s, as a compile would, and the workers fill their queues (4 x 8 batches)
    # meanwhile. Timed from that backlog, all 24 timed steps would be served at once.
    config = TrialConfig(batch_size=8, num_workers=4, prefetch_factor=8, persistent_workers=persistent)
    ctx = TrialContext(config=config, budget=Budget(samples=8 * 28, warmup_steps=4, windows=3), device=CPU)
    loader = ctx.loader(_SlowItems(400, 0.010))
    for step, _ in enumerate(ctx.batches(loader)):
        if step == 0:
            time.sleep(1.0)
    rate = ctx.measurement().throughput
    producer = 4 * 8 / (8 * 0.010)
    assert 0.5 * producer < rate < 1.35 * producer, rate
    assert ctx.measurement().data_wait_fraction > 0.5  # the consumer does nothing, so it mostly waits


@pytest.mark.parametrize("workers", [0, 2])
def test_the_restart_keeps_the_samples_and_their_order(workers: int) -> None:
    budget = Budget(samples=8 * 24, warmup_steps=6, windows=3)  # two epochs of 96

    def seen(batch_size: int, workers: int) -> list[int]:
        config = TrialConfig(batch_size=batch_size, num_workers=workers)
        ctx = TrialContext(config=config, budget=budget, seed=7, device=CPU)
        return _samples_seen(ctx, ctx.loader(_indices(96)))

    assert seen(8, workers) == seen(8, 0) == seen(16, workers)


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter([(torch.tensor(i), torch.tensor(i % 2)) for i in range(32)])


def test_an_iterable_dataset_is_loaded_in_its_own_order_and_cannot_be_shuffled() -> None:
    ctx = TrialContext(config=TrialConfig(batch_size=8), device=CPU)
    assert torch.cat([x for x, _ in ctx.loader(_Stream(), shuffle=False)]).tolist() == list(range(32))
    with pytest.raises(KnobError, match="shuffle=False"):
        ctx.loader(_Stream())


def _pairs(batch: list) -> dict:
    """A collate_fn of the script's own: a dict, so the test can tell it was kept."""
    return {"x": torch.stack([x for x, _ in batch]), "y": torch.stack([y for _, y in batch])}


def test_loader_rebuilds_the_scripts_own_dataloader_with_the_trials_knobs() -> None:
    data = _indices(128)
    plain = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True, collate_fn=_pairs, drop_last=False)
    config = TrialConfig(batch_size=32, num_workers=2, pin_memory=True, prefetch_factor=4, persistent_workers=True)
    ctx = TrialContext(config=config, seed=3, device=CPU)
    loader = ctx.loader(plain)
    assert loader.dataset is data and loader.collate_fn is _pairs and loader.drop_last is False
    assert (loader.batch_size, loader.num_workers, loader.prefetch_factor, loader.persistent_workers) == (32, 2, 4, True)
    assert loader.pin_memory is False  # pinning is for a CUDA device
    assert ctx.extras["script_batch_size"] == 16  # the script's batch, for the study's baseline
    # Its shuffle became ctx.loader's seeded order: the same samples as from the dataset itself.
    from_dataset = TrialContext(config=TrialConfig(batch_size=32), seed=3, device=CPU).loader(data)
    assert torch.cat([b["x"] for b in loader]).tolist() == torch.cat([x for x, _ in from_dataset]).tolist()


def test_loader_keeps_a_sequential_or_custom_order_and_refuses_a_batch_sampler() -> None:
    data = _indices(64)
    ctx = TrialContext(config=TrialConfig(batch_size=8), seed=3, device=CPU)
    in_order = ctx.loader(torch.utils.data.DataLoader(data, batch_size=4))
    assert torch.cat([x for x, _ in in_order]).tolist() == list(range(64))
    reverse = list(range(63, -1, -1))
    custom = ctx.loader(torch.utils.data.DataLoader(data, batch_size=4, sampler=reverse))
    assert custom.sampler is reverse and torch.cat([x for x, _ in custom]).tolist() == reverse
    batches = torch.utils.data.BatchSampler(range(64), batch_size=4, drop_last=True)
    with pytest.raises(KnobError, match="own batch_sampler"):
        ctx.loader(torch.utils.data.DataLoader(data, batch_sampler=batches))


def test_a_batch_size_passed_to_loader_is_recorded_and_the_trials_batch_loads() -> None:
    ctx = TrialContext(config=TrialConfig(batch_size=32), device=CPU)
    loader = ctx.loader(_indices(128), batch_size=256)
    assert loader.batch_size == 32 and ctx.extras["script_batch_size"] == 256


def test_schedule_lengths_come_from_the_trial_plan() -> None:
    budget = Budget(samples=1024, warmup_steps=3, windows=3)
    ctx = TrialContext(config=TrialConfig(batch_size=32, global_batch=128, batch_policy="fixed"), budget=budget,
                       device=CPU)
    assert ctx.optimizer_steps == 1024 // 128 and ctx.micro_steps == 4 * ctx.optimizer_steps
    assert ctx.warmup_steps == 1  # 3 micro-steps, rounded up to a whole optimizer step
    outside = TrialContext(config=TrialConfig(batch_size=32), device=CPU)
    with pytest.raises(KnobError, match="build it first"):
        outside.optimizer_steps
    outside.loader(_indices(100))
    assert outside.optimizer_steps == 3 and outside.warmup_steps == 0  # one epoch, the last batch dropped


def test_a_time_share_shortens_the_windows_and_keeps_the_schedule_length() -> None:
    """A run with ``Budget.seconds`` measures its step time in its first window, then shortens every window to
    end inside the share; ``ctx.optimizer_steps`` (a schedule's length) stays the budget's, and the run
    records the length it trained, which a later run at ``schedule_samples`` trains exactly."""
    import time

    budget = Budget(samples=32 * 400, warmup_steps=2, windows=3, seconds=1.5)
    ctx = TrialContext(config=TrialConfig(batch_size=32), budget=budget, device=CPU)
    step = _step(ctx)
    scheduled = ctx.optimizer_steps
    steps = 0
    for inputs, targets in ctx.batches(ctx.loader(workloads.dataset(512))):
        time.sleep(0.01)  # 400 steps would take 4 s: three times the share
        step(inputs, targets)
        steps += 1
    assert scheduled == 400 and ctx.optimizer_steps == 400
    shortened = ctx.extras["shortened"]
    assert steps < 400 and shortened["samples"] == steps * 32 and shortened["from_samples"] == 400 * 32
    # The steps left out, at the step time measured (over 10 ms each; a loaded machine stretched it to 54 ms once):
    # what the full length would have added.
    assert (400 - steps) * 0.01 <= shortened["missing_seconds"] <= (400 - steps) * 0.1, shortened
    windows = [w.steps for w in ctx.recorder.windows]
    assert len(windows) == 3 and len(set(windows)) == 1 and steps == 2 + 3 * windows[0]

    again = TrialContext(config=TrialConfig(batch_size=32), device=CPU,
                         budget=Budget(samples=shortened["samples"], schedule_samples=400 * 32, warmup_steps=2,
                                       windows=3))
    assert again.optimizer_steps == 400
    step = _step(again)
    assert sum(1 for batch in again.batches(again.loader(workloads.dataset(512))) if step(*batch) or True) == steps
    assert "shortened" not in again.extras


def test_the_reference_adopts_the_scripts_batch_unless_a_length_was_read_first() -> None:
    """``adopt_script_batch``: ``ctx.loader(batch_size=16)`` makes the run's batch 16 when nothing read so far
    depended on the batch; after ``ctx.optimizer_steps`` it keeps the config's and only records the script's."""
    budget = Budget(samples=640, warmup_steps=1, windows=3)
    ctx = TrialContext(config=TrialConfig(batch_size=32), budget=budget, device=CPU, adopt_script_batch=True)
    loader = ctx.loader(workloads.dataset(512), batch_size=16)
    assert ctx.config.batch_size == 16 and ctx.extras["batch_adopted"] == 16 and ctx.lr_scale == 1.0
    assert next(iter(loader))[0].shape[0] == 16 and ctx.optimizer_steps == 40

    read_first = TrialContext(config=TrialConfig(batch_size=32), budget=budget, device=CPU, adopt_script_batch=True)
    assert read_first.optimizer_steps == 20
    read_first.loader(workloads.dataset(512), batch_size=16)
    assert read_first.config.batch_size == 32 and "batch_adopted" not in read_first.extras
    assert read_first.extras["script_batch_size"] == 16
