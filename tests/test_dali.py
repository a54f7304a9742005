"""The image loader's two backends on real JPEGs on the CPU: torch (PIL) and NVIDIA DALI in CPU-only mode.

CI installs the `dali` extra, so a DALI that does not import fails these tests; ``AUTOTUNE_SKIP_DALI=1``
skips the ones that need it, saying so.
"""

from __future__ import annotations

import collections
import os
from pathlib import Path

import optuna
import pytest
import torch
from optuna.trial import TrialState

from autotune import Budget, KnobError, SpaceError, TrialConfig, TrialContext, Tuner, WorkloadError, load_space
from autotune.hardware import Capabilities
from autotune.trial._images import Shard, list_images, shard_from_env
from autotune.search._space import restrict_to
from benchmarks.runners import dali_pick
from benchmarks.workloads import make_jpegs

CPU = torch.device("cpu")
CLASSES = 4
IMAGES = 320  # 80 per class: 10 batches of 32 per epoch
BATCH = 32
SIZE = 40
WORKLOAD = str(Path(make_jpegs.__file__).with_name("jpeg.py"))


@pytest.fixture(scope="session")
def dali() -> str:
    """DALI's version; fails (CI installs the extra) unless AUTOTUNE_SKIP_DALI=1 asks to skip."""
    if os.environ.get("AUTOTUNE_SKIP_DALI") == "1":
        pytest.skip("AUTOTUNE_SKIP_DALI=1: NVIDIA DALI tests skipped on request")
    from autotune.hardware import dali_availability as availability

    ok, detail = availability()
    if not ok:
        pytest.fail(f"NVIDIA DALI must import here, CI installs the `dali` extra ({detail}); "
                    "set AUTOTUNE_SKIP_DALI=1 to skip these tests instead")
    return detail


@pytest.fixture(scope="session")
def jpegs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real JPEGs of different sizes (48 to 160 pixels wide, four aspect ratios), one colour per class."""
    root = tmp_path_factory.mktemp("jpegs")
    make_jpegs.generate(root, images=IMAGES, classes=CLASSES, min_size=48, max_size=160, workers=0)
    return root


def _ctx(loader: str, budget: Budget | None = None, **knobs) -> TrialContext:
    config = TrialConfig(loader=loader, batch_size=BATCH, dali_threads=2, **knobs)
    return TrialContext(config=config, budget=budget, device=CPU)


def _epoch(ctx: TrialContext, source, **options) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(ctx.batches(ctx.image_loader(source, size=SIZE, **options)))


def _class_means(batches) -> dict[int, torch.Tensor]:
    """Mean normalised value per channel, per class."""
    images = torch.cat([x.float() for x, _ in batches])
    labels = torch.cat([y for _, y in batches])
    return {c: images[labels == c].mean(dim=(0, 2, 3)) for c in labels.unique().tolist()}


@pytest.mark.parametrize("precision, channels_last, dtype", [
    ("fp32", False, torch.float32),
    ("fp16", True, torch.float16),
    ("bf16", True, torch.bfloat16),
    ("bf16", False, torch.bfloat16),
])
def test_both_backends_yield_the_same_batches(dali, jpegs, precision, channels_last, dtype) -> None:
    epochs = {}
    for loader in ("torch", "dali"):
        epochs[loader] = _epoch(_ctx(loader, precision=precision, channels_last=channels_last), jpegs, shuffle=False)
    torch_epoch, dali_epoch = epochs["torch"], epochs["dali"]
    assert len(torch_epoch) == len(dali_epoch) == IMAGES // BATCH
    for batches in (torch_epoch, dali_epoch):
        for images, labels in batches:
            assert images.shape == (BATCH, 3, SIZE, SIZE) and images.dtype == dtype and images.device == CPU
            if channels_last:
                assert images.is_contiguous(memory_format=torch.channels_last) and not images.is_contiguous()
            else:
                assert images.is_contiguous()
            assert labels.shape == (BATCH,) and labels.dtype == torch.int64
    # Unshuffled, both read the one listing in order: the same labels in the same order.
    assert [y.tolist() for _, y in torch_epoch] == [y.tolist() for _, y in dali_epoch]
    assert {int(v) for _, y in dali_epoch for v in y} == set(range(CLASSES))
    # The same decode (RGB order) and normalisation: each class's colour comes out the same.
    torch_means, dali_means = _class_means(torch_epoch), _class_means(dali_epoch)
    for label in range(CLASSES):
        assert torch.allclose(torch_means[label], dali_means[label], atol=0.1), (label, torch_means, dali_means)


def test_dali_decodes_real_jpegs_in_cpu_only_mode(dali, jpegs) -> None:
    ctx = _ctx("dali")
    loader = ctx.image_loader(jpegs, size=SIZE)
    assert ctx.extras["input_backend"] == "dali-cpu"
    assert loader._iterator._pipes[0].device_id is None  # DALI's CPU-only mode
    batches = list(ctx.batches(loader))
    assert len(batches) == len(loader) == IMAGES // BATCH
    # Undo the normalisation: each class's mean pixel is the colour make_jpegs painted it.
    mean = torch.tensor([0.485, 0.456, 0.406]) * 255
    std = torch.tensor([0.229, 0.224, 0.225]) * 255
    for label, value in _class_means(batches).items():
        pixel = value * std + mean
        assert torch.allclose(pixel, torch.tensor(make_jpegs.class_color(label), dtype=torch.float32), atol=12), (
            label, pixel)


@pytest.mark.parametrize("loader", ["torch", "dali"])
def test_a_budget_restarts_the_loader_every_epoch(dali, jpegs, loader) -> None:
    # 25 steps of 32 over 10 batches per epoch: two restarts; each epoch is the whole folder, reshuffled.
    ctx = _ctx(loader, budget=Budget(samples=25 * BATCH, warmup_steps=1, windows=3))
    labels = [y for _, y in ctx.batches(ctx.image_loader(jpegs, size=SIZE))]
    assert len(labels) == 25
    first, second = torch.cat(labels[:10]), torch.cat(labels[10:20])
    assert collections.Counter(first.tolist()) == collections.Counter(second.tolist()) == {c: 80 for c in range(4)}
    assert first.tolist() != second.tolist()
    m = ctx.measurement()
    assert m.steps == 25 and 0 < m.data_wait_fraction <= 1


def test_a_list_of_paths_and_labels_is_a_source(dali, jpegs) -> None:
    pairs = [(path, 7 if label == 3 else label) for path, label in list_images(jpegs).samples[::2]]
    for loader in ("torch", "dali"):
        labels = torch.cat([y for _, y in _epoch(_ctx(loader), pairs)])
        assert len(labels) == len(pairs) // BATCH * BATCH and set(labels.tolist()) == {0, 1, 2, 7}


def test_shards_come_from_the_launcher_environment(dali, jpegs, monkeypatch) -> None:
    assert shard_from_env({}) == Shard(0, 1)
    assert shard_from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}) == Shard(3, 4)
    assert shard_from_env({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}) == Shard(1, 2)
    with pytest.raises(WorkloadError, match="RANK=4 is not a rank of WORLD_SIZE=4"):
        shard_from_env({"RANK": "4", "WORLD_SIZE": "4"})
    # Unshuffled, the class-sorted listing splits in halves: classes 0-1 in shard 0, 2-3 in shard 1.
    for rank, classes in ((0, {0, 1}), (1, {2, 3})):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        for loader in ("torch", "dali"):
            batches = _epoch(_ctx(loader), jpegs, shuffle=False)
            assert len(batches) == IMAGES // 2 // BATCH
            assert {int(v) for _, y in batches for v in y} == classes, (loader, rank)


def test_too_few_images_or_none_is_one_error(jpegs, tmp_path) -> None:
    pairs = list_images(jpegs).samples[:BATCH - 1]
    with pytest.raises(KnobError, match=f"has {BATCH - 1} images, fewer than one batch of {BATCH}"):
        _ctx("dali").image_loader(pairs)
    (tmp_path / "empty_class").mkdir()
    with pytest.raises(WorkloadError, match="holds no image in class subfolders"):
        _ctx("torch").image_loader(tmp_path)
    with pytest.raises(WorkloadError, match="does not exist"):
        _ctx("torch").image_loader(tmp_path / "missing")


def test_the_loader_alone_is_all_data_wait(dali, jpegs, monkeypatch) -> None:
    # Decode, augmentation, copy and normalisation all happen inside next(): all of it counts as waiting.
    from benchmarks.workloads import jpeg as jpeg_workload

    monkeypatch.setenv("AUTOTUNE_JPEG_ROOT", str(jpegs))
    monkeypatch.setenv("AUTOTUNE_JPEG_SIZE", str(SIZE))
    for loader in ("torch", "dali"):
        # 24 batches: windows of several steps, so a batch that DALI had decoded ahead weighs little.
        ctx = _ctx(loader, budget=Budget(samples=24 * BATCH, warmup_steps=1, windows=3))
        jpeg_workload.loader_only(ctx)
        assert ctx.measurement().data_wait_fraction > 0.9, (loader, ctx.measurement().data_wait_fraction)


def test_short_study_over_both_backends_records_data_wait(dali, jpegs, tmp_path, write_space, monkeypatch) -> None:
    monkeypatch.setenv("AUTOTUNE_JPEG_ROOT", str(jpegs))
    monkeypatch.setenv("AUTOTUNE_JPEG_MODEL", "tiny")
    monkeypatch.setenv("AUTOTUNE_JPEG_SIZE", "32")
    monkeypatch.setenv("AUTOTUNE_JPEG_EVAL", "64")
    space = write_space("""
        knobs:
          loader: [torch, dali]
          dali_threads: [1, 2]
          batch_size: [16]
        baseline: {batch_size: 16, loader: torch}
        budget: {samples: 128, warmup_steps: 1, windows: 3}
    """)
    caps = Capabilities(cuda=False, bf16=True, cpu_count=2, compile=True, hostname="test-host", torch="test",
                        dali=True)
    url = f"sqlite:///{tmp_path}/dali.db"
    result = Tuner(f"{WORKLOAD}:train", space=space, n_trials=3, storage=url, studies_dir=tmp_path / "studies",
                   progress=False, plots=False, capabilities=caps, reference_repeats=1, top_k=0, prune_below=None,
                   trial_timeout=120, study_name="dali").run()
    trials = optuna.load_study(study_name="dali", storage=url).get_trials()
    assert len(trials) == 3 and all(t.state == TrialState.COMPLETE for t in trials)
    backends = set()
    for trial in trials:
        attrs = trial.user_attrs
        assert attrs["status"] == "ok", attrs.get("error")
        assert 0 < attrs["data_wait_fraction"] <= 1
        config = TrialConfig.from_dict(attrs["config"])
        if attrs.get("role") != "reference":  # trial 0 is the fp32 reference run, recorded without extras
            assert attrs["extra:input_backend"] == ("dali-cpu" if config.loader == "dali" else "torch")
        backends.add(config.loader)
    assert backends == {"torch", "dali"}
    assert result.best is not None

    # The benchmark's check of the pick: the same compute config on device-resident data, measured.
    pick = dali_pick.check("dali", storage=url, logs=tmp_path / "pick")
    assert pick.config == result.best.config and pick.picked == result.best.throughput
    assert pick.synthetic > 0 and f"{pick.fraction:.1%}" in pick.markdown()


# -- the space and the probe: no DALI needed ------------------------------------------------------
def test_the_probe_removes_dali_with_the_reason_when_it_does_not_import(cpu_caps, write_space) -> None:
    space = load_space(write_space("knobs:\n  loader: [torch, dali]\n  dali_threads: [2, 4]\n"))
    missing = Capabilities(**{**cpu_caps.to_dict(), "extras": {"dali_reason": "nvidia.dali is not installed"}})
    restricted = restrict_to(space, missing)
    assert restricted.knobs["loader"].values == ("torch",)
    assert restricted.removed["loader=dali"].startswith("nvidia.dali is not installed (install the `dali` extra")
    # Without a GPU DALI runs in CPU-only mode: an importable DALI stays.
    present = Capabilities(**{**cpu_caps.to_dict(), "dali": True})
    assert restrict_to(space, present).knobs["loader"].values == ("torch", "dali")


def test_the_probe_imports_dali_to_say_whether_it_works(dali) -> None:
    from autotune.hardware._machine import _probe_dali

    assert _probe_dali() == {"dali": True, "extras": {"dali_version": dali}}


@pytest.mark.parametrize("text, problem", [
    ("dali_threads: [0, 4]", "knobs.dali_threads: 0 is below 1"),
    ("dali_threads: [two]", "knobs.dali_threads: 'two' is not an integer"),
    ("dali_prefetch: {low: 0, high: 3}", "knobs.dali_prefetch.low: 0 is below 1"),
    ("loader: [torch, nvidia]", "knobs.loader: 'nvidia' is not one of torch, dali, device"),
])
def test_bad_dali_knobs_are_refused_in_one_line(write_space, text, problem) -> None:
    path = write_space(f"knobs:\n  {text}\n", name="bad.yaml")
    with pytest.raises(SpaceError) as info:
        load_space(path)
    assert str(info.value) == f"{path}: {problem}"


def test_each_loader_is_asked_only_its_own_knobs(write_space) -> None:
    space = load_space(write_space("""
        knobs:
          loader: [torch, dali]
          num_workers: [0, 2]
          pin_memory: [false, true]
          dali_threads: {low: 1, high: 4}
          dali_prefetch: [2, 3]
    """))
    full = {"loader": "dali", "num_workers": 2, "pin_memory": True, "dali_threads": 3, "dali_prefetch": 3}
    assert space.asked_params(full) == {"loader": "dali", "dali_threads": 3, "dali_prefetch": 3}
    assert space.asked_params({**full, "loader": "torch"}) == {"loader": "torch", "num_workers": 2, "pin_memory": True}
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(20):
        trial = study.ask()
        config = space.sample(trial)
        other = ("num_workers", "pin_memory") if config.loader == "dali" else ("dali_threads", "dali_prefetch")
        assert not set(other) & set(trial.params)
        assert all(getattr(config, k) == getattr(TrialConfig(), k) for k in other)
        study.tell(trial, 1.0)
    assert TrialConfig(loader="dali", dali_threads=8, dali_prefetch=3).describe() == "fp32 bs64 dali threads=8 prefetch=3"


def test_the_device_side_of_the_input_wait_adds_what_the_host_did_not_wait_for() -> None:
    # CUDA events need a GPU; this checks the arithmetic with stand-ins that time like them (milliseconds).
    from autotune.trial._context import _DeviceInputWait

    class Event:
        def __init__(self, ms: float) -> None:
            self.ms = ms

        def elapsed_time(self, end: "Event") -> float:
            return end.ms - self.ms

    assert _DeviceInputWait(CPU).begin() is None  # no events, nothing added, on a CPU
    wait = _DeviceInputWait(CPU)
    # A pinned copy the host queued in 1 ms but the stream spent 5 ms on; a fetch the host waited 10 ms for.
    wait._pending = [(0.001, Event(0.0), Event(5.0)), (0.010, Event(0.0), Event(2.0))]
    assert wait.collect() == pytest.approx(0.004)
    assert wait.collect() == 0.0
