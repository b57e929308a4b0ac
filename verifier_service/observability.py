"""What the verifier reports about its steps: tracing spans and Prometheus metrics.

Trace shape, per ``Generate`` request (root span ``specdec.generate``, a child
of the caller's span when it sent a W3C ``traceparent``):

* ``specdec.step``, one per step the request took part in, with this
  request's share (``specdec.k``: drafts verified, ``specdec.accepted``,
  ``specdec.tokens``), linked to the step's batch span;
* ``specdec.batch_step``, one per step, the child of the *first* request in
  the batch (other requests reach it through their step spans' links), with
  the batch's stages as children: ``specdec.propose`` (whose gRPC call to the
  drafter carries the context on, so the drafter's ``specdec.drafter.propose``
  joins the same trace), ``specdec.score`` (the target forward pass) and
  ``specdec.accept``.

So one request alone in the batch yields one trace holding every span of
both services; in a busy batch every request's trace still shows each step it
took part in, one link away from the shared work.
"""

from __future__ import annotations

import contextlib
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Link

from specdec.telemetry import Tracing
from verifier_service.metrics import VerifierMetrics
from verifier_service.scheduler import RequestHandle, RowStep


class ServiceObserver:
    def __init__(self, tracing: Tracing, metrics: VerifierMetrics) -> None:
        self.tracing, self.metrics = tracing, metrics
        self.tracer = tracing.tracer
        self._batch_span: Any = None  # the SDK's span: once ended, it knows its start and end times

    def stage_spans(self, name: str, attributes: dict) -> contextlib.AbstractContextManager:
        """The engine's stage hook: a span under the current batch step (none outside one, e.g. the warm-up)."""
        if self._batch_span is None:
            return contextlib.nullcontext(trace.INVALID_SPAN)
        return self.tracer.start_as_current_span(name, attributes=attributes)

    @contextlib.contextmanager
    def step(self, handles: list[RequestHandle]):
        if not self.tracing.enabled:
            yield
            return
        span = self.tracer.start_span(
            "specdec.batch_step", context=handles[0].trace_context, attributes={"specdec.batch_size": len(handles)}
        )
        self._batch_span = span
        with trace.use_span(span, end_on_exit=True):
            yield

    def stepped(self, handles: list[RequestHandle], seconds: float, rows: list[RowStep]) -> None:
        self.metrics.record_step(seconds, [(row.verified, row.accepted, row.emitted) for row in rows])
        if not self.tracing.enabled or self._batch_span is None:
            return
        batch = self._batch_span  # ended: the SDK span knows its start and end (ns)
        link = [Link(batch.get_span_context())]
        for handle, row in zip(handles, rows):
            span = self.tracer.start_span(
                "specdec.step",
                context=handle.trace_context,
                links=link,
                start_time=batch.start_time,
                attributes={"specdec.k": row.verified, "specdec.accepted": row.accepted, "specdec.tokens": row.emitted},
            )
            span.end(end_time=batch.end_time)
        self._batch_span = None

    def prefilled(self, handle: RequestHandle, emitted: int) -> None:
        self.metrics.record_prefill(emitted)
