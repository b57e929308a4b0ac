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

import ipaddress
import logging
import re
import secrets
import ssl
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import torch
from grpc_health.v1 import health

from specdec import serving, settings, telemetry
from specdec.flags import nested, setting
from specdec.limits import ConnectionLimits
from specdec.v1 import verifier_pb2, verifier_pb2_grpc
from specdec.vocabulary import tokenizer_fingerprint
from verifier_service.adaptive import SOURCE_CONTEXT, SOURCE_GLOBAL, SOURCE_HEAD, SOURCE_SUCCESSOR
from verifier_service.calibration import StepCostModel
from verifier_service.draft_head import DEFAULT_HEAD_VOCABULARY, find_head
from verifier_service.drafter_client import DrafterClientConfig, RemoteDrafter
from verifier_service.engine import EngineConfig, SpeculativeEngine
from verifier_service.errors import InvalidRequest
from verifier_service.generation import (
    FINISH_CANCELLED,
    FINISH_LENGTH,
    FINISH_STOP,
    SOURCE_DRAFT,
    SOURCE_TARGET,
    GenerationRequest,
    GenerationResult,
    GenerationStats,
)
from verifier_service.metrics import VerifierMetrics
from verifier_service.model_loading import DEFAULT_MODEL, DEFAULT_MODEL_HUB_NAME, cache_root, chat_prompt_ids, load_model
from verifier_service.observability import ServiceObserver
from verifier_service.openai_api import NO_DRAFTER_WARNING, HttpLimits, HttpServer, OpenAIApi, host_name
from verifier_service.processing import TokenLogprob
from verifier_service.rejection import SamplingParams
from verifier_service.scheduler import Cancelled, QueueFull, RequestHandle, Scheduler, SchedulerConfig, ShuttingDown
from verifier_service.scopes import KeyEntry, given_secret, parse_key_line
from verifier_service.service import CHAT, TEXT_COMPLETION, RequestStats, VerifierService
from verifier_service.text import IncrementalText

log = logging.getLogger(__name__)

SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name
FINISH_REASONS = {
    FINISH_STOP: verifier_pb2.FINISH_REASON_STOP,
    FINISH_LENGTH: verifier_pb2.FINISH_REASON_LENGTH,
    FINISH_CANCELLED: verifier_pb2.FINISH_REASON_CANCELLED,
}
DEFAULT_METRICS_PORT = 9102  # the drafter's is 9101
TOKEN_SOURCES = {
    SOURCE_TARGET: verifier_pb2.TOKEN_SOURCE_TARGET,
    SOURCE_CONTEXT: verifier_pb2.TOKEN_SOURCE_CONTEXT,
    SOURCE_GLOBAL: verifier_pb2.TOKEN_SOURCE_GLOBAL,
    SOURCE_DRAFT: verifier_pb2.TOKEN_SOURCE_DRAFT,
    SOURCE_SUCCESSOR: verifier_pb2.TOKEN_SOURCE_SUCCESSOR,
    SOURCE_HEAD: verifier_pb2.TOKEN_SOURCE_HEAD,
}


# --help groups (specdec.flags).
SERVER, MODEL, DRAFTER, HTTP = "server", "model", "drafter (--drafter HOST:PORT)", "HTTP API"
CALLERS, ENGINE, CONNECTIONS = "callers, API keys and learning scopes", "engine and batching", "gRPC connections"


@dataclass(frozen=True)
class VerifierConfig:
    """The service's settings, the engine's and the scheduler's nested: each field is a flag
    and a SPECDEC_VERIFIER_* variable (``specdec.flags``)."""

    port: int = setting(50052, group=SERVER, help="gRPC port (0: a free one)")
    host: str = setting("127.0.0.1", group=SERVER, help="address to bind")
    model: str = setting(DEFAULT_MODEL, group=MODEL, help="the embedded default, or any Hugging Face causal LM path or name")
    # vLLM's flag: clients name the model as they know it.
    served_model_name: str | None = setting(
        None,
        group=MODEL,
        help="names the HTTP API answers to, comma-separated; the first is the one it reports (none: --model, and for the "
        f"default model also {DEFAULT_MODEL_HUB_NAME})",
    )
    device: str | None = setting(None, group=MODEL, help="cpu, cuda, cuda:1 (none: CUDA when present, else CPU)")
    # float32 keeps greedy output identical to transformers' own; see model_loading.DTYPES.
    dtype: str = setting(
        "float32",
        group=MODEL,
        choices=["float32", "bfloat16", "auto"],
        help="weights and activations (auto: bfloat16 where the hardware has native bf16: GPUs, AMX or AVX512-BF16 CPUs)",
    )
    # Trained by python -m verifier_service.train_head; refused when trained on another model.
    # Off by default: on a 2-core CPU it pays for one sequence but not yet for 16
    # (docs/benchmarks.md: the draft head), and a default must not slow any batch down.
    draft_head: str = setting(
        "none",
        group=MODEL,
        help="a trained draft head's folder; auto: the one trained for this model in the cache folder "
        "($SPECDEC_CACHE_DIR/draft-heads), if there is one; none: no head",
    )
    draft_head_vocabulary: int = setting(
        DEFAULT_HEAD_VOCABULARY,
        group=MODEL,
        minimum=0,
        formerly=["head-vocabulary"],
        help="the draft head drafts only its this many most frequent tokens (0: all it was trained on): fewer weights read a level",
    )
    # How the verifier reaches the drafter: --drafter HOST:PORT and the --drafter-* flags.
    drafter: DrafterClientConfig = nested(DrafterClientConfig, prefix="drafter-", group=DRAFTER)
    # A 4K-token prompt as ids is ~20 KB.
    max_message_bytes: int = setting(serving.MAX_MESSAGE_BYTES, group=SERVER, minimum=1, help="gRPC message size cap, both ways")
    grace_s: float = setting(10.0, group=SERVER, minimum=0.0, help="seconds SIGTERM gives in-flight requests")
    http_port: int = setting(
        8000, group=HTTP, minimum=-1, help="OpenAI-compatible HTTP API and the live view at / (0: a free one, -1: off)"
    )
    # Off by default, so make run, the benchmarks and a loopback-only deployment need
    # none; anything reachable from a network should set keys. Not in the config's repr
    # (the start-up log). The flag can take one key only (flags.py has no repeated flags):
    # several go comma-separated, or one a line in --api-key-file.
    api_key: str | None = setting(
        None,
        group=CALLERS,
        repr=False,
        help="API key(s), comma-separated, that /v1 and gRPC Generate/GenerateStream require as "
        "'authorization: Bearer KEY' (none: open). A command line is visible to local users: prefer the variable or --api-key-file",
    )
    api_key_file: str | None = setting(
        None,
        group=CALLERS,
        help="file of API keys, one a line, each optionally followed by scope=NAME: keys of one scope share what the drafter "
        "learns from them, and each other key learns alone ('#' comments and blank lines skipped); adds to --api-key",
    )
    # The drafter is told a keyed hash of each caller's scope, never a key: without the
    # secret nobody can name another caller's scope. Not in the config's repr.
    scope_secret: str | None = setting(
        None,
        group=CALLERS,
        repr=False,
        help="secret (16+ characters) that learning scopes' ids are keyed with; verifiers sharing a drafter share what "
        "they learn for a key only with one secret (none: --scope-secret-file, else one kept in the cache folder)",
    )
    scope_secret_file: str | None = setting(None, group=CALLERS, help="file holding --scope-secret (its first line)")
    # A fleet-wide table of text that is safe to share: every caller's drafts read it,
    # only its own keys write it.
    shared_scope: str | None = setting(
        None,
        group=CALLERS,
        help="a scope named in --api-key-file whose learned text every caller's drafts also read (none: each reads its own only)",
    )
    # Half of the default batch and queue (16 + 64): one client cannot take every
    # slot and queue place, while 16-client benchmarks from one host still fit.
    max_requests_per_caller: int = setting(
        40,
        group=CALLERS,
        minimum=1,
        help="requests one caller (API key; else client certificate; else address) may have in flight, over HTTP and gRPC together",
    )
    # OpenAI allows 128. Each choice is a sequence of its own (a batch slot, a caller's
    # place): 8 leaves a default batch of 16 room for another such request.
    max_choices: int = setting(
        8,
        group=CALLERS,
        minimum=1,
        help="choices (n) one HTTP request may ask for; each is a sequence, counted against --max-requests-per-caller",
    )
    # None: what the cache can hold could never need more characters: a position
    # per token, each at most the tokenizer's longest token plus one separator a
    # whitespace pre-tokenizer drops (SmolLM2: 4,096 x (81 + 1), ~336K). Checked before any
    # template or tokenizer runs, so a huge text costs no tokenizing.
    max_prompt_chars: int | None = setting(
        None,
        group=CALLERS,
        minimum=1,
        help="characters of prompt text (a chat's contents together) accepted before tokenizing "
        "(none: the per-request cache positions x (the tokenizer's longest token + 1))",
    )
    # A 4,096-token prompt is ~20-100 KB of JSON; 1 MiB holds a 128K-token one, and with
    # --max-http-connections bounds what half-sent bodies can hold (256 MiB).
    max_http_body_bytes: int = setting(
        1 << 20,
        minimum=1,
        group=HTTP,
        formerly=["http-max-body-bytes"],
        help="HTTP request body cap in bytes (413 beyond; from Content-Length first)",
    )
    # Headers arrive in one packet; 10 s allows a very slow link and still frees a
    # slow-loris connection quickly.
    http_header_timeout_s: float = setting(10.0, group=HTTP, minimum=0.001, help="seconds a client may take to send a request's headers")
    # The whole body, from its headers: a 1 MiB body at ~17 KB/s.
    http_body_timeout_s: float = setting(60.0, group=HTTP, minimum=0.001, help="seconds a client may take to send a request's body")
    # 3x the 80 requests the scheduler holds (16 + 64), room for clients' idle
    # keep-alive connections, and well inside a 1,024 open-file limit.
    max_http_connections: int = setting(
        256, minimum=1, group=HTTP, formerly=["http-max-connections"], help="open HTTP connections; beyond, new ones get 503 and are closed"
    )
    # Browsers refuse a page's cross-origin calls unless the server allows its origin.
    # None: no CORS headers, so only pages served from this port (the live view) call it.
    allowed_origins: str | None = setting(
        None,
        group=HTTP,
        help="origins (comma-separated, e.g. https://app.example.com; * for any) whose browser pages "
        "may call the HTTP API (none: same origin only)",
    )
    # DNS rebinding: a page on another site can have its own name resolve to this
    # server's address, then call it as same-origin, with that name in Host. Only
    # this server's own names are answered. None: the names of --host, which for a
    # loopback address are localhost, 127.0.0.1 and ::1; for all interfaces (0.0.0.0,
    # ::) any name, since the server cannot know the names clients reach it by
    # (a deployment behind a name should list it).
    allowed_hosts: str | None = setting(
        None,
        group=HTTP,
        help="host names (comma-separated, no port; * for any) the HTTP API answers to in a request's Host header "
        "(none: the --host address's: localhost, 127.0.0.1 and ::1 for a loopback address, any for 0.0.0.0 or ::)",
    )
    calibrate: bool = setting(
        True,
        group=ENGINE,
        help="serve from a flat step cost that real steps refine instead of measuring the cost at start-up (tests, tiny models)",
    )
    # Calibrating takes ~20 s on an idle 2-core machine (at most --calibration-budget-seconds);
    # a start with a stored one serves from it at once.
    calibration_cache: bool = setting(
        True,
        group=ENGINE,
        help="neither read nor keep a stored step-cost calibration: measure it at every start. By default it is kept under the "
        "cache folder ($SPECDEC_CACHE_DIR/calibration) and served from at once at later starts (lowered when real "
        "steps show the machine faster, never replaced by a busy start's timings)",
    )
    connections: ConnectionLimits = nested(ConnectionLimits, group=CONNECTIONS)
    engine: EngineConfig = nested(EngineConfig, group=ENGINE)
    scheduler: SchedulerConfig = nested(SchedulerConfig, group=ENGINE)
    # The settings every service has (specdec.serving): health outside the request limit.
    tls_cert: str | None = settings.tls_cert_setting()
    tls_key: str | None = settings.tls_key_setting()
    tls_client_ca: str | None = settings.tls_client_ca_setting()
    metrics_port: int | None = settings.metrics_port_setting(DEFAULT_METRICS_PORT)
    health_port: int | None = settings.health_port_setting()

    def __post_init__(self) -> None:
        settings.check_tls(self.tls_cert, self.tls_key, self.tls_client_ca, settings.SERVER_TLS_FLAGS, client=False)
        entries = self.key_entries()  # fail fast: an unreadable key file or a malformed key is a usage error
        given_secret(self.scope_secret, self.scope_secret_file)  # and so is a short secret, or an unreadable file
        if self.shared_scope is not None and self.shared_scope not in {entry.scope for entry in entries}:
            raise ValueError(f"--shared-scope {self.shared_scope!r} is no scope of --api-key-file (a line 'KEY scope=NAME' names one)")
        self.origins()
        self.hosts()
        if self.draft_head_vocabulary == 1:  # each drafting step takes the head's two best guesses
            raise ValueError("--draft-head-vocabulary is 0 (every token the head was trained on) or at least 2, got 1")

    def served_names(self) -> list[str]:
        """The names the HTTP API answers to, the reported one first (--served-model-name)."""
        names = [name.strip() for name in (self.served_model_name or "").split(",") if name.strip()]
        if not names:
            names = [self.model, DEFAULT_MODEL_HUB_NAME] if self.model == DEFAULT_MODEL else [self.model]
        return list(dict.fromkeys(names))

    def origins(self) -> list[str]:
        """The --allowed-origins, each a scheme://host[:port] or *."""
        origins = [origin.strip() for origin in (self.allowed_origins or "").split(",") if origin.strip()]
        for origin in origins:
            if origin != "*" and not ORIGIN_PATTERN.fullmatch(origin):
                raise ValueError(f"--allowed-origins: {origin!r} is not an origin (scheme://host[:port], no path) or *")
        return origins

    def hosts(self) -> frozenset[str] | None:
        """The names an HTTP request's Host may give (the port aside), lower case, IPv6
        addresses without brackets; None: any (--allowed-hosts, module docstring)."""
        if self.allowed_hosts is None:
            host = host_name(self.host)
            if host in ALL_INTERFACES:
                return None
            loopback = host == "localhost" or _is_loopback(host)
            return frozenset({host, *LOOPBACK_NAMES}) if loopback else frozenset({host})
        names = [name.strip() for name in self.allowed_hosts.split(",") if name.strip()]
        if "*" in names:
            return None
        for name in names:
            if not _is_host(host_name(name)):
                raise ValueError(f"--allowed-hosts: {name!r} is not a host name or address (no scheme, port or path) or *")
        if not names:
            raise ValueError("--allowed-hosts names no host: give names, or * for any")
        return frozenset(host_name(name) for name in names)

    def api_keys(self) -> tuple[str, ...]:
        """The configured keys, from --api-key and --api-key-file (``key_entries``)."""
        return tuple(entry.key for entry in self.key_entries())

    def key_entries(self) -> tuple[KeyEntry, ...]:
        """The configured keys with their scopes' names (ValueError naming where, never the
        key, for a key that cannot travel in a header, a malformed line, or an unreadable file)."""
        keys = [(key.strip(), f"key {index} of --api-key") for index, key in enumerate((self.api_key or "").split(","), 1)]
        entries = [KeyEntry(key, None) for key, where in keys if key]
        wheres = [where for key, where in keys if key]
        if self.api_key_file:
            try:
                lines = Path(self.api_key_file).read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError) as error:
                raise ValueError(f"cannot read --api-key-file {self.api_key_file}: {error}") from None
            listed = [(line.strip(), f"line {number} of --api-key-file") for number, line in enumerate(lines, 1)]
            listed = [(line, where) for line, where in listed if line and not line.startswith("#")]
            if not listed:
                raise ValueError(f"--api-key-file {self.api_key_file} holds no key")
            entries += [parse_key_line(line, where) for line, where in listed]
            wheres += [where for _, where in listed]
        for entry, where in zip(entries, wheres):
            if not KEY_PATTERN.fullmatch(entry.key):
                raise ValueError(f"{where}: an API key is printable ASCII without spaces or commas")
        return tuple(entries)


# What an HTTP header and gRPC metadata carry unchanged, less the --api-key separator.
KEY_PATTERN = re.compile(r"[!-+\--~]+")
# An origin as browsers send it: scheme://host[:port], no path.
ORIGIN_PATTERN = re.compile(r"[a-z][a-z0-9+.-]*://[A-Za-z0-9.\-\[\]:]+")
# A host name or an IPv4 or IPv6 address, as --allowed-hosts takes them (host_name's form).
HOST_PATTERN = re.compile(r"[a-z0-9.\-:_]+")
# --host values that bind every interface, and the names a loopback address is reached by.
ALL_INTERFACES = frozenset({"", "0.0.0.0", "::"})
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def _is_host(name: str) -> bool:
    """A host name or address in host_name's form; a colon only in an IPv6 address (not a port)."""
    if not HOST_PATTERN.fullmatch(name):
        return False
    try:
        return ":" not in name or ipaddress.ip_address(name).version == 6
    except ValueError:
        return False


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
        """Load the model, calibrate and warm up, start the scheduler, then report SERVING."""
        config = self.service.config
        started = time.perf_counter()
        loaded = load_model(config.model, device=config.device, dtype=config.dtype)
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
        observer = ServiceObserver(self.service.tracing, self.service.metrics)
        proposer = observer.traced(self.drafter) if self.drafter is not None else None
        folder = cache_root() / "calibration" if config.calibration_cache else None
        head = find_head(config.draft_head, loaded.model, loaded.tokenizer, config.draft_head_vocabulary)
        engine = SpeculativeEngine(loaded.model, loaded.tokenizer, proposer, config.engine, step_cost, folder, head)
        # Warm-up: a prefill and a one-token pass, the two shapes every request starts with.
        engine.generate([GenerationRequest([0, 1, 2, 3], 2, num_speculative_tokens=0)])
        scheduler = Scheduler(engine, config.scheduler, observer)
        self.service.metrics.queue_depth.set_function(lambda: scheduler.queue_depth)
        self.service.metrics.active_sequences.set_function(lambda: scheduler.batch_size)
        self.service.metrics.kv_cache_usage.set_function(lambda: engine.cache_usage()[0])
        self.service.metrics.kv_cache_slot_usage.set_function(lambda: engine.cache_usage()[1])
        scheduler.start()
        self.service.attach(engine, scheduler)
        serving.set_serving(self.health, SERVICE_NAME, True)
        log.info(
            "model %s (%s) ready on %s in %.1fs",
            config.model,
            next(loaded.model.parameters()).dtype,
            engine.device,
            time.perf_counter() - started,
        )

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
    metrics.watch("auxiliary_streams_refused", "Reflection and health Watch streams refused for want of a slot", lambda: guard.refused)
    metrics.watch("auxiliary_streams_ended_idle", "Reflection and health Watch streams ended for silence", lambda: guard.ended_idle)
    if config.health_port is not None:
        verifier._health_server, verifier.health_port = serving.serve_health(health_servicer, config.host, config.health_port)
    if config.metrics_port is not None:
        verifier._metrics_server, verifier.metrics_port = telemetry.start_metrics_server(metrics.registry, config.host, config.metrics_port)
    if config.http_port >= 0:
        names = config.served_names()
        api = OpenAIApi(service, names[0], names[1:])
        limits = HttpLimits(config.max_http_connections, config.http_header_timeout_s, config.http_body_timeout_s)
        verifier.http = HttpServer(api.app, config.host, config.http_port, limits, http_tls(config), config.grace_s)
        verifier.http.start()
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
