"""The study annotation (diagnoses, dashboard notes, plot artifacts) and ``autotune report``, on a real
study: a real Tuner on CPU with trials in real processes, SQLite, optuna-dashboard's note API and Optuna's
artifact store."""

from __future__ import annotations

import sys
import optuna
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState
from optuna_dashboard import get_note, save_note
from PIL import Image

from autotune import ReportError, Tuner
from autotune._config import NO_FASTER_CONFIG
from autotune.insight._diagnose import DATA_WAIT_HIGH, MEMORY_CAPACITY_BOUND, next_step, stored_diagnoses
from autotune.hardware import Capabilities
from autotune.insight._report import (
    ARTIFACT_FILES,
    NOTE_HEADING,
    PLOTS,
    _TrialRef,
    annotate_study,
    study_artifacts,
    write_report,
)
from autotune._records import summarize_study
from test_cli import assert_one_line_error, cli
from workloads import WORKLOADS

# pin_memory=true is removed by the probe on CPU; batch 256 runs out of memory in train_oom_at_256.
SPACE = """\
knobs:
  batch_size: [64, 128, 256]
  channels_last: [false, true]
  pin_memory: [false, true]
batch_policy: scale
budget: {samples: 1024, warmup_steps: 1, windows: 3}
"""
PRUNED_REASON = "pruned: first window ran at 10.0 samples/s, below 900.0"


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict:
    """A study of 4 trials: the reference (bs64), bs256 (out of memory), bs128 and bs64 channels_last, plus a
    PRUNED trial added the way the tuner records one."""
    tmp = tmp_path_factory.mktemp("report")
    (tmp / "space.yaml").write_text(SPACE)
    url = f"sqlite:///{tmp}/studies.db"
    caps = Capabilities(cuda=False, bf16=True, cpu_count=2, compile=True, hostname="test-host", torch="test")
    options = dict(space=tmp / "space.yaml", storage=url, studies_dir=tmp / "studies", progress=False, capabilities=caps,
                   reference_repeats=1, trial_timeout=120, top_k=0, study_name="report-e2e",
                   prune_below=None)  # timing noise on a busy CPU must not prune the enqueued trials
    Tuner(f"{WORKLOADS}:train_oom_at_256", n_trials=1, **options).run()  # trial 0 is the reference run
    study = optuna.load_study(study_name="report-e2e", storage=url)
    for batch, layout in ((256, True), (128, True), (64, True)):
        study.enqueue_trial({"batch_size": batch, "channels_last": layout})
    Tuner(f"{WORKLOADS}:train_oom_at_256", n_trials=4, **options).run()
    study = optuna.load_study(study_name="report-e2e", storage=url)
    study.add_trial(optuna.trial.create_trial(
        state=TrialState.PRUNED,
        params={"batch_size": 128, "channels_last": False},
        distributions={"batch_size": CategoricalDistribution([64, 128, 256]),
                       "channels_last": CategoricalDistribution([False, True])},
        user_attrs={"status": "pruned", "pruned_reason": PRUNED_REASON, "throughput": 10.0,
                    "data_wait_fraction": 0.5, "step_time": 1.0,
                    "config": {**study.trials[0].user_attrs["config"], "batch_size": 128}},
    ))
    return {"url": url, "studies": tmp / "studies", "study": study}


def test_tuner_run_annotates_the_study(made) -> None:
    study = optuna.load_study(study_name="report-e2e", storage=made["url"])
    trials = study.get_trials(states=(TrialState.COMPLETE,))
    assert [t.user_attrs["config"]["batch_size"] for t in trials] == [64, 256, 128, 64]
    assert trials[1].user_attrs["status"] == "oom"
    diagnoses = stored_diagnoses(study)
    assert set(diagnoses) == {0, 1, 2, 3}  # the PRUNED trial came after the last run
    assert diagnoses[1].bottleneck == MEMORY_CAPACITY_BOUND and "Batch 256 (fp32) ran out of memory" in diagnoses[1].evidence
    # The others follow what the trial measured on this CPU: no utilisation is ever claimed.
    for number, at_the_limit in ((0, False), (2, True), (3, False)):
        d, wait = diagnoses[number], trials[number].user_attrs["data_wait_fraction"]
        assert not d.gpu_readings and "busy" not in d.evidence and d.numbers["data_wait_fraction"] == round(wait, 3)
        if wait >= DATA_WAIT_HIGH:
            assert d.label == "input-bound"
        elif at_the_limit:  # bs128 is the largest fp32 batch that fit
            assert d.label == MEMORY_CAPACITY_BOUND and "largest that fit: batch 256" in d.evidence
        else:
            assert d.label == "compute-bound (no GPU readings)" and "utilisation was not measured" in d.evidence
    best = summarize_study(study).best
    assert study.user_attrs["next_step"] == next_step(diagnoses[best.number], best.config.to_dict())

    note = get_note(study)
    assert note.startswith(f"{NOTE_HEADING} report-e2e")
    verdict = (f"verdict: {summarize_study(study).verdict} (from single runs" if summarize_study(study).faster
               else f"verdict: {NO_FASTER_CONFIG}: ")  # top_k=0: single runs, and the note says so
    for text in ("Baseline: `fp32 bs64", "(the fp32 reference run). It comes from the space ", "a single run); " + verdict, "Accuracy check: reference metric", "noise band",
                 "Removed by the capability probe: `pin_memory=true` (", "no CUDA device", "1 oom",
                 "Next step: ", "autotune report report-e2e"):
        assert text in note, text
    assert diagnoses[1].evidence in get_note(_TrialRef(study, trials[1]))

    artifacts = study_artifacts(study)
    assert sorted(a["filename"] for a in artifacts) == sorted(ARTIFACT_FILES)
    store = made["studies"] / "artifacts"  # what `autotune dashboard` serves with --artifact-dir
    for artifact in artifacts:
        assert (store / artifact["artifact_id"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert artifact["mimetype"] == "image/png"


def test_annotating_again_replaces_plots_and_keeps_notes_written_by_hand(made) -> None:
    study = made["study"]
    before = {a["artifact_id"] for a in study_artifacts(study)}
    trial = study.get_trials(states=(TrialState.COMPLETE,))[0]
    save_note(_TrialRef(study, trial), "checked by hand: keep")
    annotation = annotate_study(study, studies_dir=made["studies"])
    assert annotation.note and annotation.skipped == ()
    assert set(annotation.diagnoses) == {0, 1, 2, 3, 4}  # now with the PRUNED trial, from its partial window
    assert annotation.diagnoses[4].label == "input-bound"  # waited 50% in its one window
    after = {a["artifact_id"] for a in study_artifacts(study)}
    assert len(after) == len(ARTIFACT_FILES) and not after & before
    assert {p.name for p in (made["studies"] / "artifacts").iterdir()} == after  # the old files are gone
    assert get_note(_TrialRef(study, trial)) == "checked by hand: keep"


def test_report_command_writes_html_and_pngs(made) -> None:
    proc = cli("report", "report-e2e", "--storage", made["url"], "--studies-dir", made["studies"], cwd=made["studies"])
    assert proc.returncode == 0, proc.stderr
    out = made["studies"] / "report-e2e"
    html = (out / "report.html").read_text()
    assert f"report written to {out / 'report.html'} ({len(PLOTS)} PNGs" in proc.stdout
    for text in ("throughput", "accuracy_loss", "batch_size", "channels_last", "Plotly", MEMORY_CAPACITY_BOUND,
                 PRUNED_REASON, "out of memory", "pin_memory=true", *[title for title, _ in PLOTS.values()]):
        assert text in html, text
    assert html.count('class="plotly-graph-div"') == len(PLOTS)
    assert "not drawn" not in proc.stdout.lower()
    expected = {  # texts drawn on each PNG (kept in its metadata)
        "throughput_by_knob": ["throughput", "batch_size", "channels_last", "64", "256"],
        "pareto_front": ["throughput", "accuracy_loss", "Infeasible Trial"],
        "importances": ["batch_size", "channels_last", "throughput"],
        "history": ["throughput", "out of memory", "pruned"],
    }
    for name, texts in expected.items():
        with Image.open(out / f"{name}.png") as image:
            assert image.format == "PNG" and image.size[0] > 400 and image.size[1] > 300
            drawn = image.text["Description"]
        for text in texts:
            assert text in drawn.split("\n"), (name, text, drawn)


def test_report_of_a_missing_study_is_one_line(made) -> None:
    proc = cli("report", "nope", "--storage", made["url"], cwd=made["studies"])
    assert_one_line_error(proc, "autotune: error:", "no study 'nope'", "report-e2e")


def test_annotation_never_fails_the_study(tmp_path, monkeypatch) -> None:
    bare = optuna.create_study(study_name="bare", storage=f"sqlite:///{tmp_path}/bare.db",
                               directions=["maximize", "minimize"])
    annotation = annotate_study(bare, studies_dir=tmp_path)  # no reference run, no trials
    assert annotation.diagnoses == {} and annotation.artifacts == ()
    assert any("no reference run" in s for s in annotation.skipped)
    # Without the optional extras (as if not installed), what needs them is left out, with the reason.
    monkeypatch.setitem(sys.modules, "optuna_dashboard", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    annotation = annotate_study(bare, studies_dir=tmp_path)
    assert "notes: optuna-dashboard is not installed (pip install 'autotune[dashboard]')" in annotation.skipped
    assert "plots: matplotlib.pyplot is not installed (pip install 'autotune[plots]')" in annotation.skipped


def test_report_without_the_plots_extra_is_a_report_error(made, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "plotly", None)  # as if `autotune[plots]` were not installed
    with pytest.raises(ReportError, match=r"the report needs plotly: pip install 'autotune\[plots\]'"):
        write_report(made["study"], studies_dir=made["studies"])
