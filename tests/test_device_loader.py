"""loader=device: the dataset kept on the device serves the DataLoader's batches, or is refused with why."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
import torch

import workloads
from autotune import Budget, KnobError, TrialConfig, TrialContext, Tuner
from autotune.search._space import DEVICE_LOADER_REFUSED, NO_CTX_LOADER, load_space, restrict_to_model
from autotune.trial._resident import refusal, same

CPU = torch.device("cpu")


class _Dicts(torch.utils.data.Dataset):
    """Dict items of several dtypes and shapes, whose values can be traced back to their index."""

    def __len__(self) -> int:
        return 203

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.full((3, 2), float(i)), "ids": torch.arange(i, i + 5), "label": i % 7}


class _Augmented(torch.utils.data.Dataset):
    """Random noise per fetch, as an augmentation pipeline adds."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.arange(4.0) + i + torch.rand(4)


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(torch.arange(32))


def _loaders(dataset, *, loader: str = "torch", seed: int = 5, **kwargs):
    ctx = TrialContext(config=TrialConfig(batch_size=16, loader=loader), seed=seed, device=CPU)
    return ctx.loader(dataset, **kwargs)


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("dataset", [_Dicts(), torch.utils.data.TensorDataset(torch.randn(203, 5),
                                                                             torch.arange(203))],
                         ids=["dict-of-tensors", "tuple"])
def test_device_batches_are_the_dataloaders_element_by_element(dataset, drop_last) -> None:
    torch_loader = _loaders(dataset, drop_last=drop_last)
    device_loader = _loaders(dataset, loader="device", drop_last=drop_last)
    assert isinstance(torch_loader, torch.utils.data.DataLoader)
    assert not isinstance(device_loader, torch.utils.data.DataLoader)
    for _ in range(2):  # two epochs: each reshuffles, both alike
        expected, served = list(torch_loader), list(device_loader)
        assert len(served) == len(expected) == len(device_loader) == (12 if drop_last else 13)
        assert all(same(a, b) for a, b in zip(expected, served))
    assert not same(list(_loaders(dataset, seed=6))[0], expected[0])  # the seed matters: shuffled


def test_device_batches_follow_a_budgeted_trial_like_the_dataloaders() -> None:
    budget = Budget(samples=16 * 30, warmup_steps=2, windows=3)  # more than two epochs of 203

    def seen(loader: str) -> list[list[float]]:
        ctx = TrialContext(config=TrialConfig(batch_size=16, loader=loader), budget=budget, seed=2, device=CPU)
        return [batch["x"][:, 0, 0].tolist() for batch in ctx.batches(ctx.loader(_Dicts()))]

    assert seen("device") == seen("torch")


def test_a_custom_collate_fn_is_used_and_one_that_pads_per_batch_is_refused() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(64.0))

    def doubled(items):
        return torch.stack([x for (x,) in items]) * 2

    assert all(same(a, b) for a, b in zip(_loaders(data, collate_fn=doubled),
                                          _loaders(data, loader="device", collate_fn=doubled)))

    def centred(items):  # depends on the whole batch, not on each item
        x = torch.stack([x for (x,) in items])
        return x - x.mean()

    with pytest.raises(KnobError, match="does not act per item"):
        _loaders(data, loader="device", collate_fn=centred)


@pytest.mark.parametrize("dataset, reason", [
    (_Augmented(), r"random augmentation: item 0 differs between two fetches"),
    (_Stream(), "an IterableDataset has no indices"),
])
def test_refused_with_its_reason(dataset, reason) -> None:
    torch.manual_seed(0)
    with pytest.raises(KnobError, match=f"^loader=device: {reason}"):
        _loaders(dataset, loader="device")
    torch.manual_seed(0)
    assert refusal(dataset, share=0.25, device=CPU).startswith(reason)


def test_refused_when_larger_than_the_declared_share() -> None:
    data = torch.utils.data.TensorDataset(torch.zeros(1000, 1000))
    assert refusal(data, share=0.25, device=CPU) is None
    assert refusal(data, share=1e-6, device=CPU).startswith("too large: 1,000 items take about 0.00373 GiB")
    ctx = TrialContext(config=TrialConfig(batch_size=16, loader="device", device_data_share=1e-6), device=CPU)
    with pytest.raises(KnobError, match="too large"):
        ctx.loader(data)


def test_a_trial_records_what_the_device_loader_would_make_of_its_dataset() -> None:
    budget = Budget(samples=512, warmup_steps=1, windows=3)
    ctx = TrialContext(config=TrialConfig(batch_size=16), budget=budget, device=CPU)
    ctx.loader(_Dicts())
    assert ctx.extras["device_loader"] == "ok"
    ctx.loader(_Augmented())
    assert ctx.extras["device_loader"].startswith("random augmentation")


def test_the_reference_runs_refusal_drops_loader_device_from_the_space(write_space) -> None:
    space = load_space(write_space("""
        knobs:
          loader: [torch, device]
          num_workers: [0, 2]
        baseline: {batch_size: 16}
        device_data_share: 0.5
        budget: {samples: 512, warmup_steps: 1, windows: 3}
    """))
    assert space.device_data_share == 0.5 and space.sample(_Asker()).device_data_share == 0.5
    kept = restrict_to_model(space, activations_4d=None, device_loader="ok")
    assert kept.knobs["loader"].values == ("torch", "device")
    dropped = restrict_to_model(space, activations_4d=None, device_loader="random augmentation: item 0 differs")
    assert dropped.knobs["loader"].values == ("torch",)
    assert dropped.removed["loader=device"] == f"{DEVICE_LOADER_REFUSED}: random augmentation: item 0 differs"
    # loader=device asks none of the DataLoader's knobs: 2 workers x torch, and device.
    assert space.size == 3


class _Asker:
    def suggest_categorical(self, name, choices):
        return choices[-1]


SPACE = """
knobs:
  loader: [torch, device]
  num_workers: [0, 1]
batch_policy: fixed
baseline: {batch_size: 64, loader: torch, num_workers: 0, cpu_threads: 1}  # one thread: the step is not slowed by idle threads spinning
budget: {samples: 32000, warmup_steps: 10, windows: 3}
"""


def test_a_per_sample_dataset_study_picks_loader_device_at_twice_the_dataloaders_speed(
        tmp_path, write_space, cpu_caps) -> None:
    storage = f"sqlite:///{tmp_path}/s.db"
    result = Tuner(f"{workloads.WORKLOADS}:train_per_sample", space=write_space(SPACE), n_trials=3, storage=storage,
                   studies_dir=tmp_path / "studies", progress=False, plots=False, capabilities=cpu_caps,
                   reference_repeats=1, top_k=0, study_name="device", trial_timeout=120).run()
    assert result.best is not None and result.best.config.loader == "device"
    study = optuna.load_study(study_name="device", storage=storage)
    done = [t for t in study.trials if t.user_attrs.get("status") == "ok"]
    for t in study.trials:
        print(t.number, t.state.name, t.params, t.user_attrs.get("status"), t.user_attrs.get("throughput"),
              t.user_attrs.get("data_wait_fraction"), t.user_attrs.get("diagnosis"), t.user_attrs.get("pruned_reason"))
    # The reference waited on the loader, so its loader variants were probed apart and loader=device, the
    # fastest predicted, was the first full trial after it.
    assert [t.params.get("loader") for t in study.trials][:2] == ["torch", "device"]
    assert study.trials[1].user_attrs.get("predicted_throughput")
    assert study.trials[0].user_attrs["diagnosis"] == "input-bound"
    # The fastest DataLoader config that ran to its end (a pruned one was slower still).
    best_torch = max(t.values[0] for t in done if t.params.get("loader", "torch") == "torch")
    print(f"loader=device {result.best.throughput:,.0f}/s, best DataLoader config {best_torch:,.0f}/s: "
          f"{result.best.throughput / best_torch:.1f}x")
    assert result.best.throughput >= 2 * best_torch
    # best_config.json says what the pick asks of the user's own code.
    doc = json.loads(Path(result.best_config_path).read_text())
    assert doc["input_pipeline"].startswith("loader=device: copy the whole dataset to the device once")
    assert "25% of the device's memory" in doc["input_pipeline"]


def test_a_study_whose_reference_augments_at_random_drops_loader_device(tmp_path, write_space, cpu_caps) -> None:
    space = write_space(SPACE.replace("samples: 32000, warmup_steps: 10", "samples: 2048, warmup_steps: 2"))
    result = Tuner(f"{workloads.WORKLOADS}:train_augmented", space=space, n_trials=1, studies_dir=tmp_path / "studies",
                   storage=f"sqlite:///{tmp_path}/s.db", progress=False, plots=False, capabilities=cpu_caps,
                   reference_repeats=1, top_k=0, study_name="augmented", trial_timeout=120).run()
    reason = result.removed_knobs["loader=device"]
    assert reason.startswith(f"{DEVICE_LOADER_REFUSED}: random augmentation: item 0 differs between two fetches")
    assert result.best is not None and result.best.config.loader == "torch"


def test_a_trial_that_meets_a_refusal_ends_in_one_line_and_the_walk_drops_the_value(
        tmp_path, write_space, cpu_caps) -> None:
    # With workers the reference run does not fetch items itself, so it leaves the question open.
    space = write_space(SPACE.replace("samples: 32000, warmup_steps: 10", "samples: 2048, warmup_steps: 2")
                        .replace("num_workers: 0,", "num_workers: 1,"))
    storage = f"sqlite:///{tmp_path}/s.db"
    result = Tuner(f"{workloads.WORKLOADS}:train_augmented", space=space, n_trials=3, studies_dir=tmp_path / "studies",
                   storage=storage, progress=False, plots=False, capabilities=cpu_caps, reference_repeats=1, top_k=0,
                   study_name="late", trial_timeout=120).run()
    assert "loader=device" not in result.removed_knobs
    trials = optuna.load_study(study_name="late", storage=storage).trials
    refused = [t for t in trials if t.params.get("loader") == "device"]
    assert len(refused) == 1, [t.params for t in trials]  # tried once, then dropped
    attrs = refused[0].user_attrs
    assert attrs["status"] == "error" and attrs["refused_value"] == {"knob": "loader", "value": "device"}
    assert attrs["error"].startswith("KnobError: loader=device: random augmentation: item 0 differs")
    assert result.best is not None and result.best.config.loader == "torch"


def test_the_default_spaces_list_loader_device() -> None:
    for name in ("cpu_default", "gpu_default"):
        assert load_space(name).knobs["loader"].values == ("torch", "device"), name
    restricted = restrict_to_model(load_space("cpu_default"), activations_4d=None, device_loader=NO_CTX_LOADER)
    assert restricted.knobs["loader"].values == ("torch",)
    assert restricted.removed["loader=device"] == f"{DEVICE_LOADER_REFUSED}: {NO_CTX_LOADER}"


def _default_study(tmp_path, cpu_caps, func: str, n_trials: int, name: str):
    """A study of ``func`` from the default CPU space (no ``space``), its budget cut to a few windows."""
    storage = f"sqlite:///{tmp_path}/{name}.db"
    result = Tuner(f"{workloads.WORKLOADS}:{func}", n_trials=n_trials, storage=storage,
                   studies_dir=tmp_path / "studies", progress=False, plots=False, capabilities=cpu_caps,
                   reference_repeats=1, top_k=0, study_name=name, trial_timeout=120).run()
    return result, optuna.load_study(study_name=name, storage=storage)


def test_the_default_cpu_space_proposes_loader_device_for_a_deterministic_dataset(tmp_path, cpu_caps) -> None:
    result, study = _default_study(tmp_path, cpu_caps, "train_stored_items", 3, "default")
    assert "loader=device" not in result.removed_knobs
    # The reference waits on its items (input-bound): serving them from the device is the first move (the
    # probes' pick where the wait passes their threshold, else the walk's first input knob after the prior).
    assert study.trials[0].user_attrs["diagnosis"].startswith("input-bound")
    loaders = [t.params.get("loader") for t in study.trials]
    assert "device" in loaders[1:3], loaders
    device = study.trials[loaders.index("device")]
    loader_knobs = {"loader", "num_workers", "persistent_workers"}

    def rest(t):
        return {k: v for k, v in t.params.items() if k not in loader_knobs}

    # Against the DataLoader config it moved from (every other knob the same): no wait on storage.
    moved_from = next(t for t in study.trials if t.params.get("loader") == "torch" and rest(t) == rest(device))
    assert device.values[0] > 2 * moved_from.values[0]
    assert result.best is not None and result.best.config.loader == "device"


def test_the_default_cpu_space_drops_loader_device_for_random_augmentation(tmp_path, cpu_caps) -> None:
    storage = f"sqlite:///{tmp_path}/s.db"
    # Creating the study runs the reference, which checks the dataset; no trial is needed to see the removal.
    Tuner(f"{workloads.WORKLOADS}:train_augmented", mode="create", storage=storage, studies_dir=tmp_path / "studies",
          progress=False, plots=False, capabilities=cpu_caps, reference_repeats=1, study_name="augmented").run()
    removed = optuna.load_study(study_name="augmented", storage=storage).user_attrs["removed_knobs"]
    assert removed["loader=device"].startswith(f"{DEVICE_LOADER_REFUSED}: random augmentation: item 0 differs")


def test_the_default_cpu_space_drops_loader_device_for_an_iterable_dataset() -> None:
    # What the reference run of train_iterable records (ctx.loader checks the dataset), and what it removes.
    ctx = TrialContext(config=TrialConfig(batch_size=16), budget=Budget(samples=64, warmup_steps=1, windows=3),
                       device=CPU)
    ctx.loader(workloads.IterableItems(64), shuffle=False)
    reason = ctx.extras["device_loader"]
    assert reason == "an IterableDataset has no indices to serve batches by"
    space = restrict_to_model(load_space("cpu_default"), activations_4d=None, device_loader=reason)
    assert space.knobs["loader"].values == ("torch",)
    assert space.removed["loader=device"] == f"{DEVICE_LOADER_REFUSED}: {reason}"


class _SlowDicts(_Dicts):
    """``_Dicts`` whose items take 10 ms each to fetch, as a decode or a CPU augmentation does."""

    def __len__(self) -> int:
        return 400

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        import time

        time.sleep(0.01)
        return super().__getitem__(i)


def test_a_slow_dataset_fills_the_device_with_workers_and_serves_the_same_batches(monkeypatch) -> None:
    """400 items of 10 ms: about 4 s on one core, over the 2 s after which the fill fetches with workers."""
    import time

    from autotune.trial import _resident

    assert _resident.fill_workers(_SlowDicts(), 400) >= 2 and _resident.fill_workers(_Dicts(), 203) == 0
    started = time.perf_counter()
    fast = list(_loaders(_SlowDicts(), loader="device"))
    with_workers = time.perf_counter() - started
    monkeypatch.setattr(_resident, "FILL_WORKERS_AFTER_S", float("inf"))  # the fill on one core
    started = time.perf_counter()
    slow = list(_loaders(_SlowDicts(), loader="device"))
    in_process = time.perf_counter() - started
    assert all(same(a, b) for a, b in zip(fast, slow)) and len(fast) == len(slow) == 25
    assert with_workers < 0.75 * in_process, (with_workers, in_process)
