"""Tracing and metrics setup shared by both services.

Tracing is OpenTelemetry with OTLP over gRPC, configured by the standard
variables (``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``..._TRACES_ENDPOINT``,
``OTEL_SERVICE_NAME``, ``OTEL_BSP_*``, ``OTEL_TRACES_SAMPLER``...). It is off
unless an endpoint is set (or ``OTEL_TRACES_EXPORTER=none`` / ``OTEL_SDK_DISABLED=true``
turn it off): the API's no-op tracer then costs next to nothing.

A slow or absent collector never slows generation: spans go to a bounded
queue that a background thread exports in batches; when the queue is full
spans are dropped and counted (``dropped_spans``), and shutdown waits at most
``SHUTDOWN_TIMEOUT_S`` for the last export.

W3C trace context travels in gRPC metadata (``traceparent``): ``outgoing_metadata``
on the client side, ``incoming_context`` on the server side.

Span attributes are scalars named ``specdec.*``; never prompt text or token
lists, which may hold user data.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Sequence

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from prometheus_client import CollectorRegistry, start_http_server

from specdec.settings import cannot_listen

log = logging.getLogger(__name__)

# Shutdown never waits longer than this for the collector: a SIGTERM'd
# service must exit within its grace period even if the collector is gone.
SHUTDOWN_TIMEOUT_S = 3.0
# Per export attempt, unless OTEL_EXPORTER_OTLP_TIMEOUT says otherwise.
EXPORT_TIMEOUT_S = 5.0


class _CountingExporter(SpanExporter):
    """Counts spans that failed to export (collector down, timeout)."""

    def __init__(self, exporter: SpanExporter, tracing: Tracing) -> None:
        self._exporter, self._tracing = exporter, tracing

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        result = self._exporter.export(spans)
        if result != SpanExportResult.SUCCESS:
            self._tracing.dropped_spans += len(spans)
        return result

    def shutdown(self) -> None:
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._exporter.force_flush(timeout_millis)


class _CountingProcessor(BatchSpanProcessor):
    """A BatchSpanProcessor that counts the spans its full queue drops."""

    def __init__(self, exporter: SpanExporter, tracing: Tracing) -> None:
        super().__init__(exporter)
        self._tracing = tracing

    def on_end(self, span: ReadableSpan) -> None:
        batch = getattr(self, "_batch_processor", None)  # the SDK keeps the queue private
        queue = getattr(batch, "_queue", None)
        if queue is not None and len(queue) >= getattr(batch, "_max_queue_size", float("inf")):
            self._tracing.dropped_spans += 1
        super().on_end(span)


class Tracing:
    """The service's tracer; a no-op one when no collector is configured."""

    def __init__(self, default_service_name: str) -> None:
        self.dropped_spans = 0
        self.provider: TracerProvider | None = None
        if _tracing_enabled():
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            name = os.environ.get("OTEL_SERVICE_NAME", default_service_name)
            self.provider = TracerProvider(resource=Resource.create({"service.name": name}))
            timeout = None if "OTEL_EXPORTER_OTLP_TIMEOUT" in os.environ else EXPORT_TIMEOUT_S
            exporter = _CountingExporter(OTLPSpanExporter(timeout=timeout), self)
            self.provider.add_span_processor(_CountingProcessor(exporter, self))
            log.info("tracing: OTLP export as %s", name)
        self.tracer = (self.provider or trace.NoOpTracerProvider()).get_tracer("specdec")

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    def server_span(self, name: str, grpc_context, attributes: dict) -> contextlib.AbstractContextManager:
        """The current span for one RPC, a child of the caller's trace context. With tracing
        off, nothing at all: not even the context extraction, which costs tens of µs per call."""
        if self.provider is None:
            return contextlib.nullcontext(trace.INVALID_SPAN)
        return self.tracer.start_as_current_span(
            name, context=incoming_context(grpc_context), kind=trace.SpanKind.SERVER, attributes=attributes
        )

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Export what is queued, waiting at most ``timeout_s`` whatever the collector does."""
        if self.provider is None:
            return
        worker = threading.Thread(target=self.provider.shutdown, name="otel-shutdown", daemon=True)
        worker.start()
        worker.join(timeout_s)
        if worker.is_alive():
            log.warning("tracing: collector did not take the last spans within %.1fs; dropped", timeout_s)


def _tracing_enabled() -> bool:
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").lower() == "none":
        return False
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def outgoing_metadata() -> list[tuple[str, str]]:
    """gRPC metadata carrying the current trace context (W3C traceparent) to a peer."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return list(carrier.items())


def incoming_context(grpc_context) -> Context:
    """The caller's trace context from a server call's metadata (empty when none came)."""
    metadata = grpc_context.invocation_metadata() if grpc_context is not None else ()
    return propagate.extract({key: value for key, value in metadata})


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> tuple[object, int]:
    """Serve ``registry`` in Prometheus text format at http://host:port/metrics; returns (server, bound port)."""
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as error:
        reason = error.strerror or str(error)
        raise OSError(cannot_listen("metrics", f"{host}:{port}", reason, "--metrics-port", "-1 turns metrics off")) from error
    return server, server.server_port
