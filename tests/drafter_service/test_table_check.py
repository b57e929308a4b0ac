"""Tests for drafter_service.table_check: the walk of start-up and of drafter_service.check,
over sound tables and over tables with a record that breaks the format."""

from __future__ import annotations

import struct

import lmdb
import pytest
from test_store import NAMESPACE, make_config, put_ngram_value

from drafter_service import table_check
from drafter_service.store import LMDBNGramStore
from drafter_service.table_check import TableWalk, walk_table, walk_tables


def test_the_walk_reads_every_record_of_a_sound_table_or_as_many_as_it_is_allowed(tmp_path):
    config = make_config(tmp_path, n_min=2, n_max=2)
    with LMDBNGramStore(config) as store:
        store.apply([("a", [1, 2, 3, 4]), ("b", [1, 2, 5])])
        store.advance_epoch()
        store.observe([1, 2, 3])
    # 2 bigrams ((1, 2) -> 3, 5; (2, 3) -> 4), each with its coldness entry, 2 applied ids, 8 meta records.
    assert walk_table(config.path) == TableWalk(None, records=14, entries=14, version=4)
    # 2 shared out by size, rounded up: one n-gram, one coldness entry, one applied id.
    assert walk_table(config.path, max_records=2) == TableWalk(None, records=11, entries=14, version=4)
    assert walk_tables([config.path, config.path], max_records=2) == [walk_table(config.path, max_records=2)] * 2


def test_an_environment_never_written_is_sound_and_empty(tmp_path):
    config = make_config(tmp_path)
    lmdb.open(config.path).close()  # a creation cut short after LMDB's meta pages, before the store's first commit
    assert walk_table(config.path) == TableWalk(None)
    with LMDBNGramStore(config) as store:  # and the store takes it over
        store.observe([1, 2, 3])


@pytest.mark.parametrize(
    "value, coldness, problem",
    [
        (struct.pack(">BIIIIII", 1, 0, 3, 7, 1, 8, 2), struct.pack(">II", 0, 3), "breaks the format"),  # counts rising
        (struct.pack(">BIIII", 1, 0, 5, 7, 4), struct.pack(">II", 0, 5), "breaks the format"),  # total is not the sum
        (struct.pack(">BIIIIII", 1, 0, 2, 7, 1, 7, 1), struct.pack(">II", 0, 2), "breaks the format"),  # a token twice
        (struct.pack(">BIIII", 1, 9, 1, 7, 1), struct.pack(">II", 9, 1), "breaks the format"),  # from a future epoch
        (struct.pack(">BIIII", 2, 0, 1, 7, 1), struct.pack(">II", 0, 1), "is not version 1"),
        (struct.pack(">BIIII", 1, 0, 1, 7, 1), struct.pack(">II", 0, 2), "has no coldness entry"),
    ],
    ids=["counts rising", "wrong total", "token twice", "future epoch", "value version", "no coldness entry"],
)
def test_the_walk_finds_a_record_that_breaks_the_format(tmp_path, value, coldness, problem):
    config = make_config(tmp_path, n_min=2, n_max=2)
    LMDBNGramStore(config).close()
    put_ngram_value(config, (1, 2), value, coldness)
    walk = walk_table(config.path)
    assert walk.problem is not None and problem in walk.problem and walk.problem.startswith("n-gram ")


def test_the_walk_counts_n_grams_against_coldness_entries(tmp_path):
    config = make_config(tmp_path, n_min=2, n_max=2)
    with LMDBNGramStore(config) as store:
        store.observe([1, 2, 3])
    env = lmdb.open(config.path, max_dbs=4)
    with env.begin(write=True) as txn:
        txn.put(b"\x00" * 25, b"", db=env.open_db(b"coldness", txn=txn))  # an entry for no n-gram
    env.close()
    assert walk_table(config.path).problem == "it holds 1 n-gram records but 2 coldness entries (one each)"


def test_a_walk_that_lmdb_kills_condemns_the_table_and_one_that_cannot_run_raises(tmp_path, monkeypatch):
    config = make_config(tmp_path)
    LMDBNGramStore(config).close()
    # As LMDB does on some damaged pages: an assertion, which aborts (seen on 5 of 60 tables with 20 random pages).
    monkeypatch.setattr(table_check, "_CHILD_WALK", "import os, sys; print('mdb.c: Assertion failed', file=sys.stderr); os.abort()")
    (walk,) = walk_tables([config.path])
    assert walk == TableWalk("reading it crashed LMDB (SIGABRT: mdb.c: Assertion failed): its pages are damaged")
    monkeypatch.setattr(table_check, "_CHILD_WALK", "raise SystemExit('no module named lmdb')")
    with pytest.raises(RuntimeError, match=r"could not run \(exit status 1\): no module named lmdb"):
        walk_tables([config.path])  # says nothing about the table: never a quarantine


STAMP_0 = struct.pack(">I", 0)


@pytest.mark.parametrize(
    "key, value, problem, served",
    [
        (b"\x01" + struct.pack(">I", 5), b"\x01" + STAMP_0 + struct.pack(">I", 7), "is not version 2", None),
        (b"\x01" + struct.pack(">I", 5), b"\x02" + STAMP_0, "is not version 2 and 1..16 tokens", None),
        (b"\x03" + struct.pack(">3I", 1, 2, 5), b"\x02" + STAMP_0 + struct.pack(">I", 7), "is not namespace | n (1 or 2)", None),
        (b"\x01" + struct.pack(">I", 5), b"\x02" + struct.pack(">2I", 9, 7), "is stamped after the current tick 0", (7,)),
    ],
    ids=["value version", "no tokens", "three-token key", "future stamp"],
)
def test_the_walk_finds_a_successor_record_that_breaks_the_format(tmp_path, key, value, problem, served):
    with LMDBNGramStore(make_config(tmp_path)) as store:
        path = store.config.path
    env = lmdb.open(path, max_dbs=6)
    with env.begin(write=True) as txn:  # the record with its recency entry, so that they count as one each
        txn.put(NAMESPACE + key, value, db=env.open_db(b"successors", txn=txn))
        txn.put(value[1:5] + NAMESPACE + key, b"", db=env.open_db(b"successor_recency", txn=txn))
    env.close()
    walk = walk_table(path)
    assert walk.problem is not None and problem in walk.problem
    with LMDBNGramStore(make_config(tmp_path)) as store:  # served meanwhile: an unreadable record reads as none
        assert store.successors((5,)) == served


@pytest.mark.parametrize(
    "change, problem",
    [
        ("drop the entry", "it holds 2 successor records but 1 successor-recency entries (one each)"),
        ("add an entry", "it holds 2 successor records but 3 successor-recency entries (one each)"),
        ("restamp the entry", "has no successor-recency entry"),
    ],
)
def test_the_walk_finds_a_missing_or_extra_successor_recency_entry(tmp_path, change, problem):
    with LMDBNGramStore(make_config(tmp_path)) as store:
        store.record_successors([((5,), (6,)), ((6,), (7,))])  # both stamped 0
        path = store.config.path
    assert walk_table(path).problem is None
    env = lmdb.open(path, max_dbs=6)
    with env.begin(write=True) as txn:
        recency = env.open_db(b"successor_recency", txn=txn)
        entry = STAMP_0 + NAMESPACE + b"\x01" + struct.pack(">I", 5)
        if change != "add an entry":
            assert txn.delete(entry, db=recency)
        if change != "drop the entry":  # a second entry for (5,), or (after the delete) one under another stamp
            txn.put(struct.pack(">I", 1) + entry[4:], b"", db=recency)
            txn.put(b"successor_tick", struct.pack(">I", 1), db=env.open_db(b"meta", txn=txn))
    env.close()
    walk = walk_table(path)
    assert walk.problem is not None and problem in walk.problem, walk.problem
