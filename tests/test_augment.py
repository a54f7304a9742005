"""augment=device: torchvision's transforms run batch-wise on the device, each sample with its own draw.

Each recognised transform is compared with its CPU torchvision counterpart: the deterministic ones pixel by
pixel, the random ones by the distribution of what they draw (crop boxes, flip rate, colour statistics)
over a few thousand samples of a test image. All on the CPU: the device ops are plain torch.
"""

from __future__ import annotations

import math

import pytest
import torch
from PIL import Image
from torchvision import transforms as v1
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as VF

from autotune import TrialConfig
from autotune._errors import KnobError
from autotune.search._space import DEVICE_AUGMENT_REFUSED, load_space, restrict_to_model
from autotune.trial import _augment
from autotune.trial._augment import Images
from autotune.trial._context import TrialContext
from autotune._config import Budget

CPU = torch.device("cpu")
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def _smooth(height: int = 48, width: int = 64) -> torch.Tensor:
    """A uint8 RGB image of gradients: resampling errors show as rounding, not as aliasing."""
    yy, xx = torch.meshgrid(torch.linspace(0, 1, height), torch.linspace(0, 1, width), indexing="ij")
    return torch.stack([yy, xx, 0.2 + 0.6 * yy * xx]).mul(255).round().to(torch.uint8)


def _pipeline(transform, chw, *, integer: bool = True, seed: int = 0) -> _augment.Pipeline:
    return _augment.compile_pipeline(transform, chw, integer=integer, seed=seed, device=CPU)


def _ks(a: torch.Tensor, b: torch.Tensor) -> float:
    """The two-sample Kolmogorov-Smirnov statistic: the largest gap between the two empirical CDFs."""
    a, b = a.double().sort().values, b.double().sort().values
    grid = torch.cat([a, b])
    cdf_a = torch.searchsorted(a, grid, right=True).double() / len(a)
    cdf_b = torch.searchsorted(b, grid, right=True).double() / len(b)
    return float((cdf_a - cdf_b).abs().max())


# -- per-sample draws -----------------------------------------------------------------------------------

def test_draws_differ_within_a_batch_and_repeat_for_the_same_seed() -> None:
    transform = v2.Compose([v2.RandomResizedCrop(24), v2.RandomHorizontalFlip(), v2.ColorJitter(0.4, 0.4, 0.4, 0.1),
                            v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])
    batch = _smooth().unsqueeze(0).repeat(16, 1, 1, 1)  # one image sixteen times: only the draws differ
    first = _pipeline(transform, (3, 48, 64), seed=7)(batch)
    again = _pipeline(transform, (3, 48, 64), seed=7)(batch)
    other = _pipeline(transform, (3, 48, 64), seed=8)(batch)
    assert first.shape == (16, 3, 24, 24) and first.dtype == torch.float32
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    distinct = {sample.numpy().tobytes() for sample in first}
    assert len(distinct) == 16
    # The stream goes on: the next batch draws anew.
    pipeline = _pipeline(transform, (3, 48, 64), seed=7)
    assert not torch.equal(pipeline(batch), pipeline(batch))


# -- geometry -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("size,scale,ratio", [((48, 64), (0.08, 1.0), (3 / 4, 4 / 3)),
                                              ((40, 40), (0.6, 1.0), (2.0, 3.0))])  # the second falls back often
def test_crop_boxes_follow_torchvision(size, scale, ratio) -> None:
    n = 3000
    op = _augment.recognise(v2.RandomResizedCrop(16, scale=scale, ratio=ratio))
    op.shape((3, *size))
    ours = op.boxes(n, torch.Generator().manual_seed(0), CPU)
    torch.manual_seed(0)
    theirs_tv = v2.RandomResizedCrop(16, scale=scale, ratio=ratio)
    image = torch.zeros(3, *size, dtype=torch.uint8)
    theirs = torch.tensor([[p["top"], p["left"], p["height"], p["width"]]
                           for p in (theirs_tv.make_params([image]) for _ in range(n))], dtype=torch.float64)
    for column, name in enumerate(("top", "left", "height", "width")):
        assert _ks(ours[:, column], theirs[:, column]) < 0.05, name
    assert (ours[:, 0] + ours[:, 2] <= size[0]).all() and (ours[:, 1] + ours[:, 3] <= size[1]).all()
    assert (ours[:, 2:] > 0).all()


@pytest.mark.parametrize("box", [(5, 7, 40, 50), (0, 0, 48, 64), (10, 3, 12, 9)])
def test_a_crop_box_resizes_as_torchvision_resized_crop(box) -> None:
    image = _smooth()
    top, left, h, w = (torch.tensor([float(v)]) for v in box)
    ours = _augment.resized_crop(Images(image[None].float(), True), top, left, h, w, (24, 24))[0]
    theirs = VF.resized_crop(image, *box, [24, 24], antialias=True).float()
    # Up to one uint8 level (a rounding) where the box is resized up; two where it is resized down, where
    # roi_align averages a box of bilinear samples and torchvision filters with a triangle.
    error = (ours - theirs).abs()
    assert error.max() <= (1 if box[2] <= 24 or box[3] <= 24 else 2) and error.mean() < 0.4


def test_flip_rate_and_flipped_pixels() -> None:
    n = 4000
    image = _smooth(8, 8)
    out = _pipeline(v2.RandomHorizontalFlip(p=0.3), (3, 8, 8))(image[None].repeat(n, 1, 1, 1))
    flipped = torch.tensor([torch.equal(o, image.flip(-1)) for o in out])
    kept = torch.tensor([torch.equal(o, image) for o in out])
    assert bool((flipped | kept).all())
    assert abs(flipped.double().mean().item() - 0.3) < 0.03
    vertical = _pipeline(v1.RandomVerticalFlip(p=1.0), (3, 8, 8))(image[None])
    assert torch.equal(vertical[0], image.flip(-2))


@pytest.mark.parametrize("transform, ltrb", [(v2.RandomCrop(16, padding=4), [4, 4, 4, 4]),
                                             (v1.RandomCrop(16, padding=(2, 5)), [2, 5, 2, 5]),
                                             (v2.RandomCrop(16, padding=[1, 2, 3, 4], padding_mode="reflect"),
                                              [1, 2, 3, 4])])
def test_random_crop_with_padding_matches_torchvision_offsets(transform, ltrb) -> None:
    n = 1000
    height, width = 20, 24
    # Each pixel holds its own (row, column) + 1, so a window names its offset and padding reads as 0.
    rows = torch.arange(1, height + 1).view(-1, 1).expand(height, width)
    cols = torch.arange(1, width + 1).view(1, -1).expand(height, width)
    image = torch.stack([rows, cols, rows]).to(torch.uint8)
    ours = _pipeline(transform, (3, height, width))(image[None].repeat(n, 1, 1, 1))
    torch.manual_seed(0)
    theirs = torch.stack([transform(image) for _ in range(n)])
    assert ours.shape == theirs.shape == (n, 3, 16, 16)
    # Every window is one of torchvision's (its padding, its content): all of them, at every offset.
    padded = VF.pad(image, ltrb, padding_mode=transform.padding_mode)
    windows = {padded[:, t:t + 16, l:l + 16].numpy().tobytes()
               for t in range(padded.shape[1] - 15) for l in range(padded.shape[2] - 15)}
    assert all(o.numpy().tobytes() in windows for o in ours) and all(o.numpy().tobytes() in windows for o in theirs)

    def offsets(batch: torch.Tensor) -> torch.Tensor:
        return batch[:, :2].float().mean(dim=(-2, -1))  # the window's mean (row, column): its position

    for column in range(2):
        assert _ks(offsets(ours)[:, column], offsets(theirs)[:, column]) < 0.08


@pytest.mark.parametrize("transform", [
    v2.Compose([v2.CenterCrop(40), v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]),
    v2.Compose([v2.CenterCrop((60, 70)), v2.ToDtype(torch.float32, scale=True)]),  # larger: padded
    v2.Compose([v2.Resize(32), v2.ToDtype(torch.float32, scale=True)]),
    v2.Compose([v2.Resize((50, 30)), v2.ToImage(), v2.ToDtype(torch.float16, scale=True)]),
    v1.Compose([v1.Resize(40), v1.CenterCrop(32), v1.ConvertImageDtype(torch.float32), v1.Normalize(MEAN, STD)]),
])
def test_deterministic_transforms_match_torchvision(transform) -> None:
    image = _smooth()
    ours = _pipeline(transform, (3, 48, 64))(image[None])[0]
    theirs = transform(image)
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    assert (ours.float() - theirs.float()).abs().max() <= 1.01 / 255 / min(STD)  # one uint8 level, normalised


# -- colour -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("integer", [False, True])
def test_each_colour_adjustment_matches_torchvision_at_a_given_factor(integer: bool) -> None:
    image = _smooth(12, 16)
    data = image if integer else image.float() / 255
    x = Images(data[None].float(), integer)
    adjust = {0: VF.adjust_brightness, 1: VF.adjust_contrast, 2: VF.adjust_saturation, 3: VF.adjust_hue}
    for fn, factor in ((0, 1.3), (0, 0.7), (1, 1.35), (1, 0.6), (2, 1.4), (2, 0.5), (3, 0.08), (3, -0.1)):
        ours = _augment.ColorJitter._adjust(fn, x, torch.tensor(factor).view(1, 1, 1, 1))[0]
        theirs = adjust[fn](data, factor).float()
        assert (ours - theirs).abs().max() <= (1.0 if integer else 1e-5), (fn, factor)


@pytest.mark.parametrize("integer", [False, True])
def test_each_jittered_sample_is_torchvisions_jitter_with_that_samples_draw(integer: bool) -> None:
    n = 24
    image = _smooth(10, 12) if integer else _smooth(10, 12).float() / 255
    ranges = ((0.6, 1.4), (0.7, 1.3), (0.5, 1.5), (-0.1, 0.1))
    out = _pipeline(v2.ColorJitter(*ranges), (3, 10, 12), integer=integer, seed=5)(image[None].repeat(n, 1, 1, 1))
    # The same draws, in the order the op makes them: a permutation per sample, then each factor per sample.
    generator = torch.Generator().manual_seed(5)
    order = torch.rand(n, 4, generator=generator).argsort(dim=1)
    factors = [torch.rand(n, generator=generator) * (high - low) + low for low, high in ranges]
    adjust = (VF.adjust_brightness, VF.adjust_contrast, VF.adjust_saturation, VF.adjust_hue)
    for i in range(n):
        expected = image
        for fn in order[i].tolist():
            expected = adjust[fn](expected, float(factors[fn][i]))
        assert (out[i].float() - expected.float()).abs().max() <= (1 if integer else 1e-5), i


def test_colour_jitter_statistics_match_torchvision() -> None:
    n = 500  # torchvision's jitter costs milliseconds an image on the CPU
    image = _smooth(12, 16).float() / 255
    jitter = v2.ColorJitter(brightness=0.4, contrast=0.4, saturation=0.4, hue=0.1)
    ours = _pipeline(jitter, (3, 12, 16), integer=False)(image[None].repeat(n, 1, 1, 1))
    torch.manual_seed(0)
    theirs = torch.stack([jitter(image) for _ in range(n)])
    for name, stat in (("mean", lambda b: b.mean(dim=(1, 2, 3))), ("contrast", lambda b: b.std(dim=(1, 2, 3))),
                       ("red", lambda b: b[:, 0].mean(dim=(1, 2))), ("blue", lambda b: b[:, 2].mean(dim=(1, 2)))):
        assert _ks(stat(ours), stat(theirs)) < 0.1, name
        assert abs(stat(ours).mean() - stat(theirs).mean()) < 0.01, name
        assert 0.85 < stat(ours).std() / stat(theirs).std() < 1.15, name


# -- serving a dataset --------------------------------------------------------------------------------------

class _Tensors(torch.utils.data.Dataset):
    """uint8 images in memory with a torchvision-style ``transform`` attribute."""

    def __init__(self, n: int = 48, transform=None, size: tuple[int, int] = (40, 48)) -> None:
        generator = torch.Generator().manual_seed(0)
        self.images = torch.randint(0, 256, (n, 3, *size), generator=generator, dtype=torch.uint8)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        image = self.images[index]
        return (self.transform(image) if self.transform is not None else image), index


class _Pictures(_Tensors):
    """The same as PIL images, as torchvision's CIFAR10 serves them."""

    def __getitem__(self, index: int):
        image = Image.fromarray(self.images[index].permute(1, 2, 0).numpy())
        return (self.transform(image) if self.transform is not None else image), index


TRAIN = v2.Compose([v2.RandomResizedCrop(32), v2.RandomHorizontalFlip(), v2.ToDtype(torch.float32, scale=True),
                    v2.Normalize(MEAN, STD)])


def _context(config: TrialConfig, **kwargs) -> TrialContext:
    return TrialContext(config=config, device=CPU, seed=3, **kwargs)


def test_the_dataloader_route_serves_uint8_items_and_augments_each_batch() -> None:
    dataset = _Tensors(transform=TRAIN)
    ctx = _context(TrialConfig(batch_size=8, augment="device", num_workers=2))
    loader = ctx.loader(dataset)
    assert isinstance(loader.loader, torch.utils.data.DataLoader) and loader.loader.num_workers == 2
    assert dataset.transform is TRAIN  # the script's dataset is left as it is
    served = loader.loader.dataset[0][0]
    assert served.dtype == torch.uint8 and torch.equal(served, dataset.images[0])
    batches = list(ctx.batches(loader))
    assert len(batches) == len(dataset) // 8
    images, labels = batches[0]
    assert images.shape == (8, 3, 32, 32) and images.dtype == torch.float32
    assert labels.dtype == torch.long and sorted(set(torch.cat([b[1] for b in batches]).tolist())) == list(range(48))
    assert ctx.extras["augment_transforms"] == ["RandomResizedCrop", "RandomHorizontalFlip", "ToDtype", "Normalize"]
    # The same seed and order from the device: the same batches, draw for draw.
    resident = _context(TrialConfig(batch_size=8, augment="device", loader="device"))
    first = next(iter(resident.batches(resident.loader(_Tensors(transform=TRAIN)))))
    assert torch.equal(first[0], images) and torch.equal(first[1], labels)


def test_pil_items_with_v1_transforms_are_served_as_tensors() -> None:
    cifar = v1.Compose([v1.RandomCrop(32, padding=4), v1.RandomHorizontalFlip(), v1.ToTensor(),
                        v1.Normalize(MEAN, STD)])
    ctx = _context(TrialConfig(batch_size=8, augment="device"))
    images, _ = next(iter(ctx.loader(_Pictures(transform=cifar, size=(32, 32)))))
    assert images.shape == (8, 3, 32, 32) and images.dtype == torch.float32
    on_cpu = torch.stack([cifar(_Pictures(size=(32, 32))[i][0]) for i in range(8)])
    assert abs(images.mean() - on_cpu.mean()) < 0.15  # padding and crops move the mean a little, not more


def test_a_declared_transform_runs_per_item_or_on_the_device() -> None:
    for augment in ("dataset", "device"):
        ctx = _context(TrialConfig(batch_size=8, augment=augment))
        images, labels = next(iter(ctx.loader(_Tensors(), transform=TRAIN)))
        assert images.shape == (8, 3, 32, 32) and images.dtype == torch.float32, augment
        assert labels.shape == (8,)


def test_an_unknown_transform_keeps_the_cpu_pipeline_and_is_named() -> None:
    transform = v2.Compose([v2.RandomResizedCrop(32), v2.RandAugment(), v2.ToDtype(torch.float32, scale=True)])
    with pytest.raises(KnobError, match=r"augment=device: RandAugment \(torchvision v2\) has no device"):
        _context(TrialConfig(batch_size=8, augment="device")).loader(_Tensors(transform=transform))
    # A study's run records why, and the space drops the value with that reason.
    ctx = _context(TrialConfig(batch_size=8), budget=Budget(samples=64, warmup_steps=1, windows=3))
    loader = ctx.loader(_Tensors(transform=transform))
    assert isinstance(loader, torch.utils.data.DataLoader)  # the CPU pipeline, as written
    assert "RandAugment" in ctx.extras["device_augment"]
    space = restrict_to_model(load_space("gpu_default"), activations_4d=True,
                              device_augment=ctx.extras["device_augment"])
    assert "device" not in space.knobs["augment"].values
    assert space.removed["augment=device"].startswith(DEVICE_AUGMENT_REFUSED)
    assert "RandAugment" in space.removed["augment=device"]


def test_a_study_run_records_that_the_served_items_fit_on_the_device() -> None:
    ctx = _context(TrialConfig(batch_size=8), budget=Budget(samples=64, warmup_steps=1, windows=3))
    ctx.loader(_Tensors(transform=TRAIN))
    assert ctx.extras["device_loader"].startswith("random augmentation")
    assert ctx.extras["device_augment"] == "ok" and ctx.extras["device_loader_augmented"] == "ok"
    space = restrict_to_model(load_space("gpu_default"), activations_4d=True,
                              device_loader=ctx.extras["device_loader"], device_augment="ok",
                              device_loader_augmented="ok")
    assert "device" in space.knobs["loader"].values and "device" in space.knobs["augment"].values
    assert space.cannot_run({**space.baseline.to_dict(), "loader": "device", "augment": "dataset"})
    assert space.cannot_run({**space.baseline.to_dict(), "loader": "device", "augment": "device"}) is None
    # Without a transform there is nothing to move.
    bare = _context(TrialConfig(batch_size=8), budget=Budget(samples=64, warmup_steps=1, windows=3))
    bare.loader(_Tensors())
    assert bare.extras["device_augment"].startswith("the dataset has no transform")


class _Ragged(_Tensors):
    """Images of six sizes, as an ImageFolder's are (cut from the stored ones)."""

    def __getitem__(self, index: int):
        image = self.images[index][:, : 30 + 4 * (index % 3), : 36 + 6 * (index % 2)]
        return (self.transform(image) if self.transform is not None else image), index


def test_images_of_several_sizes_are_padded_and_each_cropped_in_its_own_size() -> None:
    ctx = _context(TrialConfig(batch_size=8, augment="device", num_workers=2))  # padded in the workers
    images, labels = next(iter(ctx.loader(_Ragged(transform=TRAIN))))
    assert images.shape == (8, 3, 32, 32) and labels.shape == (8,)
    # Resized whole, each image is torchvision's resize of it: the padding never shows at its border.
    resize = v2.Compose([v2.Resize((44, 50)), v2.ToDtype(torch.float32, scale=True)])
    dataset = _Ragged(n=6)
    batch, sizes = _augment.pad([dataset[i][0] for i in range(6)])
    ours = _pipeline(resize, (3, 30, 36))(batch, sizes)
    theirs = torch.stack([resize(dataset[i][0]) for i in range(6)])
    assert (ours - theirs).abs().max() <= 1.01 / 255
    # The crop boxes are drawn in each image's own size.
    op = _augment.recognise(v2.RandomResizedCrop(16))
    op.shape((3, 30, 36))
    n = 2000
    boxes = op.boxes(n, torch.Generator().manual_seed(0), CPU, torch.tensor([[30, 36], [38, 42]]).repeat(n // 2, 1))
    torch.manual_seed(0)
    theirs = torch.tensor([[p["height"], p["width"]] for p in (v2.RandomResizedCrop(16).make_params(
        [torch.zeros(3, 38, 42)]) for _ in range(n // 2))], dtype=torch.float64)
    assert _ks(boxes[1::2, 2], theirs[:, 0]) < 0.07 and _ks(boxes[1::2, 3], theirs[:, 1]) < 0.07
    assert (boxes[0::2, 2] <= 30).all() and (boxes[0::2, 3] <= 36).all()


def test_images_of_several_sizes_need_a_first_transform_that_gives_them_one() -> None:
    why = _augment.refusal(_Ragged(transform=v2.Compose([v2.RandomHorizontalFlip(), v2.RandomResizedCrop(32)])))
    assert "differ in size" in why and "RandomHorizontalFlip comes first" in why
    with pytest.raises(KnobError, match="loader=device: its images before their transforms differ in size"):
        _context(TrialConfig(batch_size=8, augment="device", loader="device")).loader(_Ragged(transform=TRAIN))


def test_the_config_says_how_to_apply_it() -> None:
    config = TrialConfig(augment="device")
    assert "augment=device" in config.describe()
    assert "augment=device" in config.input_pipeline and "PILToTensor" in config.input_pipeline
    assert "augment" not in TrialConfig().input_pipeline
    with pytest.raises(ValueError, match="augment must be one of"):
        TrialConfig(augment="gpu")
    assert math.isclose(len(load_space("gpu_default").knobs["augment"].values), 2)


def _train_small(ctx) -> None:
    """A linear classifier over augmented 32 x 32 crops: reports whether its loader augments on the device."""
    torch.manual_seed(ctx.seed)
    model = ctx.model(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 48)))  # a class per image
    optimizer = ctx.optimizer(torch.optim.SGD, model.parameters(), lr=0.01)
    loader = ctx.loader(_Tensors(transform=TRAIN), batch_size=8)
    step = ctx.train_step(model, optimizer, torch.nn.CrossEntropyLoss())
    for images, labels in ctx.batches(loader):
        step(images, labels)
    ctx.report_metric(float(isinstance(loader, _augment.AugmentedLoader)))


def test_autotune_train_trains_with_it(tmp_path) -> None:
    import json

    import autotune

    config = TrialConfig(batch_size=8, augment="device", cpu_threads=1)
    path = tmp_path / "best_config.json"
    path.write_text(json.dumps({"study": None, "config": config.to_dict(), "throughput": None, "measurement": {},
                                "baseline": {"config": TrialConfig().to_dict(), "throughput": None}}))
    run = autotune.train(_train_small, config=path, epochs=1, out=tmp_path, progress=False,
                         say=lambda _: None).runs["pick"]
    assert run.status == "ok", run.error
    assert run.config.augment == "device" and run.steps_done == 48 // 8
    assert run.metrics[-1]["value"] == 1.0


def train_for_a_study(ctx) -> None:
    """The same classifier for a study: no metric, the loss trajectory judges."""
    torch.manual_seed(ctx.seed)
    model = ctx.model(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 48)))
    optimizer = ctx.optimizer(torch.optim.SGD, model.parameters(), lr=0.01)
    step = ctx.train_step(model, optimizer, torch.nn.CrossEntropyLoss())
    for images, labels in ctx.batches(ctx.loader(_Tensors(transform=TRAIN), batch_size=16)):
        step(images, labels)


def test_a_study_searches_it_and_its_trial_trains_with_the_transforms_on_the_device(
        tmp_path, write_space, cpu_caps) -> None:
    import optuna

    from autotune import Tuner

    space = write_space("""
    knobs:
      augment: [dataset, device]
    batch_policy: fixed
    baseline: {batch_size: 16, num_workers: 0, cpu_threads: 1}
    budget: {samples: 1024, warmup_steps: 2, windows: 3}
    """)
    storage = f"sqlite:///{tmp_path}/s.db"
    result = Tuner(f"{__file__}:train_for_a_study", space=space, n_trials=2, storage=storage,
                   studies_dir=tmp_path / "studies", progress=False, plots=False, capabilities=cpu_caps,
                   reference_repeats=1, top_k=0, study_name="aug", trial_timeout=120).run()
    assert "augment=device" not in result.removed_knobs
    trials = optuna.load_study(study_name="aug", storage=storage).trials
    device = [t for t in trials if (t.user_attrs.get("config") or {}).get("augment") == "device"]
    assert device and device[0].user_attrs["status"] == "ok", [t.user_attrs.get("error") for t in trials]
