"""DrafterServicer in-process: overload paths that a live server makes hard to reach on purpose."""

from __future__ import annotations

import grpc
import pytest

from drafter_service.server import DrafterConfig, DrafterServicer, ObservationWriter, StoreRegistry
from specdec.v1 import drafter_pb2 as pb

VOCABULARY = "00112233445566aa"


class Aborted(Exception):
    pass


class FakeContext:
    def invocation_metadata(self):
        return ()

    def time_remaining(self):
        return None

    def abort(self, code, details):
        self.code, self.details = code, details
        raise Aborted(details)


@pytest.fixture
def servicer(tmp_path):
    config = DrafterConfig(db=str(tmp_path / "db"), max_pending_observations=1, max_sessions=2)
    stores = StoreRegistry(config)
    writer = ObservationWriter(config.max_pending_observations, stores.disk)  # never started: the queue stays full
    yield DrafterServicer(config, stores, writer)
    stores.close()


def test_full_write_queue_is_resource_exhausted(servicer):
    servicer.writer.queue.put_nowait(None)  # one slot, taken
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
    assert servicer.sessions == {}  # checked before any session was opened


def test_one_bad_item_in_a_write_group_fails_only_its_own_caller(tmp_path):
    # The writer commits what several callers queued in one transaction; an item
    # the store refuses (here an observe id past LMDB's key size) must not fail the rest.
    from drafter_service.server import _Pending

    config = DrafterConfig(db=str(tmp_path / "db"))
    stores = StoreRegistry(config)
    try:
        store = stores.get(VOCABULARY)
        group = [_Pending(store, "good-1", [5, 6, 7]), _Pending(store, "x" * 600, [8, 9, 10]), _Pending(store, "good-2", [11, 12, 13])]
        ObservationWriter(4, stores.disk)._commit(group)
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
    from drafter_service.store import LMDBNGramStore, StoreFull

    config = DrafterConfig(db=str(tmp_path / "db"))
    stores = StoreRegistry(config)
    writer = ObservationWriter(config.max_pending_observations, stores.disk)
    writer.start()
    servicer = DrafterServicer(config, stores, writer)
    apply, full_once = LMDBNGramStore.apply, [True]

    def apply_with_no_room_once(store, batch):
        if full_once and len(batch) == 2:
            full_once.clear()
            results = apply(store, batch[:1])
            raise StoreFull("no room", results + [None])
        return apply(store, batch)

    monkeypatch.setattr(LMDBNGramStore, "apply", apply_with_no_room_once)
    request = pb.ObserveRequest(vocabulary=VOCABULARY, observe_id="o", sequences=[
        pb.TokenSequence(tokens=[5, 6, 7, 8]), pb.TokenSequence(tokens=[9, 10, 11, 12]),
    ])
    try:
        context = FakeContext()
        with pytest.raises(Aborted):
            servicer.Observe(request, context)
        assert context.code == grpc.StatusCode.UNAVAILABLE
        assert "1 of 2 sequences were not stored" in context.details and "same observe_id" in context.details
        response = servicer.Observe(request, FakeContext())
        assert (response.applied_sequences, response.duplicate_sequences) == (1, 1)
        table = stores.get(VOCABULARY)
        assert table.continuations((5, 6, 7)) == {8: 1} and table.continuations((9, 10, 11)) == {12: 1}
    finally:
        writer.stop()
        stores.close()


def test_below_min_free_space_writes_are_refused_drafts_served_and_the_refusal_clears(tmp_path):
    # Any real disk is "full" under a threshold larger than itself; the tmpfs test
    # (tests/e2e/test_drafter_disk_full.py) fills a real one.
    config = DrafterConfig(db=str(tmp_path / "db"), min_free_mb=1 << 40)
    stores = StoreRegistry(config)
    writer = ObservationWriter(config.max_pending_observations, stores.disk)
    writer.start()
    servicer = DrafterServicer(config, stores, writer)
    try:
        assert servicer.registry.get_sample_value("specdec_drafter_disk_full") == 1
        request = pb.ObserveRequest(vocabulary=VOCABULARY, observe_id="o", sequences=[pb.TokenSequence(tokens=[1, 2, 3, 4])])
        context = FakeContext()
        with pytest.raises(Aborted):
            servicer.Observe(request, context)
        assert context.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "below --min-free-mb" in context.details and "until space is freed" in context.details
        assert stores.find(VOCABULARY) is None  # no table created on a full disk
        stores.disk.min_free_bytes = 1  # an operator frees space; the janitor's next check sees it
        stores.disk.check()
        assert servicer.registry.get_sample_value("specdec_drafter_disk_full") == 0
        assert servicer.registry.get_sample_value("specdec_drafter_disk_free_bytes") > 0
        assert servicer.Observe(request, FakeContext()).applied_sequences == 1
        assert stores.find(VOCABULARY).best((1, 2, 3))[0] == 4
    finally:
        writer.stop()
        stores.close()
