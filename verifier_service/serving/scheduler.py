"""Continuous batching: one thread owns the engine; requests join and leave between steps.

Callers ``submit`` a request and get a ``RequestHandle``: its ``stream()``
yields the tokens as they are accepted, and its ``result()`` returns how the
request ended (or raises why it could not). The loop, per
iteration: mark cancelled sequences, admit waiting requests while the engine
has free cache slots (their prompts are prefilled in chunks by the following
steps, alongside the running sequences), run one step, and hand each
sequence what the step produced for it.

Bounds: at most the engine's ``max_batch_size`` sequences run at once and at most
``max_queued`` wait; beyond that ``submit`` raises ``QueueFull`` at once
(the service answers RESOURCE_EXHAUSTED), so overload never piles up latency.

A failure that belongs to one request (its sampling, its stop strings, its
part of the forward pass: see ``target.PackedModel.score``) fails that
request only, with the error. A failure of the step as a whole (a bug in the
batch bookkeeping) fails the requests of that batch and resets it; the loop,
and the process, go on.

What happens is reported to a ``SchedulerObserver`` (tracing and metrics in
the service; nothing by default), so this module needs neither.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from specdec.flags import setting
from verifier_service.core.drafting import DraftEvidence
from verifier_service.core.engine import SpeculativeEngine
from verifier_service.core.generation import GenerationRequest, GenerationResult, RejectedDraft, SequenceHandle, StepOutcome, StepReport
from verifier_service.core.processing import TokenLogprob

log = logging.getLogger(__name__)


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


class Cancelled(Exception):
    """The request was cancelled while it waited for a slot: it produced nothing.

    (One cancelled while running finishes with FINISH_CANCELLED and what it produced.)"""


class SchedulerObserver(Protocol):
    def step(self, handles: list[RequestHandle]) -> contextlib.AbstractContextManager:
        """Wraps one engine step over ``handles`` (the batch, in row order)."""

    def stepped(self, handles: list[RequestHandle], seconds: float, rows: list[StepOutcome], report: StepReport | None) -> None:
        """After a step: ``rows[i]`` is what it did for decoding sequence ``handles[i]``;
        ``report`` what it did as a whole (None when it ran no forward pass)."""

    def prefilled(self, handle: RequestHandle, emitted: int) -> None: ...


class NoObserver:
    def step(self, handles):
        return contextlib.nullcontext()

    def stepped(self, handles, seconds, rows, report) -> None:
        pass

    def prefilled(self, handle, emitted) -> None:
        pass


@dataclass(frozen=True)
class SchedulerConfig:
    """How many sequences run at once is the engine's (``EngineConfig.max_batch_size``)."""

    max_queued: int = setting(64, minimum=1, help="requests waiting for a slot; beyond it new ones are refused (RESOURCE_EXHAUSTED)")


@dataclass(frozen=True)
class TokenChunk:
    """What one step added to a request's output."""

    tokens: list[int]
    sources: list[str]  # per token: engine.SOURCE_TARGET, or the accepted draft's source ("context", "global")
    verified: int  # draft tokens the step scored for this request (accepted ones are among ``tokens``)
    logprobs: tuple[TokenLogprob, ...] = ()  # per token, when the request asked
    evidence: tuple[DraftEvidence | None, ...] = ()  # per token: why it was drafted (None: the target's own)
    rejected: tuple[RejectedDraft, ...] = ()  # the draft the step turned down, where its own token went


@dataclass(frozen=True)
class _End:
    """The last event of a request: its result, or the error that ended it (both None: cancelled while queued)."""

    result: GenerationResult | None = None
    error: BaseException | None = None


@dataclass(eq=False)  # a handle is one request: compared by identity
class RequestHandle:
    """One submitted request, read by the one caller that submitted it.

    ``stream()`` yields the tokens as steps accept them, in lists, and ends
    when the request does; ``result()`` waits for the end and returns the
    result, raises ``Cancelled`` when the request was cancelled while queued,
    or raises the error that failed it. Both may be called once each, in that
    order, or ``result()`` alone. The scheduler's thread writes through the
    ``_push``/``_end`` methods.
    """

    request: GenerationRequest
    arrived: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None  # when it got a cache slot
    first_token_at: float | None = None
    cancelled: bool = False
    trace_context: Any = None  # the request's tracing context, for the observer
    _sequence: SequenceHandle | None = None  # the engine's, once the request has a cache slot
    _events: queue.Queue[TokenChunk | _End] = field(default_factory=queue.Queue)
    _ending: _End | None = None
    # Handles queued together (Scheduler.submit_group) share a feed: each event's handle, for interleave().
    _feed: queue.Queue[RequestHandle] | None = None

    def stream(self, timeout_s: float | None = None) -> Iterator[TokenChunk]:
        """The tokens as they are accepted, a step's at a time (never empty); ``timeout_s``
        bounds each wait (TimeoutError), for callers that must not hang on a stuck scheduler."""
        while self._ending is None:
            try:
                event = self._events.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"no event from request {self.request.request_id!r} in {timeout_s} s") from None
            if isinstance(event, _End):
                self._ending = event
            else:
                yield event

    def result(self, timeout_s: float | None = None) -> GenerationResult:
        """How the request ended; tokens not yet read through ``stream()`` are skipped."""
        for _ in self.stream(timeout_s):
            pass
        assert self._ending is not None  # stream() returns only at the end
        if self._ending.error is not None:
            raise self._ending.error
        if self._ending.result is None:
            raise Cancelled(f"request {self.request.request_id!r} was cancelled while queued")
        return self._ending.result

    def _push(self, outcome: StepOutcome) -> None:
        if outcome.tokens:
            if self.first_token_at is None:
                self.first_token_at = time.perf_counter()
            self._post(
                TokenChunk(
                    list(outcome.tokens), list(outcome.sources), outcome.verified, outcome.logprobs, outcome.evidence, outcome.rejected
                )
            )

    def _end(self, result: GenerationResult | None = None, error: BaseException | None = None) -> None:
        self._post(_End(result, error))

    def _post(self, event: TokenChunk | _End) -> None:
        self._events.put(event)
        if self._feed is not None:  # after the event: interleave() takes one event per feed entry
            self._feed.put(self)


def interleave(handles: list[RequestHandle]) -> Iterator[tuple[int, TokenChunk | None]]:
    """The chunks of requests queued together (``Scheduler.submit_group``), in the order the
    scheduler made them: ``(index, chunk)``, and ``(index, None)`` when request ``index``
    has ended (its ``result()`` then returns at once). Read a group this way or each
    handle's ``stream()``, not both."""
    feed = handles[0]._feed
    assert feed is not None and all(handle._feed is feed for handle in handles), "handles from one submit_group"
    where = {id(handle): index for index, handle in enumerate(handles)}
    running = len(handles)
    while running:
        handle = feed.get()
        event = handle._events.get_nowait()  # the feed holds one entry per event, put after it
        if isinstance(event, _End):
            handle._ending = event
            running -= 1
            yield where[id(handle)], None
        else:
            yield where[id(handle)], event


class Scheduler:
    def __init__(self, engine: SpeculativeEngine, config: SchedulerConfig, observer: SchedulerObserver | None = None) -> None:
        self.engine = engine
        self.config = config
        self.observer = observer or NoObserver()
        self._waiting: collections.deque[RequestHandle] = collections.deque()
        self._running: list[RequestHandle] = []
        self._wake = threading.Condition()
        self._stopping = False
        self.steps = 0
        self._thread = threading.Thread(target=self._loop, name="verifier-scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: GenerationRequest, trace_context: object = None) -> RequestHandle:
        [handle] = self._queue([RequestHandle(request, trace_context=trace_context)])
        return handle

    def submit_group(self, requests: list[GenerationRequest], trace_context: object = None) -> list[RequestHandle]:
        """Queue requests together, all or none (an HTTP request's ``n`` choices): their
        handles share one feed, read with ``interleave``."""
        feed: queue.Queue[RequestHandle] = queue.Queue()
        return self._queue([RequestHandle(request, trace_context=trace_context, _feed=feed) for request in requests])

    def _queue(self, handles: list[RequestHandle]) -> list[RequestHandle]:
        with self._wake:
            if self._stopping:
                raise ShuttingDown("the verifier is shutting down; retry on another replica")
            if len(self._waiting) + len(handles) > self.config.max_queued:
                room = "" if len(handles) == 1 else f", no room for {len(handles)} more"
                raise QueueFull(
                    f"{len(self._running)} requests running and {len(self._waiting)} queued "
                    f"(limit {self.config.max_queued}{room}); retry with backoff"
                )
            self._waiting.extend(handles)
            self._wake.notify()
        return handles

    def cancel(self, handle: RequestHandle) -> None:
        """Free the handle's queue place now, or its batch slot at the next step boundary
        (safe from any thread, any time)."""
        with self._wake:
            handle.cancelled = True
            for index, waiting in enumerate(self._waiting):
                if waiting is handle:
                    del self._waiting[index]
                    handle._end()
                    break
            self._wake.notify()

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def batch_size(self) -> int:
        return len(self._running)

    def stop(self, timeout_s: float) -> bool:
        """Refuse new requests, let running and queued ones finish for up to ``timeout_s``,
        then cancel what is left. True when everything finished in time."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and (self._waiting or self._running):
            time.sleep(0.02)
        drained = not (self._waiting or self._running)
        with self._wake:
            for handle in list(self._waiting) + self._running:
                handle.cancelled = True
            self._wake.notify()
        self._thread.join(timeout=max(1.0, timeout_s))
        return drained

    # -- the loop -------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._waiting and not self._running:
                    if self._stopping:
                        return
                    self._wake.wait()
                for handle in self._running:
                    if handle.cancelled and handle._sequence is not None:
                        self.engine.cancel(handle._sequence)
            try:
                self._admit()
                if self._running:
                    self._step()
            except Exception as error:  # never let one bad step take the service down
                log.exception("step failed; failing the batch and starting over")
                self.engine.abort_all()
                for handle in self._running:
                    handle._end(error=error)
                self._running = []

    def _admit(self) -> None:
        """Give waiting requests free cache slots; their prefill runs inside the next steps."""
        while self.engine.free_slots:
            with self._wake:
                if not self._waiting:
                    return
                handle = self._waiting.popleft()
            if handle.cancelled:  # gave up while queued: costs nothing
                handle._end()
                continue
            try:
                handle._sequence = self.engine.add(handle.request)
                handle.admitted_at = time.perf_counter()
            except Exception as error:  # a bad request (ValueError, validated by the service already) or a bug: this request only
                if not isinstance(error, ValueError):
                    log.exception("admitting a request failed")
                handle._end(error=error)
                continue
            self._running.append(handle)

    def _step(self) -> None:
        by_sequence = {handle._sequence: handle for handle in self._running}
        started = time.perf_counter()
        with self.observer.step(self._running):
            outcomes = self.engine.step()
        seconds = time.perf_counter() - started
        self.steps += 1
        stepped, rows = [], []
        for outcome in outcomes:
            handle = by_sequence[outcome.sequence]
            if outcome.first:
                self.observer.prefilled(handle, len(outcome.tokens))
            elif outcome.tokens:
                stepped.append(handle)
                rows.append(outcome)
            handle._push(outcome)
            if outcome.error is not None or outcome.result is not None:
                handle._end(outcome.result, outcome.error)
                self._running.remove(handle)
        self.observer.stepped(stepped, seconds, rows, self.engine.last_step)
