"""What the verifier reports about its steps: tracing spans and Prometheus metrics.

Trace shape, per request (root span ``{operation} {model}``, as OpenTelemetry's
GenAI conventions name it: ``service.VerifierService.request_span``; a child of
the caller's span when it sent a W3C ``traceparent``):

* ``specdec.queue`` (arrival to a cache slot) and ``specdec.prefill`` (the slot
  to the first token, its prompt chunked among steps), once each;
* ``specdec.step``, one per step the request took part in, with this
  request's share (``specdec.k``: drafts verified, ``specdec.accepted``,
  ``specdec.tokens``), linked to the step's batch span;
* ``specdec.batch_step``, one per step, the child of the *first* request in
  the batch (other requests reach it through their step spans' links), with
  the batch's stages as children: ``specdec.propose`` (the call to the
  drafter, made while its span is current, so the gRPC call carries the
  context on and the drafter's ``specdec.drafter.propose`` joins the same
  trace), ``specdec.score`` (the target forward pass) and ``specdec.accept``.

So one request alone in the batch yields one trace holding every span of
both services; in a busy batch every request's trace still shows each step it
took part in, one link away from the shared work.

The engine knows nothing of this: ``traced`` wraps its proposer, and the
score and accept spans are written after the step from the engine's
``StepReport`` (what each stage did, and when).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Link

from specdec.telemetry import Tracing
from verifier_service.core.drafting import DraftProposer, DraftRequest, FinishedSequence, ProposedDraft
from verifier_service.core.generation import StepOutcome, StepReport
from verifier_service.serving.metrics import VerifierMetrics
from verifier_service.serving.scheduler import RequestHandle


class ServiceObserver:
    def __init__(self, tracing: Tracing, metrics: VerifierMetrics) -> None:
        self.tracing, self.metrics = tracing, metrics
        self.tracer = tracing.tracer
        self._batch_span: Any = None  # the SDK's span: once ended, it knows its start and end times

    def traced(self, proposer: DraftProposer) -> DraftProposer:
        """``proposer`` with each ``propose`` call in a ``specdec.propose`` span under the current batch step."""
        return _TracedProposer(proposer, self)

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

    def stepped(self, handles: list[RequestHandle], seconds: float, rows: list[StepOutcome], report: StepReport | None) -> None:
        self.metrics.record_step(seconds, [(row.verified, row.accepted, len(row.tokens)) for row in rows])
        batch, self._batch_span = self._batch_span, None
        if not self.tracing.enabled or batch is None:
            return
        if report is not None:
            self._stage_spans(batch, report)
        link = [Link(batch.get_span_context())]
        for handle, row in zip(handles, rows):
            span = self.tracer.start_span(
                "specdec.step",
                context=handle.trace_context,
                links=link,
                start_time=batch.start_time,  # ended: the SDK span knows its start and end (ns)
                attributes={"specdec.k": row.verified, "specdec.accepted": row.accepted, "specdec.tokens": len(row.tokens)},
            )
            span.end(end_time=batch.end_time)

    def _stage_spans(self, batch: Any, report: StepReport) -> None:
        parent = trace.set_span_in_context(batch)
        stages = (
            (
                "specdec.score",
                report.scoring_ns,
                report.accepting_ns,
                {"specdec.width": report.width, "specdec.tokens_scored": report.tokens},
            ),
            (
                "specdec.accept",
                report.accepting_ns,
                report.done_ns,
                {"specdec.draft_tokens": report.verified, "specdec.accepted": report.accepted},
            ),
        )
        for name, start, end, attributes in stages:
            span = self.tracer.start_span(
                name, context=parent, start_time=start, attributes={"specdec.batch_size": report.decoding, **attributes}
            )
            span.end(end_time=end)

    def prefilled(self, handle: RequestHandle, emitted: int) -> None:
        """A request's prompt is in the cache and its first token out: how long it queued and
        prefilled, in the metrics and as the request's ``specdec.queue`` and ``specdec.prefill`` spans."""
        now = time.perf_counter()
        admitted = handle.admitted_at if handle.admitted_at is not None else now
        self.metrics.record_prefill(len(handle.request.prompt_ids), emitted, admitted - handle.arrived, now - admitted)
        if not self.tracing.enabled:
            return
        wall_ns = time.time_ns()

        def wall(moment: float) -> int:  # a perf_counter() moment as the epoch nanoseconds spans take
            return wall_ns - int((now - moment) * 1e9)

        for name, start, end in (("specdec.queue", handle.arrived, admitted), ("specdec.prefill", admitted, now)):
            span = self.tracer.start_span(name, context=handle.trace_context, start_time=wall(start))
            span.end(end_time=wall(end))


class _TracedProposer:
    def __init__(self, proposer: DraftProposer, observer: ServiceObserver) -> None:
        self.proposer, self.observer = proposer, observer

    def propose(self, requests: list[DraftRequest]) -> list[ProposedDraft]:
        if self.observer._batch_span is None:  # outside a batch step (the warm-up), or tracing is off
            return self.proposer.propose(requests)
        attributes = {"specdec.sequences": len(requests), "specdec.k_asked": sum(request.k for request in requests)}
        with self.observer.tracer.start_as_current_span("specdec.propose", attributes=attributes):
            return self.proposer.propose(requests)

    def close(self, finished: list[FinishedSequence]) -> None:
        self.proposer.close(finished)
