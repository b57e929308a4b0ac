"""The verifier's Prometheus metrics, in one registry per server.

Every family carries a ``model_name`` label (the served model, as in vLLM), so
a dashboard can select one model across replicas and Prometheus adds
``instance``. Counters are chosen so the rates people ask for are derivable in
PromQL:

* acceptance rate = accepted_tokens / draft_tokens;
* tokens per forward pass = generated_tokens / forward_passes;
* mean acceptance length (vLLM's) = 1 + accepted_tokens / drafts;
* acceptance at draft position i = accepted_by_position{position=i} /
  drafted_by_position{position=i}, positions counted from 0 as vLLM's
  ``spec_decode_num_accepted_tokens_per_pos`` counts them.

The names mirror vLLM's where the quantity is the same (docs/reference/metrics.md
lists each with its vLLM name), and the request latencies are OpenTelemetry's GenAI server
metrics, named as OpenTelemetry's Prometheus exporter names them
(``gen_ai.server.time_to_first_token``, unit s ->
``gen_ai_server_time_to_first_token_seconds``; attribute ``gen_ai.request.model``
-> label ``gen_ai_request_model``), with the conventions' buckets.
"""

from __future__ import annotations

from collections.abc import Callable

from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
from opentelemetry.semconv._incubating.metrics import gen_ai_metrics
from opentelemetry.semconv.attributes import error_attributes
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "specdec_verifier_"
PROVIDER = "specdec"  # gen_ai.provider.name: this server, not a vendor's API
# Draft positions 0 .. 15 get their own label value; later ones share the last.
MAX_POSITION_LABEL = 15
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
QUEUE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# The GenAI conventions' advice for each histogram's boundaries.
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TIME_PER_OUTPUT_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
REQUEST_DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
# The GenAI metrics' attributes, as labels; error_type is "" (no label) on success.
GEN_AI_LABELS = tuple(
    name.replace(".", "_")
    for name in (
        gen_ai.GEN_AI_OPERATION_NAME,
        gen_ai.GEN_AI_PROVIDER_NAME,
        gen_ai.GEN_AI_REQUEST_MODEL,
        gen_ai.GEN_AI_RESPONSE_MODEL,
    )
)
ERROR_TYPE_LABEL = error_attributes.ERROR_TYPE.replace(".", "_")


def prometheus_name(instrument: str, unit: str) -> str:
    """OpenTelemetry's instrument name as its Prometheus exporter writes it:
    "gen_ai.server.request.duration", "s" -> "gen_ai_server_request_duration_seconds"."""
    return instrument.replace(".", "_") + {"s": "_seconds"}[unit]


class CacheUsage:
    """The two KV-cache gauges from one reading per scrape. ``read`` (the engine's
    ``cache_usage``) walks the slots; a reading per gauge would cost two walks, and a
    step between them would pair the token share of one moment with the slot share of another.
    Both are 0 until an engine is attached, as unset gauges are."""

    TOKENS = (PREFIX + "kv_cache_usage_perc", "Fraction of the KV cache's token positions held, 0 to 1")
    SLOTS = (PREFIX + "kv_cache_slot_usage_perc", "Fraction of the KV cache's sequence slots in use, 0 to 1")

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.read: Callable[[], tuple[float, float]] = lambda: (0.0, 0.0)  # (tokens, slots)

    def collect(self) -> list[GaugeMetricFamily]:
        families = self.describe()
        for family, share in zip(families, self.read(), strict=True):
            family.add_metric([self.model_name], share)
        return families

    def describe(self) -> list[GaugeMetricFamily]:
        """The families without samples: the registry checks their names are not taken."""
        return [GaugeMetricFamily(name, help_text, labels=["model_name"]) for name, help_text in (self.TOKENS, self.SLOTS)]


class VerifierMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name

        def counter(name: str, help_text: str):
            return Counter(PREFIX + name, help_text, ["model_name"], registry=self.registry).labels(model_name)

        def histogram(name: str, help_text: str, buckets):
            return Histogram(PREFIX + name, help_text, ["model_name"], buckets=buckets, registry=self.registry).labels(model_name)

        def gauge(name: str, help_text: str):
            return Gauge(PREFIX + name, help_text, ["model_name"], registry=self.registry).labels(model_name)

        self._requests = Counter(
            PREFIX + "requests",
            "Finished sequences (one per choice), by finish reason",
            ["model_name", "finish_reason"],
            registry=self.registry,
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled")
        self.generated_tokens = counter("generated_tokens", "Tokens generated")
        # Per sequence, as in a request's stats: a step over 8 sequences counts 8.
        self.forward_passes = counter("forward_passes", "Target forward passes per sequence (prefills and steps)")
        self.drafts = counter("drafts", "Sequence steps that scored a draft (vLLM's spec_decode_num_drafts)")
        self.draft_tokens = counter("draft_tokens", "Draft tokens scored by the target")
        self.accepted_tokens = counter("accepted_tokens", "Draft tokens accepted")
        self._drafted_by_position = Counter(
            PREFIX + "drafted_by_position",
            "Draft tokens scored at each draft position (from 0)",
            ["model_name", "position"],
            registry=self.registry,
        )
        self._accepted_by_position = Counter(
            PREFIX + "accepted_by_position",
            "Draft tokens accepted at each draft position (from 0)",
            ["model_name", "position"],
            registry=self.registry,
        )
        self.verified_k = histogram(
            "verified_k", "Draft tokens verified per sequence per step (the K chosen)", (0, 1, 2, 3, 4, 5, 6, 8, 12, 16)
        )
        self.batch_size = histogram("batch_size", "Sequences per step", (1, 2, 4, 8, 12, 16, 24, 32, 64))
        self.step_seconds = histogram("step_seconds", "Time per decoding step (propose, score, accept)", LATENCY_BUCKETS)
        self.queue_seconds = histogram("request_queue_seconds", "Time from arrival to a cache slot (queueing)", QUEUE_BUCKETS)
        self.prefill_seconds = histogram(
            "request_prefill_seconds", "Time from a cache slot to the prompt's first token (prefill, chunked among steps)", QUEUE_BUCKETS
        )
        self.queue_depth = gauge("queue_depth", "Requests waiting for a batch slot (vLLM's num_requests_waiting)")
        self.active_sequences = gauge("active_sequences", "Sequences holding a cache slot (vLLM's num_requests_running)")
        self._cache_usage = CacheUsage(model_name)
        self.registry.register(self._cache_usage)
        self.time_to_first_token = self._gen_ai_histogram(
            gen_ai_metrics.GEN_AI_SERVER_TIME_TO_FIRST_TOKEN, "Time to the first token of successful requests", TIME_TO_FIRST_TOKEN_BUCKETS
        )
        self.time_per_output_token = self._gen_ai_histogram(
            gen_ai_metrics.GEN_AI_SERVER_TIME_PER_OUTPUT_TOKEN,
            "Time per output token after the first, for successful requests",
            TIME_PER_OUTPUT_TOKEN_BUCKETS,
        )
        self.request_duration = self._gen_ai_histogram(
            gen_ai_metrics.GEN_AI_SERVER_REQUEST_DURATION,
            "Request duration, from arrival to the last token or the error",
            REQUEST_DURATION_BUCKETS,
            error_label=True,
        )
        # vLLM's cache_config_info idiom: the form as labels of a sample that is always 1.
        self._form = Info(
            PREFIX + "model",
            "The form the model is served in (dtype, weights, threads, batch-invariant passes)",
            ["model_name"],
            registry=self.registry,
        ).labels(model_name)
        # Read from elsewhere at scrape time: name -> (help, read, family).
        self._external: dict[str, tuple[str, Callable[[], float], type[CounterMetricFamily | GaugeMetricFamily]]] = {}
        self.registry.register(self)  # collect() below adds counters read from elsewhere

    def _gen_ai_histogram(self, instrument: str, help_text: str, buckets, error_label: bool = False) -> Histogram:
        labels = ["model_name", *GEN_AI_LABELS, *([ERROR_TYPE_LABEL] if error_label else [])]
        return Histogram(prometheus_name(instrument, "s"), help_text, labels, buckets=buckets, registry=self.registry)

    def describe_form(self, form: dict) -> None:
        """``specdec_verifier_model_info{model_name, dtype, weights, threads, batch_invariant} 1``."""
        self._form.info({name: str(value).lower() for name, value in form.items()})

    def watch(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        """A counter kept by another object (e.g. the drafter client's fallbacks), read at scrape time."""
        self._external[name] = (help_text, read, CounterMetricFamily)

    def watch_gauge(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        """A gauge kept by another object (e.g. which drafter replica is in use), read at scrape time."""
        self._external[name] = (help_text, read, GaugeMetricFamily)

    def watch_cache_usage(self, read: Callable[[], tuple[float, float]]) -> None:
        """The engine's ``cache_usage``, read once per scrape for both KV-cache gauges."""
        self._cache_usage.read = read

    def collect(self):
        for name, (help_text, read, kind) in self._external.items():
            family = kind(PREFIX + name, help_text, labels=["model_name"])
            family.add_metric([self.model_name], read())
            yield family

    def describe(self):
        return []  # dynamic: skip the registry's duplicate-name check at registration

    def record_prefill(self, prompt_tokens: int, generated: int, queued_s: float, prefill_s: float) -> None:
        self.forward_passes.inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generated_tokens.inc(generated)
        self.queue_seconds.observe(queued_s)
        self.prefill_seconds.observe(prefill_s)

    def record_step(self, seconds: float, rows: list[tuple[int, int, int]]) -> None:
        """One step; ``rows`` holds (drafts verified, drafts accepted, tokens emitted) per sequence."""
        self.step_seconds.observe(seconds)
        self.batch_size.observe(len(rows))
        self.forward_passes.inc(len(rows))
        for verified, accepted, emitted in rows:
            self.verified_k.observe(verified)
            self.generated_tokens.inc(emitted)
            if verified:
                self.drafts.inc()
                self.draft_tokens.inc(verified)
                self.accepted_tokens.inc(accepted)
                for position in range(verified):
                    label = str(min(position, MAX_POSITION_LABEL))
                    self._drafted_by_position.labels(self.model_name, label).inc()
                    if position < accepted:
                        self._accepted_by_position.labels(self.model_name, label).inc()

    def record_sequence(self, finish_reason: str) -> None:
        """A sequence (one choice of a request) ended."""
        self._requests.labels(self.model_name, finish_reason).inc()

    def record_request(
        self, operation: str, seconds: float, error_type: str = "", first_token_s: float | None = None, output_tokens: int = 0
    ) -> None:
        """A request (one operation, all its choices) ended: its duration, and for a success
        the time to its first token and per output token after it (the GenAI server metrics)."""
        labels = (self.model_name, operation, PROVIDER, self.model_name, self.model_name)
        self.request_duration.labels(*labels, error_type).observe(seconds)
        if error_type or first_token_s is None:
            return
        self.time_to_first_token.labels(*labels).observe(first_token_s)
        if output_tokens > 1:
            self.time_per_output_token.labels(*labels).observe((seconds - first_token_s) / (output_tokens - 1))
