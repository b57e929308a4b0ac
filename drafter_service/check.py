"""python -m drafter_service.check --db DIR: verify every table of a drafter's store, offline.

For each table (one folder per vocabulary fingerprint) it checks, without
changing anything: the file is whole (not truncated) and an LMDB
environment; it holds this store's sub-databases and format record, in a
version this code reads; every n-gram record decodes and has its coldness
entry. It also lists tables the drafter quarantined at start-up. Exit 0 when
every table is sound, 1 otherwise. A format 1 table is sound: the drafter
migrates it to format 2 when it opens it (observe ids were kept by decay
epoch then, and are dropped).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lmdb

from drafter_service.config import VOCABULARY_PATTERN
from drafter_service.storage import LOCK_FILE_NAME
from drafter_service.store import (
    _META_VERSION,
    _OUR_DATABASES,
    FORMAT_VERSION,
    MIGRATED_FORMAT_VERSION,
    SUB_DATABASES,
    coldness_key,
    decode_value,
    file_problem,
)


def check_table(path: Path) -> tuple[str | None, int, int | None]:
    """(the problem, or None; n-gram records checked; the format version found)."""
    problem = file_problem(path)
    if problem is not None:
        return problem, 0, None
    try:
        env = lmdb.open(str(path), readonly=True, max_dbs=SUB_DATABASES)
    except lmdb.Error as error:
        return f"LMDB cannot open it: {error}", 0, None
    try:
        with env.begin() as txn:
            names = set(txn.cursor().iternext(keys=True, values=False))
            if names != _OUR_DATABASES:
                return f"its sub-databases are {sorted(names)}, not this store's", 0, None
            meta = env.open_db(b"meta", txn=txn, create=False)
            version = txn.get(_META_VERSION, db=meta)
            if version not in (bytes((FORMAT_VERSION,)), bytes((MIGRATED_FORMAT_VERSION,))):
                return (
                    (f"format version {version!r}; this code reads {MIGRATED_FORMAT_VERSION} (migrating it) " f"and {FORMAT_VERSION}"),
                    0,
                    None,
                )
            ngrams = env.open_db(b"ngrams", txn=txn, create=False)
            coldness = env.open_db(b"coldness", txn=txn, create=False)
            records = 0
            for key, value in txn.cursor(db=ngrams):
                epoch, total, _pairs = decode_value(value)
                if txn.get(coldness_key(epoch, total, key), db=coldness) is None:
                    return f"n-gram record {key.hex()} has no coldness entry", records, version[0]
                records += 1
            return None, records, version[0]
    except Exception as error:  # corrupt pages (lmdb.CorruptedError), undecodable values (StoreFormatError)
        return f"unreadable: {type(error).__name__}: {error}", 0, None
    finally:
        env.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m drafter_service.check", description=__doc__.splitlines()[0])
    parser.add_argument("--db", required=True, help="the drafter's --db directory")
    args = parser.parse_args(argv)
    root = Path(args.db)
    if not root.is_dir():
        print(f"{root}: no such directory", file=sys.stderr)
        return 1
    sound = True
    for entry in sorted(root.iterdir()):
        if entry.name == LOCK_FILE_NAME:
            continue
        if entry.is_dir() and VOCABULARY_PATTERN.fullmatch(entry.name):
            problem, records, version = check_table(entry)
            if problem is None and version != FORMAT_VERSION:
                print(
                    f"{entry.name}: ok, format {version}: the drafter migrates it to {FORMAT_VERSION} when it opens it "
                    f"(its observe ids are dropped), {records} n-grams"
                )
            elif problem is None:
                print(f"{entry.name}: ok, format {FORMAT_VERSION} (current), {records} n-grams")
            else:
                sound = False
                print(f"{entry.name}: PROBLEM: {problem}")
        elif ".quarantined-" in entry.name:
            print(f"{entry.name}: quarantined by the drafter at start-up (not served; inspect, then delete or restore)")
        else:
            print(f"{entry.name}: not a table (ignored by the drafter)")
    return 0 if sound else 1


if __name__ == "__main__":
    sys.exit(main())
