"""The successor table: the target's own predictions, kept by the drafter in LMDB beside the
n-gram table, written by the one writer, drafted from where n-grams have nothing."""

from __future__ import annotations

import logging
import random
import time

import grpc
import pytest
from test_hostile_callers import aborted, running  # noqa: F401  (a fixture)
from test_servicer_overload import VOCABULARY, FakeContext
from test_store import as_older_format

from drafter_service.ngram import SOURCE_CONTEXT, SOURCE_GLOBAL, SOURCE_SUCCESSOR, Evidence, InMemoryNGramTable, NGramConfig, propose_tree
from drafter_service.sessions import ContextIndex
from drafter_service.storage import DiskSpace
from drafter_service.store import LMDBNGramStore, StoreConfig
from drafter_service.table_check import TableWalk, walk_table
from drafter_service.writer import ObservationWriter
from specdec.v1 import drafter_pb2 as pb

NAMESPACE = b"testvoc0"


def make_store(tmp_path, **overrides) -> LMDBNGramStore:
    return LMDBNGramStore(StoreConfig(path=str(tmp_path / "store"), namespace=NAMESPACE, **overrides))


# -- the store ---------------------------------------------------------------------------


def test_the_newest_predictions_replace_the_old_and_survive_a_reopen(tmp_path):
    with make_store(tmp_path) as store:
        assert store.record_successors([((5,), (1, 2, 3)), ((4, 5), (2, 1))]) == 2
        assert store.successors((5,)) == (1, 2, 3) and store.successors((4, 5)) == (2, 1)
        store.record_successors([((5,), (9,))])
        assert store.successors((5,)) == (9,)
        assert store.successors((6,)) is None and store.successors((1, 2, 3)) is None
        assert store.stats()["successor_entries"] == 2
    with make_store(tmp_path) as store:  # committed: durable
        assert store.successors((5,)) == (9,)
    assert walk_table(store.config.path).problem is None


def held(store, keys):
    return [key for key in keys if store.successors(key) is not None]


def test_a_full_table_keeps_taking_new_keys_and_evicts_the_least_recently_written(tmp_path):
    # Was: once full, new keys were refused for good, so a client that filled the table
    # with made-up keys froze it. Bound 4: each call is a tick of its own (4 // 256 < 1).
    with make_store(tmp_path, max_successor_entries=4) as store:
        for token in (1, 2, 3, 4):
            assert store.record_successors([((token,), (7,))]) == 1
        assert store.record_successors([((5,), (8,)), ((6,), (8,))]) == 2
        assert held(store, [(t,) for t in range(1, 7)]) == [(3,), (4,), (5,), (6,)]  # 1 and 2 were the oldest
        store.record_successors([((3,), (9,))])  # rewritten: now the newest
        store.record_successors([((7,), (8,))])
        assert held(store, [(t,) for t in range(1, 8)]) == [(3,), (5,), (6,), (7,)]  # 4 went, not 3
        assert store.successors((3,)) == (9,)
        stats = store.stats()
        assert (stats["successor_entries"], stats["successor_evictions"]) == (4, 3)
    assert walk_table(store.config.path).problem is None


def test_a_call_with_more_keys_than_the_bound_keeps_its_newest_and_evicts_none_of_them(tmp_path):
    with make_store(tmp_path, max_successor_entries=3) as store:
        store.record_successors([((1,), (7,)), ((2,), (7,))])
        # Five keys, (2,) among them: the last three stay, and the held (1,) and (2,) make room.
        assert store.record_successors([((2,), (8,)), ((3,), (8,)), ((4,), (8,)), ((5,), (8,)), ((6,), (8,))]) == 3
        assert held(store, [(t,) for t in range(1, 7)]) == [(4,), (5,), (6,)]
        assert store.stats()["successor_evictions"] == 2


def test_within_its_tick_a_rewritten_key_keeps_its_place_and_the_bound_holds_after_every_call(tmp_path):
    rng = random.Random(3)
    # Bound 512: two keys per tick, so rewrites within a tick leave the index alone.
    with make_store(tmp_path, max_successor_entries=512) as store:
        assert store.config.successor_writes_per_tick == 2
        for _ in range(200):
            updates = [((rng.randrange(400), rng.randrange(400)), (rng.randrange(50),)) for _ in range(rng.randrange(1, 40))]
            store.record_successors(updates)
            assert store.stats()["successor_entries"] <= 512
        assert store.stats()["successor_evictions"] > 0
        last = updates[-1]
        assert store.successors(last[0]) == last[1]  # the newest call's keys are all held
    assert walk_table(store.config.path).problem is None


def test_a_table_reopened_under_a_smaller_bound_is_trimmed_oldest_first(tmp_path):
    with make_store(tmp_path, max_successor_entries=8) as store:
        for token in range(8):
            store.record_successors([((token,), (1,))])
    with make_store(tmp_path, max_successor_entries=3, eviction_chunk_records=2) as store:  # trimmed in three transactions
        assert held(store, [(t,) for t in range(8)]) == [(5,), (6,), (7,)]
        assert store.stats()["successor_evictions"] == 5
    assert walk_table(store.config.path).problem is None


@pytest.mark.parametrize("key, tokens", [((1, 2, 3), (4,)), ((1,), ()), ((1,), tuple(range(17))), ((1 << 32,), (4,))])
def test_what_the_table_cannot_hold_is_refused_whole(tmp_path, key, tokens):
    with make_store(tmp_path) as store:
        with pytest.raises(ValueError):
            store.record_successors([((9,), (1,)), (key, tokens)])
        assert store.successors((9,)) is None


def test_a_format_2_table_is_migrated_and_keeps_its_n_grams(tmp_path, caplog):
    with make_store(tmp_path, n_min=2, n_max=2) as store:
        store.observe([1, 2, 3])
        path = store.config.path
    as_older_format(path, 2)
    assert walk_table(path).version == 2 and walk_table(path).problem is None
    with caplog.at_level(logging.INFO, logger="drafter_service.store"), make_store(tmp_path, n_min=2, n_max=2) as store:
        assert "migrated store format 2 to 4 (a successor table is added" in caplog.text
        assert store.continuations((1, 2)) == {3: 1}
        store.record_successors([((3,), (4,))])
    assert walk_table(path).version == 4 and walk_table(path).problem is None


def test_a_format_3_table_is_migrated_keeping_every_record_each_older_than_any_written_since(tmp_path, caplog):
    with make_store(tmp_path, n_min=2, n_max=2, max_successor_entries=3) as store:
        store.observe([1, 2, 3])
        store.record_successors([((5,), (1, 2, 3)), ((4, 5), (2, 1)), ((6,), (9,))])
        path = store.config.path
    as_older_format(path, 3)  # version 1 values, no stamps, no successor_recency
    assert walk_table(path) == TableWalk(None, records=10, entries=10, version=3)  # 1 n-gram, its coldness, 3 successors, 5 meta
    logs = caplog.at_level(logging.INFO, logger="drafter_service.store")
    with logs, make_store(tmp_path, n_min=2, n_max=2, max_successor_entries=3) as store:
        assert "migrated store format 3 to 4 (each successor record is stamped as the oldest" in caplog.text
        assert "stamped 3 successor records" in caplog.text
        assert (store.successors((5,)), store.successors((4, 5)), store.successors((6,))) == ((1, 2, 3), (2, 1), (9,))
        assert store.continuations((1, 2)) == {3: 1}
        # The records written under format 3 are the oldest: (5,), rewritten now, outlives them
        # when two new keys need room in a table of 3.
        store.record_successors([((5,), (7,))])
        store.record_successors([((8,), (1,)), ((9,), (1,))])
        assert held(store, [(4, 5), (5,), (6,), (8,), (9,)]) == [(5,), (8,), (9,)]
        assert store.successors((5,)) == (7,)
    walk = walk_table(path)
    # (1, 2) and its coldness entry, 3 records, their 3 recency entries, 8 meta records.
    assert (walk.problem, walk.version, walk.entries) == (None, 4, 2 + 3 + 3 + 8)


def test_a_backup_holds_the_successor_table(tmp_path):
    with make_store(tmp_path) as store:
        store.record_successors([((5,), (6, 7))])
        store.backup(tmp_path / "copy")
    with LMDBNGramStore(StoreConfig(path=str(tmp_path / "copy"), namespace=NAMESPACE)) as copy:
        assert copy.successors((5,)) == (6, 7)


# -- the writer ---------------------------------------------------------------------------


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the writer never stored it"
        time.sleep(0.01)


def test_the_writer_stores_predictions_and_drops_keys_beyond_its_bound(tmp_path):
    writer = ObservationWriter(16, DiskSpace(str(tmp_path), 0), max_pending_successors=2, max_pending_successors_per_table=2)
    with make_store(tmp_path) as store:
        writer.submit_successors(store, [((1,), (2,)), ((1,), (3,)), ((4,), (5,)), ((6,), (7,))])  # (1,) twice: the newest kept
        assert writer.dropped_successors == 1  # (6,): a third key while two wait
        writer.start()
        try:
            wait_for(lambda: store.successors((4,)) == (5,))
            assert store.successors((1,)) == (3,) and store.successors((6,)) is None
            writer.submit_successors(store, [((6,), (7,))])  # room again once stored
            wait_for(lambda: store.successors((6,)) == (7,))
        finally:
            writer.stop()
        assert writer.stored_successors == 3


# -- drafting ------------------------------------------------------------------------------


def test_where_n_grams_find_nothing_the_tree_is_the_targets_own_predictions():
    config = NGramConfig()
    table = InMemoryNGramTable(config.n_min, config.n_max)
    table.record_successors([((8, 9), (10, 11)), ((10,), (12,)), ((9, 10), (13, 14))])
    index = ContextIndex(config)
    index.extend([1, 2, 8, 9])  # no n-gram of it repeats
    sources = ((SOURCE_CONTEXT, index), (SOURCE_GLOBAL, table))
    draft = propose_tree(index.tokens, sources, k=3, max_nodes=8, config=config)
    # The chain: (8, 9) -> 10, then (9, 10) -> 13, then (10, 13) unknown, (13,) unknown: it stops.
    # Branches: 11 beside 10 (with its own chain: (9, 11), (11,) unknown), 14 beside 13.
    assert draft.tokens == [10, 13, 11, 14]
    assert draft.parents == [-1, 0, -1, 0]
    assert draft.evidence[0] == Evidence(SOURCE_SUCCESSOR, 2, 2, 2)  # the top prediction of two
    assert draft.evidence[2] == Evidence(SOURCE_SUCCESSOR, 2, 1, 2)


def test_an_n_gram_chain_continues_from_the_successor_table_where_it_stops():
    config = NGramConfig(n_min=2, n_max=2)
    table = InMemoryNGramTable(2, 2)
    for _ in range(2):  # seen twice: trusted (min_global_count)
        table.observe([1, 2, 3, 4])
    table.record_successors([((3, 4), (30,)), ((30,), (31,))])
    index = ContextIndex(config)
    index.extend([7, 1, 2])  # the global table goes (1, 2) -> 3 -> 4, then knows no more
    draft = propose_tree(index.tokens, ((SOURCE_CONTEXT, index), (SOURCE_GLOBAL, table)), k=4, max_nodes=4, config=config)
    assert draft.tokens == [3, 4, 30, 31]  # (4, 30) is not held: (30,) is
    assert [evidence.source for evidence in draft.evidence] == [SOURCE_GLOBAL, SOURCE_GLOBAL, SOURCE_SUCCESSOR, SOURCE_SUCCESSOR]
    assert [evidence.match_length for evidence in draft.evidence[2:]] == [2, 1]


# -- through the servicer ------------------------------------------------------------------


def update_with_predictions(session_id, tokens, predictions, open_=True, k=4, nodes=8):
    return pb.SequenceUpdate(
        session_id=session_id, new_tokens=tokens, open=open_, num_draft_tokens=k, max_tree_nodes=nodes, predictions=predictions
    )


def propose(servicer, *updates, certificate=None):
    return servicer.Propose(pb.ProposeRequest(vocabulary=VOCABULARY, sequences=list(updates)), FakeContext(certificate=certificate))


def test_predictions_sent_by_one_caller_draft_for_another(running):  # noqa: F811
    servicer, stores = running
    predictions = pb.Predictions(k=2, previous=[40, 41], current=[41, 42], tokens=[42, 50, 43, 51])
    propose(servicer, update_with_predictions("a", [40, 41], predictions), certificate="one")
    wait_for(lambda: stores.find(VOCABULARY) is not None and stores.find(VOCABULARY).successors((41, 42)) == (43, 51))
    draft = propose(servicer, update_with_predictions("b", [7, 40, 41], None), certificate="two").drafts[0]
    assert list(draft.tokens[:2]) == [42, 43] and list(draft.sources[:2]) == [pb.DRAFT_SOURCE_SUCCESSOR] * 2
    # Counted as the successor table's, in Stats and in the metrics, not as the global table's.
    successor_tokens = list(draft.sources).count(pb.DRAFT_SOURCE_SUCCESSOR)
    stats = servicer.Stats(pb.StatsRequest(), FakeContext())
    # Two positions, each keyed by (current,) and (previous, current): (41,), (40, 41), (42,), (41, 42).
    assert (stats.successor_hits, stats.successor_entries) == (successor_tokens, 4)
    assert stats.global_hits == list(draft.sources).count(pb.DRAFT_SOURCE_GLOBAL)
    registry = servicer.registry
    assert registry.get_sample_value("specdec_drafter_proposed_tokens_total", {"source": "successor"}) == successor_tokens
    assert registry.get_sample_value("specdec_drafter_table_successor_entries", {"vocabulary": VOCABULARY}) == 4


@pytest.mark.parametrize(
    "predictions, message",
    [
        (pb.Predictions(k=0, previous=[1], current=[2], tokens=[]), "k 0 is out of range [1, 16]"),
        (pb.Predictions(k=17, previous=[1], current=[2], tokens=[3] * 17), "k 17 is out of range [1, 16]"),
        (pb.Predictions(k=2, previous=[1], current=[2], tokens=[3]), "1 previous and 1 tokens for 1 positions of k 2 (need 1 and 2)"),
        (pb.Predictions(k=1, previous=[], current=[2], tokens=[3]), "0 previous and 1 tokens for 1 positions"),
        (pb.Predictions(k=1, previous=[1], current=[2], tokens=[1 << 25]), "predictions.tokens: token id 33554432 is out of range"),
        (pb.Predictions(k=1, previous=[1] * 1025, current=[2] * 1025, tokens=[3] * 1025), "1025 positions, more than 1024"),
    ],
    ids=["k 0", "k 17", "short tokens", "short previous", "bad id", "too many"],
)
def test_malformed_predictions_are_invalid_argument_naming_the_field(running, predictions, message):  # noqa: F811
    servicer, _ = running
    request = pb.ProposeRequest(vocabulary=VOCABULARY, sequences=[update_with_predictions("s", [1, 2], predictions)])
    context = aborted(servicer.Propose, request, FakeContext())
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT
    assert context.details.startswith("sequences[0].predictions") and message in context.details


def test_the_check_says_what_opening_an_older_table_will_do():
    from drafter_service.check import verdict

    assert "migrates it to 4 when it opens it (a successor table is added), 11 records" in verdict("t", TableWalk(None, 11, 11, 2))
    assert "(its observe ids are dropped" in verdict("t", TableWalk(None, 11, 11, 1))
    assert verdict("t", TableWalk(None, 11, 11, 4)) == "t: ok, format 4 (current), 11 records"
