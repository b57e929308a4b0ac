"""A live verifier with API keys: the openai client, gRPC metadata, the CLI client, the open
health and reflection services, and the per-caller limit across both front doors.

The keys come from --api-key and --api-key-file; none of them may appear in the log.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from specdec.v1 import verifier_pb2 as pb

from processes import HttpVerifier

FLAG_KEY = "flag-key-0123"
FILE_KEYS = ("file-key-4567", "file-key-89ab")
PROMPT_IDS = [5, 9, 14, 20]  # cycles without EOS: a long request holds its place until cancelled
LONG_RUNNING_TOKENS = 60_000
CALL_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def keyed(chat_model_dir, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text("# one key a line\n" + "\n".join(FILE_KEYS) + "\n")
    verifier = HttpVerifier(
        chat_model_dir,
        *("--api-key", FLAG_KEY, "--api-key-file", str(keys), "--max-requests-per-caller", "1"),
        *("--max-new-tokens", str(LONG_RUNNING_TOKENS), "--max-sequence-tokens", str(1 << 16)),
    )
    try:
        yield verifier
    finally:
        verifier.process.stop()


def openai_client(verifier: HttpVerifier, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=verifier.base + "/v1", api_key=key, max_retries=0, timeout=CALL_TIMEOUT_S)


def metadata(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def short_request() -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=PROMPT_IDS, max_new_tokens=4)


def test_the_openai_client_needs_a_configured_key(keyed):
    for key in (FLAG_KEY, *FILE_KEYS):
        [model] = openai_client(keyed, key).models.list().data
        assert model.id == keyed.model
        response = openai_client(keyed, key).completions.create(model=keyed.model, prompt=PROMPT_IDS, max_tokens=4, temperature=0)
        assert response.usage.completion_tokens == 4
    with pytest.raises(openai.AuthenticationError) as raised:
        openai_client(keyed, "not-a-key").completions.create(model=keyed.model, prompt=PROMPT_IDS, max_tokens=4)
    assert raised.value.code == "invalid_api_key" and raised.value.response.headers["www-authenticate"].startswith("Bearer")


def test_grpc_generate_needs_a_key_in_its_metadata(keyed):
    for call in (keyed.stub.Generate, lambda request, **kwargs: list(keyed.stub.GenerateStream(request, **kwargs))):
        for sent in ((), metadata("not-a-key"), (("authorization", "Basic Zm9v"),)):
            with pytest.raises(grpc.RpcError) as raised:
                call(short_request(), metadata=sent, timeout=CALL_TIMEOUT_S)
            assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "authorization: Bearer <key>" in raised.value.details() or "--api-key" in raised.value.details()
            assert "not-a-key" not in raised.value.details()
    response = keyed.stub.Generate(short_request(), metadata=metadata(FILE_KEYS[1]), timeout=CALL_TIMEOUT_S)
    assert len(response.token_ids) == 4


def test_health_and_reflection_stay_open_without_a_key(keyed):
    check = health_pb2_grpc.HealthStub(keyed.process.channel).Check(
        health_pb2.HealthCheckRequest(service="specdec.v1.Verifier"), timeout=10
    )
    assert check.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(keyed.process.channel)
    [answer] = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    assert "specdec.v1.Verifier" in {service.name for service in answer.list_services_response.service}


def run_client(keyed, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "verifier_service.client", "t5 t9 t14", "--no-chat", "--max-new-tokens", "3"]
    return subprocess.run(
        [*command, "--target", keyed.process.address, *args], capture_output=True, text=True, timeout=CALL_TIMEOUT_S, env=env
    )


def test_the_cli_client_sends_its_key_from_the_flag_or_the_variable(keyed):
    without = {name: value for name, value in os.environ.items() if name != "SPECDEC_VERIFIER_API_KEY"}
    refused = run_client(keyed, env=without)
    assert refused.returncode == 1 and "UNAUTHENTICATED: this verifier requires an API key" in refused.stderr
    assert run_client(keyed, "--api-key", FLAG_KEY, env=without).returncode == 0
    answered = run_client(keyed, "--stream", env=without | {"SPECDEC_VERIFIER_API_KEY": FILE_KEYS[0]})
    assert answered.returncode == 0, answered.stderr


def long_grpc_stream(keyed, key: str):
    """A stream that decodes for minutes, read up to its first chunk."""
    call = keyed.stub.GenerateStream(
        pb.GenerateRequest(prompt_token_ids=PROMPT_IDS, max_new_tokens=LONG_RUNNING_TOKENS), metadata=metadata(key), timeout=CALL_TIMEOUT_S
    )
    next(call)
    return call


def test_one_key_at_its_limit_is_refused_on_both_front_doors_while_another_key_is_served(keyed):
    held = long_grpc_stream(keyed, FILE_KEYS[0])  # --max-requests-per-caller 1
    try:
        with pytest.raises(grpc.RpcError) as raised:
            keyed.stub.Generate(short_request(), metadata=metadata(FILE_KEYS[0]), timeout=CALL_TIMEOUT_S)
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "api key #2 has 1 requests in flight" in raised.value.details() and "--max-requests-per-caller 1" in raised.value.details()
        with pytest.raises(openai.RateLimitError) as refused:
            openai_client(keyed, FILE_KEYS[0]).completions.create(model=keyed.model, prompt=PROMPT_IDS, max_tokens=4)
        assert refused.value.code == "too_many_requests_per_caller" and "--max-requests-per-caller" in refused.value.message
        assert len(keyed.stub.Generate(short_request(), metadata=metadata(FILE_KEYS[1]), timeout=CALL_TIMEOUT_S).token_ids) == 4
    finally:
        held.cancel()
    deadline = time.monotonic() + CALL_TIMEOUT_S  # the cancel reaches the server asynchronously
    while True:
        try:
            keyed.stub.Generate(short_request(), metadata=metadata(FILE_KEYS[0]), timeout=CALL_TIMEOUT_S)
            break
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
            time.sleep(0.1)


def test_the_log_says_keys_are_required_and_never_shows_one(keyed):
    log = keyed.process.log()
    assert "API keys required (3 configured) on /v1 and gRPC Generate/GenerateStream" in log
    for key in (FLAG_KEY, *FILE_KEYS, "not-a-key"):
        assert key not in log
