"""Where studies live: storage URLs (SQLite by default, any Optuna URL accepted) and output paths."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import optuna

from autotune._errors import StudyError
from autotune._records import DEFAULT_STUDIES_DIR
from autotune.study._locks import file_lock

log = logging.getLogger(__name__)

DEFAULT_DB = "autotune.db"


def default_storage_url(studies_dir: Path = DEFAULT_STUDIES_DIR) -> str:
    """The SQLite URL of ``studies_dir/autotune.db``: a ``?`` or ``%`` in the folder's name is percent-encoded,
    or the URL's reader would take what follows a ``?`` for a query string and put the file elsewhere."""
    path = str(studies_dir / DEFAULT_DB).replace("%", "%25").replace("?", "%3F")
    return f"sqlite:///{path}"


def sqlite_path(url: str) -> Path:
    """The file a ``sqlite:///`` URL names, as SQLAlchemy reads it: up to a query string, percent-decoded."""
    from urllib.parse import unquote

    return Path(unquote(url[len("sqlite:///"):].split("?", 1)[0]))


RDB_SCHEMES = ("sqlite", "postgresql", "mysql", "oracle", "mssql")


# Where `autotune tune --workers/--gpus` hands its workers the storage URL: not their argv, which `ps` shows.
STORAGE_ENV = "AUTOTUNE_STORAGE"


_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def mask_url(text: str) -> str:
    """``text`` with the password of every URL in it replaced by ``***``, for messages, logs and files.

    A password runs from the first ``:`` of the user part to the last ``@`` of the line before the next
    URL, so one that holds ``/``, ``:``, a raw ``@`` or a raw space is hidden whole (text between two such
    ``@`` is hidden with it: too much, never too little). An empty user name still hides the password;
    ``password=`` in a query string is masked too.
    """
    out: list[str] = []
    pos = 0
    for match in _SCHEME.finditer(text):
        if match.start() < pos:
            continue  # inside a password already hidden
        after = match.end()
        stop = next((m.start() for m in _SCHEME.finditer(text, after)), len(text))
        line_end = text.find("\n", after)
        stop = min(stop, line_end if line_end >= 0 else len(text))
        user = re.match(r"[^:@/\s]*", text[after:stop]).group(0)  # type: ignore[union-attr]
        colon = after + len(user)
        at = text.rfind("@", colon, stop)
        if colon < stop and text[colon] == ":" and at > colon:
            out.append(text[pos:colon] + ":***")
            pos = at
    out.append(text[pos:])
    return re.sub(r"(?i)((?:^|[?&;\s])(?:password|passwd|pwd)=)[^&;\s]*", r"\1***", "".join(out))


def password_fragments(url: str) -> list[str]:
    """The password of ``url`` and the pieces a driver may print of it: a raw ``/``, ``@`` or ``:`` in a
    password makes the driver parse its tail as a host or a path, which ``mask_url`` cannot recognise."""
    match = _SCHEME.match(url)
    if match is None:
        return []
    rest = url[match.end():]
    user = re.match(r"[^:@/\s]*", rest).group(0)  # type: ignore[union-attr]
    at = rest.rfind("@")
    if len(rest) <= len(user) or rest[len(user)] != ":" or at <= len(user):
        return []
    password = rest[len(user) + 1:at]
    pieces = {password, *re.split(r"[/@:\s]", password)}
    return sorted((p for p in pieces if len(p) >= 3), key=len, reverse=True)


def hide_secret(text: str, url: Optional[str]) -> str:
    """``mask_url(text)``, and any piece of ``url``'s password left in it (a driver's own words) as ``***``."""
    text = mask_url(text)
    for piece in password_fragments(url or ""):
        text = text.replace(piece, "***")
    return text


def scrub_initial_environ(name: str) -> bool:
    """Overwrite ``name``'s value in this process's initial environment block, which ``/proc/PID/environ``
    shows to every process of the user (a trial's included) for the process's whole life, whatever
    ``os.environ`` holds since. Linux only; returns whether a value was overwritten.
    """
    import ctypes

    try:
        with open("/proc/self/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[47]), int(fields[48])  # env_start, env_end (fields 50 and 51 of proc(5))
        with open("/proc/self/environ", "rb") as fh:
            block = fh.read()
    except (OSError, IndexError, ValueError):
        return False
    key = name.encode() + b"="
    done = False
    offset = 0
    for entry in block.split(b"\0"):
        if entry.startswith(key) and len(entry) > len(key) and start + offset + len(entry) <= end:
            where = start + offset + len(key)
            ctypes.memset(where, ord("*"), len(entry) - len(key))
            done = True
        offset += len(entry) + 1
    return done


STORAGE_FILE_BYTES = 4096  # the longest first line --storage-file reads as a URL


def storage_from(url: Optional[str], path: Optional[str]) -> Optional[str]:
    """The storage URL a command was given: ``--storage``, else the first line of ``--storage-file``, else
    the ``AUTOTUNE_STORAGE`` environment variable (the last two keep a password out of ``ps`` and shell
    history); ``None`` for the default.

    Raises:
        StudyError: the file cannot be read or holds no URL.
    """
    if url:
        return url
    if path:
        try:
            with open(path, "rb") as handle:
                head = handle.read(STORAGE_FILE_BYTES + 1)  # a bounded read: the path may be /dev/zero or a pipe
        except OSError as exc:
            raise StudyError(f"--storage-file {path}: cannot read it ({exc.strerror or exc})") from None
        line = head.split(b"\n", 1)[0].strip()
        if not head.strip():
            raise StudyError(f"--storage-file {path}: the file is empty; put the storage URL on its first line")
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            text = ""
        if not text or len(line) > STORAGE_FILE_BYTES or not text.isprintable():
            raise StudyError(f"--storage-file {path}: its first line is no storage URL (binary, or longer than "
                             f"{STORAGE_FILE_BYTES} bytes); put the storage URL on its first line")
        return text
    return os.environ.get(STORAGE_ENV) or None


# How a driver says the disk is full, and how SQLite says its file is damaged.
DISK_FULL = ("database or disk is full", "no space left on device", "disk quota exceeded", "could not extend file",
             "file too large")
# How a driver says the server dropped the connection under a query (a restart, pg_terminate_backend).
DROPPED = ("terminating connection", "server closed the connection", "connection is closed", "connection was closed",
           "could not receive data from server", "lost connection", "server has gone away", "connection reset")
DAMAGED = ("database disk image is malformed", "file is not a database", "btreeinitpage", "on tree page", "corrupt")


def _causes(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    todo: list[Optional[BaseException]] = [exc]
    while todo:
        item = todo.pop()
        if item is None or any(item is s for s in seen) or len(seen) > 20:
            continue
        seen.append(item)
        orig = getattr(item, "orig", None)  # SQLAlchemy's wrapped driver error
        todo += [item.__cause__, item.__context__, orig if isinstance(orig, BaseException) else None]
    return seen


def storage_failure(exc: BaseException, url: Optional[str]) -> Optional[StudyError]:
    """One line for a storage on a full disk, a dropped server connection, or a damaged SQLite file, from
    whatever the driver raised (``None`` for any other error).

    Args:
        url: The storage's URL (``None``: the default SQLite file); it is masked in the line.
    """
    import errno

    for cause in _causes(exc):
        text = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        lower = text.lower()
        where = mask_url(url) if url else "the study database"
        if (isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)) or any(
                k in lower for k in DISK_FULL):
            return StudyError(f"storage {where}: the disk is full ({hide_secret(text, url)[:200]}); free space on it, then "
                              "rerun the same command to resume (a trial it was running is run again)")
        if isinstance(cause, json.JSONDecodeError) and url and url.split(":", 1)[0].split("+")[0] in RDB_SCHEMES:
            bad = _bad_json_attribute(url)
            if bad:
                return StudyError(f"{bad} is not valid JSON ({text[:120]}); the storage {mask_url(url)} cannot be "
                                  "read until that row is fixed or deleted")
        if _dropped(cause):
            return StudyError(f"storage {where}: the server dropped the connection ({hide_secret(text, url)[:200]}); "
                              "rerun the same command to resume (a trial it was running is run again)")
        if type(cause).__name__ in ("DatabaseError", "IntegrityError", "OperationalError") and any(
                k in lower for k in DAMAGED):
            name = str(sqlite_path(url)) if url and url.startswith("sqlite:///") else where
            return StudyError(f"the study database {name} is damaged ({hide_secret(text, url)[:200]}); restore it from a copy "
                              "(or move it aside to start a new study there)")
    return None


def _dropped(cause: BaseException) -> bool:
    """Whether ``cause`` is a driver's word that the server dropped the connection under a query."""
    lower = str(cause).lower()
    return bool(getattr(cause, "connection_invalidated", False)) or (
        type(cause).__name__ in ("OperationalError", "AdminShutdown", "InterfaceError")
        and any(k in lower for k in DROPPED))


RECONNECTS = 3  # tries again after a dropped connection, waiting 0.5, 1 and 2 s, before the error stands


_calls = threading.local()  # how deep in retried calls this thread is: only the outermost one tries again


def _reconnecting(method: Any) -> Any:
    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(_calls, "depth", 0)
        _calls.depth = depth + 1
        try:
            for attempt in range(RECONNECTS + 1):
                try:
                    return method(self, *args, **kwargs)
                except Exception as exc:  # noqa: BLE001 - only a dropped connection is tried again
                    if depth or attempt == RECONNECTS or not any(_dropped(c) for c in _causes(exc)):
                        raise
                    log.warning("storage: the server dropped a connection in %s; trying again on a new one "
                                "(%d of %d)", method.__name__, attempt + 1, RECONNECTS)
                    time.sleep(0.5 * 2 ** attempt)
            raise AssertionError("unreachable")
        finally:
            _calls.depth = depth

    return call


class ReconnectingRDBStorage(optuna.storages.RDBStorage):
    """Optuna's RDB storage, whose every call is tried again on a new connection (a few times, a few seconds
    apart) when the server dropped its connection under it: a restart, a failover, ``pg_terminate_backend``.

    A dropped connection rolls its transaction back, so the retried call finds the database as before it.
    Only a commit the server made but whose answer was lost is in doubt: a retried trial creation then
    leaves one extra trial, which the heartbeat (``--grace-period``) fails like any other lost trial.
    """


for _name, _method in vars(optuna.storages.BaseStorage).items():
    if not _name.startswith("_") and callable(_method) and hasattr(optuna.storages.RDBStorage, _name):
        setattr(ReconnectingRDBStorage, _name, _reconnecting(getattr(optuna.storages.RDBStorage, _name)))
# What Optuna's cached storage calls on it besides the public methods.
for _name in ("record_heartbeat", "_get_stale_trial_ids", "_get_trials", "_create_new_trial", "_get_best_trial_id",
              "_set_trial_param"):
    if hasattr(optuna.storages.RDBStorage, _name):
        setattr(ReconnectingRDBStorage, _name, _reconnecting(getattr(optuna.storages.RDBStorage, _name)))


def _bad_json_attribute(url: str) -> str:
    """Which stored attribute of an RDB storage holds text that is not JSON, in words ("" if none is found):
    Optuna reads every study's attributes at once and fails on the first one with a bare ``JSONDecodeError``."""
    import sqlalchemy

    queries = (
        ("study_user_attributes", "select s.study_name, a.key, a.value_json, null from study_user_attributes a "
                                  "join studies s on s.study_id = a.study_id"),
        ("study_system_attributes", "select s.study_name, a.key, a.value_json, null from study_system_attributes a "
                                    "join studies s on s.study_id = a.study_id"),
        ("trial_user_attributes", "select s.study_name, a.key, a.value_json, t.number from trial_user_attributes a "
                                  "join trials t on t.trial_id = a.trial_id join studies s on s.study_id = t.study_id"),
        ("trial_system_attributes", "select s.study_name, a.key, a.value_json, t.number from trial_system_attributes a "
                                    "join trials t on t.trial_id = a.trial_id join studies s on s.study_id = t.study_id"),
    )
    engine = None
    try:
        engine = sqlalchemy.create_engine(url)
        with engine.connect() as connection:
            for table, query in queries:
                for study_name, key, value, number in connection.execute(sqlalchemy.text(query)):
                    try:
                        json.loads(value)
                    except (TypeError, ValueError):
                        trial = f" of trial {number}" if number is not None else ""
                        kind = "user" if table.endswith("user_attributes") else "system"
                        return f"study {study_name!r}: the {kind} attribute {key!r}{trial} ({table})"
    except Exception:  # noqa: BLE001 - a diagnosis only: the caller falls back to the raw error
        return ""
    finally:
        if engine is not None:
            with contextlib.suppress(Exception):
                engine.dispose()
    return ""


def _read_only_uri(path: Path, *, quoted: int = 1) -> str:
    """SQLite's URI of ``path`` opened read-only; ``immutable`` (no locks, no -shm file) unless a write-ahead
    log holds pages the file lacks, which only a reader that maps its -shm file can see. ``quoted``: how many
    times the path is percent-encoded (SQLAlchemy decodes a URL's path once before SQLite reads it)."""
    from urllib.parse import quote

    wal = path.with_name(path.name + "-wal")
    immutable = "" if wal.is_file() and wal.stat().st_size else "&immutable=1"
    name = str(path.absolute())
    for _ in range(quoted):
        name = quote(name)
    return f"file:{name}?mode=ro{immutable}"


def _read_only_url(path: Path) -> str:
    """The SQLAlchemy URL that opens ``path`` read-only (``_read_only_uri``)."""
    return f"sqlite:///{_read_only_uri(path, quoted=2)}&uri=true"


def _check_sqlite(path: Path, *, read_only: bool = False) -> None:
    """Refuse a damaged SQLite file before Optuna reads it (SQLite's quick check: every page's structure)."""
    import sqlite3

    with contextlib.closing(sqlite3.connect(_read_only_uri(path) if read_only else path, timeout=60,
                                            uri=read_only)) as conn:
        rows = conn.execute("PRAGMA quick_check").fetchall()
    if rows and rows[0][0] != "ok":
        problem = " ".join(str(rows[0][0]).replace("*** in database main ***", "").split())
        raise sqlite3.DatabaseError(f"database disk image is malformed: {problem}")


def _enable_sqlite_wal(path: Path) -> None:
    # WAL lets readers (a dashboard, other workers) read while one writer writes; it persists in the file.
    import sqlite3

    with contextlib.closing(sqlite3.connect(path, timeout=60)) as conn:
        conn.execute("PRAGMA journal_mode=WAL")


def check_scheme(url: str) -> None:
    """Raise ``StudyError`` for a storage URL whose scheme no storage here opens."""
    scheme = url.split(":", 1)[0].split("+", 1)[0]
    if scheme not in RDB_SCHEMES + ("journal",):
        raise StudyError(
            f"storage {mask_url(url)}: unknown scheme {scheme!r} "
            "(use sqlite:///PATH, postgresql://..., mysql://... or journal:PATH)"
        )


def open_storage(
    url: Optional[str], studies_dir: Path = DEFAULT_STUDIES_DIR, *, grace_period: Optional[int] = None,
    create: bool = True,
) -> tuple[Any, str]:
    """Open an Optuna storage from a URL; ``None`` means ``studies/autotune.db``.

    ``journal:PATH`` opens a journal file (several processes on one host), refusing one that ends in a
    cut-off record (``_journal``). A SQLite file is first created by one process at a time (a lock file
    ``PATH.lock`` beside it).

    Args:
        grace_period: Keep heartbeats of running trials (RDB storages; leases in a journal): a trial without
            one for this many seconds is failed and its config retried once. ``None`` keeps no heartbeats
            (a journal then uses 60 s).

        create: Make the file or the tables when missing; read commands pass ``False``, so that reading
            a study that does not exist creates nothing.

    Returns:
        The storage object and its URL with any password masked (for messages and files).

    Raises:
        StudyError: the URL has an unknown scheme or cannot be opened, or (``create=False``) holds no studies.
    """
    url = url or default_storage_url(studies_dir)
    check_scheme(url)
    try:
        if url.startswith("journal:"):
            from autotune.study._journal import open_journal

            path = Path(url[len("journal:") :])
            if not create and not path.is_file():
                raise StudyError(f"no journal file at {path}; run `autotune tune` first")
            return open_journal(path, grace_period=grace_period), url
        # A server's connection can be dropped under a pooled one (a restart, a failover, an idle timeout,
        # pg_terminate_backend): test each before use, so a dropped one is replaced rather than failing the study.
        engine_kwargs: dict[str, Any] = {"pool_pre_ping": True}
        creation: Any = contextlib.nullcontext()
        opened, read_only = url, False
        if url.startswith("sqlite:///"):
            path = sqlite_path(url)
            if not create and not path.is_file():
                raise StudyError(f"no study database at {path}; run `autotune tune` first")
            # A read command on a file it may not write (a read-only mount, another user's studies): SQLite
            # reads it as it is, with no lock, journal or -shm file to make beside it.
            read_only = not create and not (os.access(path, os.W_OK) and os.access(path.parent, os.W_OK))
            if read_only:
                opened = _read_only_url(path)
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                # Concurrent first openers would each create Optuna's tables; one at a time, the others find them.
                creation = file_lock(path.with_name(path.name + ".lock"))
            # Wait for a lock instead of failing at once when a dashboard or a second worker writes.
            engine_kwargs = {"connect_args": {"timeout": 60}}
        options: dict[str, Any] = {}
        with warnings.catch_warnings(), creation:
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            if url.startswith("sqlite:///"):
                if path.is_file() and path.stat().st_size:
                    _check_sqlite(path, read_only=read_only)
                if not read_only:
                    _enable_sqlite_wal(path)
            if grace_period is not None:
                options = {
                    "heartbeat_interval": max(1, grace_period // 6),
                    "grace_period": grace_period,
                    "heartbeat_stale_trial_callback": optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1),
                }
            if not create:
                _require_tables(opened, engine_kwargs)
                options["skip_table_creation"] = True
            return ReconnectingRDBStorage(opened, engine_kwargs=engine_kwargs, **options), mask_url(url)
    except StudyError:
        raise
    except ImportError as exc:
        raise StudyError(
            f"{mask_url(url)}: a driver is missing ({exc.name}); for PostgreSQL install autotune[postgres]"
        ) from None
    except Exception as exc:  # SQLAlchemy raises many types; the user needs one line
        failure = storage_failure(exc, url)
        if failure is not None:
            raise failure from None
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StudyError(f"cannot open storage {mask_url(url)}: {hide_secret(first, url)}") from None


def _require_tables(url: str, engine_kwargs: dict[str, Any]) -> None:
    """Refuse a database without Optuna's tables, rather than create them there."""
    import sqlalchemy

    engine = sqlalchemy.create_engine(url, **engine_kwargs)
    try:
        if not sqlalchemy.inspect(engine).has_table("studies"):
            raise StudyError(f"{mask_url(url)} holds no Optuna studies (no 'studies' table); check the URL")
    finally:
        engine.dispose()


def study_exists(storage: Any, study_name: str) -> bool:
    return any(s.study_name == study_name for s in optuna.get_all_study_summaries(storage, include_best_trial=False))
