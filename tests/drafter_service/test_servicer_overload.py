"""DrafterServicer in-process: overload paths that a live server makes hard to reach on purpose."""

from __future__ import annotations

import random
import time
from contextlib import contextmanager

import grpc
import pytest

from drafter_service.config import DrafterConfig
from drafter_service.server import DrafterServicer
from drafter_service.storage import StoreRegistry
from drafter_service.store import LMDBNGramStore, StoreConfig, StoreFull
from drafter_service.writer import CHUNK_TOKENS, ObservationWriter, WriteQueueFull, _Pending
from specdec.v1 import drafter_pb2 as pb

VOCABULARY = "00112233445566aa"


class Aborted(Exception):
    pass


class FakeContext:
    def __init__(
        self, peer: str = "ipv4:10.0.0.7:51234", remaining: float | None = None, certificate: str | None = None, token: str | None = None
    ) -> None:
        self._peer = peer
        self._metadata = () if token is None else (("authorization", f"Bearer {token}"),)
        self._deadline = None if remaining is None else time.monotonic() + remaining
        self._certificate = certificate
        self.callbacks: list = []

    def add_callback(self, callback) -> bool:
        self.callbacks.append(callback)
        return True

    def cancel(self) -> None:
        """As gRPC does when the client cancels or goes away: the call's callbacks run."""
        for callback in self.callbacks:
            callback()

    def invocation_metadata(self):
        return self._metadata

    def peer(self):
        return self._peer

    def auth_context(self):
        return {} if self._certificate is None else {"x509_common_name": [self._certificate.encode()]}

    def time_remaining(self):
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def abort(self, code, details):
        self.code, self.details = code, details
        raise Aborted(details)


@contextmanager
def started_writer(tmp_path, **settings):
    """A registry on tmp_path/db and its writer thread, running; stopped and closed after."""
    config = DrafterConfig(db=str(tmp_path / "db"), **settings)
    stores = StoreRegistry(config)
    writer = ObservationWriter(config.max_pending_observations, stores.disk)
    writer.start()
    try:
        yield config, stores, writer
    finally:
        writer.stop()
        stores.close()


@pytest.fixture
def servicer(tmp_path):
    config = DrafterConfig(db=str(tmp_path / "db"), max_pending_observations=1, max_sessions=2)
    stores = StoreRegistry(config)
    writer = ObservationWriter(config.max_pending_observations, stores.disk)  # never started: the queue stays full
    yield DrafterServicer(config, stores, writer)
    stores.close()


def test_full_write_queue_is_resource_exhausted(servicer):
    servicer.writer.submit([_Pending(servicer.stores.get(VOCABULARY), "first", [1, 2])])  # one slot, taken (never written)
    context = FakeContext()
    request = pb.ObserveRequest(vocabulary=VOCABULARY, observe_id="o", sequences=[pb.TokenSequence(tokens=[1, 2, 3])])
    with pytest.raises(Aborted):
        servicer.Observe(request, context)
    assert context.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "write queue is full" in context.details


def test_session_limit_is_resource_exhausted_and_opens_nothing(servicer):
    opening = [pb.SequenceUpdate(session_id=f"s{i}", open=True, new_tokens=[1, 2]) for i in range(3)]
    context = FakeContext()
    with pytest.raises(Aborted):
        servicer.Propose(pb.ProposeRequest(vocabulary=VOCABULARY, sequences=opening), context)
    assert context.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "too many open sessions (0, limit 2)" in context.details
    assert len(servicer.sessions) == 0  # checked before any session was opened


def test_one_bad_item_in_a_write_group_fails_only_its_own_caller(tmp_path):
    # The writer commits what several callers queued in one transaction; an item
    # the store refuses (here an observe id past LMDB's key size) must not fail the rest.
    config = DrafterConfig(db=str(tmp_path / "db"))
    stores = StoreRegistry(config)
    try:
        store = stores.get(VOCABULARY)
        group = [_Pending(store, "good-1", [5, 6, 7]), _Pending(store, "x" * 600, [8, 9, 10]), _Pending(store, "good-2", [11, 12, 13])]
        writer = ObservationWriter(4, stores.disk, max_pending_per_table=4)
        writer.submit(group)  # queued before the writer starts: one transaction
        writer.start()
        writer.stop()
        assert [item.done.is_set() for item in group] == [True, True, True]
        assert [item.error is None for item in group] == [True, False, True]
        assert group[0].applied and group[2].applied
        assert store.best((5, 6))[0] == 7 and store.best((11, 12))[0] == 13
        assert store.best((8, 9)) is None
    finally:
        stores.close()


def test_sequences_without_room_answer_unavailable_and_a_retry_stores_only_those(tmp_path, monkeypatch):
    # The store refuses the second sequence once (StoreFull: a reader pinning pages);
    # Observe must not answer OK (the client would drop it), and the retry under the
    # same id stores it without counting the first twice.
    with started_writer(tmp_path) as (config, stores, writer):
        servicer = DrafterServicer(config, stores, writer)
        apply, full_once = LMDBNGramStore.apply, [True]

        def apply_with_no_room_once(store, batch):
            if full_once and len(batch) == 2:
                full_once.clear()
                results = apply(store, batch[:1])
                raise StoreFull("no room", results + [None])
            return apply(store, batch)

        monkeypatch.setattr(LMDBNGramStore, "apply", apply_with_no_room_once)
        request = pb.ObserveRequest(
            vocabulary=VOCABULARY,
            observe_id="o",
            sequences=[
                pb.TokenSequence(tokens=[5, 6, 7, 8]),
                pb.TokenSequence(tokens=[9, 10, 11, 12]),
            ],
        )
        context = FakeContext()
        with pytest.raises(Aborted):
            servicer.Observe(request, context)
        assert context.code == grpc.StatusCode.UNAVAILABLE
        assert "1 of 2 sequences were not stored" in context.details and "same observe_id" in context.details
        response = servicer.Observe(request, FakeContext())
        assert (response.applied_sequences, response.duplicate_sequences) == (1, 1)
        table = stores.get(VOCABULARY)
        assert table.continuations((5, 6, 7)) == {8: 1} and table.continuations((9, 10, 11)) == {12: 1}


def test_below_min_free_space_writes_are_refused_drafts_served_and_the_refusal_clears(tmp_path):
    # Any real disk is "full" under a threshold larger than itself; the tmpfs test
    # (tests/e2e/test_drafter_disk_full.py) fills a real one.
    with started_writer(tmp_path, min_free_bytes=1 << 60) as (config, stores, writer):
        servicer = DrafterServicer(config, stores, writer)
        assert servicer.registry.get_sample_value("specdec_drafter_disk_full") == 1
        request = pb.ObserveRequest(vocabulary=VOCABULARY, observe_id="o", sequences=[pb.TokenSequence(tokens=[1, 2, 3, 4])])
        context = FakeContext()
        with pytest.raises(Aborted):
            servicer.Observe(request, context)
        assert context.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "below --min-free-bytes" in context.details and "until space is freed" in context.details
        assert stores.find(VOCABULARY) is None  # no table created on a full disk
        stores.disk.min_free_bytes = 1  # an operator frees space; the janitor's next check sees it
        stores.disk.check()
        assert servicer.registry.get_sample_value("specdec_drafter_disk_full") == 0
        assert servicer.registry.get_sample_value("specdec_drafter_disk_free_bytes") > 0
        assert servicer.Observe(request, FakeContext()).applied_sequences == 1
        assert stores.find(VOCABULARY).best((1, 2, 3))[0] == 4


def test_one_caller_cannot_take_every_session(tmp_path):
    # A flood of opens from one address stops at --max-sessions-per-caller (on any
    # of its connections); another caller still opens sessions; closing frees room.
    config = DrafterConfig(db=str(tmp_path / "db"), max_sessions=6, max_sessions_per_caller=4)
    stores = StoreRegistry(config)
    servicer = DrafterServicer(config, stores, ObservationWriter(1, stores.disk))

    def open_sessions(peer: str, names: list[str]):
        context = FakeContext(peer)
        updates = [pb.SequenceUpdate(session_id=name, open=True, new_tokens=[1, 2]) for name in names]
        servicer.Propose(pb.ProposeRequest(vocabulary=VOCABULARY, sequences=updates), context)
        return context

    try:
        open_sessions("ipv4:10.0.0.7:5000", ["a1", "a2", "a3"])
        with pytest.raises(Aborted):
            context = FakeContext("ipv4:10.0.0.7:5001")  # the same host on a new connection
            servicer.Propose(
                pb.ProposeRequest(
                    vocabulary=VOCABULARY, sequences=[pb.SequenceUpdate(session_id=f"a{i}", open=True, new_tokens=[1]) for i in (4, 5)]
                ),
                context,
            )
        assert context.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "this caller (10.0.0.7) holds 3 open sessions, limit 4" in context.details
        open_sessions("ipv6:[::1]:7000", ["b1", "b2", "b3"])  # another caller is not locked out
        assert (servicer.sessions.held_by("10.0.0.7"), servicer.sessions.held_by("::1")) == (3, 3)
        servicer.CloseSessions(pb.CloseSessionsRequest(vocabulary=VOCABULARY, session_ids=["a1", "a2"]), FakeContext())
        assert (servicer.sessions.held_by("10.0.0.7"), servicer.sessions.held_by("::1")) == (1, 3)
        open_sessions("ipv4:10.0.0.7:5002", ["a4", "a5"])
        assert servicer.sessions.held_by("10.0.0.7") == 3
    finally:
        stores.close()


def test_a_long_observation_is_stored_in_chunks_exactly_as_whole(tmp_path):
    # Chunks carry the n_max tokens before them: no n-gram lost at a boundary, none counted twice.
    rng = random.Random(5)
    tokens = [rng.randrange(50) for _ in range(3 * CHUNK_TOKENS + 123)]  # small alphabet: many repeats
    namespace = bytes.fromhex(VOCABULARY)
    with (
        LMDBNGramStore(StoreConfig(path=str(tmp_path / "whole"), namespace=namespace)) as whole,
        LMDBNGramStore(StoreConfig(path=str(tmp_path / "chunked"), namespace=namespace)) as chunked,
    ):
        whole.apply([("o", tokens)])
        item = _Pending(chunked, "o", tokens)
        assert item.chunks == 4
        assert chunked.apply([item.chunk(index) for index in range(item.chunks)]) == [True] * 4
        assert chunked.apply([item.chunk(2)]) == [False]  # a retry of a stored chunk
        for position in range(len(tokens)):
            for n in (2, 3, 4):
                key = tuple(tokens[position : position + n])
                assert chunked.continuations(key) == whole.continuations(key), (position, n)
        assert chunked.stats()["entries"] == whole.stats()["entries"]


def test_small_observations_do_not_wait_for_a_long_one(tmp_path):
    # A 128K-token Observe takes ~4.5 s to commit in one transaction here; small
    # ones queued behind it used to wait that long. Now they wait one chunk's commit.
    with started_writer(tmp_path) as (config, stores, writer):
        store = stores.get(VOCABULARY)
        rng = random.Random(1)
        long = _Pending(store, "long/0", [rng.randrange(100, 40_000) for _ in range(config.max_tokens_per_call)])
        writer.submit([long])
        while long.next_chunk == 0:  # the writer has started on it
            time.sleep(0.001)
        small = [_Pending(store, f"small-{i}/0", [7, 8, 9, i]) for i in range(20)]
        writer.submit(small)
        for item in small:
            assert item.done.wait(60)
        assert not long.done.is_set(), "the small observations waited for the whole long one"
        assert long.next_chunk < long.chunks
        assert long.done.wait(120) and long.error is None and long.applied
        assert all(item.applied and item.error is None for item in small)
        assert store.best(tuple(long.tokens[-4:-1]))[0] == long.tokens[-1]


def test_a_long_observation_whose_caller_gave_up_stops_and_a_retry_stores_only_the_rest(tmp_path):
    with started_writer(tmp_path) as (config, stores, writer):
        store = stores.get(VOCABULARY)
        rng = random.Random(2)
        tokens = [rng.randrange(100, 40_000) for _ in range(8 * CHUNK_TOKENS)]
        gave_up = _Pending(store, "late/0", tokens)
        writer.submit([gave_up])
        while gave_up.next_chunk == 0:  # the writer has started on it
            time.sleep(0.001)
        gave_up.abandoned = True  # its handler stopped waiting (deadline, cancel, --max-write-wait-seconds)
        assert gave_up.done.wait(60)
        assert isinstance(gave_up.error, TimeoutError)
        stored = gave_up.next_chunk
        assert 1 <= stored < gave_up.chunks  # stopped after the transaction in progress
        retry = _Pending(store, "late/0", tokens)
        writer.submit([retry])
        assert retry.done.wait(60) and retry.error is None and retry.applied
        before = store.stats()["entries"]
        again = _Pending(store, "late/0", tokens)  # everything stored now: a pure duplicate
        writer.submit([again])
        assert again.done.wait(60) and again.error is None and not again.applied
        assert store.stats()["entries"] == before


def test_a_queued_write_that_outlived_its_caller_is_dropped_however_short(tmp_path):
    # Before, only a long observation stopped between chunks; a one-chunk write whose
    # caller had left was still committed, so a pile of them held the writer for a minute.
    with started_writer(tmp_path) as (config, stores, writer):
        store = stores.get(VOCABULARY)
        late = [_Pending(store, f"late-{i}/0", [5, 6, 7, i], deadline=time.monotonic() - 1) for i in range(50)]
        writer.submit(late)
        for item in late:
            assert item.done.wait(60)
        assert all(isinstance(item.error, TimeoutError) and not item.applied and item.next_chunk == 0 for item in late)
        assert store.best((5, 6, 7)) is None and writer.dropped == 50
        assert (writer.pending, writer.pending_tokens) == (0, 0)  # their room in the queue is free again


def test_the_write_queue_is_bounded_in_tokens_all_or_none(tmp_path):
    config = DrafterConfig(db=str(tmp_path / "db"))
    stores = StoreRegistry(config)
    try:
        store = stores.get(VOCABULARY)
        writer = ObservationWriter(100, stores.disk, max_pending_tokens=1000, max_pending_tokens_per_table=1000)  # never started
        writer.submit([_Pending(store, "a", [1] * 600)])
        with pytest.raises(WriteQueueFull, match="600 tokens queued, this call adds 500, --max-pending-write-tokens 1000"):
            writer.submit([_Pending(store, "b", [1] * 100), _Pending(store, "c", [1] * 400)])
        assert (writer.pending, writer.pending_tokens, writer.queue.qsize()) == (1, 600, 1)  # none of the refused call queued
        writer.submit([_Pending(store, "d", [1] * 400)])  # what fits still goes in
    finally:
        stores.close()


def test_a_table_set_aside_while_serving_costs_drafts_not_calls_and_health_says_so(tmp_path):
    from grpc_health.v1 import health, health_pb2

    from drafter_service.server import table_health_name

    with started_writer(tmp_path) as (config, stores, writer):
        servicer = DrafterServicer(config, stores, writer)
        health_servicer = health.HealthServicer()
        servicer.watch_health(health_servicer)
        learned = pb.ObserveRequest(vocabulary=VOCABULARY, observe_id="o", sequences=[pb.TokenSequence(tokens=[1, 2, 3, 4, 5])])
        assert servicer.Observe(learned, FakeContext()).applied_sequences == 1

        def status() -> int:
            return health_servicer.Check(health_pb2.HealthCheckRequest(service=table_health_name(VOCABULARY)), None).status

        assert status() == health_pb2.HealthCheckResponse.SERVING
        store = stores.find(VOCABULARY)
        with store.snapshot():  # a reader mid-transaction when the damage is found
            assert stores.quarantine(VOCABULARY, RuntimeError("MDB_CORRUPTED found by a read"), store=store)
        assert status() == health_pb2.HealthCheckResponse.NOT_SERVING
        assert servicer.registry.get_sample_value("specdec_drafter_quarantined_tables") == 1
        # Propose still answers, from the context alone (the table taught it [1, 2] -> 3).
        update = pb.SequenceUpdate(session_id="s", new_tokens=[1, 2, 9, 1, 2], open=True, num_draft_tokens=2)
        draft = servicer.Propose(pb.ProposeRequest(vocabulary=VOCABULARY, sequences=[update]), FakeContext()).drafts[0]
        assert list(draft.tokens) == [9, 1] and list(draft.sources) == [pb.DRAFT_SOURCE_CONTEXT] * 2
        # The next write starts a fresh table, which serves.
        again = pb.ObserveRequest(vocabulary=VOCABULARY, observe_id="o2", sequences=[pb.TokenSequence(tokens=[6, 7, 8])])
        assert servicer.Observe(again, FakeContext()).applied_sequences == 1
        assert status() == health_pb2.HealthCheckResponse.SERVING and stores.find(VOCABULARY) is not store
