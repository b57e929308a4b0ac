"""DrafterServicer in-process, as a hostile caller would use it: each test is a row of the
hostile-client audit that the drafter used to fail.

Callers are told apart as the service tells them apart: by client certificate
(``FakeContext(certificate=...)``), else by peer host.
"""

from __future__ import annotations

import random
import threading
import time

import grpc
import pytest
from test_servicer_overload import VOCABULARY, Aborted, FakeContext, started_writer

from drafter_service.config import DrafterConfig
from drafter_service.server import DrafterServicer
from drafter_service.storage import StoreRegistry
from drafter_service.writer import ObservationWriter
from specdec.v1 import drafter_pb2 as pb

VICTIM, THIEF = "victim", "thief"  # client certificates' common names


def aborted(call, request, context) -> FakeContext:
    with pytest.raises(Aborted):
        call(request, context)
    return context


def open_request(session_id: str, tokens, k: int = 0) -> pb.ProposeRequest:
    return pb.ProposeRequest(
        vocabulary=VOCABULARY, sequences=[pb.SequenceUpdate(session_id=session_id, new_tokens=tokens, open=True, num_draft_tokens=k)]
    )


def extend_request(session_id: str, tokens, k: int = 8) -> pb.ProposeRequest:
    return pb.ProposeRequest(
        vocabulary=VOCABULARY, sequences=[pb.SequenceUpdate(session_id=session_id, new_tokens=tokens, num_draft_tokens=k)]
    )


@pytest.fixture
def running(tmp_path):
    """A servicer over a started writer: (servicer, stores)."""
    with started_writer(tmp_path, max_write_wait_s=5.0) as (config, stores, writer):
        yield DrafterServicer(config, stores, writer), stores


def test_propose_on_another_callers_session_is_not_found_and_reads_nothing(running):
    # Was: 12 of 12 of the victim's context tokens came back as the thief's draft.
    servicer, _ = running
    secret = [101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112]
    servicer.Propose(open_request("s-1", [7, 8, *secret, 7, 8]), FakeContext(certificate=VICTIM))
    stolen = aborted(servicer.Propose, extend_request("s-1", [], k=12), FakeContext(certificate=THIEF))
    missing = aborted(servicer.Propose, extend_request("never-opened", [], k=12), FakeContext(certificate=THIEF))
    assert stolen.code == missing.code == grpc.StatusCode.NOT_FOUND
    assert stolen.details == "sequences[0]: unknown session 's-1' (open it first)"
    assert missing.details == stolen.details.replace("s-1", "never-opened")  # indistinguishable from an id never opened
    # The victim's session is untouched and still drafts its own context.
    draft = servicer.Propose(extend_request("s-1", [], k=12), FakeContext(certificate=VICTIM)).drafts[0]
    assert list(draft.tokens) == secret


def test_another_caller_can_neither_extend_nor_close_nor_observe_a_session(running):
    # Was: accepted; the victim's next draft was empty, then NOT_FOUND, and the victim's tokens went into the global table.
    servicer, stores = running
    victim = [5, 6, 7, 8, 5, 6]
    servicer.Propose(open_request("s", victim), FakeContext(certificate=VICTIM))
    aborted(servicer.Propose, extend_request("s", [99, 98]), FakeContext(certificate=THIEF))
    close = pb.CloseSessionsRequest(vocabulary=VOCABULARY, session_ids=["s"], observe=True, observe_id="steal")
    assert servicer.CloseSessions(close, FakeContext(certificate=THIEF)).closed == 0
    assert stores.find(VOCABULARY) is None or stores.find(VOCABULARY).best((5, 6)) is None  # nothing of the victim's observed
    draft = servicer.Propose(extend_request("s", [], k=2), FakeContext(certificate=VICTIM)).drafts[0]
    assert list(draft.tokens) == [7, 8]  # extended by nobody, still open
    assert servicer.CloseSessions(close, FakeContext(certificate=VICTIM)).closed == 1
    assert stores.find(VOCABULARY).best((5, 6))[0] == 7  # observed once, by its owner


def test_close_sessions_refuses_a_repeated_id_and_counts_nothing(running):
    # Was: one session id repeated 50 times counted its n-grams 50 times from one call.
    servicer, stores = running
    servicer.Propose(open_request("s", [1, 2, 3, 4]), FakeContext())
    repeated = pb.CloseSessionsRequest(vocabulary=VOCABULARY, session_ids=["s"] * 50, observe=True, observe_id="o")
    context = aborted(servicer.CloseSessions, repeated, FakeContext())
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT
    assert context.details == "session_ids[1]: session 's' appears twice in one call"
    assert stores.find(VOCABULARY) is None  # nothing written, not even a table
    assert (
        servicer.CloseSessions(
            pb.CloseSessionsRequest(vocabulary=VOCABULARY, session_ids=["s"], observe=True, observe_id="o"), FakeContext()
        ).closed
        == 1
    )
    again = pb.CloseSessionsRequest(vocabulary=VOCABULARY, session_ids=["s"], observe=True, observe_id="o-2")
    assert servicer.CloseSessions(again, FakeContext()).closed == 0  # observed once: a closed session is gone
    assert stores.find(VOCABULARY).continuations((1, 2, 3)) == {4: 1}


def test_close_sessions_obeys_the_per_call_limits(tmp_path):
    with started_writer(tmp_path, max_sequences_per_call=4, max_tokens_per_call=100) as (config, stores, writer):
        servicer = DrafterServicer(config, stores, writer)
        too_many = pb.CloseSessionsRequest(vocabulary=VOCABULARY, session_ids=[f"s{i}" for i in range(5)])
        context = aborted(servicer.CloseSessions, too_many, FakeContext())
        assert (context.code, context.details) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "5 sessions in one call; the limit is 4 (--max-sequences-per-call)",
        )
        for name in ("a", "b"):
            servicer.Propose(open_request(name, list(range(60))), FakeContext())
        both = pb.CloseSessionsRequest(vocabulary=VOCABULARY, session_ids=["a", "b"], observe=True, observe_id="o")
        context = aborted(servicer.CloseSessions, both, FakeContext())
        assert context.code == grpc.StatusCode.INVALID_ARGUMENT and "hold 120 tokens, over the 100 one call may observe" in context.details
        assert len(servicer.sessions) == 2 and not any(session.busy for session in servicer.sessions._sessions.values())
        for name in ("a", "b"):  # one at a time, as the message says
            one = pb.CloseSessionsRequest(vocabulary=VOCABULARY, session_ids=[name], observe=True, observe_id=f"o-{name}")
            assert servicer.CloseSessions(one, FakeContext()).closed == 1


def test_a_write_whose_caller_gave_up_is_dropped_and_others_are_stored_at_once(running):
    # Was: CloseSessions(observe) on one 4,096-token session repeated 300 times, caller gone
    # after 1 s: every other caller's Observe timed out, the writer stuck for 58 s. Now the
    # repeat is refused (above); the most one call may queue, 32 distinct sessions of 4,096
    # tokens (--max-tokens-per-call), stops being written once its caller has left.
    servicer, stores = running
    rng = random.Random(3)
    ids = [f"long-{i}" for i in range(32)]
    for sid in ids:
        servicer.Propose(open_request(sid, [rng.randrange(1000, 40_000) for _ in range(4096)]), FakeContext())
    close = pb.CloseSessionsRequest(vocabulary=VOCABULARY, session_ids=ids, observe=True, observe_id="big")
    context = aborted(servicer.CloseSessions, close, FakeContext(remaining=0.05))
    assert context.code == grpc.StatusCode.DEADLINE_EXCEEDED and "retry with the same observe_id" in context.details
    assert len(servicer.sessions) == 32  # not stored whole, so none closed: a retry can observe them
    small = pb.ObserveRequest(vocabulary=VOCABULARY, observe_id="small", sequences=[pb.TokenSequence(tokens=[1, 2, 3, 4])])
    assert servicer.Observe(small, FakeContext(peer="ipv4:10.0.0.8:1")).applied_sequences == 1
    while servicer.writer.pending:  # what is left of the big call drains, dropped rather than written
        time.sleep(0.01)
    assert servicer.writer.dropped >= 1
    stored = sum(stores.find(VOCABULARY).best(tuple(s.context.tokens[:3])) is not None for s in servicer.sessions._sessions.values())
    assert stored < 32, "the writer committed every sequence of a call whose caller had left"


def test_writes_never_hold_every_thread_and_each_wait_is_bounded(tmp_path):
    # Was: one huge close plus 15 small ones, all with 1 s deadlines: all 16 worker threads
    # stayed held after their callers left, and Propose failed 20 of 20 times for 60 s.
    config = DrafterConfig(db=str(tmp_path / "db"), max_workers=4, max_write_calls=2, max_write_wait_s=0.5)
    stores = StoreRegistry(config)
    writer = ObservationWriter(config.max_pending_observations, stores.disk)  # never started: every write waits
    servicer = DrafterServicer(config, stores, writer)
    outcomes: list[FakeContext] = []

    def write(index: int, context: FakeContext) -> None:
        request = pb.ObserveRequest(vocabulary=VOCABULARY, observe_id=f"o{index}", sequences=[pb.TokenSequence(tokens=[1, 2, 3])])
        try:
            servicer.Observe(request, context)
        except Aborted:
            outcomes.append(context)

    try:
        held = [threading.Thread(target=write, args=(i, FakeContext(peer=f"ipv4:10.0.1.{i}:1"))) for i in range(2)]
        for thread in held:
            thread.start()
        while servicer.admission.writes < 2:
            time.sleep(0.001)
        third = aborted(
            servicer.Observe,
            pb.ObserveRequest(vocabulary=VOCABULARY, observe_id="o3", sequences=[pb.TokenSequence(tokens=[1, 2, 3])]),
            FakeContext(peer="ipv4:10.0.1.3:1"),
        )
        assert third.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-write-calls 2" in third.details
        # Two threads wait on the writer; Propose still runs (drafts from the context alone).
        draft = servicer.Propose(open_request("p", [1, 2, 3, 1, 2], k=1), FakeContext(peer="ipv4:10.0.1.9:1")).drafts[0]
        assert list(draft.tokens) == [3]
        for thread in held:  # no deadline was given: --max-write-wait-seconds ends the wait
            thread.join(30)
            assert not thread.is_alive()
        assert [(c.code, "--max-write-wait-seconds" in c.details) for c in outcomes] == [(grpc.StatusCode.UNAVAILABLE, True)] * 2
        assert servicer.admission.writes == 0
    finally:
        stores.close()


def test_one_caller_cannot_hold_every_thread(tmp_path):
    config = DrafterConfig(db=str(tmp_path / "db"), max_workers=4, max_write_calls=3, max_calls_per_caller=2, max_write_wait_s=5.0)
    stores = StoreRegistry(config)
    writer = ObservationWriter(config.max_pending_observations, stores.disk)  # never started: writes wait
    servicer = DrafterServicer(config, stores, writer)
    flood = [FakeContext(peer="ipv4:10.0.0.66:1"), FakeContext(peer="ipv4:10.0.0.66:2")]
    request = pb.ObserveRequest(vocabulary=VOCABULARY, observe_id="o", sequences=[pb.TokenSequence(tokens=[1, 2, 3])])
    threads = [threading.Thread(target=lambda c=c: pytest.raises(Aborted, servicer.Observe, request, c)) for c in flood]
    try:
        for thread in threads:
            thread.start()
        while servicer.admission.running("10.0.0.66") < 2:
            time.sleep(0.001)
        refused = aborted(servicer.Propose, open_request("x", [1, 2]), FakeContext(peer="ipv4:10.0.0.66:3"))
        assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "this caller (10.0.0.66) has 2 calls running, the limit (--max-calls-per-caller 2)" in refused.details
        servicer.Propose(open_request("y", [1, 2]), FakeContext(peer="ipv4:10.0.0.77:1"))  # another caller is served
        for context in flood:  # the flood's callers cancel: their waits end, their items are abandoned
            context.cancel()
        for thread in threads:
            thread.join(30)
        assert servicer.admission.running("10.0.0.66") == 0
    finally:
        stores.close()


def test_a_cancelled_write_is_abandoned_and_never_committed(tmp_path):
    config = DrafterConfig(db=str(tmp_path / "db"))
    stores = StoreRegistry(config)
    writer = ObservationWriter(config.max_pending_observations, stores.disk)
    servicer = DrafterServicer(config, stores, writer)
    context = FakeContext()
    request = pb.ObserveRequest(vocabulary=VOCABULARY, observe_id="o", sequences=[pb.TokenSequence(tokens=[4, 5, 6])])
    thread = threading.Thread(target=lambda: pytest.raises(Aborted, servicer.Observe, request, context))
    try:
        thread.start()
        while writer.pending < 1:
            time.sleep(0.001)
        context.cancel()  # the client went away before the writer got to it
        writer.start()  # now it does: the item is dropped, not written
        thread.join(30)
        assert context.code == grpc.StatusCode.DEADLINE_EXCEEDED and writer.dropped == 1
        assert stores.get(VOCABULARY).best((4, 5)) is None
    finally:
        writer.stop()
        stores.close()


def test_session_memory_has_a_budget_in_bytes_per_caller(tmp_path):
    # Was: six 131,072-token sessions took 47 -> 521 MB; 2,048 per caller were admitted.
    with started_writer(tmp_path, max_session_bytes_per_caller=1 << 20, max_session_bytes=1 << 21) as (config, stores, writer):
        servicer = DrafterServicer(config, stores, writer)
        big = list(range(4000))
        servicer.Propose(open_request("a", big), FakeContext(certificate="hog"))
        context = aborted(servicer.Propose, open_request("b", big + big), FakeContext(certificate="hog"))
        assert context.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-session-bytes-per-caller" in context.details
        assert ("certificate hog", "b") not in servicer.sessions
        servicer.Propose(open_request("b", big), FakeContext(certificate="other"))  # another caller has its own budget
        used = servicer.registry.get_sample_value("specdec_drafter_session_bytes")
        assert used == servicer.sessions.bytes_in_use > 0
