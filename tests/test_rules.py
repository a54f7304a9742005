import pytest

from autotune.search._rules import infeasible_reason, needs_at_least

FAILED = {"precision": "bf16", "batch_size": 256, "channels_last": True, "compile": "off", "num_workers": 4}


@pytest.mark.parametrize(
    "change, expected",
    [
        ({}, True),
        ({"batch_size": 512}, True),  # larger batch, same settings
        ({"precision": "fp32"}, True),  # wider activations at the same batch
        ({"precision": "fp32", "batch_size": 512}, True),
        ({"num_workers": 8, "pin_memory": True}, True),  # host-side knobs do not change device memory
        ({"batch_size": 128}, False),  # smaller batch may fit
        ({"precision": "fp16"}, True),  # same width as bf16
        ({"channels_last": False}, False),  # another device-side setting: unknown, so not ruled out
        ({"compile": "default"}, False),
    ],
)
def test_needs_at_least(change, expected):
    assert needs_at_least({**FAILED, **change}, FAILED) is expected


def test_narrower_precision_is_not_ruled_out_by_a_wider_failure():
    failed = {**FAILED, "precision": "fp32"}
    assert not needs_at_least({**failed, "precision": "bf16"}, failed)
    assert needs_at_least({**failed, "precision": "tf32"}, failed)


def test_less_memory_allowed_needs_at_least_as_much():
    failed = {**FAILED, "memory_fraction": 0.5}
    assert needs_at_least({**failed, "memory_fraction": 0.25}, failed)
    assert not needs_at_least({**failed, "memory_fraction": 0.75}, failed)


def test_reason_names_the_trial_that_ran_out_of_memory():
    reason = infeasible_reason({**FAILED, "batch_size": 512}, [(7, FAILED)])
    assert reason.startswith("infeasible:") and "trial 7" in reason and "batch_size=256" in reason
    assert infeasible_reason({**FAILED, "batch_size": 64}, [(7, FAILED)]) is None


def test_expandable_segments_may_fit_what_the_default_allocator_could_not():
    failed = {"batch_size": 256, "precision": "bf16", "allocator": "default"}
    assert not needs_at_least({**failed, "allocator": "expandable"}, failed)
    roomy = {**failed, "allocator": "expandable"}
    assert needs_at_least({**roomy, "allocator": "default"}, roomy)  # less room than what ran out


def test_fp8_keeps_bf16_activations():
    failed = {"batch_size": 256, "precision": "bf16"}
    assert needs_at_least({"batch_size": 256, "precision": "fp8"}, failed)
    assert needs_at_least({"batch_size": 256, "precision": "bf16"}, {"batch_size": 256, "precision": "fp8"})
