"""Replace the absolute paths of the machine a result was measured on, before the result is committed.

    python -m benchmarks.runners.scrub_paths RESULT... --replace OLD=NEW [--replace OLD=NEW ...]

A study's SQLite file keeps the target it tuned (``<checkout>/examples/x.py:train``) and each failed trial's
stderr; a runner's JSON and log keep its working directory. Each ``OLD`` is replaced by ``NEW`` in every
text value of every table of a ``.db`` file (which is then vacuumed, so no old page keeps the text) and in
any other file's text. Exits 1 when an ``OLD`` is still found afterwards.
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
from pathlib import Path
from typing import Optional


def _pairs(values: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for value in values:
        old, sep, new = value.partition("=")
        if not sep or not old:
            raise SystemExit(f"--replace {value!r}: expected OLD=NEW")
        pairs.append((old, new))
    return pairs


def scrub_db(path: Path, pairs: list[tuple[str, str]]) -> int:
    """Replace in every TEXT value of every table; returns the values changed."""
    changed = 0
    db = sqlite3.connect(path)
    try:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        for table in tables:
            columns = [r[1] for r in db.execute(f'PRAGMA table_info("{table}")')]
            for column in columns:
                for old, new in pairs:
                    cursor = db.execute(
                        f'UPDATE "{table}" SET "{column}" = replace("{column}", ?, ?) '
                        f'WHERE typeof("{column}") = \'text\' AND instr("{column}", ?) > 0', (old, new, old))
                    changed += cursor.rowcount
        db.commit()
        db.execute("VACUUM")  # rewrites the file, so that no free page keeps an old value
    finally:
        db.close()
    return changed


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", type=Path, nargs="+")
    parser.add_argument("--replace", action="append", required=True, metavar="OLD=NEW")
    args = parser.parse_args(argv)
    pairs = _pairs(args.replace)
    left = []
    for path in args.files:
        if path.suffix == ".db":
            print(f"{path}: {scrub_db(path, pairs)} values changed")
        else:
            text = path.read_text()
            for old, new in pairs:
                text = text.replace(old, new)
            path.write_text(text)
        raw = path.read_bytes()
        left += [f"{path}: {old!r}" for old, _ in pairs if old.encode() in raw]
    for line in left:
        print(f"still found: {line}", file=sys.stderr)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
