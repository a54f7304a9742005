"""GuidedSampler on real in-memory Optuna studies."""

import optuna
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from autotune.search._sampler import GuidedSampler

SPACE = {
    "precision": CategoricalDistribution(["fp32", "bf16"]),
    "batch_size": CategoricalDistribution([64, 128, 256, 512]),
    "channels_last": CategoricalDistribution([False, True]),
}


def _study(sampler):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(direction="maximize", sampler=sampler)


def _ask(study):
    trial = study.ask()
    return trial, {name: trial.suggest_categorical(name, dist.choices) for name, dist in SPACE.items()}


def _tell(study, trial, value=None, status="ok"):
    trial.set_user_attr("status", status)
    trial.set_constraint("failure", 0.0 if status == "ok" else 1.0)
    study.tell(trial, value if value is not None else 0.0)


def test_starts_at_the_prior_point_then_walks_coordinates():
    study = _study(GuidedSampler(search_space=SPACE, seed=0))
    trial, first = _ask(study)
    assert first == {"precision": "bf16", "batch_size": 256, "channels_last": True}
    _tell(study, trial, 100.0)
    proposals = []
    for _ in range(3):
        trial, params = _ask(study)
        proposals.append(params)
        _tell(study, trial, 50.0)  # every neighbour is slower: the incumbent stays
    # The batch first, nearest value first and upward before downward, then precision: batch 64 lies past
    # the slower 128, so it waits.
    assert proposals == [
        {"precision": "bf16", "batch_size": 512, "channels_last": True},
        {"precision": "bf16", "batch_size": 128, "channels_last": True},
        {"precision": "fp32", "batch_size": 256, "channels_last": True},
    ]


def test_defers_batch_sizes_past_a_slower_one_until_the_other_moves_are_done():
    # The H200 walk: 256 < 384 < 512, so 192 and 128 (past the slower 384 and 256) wait for the other knobs.
    space = {"batch_size": CategoricalDistribution([128, 192, 256, 384, 512]),
             "precision": CategoricalDistribution(["bf16", "fp16"])}
    study = _study(GuidedSampler(search_space=space, seed=0))
    rate = {128: 6372, 192: 6479, 256: 6726, 384: 6760, 512: 6928}
    order = []
    for _ in range(10):
        trial = study.ask()
        params = {name: trial.suggest_categorical(name, dist.choices) for name, dist in space.items()}
        order.append((params["batch_size"], params["precision"]))
        _tell(study, trial, rate[params["batch_size"]] * (1.02 if params["precision"] == "fp16" else 1.0))
    assert order[:4] == [(256, "bf16"), (384, "bf16"), (512, "bf16"), (512, "fp16")]
    # Then the walk goes on from fp16 bs512; every config is still reached, the deferred ones last.
    assert sorted(order) == sorted((b, p) for b in rate for p in ("bf16", "fp16"))
    assert set(order[-4:]) == {(192, "bf16"), (128, "bf16"), (192, "fp16"), (128, "fp16")}


def test_never_proposes_what_an_out_of_memory_rules_out():
    study = _study(GuidedSampler(search_space=SPACE, seed=0))
    trial, first = _ask(study)
    _tell(study, trial, status="oom")  # bf16 bs256 does not fit
    seen = []
    for _ in range(10):
        trial, params = _ask(study)
        seen.append(params)
        _tell(study, trial, 10.0 * params["batch_size"] / 64)
    for params in seen:
        if params["channels_last"] == first["channels_last"]:
            assert params["batch_size"] < 256, params  # bf16 or fp32 at >= 256 needs more memory
    # Repairing the failed prior moves the batch down first.
    assert seen[0] == {"precision": "bf16", "batch_size": 128, "channels_last": True}


def test_moves_to_a_better_neighbour_and_does_not_repeat_configs():
    truth = {("bf16", 512, True): 900.0, ("bf16", 256, True): 800.0}
    study = _study(GuidedSampler(search_space=SPACE, seed=0))
    seen = []
    for _ in range(16):
        trial, params = _ask(study)
        seen.append(tuple(params.values()))
        _tell(study, trial, truth.get(tuple(params.values()), 100.0))
    assert len(set(seen)) == 16  # the whole space, each config once
    assert seen.index(("bf16", 512, True)) == 1  # the first move: the batch goes up


def test_running_trials_of_other_workers_are_not_proposed_again():
    study = _study(GuidedSampler(search_space=SPACE, seed=0))
    running, first = _ask(study)  # another worker is still running this one
    trial, second = _ask(study)
    assert second != first


@pytest.mark.parametrize("margin", [-0.1, 1.0])
def test_rejects_a_bad_margin(margin):
    with pytest.raises(ValueError, match="skip_margin"):
        GuidedSampler(search_space=SPACE, skip_margin=margin)


def test_pruned_trials_count_as_measured():
    study = _study(GuidedSampler(search_space=SPACE, seed=0))
    trial, first = _ask(study)
    trial.set_user_attr("throughput", 5.0)
    study.tell(trial, state=TrialState.PRUNED)
    trial, second = _ask(study)
    assert second != first


def test_input_knobs_wait_while_the_incumbent_does_not_wait_for_input():
    space = {**SPACE, "num_workers": CategoricalDistribution([0, 4, 8])}
    study = _study(GuidedSampler(search_space=space, seed=0))
    order = []
    for _ in range(7):
        trial = study.ask()
        params = {name: trial.suggest_categorical(name, dist.choices) for name, dist in space.items()}
        order.append(params)
        trial.set_user_attr("data_wait_fraction", 0.0)  # a GPU-side data pool: nothing to wait for
        _tell(study, trial, 100.0 if len(order) == 1 else 50.0)
    changed = [next(k for k in p if p[k] != order[0][k]) for p in order[1:]]
    # Every compute-side move (3 batches, precision, channels_last) comes before the first workers move;
    # batch 64, past the slower 128, after the other compute knobs.
    assert changed[:5] == ["batch_size", "batch_size", "precision", "channels_last", "batch_size"]
    assert "num_workers" not in changed[:5]


def test_input_knobs_keep_their_place_when_the_incumbent_waits():
    space = {**SPACE, "num_workers": CategoricalDistribution([0, 4, 8])}
    study = _study(GuidedSampler(search_space=space, seed=0, knob_order=("num_workers", "precision")))
    trial = study.ask()
    first = {name: trial.suggest_categorical(name, dist.choices) for name, dist in space.items()}
    trial.set_user_attr("data_wait_fraction", 0.4)  # input-bound
    _tell(study, trial, 100.0)
    trial = study.ask()
    second = {name: trial.suggest_categorical(name, dist.choices) for name, dist in space.items()}
    assert second["num_workers"] != first["num_workers"]


def test_never_proposes_values_that_cannot_run_together():
    from autotune.hardware import Capabilities
    from autotune.search._space import parse_space, restrict_to

    # attention is not searched (the baseline's flash), so the check fills it in from the baseline.
    space = restrict_to(parse_space({"knobs": {"precision": ["fp32", "bf16"], "batch_size": [32, 64],
                                               "channels_last": [False, True]},
                                     "baseline": {"attention": "flash"}}),
                        Capabilities(cuda=False, bf16=True, attention_precision_unavailable={
                            "flash": {"bf16": "no bf16 flash here"}}))
    assert space.size == 4

    def proposals(cannot_run):
        study = _study(GuidedSampler(search_space=space.distributions(), canonical=space.asked_params,
                                     cannot_run=cannot_run, seed=0))
        out = []
        for i in range(space.size):
            trial = study.ask()
            config = space.sample(trial)
            out.append(config)
            trial.set_user_attr("status", "ok")
            trial.set_constraint("failure", 0.0)
            study.tell(trial, 100.0 + i)
        return out

    configs = proposals(space.cannot_run)
    assert all(c.precision == "fp32" and c.attention == "flash" for c in configs)
    assert len({(c.batch_size, c.channels_last) for c in configs}) == space.size  # every config that can run
    assert proposals(None)[0].precision == "bf16"  # without the check the prior point is bf16


FIXED = {"precision": CategoricalDistribution(["fp32", "bf16"]),
         "batch_size": CategoricalDistribution([32, 64, 128, 256, 512]),
         "channels_last": CategoricalDistribution([False, True])}


def _fixed_walk(whole_batch, *, oom_at=None, moves=2, reference_at=None):
    """The batches of the prior point and the next ``moves`` proposals, every move slower than the prior;
    ``oom_at``: a trial (fp32, no channels_last) at that batch ran out of memory first; ``reference_at``:
    the fp32 reference ran at that batch first."""
    study = _study(GuidedSampler(search_space=FIXED, seed=0, whole_batch=whole_batch))
    if reference_at is not None:
        study.enqueue_trial({"precision": "fp32", "batch_size": reference_at, "channels_last": False})
        trial = study.ask()
        for name, dist in FIXED.items():
            trial.suggest_categorical(name, dist.choices)
        trial.set_user_attr("role", "reference")
        _tell(study, trial, 10.0)
    if oom_at is not None:
        study.enqueue_trial({"precision": "fp32", "batch_size": oom_at, "channels_last": False})
        trial = study.ask()
        for name, dist in FIXED.items():
            trial.suggest_categorical(name, dist.choices)
        _tell(study, trial, status="oom")
    batches = []
    for i in range(moves + 1):
        trial = study.ask()
        params = {name: trial.suggest_categorical(name, dist.choices) for name, dist in FIXED.items()}
        batches.append(params["batch_size"])
        _tell(study, trial, 100.0 if i == 0 else 50.0)
    return batches


def test_under_fixed_the_micro_batch_without_accumulation_is_the_first_move():
    # The prior point takes the upper median, 128 (accumulated 4 times into the global batch 512); the
    # first move is 512, no accumulation, ahead of the nearest value up.
    assert _fixed_walk(512) == [128, 512, 256]
    assert _fixed_walk(None) == [128, 256, 64]  # without the rule: nearest first, up before down
    # The global batch among the values, but not the largest: the rule follows it, not the ladder.
    assert _fixed_walk(256)[:2] == [128, 256]


def test_under_fixed_the_prior_point_takes_the_whole_batch_where_the_reference_fitted_it():
    # The fp32 reference trained at the global batch as one micro-batch: that fits, so the prior point,
    # the first trial, takes it; the walk then goes on from there.
    assert _fixed_walk(512, reference_at=512)[0] == 512
    assert _fixed_walk(256, reference_at=512)[0] == 256  # a larger run fitted too
    # A reference at a smaller micro-batch proves nothing about the whole batch: upper median, then 512.
    assert _fixed_walk(512, reference_at=64)[:2] == [128, 512]
    assert _fixed_walk(None, reference_at=512)[0] == 128  # not under fixed: the upper median
    # An out-of-memory at or below the global batch outweighs the reference's fit.
    assert _fixed_walk(512, reference_at=512, oom_at=256)[0] == 128


def test_under_fixed_an_out_of_memory_at_or_below_the_global_batch_makes_accumulation_the_fallback():
    assert _fixed_walk(512, oom_at=64) == [128, 256, 64]  # memory binds: the usual walk
    assert _fixed_walk(512, oom_at=512)[:2] == [128, 256]


def _seen(number, params, value=None, *, oom=False, diagnosis=None):
    from autotune.search._sampler import _Seen

    return _Seen(number=number, params=params, value=value, feasible=value is not None, oom=oom, reference=False,
                 diagnosis=diagnosis)


ALLOCATOR = {"batch_size": CategoricalDistribution([64, 128, 256]),
             "allocator": CategoricalDistribution(["default", "expandable"])}


def _walk(sampler, seen):
    """Every proposal until none is left, each measured slower than the first."""
    out = []
    while (params := sampler.propose(seen, len(seen))) is not None:
        out.append(params)
        seen = [*seen, _seen(len(seen), params, 50.0)]
    return out


def test_expandable_segments_are_not_asked_while_memory_does_not_bind():
    sampler = GuidedSampler(search_space=ALLOCATOR, seed=0)
    assert sampler.prior_point() == {"batch_size": 128, "allocator": "default"}
    walked = _walk(sampler, [_seen(0, {"batch_size": 128, "allocator": "default"}, 100.0)])
    assert walked and all(p["allocator"] == "default" for p in walked)


def test_a_larger_micro_batch_out_of_memory_asks_it_there_first():
    sampler = GuidedSampler(search_space=ALLOCATOR, seed=0)
    seen = [_seen(0, {"batch_size": 128, "allocator": "default"}, 100.0),
            _seen(1, {"batch_size": 256, "allocator": "default"}, oom=True)]
    assert sampler.propose(seen) == {"batch_size": 256, "allocator": "expandable"}
    # The same out-of-memory under expandable segments rules the default allocator out too.
    seen.append(_seen(2, {"batch_size": 256, "allocator": "expandable"}, oom=True))
    assert all(p["batch_size"] < 256 for p in _walk(sampler, seen))


def test_a_memory_bound_incumbent_asks_it_as_a_move():
    sampler = GuidedSampler(search_space=ALLOCATOR, seed=0)
    seen = [_seen(0, {"batch_size": 256, "allocator": "default"}, 100.0, diagnosis="memory-capacity-bound")]
    assert {"batch_size": 256, "allocator": "expandable"} in _walk(sampler, seen)


@pytest.mark.parametrize(("share", "first"), [(1.0, "fp8"), (0.1, "fp16")])
def test_fp8_is_ordered_by_its_predicted_gain(share, first):
    space = {"precision": CategoricalDistribution(["fp32", "fp16", "bf16", "fp8"])}
    sampler = GuidedSampler(search_space=space, seed=0, value_gains={("precision", "fp8"): share})
    assert sampler.prior_point() == {"precision": "bf16"}  # fp8 is a move, never the start
    assert sampler.propose([_seen(0, {"precision": "bf16"}, 100.0)]) == {"precision": first}


def test_a_value_the_space_lacks_does_not_change_the_order_of_the_others():
    # fp8 sits after bf16 in the priors; without it in the space fp16 is still bf16's peer, not a step down.
    space = {"precision": CategoricalDistribution(["fp32", "tf32", "fp16", "bf16"]),
             "channels_last": CategoricalDistribution([False, True])}
    # channels_last first in the order: its step down (gain 1 x 0.25) goes before a down step of precision
    # (1/2 x 0.25), not before fp16 as bf16's peer (1/2).
    sampler = GuidedSampler(search_space=space, seed=0, knob_order=("channels_last", "precision"))
    seen = [_seen(0, {"precision": "bf16", "channels_last": True}, 100.0)]
    assert sampler.propose(seen) == {"precision": "fp16", "channels_last": True}


COMPILE = {"precision": CategoricalDistribution(["fp32", "bf16"]),
           "batch_size": CategoricalDistribution([128, 256, 512]),
           "compile": CategoricalDistribution(["off", "default", "max-autotune-no-cudagraphs"]),
           "cuda_graphs": CategoricalDistribution([False, True])}


@pytest.mark.parametrize(("rates", "bound"), [((100.0, 101.0), "compute-bound"), ((100.0, 190.0), "launch-bound"),
                                              ((100.0, 140.0), None)])
def test_without_a_diagnosis_the_step_time_against_the_batch_names_the_bound(rates, bound):
    # Time per sample constant (throughput flat in the batch): compute-bound; time per step constant
    # (throughput doubles with the batch): launch-bound; in between, nothing said.
    sampler = GuidedSampler(search_space=COMPILE, seed=0)
    prior = sampler.prior_point()
    seen = [_seen(0, prior, rates[0]), _seen(1, {**prior, "batch_size": 512}, rates[1])]
    assert sampler._bottleneck_of(seen, seen[1]) == bound


def test_a_step_that_waits_for_input_is_not_judged_by_its_batch_line():
    from dataclasses import replace

    sampler = GuidedSampler(search_space=COMPILE, seed=0)
    prior = sampler.prior_point()
    seen = [_seen(0, prior, 100.0), replace(_seen(1, {**prior, "batch_size": 512}, 101.0), data_wait=0.1)]
    assert sampler._bottleneck_of(seen, seen[1]) is None


def test_a_compute_bound_step_tries_the_max_autotune_compile_first():
    sampler = GuidedSampler(search_space=COMPILE, seed=0)
    prior = sampler.prior_point()
    assert prior == {"precision": "bf16", "batch_size": 256, "compile": "default", "cuda_graphs": True}
    seen = [_seen(0, prior, 100.0), _seen(1, {**prior, "batch_size": 512}, 101.0)]
    # Compute-bound: the fused kernels before the batch's next value down, precision or graphs off.
    assert sampler.propose(seen) == {**prior, "batch_size": 512, "compile": "max-autotune-no-cudagraphs"}


def test_only_the_top_precision_has_a_peer():
    # From bf16, fp16 is its peer and keeps its gain; from fp16, tf32 is a step down: a check that waits.
    space = {"precision": CategoricalDistribution(["fp32", "tf32", "fp16", "bf16"]),
             "batch_size": CategoricalDistribution([128, 256])}
    sampler = GuidedSampler(search_space=space, seed=0, knob_order=("precision", "batch_size"))
    seen = [_seen(0, {"precision": "bf16", "batch_size": 256}, 90.0),
            _seen(1, {"precision": "fp16", "batch_size": 256}, 100.0)]
    assert sampler.propose(seen) == {"precision": "fp16", "batch_size": 128}
    assert GuidedSampler(search_space=space, seed=0, knob_order=("precision", "batch_size")).propose(
        seen[:1]) == {"precision": "fp16", "batch_size": 256}


def test_after_an_out_of_memory_the_larger_batch_is_retried_with_the_memory_savers():
    space = {"batch_size": CategoricalDistribution([64, 128, 256]),
             "cuda_graphs": CategoricalDistribution([False, True]),
             "cudnn_benchmark": CategoricalDistribution([False, True])}
    sampler = GuidedSampler(search_space=space, seed=0)
    prior = sampler.prior_point()
    assert prior == {"batch_size": 128, "cuda_graphs": True, "cudnn_benchmark": True}
    seen = [_seen(0, prior, 100.0), _seen(1, {**prior, "batch_size": 256}, oom=True)]
    # No graph pool, no cuDNN workspace: the one config at 256 that may fit, before any other move.
    assert sampler.propose(seen) == {"batch_size": 256, "cuda_graphs": False, "cudnn_benchmark": False}


def test_after_a_repaired_prior_point_the_reverted_knobs_come_back_one_at_a_time():
    from autotune.search._sampler import _Seen

    space = {"precision": CategoricalDistribution(["fp32", "bf16"]),
             "batch_size": CategoricalDistribution([64, 128, 256]),
             "channels_last": CategoricalDistribution([False, True]),
             "cuda_graphs": CategoricalDistribution([False, True])}
    sampler = GuidedSampler(search_space=space, seed=0)
    prior = sampler.prior_point()
    assert prior == {"precision": "bf16", "batch_size": 128, "channels_last": True, "cuda_graphs": True}
    failed = _Seen(number=0, params=prior, value=None, feasible=False, oom=False, reference=False, failed=True)
    repaired = sampler.propose([failed])
    assert repaired == {**prior, "channels_last": False, "cuda_graphs": False}  # the later half reverted
    seen = [failed, _seen(1, repaired, 100.0)]
    # The fault is usually one value: channels_last back first, then graphs, before any other move.
    assert sampler.propose(seen) == {**repaired, "channels_last": True}
    seen.append(_seen(2, {**repaired, "channels_last": True}, 90.0))
    assert sampler.propose(seen) == {**repaired, "cuda_graphs": True}
