"""The verifier as a real process: exact outputs over gRPC, concurrency, streaming,
a drafter that dies or was never there, cancellation, deadlines, overload, bad
input, a stock client, graceful shutdown and start-up health.

Most tests run the tiny seeded Llama of conftest (64-token vocabulary, ~1 ms a
token), saved to disk and served with ``--model DIR --no-calibrate``; only
equality with transformers' ``generate`` uses the real default model. The
tiny model's greedy outputs fall into short cycles that never reach its EOS
token, so a request with a large ``max_new_tokens`` runs for a minute: long
enough to be cancelled, time out or hold a batch slot on purpose.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx2 as httpx
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import AutoTokenizer

from specdec.v1 import drafter_pb2, drafter_pb2_grpc
from specdec.v1 import verifier_pb2 as pb
from specdec.v1 import verifier_pb2_grpc as rpc
from specdec.vocabulary import tokenizer_fingerprint
from verifier_service.core.engine import reference_greedy
from verifier_service.core.model_loading import chat_prompt_ids

from processes import ServiceProcess, free_port, running

SERVICE = "specdec.v1.Verifier"
TINY_STARTUP_S = 120  # guards against a hang, not a speed requirement
REAL_STARTUP_S = 600  # the first load converts the GGUF checkpoint (once per cache folder)
CALL_TIMEOUT_S = 120  # every call that should complete gets a deadline this long
# Context of the "long" copy of the tiny model: requests of tens of thousands
# of tokens, which run for a minute and are cancelled long before they end.
LONG_RUNNING_TOKENS = 60_000
MAX_NEW_TOKENS_LIMIT = 400  # the shared tiny server's --max-new-tokens (below its 512-token context)
# Prompts whose greedy continuations cycle without EOS (checked by the tests that rely on it).
PROMPTS = [
    [5, 9, 14, 20],
    [7, 33, 21, 40, 12],
    [11, 22, 33, 44],
    [50, 3, 17, 29, 42, 8],
    [2, 4, 6, 8],
    [60, 61, 62, 63],
    [13, 27, 39],
    [31, 30, 29, 28, 27, 26],
]
LONG_PROMPT = PROMPTS[0]


# Models on disk (tiny_model_dir, and long_tiny_model_dir) come from tests/e2e/conftest.py.
LONG_CONTEXT = 1 << 16  # long_tiny_model_dir's


@pytest.fixture(scope="session")
def expected(tiny_model):
    """Plain greedy decoding of the tiny model, by full recomputation in this process."""
    cache = {}
    eos = frozenset({tiny_model.config.eos_token_id})

    def greedy(prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt), max_new_tokens)
        if key not in cache:
            cache[key] = reference_greedy(tiny_model, prompt, max_new_tokens, eos)
        return cache[key]

    return greedy


# -- processes ---------------------------------------------------------------------------


# Several services run at once here: each serves its metrics (where it has
# them) on a free port rather than the fixed default. Set through the
# environment, which a service without metrics ignores.
SERVICE_ENV = {"SPECDEC_VERIFIER_METRICS_PORT": "0", "SPECDEC_DRAFTER_METRICS_PORT": "0"}


class Verifier(ServiceProcess):
    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        super().__init__("verifier_service", "--port", "0", *args, env={**os.environ, **SERVICE_ENV, **(env or {})})
        self.stub = rpc.VerifierStub(self.channel)


def start_verifier(*args: str, startup_s: float = TINY_STARTUP_S) -> Verifier:
    verifier = Verifier(*args)
    try:
        verifier.wait_until_serving(SERVICE, startup_s)
    except BaseException:
        verifier.stop()
        raise
    return verifier


class Drafter(ServiceProcess):
    def __init__(self, db: Path, port: int = 0) -> None:
        super().__init__("drafter_service", "--port", str(port), "--db", str(db), env={**os.environ, **SERVICE_ENV})
        self.stub = drafter_pb2_grpc.DrafterStub(self.channel)
        try:
            self.wait_until_serving("specdec.v1.Drafter", TINY_STARTUP_S)
        except BaseException:
            self.stop()
            raise

    def stats(self) -> drafter_pb2.StatsResponse:
        return self.stub.Stats(drafter_pb2.StatsRequest(), timeout=10)


# A loaded test machine must not turn drafts off: the default 0.1 s Propose
# deadline is tuned for production, where a missed draft only costs speed.
DRAFTER_TIMEOUT = ("--drafter-timeout-seconds", "5")


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory, tiny_model_dir):
    """One tiny verifier with a drafter, shared by the tests that leave it as they found it."""
    drafter = Drafter(tmp_path_factory.mktemp("tiny-drafter-db"))
    try:
        verifier = start_verifier(
            "--model",
            str(tiny_model_dir),
            "--no-calibrate",
            "--drafter",
            drafter.address,
            *DRAFTER_TIMEOUT,
            "--max-new-tokens",
            str(MAX_NEW_TOKENS_LIMIT),
        )
        try:
            yield verifier
        finally:
            verifier.stop()
    finally:
        drafter.stop()


@pytest.fixture(scope="module")
def single_slot_server(long_tiny_model_dir):
    """One batch slot and one queue place: a leaked slot blocks every later request."""
    verifier = start_verifier(
        "--model",
        str(long_tiny_model_dir),
        "--no-calibrate",
        "--max-batch-size",
        "1",
        "--max-queued",
        "1",
        "--max-new-tokens",
        str(LONG_RUNNING_TOKENS),
        "--max-sequence-tokens",
        str(LONG_CONTEXT),
    )
    try:
        yield verifier
    finally:
        verifier.stop()


# -- requests ------------------------------------------------------------------------------


def request(prompt_ids: list[int], max_new_tokens: int, k: int | None = None, **fields) -> pb.GenerateRequest:
    """A greedy request; ``k`` None leaves num_speculative_tokens unset (adaptive)."""
    if k is not None:
        fields["num_speculative_tokens"] = k
    return pb.GenerateRequest(prompt_token_ids=prompt_ids, max_new_tokens=max_new_tokens, **fields)


def generate(server: Verifier, generation: pb.GenerateRequest, timeout: float = CALL_TIMEOUT_S) -> pb.GenerateResponse:
    return server.stub.Generate(generation, timeout=timeout)


def stream_to_end(server: Verifier, generation: pb.GenerateRequest) -> list[pb.GenerateChunk]:
    return list(server.stub.GenerateStream(generation, timeout=CALL_TIMEOUT_S))


def assert_answers_correctly(server: Verifier, expected, prompt=PROMPTS[1], max_new_tokens=12) -> None:
    """The server completes a fresh request with the right tokens (a deadline guards against a hang).

    Cancels reach the server asynchronously, so right after cancelling calls
    the queue may still be full for a moment: RESOURCE_EXHAUSTED is retried,
    as its message tells clients to.
    """
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while True:
        try:
            response = generate(server, request(prompt, max_new_tokens, k=4))
            break
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    assert list(response.token_ids) == expected(prompt, max_new_tokens)
    assert response.finish_reason == pb.FINISH_REASON_LENGTH


class StreamReader:
    """Reads one stream on a thread; ``first_chunk`` is set once a chunk has arrived (or the call ended)."""

    def __init__(self, server: Verifier, generation: pb.GenerateRequest) -> None:
        self.call = server.stub.GenerateStream(generation, timeout=CALL_TIMEOUT_S)
        self.chunks: list[pb.GenerateChunk] = []
        self.error: grpc.RpcError | None = None
        self.first_chunk = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for chunk in self.call:
                self.chunks.append(chunk)
                self.first_chunk.set()
        except grpc.RpcError as error:
            self.error = error
        finally:
            self.first_chunk.set()

    def result(self) -> tuple[list[int], int]:
        self.thread.join(CALL_TIMEOUT_S)
        assert not self.thread.is_alive(), "stream did not end"
        if self.error is not None:
            raise self.error
        return [t for chunk in self.chunks for t in chunk.token_ids], self.chunks[-1].finish_reason


# -- 1. exact outputs on the real model ----------------------------------------------------

REAL_MAX_NEW_TOKENS = 48
GROUNDED_PROMPT = (
    "Repeat the following passage word for word, and nothing else:\n\n"
    "The lighthouse keeper climbed the ninety-nine steps every evening, lit the great lamp, "
    "and watched the fishing boats come home through the narrow channel between the rocks."
)
REAL_PROMPTS = ["What is the capital of France?", "Write a haiku about autumn.", GROUNDED_PROMPT]


@contextlib.contextmanager
def real_verifier(db: Path, *args: str) -> Iterator[Verifier]:
    drafter = Drafter(db)
    try:
        verifier = start_verifier("--drafter", drafter.address, *DRAFTER_TIMEOUT, *args, startup_s=REAL_STARTUP_S)
        try:
            yield verifier
        finally:
            verifier.stop()
    finally:
        drafter.stop()


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    """float32: transformers' own arithmetic, so its output is transformers' token for token."""
    with real_verifier(tmp_path_factory.mktemp("real-drafter-db"), "--dtype", "float32") as verifier:
        yield verifier


def test_greedy_outputs_equal_transformers_generate_on_the_real_model(real_server, real_model):
    model, tokenizer = real_model.model, real_model.tokenizer
    references = {}
    for prompt in REAL_PROMPTS:
        ids = chat_prompt_ids(tokenizer, prompt)
        reference = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=REAL_MAX_NEW_TOKENS,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )[0, len(ids) :].tolist()
        references[prompt] = reference
        # Adaptive K (num_speculative_tokens unset), the text prompt through the chat template.
        response = generate(real_server, pb.GenerateRequest(prompt=prompt, chat=True, max_new_tokens=REAL_MAX_NEW_TOKENS))
        assert list(response.token_ids) == reference, prompt
        assert response.stats.prompt_tokens == len(ids)
        assert response.text == tokenizer.decode(reference, skip_special_tokens=True)
    # Copying the passage: drafts from the prompt are verified and kept. Asked
    # with a fixed K, since adaptive K may rightly verify no drafts at all when
    # the start-up calibration finds wide steps dear on this (shared) CPU.
    grounded = generate(
        real_server,
        pb.GenerateRequest(
            prompt=GROUNDED_PROMPT,
            chat=True,
            max_new_tokens=REAL_MAX_NEW_TOKENS,
            num_speculative_tokens=4,
        ),
    )
    assert list(grounded.token_ids) == references[GROUNDED_PROMPT]
    assert grounded.stats.accepted_tokens > 0, grounded.stats


def test_in_the_form_the_defaults_choose_speculative_output_is_plain_output_batched(tmp_path):
    """Whatever form the start-up measurement picks on this machine (bfloat16 or int4 where
    they are fastest), adaptive and fixed-K speculation, batched together, give plain
    decoding's tokens in that form."""
    with real_verifier(tmp_path / "db") as verifier:
        requests = [
            pb.GenerateRequest(prompt=prompt, chat=True, max_new_tokens=REAL_MAX_NEW_TOKENS, **k)
            for prompt in REAL_PROMPTS
            for k in ({"num_speculative_tokens": 0}, {}, {"num_speculative_tokens": 4})
        ]
        with ThreadPoolExecutor(len(requests)) as pool:
            answers = list(pool.map(lambda r: generate(verifier, r), requests))
    for index, prompt in enumerate(REAL_PROMPTS):
        plain, adaptive, fixed = answers[3 * index : 3 * index + 3]
        assert list(adaptive.token_ids) == list(fixed.token_ids) == list(plain.token_ids), prompt
    assert sum(answer.stats.accepted_tokens for answer in answers) > 0


# -- 2. concurrency -------------------------------------------------------------------------

CONCURRENT_K = [None, 4, 0, None, 4, 0, None, 4]


def test_concurrent_requests_get_the_same_tokens_as_one_by_one(tiny_server, expected):
    requests = [request(prompt, 24, k) for prompt, k in zip(PROMPTS, CONCURRENT_K)]
    one_by_one = [generate(tiny_server, r) for r in requests]
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(lambda r: generate(tiny_server, r), requests))
    for prompt, alone, batched in zip(PROMPTS, one_by_one, together):
        assert list(batched.token_ids) == list(alone.token_ids) == expected(prompt, 24), prompt
        assert batched.finish_reason == alone.finish_reason == pb.FINISH_REASON_LENGTH
    # The cycling outputs are drafted from their own context: speculation really ran.
    assert sum(r.stats.accepted_tokens for r in one_by_one + together) > 0
    assert all(r.stats.draft_tokens == 0 for r, k in zip(one_by_one + together, CONCURRENT_K * 2) if k == 0)


# -- 3. streaming ---------------------------------------------------------------------------


STREAM_PROMPT = PROMPTS[5]  # its output wanders for 20 tokens before it cycles


def stop_string_case(expected, tokenizer):
    """A stop string taken from the middle of a known output, and the text that must come back."""
    tokens = expected(STREAM_PROMPT, 40)
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    stop = tokenizer.decode(tokens[10:12])
    return stop, text[: text.find(stop)]


@pytest.mark.parametrize("case", ["token ids, K=4", "text prompt, adaptive K", "stop string"])
def test_stream_chunks_join_to_the_unary_result(tiny_server, expected, tiny_tokenizer, case):
    stop_text = None
    if case == "token ids, K=4":
        generation = request(STREAM_PROMPT, 40, k=4)
    elif case == "text prompt, adaptive K":
        generation = pb.GenerateRequest(prompt=tiny_tokenizer.decode(STREAM_PROMPT), max_new_tokens=40)
    else:
        stop, stop_text = stop_string_case(expected, tiny_tokenizer)
        generation = request(STREAM_PROMPT, 40, k=4, stop=[stop])
    unary = generate(tiny_server, generation)
    chunks = stream_to_end(tiny_server, generation)

    assert "".join(chunk.text for chunk in chunks) == unary.text
    assert [t for chunk in chunks for t in chunk.token_ids] == list(unary.token_ids)
    # Each token's source: the target's own, or an accepted draft (the drafter says which table).
    assert all(len(chunk.token_sources) == len(chunk.token_ids) for chunk in chunks)
    sources = [source for chunk in chunks for source in chunk.token_sources]
    assert set(sources) <= {pb.TOKEN_SOURCE_TARGET, pb.TOKEN_SOURCE_CONTEXT, pb.TOKEN_SOURCE_GLOBAL}
    if stop_text is None:  # every forward pass adds one token of the target's own (a stop string may cut the last)
        assert sources.count(pb.TOKEN_SOURCE_TARGET) == chunks[-1].stats.target_forward_passes
    *middle, last = chunks
    assert all(c.finish_reason == pb.FINISH_REASON_UNSPECIFIED and not c.HasField("stats") for c in middle)
    assert last.finish_reason == unary.finish_reason
    assert last.HasField("stats")
    assert last.stats.generated_tokens == len(unary.token_ids)
    assert last.stats.prompt_tokens == len(STREAM_PROMPT)
    if stop_text is None:
        assert unary.finish_reason == pb.FINISH_REASON_LENGTH
        assert list(unary.token_ids) == expected(STREAM_PROMPT, 40)
    else:
        # The text ends before the stop string; the tokens that spelled it were generated.
        assert unary.finish_reason == pb.FINISH_REASON_STOP
        assert unary.text == stop_text
        assert list(unary.token_ids) == expected(STREAM_PROMPT, 40)[: len(unary.token_ids)]


# -- 4. the drafter dies mid-run and comes back ---------------------------------------------

# Prompt and answer share no 2-gram, so drafts for this request can only come
# from the drafter's global table, never from the request's own context.
REPEATED_PROMPT = [54, 57, 23, 17]
REPEATED_TOKENS = 16
KILL_PROMPTS = PROMPTS[:4]
KILL_K = [None, 4, 4, None]
KILL_TOKENS = 1000


def test_drafter_killed_mid_run_and_restarted_on_the_same_port(tmp_path, long_tiny_model_dir, expected):
    db, port = tmp_path / "drafter-db", free_port()
    drafter = Drafter(db, port)
    verifier = None
    try:
        verifier = start_verifier(
            "--model",
            str(long_tiny_model_dir),
            "--no-calibrate",
            "--drafter",
            f"127.0.0.1:{port}",
            *DRAFTER_TIMEOUT,
            "--max-new-tokens",
            str(KILL_TOKENS),
        )
        repeated = request(REPEATED_PROMPT, REPEATED_TOKENS, k=4)
        first = generate(verifier, repeated)
        assert list(first.token_ids) == expected(REPEATED_PROMPT, REPEATED_TOKENS)
        assert first.stats.draft_tokens == 0  # an empty table, a context without repeats: nothing to draft
        # The finished sequence is observed in the background; wait until the drafter has it.
        observed = len(REPEATED_PROMPT) + REPEATED_TOKENS
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while drafter.stats().observed_tokens < observed:
            assert time.monotonic() < deadline, "the verifier never observed the finished request"
            time.sleep(0.05)

        # Plain decoding (K=0 never calls the drafter) is the reference.
        with ThreadPoolExecutor(len(KILL_PROMPTS)) as pool:
            plain = list(pool.map(lambda p: generate(verifier, request(p, KILL_TOKENS, k=0)), KILL_PROMPTS))
        assert all(r.finish_reason == pb.FINISH_REASON_LENGTH for r in plain)

        readers = [StreamReader(verifier, request(p, KILL_TOKENS, k)) for p, k in zip(KILL_PROMPTS, KILL_K)]
        for reader in readers:
            assert reader.first_chunk.wait(CALL_TIMEOUT_S)
        drafter.kill()
        drafter = Drafter(db, port)

        # What the drafter acknowledged before the kill is still there: the
        # repeated request's prompt and first 4 answer tokens draft the next 8.
        answer = list(first.token_ids)
        vocabulary = tokenizer_fingerprint(AutoTokenizer.from_pretrained(long_tiny_model_dir))
        probe = drafter_pb2.SequenceUpdate(session_id="probe", new_tokens=REPEATED_PROMPT + answer[:4], open=True, num_draft_tokens=8)
        draft = drafter.stub.Propose(drafter_pb2.ProposeRequest(vocabulary=vocabulary, sequences=[probe]), timeout=10).drafts[0]
        assert list(draft.tokens) == answer[4:12]
        assert list(draft.sources) == [drafter_pb2.DRAFT_SOURCE_GLOBAL] * 8

        for reader, reference in zip(readers, plain):
            tokens, finish_reason = reader.result()
            assert tokens == list(reference.token_ids)
            assert finish_reason == pb.FINISH_REASON_LENGTH

        # Once the verifier has reconnected, the repeated request is drafted from
        # the table the drafter kept through the kill.
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while True:
            again = generate(verifier, repeated)
            assert list(again.token_ids) == answer
            if again.stats.accepted_tokens > 0:
                break
            assert time.monotonic() < deadline, "the restarted drafter's table was never used"
            time.sleep(0.2)
    finally:
        if verifier is not None:
            verifier.stop()
        drafter.stop()


# -- 5. no drafter at the address -------------------------------------------------------------


def test_a_drafter_address_where_nothing_listens_means_plain_decoding(tiny_model_dir, expected):
    nowhere = f"127.0.0.1:{free_port()}"
    verifier = start_verifier("--model", str(tiny_model_dir), "--no-calibrate", "--drafter", nowhere)
    try:
        for prompt, k in [(PROMPTS[0], None), (PROMPTS[1], 4), (PROMPTS[2], 8)]:
            response = generate(verifier, request(prompt, 32, k))
            assert list(response.token_ids) == expected(prompt, 32)
            assert response.finish_reason == pb.FINISH_REASON_LENGTH
            assert response.stats.draft_tokens == 0
    finally:
        verifier.stop()


# -- 6-8. cancellation, deadlines and a full queue on one batch slot ----------------------------


def long_request() -> pb.GenerateRequest:
    return request(LONG_PROMPT, LONG_RUNNING_TOKENS, k=0)


def test_cancelled_stream_frees_its_slot(single_slot_server, expected):
    call = single_slot_server.stub.GenerateStream(long_request(), timeout=CALL_TIMEOUT_S)
    first = next(call)
    assert list(first.token_ids) == expected(LONG_PROMPT, len(first.token_ids))
    call.cancel()
    with pytest.raises(grpc.RpcError) as raised:
        list(call)
    assert raised.value.code() == grpc.StatusCode.CANCELLED
    assert raised.value.details() == "Locally cancelled by application!"
    # One slot: this completes only if the cancelled sequence left the batch.
    assert_answers_correctly(single_slot_server, expected)


def test_deadline_exceeded_frees_its_slot(single_slot_server, expected):
    with pytest.raises(grpc.RpcError) as raised:
        generate(single_slot_server, long_request(), timeout=1.0)
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert raised.value.details() == "Deadline Exceeded"
    assert_answers_correctly(single_slot_server, expected)


def first_done(calls, timeout_s: float):
    """The first of ``calls`` to end (by its done-callback: no polling)."""
    ended = threading.Event()
    for call in calls:
        call.add_done_callback(lambda _call: ended.set())
    assert ended.wait(timeout_s), "no call ended"
    return next(call for call in calls if call.done())


def fill_slot_and_queue(stub, calls: list):
    """One long request in the slot, one in the queue place; returns (queued, refused).

    Both waiting requests are sent the same way since which of them takes the
    queue place depends on arrival order; exactly one finds the queue full.
    Every call is appended to ``calls`` for the caller to cancel.
    """
    calls.append(stub.GenerateStream(long_request(), timeout=CALL_TIMEOUT_S))
    next(calls[0])  # it holds the slot now; the queue is empty
    waiting = [stub.GenerateStream(long_request(), timeout=CALL_TIMEOUT_S) for _ in range(2)]
    calls += waiting
    refused = first_done(waiting, CALL_TIMEOUT_S)
    return waiting[1 - waiting.index(refused)], refused


def test_full_queue_answers_resource_exhausted(single_slot_server, expected):
    calls = []
    try:
        queued, refused = fill_slot_and_queue(single_slot_server.stub, calls)
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "1 queued (limit 1)" in refused.details()
        assert not queued.done()
    finally:
        for call in calls:
            call.cancel()
    assert_answers_correctly(single_slot_server, expected)


PROBE_DEADLINE_S = 3.0


def test_cancelling_a_queued_request_gives_its_queue_place_back(single_slot_server, expected):
    """A client that gave up while queued no longer waits, so it must not hold the queue place.

    Probes are unary calls with a short deadline: a probe that finds the queue
    full is refused at once (RESOURCE_EXHAUSTED); one that was queued behind
    the running request waits until its deadline passes (DEADLINE_EXCEEDED).
    """
    calls = []
    try:
        queued, _ = fill_slot_and_queue(single_slot_server.stub, calls)
        queued.cancel()
        # The server learns of the cancel asynchronously: probe until one is queued.
        probe = request(PROMPTS[1], 12, k=0)
        outcomes = []
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            with pytest.raises(grpc.RpcError) as raised:
                generate(single_slot_server, probe, timeout=PROBE_DEADLINE_S)
            outcomes.append(raised.value.code())
            if outcomes[-1] != grpc.StatusCode.RESOURCE_EXHAUSTED:
                break
            time.sleep(0.2)
        assert outcomes[-1] == grpc.StatusCode.DEADLINE_EXCEEDED, (
            f"the cancelled request still holds the only queue place: {len(outcomes)} probes, "
            f"last {outcomes[-1].name}: {raised.value.details()}"
        )
    finally:
        for call in calls:
            call.cancel()
    assert_answers_correctly(single_slot_server, expected)


# -- 9. bad input ----------------------------------------------------------------------------

INVALID = grpc.StatusCode.INVALID_ARGUMENT
BAD_INPUTS = [
    # (name, request fields, status, message fragment)
    (
        "prompt and prompt_token_ids",
        {"prompt": "t5 t6", "prompt_token_ids": [5, 6], "max_new_tokens": 4},
        INVALID,
        "set either prompt or prompt_token_ids, not both",
    ),
    ("empty prompt", {"max_new_tokens": 4}, INVALID, "prompt is empty: set prompt (text) or prompt_token_ids"),
    ("prompt of no tokens", {"prompt": "   ", "max_new_tokens": 4}, INVALID, "prompt is empty"),
    (
        "max_new_tokens 0",
        {"prompt_token_ids": [5, 6], "max_new_tokens": 0},
        INVALID,
        "max_new_tokens 0 generates nothing",
    ),
    (
        "max_new_tokens above the limit",
        {"prompt_token_ids": [5, 6], "max_new_tokens": MAX_NEW_TOKENS_LIMIT + 1},
        INVALID,
        f"max_new_tokens must be in [1, {MAX_NEW_TOKENS_LIMIT}] (the server's --max-new-tokens), got {MAX_NEW_TOKENS_LIMIT + 1}",
    ),
    (
        "temperature NaN",
        {"prompt_token_ids": [5, 6], "max_new_tokens": 4, "temperature": float("nan")},
        INVALID,
        "temperature must be a finite number >= 0 (below 1e-05 = greedy), got nan",
    ),
    (
        "temperature inf",
        {"prompt_token_ids": [5, 6], "max_new_tokens": 4, "temperature": float("inf")},
        INVALID,
        "temperature must be a finite number >= 0 (below 1e-05 = greedy), got inf",
    ),
    (
        "temperature -1",
        {"prompt_token_ids": [5, 6], "max_new_tokens": 4, "temperature": -1.0},
        INVALID,
        "temperature must be a finite number >= 0 (below 1e-05 = greedy), got -1.0",
    ),
    (
        "top_p NaN",
        {"prompt_token_ids": [5, 6], "max_new_tokens": 4, "top_p": float("nan")},
        INVALID,
        "top_p must be in [0, 1] (0 or 1 = off), got nan",
    ),
    (
        "top_p 1.5",
        {"prompt_token_ids": [5, 6], "max_new_tokens": 4, "top_p": 1.5},
        INVALID,
        "top_p must be in [0, 1] (0 or 1 = off), got 1.5",
    ),
    (
        "top_p -0.1",
        {"prompt_token_ids": [5, 6], "max_new_tokens": 4, "top_p": -0.1},
        INVALID,
        "top_p must be in [0, 1] (0 or 1 = off), got -0.1",
    ),  # float32: -0.10000000149...
    (
        "token id = vocabulary size",
        {"prompt_token_ids": [5, 64], "max_new_tokens": 4},
        INVALID,
        "token ids outside the vocabulary [0, 64): [64]",
    ),
    (
        "largest uint32 token id",
        {"prompt_token_ids": [5, 2**32 - 1], "max_new_tokens": 4},
        INVALID,
        "token ids outside the vocabulary [0, 64): [4294967295]",
    ),
    (
        "prompt past the context",
        {"prompt_token_ids": [5] * 500, "max_new_tokens": 20},
        INVALID,
        "prompt (500 tokens) + max_new_tokens (20) needs 520 cache positions; this server holds at most 512 per request",
    ),
    (
        "num_speculative_tokens 99",
        {"prompt_token_ids": [5, 6], "max_new_tokens": 4, "num_speculative_tokens": 99},
        INVALID,
        "num_speculative_tokens must be in [0, 16] (unset = adaptive), got 99",
    ),
    (
        "chat with token ids",
        {"prompt_token_ids": [5, 6], "chat": True, "max_new_tokens": 4},
        INVALID,
        "chat applies to a text prompt; prompt_token_ids are used as given",
    ),
    (
        "empty stop string",
        {"prompt_token_ids": [5, 6], "max_new_tokens": 4, "stop": ["t7", ""]},
        INVALID,
        "stop[1] is empty; stop strings must be non-empty",
    ),
    (
        "17 stop strings",
        {"prompt_token_ids": [5, 6], "max_new_tokens": 4, "stop": [f"t{i}" for i in range(17)]},
        INVALID,
        "stop takes at most 16 strings (--max-stop-strings), got 17",
    ),
    (
        "a 257-character stop string",
        {"prompt_token_ids": [5, 6], "max_new_tokens": 4, "stop": ["t7", "é" * 257]},
        INVALID,
        "stop[1] is 257 characters; at most 256 (--max-stop-string-length)",
    ),
]


@pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
@pytest.mark.parametrize("name, fields, code, fragment", BAD_INPUTS, ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_gets_a_clear_status_and_the_server_goes_on(tiny_server, expected, method, name, fields, code, fragment):
    bad = pb.GenerateRequest(**fields)
    with pytest.raises(grpc.RpcError) as raised:
        if method == "Generate":
            generate(tiny_server, bad)
        else:
            stream_to_end(tiny_server, bad)
    assert raised.value.code() == code
    assert fragment in raised.value.details()
    assert_answers_correctly(tiny_server, expected)


# -- 10. a stock client ------------------------------------------------------------------------


def test_a_stock_client_calls_generate_through_reflection(tiny_server):
    """grpcurl knows nothing of our stubs: it reads the schema from server reflection."""
    grpcurl = Path(sys.executable).parent / "grpcurl"
    fields = {"prompt_token_ids": PROMPTS[4], "max_new_tokens": 20, "num_speculative_tokens": 4}
    result = subprocess.run(
        [
            str(grpcurl),
            "-plaintext",
            "-max-time",
            str(CALL_TIMEOUT_S),
            "-d",
            json.dumps(fields),
            tiny_server.address,
            f"{SERVICE}/Generate",
        ],
        capture_output=True,
        text=True,
        timeout=CALL_TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    stub_answer = generate(tiny_server, pb.GenerateRequest(**fields))
    assert answer["token_ids"] == list(stub_answer.token_ids)
    assert answer["text"] == stub_answer.text
    assert answer["finish_reason"] == "FINISH_REASON_LENGTH"


# -- 11. graceful shutdown ------------------------------------------------------------------------

SHUTDOWN_TOKENS = 1000
GRACE_S = 120  # far longer than the request needs: the test is that it is allowed to finish


def test_sigterm_lets_the_running_request_finish_then_exits_zero(long_tiny_model_dir, expected):
    verifier = start_verifier(
        "--model",
        str(long_tiny_model_dir),
        "--no-calibrate",
        "--grace-seconds",
        str(GRACE_S),
        "--max-new-tokens",
        str(SHUTDOWN_TOKENS),
    )
    try:
        call = verifier.stub.GenerateStream(request(LONG_PROMPT, SHUTDOWN_TOKENS, k=0), timeout=CALL_TIMEOUT_S)
        chunks = [next(call)]  # running now
        verifier.process.send_signal(signal.SIGTERM)
        chunks += list(call)
        tokens = [t for chunk in chunks for t in chunk.token_ids]
        assert len(tokens) == SHUTDOWN_TOKENS
        assert tokens[:64] == expected(LONG_PROMPT, 64)
        assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert verifier.process.wait(timeout=GRACE_S + 30) == 0
        assert "stopped cleanly" in verifier.log()  # drained, not cut off at the grace period
    finally:
        verifier.stop()


# -- 12. start-up health -----------------------------------------------------------------------

# Holds load_model at a FIFO until the test writes to it, so the window in
# which the model is "still loading" is as long as the test needs, not a race.
LOAD_GATE_SITECUSTOMIZE = """
import os

_gate = os.environ.get("SPECDEC_TEST_LOAD_GATE")
if _gate:
    import verifier_service.core.model_loading as _loading

    _load_model = _loading.load_model

    def _gated_load_model(*args, **kwargs):
        with open(_gate) as gate:
            gate.read()
        return _load_model(*args, **kwargs)

    _loading.load_model = _gated_load_model
"""


def open_gate(fifo: Path, process: Verifier, timeout_s: float) -> None:
    """Write to the FIFO once the server has it open for reading (non-blocking: never hangs the test)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            descriptor = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError:  # ENXIO: no reader yet
            assert process.process.poll() is None, process.log()
            assert time.monotonic() < deadline, "the server never opened the load gate"
            time.sleep(0.05)
    os.write(descriptor, b"go")
    os.close(descriptor)


def test_health_is_not_serving_and_calls_unavailable_until_the_model_is_loaded(tmp_path, tiny_model_dir, expected):
    (tmp_path / "sitecustomize.py").write_text(LOAD_GATE_SITECUSTOMIZE)
    fifo = tmp_path / "load-gate"
    os.mkfifo(fifo)
    env = dict(
        os.environ,
        **SERVICE_ENV,
        SPECDEC_TEST_LOAD_GATE=str(fifo),
        PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])),
    )
    args = ("--port", "0", "--http-port", "0", "--model", str(tiny_model_dir), "--no-calibrate")
    with running("verifier_service", *args, env=env) as process:
        base = f"http://127.0.0.1:{process.announced_port('http')}"
        health = health_pb2_grpc.HealthStub(process.channel)
        stub = rpc.VerifierStub(process.channel)
        for service in ("", SERVICE):
            status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=CALL_TIMEOUT_S).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING, service
        for call in (stub.Generate, lambda r, timeout: list(stub.GenerateStream(r, timeout=timeout))):
            with pytest.raises(grpc.RpcError) as raised:
                call(request(PROMPTS[1], 12), timeout=CALL_TIMEOUT_S)
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
            assert raised.value.details() == "the model is still loading; retry when health reports SERVING"
        # The HTTP API says the same: 503 in OpenAI's error shape.
        loading = (
            ("GET", "/health", None),
            ("GET", "/v1/models", None),
            ("GET", f"/v1/models/{tiny_model_dir}", None),
            ("POST", "/v1/completions", {"prompt": [5, 6], "max_tokens": 2}),
            ("POST", "/tokenize", {"prompt": "t5"}),
        )
        for method, path, body in loading:
            answer = httpx.request(method, base + path, json=body, timeout=CALL_TIMEOUT_S)
            assert answer.status_code == 503, path
            assert answer.json()["error"]["code"] == "loading", path

        open_gate(fifo, process, TINY_STARTUP_S)
        process.wait_until_serving("", TINY_STARTUP_S)
        process.wait_until_serving(SERVICE, TINY_STARTUP_S)
        response = stub.Generate(request(PROMPTS[1], 12, k=4), timeout=CALL_TIMEOUT_S)
        assert list(response.token_ids) == expected(PROMPTS[1], 12)
        assert httpx.get(base + "/health", timeout=CALL_TIMEOUT_S).status_code == 200
        assert httpx.get(base + "/v1/models", timeout=CALL_TIMEOUT_S).json()["data"][0]["id"] == str(tiny_model_dir)
        assert process.terminate() == 0
