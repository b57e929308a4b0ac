"""Drafter replicas fed by one observation log, against a real nats-server (JetStream, fsync
before every acknowledgement) on loopback: the drafters run in this process, each with a
--db of its own, as separate machines would. Every server is stopped by its fixture."""

from __future__ import annotations

import random
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from drafter_service.config import DrafterConfig
from drafter_service.log_config import LogConfig
from drafter_service.log_format import encode_observe, table_subject
from drafter_service.server import SERVICE_NAME, DrafterServer, create_server
from specdec.processes import LocalNatsServer
from specdec.v1 import drafter_pb2 as pb
from specdec.v1 import drafter_pb2_grpc
from tests.metrics_reference import documented_metrics, exposed_metrics

VOCABULARY = "0123456789abcdef"
SCOPE_X, SCOPE_Y = "aa" * 16, "bb" * 16
WAIT_S = 30.0


@pytest.fixture
def nats(tmp_path) -> Iterator[LocalNatsServer]:
    server = LocalNatsServer(tmp_path / "nats-server")
    yield server
    server.stop()


class Replicas:
    """Drafters sharing the test's log; each stopped at the end."""

    def __init__(self, root: Path, nats: LocalNatsServer) -> None:
        self.root, self.nats = root, nats
        self.running: dict[str, DrafterServer] = {}

    def start(self, name: str, wait: bool = True, drafter_flags: dict | None = None, **log_flags) -> DrafterServer:
        """A replica with --db ROOT/name; ``drafter_flags``: DrafterConfig's, ``log_flags``: LogConfig's."""
        flags = {"url": self.nats.url, "publish_timeout_s": 2.0, "bootstrap_wait_s": 3.0, **log_flags}
        settings = {"metrics_port": None, **(drafter_flags or {})}
        drafter = create_server(DrafterConfig(port=0, db=str(self.root / name), log=LogConfig(**flags), **settings))
        self.running[name] = drafter
        if wait:
            until(lambda: drafter.servicer.replica.serving, f"replica {name} to serve")
        return drafter

    def stop(self, name: str) -> None:
        self.running.pop(name).stop(0)

    def stop_all(self) -> None:
        for name in list(self.running):
            self.stop(name)


@pytest.fixture
def replicas(tmp_path, nats) -> Iterator[Replicas]:
    group = Replicas(tmp_path, nats)
    yield group
    group.stop_all()


def until(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def stub(drafter: DrafterServer) -> drafter_pb2_grpc.DrafterStub:
    return drafter_pb2_grpc.DrafterStub(grpc.insecure_channel(f"127.0.0.1:{drafter.port}"))


def observe(drafter: DrafterServer, observe_id: str, *sequences: list[int], scope: str = "") -> pb.ObserveResponse:
    request = pb.ObserveRequest(
        vocabulary=VOCABULARY, observe_id=observe_id, scope=scope, sequences=[pb.TokenSequence(tokens=tokens) for tokens in sequences]
    )
    return stub(drafter).Observe(request, timeout=10)


def caught_up(drafter: DrafterServer, sequence: int) -> None:
    until(lambda: drafter.servicer.replica.position.sequence >= sequence, f"log sequence {sequence}")


def log_end(drafter: DrafterServer) -> int:
    return drafter.servicer.log.stream_state().last


def drafts(drafter: DrafterServer, contexts: list[list[int]], scope: str = "") -> list[tuple[list[int], list[int]]]:
    """(tokens, sources) of each context's draft, each from a fresh session."""
    updates = [
        pb.SequenceUpdate(session_id=f"probe-{time.monotonic_ns()}-{i}", new_tokens=tokens, open=True, num_draft_tokens=8, scope=scope)
        for i, tokens in enumerate(contexts)
    ]
    answer = stub(drafter).Propose(pb.ProposeRequest(vocabulary=VOCABULARY, sequences=updates), timeout=10)
    return [(list(draft.tokens), list(draft.sources)) for draft in answer.drafts]


def records(drafter: DrafterServer) -> dict[str, dict[str, dict[bytes, bytes]]]:
    """Every record of every table the replica holds (its meta records aside: the log marks may differ)."""
    held = {}
    for name, store in drafter.stores.all().items():
        with store._env.begin() as txn:
            held[name] = {
                label: dict(txn.cursor(db=db))
                for label, db in (
                    ("ngrams", store._ngrams),
                    ("coldness", store._coldness),
                    ("applied", store._applied),
                    ("successors", store._successors),
                )
            }
    return held


def text(seed: int, length: int = 40) -> list[int]:
    """Deterministic token ids, distinct per seed (so each call's 4-grams are its own)."""
    return random.Random(seed).choices(range(100, 50_100), k=length)


PROBES = [text(seed)[:6] for seed in range(12)]


def test_learning_through_one_replica_drafts_warm_on_another(replicas):
    a, b = replicas.start("a"), replicas.start("b")
    assert [draft for draft in drafts(b, PROBES)] == [([], [])] * len(PROBES)  # cold
    for seed in range(12):
        assert observe(a, f"call-{seed}", text(seed)).applied_sequences == 1
    caught_up(a, log_end(a))
    caught_up(b, log_end(a))
    on_b = drafts(b, PROBES)
    assert on_b == drafts(a, PROBES)
    assert all(tokens == text(seed)[6:14] and set(sources) == {pb.DRAFT_SOURCE_GLOBAL} for seed, (tokens, sources) in enumerate(on_b))
    assert records(a) == records(b)


def test_the_same_call_published_twice_is_applied_once_on_every_replica(replicas):
    a, b = replicas.start("a"), replicas.start("b")
    first = observe(a, "retry-me", text(1), text(2))
    again = observe(b, "retry-me", text(1), text(2))  # the verifier's retry, on the other replica
    assert (first.applied_sequences, first.duplicate_sequences) == (2, 0)
    assert (again.applied, again.applied_sequences, again.duplicate_sequences) == (False, 0, 2)
    # A retry later than JetStream's duplicate window is a second message: the tables' own ids drop it.
    late = a.servicer.log.publish(
        table_subject("specdec.drafter", VOCABULARY, ""), encode_observe(VOCABULARY, "", "retry-me", [text(1), text(2)]), "after-window"
    )
    end = late[0]
    for replica in (a, b):
        caught_up(replica, end)
        store = replica.stores.find(VOCABULARY)
        assert store.continuations(tuple(text(1)[:4])) == {text(1)[4]: 1}  # counted once
    assert a.servicer.replica.skipped == b.servicer.replica.skipped == 0  # the message applied; its ids were held
    assert records(a) == records(b)


def test_one_scope_never_reaches_another_and_forgetting_it_empties_it_everywhere(replicas):
    a, b = replicas.start("a"), replicas.start("b")
    observe(a, "x-1", text(3), scope=SCOPE_X)
    observe(a, "y-1", text(4), scope=SCOPE_Y)
    caught_up(b, log_end(a))
    for replica in (a, b):
        assert drafts(replica, [text(3)[:6]], scope=SCOPE_Y)[0] == ([], [])  # X's text is not Y's
        assert drafts(replica, [text(3)[:6]], scope=SCOPE_X)[0][0] == text(3)[6:14]
        assert sorted(replica.stores.all()) == sorted([f"{VOCABULARY}-{SCOPE_X}", f"{VOCABULARY}-{SCOPE_Y}"])
    forgotten = stub(b).Forget(pb.ForgetRequest(vocabulary=VOCABULARY, scope=SCOPE_X), timeout=10)
    assert forgotten.dropped and forgotten.log_sequence > 0
    caught_up(a, forgotten.log_sequence)
    for replica in (a, b):
        assert sorted(replica.stores.all()) == [f"{VOCABULARY}-{SCOPE_Y}"]
        assert drafts(replica, [text(3)[:6]], scope=SCOPE_X)[0] == ([], [])
        assert not (Path(replica.stores.root) / f"{VOCABULARY}-{SCOPE_X}").exists()
    # The log keeps none of X's messages: a replica that starts now never learns them.
    state = a.servicer.log._call(a.servicer.log._js.stream_info("SPECDEC_DRAFTER", subjects_filter=">"), 5)
    assert table_subject("specdec.drafter", VOCABULARY, SCOPE_X) not in (state.state.subjects or {})
    c = replicas.start("c")
    assert sorted(c.stores.all()) == [f"{VOCABULARY}-{SCOPE_Y}"]
    assert records(c) == records(a)


def test_forget_without_a_log_drops_the_table_and_refuses_a_malformed_scope(tmp_path):
    drafter = create_server(DrafterConfig(port=0, db=str(tmp_path / "alone"), metrics_port=None))
    try:
        observe(drafter, "x-1", text(3), scope=SCOPE_X)
        with pytest.raises(grpc.RpcError) as refused:
            stub(drafter).Forget(pb.ForgetRequest(vocabulary=VOCABULARY, scope="../x"), timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "32 lowercase hex digits" in refused.value.details()
        answer = stub(drafter).Forget(pb.ForgetRequest(vocabulary=VOCABULARY, scope=SCOPE_X), timeout=10)
        assert (answer.dropped, answer.log_sequence) == (True, 0)
        assert drafter.stores.all() == {}
        assert not stub(drafter).Forget(pb.ForgetRequest(vocabulary=VOCABULARY, scope=SCOPE_X), timeout=10).dropped
    finally:
        drafter.stop(0)


def test_a_new_replica_with_an_empty_store_catches_up_and_drafts_as_its_peers(replicas):
    a, b = replicas.start("a"), replicas.start("b")
    for seed in range(30):
        observe(a if seed % 2 else b, f"c-{seed}", text(seed), text(seed + 100))
    c = replicas.start("c")  # SERVING only once within --log-max-serving-lag of the end
    caught_up(c, log_end(a))
    caught_up(b, log_end(a))
    assert drafts(c, PROBES) == drafts(a, PROBES) == drafts(b, PROBES)
    assert records(c) == records(a) == records(b)


def test_a_killed_nats_server_loses_no_acknowledged_observation(replicas, nats):
    a = replicas.start("a")
    acknowledged = [seed for seed in range(20) if observe(a, f"k-{seed}", text(seed)).applied_sequences == 1]
    assert acknowledged == list(range(20))
    nats.kill()
    with pytest.raises(grpc.RpcError) as refused:
        observe(a, "while-away", text(99))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "retry with the same observe_id" in refused.value.details()
    assert drafts(a, PROBES[:3])[0][0] == text(0)[6:14]  # drafts never wait on the log
    nats.start()
    fresh = replicas.start("fresh")  # an empty store: everything it holds came from the log on disk
    caught_up(fresh, 20)
    for seed in acknowledged:
        assert fresh.stores.find(VOCABULARY).continuations(tuple(text(seed)[:4])) == {text(seed)[4]: 1}
    # The verifier retries with the same id until the drafter is back on the log: stored once.
    answers: list[pb.ObserveResponse] = []

    def retried() -> bool:
        try:
            answers.append(observe(a, "while-away", text(99)))
        except grpc.RpcError as away:
            assert away.code() == grpc.StatusCode.UNAVAILABLE
        return bool(answers)

    until(retried, "the drafter to reach the log again")
    assert answers[0].applied_sequences == 1


def test_a_new_replica_the_logs_retention_left_behind_bootstraps_from_a_peers_snapshot(replicas):
    small = {"max_bytes": 1 << 20}
    a = replicas.start("a", **small)
    observe(a, "early", text(5))
    for seed in range(10):  # ~1.3 MiB of 32K-token calls: the stream drops its oldest messages
        observe(a, f"big-{seed}", *[text(10_000 + 1000 * seed + part, 2048) for part in range(16)])
        caught_up(a, log_end(a))  # before the retention drops them: a holds every call
    state = a.servicer.log.stream_state()
    assert state.first > 2, "the stream's retention should have dropped the first messages"
    b = replicas.start("b", **small)  # an empty store
    caught_up(b, log_end(a))
    assert b.servicer.replica.bootstraps == 1
    assert records(b) == records(a)
    assert b.stores.find(VOCABULARY).continuations(tuple(text(5)[:4])) == {text(5)[4]: 1}  # only the snapshot held it


def test_with_no_peer_a_replica_left_behind_is_not_serving_until_it_applied_what_the_log_holds(replicas):
    small = {"max_bytes": 1 << 20}
    a = replicas.start("a", **small)
    observe(a, "early", text(5))
    b = replicas.start("b", **small)
    replicas.stop("b")
    for seed in range(10):
        observe(a, f"big-{seed}", *[text(10_000 + 1000 * seed + part, 2048) for part in range(16)])
    replicas.stop("a")  # no peer to give a snapshot
    b = replicas.start("b", wait=False, bootstrap_wait_s=3.0, **small)
    status = b.health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), None).status
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    until(lambda: b.servicer.replica.serving, "b to serve from what the log holds")
    caught_up(b, log_end(b))  # serving within --log-max-serving-lag messages of the end; now at it
    assert b.servicer.replica.bootstraps == 1
    assert b.health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), None).status == health_pb2.HealthCheckResponse.SERVING
    # It holds what it had, and what the log still held: the latest calls.
    store = b.stores.find(VOCABULARY)
    assert store.continuations(tuple(text(5)[:4])) == {text(5)[4]: 1}
    assert store.continuations(tuple(text(19_000, 2048)[:4])) == {text(19_000, 2048)[4]: 1}


def test_a_replicas_metrics_are_the_drafters_and_the_replicas_documented_ones(replicas):
    a = replicas.start("a", drafter_flags={"metrics_port": 0})
    observe(a, "m-1", text(1))
    caught_up(a, log_end(a))
    exposed = exposed_metrics(a.metrics_port)
    assert exposed == documented_metrics("Drafter") | documented_metrics("Drafter replicas")
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{a.metrics_port}/metrics", timeout=10).read().decode()
    assert "specdec_drafter_log_messages_applied_total 1.0" in metrics
    assert "specdec_drafter_log_serving 1.0" in metrics
    assert "specdec_drafter_log_publish_seconds_count 1.0" in metrics


def test_the_targets_predictions_reach_every_replicas_successor_table(replicas):
    a, b = replicas.start("a", successor_interval_s=0.05), replicas.start("b", successor_interval_s=0.05)
    predictions = pb.Predictions(k=2, previous=[40, 41], current=[41, 42], tokens=[42, 50, 43, 51])
    update = pb.SequenceUpdate(session_id="s-1", new_tokens=[40, 41, 42], open=True, num_draft_tokens=4, predictions=predictions)
    stub(a).Propose(pb.ProposeRequest(vocabulary=VOCABULARY, sequences=[update]), timeout=10)
    until(lambda: a.servicer.log.published_successors >= 4, "the predictions' message")
    caught_up(a, log_end(a))
    caught_up(b, log_end(a))
    for replica in (a, b):
        store = replica.stores.find(VOCABULARY)
        assert store.successors((41,)) == (42, 50) and store.successors((41, 42)) == (43, 51)
    assert records(a) == records(b)


def test_a_scope_beyond_max_scopes_is_refused_at_publishing_and_skipped_alike_when_applying(replicas):
    a, b = (replicas.start(name, drafter_flags={"max_scopes": 1}) for name in "ab")
    observe(a, "x", text(1), scope=SCOPE_X)
    caught_up(a, log_end(a))
    with pytest.raises(grpc.RpcError) as refused:
        observe(a, "y", text(2), scope=SCOPE_Y)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-scopes" in refused.value.details()
    # A message that got past a publisher's check (another replica's race) is skipped by every replica alike.
    subject = table_subject("specdec.drafter", VOCABULARY, SCOPE_Y)
    sequence, _ = a.servicer.log.publish(subject, encode_observe(VOCABULARY, SCOPE_Y, "y", [text(2)]), "raced")
    for replica in (a, b):
        caught_up(replica, sequence)
        assert sorted(replica.stores.all()) == [f"{VOCABULARY}-{SCOPE_X}"]
        assert replica.servicer.replica.skipped == 1


def test_closing_sessions_with_observe_publishes_each_scopes_sequences(replicas):
    a, b = replicas.start("a"), replicas.start("b")
    updates = [
        pb.SequenceUpdate(session_id="x", new_tokens=text(7), open=True, scope=SCOPE_X),
        pb.SequenceUpdate(session_id="y", new_tokens=text(8), open=True, scope=SCOPE_Y),
    ]
    stub(a).Propose(pb.ProposeRequest(vocabulary=VOCABULARY, sequences=updates), timeout=10)
    closed = stub(a).CloseSessions(
        pb.CloseSessionsRequest(vocabulary=VOCABULARY, session_ids=["x", "y"], observe=True, observe_id="close-1"), timeout=10
    )
    assert closed.closed == 2
    caught_up(b, log_end(a))
    assert drafts(b, [text(7)[:6]], scope=SCOPE_X)[0][0] == text(7)[6:14]
    assert drafts(b, [text(8)[:6]], scope=SCOPE_Y)[0][0] == text(8)[6:14]
    assert drafts(b, [text(8)[:6]], scope=SCOPE_X)[0] == ([], [])


def test_a_backup_names_the_log_sequence_it_reflects(tmp_path, nats):
    group = Replicas(tmp_path, nats)
    try:
        config = DrafterConfig(
            port=0, db=str(tmp_path / "a"), metrics_port=None, backup_dir=str(tmp_path / "backups"), log=LogConfig(url=nats.url)
        )
        a = create_server(config)
        group.running["a"] = a
        until(lambda: a.servicer.replica.serving, "a to serve")
        for seed in range(3):
            observe(a, f"b-{seed}", text(seed))
        caught_up(a, 3)
        answer = stub(a).Backup(pb.BackupRequest(vocabulary=VOCABULARY, destination="one"), timeout=30)
        assert answer.log_sequence == 3 and answer.bytes > 0
        from drafter_service.store import LMDBNGramStore, StoreConfig

        copy = LMDBNGramStore(StoreConfig(path=str(tmp_path / "backups" / "one" / VOCABULARY), namespace=bytes.fromhex(VOCABULARY)))
        assert copy.log_sequence() == 3  # a replica restored from it skips what it holds
        copy.close()
    finally:
        group.stop_all()


def test_the_publish_is_a_span_inside_observes_trace(replicas):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    a = replicas.start("a")
    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    a.servicer.tracing.provider, a.servicer.tracing.tracer = provider, provider.get_tracer("specdec")
    observe(a, "traced", text(1))
    spans = {span.name: span for span in exporter.get_finished_spans()}
    publish, call = spans["specdec.drafter.log_publish"], spans["specdec.drafter.observe"]
    assert publish.parent is not None and publish.parent.span_id == call.context.span_id
    assert publish.context.trace_id == call.context.trace_id
    assert publish.attributes["specdec.sequences"] == 1


def test_a_call_over_the_logs_max_payload_is_refused_as_invalid_not_retried_forever(tmp_path):
    small = LocalNatsServer(tmp_path / "small-nats", extra="max_payload: 65536")
    group = Replicas(tmp_path, small)
    try:
        a = group.start("a")
        with pytest.raises(grpc.RpcError) as refused:
            observe(a, "huge", text(1, 20_000))  # 80 KB of tokens
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_payload" in refused.value.details() and "fewer tokens per call" in refused.value.details()
        assert observe(a, "small", text(2)).applied_sequences == 1
    finally:
        group.stop_all()
        small.stop()


def test_many_successor_predictions_reach_the_log_in_messages_within_its_payload(replicas):
    a, b = replicas.start("a", successor_interval_s=0.05), replicas.start("b", successor_interval_s=0.05)
    keys = 10_000  # three messages' worth of keys with 16 predictions each
    a.servicer.log.offer_successors(VOCABULARY, "", [((token,), tuple(range(token, token + 16))) for token in range(keys)])
    until(lambda: a.servicer.log.published_successors == keys, "every key published")
    caught_up(b, log_end(a))
    store = b.stores.find(VOCABULARY)
    assert store.successors((9_999,)) == tuple(range(9_999, 10_015))
    assert store.stats()["successor_entries"] == keys
    assert a.servicer.log.dropped_successors == 0


def test_observe_waits_while_its_replica_lags_and_refuses_with_backoff_when_it_stays_behind(replicas):
    a = replicas.start("a", publish_timeout_s=1.0)
    replica = a.servicer.replica
    replica.stop()  # it follows the log no more: its lag stays what the test sets
    with replica._advanced:
        replica.lag_messages, replica.lag_seconds = 40, 3.0
    with pytest.raises(grpc.RpcError) as refused:
        observe(a, "held-back", text(1))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "3.0 s behind the observation log (--log-max-publish-lag-seconds 0.5)" in refused.value.details()
    assert a.servicer.log.stream_state().last == 0  # nothing was published
    # The replica catches up while a call waits: the call goes through.
    threading.Timer(0.3, replica._set_lag, (0, 0.0)).start()
    assert observe(a, "held-back", text(1)).applied_sequences == 1
