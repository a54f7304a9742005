"""The answer first: user-style model-zoo scripts under a short budget, and the best known re-measured by hand.

    python -m benchmarks.runners.answer_first_h200 OUT_DIR RUN [RUN ...] [--studies DIR] [--deadline SECONDS]

A RUN is ``WORKLOAD:MINUTES[:STUDY]``; WORKLOAD is ``convnext`` (``benchmarks/workloads/zoo_convnext.py``,
torchvision ConvNeXt-Tiny), ``vit`` (``benchmarks/workloads/zoo_vit.py``, timm ViT-B/32), ``effnet``
(``zoo_effnet.py``, torchvision EfficientNet-B0), all with CPU augmentation in the Dataset, ``bert``
(``zoo_bert.py``, a transformers BERT-base classifier on token sequences masked in the Dataset) or ``vits``
(``zoo_vits.py``, timm ViT-S/16, a Dataset built item by item in Python and augmented at random), each tuned
over ``gpu_default`` as a new user would (``autotune tune FILE:train --budget MINUTES``); ``gpt2``
(``zoo_gpt2_trainer.py``, a transformers GPT-2 trained by the ``Trainer``), tuned through the Trainer
adapter from its own ``TrainingArguments`` as ``docs/trainers.md`` shows (``tuned.tune(train, args=ARGS,
budget=MINUTES)``); or ``demo`` (``autotune demo``; ``demo`` alone keeps its space's own budget). Every run
of one workload shares one studies folder, so a second study of it finds the first's fp32 references
(``--studies``: where those folders go, default OUT_DIR; the study database is copied to
``OUT_DIR/<workload>.db`` after each run). Each run is timed from outside and writes ``OUT_DIR/<study>.json``:
the command, the wall time, the pick, when the first faster config was measured, the plan's decisions, the
time split and the trials.

The best known, by hand: after its study, each config of ``HAND`` for the workload (``vits``, ``gpt2``,
``demo``; ``--hand WORKLOAD=knob:value,...`` replaces them, ``--no-hand`` skips them) is trained as one
isolated trial of autotune's own (the space's trial length, nothing tuned), and the record gains its
throughput and the pick's share: the pick's throughput over the best of the hand configs and of the study's
own full trials that no verdict ruled out (``pick_share``). The record is rewritten after each step, so a call
cut short keeps what it measured; ``--deadline`` (seconds from the start) ends a study still running there and
skips what cannot start in time. ``--tiny`` runs the workloads at their CPU sizes in a two-knob space with
short trials (a check of the runner on a CPU; the numbers mean nothing there).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from benchmarks.runners.budget_h200 import trials

REPO = Path(__file__).resolve().parents[2]
TARGETS = {name: f"benchmarks/workloads/zoo_{name}.py:train" for name in ("convnext", "vit", "effnet", "bert", "vits")}
TARGETS["gpt2"] = "benchmarks/workloads/zoo_gpt2_trainer.py:train"
TARGETS["demo"] = "autotune.demo:train"
# Each workload's global batch (the script's) and its space, for the hand-measured configs.
BATCH = {"vits": 128, "gpt2": 32, "demo": 512}
SPACE = {"gpt2": "hf_trainer", "demo": "demo_gpu"}
# The best known configs, measured by hand after the study (the first compiles, the others mostly hit its
# compile cache): the hand-tuned config of issue 57's ViT-S/16 (bf16, compile, fused AdamW, 8 workers; 3,968
# img/s on an H100) and the same with 14 workers, as its Dataset's augmentation may bind; for the GPT-2, the
# same in what TrainingArguments take, and with the micro-batch the Trainer example's study picked (16 x 2);
# the demo's best of benchmarks/results/answer-first-h200.md (fp16: 6,026 img/s on an H100) and its bf16 twin.
_FAST = "precision:bf16,compile:default,optimizer_impl:fused,pin_memory:true,persistent_workers:true"
HAND = {
    "vits": [f"{_FAST},num_workers:8", f"{_FAST},num_workers:14"],
    "gpt2": [f"{_FAST},num_workers:4", f"{_FAST},num_workers:4,batch_size:16"],
    "demo": ["precision:fp16,channels_last:true,compile:default,cuda_graphs:true,cudnn_benchmark:true",
             "precision:bf16,channels_last:true,compile:default,cuda_graphs:true,cudnn_benchmark:true"],
}
# The Trainer study as docs/trainers.md runs it: from the script's own TrainingArguments.
TRAINER_STUDY = (
    "import sys\n"
    "from autotune.integrations import transformers as tuned\n"
    "from benchmarks.workloads import zoo_gpt2_trainer as script\n"
    "study, studies, minutes, space = sys.argv[1:5]\n"
    "tuned.tune(script.train, args=script.ARGS, budget=float(minutes), study=study, studies_dir=studies, trials=40,\n"
    "           storage=f'sqlite:///{studies}/autotune.db', progress=False, **({'space': space} if space else {}))\n"
)
TINY_SPACE = """\
description: the runner's CPU check (--tiny)
knobs:
  batch_size: [%(batch)d]
  optimizer_impl: [default, fused]
  num_workers: [0, 1]
baseline: {batch_size: %(batch)d}
global_batch: %(batch)d
budget: {samples: %(samples)d, warmup_steps: 2, windows: 3}
"""
TINY_BATCH = 16


def study_attrs(db: Path, study: str, keys: tuple[str, ...]) -> dict[str, Any]:
    import sqlite3

    if not db.exists():
        return {}
    with sqlite3.connect(db) as con:
        rows = con.execute("select a.key, a.value_json from study_user_attributes a join studies s using (study_id) "
                           "where s.study_name = ?", (study,)).fetchall()
    return {k: json.loads(v) for k, v in rows if k in keys}


def verdicts(db: Path, study: str) -> dict[int, Any]:
    """Each trial's accuracy verdict, by trial number."""
    import sqlite3

    if not db.exists():
        return {}
    with sqlite3.connect(db) as con:
        rows = con.execute("select t.number, a.value_json from trials t join studies s using (study_id) "
                           "join trial_user_attributes a using (trial_id) "
                           "where s.study_name = ? and a.key = 'accuracy_verdict'", (study,)).fetchall()
    return {number: json.loads(value) for number, value in rows}


def parse_run(spec: str) -> tuple[str, Optional[str], str]:
    """``WORKLOAD:MINUTES[:STUDY]`` (``demo`` needs no minutes) as (workload, minutes, study)."""
    workload, minutes, study = (spec.split(":") + [None, None])[:3]
    if workload not in TARGETS:
        raise SystemExit(f"{spec}: unknown workload {workload!r} (known: {', '.join(TARGETS)})")
    if not minutes and workload != "demo":
        raise SystemExit(f"{spec}: say the budget, {workload}:MINUTES")
    return workload, minutes or None, study or (f"{workload}-b{minutes}" if minutes else workload)


def study_command(workload: str, minutes: Optional[str], study: str, studies: Path,
                  space: Optional[str]) -> tuple[list[str], str]:
    """The study's command line, and how the record shows it (no path of the machine it ran on)."""
    if workload == "gpt2":
        command = [sys.executable, "-c", TRAINER_STUDY, study, str(studies), str(minutes), space or ""]
        shown = (f"python3 -c 'tuned.tune(zoo_gpt2_trainer.train, args=zoo_gpt2_trainer.ARGS, budget={minutes}, "
                 f"study={study!r}, trials=40, progress=False)'")
        return command, shown
    if workload == "demo":
        command = [sys.executable, "-m", "autotune", "demo", "--study", study]
        command += ["--budget", minutes] if minutes else []
    else:
        command = [sys.executable, "-m", "autotune", "tune", TARGETS[workload], "--study", study, "--budget",
                   str(minutes), "--trials", "40"]
        space = space or "gpu_default"
    command += (["--space", space] if space else []) + ["--studies-dir", str(studies), "--no-progress"]
    shown = " ".join(["python3 -m autotune", *command[3:]]).replace(str(studies), "STUDIES")
    return command, shown


def run_study(command: list[str], left: Optional[float]) -> tuple[int, str, str, bool]:
    """Run a study to its end, or to ``left`` seconds: then SIGTERM (the tuner ends its trial and writes its
    pick), and 30 s later SIGKILL. Its exit code, output, errors, and whether the deadline stopped it."""
    proc = subprocess.Popen(command, cwd=REPO, env=dict(os.environ), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=left)
        return proc.returncode, stdout, stderr, False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        return proc.returncode, stdout, stderr, True


def hand_config(workload: str, spec: str, *, tiny: bool) -> Any:
    """A hand config: ``knob:value,...`` at the workload's global batch (``--tiny``: eager fp32 in the main
    process at the tiny batch, what a CPU runs in seconds)."""
    import yaml

    from autotune import TrialConfig

    batch = TINY_BATCH if tiny else BATCH[workload]
    values: dict[str, Any] = {"batch_size": batch, "global_batch": batch}
    for item in filter(None, spec.split(",")):
        key, _, raw = item.partition(":")
        values[key.strip()] = yaml.safe_load(raw)
    if tiny:
        values.update(precision="fp32", compile="off", cuda_graphs=False, channels_last=False, num_workers=0,
                      pin_memory=False, persistent_workers=False, batch_size=batch, global_batch=batch)
    return TrialConfig(**values)


def measure_hand(workload: str, spec: str, *, space: str, work: Path, left: Optional[float],
                 tiny: bool) -> dict[str, Any]:
    """One hand config, trained as one isolated trial of the space's length; what it measured."""
    from autotune import Budget
    from autotune.search._space import load_space
    from autotune.study._isolation import run_isolated
    from autotune.trial._execute import TrialSpec

    config = hand_config(workload, spec, tiny=tiny)
    row: dict[str, Any] = {"spec": spec, "config": config.describe()}
    if left is not None and left < 60:
        return {**row, "status": "skipped", "error": f"{left:.0f} s left before the deadline"}
    length = load_space(space).budget
    budget = Budget(samples=length.samples, warmup_steps=length.warmup_steps, windows=length.windows)
    target = str(REPO / TARGETS[workload].split(":")[0]) + ":train" if workload != "demo" else TARGETS[workload]
    o = run_isolated(TrialSpec(target, config, budget, baseline_batch_size=config.global_batch_size), workdir=work,
                     timeout=min(600.0, left - 5) if left is not None else 600.0)
    m = o.measurement
    row.update(status=o.status, error=o.error, wall_seconds=round(o.wall_seconds, 1))
    if m is not None:
        row.update(throughput=m.throughput, window_throughputs=list(m.window_throughputs), spread=m.spread,
                   step_ms=m.step_time * 1000, data_wait_fraction=m.data_wait_fraction,
                   compile_seconds=m.compile_seconds, capture_seconds=m.capture_seconds,
                   peak_memory_gib=m.peak_memory_gib, samples=m.samples)
    return row


def best_known(record: dict[str, Any]) -> None:
    """The best of the hand configs and of the study's full trials no verdict ruled out, and the pick's share
    of it (``pick_share``), into ``record``."""
    candidates = [(h["throughput"], f"by hand: {h['config']}") for h in record.get("hand") or []
                  if isinstance(h.get("throughput"), (int, float))]
    measured = [t for t in record["trials"] if t.get("status") == "ok" and isinstance(t.get("throughput"), (int, float))]
    feasible = [t for t in measured if t.get("accuracy_verdict") != "degraded"]
    candidates += [(t["throughput"], f"study trial #{t['number']}{' (' + t['role'] + ')' if t.get('role') else ''}: "
                                     f"{t.get('config')}") for t in feasible]
    record["best_study_trial"] = max((t["throughput"] for t in feasible), default=None)
    record["best_study_trial_any_verdict"] = max((t["throughput"] for t in measured), default=None)
    pick = record["pick"].get("throughput")
    # The pick's own full trial (a race median can differ from it): the share by that measure too.
    own = [t["throughput"] for t in measured if record["pick"].get("config") and t.get("config") == record["pick"]["config"]]
    record["pick_trial_throughput"] = max(own, default=None)
    if candidates:
        rate, source = max(candidates, key=lambda c: c[0])
        record["best_known"] = {"throughput": rate, "source": source}
        record["pick_share"] = round(pick / rate, 4) if isinstance(pick, (int, float)) and rate > 0 else None
        record["pick_trial_share"] = round(max(own) / rate, 4) if own and rate > 0 else None


def environment() -> dict[str, Any]:
    """The versions and the device this call ran with (nothing here initialises CUDA)."""
    from importlib import metadata

    env: dict[str, Any] = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    for name in ("torch", "torchvision", "timm", "transformers", "accelerate", "optuna", "numpy", "pillow"):
        try:
            env[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            env[name] = None
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(handle)
        env["gpu"] = name.decode() if isinstance(name, bytes) else name
        env["driver"] = pynvml.nvmlSystemGetDriverVersion()
        env["driver"] = env["driver"].decode() if isinstance(env["driver"], bytes) else env["driver"]
    except Exception as exc:  # no NVML, no GPU: say so
        env["gpu"] = f"none ({type(exc).__name__})"
    return env


def run(spec: str, out: Path, root: Path, *, hand: Optional[list[str]] = None, deadline: Optional[float] = None,
        tiny_space: Optional[Path] = None) -> dict[str, Any]:
    """One study (and the workload's hand configs after it); ``deadline``: a ``time.monotonic()`` to end by."""
    workload, minutes, study = parse_run(spec)
    studies = root / f"studies-{workload}"
    space = str(tiny_space) if tiny_space is not None else None
    command, shown = study_command(workload, minutes, study, studies, space)
    left = (lambda: deadline - time.monotonic()) if deadline is not None else (lambda: None)
    record: dict[str, Any] = {"run": spec, "command": shown}
    if left() is not None and left() < 60:
        record["skipped"] = f"{left():.0f} s left before the deadline"
        (out / f"{study}.json").write_text(json.dumps(record, indent=1, default=str))
        print(f"{study}: skipped, {record['skipped']}", flush=True)
        return record
    began = time.monotonic()
    code, stdout, stderr, stopped = run_study(command, left())
    wall = time.monotonic() - began
    best_path = studies / study / "best_config.json"
    best = json.loads(best_path.read_text()) if best_path.exists() else {}
    record.update({
        "wall_seconds": round(wall, 1),
        "returncode": code,
        "stopped_at_deadline": stopped,
        "stdout_tail": stdout.splitlines()[-24:],
        "stderr_tail": stderr.splitlines()[-6:],
        "pick": {k: best.get(k) for k in ("config", "throughput", "speedup", "verdict", "speedup_spread", "baseline",
                                          "confirmed", "time_split", "accuracy_verdict", "time_to_first_faster",
                                          "evidence_length")},
        "study": study_attrs(studies / "autotune.db", study, ("plan", "probes", "first_faster", "trial_budget",
                                                              "references_shortened", "references_reused",
                                                              "baseline_speed", "reference_config",
                                                              "baseline_throughput")),
        "trials": trials(studies / "autotune.db", study),
    })
    for number, verdict in verdicts(studies / "autotune.db", study).items():
        for t in record["trials"]:
            if t["number"] == number:
                t["accuracy_verdict"] = verdict
    for probe in record["study"].get("probes") or []:
        probe.pop("extras", None)
    path = out / f"{study}.json"
    best_known(record)
    path.write_text(json.dumps(record, indent=1, default=str))
    if (studies / "autotune.db").exists():
        shutil.copy(studies / "autotune.db", out / f"{workload}.db")
    print(f"{study}: {wall:.0f} s, exit {code}{' (stopped at the deadline)' if stopped else ''}, pick "
          f"{best.get('throughput')} ({best.get('speedup')}x), first faster {best.get('time_to_first_faster')}",
          flush=True)
    specs = HAND.get(workload, []) if hand is None else hand
    for i, hand_spec in enumerate(specs):
        row = measure_hand(workload, hand_spec, space=space or SPACE.get(workload, "gpu_default"),
                           work=out / "hand" / f"{study}-{i}", left=left(), tiny=tiny_space is not None)
        record.setdefault("hand", []).append(row)
        best_known(record)
        path.write_text(json.dumps(record, indent=1, default=str))
        print(f"{study}: by hand {row['config']}: {row['status']} {row.get('throughput') or row.get('error') or ''}; "
              f"pick share {record.get('pick_share')} of {record.get('best_known', {}).get('throughput')}", flush=True)
    return record


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("runs", nargs="+", help="WORKLOAD:MINUTES[:STUDY], or demo")
    parser.add_argument("--studies", type=Path)
    parser.add_argument("--deadline", type=float, metavar="SECONDS",
                        help="end by this many seconds from the start: a study still running is stopped (its pick "
                             "written), and what cannot start with a minute left is skipped")
    parser.add_argument("--hand", action="append", metavar="WORKLOAD=KNOB:VALUE,...",
                        help="a hand config for WORKLOAD, measured after its study (repeat for more; replaces the "
                             "workload's defaults)")
    parser.add_argument("--no-hand", action="store_true", help="measure no hand config")
    parser.add_argument("--tiny", action="store_true", help="the workloads' CPU sizes, a two-knob space (a check)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    deadline = started + args.deadline if args.deadline else None
    args.out.mkdir(parents=True, exist_ok=True)
    for spec in args.runs:
        parse_run(spec)  # refuse a wrong run before anything runs
    given: dict[str, list[str]] = {}
    for item in args.hand or []:
        workload, _, spec = item.partition("=")
        given.setdefault(workload, []).append(spec)
    tiny_space = None
    if args.tiny:
        os.environ["AUTOTUNE_BENCH_SIZE"] = "tiny"  # the trial processes inherit it
        tiny_space = args.out / "space-tiny.yaml"
        tiny_space.write_text(TINY_SPACE % {"batch": TINY_BATCH, "samples": 8 * TINY_BATCH})
    (args.out / "env.json").write_text(json.dumps(environment(), indent=1))
    records = []
    for spec in args.runs:
        workload = parse_run(spec)[0]
        hand = [] if args.no_hand else given.get(workload)
        records.append(run(spec, args.out, args.studies or args.out, hand=hand, deadline=deadline,
                           tiny_space=tiny_space))
    print(f"done in {time.monotonic() - started:.0f} s", flush=True)
    return 0 if all(r.get("returncode") == 0 for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
