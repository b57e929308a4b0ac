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

    def abort(self, code, details):
        self.code, self.details = code, details
        raise Aborted(details)


@pytest.fixture
def servicer(tmp_path):
    config = DrafterConfig(db=str(tmp_path / "db"), max_pending_observations=1, max_sessions=2)
    stores = StoreRegistry(config)
    writer = ObservationWriter(config.max_pending_observations)  # never started: the queue stays full
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
