"""Tests for drafter_service.storage: the --db lock, StoreRegistry's start-up walk and quarantine.

Damaged tables are made from a compacted copy (``backup``): a compact copy holds no free
pages, so every page after the two meta pages is a B-tree page in use, which the start-up
walk reads. Corruption written there is met by the walk, whatever the seed's choices.
"""

from __future__ import annotations

import fcntl
import random
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from drafter_service import check
from drafter_service.config import DrafterConfig
from drafter_service.storage import LOCK_FILE_NAME, DirectoryLocked, Quarantined, StoreRegistry
from drafter_service.store import LMDBNGramStore, StoreClosed, StoreConfig, StoreCorrupted

DAMAGED = "00112233445566aa"
SOUND = "ffeeddccbbaa9988"
PAGE = 4096
# Tokens of each test table: ~15,000 n-grams, ~350 pages of B-tree, built in a fraction of a second.
TABLE_TOKENS = 5000


def table_tokens(vocabulary: str) -> list[int]:
    rng = random.Random(vocabulary)
    return [rng.randrange(1000) for _ in range(TABLE_TOKENS)]


def make_table(db: Path, vocabulary: str) -> None:
    """A compacted table of table_tokens(vocabulary) under db/vocabulary: every page past the metas in use."""
    staging = db.parent / f"staging-{vocabulary}"
    with LMDBNGramStore(StoreConfig(path=str(staging), namespace=bytes.fromhex(vocabulary))) as store:
        store.apply([("o1", table_tokens(vocabulary))])
        store.backup(db / vocabulary)
    shutil.rmtree(staging)


def garbage_pages(data: Path, count: int = 20, seed: int = 1) -> None:
    rng = random.Random(seed)
    with open(data, "r+b") as handle:
        for page in rng.sample(range(2, data.stat().st_size // PAGE), count):
            handle.seek(page * PAGE)
            handle.write(rng.randbytes(PAGE))


def flipped_bytes(data: Path, count: int = 200, seed: int = 2) -> None:
    rng = random.Random(seed)
    with open(data, "r+b") as handle:
        for offset in rng.sample(range(2 * PAGE, data.stat().st_size), count):
            handle.seek(offset)
            byte = handle.read(1)[0]
            handle.seek(offset)
            handle.write(bytes((byte ^ (1 << rng.randrange(8)),)))


def zeroed_pages(data: Path) -> None:
    """Every page past the metas zeroed, through the file, under an open environment's map."""
    with open(data, "r+b") as handle:
        handle.seek(2 * PAGE)
        handle.write(bytes(data.stat().st_size - 2 * PAGE))


def registry(db: Path, **settings) -> StoreRegistry:
    return StoreRegistry(DrafterConfig(db=str(db), **settings))


def drafts(stores: StoreRegistry, vocabulary: str) -> list:
    """The table's stored continuation of the first 4-gram of table_tokens (None when it has none)."""
    tokens = table_tokens(vocabulary)
    store = stores.find(vocabulary)
    assert store is not None
    with store.snapshot() as table:
        return [table.best(tuple(tokens[i : i + 4])) for i in range(3)]


def expected_drafts(vocabulary: str) -> list:
    tokens = table_tokens(vocabulary)
    # Each 4-gram of random tokens over 1000 ids is almost surely seen once: (next, 1, 1).
    return [(tokens[i + 4], 1, 1) for i in range(3)]


def aside(db: Path) -> list[str]:
    return sorted(path.name.split(".")[0] for path in db.iterdir() if ".quarantined-" in path.name)


# --- the start-up walk -------------------------------------------------------------------


@pytest.mark.parametrize("damage", [garbage_pages, flipped_bytes], ids=["20 garbage pages", "200 flipped bytes"])
def test_a_table_with_damaged_pages_is_quarantined_at_start_up_and_the_others_serve(tmp_path, damage, capsys):
    db = tmp_path / "db"
    make_table(db, DAMAGED)
    make_table(db, SOUND)
    damage(db / DAMAGED / "data.mdb")
    assert check.main(["--db", str(db)]) == 1
    report = capsys.readouterr().out
    assert f"{SOUND}: ok, format 4 (current)" in report
    problem = report.split(f"{DAMAGED}: PROBLEM: ")[1].splitlines()[0]

    stores = registry(db)
    try:
        ((quarantined),) = stores.quarantined
        # The start-up walk and the offline check are one walk: the same verdict, word for word.
        assert quarantined[:1] == (DAMAGED,) and quarantined.reason == problem and quarantined.at_startup
        assert aside(db) == [DAMAGED] and not (db / DAMAGED).exists()
        assert sorted(stores.all()) == [SOUND]
        assert drafts(stores, SOUND) == expected_drafts(SOUND)
        assert stores.get(SOUND).apply([("o2", [1, 2, 3, 4, 5])]) == [True]
        # The damaged vocabulary starts over: its next write creates a fresh table.
        assert stores.find(DAMAGED) is None
        assert stores.get(DAMAGED).apply([("o1", [1, 2, 3, 4, 5])]) == [True]
        assert stores.get(DAMAGED).stats()["entries"] == 6  # 2-, 3- and 4-grams of 5 tokens: 3 + 2 + 1
    finally:
        stores.close()


def test_a_table_above_the_walk_bound_is_walked_that_far(tmp_path, caplog):
    db = tmp_path / "db"
    make_table(db, SOUND)
    with caplog.at_level("INFO", logger="drafter_service.storage"):
        stores = registry(db)  # the default bound: walked whole, nothing said
        stores.close()
        assert "walked" not in caplog.text
        stores = StoreRegistry(DrafterConfig(db=str(db)), startup_walk_records=1000)
    try:
        # 1000 shared out by size, rounded up (500 n-grams, 500 coldness entries, 1 applied id), and the 8 meta records.
        assert f"table {SOUND}: walked 1009 of its 29969 records at start-up" in caplog.text
        assert drafts(stores, SOUND) == expected_drafts(SOUND)
    finally:
        stores.close()


def test_an_empty_data_file_is_quarantined_not_deleted(tmp_path):
    db = tmp_path / "db"
    make_table(db, DAMAGED)
    make_table(db, SOUND)
    (db / DAMAGED / "data.mdb").write_bytes(b"")  # emptied: the table's data is gone, its folder is evidence
    (db / DAMAGED / "lock.mdb").write_bytes(bytes(8192))
    stores = registry(db)
    try:
        assert [(q.table, q.reason) for q in stores.quarantined] == [(DAMAGED, "data.mdb is 0 bytes: too short for LMDB's two meta pages")]
        assert aside(db) == [DAMAGED]
        assert sorted(stores.all()) == [SOUND]
    finally:
        stores.close()


@pytest.mark.parametrize("files", [[], ["lock.mdb"]], ids=["empty folder", "lock file only"])
def test_a_folder_that_never_held_data_is_removed(tmp_path, files, caplog):
    db = tmp_path / "db"
    (db / DAMAGED).mkdir(parents=True)
    for name in files:  # LMDB sets up its lock file before it creates the data file
        (db / DAMAGED / name).write_bytes(bytes(32896))
    stores = registry(db)
    try:
        assert not (db / DAMAGED).exists() and stores.quarantined == [] and aside(db) == []
        assert "was never completed" in caplog.text
    finally:
        stores.close()


# --- quarantine while serving --------------------------------------------------------------


@pytest.mark.parametrize("call", ["read", "write"])
def test_a_table_damaged_while_serving_is_quarantined_by_the_call_that_meets_it(tmp_path, call):
    db = tmp_path / "db"
    make_table(db, DAMAGED)
    make_table(db, SOUND)
    stores = registry(db)
    told: list[tuple[str, str]] = []
    stores.add_quarantine_listener(lambda vocabulary, reason: told.append((vocabulary, reason)))
    try:
        damaged = stores.get(DAMAGED)
        zeroed_pages(db / DAMAGED / "data.mdb")
        # Zeroed pages: MDB_CORRUPTED, which LMDB 0.9 reports as MDB_BAD_TXN when met by a named
        # database's first lookup in a transaction (see store._LMDB_CORRUPTION).
        damage = r"(CorruptedError: .*MDB_CORRUPTED|BadTxnError: .*MDB_BAD_TXN)"
        with pytest.raises(StoreCorrupted, match=rf"is damaged \({damage}.*\) and was set aside; nothing of this call") as raised:
            if call == "read":
                drafts(stores, DAMAGED)
            else:
                damaged.apply([("o2", [1, 2, 3, 4, 5])])
        assert isinstance(raised.value, StoreClosed)  # what a caller maps to UNAVAILABLE: retry
        ((record),) = stores.quarantined
        assert record.table == DAMAGED and re.match(damage, record.reason) and not record.at_startup
        assert told == [(DAMAGED, record.reason)]
        assert aside(db) == [DAMAGED] and (db / record.aside).is_dir()
        assert damaged.closed and stores.find(DAMAGED) is None
        with pytest.raises(StoreClosed, match="was set aside as unservable"):
            damaged.apply([("o3", [1, 2, 3])])  # a write queued for it before: refused, never written aside
        # The other table serves on; the damaged vocabulary's next write creates a fresh table.
        assert drafts(stores, SOUND) == expected_drafts(SOUND)
        assert stores.get(DAMAGED).apply([("o2", [1, 2, 3, 4, 5])]) == [True]
        assert stores.quarantine(DAMAGED, "late report", store=damaged) is False  # idempotent: the fresh one stays
        assert stores.find(DAMAGED) is not None and len(stores.quarantined) == 1
    finally:
        stores.close()


def test_quarantine_waits_for_readers_in_the_table_before_closing_it(tmp_path):
    db = tmp_path / "db"
    make_table(db, DAMAGED)
    stores = registry(db)
    store = stores.get(DAMAGED)
    inside, quarantined, results = threading.Event(), threading.Event(), []

    def reader() -> None:
        with store.snapshot() as table:
            inside.set()
            quarantined.wait()
            results.append(table.best(tuple(table_tokens(DAMAGED)[:4])))  # its transaction still reads

    thread = threading.Thread(target=reader)
    thread.start()
    inside.wait()
    assert stores.quarantine(DAMAGED, "an operator's call") is True
    assert stores.quarantine(DAMAGED, "again") is False
    assert store.closed and store._env is not None  # refused to new calls, open for the one inside
    with pytest.raises(StoreClosed):
        store.stats()
    quarantined.set()
    thread.join()
    assert results == expected_drafts(DAMAGED)[:1]
    assert store._env is None  # closed when the last reader left
    assert stores.quarantined == [Quarantined(DAMAGED, stores.quarantined[0].aside, "an operator's call", False)]
    stores.close()


def test_listeners_hear_of_start_up_quarantines_when_they_subscribe(tmp_path):
    db = tmp_path / "db"
    make_table(db, DAMAGED)
    garbage_pages(db / DAMAGED / "data.mdb")
    stores = registry(db)
    told: list[str] = []
    stores.add_quarantine_listener(lambda vocabulary, reason: told.append(vocabulary))
    assert told == [DAMAGED]
    stores.close()


# --- the one-drafter-per---db lock -------------------------------------------------------------


def test_deleting_the_lock_file_does_not_let_a_second_registry_in(tmp_path):
    db = tmp_path / "db"
    first = registry(db)
    try:
        (db / LOCK_FILE_NAME).unlink()
        with pytest.raises(DirectoryLocked, match=r"another drafter \(another process\) is serving --db"):
            registry(db)
    finally:
        first.close()
    registry(db).close()  # released with the first


def test_a_drafter_of_an_older_version_holding_only_the_lock_file_keeps_this_one_out(tmp_path):
    db = tmp_path / "db"
    db.mkdir()
    with open(db / LOCK_FILE_NAME, "a+") as older:
        older.write("pid 12345\n")
        older.flush()
        fcntl.flock(older, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(DirectoryLocked, match=r"another drafter \(pid 12345\)"):
            registry(db)
    registry(db).close()


HOLDER = """
import sys, threading
from drafter_service.config import DrafterConfig
from drafter_service.storage import StoreRegistry
registry = StoreRegistry(DrafterConfig(db=sys.argv[1]))  # held: the lock lives as long as the process
print("locked", flush=True)
threading.Event().wait()
"""


def test_the_lock_dies_with_its_holder_under_kill_9(tmp_path):
    db = tmp_path / "db"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(db)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(DirectoryLocked, match=rf"another drafter \(pid {holder.pid}\)"):
            registry(db)
    finally:
        holder.kill()  # SIGKILL: no shutdown code runs
        holder.wait()
    registry(db).close()
