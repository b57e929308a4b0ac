"""The OpenAI-compatible HTTP API of a live verifier, called by the official
``openai`` client, by curl and by plain HTTP, and held against gRPC ``Generate``.

The tiny model's word-level tokenizer reads "t5 t9" as tokens [5, 9]; a
one-line chat template joins the messages' contents, so chat prompts are
tokens too.
"""

from __future__ import annotations

import json
import signal
import subprocess

import httpx2 as httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from verifier_service.core.model_loading import DEFAULT_MODEL

from processes import HttpVerifier

PROMPT = "t5 t9 t14 t20"
# Token ids whose greedy continuation cycles without EOS (tests/e2e/test_verifier_service.py's PROMPTS[0]):
# a request for 60,000 of them holds its batch slot for minutes unless cancelled.
CYCLING_PROMPT_IDS = [5, 9, 14, 20]
LONG_RUNNING_TOKENS = 60_000  # minutes of decoding: such requests end only by being cancelled
LONG_CONTEXT = 1 << 16  # long_tiny_model_dir's, and chat_model_dir's (tests/e2e/conftest.py)
CALL_TIMEOUT_S = 120
PROBE_TIMEOUT_S = 20  # a request behind a leaked slot would wait for 60,000 tokens


@pytest.fixture(scope="module")
def server(chat_model_dir):
    """One batch slot and one queue place: a leaked slot blocks every later request."""
    verifier = HttpVerifier(
        chat_model_dir,
        *("--max-batch-size", "1", "--max-queued", "1"),
        *("--max-new-tokens", str(LONG_RUNNING_TOKENS), "--max-sequence-tokens", str(LONG_CONTEXT)),
    )
    try:
        yield verifier
    finally:
        verifier.process.stop()


def test_models_and_health(server):
    [model] = server.client.models.list().data
    assert model.id == server.model
    health = httpx.get(server.base + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert health.json()["drafter"] is None and "every step is plain decoding" in health.json()["warning"]  # started without one


def test_greedy_chat_completion_equals_grpc_generate(server):
    reference = server.generate(prompt=PROMPT, chat=True, max_new_tokens=24)
    response = server.client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": PROMPT}], max_tokens=24, temperature=0
    )
    [choice] = response.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == reference.text
    assert choice.finish_reason == "length"
    assert response.usage.completion_tokens == len(reference.token_ids) == 24
    assert response.usage.prompt_tokens == reference.stats.prompt_tokens
    assert response.usage.total_tokens == response.usage.prompt_tokens + 24
    speculation = response.model_extra["specdec"]
    assert speculation["target_forward_passes"] >= 1 and speculation["generated_tokens"] == 24


def test_streamed_chat_carries_grpcs_tokens_and_text_then_usage(server):
    reference = server.generate(prompt=PROMPT, chat=True, max_new_tokens=20)
    stream = server.client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": PROMPT}],
        max_completion_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    tokens = [
        token
        for chunk in chunks
        if chunk.choices and "token_ids" in chunk.model_extra.get("specdec", {})
        for token in chunk.model_extra["specdec"]["token_ids"]
    ]
    assert text == reference.text
    assert tokens == list(reference.token_ids)
    finishing = [chunk for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    assert [chunk.choices[0].finish_reason for chunk in finishing] == ["length"]
    assert finishing[0].model_extra["specdec"]["generated_tokens"] == 20
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 20
    assert usage.usage.prompt_tokens == reference.stats.prompt_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_equals_grpc_generate(server, stream):
    reference = server.generate(prompt=PROMPT, max_new_tokens=16)
    if stream:
        chunks = list(server.client.completions.create(model=server.model, prompt=PROMPT, max_tokens=16, temperature=0, stream=True))
        text = "".join(chunk.choices[0].text for chunk in chunks)
        finish = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices[0].finish_reason]
    else:
        response = server.client.completions.create(model=server.model, prompt=PROMPT, max_tokens=16, temperature=0)
        text, finish = response.choices[0].text, [response.choices[0].finish_reason]
        assert response.usage.completion_tokens == 16
    assert text == reference.text
    assert finish == ["length"]


def test_completions_default_to_openais_sixteen_tokens(server):
    response = server.client.completions.create(model=server.model, prompt=PROMPT, temperature=0)
    assert response.usage.completion_tokens == 16


def test_a_stop_string_ends_the_text_before_it(server):
    words = server.generate(prompt=PROMPT, max_new_tokens=12).text.split()
    stop = words[5]  # a word of the greedy continuation (the first time it appears ends the text)
    reference = server.generate(prompt=PROMPT, max_new_tokens=12, stop=[stop])
    for stream in (False, True):
        if stream:
            chunks = list(
                server.client.completions.create(model=server.model, prompt=PROMPT, max_tokens=12, temperature=0, stop=stop, stream=True)
            )
            text = "".join(chunk.choices[0].text for chunk in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            response = server.client.completions.create(model=server.model, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
            text, finish = response.choices[0].text, response.choices[0].finish_reason
        assert text == reference.text
        assert stop not in text
        assert finish == "stop"


def test_a_seed_makes_sampling_repeatable_and_equal_to_grpcs(server):
    reference = server.generate(prompt=PROMPT, max_new_tokens=24, temperature=1.0, seed=7)
    texts = [
        server.client.completions.create(model=server.model, prompt=PROMPT, max_tokens=24, temperature=1.0, seed=7).choices[0].text
        for _ in range(2)
    ]
    assert texts == [reference.text] * 2


@pytest.mark.parametrize(
    "fields, error, param, says",
    [
        ({"n": 2}, openai.BadRequestError, "n", "n must be in [1, 1] (--max-choices, --max-queued), got 2"),
        ({"max_tokens": 0}, openai.BadRequestError, "max_tokens", "max_tokens 0 generates nothing; it is taken with echo: true"),
        ({"max_tokens": -1}, openai.BadRequestError, "max_tokens", "max_tokens must be in [1, 60000]"),
        ({"temperature": "hot"}, openai.BadRequestError, "temperature", "temperature must be a number"),
        ({"temperature": -1}, openai.BadRequestError, "temperature", "temperature must be a finite number >= 0"),
        ({"stop": ["t3"] * 17}, openai.BadRequestError, "stop", "stop takes at most 16 strings"),
        ({"model": "gpt-4o"}, openai.NotFoundError, "model", "GET /v1/models lists"),
        ({"best_of": 3}, openai.BadRequestError, "best_of", "best_of is not supported here"),
        ({"frequency_penalty": 2.5}, openai.BadRequestError, "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
        ({"logit_bias": {"64": 1}}, openai.BadRequestError, "logit_bias", "outside the vocabulary"),
        ({"logprobs": 21}, openai.BadRequestError, "logprobs", "logprobs must be in [0, 20]"),
        ({"extra_body": {"guided_json": {}}}, openai.BadRequestError, "guided_json", 'unknown field "guided_json"'),
    ],
    ids=[
        "n",
        "max_tokens-0",
        "max_tokens-negative",
        "temperature-type",
        "temperature-range",
        "stop",
        "model",
        "best_of",
        "penalty",
        "logit_bias",
        "logprobs",
        "unknown-field",
    ],
)
def test_bad_requests_raise_the_sdks_typed_errors(server, fields, error, param, says):
    request = {"model": server.model, "prompt": PROMPT, "max_tokens": 4} | fields
    with pytest.raises(error) as raised:
        server.client.completions.create(**request)
    assert raised.value.param == param
    assert says in raised.value.message


def test_penalties_bias_and_min_tokens_through_the_sdk_equal_grpcs(server):
    """The same fields by both transports give the same tokens, and they change the output."""
    shaping = {"presence_penalty": 0.8, "frequency_penalty": 0.5, "logit_bias": {"9": -100, "20": 4}}
    reference = server.generate(
        prompt=PROMPT,
        max_new_tokens=16,
        presence_penalty=0.8,
        frequency_penalty=0.5,
        repetition_penalty=1.2,
        logit_bias={9: -100, 20: 4},
        min_tokens=16,
    )
    response = server.client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=16, temperature=0, **shaping, extra_body={"repetition_penalty": 1.2, "min_tokens": 16}
    )
    assert response.choices[0].text == reference.text and response.usage.completion_tokens == len(reference.token_ids) == 16
    assert 9 not in reference.token_ids
    assert reference.text != server.generate(prompt=PROMPT, max_new_tokens=16).text


def test_logprobs_through_the_sdk_match_grpcs(server):
    reference = server.generate(prompt=PROMPT, chat=True, max_new_tokens=10, logprobs=2)
    assert [entry.token_id for entry in reference.logprobs] == list(reference.token_ids)
    response = server.client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": PROMPT}], max_tokens=10, temperature=0, logprobs=True, top_logprobs=2
    )
    content = response.choices[0].logprobs.content
    assert "".join(entry.token for entry in content) == response.choices[0].message.content == reference.text
    assert [entry.logprob for entry in content] == pytest.approx([entry.logprob for entry in reference.logprobs], abs=1e-5)
    for entry, grpc_entry in zip(content, reference.logprobs):
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert [top.logprob for top in entry.top_logprobs] == pytest.approx([top.logprob for top in grpc_entry.top], abs=1e-5)
        assert entry.logprob <= 0
    legacy = server.client.completions.create(model=server.model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1)
    assert "".join(legacy.choices[0].logprobs.tokens) == legacy.choices[0].text


def test_chat_refuses_malformed_messages(server):
    with pytest.raises(openai.BadRequestError) as raised:
        server.client.chat.completions.create(model=server.model, messages=[{"role": "wizard", "content": "t5"}], max_tokens=4)
    assert raised.value.param == "messages" and "needs a role" in raised.value.message


@pytest.mark.parametrize(
    "method, path, body, status",
    [
        ("POST", "/v1/completions", b"{not json", 400),
        ("POST", "/v1/completions", b"[1, 2]", 400),
        ("POST", "/v1/completions", b'{"prompt": [5], "temperature": 1' + b"0" * 400 + b"}", 400),  # an int no float holds
        ("GET", "/v1/nothing", None, 404),
        ("GET", "/v1/completions", None, 405),
    ],
    ids=["not-json", "not-an-object", "huge-temperature", "no-route", "wrong-method"],
)
def test_protocol_errors_have_openais_error_shape(server, method, path, body, status):
    response = httpx.request(method, server.base + path, content=body, headers={"content-type": "application/json"}, timeout=10)
    assert response.status_code == status
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_curl_receives_server_sent_events_ending_with_done(server):
    body = json.dumps({"model": server.model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True})
    output = subprocess.run(
        ["curl", "-sSN", "-H", "Content-Type: application/json", "-d", body, server.base + "/v1/completions"],
        capture_output=True,
        text=True,
        timeout=CALL_TIMEOUT_S,
        check=True,
    ).stdout
    events = [line.removeprefix("data: ") for line in output.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert all(chunk["object"] == "text_completion" for chunk in chunks)
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == server.generate(prompt=PROMPT, max_new_tokens=8).text


def long_stream(server) -> tuple[httpx.Client, httpx.Response, object, dict]:
    """A streamed request that decodes for minutes, opened and read up to its first token.
    Returns its line iterator too (dropping that would close the connection, which cancels
    the request), and its first chunk."""
    client = httpx.Client(timeout=CALL_TIMEOUT_S)
    body = {"model": server.model, "prompt": CYCLING_PROMPT_IDS, "max_tokens": LONG_RUNNING_TOKENS, "temperature": 0, "stream": True}
    response = client.send(client.build_request("POST", server.base + "/v1/completions", json=body), stream=True)
    assert response.status_code == 200
    lines = response.iter_lines()
    while not (line := next(lines)).startswith("data: "):
        pass
    return client, response, lines, json.loads(line.removeprefix("data: "))


def probe(server) -> str:
    """A short request that can only complete once the one batch slot is free."""
    client = server.client.with_options(timeout=PROBE_TIMEOUT_S)
    return client.completions.create(model=server.model, prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text


def test_a_client_that_disconnects_mid_stream_frees_its_slot_and_the_log_says_so_in_one_line(server):
    before = len(server.process.log().splitlines())
    client, response, _, first = long_stream(server)
    response.close()
    client.close()
    assert probe(server) == server.generate(prompt=PROMPT, max_new_tokens=4).text
    logged = server.process.log().splitlines()[before:]
    [line] = [line for line in logged if "disconnected" in line]
    assert f"({first['id']})" in line  # names the request the client knew
    assert "INFO" in line and "request http-" in line and "before its answer ended; cancelled" in line
    assert not [line for line in logged if "Traceback" in line or "ERROR" in line], "\n".join(logged)


def test_a_full_queue_raises_rate_limit_error(server):
    held = [long_stream(server)]  # in the slot
    try:
        client = httpx.Client(timeout=CALL_TIMEOUT_S)
        body = {"model": server.model, "prompt": CYCLING_PROMPT_IDS, "max_tokens": LONG_RUNNING_TOKENS, "temperature": 0, "stream": True}
        queued = client.send(client.build_request("POST", server.base + "/v1/completions", json=body), stream=True)
        held.append((client, queued, None, None))  # in the queue place: its headers came, its first token never will
        with pytest.raises(openai.RateLimitError) as raised:
            server.client.completions.create(model=server.model, prompt=PROMPT, max_tokens=4)
        assert "1 queued (limit 1)" in raised.value.message
    finally:
        for client, response, *_ in held:
            response.close()
            client.close()
    assert probe(server)


@pytest.mark.slow
def test_the_default_model_answers_the_openai_client_as_grpc_does():
    """Once with the real model: a greedy chat completion, whole and streamed, is gRPC's answer token for token."""
    verifier = HttpVerifier(DEFAULT_MODEL)
    try:
        question = "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog."
        reference = verifier.generate(prompt=question, chat=True, max_new_tokens=32)
        messages = [{"role": "user", "content": question}]
        response = verifier.client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=32, temperature=0)
        assert response.choices[0].message.content == reference.text
        assert response.usage.completion_tokens == len(reference.token_ids)
        chunks = list(
            verifier.client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=32, temperature=0, stream=True)
        )
        tokens = [token for chunk in chunks if chunk.choices for token in chunk.model_extra.get("specdec", {}).get("token_ids", [])]
        assert tokens == list(reference.token_ids)
        sampled = verifier.client.chat.completions.create(
            model=DEFAULT_MODEL, messages=messages, max_tokens=16, temperature=1.0, seed=3, n=2, logprobs=True
        )
        assert [choice.index for choice in sampled.choices] == [0, 1]
        for index, choice in enumerate(sampled.choices):
            single = verifier.generate(prompt=question, chat=True, max_new_tokens=16, temperature=1.0, seed=3 + index)
            assert choice.message.content == single.text
            assert "".join(entry.token for entry in choice.logprobs.content) == single.text
    finally:
        verifier.process.stop()


def test_a_number_too_large_for_a_float_fails_only_its_own_request(server):
    body = b'{"prompt": [5], "max_tokens": 2, "temperature": 1' + b"0" * 400 + b"}"
    response = httpx.post(server.base + "/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=10)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "temperature"
    assert probe(server)  # the server goes on


def test_a_chat_body_over_the_http_limit_is_refused_413_through_the_openai_client(server):
    """7 MiB of chat text: refused from its Content-Length (--max-http-body-bytes, 1 MiB), never parsed or tokenized."""
    with pytest.raises(openai.APIStatusError) as raised:
        server.client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "t5 " * ((7 << 20) // 3)}])
    assert raised.value.status_code == 413
    assert raised.value.code == "body_too_large" and "--max-http-body-bytes" in raised.value.message
    assert probe(server)


def test_the_start_up_log_says_no_api_keys_are_required(server):
    assert "no API keys configured: /v1 and gRPC Generate/GenerateStream are open" in server.process.log()


def test_langchains_chat_openai_gets_grpcs_answer_and_a_named_refusal_for_tools(server):
    """Once through LangChain, as agent frameworks call the API: the answer and its
    log-probabilities are gRPC's; tools are refused by name instead of ignored."""
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=server.model, base_url=server.base + "/v1", api_key="not-checked", temperature=0, max_tokens=12, max_retries=0)
    reference = server.generate(prompt=PROMPT, chat=True, max_new_tokens=12, logprobs=0)
    answer = chat.bind(logprobs=True).invoke([("user", PROMPT)])
    assert answer.content == reference.text
    content = answer.response_metadata["logprobs"]["content"]
    assert [entry["logprob"] for entry in content] == pytest.approx([entry.logprob for entry in reference.logprobs], abs=1e-5)
    tool = {
        "type": "function",
        "function": {"name": "lookup", "description": "look up", "parameters": {"type": "object", "properties": {}}},
    }
    with pytest.raises(openai.BadRequestError) as raised:
        chat.bind_tools([tool], tool_choice="required").invoke([("user", PROMPT)])
    # LangChain sends tool_choice before tools; the first refused field is the one named.
    assert raised.value.param in ("tools", "tool_choice") and "tool calling is not supported" in raised.value.message


def test_sigterm_exits_without_waiting_on_idle_connections_or_health_watches(chat_model_dir):
    """Nothing running: an open health Watch, an idle keep-alive HTTP connection and an idle
    gRPC channel do not hold the exit for the grace period (600 s here; the wait allows 120)."""
    verifier = HttpVerifier(chat_model_dir, "--grace-seconds", "600")
    try:
        watch = health_pb2_grpc.HealthStub(verifier.process.channel).Watch(health_pb2.HealthCheckRequest(service=""))
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        idle = httpx.Client(timeout=CALL_TIMEOUT_S)
        assert idle.get(verifier.base + "/health").status_code == 200  # its connection stays open
        assert verifier.generate(prompt=PROMPT, max_new_tokens=2).token_ids
        verifier.process.process.send_signal(signal.SIGTERM)
        assert verifier.process.process.wait(timeout=120) == 0
        assert "stopped cleanly" in verifier.process.log()
        idle.close()
    finally:
        verifier.process.stop()
