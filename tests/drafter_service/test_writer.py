"""The writer's rules that tenants rely on: one call counts each n-gram once, however its
parts are committed; each transaction serves the tables waiting round-robin; and one table
holds only its share of the queue."""

from __future__ import annotations

from collections import deque

import pytest

from drafter_service.storage import DiskSpace
from drafter_service.store import ApplyItem, LMDBNGramStore, StoreConfig, first_occurrences
from drafter_service.writer import CHUNK_TOKENS, WRITE_BATCH_TOKENS, ObservationWriter, WriteQueueFull, _Pending, next_group

NAMESPACE = b"testvoc0"


@pytest.fixture
def tables(tmp_path):
    """Two tables (two scopes), n-grams of 4 only."""
    stores = [LMDBNGramStore(StoreConfig(path=str(tmp_path / name), namespace=NAMESPACE, n_min=4, n_max=4)) for name in "ab"]
    yield stores
    for store in stores:
        store.close()


def commit(writer: ObservationWriter, items: list[_Pending]) -> None:
    """Submit one call's items and wait until each is stored."""
    writer.submit(items)
    for item in items:
        assert item.done.wait(60) and item.error is None, item.error


# -- one vote per call ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "sequences",
    [
        [[1, 2, 3, 4, 9] * 50],  # 50 copies in one sequence
        [[1, 2, 3, 4, 9]] * 50,  # the same in 50 sequences
        [[1, 2, 3, 4, 9] * 200] * 20,  # 20,000 tokens: parts in several transactions
        [[1, 2, 3, 4, 9] * (CHUNK_TOKENS // 2)],  # one sequence in chunks, in several transactions
    ],
    ids=["one sequence", "50 sequences", "several transactions", "chunks"],
)
def test_one_call_counts_an_n_gram_once_and_two_calls_twice(tmp_path, tables, sequences):
    store = tables[0]
    writer = ObservationWriter(4096, DiskSpace(str(tmp_path), 0))
    writer.start()
    try:
        commit(writer, [_Pending(store, f"call-1/{i}", tokens) for i, tokens in enumerate(sequences)])
        assert store.continuations((1, 2, 3, 4)) == {9: 1}
        commit(writer, [_Pending(store, f"call-2/{i}", tokens) for i, tokens in enumerate(sequences)])
        assert store.continuations((1, 2, 3, 4)) == {9: 2}
    finally:
        writer.stop()


def test_a_retried_call_counts_only_the_pairs_first_seen_in_the_parts_not_yet_stored(tables):
    store = tables[0]
    first, second = [1, 2, 3, 4, 9], [1, 2, 3, 4, 9, 1, 2, 3, 4, 7]
    # As if the call's first part had been stored, and the call then cut short.
    store.apply([ApplyItem("o/0", first, 0, first_occurrences([first, second], 4, 4)[0])])
    writer = ObservationWriter(16, DiskSpace(store.config.path, 0))
    writer.start()
    try:
        retry = [_Pending(store, "o/0", first), _Pending(store, "o/1", second)]
        commit(writer, retry)
        assert not retry[0].applied and retry[1].applied  # the first part: skipped as stored
        assert store.continuations((1, 2, 3, 4)) == {9: 1, 7: 1}  # 9 was the first part's vote
    finally:
        writer.stop()


# -- each transaction serves the tables round-robin ------------------------------------------


def test_a_table_with_one_item_waiting_is_in_the_first_group_beside_a_flooding_table(tables):
    a, b = tables
    flood = [_Pending(a, f"a-{i}/0", [i] * 200) for i in range(100)]  # 20,000 tokens, queued first
    waiting = deque([*flood, _Pending(b, "b/0", [7] * 200)])
    group = next_group(waiting)
    assert [item.store for item, _ in group[:2]] == [a, b]  # B's first item right after A's first
    assert sum(min(len(item.tokens), CHUNK_TOKENS) for item, _ in group) <= WRITE_BATCH_TOKENS
    assert len(waiting) == 101 - len(group) and waiting[0] is flood[len(group) - 1]  # the rest keep their place


def test_a_table_whose_item_did_not_fit_leads_the_next_group(tmp_path, tables):
    a, b = tables
    with LMDBNGramStore(StoreConfig(path=str(tmp_path / "c"), namespace=NAMESPACE)) as c:
        full = CHUNK_TOKENS  # two of them fill a transaction
        waiting = deque([_Pending(a, f"a-{i}/0", [1] * full) for i in range(3)])
        waiting += [_Pending(b, "b/0", [2] * full), _Pending(c, "c/0", [3] * full)]
        turns: dict = {}
        first = next_group(waiting, turns)
        assert [item.store for item, _ in first] == [a, b]
        second = next_group(waiting, turns)
        assert [item.store for item, _ in second] == [c, a]  # C waited a turn; A's queue came before C's item


# -- each table holds only its share of the queue ----------------------------------------------


def test_a_table_beyond_its_share_of_the_queue_is_refused_while_another_is_accepted(tmp_path, tables):
    a, b = tables
    writer = ObservationWriter(100, DiskSpace(str(tmp_path), 0), max_pending_tokens=1000)  # never started: nothing drains
    assert (writer.max_pending_tokens_per_table, writer.max_pending_per_table) == (250, 25)  # a quarter by default
    writer.submit([_Pending(a, "a-1/0", [1] * 200)])
    refusal = r"\(200 tokens queued for its table, this call adds 100, --max-pending-write-tokens-per-scope 250\)"
    with pytest.raises(WriteQueueFull, match=refusal):
        writer.submit([_Pending(a, "a-2/0", [1] * 100)])
    with pytest.raises(WriteQueueFull, match=r"this call adds 25, --max-pending-observations-per-scope 25\)"):
        writer.submit([_Pending(a, f"a-3/{i}", [1]) for i in range(25)])
    writer.submit([_Pending(b, "b-1/0", [1] * 200)])  # another table: its own share
    writer.submit([_Pending(a, "a-4/0", [1] * 50)])  # what fits A's share still goes in
    assert (writer.pending, writer.pending_tokens) == (3, 450)


def test_a_tables_share_comes_back_as_its_items_are_stored(tmp_path, tables):
    a, _ = tables
    writer = ObservationWriter(100, DiskSpace(str(tmp_path), 0), max_pending_tokens_per_table=300)
    writer.start()
    try:
        for call in range(5):  # 5 x 200 tokens: more than the share, one call at a time
            commit(writer, [_Pending(a, f"a-{call}/0", [call] * 200)])
        assert (writer.pending, writer.pending_tokens) == (0, 0)
    finally:
        writer.stop()


def test_a_tables_prediction_flood_does_not_drop_another_tables_predictions(tmp_path, tables):
    a, b = tables
    writer = ObservationWriter(16, DiskSpace(str(tmp_path), 0), max_pending_successors=8)  # a quarter: 2 keys per table
    writer.submit_successors(a, [((token,), (1,)) for token in range(5)])
    writer.submit_successors(b, [((5,), (6,)), ((7,), (8,))])
    assert writer.dropped_successors == 3  # A's beyond its 2, none of B's
    writer.start()
    try:
        writer.stop()  # stores what is pending first
    finally:
        assert not writer.is_alive()
    assert (b.successors((5,)), b.successors((7,))) == ((6,), (8,))
    assert [a.successors((token,)) for token in range(5)] == [(1,), (1,), None, None, None]
    assert writer.stored_successors == 4
