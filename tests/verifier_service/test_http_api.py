"""The HTTP API in process (Starlette's TestClient, or the ASGI app called directly) over a
real service, engine and scheduler on the tiny model: API keys, per-caller limits, body
and prompt bounds, malformed bodies, the fallback for the unexpected, and dropped bodies.

The tiny model's word-level tokenizer reads "t5 t9" as tokens [5, 9]; its longest token
("t63") is 3 characters, so --max-prompt-chars defaults to 4 characters per cache position.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import hmac
import importlib.metadata
import inspect
import json
import logging

import openai
import pytest
import torch
from openai.types import completion_create_params as openai_completion_params
from openai.types.chat import completion_create_params as openai_chat_params
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from starlette.testclient import TestClient

from specdec import telemetry
from specdec.serving import peer_host
from specdec.v1 import verifier_pb2 as pb
from tests.conftest import TINY_EOS
from tests.verifier_service.test_processing import reference_decode
from verifier_service.core.engine import EngineConfig, SpeculativeEngine
from verifier_service.core.errors import InvalidRequest
from verifier_service.core.model_loading import DEFAULT_MODEL, DEFAULT_MODEL_HUB_NAME, chat_ids
from verifier_service.core.rejection import SamplingParams
from verifier_service.serving import openai_api
from verifier_service.serving.config import VerifierConfig
from verifier_service.serving.metrics import VerifierMetrics
from verifier_service.serving.openai_api import NO_DRAFTER_WARNING, OpenAIApi
from verifier_service.serving.openai_protocol import ChatCompletionRequest, CompletionRequest
from verifier_service.serving.scheduler import Scheduler, SchedulerConfig
from verifier_service.serving.server import VerifierServicer
from verifier_service.serving.service import ApiKeys, CallerLimit, VerifierService

CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
KEYS = ("key-one", "key-two")
CAPACITY = 256  # cache positions per request: prompt text up to 256 x (3 + 1) characters
MODEL = "tiny"
BASE = "http://localhost:8000"  # a name the default --host (127.0.0.1) answers to
JSON = {"content-type": "application/json"}  # what a body sent by hand must declare (json= declares it)


@pytest.fixture(scope="module")
def chat_tokenizer(tiny_tokenizer):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def api(service: VerifierService) -> TestClient:
    """The HTTP API over ``service``, called as a local client calls it: by the name localhost."""
    return TestClient(OpenAIApi(service, MODEL).app, base_url=BASE)


def started(tiny_model, tokenizer, **fields) -> VerifierService:
    config = VerifierConfig(engine=EngineConfig(max_batch_size=2, max_sequence_tokens=CAPACITY), **fields)
    service = VerifierService(config, telemetry.Tracing("test"), VerifierMetrics(config.model))
    engine = SpeculativeEngine(tiny_model, tokenizer, None, config.engine)
    scheduler = Scheduler(engine, SchedulerConfig())
    scheduler.start()
    service.attach(engine, scheduler)
    return service


@pytest.fixture(scope="module")
def open_service(tiny_model, chat_tokenizer):
    service = started(tiny_model, chat_tokenizer, max_requests_per_caller=1)
    yield service
    service.scheduler.stop(1.0)


@pytest.fixture(scope="module")
def keyed_service(tiny_model, chat_tokenizer):
    service = started(tiny_model, chat_tokenizer, api_key=",".join(KEYS), max_requests_per_caller=1)
    yield service
    service.scheduler.stop(1.0)


@pytest.fixture(scope="module")
def client(open_service):
    return api(open_service)


@pytest.fixture(scope="module")
def keyed(keyed_service):
    return api(keyed_service)


def completion(**fields) -> dict:
    return {"prompt": [5, 9, 14], "max_tokens": 2, "temperature": 0} | fields


def assert_openai_error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# -- API keys ------------------------------------------------------------------------------


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_without_keys_every_route_is_open_whatever_authorization_says(client):
    for headers in ({}, bearer("anything"), {"Authorization": "garbage"}):
        assert client.get("/v1/models", headers=headers).status_code == 200
        assert client.post("/v1/completions", json=completion(), headers=headers).status_code == 200


REFUSED_AUTHORIZATIONS = {
    "none": ({}, "requires an API key"),
    "wrong": (bearer("key-three"), "not one this verifier accepts"),
    "prefix of a key": (bearer("key-on"), "not one this verifier accepts"),
    "another scheme": ({"Authorization": "Basic a2V5LW9uZTo="}, "not one this verifier accepts"),
    "no token": ({"Authorization": "Bearer"}, "not one this verifier accepts"),
    "garbage": ({"Authorization": b"\x01\x7f\xff" * 100}, "not one this verifier accepts"),
    "bearer garbage": ({"Authorization": b"Bearer \xed\xa0\x80\xff"}, "not one this verifier accepts"),
}


@pytest.mark.parametrize("sent", REFUSED_AUTHORIZATIONS, ids=list(REFUSED_AUTHORIZATIONS))
@pytest.mark.parametrize("method, path", [("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/v1/nothing")])
def test_with_keys_each_v1_route_answers_401_without_a_valid_one(keyed, sent, method, path):
    headers, says = REFUSED_AUTHORIZATIONS[sent]
    response = keyed.request(method, path, headers=headers, json=completion() if method == "POST" else None)
    error = assert_openai_error(response, 401)
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
    assert says in error["message"]
    assert response.headers["www-authenticate"].startswith("Bearer")
    for key in (*KEYS, "key-three", "key-on"):  # neither the keys nor what was sent is echoed
        assert key not in response.text


def test_with_keys_each_configured_key_is_accepted_and_health_and_the_view_stay_open(keyed):
    for key in KEYS:
        assert keyed.get("/v1/models", headers=bearer(key)).status_code == 200
        response = keyed.post("/v1/completions", json=completion(), headers={"authorization": f"bearer  {key} "})
        assert response.status_code == 200
    assert keyed.get("/health").status_code == 200
    assert keyed.get("/").status_code == 200


def test_a_key_check_compares_every_key_in_constant_time(monkeypatch):
    calls = []
    compare = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append((len(a), len(b))) or compare(a, b))
    keys = ApiKeys(["k1", "a much longer second key", "k3"])
    assert keys.caller("k1") == "api key #1"  # the first key matches: the others are compared all the same
    assert keys.caller("k3") == "api key #3"
    assert keys.caller("nope") is None
    assert keys.caller(None) is None
    assert calls == [(32, 32)] * 12  # SHA-256 digests: every comparison is of equal lengths, whatever the keys'
    assert not ApiKeys([]).required


def test_keys_come_from_the_flag_the_variable_and_a_file_and_stay_out_of_the_config_repr(tmp_path, monkeypatch):
    from verifier_service.__main__ import parse_config

    listed = tmp_path / "keys"
    listed.write_text("# deploy keys\nfile-key-1\n\n  file-key-2  \n")
    config = parse_config(["--api-key", "flag-key", "--api-key-file", str(listed)])
    assert config.api_keys() == ("flag-key", "file-key-1", "file-key-2")
    assert "flag-key" not in repr(config)  # the start-up log prints the config
    monkeypatch.setenv("SPECDEC_VERIFIER_API_KEY", "env-key-1, env-key-2")
    assert parse_config([]).api_keys() == ("env-key-1", "env-key-2")
    assert VerifierConfig().api_keys() == ()


@pytest.mark.parametrize(
    "fields, says",
    [
        ({"api_key": "good,bad key"}, "key 2 of --api-key: an API key is printable ASCII"),
        ({"api_key_file": "/nonexistent/keys"}, "cannot read --api-key-file /nonexistent/keys"),
    ],
    ids=["space", "missing-file"],
)
def test_a_malformed_key_or_an_unreadable_file_is_a_config_error_that_names_no_key(fields, says):
    with pytest.raises(ValueError) as raised:
        VerifierConfig(**fields)
    assert says in str(raised.value)
    assert "bad key" not in str(raised.value)


def test_a_key_file_without_a_key_is_a_config_error(tmp_path):
    empty = tmp_path / "keys"
    empty.write_text("# none yet\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        VerifierConfig(api_key_file=str(empty))


# -- per-caller limit -------------------------------------------------------------------------


def test_caller_limit_counts_per_caller_and_releases_once():
    limit = CallerLimit(2)
    first, second = limit.admit("a"), limit.admit("a")
    assert first and second and limit.admit("a") is None
    assert limit.admit("b") is not None  # another caller is not refused
    first()
    first()  # twice: still one place back
    assert limit.in_flight("a") == 1
    assert limit.admit("a") is not None and limit.admit("a") is None
    assert "--max-requests-per-caller 2" in limit.refusal("a")


def test_a_caller_at_its_limit_gets_429_naming_the_flag_while_others_are_served(keyed_service, keyed):
    release = keyed_service.callers.admit("api key #1")  # one request of key-one in flight
    try:
        error = assert_openai_error(keyed.post("/v1/completions", json=completion(), headers=bearer("key-one")), 429)
        assert (error["type"], error["code"]) == ("rate_limit_error", "too_many_requests_per_caller")
        assert "--max-requests-per-caller 1" in error["message"]
        assert keyed.post("/v1/completions", json=completion(), headers=bearer("key-two")).status_code == 200
    finally:
        release()
    assert keyed.post("/v1/completions", json=completion(), headers=bearer("key-one")).status_code == 200


def test_without_keys_the_caller_is_the_peer_address(open_service, client):
    release = open_service.callers.admit("testclient")  # TestClient's peer host
    try:
        assert assert_openai_error(client.post("/v1/completions", json=completion()), 429)["code"] == "too_many_requests_per_caller"
    finally:
        release()


def test_every_way_a_request_ends_gives_its_callers_place_back(client):
    """The limit is 1: each request below would be refused if an earlier one kept its place."""
    for _ in range(2):
        assert client.post("/v1/completions", json=completion()).status_code == 200
        with client.stream("POST", "/v1/completions", json=completion(stream=True)) as stream:
            assert stream.read().decode().rstrip().endswith("data: [DONE]")
        assert client.post("/v1/completions", json=completion(max_tokens=0)).status_code == 400
        assert client.post("/v1/completions", content=b"{not json", headers=JSON).status_code == 400
        assert client.post("/v1/completions", json=completion(prompt=[999])).status_code == 400


def test_grpc_peers_are_named_as_http_names_them():
    assert peer_host("ipv4:10.0.0.7:51234") == "10.0.0.7"
    assert peer_host("ipv6:[::1]:51234") == "::1"
    assert peer_host("unix:/run/verifier.sock") == "unix:/run/verifier.sock"


# -- body and prompt bounds -----------------------------------------------------------------------


def call_asgi(
    app, headers: list[tuple[bytes, bytes]], parts: list[bytes], disconnect: bool = False, host: bytes | None = b"127.0.0.1:8000"
):
    """One POST /v1/completions (for ``host``; a JSON body unless ``headers`` say otherwise) straight
    into the ASGI app: (status, body, the number of body parts it read)."""
    typed = any(name == b"content-type" for name, _ in headers)
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [*([(b"host", host)] if host else []), *([] if typed else [(b"content-type", b"application/json")]), *headers],
        "client": ("10.1.2.3", 5000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }
    pending = list(parts)
    read = []
    sent: list[dict] = []

    async def receive():
        if pending:
            read.append(pending.pop(0))
            return {"type": "http.request", "body": read[-1], "more_body": bool(pending) or disconnect}
        if disconnect:
            return {"type": "http.disconnect"}
        await asyncio.sleep(3600)  # a client that sends nothing more

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    status = next(message["status"] for message in sent if message["type"] == "http.response.start")
    body = b"".join(message.get("body", b"") for message in sent if message["type"] == "http.response.body")
    return status, json.loads(body), len(read)


def test_a_body_over_the_limit_is_refused_from_its_content_length_before_a_byte_is_read(tiny_model, chat_tokenizer):
    service = started(tiny_model, chat_tokenizer, max_http_body_bytes=1000)
    try:
        app = OpenAIApi(service, MODEL).app
        status, body, parts_read = call_asgi(app, [(b"content-length", b"7340032")], [b"{" * 65536] * 3)
        assert (status, body["error"]["code"], parts_read) == (413, "body_too_large", 0)
        assert "--max-http-body-bytes" in body["error"]["message"]
        # Chunked (no Content-Length): refused as soon as the parts read pass the limit.
        status, body, parts_read = call_asgi(app, [(b"transfer-encoding", b"chunked")], [b" " * 600] * 5)
        assert (status, body["error"]["code"], parts_read) == (413, "body_too_large", 2)
    finally:
        service.scheduler.stop(1.0)


class NoTokenizing:
    """The tokenizer, but calling it (or its chat template) fails the test."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        if name == "apply_chat_template":
            raise AssertionError("the chat template ran on a prompt already known to be too long")
        return getattr(self._tokenizer, name)

    def __call__(self, *args, **kwargs):
        raise AssertionError("the tokenizer ran on a prompt already known to be too long")


def test_prompt_text_longer_than_the_cache_could_hold_is_refused_before_any_template_or_tokenizer(open_service, client, monkeypatch):
    limit = CAPACITY * (3 + 1)
    assert open_service.max_prompt_chars == limit
    monkeypatch.setattr(open_service.engine, "tokenizer", NoTokenizing(open_service.engine.tokenizer))
    text = "t5 " * (limit // 3 + 1)
    error = assert_openai_error(client.post("/v1/completions", json=completion(prompt=text)), 400)
    assert error["param"] == "prompt" and f"at most {limit}" in error["message"] and "--max-prompt-chars" in error["message"]
    halves = [{"role": "user", "content": text[: len(text) // 2]}, {"role": "user", "content": text[len(text) // 2 :]}]
    error = assert_openai_error(client.post("/v1/chat/completions", json={"messages": halves}), 400)
    assert error["param"] == "messages" and "--max-prompt-chars" in error["message"]


def test_a_prompt_within_the_character_bound_but_past_the_cache_is_still_the_engines_400(client):
    error = assert_openai_error(client.post("/v1/completions", json=completion(prompt="t5 " * (CAPACITY + 1))), 400)
    assert "cache positions" in error["message"]


def test_grpc_prompt_text_is_bounded_before_tokenizing_too(open_service, monkeypatch):
    monkeypatch.setattr(open_service.engine, "tokenizer", NoTokenizing(open_service.engine.tokenizer))
    for chat in (False, True):
        with pytest.raises(ValueError, match="--max-prompt-chars"):
            VerifierServicer(open_service)._generation_request(pb.GenerateRequest(prompt="t5" * CAPACITY * 4, chat=chat, max_new_tokens=1))


def test_max_prompt_chars_set_by_flag_wins(tiny_model, chat_tokenizer):
    service = started(tiny_model, chat_tokenizer, max_prompt_chars=10)
    try:
        error = assert_openai_error(api(service).post("/v1/completions", json=completion(prompt="t5 t6 t7 t8")), 400)
        assert "at most 10" in error["message"]
    finally:
        service.scheduler.stop(1.0)


# -- malformed bodies ------------------------------------------------------------------------------

DEEP = 100_000
MALFORMED = {
    "nested-100000-deep": b"[" * DEEP + b"]" * DEEP,
    "nested-100000-deep-object": b'{"a":' * DEEP + b"1" + b"}" * DEEP,
    "deep-inside-a-field": b'{"prompt": [5], "temperature": ' + b"[" * 900 + b"]" * 900 + b"}",
    "lone-surrogate-prompt": b'{"prompt": "t5 \\ud800 t9", "max_tokens": 2}',
    "lone-surrogate-message": b'{"messages": [{"role": "user", "content": "\\udc00"}], "max_tokens": 2}',
    "lone-surrogate-text-part": b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "t5\\ud800"}]}]}',
    "lone-surrogate-stop": b'{"prompt": [5], "max_tokens": 2, "stop": ["\\ud800"]}',
    "surrogate-as-raw-bytes": b'{"prompt": "t5 \xed\xa0\x80", "max_tokens": 2}',
    "invalid-utf8": b'{"prompt": "t5 \xff\xfe", "max_tokens": 2}',
    "truncated": b'{"prompt": [5',
    "empty": b"",
    "array": b"[1, 2]",
    "number": b"7",
    "null": b"null",
    "string": b'"t5"',
    "nan-temperature": b'{"prompt": [5], "temperature": NaN}',
    "prompt-object": b'{"prompt": {"text": "t5"}}',
    "prompt-floats": b'{"prompt": [5.5]}',
    "max-tokens-string": b'{"prompt": [5], "max_tokens": "4"}',
    "max-tokens-huge": b'{"prompt": [5], "max_tokens": 1' + b"0" * 400 + b"}",
    "int-too-long-for-python": b'{"prompt": [5], "max_tokens": 1' + b"0" * 5000 + b"}",
    "stream-number": b'{"prompt": [5], "stream": 1}',
    "stream-options-list": b'{"prompt": [5], "stream_options": []}',
    "messages-string": b'{"messages": "hi"}',
    "message-not-object": b'{"messages": [[]]}',
    "token-id-huge": b'{"prompt": [1' + b"0" * 400 + b"]}",
    "seed-negative": b'{"prompt": [5], "seed": -1}',
    "model-list": b'{"prompt": [5], "model": ["tiny"]}',
    "lone-surrogate-key": b'{"prompt": [5], "nope\\ud800": 1}',
    "logit-bias-key-too-long-for-python": b'{"prompt": [5], "logit_bias": {"' + b"1" * 5000 + b'": 1}}',
    "logit-bias-int-too-large-for-a-float": b'{"prompt": [5], "logit_bias": {"5": 1' + b"0" * 400 + b"}}",
}
CHAT_BODIES = {"lone-surrogate-message", "lone-surrogate-text-part", "messages-string", "message-not-object"}


@pytest.mark.parametrize("name", MALFORMED, ids=list(MALFORMED))
def test_every_malformed_body_is_a_400_in_openais_shape(client, name):
    path = "/v1/chat/completions" if name in CHAT_BODIES else "/v1/completions"
    error = assert_openai_error(client.post(path, content=MALFORMED[name], headers=JSON), 400)
    assert error["type"] == "invalid_request_error"


def test_a_lone_surrogate_is_named_with_its_field(client):
    error = assert_openai_error(client.post("/v1/chat/completions", content=MALFORMED["lone-surrogate-message"], headers=JSON), 400)
    assert error["param"] == "messages" and "messages[0].content holds a lone surrogate ('\\udc00')" in error["message"]
    # Spelt in bytes (ed a0 80, which UTF-8 forbids) rather than escaped: named the same.
    error = assert_openai_error(client.post("/v1/completions", content=MALFORMED["surrogate-as-raw-bytes"], headers=JSON), 400)
    assert error["param"] == "prompt" and "prompt holds a lone surrogate ('\\ud800') at character 3" in error["message"]


@pytest.mark.parametrize(
    ("name", "param", "says"),
    [
        ("nested-100000-deep", None, "the body nests too deeply to be a request"),
        ("array", None, "the body must be a JSON object"),
        ("invalid-utf8", None, "the body must be a JSON object in UTF-8: 'utf-8' codec can't decode byte 0xff"),
        ("truncated", None, "the body must be a JSON object in UTF-8: EOF while parsing a list"),
        ("max-tokens-string", "max_tokens", 'max_tokens must be an integer, got "4"'),
        ("stream-number", "stream", "stream must be true or false, got 1"),
        ("seed-negative", "seed", "seed must be in [0, 2**64), got -1"),
        ("stream-options-list", "stream_options", "stream_options must be an object, got a list"),
        ("lone-surrogate-key", None, "the body's keys must be text: one holds a lone surrogate"),
        ("logit-bias-key-too-long-for-python", "logit_bias", "logit_bias keys are token ids (digits)"),
        ("logit-bias-int-too-large-for-a-float", "logit_bias", "logit_bias[5] must be a finite number"),
    ],
)
def test_what_a_malformed_body_is_told(client, name, param, says):
    error = assert_openai_error(client.post("/v1/completions", content=MALFORMED[name], headers=JSON), 400)
    assert error["param"] == param and error["message"].startswith(says), error


@pytest.mark.parametrize(
    ("path", "body", "param", "says"),
    [
        ("/v1/chat/completions", {"messages": []}, "messages", "messages must be a non-empty list of {role, content} objects"),
        ("/v1/chat/completions", {}, "messages", "messages must be a non-empty list of {role, content} objects"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t5"}, 7]}, "messages", "messages[1] needs a role, one of"),
        ("/v1/chat/completions", {"messages": [{"role": "bot", "content": "t5"}]}, "messages", "messages[0] needs a role, one of"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages", "messages[0].content must be a string or a list of text"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages",
            "messages[0].content: only text parts are supported",
        ),
        ("/v1/completions", {"prompt": [5], "stop": ["t5", 7]}, "stop", "stop must be a string or a list of strings"),
        ("/v1/completions", {"prompt": [5], "top_p": True}, "top_p", "top_p must be a number, got true"),
        ("/v1/completions", {"prompt": [5], "num_speculative_tokens": "2"}, "num_speculative_tokens", "num_speculative_tokens must be an"),
        (
            "/v1/completions",
            {"prompt": [5], "stream_options": {"include_usage": 1}},
            "include_usage",
            "include_usage must be true or false",
        ),
        ("/v1/completions", {"prompt": [5], "stream_options": {"include_obfuscation": True}}, "stream_options", "stream_options: only"),
        (
            "/v1/completions",
            {"prompt": [5], "stream_options": {"usage": True}},
            "stream_options",
            'unknown field "usage" in stream_options',
        ),
        ("/v1/completions", {}, "prompt", "prompt must be a string, a list of token ids, or a list of either (a prompt each)"),
        ("/detokenize", {}, "tokens", "tokens must be a list of token ids"),
        (
            "/tokenize",
            {"prompt": "t5", "add_special_tokens": "no"},
            "add_special_tokens",
            'add_special_tokens must be true or false, got "no"',
        ),
    ],
)
def test_each_bad_value_is_told_in_its_fields_words(client, path, body, param, says):
    error = assert_openai_error(client.post(path, json=body), 400)
    assert error["param"] == param and error["message"].startswith(says), error


def test_an_unknown_key_is_named_before_a_refused_field_and_that_before_a_bad_value(client):
    body = completion(store=True, top_p=5, Temperature=1)
    assert assert_openai_error(client.post("/v1/completions", json=body), 400)["param"] == "Temperature"
    body = completion(store=True, top_p=5)
    assert assert_openai_error(client.post("/v1/completions", json=body), 400)["param"] == "store"


def test_an_unexpected_exception_is_a_500_in_openais_shape_and_one_log_line(open_service, client, monkeypatch, caplog):
    def broken(generations, span, caller=""):
        raise RuntimeError("the engine fell over")

    monkeypatch.setattr(open_service, "submit_group", broken)
    with caplog.at_level(logging.INFO):
        response = client.post("/v1/completions", json=completion())
    error = assert_openai_error(response, 500)
    assert (error["type"], error["code"]) == ("server_error", "internal_error")
    assert "fell over" not in error["message"]  # the client is told it failed, not our internals
    [record] = [record for record in caplog.records if record.levelno >= logging.WARNING]
    assert record.name == "verifier_service.serving.openai_api"
    assert "POST /v1/completions failed: RuntimeError: the engine fell over at " in record.getMessage()
    assert "\n" not in record.getMessage() and record.exc_info is None
    assert client.post("/v1/completions", json=completion()).status_code == 500  # its caller's place came back


def test_a_body_the_client_abandons_logs_one_line_naming_the_request(open_service, caplog):
    app = OpenAIApi(open_service, MODEL).app
    with caplog.at_level(logging.INFO):
        call_asgi(app, [(b"content-length", b"1000")], [b'{"prompt": '], disconnect=True)
    [record] = [record for record in caplog.records if record.name.startswith(("verifier_service", "uvicorn", "starlette"))]
    assert record.levelno == logging.INFO and record.exc_info is None
    assert "request http-" in record.getMessage() and "closed after 11 bytes of its body" in record.getMessage()
    assert open_service.callers.in_flight("10.1.2.3") == 0


def test_the_module_keeps_one_bearer_parser():
    assert openai_api.bearer("Bearer  abc ") == "abc"
    assert openai_api.bearer("bearer abc") == "abc"
    assert openai_api.bearer("Basic abc") is None
    assert openai_api.bearer("Bearer") is None
    assert openai_api.bearer(None) is None


NEW_SETTINGS = {  # flag -> (config field, a value other than its default)
    "--max-requests-per-caller": ("max_requests_per_caller", 7),
    "--max-prompt-chars": ("max_prompt_chars", 1000),
    "--max-http-body-bytes": ("max_http_body_bytes", 4096),
    "--http-header-timeout-seconds": ("http_header_timeout_s", 2.5),
    "--http-body-timeout-seconds": ("http_body_timeout_s", 3.5),
    "--max-http-connections": ("max_http_connections", 9),
    "--allowed-hosts": ("allowed_hosts", "api.example.com"),
}


@pytest.mark.parametrize("flag", NEW_SETTINGS)
def test_each_limit_has_a_flag_and_a_variable(flag, monkeypatch):
    from verifier_service.__main__ import parse_config

    field, value = NEW_SETTINGS[flag]
    assert getattr(VerifierConfig(), field) != value
    assert getattr(parse_config([flag, str(value)]), field) == value
    monkeypatch.setenv("SPECDEC_VERIFIER_" + flag[2:].replace("-", "_").upper(), str(value))
    assert getattr(parse_config([]), field) == value


def test_the_http_limits_reach_the_server(tiny_model, chat_tokenizer):
    from verifier_service.serving.server import create_server

    config = VerifierConfig(
        port=0, http_port=0, metrics_port=None, max_http_connections=9, http_header_timeout_s=2.5, http_body_timeout_s=3.5
    )
    verifier = create_server(config)
    try:
        limits = verifier.http.server.config.http_protocol_class.limits
        assert (limits.max_connections, limits.header_timeout_s, limits.body_timeout_s) == (9, 2.5, 3.5)
    finally:
        verifier.stop(0)


# -- no field silently dropped -------------------------------------------------------------

# Each known field this server does not honour: (no-op values, taken; values that would
# change the answer, refused with the field in ``param``).
NOT_HONOURED = {
    "service_tier": (["auto", "default"], ["flex"]),
    "store": ([False], [True]),
}
NOT_HONOURED_CHAT = NOT_HONOURED | {
    "response_format": ([{"type": "text"}], [{"type": "json_object"}]),
    "tools": ([[]], [[{"type": "function", "function": {"name": "f", "parameters": {}}}]]),
    "tool_choice": (["none", "auto"], ["required", {"type": "function", "function": {"name": "f"}}]),
    "parallel_tool_calls": ([True, False], ["yes"]),
    "functions": ([[]], [[{"name": "f"}]]),
    "function_call": (["none"], [{"name": "f"}]),
    "modalities": ([["text"]], [["text", "audio"]]),
    "audio": ([None], [{"voice": "alloy", "format": "wav"}]),
    "prediction": ([None], [{"type": "content", "content": "t5"}]),
    "reasoning_effort": ([None], ["low"]),
    "verbosity": ([None], ["high"]),
    "web_search_options": ([None], [{}]),
    "moderation": ([None], [{"policy": {"output": {"mode": "block"}}}]),
}
NOT_HONOURED_COMPLETIONS = NOT_HONOURED | {
    "best_of": ([1], [3]),
    "suffix": ([None, ""], ["t9"]),
}


def chat_body(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "t5 t9"}], "max_tokens": 2, "temperature": 0} | fields


def field_cases() -> list:
    """(path, body builder, field, value, taken) for every case of both endpoints' tables."""
    endpoints = (("/v1/chat/completions", chat_body, NOT_HONOURED_CHAT), ("/v1/completions", completion, NOT_HONOURED_COMPLETIONS))
    return [
        (path, body, name, value, taken)
        for path, body, table in endpoints
        for name, (no_ops, changes) in table.items()
        for values, taken in ((no_ops, True), (changes, False))
        for value in values
    ]


@pytest.mark.parametrize(("path", "body", "name", "value", "taken"), field_cases())
def test_a_field_not_honoured_is_taken_only_at_its_no_op(client, path, body, name, value, taken):
    response = client.post(path, json=body(**{name: value}))
    if taken:
        assert response.status_code == 200, response.text
        return
    error = assert_openai_error(response, 400)
    assert (error["param"], error["code"]) == (name, "unsupported_field")
    assert error["message"].startswith(f"{name} is not supported here (") and "leave it out or set it to" in error["message"]


@pytest.fixture(scope="module")
def sdk(client):
    """The official ``openai`` client, in-process: its HTTP client is the app's TestClient."""
    return openai.OpenAI(base_url=BASE + "/v1", api_key="not-checked", http_client=client, max_retries=0)


def sdk_call(sdk, path: str, body: dict):
    """``body`` sent by the SDK's own create(): its keyword arguments where it has them, extra_body for the rest."""
    create = sdk.chat.completions.create if path == "/v1/chat/completions" else sdk.completions.create
    known = inspect.signature(create).parameters
    return create(
        **{name: value for name, value in body.items() if name in known},
        extra_body={name: value for name, value in body.items() if name not in known} or None,
    )


@pytest.mark.parametrize(("path", "body", "name", "value", "taken"), field_cases())
def test_the_openai_client_gets_each_refusal_as_a_bad_request_naming_the_field(sdk, path, body, name, value, taken):
    request = body(**{name: value}) | {"model": MODEL}
    if taken:
        assert sdk_call(sdk, path, request).choices
        return
    with pytest.raises(openai.BadRequestError) as raised:
        sdk_call(sdk, path, request)
    assert (raised.value.param, raised.value.code) == (name, "unsupported_field")


@pytest.mark.parametrize(
    ("path", "body", "key"),
    [
        ("/v1/chat/completions", chat_body(guided_json={"type": "object"}), "guided_json"),
        ("/v1/chat/completions", chat_body(prompt="t5"), "prompt"),  # a completions field
        ("/v1/chat/completions", chat_body(echo=True), "echo"),
        ("/v1/completions", completion(messages=[]), "messages"),  # a chat field
        ("/v1/completions", completion(max_completion_tokens=2), "max_completion_tokens"),
        ("/v1/completions", completion(Temperature=0.5), "Temperature"),  # keys are case-sensitive
    ],
)
def test_an_unknown_field_is_a_400_naming_it(client, path, body, key):
    error = assert_openai_error(client.post(path, json=body), 400)
    assert (error["param"], error["code"]) == (key, "unknown_field")
    assert f'unknown field "{key}" for {path}' in error["message"]


@pytest.mark.parametrize(
    ("options", "status"),
    [
        ({"include_usage": True}, 200),
        ({"include_obfuscation": False}, 200),
        ({"continuous_usage_stats": True}, 400),
        ({"usage": True}, 400),
    ],
)
def test_stream_options_take_include_usage_and_refuse_the_rest(client, options, status):
    response = client.post("/v1/completions", json=completion(stream=True, stream_options=options))
    if status == 200:
        assert response.status_code == 200 and response.text.rstrip().endswith("data: [DONE]")
    else:
        assert assert_openai_error(response, 400)["param"] == "stream_options"


def test_the_labels_a_sender_puts_on_a_request_are_taken(client):
    labels = {"user": "u-1", "metadata": {"team": "a"}, "safety_identifier": "s", "prompt_cache_key": "k"}
    assert client.post("/v1/chat/completions", json=chat_body(**labels)).status_code == 200
    assert client.post("/v1/completions", json=completion(**labels)).status_code == 200


# -- endpoints and headers ------------------------------------------------------------------


def test_a_model_is_retrieved_by_its_id_and_another_is_openais_404(client, open_service):
    assert client.get(f"/v1/models/{MODEL}").json() == client.get("/v1/models").json()["data"][0]
    card = client.get(f"/v1/models/{MODEL}").json()
    assert card["max_model_len"] == CAPACITY
    assert (card["dtype"], card["weights"], card["threads"]) == ("float32", "float", torch.get_num_threads())  # its form
    assert card["batch_invariant"] is (open_service.engine.target.invariance is not None)
    error = assert_openai_error(client.get("/v1/models/org/other-model"), 404)
    assert (error["param"], error["code"]) == ("model", "model_not_found") and '"org/other-model"' in error["message"]


def test_tokenize_and_detokenize_round_trip_in_vllms_shapes(client, chat_tokenizer):
    tokenized = client.post("/tokenize", json={"prompt": "t5 t9 t14"}).json()
    expected = chat_tokenizer("t5 t9 t14").input_ids
    assert tokenized == {"count": len(expected), "max_model_len": CAPACITY, "tokens": expected} and len(expected) >= 3
    assert client.post("/detokenize", json={"tokens": tokenized["tokens"]}).json() == {"prompt": chat_tokenizer.decode(tokenized["tokens"])}
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "t5 t9"}]}).json()
    assert chat["tokens"] == chat_ids(chat_tokenizer, [{"role": "user", "content": "t5 t9"}])  # what chat completions feed the model


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": "t5", "messages": []}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": None}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "t5", "truncate": True}, "truncate"),
        ("/tokenize", {"messages": [{"role": "user", "content": "t5"}], "add_generation_prompt": False}, "add_generation_prompt"),
        ("/detokenize", {"tokens": "t5"}, "tokens"),
        ("/detokenize", {"tokens": [5, -1]}, "tokens"),
        ("/detokenize", {"tokens": [5, 10**9]}, "tokens"),
        ("/detokenize", {"tokens": [5] * (CAPACITY + 1)}, "tokens"),
    ],
)
def test_tokenize_and_detokenize_refuse_bad_bodies_naming_the_field(client, path, body, param):
    assert assert_openai_error(client.post(path, json=body), 400)["param"] == param


def test_tokenize_and_detokenize_need_a_key_when_keys_are_configured(keyed):
    assert keyed.post("/tokenize", json={"prompt": "t5"}).status_code == 401
    assert keyed.post("/detokenize", json={"tokens": [5]}, headers=bearer(KEYS[0])).status_code == 200


def test_every_answer_carries_the_clients_request_id_or_one_made_for_it(client):
    assert client.get("/health", headers={"X-Request-Id": "abc-123"}).headers["x-request-id"] == "abc-123"
    made = client.post("/v1/completions", json=completion()).headers["x-request-id"]
    assert made.startswith("req-") and len(made) == 20
    for unusable in (b"a b", b"x" * 129, "é".encode()):  # spaces, too long, not ASCII: replaced
        sent = {"X-Request-Id": unusable}
        assert client.post("/v1/completions", json=completion(), headers=sent).headers["x-request-id"].startswith("req-")
    assert_openai_error(client.post("/v1/completions", json=completion(n=0), headers={"X-Request-Id": "e-1"}), 400)
    assert client.post("/v1/completions", json=completion(n=0), headers={"X-Request-Id": "e-1"}).headers["x-request-id"] == "e-1"


@pytest.mark.parametrize("top_p", [0, -0.1, 1.5])
def test_top_p_outside_openais_range_is_a_400(client, top_p):
    error = assert_openai_error(client.post("/v1/completions", json=completion(top_p=top_p)), 400)
    assert error["param"] == "top_p" and "top_p must be in (0, 1]" in error["message"]


def test_metrics_are_served_on_the_api_port_too(open_service, client):
    client.post("/v1/completions", json=completion())
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    assert "specdec_verifier_generated_tokens_total" in response.text
    assert 'specdec_verifier_requests_total{finish_reason="length",model_name="smollm2-135m-instruct"}' in response.text


def test_cors_answers_only_the_allowed_origins(tiny_model, chat_tokenizer, client):
    service = started(tiny_model, chat_tokenizer, allowed_origins="https://app.example.com, http://localhost:3000")
    try:
        cors = api(service)
        preflight = {
            "Origin": "https://app.example.com",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization",
        }
        answer = cors.options("/v1/completions", headers=preflight)
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "https://app.example.com"
        called = cors.post("/v1/completions", json=completion(), headers={"Origin": "http://localhost:3000"})
        assert called.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "x-request-id" in called.headers["access-control-expose-headers"].lower()
        other = cors.post("/v1/completions", json=completion(), headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers
        assert cors.options("/v1/completions", headers=preflight | {"Origin": "https://evil.example"}).status_code == 400
    finally:
        service.scheduler.stop(1.0)
    # Without the flag, no CORS headers at all.
    assert "access-control-allow-origin" not in client.get("/health", headers={"Origin": "https://app.example.com"}).headers


@pytest.mark.parametrize("origins", ["https://app.example.com/path", "app.example.com", "https://a.example, ftp//b"])
def test_an_origin_that_is_not_one_is_a_config_error(origins):
    with pytest.raises(ValueError, match="--allowed-origins: .* is not an origin"):
        VerifierConfig(allowed_origins=origins)


def test_echo_puts_the_prompt_before_the_completion(client, chat_tokenizer):
    plain = client.post("/v1/completions", json=completion(prompt="t5 t9")).json()["choices"][0]["text"]
    echoed = client.post("/v1/completions", json=completion(prompt="t5 t9", echo=True)).json()["choices"][0]["text"]
    assert echoed == chat_tokenizer.decode(chat_tokenizer("t5 t9").input_ids) + plain and plain
    by_ids = client.post("/v1/completions", json=completion(echo=True)).json()["choices"][0]["text"]
    assert by_ids.startswith(chat_tokenizer.decode([5, 9, 14]))
    streamed = client.post("/v1/completions", json=completion(prompt="t5 t9", echo=True, stream=True)).text
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in streamed.splitlines() if line.startswith("data: {")]
    assert "".join(texts) == echoed and texts[0] == chat_tokenizer.decode(chat_tokenizer("t5 t9").input_ids)
    assert assert_openai_error(client.post("/v1/completions", json=completion(echo="yes")), 400)["param"] == "echo"


# -- penalties, logit_bias, min_tokens and log-probabilities --------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        {"frequency_penalty": 1.5},
        {"presence_penalty": 2},
        {"repetition_penalty": 1.8},
        {"logit_bias": {"7": 5, "9": -100, "30": 3.5, "36": -100}},
        {"min_tokens": 6, "repetition_penalty": 1.3, "logit_bias": {"12": 2}},
    ],
)
def test_penalties_bias_and_min_tokens_give_plain_decodings_output_with_them(client, tiny_model, chat_tokenizer, fields):
    prompt = [9, 3, 3, 9, 3, 3, 9, 3]
    body = completion(prompt=prompt, max_tokens=20, **fields)
    answer = client.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    bias = tuple(sorted((int(token), float(value)) for token, value in fields.get("logit_bias", {}).items()))
    numbers = {
        name: fields[name] for name in ("frequency_penalty", "presence_penalty", "repetition_penalty", "min_tokens") if name in fields
    }
    params = SamplingParams(logit_bias=bias, **numbers)
    expected = reference_decode(tiny_model, prompt, params, 20, frozenset({TINY_EOS}))
    assert answer.json()["choices"][0]["text"] == chat_tokenizer.decode(expected, skip_special_tokens=True)
    plain = client.post("/v1/completions", json=completion(prompt=prompt, max_tokens=20)).json()["choices"][0]["text"]
    assert plain != answer.json()["choices"][0]["text"]


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"frequency_penalty": 2.5}, "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
        ({"presence_penalty": "high"}, "presence_penalty", "presence_penalty must be a number"),
        ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty must be in [0.01, 100]"),
        ({"logit_bias": {"t5": 1}}, "logit_bias", "logit_bias keys are token ids"),
        ({"logit_bias": {"5": "up"}}, "logit_bias", "logit_bias[5] must be a number"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "logit_bias[5] must be in [-100, 100]"),
        ({"logit_bias": {"64": 1}}, "logit_bias", "logit_bias names token ids outside the vocabulary [0, 64)"),
        ({"logit_bias": [5]}, "logit_bias", "logit_bias must be an object"),
        ({"min_tokens": 3}, "min_tokens", "min_tokens (3) must not exceed the tokens asked for (2)"),
        ({"logprobs": 21}, "logprobs", "logprobs must be in [0, 20]"),
    ],
)
def test_bad_penalties_bias_min_tokens_and_logprobs_are_400s_naming_the_field(client, fields, param, says):
    error = assert_openai_error(client.post("/v1/completions", json=completion(**fields)), 400)
    assert error["param"] == param and says in error["message"], error


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be in [0, 20]"),
    ],
)
def test_chats_top_logprobs_need_logprobs_and_stay_in_range(client, fields, says):
    error = assert_openai_error(client.post("/v1/chat/completions", json=chat_body(**fields)), 400)
    assert error["param"] == "top_logprobs" and says in error["message"], error


def test_the_max_tokens_limit_is_named_as_openai_names_it(client):
    error = assert_openai_error(client.post("/v1/completions", json=completion(max_tokens=-1)), 400)
    assert error["param"] == "max_tokens" and error["message"].startswith("max_tokens must be in [1, ")
    error = assert_openai_error(client.post("/v1/completions", json=completion(max_tokens=0)), 400)
    assert error["param"] == "max_tokens" and "it is taken with echo: true, to score the prompt" in error["message"]


def test_chat_logprobs_are_the_targets_in_openais_shape_streamed_or_not(client, tiny_model, chat_tokenizer):
    body = chat_body(max_tokens=8, logprobs=True, top_logprobs=3)
    whole = client.post("/v1/chat/completions", json=body).json()
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == whole["usage"]["completion_tokens"] == 8
    assert "".join(entry["token"] for entry in content) == whole["choices"][0]["message"]["content"]
    ids = chat_ids(chat_tokenizer, [{"role": "user", "content": "t5 t9"}])
    output = chat_tokenizer(whole["choices"][0]["message"]["content"]).input_ids
    with torch.inference_mode():
        full = torch.log_softmax(tiny_model(torch.tensor([list(ids) + output])).logits[0].float(), dim=-1)
    for index, entry in enumerate(content):
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode())
        assert entry["logprob"] == pytest.approx(float(full[len(ids) - 1 + index, output[index]]), abs=1e-5)
        assert len(entry["top_logprobs"]) == 3 and entry["top_logprobs"][0]["token"] == entry["token"]  # greedy
    streamed = client.post("/v1/chat/completions", json=body | {"stream": True}).text
    chunks = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    pieces = [
        entry
        for chunk in chunks
        if chunk["choices"] and chunk["choices"][0]["logprobs"]
        for entry in chunk["choices"][0]["logprobs"]["content"]
    ]

    # The same tokens; a value may differ in its last bits, as the two runs' passes can be shaped differently.
    def values(entries):
        return [entry["logprob"] for entry in entries] + [top["logprob"] for entry in entries for top in entry["top_logprobs"]]

    def names(entries):
        return [(entry["token"], [top["token"] for top in entry["top_logprobs"]]) for entry in entries]

    assert names(pieces) == names(content) and values(pieces) == pytest.approx(values(content), abs=1e-5)
    assert client.post("/v1/chat/completions", json=chat_body()).json()["choices"][0]["logprobs"] is None


def test_completion_logprobs_in_openais_legacy_shape(client):
    answer = client.post("/v1/completions", json=completion(max_tokens=6, logprobs=2)).json()["choices"][0]
    logprobs = answer["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert "".join(logprobs["tokens"]) == answer["text"]
    assert logprobs["text_offset"] == [sum(len(token) for token in logprobs["tokens"][:index]) for index in range(6)]
    assert all(
        len(top) == 2 and max(top.values()) >= value - 1e-6 for top, value in zip(logprobs["top_logprobs"], logprobs["token_logprobs"])
    )


# -- n choices -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def roomy_service(tiny_model, chat_tokenizer):
    """Room for a caller's several choices: 4 places, at most 3 choices a request, a batch of 2 (so choices queue)."""
    service = started(tiny_model, chat_tokenizer, max_requests_per_caller=4, max_choices=3)
    yield service
    service.scheduler.stop(1.0)


@pytest.fixture(scope="module")
def roomy(roomy_service):
    return api(roomy_service)


def sampled(**fields) -> dict:
    return completion(prompt=[5, 9, 14, 20], max_tokens=12, temperature=1.0, seed=11) | fields


def test_n_choices_are_the_requests_with_seeds_seed_plus_index(roomy):
    answer = roomy.post("/v1/completions", json=sampled(n=3)).json()
    assert [choice["index"] for choice in answer["choices"]] == [0, 1, 2]
    singles = [roomy.post("/v1/completions", json=sampled(seed=11 + index)).json() for index in range(3)]
    texts = [single["choices"][0]["text"] for single in singles]
    assert [choice["text"] for choice in answer["choices"]] == texts
    assert len(set(texts)) > 1  # the seeds differ, so the samples do
    generated = sum(single["usage"]["completion_tokens"] for single in singles)
    assert answer["usage"] == {"prompt_tokens": 4, "completion_tokens": generated, "total_tokens": 4 + generated}
    assert answer["specdec"]["generated_tokens"] == generated


def test_streamed_choices_carry_their_index_and_end_once_each(roomy):
    whole = roomy.post("/v1/chat/completions", json=chat_body(n=3, max_tokens=10, temperature=1.0, seed=5, logprobs=True)).json()
    body = chat_body(n=3, max_tokens=10, temperature=1.0, seed=5, logprobs=True, stream=True, stream_options={"include_usage": True})
    lines = [line for line in roomy.post("/v1/chat/completions", json=body).text.splitlines() if line]
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert lines[-1] == "data: [DONE]" and chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    texts, finishes, tokens = collections.defaultdict(str), collections.Counter(), collections.defaultdict(list)
    for chunk in chunks[:-1]:
        [choice] = chunk["choices"]
        texts[choice["index"]] += choice["delta"].get("content", "")
        finishes[choice["index"]] += choice["finish_reason"] is not None
        if choice["logprobs"]:
            tokens[choice["index"]] += [entry["token"] for entry in choice["logprobs"]["content"]]
    assert [texts[index] for index in range(3)] == [choice["message"]["content"] for choice in whole["choices"]]
    assert finishes == {0: 1, 1: 1, 2: 1}
    assert [tokens[index] for index in range(3)] == [
        [entry["token"] for entry in choice["logprobs"]["content"]] for choice in whole["choices"]
    ]


def test_greedy_choices_are_alike(roomy):
    answer = roomy.post("/v1/completions", json=completion(n=2, max_tokens=8)).json()
    first, second = (choice["text"] for choice in answer["choices"])
    assert first == second == roomy.post("/v1/completions", json=completion(max_tokens=8)).json()["choices"][0]["text"]


def test_n_over_the_limit_or_the_callers_places_is_refused(roomy, client, open_service):
    error = assert_openai_error(roomy.post("/v1/completions", json=sampled(n=4)), 400)
    assert error["param"] == "n" and "n must be in [1, 3] (--max-choices, --max-queued), got 4" in error["message"]
    assert assert_openai_error(roomy.post("/v1/completions", json=sampled(n=0)), 400)["param"] == "n"
    error = assert_openai_error(client.post("/v1/completions", json=completion(n=2)), 429)  # one place per caller
    assert "--max-requests-per-caller 1" in error["message"] and "n=2 takes 2" in error["message"]
    assert open_service.callers.in_flight("testclient") == 0
    assert client.post("/v1/completions", json=completion()).status_code == 200


# -- the declared bodies against OpenAI's own request types ----------------------------------


def sdk_fields(module) -> set[str]:
    """Every key of the ``openai`` package's request TypedDicts in ``module`` (streamed or not)."""
    return {
        name
        for kind in (module.CompletionCreateParamsStreaming, module.CompletionCreateParamsNonStreaming)
        for name in kind.__annotations__
    }


@pytest.mark.parametrize(
    ("module", "declared"),
    [(openai_completion_params, CompletionRequest), (openai_chat_params, ChatCompletionRequest)],
    ids=["completions", "chat"],
)
def test_every_field_the_openai_client_can_send_is_declared(module, declared):
    """Honoured or refused by name, never unknown: a new field in the SDK fails this test until declared."""
    assert sdk_fields(module) - set(declared.model_fields) == set()


@pytest.mark.parametrize("name", ["prompt_cache_retention", "prompt_cache_options", "user", "metadata"])
def test_labels_and_cache_hints_are_taken_whatever_they_hold(client, name):
    value = {"prompt_cache_retention": "24h", "prompt_cache_options": {"ttl": "1h"}, "user": "u-1", "metadata": {"a": "b"}}[name]
    assert client.post("/v1/chat/completions", json=chat_body(**{name: value})).status_code == 200


def test_the_eos_that_ends_a_completion_has_its_logprob_and_no_text(client):
    """min_tokens 2, then EOS (token 1, special) made certain by logit_bias: three entries, the last one ""."""
    body = completion(max_tokens=6, logprobs=1, min_tokens=2, logit_bias={"1": 100})
    answer = client.post("/v1/completions", json=body).json()["choices"][0]
    logprobs = answer["logprobs"]
    assert answer["finish_reason"] == "stop" and len(logprobs["tokens"]) == 3
    assert logprobs["tokens"][-1] == "" and "".join(logprobs["tokens"]) == answer["text"] != ""
    assert logprobs["token_logprobs"][-1] < 0  # the raw log-probability, before the bias


# -- the request span, in OpenTelemetry's GenAI conventions --------------------------------


def test_an_http_request_span_follows_the_genai_conventions(roomy_service, monkeypatch):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(roomy_service.tracing, "tracer", provider.get_tracer("test"))
    client = api(roomy_service)
    answer = client.post("/v1/chat/completions", json=chat_body(n=2, max_tokens=5, temperature=0.7, seed=3)).json()
    [span] = exporter.get_finished_spans()
    attributes = dict(span.attributes)
    assert span.name == f"chat {roomy_service.config.model}"
    assert attributes["gen_ai.operation.name"] == "chat" and attributes["gen_ai.request.model"] == roomy_service.config.model
    assert (attributes["gen_ai.request.max_tokens"], attributes["gen_ai.request.temperature"]) == (5, 0.7)
    assert (attributes["gen_ai.request.seed"], attributes["gen_ai.request.choice.count"]) == (3, 2)  # the request's seed
    assert attributes["gen_ai.response.id"] == answer["id"]
    assert list(attributes["gen_ai.response.finish_reasons"]) == [choice["finish_reason"] for choice in answer["choices"]]
    usage = answer["usage"]
    assert (attributes["gen_ai.usage.input_tokens"], attributes["gen_ai.usage.output_tokens"]) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )


# -- hostile callers: what each refusal names, and work that waits for no check ----------------


@pytest.mark.parametrize("token", [-1, 2**70, 64])
def test_echoed_token_ids_outside_the_vocabulary_are_a_400_naming_the_prompt(client, token):
    """The ids are checked before the echo decodes them (a decoder takes no id < 0 or >= 2**64)."""
    error = assert_openai_error(client.post("/v1/completions", json=completion(prompt=[5, token], echo=True)), 400)
    assert error["param"] == "prompt" and "outside the vocabulary [0, 64)" in error["message"] and str(token) in error["message"]


@pytest.mark.parametrize("penalty", [1e-38, 1e-3, 1e3, 1e38])
def test_a_repetition_penalty_whose_shaped_logits_could_overflow_is_a_400_up_front(client, penalty):
    """Sampling divides a seen token's positive logit by the penalty: by 1e-38 that is inf, and
    softmax NaN. Refused before the request is queued, naming the field and the range."""
    body = completion(prompt=[9, 3, 3, 9], max_tokens=4, temperature=1.0, seed=1, repetition_penalty=penalty)
    error = assert_openai_error(client.post("/v1/completions", json=body), 400)
    assert error["param"] == "repetition_penalty" and "repetition_penalty must be in [0.01, 100]" in error["message"]


@pytest.mark.parametrize("penalty", [0.01, 100.0])
def test_a_repetition_penalty_at_either_end_of_its_range_samples(client, penalty):
    body = completion(prompt=[9, 3, 3, 9], max_tokens=6, temperature=1.0, seed=1, repetition_penalty=penalty)
    assert client.post("/v1/completions", json=body).status_code == 200


def test_an_error_raised_while_a_whole_answer_is_awaited_keeps_its_own_status(client, monkeypatch):
    """The wait runs in a task group, which wraps what it raises in an ExceptionGroup: the
    request's own error must come out of it, not a 500."""

    def refused(self):
        raise openai_api.ApiError(409, "this choice was refused", param="n", code="refused")

    monkeypatch.setattr(openai_api._Reply, "all_results", refused)
    error = assert_openai_error(client.post("/v1/completions", json=completion()), 409)
    assert (error["param"], error["code"], error["message"]) == ("n", "refused", "this choice was refused")


def test_tokenize_and_detokenize_count_against_the_callers_limit(open_service, client):
    release = open_service.callers.admit("testclient")  # the caller's one place is taken
    try:
        for path, body in (("/tokenize", {"prompt": "t5"}), ("/detokenize", {"tokens": [5]})):
            error = assert_openai_error(client.post(path, json=body), 429)
            assert error["code"] == "too_many_requests_per_caller" and "--max-requests-per-caller 1" in error["message"]
        assert assert_openai_error(client.post("/v1/completions", json=completion()), 429)["code"] == "too_many_requests_per_caller"
    finally:
        release()
    assert client.post("/tokenize", json={"prompt": "t5"}).status_code == 200
    assert client.post("/detokenize", json={"tokens": [5]}).status_code == 200
    assert open_service.callers.in_flight("testclient") == 0  # each gave its place back


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_a_post_that_is_not_json_is_refused_415_before_its_body_is_read(client, path, content_type):
    """What a page on another site may POST without a CORS preflight ("simple requests") is
    refused, so such a page cannot make this server generate."""
    headers = {"content-type": content_type} if content_type else {}
    error = assert_openai_error(client.post(path, content=json.dumps(completion()).encode(), headers=headers), 415)
    assert error["code"] == "unsupported_media_type" and "Content-Type: application/json" in error["message"]


def test_a_text_plain_post_is_refused_unread(open_service):
    body = json.dumps(completion()).encode()
    status, answer, parts_read = call_asgi(OpenAIApi(open_service, MODEL).app, [(b"content-type", b"text/plain")], [body])
    assert (status, answer["error"]["code"], parts_read) == (415, "unsupported_media_type", 0)


def test_a_json_content_type_with_parameters_is_taken(client):
    body = json.dumps(completion()).encode()
    for content_type in ("application/json; charset=utf-8", "Application/JSON"):
        assert client.post("/v1/completions", content=body, headers={"content-type": content_type}).status_code == 200


def test_a_logit_bias_over_the_limit_is_refused_by_its_count_before_any_entry_is_read(client):
    """Over --max-logit-bias (300) the count is the error, before any key is read (the first
    key here is not even a token id)."""
    bias = {"t5": 1} | {str(token): 1 for token in range(400)}
    error = assert_openai_error(client.post("/v1/completions", json=completion(logit_bias=bias)), 400)
    assert error["param"] == "logit_bias" and "at most 300 tokens (--max-logit-bias), got 401" in error["message"]


def test_a_grpc_logit_bias_over_the_limit_is_refused_before_it_is_converted(open_service):
    request = pb.GenerateRequest(prompt_token_ids=[5], max_new_tokens=2, logit_bias={token: 1.0 for token in range(100_000)})
    with pytest.raises(InvalidRequest) as refused:
        VerifierServicer(open_service)._generation_request(request)  # the proto's map, before it is made a tuple
    assert refused.value.field == "logit_bias" and "at most 300 tokens (--max-logit-bias), got 100000" in str(refused.value)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_log_probability_texts_are_rendered_off_the_event_loop(roomy, chat_tokenizer, monkeypatch, path, stream):
    """Each token's text and its alternatives' take tokenizer decodes: done on the event loop,
    n choices of long answers froze every other stream. None may run on a thread running a loop."""
    decode, on_loop = chat_tokenizer.decode, []

    def watched(*args, **kwargs):
        try:
            asyncio.get_running_loop()
            on_loop.append(args)
        except RuntimeError:
            pass
        return decode(*args, **kwargs)

    monkeypatch.setattr(chat_tokenizer, "decode", watched)
    if path == "/v1/completions":
        body = sampled(n=2, logprobs=3, stream=stream, echo=False)
    else:
        body = chat_body(n=2, max_tokens=8, temperature=1.0, seed=3, logprobs=True, top_logprobs=3, stream=stream)
    answer = roomy.post(path, json=body)
    assert answer.status_code == 200 and "logprob" in answer.text
    assert on_loop == []


@pytest.mark.parametrize("host", ["localhost:8000", "127.0.0.1", "[::1]:8000", "LocalHost.:1", "127.0.0.1:65535"])
def test_the_names_of_a_loopback_address_are_answered_with_any_port(client, host):
    for method, path in (("GET", "/health"), ("GET", "/"), ("POST", "/v1/completions")):
        answer = client.request(method, path, json=completion() if method == "POST" else None, headers={"host": host})
        assert answer.status_code == 200, (path, answer.text)


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "localhost.evil.example", "127.0.0.2", "[::2]:8000", "::1"])
def test_a_request_naming_another_host_is_refused_before_any_route(open_service, client, host):
    """DNS rebinding: a page whose own name was made to resolve to 127.0.0.1 calls the server as
    same-origin, with its name in Host. Every path is refused, the live view and /health too."""
    for method, path in (("GET", "/health"), ("GET", "/"), ("POST", "/v1/completions"), ("POST", "/tokenize")):
        error = assert_openai_error(client.request(method, path, json={"prompt": "t5"}, headers={"host": host}), 400)
        assert error["code"] == "host_not_allowed" and "--allowed-hosts" in error["message"], error
    assert open_service.callers.in_flight("testclient") == 0


def test_a_request_without_a_host_header_is_refused_when_hosts_are_listed(open_service):
    status, body, parts_read = call_asgi(OpenAIApi(open_service, MODEL).app, [], [b"{}"], host=None)
    assert (status, body["error"]["code"], parts_read) == (400, "host_not_allowed", 0)
    assert "no Host header" in body["error"]["message"]


@pytest.mark.parametrize(
    ("fields", "hosts"),
    [
        ({}, {"localhost", "127.0.0.1", "::1"}),  # the default --host
        ({"host": "::1"}, {"localhost", "127.0.0.1", "::1"}),
        ({"host": "localhost"}, {"localhost", "127.0.0.1", "::1"}),
        ({"host": "10.0.0.5"}, {"10.0.0.5"}),
        ({"host": "0.0.0.0"}, None),  # all interfaces: the server cannot know its names
        ({"host": "::"}, None),
        ({"allowed_hosts": "API.example.com, [fd00::1] ,10.0.0.5."}, {"api.example.com", "fd00::1", "10.0.0.5"}),
        ({"host": "0.0.0.0", "allowed_hosts": "api.example.com"}, {"api.example.com"}),
        ({"allowed_hosts": "api.example.com,*"}, None),
    ],
)
def test_allowed_hosts_default_to_the_bound_addresss_names(fields, hosts):
    assert VerifierConfig(**fields).hosts() == (None if hosts is None else frozenset(hosts))


@pytest.mark.parametrize("hosts", ["https://api.example.com", "api.example.com:8000", "api.example.com/v1", " , ", "a b"])
def test_an_allowed_host_that_is_not_one_is_a_config_error(hosts):
    with pytest.raises(ValueError, match="--allowed-hosts"):
        VerifierConfig(allowed_hosts=hosts)


def test_a_server_on_all_interfaces_answers_any_host(tiny_model, chat_tokenizer):
    service = started(tiny_model, chat_tokenizer, host="0.0.0.0")
    try:
        assert api(service).get("/health", headers={"host": "verifier.internal:8000"}).status_code == 200
    finally:
        service.scheduler.stop(1.0)


def test_the_api_answers_to_every_served_name_and_reports_the_first(open_service):
    named = TestClient(OpenAIApi(open_service, "smollm2", ["HuggingFaceTB/SmolLM2-135M-Instruct"]).app, base_url=BASE)
    listed = named.get("/v1/models").json()["data"]
    assert [card["id"] for card in listed] == ["smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct"]
    assert {card["max_model_len"] for card in listed} == {CAPACITY}
    for name in ("smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        answer = named.post("/v1/completions", json=completion(model=name))
        assert answer.status_code == 200 and answer.json()["model"] == "smollm2"
    assert named.post("/v1/completions", json=completion(model="other")).status_code == 404


def test_served_names_default_to_the_model_and_for_the_default_model_its_hub_name():
    assert VerifierConfig().served_names() == [DEFAULT_MODEL, DEFAULT_MODEL_HUB_NAME]
    assert VerifierConfig(model="org/model").served_names() == ["org/model"]
    assert VerifierConfig(served_model_name="a, b,a").served_names() == ["a", "b"]


def test_health_says_whether_a_drafter_speculates_and_version_says_the_release(client):
    health = client.get("/health").json()
    assert health == {"status": "ok", "drafter": None, "warning": NO_DRAFTER_WARNING}
    assert client.get("/version").json()["version"] == importlib.metadata.version("specdec")
