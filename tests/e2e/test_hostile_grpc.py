"""Both services as real processes against hostile gRPC callers: two client
certificates under mutual TLS, idle streams holding threads and slots, and two verifiers
sharing one drafter."""

from __future__ import annotations

import os
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2_grpc
from test_tls import self_signed
from transformers import AutoTokenizer

from specdec import serving
from specdec.v1 import drafter_pb2 as pb
from specdec.v1 import drafter_pb2_grpc as rpc
from specdec.v1 import verifier_pb2, verifier_pb2_grpc
from specdec.vocabulary import tokenizer_fingerprint

from processes import ServiceProcess, running, running_tiny_verifier

VOCABULARY = "00112233445566aa"
CALL_TIMEOUT_S = 120
ENV = {**os.environ, "SPECDEC_DRAFTER_METRICS_PORT": "-1"}


def open_update(session_id: str, tokens, k: int = 0) -> pb.ProposeRequest:
    update = pb.SequenceUpdate(session_id=session_id, new_tokens=tokens, open=True, num_draft_tokens=k)
    return pb.ProposeRequest(vocabulary=VOCABULARY, sequences=[update])


def extend_update(session_id: str, k: int) -> pb.ProposeRequest:
    return pb.ProposeRequest(vocabulary=VOCABULARY, sequences=[pb.SequenceUpdate(session_id=session_id, num_draft_tokens=k)])


@pytest.fixture(scope="module")
def certificates(tmp_path_factory):
    """The drafter's certificate, and two clients' (each its own CA; the drafter trusts both)."""
    directory = tmp_path_factory.mktemp("tls-hostile")
    server = self_signed(directory, "drafter", "IP:127.0.0.1")
    clients = {name: self_signed(directory, name, f"DNS:{name}") for name in ("victim", "thief")}
    trusted = directory / "clients.pem"
    trusted.write_bytes(b"".join(cert.read_bytes() for cert, _ in clients.values()))
    return server, clients, trusted


def test_under_mutual_tls_a_caller_cannot_read_or_close_another_callers_session(tmp_path, certificates):
    (cert, key), clients, trusted = certificates
    args = ("--port", "0", "--db", str(tmp_path / "db"), "--tls-cert", str(cert), "--tls-key", str(key), "--tls-client-ca", str(trusted))
    with running("drafter_service", *args, env=ENV) as drafter:
        stubs = {}
        for name, (client_cert, client_key) in clients.items():
            channel = serving.channel(drafter.address, cert, tls_cert=client_cert, tls_key=client_key)
            grpc.channel_ready_future(channel).result(timeout=CALL_TIMEOUT_S)
            stubs[name] = rpc.DrafterStub(channel)
        secret = list(range(100, 112))
        stubs["victim"].Propose(open_update("shared-id", [7, 8, *secret, 7, 8]), timeout=10)
        with pytest.raises(grpc.RpcError) as stolen:
            stubs["thief"].Propose(extend_update("shared-id", 12), timeout=10)
        assert stolen.value.code() == grpc.StatusCode.NOT_FOUND
        assert stolen.value.details() == "sequences[0]: unknown session 'shared-id' (open it first)"
        close = pb.CloseSessionsRequest(vocabulary=VOCABULARY, session_ids=["shared-id"], observe=True, observe_id="steal")
        assert stubs["thief"].CloseSessions(close, timeout=10).closed == 0
        draft = stubs["victim"].Propose(extend_update("shared-id", 12), timeout=10).drafts[0]
        assert list(draft.tokens) == secret  # the victim's session, untouched


def test_idle_streams_cannot_take_the_drafters_threads(tmp_path):
    # Was: 16 idle reflection streams held all 16 worker threads; Propose timed out 3 of 3,
    # and the streams were never timed out (held 300 s). Reflection streams now run on
    # threads of their own: one caller's 20 idle streams leave even 2 worker threads free.
    args = ("--port", "0", "--db", str(tmp_path / "db"), "--max-workers", "2", "--max-auxiliary-streams", "4")
    limits = ("--max-waiting-auxiliary-streams", "8", "--auxiliary-stream-idle-seconds", "3", "--auxiliary-stream-quiet-seconds", "3")
    with running("drafter_service", *args, *limits, env=ENV) as drafter:
        grpc.channel_ready_future(drafter.channel).result(timeout=CALL_TIMEOUT_S)
        silent, outcomes = threading.Event(), []

        def idle_stream() -> None:
            channel = grpc.insecure_channel(drafter.address)  # one connection each, as separate clients
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            started = time.monotonic()
            try:
                for _ in stub.ServerReflectionInfo(iter(silent.wait, True), timeout=60):  # sends nothing, ever
                    pass
            except grpc.RpcError as error:
                outcomes.append((error.code(), time.monotonic() - started))
            finally:
                channel.close()

        idlers = [threading.Thread(target=idle_stream) for _ in range(20)]
        for thread in idlers:
            thread.start()
        stub = rpc.DrafterStub(drafter.channel)
        for i in range(5):  # while they hold what they can, Propose is served
            draft = stub.Propose(open_update(f"s{i}", [1, 2, 3, 1, 2], k=1), timeout=5).drafts[0]
            assert list(draft.tokens) == [3]
        health = health_pb2_grpc.HealthStub(drafter.channel)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
        for thread in idlers:
            thread.join(CALL_TIMEOUT_S)
        silent.set()
        codes = sorted(code.name for code, _ in outcomes)
        assert len(codes) == 20 and set(codes) <= {"RESOURCE_EXHAUSTED", "CANCELLED"}
        # 4 run, 8 wait (each runs when one is cut), the rest are refused at once; the ones
        # that arrive after the first cuts (3 s on) may wait instead: fewer refused, never more.
        assert codes.count("RESOURCE_EXHAUSTED") <= 8 and codes.count("CANCELLED") >= 12
        assert all(seconds < 55 for _, seconds in outcomes)  # none lasted to the client's own 60 s deadline


def test_two_verifiers_share_one_drafter_what_one_learns_drafts_for_the_other(tmp_path, tiny_model_dir):
    prompt, new_tokens = [54, 57, 23, 17], 16  # no 2-gram repeats in prompt and answer: drafts only from the global table
    drafter = ServiceProcess("drafter_service", "--port", "0", "--db", str(tmp_path / "db"), env=ENV)
    try:
        drafter.wait_until_serving("specdec.v1.Drafter", CALL_TIMEOUT_S)
        flags = ("--drafter", drafter.address, "--drafter-timeout-seconds", "5")
        with running_tiny_verifier(tiny_model_dir, *flags) as first, running_tiny_verifier(tiny_model_dir, *flags) as second:
            for verifier in (first, second):
                verifier.wait_until_serving("specdec.v1.Verifier", CALL_TIMEOUT_S)
            request = verifier_pb2.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=new_tokens, num_speculative_tokens=4)
            learned = verifier_pb2_grpc.VerifierStub(first.channel).Generate(request, timeout=CALL_TIMEOUT_S)
            assert learned.stats.draft_tokens == 0
            vocabulary = tokenizer_fingerprint(AutoTokenizer.from_pretrained(tiny_model_dir))
            drafter_stub = rpc.DrafterStub(drafter.channel)
            deadline = time.monotonic() + CALL_TIMEOUT_S
            while drafter_stub.Stats(pb.StatsRequest(vocabulary=vocabulary), timeout=10).observed_tokens < len(prompt) + new_tokens:
                assert time.monotonic() < deadline, "the first verifier never observed its request"
                time.sleep(0.05)
            again = verifier_pb2_grpc.VerifierStub(second.channel).GenerateStream(request, timeout=CALL_TIMEOUT_S)
            chunks = list(again)
            tokens = [token for chunk in chunks for token in chunk.token_ids]
            assert tokens == list(learned.token_ids)  # the same answer...
            assert chunks[-1].stats.accepted_tokens > 0  # ...drafted from what the first verifier taught the drafter
            sources = {source for chunk in chunks for source in chunk.token_sources}
            assert verifier_pb2.TOKEN_SOURCE_GLOBAL in sources
    finally:
        drafter.stop()


def test_idle_streams_cannot_take_the_verifiers_request_slots(tiny_model_dir):
    # Was: 88 idle reflection streams (batch + queue + 8) and every Generate got RESOURCE_EXHAUSTED.
    limits = ("--max-auxiliary-streams", "4", "--max-waiting-auxiliary-streams", "8", "--auxiliary-stream-idle-seconds", "2")
    with running_tiny_verifier(tiny_model_dir, *limits) as verifier:
        verifier.wait_until_serving("specdec.v1.Verifier", CALL_TIMEOUT_S)
        silent, outcomes = threading.Event(), []

        def idle_stream() -> None:
            stub = reflection_pb2_grpc.ServerReflectionStub(verifier.channel)
            try:
                for _ in stub.ServerReflectionInfo(iter(silent.wait, True), timeout=60):
                    pass
            except grpc.RpcError as error:
                outcomes.append(error.code())

        idlers = [threading.Thread(target=idle_stream) for _ in range(96)]
        for thread in idlers:
            thread.start()
        stub = verifier_pb2_grpc.VerifierStub(verifier.channel)
        for _ in range(2):
            answer = stub.Generate(verifier_pb2.GenerateRequest(prompt_token_ids=[5, 9, 14, 20], max_new_tokens=4), timeout=CALL_TIMEOUT_S)
            assert len(answer.token_ids) == 4
        for thread in idlers:
            thread.join(CALL_TIMEOUT_S)
        silent.set()
        assert len(outcomes) == 96 and set(outcomes) <= {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED}
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in outcomes and grpc.StatusCode.CANCELLED in outcomes  # refused, or held and cut
