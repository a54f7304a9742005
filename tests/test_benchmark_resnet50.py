"""The ResNet-50 benchmark's report: the compile break-even it states."""

import optuna
from optuna.distributions import CategoricalDistribution

from benchmarks.runners.resnet50 import _break_even_lines


def _study(compiles: list[tuple[str, float]]) -> optuna.Study:
    study = optuna.create_study(directions=["maximize", "minimize"])
    for mode, seconds in compiles:
        study.add_trial(optuna.trial.create_trial(
            params={"compile": mode}, distributions={"compile": CategoricalDistribution(["off", "default"])},
            values=[1000.0, 0.0], user_attrs={"compile_seconds": seconds}))
    return study


def test_a_best_config_compiled_from_a_warm_cache_also_gets_the_cold_cache_break_even():
    study = _study([("off", 0.0), ("default", 40.0), ("default", 5.0)])
    lines = _break_even_lines(study, 2, [{"role": "best", "compile_seconds": 6.0}], best_rate=2000.0, eager_rate=1000.0)
    # 6 s (the rerun's compile beats the trial's 5 s) at 1/1000 - 1/2000 s saved per sample: 12,000 samples
    assert lines[0].startswith("- break-even: 6 s of compile pays off after 12,000 samples")
    assert lines[1].startswith("- break-even on a cold compile cache: 40 s of compile pays off after 80,000 samples")
    assert lines[1].endswith("(the study's first compile, trial #1)")


def test_the_first_compile_of_the_study_needs_no_second_line():
    study = _study([("off", 0.0), ("default", 40.0)])
    lines = _break_even_lines(study, 1, [], best_rate=2000.0, eager_rate=1000.0)
    assert len(lines) == 1 and "40 s of compile pays off after 80,000 samples" in lines[0]
