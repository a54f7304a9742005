"""Search spaces: YAML validation with one-line errors, the capability filter, and sampling through Optuna."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import optuna
import pytest

from autotune import SpaceError, TrialConfig, load_space
from autotune._config import COMPILE_MODES_WITH_GRAPHS
from autotune.hardware import Capabilities
from autotune.search._space import (
    SPACES_DIR,
    builtin_spaces,
    describe_changes,
    format_baseline,
    parse_baseline,
    parse_space,
    restrict_to,
    restrict_to_model,
)

optuna.logging.set_verbosity(optuna.logging.WARNING)

VALID = """\
description: a small valid space
knobs:
  precision: [fp32, bf16]
  batch_size: [32, 64]
budget:
  samples: 1024
  warmup_steps: 1
  windows: 3
"""

# (test id, YAML text, what the one-line message must name besides the file)
INVALID = [
    ("does-not-parse", "knobs:\n  batch_size: [32, 64\n  precision: fp32\n", ["does not parse", "line"]),
    ("unknown-top-level-key", "knobs:\n  batch_size: [32]\nsampler: tpe\n", ["'sampler'"]),
    ("unknown-knob", "knobs:\n  batch_sise: [32]\n", ["knobs.batch_sise", "unknown knob"]),
    ("empty-choices", "knobs:\n  batch_size: []\n", ["knobs.batch_size", "empty choices"]),
    ("empty-choices-mapping", "knobs:\n  num_workers: {choices: []}\n", ["knobs.num_workers", "empty choices"]),
    ("batch-not-positive", "knobs:\n  batch_size: [32, 0]\n", ["knobs.batch_size", "0", "not a positive integer"]),
    ("batch-range-step", "knobs:\n  batch_size: {low: 32, high: 128, step: 12}\n", ["knobs.batch_size.step", "12"]),
    ("batch-range-low", "knobs:\n  batch_size: {low: 20, high: 128}\n", ["knobs.batch_size.low", "20"]),
    ("low-above-high", "knobs:\n  num_workers: {low: 4, high: 1}\n", ["knobs.num_workers", "low 4 > high 1"]),
    (
        "too-few-samples-for-largest-batch",
        "knobs:\n  batch_size: [64, 512]\nbatch_policy: scale\nbudget: {samples: 2048, warmup_steps: 2, windows: 3}\n",
        ["budget.samples", "2048", "batch 512"],
    ),
    ("too-few-windows", "knobs:\n  batch_size: [32]\nbudget: {samples: 4096, windows: 2}\n", ["budget"]),
    ("unknown-budget-key", "knobs:\n  batch_size: [32]\nbudget: {sample: 4096}\n", ["budget.sample"]),
    ("bad-precision", "knobs:\n  precision: [fp32, int8]\n", ["knobs.precision", "int8"]),
    ("bad-compile-mode", "knobs:\n  compile: [off, fast]\n", ["knobs.compile", "fast"]),
    ("duplicate-choices", "knobs:\n  batch_size: [32, 32]\n", ["knobs.batch_size", "duplicate"]),
    ("bool-knob-not-bool", "knobs:\n  channels_last: [yes-please]\n", ["knobs.channels_last"]),
    ("range-on-categorical", "knobs:\n  precision: {low: 1, high: 2}\n", ["knobs.precision", "range"]),
    ("baseline-unknown-knob", "knobs:\n  batch_size: [32]\nbaseline: {batch: 32}\n", ["baseline.batch"]),
    ("baseline-bad-batch", "knobs:\n  batch_size: [32]\nbaseline: {batch_size: 0}\n", ["baseline.batch_size"]),
    ("no-knobs", "description: nothing to tune\n", ["'knobs'"]),
]


@pytest.mark.parametrize("text, names", [case[1:] for case in INVALID], ids=[case[0] for case in INVALID])
def test_invalid_space_is_one_line_naming_file_and_key(write_space, text: str, names: list[str]) -> None:
    path = write_space(text, name="bad_space.yaml")
    with pytest.raises(SpaceError) as info:
        load_space(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: ")
    for name in names:
        assert name in message


def test_missing_space_file_names_it_and_lists_the_built_ins(tmp_path: Path) -> None:
    with pytest.raises(SpaceError, match="no such search space") as info:
        load_space(tmp_path / "nope.yaml")
    assert str(tmp_path / "nope.yaml") in str(info.value)
    assert "cpu_default" in str(info.value)


@pytest.mark.parametrize("path", builtin_spaces(), ids=lambda p: p.stem)
def test_builtin_space_loads(path: Path) -> None:
    space = load_space(path)
    assert space.knobs and space.size >= 2
    assert space.description
    assert load_space(path.stem).fingerprint == space.fingerprint  # by name as well as by path


def test_the_builtin_spaces_include_the_documented_ones() -> None:
    assert {p.stem for p in builtin_spaces()} >= {
        "cpu_default", "demo_cpu", "demo_gpu", "example_cifar_cnn", "gpu_default"
    }
    assert all(p.parent == SPACES_DIR for p in builtin_spaces())


def test_compile_off_is_the_string_off_not_false(write_space) -> None:
    space = load_space(write_space("knobs:\n  compile: [off, default]\nbaseline:\n  compile: off\n"))
    assert space.knobs["compile"].choices == ("off", "default")
    assert space.baseline.compile == "off"


def test_ranges_expand_to_their_values(write_space) -> None:
    space = load_space(write_space(
        "knobs:\n"
        "  batch_size: {low: 32, high: 128, step: 32}\n"
        "  num_workers: {low: 0, high: 2}\n"
        "  memory_fraction: {low: 0.5, high: 1, step: 0.25}\n"
        "batch_policy: scale\n"
        "budget: {samples: 1024, warmup_steps: 1, windows: 3}\n"
    ))
    assert space.knobs["batch_size"].values == (32, 64, 96, 128)
    assert space.knobs["num_workers"].values == (0, 1, 2)
    assert space.knobs["memory_fraction"].values == (0.5, 0.75, 1.0)
    assert space.size == 4 * 3 * 3
    assert space.max_batch_size() == 128


def test_fingerprint_is_stable_and_tracks_the_definition(write_space) -> None:
    first = load_space(write_space(VALID, "a.yaml"))
    again = load_space(write_space(VALID, "b.yaml"))
    assert first.fingerprint == again.fingerprint
    # The description is prose, not part of the definition.
    reworded = load_space(write_space(VALID.replace("a small valid space", "reworded"), "c.yaml"))
    assert reworded.fingerprint == first.fingerprint

    bigger = load_space(write_space(VALID.replace("[32, 64]", "[32, 64, 128]"), "d.yaml"))
    assert bigger.fingerprint != first.fingerprint
    assert describe_changes(first.to_dict(), bigger.to_dict()) == ["knobs.batch_size"]

    longer = load_space(write_space(VALID.replace("samples: 1024", "samples: 2048"), "e.yaml"))
    assert longer.fingerprint != first.fingerprint
    assert describe_changes(first.to_dict(), longer.to_dict()) == ["budget.samples"]


def test_describe_changes_sees_no_change_after_a_json_round_trip(write_space) -> None:
    # The tuner compares the definition stored in the study (JSON) with the one loaded now.
    space = load_space(SPACES_DIR / "gpu_default.yaml")
    stored = json.loads(json.dumps(space.to_dict()))
    assert describe_changes(stored, space.to_dict()) == []


def test_restrict_to_a_machine_without_cuda_removes_cuda_knobs_with_reasons() -> None:
    space = load_space("gpu_default")
    cpu = Capabilities(cuda=False, bf16=True, compile=True)
    before = dict(space.removed)  # the batch policy's own removals (micro-batches above the global batch)
    restricted = restrict_to(space, cpu)

    assert restricted.knobs["precision"].values == ("fp32", "bf16")
    for knob in ("cuda_graphs", "cudnn_benchmark", "pin_memory"):
        assert restricted.knobs[knob].values == (False,), knob
    assert set(restricted.knobs["compile"].values) == {"off", "default", "max-autotune-no-cudagraphs"}
    for key in ("precision=tf32", "precision=fp16", "cuda_graphs=true", "cudnn_benchmark=true",
                "pin_memory=true", "compile=max-autotune"):
        assert "no CUDA device" in restricted.removed[key], key
    assert restricted.size < space.size
    assert space.removed == before  # the original is untouched


def test_restrict_to_removes_memory_fractions_below_one_without_cuda(write_space) -> None:
    space = load_space(write_space("knobs:\n  memory_fraction: [0.5, 0.8, 1.0]\n  batch_size: [32, 64]\n"))
    restricted = restrict_to(space, Capabilities(cuda=False, bf16=True))
    assert restricted.knobs["memory_fraction"].values == (1.0,)
    assert set(restricted.removed) == {"memory_fraction=0.5", "memory_fraction=0.8"}


def test_restrict_to_falls_back_when_the_baseline_value_is_removed(write_space) -> None:
    space = load_space(write_space("knobs:\n  memory_fraction: [0.5, 1.0]\nbaseline:\n  memory_fraction: 0.5\n"))
    restricted = restrict_to(space, Capabilities(cuda=False, bf16=True))
    assert restricted.knobs["memory_fraction"].values == (1.0,)
    assert restricted.baseline.memory_fraction == 1.0


def test_restrict_to_without_a_compiler_or_bf16() -> None:
    space = load_space("gpu_default")
    no_compile = restrict_to(space, Capabilities(cuda=True, bf16=True, compile=False, compile_reason="no compiler"))
    assert no_compile.knobs["compile"].values == ("off",)
    assert no_compile.removed["compile=default"] == "no compiler"
    no_bf16 = restrict_to(space, Capabilities(cuda=True, bf16=False, gpu_name="Old GPU"))
    assert "bf16" not in no_bf16.knobs["precision"].values
    assert "Old GPU" in no_bf16.removed["precision=bf16"]
    assert "tf32" in no_bf16.knobs["precision"].values  # CUDA knobs stay on a CUDA machine


SAMPLING_SPACE = """\
knobs:
  precision: [bf16]
  batch_size: {low: 32, high: 128, step: 32}
  compile: [off, default, reduce-overhead, max-autotune]
  cuda_graphs: [false, true]
  num_workers: [0, 2]
  prefetch_factor: [2, 4]
  persistent_workers: [false, true]
  memory_fraction: {low: 0.5, high: 1.0, step: 0.25}
  cpu_threads: {low: 1, high: 4}
baseline:
  channels_last: true
batch_policy: scale
budget: {samples: 2048, warmup_steps: 2, windows: 3}
"""


def test_sampling_through_optuna_stays_in_the_space_and_skips_moot_knobs(write_space) -> None:
    space = load_space(write_space(SAMPLING_SPACE))
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    distributions = space.distributions()
    seen: Counter = Counter()
    for _ in range(80):
        trial = study.ask()
        config = space.sample(trial)
        assert isinstance(config, TrialConfig)
        for name, knob in space.knobs.items():
            assert getattr(config, name) in knob.values, name
        assert config.precision == "bf16" and "precision" not in trial.params  # fixed: not asked
        assert config.channels_last is True  # not listed: the baseline's value
        for name, value in trial.params.items():
            dist = distributions[name]
            assert dist._contains(dist.to_internal_repr(value)), name
        if config.compile in COMPILE_MODES_WITH_GRAPHS:
            assert config.cuda_graphs is False and "cuda_graphs" not in trial.params
        if config.num_workers == 0:
            assert "prefetch_factor" not in trial.params and "persistent_workers" not in trial.params
            assert config.prefetch_factor == TrialConfig().prefetch_factor
        seen.update({
            "graphs": config.cuda_graphs,
            "graph-mode": config.compile in COMPILE_MODES_WITH_GRAPHS,
            "prefetch4": config.prefetch_factor == 4,
            "no-workers": config.num_workers == 0,
        })
        study.tell(trial, 0.0)
    # The conditions above were exercised both ways, so the test can tell a sampler that ignores them.
    assert all(seen[key] > 0 for key in ("graphs", "graph-mode", "prefetch4", "no-workers")), seen


def test_an_enqueued_config_is_sampled_as_given(write_space) -> None:
    space = load_space(write_space(SAMPLING_SPACE))
    study = optuna.create_study()
    study.enqueue_trial({"batch_size": 96, "compile": "default", "cuda_graphs": True, "num_workers": 2,
                         "prefetch_factor": 4, "persistent_workers": True, "memory_fraction": 0.75,
                         "cpu_threads": 3})
    config = space.sample(study.ask())
    assert config == TrialConfig(precision="bf16", batch_size=96, channels_last=True, compile="default",
                                 cuda_graphs=True, num_workers=2, prefetch_factor=4, persistent_workers=True,
                                 memory_fraction=0.75, cpu_threads=3, batch_policy="scale")


def test_size_counts_distinct_configs_not_knobs_that_cannot_matter(write_space) -> None:
    space = load_space(write_space(
        "knobs:\n"
        "  num_workers: [0, 2]\n"
        "  prefetch_factor: [2, 4]\n"  # only asked with workers: 1 + 2 configs, not 4
        "  compile: ['off', max-autotune]\n"
        "  cuda_graphs: [false, true]\n"  # max-autotune captures graphs itself: 2 + 1, not 4
        "budget: {samples: 1024, warmup_steps: 1, windows: 3}\n"
    ))
    assert space.size == 3 * 3


def test_restrict_to_removes_cpu_threads_above_the_usable_cores() -> None:
    space = load_space("cpu_default")  # cpu_threads: [null, 1, 2, 4, 8]
    two = restrict_to(space, Capabilities(cuda=False, bf16=True, cpu_count=2))
    assert two.knobs["cpu_threads"].values == (None, 1, 2)
    assert set(k for k in two.removed if k.startswith("cpu_threads")) == {"cpu_threads=4", "cpu_threads=8"}
    assert "may use 2 cores" in two.removed["cpu_threads=8"]
    assert restrict_to(space, Capabilities(cuda=False, bf16=True, cpu_count=8)).knobs["cpu_threads"].values == (
        None, 1, 2, 4, 8)
    unknown = restrict_to(space, Capabilities(cuda=False, bf16=True))  # cpu_count 0: not probed, nothing goes
    assert unknown.knobs["cpu_threads"].values == (None, 1, 2, 4, 8)


def test_restrict_to_model_drops_channels_last_only_without_4d_activations(write_space) -> None:
    space = load_space("cpu_default")
    flat = restrict_to_model(space, activations_4d=False)
    assert flat.knobs["channels_last"].values == (False,)
    assert "no 4-D activations" in flat.removed["channels_last=true"]
    assert flat.size < space.size
    for told in (True, None):  # convolutions, or a workload that did not call ctx.model
        assert restrict_to_model(space, activations_4d=told) == space
    uses_it = load_space(write_space("knobs:\n  channels_last: [false, true]\nbaseline: {channels_last: true}\n"))
    assert restrict_to_model(uses_it, activations_4d=False) == uses_it  # the reference ran with it: keep


# -- the baseline stated on the command line (--baseline) -------------------------------------------------

def test_a_stated_baseline_overrides_the_yaml_and_sets_the_fixed_global_batch() -> None:
    space = load_space("cpu_default")
    assert (space.baseline.batch_size, space.global_batch) == (64, 64)
    stated = space.with_baseline(parse_baseline("batch_size=32,precision=fp32,compile=off,cpu_threads=null"))
    assert (stated.baseline.batch_size, stated.global_batch, stated.batch_policy) == (32, 32, "fixed")
    assert stated.baseline.compile == "off" and stated.baseline.cpu_threads is None
    assert stated.knobs["batch_size"].values == (16, 32)  # micro-batches of the new global batch
    assert "batch_size=64,128,256" in stated.removed
    assert describe_changes(space.to_dict(), stated.to_dict()) == ["global_batch", "baseline.batch_size"]
    # A space's own global_batch gives way too: the baseline is the training the user runs.
    demo = load_space("demo_cpu").with_baseline({"batch_size": 64})
    assert (demo.baseline.batch_size, demo.global_batch) == (64, 64)


def test_a_stated_baseline_under_scale_keeps_every_batch() -> None:
    space = load_space("example_cifar_cnn").with_baseline({"batch_size": 32, "channels_last": True})
    assert space.batch_policy == "scale" and space.baseline.batch_size == 32 and space.baseline.channels_last
    assert space.knobs["batch_size"].values == (32, 64, 128, 256, 1024)


@pytest.mark.parametrize("text, names", [
    ("batch_sise=32", ["batch_sise", "unknown knob"]),
    ("batch_size=-3", ["batch_size", "-3", "not a positive integer"]),
    ("precision=int8", ["precision", "int8"]),
    ("channels_last=maybe", ["channels_last", "maybe"]),
    ("batch_size", ["'batch_size'", "knob=value"]),
    ("batch_size=32,batch_size=64", ["batch_size", "twice"]),
    (",", ["no knob=value"]),
])
def test_a_bad_stated_baseline_is_one_line(text: str, names: list[str]) -> None:
    with pytest.raises(SpaceError) as info:
        parse_baseline(text)
    message = str(info.value)
    assert "\n" not in message and message.startswith("--baseline: ")
    for name in names:
        assert name in message


def test_a_stated_baseline_batch_leaves_out_the_micro_batches_that_do_not_divide_it() -> None:
    # The script's batch (24; the word-language-model example's 20) is the baseline on any device: the
    # space's micro-batches that do not divide it are left out, each with its reason, not the batch refused.
    space = load_space("cpu_default").with_baseline({"batch_size": 24})
    assert space.baseline.global_batch_size == 24 and space.knobs.get("batch_size") is None
    assert "does not divide the global batch 24" in space.removed["batch_size=16"]
    assert "above the global batch 24" in space.removed["batch_size=32,64,128,256"]
    # A space that says its own batch and lists a micro-batch that does not divide it contradicts itself.
    with pytest.raises(SpaceError, match="does not divide the global batch 64"):
        parse_space({"knobs": {"batch_size": [16, 48]}, "baseline": {"batch_size": 64}})
    # One that does not say it leaves the batch to the script: [10, 20] waits for --batch-size 20.
    waiting = parse_space({"knobs": {"batch_size": [10, 20]}})
    assert waiting.with_baseline({"batch_size": 20}).knobs["batch_size"].values == (10, 20)


def test_format_baseline_reads_back() -> None:
    values = {"batch_size": 32, "channels_last": True, "cpu_threads": None, "compile": "off"}
    assert parse_baseline(format_baseline(values)) == values


# -- values that cannot run together -----------------------------------------------------------------
FLASH_FP32 = "SDPA has no flash kernel for float32 on CUDA here (torch: No available kernel)"
CUDNN_FP32 = "SDPA has no cudnn kernel for float32 on CUDA here (torch: No available kernel)"
H200_LIKE = Capabilities(cuda=True, bf16=True, gpu_count=1, gpu_name="GPU", attention_precision_unavailable={
    "flash": {"fp32": FLASH_FP32, "tf32": FLASH_FP32},
    "cudnn": {"fp32": CUDNN_FP32, "tf32": CUDNN_FP32},
    "efficient": {"fp16": "not in this space"},  # efficient is no value of the space below: nothing recorded
})
ATTENTION_SPACE = ("knobs:\n  precision: [fp32, tf32, fp16, bf16]\n  attention: [explicit, auto, flash, cudnn]\n"
                   "  batch_size: [32, 64]\nbudget: {samples: 2048, warmup_steps: 1, windows: 3}\n")


def test_restrict_to_records_values_that_cannot_run_together(write_space) -> None:
    space = load_space(write_space(ATTENTION_SPACE))
    restricted = restrict_to(space, H200_LIKE)
    keys = {"attention=flash with precision=fp32", "attention=flash with precision=tf32",
            "attention=cudnn with precision=fp32", "attention=cudnn with precision=tf32"}
    assert {c.key for c in restricted.combinations} == keys
    assert {k: restricted.removed[k] for k in keys} == {k: FLASH_FP32 if "flash" in k else CUDNN_FP32 for k in keys}
    # Each value alone still runs: both stay, and the definition (the fingerprint) is the user's.
    assert restricted.knobs["attention"].values == space.knobs["attention"].values
    assert restricted.knobs["precision"].values == space.knobs["precision"].values
    assert restricted.fingerprint == space.fingerprint and restricted.to_dict() == space.to_dict()
    for precision in ("fp32", "tf32", "fp16", "bf16"):
        for attention in ("explicit", "auto", "flash", "cudnn"):
            expected = {"flash": FLASH_FP32, "cudnn": CUDNN_FP32}.get(attention) if precision in ("fp32", "tf32") else None
            assert restricted.cannot_run({"precision": precision, "attention": attention, "batch_size": 32}) == expected
            full = restricted.baseline.replace(precision=precision, attention=attention).to_dict()
            assert restricted.cannot_run(full) == expected, (precision, attention)
    assert space.size == 32 and restricted.size == 32 - 2 * 4  # the combinations, at each batch size
    assert restrict_to(space, dataclasses.replace(H200_LIKE, attention_precision_unavailable={})).combinations == ()


def test_a_value_that_no_precision_of_the_space_runs_with_is_removed_as_a_value(write_space) -> None:
    space = load_space(write_space(ATTENTION_SPACE.replace("fp32, tf32, fp16, bf16", "fp32, tf32")))
    restricted = restrict_to(space, H200_LIKE)
    assert restricted.combinations == () and "flash" not in restricted.knobs["attention"].values
    assert restricted.removed["attention=flash"] == FLASH_FP32


def test_a_combination_with_the_baseline_value_of_an_unsearched_knob(write_space) -> None:
    # attention is not searched (the baseline's flash); flash cannot run in fp16 only here.
    text = "knobs:\n  precision: [fp32, fp16]\nbaseline: {attention: flash}\nbudget: {samples: 2048, warmup_steps: 1, windows: 3}\n"
    caps = dataclasses.replace(H200_LIKE, attention_precision_unavailable={"flash": {"fp16": "no fp16 flash"}})
    restricted = restrict_to(load_space(write_space(text)), caps)
    assert [c.key for c in restricted.combinations] == ["attention=flash with precision=fp16"]
    assert restricted.cannot_run({"precision": "fp16"}) == "no fp16 flash"  # the unsearched knob from the baseline
    assert restricted.cannot_run({"precision": "fp32"}) is None


@pytest.mark.parametrize("baseline, what", [("{precision: fp32, attention: flash}", "the baseline"),
                                            ("{precision: fp32, attention: cudnn}", "the baseline")])
def test_a_baseline_that_cannot_run_is_one_error(write_space, baseline: str, what: str) -> None:
    # A bf16 baseline (whose fp32 reference alone could not run) is refused at load now: the baseline is fp32.
    space = load_space(write_space(ATTENTION_SPACE + f"baseline: {baseline}\n"))
    with pytest.raises(SpaceError) as info:
        restrict_to(space, H200_LIKE)
    message = str(info.value)
    assert "\n" not in message and what in message and "reference run could not run" in message
    pair = "attention=flash with precision=fp32" if "flash" in baseline else "attention=cudnn with precision=fp32"
    assert pair in message and (FLASH_FP32 if "flash" in baseline else CUDNN_FP32) in message


def test_numbers_yaml_1_1_reads_as_strings_are_numbers(write_space) -> None:
    # PyYAML's resolver wants a dot in a float ("1.0e-7"): 5e-2 and 1e2 arrive as strings.
    space = load_space(write_space("knobs:\n  memory_fraction: {low: 0.5, high: 1.0, step: 5e-2}\n"
                                   "  num_workers: {low: 0, high: 1e0}\n"))
    assert space.knobs["memory_fraction"].step == 0.05 and len(space.knobs["memory_fraction"].values) == 11
    assert space.knobs["num_workers"].high == 1 and isinstance(space.knobs["num_workers"].high, int)
    with pytest.raises(SpaceError, match="'fast' is not a positive number"):
        load_space(write_space("knobs:\n  memory_fraction: {low: 0.5, high: 1.0, step: fast}\n", "bad.yaml"))
