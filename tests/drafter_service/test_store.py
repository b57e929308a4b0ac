"""Tests for drafter_service.store: format, merge, decay, eviction, durability.

Record sizes used below (drafter_service.table_format's layout, and the store's
RECORD_OVERHEAD_BYTES = 10): a
2-gram key is 8 + 1 + 2*4 = 17 bytes, a value with one pair 9 + 8 = 17, its
coldness key 8 + 17 = 25; so one 2-gram with one continuation tracks
17 + 17 + 10 + 25 + 10 = 79 bytes.
"""

from __future__ import annotations

import inspect
import logging
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading

import lmdb
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from drafter_service.ngram import SOURCE_GLOBAL, InMemoryNGramTable, NGramConfig
from drafter_service.sessions import NGramDrafter
from drafter_service.store import (
    FILE_BYTES_PER_MAX_BYTE,
    LMDBNGramStore,
    StoreClosed,
    StoreConfig,
    StoreCorrupted,
    StoreFull,
    count_ngrams,
    first_occurrences,
    is_corruption,
)
from drafter_service.table_check import TableWalk, walk_table
from drafter_service.table_format import UINT32_MAX, StoreFormatError

NAMESPACE = b"testvoc0"
OTHER_NAMESPACE = b"othervoc"
BYTES_PER_BIGRAM = 79  # see the module docstring


def make_config(tmp_path, **overrides) -> StoreConfig:
    return StoreConfig(path=str(tmp_path / "store"), namespace=overrides.pop("namespace", NAMESPACE), **overrides)


def contents(store, keys):
    return {key: store.continuations(key) for key in keys}


# --- format ---------------------------------------------------------------------


def test_config_rejects_a_namespace_that_is_not_8_bytes(tmp_path):
    with pytest.raises(ValueError, match="namespace must be 8 bytes"):
        make_config(tmp_path, namespace=b"short")


def test_tracked_bytes_follow_the_documented_record_sizes(tmp_path):
    with LMDBNGramStore(make_config(tmp_path, n_min=2, n_max=2)) as store:
        store.observe([1, 2, 3])
        assert store.stats()["bytes"] == BYTES_PER_BIGRAM
        # An applied id "ab" adds key 4 + 8 + 2 = 14 bytes, empty value, 10 overhead.
        store.apply([("ab", [])])
        assert store.stats()["bytes"] == BYTES_PER_BIGRAM + 24


def test_an_unknown_value_version_raises_a_clear_error(tmp_path):
    config = make_config(tmp_path, n_min=2, n_max=2)
    LMDBNGramStore(config).close()
    env = lmdb.open(config.path, max_dbs=4)
    with env.begin(write=True) as txn:
        ngrams = env.open_db(b"ngrams", txn=txn)
        key = NAMESPACE + bytes([2]) + struct.pack(">II", 1, 2)
        txn.put(key, bytes([9]) + struct.pack(">IIII", 0, 1, 3, 1), db=ngrams)
    env.close()
    with LMDBNGramStore(config) as store:
        with pytest.raises(StoreFormatError, match="value has version 9; this code reads version 1"):
            store.continuations((1, 2))


def test_an_unknown_file_version_is_refused_on_open(tmp_path):
    config = make_config(tmp_path)
    LMDBNGramStore(config).close()
    env = lmdb.open(config.path, max_dbs=4)
    with env.begin(write=True) as txn:
        txn.put(b"format_version", bytes([5]), db=env.open_db(b"meta", txn=txn))
    env.close()
    with pytest.raises(StoreFormatError, match="store format version 5; this code reads version 4"):
        LMDBNGramStore(config)


def as_older_format(path: str, version: int) -> None:
    """Rewrite a table of this format as format ``version`` (1, 2 or 3) left it, by each one's
    layout (drafter_service.table_format's history): 3 had successor values of version 1 (the tokens,
    unstamped), no successor_recency and no successor meta records; 2 and 1 no successor table."""
    env = lmdb.open(path, max_dbs=6, map_size=1 << 30)  # sparse: room to rewrite a big table
    with env.begin(write=True) as txn:
        meta, successors = env.open_db(b"meta", txn=txn), env.open_db(b"successors", txn=txn)
        txn.drop(env.open_db(b"successor_recency", txn=txn), delete=True)
        for key in (b"successor_tick", b"successor_tick_writes", b"successor_evictions"):
            assert txn.delete(key, db=meta)
        cursor = txn.cursor(db=successors)
        for key, value in cursor:
            assert value[0] == 2
            cursor.put(key, b"\x01" + value[5:])  # version 1 | tokens: the stamp goes
        if version < 3:
            txn.drop(successors, delete=True)
        txn.put(b"format_version", bytes([version]), db=meta)
    env.close()


def test_the_fast_path_reads_no_header_past_a_value_too_short_for_one_pair(tmp_path):
    config = make_config(tmp_path, n_min=2, n_max=2)
    LMDBNGramStore(config).close()
    put_ngram_value(config, (1, 2), b"\x01\x00\x00")
    with LMDBNGramStore(config) as store, store.snapshot() as table, pytest.raises(StoreFormatError):
        table.best((1, 2))  # the fast path reads no header past the end


def put_ngram_value(config: StoreConfig, key: tuple[int, ...], value: bytes, coldness: bytes | None = None) -> None:
    """Write one ``ngrams`` record (and a coldness key) behind the store's back."""
    env = lmdb.open(config.path, max_dbs=4)
    with env.begin(write=True) as txn:
        ngram_key = config.namespace + bytes([len(key)]) + struct.pack(f">{len(key)}I", *key)
        txn.put(ngram_key, value, db=env.open_db(b"ngrams", txn=txn))
        if coldness is not None:
            txn.put(coldness + ngram_key, b"", db=env.open_db(b"coldness", txn=txn))
    env.close()


# --- counting and merging ------------------------------------------------------------


def test_observe_counts_what_the_in_memory_table_counts(tmp_path):
    reference = InMemoryNGramTable(n_min=2, n_max=3)
    reference.observe([5, 6, 7, 8])
    with LMDBNGramStore(make_config(tmp_path, n_min=2, n_max=3)) as store:
        store.observe([5, 6, 7, 8])
        expected = {(5, 6): {7: 1}, (6, 7): {8: 1}, (5, 6, 7): {8: 1}}
        assert contents(store, expected) == expected
        assert contents(reference, expected) == expected
        assert store.stats()["entries"] == 3  # and nothing else was stored
        # The last token has no continuation; (6,) is below n_min; (5, 6, 7, 8) above n_max.
        assert contents(store, [(7, 8), (6,), (5, 6, 7, 8)]) == {(7, 8): None, (6,): None, (5, 6, 7, 8): None}


def packed_sequence(tokens, start=0, counted=None):
    return tokens, struct.pack(f">{len(tokens)}I", *tokens), start, counted


def test_a_sequence_counts_each_pair_once_in_first_seen_order():
    counts = count_ngrams([packed_sequence([1, 2, 1, 2, 1, 3])], b"", 1, 1)
    # (1,)->2 occurs twice, counted once; 2 before 3 after (1,), as first seen.
    assert counts == {b"\x01" + struct.pack(">I", 1): {2: 1, 3: 1}, b"\x01" + struct.pack(">I", 2): {1: 1}}
    assert list(counts[b"\x01" + struct.pack(">I", 1)]) == [2, 3]
    # Two sequences (two calls): once each.
    assert count_ngrams([packed_sequence([1, 2])] * 2, b"", 1, 1) == {b"\x01" + struct.pack(">I", 1): {2: 2}}


def test_first_occurrences_mark_where_each_pair_of_a_call_is_first_seen():
    assert first_occurrences([[1, 2, 1, 2], [2, 1, 3]], 1, 1) == [(bytes([0, 1, 1, 0]),), (bytes([0, 0, 1]),)]
    # n 1 and 2: (1, 2)->1 at 2, then (2, 1)->2 at 3; the second sequence repeats (1,)->2 and (1, 2)->1.
    assert first_occurrences([[1, 2, 1, 2], [1, 2, 1]], 1, 2) == [
        (bytes([0, 1, 1, 0]), bytes([0, 0, 1, 1])),
        (bytes([0, 0, 0]), bytes([0, 0, 0])),
    ]
    with pytest.raises(ValueError, match="token ids must be integers"):
        first_occurrences([[1, 1 << 32]], 1, 1)


def test_a_call_counts_an_n_gram_once_however_often_it_repeats(tmp_path):
    # Was: an Observe of 50 copies of another caller's 4-gram followed by junk outvoted that
    # caller's observation 50 to 1, and its 8-token draft became the junk.
    victim = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    with LMDBNGramStore(make_config(tmp_path, n_min=4, n_max=4)) as store:
        store.observe(victim)
        store.observe([1, 2, 3, 4, 99] * 50)
        assert list(store.continuations((1, 2, 3, 4)).items()) == [(5, 1), (99, 1)]  # a tie: the stored one first
        store.apply([(None, [1, 2, 3, 4, 99]), (None, [1, 2, 3, 4, 99])])  # two calls: two votes
        assert store.continuations((1, 2, 3, 4)) == {99: 3, 5: 1}


def test_the_parts_of_a_call_count_only_the_positions_marked(tmp_path):
    parts = [[1, 2, 3, 4, 9] * 50] * 3  # one call, three sequences of 50 copies each
    with LMDBNGramStore(make_config(tmp_path, n_min=4, n_max=4)) as store:
        masks = first_occurrences(parts, 4, 4)
        assert store.apply([(f"o/{i}", tokens, 0, counted) for i, (tokens, counted) in enumerate(zip(parts, masks))]) == [True] * 3
        # One vote per pair for the call: (1, 2, 3, 4)->9, (2, 3, 4, 9)->1, and so on.
        assert store.continuations((1, 2, 3, 4)) == {9: 1} and store.continuations((2, 3, 4, 9)) == {1: 1}
        with pytest.raises(ValueError, match=r"counted must hold 1 masks \(n 4..4\) of 5 bytes"):
            store.apply([("p", [1, 2, 3, 4, 9], 0, [b"\x01" * 4])])


def test_continuations_are_most_frequent_first_and_ties_keep_stored_order(tmp_path):
    with LMDBNGramStore(make_config(tmp_path, n_min=2, n_max=2)) as store:
        store.observe([1, 2, 3])
        store.observe([1, 2, 4])
        assert list(store.continuations((1, 2)).items()) == [(3, 1), (4, 1)]  # tie: 3 was stored first
        store.observe([1, 2, 4])
        assert list(store.continuations((1, 2)).items()) == [(4, 2), (3, 1)]
        store.observe([1, 2, 3])
        # Tie again; the stored order is now [4, 3], which the stable sort keeps
        # (InMemoryNGramTable would put 3 first: it orders by first sighting).
        assert list(store.continuations((1, 2)).items()) == [(4, 2), (3, 2)]


def test_max_continuations_keeps_the_top_counts(tmp_path):
    with LMDBNGramStore(make_config(tmp_path, n_min=2, n_max=2, max_continuations=2)) as store:
        store.apply([(None, [1, 2, 3])] * 3 + [(None, [1, 2, 4])] * 2)
        store.observe([1, 2, 5])
        # {3: 3, 4: 2, 5: 1} ranked and cut to two: 5 is dropped.
        assert list(store.continuations((1, 2)).items()) == [(3, 3), (4, 2)]
        store.apply([(None, [1, 2, 5])] * 3)
        # 5 arrives with 3 in one batch: ties 3 (stored first), beats 4.
        assert list(store.continuations((1, 2)).items()) == [(3, 3), (5, 3)]


def test_counts_saturate_at_uint32_max(tmp_path):
    config = make_config(tmp_path, n_min=2, n_max=2)
    LMDBNGramStore(config).close()
    env = lmdb.open(config.path, max_dbs=4)
    with env.begin(write=True) as txn:  # a count one below the maximum, written in the documented format
        key = NAMESPACE + bytes([2]) + struct.pack(">II", 1, 2)
        txn.put(key, struct.pack(">BIIII", 1, 0, UINT32_MAX - 1, 3, UINT32_MAX - 1), db=env.open_db(b"ngrams", txn=txn))
    env.close()
    with LMDBNGramStore(config) as store:
        store.apply([(None, [1, 2, 3])] * 2)
        assert store.continuations((1, 2)) == {3: UINT32_MAX}


# --- ids, epochs, decay ---------------------------------------------------------------


def test_apply_skips_ids_already_applied_even_after_reopen(tmp_path):
    config = make_config(tmp_path, n_min=2, n_max=2)
    with LMDBNGramStore(config) as store:
        assert store.apply([("a", [1, 2, 3]), ("a", [1, 2, 3]), ("b", [1, 2, 3]), (None, [1, 2, 3])]) == [
            True,
            False,  # the same id earlier in the batch
            True,
            True,  # no id: always counted
        ]
        assert store.apply([("a", [1, 2, 3])]) == [False]
    with LMDBNGramStore(config) as store:
        assert store.apply([("b", [1, 2, 3])]) == [False]
        assert store.continuations((1, 2)) == {3: 3}
        assert store.stats()["applied_ids"] == 2


def test_applied_ids_expire_after_the_window_by_the_clock(tmp_path):
    clock = FakeClock(3600 * 1000 + 10)  # hour 1000
    with LMDBNGramStore(make_config(tmp_path, dedup_window_hours=1, decay_shift_per_epoch=0, clock=clock.now)) as store:
        store.apply([("a", [1, 2, 3])])  # recorded under hour 1000
        store.advance_epoch(50)  # epochs pass: ids stay
        clock.seconds += 3600  # hour 1001: 1000 >= 1001 - 1 is still remembered
        assert store.apply([("a", [1, 2, 3])]) == [False]
        clock.seconds += 3600  # hour 1002: expired at this apply
        assert store.apply([("b", [1, 2, 3])]) == [True]
        assert store.stats()["applied_ids"] == 1
        assert store.apply([("a", [1, 2, 3])]) == [True]


def test_late_retries_on_a_small_table_are_still_recognised(tmp_path):
    # A 1 MiB table spans few tokens per epoch; ids kept by epoch were gone after ~30
    # observations (188 of 200 late retries applied twice). By the clock, none are.
    rng = random.Random(4)
    batches = [(f"obs-{i}", [rng.randrange(5000) for _ in range(100)]) for i in range(200)]
    config = make_config(tmp_path, max_bytes=1 << 20, epoch_observations=1000)
    with LMDBNGramStore(config) as store:
        assert all(store.apply([batch]) == [True] for batch in batches)
        assert store.stats()["epoch"] >= 19
        assert [store.apply([batch]) for batch in batches] == [[False]] * 200


def test_a_format_1_store_is_migrated_and_its_epoch_keyed_ids_dropped(tmp_path, caplog):
    config = make_config(tmp_path, n_min=2, n_max=2)
    with LMDBNGramStore(config) as store:
        store.apply([("a", [1, 2, 3])])
    as_older_format(config.path, 1)
    env = lmdb.open(config.path, max_dbs=4)  # as format 1 left it: ids under epoch 0
    with env.begin(write=True) as txn:
        applied = env.open_db(b"applied", txn=txn)
        txn.drop(applied, delete=False)
        txn.put(struct.pack(">I", 0) + NAMESPACE + b"a", b"", db=applied)
    env.close()
    assert walk_table(config.path) == TableWalk(None, records=8, entries=8, version=1)  # a bigram, its coldness, an id, 5 meta
    with caplog.at_level(logging.WARNING, logger="drafter_service.store"), LMDBNGramStore(config) as store:
        assert "migrated store format 1 to 4 (its observe ids are dropped, a successor table is added: dropped 1 observe ids" in caplog.text
        assert store.continuations((1, 2)) == {3: 1}  # n-grams untouched
        assert store.stats()["applied_ids"] == 0
        assert store.apply([("a", [1, 2, 3])]) == [True]
    assert walk_table(config.path).version == 4
    with LMDBNGramStore(config) as store:  # now format 4: opens as is
        assert store.apply([("a", [1, 2, 3])]) == [False]


def test_epoch_advances_every_epoch_observations_tokens(tmp_path):
    with LMDBNGramStore(make_config(tmp_path, epoch_observations=10)) as store:
        store.observe([1, 2, 3, 4])
        assert (store.stats()["epoch"], store.stats()["epoch_tokens"]) == (0, 4)
        store.apply([("x", [1] * 7)])
        assert (store.stats()["epoch"], store.stats()["epoch_tokens"]) == (1, 1)  # 4 + 7 = 11 = one epoch + 1
        store.apply([("x", [1] * 30)])
        assert (store.stats()["epoch"], store.stats()["epoch_tokens"]) == (1, 1)  # a skipped item counts no tokens
        store.observe([1] * 29)
        assert (store.stats()["epoch"], store.stats()["epoch_tokens"]) == (4, 0)


def test_counts_halve_per_epoch_but_never_below_one(tmp_path):
    with LMDBNGramStore(make_config(tmp_path, n_min=2, n_max=2, decay_shift_per_epoch=1)) as store:
        store.apply([(None, [1, 2, 3])] * 4 + [(None, [1, 2, 4])])
        assert store.continuations((1, 2)) == {3: 4, 4: 1}
        store.advance_epoch()
        assert store.continuations((1, 2)) == {3: 2, 4: 1}  # 1 >> 1 = 0: still worth 1
        store.advance_epoch()
        store.advance_epoch()
        assert store.continuations((1, 2)) == {3: 1, 4: 1}  # readable until evicted
        store.observe([1, 2, 4])
        # Stored {3: 4, 4: 1} is three epochs old: both worth 1 on write, then 4 gains one.
        assert list(store.continuations((1, 2)).items()) == [(4, 2), (3, 1)]


def test_a_batch_that_crosses_an_epoch_boundary_lands_fresh(tmp_path):
    # 8 + 5 tokens with 10 per epoch: the second batch advances the epoch. Merged
    # before that, its count-1 n-grams would be a whole epoch old on arrival.
    with LMDBNGramStore(make_config(tmp_path, n_min=2, n_max=2, epoch_observations=10, decay_shift_per_epoch=1)) as store:
        store.observe([1, 2, 3, 4, 5, 6, 7, 8])
        store.observe([20, 21, 22, 23, 24])
        assert store.stats()["epoch"] == 1
        with store.snapshot() as table:
            assert table.best((21, 22)) == (23, 1, 1)  # stored at the new epoch: the fast path reads it
        assert store.continuations((1, 2)) == {3: 1}  # an epoch old, singletons still draft


# --- eviction and size ----------------------------------------------------------------


def test_eviction_removes_oldest_epoch_then_lowest_total_then_lowest_key(tmp_path):
    config = make_config(tmp_path, n_min=2, n_max=2, decay_shift_per_epoch=0, max_bytes=3 * BYTES_PER_BIGRAM, low_water_fraction=1.0)
    with LMDBNGramStore(config) as store:
        store.observe([1, 2, 3])  # epoch 0
        store.advance_epoch()
        store.observe([4, 5, 6])
        store.apply([(None, [7, 8, 9])] * 2)  # total 2
        assert store.stats()["bytes"] == 3 * BYTES_PER_BIGRAM  # at the ceiling, nothing evicted yet
        store.observe([10, 11, 12])
        assert store.continuations((1, 2)) is None  # oldest epoch
        store.observe([13, 14, 15])
        assert store.continuations((4, 5)) is None  # epoch 1, total 1, key below (10, 11)
        store.observe([16, 17, 18])
        assert store.continuations((10, 11)) is None  # (7, 8) has total 2; (10, 11) < (13, 14) < (16, 17)
        assert contents(store, [(7, 8), (13, 14), (16, 17)]) == {(7, 8): {9: 2}, (13, 14): {15: 1}, (16, 17): {18: 1}}
        assert store.stats()["evictions"] == 3


def test_each_apply_evicts_one_chunk_towards_low_water_and_more_only_above_the_ceiling(tmp_path):
    # Ceiling 3 bigrams, low-water 80 bytes (one bigram), one record per apply.
    config = make_config(tmp_path, n_min=2, n_max=2, max_bytes=3 * BYTES_PER_BIGRAM, low_water_fraction=0.34, eviction_chunk_records=1)
    with LMDBNGramStore(config) as store:
        store.observe([1, 2, 3, 4, 5, 6])  # 4 bigrams: over the ceiling, one eviction suffices
        assert (store.stats()["entries"], store.stats()["evictions"]) == (3, 1)
        store.apply([(None, [])])  # adds nothing, still drains one record towards low-water
        assert (store.stats()["entries"], store.stats()["evictions"]) == (2, 2)
        store.apply([(None, [10, 11, 12, 13, 14, 15, 16])])  # 2 + 5 bigrams: 4 must go, beyond the chunk
        assert (store.stats()["entries"], store.stats()["evictions"]) == (3, 6)


def test_file_stays_bounded_when_fed_far_more_than_max_bytes(tmp_path):
    max_bytes = 256 << 10
    # One epoch per apply, so the newest batch is the warmest and must survive.
    config = make_config(tmp_path, max_bytes=max_bytes, epoch_observations=200, decay_shift_per_epoch=0)
    rng = random.Random(7)
    with LMDBNGramStore(config) as store:
        for _ in range(80):  # 80 * 600 n-grams * ~100 bytes: ~19x max_bytes
            batch = [(None, [rng.randrange(1000) for _ in range(100)]) for _ in range(2)]
            store.apply(batch)
            assert store.stats()["bytes"] <= max_bytes
        stats = store.stats()
        assert stats["evictions"] > 30_000  # most of what was fed was evicted
        assert stats["file_bytes"] <= FILE_BYTES_PER_MAX_BYTE * max_bytes
        for tokens in (tokens for _id, tokens in batch):
            for position in range(4, 100):
                assert tokens[position] in store.continuations(tuple(tokens[position - 4 : position]))


def test_map_full_never_reaches_the_caller(tmp_path, caplog):
    # A 30-item batch of ~900 KB of records cannot fit in a 512 KiB map at once;
    # item by item (each evicting down to 64 KiB), it does.
    config = make_config(tmp_path, max_bytes=64 << 10, map_size=512 << 10, epoch_observations=100, decay_shift_per_epoch=0)
    rng = random.Random(0)
    batch = [(f"item{index}", [rng.randrange(1000) for _ in range(100)]) for index in range(30)]
    with caplog.at_level(logging.WARNING, logger="drafter_service.store"), LMDBNGramStore(config) as store:
        assert store.apply(batch) == [True] * 30
        assert "map full applying 30 items" in caplog.text  # the recovery path did run
        assert store.stats()["bytes"] <= 64 << 10
        last = batch[-1][1]  # applied in the newest epoch, so never evicted
        assert all(last[p] in store.continuations(tuple(last[p - 4 : p])) for p in range(4, 100))
        assert store.apply([batch[-1]]) == [False]


HOLD_A_READER = """
import lmdb, sys, time
env = lmdb.open(sys.argv[1], max_dbs=4, readonly=True, lock=True)
txn = env.begin()  # a snapshot: every page it can see stays out of reuse
print("reading", flush=True)
time.sleep(600)
"""


def test_a_reader_that_pins_pages_gets_observations_refused_never_dropped_or_evicted(tmp_path):
    # Another process's read transaction keeps the writer from reusing pages, so the
    # file grows to the map's size. Observations that then find no room must be
    # refused (StoreFull: the caller retries), never answered as applied or
    # duplicate, and no eviction may cut the table below its bound to make room.
    config = make_config(tmp_path, max_bytes=64 << 10, map_size=1 << 20, epoch_observations=100_000, decay_shift_per_epoch=0)
    rng = random.Random(3)
    with LMDBNGramStore(config) as store:
        store.apply([("warm", [rng.randrange(1000) for _ in range(400)])])  # the table near its bound
        reader = subprocess.Popen([sys.executable, "-c", HOLD_A_READER, config.path], stdout=subprocess.PIPE, text=True)
        try:
            assert reader.stdout.readline() == "reading\n"
            refused = None
            for index in range(400):
                try:
                    assert store.apply([(f"o{index}", [rng.randrange(1000) for _ in range(100)])]) == [True]
                except StoreFull as full:
                    assert full.results == [None]
                    refused = index
                    break
            assert refused is not None, "the pinned map never filled"
            assert store.stats()["bytes"] >= 0.8 * config.max_bytes  # nothing evicted to make room
            reader.send_signal(signal.SIGKILL)
            reader.wait(timeout=10)
            assert store.check_readers() == 1  # the dead reader's slot, freed
            # The refused observation, retried under its id, is stored now.
            assert store.apply([(f"o{refused}", [7, 8, 9, 10, 11])]) == [True]
            assert store.apply([(f"o{refused}", [7, 8, 9, 10, 11])]) == [False]  # and known as applied
        finally:
            reader.kill()
            reader.wait(timeout=10)


# --- persistence, backup, integration, concurrency -----------------------------------------


def test_entries_and_epoch_persist_across_close_and_reopen(tmp_path):
    config = make_config(tmp_path, n_min=2, n_max=3, decay_shift_per_epoch=0)
    keys = [(5, 6), (6, 7), (5, 6, 7), (6, 9)]
    with LMDBNGramStore(config) as store:
        store.apply([("a", [5, 6, 7, 8]), ("b", [5, 6, 9])])
        store.advance_epoch()
        before = store.stats()
    with LMDBNGramStore(config) as store:
        assert contents(store, keys) == {(5, 6): {7: 1, 9: 1}, (6, 7): {8: 1}, (5, 6, 7): {8: 1}, (6, 9): None}
        assert store.stats() == before  # epoch 1, 7 tokens, 2 ids, the same bytes and file
        assert store.apply([("a", [5, 6, 7, 8])]) == [False]


def test_namespaces_in_one_file_do_not_see_each_other(tmp_path):
    with LMDBNGramStore(make_config(tmp_path, n_min=2, n_max=2)) as store:
        store.apply([("same-id", [1, 2, 3])])
    with LMDBNGramStore(make_config(tmp_path, n_min=2, n_max=2, namespace=OTHER_NAMESPACE)) as other:
        assert other.continuations((1, 2)) is None
        assert other.apply([("same-id", [1, 2, 4])]) == [True]  # ids are per namespace too
        assert other.continuations((1, 2)) == {4: 1}
        assert other.stats()["entries"] == 2  # one file: entries of both namespaces
    with LMDBNGramStore(make_config(tmp_path, n_min=2, n_max=2)) as store:
        assert store.continuations((1, 2)) == {3: 1}


def test_backup_is_a_compact_copy_holding_the_same_entries(tmp_path):
    keys = [(1, 2), (2, 3), (3, 1), (1, 2, 3), (2, 3, 1), (3, 1, 2)]
    with LMDBNGramStore(make_config(tmp_path, n_min=2, n_max=3)) as store:
        store.apply([("a", [1, 2, 3, 1, 2, 3]), (None, [3, 1, 2])])
        store.backup(tmp_path / "backup")
        original = contents(store, keys)
        original_stats = store.stats()
    with LMDBNGramStore(StoreConfig(path=str(tmp_path / "backup"), namespace=NAMESPACE, n_min=2, n_max=3)) as copy:
        assert contents(copy, keys) == original
        assert original[(3, 1)] == {2: 2}  # the copy holds real counts, not just Nones
        assert copy.apply([("a", [7, 8, 9])]) == [False]  # applied ids are copied too
        assert copy.stats()["bytes"] == original_stats["bytes"]
        assert copy.stats()["file_bytes"] <= original_stats["file_bytes"]


def test_the_store_serves_as_the_drafters_global_table_after_reopen(tmp_path):
    config = make_config(tmp_path)  # n_min=2, n_max=4, as NGramConfig's defaults
    with LMDBNGramStore(config) as store:
        drafter = NGramDrafter(NGramConfig(), global_table=store)
        drafter.open("first", [1, 2, 3, 4, 5, 6])
        drafter.close("first")  # observes [1..6] into the store
    with LMDBNGramStore(config) as store:
        drafter = NGramDrafter(NGramConfig(), global_table=store)
        drafter.open("second", [1, 2, 3, 4])
        draft = drafter.propose("second", [], k=3)
    # (1, 2, 3, 4) -> 5 and (2, 3, 4, 5) -> 6 are 4-token matches, trusted at
    # count 1; (3, 4, 5, 6) was never followed by anything, so the chain stops.
    assert draft.tokens == [5, 6]
    assert [why.source for why in draft.evidence] == [SOURCE_GLOBAL, SOURCE_GLOBAL]


def test_readers_see_only_committed_counts_while_a_writer_applies(tmp_path):
    writes = 30
    with LMDBNGramStore(make_config(tmp_path, n_min=2, n_max=2)) as store:
        done = threading.Event()
        seen: list[list[int]] = [[] for _ in range(4)]

        def read(log: list[int]) -> None:
            while not done.is_set():
                counts = store.continuations((1, 2))
                log.append(0 if counts is None else counts[3])

        readers = [threading.Thread(target=read, args=(log,)) for log in seen]
        for reader in readers:
            reader.start()
        for _ in range(writes):
            store.observe([1, 2, 3])
        done.set()
        for reader in readers:
            reader.join()
        assert store.continuations((1, 2)) == {3: writes}
    for log in seen:
        assert log == sorted(log) and set(log) <= set(range(writes + 1))  # never backwards, never torn
    assert any(0 < count < writes for log in seen for count in log)  # reads did overlap the writes


# --- kill -9 --------------------------------------------------------------------------


def crash_batch(index: int) -> list[tuple[str, list[int]]]:
    """Batch ``index``: 5 items of 20 tokens, no token shared with another batch."""
    return [(f"batch{index}-item{item}", [index * 1000 + item * 100 + t for t in range(20)]) for item in range(5)]


CRASH_STORE = dict(namespace=b"crashns0", n_min=2, n_max=4, max_bytes=64 << 20, epoch_observations=10**9)

CHILD = """
import sys
from drafter_service.store import LMDBNGramStore, StoreConfig
{batch_source}
store = LMDBNGramStore(StoreConfig(path=sys.argv[1], **{store}))
for index in range(int(sys.argv[2]), 10**6):
    store.apply(crash_batch(index))
    print(index, flush=True)
"""


def batch_presence(store: LMDBNGramStore, index: int) -> set[bool]:
    """{True} if every n-gram of the batch is stored exactly once, {False} if none is."""
    present = set()
    for _id, tokens in crash_batch(index):
        for position in range(2, len(tokens)):
            counts = store.continuations(tuple(tokens[position - 2 : position]))
            assert counts in (None, {tokens[position]: 1}), f"batch {index} counted {counts}"
            present.add(counts is not None)
    return present


def test_every_acknowledged_batch_survives_kill_9(tmp_path):
    path = str(tmp_path / "store")
    child = CHILD.format(batch_source=inspect.getsource(crash_batch), store=CRASH_STORE)
    rng = random.Random(1234)
    next_index = 0
    for _kill in range(5):
        process = subprocess.Popen([sys.executable, "-c", child, path, str(next_index)], stdout=subprocess.PIPE, text=True)
        acknowledged = [int(process.stdout.readline()) for _ in range(rng.randint(1, 8))]
        threading.Event().wait(rng.uniform(0.0, 0.01))  # land anywhere inside a later apply
        process.send_signal(signal.SIGKILL)
        acknowledged += [int(line) for line in process.stdout.read().split()]
        process.wait()
        with LMDBNGramStore(StoreConfig(path=path, **CRASH_STORE)) as store:  # no repair step
            for index in range(acknowledged[-1] + 1):
                assert batch_presence(store, index) == {True}, f"acknowledged batch {index} lost"
            in_flight = acknowledged[-1] + 1
            committed = batch_presence(store, in_flight)
            assert committed in ({True}, {False})  # atomic: all of the batch or none of it
            # The client retries the unacknowledged batch: counted once either way.
            assert store.apply(crash_batch(in_flight)) == [committed == {False}] * 5
            assert batch_presence(store, in_flight) == {True}
        next_index = in_flight + 1


# --- the model: an executable spec of the module docstring ------------------------------


class FakeClock:
    def __init__(self, seconds: float = 1_800_000_000.0) -> None:
        self.seconds = seconds

    def now(self) -> float:
        return self.seconds


class StoreModel:
    """The documented semantics on plain dicts, for one namespace (record sizes from the docstring)."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.epoch = 0
        self.epoch_tokens = 0
        self.evictions = 0
        self.ngrams: dict[tuple[int, ...], tuple[int, list[tuple[int, int]]]] = {}  # key -> (last-touched, pairs)
        self.applied: dict[str, int] = {}  # id -> epoch applied

    def tracked_bytes(self) -> int:
        total = 0
        for key, (_epoch, pairs) in self.ngrams.items():
            key_bytes = 9 + 4 * len(key)
            total += key_bytes + 9 + 8 * len(pairs) + 10  # ngrams record
            total += 8 + key_bytes + 10  # coldness record
        return total + sum(4 + 8 + len(observe_id.encode()) + 10 for observe_id in self.applied)

    def decayed(self, pairs, age):
        shift = age * self.config.decay_shift_per_epoch
        return [(token, max(1, count >> shift)) for token, count in pairs]

    def continuations(self, key):
        if key not in self.ngrams:
            return None
        last_touched, pairs = self.ngrams[key]
        return dict(self.decayed(pairs, self.epoch - last_touched))

    def apply(self, batch) -> list[bool]:
        if not batch:
            return []  # an empty batch is no apply: no transaction, no eviction
        hour = int(self.config.clock() // 3600)
        cutoff = hour - self.config.dedup_window_hours
        self.applied = {observe_id: applied for observe_id, applied in self.applied.items() if applied >= cutoff}
        results, fresh = [], []
        for observe_id, tokens in batch:
            new = observe_id is None or observe_id not in self.applied
            if observe_id is not None and new:
                self.applied[observe_id] = hour
            results.append(new)
            if new:
                fresh.append(tokens)
        epochs, self.epoch_tokens = divmod(self.epoch_tokens + sum(map(len, fresh)), self.config.epoch_observations)
        if epochs:
            self.advance_epoch(epochs)
        for key, additions in self.count(fresh).items():
            self.merge(key, additions)
        self.evict()
        return results

    def count(self, sequences):
        counts: dict[tuple[int, ...], dict[int, int]] = {}
        for tokens in sequences:  # each one call: a pair counts once in it
            pairs = {}  # ordered: first seen first
            for position in range(1, len(tokens)):
                for n in range(self.config.n_min, min(self.config.n_max, position) + 1):
                    pairs[(tuple(tokens[position - n : position]), tokens[position])] = None
            for key, token in pairs:
                following = counts.setdefault(key, {})
                following[token] = following.get(token, 0) + 1
        return counts

    def merge(self, key, additions) -> None:
        last_touched, pairs = self.ngrams.get(key, (self.epoch, []))
        merged = dict(self.decayed(pairs, self.epoch - last_touched))
        for token, count in additions.items():
            merged[token] = min(UINT32_MAX, merged.get(token, 0) + count)
        ranked = sorted(merged.items(), key=lambda pair: -pair[1])
        self.ngrams[key] = (self.epoch, ranked[: self.config.max_continuations])

    def advance_epoch(self, epochs: int) -> None:
        self.epoch += epochs

    def evict(self) -> None:
        def coldness(key):
            last_touched, pairs = self.ngrams[key]
            return (last_touched, min(UINT32_MAX, sum(count for _token, count in pairs)), len(key), key)

        removed = 0
        while self.tracked_bytes() > self.config.low_water_bytes and (
            removed < self.config.eviction_chunk_records or self.tracked_bytes() > self.config.high_water_bytes
        ):
            if self.ngrams:
                del self.ngrams[min(self.ngrams, key=coldness)]
            else:
                del self.applied[min(self.applied, key=lambda i: (self.applied[i], i.encode()))]
            removed += 1
        self.evictions += removed


TOKENS = st.lists(st.integers(0, 5), max_size=8)
IDS = st.one_of(st.none(), st.sampled_from(["a", "b", "c", "d"]))


class StoreMatchesModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.directory = tempfile.mkdtemp(prefix="store-machine-")
        self.clock = FakeClock()
        # ~15 bigrams fit; every path of the eviction rule is reachable.
        self.config = StoreConfig(
            path=self.directory,
            namespace=NAMESPACE,
            n_min=1,
            n_max=3,
            max_bytes=1500,
            high_water_fraction=0.9,
            low_water_fraction=0.6,
            eviction_chunk_records=3,
            max_continuations=2,
            epoch_observations=15,
            decay_shift_per_epoch=1,
            dedup_window_hours=1,
            clock=self.clock.now,
        )
        self.store = LMDBNGramStore(self.config)
        self.model = StoreModel(self.config)
        self.keys_ever_written: set[tuple[int, ...]] = set()

    def remember(self, sequences) -> None:
        self.keys_ever_written.update(self.model.count(sequences))

    @rule(tokens=TOKENS)
    def observe(self, tokens):
        self.store.observe(tokens)
        self.model.apply([(None, tokens)])
        self.remember([tokens])

    @rule(batch=st.lists(st.tuples(IDS, TOKENS), max_size=4))
    def apply(self, batch):
        assert self.store.apply(batch) == self.model.apply(batch)
        self.remember([tokens for _id, tokens in batch])

    @rule()
    def reopen(self):
        self.store.close()
        self.store = LMDBNGramStore(self.config)

    @rule(hours=st.integers(1, 2))
    def pass_time(self, hours):
        self.clock.seconds += hours * 3600

    @rule(epochs=st.integers(1, 2))
    def advance_epoch(self, epochs):
        self.store.advance_epoch(epochs)
        self.model.advance_epoch(epochs)

    @invariant()
    def continuations_agree(self):
        for key in self.keys_ever_written:
            expected = self.model.continuations(key)
            actual = self.store.continuations(key)
            assert actual == expected and (actual is None or list(actual.items()) == list(expected.items())), key

    @invariant()
    def bookkeeping_agrees_and_size_is_bounded(self):
        stats = self.store.stats()
        assert stats["bytes"] == self.model.tracked_bytes() <= self.config.high_water_bytes
        assert (stats["entries"], stats["applied_ids"]) == (len(self.model.ngrams), len(self.model.applied))
        assert (stats["epoch"], stats["epoch_tokens"]) == (self.model.epoch, self.model.epoch_tokens)
        assert stats["evictions"] == self.model.evictions

    def teardown(self):
        self.store.close()
        shutil.rmtree(self.directory, ignore_errors=True)


StoreMatchesModel.TestCase.settings = settings(max_examples=50, stateful_step_count=30, deadline=None)
TestStoreMatchesModel = StoreMatchesModel.TestCase


# --- corruption and closing --------------------------------------------------------------


def test_corruption_is_lmdbs_damaged_page_errors_and_undecodable_records():
    damaged = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.BadTxnError, StoreFormatError)
    assert all(is_corruption(error("x")) for error in damaged)
    # A full map, a full disk, a caller's oversized key, a failed meta write, a closed store: none says the file is damaged.
    others = (lmdb.MapFullError, lmdb.DiskError, lmdb.BadValsizeError, lmdb.PanicError, StoreClosed, ValueError)
    assert not any(is_corruption(error("x")) for error in others)


def test_a_store_reports_a_damaged_record_to_its_owner_before_its_caller_hears(tmp_path):
    config = make_config(tmp_path, n_min=2, n_max=2)
    LMDBNGramStore(config).close()
    put_ngram_value(config, (1, 2), struct.pack(">BIIII", 9, 0, 1, 3, 1))
    reports = []
    with LMDBNGramStore(config, on_corruption=lambda store, error: reports.append(type(error))) as store:
        with pytest.raises(StoreFormatError):  # the owner let it serve on: the error itself
            store.continuations((1, 2))
        assert reports == [StoreFormatError]
        store.on_corruption = lambda store, error: store.retire("was set aside")
        with pytest.raises(StoreCorrupted, match=r"is damaged \(StoreFormatError: n-gram value has version 9"):
            store.continuations((1, 2))
        with pytest.raises(StoreClosed, match="was set aside$"):
            store.observe([4, 5, 6])  # refused, nothing written


def test_a_closed_store_refuses_every_call(tmp_path):
    store = LMDBNGramStore(make_config(tmp_path))
    store.close()
    store.close()  # idempotent
    for call in (store.stats, lambda: store.observe([1, 2, 3]), lambda: store.continuations((1, 2)), store.check_readers):
        with pytest.raises(StoreClosed, match="is closed$"):
            call()
