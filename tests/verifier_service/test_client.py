"""The CLI client against an in-process fake Verifier on a loopback port: request fields, output, errors."""

from __future__ import annotations

import json
import threading
from concurrent import futures

import grpc
import pytest

from specdec.v1 import verifier_pb2 as pb
from specdec.v1 import verifier_pb2_grpc as rpc
from verifier_service import client

STATS = pb.GenerationStats(
    target_forward_passes=4,
    draft_tokens=8,
    accepted_tokens=6,
    acceptance_rate=0.75,
    tokens_per_forward_pass=1.5,
    time_to_first_token_ms=12.5,
    total_ms=40.0,
    prompt_tokens=9,
    generated_tokens=6,
)
RESPONSE = pb.GenerateResponse(
    text="Hello, world!",
    token_ids=[10, 11, 12, 13, 14, 15],
    finish_reason=pb.FINISH_REASON_STOP,
    stats=STATS,
)
# The same generation in pieces; the last chunk carries text too, so a client
# that keeps only the stats of the last chunk loses the "!".
CHUNKS = (
    pb.GenerateChunk(text="Hel", token_ids=[10, 11]),
    pb.GenerateChunk(text="lo, ", token_ids=[12]),
    pb.GenerateChunk(text="world", token_ids=[13, 14]),
    pb.GenerateChunk(text="!", token_ids=[15], finish_reason=pb.FINISH_REASON_STOP, stats=STATS),
)
EXPECTED_JSON = {
    "text": "Hello, world!",
    "token_ids": [10, 11, 12, 13, 14, 15],
    "finish_reason": "stop",
    "stats": {
        "target_forward_passes": 4,
        "draft_tokens": 8,
        "accepted_tokens": 6,
        "acceptance_rate": 0.75,
        "tokens_per_forward_pass": 1.5,
        "time_to_first_token_ms": 12.5,
        "total_ms": 40.0,
        "prompt_tokens": 9,
        "generated_tokens": 6,
    },
}


class FakeVerifier(rpc.VerifierServicer):
    """Records each request; answers RESPONSE / CHUNKS, aborts with `abort`, or hangs while `hang` is set."""

    def __init__(self):
        self.requests: list[pb.GenerateRequest] = []
        self.abort: tuple[grpc.StatusCode, str] | None = None
        self.hang = threading.Event()
        self.release = threading.Event()

    def _begin(self, request, context):
        self.requests.append(request)
        if self.abort is not None:
            context.abort(*self.abort)
        if self.hang.is_set():
            self.release.wait(timeout=10)

    def Generate(self, request, context):
        self._begin(request, context)
        return RESPONSE

    def GenerateStream(self, request, context):
        self._begin(request, context)
        yield from CHUNKS


@pytest.fixture
def verifier():
    servicer = FakeVerifier()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    rpc.add_VerifierServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        servicer.release.set()
        server.stop(grace=None)


def run(target: str, *flags: str) -> int:
    return client.main(["a prompt", "--target", target, "--timeout-seconds", "10", *flags])


def test_flags_become_request_fields(verifier):
    servicer, target = verifier
    code = run(
        target,
        "--max-new-tokens",
        "17",
        "--temperature",
        "0.7",
        "--top-p",
        "0.9",
        "--top-k",
        "40",
        "--seed",
        "1234",
        "--stop",
        "\n\n",
        "--stop",
        "END",
        "--k",
        "5",
        "--no-chat",
    )
    assert code == 0
    [request] = servicer.requests
    assert request.prompt == "a prompt"
    assert not request.chat  # --no-chat
    assert request.max_new_tokens == 17
    assert request.temperature == pytest.approx(0.7)  # float32 on the wire
    assert request.top_p == pytest.approx(0.9)
    assert request.top_k == 40
    assert request.HasField("seed") and request.seed == 1234
    assert list(request.stop) == ["\n\n", "END"]
    assert request.HasField("num_speculative_tokens") and request.num_speculative_tokens == 5


def test_defaults_leave_optional_fields_unset_and_apply_the_chat_template(verifier):
    servicer, target = verifier
    assert run(target) == 0
    [request] = servicer.requests
    assert not request.HasField("num_speculative_tokens")  # the server chooses K
    assert not request.HasField("seed")
    assert request.chat
    assert request.temperature == 0.0  # greedy
    assert request.max_new_tokens == client.DEFAULT_MAX_NEW_TOKENS
    assert list(request.stop) == []


def test_k_zero_is_sent_as_set_to_zero():
    # 0 disables speculation and must stay distinguishable from "unset".
    request = client.build_request(client.parse_args(["p", "--k", "0"]))
    assert request.HasField("num_speculative_tokens")
    assert request.num_speculative_tokens == 0


def test_negative_k_is_rejected_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exit_info:
        client.parse_args(["p", "--k", "-1"])
    assert exit_info.value.code == 2
    assert "must be >= 0, got -1" in capsys.readouterr().err


def test_target_defaults_to_the_environment_variable(verifier, monkeypatch):
    servicer, target = verifier
    monkeypatch.setenv(client.TARGET_ENV, target)
    assert client.main(["from env", "--timeout-seconds", "10"]) == 0
    assert [r.prompt for r in servicer.requests] == ["from env"]


def test_unary_prints_text_and_a_stats_line(verifier, capsys):
    _, target = verifier
    assert run(target) == 0
    out, err = capsys.readouterr()
    assert out == "Hello, world!\n"
    assert err == (
        "6 tokens, 4 forward passes, acceptance 75.0% of 8 drafts, 1.50 tokens/pass, " "TTFT 12.5 ms, total 40.0 ms, finish stop\n"
    )


def test_json_output(verifier, capsys):
    _, target = verifier
    assert run(target, "--json") == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == EXPECTED_JSON
    assert err == ""


def test_stream_json_joins_chunks_into_the_unary_object(verifier, capsys):
    _, target = verifier
    assert run(target, "--json") == 0
    unary = json.loads(capsys.readouterr().out)
    assert run(target, "--json", "--stream") == 0
    streamed = json.loads(capsys.readouterr().out)
    assert streamed == unary == EXPECTED_JSON


def test_stream_prints_the_same_text_and_stats_as_unary(verifier, capsys):
    servicer, target = verifier
    assert run(target) == 0
    unary = capsys.readouterr()
    assert run(target, "--stream") == 0
    streamed = capsys.readouterr()
    assert streamed.out == unary.out == "Hello, world!\n"
    assert streamed.err == unary.err
    assert len(servicer.requests) == 2


def test_stream_hands_each_chunk_to_the_printer_as_it_arrives():
    seen = []
    response = client.join_chunks(CHUNKS, on_text=seen.append)
    assert seen == ["Hel", "lo, ", "world", "!"]
    assert response == RESPONSE


def test_finish_reason_names():
    assert client.finish_reason_name(pb.FINISH_REASON_STOP) == "stop"
    assert client.finish_reason_name(pb.FINISH_REASON_LENGTH) == "length"
    assert client.finish_reason_name(pb.FINISH_REASON_CANCELLED) == "cancelled"


def test_no_drafts_is_not_reported_as_zero_acceptance():
    response = pb.GenerateResponse(
        finish_reason=pb.FINISH_REASON_LENGTH, stats=pb.GenerationStats(generated_tokens=3, target_forward_passes=3)
    )
    assert "acceptance no drafts" in client.stats_summary(response)
    assert client.stats_summary(response).endswith("finish length")


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_invalid_argument_exits_2_with_the_servers_message(verifier, capsys, stream):
    servicer, target = verifier
    servicer.abort = (grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens must be in 1..1024, got 5000")
    code = run(target, *(["--stream"] if stream else []))
    out, err = capsys.readouterr()
    assert code == 2
    assert err == "error: INVALID_ARGUMENT: max_new_tokens must be in 1..1024, got 5000\n"
    assert out == ""


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_other_status_codes_exit_1(verifier, capsys, stream):
    servicer, target = verifier
    servicer.abort = (grpc.StatusCode.RESOURCE_EXHAUSTED, "too many requests in flight (64); retry later")
    code = run(target, "--json", *(["--stream"] if stream else []))
    out, err = capsys.readouterr()
    assert code == 1
    assert err == "error: RESOURCE_EXHAUSTED: too many requests in flight (64); retry later\n"
    assert out == ""


def test_timeout_is_the_calls_deadline(verifier, capsys):
    servicer, target = verifier
    servicer.hang.set()
    code = client.main(["slow", "--target", target, "--timeout-seconds", "0.3"])
    assert code == 1
    assert capsys.readouterr().err.startswith("error: DEADLINE_EXCEEDED: ")


def test_unreadable_tls_ca_exits_2(tmp_path, capsys):
    code = client.main(["p", "--target", "127.0.0.1:1", "--tls-ca", str(tmp_path / "missing.pem")])
    assert code == 2
    assert capsys.readouterr().err.startswith("error: cannot read a TLS file: ")
