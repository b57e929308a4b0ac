"""The drafter as a real process on a free loopback port: restarts, kill -9, bad input, health."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import grpc
import lmdb
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.v1 import drafter_pb2 as pb
from specdec.v1 import drafter_pb2_grpc as rpc

from processes import ServiceProcess

VOCABULARY = "00112233445566aa"
OTHER_VOCABULARY = "ffeeddccbbaa9988"
STARTUP_TIMEOUT_S = 30


class DrafterProcess(ServiceProcess):
    """``python -m drafter_service`` on a free port (metrics too, so parallel runs never
    collide on 9101), with a stub on its channel."""

    def __init__(self, db, *extra):
        metrics_port = os.environ.get("SPECDEC_DRAFTER_METRICS_PORT", "0")
        super().__init__(
            "drafter_service", "--port", "0", "--db", str(db), *extra, env={**os.environ, "SPECDEC_DRAFTER_METRICS_PORT": metrics_port}
        )
        self.stub = rpc.DrafterStub(self.channel)
        grpc.channel_ready_future(self.channel).result(timeout=STARTUP_TIMEOUT_S)


@contextmanager
def drafter(db, *extra):
    process = DrafterProcess(db, *extra)
    try:
        yield process
    finally:
        process.kill()


def tables(db) -> list[str]:
    """The table folders under ``db`` (beside them: the drafter's lock file)."""
    return sorted(p.name for p in Path(db).iterdir() if p.is_dir())


def propose(stub, session, tokens, k, open_=False, vocabulary=VOCABULARY, scope=""):
    request = pb.ProposeRequest(
        vocabulary=vocabulary,
        sequences=[pb.SequenceUpdate(session_id=session, new_tokens=tokens, open=open_, num_draft_tokens=k, scope=scope)],
    )
    return stub.Propose(request, timeout=5).drafts[0]


def observe(stub, observe_id, *sequences, vocabulary=VOCABULARY, scope=""):
    request = pb.ObserveRequest(
        vocabulary=vocabulary, observe_id=observe_id, sequences=[pb.TokenSequence(tokens=s) for s in sequences], scope=scope
    )
    return stub.Observe(request, timeout=10)


def test_propose_chains_from_context_and_batches_sessions(tmp_path):
    with drafter(tmp_path / "db") as server:
        request = pb.ProposeRequest(
            vocabulary=VOCABULARY,
            sequences=[
                pb.SequenceUpdate(session_id="a", new_tokens=[1, 2, 3, 4, 2, 3], open=True, num_draft_tokens=3),
                pb.SequenceUpdate(session_id="b", new_tokens=[9, 8], open=True, num_draft_tokens=3),
            ],
        )
        first, second = server.stub.Propose(request, timeout=5).drafts
        # Context [1,2,3,4,2,3]: (2,3)->4, (3,4)->2, (4,2)->3 -- the 2-gram chain,
        # lengthened to 3- and 4-token matches as the chain reuses the context.
        assert list(first.tokens) == [4, 2, 3]
        assert list(first.sources) == [pb.DRAFT_SOURCE_CONTEXT] * 3
        assert list(first.match_lengths) == [2, 3, 4]
        assert list(second.tokens) == []  # nothing seen before
        # Later calls send only the new tokens: after 4 the context continues 2, 3, 4.
        assert list(propose(server.stub, "a", [4], 3).tokens) == [2, 3, 4]
        assert server.terminate() == 0


def test_acknowledged_observations_survive_kill_9_and_proposals_are_identical(tmp_path):
    db = tmp_path / "db"
    rng = random.Random(7)
    sequences = [[rng.randrange(1000) for _ in range(40)] for _ in range(20)]
    with drafter(db) as server:
        for index, sequence in enumerate(sequences):
            assert observe(server.stub, f"obs-{index}", sequence).applied
        before = [list(propose(server.stub, f"s{i}", s[:6], 8, open_=True).tokens) for i, s in enumerate(sequences)]
        server.kill()
    with drafter(db) as server:
        after = [list(propose(server.stub, f"s{i}", s[:6], 8, open_=True).tokens) for i, s in enumerate(sequences)]
        # A 4-token match is trusted once: each sequence's own next 8 tokens come back.
        assert after == before == [s[6:14] for s in sequences]
        # Retrying an acknowledged id after the restart is not counted twice.
        assert not observe(server.stub, "obs-0", sequences[0]).applied
        assert server.terminate() == 0


def test_kill_9_during_concurrent_observes_loses_nothing_acknowledged(tmp_path):
    db = tmp_path / "db"
    rng = random.Random(11)
    acknowledged = {}
    for round_ in range(3):
        with drafter(db) as server:
            stop = threading.Event()
            lock = threading.Lock()

            def writer(worker):
                for index in range(1000):
                    if stop.is_set():
                        return
                    sequence = [rng.randrange(50_000) for _ in range(12)]
                    key = f"r{round_}-w{worker}-{index}"
                    try:
                        observe(server.stub, key, sequence)
                    except grpc.RpcError:
                        return  # the server died mid-call: not acknowledged
                    with lock:
                        acknowledged[key] = sequence

            threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
            for thread in threads:
                thread.start()
            time.sleep(0.5 + rng.random())
            server.kill()
            stop.set()
            for thread in threads:
                thread.join(timeout=30)
    assert len(acknowledged) > 20
    with drafter(db) as server:  # reopens without any repair step
        for key, sequence in acknowledged.items():
            # Every acknowledged sequence is in the table: its first 4 tokens draft the rest.
            draft = propose(server.stub, key, sequence[:4], 8, open_=True)
            assert list(draft.tokens) == sequence[4:12], key
            # Closed at once: a fast machine acknowledges more keys than one caller may hold open.
            server.stub.CloseSessions(pb.CloseSessionsRequest(vocabulary=VOCABULARY, session_ids=[key]), timeout=5)
        assert server.terminate() == 0


def test_vocabularies_never_share_drafts(tmp_path):
    with drafter(tmp_path / "db") as server:
        observe(server.stub, "o1", [5, 6, 7, 8, 9, 10])
        assert list(propose(server.stub, "x", [5, 6, 7, 8], 2, open_=True, vocabulary=OTHER_VOCABULARY).tokens) == []
        assert list(propose(server.stub, "y", [5, 6, 7, 8], 2, open_=True).tokens) == [9, 10]


def test_health_serves_and_reflection_lists_the_service(tmp_path):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with drafter(tmp_path / "db") as server:
        health = health_pb2_grpc.HealthStub(server.channel)
        for service in ("", "specdec.v1.Drafter"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        reflection_stub = reflection_pb2_grpc.ServerReflectionStub(server.channel)
        responses = reflection_stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        names = {s.name for s in next(responses).list_services_response.service}
        assert {"specdec.v1.Drafter", "grpc.health.v1.Health"} <= names


def test_backup_is_a_consistent_copy_that_serves_the_same_drafts(tmp_path):
    with drafter(tmp_path / "db", "--backup-dir", str(tmp_path / "backups")) as server:
        observe(server.stub, "o1", [5, 6, 7, 8, 9, 10])
        response = server.stub.Backup(pb.BackupRequest(vocabulary=VOCABULARY, destination="copy"), timeout=30)
        assert response.bytes > 0
        assert server.terminate() == 0
    restored = tmp_path / "restored"
    restored.mkdir()
    assert [entry.name for entry in (tmp_path / "backups" / "copy").iterdir()] == [VOCABULARY]  # one folder per table, as in --db
    (tmp_path / "backups" / "copy" / VOCABULARY).rename(restored / VOCABULARY)
    with drafter(restored) as server:
        assert list(propose(server.stub, "y", [5, 6, 7, 8], 2, open_=True).tokens) == [9, 10]


def test_every_scope_survives_kill_9_and_is_in_the_backup(tmp_path):
    db, alice, bob = tmp_path / "db", "a" * 32, "b" * 32
    with drafter(db, "--backup-dir", str(tmp_path / "backups")) as server:
        assert observe(server.stub, "a1", [5, 6, 7, 8, 9, 10], scope=alice).applied
        assert observe(server.stub, "b1", [5, 6, 7, 8, 20, 21], scope=bob).applied
        server.kill()
    assert tables(db) == [f"{VOCABULARY}-{alice}", f"{VOCABULARY}-{bob}"]  # no default-scope table: nobody wrote one
    with drafter(db, "--backup-dir", str(tmp_path / "backups")) as server:
        assert list(propose(server.stub, "a", [5, 6, 7, 8], 2, open_=True, scope=alice).tokens) == [9, 10]
        assert list(propose(server.stub, "b", [5, 6, 7, 8], 2, open_=True, scope=bob).tokens) == [20, 21]
        assert list(propose(server.stub, "c", [5, 6, 7, 8], 2, open_=True).tokens) == []
        assert server.stub.Stats(pb.StatsRequest(), timeout=5).scopes == 2
        server.stub.Backup(pb.BackupRequest(vocabulary=VOCABULARY, destination="both"), timeout=30)
        assert server.terminate() == 0
    assert tables(tmp_path / "backups" / "both") == tables(db)


def test_stats_count_table_and_hits(tmp_path):
    with drafter(tmp_path / "db") as server:
        observe(server.stub, "o1", [5, 6, 7, 8, 9, 10])
        propose(server.stub, "a", [5, 6, 7, 8], 2, open_=True)  # 2 global hits
        propose(server.stub, "b", [1, 2], 2, open_=True)  # a miss
        stats = server.stub.Stats(pb.StatsRequest(vocabulary=VOCABULARY), timeout=5)
        # [5..10] has 5 tokens with a predecessor: 4 keys of n=2, 3 of n=3, 2 of n=4.
        assert stats.entries == 9
        assert (stats.global_hits, stats.context_hits, stats.misses) == (2, 0, 1)
        assert stats.observed_tokens == 6 and stats.open_sessions == 2


def test_verifier_feedback_gives_acceptance_per_source(tmp_path):
    with drafter(tmp_path / "db") as server:
        observe(server.stub, "o1", [50, 51, 52, 53, 54, 55])
        # Context [1,2,3,1,2] drafts 3 from the context, then (.., 3) is unknown;
        # session g drafts [54, 55] from the global table.
        assert list(propose(server.stub, "c", [1, 2, 3, 1, 2], 3, open_=True).sources) == [pb.DRAFT_SOURCE_CONTEXT] * 3
        assert list(propose(server.stub, "g", [50, 51, 52, 53], 2, open_=True).sources) == [pb.DRAFT_SOURCE_GLOBAL] * 2
        feedback = pb.ProposeRequest(
            vocabulary=VOCABULARY,
            sequences=[
                # The verifier scored all 3 context tokens and accepted 2 ...
                pb.SequenceUpdate(session_id="c", new_tokens=[3, 1, 9], verified_draft_tokens=3, accepted_draft_tokens=2),
                # ... and only the first global token (say K was cut to 1), accepting it.
                pb.SequenceUpdate(session_id="g", new_tokens=[54, 0], verified_draft_tokens=1, accepted_draft_tokens=1),
            ],
        )
        server.stub.Propose(feedback, timeout=5)
        stats = server.stub.Stats(pb.StatsRequest(vocabulary=VOCABULARY), timeout=5)
        assert (stats.context_verified, stats.context_accepted) == (3, 2)
        assert (stats.global_verified, stats.global_accepted) == (1, 1)


BAD_INPUTS = [
    # (name, rpc, request, status, message fragment)
    ("bad vocabulary", "Propose", pb.ProposeRequest(vocabulary="xyz"), grpc.StatusCode.INVALID_ARGUMENT, "16-hex-digit"),
    (
        "unknown session",
        "Propose",
        pb.ProposeRequest(vocabulary=VOCABULARY, sequences=[pb.SequenceUpdate(session_id="ghost", num_draft_tokens=2)]),
        grpc.StatusCode.NOT_FOUND,
        "unknown session 'ghost'",
    ),
    (
        "empty session id",
        "Propose",
        pb.ProposeRequest(vocabulary=VOCABULARY, sequences=[pb.SequenceUpdate(open=True, new_tokens=[1])]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "session_id is empty",
    ),
    (
        "huge token id",
        "Propose",
        pb.ProposeRequest(vocabulary=VOCABULARY, sequences=[pb.SequenceUpdate(session_id="s", open=True, new_tokens=[1, 4_000_000_000])]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "token id 4000000000 is out of range",
    ),
    (
        "K out of range",
        "Propose",
        pb.ProposeRequest(vocabulary=VOCABULARY, sequences=[pb.SequenceUpdate(session_id="s", open=True, num_draft_tokens=33)]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "num_draft_tokens 33 is out of range [0, 32]",
    ),
    (
        "duplicate session in a call",
        "Propose",
        pb.ProposeRequest(vocabulary=VOCABULARY, sequences=[pb.SequenceUpdate(session_id="d", open=True)] * 2),
        grpc.StatusCode.INVALID_ARGUMENT,
        "appears twice",
    ),
    (
        "feedback beyond the previous draft",
        "Propose",
        pb.ProposeRequest(vocabulary=VOCABULARY, sequences=[pb.SequenceUpdate(session_id="s", open=True, verified_draft_tokens=1)]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "verified_draft_tokens (1) <= the previous draft's length (0)",
    ),
    (
        "observe without id",
        "Observe",
        pb.ObserveRequest(vocabulary=VOCABULARY, sequences=[pb.TokenSequence(tokens=[1, 2, 3])]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "observe_id is empty",
    ),
    (
        "observe huge token",
        "Observe",
        pb.ObserveRequest(vocabulary=VOCABULARY, observe_id="o", sequences=[pb.TokenSequence(tokens=[1, 1 << 25])]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "out of range",
    ),
    (
        "backup without --backup-dir",
        "Backup",
        pb.BackupRequest(vocabulary=VOCABULARY, destination="copy"),
        grpc.StatusCode.FAILED_PRECONDITION,
        "start the drafter with --backup-dir",
    ),
    (
        "forget a malformed scope",
        "Forget",
        pb.ForgetRequest(vocabulary=VOCABULARY, scope="../../etc"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "32 lowercase hex digits",
    ),
    (
        "vocabulary with a trailing newline",
        "Observe",
        pb.ObserveRequest(vocabulary=VOCABULARY + "\n", observe_id="nl", sequences=[pb.TokenSequence(tokens=[1, 2, 3])]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "16-hex-digit",
    ),
]


@pytest.mark.parametrize("name, method, request_, code, fragment", BAD_INPUTS, ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_gets_a_clear_status_and_changes_nothing(tmp_path, name, method, request_, code, fragment):
    with drafter(tmp_path / "db") as server:
        observe(server.stub, "seed", [5, 6, 7, 8, 9, 10])
        before = server.stub.Stats(pb.StatsRequest(), timeout=5)
        with pytest.raises(grpc.RpcError) as raised:
            getattr(server.stub, method)(request_, timeout=5)
        assert raised.value.code() == code
        assert fragment in raised.value.details()
        after = server.stub.Stats(pb.StatsRequest(), timeout=5)
        assert (after.entries, after.open_sessions, after.observed_tokens) == (before.entries, before.open_sessions, before.observed_tokens)
        # The server still works and still knows what it learned.
        assert list(propose(server.stub, "ok", [5, 6, 7, 8], 2, open_=True).tokens) == [9, 10]
    assert tables(tmp_path / "db") == [VOCABULARY]  # no table made from bad input


ESCAPES = ["/tmp/elsewhere", "../escape", "a/b", "..", ".hidden", "copy\n", "", "x" * 129]


@pytest.mark.parametrize("destination", ESCAPES, ids=repr)
def test_backup_writes_only_plain_names_under_the_backup_dir(tmp_path, destination):
    backups = tmp_path / "backups"
    with drafter(tmp_path / "db", "--backup-dir", str(backups)) as server:
        observe(server.stub, "o1", [5, 6, 7, 8])
        with pytest.raises(grpc.RpcError) as raised:
            server.stub.Backup(pb.BackupRequest(vocabulary=VOCABULARY, destination=destination), timeout=10)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "plain name" in raised.value.details()
    assert not backups.exists() or not any(backups.iterdir())
    assert not (tmp_path / "escape").exists() and not Path("/tmp/elsewhere").exists()


def test_backup_under_an_existing_name_says_only_that(tmp_path):
    backups = tmp_path / "backups"
    with drafter(tmp_path / "db", "--backup-dir", str(backups)) as server:
        observe(server.stub, "o1", [5, 6, 7, 8])
        server.stub.Backup(pb.BackupRequest(vocabulary=VOCABULARY, destination="nightly"), timeout=30)
        with pytest.raises(grpc.RpcError) as raised:
            server.stub.Backup(pb.BackupRequest(vocabulary=VOCABULARY, destination="nightly"), timeout=30)
        assert raised.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert str(tmp_path) not in raised.value.details()  # nothing about the host's paths


@pytest.mark.parametrize("inside", ["db", "db/backups"])
def test_a_backup_dir_in_the_table_directory_is_refused_at_start(tmp_path, inside):
    completed = subprocess.run(
        [sys.executable, "-m", "drafter_service", "--port", "0", "--db", str(tmp_path / "db"), "--backup-dir", str(tmp_path / inside)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert completed.returncode == 2
    assert "must lie outside the table directory" in completed.stderr


def test_oversized_message_is_refused_and_server_keeps_serving(tmp_path):
    with drafter(tmp_path / "db") as server:
        huge = pb.ObserveRequest(
            vocabulary=VOCABULARY, observe_id="big", sequences=[pb.TokenSequence(tokens=[1 << 23] * 3_000_000)]
        )  # ~12 MB > the 8 MB cap
        with pytest.raises(grpc.RpcError) as raised:
            server.stub.Observe(huge, timeout=10)
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert observe(server.stub, "small", [1, 2, 3]).applied


def test_reopening_an_open_session_is_already_exists(tmp_path):
    with drafter(tmp_path / "db") as server:
        propose(server.stub, "a", [1, 2], 0, open_=True)
        with pytest.raises(grpc.RpcError) as raised:
            propose(server.stub, "a", [1, 2], 0, open_=True)
        assert raised.value.code() == grpc.StatusCode.ALREADY_EXISTS


def test_sigterm_drains_and_exits_zero(tmp_path):
    with drafter(tmp_path / "db", "--grace-seconds", "2") as server:
        observe(server.stub, "o1", [1, 2, 3, 4, 5])
        started = time.monotonic()
        assert server.terminate() == 0
        assert time.monotonic() - started < 15


def test_flags_come_from_environment_variables(tmp_path):
    env = dict(os.environ, SPECDEC_DRAFTER_DB=str(tmp_path / "envdb"), SPECDEC_DRAFTER_PORT="0", SPECDEC_DRAFTER_METRICS_PORT="-1")
    process = subprocess.Popen([sys.executable, "-m", "drafter_service"], stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = process.stdout.readline()
        assert f"(db {tmp_path / 'envdb'})" in line
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0


def test_idle_sessions_expire_and_then_are_not_found(tmp_path):
    with drafter(tmp_path / "db", "--session-idle-timeout-seconds", "1") as server:
        propose(server.stub, "idle", [1, 2, 3], 0, open_=True)
        deadline = time.monotonic() + 15
        while server.stub.Stats(pb.StatsRequest(), timeout=5).open_sessions and time.monotonic() < deadline:
            time.sleep(0.2)
        with pytest.raises(grpc.RpcError) as raised:
            propose(server.stub, "idle", [4], 2)
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND


def test_table_stays_within_its_bound_under_far_more_data(tmp_path):
    from drafter_service.store import FILE_BYTES_PER_MAX_BYTE

    max_bytes = 1 << 20
    rng = random.Random(3)
    with drafter(tmp_path / "db", "--max-bytes", str(max_bytes)) as server:
        # 400 calls of 256 tokens: ~300k n-gram records, ~25x what the bound holds.
        # Each call stays under a quarter of the bound, the size the file bound
        # is documented for (one transaction's pages are written before eviction).
        for call in range(400):
            sequences = [[rng.randrange(30_000) for _ in range(64)] for _ in range(4)]
            observe(server.stub, f"bulk-{call}", *sequences)
        stats = server.stub.Stats(pb.StatsRequest(vocabulary=VOCABULARY), timeout=5)
        assert stats.bytes <= max_bytes
        assert stats.evictions > 0
        # The file's documented bound (live pages plus copy-on-write copies).
        assert stats.file_bytes <= FILE_BYTES_PER_MAX_BYTE * max_bytes
        # Still answering, and the newest sequence is drafted from the table.
        assert list(propose(server.stub, "after", sequences[-1][:4], 4, open_=True).tokens) == sequences[-1][4:8]


def test_a_stock_client_calls_propose_through_reflection(tmp_path):
    """grpcurl knows nothing of our stubs: it reads the schema from server reflection."""
    grpcurl = Path(sys.executable).parent / "grpcurl"
    request = {
        "vocabulary": VOCABULARY,
        "sequences": [{"session_id": "g", "open": True, "new_tokens": [1, 2, 3, 4, 2, 3], "num_draft_tokens": 3}],
    }
    with drafter(tmp_path / "db") as server:
        result = subprocess.run(
            [str(grpcurl), "-plaintext", "-d", json.dumps(request), f"127.0.0.1:{server.port}", "specdec.v1.Drafter/Propose"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        [draft] = json.loads(result.stdout)["drafts"]
        assert draft["tokens"] == [4, 2, 3]  # the context's own chain, as in the stub-based test
        assert draft["sources"] == ["DRAFT_SOURCE_CONTEXT"] * 3


# -- tables only from writes, within --max-vocabularies; CloseSessions validates first ----


def test_read_only_calls_never_create_a_table(tmp_path):
    with drafter(tmp_path / "db") as server:
        stats = server.stub.Stats(pb.StatsRequest(vocabulary=OTHER_VOCABULARY), timeout=5)
        assert stats.entries == 0
        # Propose under a vocabulary with no table drafts from the context alone.
        assert list(propose(server.stub, "s", [1, 2, 3, 1, 2], 1, open_=True, vocabulary=OTHER_VOCABULARY).tokens) == [3]
        assert tables(tmp_path / "db") == []
        observe(server.stub, "o1", [5, 6, 7], vocabulary=OTHER_VOCABULARY)
        assert tables(tmp_path / "db") == [OTHER_VOCABULARY]


def test_vocabularies_beyond_the_limit_get_resource_exhausted(tmp_path):
    with drafter(tmp_path / "db", "--max-vocabularies", "1") as server:
        observe(server.stub, "o1", [5, 6, 7, 8, 9, 10])
        with pytest.raises(grpc.RpcError) as raised:
            observe(server.stub, "o2", [5, 6, 7, 8], vocabulary=OTHER_VOCABULARY)
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-vocabularies" in raised.value.details()
        assert observe(server.stub, "o3", [9, 10, 11]).applied  # the table it holds still learns
    assert tables(tmp_path / "db") == [VOCABULARY]
    with drafter(tmp_path / "db", "--max-vocabularies", "1") as server:  # tables found at start always open
        assert list(propose(server.stub, "s", [5, 6, 7, 8], 2, open_=True).tokens) == [9, 10]


def close_request(session_ids, observe_id="c1", vocabulary=VOCABULARY):
    return pb.CloseSessionsRequest(vocabulary=vocabulary, session_ids=session_ids, observe=True, observe_id=observe_id)


@pytest.mark.parametrize(
    "request_, fragment",
    [
        (close_request(["a", "b"], observe_id="x" * 600), "observe_id is 600 bytes"),
        (close_request(["a", "b"], vocabulary=OTHER_VOCABULARY), "opened under another vocabulary"),
    ],
    ids=["observe_id too long", "another vocabulary"],
)
def test_a_refused_close_keeps_the_sessions_and_stores_nothing(tmp_path, request_, fragment):
    with drafter(tmp_path / "db") as server:
        propose(server.stub, "a", [20, 21, 22, 23, 24, 25], 0, open_=True)
        propose(server.stub, "b", [30, 31, 32, 33, 34, 35], 0, open_=True)
        with pytest.raises(grpc.RpcError) as raised:
            server.stub.CloseSessions(request_, timeout=10)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert fragment in raised.value.details()
        stats = server.stub.Stats(pb.StatsRequest(), timeout=5)
        assert (stats.open_sessions, stats.entries) == (2, 0)
        # Retried correctly, the sessions' tokens go into their own vocabulary's table.
        assert server.stub.CloseSessions(close_request(["a", "b"]), timeout=10).closed == 2
        assert list(propose(server.stub, "n", [20, 21, 22, 23], 2, open_=True).tokens) == [24, 25]
    assert tables(tmp_path / "db") == [VOCABULARY]


def test_a_second_drafter_on_the_same_db_refuses_to_start(tmp_path):
    with drafter(tmp_path / "db") as first:
        observe(first.stub, "o1", [5, 6, 7, 8, 9, 10])
        second = subprocess.run(
            [sys.executable, "-m", "drafter_service", "--port", "0", "--db", str(tmp_path / "db")],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "SPECDEC_DRAFTER_METRICS_PORT": "0"},
        )
        assert second.returncode == 1
        assert f"another drafter (pid {first.process.pid}) is serving --db" in second.stderr
        assert list(propose(first.stub, "s", [5, 6, 7, 8], 2, open_=True).tokens) == [9, 10]  # untouched
        first.kill()
    with drafter(tmp_path / "db") as again:  # the lock died with its process
        assert list(propose(again.stub, "s", [5, 6, 7, 8], 2, open_=True).tokens) == [9, 10]


def test_admin_calls_are_served_only_on_the_admin_port(tmp_path):
    with drafter(tmp_path / "db", "--admin-port", "0", "--backup-dir", str(tmp_path / "backups")) as server:
        admin_port = server.announced_port("admin")
        observe(server.stub, "o1", [5, 6, 7, 8, 9, 10])  # verifiers' calls: on the main port
        assert list(propose(server.stub, "s", [5, 6, 7, 8], 2, open_=True).tokens) == [9, 10]
        for method, request in (
            ("Stats", pb.StatsRequest()),
            ("Backup", pb.BackupRequest(vocabulary=VOCABULARY, destination="b")),
            ("Forget", pb.ForgetRequest(vocabulary=VOCABULARY)),
        ):
            with pytest.raises(grpc.RpcError) as raised:
                getattr(server.stub, method)(request, timeout=5)
            assert raised.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "admin port" in raised.value.details()
        with grpc.insecure_channel(f"127.0.0.1:{admin_port}") as channel:
            admin = rpc.DrafterStub(channel)
            assert admin.Stats(pb.StatsRequest(), timeout=5).observed_tokens == 6
            assert admin.Backup(pb.BackupRequest(vocabulary=VOCABULARY, destination="b"), timeout=30).bytes > 0
            assert admin.Forget(pb.ForgetRequest(vocabulary=VOCABULARY), timeout=30).dropped


# -- damaged tables: quarantined at start-up, the others served; the offline check ------------


def damaged_store(db: Path) -> None:
    """Four tables: one sound, one truncated, one with another format version, one foreign LMDB environment."""
    from drafter_service.store import LMDBNGramStore, StoreConfig

    for name in (VOCABULARY, "1111111111111111", "2222222222222222"):
        with LMDBNGramStore(StoreConfig(path=str(db / name), namespace=bytes.fromhex(name))) as store:
            store.observe([5, 6, 7, 8, 9, 10] + list(range(100, 3000)))
    data = db / "1111111111111111" / "data.mdb"
    with open(data, "r+b") as handle:
        handle.truncate(data.stat().st_size // 2)
    env = lmdb.open(str(db / "2222222222222222"), max_dbs=4)
    with env.begin(write=True) as txn:
        txn.put(b"format_version", bytes((99,)), db=env.open_db(b"meta", txn=txn))
    env.close()
    env = lmdb.open(str(db / "3333333333333333"), max_dbs=4)
    with env.begin(write=True) as txn:
        txn.put(b"someone", b"else's data", db=env.open_db(b"theirs", txn=txn))
    env.close()


def test_damaged_tables_are_quarantined_and_the_others_served(tmp_path):
    db = tmp_path / "db"
    damaged_store(db)
    check = subprocess.run([sys.executable, "-m", "drafter_service.check", "--db", str(db)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 1
    assert f"{VOCABULARY}: ok" in check.stdout
    assert "1111111111111111: PROBLEM: data.mdb is truncated" in check.stdout
    assert "2222222222222222: PROBLEM: format version" in check.stdout
    assert "3333333333333333: PROBLEM: its sub-databases" in check.stdout
    with drafter(db) as server:
        assert list(propose(server.stub, "s", [5, 6, 7, 8], 2, open_=True).tokens) == [9, 10]
        log = server.log()
    assert [name for name in tables(db) if len(name) == 16] == [VOCABULARY]
    aside = sorted(p.name.split(".")[0] for p in db.iterdir() if ".quarantined-" in p.name)
    assert aside == ["1111111111111111", "2222222222222222", "3333333333333333"]
    assert log.count("moved aside to") == 3
    # The foreign environment was not written to: still only its own data.
    foreign = next(p for p in db.iterdir() if p.name.startswith("3333333333333333"))
    env = lmdb.open(str(foreign), max_dbs=4, readonly=True)
    with env.begin() as txn:
        assert list(txn.cursor().iternext(values=False)) == [b"theirs"]
    env.close()
    check = subprocess.run([sys.executable, "-m", "drafter_service.check", "--db", str(db)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and check.stdout.count("quarantined by the drafter") == 3


def test_the_check_finds_random_pages(tmp_path):
    db = tmp_path / "db"
    from drafter_service.store import LMDBNGramStore, StoreConfig

    with LMDBNGramStore(StoreConfig(path=str(db / VOCABULARY), namespace=bytes.fromhex(VOCABULARY))) as store:
        store.observe(list(range(100, 20_000)))
    data = db / VOCABULARY / "data.mdb"
    rng = random.Random(1)
    with open(data, "r+b") as handle:
        for page in range(4, data.stat().st_size // 4096, 7):  # past the meta and root pages, every 7th page
            handle.seek(page * 4096)
            handle.write(rng.randbytes(4096))
    check = subprocess.run([sys.executable, "-m", "drafter_service.check", "--db", str(db)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 1 and f"{VOCABULARY}: PROBLEM" in check.stdout


def test_the_successor_table_survives_kill_9(tmp_path):
    """The target's predictions, sent with Propose, are drafted from once stored, and after
    kill -9 and a restart still are: the warm state of the successor table is on disk."""
    db = tmp_path / "db"
    predictions = pb.Predictions(k=2, previous=[70, 71], current=[71, 72], tokens=[72, 80, 73, 81])

    def tree(stub, session, tokens, **extra):
        update = pb.SequenceUpdate(session_id=session, new_tokens=tokens, open=True, num_draft_tokens=3, max_tree_nodes=8, **extra)
        return stub.Propose(pb.ProposeRequest(vocabulary=VOCABULARY, sequences=[update]), timeout=5).drafts[0]

    with drafter(db) as server:
        tree(server.stub, "sender", [70, 71], predictions=predictions)
        deadline = time.monotonic() + 10
        while list(tree(server.stub, f"probe-{time.monotonic()}", [5, 70, 71]).tokens[:2]) != [72, 73]:
            assert time.monotonic() < deadline, "the predictions were never drafted from"
            time.sleep(0.05)
        server.kill()
    with drafter(db) as server:
        draft = tree(server.stub, "after", [5, 70, 71])
        assert list(draft.tokens[:2]) == [72, 73] and list(draft.sources[:2]) == [pb.DRAFT_SOURCE_SUCCESSOR] * 2
        assert server.terminate() == 0
