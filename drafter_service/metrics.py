"""The drafter's Prometheus metrics: counters updated as calls are served (prometheus_client's
own locks make them safe from any worker thread), and gauges read at scrape time."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "specdec_drafter_"
SOURCES = ("context", "global")  # where a draft token came from: the request's own context, or the global table


class DrafterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self._external: dict[str, tuple[str, Callable[[], float]]] = {}
        self._tables: Callable[[], dict[str, dict]] = dict
        self.propose_seconds = Histogram(
            PREFIX + "propose_seconds",
            "Server-side Propose latency",
            registry=registry,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25),
        )
        self.propose_calls = Counter(PREFIX + "propose_calls", "Propose calls", registry=registry)
        self.misses = Counter(PREFIX + "misses", "Sequences that asked for drafts and got none", registry=registry)
        self.observed_tokens = Counter(PREFIX + "observed_tokens", "Tokens observed into the global table", registry=registry)
        self.proposed = Counter(PREFIX + "proposed_tokens", "Draft tokens proposed, by source", ["source"], registry=registry)
        self.verified = Counter(
            PREFIX + "verified_tokens", "Draft tokens the verifier reported verified, by source", ["source"], registry=registry
        )
        self.accepted = Counter(
            PREFIX + "accepted_tokens", "Draft tokens the verifier reported accepted, by source", ["source"], registry=registry
        )
        for source in SOURCES:  # exported at 0 from the start, so rates work before the first draft
            self.proposed.labels(source)
            self.verified.labels(source)
            self.accepted.labels(source)

        registry.register(self)  # the scrape-time families below

    def gauge(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        """A gauge whose value is ``read()`` at scrape time."""
        Gauge(PREFIX + name, help_text, registry=self.registry).set_function(read)

    def watch(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        """A counter kept by another object (the tracer's dropped spans), read at scrape time."""
        self._external[name] = (help_text, read)

    def watch_tables(self, read: Callable[[], dict[str, dict]]) -> None:
        """``read()``: each vocabulary's table stats (``entries``, ``bytes``), at scrape time."""
        self._tables = read

    def collect(self):
        for name, (help_text, read) in self._external.items():
            family = CounterMetricFamily(PREFIX + name, help_text)
            family.add_metric([], read())
            yield family
        entries = GaugeMetricFamily(PREFIX + "table_entries", "n-grams in the global table", labels=["vocabulary"])
        size = GaugeMetricFamily(PREFIX + "table_bytes", "Tracked size of the global table", labels=["vocabulary"])
        for vocabulary, stats in self._tables().items():
            entries.add_metric([vocabulary], stats.get("entries", 0))
            size.add_metric([vocabulary], stats.get("bytes", 0))
        yield entries
        yield size

    def describe(self):
        return []  # dynamic: skip the registry's duplicate-name check at registration

    def proposed_call(self, drafts: list[tuple[int, int]], misses: int) -> None:
        """One Propose call: (context, global) token counts of each draft, and the sequences that wanted one and got none."""
        self.propose_calls.inc()
        self.misses.inc(misses)
        self.proposed.labels("context").inc(sum(context for context, _ in drafts))
        self.proposed.labels("global").inc(sum(other for _, other in drafts))

    def stats(self) -> dict[str, int]:
        """The counter fields of StatsResponse, read from the counters themselves (not a scrape
        of the registry, which would also read every table's size)."""
        totals: dict[tuple[str, str | None], int] = {}
        for counter in (self.propose_calls, self.misses, self.observed_tokens, self.proposed, self.verified, self.accepted):
            for family in counter.collect():
                for sample in family.samples:
                    if sample.name.endswith("_total"):
                        totals[sample.name.removeprefix(PREFIX).removesuffix("_total"), sample.labels.get("source")] = int(sample.value)
        return {
            "propose_calls": totals["propose_calls", None],
            "proposed_tokens": totals["proposed_tokens", "context"] + totals["proposed_tokens", "global"],
            "context_hits": totals["proposed_tokens", "context"],
            "global_hits": totals["proposed_tokens", "global"],
            "misses": totals["misses", None],
            "observed_tokens": totals["observed_tokens", None],
            **{f"{source}_{verdict}": totals[f"{verdict}_tokens", source] for source in SOURCES for verdict in ("verified", "accepted")},
        }
