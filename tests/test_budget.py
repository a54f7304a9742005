"""The study's budget, the race of the finalists and where the minutes go, in real studies.

The studies replay scripted throughputs (``autotune.search._simulate:replay_train``) in real trial
processes, with the timed windows slept in full, so the study's clock, the cost model and the race see
real seconds; a scripted factor on one run of the baseline stands in for another job loading the machine.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from autotune import TrialConfig, Tuner
from autotune.search._simulate import config_key, replay_env
from autotune.insight._report import format_split
from autotune.study._budget import time_split, trial_parts
from autotune.study._confirm import CLEARLY_SLOWER, clearly_slower, disagreement

optuna.logging.set_verbosity(optuna.logging.WARNING)

REPLAY = "autotune.search._simulate:replay_train"
SPACE = """\
knobs:
  batch_size: [32, 64]
  channels_last: [false, true]
  num_workers: [0, 1, 2, 3]
baseline: {batch_size: 64}
global_batch: 64
budget: {samples: 1024, warmup_steps: 1, windows: 3}
"""
BASE = {"batch_size": 64, "channels_last": False, "num_workers": 0}


# The same space with twice the configs: the replay's num_workers is only a key of the table (no processes),
# so a study on a fast quiet machine still cannot measure it all inside a short budget.
WIDE_WORKERS = tuple(range(8))
SPACE_WIDE = SPACE.replace("num_workers: [0, 1, 2, 3]", f"num_workers: {list(WIDE_WORKERS)}")


def _write_table(tmp_path: Path, rates: dict[str, float], default: float,
                 workers: tuple[int, ...] = (0, 1, 2, 3)) -> Path:
    rows = []
    for batch, last, workers in itertools.product((32, 64), (False, True), workers):
        params = {"batch_size": batch, "channels_last": last, "num_workers": workers}
        rows.append({"params": params, "status": "ok", "throughput": rates.get(config_key(params), default),
                     "accuracy_loss": 0.0})
    path = tmp_path / "table.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _env(tmp_path: Path, rates: dict[str, float], *, default: float = 1000.0, time_scale: float = 1.0,
         script: dict[str, list[float]] | None = None, workers: tuple[int, ...] = (0, 1, 2, 3)) -> dict[str, str]:
    return replay_env(_write_table(tmp_path, rates, default, workers), script=script, state_dir=tmp_path,
                      time_scale=time_scale)


def _tuner(tmp_path: Path, cpu_caps, *, space: str = SPACE, **options) -> Tuner:
    (tmp_path / "space.yaml").write_text(space)
    settings = dict(space=tmp_path / "space.yaml", n_trials=6, storage=f"sqlite:///{tmp_path}/s.db",
                    studies_dir=tmp_path / "studies", progress=False, plots=False, capabilities=cpu_caps,
                    reference_repeats=1, trial_timeout=120, top_k=3, prune_below=None, study_name="b")
    settings.update(options)
    return Tuner(REPLAY, **settings)


def _study(tmp_path: Path) -> optuna.Study:
    return optuna.load_study(study_name="b", storage=f"sqlite:///{tmp_path}/s.db")


def _key(**changes) -> str:
    return config_key({**BASE, **changes})


# -- the budget ----------------------------------------------------------------------------------------


def test_a_study_with_a_short_budget_ends_inside_it_with_a_pick_and_a_split_that_adds_up(tmp_path, cpu_caps,
                                                                                          monkeypatch):
    # 32 configs of about 2-4 s each and a race: far more than 40 s, so the budget, not the space, ends it
    # (16 configs all ran inside 40 s on a quiet 2-core machine).
    for key, value in _env(tmp_path, {_key(num_workers=2): 1400.0, _key(channels_last=True): 1200.0},
                           default=700.0, workers=WIDE_WORKERS).items():
        monkeypatch.setenv(key, value)
    budget = 40.0
    began = time.monotonic()
    result = _tuner(tmp_path, cpu_caps, space=SPACE_WIDE, n_trials=100, budget_minutes=budget / 60).run()
    wall = time.monotonic() - began
    assert 0.75 * budget <= wall <= 1.1 * budget, wall

    doc = json.loads(Path(result.best_config_path).read_text())
    assert doc["config"] is not None and result.best is not None
    assert "confirmed" in doc["confirmed"]
    if not doc["confirmed"]["confirmed"]:
        assert doc["confirmed"]["why"]
    study = _study(tmp_path)
    measured = [t for t in study.trials if t.user_attrs.get("status") == "ok"]
    assert 2 <= len(measured) < 2 * 2 * len(WIDE_WORKERS)  # the budget ended the search before the space did

    split = doc["time_split"]
    assert split == study.user_attrs["time_split"] and split["budget"] == pytest.approx(budget)
    parts = sum(split["parts"].values())
    assert abs(parts - split["wall"]) <= 0.05 * split["wall"], split
    assert split["wall"] <= wall and split["parts"]["timed"] > 0 and split["parts"]["references"] > 0
    assert format_split(split).startswith(f"{split['wall']:.0f} s of a 0.666667-minute budget: references ")
    # The study note and `autotune report` say the same, with the race's line.
    from autotune.insight._report import summary_lines

    note = "\n".join(summary_lines(study, {}))
    assert "Where the minutes went: " in note
    if doc["confirmed"]["confirmed"]:
        assert "Race of the finalists: " in note


def test_a_budget_too_short_for_the_reference_is_refused_in_one_line(tmp_path, cpu_caps, monkeypatch):
    for key, value in _env(tmp_path, {}, default=100.0).items():  # 1024 samples at 100/s: 10 s of windows
        monkeypatch.setenv(key, value)
    from autotune._errors import StudyError

    with pytest.raises(StudyError, match="budget of 0.1 minutes is too short") as info:
        _tuner(tmp_path, cpu_caps, budget_minutes=0.1).run()
    # It names both figures to change: the study's minutes, and the samples every run trains.
    assert "budget.samples is smaller than its 1,024" in str(info.value)


def test_sigint_after_the_first_trial_writes_an_unconfirmed_pick(tmp_path):
    env = {**os.environ, **_env(tmp_path, {_key(num_workers=1): 2000.0}, default=500.0, time_scale=1.0)}
    (tmp_path / "space.yaml").write_text(SPACE)
    studies = tmp_path / "studies"
    proc = subprocess.Popen(
        [sys.executable, "-m", "autotune", "tune", REPLAY, "--space", str(tmp_path / "space.yaml"), "--study", "s",
         "--trials", "30", "--studies-dir", str(studies), "--no-progress", "--no-plots", "--prune-below", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        finished = 0
        while finished < 2 and time.monotonic() < deadline:  # trial 0 is the reference, then one more
            time.sleep(0.5)
            if (studies / "autotune.db").exists():
                with sqlite3.connect(studies / "autotune.db") as db:
                    try:
                        finished = db.execute("select count(*) from trials where state = 'COMPLETE'").fetchone()[0]
                    except sqlite3.OperationalError:
                        finished = 0
        assert finished >= 2
        assert not (studies / "s" / "best_config.json").exists()
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    doc = json.loads((studies / "s" / "best_config.json").read_text())
    assert doc["config"] is not None
    assert doc["confirmed"] == {"confirmed": False, "why": "interrupted by SIGINT (Ctrl-C) before the race confirmed it",
                                "basis": "single runs"}
    assert "the best so far, unconfirmed, is in" in stderr and len(stderr.strip().splitlines()) == 1


# -- the race ------------------------------------------------------------------------------------------


def _race_of_three(tmp_path, cpu_caps, monkeypatch, rates):
    """A study of 1, 2 and 3 workers at ``rates`` (every other config at 500), run and raced: its result and study."""
    for key, value in _env(tmp_path, {_key(num_workers=n): rate for n, rate in zip((1, 2, 3), rates)}, default=500.0,
                           time_scale=0.0).items():
        monkeypatch.setenv(key, value)
    enqueue = [{"num_workers": 1}, {"num_workers": 2}, {"num_workers": 3}]
    return _tuner(tmp_path, cpu_caps, n_trials=4, sampler=_Enqueued(enqueue)).run(), _study(tmp_path)


def test_the_race_stops_early_on_a_clearly_faster_finalist(tmp_path, cpu_caps, monkeypatch):
    result, study = _race_of_three(tmp_path, cpu_caps, monkeypatch, (2000.0, 1750.0, 1700.0))
    race = study.user_attrs["top_k_confirmation"]
    assert race["race"]["ended"].startswith("settled")
    # Round 1: the three finalists and the baseline; the two slower ones drop; round 2: the leader and
    # the baseline's second run. Six runs where a fixed alternation of 3 rounds runs twelve.
    assert len(race["rounds"]) == 2 and race["race"]["runs"] == 6
    assert set(race["race"]["dropped"]) == {str(n) for n in race["trials"] if race["medians"][str(n)] < 1900}
    assert result.best.config.num_workers == 1 and result.faster and result.speedup_rounds == 2
    assert not race["race"]["noisy"] and all("load_1min" in v for load in race["race"]["load"] for v in load.values())


def test_a_config_far_slower_than_the_leader_is_no_finalist_and_its_run_is_not_reserved(tmp_path, cpu_caps, monkeypatch):
    """Of the three fastest, one ran at 1,000 against the leader's 2,000: more than OUT_OF_REACH apart, so it is
    not raced (nor reserved for), while the one at 1,750 is raced and dropped as today."""
    from autotune.study._confirm import OUT_OF_REACH, _entrants, race_seconds

    result, study = _race_of_three(tmp_path, cpu_caps, monkeypatch, (2000.0, 1750.0, 1000.0))
    race = study.user_attrs["top_k_confirmation"]
    number = {t.user_attrs["config"]["num_workers"]: t.number for t in study.trials if t.user_attrs.get("config")}
    assert 2000.0 > OUT_OF_REACH * 1000.0 and 2000.0 < OUT_OF_REACH * 1750.0
    assert race["trials"] == [number[1], number[2]]
    assert all(str(number[3]) not in r for r in race["rounds"])
    assert set(race["race"]["dropped"]) == {str(number[2])} and result.best.config.num_workers == 1
    # The race's reservation during the trials prices the same entrants: the far one is not among them.
    entrants = _entrants(study, 3)[0]
    assert str(number[3]) not in [key for key, _, _ in entrants] and race_seconds(study, 3) > 0


def test_each_round_races_the_leader_and_the_baseline_first_and_the_next_reverses_both_parts():
    """A budget that ends the race inside its first round has measured the pair the speed-up is read from."""
    from autotune.study._confirm import _Race

    config = TrialConfig()
    race = _Race(None, [("4", config, 1800.0), ("1", config, 2000.0), ("7", config, 1900.0), ("baseline", config, 100.0)],
                 "baseline", 3)
    assert race._sequence(0) == ["1", "baseline", "4", "7"]
    assert race._sequence(1) == ["baseline", "1", "7", "4"]
    race.rounds = [{"1": 2000.0, "4": 1800.0, "7": 1900.0, "baseline": 100.0},
                   {"1": 2000.0, "4": 1800.0, "7": 1900.0, "baseline": 100.0}]
    assert race._sequence(2) == ["1", "4", "7"]  # the baseline has its two runs


def test_the_race_keeps_racing_a_tie(tmp_path, cpu_caps, monkeypatch):
    a, b = _key(num_workers=1), _key(num_workers=2)
    for key, value in _env(tmp_path, {a: 1500.0, b: 1500.0}, default=500.0, time_scale=0.0).items():
        monkeypatch.setenv(key, value)
    result = _tuner(tmp_path, cpu_caps, n_trials=3, top_k=2, confirm_rounds=3,
                    sampler=_Enqueued([{"num_workers": 1}, {"num_workers": 2}])).run()
    race = _study(tmp_path).user_attrs["top_k_confirmation"]
    assert race["race"]["dropped"] == {} and len(race["rounds"]) == 3
    tied = [str(n) for n in race["trials"]]
    assert all(r[k] for r in race["rounds"] for k in tied)  # both ran in every round
    assert "the most allowed" in race["race"]["ended"] and "within 10% of each other" in race["race"]["ended"]
    assert sum(1 for r in race["rounds"] if r.get("0") or r.get("baseline")) == 2  # the baseline twice only
    assert result.best.config.num_workers in (1, 2)


def test_a_noisy_baseline_makes_the_speed_up_a_range(tmp_path, cpu_caps, monkeypatch):
    fast = _key(num_workers=1)
    # The baseline's runs: the reference, then the race's; a stand-in load halves its second race run.
    for key, value in _env(tmp_path, {fast: 2000.0}, default=500.0, time_scale=0.0,
                           script={config_key(BASE): [1.0, 1.0, 0.5, 1.0]}).items():
        monkeypatch.setenv(key, value)
    result = _tuner(tmp_path, cpu_caps, n_trials=2, top_k=1,
                    sampler=_Enqueued([{"num_workers": 1}])).run()
    race = _study(tmp_path).user_attrs["top_k_confirmation"]
    assert race["race"]["noisy"] and race["race"]["baseline_disagreement"] == pytest.approx(1.0)
    # Its runs disagreed beyond the threshold, so it ran a third time, in the last round.
    assert [v for v in race["baseline"]["throughputs"] if v] == pytest.approx([500.0, 250.0, 500.0])
    assert result.noisy == pytest.approx(1.0)
    assert (result.speedup_low, result.speedup_high) == (pytest.approx(4.0), pytest.approx(8.0))
    assert result.verdict == "4.00x to 8.00x faster than the baseline"
    assert "the machine was noisy" in result.spread_text
    doc = json.loads(Path(result.best_config_path).read_text())
    assert doc["confirmed"]["noisy"] is True


def _resumed_after_a_loaded_baseline(tmp_path, cpu_caps, monkeypatch, *, loaded: str = "", fast: float = 2000.0,
                                     factor: float = 0.25, top_k: int = 1, resume_top_k: int | None = None):
    """A study whose first run measured one config under a stand-in load (``factor`` of its rate: its first three
    runs, the baseline's reference and race runs unless ``loaded`` names another), then resumed with nothing new
    to run (``resume_top_k``: the resume's --top-k, else ``top_k``): the first run's result and the resumed one's."""
    for key, value in _env(tmp_path, {_key(num_workers=1): fast}, default=500.0, time_scale=0.0,
                           script={loaded or config_key(BASE): [factor] * 3}).items():
        monkeypatch.setenv(key, value)
    first = _tuner(tmp_path, cpu_caps, n_trials=2, top_k=top_k, sampler=_Enqueued([{"num_workers": 1}])).run()
    return first, _tuner(tmp_path, cpu_caps, n_trials=2, top_k=top_k if resume_top_k is None else resume_top_k,
                         sampler=_Enqueued([{"num_workers": 1}])).run()


def test_a_resume_races_the_pick_and_the_baseline_again_rather_than_divide_by_an_earlier_run(tmp_path, cpu_caps,
                                                                                              monkeypatch, capsys):
    """The first run's race paired the pick (2,000/s) with a loaded baseline (125/s): 16x. The resume added
    nothing new, and still races the two again in its own run, beside each other: 4x, with no range reaching
    back to the first run's full trials."""
    from autotune.integrations._summary import print_summary
    from autotune.insight._report import summary_lines

    first, resumed = _resumed_after_a_loaded_baseline(tmp_path, cpu_caps, monkeypatch)
    assert (first.speedup_low, first.speedup_high) == (pytest.approx(16.0), pytest.approx(16.0))
    race = _study(tmp_path).user_attrs["top_k_confirmation"]
    assert [v for v in race["baseline"]["throughputs"] if v] == pytest.approx([500.0, 500.0])
    assert (resumed.speedup_low, resumed.speedup_high) == (pytest.approx(4.0), pytest.approx(4.0))
    assert resumed.verdict.startswith("4.00x faster") and not resumed.noisy
    assert "earlier run" not in resumed.baseline_source
    capsys.readouterr()
    print_summary(resumed, storage=None, studies_dir=str(tmp_path / "studies"))
    printed = capsys.readouterr()
    assert "4.00x" in printed.out + printed.err and "16.00x" not in printed.out + printed.err
    assert "16.00x" not in "\n".join(summary_lines(_study(tmp_path), {}))


def test_a_resume_that_cannot_race_again_says_in_one_line_why_its_speed_up_divides_by_an_earlier_run(
        tmp_path, cpu_caps, monkeypatch, capsys):
    from autotune.integrations._summary import print_summary

    _, resumed = _resumed_after_a_loaded_baseline(tmp_path, cpu_caps, monkeypatch, resume_top_k=0)
    assert resumed.speedup_low == pytest.approx(16.0)  # the first run's race stands, and is said to
    capsys.readouterr()
    print_summary(resumed, storage=None, studies_dir=str(tmp_path / "studies"), top_k=0)
    printed = capsys.readouterr()
    lines = [line for line in (printed.out + printed.err).splitlines() if "earlier run of this study" in line]
    assert len(lines) == 1, printed
    assert "not re-measured beside the pick in this run: --top-k 0" in lines[0]


def test_no_first_faster_trial_beside_a_faster_verdict_says_which_runs_made_it_faster(tmp_path, cpu_caps,
                                                                                     monkeypatch, capsys):
    """The pick's full trial and the first run's race ran under a load (450/s against the baseline's 500/s): no
    full trial's own run beat the baseline's. The resume races them side by side (1,000/s against 500/s): the
    verdict says 2.00x, and the first-faster line says where that came from rather than contradict it."""
    from autotune.integrations._summary import print_summary
    from autotune.insight._report import summary_lines

    first, resumed = _resumed_after_a_loaded_baseline(tmp_path, cpu_caps, monkeypatch, fast=1000.0,
                                                      loaded=_key(num_workers=1), factor=0.45, top_k=2)
    assert not first.faster and resumed.faster and resumed.verdict == "2.00x faster than the baseline"
    capsys.readouterr()
    print_summary(resumed, storage=None, studies_dir=str(tmp_path / "studies"))
    printed = capsys.readouterr().out
    note = "\n".join(summary_lines(_study(tmp_path), {}))
    for text in (printed, note):
        line = next(line for line in text.splitlines() if "First faster config:" in line)
        assert "no feasible full trial's own run beat the baseline's by more than 5%; the pick's speed-up (2.00x " \
               "faster than the baseline) is from per-round ratios" in line, line


def test_the_reports_accuracy_check_cost_and_the_summarys_minutes_are_one_set_of_figures(tmp_path, cpu_caps,
                                                                                         monkeypatch, capsys):
    """After a resume, the report's accuracy-check cost and the summary's "Where the minutes went" state the same
    seconds: the report's came from every run's timestamps and said 269 s of 6.1 min beside the summary's 347 s
    of 809 s."""
    import re

    from autotune.integrations._summary import print_summary
    from autotune.insight._report import summary_lines

    _, resumed = _resumed_after_a_loaded_baseline(tmp_path, cpu_caps, monkeypatch, resume_top_k=0)
    capsys.readouterr()
    print_summary(resumed, storage=None, studies_dir=str(tmp_path / "studies"), top_k=0)
    printed = capsys.readouterr().out
    minutes = next(line for line in printed.splitlines() if line.startswith("Where the minutes went: "))
    wall = re.match(r"Where the minutes went: (\d+) s", minutes).group(1)
    # The resume ran no references: the split leaves a part under half a second out.
    references, share = (re.search(r": references (\d+) s \((\d+%)\)", minutes) or re.match("()()", "")).groups()
    references, share = references or "0", share or "0%"
    cost = next(line for line in summary_lines(_study(tmp_path), {}) if line.startswith("Accuracy check cost: "))
    assert cost.startswith(f"Accuracy check cost: {references} s of fp32 reference runs, {share} of this run's "
                           f"{wall} s"), (cost, minutes)


# -- the decision rules and the split, alone -------------------------------------------------------------


@pytest.mark.parametrize("ratios, dropped", [
    ([0.5], False),               # one measurement is not enough
    ([0.7, 0.85], True),          # slower by more than the threshold twice
    ([0.7, 0.95], False),         # one measurement within the noise
    ([0.99, 1.01, 0.98], False),  # a tie
])
def test_a_finalist_is_dropped_only_when_clearly_slower_in_every_measurement(ratios, dropped):
    assert CLEARLY_SLOWER == 0.10 and clearly_slower(ratios) is dropped


def test_disagreement_and_the_split_of_a_trial():
    assert disagreement([306.0, 1702.0]) == pytest.approx(1702 / 306 - 1) and disagreement([5.0]) == 0.0
    parts = trial_parts({"wall_seconds": 20.0, "compile_seconds": 8.0, "capture_seconds": 1.0, "warmup_seconds": 12.0,
                         "extra:timed_seconds": 5.0})
    assert parts == {"compile": 9.0, "warmup": 3.0, "timed": 5.0, "process": 3.0}
    # The race runs inside the trials' part (the loop runs it when the planner says so): 25 s of trials, 8 of race.
    split = time_split({"references": 10.0, "trials": 33.0, "race": 8.0, "probe": 2.0, "report": 1.0, "setup": 1.0},
                       48.0, [{"wall_seconds": 20.0, "compile_seconds": 8.0, "warmup_seconds": 11.0,
                               "extra:timed_seconds": 5.0}], budget_seconds=60.0)
    assert split["parts"]["coordinator"] == pytest.approx(6.0) and split["unaccounted"] == pytest.approx(1.0)
    assert sum(split["parts"].values()) + split["unaccounted"] == pytest.approx(48.0)


class _Enqueued(optuna.samplers.BaseSampler):
    """Proposes the given knob values in order over the baseline's (then the baseline again)."""

    def __init__(self, configs: list[dict]) -> None:
        self.configs = list(configs)
        self.inner = optuna.samplers.RandomSampler(seed=0)

    def infer_relative_search_space(self, study, trial):
        return {}

    def sample_relative(self, study, trial, search_space):
        return {}

    def sample_independent(self, study, trial, name, distribution):
        index = len([t for t in study.trials if t.user_attrs.get("role") != "reference"]) - 1
        config = {**BASE, **(self.configs[index] if index < len(self.configs) else {})}
        return config[name] if name in config else self.inner.sample_independent(study, trial, name, distribution)
