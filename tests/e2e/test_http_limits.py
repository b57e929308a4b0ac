"""A live verifier's HTTP limits, set by its flags: header and body deadlines (1 s here; the
tests allow 30 s for the close), a body refused from its Content-Length, and the per-caller
limit shared with gRPC (no keys: the caller is the peer's address, 127.0.0.1 for both)."""

from __future__ import annotations

import json
import socket

import grpc
import openai
import pytest

from specdec.v1 import verifier_pb2 as pb

from processes import HttpVerifier

CLOSE_WITHIN_S = 30
PROMPT_IDS = [5, 9, 14, 20]
LONG_RUNNING_TOKENS = 60_000
CALL_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def verifier(chat_model_dir):
    server = HttpVerifier(
        chat_model_dir,
        *("--http-header-timeout-seconds", "1", "--http-body-timeout-seconds", "1", "--max-requests-per-caller", "1"),
        *("--max-new-tokens", str(LONG_RUNNING_TOKENS), "--max-sequence-tokens", str(1 << 16)),
    )
    try:
        yield server
    finally:
        server.process.stop()


def raw_exchange(verifier: HttpVerifier, sent: bytes) -> bytes:
    """What the server answers to ``sent`` (all it writes until it closes the connection)."""
    with socket.create_connection(("127.0.0.1", int(verifier.base.rsplit(":", 1)[1])), timeout=CLOSE_WITHIN_S) as connection:
        connection.sendall(sent)
        received = b""
        while part := connection.recv(65536):
            received += part
    return received


def status_and_error(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def test_half_a_request_line_is_cut_off_after_the_header_timeout(verifier):
    status, error = status_and_error(raw_exchange(verifier, b"POST /v1/chat/completions HT"))
    assert status == 408 and "--http-header-timeout-seconds" in error["message"]


def test_a_body_that_stops_arriving_is_cut_off_after_the_body_timeout(verifier):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    status, error = status_and_error(raw_exchange(verifier, head + b'{"prompt": [5'))
    assert status == 408 and "--http-body-timeout-seconds" in error["message"]
    assert "Traceback" not in verifier.process.log()


def test_a_7_mib_body_is_refused_413_before_any_of_it_is_sent(verifier):
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 7340032\r\n\r\n"
    with socket.create_connection(("127.0.0.1", int(verifier.base.rsplit(":", 1)[1])), timeout=CLOSE_WITHIN_S) as connection:
        connection.sendall(head)
        answer = connection.recv(65536)  # the answer comes while the body is still owed
    assert answer.startswith(b"HTTP/1.1 413")


def test_a_request_for_another_host_name_is_refused_and_a_cross_site_form_is_not_read(verifier):
    """A page that had its own name resolve to 127.0.0.1 (DNS rebinding) sends that name in Host;
    a page on another site may POST text/plain without a preflight. Neither is served."""
    body = json.dumps({"prompt": PROMPT_IDS, "max_tokens": 2}).encode()
    for host, kind, status, code in (
        (b"rebound.example:80", b"application/json", 400, "host_not_allowed"),
        (b"localhost", b"text/plain", 415, "unsupported_media_type"),
    ):
        head = b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n" % (host, kind, len(body))
        answered, error = status_and_error(raw_exchange(verifier, head + b"Connection: close\r\n\r\n" + body))
        assert (answered, error["code"]) == (status, code)


def test_one_address_at_its_limit_is_refused_on_both_front_doors(verifier):
    held = verifier.stub.GenerateStream(
        pb.GenerateRequest(prompt_token_ids=PROMPT_IDS, max_new_tokens=LONG_RUNNING_TOKENS), timeout=CALL_TIMEOUT_S
    )
    try:
        next(held)
        with pytest.raises(openai.RateLimitError) as refused:
            verifier.client.completions.create(model=verifier.model, prompt=PROMPT_IDS, max_tokens=4)
        assert "127.0.0.1 has 1 requests in flight" in refused.value.message and "--max-requests-per-caller 1" in refused.value.message
        with pytest.raises(grpc.RpcError) as raised:
            verifier.generate(prompt_token_ids=PROMPT_IDS, max_new_tokens=4)
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-requests-per-caller" in raised.value.details()
    finally:
        held.cancel()
