"""Continuous batching: one thread owns the engine; requests join and leave between steps.

Callers ``submit`` a request and get a ``RequestHandle`` whose event queue
yields the tokens as they are accepted, then the result. The loop, per
iteration: mark cancelled sequences, admit waiting requests while the engine
has free cache slots (their prompts are prefilled in chunks by the following
steps, alongside the running sequences), run one step, and hand each
sequence what the step produced for it.

Bounds: at most ``max_batch_size`` sequences run at once and at most
``max_queued`` wait; beyond that ``submit`` raises ``QueueFull`` at once
(the service answers RESOURCE_EXHAUSTED), so overload never piles up latency.

A failure that belongs to one request (its sampling, its stop strings, its
part of the forward pass: see ``SpeculativeEngine._score``) fails that
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
from dataclasses import dataclass, field
from typing import Any, Protocol

from verifier_service.engine import GenerationRequest, GenerationResult, SpeculativeEngine

log = logging.getLogger(__name__)


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


@dataclass(frozen=True)
class RowStep:
    """One sequence's part in one step."""

    verified: int  # draft tokens the target scored
    accepted: int  # of those, accepted
    emitted: int  # tokens added to the output (accepted + the step's own, cut at a stop)


class SchedulerObserver(Protocol):
    def step(self, handles: list[RequestHandle]) -> contextlib.AbstractContextManager:
        """Wraps one engine step over ``handles`` (the batch, in row order)."""

    def stepped(self, handles: list[RequestHandle], seconds: float, rows: list[RowStep]) -> None:
        """After a step: ``rows[i]`` is what it did for decoding sequence ``handles[i]``."""

    def prefilled(self, handle: RequestHandle, emitted: int) -> None: ...


class NoObserver:
    def step(self, handles):
        return contextlib.nullcontext()

    def stepped(self, handles, seconds, rows) -> None:
        pass

    def prefilled(self, handle, emitted) -> None:
        pass


@dataclass
class SchedulerConfig:
    # Sequences in one forward pass: on a 2-core CPU a step of 16 rows costs
    # ~3x a step of 1; more rows stop paying long before memory runs out.
    max_batch_size: int = 16
    # Requests waiting for a slot; beyond it new requests are refused at once.
    max_queued: int = 64


@dataclass
class RequestHandle:
    request: GenerationRequest
    arrived: float = field(default_factory=time.perf_counter)
    # ("tokens", list[int]) as they are accepted, then ("done", GenerationResult)
    # or ("error", exception). Consumed by the one gRPC call that owns the handle.
    events: queue.Queue = field(default_factory=queue.Queue)
    first_token_at: float | None = None
    cancelled: bool = False
    trace_context: Any = None  # the request's tracing context, for the observer
    _sequence: Any = None  # the engine's handle, once the request has a cache slot


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
        handle = RequestHandle(request, trace_context=trace_context)
        with self._wake:
            if self._stopping:
                raise ShuttingDown("the verifier is shutting down; retry on another replica")
            if len(self._waiting) >= self.config.max_queued:
                raise QueueFull(
                    f"{len(self._running)} requests running and {len(self._waiting)} queued "
                    f"(limit {self.config.max_queued}); retry with backoff"
                )
            self._waiting.append(handle)
            self._wake.notify()
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        """Free the handle's queue place now, or its batch slot at the next step boundary
        (safe from any thread, any time)."""
        with self._wake:
            handle.cancelled = True
            for index, waiting in enumerate(self._waiting):
                if waiting is handle:  # identity: handles are dataclasses, == compares fields
                    del self._waiting[index]
                    handle.events.put(("done", None))
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
                    if handle.cancelled:
                        self.engine.cancel(handle._sequence)
            try:
                self._admit()
                if self._running:
                    self._step()
            except Exception as error:  # never let one bad step take the service down
                log.exception("step failed; failing the batch and starting over")
                self.engine.abort_all()
                for handle in self._running:
                    handle.events.put(("error", error))
                self._running = []

    def _admit(self) -> None:
        """Give waiting requests free cache slots; their prefill runs inside the next steps."""
        while len(self._running) < self.config.max_batch_size and self.engine.free_slots:
            with self._wake:
                if not self._waiting:
                    return
                handle = self._waiting.popleft()
            if handle.cancelled:  # gave up while queued: costs nothing
                handle.events.put(("done", None))
                continue
            try:
                handle._sequence = self.engine.add(handle.request)
            except Exception as error:  # a bad request (ValueError, validated by the service already) or a bug: this request only
                if not isinstance(error, ValueError):
                    log.exception("admitting a request failed")
                handle.events.put(("error", error))
                continue
            self._running.append(handle)

    def _step(self) -> None:
        by_sequence = {id(handle._sequence): handle for handle in self._running}
        started = time.perf_counter()
        with self.observer.step(self._running):
            outcomes = self.engine.step()
        seconds = time.perf_counter() - started
        self.steps += 1
        stepped, rows = [], []
        for outcome in outcomes:
            handle = by_sequence[id(outcome.sequence)]
            if outcome.first:
                self.observer.prefilled(handle, len(outcome.tokens))
            elif outcome.tokens:
                stepped.append(handle)
                rows.append(RowStep(outcome.verified, outcome.accepted, len(outcome.tokens)))
            self._deliver(handle, outcome.tokens)
            if outcome.error is not None:
                handle.events.put(("error", outcome.error))
                self._running.remove(handle)
            elif outcome.result is not None:
                handle.events.put(("done", outcome.result))
                self._running.remove(handle)
        self.observer.stepped(stepped, seconds, rows)

    @staticmethod
    def _deliver(handle: RequestHandle, tokens: list[int]) -> None:
        if tokens:
            if handle.first_token_at is None:
                handle.first_token_at = time.perf_counter()
            handle.events.put(("tokens", list(tokens)))


def result_of(handle: RequestHandle) -> GenerationResult | None:
    """Block until the handle's request ends; None when it was cancelled while queued."""
    while True:
        kind, payload = handle.events.get()
        if kind == "done":
            return payload
        if kind == "error":
            raise payload
