"""An OpenAI-compatible HTTP API in front of the verifier's scheduler.

``POST /v1/chat/completions`` and ``POST /v1/completions`` (streaming as
server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``),
``GET /v1/models`` and ``GET /health``, served by uvicorn on a thread of
its own beside the gRPC server. Requests go into the same ``Scheduler`` as
gRPC's, so HTTP and gRPC requests share batches, and through the same
validation (``SpeculativeEngine.validate``), spans and metrics.

What OpenAI's API says is followed where it has a rule: ``temperature``
defaults to 1 (sampling; 0 is greedy), ``/v1/completions``' ``max_tokens``
to 16, chat's to what the request's cache room and ``--max-new-tokens-limit``
allow; ``n`` must be 1. Errors have OpenAI's shape, ``{"error": {"message",
"type", "param", "code"}}``: 400 naming the field in ``param``, 404 for
another model, 429 for a full queue, 503 while the model loads or the
server drains. Beyond OpenAI's fields, a request may set
``num_speculative_tokens`` (K; 0 decodes plainly, unset is adaptive) and
``top_k``; responses carry a ``specdec`` object (forward passes, drafted,
accepted, acceptance, tokens per pass), which OpenAI's clients keep as an
extra field, and each streamed chunk's ``specdec`` lists its tokens with
the text each added and where each came from (``sources``).

A client that disconnects frees its batch slot at the next step, as a
cancelled gRPC call does.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import uvicorn
from google.protobuf import json_format
from opentelemetry import propagate
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from verifier_service.engine import FINISH_LENGTH, GenerationRequest
from verifier_service.model_loading import chat_ids
from verifier_service.rejection import SamplingParams
from verifier_service.scheduler import QueueFull, RequestHandle, ShuttingDown, TokenChunk
from verifier_service.text import IncrementalDecoder, IncrementalText

log = logging.getLogger(__name__)

VIEW = Path(__file__).parent / "static" / "index.html"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# Our fields that a ValueError from the engine's validate may name -> OpenAI's parameter.
PARAMS = {
    "max_new_tokens": "max_tokens",
    "num_speculative_tokens": "num_speculative_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "stop": "stop",
    "prompt": "prompt",
    "token ids": "prompt",
}


class ApiError(Exception):
    """An answer in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


def _take(body: dict, name: str, kinds: tuple[type, ...], what: str, default: Any = None) -> Any:
    """``body[name]`` when it has one of ``kinds`` (a bool is not a number), ``default`` when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise ApiError(400, f"{name} must be {what}, got {json.dumps(value)[:80]}", param=name)
    return value


def _float(body: dict, name: str, default: float) -> float:
    """``body[name]`` as a float; a JSON integer too large for one is the client's error, not ours."""
    try:
        return float(_take(body, name, (int, float), "a number", default))
    except OverflowError:
        raise ApiError(400, f"{name} must be a finite number; this integer is too large for one", param=name) from None


class OpenAIApi:
    """The routes, over a ``VerifierServicer`` (its engine, scheduler, tracing and metrics)."""

    def __init__(self, servicer, model_id: str) -> None:
        self.servicer = servicer
        self.model_id = model_id
        self.created = int(time.time())
        self.page = VIEW.read_text(encoding="utf-8")
        # Waiting on a request's tokens blocks a thread: one per request that may be running or queued.
        config = servicer.config
        self.limiter = anyio.CapacityLimiter(config.engine.max_batch_size + config.scheduler.max_queued + 8)
        self.app = Starlette(
            routes=[
                Route("/", self.view, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            ],
            exception_handlers={
                ApiError: lambda request, error: error.response(),
                HTTPException: lambda request, error: ApiError(error.status_code, str(error.detail)).response(),
            },
        )

    # -- routes -------------------------------------------------------------------

    async def view(self, request: Request) -> Response:
        """The live view: one static page that streams a chat completion and colours each token by its source."""
        return HTMLResponse(self.page)

    async def health(self, request: Request) -> Response:
        if not self.servicer.ready.is_set():
            raise ApiError(503, "the model is still loading", kind="server_error", code="loading")
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        model = {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "specdec"}
        return JSONResponse({"object": "list", "data": [model]})

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    # -- one request --------------------------------------------------------------------

    async def _serve(self, request: Request, chat: bool) -> Response:
        if not self.servicer.ready.is_set():
            raise ApiError(503, "the model is still loading; retry when GET /health answers 200", kind="server_error", code="loading")
        received = await self._body(request)
        # Parsing, chat templates and tokenizing up to --max-message-bytes take a worker
        # thread, so the event loop keeps serving the other requests' streams meanwhile.
        generation, stream, include_usage = await anyio.to_thread.run_sync(self._parse, received, chat, limiter=self.limiter)
        span_context = self.servicer.request_span(propagate.extract(dict(request.headers)))
        span = span_context.__enter__()
        try:
            handle = self._submit(generation, span)
        except BaseException as error:
            span_context.__exit__(type(error), error, error.__traceback__)
            raise
        reply = _Reply(self, handle, chat, span, span_context)
        if stream:
            return _EventStream(self._events(reply, include_usage), reply.close)
        try:
            return JSONResponse(await self._complete(request, reply))
        except BaseException as error:
            reply.close(error)
            raise
        finally:
            reply.close()

    async def _body(self, request: Request) -> bytearray:
        """The body, read up to --max-message-bytes (413 beyond it)."""
        limit, received = self.servicer.config.max_message_bytes, bytearray()
        async for part in request.stream():
            received += part
            if len(received) > limit:
                raise ApiError(413, f"the body is over {limit} bytes (--max-message-bytes)", code="body_too_large")
        return received

    def _parse(self, received: bytearray, chat: bool) -> tuple[GenerationRequest, bool, bool]:
        """(the request, stream, stream_options.include_usage) from a JSON body."""
        try:
            body = json.loads(received)
        except ValueError:
            raise ApiError(400, "the body must be a JSON object") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        generation = self._generation_request(body, chat)
        stream = _take(body, "stream", (bool,), "true or false", False)
        options = _take(body, "stream_options", (dict,), "an object", {})
        return generation, stream, _take(options, "include_usage", (bool,), "true or false", False)

    def _submit(self, generation: GenerationRequest, span) -> RequestHandle:
        try:
            return self.servicer.submit(generation, span)
        except ValueError as error:
            message = str(error).replace("max_new_tokens", "max_tokens")
            param = next((PARAMS[name] for name in PARAMS if str(error).startswith(name)), None)
            raise ApiError(400, message, param=param) from None
        except QueueFull as error:
            raise ApiError(429, str(error), kind="rate_limit_error", code="queue_full") from None
        except ShuttingDown as error:
            raise ApiError(503, str(error), kind="server_error", code="shutting_down") from None

    async def _complete(self, request: Request, reply: _Reply) -> dict:
        """The whole answer; a client that disconnects first cancels the request."""
        scheduler = self.servicer.scheduler

        async def cancel_on_disconnect() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            scheduler.cancel(reply.handle)

        async with anyio.create_task_group() as group:
            group.start_soon(cancel_on_disconnect)
            result = await anyio.to_thread.run_sync(reply.result, abandon_on_cancel=True, limiter=self.limiter)
            group.cancel_scope.cancel()
        return reply.whole(result, self.servicer.finished(reply.handle, result, reply.span))

    async def _events(self, reply: _Reply, include_usage: bool) -> AsyncIterator[str]:
        """The SSE data lines; a disconnect cancels this generator, and the request with it
        (``_EventStream`` closes the reply however the stream ends, even before it began)."""
        try:
            if reply.chat:
                yield json.dumps(reply.first_chunk())
            tokens = iter(reply.handle.stream())
            while (piece := await anyio.to_thread.run_sync(next, tokens, None, abandon_on_cancel=True, limiter=self.limiter)) is not None:
                yield json.dumps(reply.token_chunk(piece))
            try:
                result = reply.result()
            except ApiError as error:  # the request failed after its stream began: say so in the stream
                reply.close(error)
                yield json.dumps({"error": {"message": error.message, "type": error.kind, "param": None, "code": error.code}})
                return
            stats = self.servicer.finished(reply.handle, result, reply.span)
            yield json.dumps(reply.final_chunk(result, stats, include_usage))
            if include_usage:
                yield json.dumps(reply.usage_chunk(result))
            yield "[DONE]"
        except BaseException as error:
            reply.close(error)
            raise

    # -- the request ----------------------------------------------------------------------

    def _generation_request(self, body: dict, chat: bool) -> GenerationRequest:
        model = _take(body, "model", (str,), "a string")
        if model is not None and model != self.model_id:
            raise ApiError(
                404, f"model {model!r} is not served here; GET /v1/models lists {self.model_id!r}", "model", code="model_not_found"
            )
        if _take(body, "n", (int,), "an integer", 1) != 1:
            raise ApiError(400, "n must be 1: this server returns one choice per request", param="n")
        prompt_ids = self._chat_prompt(body) if chat else self._completion_prompt(body)
        engine = self.servicer.engine
        if chat:
            room = engine.cache.capacity - len(prompt_ids)
            default_max = max(1, min(engine.config.max_new_tokens_limit, room))
            max_tokens = _take(body, "max_completion_tokens", (int,), "an integer", None)
            if max_tokens is None:
                max_tokens = _take(body, "max_tokens", (int,), "an integer", default_max)
        else:
            max_tokens = _take(body, "max_tokens", (int,), "an integer", COMPLETIONS_DEFAULT_MAX_TOKENS)
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        elif stop is None:
            stop = []
        elif not isinstance(stop, list) or not all(isinstance(item, str) for item in stop):
            raise ApiError(400, "stop must be a string or a list of strings", param="stop")
        seed = _take(body, "seed", (int,), "an integer")
        if seed is not None and not 0 <= seed < 1 << 64:
            raise ApiError(400, f"seed must be in [0, 2**64), got {seed}", param="seed")
        sampling = SamplingParams(
            temperature=_float(body, "temperature", 1.0),
            top_k=_take(body, "top_k", (int,), "an integer", 0),
            top_p=_float(body, "top_p", 1.0),
            seed=seed,
        )
        k = _take(body, "num_speculative_tokens", (int,), "an integer (unset: adaptive)")
        return GenerationRequest(prompt_ids, max_tokens, sampling, tuple(stop), k, request_id=f"http-{secrets.token_hex(6)}")

    def _chat_prompt(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
        plain = []
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
                raise ApiError(400, f"messages[{index}] needs a role, one of {list(CHAT_ROLES)}", param="messages")
            content = message.get("content")
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in content):
                    raise ApiError(400, f"messages[{index}].content: only text parts are supported", param="messages")
                content = "".join(part["text"] for part in content)
            if not isinstance(content, str):
                raise ApiError(400, f"messages[{index}].content must be a string or a list of text parts", param="messages")
            plain.append({"role": message["role"], "content": content})
        tokenizer = self.servicer.engine.tokenizer
        if not tokenizer.chat_template:
            raise ApiError(400, "this model has no chat template; use /v1/completions", param="messages")
        try:
            return chat_ids(tokenizer, plain)
        except Exception as error:  # the template's own rules (role order, ...)
            raise ApiError(400, f"the chat template refused these messages: {error}", param="messages") from None

    def _completion_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return list(self.servicer.engine.tokenizer(prompt).input_ids)
        if isinstance(prompt, list) and all(isinstance(token, int) and not isinstance(token, bool) for token in prompt):
            return prompt
        raise ApiError(400, "prompt must be a string or a list of token ids (one prompt per request)", param="prompt")


class _EventStream(EventSourceResponse):
    """Server-sent events (sse-starlette's framing, a comment every 15 s to keep proxies from
    timing out) that call ``on_close`` however the response ends: finished, failed, or the
    client gone, even before the first event."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, ping=15)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class _Reply:
    """One request's answer as OpenAI objects: chunks while it streams, or the whole."""

    def __init__(self, api: OpenAIApi, handle: RequestHandle, chat: bool, span, span_context) -> None:
        self.api, self.handle, self.chat, self.span = api, handle, chat, span
        self._span_context = span_context  # servicer.request_span's, entered
        self._closed = False
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.object = "chat.completion.chunk" if chat else "text_completion"
        self.text = _StreamText(api.servicer.engine.tokenizer, handle.request.stop)

    def close(self, error: BaseException | None = None) -> None:
        """Once: cancel the request (a no-op once it ended; it frees the slot of a client that
        left) and end its span, with ``error`` unless that is the client going away."""
        if self._closed:
            return
        self._closed = True
        self.api.servicer.scheduler.cancel(self.handle)
        if error is None or isinstance(error, anyio.get_cancelled_exc_class() | GeneratorExit):
            self._span_context.__exit__(None, None, None)
        else:
            self._span_context.__exit__(type(error), error, error.__traceback__)

    def result(self):
        try:
            return self.handle.result()
        except Exception as error:  # Cancelled (the client left) or what failed this request alone
            raise ApiError(500, f"generation failed: {error}", kind="server_error") from None

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": int(time.time()), "model": self.api.model_id, "choices": choices}

    def _choice(self, text: str | None, finish_reason: str | None, role: bool = False) -> dict:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}

    def first_chunk(self) -> dict:
        """Chat streams open with the assistant's role, as OpenAI's do."""
        return self._envelope(self.object, [self._choice("", None, role=True)])

    def token_chunk(self, chunk: TokenChunk) -> dict:
        delta, pieces = self.text.push(chunk.tokens)
        extra = {"token_ids": chunk.tokens, "token_texts": pieces, "sources": chunk.sources, "verified": chunk.verified}
        return self._envelope(self.object, [self._choice(delta, None)]) | {"specdec": extra}

    def final_chunk(self, result, stats, usage: bool) -> dict:
        out = self._envelope(self.object, [self._choice(self.text.finish(result.text), _finish(result))])
        out["specdec"] = _speculation(stats)
        if usage:
            out["usage"] = None  # OpenAI: null on every chunk but the last, which carries it alone
        return out

    def usage_chunk(self, result) -> dict:
        return self._envelope(self.object, []) | {"usage": _usage(self.handle, result)}

    def whole(self, result, stats) -> dict:
        obj = "chat.completion" if self.chat else "text_completion"
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text}, "logprobs": None}
        else:
            choice = {"index": 0, "text": result.text, "logprobs": None}
        choice["finish_reason"] = _finish(result)
        return self._envelope(obj, [choice]) | {"usage": _usage(self.handle, result), "specdec": _speculation(stats)}


class _StreamText:
    """Text deltas safe to send (``text.IncrementalText``, as gRPC's stream), and the text each token added."""

    def __init__(self, tokenizer, stop: tuple[str, ...]) -> None:
        self.text = IncrementalText(tokenizer, stop)
        self.pieces = IncrementalDecoder(tokenizer)

    def push(self, tokens: list[int]) -> tuple[str, list[str]]:
        return self.text.push(tokens), [self.pieces.push([token]) for token in tokens]

    def finish(self, final_text: str) -> str:
        return self.text.finish(final_text)


def _finish(result) -> str:
    return "length" if result.finish_reason == FINISH_LENGTH else "stop"


def _usage(handle: RequestHandle, result) -> dict:
    prompt, completion = len(handle.request.prompt_ids), len(result.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _speculation(stats) -> dict:
    """The gRPC GenerationStats, under OpenAI-style snake_case names."""
    return json_format.MessageToDict(stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


class HttpServer:
    """uvicorn on a thread of its own, on a socket bound here (so port 0 works and the port is known)."""

    def __init__(self, app: Callable, host: str, port: int, ssl: dict[str, Any] | None = None, grace_s: float = 10.0) -> None:
        family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        self.socket = socket.socket(family, kind)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind(address)
            self.socket.listen(2048)  # connections queue from now on, before uvicorn's loop accepts them
        except OSError:
            self.socket.close()
            raise
        self.port = self.socket.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=int(grace_s) + 1, **(ssl or {}))
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
