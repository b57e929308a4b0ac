"""python -m drafter_service.check --db DIR: verify every table of a drafter's store, offline.

Each table (one folder per vocabulary fingerprint and learning scope) gets the walk the drafter gives it at
start-up (``table_check.walk_tables``), whole instead of bounded, so a table the drafter would
quarantine is a PROBLEM here and one it serves is ok: the file is whole (not truncated)
and an LMDB environment; it holds this store's sub-databases and format record, in a
version this code reads; every record of every sub-database is read through its cursor
(a damaged page is an error, or kills the walk's own child process, never this one) and
decodes per the format, each n-gram with its coldness entry, each successor-table
record with its version and 1..16 predictions. Nothing is changed. It also lists the
tables the drafter quarantined. Exit 0 when every table is sound, 1 otherwise. Format 1,
2 and 3 tables are sound: the drafter migrates them to the current format when it opens them
(``table_format.MIGRATIONS`` says how; format 1 kept observe ids by decay epoch, and
those are dropped).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from drafter_service.scopes import split_table_name
from drafter_service.storage import LOCK_FILE_NAME
from drafter_service.table_check import TableWalk, walk_tables
from drafter_service.table_format import FORMAT_VERSION, MIGRATIONS


def verdict(name: str, walk: TableWalk) -> str:
    """The line the check prints for table ``name``."""
    if walk.problem is not None:
        return f"{name}: PROBLEM: {walk.problem}"
    if walk.version is None:
        return f"{name}: ok, empty (never written: the drafter sets it up when it opens it)"
    if walk.version != FORMAT_VERSION:
        migration = f"the drafter migrates it to {FORMAT_VERSION} when it opens it ({MIGRATIONS[walk.version]})"
        return f"{name}: ok, format {walk.version}: {migration}, {walk.records} records"
    return f"{name}: ok, format {FORMAT_VERSION} (current), {walk.records} records"


def parser() -> argparse.ArgumentParser:
    """The checker's command line (``docs/reference/tools.md`` is made from it)."""
    parser = argparse.ArgumentParser(prog="python -m drafter_service.check", description=__doc__.splitlines()[0])
    parser.add_argument("--db", required=True, help="the drafter's --db directory")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    root = Path(args.db)
    if not root.is_dir():
        print(f"{root}: no such directory", file=sys.stderr)
        return 1
    entries = sorted(root.iterdir())
    tables = [entry for entry in entries if entry.is_dir() and split_table_name(entry.name) is not None]
    walks = dict(zip(tables, walk_tables(tables)))
    sound = True
    for entry in entries:
        if entry in walks:
            sound &= walks[entry].problem is None
            print(verdict(entry.name, walks[entry]))
        elif entry.name == LOCK_FILE_NAME:
            continue
        elif ".quarantined-" in entry.name:
            print(f"{entry.name}: quarantined by the drafter (not served; inspect, then delete or restore)")
        else:
            print(f"{entry.name}: not a table (ignored by the drafter)")
    return 0 if sound else 1


if __name__ == "__main__":
    sys.exit(main())
