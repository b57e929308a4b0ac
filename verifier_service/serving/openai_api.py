"""An OpenAI-compatible HTTP API in front of the verifier's scheduler.

``POST /v1/chat/completions`` and ``POST /v1/completions`` (streaming as
server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``),
``GET /v1/models`` (and ``/v1/models/{id}``), ``GET /health``, and vLLM's
``POST /tokenize`` and ``POST /detokenize``, served by uvicorn on a thread of
its own beside the gRPC server. Requests go into the same ``Scheduler`` as
gRPC's, so HTTP and gRPC requests share batches, and through the same
validation (``SpeculativeEngine.validate``), spans and metrics.

What OpenAI's API says is followed where it has a rule: ``temperature``
defaults to 1 (sampling; 0 is greedy), ``/v1/completions``' ``max_tokens``
to 16, chat's to what the request's cache room and ``--max-new-tokens``
allow; ``n`` choices are sequences queued together. ``/v1/completions``
takes a list of prompts (strings or token-id lists): each is a sequence of
its own, ``n`` choices per prompt, prompt i's at indices i*n to i*n+n-1
(vLLM's order). With ``echo`` and ``logprobs`` a choice's log-probabilities
cover its prompt (the first token's null), scored in the prefill's own
passes, then its completion; ``max_tokens`` 0 with ``echo`` scores the prompt
and generates nothing (how lm-eval's ``local-completions`` scores
log-likelihoods). Penalties (presence,
frequency, repetition), ``logit_bias``, ``min_tokens`` and ``logprobs`` are
honoured by the engine, speculation included; log-probabilities are the
target's raw ones, before any penalty or temperature (vLLM's default). No
field is dropped without a word: the bodies are declared
(``openai_protocol``), a key the endpoint does not know is a 400 naming it,
and a known field this server does not honour (``tools``,
``response_format``, ...) is a 400 naming it
unless it holds its no-op value. Errors have OpenAI's shape, ``{"error": {"message",
"type", "param", "code"}}``: 400 naming the field in ``param``, 404 for
another model, 429 for a full queue, 503 while the model loads or the
server drains. Beyond OpenAI's fields, a request may set
``num_speculative_tokens`` (K; 0 decodes plainly, unset is adaptive) and
``top_k``; responses carry a ``specdec`` object (forward passes, drafted,
accepted, acceptance, tokens per pass), which OpenAI's clients keep as an
extra field, and each streamed chunk's ``specdec`` lists its tokens with
the text each added and where each came from (``sources``).

A client that disconnects frees its batch slot at the next step, as a
cancelled gRPC call does, and the log says so in one line naming the request.

Hostile callers: a request whose Host header is not one of the server's
names (``--allowed-hosts``; by default those of the address bound) is a 400
before any route (DNS rebinding); with API keys configured every ``/v1``
route needs ``Authorization: Bearer <key>`` (401 otherwise; ``/``, the live
view, and ``/health`` stay open); a caller has at most
``--max-requests-per-caller`` requests in flight, ``/tokenize`` and
``/detokenize`` included (429); a body not declared
``Content-Type: application/json`` is refused unread (415: a page on another
site can POST a form or plain text without a CORS preflight); a body over
``--max-http-body-bytes`` is refused from its Content-Length before a byte
of it is read (413), and prompt text over ``--max-prompt-chars`` before any
template or tokenizer runs (400). Texts (log-probabilities' take a tokenizer
decode per alternative per token) and answers' JSON are made on worker
threads, never on the event loop that serves every stream.
Every malformed body (any nesting depth, lone surrogates, invalid UTF-8,
wrong types) is a 400, and anything unexpected a 500, both in OpenAI's shape.
The server (``HttpServer``) caps open connections (``--max-http-connections``)
and gives a request's headers and its body deadlines of their own
(``--http-header-timeout-seconds``, ``--http-body-timeout-seconds``), which uvicorn lacks.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import importlib.metadata
import json
import logging
import re
import secrets
import socket
import threading
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, cast

import anyio
import h11
import uvicorn
from opentelemetry import propagate
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from specdec.serving import CERTIFICATE_CALLER, bearer
from specdec.settings import cannot_listen
from verifier_service.core.errors import InvalidRequest
from verifier_service.core.generation import FINISH_LENGTH, GenerationRequest
from verifier_service.core.model_loading import chat_ids
from verifier_service.core.processing import TokenLogprob
from verifier_service.core.rejection import SamplingParams
from verifier_service.core.text import IncrementalDecoder, IncrementalText
from verifier_service.serving.config import host_name
from verifier_service.serving.openai_protocol import (
    CHECK_LOGIT_BIAS_COUNT,
    ApiError,
    Body,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse,
)
from verifier_service.serving.openai_protocol import shown as _shown
from verifier_service.serving.scheduler import QueueFull, RequestHandle, ShuttingDown, TokenChunk, interleave
from verifier_service.serving.service import CHAT, TEXT_COMPLETION, RequestStats, TracedRequest, VerifierService

log = logging.getLogger(__name__)

VIEW = Path(__file__).parent.parent / "static" / "index.html"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
# The engine's field names (``InvalidRequest.field``) that OpenAI spells otherwise; the rest are the same.
OPENAI_FIELDS = {"max_new_tokens": "max_tokens", "prompt_ids": "prompt"}
OPENAI_CHAT_FIELDS = OPENAI_FIELDS | {"prompt_ids": "messages", "logprobs": "top_logprobs"}


def _or(value: Any, default: Any) -> Any:
    """A declared field's value, or ``default`` when the body left it out or sent null."""
    return default if value is None else value


def _text(value: str, where: str, param: str) -> str:
    """``value`` if it is Unicode text a tokenizer takes: JSON's escapes can spell a lone
    surrogate ("\\ud800"), which Python keeps in a str and tokenizers refuse."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        surrogate = ascii(value[error.start])
        raise ApiError(400, f"{where} holds a lone surrogate ({surrogate}) at character {error.start}: not text", param) from None
    return value


class OpenAIApi:
    """The routes, over a ``VerifierService`` (the gRPC front door's too: submitting and
    cancelling, readiness, spans, stats, API keys and the per-caller limit)."""

    def __init__(self, service: VerifierService, model_id: str, aliases: Sequence[str] = ()) -> None:
        self.service = service
        self.model_id = model_id  # what answers and /v1/models report
        self.model_names = frozenset((model_id, *aliases))  # what a request may name
        self.created = int(time.time())
        self.page = VIEW.read_text(encoding="utf-8")
        # Waiting on a request's tokens blocks a thread: one per request that may be running or queued.
        config = service.config
        self.limiter = anyio.CapacityLimiter(config.engine.max_batch_size + config.scheduler.max_queued + 8)
        self.app = Starlette(
            routes=[
                Route("/", self.view, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/version", self.version, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            ],
            middleware=[
                *self._cors(config.origins()),
                Middleware(_RequestIds),
                Middleware(_Hosts, allowed=config.hosts()),
                Middleware(_Unexpected),
                Middleware(_Callers, keys=service.keys),
            ],
            exception_handlers={
                ApiError: lambda request, error: error.response(),
                HTTPException: lambda request, error: ApiError(error.status_code, str(error.detail)).response(),
            },
        )

    @staticmethod
    def _cors(origins: list[str]) -> list[Middleware]:
        """Starlette's CORS middleware for --allowed-origins (none without): preflights answered,
        the headers a client sends (keys, X-Request-Id, tracing) allowed, X-Request-Id readable."""
        if not origins:
            return []
        return [
            Middleware(
                CORSMiddleware,
                allow_origins=origins,
                allow_methods=["GET", "POST"],
                allow_headers=["authorization", "content-type", REQUEST_ID_HEADER, "traceparent", "tracestate"],
                expose_headers=[REQUEST_ID_HEADER],
                max_age=600,
            )
        ]

    # -- routes -------------------------------------------------------------------

    async def metrics(self, request: Request) -> Response:
        """The service's Prometheus metrics (as on --metrics-port), so one port can be scraped."""
        return Response(generate_latest(self.service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def view(self, request: Request) -> Response:
        """The live view: one static page that streams a chat completion and colours each token by its source.

        Its Content-Security-Policy allows the page's own inline script and style sheet, by their SHA-256,
        and requests to this origin; nothing else (no injected script, inline style attribute or eval,
        no framing, no <base>, no plugin, no form posted elsewhere)."""

        def hashes(tag: str) -> str:
            bodies = re.findall(f"<{tag}>(.*?)</{tag}>", self.page, re.DOTALL)
            return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()}'" for body in bodies)

        policy = (
            f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; connect-src 'self'; "
            "base-uri 'none'; form-action 'none'; frame-ancestors 'none'; object-src 'none'"
        )
        headers = {"Content-Security-Policy": policy, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}
        return HTMLResponse(self.page, headers=headers)

    def _ready(self) -> None:
        """503 until the model can serve: /health, /v1/models and every request route agree
        with gRPC's health service (SERVING from the same moment)."""
        if not self.service.ready.is_set():
            raise ApiError(503, "the model is still loading; retry when GET /health answers 200", kind="server_error", code="loading")

    async def health(self, request: Request) -> Response:
        """200 once the model serves, with how it speculates: ``drafter`` is the drafter's address,
        or null with a ``warning`` when there is none (every step is then plain decoding)."""
        self._ready()
        drafter = self.service.config.drafter.target
        answer: dict[str, Any] = {"status": "ok", "drafter": drafter}
        if drafter is None and self.service.config.draft_head == "none":  # a draft head drafts on its own
            answer["warning"] = NO_DRAFTER_WARNING
        return JSONResponse(answer)

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": _VERSION})

    def _model(self, name: str) -> dict:
        # max_model_len: prompt and output tokens one request may hold (vLLM's name);
        # dtype, weights, threads and batch_invariant: the form it is served in (core.forms).
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "specdec",
            "root": self.service.config.model,
            "max_model_len": self.service.capacity,
            **self.service.precision,
        }

    async def models(self, request: Request) -> Response:
        """Every name the model answers to (--served-model-name), the reported one first."""
        self._ready()
        names = [self.model_id, *sorted(self.model_names - {self.model_id})]
        return JSONResponse({"object": "list", "data": [self._model(name) for name in names]})

    async def model(self, request: Request) -> Response:
        """``GET /v1/models/{id}``: the served model, or OpenAI's 404 for any other id."""
        self._ready()
        self._refuse_other_model(request.path_params["model"], _shown(request.path_params["model"]))
        return JSONResponse(self._model(request.path_params["model"]))

    def _refuse_other_model(self, model: str | None, shown: str) -> None:
        """OpenAI's 404 for a model id (``shown`` as the message renders it) not served here; None passes."""
        if model is not None and model not in self.model_names:
            raise ApiError(
                404, f"model {shown} is not served here; GET /v1/models lists {self.model_id!r}", "model", code="model_not_found"
            )

    async def tokenize(self, request: Request) -> Response:
        """``POST /tokenize`` in vLLM's shapes: ``{"prompt": str, "add_special_tokens": true}`` or
        ``{"messages": [...], "add_generation_prompt": true}`` (the chat template, as chat
        completions apply it) -> ``{"count", "max_model_len", "tokens"}``."""
        return await self._holding_a_place(request, self._tokenize)

    async def detokenize(self, request: Request) -> Response:
        """``POST /detokenize``: ``{"tokens": [ids]}`` -> ``{"prompt": text}`` (vLLM's shapes)."""
        return await self._holding_a_place(request, self._detokenize)

    async def _holding_a_place(self, request: Request, answer: Callable[[Request], Awaitable[Response]]) -> Response:
        """``answer(request)`` with the caller's place under --max-requests-per-caller held
        while it runs: tokenizing costs a worker thread as generating does."""
        self._ready()
        release = self._admit(request)
        try:
            return await answer(request)
        finally:
            release()

    def _admit(self, request: Request) -> Callable[[], None]:
        """A place for the request's caller under --max-requests-per-caller (429 without one)."""
        caller = request.scope["state"]["caller"]  # _Callers'
        callers = self.service.callers
        release = callers.admit(caller)
        if release is None:
            raise ApiError(429, callers.refusal(caller), kind="rate_limit_error", code="too_many_requests_per_caller")
        return release

    async def _tokenize(self, request: Request) -> Response:
        body = await self._small_body(request, TokenizeRequest)
        if body.messages is not None:
            if body.add_generation_prompt is False:
                raise ApiError(
                    400, "add_generation_prompt must be true: chats are tokenized as chat completions see them", "add_generation_prompt"
                )
            tokens = await anyio.to_thread.run_sync(self._chat_prompt, body.messages, limiter=self.limiter)
        else:
            assert body.prompt is not None  # the model takes exactly one of the two
            prompt, special = body.prompt, _or(body.add_special_tokens, True)
            self._check_prompt_chars(len(_text(prompt, "prompt", "prompt")), "prompt")
            tokenizer = self.service.tokenizer
            tokens = await anyio.to_thread.run_sync(
                lambda: list(tokenizer(prompt, add_special_tokens=special).input_ids), limiter=self.limiter
            )
        return JSONResponse({"count": len(tokens), "max_model_len": self.service.capacity, "tokens": tokens})

    async def _detokenize(self, request: Request) -> Response:
        tokens = (await self._small_body(request, DetokenizeRequest)).tokens
        vocabulary = self.service.vocab_size
        if len(tokens) > self.service.capacity:
            raise ApiError(400, f"tokens holds {len(tokens)} ids, more than a sequence's {self.service.capacity}", "tokens")
        if (bad := next((token for token in tokens if not 0 <= token < vocabulary), None)) is not None:
            raise ApiError(400, f"token id {bad} is outside the vocabulary [0, {vocabulary})", param="tokens")
        tokenizer = self.service.tokenizer
        return JSONResponse({"prompt": await anyio.to_thread.run_sync(tokenizer.decode, tokens, limiter=self.limiter)})

    async def _small_body(self, request: Request, model: type[Body]) -> Body:
        """A tokenize/detokenize body, for the served model."""
        self._ready()
        body = parse(await self._body(request, f"http-{secrets.token_hex(6)}"), model)
        self._refuse_other_model(body.model, repr(body.model))
        return body

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    # -- one request --------------------------------------------------------------------

    async def _serve(self, request: Request, chat: bool) -> Response:
        """The answer, with the caller's place under --max-requests-per-caller held from
        before its body is read until its answer ends (streamed: until the stream closes)."""
        self._ready()
        caller = request.scope["state"]["caller"]  # _Callers'
        places = [self._admit(request)]  # one per choice: a request for n choices holds n places

        def release_all() -> None:
            for give_back in places:
                give_back()

        try:
            response = await self._answer(request, chat, caller, places, release_all)
        except BaseException:
            release_all()
            raise
        if not isinstance(response, _EventStream):  # a stream releases its places when it closes
            release_all()
        return response

    async def _answer(self, request: Request, chat: bool, caller: str, places: list, release: Callable[[], None]) -> Response:
        request_id = f"http-{secrets.token_hex(6)}"
        received = await self._body(request, request_id)
        # Parsing, chat templates and tokenizing up to --max-http-body-bytes take a worker
        # thread, so the event loop keeps serving the other requests' streams meanwhile.
        generations, stream, include_usage, echo, prompt_logprobs = await anyio.to_thread.run_sync(
            self._parse, received, chat, request_id, limiter=self.limiter
        )
        callers = self.service.callers
        for _ in generations[1:]:
            place = callers.admit(caller)
            if place is None:
                raise ApiError(
                    429,
                    callers.refusal(caller) + f" (n={len(generations)} takes {len(generations)})",
                    kind="rate_limit_error",
                    code="too_many_requests_per_caller",
                )
            places.append(place)
        span_context = self.service.request_span(propagate.extract(dict(request.headers)), CHAT if chat else TEXT_COMPLETION, _error_type)
        traced = span_context.__enter__()
        traced.span.set_attribute("http.request.id", request.scope["state"]["request_id"])  # _RequestIds'
        try:
            handles = self._submit(generations, traced.span, chat, caller)
        except BaseException as error:
            span_context.__exit__(type(error), error, error.__traceback__)
            raise
        reply = _Reply(self, handles, chat, traced, span_context)
        reply.prompt_logprobs = prompt_logprobs
        try:
            if echo:  # decoded once submitting checked the ids (a decoder fails on one outside the vocabulary)
                reply.echoes = await anyio.to_thread.run_sync(self._echoes, generations, limiter=self.limiter)
            if stream:
                return _EventStream(self._events(reply, include_usage), reply.close, release)
            return await self._complete(request, reply)
        except BaseException as error:
            reply.close(error)
            raise
        finally:
            if not stream:
                reply.close()

    def _echoes(self, generations: list[GenerationRequest]) -> list[str]:
        """Each choice's prompt text, decoded once per prompt (its ``n`` choices share its list)."""
        texts: dict[int, str] = {}
        for generation in generations:
            if id(generation.prompt_ids) not in texts:
                texts[id(generation.prompt_ids)] = str(self.service.tokenizer.decode(generation.prompt_ids))
        return [texts[id(generation.prompt_ids)] for generation in generations]

    async def _body(self, request: Request, request_id: str) -> bytearray:
        """The body, sent as JSON (415 otherwise, before a byte is read), up to
        --max-http-body-bytes (413 beyond: from its Content-Length before a byte is read,
        else while a chunked one arrives)."""
        _require_json(request.headers)
        limit, received = self.service.config.max_http_body_bytes, bytearray()
        too_large = ApiError(413, f"the body is over {limit} bytes (--max-http-body-bytes)", code="body_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:  # h11 has refused any other Content-Length
            raise too_large
        try:
            async for part in request.stream():
                received += part
                if len(received) > limit:
                    raise too_large
        except ClientDisconnect:
            log.info("request %s: the connection closed after %d bytes of its body; nothing to answer", request_id, len(received))
            raise ApiError(400, "the connection closed before the whole body came", code="client_disconnected") from None
        return received

    def _parse(self, received: bytearray, chat: bool, request_id: str) -> tuple[list[GenerationRequest], bool, bool, bool, int | None]:
        """(a request per choice, stream, stream_options.include_usage, echo: the prompt goes
        before the completion, vLLM's prompt_logprobs: alternatives shown per prompt token)
        from a JSON body."""
        checks = {CHECK_LOGIT_BIAS_COUNT: self.service.config.engine.check_logit_bias_count}
        body: Any = parse(received, ChatCompletionRequest if chat else CompletionRequest, checks)
        generations = self._generation_requests(body, chat, request_id)
        stream = _or(body.stream, False)
        include_usage = body.stream_options is not None and bool(body.stream_options.include_usage)
        echo = not chat and bool(body.echo)
        prompt_logprobs = None if chat else body.prompt_logprobs
        if stream and (echo and body.logprobs is not None or prompt_logprobs is not None):
            raise ApiError(
                400,
                "the prompt's log-probabilities (echo with logprobs, prompt_logprobs) are answered whole; set stream to false",
                param="stream",
            )
        return generations, stream, include_usage, echo, prompt_logprobs

    def _submit(self, generations: list[GenerationRequest], span, chat: bool, caller: str) -> list[RequestHandle]:
        try:
            return self.service.submit_group(generations, span, caller)
        except InvalidRequest as error:
            param = (OPENAI_CHAT_FIELDS if chat else OPENAI_FIELDS).get(error.field, error.field)
            raise ApiError(400, error.named(param), param=param) from None
        except QueueFull as error:
            raise ApiError(429, str(error), kind="rate_limit_error", code="queue_full") from None
        except ShuttingDown as error:
            raise ApiError(503, str(error), kind="server_error", code="shutting_down") from None

    async def _complete(self, request: Request, reply: _Reply) -> Response:
        """The whole answer; a client that disconnects first cancels the request. Its texts
        (log-probabilities' take a decode per alternative per token) and its JSON are made on
        a worker thread, as the tokens are waited for, so the event loop goes on serving others."""

        async def cancel_on_disconnect() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            reply.client_left()

        def answer() -> Response:
            results = reply.all_results()
            stats = [self.service.recorded(handle, result) for handle, result in zip(reply.handles, results)]
            return JSONResponse(reply.whole(results, stats))

        try:
            async with anyio.create_task_group() as group:
                group.start_soon(cancel_on_disconnect)
                response = await anyio.to_thread.run_sync(answer, abandon_on_cancel=True, limiter=self.limiter)
                group.cancel_scope.cancel()
        except BaseExceptionGroup as group:  # the task group wraps what its tasks raised
            raise _unwrapped(group) from None
        return response

    async def _events(self, reply: _Reply, include_usage: bool) -> AsyncIterator[str]:
        """The SSE data lines; a disconnect cancels this generator, and the request with it
        (``_EventStream`` closes the reply however the stream ends, even before it began)."""
        try:
            if reply.chat or reply.echoes is not None:
                for index in range(len(reply.handles)):
                    yield json.dumps(reply.first_chunk(index))
            data = self._data(reply, interleave(reply.handles), include_usage)
            # Waiting for the next tokens and rendering their texts (log-probabilities' take a
            # decode per alternative per token) take a worker thread, so the loop serves other streams.
            while (line := await anyio.to_thread.run_sync(next, data, None, abandon_on_cancel=True, limiter=self.limiter)) is not None:
                yield line
            if include_usage:
                yield json.dumps(reply.usage_chunk())
            yield "[DONE]"
        except Exception as error:  # the request failed after its stream began: say so in the stream
            if not isinstance(error, ApiError):
                _log_unexpected(f"request {reply.handles[0].request.request_id}'s stream", error)
                error = ApiError(500, "the server failed on this request; it is logged", kind="server_error", code="internal_error")
            reply.close(error)
            yield json.dumps(error.body())
        except BaseException as error:  # the client left (cancelled, or the generator closed)
            reply.close(error)
            raise

    def _data(self, reply: _Reply, events: Iterator[tuple[int, TokenChunk | None]], include_usage: bool) -> Iterator[str]:
        """Each event of ``interleave`` as its chunk's JSON: a choice's tokens, or its end."""
        for index, piece in events:
            if piece is not None:
                yield json.dumps(reply.token_chunk(index, piece))
                continue
            result = reply.result(index)
            yield json.dumps(reply.final_chunk(index, result, self.service.recorded(reply.handles[index], result), include_usage))

    # -- the request ----------------------------------------------------------------------

    def _generation_requests(self, body: Any, chat: bool, request_id: str) -> list[GenerationRequest]:
        """A request per choice from a declared body (``openai_protocol``): ``n`` per prompt
        (completions take a list), prompt i's choices at i*n to i*n+n-1, each the same but
        for its id and, when ``seed`` is set, its seed (choice j of a prompt samples with
        seed + j, so choice 0 is what n = 1 gives)."""
        self._refuse_other_model(body.model, repr(body.model))
        # The choices are queued together, so the queue must hold them all.
        limit = min(self.service.config.max_choices, self.service.max_queued)
        n = _or(body.n, 1)
        if not 1 <= n <= limit:
            raise ApiError(400, f"n must be in [1, {limit}] (--max-choices, --max-queued), got {n}", param="n")
        if chat:
            prompts = [self._chat_prompt(body.messages)]
        else:
            prompts = self._completion_prompts(body.prompt, limit // n)
        firsts = [
            self._generation_request(body, chat, prompt, request_id if len(prompts) == 1 else f"{request_id}-p{index}")
            for index, prompt in enumerate(prompts)
        ]
        if len(prompts) > 1:
            self._validate_each(firsts)
        if n == 1:
            return firsts
        return [
            replace(
                first,
                request_id=f"{first.request_id}-{index}",
                sampling=first.sampling
                if first.sampling.seed is None
                else replace(first.sampling, seed=(first.sampling.seed + index) % (1 << 64)),
            )
            for first in firsts
            for index in range(n)
        ]

    def _validate_each(self, generations: list[GenerationRequest]) -> None:
        """The engine's rules per prompt of a list, so a 400 says which (``prompt[i]``)."""
        assert self.service.engine is not None  # ready
        for index, generation in enumerate(generations):
            try:
                self.service.engine.validate(generation)
            except InvalidRequest as error:
                param = OPENAI_FIELDS.get(error.field, error.field)
                raise ApiError(400, f"prompt[{index}]: {error.named(param)}", param=param) from None

    def _generation_request(self, body: Any, chat: bool, prompt_ids: list[int], request_id: str) -> GenerationRequest:
        # Stop strings are checked first: cheap, and the prompt's tokenizing is not.
        stop = [body.stop] if isinstance(body.stop, str) else _or(body.stop, [])
        for index, item in enumerate(stop):
            _text(item, f"stop[{index}]", "stop")
        if chat:
            room = self.service.capacity - len(prompt_ids)
            default_max = max(1, min(self.service.max_new_tokens_limit, room))
            max_tokens = _or(body.max_completion_tokens, _or(body.max_tokens, default_max))
        else:
            max_tokens = _or(body.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS)
        sampling = SamplingParams(
            temperature=_or(body.temperature, 1.0),
            top_k=_or(body.top_k, 0),
            top_p=_or(body.top_p, 1.0),
            seed=body.seed,
            presence_penalty=_or(body.presence_penalty, 0.0),
            frequency_penalty=_or(body.frequency_penalty, 0.0),
            repetition_penalty=_or(body.repetition_penalty, 1.0),
            logit_bias=tuple(sorted(_or(body.logit_bias, {}).items())),
            min_tokens=_or(body.min_tokens, 0),
        )
        logprobs = _chat_logprobs(body) if chat else body.logprobs
        # The prompt is scored for echo's logprobs and vLLM's prompt_logprobs, to the larger
        # count of alternatives (each shown to its own), and for max_tokens 0 with echo.
        asked = [] if chat else [value for value in (body.prompt_logprobs, logprobs if body.echo else None) if value is not None]
        prompt_logprobs = max(asked) if asked else None
        if max_tokens == 0 and not chat and prompt_logprobs is None:
            if not body.echo:
                raise ApiError(
                    400,
                    "max_tokens 0 generates nothing; it is taken with echo: true, to score the prompt (or with prompt_logprobs)",
                    param="max_tokens",
                )
            prompt_logprobs = 0
        k = body.num_speculative_tokens
        return GenerationRequest(
            prompt_ids, max_tokens, sampling, tuple(stop), k, request_id=request_id, logprobs=logprobs, prompt_logprobs=prompt_logprobs
        )

    def _check_prompt_chars(self, chars: int, param: str) -> None:
        try:
            self.service.check_prompt_chars(chars)
        except InvalidRequest as error:
            raise ApiError(400, str(error), param=param) from None

    def _chat_prompt(self, messages: list[ChatMessage]) -> list[int]:
        plain = []
        for index, message in enumerate(messages):
            content = message.content if isinstance(message.content, str) else "".join(part.text for part in message.content)
            plain.append({"role": message.role, "content": _text(content, f"messages[{index}].content", "messages")})
        self._check_prompt_chars(sum(len(message["content"]) for message in plain), "messages")
        tokenizer = self.service.tokenizer
        if not tokenizer.chat_template:
            raise ApiError(400, "this model has no chat template; use /v1/completions", param="messages")
        try:
            return chat_ids(tokenizer, plain)
        except Exception as error:  # the template's own rules (role order, ...)
            raise ApiError(400, f"the chat template refused these messages: {error}", param="messages") from None

    def _completion_prompts(self, prompt: str | list[int] | list[str | list[int]], limit: int) -> list[list[int]]:
        """The prompts of a completions request: one (a string, or token ids, an empty list
        included: the engine says the prompt is empty), or a list of them, at most ``limit``
        (each is a sequence, counted as ``n`` choices are)."""
        if isinstance(prompt, str) or all(isinstance(token, int) for token in prompt):
            return [self._completion_prompt(cast(str | list[int], prompt), "prompt")]
        prompts = cast(list[str | list[int]], prompt)
        if len(prompts) > limit:
            raise ApiError(
                400,
                f"prompt lists {len(prompts)} prompts; with n choices each at most {limit} (--max-choices, --max-queued)",
                param="prompt",
            )
        return [self._completion_prompt(item, f"prompt[{index}]") for index, item in enumerate(prompts)]

    def _completion_prompt(self, prompt: str | list[int], where: str) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        try:
            self.service.check_prompt_chars(len(_text(prompt, where, "prompt")))
        except InvalidRequest as error:
            raise ApiError(400, f"{where}: {error}" if where != "prompt" else str(error), param="prompt") from None
        return list(self.service.tokenizer(prompt).input_ids)


def _chat_logprobs(body: ChatCompletionRequest) -> int | None:
    """Chat's ``logprobs`` (true: return them) and ``top_logprobs`` (alternatives per token,
    which OpenAI takes only beside ``logprobs: true``) as the engine's: None, or the alternatives."""
    wanted, top = body.logprobs, body.top_logprobs
    if top is not None and not wanted:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return (top or 0) if wanted else None


def _error_type(error: BaseException) -> str:
    """A failed request's error.type: its HTTP status, as OpenTelemetry's HTTP conventions name one."""
    return str(error.status) if isinstance(error, ApiError) else "500"


def _unwrapped(group: BaseExceptionGroup) -> BaseException:
    """What failed a request, out of the exception groups that task groups wrap it in: an
    ``ApiError`` when one is there (so a request's own error keeps its status), else the first."""
    leaves: list[BaseException] = []
    pending: list[BaseException] = [group]
    while pending:
        error = pending.pop(0)
        if isinstance(error, BaseExceptionGroup):
            pending[:0] = error.exceptions
        else:
            leaves.append(error)
    return next((error for error in leaves if isinstance(error, ApiError)), leaves[0])


def _require_json(headers: Headers) -> None:
    """415 unless the body is declared JSON. A page on another site may POST a form or plain
    text here without asking first (a CORS "simple request"); a JSON body needs a preflight,
    which the browser refuses without --allowed-origins, so the page's request never comes."""
    declared = headers.get("content-type")
    if declared is None or declared.partition(";")[0].strip().lower() != "application/json":
        got = "none" if declared is None else _shown(declared)
        raise ApiError(415, f"send the body as JSON, with Content-Type: application/json (got {got})", code="unsupported_media_type")


def _log_unexpected(what: str, error: BaseException) -> None:
    """One line for a failure nobody foresaw: what failed, the exception, and where it was raised."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    detail = str(error)[:300].encode("ascii", "backslashreplace").decode("ascii")
    log.error("%s failed: %s: %s%s", what, type(error).__name__, detail, where)


class _Unexpected:
    """Any exception a route did not turn into an ``ApiError``: a 500 in OpenAI's shape (when
    no response has begun) and one log line, instead of Starlette's plain "Internal Server
    Error" and uvicorn's traceback."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        started = False

        async def watched(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as raised:
            error = _unwrapped(raised) if isinstance(raised, ExceptionGroup) else raised
            if not isinstance(error, ApiError):
                _log_unexpected(f"{scope.get('method', '')} {scope.get('path', '')}", error)
                error = ApiError(500, "the server failed on this request; it is logged", kind="server_error", code="internal_error")
            if scope["type"] == "http" and not started:
                await error.response()(scope, receive, send)


# Routes outside /v1 that need a caller (and a key, when keys are configured), as /v1's do.
GUARDED = ("/tokenize", "/detokenize")
# X-Request-Id: a client's own id is echoed when it is this long at most and printable
# ASCII without spaces; otherwise (or without one) the server makes one.
REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID_CHARS = 128


def request_id_of(headers: Headers) -> str:
    """The request's id: the client's ``X-Request-Id`` if it is a plain token, else a new one."""
    sent = headers.get(REQUEST_ID_HEADER, "")
    if 0 < len(sent) <= MAX_REQUEST_ID_CHARS and sent.isascii() and sent.isprintable() and " " not in sent:
        return sent
    return f"req-{secrets.token_hex(8)}"


class _RequestIds:
    """Every HTTP answer carries ``X-Request-Id`` (the client's, or one made here), and the
    request's span records it (``http.request.id``), so a client's id finds its trace."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_of(Headers(scope=scope))
        scope.setdefault("state", {})["request_id"] = request_id

        async def stamped(message) -> None:
            if message["type"] == "http.response.start":
                headers = [(name, value) for name, value in message.get("headers", []) if name.lower() != REQUEST_ID_HEADER.encode()]
                message = message | {"headers": [*headers, (REQUEST_ID_HEADER.encode(), request_id.encode())]}
            await send(message)

        await self.app(scope, receive, stamped)


def host_of(header: str) -> str:
    """The host a Host header names, without its port: "[::1]:8000" -> "::1", "Localhost:80" -> "localhost"."""
    header = header.strip()
    if header.startswith("["):  # an IPv6 address: its colons are not a port's
        return host_name(header.partition("]")[0] + "]")
    return host_name(header.partition(":")[0])


class _Hosts:
    """Only requests for one of this server's names (``allowed``, from --allowed-hosts;
    None: any) reach a route. A page on another site can have its own name resolve to this
    server's address (DNS rebinding) and then call it as same-origin, past the browser's
    CORS rules; its requests carry that name in Host, so they are refused here.

    400 in OpenAI's shape (as Django and Starlette's TrustedHostMiddleware answer), not
    421 Misdirected Request: 421 tells a client to retry on another connection, which is
    for a connection reused across origins (HTTP/2), not for a name this server never has."""

    def __init__(self, app, allowed: frozenset[str] | None) -> None:
        self.app, self.allowed = app, allowed

    async def __call__(self, scope, receive, send) -> None:
        sent = Headers(scope=scope).get("host") if scope["type"] == "http" else None
        if scope["type"] != "http" or self.allowed is None or sent is not None and host_of(sent) in self.allowed:
            await self.app(scope, receive, send)
            return
        if sent is None:
            message = "the request has no Host header; send one naming this server (--allowed-hosts)"
        else:
            message = (
                f"this server does not answer to the host {_shown(host_of(sent))} (the request's Host header): call it by "
                "one of its own names, or add this one to its --allowed-hosts"
            )
        await ApiError(400, message, code="host_not_allowed").response()(scope, receive, send)


class _Callers:
    """Who calls each ``/v1`` route, in ``scope["state"]["caller"]``: the API key's name when
    keys are configured (a 401 in OpenAI's shape, with ``WWW-Authenticate: Bearer``, without
    a valid one), else its client certificate's common name under mutual TLS (as the gRPC
    door names it: ``serving.caller_identity``), else the peer's host. Other paths (the live
    view, /health) pass open."""

    def __init__(self, app, keys) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not (scope["path"] == "/v1" or scope["path"].startswith("/v1/") or scope["path"] in GUARDED):
            await self.app(scope, receive, send)
            return
        if self.keys.required:
            values = Headers(scope=scope).getlist("authorization")
            caller = self.keys.caller(bearer(values[0]) if values else None)
            if caller is None:
                refused = ApiError(
                    401, self.keys.refusal(bool(values)), code="invalid_api_key", headers={"www-authenticate": 'Bearer realm="specdec"'}
                )
                await refused.response()(scope, receive, send)
                return
        elif scope.get("state", {}).get(CERTIFICATE_STATE):
            caller = CERTIFICATE_CALLER + scope["state"][CERTIFICATE_STATE]
        else:
            client = scope.get("client")
            caller = client[0] if client else "unknown"
        scope.setdefault("state", {})["caller"] = caller
        await self.app(scope, receive, send)


# What /health and the start-up log say of a verifier with no drafter.
NO_DRAFTER_WARNING = "no drafter (--drafter): every step is plain decoding, with no speculation"
try:
    _VERSION = importlib.metadata.version("specdec")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
    _VERSION = "unknown"


# Where _LimitedH11 puts a request's client-certificate common name (mutual TLS) for _Callers.
CERTIFICATE_STATE = "client_certificate"


def _common_name(ssl_object) -> str | None:
    """The verified client certificate's common name on a TLS connection (None: no TLS, or no certificate)."""
    certificate = ssl_object.getpeercert() if ssl_object is not None else None
    for rdn in (certificate or {}).get("subject", ()):
        for name, value in rdn:
            if name == "commonName":
                return value
    return None


class _EventStream(EventSourceResponse):
    """Server-sent events (sse-starlette's framing, a comment every 15 s to keep proxies from
    timing out) that call each of ``on_close`` however the response ends: finished, failed,
    or the client gone, even before the first event."""

    def __init__(self, events: AsyncIterator[str], *on_close: Callable[[], None]) -> None:
        super().__init__(events, ping=15)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for close in self._on_close:
                close()


class _Reply:
    """One request's answer as OpenAI objects, a choice per handle (``n``): chunks while it
    streams, or the whole."""

    def __init__(self, api: OpenAIApi, handles: list[RequestHandle], chat: bool, traced: TracedRequest, span_context) -> None:
        self.api, self.handles, self.chat, self.traced = api, handles, chat, traced
        self.echoes: list[str] | None = None  # completions' echo: each choice's prompt text, sent before its completion's
        self.prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: alternatives shown per prompt token
        self._span_context = span_context  # service.request_span's, entered
        self._closed = False
        self._left = False  # the client disconnected first
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.object = "chat.completion.chunk" if chat else "text_completion"
        tokenizer = api.service.tokenizer
        self.texts = [_StreamText(tokenizer, handle.request.stop) for handle in handles]
        wanted = handles[0].request.logprobs is not None
        self.logprobs = [_Logprobs(tokenizer, chat) if wanted else None for _ in handles]
        self.tokens_sent = [0] * len(handles)
        self.stats: list[Any] = [None] * len(handles)  # each choice's RequestStats, once it ended
        self.results: list[Any] = [None] * len(handles)

    @property
    def _answered(self) -> bool:
        """Every choice's last chunk, or the whole answer, was made."""
        return None not in self.stats

    def client_left(self) -> None:
        """The client disconnected before its answer: cancel the request (freeing its slots at the next step)."""
        self._left = True
        for handle in self.handles:
            self.api.service.cancel(handle)

    def close(self, error: BaseException | None = None) -> None:
        """Once: cancel the choices' requests (a no-op once they ended; it frees the slots of a
        client that left) and end the span, with ``error`` unless that is the client going
        away, which is one line in the log instead."""
        if self._closed:
            return
        self._closed = True
        for handle in self.handles:
            self.api.service.cancel(handle)
        gone = isinstance(error, anyio.get_cancelled_exc_class() | GeneratorExit) or self._left or error is None and not self._answered
        if gone:
            log.info(
                "request %s (%s): the client disconnected after %d tokens, before its answer ended; cancelled",
                self.handles[0].request.request_id,
                self.id,
                sum(self.tokens_sent),
            )
        elif self._answered:
            self.api.service.annotate(
                self.traced, RequestStats.combined(self.stats), [result.finish_reason for result in self.results], self.id
            )
        if error is None or gone:
            self._span_context.__exit__(None, None, None)
        else:
            self._span_context.__exit__(type(error), error, error.__traceback__)

    def result(self, index: int):
        try:
            self.results[index] = self.handles[index].result()
        except Exception as error:  # Cancelled (the client left) or what failed this request alone
            raise ApiError(500, f"generation failed: {error}", kind="server_error") from None
        return self.results[index]

    def all_results(self) -> list:
        return [self.result(index) for index in range(len(self.handles))]

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": int(time.time()), "model": self.api.model_id, "choices": choices}

    def _choice(self, index: int, text: str | None, finish_reason: str | None, role: bool = False, logprobs: dict | None = None) -> dict:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}

    def first_chunk(self, index: int) -> dict:
        """Chat streams open with the assistant's role, as OpenAI's do; completions with echo, with the prompt."""
        return self._envelope(self.object, [self._choice(index, self._echo(index), None, role=True)])

    def _echo(self, index: int) -> str:
        return self.echoes[index] if self.echoes is not None else ""

    def token_chunk(self, index: int, chunk: TokenChunk) -> dict:
        self.tokens_sent[index] += len(chunk.tokens)
        rejected = [draft.token for draft in chunk.rejected]
        delta, pieces, rejected_texts = self.texts[index].push(chunk.tokens, rejected)
        extra = {
            "token_ids": chunk.tokens,
            "token_texts": pieces,
            "sources": chunk.sources,
            "verified": chunk.verified,
            "evidence": [_evidence(item) for item in chunk.evidence] if chunk.evidence else [None] * len(chunk.tokens),
            # The draft the target turned down, proposed where the last token of this chunk went.
            "rejected_token_ids": rejected,
            "rejected_token_texts": rejected_texts,
            "rejected_sources": [draft.source for draft in chunk.rejected],
            "rejected_evidence": [_evidence(draft.evidence) for draft in chunk.rejected],
        }
        shown = self.logprobs[index]
        logprobs = shown.shown(chunk.logprobs) if shown is not None else None
        return self._envelope(self.object, [self._choice(index, delta, None, logprobs=logprobs)]) | {"specdec": extra}

    def final_chunk(self, index: int, result, stats, usage: bool) -> dict:
        self.stats[index] = stats
        out = self._envelope(self.object, [self._choice(index, self.texts[index].finish(result.text), _finish(result))])
        out["specdec"] = stats.as_dict()
        if usage:
            out["usage"] = None  # OpenAI: null on every chunk but the last, which carries it alone
        return out

    def usage_chunk(self) -> dict:
        return self._envelope(self.object, []) | {"usage": self._usage()}

    def _usage(self) -> dict:
        # Each prompt once, however many choices it has (OpenAI's and vLLM's count).
        prompts = {id(handle.request.prompt_ids): len(handle.request.prompt_ids) for handle in self.handles}
        prompt, completion = sum(prompts.values()), sum(len(result.token_ids) for result in self.results)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def whole(self, results: list, stats: list) -> dict:
        self.results, self.stats = results, stats
        choices = []
        for index, result in enumerate(results):
            shown, logprobs, request = self.logprobs[index], None, self.handles[index].request
            if shown is not None and self.echoes is not None and result.prompt_logprobs is not None:
                top = request.logprobs or 0
                prompt = [replace(item, top=item.top[:top]) for item in result.prompt_logprobs]
                logprobs = shown.shown_after_prompt(request.prompt_ids[0], prompt, result.logprobs or ())
            elif shown is not None:
                logprobs = shown.shown(result.logprobs or ())
            if self.chat:
                choice = {"index": index, "message": {"role": "assistant", "content": result.text}, "logprobs": logprobs}
            else:
                choice = {"index": index, "text": self._echo(index) + result.text, "logprobs": logprobs}
            choice["finish_reason"] = _finish(result)
            if self.prompt_logprobs is not None and result.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self._vllm_prompt_logprobs(result.prompt_logprobs, self.prompt_logprobs)
            choices.append(choice)
        obj = "chat.completion" if self.chat else "text_completion"
        return self._envelope(obj, choices) | {"usage": self._usage(), "specdec": RequestStats.combined(stats).as_dict()}

    def _vllm_prompt_logprobs(self, items: Sequence[TokenLogprob], top: int) -> list[dict | None]:
        """vLLM's ``prompt_logprobs``: None for the first prompt token, then per token a dict
        of token id (a string, as JSON keys are) -> {logprob, rank, decoded_token}: the
        prompt's own token first, then its ``top`` alternatives (rank 1, 2, ...); each
        token decoded alone."""
        decode = functools.lru_cache(maxsize=None)(lambda token: str(self.api.service.tokenizer.decode([token])))

        def entry(token: int, logprob: float, rank: int | None) -> dict:
            return {"logprob": logprob, "rank": rank, "decoded_token": decode(token)}

        shown: list[dict | None] = [None]
        for item in items:
            position = {str(item.token): entry(item.token, item.logprob, item.rank)}
            for place, (token, logprob) in enumerate(item.top[:top], start=1):
                position.setdefault(str(token), entry(token, logprob, place))
            shown.append(position)
        return shown


class _Logprobs:
    """The target's log-probabilities in OpenAI's shapes: chat's ``{"content": [{token,
    logprob, bytes, top_logprobs}]}``, or completions' ``{tokens, token_logprobs,
    top_logprobs, text_offset}``.

    A token's text is what it adds after the tokens emitted before it (a
    SentencePiece "▁the" after "of" is " the"), so the emitted tokens' texts
    join into the completion (a special token, such as the EOS that ended
    it, reads as ""); an alternative in ``top_logprobs`` is shown as
    it would have read in the same place. A piece of a character decodes as
    U+FFFD, as in vLLM."""

    _WINDOW = 4  # emitted tokens decoded before a token, enough for any tokenizer's joining rules

    def __init__(self, tokenizer, chat: bool) -> None:
        self.tokenizer, self.chat = tokenizer, chat
        self.offset = 0  # completions: characters of the completion before the next token
        self.recent: list[int] = []

    def _decode(self, tokens: list[int]) -> str:
        # Special tokens (EOS) read as "", as the completion's text has them.
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))

    def _texts(self, tokens: Sequence[int]) -> dict[int, str]:
        """What each of ``tokens`` would add after the recent emitted tokens (decoded once for all)."""
        before = self._decode(self.recent) if self.recent else ""
        texts = {}
        for token in tokens:
            if token not in texts:
                after = self._decode([*self.recent, token])
                texts[token] = after[len(before) :] if after.startswith(before) else self._decode([token])
        return texts

    def _emitted(self, item: TokenLogprob) -> tuple[str, list[tuple[str, float]]]:
        texts = self._texts([item.token, *(token for token, _ in item.top)])
        self.recent = [*self.recent, item.token][-self._WINDOW :]
        return texts[item.token], [(texts[token], value) for token, value in item.top]

    def shown(self, items: Sequence[TokenLogprob]) -> dict:
        rendered = [(item, *self._emitted(item)) for item in items]
        if self.chat:
            return {
                "content": [
                    _token_entry(text, item.logprob) | {"top_logprobs": [_token_entry(name, value) for name, value in top]}
                    for item, text, top in rendered
                ],
                "refusal": None,
            }
        offsets = []
        for _, text, _ in rendered:
            offsets.append(self.offset)
            self.offset += len(text)
        return {
            "tokens": [text for _, text, _ in rendered],
            "token_logprobs": [item.logprob for item in items],
            "top_logprobs": [dict(top) for _, _, top in rendered],
            "text_offset": offsets,
        }

    def shown_after_prompt(self, first: int, prompt: Sequence[TokenLogprob], generated: Sequence[TokenLogprob]) -> dict:
        """Completions' echo: the prompt's tokens, then the generated ones, as OpenAI's legacy
        completions show them: the first prompt token, which has no log-probability, with
        null in ``token_logprobs`` and ``top_logprobs``."""
        text = self._decode([first])
        self.recent, self.offset = [first], len(text)
        rest = self.shown([*prompt, *generated])
        return {
            "tokens": [text, *rest["tokens"]],
            "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]],
            "text_offset": [0, *rest["text_offset"]],
        }


def _token_entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


class _StreamText:
    """Text deltas safe to send (``text.IncrementalText``, as gRPC's stream), and the text each token added."""

    def __init__(self, tokenizer, stop: tuple[str, ...]) -> None:
        self.text = IncrementalText(tokenizer, stop)
        self.pieces = IncrementalDecoder(tokenizer)

    def push(self, tokens: list[int], rejected: list[int] | None = None) -> tuple[str, list[str], list[str]]:
        """(the delta, each token's text, each ``rejected`` token's text had it come before the last token)."""
        pieces, previews = [], []
        for index, token in enumerate(tokens):
            if rejected and index == len(tokens) - 1:
                previews = self.pieces.peek(rejected)
            pieces.append(self.pieces.push([token]))
        return self.text.push(tokens), pieces, previews

    def finish(self, final_text: str) -> str:
        return self.text.finish(final_text)


def _evidence(evidence) -> dict | None:
    """Why the drafter proposed a token (``DraftEvidence``), for the live view; None: the target's own."""
    if evidence is None:
        return None
    return {"match_length": evidence.match_length, "count": evidence.count, "total": evidence.total}


def _finish(result) -> str:
    return "length" if result.finish_reason == FINISH_LENGTH else "stop"


@dataclass(frozen=True)
class HttpLimits:
    """What HTTP connections may hold of the server (VerifierConfig's http_* fields, which give the defaults and why)."""

    max_connections: int
    header_timeout_s: float
    body_timeout_s: float


class _LimitedH11(H11Protocol):
    """uvicorn's h11 protocol with the limits it lacks (``limits``, set per server).

    A cap on open connections: past it, a new one is answered 503 and closed
    (uvicorn's ``limit_concurrency`` keeps such a connection, refuses only its
    requests, in plain text, and never one that sends nothing). And deadlines
    for a request's headers (from the connection, or the previous answer) and
    for its body (from its headers): uvicorn has only the keep-alive timeout,
    which any byte received cancels, so a client trickling a request held its
    connection, and what its body had sent, for ever. Past a deadline the
    request is answered 408 (while it has no answer) and the connection closed.
    """

    limits: ClassVar[HttpLimits]  # HttpServer's subclass sets them

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._certificate: str | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: object = None  # h11's state of the client: IDLE (sending headers), SEND_BODY, ...
        self._heard = False  # bytes came in this phase
        if len(self.connections) >= self.limits.max_connections:
            self.transport = transport
            log.info("HTTP: refused a connection: %d are open (--max-http-connections)", len(self.connections))
            message = f"the server has {len(self.connections)} open HTTP connections (--max-http-connections); retry shortly"
            transport.write(ApiError(503, message, kind="server_error", code="too_many_connections").raw())
            transport.close()
            return
        super().connection_made(transport)
        self._certificate = _common_name(transport.get_extra_info("ssl_object"))
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._heard = True
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        # The request just read (h11 reads one at a time) carries its connection's client
        # certificate to _Callers; its task has been created, not yet run.
        if self._certificate and getattr(self, "scope", None) is not None:
            self.scope.setdefault("state", {})[CERTIFICATE_STATE] = self._certificate  # type: ignore[typeddict-unknown-key]
        self._watch()

    def send_400_response(self, msg: str) -> None:
        """What h11 cannot parse, in OpenAI's shape too."""
        self.transport.write(ApiError(400, f"{msg} (not an HTTP/1.1 request this server reads)", code="invalid_http").raw())
        self.transport.close()

    def _watch(self) -> None:
        """A deadline for the phase the client is in, set as it enters the phase."""
        phase = self.conn.their_state
        if phase is self._phase:
            return
        self._phase, self._heard = phase, False
        self._cancel_deadline()
        timeouts = {h11.IDLE: ("headers", self.limits.header_timeout_s), h11.SEND_BODY: ("body", self.limits.body_timeout_s)}
        if phase in timeouts and not self.transport.is_closing():
            what, seconds = timeouts[phase]
            self._deadline = self.loop.call_later(seconds, self._expire, what, seconds)

    def _expire(self, what: str, seconds: float) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        flag = f"--http-{'header' if what == 'headers' else 'body'}-timeout-seconds"
        peer = "%s:%d" % self.client if self.client else "a client"
        cycle = self.cycle if what == "body" else None
        if cycle is not None and not cycle.response_started or what == "headers" and self._heard:
            log.info("HTTP %s: closed, its request's %s took over %g s (%s)", peer, what, seconds, flag)
            if cycle is not None:  # the route sees the client gone, and what it sends goes nowhere
                cycle.disconnected, cycle.keep_alive = True, False
                cycle.message_event.set()
            message = f"the request's {what} took over {seconds:g} s ({flag})"
            self.transport.write(ApiError(408, message, code="request_timeout").raw())
        self.transport.close()

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None


class HttpServer:
    """uvicorn on a thread of its own, on a socket bound here (so port 0 works and the port is known),
    with ``limits`` on connections and on how long a request may take to arrive."""

    def __init__(
        self,
        app: Callable,
        host: str,
        port: int,
        limits: HttpLimits,
        ssl: dict[str, Any] | None = None,
        grace_s: float = 10.0,
    ) -> None:
        family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        self.socket = socket.socket(family, kind)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind(address)
            self.socket.listen(2048)  # connections queue from now on, before uvicorn's loop accepts them
        except OSError as error:
            self.socket.close()
            reason = error.strerror or str(error)
            raise OSError(cannot_listen("HTTP", f"{host}:{port}", reason, "--http-port", "-1 turns HTTP off")) from error
        self.port = self.socket.getsockname()[1]
        protocol = type("LimitedH11", (_LimitedH11,), {"limits": limits})
        config = uvicorn.Config(
            app, log_level="warning", lifespan="off", timeout_graceful_shutdown=int(grace_s) + 1, http=protocol, **(ssl or {})
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, name="verifier-http", daemon=True)

    def start(self, timeout_s: float = 30.0) -> None:
        """Serve, and return once uvicorn accepts connections (RuntimeError if it never does)."""
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server on port {self.port} did not start")
            time.sleep(0.01)

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        self.socket.close()
