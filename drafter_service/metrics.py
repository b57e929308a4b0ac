"""The drafter's Prometheus metrics: counters updated as calls are served (prometheus_client's
own locks make them safe from any worker thread), and gauges read at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from drafter_service.ngram import SOURCE_CONTEXT, SOURCE_GLOBAL, SOURCE_SUCCESSOR

if TYPE_CHECKING:  # the replica imports the store; metrics import neither at run time
    from drafter_service.log import ObservationLog
    from drafter_service.replica import Replica

PREFIX = "specdec_drafter_"
# Where a draft token came from: the request's own context, the global n-gram table, or
# the successor table (the target's own earlier predictions).
SOURCES = (SOURCE_CONTEXT, SOURCE_GLOBAL, SOURCE_SUCCESSOR)
# Each table's stats (LMDBNGramStore.stats) exported as a gauge: (stat, metric, help).
TABLE_GAUGES = (
    ("entries", "table_entries", "n-grams in the global table"),
    ("bytes", "table_bytes", "Tracked size of the global table (what --max-bytes bounds)"),
    ("file_bytes", "table_file_bytes", "Size of the table's LMDB file on disk"),
    ("successor_entries", "table_successor_entries", "Keys in the successor table (the target's own predictions)"),
    ("scopes", "table_scopes", "Learning scopes with a table of their own (counted, never named: a scope's id is its tenant's)"),
)


class DrafterMetrics:
    log_publish_seconds: Histogram  # with an observation log only (watch_replication)

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

    def watch_replication(self, replica: Replica, log_link: ObservationLog) -> None:
        """The replica's metrics: where it stands in the log, how far behind, what it applied."""
        self.log_publish_seconds = Histogram(
            PREFIX + "log_publish_seconds",
            "Seconds from publishing an Observe to the observation log to its acknowledgement",
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0, 5.0),
        )
        self.gauge("log_position", "Sequence of the last observation-log message this replica applied", lambda: replica.position.sequence)
        self.gauge(
            "log_lag_messages",
            "Observation-log messages this replica has yet to apply (-1: not known yet)",
            lambda: -1 if replica.lag_messages is None else replica.lag_messages,
        )
        self.gauge("log_lag_seconds", "Age of the newest log message applied while more wait (0: caught up)", lambda: replica.lag_seconds)
        self.gauge("log_serving", "1 while this replica is within --log-max-serving-lag of the log's end", lambda: int(replica.serving))
        self.watch("log_messages_applied", "Observation-log messages applied to this replica's tables", lambda: replica.applied)
        self.watch(
            "log_messages_skipped",
            "Observation-log messages not applied (held already, beyond a bound, unreadable)",
            lambda: replica.skipped,
        )
        self.watch(
            "log_bootstraps",
            "Times this replica caught up from a peer's snapshot, or found the log had left it behind",
            lambda: replica.bootstraps,
        )
        self.watch("log_publish_failures", "Publishes to the observation log not acknowledged in time", lambda: log_link.publish_failures)
        self.watch(
            "log_successors_dropped",
            "Successor-table predictions not sent to the log (beyond its bound, or the log away)",
            lambda: log_link.dropped_successors,
        )
        self.watch("log_reconnects", "Reconnections to the observation log's NATS servers", lambda: log_link.reconnects)

    def watch_tables(self, read: Callable[[], dict[str, dict]]) -> None:
        """``read()``: each vocabulary's table stats (``entries``, ``bytes``, ``scopes``: summed over its scopes), at scrape time."""
        self._tables = read

    def collect(self):
        for name, (help_text, read) in self._external.items():
            family = CounterMetricFamily(PREFIX + name, help_text)
            family.add_metric([], read())
            yield family
        tables = self._tables()
        for stat, name, help_text in TABLE_GAUGES:
            family = GaugeMetricFamily(PREFIX + name, help_text, labels=["vocabulary"])
            for vocabulary, stats in tables.items():
                family.add_metric([vocabulary], stats.get(stat, 0))
            yield family
        evictions = CounterMetricFamily(
            PREFIX + "table_evictions", "n-grams evicted to keep the table under --max-bytes", labels=["vocabulary"]
        )
        for vocabulary, stats in tables.items():
            evictions.add_metric([vocabulary], stats.get("evictions", 0))
        yield evictions
        successor_evictions = CounterMetricFamily(
            PREFIX + "table_successor_evictions",
            "Successor-table keys evicted, least recently written first, to keep each table under --max-successor-entries",
            labels=["vocabulary"],
        )
        for vocabulary, stats in tables.items():
            successor_evictions.add_metric([vocabulary], stats.get("successor_evictions", 0))
        yield successor_evictions

    def describe(self):
        return []  # dynamic: skip the registry's duplicate-name check at registration

    def proposed_call(self, drafts: Sequence[Mapping[str, int]], misses: int) -> None:
        """One Propose call: each draft's token count by source, and the sequences that wanted one and got none."""
        self.propose_calls.inc()
        self.misses.inc(misses)
        for source in SOURCES:
            self.proposed.labels(source).inc(sum(draft.get(source, 0) for draft in drafts))

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
            "proposed_tokens": sum(totals["proposed_tokens", source] for source in SOURCES),
            **{f"{source}_hits": totals["proposed_tokens", source] for source in SOURCES},
            "misses": totals["misses", None],
            "observed_tokens": totals["observed_tokens", None],
            **{f"{source}_{verdict}": totals[f"{verdict}_tokens", source] for source in SOURCES for verdict in ("verified", "accepted")},
        }
