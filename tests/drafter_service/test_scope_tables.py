"""Learning scopes: a draft comes only from its sequence's own scope (and the request's
shared scope, read only), and a client that may not declare scopes learns in its own.

The drafter in-process (``DrafterServicer`` over a started writer), called as verifiers
and hostile clients call it: callers told apart by client certificate or peer address
(``FakeContext``), bearer tokens in the metadata.
"""

from __future__ import annotations

import time

import grpc
import pytest
from prometheus_client import generate_latest
from test_servicer_overload import VOCABULARY, Aborted, FakeContext, started_writer

from drafter_service.config import DrafterConfig
from drafter_service.ngram import InMemoryNGramTable, LayeredSource
from drafter_service.scopes import DEFAULT_SCOPE, ScopeGate, ScopeRefused, peer_scope, split_table_name, table_name
from drafter_service.server import DrafterServicer
from drafter_service.storage import StoreRegistry
from specdec.v1 import drafter_pb2 as pb

ALICE, BOB, FLEET = "a" * 32, "b" * 32, "f" * 32
PREFIX = [11, 12, 13, 14, 15, 16]
SECRET = [201, 202, 203, 204, 205, 206, 207, 208]
TOKEN = "verifier-token"


def observe(servicer, tokens, scope: str, observe_id: str, context=None):
    request = pb.ObserveRequest(vocabulary=VOCABULARY, observe_id=observe_id, scope=scope, sequences=[pb.TokenSequence(tokens=tokens)])
    return servicer.Observe(request, context or FakeContext())


def draft(servicer, session_id: str, tokens, scope: str = DEFAULT_SCOPE, context=None, shared: str = "", k: int = 8) -> list[int]:
    update = pb.SequenceUpdate(session_id=session_id, new_tokens=tokens, open=True, num_draft_tokens=k, scope=scope)
    request = pb.ProposeRequest(vocabulary=VOCABULARY, sequences=[update], shared_scope=shared)
    return list(servicer.Propose(request, context or FakeContext()).drafts[0].tokens)


def refused(call, request, context) -> FakeContext:
    with pytest.raises(Aborted):
        call(request, context)
    return context


@pytest.fixture
def open_drafter(tmp_path):
    """A drafter with no --client-token: any client may declare a scope."""
    with started_writer(tmp_path, max_write_wait_s=5.0) as (config, stores, writer):
        yield DrafterServicer(config, stores, writer), stores


@pytest.fixture
def gated_drafter(tmp_path):
    """A drafter with --client-token: only its holders declare scopes."""
    with started_writer(tmp_path, max_write_wait_s=5.0, client_token=TOKEN) as (config, stores, writer):
        yield DrafterServicer(config, stores, writer), stores


# -- the rules, as plain functions


def test_table_names_keep_the_default_scope_in_the_plain_folder():
    assert table_name(VOCABULARY, DEFAULT_SCOPE) == VOCABULARY  # tables written before scopes are the default scope's
    assert table_name(VOCABULARY, ALICE) == f"{VOCABULARY}-{ALICE}"
    assert split_table_name(f"{VOCABULARY}-{ALICE}") == (VOCABULARY, ALICE)
    assert split_table_name(VOCABULARY) == (VOCABULARY, DEFAULT_SCOPE)
    for stranger in (f"{VOCABULARY}-{ALICE}.quarantined-20260101T000000", f"{VOCABULARY}-ABC", "drafter.lock", VOCABULARY + "0"):
        assert split_table_name(stranger) is None


def test_peer_scopes_are_stable_per_client_and_differ_between_clients():
    assert peer_scope("certificate mallory") == peer_scope("certificate mallory")
    assert peer_scope("certificate mallory") != peer_scope("10.0.0.7")
    assert len(peer_scope("10.0.0.7")) == 32 and peer_scope("10.0.0.7") != DEFAULT_SCOPE


def test_the_gate_lets_only_trusted_clients_declare_scopes():
    open_gate = ScopeGate(None, ())
    assert not open_gate.restricted and open_gate.trusts(None, None)
    gate = ScopeGate(TOKEN, ("verifier-1",))
    assert gate.trusts(TOKEN, None) and gate.trusts(None, "verifier-1")
    assert not gate.trusts("guess", None) and not gate.trusts(None, "mallory") and not gate.trusts(None, None)
    assert gate.resolve(ALICE, "10.0.0.7", trusted=True) == ALICE
    assert gate.resolve("", "10.0.0.7", trusted=False) == peer_scope("10.0.0.7")  # not the default scope
    with pytest.raises(ScopeRefused) as declared:
        gate.resolve(ALICE, "10.0.0.7", trusted=False)
    assert declared.value.permission
    with pytest.raises(ScopeRefused) as malformed:
        gate.resolve("ALICE", "10.0.0.7", trusted=True)
    assert not malformed.value.permission and "32 lowercase hex digits" in str(malformed.value)


def test_a_layered_source_reads_its_own_table_first():
    own, shared = InMemoryNGramTable(2, 2), InMemoryNGramTable(2, 2)
    own.observe([1, 2, 3])
    shared.observe([1, 2, 4, 2, 5, 6])
    layered = LayeredSource(own, shared)
    assert layered.best((1, 2))[0] == 3  # own's, though shared has (1, 2) -> 4
    assert layered.best((2, 5))[0] == 6  # shared's: own has nothing there
    assert layered.best((7, 7)) is None
    with pytest.raises(TypeError):
        layered.observe([1, 2])


# -- isolation between scopes


def test_one_scopes_text_never_drafts_for_another_scope_nor_the_default(open_drafter):
    # Was: one table per vocabulary, so anyone with the prefix drafted alice's secret.
    servicer, _ = open_drafter
    observe(servicer, PREFIX + SECRET, ALICE, "alice-1")
    assert draft(servicer, "bob", PREFIX, scope=BOB) == []
    assert draft(servicer, "anyone", PREFIX) == []  # a client that declares no scope: the default's table, empty
    assert draft(servicer, "alice", PREFIX, scope=ALICE) == SECRET  # its own scope drafts it


def test_two_verifiers_of_one_scope_share_what_they_learn(open_drafter):
    servicer, _ = open_drafter
    observe(servicer, PREFIX + SECRET, ALICE, "from-verifier-1", FakeContext(certificate="verifier-1"))
    assert draft(servicer, "s", PREFIX, scope=ALICE, context=FakeContext(certificate="verifier-2")) == SECRET


def test_a_session_learns_into_the_scope_it_was_opened_in(open_drafter):
    servicer, stores = open_drafter
    draft(servicer, "s", PREFIX + SECRET, scope=ALICE)
    close = pb.CloseSessionsRequest(vocabulary=VOCABULARY, session_ids=["s"], observe=True, observe_id="close-1")
    assert servicer.CloseSessions(close, FakeContext()).closed == 1
    assert stores.find(VOCABULARY, ALICE).best(tuple(PREFIX[-4:]))[0] == SECRET[0]
    assert stores.find(VOCABULARY) is None  # nothing in the default scope's table


def test_a_session_keeps_its_scope(open_drafter):
    servicer, _ = open_drafter
    draft(servicer, "s", PREFIX, scope=ALICE)
    switch = pb.ProposeRequest(vocabulary=VOCABULARY, sequences=[pb.SequenceUpdate(session_id="s", num_draft_tokens=2, scope=BOB)])
    context = refused(servicer.Propose, switch, FakeContext())
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT
    assert context.details == "sequences[0]: session 's' was opened in another scope; it keeps that one"
    same = pb.ProposeRequest(vocabulary=VOCABULARY, sequences=[pb.SequenceUpdate(session_id="s", num_draft_tokens=2, scope=ALICE)])
    servicer.Propose(same, FakeContext())  # repeating it, or leaving it unsaid, is fine


def test_the_shared_scope_is_read_after_the_own_one_and_never_written(open_drafter):
    servicer, stores = open_drafter
    observe(servicer, PREFIX + SECRET, FLEET, "fleet-1")
    fleet_entries = stores.find(VOCABULARY, FLEET).stats()["entries"]
    assert draft(servicer, "s", PREFIX, scope=ALICE, shared=FLEET) == SECRET
    observe(servicer, PREFIX + [90, 91, 92], ALICE, "alice-1")
    assert draft(servicer, "t", PREFIX, scope=ALICE, shared=FLEET)[:3] == [90, 91, 92]  # its own first
    predictions = pb.Predictions(k=1, previous=[1], current=[2], tokens=[3])
    update = pb.SequenceUpdate(session_id="u", new_tokens=PREFIX, open=True, scope=ALICE, predictions=predictions)
    servicer.Propose(pb.ProposeRequest(vocabulary=VOCABULARY, sequences=[update], shared_scope=FLEET), FakeContext())
    close = pb.CloseSessionsRequest(vocabulary=VOCABULARY, session_ids=["s", "t", "u"], observe=True, observe_id="closing")
    servicer.CloseSessions(close, FakeContext())
    assert stores.find(VOCABULARY, FLEET).stats()["entries"] == fleet_entries  # nothing of alice's sessions
    assert stores.find(VOCABULARY, FLEET).successors((2,)) is None


def test_malformed_scopes_are_refused_before_anything_changes(open_drafter):
    servicer, stores = open_drafter
    for scope in ("ALICE", "a" * 31, "../" + "a" * 29, "a" * 33):
        update = pb.SequenceUpdate(session_id="s", new_tokens=PREFIX, open=True, scope=scope)
        context = refused(servicer.Propose, pb.ProposeRequest(vocabulary=VOCABULARY, sequences=[update]), FakeContext())
        assert context.code == grpc.StatusCode.INVALID_ARGUMENT and "sequences[0].scope" in context.details
        context = refused(servicer.Observe, _observe_request(scope), FakeContext())
        assert context.code == grpc.StatusCode.INVALID_ARGUMENT and context.details.startswith("scope must be empty")
    assert len(servicer.sessions) == 0 and stores.all() == {}


def _observe_request(scope: str) -> pb.ObserveRequest:
    return pb.ObserveRequest(vocabulary=VOCABULARY, observe_id="o", scope=scope, sequences=[pb.TokenSequence(tokens=PREFIX)])


# -- who may declare a scope


def test_with_a_client_token_a_client_without_it_cannot_name_a_scope(gated_drafter):
    # Was: any client that reached the drafter read every table (24 secret tokens in one Propose).
    servicer, _ = gated_drafter
    observe(servicer, PREFIX + SECRET, ALICE, "alice-1", FakeContext(token=TOKEN))
    for context in (FakeContext(), FakeContext(token="guess"), FakeContext(certificate="mallory")):
        update = pb.SequenceUpdate(session_id="steal", new_tokens=PREFIX, open=True, num_draft_tokens=8, scope=ALICE)
        refusal = refused(servicer.Propose, pb.ProposeRequest(vocabulary=VOCABULARY, sequences=[update]), context)
        assert refusal.code == grpc.StatusCode.PERMISSION_DENIED and "--client-token" in refusal.details
        assert refused(servicer.Observe, _observe_request(ALICE), context).code == grpc.StatusCode.PERMISSION_DENIED
        assert draft(servicer, f"undeclared-{id(context)}", PREFIX, context=context) == []  # its own scope: empty
    assert servicer.refused_scopes == 6
    assert draft(servicer, "alice", PREFIX, scope=ALICE, context=FakeContext(token=TOKEN)) == SECRET


def test_a_client_that_may_not_declare_learns_in_a_scope_of_its_own(gated_drafter):
    servicer, stores = gated_drafter
    mallory = FakeContext(certificate="mallory")
    observe(servicer, PREFIX + [66, 67, 68], "", "poison", mallory)
    assert draft(servicer, "verifier", PREFIX, context=FakeContext(token=TOKEN)) == []  # the default scope is untouched
    assert draft(servicer, "again", PREFIX, context=FakeContext(certificate="mallory")) == [66, 67, 68]  # its own, stable
    assert stores.find(VOCABULARY, peer_scope("certificate mallory")) is not None


def test_listed_verifier_identities_may_declare_scopes(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("not read by the servicer")
    with started_writer(tmp_path, verifier_identities="verifier-1", tls_client_ca=str(ca), tls_cert=str(ca), tls_key=str(ca)) as (
        config,
        stores,
        writer,
    ):
        servicer = DrafterServicer(config, stores, writer)
        observe(servicer, PREFIX + SECRET, ALICE, "alice-1", FakeContext(certificate="verifier-1"))
        assert draft(servicer, "s", PREFIX, scope=ALICE, context=FakeContext(certificate="verifier-1")) == SECRET
        context = refused(servicer.Observe, _observe_request(ALICE), FakeContext(certificate="verifier-2"))
        assert context.code == grpc.StatusCode.PERMISSION_DENIED


# -- budgets per scope


def test_one_scopes_flood_never_evicts_another_scopes_ngrams(tmp_path):
    # Was: one table for all, so a flood of random tokens evicted the victim's n-grams (41k tokens on 1 MiB).
    with started_writer(tmp_path, max_write_wait_s=30.0, max_bytes=1 << 16) as (config, stores, writer):
        servicer = DrafterServicer(config, stores, writer)
        observe(servicer, PREFIX + SECRET, ALICE, "victim")
        for call in range(20):  # ~2,000 tokens of distinct n-grams a call: many times the 64 KiB budget
            junk = [1000 + (call * 2000 + i) * 7 % 100_000 for i in range(2000)]
            observe(servicer, junk, BOB, f"flood-{call}")
        assert stores.find(VOCABULARY, BOB).stats()["evictions"] > 0  # the flood evicted, inside its own scope
        assert stores.find(VOCABULARY, ALICE).stats()["evictions"] == 0
        assert draft(servicer, "victim", PREFIX, scope=ALICE) == SECRET


def test_scopes_beyond_the_limit_learn_nothing_and_still_draft_from_their_context(tmp_path):
    with started_writer(tmp_path, max_write_wait_s=5.0, max_scopes=2) as (config, stores, writer):
        servicer = DrafterServicer(config, stores, writer)
        observe(servicer, PREFIX, ALICE, "a")
        observe(servicer, PREFIX, BOB, "b")
        context = refused(servicer.Observe, _observe_request(FLEET), FakeContext())
        assert context.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-scopes" in context.details
        assert draft(servicer, "s", [1, 2, 3, 1, 2], scope=FLEET, k=1) == [3]  # drafts from its own context
        observe(servicer, [7, 8, 9], ALICE, "a-2")  # the scopes held still learn


def test_predictions_beyond_the_per_call_limit_are_refused(tmp_path):
    # Was: 3 MB of predictions alone escaped --max-tokens-per-call (which counts new_tokens only).
    with started_writer(tmp_path, max_predictions_per_call=64) as (config, stores, writer):
        servicer = DrafterServicer(config, stores, writer)
        positions = 9  # 9 x k 4 x 2 sequences = 72 predicted tokens
        predictions = pb.Predictions(k=4, previous=[1] * positions, current=[2] * positions, tokens=[3] * (4 * positions))
        updates = [pb.SequenceUpdate(session_id=f"s{i}", new_tokens=[1, 2], open=True, predictions=predictions) for i in range(2)]
        context = refused(servicer.Propose, pb.ProposeRequest(vocabulary=VOCABULARY, sequences=updates), FakeContext())
        assert context.code == grpc.StatusCode.INVALID_ARGUMENT
        assert context.details == (
            "72 predicted tokens in one call; the limit is 64 (--max-predictions-per-call): send fewer positions or a smaller k"
        )
        assert len(servicer.sessions) == 0
        servicer.Propose(pb.ProposeRequest(vocabulary=VOCABULARY, sequences=updates[:1]), FakeContext())  # 36: within it


def test_predicted_positions_beyond_the_per_call_limit_are_refused_whatever_their_k(tmp_path):
    # Was: at k 1 a call carried 65K positions (131K successor keys) within --max-predictions-per-call,
    # and a few such callers left honest verifiers' Propose past their deadlines.
    with started_writer(tmp_path, max_predicted_positions_per_call=16) as (config, stores, writer):
        servicer = DrafterServicer(config, stores, writer)
        predictions = pb.Predictions(k=1, previous=[1] * 9, current=[2] * 9, tokens=[3] * 9)
        updates = [pb.SequenceUpdate(session_id=f"s{i}", new_tokens=[1, 2], open=True, predictions=predictions) for i in range(2)]
        context = refused(servicer.Propose, pb.ProposeRequest(vocabulary=VOCABULARY, sequences=updates), FakeContext())
        assert context.code == grpc.StatusCode.INVALID_ARGUMENT
        assert context.details == (
            "18 predicted positions in one call; the limit is 16 (--max-predicted-positions-per-call): send fewer positions"
        )
        servicer.Propose(pb.ProposeRequest(vocabulary=VOCABULARY, sequences=updates[:1]), FakeContext())  # 9: within it


def test_predictions_go_to_their_sessions_scope_only(open_drafter):
    # Was: one successor table per vocabulary, so an attacker's made-up predictions became the victim's drafts.
    servicer, stores = open_drafter
    predictions = pb.Predictions(k=2, previous=[41], current=[42], tokens=[666, 667])
    update = pb.SequenceUpdate(session_id="attacker", new_tokens=[41, 42], open=True, scope=BOB, predictions=predictions)
    servicer.Propose(pb.ProposeRequest(vocabulary=VOCABULARY, sequences=[update]), FakeContext())
    _wait_for(lambda: stores.find(VOCABULARY, BOB) is not None and stores.find(VOCABULARY, BOB).successors((41, 42)) == (666, 667))
    assert stores.find(VOCABULARY, ALICE) is None and stores.find(VOCABULARY) is None
    assert draft(servicer, "victim", [41, 42], scope=ALICE, k=2) == []


def _wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


# -- the tables on disk


def test_a_table_from_before_scopes_is_the_default_scopes_after_a_restart(tmp_path):
    db = tmp_path / "db"
    config = DrafterConfig(db=str(db))
    stores = StoreRegistry(config)
    stores.get(VOCABULARY).apply([("before", PREFIX + SECRET)])  # written as a drafter without scopes wrote it: db/<vocabulary>
    stores.close()
    assert sorted(entry.name for entry in db.iterdir() if entry.is_dir()) == [VOCABULARY]
    with started_writer(tmp_path) as (config, stores, writer):
        servicer = DrafterServicer(config, stores, writer)
        assert draft(servicer, "s", PREFIX) == SECRET
        assert draft(servicer, "t", PREFIX, scope=ALICE) == []
        observe(servicer, [1, 2, 3], ALICE, "a")
        stats = servicer.Stats(pb.StatsRequest(), FakeContext())
        assert stats.scopes == 2 and stats.max_bytes == 2 * config.max_bytes
    with started_writer(tmp_path) as (config, stores, writer):  # a warm restart keeps every scope
        assert sorted(stores.all()) == [VOCABULARY, f"{VOCABULARY}-{ALICE}"]


# -- configuration


def test_a_drafter_reachable_from_a_network_needs_a_token_identities_or_insecure(tmp_path):
    with pytest.raises(ValueError, match="--host 0.0.0.0 reaches beyond this machine"):
        DrafterConfig(db=str(tmp_path), host="0.0.0.0")
    DrafterConfig(db=str(tmp_path), host="0.0.0.0", client_token="t")
    DrafterConfig(db=str(tmp_path), host="0.0.0.0", insecure=True)
    for loopback in ("127.0.0.1", "127.0.0.2", "::1", "localhost", "[::1]"):
        DrafterConfig(db=str(tmp_path), host=loopback)
    with pytest.raises(ValueError, match="needs mutual TLS"):
        DrafterConfig(db=str(tmp_path), verifier_identities="verifier-1")
    token_file = tmp_path / "token"
    token_file.write_text("from-a-file\n")
    assert DrafterConfig(db=str(tmp_path), host="0.0.0.0", client_token_file=str(token_file)).token() == "from-a-file"
    with pytest.raises(ValueError, match="cannot read --client-token-file"):
        DrafterConfig(db=str(tmp_path), client_token_file=str(tmp_path / "missing"))


def test_each_scope_has_a_share_of_the_writers_queue_that_holds_one_call(tmp_path):
    config = DrafterConfig(db=str(tmp_path))
    assert (config.pending_observations_per_scope, config.pending_write_tokens_per_scope) == (1024, 1 << 18)
    assert config.pending_successors_per_scope == 1 << 14
    small = DrafterConfig(db=str(tmp_path), max_pending_observations=1)
    assert small.pending_observations_per_scope == 1  # never above the whole
    with pytest.raises(ValueError, match=r"--max-pending-observations-per-scope \(10\) must hold one call of --max-sequences-per-call"):
        DrafterConfig(db=str(tmp_path), max_pending_observations_per_scope=10)
    with pytest.raises(ValueError, match=r"--max-pending-write-tokens-per-scope \(10\) must hold one call of --max-tokens-per-call"):
        DrafterConfig(db=str(tmp_path), max_pending_write_tokens_per_scope=10)


def test_metrics_count_scopes_and_never_name_them(open_drafter):
    servicer, _ = open_drafter
    observe(servicer, PREFIX, ALICE, "a")
    observe(servicer, PREFIX, BOB, "b")
    scrape = generate_latest(servicer.registry).decode()
    assert f'specdec_drafter_table_scopes{{vocabulary="{VOCABULARY}"}} 2.0' in scrape
    assert f'specdec_drafter_table_successor_evictions_total{{vocabulary="{VOCABULARY}"}} 0.0' in scrape
    assert ALICE not in scrape and BOB not in scrape


def test_only_a_trusted_client_may_forget_a_scope(gated_drafter):
    servicer, stores = gated_drafter
    observe(servicer, PREFIX + SECRET, ALICE, "a-1", FakeContext(token=TOKEN))
    request = pb.ForgetRequest(vocabulary=VOCABULARY, scope=ALICE)
    stranger = refused(servicer.Forget, request, FakeContext())
    assert stranger.code == grpc.StatusCode.PERMISSION_DENIED and "--client-token" in stranger.details
    assert stores.find(VOCABULARY, ALICE) is not None
    assert servicer.Forget(request, FakeContext(token=TOKEN)).dropped
    assert stores.find(VOCABULARY, ALICE) is None
    assert draft(servicer, "s", PREFIX, ALICE, FakeContext(token=TOKEN)) == []  # forgotten: nothing left to draft from
