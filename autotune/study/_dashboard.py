"""What ``autotune dashboard`` serves: optuna-dashboard, told the study's constraints and autotune's best.

optuna-dashboard (0.21) reads a trial's constraints only from Optuna's old list attribute (``constraints``),
while ``trial.set_constraint`` stores each under its own key (``constraints:accuracy``): so every trial looks
feasible there, and its history's best line follows a trial that lost too much accuracy. And for a study of
two objectives it badges the Pareto front of all finished trials as "Best Trial", infeasible ones included.

``serve`` runs optuna-dashboard's own server read-only and for this machine's names only (``guard``), and with
two changes: each trial's constraints reach the page
whatever way Optuna stored them, and the best trials of an autotune study are autotune's one best (the
fastest feasible trial, or the top-K winner), of any other study the Pareto front of its feasible trials
(what Optuna's ``Study.best_trials`` returns for a constrained study).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from optuna.trial import FrozenTrial

from autotune._records import best_of

SPACE_ATTR = "space"  # every study autotune creates has it (see Tuner._create)
READ_METHODS = ("GET", "HEAD")
# Host headers a browser sends for this machine's own pages; any other name is a page of another site that
# its DNS points here (DNS rebinding), and must not read or change the studies.
LOCAL_NAMES = ("localhost", "127.0.0.1", "[::1]")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def dashboard_constraints(trial: FrozenTrial) -> list[float]:
    """The trial's constraint values as optuna-dashboard's page reads them: feasible when all are <= 0.
    JSON has no infinity, so a non-finite value is sent as 1 (infeasible) or -1."""
    out = []
    for value in trial.constraints.values():
        value = float(value)
        out.append(value if math.isfinite(value) else (-1.0 if value < 0 else 1.0))
    return out


def dashboard_best_trials(trials: Sequence[FrozenTrial], study_attrs: dict[str, Any], directions: Sequence[Any],
                          pareto_front: Callable[..., list[FrozenTrial]]) -> list[FrozenTrial]:
    """The trials the dashboard calls best: autotune's best for an autotune study, else the feasible Pareto front."""
    if SPACE_ATTR in study_attrs:
        best = best_of(list(trials), study_attrs)
        return [t for t in trials if best is not None and t.number == best.number]
    feasible = [t for t in trials if all(v <= 0 for v in t.constraints.values())]
    return pareto_front(trials=feasible, directions=directions)


def _patch(storage: Any) -> None:
    from optuna_dashboard import _app, _serializer

    serialize, pareto_front = _serializer.serialize_frozen_trial, _app.get_pareto_front_trials

    def serialize_frozen_trial(study_id: int, trial: FrozenTrial, study_system_attrs: dict[str, Any]) -> dict[str, Any]:
        out = serialize(study_id, trial, study_system_attrs)
        out["constraints"] = dashboard_constraints(trial)
        return out

    studies: dict[int, int] = {}  # trial id -> study id (Optuna 5's storages have no such look-up)

    def study_of(trial: FrozenTrial) -> Optional[int]:
        if trial._trial_id not in studies:
            for study in storage.get_all_studies():
                try:
                    if storage.get_trial_id_from_study_id_trial_number(study._study_id, trial.number) == trial._trial_id:
                        studies[trial._trial_id] = study._study_id
                        break
                except KeyError:  # that study has fewer trials
                    continue
        return studies.get(trial._trial_id)

    def best_trials(*, trials: list[FrozenTrial], directions: Sequence[Any]) -> list[FrozenTrial]:
        study_id = study_of(trials[0]) if trials else None
        attrs = storage.get_study_user_attrs(study_id) if study_id is not None else {}
        return dashboard_best_trials(trials, attrs, directions, pareto_front)

    _serializer.serialize_frozen_trial = serialize_frozen_trial  # serialize_study_detail looks it up here
    _app.get_pareto_front_trials = best_trials  # the study detail's best trials of a multi-objective study


def allowed_hosts(host: str, port: int) -> frozenset[str]:
    """The Host headers ``guard`` accepts for a server bound to ``host``:``port`` (lower case): the bound
    address and the loopback names, with the port (and without it on port 80); on every interface, also this
    machine's host names."""
    import socket

    names = {host.lower(), *LOCAL_NAMES}
    if host in WILDCARD_HOSTS:
        names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
    names = {f"[{n}]" if ":" in n and not n.startswith("[") else n for n in names if n not in WILDCARD_HOSTS}
    return frozenset({f"{n}:{port}" for n in names} | (names if port == 80 else set()))


def guard(app: Callable[..., Any], *, host: str, port: int, allow_edits: bool = False) -> Callable[..., Any]:
    """``app`` (a WSGI application) answering 403 to a Host header that names no address of this server,
    and, unless ``allow_edits``, to every method but GET and HEAD: a page of any site can send requests to
    a local port, and optuna-dashboard's API renames, deletes and tells trials of a study a tuner is running."""
    hosts = allowed_hosts(host, port)

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        name = environ.get("HTTP_HOST", "").strip().lower()
        method = environ.get("REQUEST_METHOD", "GET").upper()
        if name not in hosts:
            why = f"Host {name[:80]!r} is not this dashboard's address (use http://127.0.0.1:{port}/)"
        elif method not in READ_METHODS and not allow_edits:
            why = f"the dashboard is read-only: {method[:16]} refused (start it with --allow-edits to edit studies)"
        else:
            return app(environ, start_response)
        body = f"403 Forbidden: {why}\n".encode()
        start_response("403 Forbidden", [("Content-Type", "text/plain; charset=utf-8"),
                                         ("Content-Length", str(len(body)))])
        return [body]

    return guarded


def dashboard_app(storage: Any, *, host: str, port: int, artifact_dir: Path, allow_edits: bool) -> Callable[..., Any]:
    """optuna-dashboard's WSGI application on ``storage``, patched (see the module doc) and guarded."""
    from optuna.artifacts import FileSystemArtifactStore
    from optuna_dashboard import wsgi

    _patch(storage)
    app = wsgi(storage, artifact_store=FileSystemArtifactStore(str(artifact_dir)))
    return guard(app, host=host, port=port, allow_edits=allow_edits)


def serve(url: str, *, host: str, port: int, artifact_dir: Path, studies_dir: Path, allow_edits: bool = False) -> None:
    """Run optuna-dashboard on the storage at ``url`` until interrupted (see the module doc)."""
    from bottle import run  # the server optuna-dashboard's run_server uses

    from autotune.study._storage import open_storage

    storage, _ = open_storage(url, studies_dir, create=False)  # the command checked it exists; read-only if it must
    run(dashboard_app(storage, host=host, port=port, artifact_dir=artifact_dir, allow_edits=allow_edits),
        host=host, port=port)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``AUTOTUNE_STORAGE=URL python -c 'from autotune.study._dashboard import main; main()' --host H --port P
    --artifact-dir D --studies-dir S [--allow-edits]``: the process ``autotune dashboard`` becomes.

    The URL comes in the environment, not argv (``ps`` shows argv to every user); it is taken out of this
    process's environment, and out of the block ``/proc/PID/environ`` shows, before the server starts.
    """
    import os

    from autotune.study._storage import STORAGE_ENV, scrub_initial_environ

    url = os.environ.pop(STORAGE_ENV, "")
    scrub_initial_environ(STORAGE_ENV)
    parser = argparse.ArgumentParser(prog="autotune dashboard")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--artifact-dir", required=True)
    parser.add_argument("--studies-dir", default="studies")
    parser.add_argument("--allow-edits", action="store_true")
    args = parser.parse_args(argv)
    try:
        serve(url, host=args.host, port=args.port, artifact_dir=Path(args.artifact_dir),
              studies_dir=Path(args.studies_dir), allow_edits=args.allow_edits)
    except KeyboardInterrupt:
        pass
