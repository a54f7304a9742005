"""The ``autotune`` command. Every AutotuneError becomes one line on stderr and exit code 1."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from autotune._errors import AutotuneError, printable
from autotune.integrations._summary import PASTE_EXTRAS, _paste, print_summary  # noqa: F401 (re-exported)

DEMO_TARGET = "autotune.demo:train"


def _read(text: str, kind: type, what: str) -> Any:
    """``text`` as ``kind``; argparse names the type function in its error otherwise (``_positive_float``)."""
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def _positive_int(text: str) -> int:
    value = _read(text, int, "a positive integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def _positive_float(text: str) -> float:
    value = _read(text, float, "a positive finite number")
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text} is not a positive finite number")
    return value


def _bound(text: str) -> float:
    value = _read(text, float, "a finite number >= 0")
    if not 0 <= value < math.inf:  # nan fails this too
        raise argparse.ArgumentTypeError(f"{text} is not a finite number >= 0")
    return value


def _fraction(text: str) -> float:
    value = _read(text, float, "a fraction in [0, 1)")
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a fraction in [0, 1)")
    return value


def _add_study_options(p: argparse.ArgumentParser, *, trials: int) -> None:
    p.add_argument("--space", help="search space: a YAML path or a name in search_spaces/ (default: by hardware)")
    p.add_argument("--trials", type=_positive_int, default=trials, help=f"trials in the study (default {trials})")
    p.add_argument("--timeout", type=_positive_float, help="stop starting trials after this many seconds")
    p.add_argument("--budget", type=_positive_float, metavar="MINUTES",
                   help="the whole study's minutes (references, trials, the race of the finalists, the report): "
                        "trials run while they and the race fit, and the study always ends with a pick written "
                        "(default: none; the demo's space sets its own)")
    p.add_argument("--study", help="study name (default: the function's name)")
    p.add_argument("--storage", help="Optuna storage URL or journal:PATH (default: the AUTOTUNE_STORAGE environment "
                                     "variable, else sqlite:///studies/autotune.db)")
    _add_storage_file(p)
    p.add_argument("--max-accuracy-loss", type=_bound, default=0.01,
                   help="accuracy loss allowed beyond the reference noise band (default 0.01)")
    p.add_argument("--metric-direction", choices=("maximize", "minimize"), default="maximize")
    p.add_argument("--fresh-references", action="store_true",
                   help="run the fp32 references even where an earlier study of the same target, baseline, length, "
                        "seeds, torch and device kept them (they are reused by default; what the study cannot see, "
                        "such as changed data files, is yours to flag with this)")
    p.add_argument("--reference-loader", choices=("auto", "prior", "baseline"), default="auto",
                   help="the DataLoader knobs the fp32 references run with: prior, the prior point's (the "
                        "references' steps come as fast as the step allows, and the baseline's own speed is "
                        "measured in a short run apart); baseline, the baseline's; auto: prior on a GPU, baseline "
                        "on a CPU (default auto)")
    p.add_argument("--baseline", metavar="KNOB=VALUE,...",
                   help="the untuned config as your script trains it, e.g. batch_size=32,precision=fp32: it "
                        "overrides the space's baseline (knobs not named keep the space's); under the fixed batch "
                        "policy its batch_size is also the global batch")
    p.add_argument("--batch-size", type=_positive_int, metavar="N",
                   help="the global batch your script trains at: the baseline's batch and, under the fixed batch "
                        "policy, the study's global batch (--baseline batch_size=... or the space's global_batch "
                        "win over it; default: the batch_size your script passes to ctx.loader, else the space's)")
    p.add_argument("--batch-policy", choices=("fixed", "scale"),
                   help="fixed: every trial keeps the baseline's global batch (the batch knob is the micro-batch, "
                        "gradients accumulate); scale: the global batch follows the batch knob, judged against fp32 "
                        "at each global batch (default: the space's, else fixed)")
    p.add_argument("--nproc-per-trial", type=_positive_int, metavar="N",
                   help="run each trial as a DDP job of N ranks (one GPU each; gloo on a CPU); the space's DDP knobs "
                        "apply through ctx.ddp (default: the space's processes_per_trial, else 1)")
    p.add_argument("--accuracy-reference", choices=("baseline", "batch"), default="baseline",
                   help="superseded by --batch-policy: 'batch' (fp32 references at each trial's batch size) "
                        "selects --batch-policy scale")
    p.add_argument("--trial-timeout", type=_positive_float, default=600.0, help="seconds per trial (default 600)")
    p.add_argument("--compile-timeout", type=_positive_float, metavar="SECONDS",
                   help="seconds a trial may spend in torch.compile before it ends as compile_timeout "
                        "(default: half the trial timeout)")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--train-minutes", type=_positive_float, metavar="M",
                        help="how long the real training runs: max-autotune compile modes are tried only when "
                             "it pays for their compile (undeclared: they are left out)")
    length.add_argument("--train-steps", type=_positive_int, metavar="N",
                        help="the same as optimizer steps at the baseline's batch size")
    p.add_argument("--memory-limit", type=_positive_float, metavar="GIB",
                   help="CPU only: address space (RLIMIT_AS) a trial may add, so a too-large batch fails as oom; "
                        "threads and DataLoader workers reserve address space too, so too tight a limit fails "
                        "them as oom as well (a cgroup memory limit is better where available)")
    p.add_argument("--confirm-samples", type=_positive_int,
                   help="after the search, train the best config and the reference this long")
    p.add_argument("--top-k", type=int, default=3,
                   help="re-measure the K fastest configs in alternation before declaring the best (0: off)")
    p.add_argument("--prune-below", type=_fraction, default=0.5, metavar="FRACTION",
                   help="stop a trial after its first timed window when it runs below this fraction of the best "
                        "first window so far (default 0.5; 0: never)")
    p.add_argument("--seed", type=int, default=0)
    _add_mps_option(p)
    p.add_argument("--studies-dir", default="studies", help="where outputs go (default studies/)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-plots", action="store_true",
                   help="draw no plots at the end (they take seconds; `autotune report` draws them later)")
    p.add_argument("--grace-period", type=_positive_int, default=60,
                   help="seconds without a heartbeat before another worker's running trial counts as dead (default 60)")


def _add_storage_options(p: argparse.ArgumentParser) -> None:
    """``--storage`` and ``--studies-dir``, for the commands that read a study."""
    p.add_argument("--storage", help="the study's Optuna storage URL or journal:PATH (default: --storage-file, "
                                     "else the AUTOTUNE_STORAGE environment variable, else sqlite:///STUDIES_DIR/autotune.db)")
    _add_storage_file(p)
    p.add_argument("--studies-dir", default="studies",
                   help="the folder tune wrote to: its autotune.db and <study>/best_config.json (default studies/)")


class _Parser(argparse.ArgumentParser):
    """argparse with its errors in one line, like every other autotune error (exit code 2, as argparse's)."""

    def error(self, message: str) -> Any:
        print(f"autotune: error: {self.prog.partition(' ')[2] or self.prog}: {message} (see {self.prog} --help)",
              file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    from autotune import __version__

    parser = _Parser(prog="autotune", description="Find the fastest training config by measuring it.")
    parser.add_argument("--version", action="version", version=f"autotune {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    tune = sub.add_parser("tune", help="tune a training function")
    tune.add_argument("target", metavar="PATH_OR_MODULE:FUNC",
                      help="e.g. examples/cifar_cnn.py:train; the script's own arguments go last, after --: "
                           "autotune tune main.py:train --trials 8 -- --emsize 64 (each trial's sys.argv[1:])")
    _add_study_options(tune, trials=20)
    tune.add_argument("--create-only", action="store_true",
                      help="create the study (and run the fp32 reference) for `autotune worker`s to join")
    tune.add_argument("--gpus", help="run one worker per GPU: a list such as 0,1 or 'all'")
    tune.add_argument("--workers", type=_positive_int, help="run this many worker processes (no GPU pinning)")

    worker = sub.add_parser("worker", help="join an existing study as one more worker")
    worker.add_argument("target", metavar="PATH_OR_MODULE:FUNC")
    worker.add_argument("--study", required=True)
    worker.add_argument("--storage", help="the study's storage URL (postgresql://..., journal:PATH, ...); default: "
                                           "the AUTOTUNE_STORAGE environment variable, which keeps a password out of ps")
    _add_storage_file(worker)
    worker.add_argument("--trial-timeout", type=_positive_float, default=600.0)
    worker.add_argument("--compile-timeout", type=_positive_float, metavar="SECONDS")
    worker.add_argument("--memory-limit", type=_positive_float, metavar="GIB")
    worker.add_argument("--grace-period", type=_positive_int, default=60)
    worker.add_argument("--studies-dir", default="studies")
    worker.add_argument("--no-progress", action="store_true")
    worker.add_argument("--no-plots", action="store_true")
    _add_mps_option(worker)

    demo = sub.add_parser("demo", help="tune the built-in demo workload (small CNN on CPU, ResNet-50 on GPU)")
    _add_study_options(demo, trials=8)

    best = sub.add_parser("best", help="print a study's best config and how to apply it")
    best.add_argument("study", help="the study's name (tune's --study; default there: the function's name)")
    _add_storage_options(best)
    best.add_argument("--format", choices=("text", "json", "yaml"), default="text",
                      help="text: the config and how to apply it, in a few lines (default); json or yaml: the "
                           "whole best_config document")

    report = sub.add_parser("report", help="write studies/<study>/report.html with plots and each trial's diagnosis")
    report.add_argument("study", help="the study's name (tune's --study; default there: the function's name)")
    _add_storage_options(report)
    report.add_argument("--out", metavar="DIR",
                        help="write report.html and its PNGs here (default: the study's folder, studies/<study>/)")

    train = sub.add_parser("train", help="train for real with a study's pick (or a config, or the baseline) and "
                                         "check the study's promise at full length")
    train.add_argument("target", metavar="PATH_OR_MODULE:FUNC",
                       help="the function the study tuned; the script's own arguments go last, after --: autotune "
                            "train main.py:train --study main --steps 2000 -- --lr 0.1 (default: the study's)")
    source = train.add_mutually_exclusive_group()
    source.add_argument("--study", help="train with this study's best_config.json (under --studies-dir)")
    source.add_argument("--config", metavar="PATH", help="train with this best_config.json (or a config file)")
    length = train.add_mutually_exclusive_group(required=True)
    length.add_argument("--epochs", type=_positive_int, help="epochs of ctx.loader")
    length.add_argument("--steps", type=_positive_int, help="optimizer steps")
    length.add_argument("--minutes", type=_positive_float,
                        help="the samples the study's throughput for the config trains in this many minutes")
    train.add_argument("--compare", action="store_true",
                       help="train the baseline too, for the same samples, and compare speed and loss curves")
    train.add_argument("--seed", type=int, default=0, help="ctx.seed (default 0, the study's first fp32 reference)")
    train.add_argument("--metric-direction", choices=("maximize", "minimize"), default="maximize",
                       help="whether a higher reported metric is better (default maximize)")
    train.add_argument("--max-accuracy-loss", type=_bound, default=0.01,
                       help="--compare: the accuracy verdict's bound on the metric's loss (default 0.01)")
    train.add_argument("--studies-dir", default="studies", help="where --study's folder is (default studies)")
    train.add_argument("--out", metavar="DIR", help="where train.json goes (default: the study's folder, "
                                                    "else studies/train)")
    train.add_argument("--no-progress", action="store_true", help="no progress line")

    spaces = sub.add_parser("spaces", help="list the built-in search spaces and validate them (or the given files)")
    spaces.add_argument("paths", nargs="*", metavar="SPACE.yaml",
                        help="search space files to validate (default: the built-in spaces)")

    sim = sub.add_parser("simulate", help="replay search strategies against a table of recorded measurements")
    sim.add_argument("table", metavar="TABLE.jsonl")
    sim.add_argument("--trials", type=_positive_int, default=30, help="trials per run (default 30)")
    sim.add_argument("--seeds", type=_positive_int, default=5, help="runs per strategy, seeds 0..K-1 (default 5)")
    sim.add_argument("--strategies", default="guided,tpe,random",
                     help="comma-separated: guided, guided-flat, tpe, random (default guided,tpe,random)")
    sim.add_argument("--noise", type=float, default=0.0,
                     help="multiply each looked-up throughput by a random factor within +-this (e.g. 0.02)")
    sim.add_argument("--top-k", type=int, default=3, help="top-K re-measurement before the final pick (default 3)")
    sim.add_argument("--max-accuracy-loss", type=_bound, default=0.01)
    sim.add_argument("--probes", action="store_true",
                     help="probe the loader and the step apart when the incumbent waits on its input, as a study "
                          "does (tables that record loader_rate and step_rate)")
    sim.add_argument("--no-diagnosis", action="store_true",
                     help="replay the table without its diagnosis fields (data_wait_fraction, loader_rate, "
                          "step_rate), as a study whose trials record no input wait sees it")
    sim.add_argument("--budget", type=_positive_float, metavar="MINUTES",
                     help="replay whole studies under this budget through the study's planner (references, probes, "
                          "trials, longer evidence, the race), charged at the table's costs, one per seed")
    sim.add_argument("--rules", choices=("current", "before"), default="current",
                     help="with --budget: the planner's rules now, or before its race and evidence rules (default "
                          "current)")
    sim.add_argument("--json", action="store_true", help="print one JSON object instead of a table")

    dash = sub.add_parser("dashboard", help="open optuna-dashboard on a study storage")
    _add_storage_options(dash)
    dash.add_argument("--port", type=int, default=8080, help="port to serve on (default 8080)")
    dash.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, this machine only)")
    dash.add_argument("--allow-edits", action="store_true",
                      help="let the page change studies (rename, delete, tell trials, notes, artifacts); by default "
                           "it is read-only: a study a tuner is running must not change under it")
    return parser


def _add_storage_file(p: argparse.ArgumentParser) -> None:
    p.add_argument("--storage-file", metavar="PATH",
                   help="read the storage URL from this file's first line: a password stays out of ps and shell history")


def _add_mps_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mps", choices=("auto", "on", "off"), default="auto",
                   help="CUDA MPS for trials of mps=true, when the space has it: auto uses a running daemon or "
                        "starts one for the study (stopped when it ends), else measures without; on: fail "
                        "where it cannot start; off: never (default auto)")


# CLI option -> Tuner keyword, for the options a subcommand has (a worker takes the rest from the study).
_TUNER_OPTIONS = {
    "space": "space", "trials": "n_trials", "timeout": "timeout", "budget": "budget_minutes", "max_accuracy_loss": "max_accuracy_loss",
    "metric_direction": "metric_direction", "confirm_samples": "confirm_samples", "seed": "seed", "top_k": "top_k",
    "prune_below": "prune_below", "accuracy_reference": "accuracy_reference", "batch_policy": "batch_policy",
    "compile_timeout": "compile_timeout", "train_minutes": "train_minutes", "train_steps": "train_steps",
    "baseline": "baseline", "nproc_per_trial": "processes_per_trial", "mps": "mps", "batch_size": "batch_size",
    "fresh_references": "fresh_references", "reference_loader": "reference_loader",
    "script_args": "script_args",
}
# The commands that run the script, and so take its own arguments after "--".
_SCRIPT_COMMANDS = ("tune", "worker", "train")


def _tuner(args: argparse.Namespace, target: str, *, mode: str = "tune", storage: Optional[str] = None,
           began: Optional[float] = None) -> Any:
    from autotune.study._tuner import Tuner

    demo = target == DEMO_TARGET
    options = {keyword: getattr(args, option) for option, keyword in _TUNER_OPTIONS.items() if hasattr(args, option)}
    if began is not None:
        options["began"] = began
    try:
        return _make_tuner(Tuner, args, target, demo, mode, storage, options)
    except ValueError as exc:  # an option out of range (the records validate themselves)
        raise AutotuneError(str(exc)) from None


def _make_tuner(Tuner: Any, args: argparse.Namespace, target: str, demo: bool, mode: str, storage: Optional[str],
                options: dict[str, Any]) -> Any:
    return Tuner(
        target,
        default_spaces=("demo_cpu", "demo_gpu") if demo else ("cpu_default", "gpu_default"),
        study_name=args.study if args.study is not None else ("demo" if demo else None),
        storage=storage or args.storage,
        trial_timeout=args.trial_timeout,
        memory_limit_gib=args.memory_limit,
        studies_dir=args.studies_dir,
        progress=not args.no_progress,
        plots=not args.no_plots,
        grace_period=args.grace_period,
        mode=mode,
        **options,
    )


def _tune(args: argparse.Namespace, target: str) -> int:
    began = time.time()  # this run of the study: its workers' race, before the run below, is this run's
    workers = _worker_envs(args)
    if args.create_only or workers:
        storage = args.storage
        if workers and storage is None:
            # Several processes on one SQLite file contend for its lock; a journal file is made for this.
            storage = f"journal:{Path(args.studies_dir) / 'autotune.journal'}"
            print(f"autotune: {len(workers)} workers: using the journal storage {storage}", file=sys.stderr)
        result = _tuner(args, target, mode="create", storage=storage).run()
        if args.create_only:
            import shlex  # the command is pasted: a space or $(...) in a name must not split or run in the shell

            join = shlex.join(["autotune", "worker", target, "--study", result.study_name, "--storage", result.storage])
            print(f"created study {result.study_name} in {result.storage}; join it with: {join}")
            return 0
        _warn_if_workers_share(args, result.study_name, storage, workers)
        _run_workers(args, target, result.study_name, storage, workers)
        if args.gpus:
            os.environ["CUDA_VISIBLE_DEVICES"] = workers[0]["CUDA_VISIBLE_DEVICES"]
        args.storage, args.study = storage, result.study_name
    result = _tuner(args, target, began=began).run()
    print_summary(result, storage=args.storage, studies_dir=args.studies_dir, top_k=args.top_k)
    return 0


def _worker_envs(args: argparse.Namespace) -> list[dict[str, str]]:
    if getattr(args, "gpus", None):
        if args.gpus == "all":
            from autotune.hardware import probe

            count = probe().gpu_count
            if count == 0:
                raise AutotuneError("--gpus all: no CUDA GPU is visible")
            ids = [str(i) for i in range(count)]
        else:
            ids = [g.strip() for g in args.gpus.split(",") if g.strip()]
            if not ids or not all(g.isdigit() for g in ids):
                raise AutotuneError(f"--gpus {args.gpus}: expected a list of GPU indices such as 0,1, or 'all'")
        return [{"CUDA_VISIBLE_DEVICES": g} for g in ids]
    return [{} for _ in range(getattr(args, "workers", None) or 0)]


def _warn_if_workers_share(args: argparse.Namespace, study_name: str, storage: str, envs: list[dict[str, str]]) -> None:
    """One warning line, also recorded in the study, when the workers about to start share what they measure."""
    import socket
    from collections import Counter

    from autotune._records import COLOCATION
    from autotune.study._workers import SHARING_CHECKED_ENV

    for env in envs:
        env[SHARING_CHECKED_ENV] = "1"  # the workers need not find out again, each in its own words
    if len(envs) < 2:
        return
    host = socket.gethostname()
    if getattr(args, "gpus", None):
        twice = sorted(g for g, n in Counter(e["CUDA_VISIBLE_DEVICES"] for e in envs).items() if n > 1)
        if not twice:
            return
        line = (f"--gpus {args.gpus} gives GPU {', '.join(twice)} to more than one worker on host {host}: their "
                "trials slow each other, so their throughputs are not comparable; list each GPU once")
    else:
        line = (f"{len(envs)} workers on host {host} share its GPU and CPU cores (--workers pins neither): their "
                "trials slow each other, so their throughputs are not comparable; use --gpus to give each worker "
                "its own GPU, or run one worker per host")
    import optuna

    from autotune.study._storage import open_storage

    opened, _ = open_storage(storage, Path(args.studies_dir), grace_period=args.grace_period)
    optuna.load_study(study_name=study_name, storage=opened).set_user_attr(COLOCATION, line)
    print(f"autotune: warning: {line}", file=sys.stderr, flush=True)


def _run_workers(args: argparse.Namespace, target: str, study: str, storage: str, envs: list[dict[str, str]]) -> None:
    import subprocess

    from autotune.study._storage import STORAGE_ENV

    # The URL goes through a pipe on each worker's stdin: argv is readable by every user via ps, and the
    # environment a process started with by every process of the user (/proc/PID/environ), trials included.
    command = [sys.executable, "-m", "autotune", "worker", target, "--study", study, "--storage-file", "/dev/stdin",
               "--trial-timeout", str(args.trial_timeout), "--grace-period", str(args.grace_period),
               "--studies-dir", args.studies_dir, "--no-progress"]
    if args.memory_limit:
        command += ["--memory-limit", str(args.memory_limit)]
    if args.no_plots:
        command += ["--no-plots"]
    if args.compile_timeout:
        command += ["--compile-timeout", str(args.compile_timeout)]
    if args.script_args:
        command += ["--", *args.script_args]  # each worker's trials get the script's own arguments too
    from autotune.study._signals import PARENT_ENV, Interrupted, track_child

    # Their own session: a Ctrl-C in the terminal reaches this process only, which passes it on once.
    parent = {PARENT_ENV: str(os.getpid())}
    base = {k: v for k, v in os.environ.items() if k != STORAGE_ENV}
    procs = []
    for env in envs:
        proc = subprocess.Popen(command, env={**base, **env, **parent}, start_new_session=True, stdin=subprocess.PIPE)
        assert proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # a worker that died at once says so by its exit code
            proc.stdin.write(storage.encode() + b"\n")
            proc.stdin.close()
        procs.append(proc)
    for p in procs:
        track_child(p.pid)
    try:
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt as exc:
        import signal

        forward = exc.signum if isinstance(exc, Interrupted) else signal.SIGTERM
        for p in procs:
            if p.poll() is None:
                p.send_signal(forward)  # each records its running trial as interrupted, then exits
        deadline = time.monotonic() + 10
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        raise
    if any(codes):
        print(f"autotune: warning: worker exit codes {codes}", file=sys.stderr)


def _worker(args: argparse.Namespace) -> int:
    from autotune.study._storage import STORAGE_ENV

    if not args.storage:
        raise AutotuneError(f"autotune worker needs --storage URL (or the {STORAGE_ENV} environment variable)")

    from autotune.study._signals import die_with_parent

    die_with_parent()  # started by `autotune tune --workers/--gpus`: never outlive it
    result = _tuner(args, args.target, mode="join").run()
    best = result.best
    print(f"worker done: study {result.study_name}, best so far "
          + (f"{best.throughput:,.1f}/s ({best.config.describe()})" if best else "none"))
    return 0


def _best(args: argparse.Namespace) -> int:
    from autotune._api import load_study_result
    from autotune._records import study_dir
    from autotune.study._results import best_config_document, written_at

    study, result = load_study_result(args.study, storage=args.storage, studies_dir=args.studies_dir)
    path = study_dir(study.study_name, Path(args.studies_dir)) / "best_config.json"
    doc = best_config_document(study, result, written=written_at(path))
    paste = _paste(doc)
    if paste:
        doc["paste"] = {paste[0]: paste[1]}
    doc = _finite(doc)
    if args.format == "text":
        print("\n".join(best_summary(doc, path)))
    elif args.format == "yaml":
        import yaml

        print(yaml.safe_dump(doc, sort_keys=False), end="")
    else:
        print(json.dumps(doc, indent=2, default=str))
    return 0 if result.best is not None else 1


def best_summary(doc: dict[str, Any], path: Path) -> list[str]:
    """``autotune best``'s lines: the config, what it changes, its verdict and how to apply it."""
    import shlex  # the commands in these lines are pasted: a space or $(...) in a name must not split or run

    study = doc["study"]
    if doc.get("config") is None:
        why = doc.get("why_none") or ""
        return [f"Study {study}: {why or 'no feasible config was found'}; see the trials' failures in "
                f"`autotune report {shlex.quote(str(study))}`."]
    base = (doc.get("baseline") or {}).get("config") or {}
    changed = [f"{k}: {base.get(k)} -> {v}" for k, v in doc["config"].items() if base.get(k) != v]
    if doc.get("keep_baseline"):
        # Nothing beat the baseline: the document's config is the baseline, and no slower one is offered.
        other = doc.get("not_recommended") or {}
        measured = (f"; the fastest other, trial #{other.get('trial')}, is not recommended: {other.get('why')}"
                    if other else "; the pick is the baseline itself")
        lines = [f"Study {study}: {doc.get('verdict')}: keep the baseline{measured}",
                 "Changes: none (keep the baseline: train as your script does)"]
    else:
        lines = [f"Study {study}, trial #{doc['trial']}: {doc.get('verdict')}",
                 "Changes: " + ("; ".join(changed) if changed else "none (the baseline is the best)")]
    policy = doc.get("batch_policy") or {}
    if policy:
        lines.append(f"Batch: global {policy.get('global_batch')} = micro-batch {policy.get('micro_batch')} x "
                     f"{policy.get('accumulation_steps')} accumulated (policy {policy.get('policy')})")
    packing = doc.get("packing") or {}
    if packing.get("processes_per_gpu", 1) > 1 or packing.get("mps"):
        lines.append(f"Packing: {packing['what']}")
    if doc.get("input_pipeline"):
        lines.append(f"Input pipeline: {doc['input_pipeline']}")
    float8 = doc.get("float8") or {}
    if float8:
        converted = float8.get("converted")
        layers = ""
        if isinstance(converted, list):
            more = ", ..." if len(converted) > 6 else ""
            layers = f" (the trial converted {len(converted)} layers: {', '.join(converted[:6])}{more})"
        lines.append(f"Float8: {float8['what']}{layers}")
    allocator = doc.get("allocator") or {}
    if allocator.get("env"):
        lines.append(f"Allocator: {allocator['what']}")
    confirmed = doc.get("confirmed") or {}
    if not confirmed.get("confirmed"):
        lines.append(f"Not confirmed: {confirmed.get('why')}")
    check = doc.get("accuracy_check") or {}
    reasons = "; ".join(str(r) for r in check.get("reasons") or [])
    if check.get("blind"):  # the summary says it: so must the command that prints the pick later
        lines.append("Accuracy check: blind, nothing vouches for the pick's accuracy" + (f": {reasons}" if reasons
                                                                                          else ""))
    elif check.get("partly_blind"):
        lines.append(f"Accuracy check: part of it is blind ({reasons}); the verdict rests on the other part")
    if doc.get("keep_baseline"):
        lines.append("Apply it: nothing to change; autotune.load_best(" + repr(str(path)) + ") gives the baseline "
                     "back, and the adapters' arguments from it are your own")
    else:
        lines.append("Apply it: ctx = autotune.TrialContext(config=autotune.load_best(" + repr(str(path)) + ")) and "
                     "train as in the study (ctx.model, ctx.optimizer, ctx.loader, ctx.train_step)")
    if doc.get("paste"):
        kind, arguments = next(iter(doc["paste"].items()))
        lines.append(f"Or paste into {kind}: " + ", ".join(f"{k}={v!r}" for k, v in arguments.items()))
    lines.append(f"Written {doc.get('written') or 'never (no best_config.json yet)'}; the whole document: "
                 f"autotune best {shlex.quote(str(study))} --format json")  # quoted: the line is pasted
    return lines


def _report(args: argparse.Namespace) -> int:
    from autotune._api import load_study_result
    from autotune.insight._report import write_report

    study, _ = load_study_result(args.study, storage=args.storage, studies_dir=args.studies_dir)
    report = write_report(study, studies_dir=args.studies_dir, out_dir=Path(args.out) if args.out else None)
    print(f"report written to {report.html} ({len(report.pngs)} PNGs beside it)")
    for name, why in report.skipped.items():
        print(f"  not drawn: {name}: {why}")
    return 0


def _finite(value: Any) -> Any:
    """JSON has no infinity: write a failed trial's inf accuracy loss as the string "inf"."""
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _spaces(args: argparse.Namespace) -> int:
    from autotune._errors import one_line
    from autotune.search._space import SPACES_DIR, builtin_spaces, load_space

    paths = [Path(p) for p in args.paths] or builtin_spaces()
    if not paths:
        raise AutotuneError(f"no built-in search spaces in {SPACES_DIR}: this installation of autotune is "
                            "incomplete (its wheel ships them as package data); reinstall it")
    failed = 0
    for path in paths:
        try:
            space = load_space(path)
        except AutotuneError as exc:
            print(f"invalid  {one_line(str(exc))}", file=sys.stderr)  # it may quote a value of any size
            failed += 1
            continue
        policy = f"fixed at global batch {space.global_batch}" if space.batch_policy == "fixed" else "scale"
        if space.processes_per_trial > 1:
            policy += f"; {space.processes_per_trial} processes per trial"
        print(f"ok       {path}  ({len(space.knobs)} knobs, {space.size} configs, batch policy {policy})  "
                  f"{printable(_shortened(space.description))}")
    return 1 if failed else 0


DESCRIPTION_CHARS = 200  # of a space's description in `autotune spaces`: its first line, cut here


def _shortened(text: str, limit: int = DESCRIPTION_CHARS) -> str:
    """The first line of ``text``, cut to ``limit`` characters (with how much was left out)."""
    lines = text.strip().splitlines() or [""]
    first = lines[0]
    if len(first) <= limit and len(lines) == 1:
        return first
    left = len(text.strip()) - min(len(first), limit)
    return f"{first[:limit].rstrip()}... ({left:,} more characters)"


def _simulate_studies(table: Any, args: argparse.Namespace) -> int:
    """``autotune simulate TABLE --budget MINUTES``: whole studies replayed, one per seed (``study/_replay``)."""
    from autotune.study._replay import replay_studies

    document = replay_studies(table, budget_minutes=args.budget, seeds=args.seeds, noise=args.noise, top_k=args.top_k,
                              n_trials=args.trials, max_accuracy_loss=args.max_accuracy_loss, rules=args.rules)
    if args.json:
        print(json.dumps(document))
        return 0
    from rich.table import Table

    from autotune.study._progress import make_console

    out = Table(title=f"{table.name}: whole studies under --budget {args.budget:g} ({args.rules} rules)",
                caption=f"pick share: median {document['pick_share_median']:.3f}, worst "
                        f"{document['pick_share_worst']:.3f}; noise +-{args.noise:g}")
    for column in ("seed", "pick", "share", "verdict", "first faster starts", "wall"):
        out.add_column(column)
    for run in document["runs"]:
        first = run["first_faster_start_s"]
        out.add_row(str(run["seed"]), ", ".join(f"{k}={v}" for k, v in (run["pick"] or {}).items()) or "-",
                    f"{run['pick_share']:.3f}", run["pick_verdict"],
                    "never" if first is None else f"{first:.0f} s ({first / (args.budget * 60):.0%})",
                    f"{run['seconds']:.0f} s")
    make_console().print(out)
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from autotune.search._simulate import ReplayTable, simulate, summaries_document

    if not 0 <= args.noise < 1:
        raise AutotuneError(f"--noise {args.noise}: expected a fraction in [0, 1)")
    table = ReplayTable.load(args.table)
    if args.no_diagnosis:
        table = table.without_diagnosis()
    if args.budget is not None:
        return _simulate_studies(table, args)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    summaries = simulate(table, strategies=strategies, trials=args.trials, seeds=args.seeds, noise=args.noise,
                         top_k=args.top_k, max_accuracy_loss=args.max_accuracy_loss, probes=args.probes)
    settings = {"trials": args.trials, "seeds": args.seeds, "noise": args.noise, "top_k": args.top_k,
                "max_accuracy_loss": args.max_accuracy_loss, "probes": args.probes,
                "diagnosis": not args.no_diagnosis}
    if args.json:
        print(json.dumps(summaries_document(table, summaries, **settings)))
        return 0
    from rich.table import Table

    from autotune.study._progress import make_console

    best = table.best(args.max_accuracy_loss)
    out = Table(title=f"{table.name}: {len(table)} rows of {table.size} configs; best {best.throughput:,.1f}/s",
                caption=f"{args.trials} trials, {args.seeds} seeds, noise +-{args.noise:g}"
                        + ("; loader probes as a study runs them" if args.probes else "")
                        + ("; diagnosis fields removed" if args.no_diagnosis else "") + "; "
                        f"a run that never reaches 95% counts as {args.trials + 1}"
                        + ("" if table.has_seconds else "; the table records no trial_seconds: no minutes"))
    for column in ("strategy", "trials to 95% (median)", "(worst)", "minutes to 95% (median)", "(worst)",
                   f"best fraction after {args.trials}"):
        out.add_column(column, justify="left" if column == "strategy" else "right")
    for s in summaries:
        minutes = [f"{m:.1f}" if m is not None else "-" for m in (s.minutes_to_95_median, s.minutes_to_95_worst)]
        out.add_row(s.strategy, f"{s.trials_to_95_median:g}", str(s.trials_to_95_worst), *minutes,
                    f"{s.best_fraction_median:.3f}")
    console = make_console()
    console.print(out)
    error = table.prediction_error()
    if error is not None:
        console.print(error.describe().capitalize())
    return 0


def _dashboard(args: argparse.Namespace) -> int:
    import importlib.util

    from autotune.study._storage import default_storage_url, mask_url, open_storage, sqlite_path

    url = args.storage or default_storage_url(Path(args.studies_dir))
    if url.startswith("sqlite:///") and not sqlite_path(url).exists():
        raise AutotuneError(f"no study database at {sqlite_path(url)}; run `autotune demo` or `autotune tune` first")
    # Refuses unknown schemes, unreachable servers and torn journals in one line; creates nothing.
    storage, _ = open_storage(url, Path(args.studies_dir), create=False)
    if importlib.util.find_spec("optuna_dashboard") is None:
        raise AutotuneError("optuna-dashboard is not installed; pip install 'autotune[dashboard]'")
    host, family, address = _bind_address(args.host, args.port)
    reach = _reach(address)
    if reach:
        what = "which can edit studies (--allow-edits)" if args.allow_edits else "read-only"
        print(f"autotune: warning: binding to {args.host or repr(args.host)} ({address}) exposes the dashboard, "
              f"{what}, to {reach}", file=sys.stderr)
    import socket

    try:  # a port in use would end in optuna-dashboard's traceback, after the exec
        with socket.socket(family) as probe:
            probe.bind((address, args.port))
    except OSError as exc:
        raise AutotuneError(f"cannot listen on {address}:{args.port} ({exc.strerror}); pick another --port") from None
    args.host = address
    artifacts = Path(args.studies_dir) / "artifacts"
    try:
        artifacts.mkdir(parents=True, exist_ok=True)
    except OSError:  # a studies folder it may not write (a read-only mount) has no plots to serve: none, then
        import tempfile

        artifacts = Path(tempfile.mkdtemp(prefix="autotune-artifacts-"))
    mode = "edits allowed" if args.allow_edits else "read-only; --allow-edits to edit studies"
    shown = f"[{args.host}]" if ":" in args.host else args.host
    print(f"optuna-dashboard on http://{shown}:{args.port}/ for {mask_url(url)} ({mode}; Ctrl-C to stop)",
          flush=True)
    if url.startswith("journal:"):
        # optuna-dashboard cannot guess a storage from "journal:PATH": give it the storage object, which
        # also refuses a torn journal and never appends after one (the dashboard writes notes).
        return _serve_dashboard(storage, args.host, args.port, artifacts, allow_edits=args.allow_edits)
    # optuna-dashboard's own server, told the study's constraints and autotune's best (study/_dashboard). The
    # URL goes in the environment, which only the user's own processes can read (and the new process scrubs),
    # never in argv, which `ps` shows to every user for as long as the dashboard runs.
    from autotune.study._storage import STORAGE_ENV

    command = [sys.executable, "-c", "from autotune.study._dashboard import main; main()",
               "--host", args.host, "--port", str(args.port), "--artifact-dir", str(artifacts),
               "--studies-dir", str(args.studies_dir), *(["--allow-edits"] if args.allow_edits else [])]
    sys.stdout.flush()
    os.execve(sys.executable, command, {**os.environ, STORAGE_ENV: url})  # become the dashboard: signals reach it
    return 0


def _bind_address(host: str, port: int) -> tuple[str, int, str]:
    """``--host`` as given (brackets dropped), its address family, and the address it binds: a name, "" or
    a short form such as ``0`` is resolved as the server will resolve it.

    Raises:
        AutotuneError: the host resolves to no address.
    """
    import socket

    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        infos = socket.getaddrinfo(bare or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise AutotuneError(f"--host {host!r}: no address by that name ({getattr(exc, 'strerror', None) or exc}); "
                            "use 127.0.0.1, or a name or address of this machine") from None
    family, _, _, _, sockaddr = infos[0]
    return bare, family, str(sockaddr[0])


def _reach(address: str) -> str:
    """Who else can reach a server bound to ``address`` ("" for this machine only)."""
    import ipaddress

    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if ip.is_loopback:
        return ""
    if ip.is_unspecified:
        return "every network this machine is on"
    return f"the networks that reach {address}"


def _serve_dashboard(storage: Any, host: str, port: int, artifacts: Path, *, allow_edits: bool) -> int:
    """Serve optuna-dashboard for a storage object in this process, a thread per request, until Ctrl-C."""
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    from autotune.study._dashboard import dashboard_app

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True

    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
            pass

    app = dashboard_app(storage, host=host, port=port, artifact_dir=artifacts, allow_edits=allow_edits)
    try:
        httpd = make_server(host, port, app, server_class=Server, handler_class=Quiet)
    except OSError as exc:
        raise AutotuneError(f"cannot serve the dashboard on {host}:{port}: {exc.strerror or exc}") from None
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
    return 0


def _resolve_storage(args: argparse.Namespace) -> None:
    """Set ``args.storage`` from ``--storage``, ``--storage-file`` or ``AUTOTUNE_STORAGE`` (``storage_from``), and
    take the variable out of this process's environment: trials, and the forkserver that starts them,
    inherit the environment, and their ``/proc/PID/environ`` is readable by the user's other processes."""
    from autotune.study._storage import STORAGE_ENV, scrub_initial_environ, storage_from

    args.storage = storage_from(args.storage, getattr(args, "storage_file", None))
    if os.environ.pop(STORAGE_ENV, None) is not None:
        scrub_initial_environ(STORAGE_ENV)  # /proc/PID/environ shows the block this process started with


def _split_script_args(argv: Sequence[str]) -> tuple[list[str], Optional[list[str]]]:
    """autotune's own arguments, and the script's after the first ``--`` (None without one)."""
    argv = list(argv)
    if "--" not in argv:
        return argv, None
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def main(argv: Optional[Sequence[str]] = None) -> int:
    own, script_args = _split_script_args(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(own)
    if script_args is not None and args.command not in _SCRIPT_COMMANDS:
        parser.error(f"arguments after -- are the script's, which only {', '.join(_SCRIPT_COMMANDS)} run")
    # A trial process is started with its coordinator's sys.argv, which here is autotune's own: the script gets
    # the arguments after -- instead, or none. train without -- reuses those its study was tuned with.
    args.script_args = (script_args if args.command == "train" else (script_args or [])) \
        if args.command in _SCRIPT_COMMANDS else None
    import optuna

    from autotune._errors import one_line  # printable, and bounded: an error may quote a value of any size
    from autotune.study import _signals

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    restore = None
    if args.command in ("tune", "demo", "worker"):
        restore = _signals.install()  # Ctrl-C and SIGTERM end the trial and record it; a second one kills at once
        if argv is None:
            restore = None  # the process's own entry point: keep them through exit, when a Ctrl-C may still come
    try:
        if hasattr(args, "storage"):
            _resolve_storage(args)
        if args.command == "tune":
            return _tune(args, args.target)
        if args.command == "demo":
            args.create_only, args.gpus, args.workers = False, None, None
            return _tune(args, DEMO_TARGET)
        if args.command == "worker":
            return _worker(args)
        if args.command == "best":
            return _best(args)
        if args.command == "report":
            return _report(args)
        if args.command == "train":
            from autotune.study._train import train

            own, sys.argv = sys.argv, sys.argv[:1]  # autotune's options are not the script's: without -- and a
            try:  # study that recorded its arguments, the script gets none
                done = train(args.target, config=args.config, study=args.study, epochs=args.epochs,
                             steps=args.steps, minutes=args.minutes, compare=args.compare, seed=args.seed,
                             studies_dir=args.studies_dir, out=args.out, metric_direction=args.metric_direction,
                             max_accuracy_loss=args.max_accuracy_loss, progress=not args.no_progress,
                             args=args.script_args)
            finally:
                sys.argv = own
            return 130 if done.interrupted else 0 if all(r.status in ("ok",) for r in done.runs.values()) else 1
        if args.command == "spaces":
            return _spaces(args)
        if args.command == "dashboard":
            return _dashboard(args)
        if args.command == "simulate":
            return _simulate(args)
    except AutotuneError as exc:
        print(f"autotune: error: {one_line(str(exc))}", file=sys.stderr)  # it may quote a trial's exception
        return 1
    except OSError as exc:  # a folder that cannot be written (read-only, a file in the way, a full disk)
        import errno

        where = f"{exc.filename}: " if exc.filename else ""
        full = ("; the disk is full: free space on it, then rerun the same command to resume"
                if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "")
        print(f"autotune: error: {one_line(f'{where}{exc.strerror or exc}{full}')}", file=sys.stderr)
        return 1
    except Exception as exc:  # a storage on a full disk or a damaged file fails deep inside Optuna
        from autotune.study._storage import default_storage_url, storage_failure

        url = getattr(args, "storage", None)
        if url is None and getattr(args, "studies_dir", None) is not None:
            url = default_storage_url(Path(args.studies_dir))  # the default storage's file, named in the line
        failure = storage_failure(exc, url)
        if failure is None:
            raise
        print(f"autotune: error: {one_line(str(failure))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        _signals.settled()  # the loop has recorded the trial: a Ctrl-C from here on only ends the exit
        reason = exc.reason if isinstance(exc, _signals.Interrupted) else "KeyboardInterrupt"
        if not os.environ.get(_signals.PARENT_ENV):  # a worker's parent says it once for all
            written = getattr(exc, "best_config_path", None)
            best = f"; the best so far, unconfirmed, is in {written}" if written else ""
            print(f"autotune: interrupted by {reason}; a trial that had not finished is recorded as FAIL "
                  f"(interrupted) and the study keeps every finished one{best}: rerun the same command to resume",
                  file=sys.stderr)
        return _signals.exit_code(exc)
    finally:
        if restore is not None:
            restore()
    raise AssertionError(args.command)
