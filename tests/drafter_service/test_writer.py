"""The writer's rules that tenants rely on: one call counts each n-gram once, however its
parts are committed."""

from __future__ import annotations

import pytest

from drafter_service.storage import DiskSpace
from drafter_service.store import ApplyItem, LMDBNGramStore, StoreConfig, first_occurrences
from drafter_service.writer import CHUNK_TOKENS, ObservationWriter, _Pending

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
