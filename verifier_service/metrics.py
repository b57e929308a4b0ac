"""The verifier's Prometheus metrics, in one registry per server.

Counters are chosen so the rates people ask for are derivable in PromQL:
acceptance rate = accepted_tokens / draft_tokens, tokens per forward pass =
generated_tokens / forward_passes, acceptance at draft position i =
accepted_by_position{position=i} / drafted_by_position{position=i}.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

PREFIX = "specdec_verifier_"
# Draft positions get their own label value up to here; later ones share the last.
MAX_POSITION_LABEL = 16
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0)


class VerifierMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter(PREFIX + "requests", "Finished requests, by finish reason", ["finish_reason"], registry=registry)
        self.generated_tokens = Counter(PREFIX + "generated_tokens", "Tokens generated", registry=registry)
        # Per sequence, as in a request's stats: a step over 8 sequences counts 8.
        self.forward_passes = Counter(
            PREFIX + "forward_passes", "Target forward passes per sequence (prefills and steps)", registry=registry
        )
        self.draft_tokens = Counter(PREFIX + "draft_tokens", "Draft tokens scored by the target", registry=registry)
        self.accepted_tokens = Counter(PREFIX + "accepted_tokens", "Draft tokens accepted", registry=registry)
        self.drafted_by_position = Counter(
            PREFIX + "drafted_by_position", "Draft tokens scored at each draft position (1-based)", ["position"], registry=registry
        )
        self.accepted_by_position = Counter(
            PREFIX + "accepted_by_position", "Draft tokens accepted at each draft position (1-based)", ["position"], registry=registry
        )
        self.verified_k = Histogram(
            PREFIX + "verified_k",
            "Draft tokens verified per sequence per step (the K chosen)",
            buckets=(0, 1, 2, 3, 4, 5, 6, 8, 12, 16),
            registry=registry,
        )
        self.batch_size = Histogram(
            PREFIX + "batch_size", "Sequences per step", buckets=(1, 2, 4, 8, 12, 16, 24, 32, 64), registry=registry
        )
        self.step_seconds = Histogram(
            PREFIX + "step_seconds", "Time per decoding step (propose, score, accept)", buckets=LATENCY_BUCKETS, registry=registry
        )
        self.request_seconds = Histogram(
            PREFIX + "request_seconds", "Request latency from arrival", buckets=REQUEST_BUCKETS, registry=registry
        )
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time from arrival to the first token", buckets=REQUEST_BUCKETS, registry=registry
        )
        self.queue_depth = Gauge(PREFIX + "queue_depth", "Requests waiting for a batch slot", registry=registry)
        self.active_sequences = Gauge(PREFIX + "active_sequences", "Sequences in the running batch", registry=registry)
        self._external: dict[str, tuple[str, Callable[[], float]]] = {}
        registry.register(self)  # collect() below adds counters read from elsewhere

    def watch(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        """A counter kept by another object (e.g. the drafter client's fallbacks), read at scrape time."""
        self._external[name] = (help_text, read)

    def collect(self):
        for name, (help_text, read) in self._external.items():
            family = CounterMetricFamily(PREFIX + name, help_text)
            family.add_metric([], read())
            yield family

    def describe(self):
        return []  # dynamic: skip the registry's duplicate-name check at registration

    def record_prefill(self, generated: int) -> None:
        self.forward_passes.inc()
        self.generated_tokens.inc(generated)

    def record_step(self, seconds: float, rows: list[tuple[int, int, int]]) -> None:
        """One step; ``rows`` holds (drafts verified, drafts accepted, tokens emitted) per sequence."""
        self.step_seconds.observe(seconds)
        self.batch_size.observe(len(rows))
        self.forward_passes.inc(len(rows))
        for verified, accepted, emitted in rows:
            self.verified_k.observe(verified)
            self.generated_tokens.inc(emitted)
            if verified:
                self.draft_tokens.inc(verified)
                self.accepted_tokens.inc(accepted)
                for position in range(1, verified + 1):
                    label = str(min(position, MAX_POSITION_LABEL))
                    self.drafted_by_position.labels(label).inc()
                    if position <= accepted:
                        self.accepted_by_position.labels(label).inc()

    def record_request(self, finish_reason: str, seconds: float, time_to_first_token_s: float | None) -> None:
        self.requests.labels(finish_reason).inc()
        self.request_seconds.observe(seconds)
        if time_to_first_token_s is not None:
            self.time_to_first_token.observe(time_to_first_token_s)
