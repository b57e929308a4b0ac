"""What the verifier's two front doors share, with no gRPC and no HTTP in it.

``VerifierService`` holds the engine and scheduler once the model is loaded
(``ready``), checks and queues requests (``submit``, ``submit_group``; a
bad one raises ``InvalidRequest`` naming the engine's field, which each
front door names its own way), cancels them, traces them (``request_span``)
and records how each ended (``recorded``: ``RequestStats``, engine-side
numbers that gRPC turns into its proto and HTTP into JSON). Callers are
identified and limited here too (``ApiKeys``, ``CallerLimit``), and each request
is given its caller's learning scope (``scope_of``: ``verifier_service.serving.scopes``).
``server.py`` (gRPC) and ``openai_api.py`` (HTTP) are thin layers over it.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from opentelemetry import trace
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
from opentelemetry.semconv.attributes import error_attributes
from opentelemetry.trace import SpanKind, Status, StatusCode

from specdec import telemetry
from specdec.limits import PerCaller
from specdec.serving import CERTIFICATE_CALLER
from verifier_service.core.engine import SpeculativeEngine
from verifier_service.core.errors import InvalidRequest
from verifier_service.core.generation import FINISH_CANCELLED, GenerationRequest, GenerationResult
from verifier_service.core.model_loading import cache_root
from verifier_service.core.weights import weights_form
from verifier_service.serving.metrics import PROVIDER, VerifierMetrics
from verifier_service.serving.scheduler import RequestHandle, Scheduler
from verifier_service.serving.scopes import DEFAULT_SCOPE, ScopeIds, load_secret

if TYPE_CHECKING:
    from verifier_service.serving.config import VerifierConfig

# OpenTelemetry's GenAI operation names: a chat (a chat template applied) or a plain completion.
CHAT = gen_ai.GenAiOperationNameValues.CHAT.value
TEXT_COMPLETION = gen_ai.GenAiOperationNameValues.TEXT_COMPLETION.value


@dataclass(frozen=True)
class RequestStats:
    """How a finished request went: the engine's counts and the times the service saw
    (``GenerationStats`` in the proto, ``specdec`` in HTTP answers; the same names)."""

    target_forward_passes: int  # prefill included
    draft_tokens: int  # draft tokens scored by the target
    accepted_tokens: int
    acceptance_rate: float  # accepted_tokens / draft_tokens
    tokens_per_forward_pass: float
    time_to_first_token_ms: float  # from arrival, queueing included
    total_ms: float
    prompt_tokens: int
    generated_tokens: int

    @classmethod
    def combined(cls, parts: Sequence[RequestStats]) -> RequestStats:
        """Requests that make one answer (``n`` choices) as one: counts summed, rates
        recomputed, the first token the earliest, the total the longest."""
        if len(parts) == 1:
            return parts[0]
        passes = sum(part.target_forward_passes for part in parts)
        drafted = sum(part.draft_tokens for part in parts)
        accepted = sum(part.accepted_tokens for part in parts)
        generated = sum(part.generated_tokens for part in parts)
        return cls(
            target_forward_passes=passes,
            draft_tokens=drafted,
            accepted_tokens=accepted,
            acceptance_rate=accepted / drafted if drafted else 0.0,
            tokens_per_forward_pass=generated / passes if passes else 0.0,
            time_to_first_token_ms=min(part.time_to_first_token_ms for part in parts),
            total_ms=max(part.total_ms for part in parts),
            prompt_tokens=parts[0].prompt_tokens,
            generated_tokens=generated,
        )

    def as_dict(self) -> dict:
        return asdict(self)


class ApiKeys:
    """The keys a caller must present, when any are configured. No gRPC and no HTTP here."""

    def __init__(self, keys: Sequence[str], scopes: Sequence[str] = ()) -> None:
        # Compared as digests, so neither a key's length nor where a guess first
        # differs from it shows in the time a check takes.
        self._digests = [hashlib.sha256(key.encode()).digest() for key in keys]
        # The Nth key's learning scope id (verifier_service.serving.scopes), by its caller name.
        self._scopes = {f"api key #{index}": scope for index, scope in enumerate(scopes, 1)}

    def scope(self, caller: str) -> str:
        """The learning scope of a caller ``caller`` named (the default scope for none)."""
        return self._scopes.get(caller, DEFAULT_SCOPE)

    @property
    def required(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def caller(self, token: str | None) -> str | None:
        """ "api key #N" for the Nth configured key, None for anything else. Every key is
        compared, with no early exit, in constant time (hmac.compare_digest)."""
        digest = hashlib.sha256((token or "").encode("utf-8", "surrogatepass")).digest()
        found = None
        for index, key in enumerate(self._digests):
            if hmac.compare_digest(digest, key):
                found = index
        return None if found is None else f"api key #{found + 1}"

    @staticmethod
    def refusal(sent: bool) -> str:
        """What a caller without a valid key is told (never what it sent)."""
        if not sent:
            return (
                "this verifier requires an API key: send 'authorization: Bearer <key>' (an HTTP header, or gRPC "
                "metadata; the CLI client's --api-key or SPECDEC_VERIFIER_API_KEY)"
            )
        return "the API key sent is not one this verifier accepts (its --api-key or --api-key-file): check the key the client sends"


class CallerLimit:
    """Requests in flight per caller, shared by the HTTP and gRPC front doors. No gRPC here.

    limit=2: a caller's third request at once is refused; another caller's is not."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._places = PerCaller(limit)

    def in_flight(self, caller: str) -> int:
        return self._places.in_flight(caller)

    def admit(self, caller: str) -> Callable[[], None] | None:
        """A function that gives the place back (once, however often it is called), or None
        when ``caller`` already has ``limit`` requests in flight."""
        return self._places.hold(caller)

    def refusal(self, caller: str) -> str:
        return (
            f"{caller} has {self._places.in_flight(caller)} requests in flight, the most one caller may "
            f"(--max-requests-per-caller {self.limit}); retry when one ends"
        )


@dataclass
class TracedRequest:
    """A request as traced and measured: its root span and GenAI operation name, when the
    service took it, and its stats once it was answered (``VerifierService.annotate``)."""

    span: Any
    operation: str  # CHAT or TEXT_COMPLETION
    started: float = field(default_factory=time.perf_counter)
    stats: RequestStats | None = None
    finish_reasons: tuple[str, ...] = ()


def longest_token_chars(tokenizer) -> int:
    """Characters of the vocabulary's longest token as the tokenizer spells it, which is at
    least what it stands for: byte-level BPE spells a byte per character ("Ġthe"),
    SentencePiece a character per character ("▁the"), byte fallback "<0xE3>" for a byte."""
    return max(map(len, tokenizer.get_vocab()), default=1)


class VerifierService:
    """Submit, cancel, readiness, spans and results, for any front door (see the module docstring)."""

    def __init__(self, config: VerifierConfig, tracing: telemetry.Tracing, metrics: VerifierMetrics) -> None:
        self.config = config
        self.tracing, self.metrics = tracing, metrics
        self.ready = threading.Event()
        self.engine: SpeculativeEngine | None = None
        self.scheduler: Scheduler | None = None
        entries = config.key_entries()
        # Scopes other than the default need the secret their ids are keyed with.
        scoped = bool(entries) or config.tls_client_ca is not None
        self.scope_ids = ScopeIds(load_secret(config.scope_secret, config.scope_secret_file, cache_root())) if scoped else None
        scopes = [self.scope_ids.of_key(entry.key, entry.scope) for entry in entries] if self.scope_ids is not None else []
        self.keys = ApiKeys([entry.key for entry in entries], scopes)
        # The drafter's id of --shared-scope: every sequence's drafts also read it.
        self.shared_scope = self.scope_ids.of_name(config.shared_scope) if self.scope_ids and config.shared_scope else DEFAULT_SCOPE
        self.callers = CallerLimit(config.max_requests_per_caller)
        self.max_prompt_chars = config.max_prompt_chars or 1

    def attach(self, engine: SpeculativeEngine, scheduler: Scheduler) -> None:
        self.engine, self.scheduler = engine, scheduler
        self.max_prompt_chars = self.config.max_prompt_chars or engine.cache.capacity * (longest_token_chars(engine.tokenizer) + 1)
        self.ready.set()

    def check_prompt_chars(self, chars: int) -> None:
        """``InvalidRequest`` for prompt text longer than --max-prompt-chars, before it costs any tokenizing."""
        if chars > self.max_prompt_chars:
            raise InvalidRequest(
                "prompt_ids",
                f"prompt is {chars} characters; at most {self.max_prompt_chars} fit a request's "
                f"{self.capacity} cache positions (--max-prompt-chars)",
            )

    @contextlib.contextmanager
    def request_span(self, parent, operation: str, error_type: Callable[[BaseException], str]):
        """The request's root span, a child of ``parent`` (the caller's trace context, when it
        sent one), named and described by OpenTelemetry's GenAI conventions ("chat MODEL",
        ``gen_ai.*``) beside our ``specdec.*`` attributes, in a ``TracedRequest``. Not made
        current: the work runs on the scheduler thread (it gets the context through the
        handle), and a stream's generator may be resumed elsewhere.

        On exit the request's GenAI metrics are recorded: its duration, with the
        ``error_type`` of the exception that ended it (each front door names its own:
        a gRPC status, an HTTP status), or "cancelled" when it ended unanswered (the
        client left); and for an answered request its time to first token and per token."""
        model = self.config.model
        attributes = {gen_ai.GEN_AI_OPERATION_NAME: operation, gen_ai.GEN_AI_REQUEST_MODEL: model, gen_ai.GEN_AI_PROVIDER_NAME: PROVIDER}
        span = self.tracing.tracer.start_span(f"{operation} {model}", context=parent, kind=SpanKind.SERVER, attributes=attributes)
        traced = TracedRequest(span, operation)
        failure = ""
        try:
            yield traced
        except BaseException as error:
            if isinstance(error, GeneratorExit):  # a stream the client stopped reading is not an error
                failure = FINISH_CANCELLED
            else:
                failure = error_type(error)
                span.record_exception(error)
                span.set_status(Status(StatusCode.ERROR, str(error)))
                span.set_attribute(error_attributes.ERROR_TYPE, failure)
            raise
        finally:
            span.end()
            self._measure(traced, failure)

    def _measure(self, traced: TracedRequest, failure: str) -> None:
        stats = traced.stats
        if not failure and (stats is None or FINISH_CANCELLED in traced.finish_reasons):
            failure = FINISH_CANCELLED
        if failure or stats is None:
            self.metrics.record_request(traced.operation, time.perf_counter() - traced.started, failure)
            return
        first = stats.time_to_first_token_ms / 1000 if stats.generated_tokens else None
        self.metrics.record_request(traced.operation, stats.total_ms / 1000, first_token_s=first, output_tokens=stats.generated_tokens)

    def finished(self, handle: RequestHandle, result: GenerationResult, traced: TracedRequest) -> RequestStats:
        """Record a finished request in its span and the metrics; its stats."""
        stats = self.recorded(handle, result)
        self.annotate(traced, stats, [result.finish_reason], handle.request.request_id)
        return stats

    def recorded(self, handle: RequestHandle, result: GenerationResult) -> RequestStats:
        """Record a finished sequence (one choice) in the metrics; its stats."""
        self.metrics.record_sequence(result.finish_reason)
        return self._stats(handle, result)

    def annotate(self, traced: TracedRequest, stats: RequestStats, finish_reasons: Sequence[str], response_id: str) -> None:
        """How an answered request ended, in its span (ours and the GenAI conventions'
        attributes, one finish reason a choice) and for its metrics."""
        traced.stats, traced.finish_reasons = stats, tuple(finish_reasons)
        traced.span.set_attributes(
            {
                "specdec.prompt_tokens": stats.prompt_tokens,
                "specdec.generated_tokens": stats.generated_tokens,
                "specdec.forward_passes": stats.target_forward_passes,
                "specdec.draft_tokens": stats.draft_tokens,
                "specdec.accepted": stats.accepted_tokens,
                "specdec.finish_reason": finish_reasons[0],
                gen_ai.GEN_AI_RESPONSE_ID: response_id,
                gen_ai.GEN_AI_RESPONSE_MODEL: self.config.model,
                gen_ai.GEN_AI_RESPONSE_FINISH_REASONS: list(finish_reasons),
                gen_ai.GEN_AI_USAGE_INPUT_TOKENS: stats.prompt_tokens,
                gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS: stats.generated_tokens,
            }
        )

    def scope_of(self, caller: str) -> str:
        """A caller's learning scope: its API key's when keys are configured; else, under
        mutual TLS, its certificate's (caller "certificate NAME"); else the default scope."""
        if self.keys.required:
            return self.keys.scope(caller)
        if self.scope_ids is not None and caller.startswith(CERTIFICATE_CALLER):
            return self.scope_ids.of_certificate(caller.removeprefix(CERTIFICATE_CALLER))
        return DEFAULT_SCOPE

    def submit(self, generation: GenerationRequest, span, caller: str = "") -> RequestHandle:
        """Validate and queue a request from any front door (gRPC, HTTP) for ``caller`` (its
        scope is ``scope_of(caller)``): raises InvalidRequest (the client's to fix), QueueFull
        or ShuttingDown. Call only once ``ready`` is set."""
        generation = replace(generation, scope=self.scope_of(caller))
        self._validate(generation)
        self._annotate_request(generation, span)
        assert self.scheduler is not None  # ready: attach set it
        return self.scheduler.submit(generation, trace.set_span_in_context(span))

    def submit_group(self, generations: list[GenerationRequest], span, caller: str = "") -> list[RequestHandle]:
        """``submit`` for requests that make one answer (HTTP's ``n`` choices): all queued or none."""
        generations = [replace(generation, scope=self.scope_of(caller)) for generation in generations]
        for generation in generations:
            self._validate(generation)
        self._annotate_request(generations[0], span)  # the request as sent: choice 0 has its own seed
        span.set_attributes({"specdec.choices": len(generations), gen_ai.GEN_AI_REQUEST_CHOICE_COUNT: len(generations)})
        assert self.scheduler is not None  # ready: attach set it
        return self.scheduler.submit_group(generations, trace.set_span_in_context(span))

    def _validate(self, generation: GenerationRequest) -> None:
        assert self.engine is not None  # ready: attach set it
        self.engine.validate(generation)

    @staticmethod
    def _annotate_request(generation: GenerationRequest, span) -> None:
        sampling = generation.sampling
        attributes = {
            "specdec.max_new_tokens": generation.max_new_tokens,
            "specdec.greedy": sampling.greedy,
            "specdec.k_requested": -1 if generation.num_speculative_tokens is None else generation.num_speculative_tokens,
            gen_ai.GEN_AI_REQUEST_MAX_TOKENS: generation.max_new_tokens,
            gen_ai.GEN_AI_REQUEST_TEMPERATURE: sampling.temperature,
            gen_ai.GEN_AI_REQUEST_TOP_P: sampling.top_p or 1.0,
            gen_ai.GEN_AI_REQUEST_TOP_K: sampling.top_k,
            gen_ai.GEN_AI_REQUEST_FREQUENCY_PENALTY: sampling.frequency_penalty,
            gen_ai.GEN_AI_REQUEST_PRESENCE_PENALTY: sampling.presence_penalty,
        }
        if sampling.seed is not None and sampling.seed < 1 << 63:  # an attribute is a signed 64-bit integer
            attributes[gen_ai.GEN_AI_REQUEST_SEED] = sampling.seed
        span.set_attributes(attributes)

    # What the front doors read of the loaded model (call once ``ready`` is set).

    @property
    def tokenizer(self):
        assert self.engine is not None
        return self.engine.tokenizer

    @property
    def capacity(self) -> int:
        """Cache positions one request has: its prompt and its output together."""
        assert self.engine is not None
        return self.engine.cache.capacity

    @property
    def precision(self) -> dict[str, Any]:
        """The form the model is served in (``core.forms``): its dtype, its weights' form, torch's
        threads, and whether every pass runs fixed shapes (``--batch-invariant``), which makes a
        token's logits independent of its batch."""
        assert self.engine is not None
        model = self.engine.model
        return {
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "weights": weights_form(model),
            "threads": torch.get_num_threads(),
            "batch_invariant": self.engine.target.invariance is not None,
        }

    @property
    def vocab_size(self) -> int:
        assert self.engine is not None
        return self.engine.vocab_size

    @property
    def max_new_tokens_limit(self) -> int:
        return self.config.engine.max_new_tokens_limit

    @property
    def max_queued(self) -> int:
        assert self.scheduler is not None
        return self.scheduler.config.max_queued

    def cancel(self, handle: RequestHandle) -> None:
        """Free a request's queue place now, or its batch slot at the next step (a no-op once it ended)."""
        assert self.scheduler is not None  # ready: attach set it
        self.scheduler.cancel(handle)

    @staticmethod
    def _stats(handle: RequestHandle, result: GenerationResult) -> RequestStats:
        stats, now = result.stats, time.perf_counter()
        first = handle.first_token_at
        return RequestStats(
            target_forward_passes=stats.target_forward_passes,
            draft_tokens=stats.draft_tokens,
            accepted_tokens=stats.accepted_tokens,
            acceptance_rate=stats.acceptance_rate,
            tokens_per_forward_pass=stats.tokens_per_forward_pass,
            time_to_first_token_ms=1000 * (first - handle.arrived) if first is not None else 0.0,
            total_ms=1000 * (now - handle.arrived),
            prompt_tokens=len(handle.request.prompt_ids),
            generated_tokens=len(result.token_ids),
        )
