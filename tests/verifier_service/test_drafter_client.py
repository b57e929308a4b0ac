"""RemoteDrafter against a real in-process drafter service on a loopback port: sessions, feedback,
fallback and back-off, restarts, and background observations."""

from __future__ import annotations

import logging
import socket
import time

import grpc
import pytest

from drafter_service.server import DrafterConfig, create_server
from specdec.v1 import drafter_pb2 as pb
from specdec.v1 import drafter_pb2_grpc as rpc
from verifier_service.core.drafting import DraftEvidence, DraftRequest, FinishedSequence, Predictions
from verifier_service.serving import drafter_client
from verifier_service.serving.drafter_client import DrafterClientConfig, RemoteDrafter
from verifier_service.serving.drafter_replicas import ReplicaChoice

VOCABULARY = "00112233445566aa"
# Upper bound on waiting for background work (observations, reconnects); never a pass/fail threshold.
DEADLINE_S = 20


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until(condition, what: str):
    deadline = time.monotonic() + DEADLINE_S
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting until {what}")
        time.sleep(0.02)


class RecordingStub:
    """Passes calls to the real stub; records each Propose request and each Observe outcome."""

    def __init__(self, stub) -> None:
        self.stub = stub
        self.proposes: list[pb.ProposeRequest] = []
        self.observe_outcomes: list[str] = []
        self.observes: list[pb.ObserveRequest] = []

    def Propose(self, request, timeout=None, metadata=None):
        self.proposes.append(request)
        return self.stub.Propose(request, timeout=timeout, metadata=metadata)

    def Observe(self, request, timeout=None, metadata=None):
        self.observes.append(request)
        try:
            response = self.stub.Observe(request, timeout=timeout, metadata=metadata)
        except grpc.RpcError as error:
            self.observe_outcomes.append(error.code().name)
            raise
        self.observe_outcomes.append("OK")
        return response

    def __getattr__(self, name):
        return getattr(self.stub, name)


class Drafters:
    """Starts drafter servers (each with its own table) and stats channels; stops them all at the end."""

    def __init__(self, tmp_path) -> None:
        self.tmp_path, self.servers, self.channels, self.count = tmp_path, [], [], 0

    def start(self, port: int = 0, **settings):
        self.count += 1
        config = DrafterConfig(port=port, db=str(self.tmp_path / f"db{self.count}"), grace_s=0, metrics_port=None, **settings)
        server = create_server(config)
        self.servers.append(server)
        return server

    def stats(self, server) -> pb.StatsResponse:
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        self.channels.append(channel)
        return rpc.DrafterStub(channel).Stats(pb.StatsRequest(vocabulary=VOCABULARY), timeout=5)

    def stub(self, server):
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        self.channels.append(channel)
        return rpc.DrafterStub(channel)

    def close(self) -> None:
        for channel in self.channels:
            channel.close()
        for server in self.servers:
            server.stop(0)


@pytest.fixture
def drafters(tmp_path):
    pool = Drafters(tmp_path)
    yield pool
    pool.close()


@pytest.fixture
def clients():
    made = []

    def make(target: int | str, **overrides) -> RemoteDrafter:
        """A client of the drafter on loopback port ``target``, or of the --drafter list ``target``."""
        # A generous propose deadline: these tests check behaviour, not the latency budget.
        settings = dict(timeout_s=5.0, backoff_s=0.2, observe_timeout_s=2.0) | overrides
        target = f"127.0.0.1:{target}" if isinstance(target, int) else target
        client = RemoteDrafter(DrafterClientConfig(target=target, vocabulary=VOCABULARY, **settings))
        for replica in client.replicas:
            replica.stub = RecordingStub(replica.stub)
        made.append(client)
        return client

    yield make
    for client in made:
        client.stop(timeout_s=2)


def recorded(client: RemoteDrafter) -> RecordingStub:
    """The recorder of the replica the client uses now."""
    return client.replicas[client.replica_index].stub


CONTEXT = [1, 2, 3, 4, 2, 3]  # "2 3" was followed by 4, "3 4" by 2, "4 2" by 3
LONGER = CONTEXT + [4, 2]


def tokens(drafts) -> list[list[int]]:
    return [draft.tokens for draft in drafts]


def test_first_propose_opens_the_session_with_the_whole_context(drafters, clients):
    server = drafters.start()
    client = clients(server.port)
    assert tokens(client.propose([DraftRequest("seq-0", CONTEXT, 3)])) == [[4, 2, 3]]
    [request] = recorded(client).proposes
    [update] = request.sequences
    assert request.vocabulary == VOCABULARY
    assert update.open is True
    assert list(update.new_tokens) == CONTEXT
    assert update.num_draft_tokens == 3
    assert update.session_id.endswith("-seq-0-0")  # <instance>-<sequence>-<generation>
    stats = drafters.stats(server)
    assert (stats.open_sessions, stats.propose_calls, stats.proposed_tokens, stats.context_hits) == (1, 1, 3, 3)
    assert client.fallbacks == 0


def test_each_draft_token_carries_the_drafters_evidence(drafters, clients):
    server = drafters.start()
    client = clients(server.port)
    [draft] = client.propose([DraftRequest("seq-0", CONTEXT, 3)])
    # Suffix "2 3" -> 4 (no longer suffix was seen before), then the chain's own
    # extension matches longer: "2 3 4" -> 2, "2 3 4 2" -> 3. Each continuation
    # followed its suffix once, with no rival.
    assert draft.evidence == [
        DraftEvidence("context", 2, 1, 1),
        DraftEvidence("context", 3, 1, 1),
        DraftEvidence("context", 4, 1, 1),
    ]


def test_later_proposes_send_only_the_new_tokens_and_the_feedback(drafters, clients):
    server = drafters.start()
    client = clients(server.port)
    client.propose([DraftRequest("seq-0", CONTEXT, 3)])
    # Of the 3 drafts [4, 2, 3], the target verified 3 and accepted 2 (then "3" was wrong).
    drafts = client.propose([DraftRequest("seq-0", LONGER, 3, verified=3, accepted=2)])
    # [2, 3, 4, 2] was seen at positions 1-4 followed by 3; then [3, 4, 2, 3] -> 4, [4, 2, 3, 4] -> 2.
    assert tokens(drafts) == [[3, 4, 2]]
    update = recorded(client).proposes[1].sequences[0]
    assert update.open is False
    assert list(update.new_tokens) == [4, 2]
    assert (update.verified_draft_tokens, update.accepted_draft_tokens) == (3, 2)
    [session] = [s for (_, sid), s in server.servicer.sessions._sessions.items() if sid == update.session_id]  # any caller's
    assert session.context.tokens == LONGER  # nothing sent twice
    stats = drafters.stats(server)
    assert (stats.context_verified, stats.context_accepted) == (3, 2)
    assert (stats.global_verified, stats.global_accepted) == (0, 0)


def test_one_call_carries_every_sequence_of_the_batch(drafters, clients):
    server = drafters.start()
    client = clients(server.port)
    drafts = client.propose([DraftRequest("a", CONTEXT, 3), DraftRequest("b", [7, 8, 9, 7, 8], 2), DraftRequest("c", [5], 4)])
    # "7 8" was followed by 9, then "8 9" by 7; [5] has no 2-token suffix to match.
    assert tokens(drafts) == [[4, 2, 3], [9, 7], []]
    assert len(recorded(client).proposes) == 1
    assert drafters.stats(server).open_sessions == 3


def test_drafter_down_gives_empty_drafts_and_no_calls_during_the_back_off(drafters, clients, caplog):
    server = drafters.start()
    client = clients(server.port, backoff_s=60.0)  # long enough that the second call surely falls inside it
    client.propose([DraftRequest("seq-0", CONTEXT, 3)])
    server.stop(0)
    with caplog.at_level(logging.WARNING, logger="verifier_service.serving.drafter_client"):
        assert tokens(client.propose([DraftRequest("seq-0", LONGER, 3), DraftRequest("seq-1", [5, 6], 2)])) == [[], []]
    assert client.fallbacks == 1
    assert len(recorded(client).proposes) == 2  # the failed call was attempted
    assert "drafter unavailable (UNAVAILABLE: " in caplog.text
    assert "decoding without drafts for 60.0s" in caplog.text
    assert tokens(client.propose([DraftRequest("seq-0", LONGER + [3], 3)])) == [[]]
    assert client.fallbacks == 2
    assert len(recorded(client).proposes) == 2  # backing off: no call at all


def test_restarted_drafter_gets_the_sessions_reopened_with_their_whole_context(drafters, clients):
    port = free_port()
    first = drafters.start(port)
    client = clients(port, backoff_s=0.2)
    assert tokens(client.propose([DraftRequest("seq-0", CONTEXT, 3)])) == [[4, 2, 3]]
    first.stop(0)
    assert tokens(client.propose([DraftRequest("seq-0", CONTEXT + [4], 3)])) == [[]]
    second = drafters.start(port)  # a fresh process: it knows no sessions
    drafts = wait_until(lambda: client.propose([DraftRequest("seq-0", LONGER, 3)])[0].tokens, "drafts come back")
    assert drafts == [3, 4, 2]
    update = recorded(client).proposes[-1].sequences[0]
    assert update.open is True
    assert list(update.new_tokens) == LONGER
    assert not update.session_id.endswith("-seq-0-0")  # a new generation of ids
    assert drafters.stats(second).open_sessions == 1
    assert client.fallbacks >= 1


def test_a_session_the_drafter_forgot_is_reopened_on_the_next_step_without_back_off(drafters, clients, caplog):
    server = drafters.start()
    client = clients(server.port, backoff_s=60.0)
    client.propose([DraftRequest("seq-0", CONTEXT, 3)])
    session_id = recorded(client).proposes[0].sequences[0].session_id
    # As if the drafter had expired the idle session.
    closed = drafters.stub(server).CloseSessions(pb.CloseSessionsRequest(vocabulary=VOCABULARY, session_ids=[session_id]), timeout=5)
    assert closed.closed == 1
    with caplog.at_level(logging.WARNING, logger="verifier_service.serving.drafter_client"):
        assert tokens(client.propose([DraftRequest("seq-0", LONGER, 3)])) == [[]]  # NOT_FOUND: this step runs plain
    assert client.fallbacks == 1
    assert "drafter unavailable" not in caplog.text  # the drafter is up: no back-off
    assert tokens(client.propose([DraftRequest("seq-0", LONGER, 3)])) == [[3, 4, 2]]
    update = recorded(client).proposes[-1].sequences[0]
    assert update.open is True and list(update.new_tokens) == LONGER
    assert update.session_id.endswith("-seq-0-1")


def open_ids(server) -> set[str]:
    """The ids of the drafter's open sessions, whoever opened them (keys are (caller, id))."""
    return {sid for _, sid in list(server.servicer.sessions._sessions)}


def test_sessions_left_behind_by_a_reopen_are_closed_on_the_drafter(drafters, clients):
    # After an error every session is reopened under a new generation of ids; the
    # old ones would hold the caller's --max-sessions-per-caller room until they expire.
    server = drafters.start()
    client = clients(server.port, backoff_s=60.0)
    client.propose([DraftRequest("seq-0", CONTEXT, 3), DraftRequest("seq-1", CONTEXT, 3)])
    old = [update.session_id for update in recorded(client).proposes[0].sequences]
    assert all(sid in open_ids(server) for sid in old)
    drafters.stub(server).CloseSessions(pb.CloseSessionsRequest(vocabulary=VOCABULARY, session_ids=old[:1]), timeout=5)
    assert tokens(client.propose([DraftRequest("seq-0", LONGER, 3), DraftRequest("seq-1", LONGER, 3)])) == [[], []]  # NOT_FOUND
    deadline = time.monotonic() + 5
    while old[1] in open_ids(server):
        assert time.monotonic() < deadline, "the left-behind session was never closed"
        time.sleep(0.01)
    assert tokens(client.propose([DraftRequest("seq-0", LONGER, 3), DraftRequest("seq-1", LONGER, 3)])) == [[3, 4, 2]] * 2
    assert len(server.servicer.sessions) == 2


def test_close_observes_the_finished_tokens_into_the_global_table(drafters, clients):
    server = drafters.start()
    client = clients(server.port)
    finished = [10, 11, 12, 13, 14, 15, 16]
    client.propose([DraftRequest("seq-0", finished[:5], 2)])
    client.close([("seq-0", finished)])
    wait_until(lambda: drafters.stats(server).observed_tokens == len(finished), "the observation is stored")
    wait_until(lambda: client.pending_observations == 0, "the client's queue is empty")
    assert drafters.stats(server).open_sessions == 0  # its session was closed too
    # Another request starting the same way is drafted from the global table (a 4-token match is trusted).
    assert tokens(client.propose([DraftRequest("seq-1", [10, 11, 12, 13], 3)])) == [[14, 15, 16]]
    assert drafters.stats(server).global_hits == 3


def test_an_observation_made_while_the_drafter_is_down_arrives_after_it_returns(drafters, clients):
    port = free_port()
    first = drafters.start(port)
    client = clients(port)
    first.stop(0)
    finished = [20, 21, 22, 23, 24]
    client.close([("seq-0", finished)])
    wait_until(lambda: "UNAVAILABLE" in recorded(client).observe_outcomes, "an Observe attempt fails")
    assert client.pending_observations == 1  # kept for a retry
    second = drafters.start(port)
    wait_until(lambda: drafters.stats(second).observed_tokens == len(finished), "the retried observation is stored")
    wait_until(lambda: client.pending_observations == 0, "the client's queue is empty")
    assert recorded(client).observe_outcomes[-1] == "OK"
    assert client.dropped_observations == 0


def test_an_observation_the_drafter_refuses_is_dropped_not_retried(drafters, clients, caplog):
    server = drafters.start()
    client = clients(server.port)
    with caplog.at_level(logging.ERROR, logger="verifier_service.serving.drafter_client"):
        client.close([("seq-0", [5, 1 << 24])])  # above the drafter's max_token_id
        wait_until(lambda: client.pending_observations == 0, "the refused observation leaves the queue")
    assert recorded(client).observe_outcomes == ["INVALID_ARGUMENT"]
    assert (
        "drafter refused an observation: sequences[0]: token id 16777216 is out of range (must be < 16777216) "
        "(INVALID_ARGUMENT; dropped)" in caplog.text
    )
    assert client.dropped_observations == 1  # it never reaches the drafter's table
    assert drafters.stats(server).observed_tokens == 0


def test_pending_observations_beyond_the_bound_drop_the_oldest(drafters, clients):
    port = free_port()
    client = clients(port, max_pending_observations=2)  # nothing listens on the port
    client.close([("a", [1, 2, 3, 4, 5]), ("b", [6, 7, 8]), ("c", [9, 10, 11, 12])])
    assert client.dropped_observations == 1
    assert client.pending_observations == 2
    server = drafters.start(port)
    # b and c: 3 + 4 tokens (a's 5 were dropped; dropping the newest instead would leave 8).
    wait_until(lambda: drafters.stats(server).observed_tokens == 7, "the two kept observations are stored")
    wait_until(lambda: client.pending_observations == 0, "the client's queue is empty")


def test_stop_flushes_pending_observations_before_returning(drafters, clients):
    server = drafters.start()
    client = clients(server.port)
    client.close([("seq-0", [30, 31, 32, 33])])
    client.stop(timeout_s=DEADLINE_S)
    assert client.pending_observations == 0
    assert drafters.stats(server).observed_tokens == 4


def test_stop_returns_while_the_drafter_is_down(drafters, clients):
    port = free_port()
    client = clients(port)  # nothing listens on the port
    client.close([("seq-0", [30, 31, 32])])
    wait_until(lambda: "UNAVAILABLE" in recorded(client).observe_outcomes, "an Observe attempt fails")
    client.stop(timeout_s=DEADLINE_S)
    assert client.pending_observations == 1  # given up at stop: drafts get worse, outputs never do
    assert not client._worker.is_alive()


# -- after an outage: reopening a big batch within the deadline, drafts back within a second --


def long_contexts(count: int, length: int) -> list[list[int]]:
    import random

    rng = random.Random(5)
    return [[rng.randrange(40_000) for _ in range(length)] for _ in range(count)]


def test_a_call_whose_deadline_passes_leaves_no_session(drafters):
    server = drafters.start()
    stub = drafters.stub(server)
    opening = [
        pb.SequenceUpdate(session_id=f"s{i}", open=True, new_tokens=tokens_, num_draft_tokens=3)
        for i, tokens_ in enumerate(long_contexts(16, 6000))
    ]
    with pytest.raises(grpc.RpcError) as raised:
        stub.Propose(pb.ProposeRequest(vocabulary=VOCABULARY, sequences=opening), timeout=0.01)  # ~100K tokens: far too short
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    time.sleep(1.0)  # the server finishes (or drops) the call it was serving
    assert drafters.stats(server).open_sessions == 0


def test_reopening_a_big_batch_after_an_outage_spreads_over_steps_that_each_meet_their_deadline(drafters, clients):
    # 16 sequences of 6,000 tokens: reopened in one call (96K tokens, ~0.3-0.4 s of
    # drafter work) every step would miss the 100 ms deadline forever.
    server = drafters.start()
    client = clients(server.port, timeout_s=0.1)
    contexts = long_contexts(16, 6000)
    requests = [DraftRequest(f"seq-{i}", context, 3) for i, context in enumerate(contexts)]
    steps = 0
    while len(client._sent) < 16:
        client.propose(requests)
        steps += 1
        assert steps <= 8  # 16,384 tokens a call: two sessions a step
    assert client.fallbacks == 0
    assert [len(request.sequences) for request in recorded(client).proposes][:2] == [2, 4]  # two opened, then 2 known + 2 new
    assert drafters.stats(server).open_sessions == 16


def test_drafts_come_back_within_a_second_of_a_restarted_drafter_serving(drafters, clients):
    port = free_port()
    first = drafters.start(port)
    client = clients(port, timeout_s=0.1)  # the defaults: back-off and reconnect as shipped
    assert tokens(client.propose([DraftRequest("seq-0", CONTEXT, 3)])) == [[4, 2, 3]]
    first.stop(0)
    down_until = time.monotonic() + 3.0  # down for 3 s while steps keep running
    while time.monotonic() < down_until:
        assert tokens(client.propose([DraftRequest("seq-0", CONTEXT, 3)])) == [[]]
        time.sleep(0.05)
    drafters.start(port)  # returns once it reports SERVING
    serving_at = time.monotonic()
    wait_until(lambda: client.propose([DraftRequest("seq-0", CONTEXT, 3)])[0].tokens, "drafts come back")
    assert time.monotonic() - serving_at < 1.0


def test_closing_many_sessions_stays_within_the_drafters_per_call_limits():
    # The drafter refuses a CloseSessions with an id twice or over --max-sequences-per-call
    # (1024): after an outage a verifier may close thousands at once.
    class Recorder:
        def __init__(self) -> None:
            self.calls: list[list[str]] = []

        def CloseSessions(self, request, timeout=None, metadata=None):
            self.calls.append(list(request.session_ids))

    client = RemoteDrafter(DrafterClientConfig(target="127.0.0.1:1", vocabulary=VOCABULARY))
    try:
        client.replicas[0].stub = recorder = Recorder()
        ids = [f"s{i}" for i in range(600)]
        client._close_sessions(ids + ids[:10], 0)
        assert [len(call) for call in recorder.calls] == [256, 256, 88]
        assert sum(recorder.calls, []) == ids  # each once, in order
    finally:
        client.stop(timeout_s=0)


def test_trees_and_predictions_travel_both_ways(drafters, clients):
    server = drafters.start()
    client = clients(server.port)
    # The target predicted 50 then 51 after (5, 6), and 52 after (6, 7).
    predictions = Predictions(2, previous=[5, 6], current=[6, 7], tokens=[50, 51, 52, 53])
    client.propose([DraftRequest("seq-0", [1, 5, 6], 2, max_nodes=6, predictions=predictions)])
    update = recorded(client).proposes[0].sequences[0]
    assert update.max_tree_nodes == 6
    assert (update.predictions.k, list(update.predictions.previous), list(update.predictions.current)) == (2, [5, 6], [6, 7])
    assert list(update.predictions.tokens) == [50, 51, 52, 53]
    store = server.servicer.stores.find(VOCABULARY)
    wait_until(lambda: store is not None and store.successors((5, 6)) == (50, 51), "the successor table holds the predictions")
    [draft] = client.propose([DraftRequest("seq-1", [9, 5, 6], 2, max_nodes=6)])
    # (5, 6) -> 50 best, 51 second: a root with two children; nothing is known after either.
    assert (draft.tokens, draft.parents) == ([50, 51], [-1, -1])
    assert [evidence.source for evidence in draft.evidence] == ["successor", "successor"]


ALICE, BOB, FLEET = "a" * 32, "b" * 32, "f" * 32


def test_each_sequence_drafts_and_learns_in_its_own_scope(drafters, clients):
    server = drafters.start()
    client = clients(server.port)
    secret = [10, 11, 12, 13, 14, 15, 16]
    client.propose([DraftRequest("alice-1", secret[:5], 2, scope=ALICE)])
    assert recorded(client).proposes[0].sequences[0].scope == ALICE  # declared when the session opens
    client.close([FinishedSequence("alice-1", secret, ALICE)])
    wait_until(lambda: drafters.stats(server).observed_tokens == len(secret), "the observation is stored")
    assert [request.scope for request in recorded(client).observes] == [ALICE]
    # Bob's scope, and the default one, never draft alice's text; alice's does.
    assert tokens(client.propose([DraftRequest("bob-1", secret[:4], 3, scope=BOB), DraftRequest("anon-1", secret[:4], 3)])) == [[], []]
    assert tokens(client.propose([DraftRequest("alice-2", secret[:4], 3, scope=ALICE)])) == [[14, 15, 16]]


def test_the_shared_scope_is_read_by_every_sequence(drafters, clients):
    server = drafters.start()
    fleet = clients(server.port)
    fleet.propose([DraftRequest("fleet-1", [30, 31, 32, 33], 0, scope=FLEET)])
    fleet.close([FinishedSequence("fleet-1", [30, 31, 32, 33, 34, 35, 36], FLEET)])
    wait_until(lambda: drafters.stats(server).observed_tokens == 7, "the fleet's text is stored")
    reader = clients(server.port, shared_scope=FLEET)
    assert tokens(reader.propose([DraftRequest("bob-1", [30, 31, 32, 33], 3, scope=BOB)])) == [[34, 35, 36]]
    assert recorded(reader).proposes[0].shared_scope == FLEET


def test_a_drafter_with_a_client_token_takes_scopes_only_from_verifiers_that_send_it(drafters, clients, caplog):
    server = drafters.start(client_token="drafter-token")
    trusted = clients(server.port, token="drafter-token")
    assert tokens(trusted.propose([DraftRequest("s", CONTEXT, 3, scope=ALICE)])) == [[4, 2, 3]]
    assert trusted.fallbacks == 0
    stranger = clients(server.port)
    with caplog.at_level(logging.WARNING, logger="verifier_service.serving.drafter_client"):
        assert tokens(stranger.propose([DraftRequest("s", CONTEXT, 3, scope=ALICE)])) == [[]]  # plain decoding, never an error
    assert stranger.fallbacks == 1
    assert "PERMISSION_DENIED" in caplog.text and "--client-token" in caplog.text


def test_the_token_can_come_from_a_file(tmp_path):
    (tmp_path / "token").write_text("from-a-file\n")
    assert DrafterClientConfig(token_file=str(tmp_path / "token")).bearer() == "from-a-file"
    assert DrafterClientConfig(token="flag", token_file=str(tmp_path / "token")).bearer() == "flag"
    with pytest.raises(ValueError, match="cannot read --drafter-token-file"):
        DrafterClientConfig(token_file=str(tmp_path / "missing"))


def test_a_call_carries_predictions_for_at_most_its_budget_of_positions(drafters, clients, monkeypatch):
    monkeypatch.setattr(drafter_client, "PREDICTED_POSITIONS_PER_CALL", 5)
    server = drafters.start()
    client = clients(server.port)
    three = Predictions(k=1, previous=[1, 2, 3], current=[2, 3, 4], tokens=[3, 4, 5])
    client.propose([DraftRequest(f"s{i}", CONTEXT, 2, predictions=three) for i in range(3)])
    sent = recorded(client).proposes[-1].sequences
    assert [len(update.predictions.current) for update in sent] == [3, 0, 0]  # 3 fit in 5; the next 3 would not
    assert client.fallbacks == 0


# -- replicas: --drafter A,B; one in use, the next one when it goes away -------------------------


@pytest.mark.parametrize(
    "given, targets",
    [
        ("127.0.0.1:50051", ("127.0.0.1:50051",)),
        ("drafter-a:50051,drafter-b:50051", ("drafter-a:50051", "drafter-b:50051")),
        ("[::1]:50051, 10.0.0.2:50051", ("[::1]:50051", "10.0.0.2:50051")),  # spaces after commas are dropped
        # One target with a scheme is one channel: gRPC resolves it (and its own address list) itself.
        ("dns:///drafter-headless:50051", ("dns:///drafter-headless:50051",)),
        ("ipv4:10.0.0.1:50051,10.0.0.2:50051", ("ipv4:10.0.0.1:50051,10.0.0.2:50051",)),
        ("unix:/run/specdec/drafter.sock", ("unix:/run/specdec/drafter.sock",)),
    ],
)
def test_drafter_takes_a_list_of_replicas_or_one_grpc_target(given, targets):
    assert DrafterClientConfig(target=given).targets() == targets


@pytest.mark.parametrize(
    "given, message",
    [
        ("a:50051,,b:50051", "--drafter 'a:50051,,b:50051': entry 2 is empty"),
        ("a:50051,", "--drafter 'a:50051,': entry 2 is empty"),
        ("drafter", "--drafter 'drafter': 'drafter' is not HOST:PORT (a port is required"),
        ("a:50051,b", "entry 2: 'b' is not HOST:PORT (a port is required"),
        ("a:50051,b:50051,A:50051", "entry 3 repeats entry 1 (A:50051); list each replica once"),
        ("::1:50051", "write an IPv6 address in brackets, as [::1]:50051"),
        ("a:70000", "port 70000 of 'a:70000' is not in 1-65535"),
        ("dns:///drafter-headless", "'drafter-headless' is not HOST:PORT (a port is required"),
        ("dns:///a:50051,b:50051", "a dns: target names one name; list replicas as HOST:PORT,HOST:PORT"),
        ("a:50051,dns:///b:50051", "entry 2: a target with a scheme (dns:) must be the only one"),
    ],
)
def test_a_malformed_drafter_list_is_refused_naming_the_flag(given, message):
    with pytest.raises(ValueError) as raised:
        DrafterClientConfig(target=given)
    assert message in str(raised.value)


def test_the_verifier_command_line_refuses_a_malformed_drafter_list(capsys):
    from verifier_service.__main__ import parse_config

    with pytest.raises(SystemExit) as raised:
        parse_config(["--drafter", "127.0.0.1:50051,127.0.0.1:50051"])
    assert raised.value.code == 2  # a usage error
    assert "--drafter '127.0.0.1:50051,127.0.0.1:50051': entry 2 repeats entry 1" in capsys.readouterr().err


def test_replica_choice_moves_round_robin_past_replicas_that_failed_lately():
    now = [0.0]
    choice = ReplicaChoice(3, retry_after_s=10.0, first=0, clock=lambda: now[0])
    assert choice.fail_over(0) == 1
    now[0] = 3600.0  # b works for an hour: still b
    assert choice.current == 1
    assert choice.fail_over(1) == 2
    assert choice.fail_over(2) == 0  # a failed an hour ago: a candidate again
    assert choice.fail_over(0) is None  # b and c failed within 10 s: nowhere to go
    assert choice.current == 0
    assert choice.fail_over(1) == 0  # b's failure, reported late by another thread: a is already in use
    assert choice.failovers == 3


def test_each_client_picks_its_first_replica_at_random():
    targets = ",".join(f"127.0.0.1:{port}" for port in range(1, 5))
    made = [RemoteDrafter(DrafterClientConfig(target=targets, vocabulary=VOCABULARY)) for _ in range(24)]
    try:
        # Some replica other than the first is picked: the chance all 24 pick one is 4 x 4^-24.
        assert len({client.replica_index for client in made}) > 1
        assert all(len(client.replicas) == 4 for client in made)
    finally:
        for client in made:
            client.stop(timeout_s=0)


def two_replicas(drafters, clients, **settings):
    """Two drafters on fixed ports and a client listing both; returns (client, [servers], [ports])."""
    ports = [free_port(), free_port()]
    servers = [drafters.start(port) for port in ports]
    client = clients(",".join(f"127.0.0.1:{port}" for port in ports), **settings)
    return client, servers, ports


def test_a_step_whose_replica_is_gone_gets_its_drafts_from_the_next_one(drafters, clients, caplog):
    client, servers, ports = two_replicas(drafters, clients, backoff_s=60.0)
    first = client.replica_index
    assert tokens(client.propose([DraftRequest("seq-0", CONTEXT, 3)])) == [[4, 2, 3]]
    assert drafters.stats(servers[first]).open_sessions == 1
    servers[first].stop(0)
    with caplog.at_level(logging.WARNING, logger="verifier_service.serving.drafter_client"):
        drafts = client.propose([DraftRequest("seq-0", LONGER, 3)])
    assert tokens(drafts) == [[3, 4, 2]]  # the same step, from the other replica
    second = 1 - first
    assert client.replica_index == second
    assert (client.failovers, client.fallbacks) == (1, 0)
    assert f"drafter replica 127.0.0.1:{ports[first]} failed (UNAVAILABLE: " in caplog.text
    assert f"moving to 127.0.0.1:{ports[second]}, its sessions reopened there" in caplog.text
    [request] = client.replicas[second].stub.proposes
    [update] = request.sequences
    assert update.open is True and list(update.new_tokens) == LONGER  # reopened with its whole context
    assert update.session_id.endswith("-seq-0-1")  # under a new generation of ids
    assert drafters.stats(servers[second]).open_sessions == 1


def test_after_a_failover_the_client_stays_on_the_new_replica_while_it_works(drafters, clients):
    client, servers, ports = two_replicas(drafters, clients, backoff_s=0.0)
    first = client.replica_index
    client.propose([DraftRequest("seq-0", CONTEXT, 3)])
    servers[first].stop(0)
    client.propose([DraftRequest("seq-0", CONTEXT + [4], 3)])
    assert client.replica_index == 1 - first
    back = drafters.start(ports[first])  # the failed replica serves again
    calls_before = len(client.replicas[first].stub.proposes)
    for step in range(5):
        assert tokens(client.propose([DraftRequest("seq-0", LONGER, 3)])) == [[3, 4, 2]]
    assert client.replica_index == 1 - first
    assert len(client.replicas[first].stub.proposes) == calls_before  # never called again
    assert drafters.stats(back).open_sessions == 0
    assert client.failovers == 1


def test_with_every_replica_gone_the_step_runs_without_drafts_then_backs_off(drafters, clients):
    client, servers, ports = two_replicas(drafters, clients, backoff_s=0.5)
    first = client.replica_index
    client.propose([DraftRequest("seq-0", CONTEXT, 3)])
    for server in servers:
        server.stop(0)
    assert tokens(client.propose([DraftRequest("seq-0", LONGER, 3)])) == [[]]
    assert (client.failovers, client.fallbacks) == (1, 1)  # tried the other once, then gave up
    calls = [len(replica.stub.proposes) for replica in client.replicas]
    assert tokens(client.propose([DraftRequest("seq-0", LONGER, 3)])) == [[]]
    assert [len(replica.stub.proposes) for replica in client.replicas] == calls  # backing off: no call at all
    assert client.fallbacks == 2
    drafters.start(ports[first])  # only the first comes back: after the back-off, the next step moves to it
    assert wait_until(lambda: client.propose([DraftRequest("seq-0", LONGER, 3)])[0].tokens, "drafts come back") == [3, 4, 2]
    assert client.replica_index == first


class DeadlineExceeded(grpc.RpcError, grpc.Call):
    """What a call that timed out raises (its code and details)."""

    def __init__(self, code: grpc.StatusCode = grpc.StatusCode.DEADLINE_EXCEEDED) -> None:
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return f"{self._code.name.lower()} (injected)"


class TimingOut:
    """A stub whose Propose always times out; the rest passes to ``stub``."""

    def __init__(self, stub) -> None:
        self.stub, self.proposes = stub, 0

    def Propose(self, request, timeout=None, metadata=None):
        self.proposes += 1
        raise DeadlineExceeded()

    def __getattr__(self, name):
        return getattr(self.stub, name)


def test_a_connected_replica_that_times_out_is_left_only_after_several_steps_in_a_row(drafters, clients):
    client, servers, _ = two_replicas(drafters, clients, backoff_s=0.0)
    first = client.replica_index
    client.propose([DraftRequest("seq-0", CONTEXT, 3)])
    wait_until(lambda: client.replicas[first].state == grpc.ChannelConnectivity.READY, "the channel reports READY")
    client.replicas[first].stub = slow = TimingOut(client.replicas[first].stub)
    for step in range(drafter_client.TIMEOUTS_BEFORE_FAILOVER - 1):  # slow, not gone: no reopening elsewhere yet
        assert tokens(client.propose([DraftRequest("seq-0", LONGER, 3)])) == [[]]
        assert (client.replica_index, client.failovers) == (first, 0)
    assert tokens(client.propose([DraftRequest("seq-0", LONGER, 3)])) == [[3, 4, 2]]  # one more: moved, in the same step
    assert (client.replica_index, client.failovers) == (1 - first, 1)
    assert slow.proposes == drafter_client.TIMEOUTS_BEFORE_FAILOVER


def test_sessions_are_closed_on_the_replica_that_holds_them(drafters, clients):
    client, servers, _ = two_replicas(drafters, clients)
    first = client.replica_index
    client.propose([DraftRequest("seq-0", CONTEXT, 3)])
    servers[first].stop(0)
    client.propose([DraftRequest("seq-0", LONGER, 3), DraftRequest("seq-1", CONTEXT, 3)])
    survivor = servers[1 - first]
    assert drafters.stats(survivor).open_sessions == 2
    client.close([("seq-0", LONGER + [3]), ("seq-1", CONTEXT + [4])])
    wait_until(lambda: drafters.stats(survivor).open_sessions == 0, "both sessions are closed on the survivor")


def test_an_observation_follows_the_client_to_the_next_replica_with_the_same_id(drafters, clients):
    client, servers, _ = two_replicas(drafters, clients)
    first = client.replica_index
    client.propose([DraftRequest("seq-0", CONTEXT, 3)])  # connected: the observer sees the channel go down
    servers[first].stop(0)
    finished = [40, 41, 42, 43, 44]
    client.close([("seq-0", finished)])
    survivor = servers[1 - first]
    wait_until(lambda: drafters.stats(survivor).observed_tokens == len(finished), "the observation is stored on the survivor")
    wait_until(lambda: client.pending_observations == 0, "the client's queue is empty")
    failed, stored = client.replicas[first].stub, client.replicas[1 - first].stub
    assert "UNAVAILABLE" in failed.observe_outcomes and stored.observe_outcomes == ["OK"]
    assert {request.observe_id for request in failed.observes + stored.observes} == {stored.observes[0].observe_id}
    assert client.replica_index == 1 - first
    assert client.dropped_observations == 0


class FailingObserve:
    """A stub whose first ``failures`` Observe calls fail with ``code`` before reaching the drafter."""

    def __init__(self, stub, code: grpc.StatusCode, failures: int) -> None:
        self.stub, self.code, self.failures = stub, code, failures

    def Observe(self, request, timeout=None, metadata=None):
        if self.failures:
            self.failures -= 1
            self.stub.observes.append(request)
            self.stub.observe_outcomes.append(self.code.name)
            raise DeadlineExceeded(self.code)
        return self.stub.Observe(request, timeout=timeout, metadata=metadata)

    def __getattr__(self, name):
        return getattr(self.stub, name)


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED])
def test_an_observation_the_drafter_cannot_take_now_is_retried_with_the_same_id(drafters, clients, code):
    # The drafter answers UNAVAILABLE while its log is down, RESOURCE_EXHAUSTED when its write queue is full.
    server = drafters.start()
    client = clients(server.port)
    recorder = client.replicas[0].stub
    client.replicas[0].stub = FailingObserve(recorder, code, failures=2)
    client.close([("seq-0", [50, 51, 52, 53])])
    wait_until(lambda: drafters.stats(server).observed_tokens == 4, "the retried observation is stored")
    assert recorder.observe_outcomes == [code.name, code.name, "OK"]
    assert len({request.observe_id for request in recorder.observes}) == 1
    assert client.dropped_observations == 0


def test_an_observation_in_a_scope_the_drafter_refuses_is_dropped_and_counted(drafters, clients, caplog):
    server = drafters.start(client_token="drafter-token")
    client = clients(server.port)  # sends no token: it may not declare a scope
    with caplog.at_level(logging.ERROR, logger="verifier_service.serving.drafter_client"):
        client.close([FinishedSequence("seq-0", [60, 61, 62, 63], ALICE)])
        wait_until(lambda: client.pending_observations == 0, "the refused observation leaves the queue")
    assert recorded(client).observe_outcomes == ["PERMISSION_DENIED"]
    assert client.dropped_observations == 1
    assert "drafter refused an observation: " in caplog.text and "(PERMISSION_DENIED; dropped)" in caplog.text
    assert drafters.stats(server).observed_tokens == 0


def test_one_target_of_several_addresses_moves_inside_grpc_and_reopens_the_sessions(drafters, clients):
    # ipv4:A,B is one channel, as dns:///NAME:PORT resolving to two addresses is: pick_first keeps it on
    # one address, and moves it when that one fails. The new address answers NOT_FOUND: sessions reopen.
    ports = [free_port(), free_port()]
    servers = [drafters.start(port) for port in ports]
    client = clients("ipv4:" + ",".join(f"127.0.0.1:{port}" for port in ports), backoff_s=0.05)
    assert len(client.replicas) == 1
    assert tokens(client.propose([DraftRequest("seq-0", CONTEXT, 3)])) == [[4, 2, 3]]
    [holder] = [index for index, server in enumerate(servers) if drafters.stats(server).open_sessions == 1]
    servers[holder].stop(0)
    assert wait_until(lambda: client.propose([DraftRequest("seq-0", LONGER, 3)])[0].tokens, "drafts come back") == [3, 4, 2]
    assert drafters.stats(servers[1 - holder]).open_sessions == 1
    assert recorded(client).proposes[-1].sequences[0].open is True
    assert client.failovers == 0 and client.fallbacks >= 1
