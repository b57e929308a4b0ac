"""The verifier as a gRPC service: ``Generate`` and ``GenerateStream`` over one shared batch.

``VerifierServicer`` is the gRPC front door over ``service.VerifierService``,
which the HTTP API (``openai_api``) shares. Requests are checked before any
model work (INVALID_ARGUMENT with a message naming the field), then handed
to the ``Scheduler``, which runs every
in-flight request in one forward pass per step. A full queue answers
RESOURCE_EXHAUSTED at once. A client that cancels, or whose deadline passes,
frees its batch slot at the next step (gRPC's termination callback cancels
the handle).

Callers: with API keys configured (``--api-key``, ``--api-key-file``), both
front doors (gRPC metadata and HTTP headers ``authorization: Bearer <key>``)
require one (UNAUTHENTICATED, HTTP 401); health and reflection stay open.
Each caller (its key; else its client certificate's common name under mutual
TLS; else its address) has at most ``--max-requests-per-caller`` requests in
flight across both front doors (RESOURCE_EXHAUSTED, HTTP 429), so one client
cannot hold every batch slot and queue place. Prompt text is bounded in
characters (``--max-prompt-chars``) before any chat template or tokenizer runs.

Start-up: the port is bound and health says NOT_SERVING while the model
loads, the step-cost model is read from the cache folder (or, the first time,
measured) and a two-token request is decoded as a warm-up; only then SERVING. The drafter is optional: without one (or while
it is away) every step is plain decoding.
"""

from __future__ import annotations

import logging
import secrets
import ssl
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import grpc
import torch
from grpc_health.v1 import health

from specdec import serving, telemetry
from specdec.v1 import verifier_pb2, verifier_pb2_grpc
from specdec.vocabulary import tokenizer_fingerprint
from verifier_service.core.calibration import StepCostModel
from verifier_service.core.engine import SpeculativeEngine
from verifier_service.core.errors import InvalidRequest
from verifier_service.core.forms import load_served
from verifier_service.core.generation import (
    FINISH_CANCELLED,
    FINISH_LENGTH,
    FINISH_STOP,
    SOURCE_DRAFT,
    SOURCE_TARGET,
    GenerationRequest,
    GenerationResult,
    GenerationStats,
)
from verifier_service.core.model_loading import cache_root, chat_prompt_ids, default_device
from verifier_service.core.planner import SOURCE_CONTEXT, SOURCE_GLOBAL, SOURCE_HEAD, SOURCE_SUCCESSOR
from verifier_service.core.processing import TokenLogprob
from verifier_service.core.rejection import SamplingParams
from verifier_service.core.text import IncrementalText
from verifier_service.head.model import find_head
from verifier_service.head.proposer import HeadProposer
from verifier_service.serving.config import VerifierConfig
from verifier_service.serving.drafter_client import RemoteDrafter
from verifier_service.serving.metrics import VerifierMetrics
from verifier_service.serving.observability import ServiceObserver
from verifier_service.serving.openai_api import NO_DRAFTER_WARNING, HttpLimits, HttpServer, OpenAIApi
from verifier_service.serving.scheduler import Cancelled, QueueFull, RequestHandle, Scheduler, ShuttingDown
from verifier_service.serving.service import CHAT, TEXT_COMPLETION, RequestStats, VerifierService

log = logging.getLogger(__name__)

SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name
FINISH_REASONS = {
    FINISH_STOP: verifier_pb2.FINISH_REASON_STOP,
    FINISH_LENGTH: verifier_pb2.FINISH_REASON_LENGTH,
    FINISH_CANCELLED: verifier_pb2.FINISH_REASON_CANCELLED,
}
TOKEN_SOURCES = {
    SOURCE_TARGET: verifier_pb2.TOKEN_SOURCE_TARGET,
    SOURCE_CONTEXT: verifier_pb2.TOKEN_SOURCE_CONTEXT,
    SOURCE_GLOBAL: verifier_pb2.TOKEN_SOURCE_GLOBAL,
    SOURCE_DRAFT: verifier_pb2.TOKEN_SOURCE_DRAFT,
    SOURCE_SUCCESSOR: verifier_pb2.TOKEN_SOURCE_SUCCESSOR,
    SOURCE_HEAD: verifier_pb2.TOKEN_SOURCE_HEAD,
}


# The engine's field names that the proto spells otherwise (InvalidRequest.field -> GenerateRequest's).
GRPC_FIELDS = {"prompt_ids": "prompt_token_ids"}


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    """gRPC's front door: the proto in and out, callers from metadata, and status codes;
    the rest is ``service``'s, shared with the HTTP API."""

    def __init__(self, service: VerifierService) -> None:
        self.service = service

    # -- RPCs ---------------------------------------------------------------------

    def Generate(self, request, context):
        caller = self._admit(context)
        with self._request_span(request, context) as traced:
            handle = self._submit(request, context, traced.span, caller)
            result = self._result(handle, context)
            stats = self.service.finished(handle, result, traced)
            return verifier_pb2.GenerateResponse(
                text=result.text,
                token_ids=result.token_ids,
                finish_reason=FINISH_REASONS[result.finish_reason],
                stats=proto_stats(stats),
                logprobs=proto_logprobs(result.logprobs or ()),
            )

    def GenerateStream(self, request, context):
        caller = self._admit(context)
        with self._request_span(request, context) as traced:
            handle = self._submit(request, context, traced.span, caller)
            text = IncrementalText(self.service.tokenizer, handle.request.stop)
            for chunk in handle.stream():
                sources = [TOKEN_SOURCES[source] for source in chunk.sources]
                yield verifier_pb2.GenerateChunk(
                    text=text.push(chunk.tokens),
                    token_ids=chunk.tokens,
                    token_sources=sources,
                    logprobs=proto_logprobs(chunk.logprobs),
                    rejected_token_ids=[draft.token for draft in chunk.rejected],
                    rejected_token_sources=[TOKEN_SOURCES[draft.source] for draft in chunk.rejected],
                )
            result = self._result(handle, context)
            stats = proto_stats(self.service.finished(handle, result, traced))
            yield verifier_pb2.GenerateChunk(text=text.finish(result.text), finish_reason=FINISH_REASONS[result.finish_reason], stats=stats)

    # -- helpers --------------------------------------------------------------------

    def _request_span(self, request, context):
        """The service's request span; a request that fails is measured by its status code's name."""

        def error_type(error: BaseException) -> str:
            code = context.code()  # set by abort; None when something else raised
            return code.name if isinstance(code, grpc.StatusCode) else type(error).__qualname__

        return self.service.request_span(telemetry.incoming_context(context), CHAT if request.chat else TEXT_COMPLETION, error_type)

    def _admit(self, context) -> str:
        """The call's caller, checked (UNAUTHENTICATED without a valid key when keys are
        configured) and admitted under --max-requests-per-caller (RESOURCE_EXHAUSTED beyond)
        until the call ends."""
        caller = self._caller(context)
        callers = self.service.callers
        release = callers.admit(caller)
        if release is None:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, callers.refusal(caller))
            raise AssertionError("abort raises")  # for the type checker
        if not context.add_callback(release):  # the call already ended
            release()
        return caller

    def _caller(self, context) -> str:
        """Who calls: the API key when keys are configured; else the client certificate's
        common name under mutual TLS; else the peer's host (its port changes per connection)."""
        keys = self.service.keys
        if keys.required:
            values = [value for name, value in context.invocation_metadata() if name == "authorization"]
            token = serving.bearer(values[0]) if values else None
            caller = keys.caller(token)
            if caller is None:
                context.abort(grpc.StatusCode.UNAUTHENTICATED, keys.refusal(bool(values)))
                raise AssertionError("abort raises")  # for the type checker
            return caller
        return serving.caller_identity(context)

    def _submit(self, request, context, span, caller: str) -> RequestHandle:
        if not self.service.ready.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry when health reports SERVING")
        try:
            handle = self.service.submit(self._generation_request(request), span, caller)
        except InvalidRequest as error:  # the engine's rules and the proto's shape: the client's to fix
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, error.named(GRPC_FIELDS.get(error.field, error.field)))
        except QueueFull as error:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
        except ShuttingDown as error:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        service = self.service
        # On cancel, deadline, or completion; False when the call already ended
        # (the client gave up while we validated): free the slot at once.
        if not context.add_callback(lambda: service.cancel(handle)):
            service.cancel(handle)
        return handle

    def _result(self, handle: RequestHandle, context) -> GenerationResult:
        try:
            return handle.result()
        except Cancelled:  # while queued: the caller is gone, so this answer is never read
            return GenerationResult(handle.request.request_id, [], "", FINISH_CANCELLED, GenerationStats())
        except Exception as error:  # what failed this request alone (the engine isolates it)
            context.abort(grpc.StatusCode.INTERNAL, f"generation failed: {error}")
            raise  # abort raises; this line is for the type checker

    def _generation_request(self, request) -> GenerationRequest:
        """The proto as a GenerationRequest: only what the proto's shape decides (which prompt
        field, chat) is checked here; every other rule is the engine's ``validate``."""
        has_ids = len(request.prompt_token_ids) > 0
        if request.prompt and has_ids:
            raise InvalidRequest("prompt_ids", "set either prompt or prompt_token_ids, not both")
        if not request.prompt and not has_ids:
            raise InvalidRequest("prompt_ids", "prompt is empty: set prompt (text) or prompt_token_ids")
        if has_ids and request.chat:
            raise InvalidRequest("prompt_ids", "chat applies to a text prompt; prompt_token_ids are used as given")
        tokenizer = self.service.tokenizer
        self.service.check_prompt_chars(len(request.prompt))
        self.service.config.engine.check_logit_bias_count(len(request.logit_bias))  # before the map is converted
        if has_ids:
            prompt_ids = list(request.prompt_token_ids)
        elif request.chat:
            prompt_ids = chat_prompt_ids(tokenizer, request.prompt)
        else:
            prompt_ids = tokenizer(request.prompt).input_ids
        sampling = SamplingParams(
            temperature=float(request.temperature),
            top_k=request.top_k,
            top_p=float(request.top_p),
            seed=request.seed if request.HasField("seed") else None,
            presence_penalty=float(request.presence_penalty),
            frequency_penalty=float(request.frequency_penalty),
            repetition_penalty=float(request.repetition_penalty) if request.HasField("repetition_penalty") else 1.0,
            logit_bias=tuple(sorted((int(token), float(bias)) for token, bias in request.logit_bias.items())),
            min_tokens=request.min_tokens,
        )
        k = request.num_speculative_tokens if request.HasField("num_speculative_tokens") else None
        logprobs = request.logprobs if request.HasField("logprobs") else None
        request_id = f"grpc-{secrets.token_hex(6)}"  # for logs and the span's gen_ai.response.id, as HTTP's "http-..."
        return GenerationRequest(
            prompt_ids, request.max_new_tokens, sampling, tuple(request.stop), k, request_id=request_id, logprobs=logprobs
        )


@dataclass
class VerifierServer:
    server: grpc.Server
    port: int
    service: VerifierService
    health: health.HealthServicer
    drafter: RemoteDrafter | None = None
    metrics_port: int | None = None  # where /metrics is served; None: not served
    health_port: int | None = None  # where the health-only server listens; None: not served
    _metrics_server: Any = None  # telemetry.start_metrics_server's HTTP server
    _health_server: grpc.Server | None = None
    http: HttpServer | None = None  # the OpenAI-compatible API; None: off
    guard: serving.AuxiliaryStreamGuard | None = None  # the service port's reflection and health Watch streams

    @property
    def http_port(self) -> int | None:
        return None if self.http is None else self.http.port

    def load(self) -> None:
        """Load the model, choose its form (``core.forms``), calibrate and warm up, start the
        scheduler, then report SERVING."""
        config = self.service.config
        started = time.perf_counter()
        device = torch.device(config.device) if config.device else default_device()
        # The chosen form and the step-cost calibration are kept for later starts (--calibration-cache);
        # --no-calibrate measures neither.
        cache = cache_root() if config.calibration_cache else None
        loaded, form = load_served(
            config.model,
            device,
            config.dtype,
            config.weights,
            config.threads,
            config.engine,
            cache / "forms" if cache else None,
            config.calibrate,
        )
        model = loaded.model
        torch.set_grad_enabled(False)
        # Uncalibrated: every step costs the same (as on an idle GPU), refined by real step times.
        step_cost = None if config.calibrate else StepCostModel({1: 1.0, 1024: 1.0})
        if config.drafter.target:
            link = replace(config.drafter, vocabulary=tokenizer_fingerprint(loaded.tokenizer), shared_scope=self.service.shared_scope)
            drafter = self.drafter = RemoteDrafter(link)
            self.service.metrics.watch(
                "drafter_fallbacks", "Steps run without drafts because the drafter failed or was backed off", lambda: drafter.fallbacks
            )
            self.service.metrics.watch(
                "dropped_observations",
                "Finished sequences never observed (the drafter was away too long)",
                lambda: drafter.dropped_observations,
            )
            self.service.metrics.watch(
                "drafter_failovers", "Moves from a failed drafter replica to another (--drafter lists several)", lambda: drafter.failovers
            )
            self.service.metrics.watch_gauge(
                "drafter_replica", "Position in --drafter of the drafter replica in use, from 0", lambda: drafter.replica_index
            )
        observer = ServiceObserver(self.service.tracing, self.service.metrics)
        proposer = observer.traced(self.drafter) if self.drafter is not None else None
        folder = cache / "calibration" if cache else None
        head = find_head(config.draft_head, model, loaded.tokenizer, config.draft_head_vocabulary)
        beside = [HeadProposer(head, config.draft_head_depth)] if head is not None else []
        engine = SpeculativeEngine(model, loaded.tokenizer, proposer, config.engine, step_cost, folder, beside)
        # Warm-up: a prefill and a one-token pass, the two shapes every request starts with.
        engine.generate([GenerationRequest([0, 1, 2, 3], 2, num_speculative_tokens=0)])
        scheduler = Scheduler(engine, config.scheduler, observer)
        self.service.metrics.queue_depth.set_function(lambda: scheduler.queue_depth)
        self.service.metrics.active_sequences.set_function(lambda: scheduler.batch_size)
        self.service.metrics.watch_cache_usage(engine.cache_usage)
        scheduler.start()
        self.service.attach(engine, scheduler)
        serving.set_serving(self.health, SERVICE_NAME, True)
        self.service.metrics.describe_form(self.service.precision)
        log.info("model %s (%s) ready on %s in %.1fs", config.model, form, engine.device, time.perf_counter() - started)

    def stop(self, grace: float | None = None) -> bool:
        """NOT_SERVING, drain in-flight requests for up to ``grace`` seconds, then stop."""
        grace = self.service.config.grace_s if grace is None else grace
        self.health.enter_graceful_shutdown()
        drained = True
        if self.service.scheduler is not None:
            drained = self.service.scheduler.stop(grace)
        if self.http is not None:
            self.http.stop()
        self.server.stop(1.0).wait()
        if self._health_server is not None:
            self._health_server.stop(0).wait()
        if self.drafter is not None:
            self.drafter.stop()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        if self.guard is not None:
            self.guard.stop()
        self.service.tracing.shutdown()
        return drained


def proto_stats(stats: RequestStats) -> verifier_pb2.GenerationStats:
    return verifier_pb2.GenerationStats(**stats.as_dict())


def proto_logprobs(items: Iterable[TokenLogprob]) -> list[verifier_pb2.TokenLogprob]:
    return [
        verifier_pb2.TokenLogprob(
            token_id=item.token,
            logprob=item.logprob,
            top=[verifier_pb2.TopLogprob(token_id=token, logprob=value) for token, value in item.top],
        )
        for item in items
    ]


def create_server(config: VerifierConfig) -> VerifierServer:
    """Bind the port with health NOT_SERVING; call ``load()`` to bring the model up."""
    # One worker per request that may be running or queued, plus 8 for health Check and other
    # short calls. Reflection and health Watch streams run on threads of their own
    # (--max-auxiliary-streams, serving.grpc_server), so idle streams take no request's slot.
    workers = config.engine.max_batch_size + config.scheduler.max_queued + 8
    server, guard = serving.grpc_server(config.connections, workers, workers, config.max_message_bytes)
    health_servicer = serving.add_health_and_reflection(server, SERVICE_NAME)
    tracing = telemetry.Tracing("specdec-verifier")
    metrics = VerifierMetrics(config.model)
    metrics.watch("dropped_spans", "Trace spans dropped (collector down or queue full)", lambda: tracing.dropped_spans)
    service = VerifierService(config, tracing, metrics)
    verifier_pb2_grpc.add_VerifierServicer_to_server(VerifierServicer(service), server)
    port = serving.bind(server, config.host, config.port, config.tls_cert, config.tls_key, config.tls_client_ca)
    server.start()
    verifier = VerifierServer(server, port, service, health_servicer, guard=guard)
    try:  # a port taken or refused: the gRPC port, already serving, is let go with the rest
        metrics.watch("auxiliary_streams_refused", "Reflection and health Watch streams refused for want of a slot", lambda: guard.refused)
        metrics.watch("auxiliary_streams_ended_idle", "Reflection and health Watch streams ended for silence", lambda: guard.ended_idle)
        if config.health_port is not None:
            verifier._health_server, verifier.health_port = serving.serve_health(health_servicer, config.host, config.health_port)
        if config.metrics_port is not None:
            metrics_server = telemetry.start_metrics_server(metrics.registry, config.host, config.metrics_port)
            verifier._metrics_server, verifier.metrics_port = metrics_server
        if config.http_port >= 0:
            names = config.served_names()
            api = OpenAIApi(service, names[0], names[1:])
            limits = HttpLimits(config.max_http_connections, config.http_header_timeout_s, config.http_body_timeout_s)
            verifier.http = HttpServer(api.app, config.host, config.http_port, limits, http_tls(config), config.grace_s)
            verifier.http.start()
    except BaseException:
        verifier.stop(0)
        raise
    if service.keys.required:
        log.info("API keys required (%d configured) on /v1 and gRPC Generate/GenerateStream", len(service.keys))
    else:
        log.info("no API keys configured: /v1 and gRPC Generate/GenerateStream are open to any caller that reaches the port")
    if config.drafter.target is None and config.draft_head == "none":
        log.warning("%s; start a drafter and give its address", NO_DRAFTER_WARNING)
    return verifier


def http_tls(config: VerifierConfig) -> dict[str, Any]:
    """uvicorn's TLS settings from the service's: the same certificate, and client certificates when gRPC requires them."""
    if not config.tls_cert:
        return {}
    settings: dict[str, Any] = {"ssl_certfile": config.tls_cert, "ssl_keyfile": config.tls_key}
    if config.tls_client_ca:
        settings |= {"ssl_ca_certs": config.tls_client_ca, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    return settings
