"""Continuous batching over a real engine and the tiny model: results, events, bounds, cancel, errors, stop."""

from __future__ import annotations

import threading
import time

import pytest

from drafter_service.sessions import NGramDrafter
from verifier_service.core.drafting import SessionProposer
from verifier_service.core.engine import FINISH_CANCELLED, FINISH_LENGTH, EngineConfig, GenerationRequest, SpeculativeEngine
from verifier_service.serving.scheduler import Cancelled, QueueFull, Scheduler, SchedulerConfig, ShuttingDown, interleave

PROMPTS = [[5, 6, 7], [9, 3, 3, 9, 3, 3, 9, 3], [12], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [20, 21, 20, 21], [33]]
NO_EOS = frozenset()
# Waiting on another thread is bounded so a broken scheduler fails the test instead of hanging it.
EVENT_TIMEOUT_S = 30


def make_engine(model, tokenizer, drafter: bool = True, batch: int = 16) -> SpeculativeEngine:
    proposer = SessionProposer(NGramDrafter()) if drafter else None
    engine = SpeculativeEngine(model, tokenizer, proposer, EngineConfig(max_batch_size=batch))
    engine.eos_token_ids = NO_EOS  # random weights: keep sequences running to max_new_tokens
    return engine


def alone(model, tokenizer, request: GenerationRequest) -> list[int]:
    """The request's tokens from a fresh engine, on its own."""
    [result] = make_engine(model, tokenizer).generate([request])
    return result.token_ids


def drain(handle) -> tuple[list[list[int]], object]:
    """(the chunks ``stream()`` yielded, then ``result()``'s value or the exception it raised)."""
    chunks = [chunk.tokens for chunk in handle.stream(EVENT_TIMEOUT_S)]
    try:
        return chunks, handle.result(EVENT_TIMEOUT_S)
    except Exception as error:
        return chunks, error


def result_of(handle):
    return handle.result(EVENT_TIMEOUT_S)


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting until {what}")
        time.sleep(0.005)


class GatedStep:
    """Wraps engine.step: after ``after`` steps, the loop thread parks until ``release`` is set."""

    def __init__(self, engine, after: int = 1) -> None:
        self.step, self.after, self.count = engine.step, after, 0
        self.parked, self.release = threading.Event(), threading.Event()
        engine.step = self

    def __call__(self):
        result = self.step()
        self.count += 1
        if self.count == self.after:
            self.parked.set()
            assert self.release.wait(EVENT_TIMEOUT_S), "the test never released the step"
        return result


@pytest.fixture
def scheduler_factory(tiny_model, tiny_tokenizer):
    started = []

    def build(batch=4, queued=16, drafter=True, start=True):
        scheduler = Scheduler(make_engine(tiny_model, tiny_tokenizer, drafter, batch), SchedulerConfig(max_queued=queued))
        if start:
            scheduler.start()
        started.append(scheduler)
        return scheduler

    yield build
    for scheduler in started:
        if scheduler._thread.is_alive():
            scheduler.stop(timeout_s=EVENT_TIMEOUT_S)


REQUESTS = [
    GenerationRequest(PROMPTS[0], 20, num_speculative_tokens=3, request_id="a"),
    GenerationRequest(PROMPTS[1], 30, num_speculative_tokens=None, request_id="b"),
    GenerationRequest(PROMPTS[2], 12, num_speculative_tokens=0, request_id="c"),
    GenerationRequest(PROMPTS[3], 25, num_speculative_tokens=5, request_id="d"),
    GenerationRequest(PROMPTS[4], 18, num_speculative_tokens=None, request_id="e"),
    GenerationRequest(PROMPTS[5], 1, num_speculative_tokens=2, request_id="f"),  # done at prefill
]


@pytest.mark.parametrize("drafter", [True, False])
def test_requests_from_many_threads_equal_each_request_run_alone(scheduler_factory, tiny_model, tiny_tokenizer, drafter):
    scheduler = scheduler_factory(drafter=drafter)  # batch of 4: two of the six wait for a slot
    results = {}

    def client(request):
        results[request.request_id] = result_of(scheduler.submit(request))

    threads = [threading.Thread(target=client, args=(request,)) for request in REQUESTS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(EVENT_TIMEOUT_S)
    assert sorted(results) == ["a", "b", "c", "d", "e", "f"]
    for request in REQUESTS:
        result = results[request.request_id]
        assert result.request_id == request.request_id
        assert result.token_ids == alone(tiny_model, tiny_tokenizer, request)
        assert result.finish_reason == FINISH_LENGTH
    assert scheduler.batch_size == 0 and scheduler.queue_depth == 0


def test_events_stream_tokens_in_order_then_the_result(scheduler_factory, tiny_model, tiny_tokenizer):
    scheduler = scheduler_factory()
    handles = [scheduler.submit(request) for request in REQUESTS]
    for request, handle in zip(REQUESTS, handles):
        chunks, result = drain(handle)
        streamed = [token for tokens in chunks for token in tokens]
        assert streamed == result.token_ids == alone(tiny_model, tiny_tokenizer, request)
        assert all(chunks)  # no empty chunks
        assert len(chunks) > 1 or len(streamed) == 1  # as steps accept them, not all at the end
        assert handle.first_token_at is not None and handle.first_token_at >= handle.arrived


def test_done_at_prefill_streams_one_token(scheduler_factory, tiny_model, tiny_tokenizer):
    scheduler = scheduler_factory()
    handle = scheduler.submit(REQUESTS[5])
    chunks, result = drain(handle)
    expected = alone(tiny_model, tiny_tokenizer, REQUESTS[5])
    assert len(expected) == 1
    assert chunks == [expected]
    assert result.token_ids == expected


def test_a_bounded_wait_on_a_stuck_scheduler_raises_timeout_error(scheduler_factory):
    scheduler = scheduler_factory(start=False)  # nothing ever steps
    handle = scheduler.submit(REQUESTS[0])
    with pytest.raises(TimeoutError, match=r"^no event from request 'a' in 0.05 s$"):
        next(handle.stream(timeout_s=0.05))
    with pytest.raises(TimeoutError):
        handle.result(timeout_s=0.05)


def test_submit_beyond_max_queued_raises_queue_full(scheduler_factory, tiny_model, tiny_tokenizer):
    scheduler = scheduler_factory(batch=4, queued=2, start=False)
    first = scheduler.submit(REQUESTS[0])
    second = scheduler.submit(REQUESTS[2])
    with pytest.raises(QueueFull, match=r"^0 requests running and 2 queued \(limit 2\); retry with backoff$"):
        scheduler.submit(REQUESTS[3])
    assert scheduler.queue_depth == 2
    scheduler.start()  # the queued two are served; the refused one never ran
    assert result_of(first).token_ids == alone(tiny_model, tiny_tokenizer, REQUESTS[0])
    assert result_of(second).token_ids == alone(tiny_model, tiny_tokenizer, REQUESTS[2])
    assert scheduler.steps > 0


def test_a_group_is_queued_whole_or_not_at_all_and_read_interleaved(scheduler_factory, tiny_model, tiny_tokenizer):
    scheduler = scheduler_factory(batch=2, queued=3, start=False)
    single = scheduler.submit(REQUESTS[0])
    with pytest.raises(QueueFull, match=r"^0 requests running and 1 queued \(limit 3, no room for 3 more\); retry with backoff$"):
        scheduler.submit_group([REQUESTS[1], REQUESTS[2], REQUESTS[3]])
    assert scheduler.queue_depth == 1  # none of the three was queued
    group = scheduler.submit_group([REQUESTS[2], REQUESTS[3]])
    scheduler.start()
    tokens: dict[int, list[int]] = {0: [], 1: []}
    ended = []
    for index, chunk in interleave(group):
        if chunk is None:
            ended.append(index)
        else:
            assert index not in ended  # nothing of a request after its end
            tokens[index] += chunk.tokens
    assert sorted(ended) == [0, 1]
    for index, request in enumerate((REQUESTS[2], REQUESTS[3])):
        assert tokens[index] == group[index].result(timeout_s=EVENT_TIMEOUT_S).token_ids == alone(tiny_model, tiny_tokenizer, request)
    assert result_of(single).token_ids == alone(tiny_model, tiny_tokenizer, REQUESTS[0])


def test_queue_full_counts_running_requests(scheduler_factory):
    scheduler = scheduler_factory(batch=1, queued=1)
    gate = GatedStep(scheduler.engine)
    running = scheduler.submit(GenerationRequest(PROMPTS[0], 10, request_id="running"))
    assert gate.parked.wait(EVENT_TIMEOUT_S)  # admitted and stepping: the queue is empty again
    waiting = scheduler.submit(GenerationRequest(PROMPTS[1], 10, request_id="waiting"))
    with pytest.raises(QueueFull, match=r"^1 requests running and 1 queued \(limit 1\)"):
        scheduler.submit(GenerationRequest(PROMPTS[2], 10))
    gate.release.set()
    assert result_of(running).finish_reason == FINISH_LENGTH
    assert result_of(waiting).finish_reason == FINISH_LENGTH


def test_cancel_while_queued_raises_cancelled_and_costs_nothing(scheduler_factory):
    scheduler = scheduler_factory(start=False)
    cancelled = scheduler.submit(REQUESTS[1])
    kept = scheduler.submit(REQUESTS[0])
    scheduler.cancel(cancelled)
    scheduler.start()
    chunks, outcome = drain(cancelled)
    assert chunks == [] and isinstance(outcome, Cancelled)  # no tokens: it was never prefilled
    assert str(outcome) == "request 'b' was cancelled while queued"
    assert result_of(kept).finish_reason == FINISH_LENGTH
    assert cancelled._sequence is None


def test_result_of_a_request_cancelled_while_queued_raises_cancelled(scheduler_factory):
    scheduler = scheduler_factory(start=False)
    handle = scheduler.submit(REQUESTS[0])
    scheduler.cancel(handle)
    scheduler.start()
    with pytest.raises(Cancelled):
        result_of(handle)


def test_cancel_while_running_finishes_it_as_cancelled(scheduler_factory, tiny_model, tiny_tokenizer):
    scheduler = scheduler_factory()
    gate = GatedStep(scheduler.engine)
    long_request = GenerationRequest(PROMPTS[1], 200, num_speculative_tokens=0, request_id="long")
    other_request = GenerationRequest(PROMPTS[0], 20, num_speculative_tokens=3, request_id="other")
    victim = scheduler.submit(long_request)
    other = scheduler.submit(other_request)
    assert gate.parked.wait(EVENT_TIMEOUT_S)  # both admitted, one step (their prefill) done
    scheduler.cancel(victim)
    gate.release.set()
    chunks, result = drain(victim)
    assert result.finish_reason == FINISH_CANCELLED
    # Prefill's token only: the cancel lands at the next step boundary.
    assert len(result.token_ids) == 1
    assert result.token_ids == alone(tiny_model, tiny_tokenizer, long_request)[:1]
    assert [t for tokens in chunks for t in tokens] == result.token_ids
    # The other request is unaffected.
    assert result_of(other).token_ids == alone(tiny_model, tiny_tokenizer, other_request)
    assert not scheduler.engine.busy


def test_a_failing_step_fails_the_running_requests_and_the_scheduler_goes_on(scheduler_factory, tiny_model, tiny_tokenizer, monkeypatch):
    scheduler = scheduler_factory()
    engine = scheduler.engine
    real_step = engine.step
    failures = []

    def failing_once():
        if not failures:
            failures.append(1)
            raise RuntimeError("simulated out of memory")
        return real_step()

    monkeypatch.setattr(engine, "step", failing_once)
    first, second = scheduler.submit(REQUESTS[0]), scheduler.submit(REQUESTS[3])
    with pytest.raises(RuntimeError, match="^simulated out of memory$"):
        result_of(first)
    chunks, error = drain(second)
    assert chunks == []  # the failing step was its prefill: no tokens
    assert isinstance(error, RuntimeError) and str(error) == "simulated out of memory"
    # The batch was reset (proposer sessions closed) and a new request is served exactly.
    assert not engine.busy and engine.free_slots == engine.config.max_batch_size
    assert engine.proposer._sent == {}
    after = scheduler.submit(REQUESTS[1])
    assert result_of(after).token_ids == alone(tiny_model, tiny_tokenizer, REQUESTS[1])


def test_a_failing_admission_reports_an_error_to_its_request(scheduler_factory, tiny_model, tiny_tokenizer, monkeypatch):
    """A failure while admitting one request (engine.add) ends that request only; the
    handle, already off the queue and not yet running, must still get its event."""
    scheduler = scheduler_factory(start=False)
    engine = scheduler.engine
    real_add = engine.add
    failures = []

    def failing_once(request):
        if not failures:
            failures.append(1)
            raise RuntimeError("simulated failure in add")
        return real_add(request)

    monkeypatch.setattr(engine, "add", failing_once)
    doomed = scheduler.submit(REQUESTS[0])
    scheduler.start()
    # The loop handles the failure within milliseconds; without the event, result() blocks forever.
    with pytest.raises(RuntimeError, match="^simulated failure in add$"):
        doomed.result(timeout_s=5)
    after = scheduler.submit(REQUESTS[2])
    assert result_of(after).token_ids == alone(tiny_model, tiny_tokenizer, REQUESTS[2])


def test_invalid_request_gets_its_value_error_and_others_run(scheduler_factory, tiny_model, tiny_tokenizer):
    scheduler = scheduler_factory()
    bad = scheduler.submit(GenerationRequest([1, 64], 5))  # token 64 is outside the tiny vocabulary
    good = scheduler.submit(REQUESTS[0])
    with pytest.raises(ValueError, match=r"token ids outside the vocabulary \[0, 64\): \[64\]"):
        result_of(bad)
    assert result_of(good).token_ids == alone(tiny_model, tiny_tokenizer, REQUESTS[0])


def test_stop_drains_running_requests_then_refuses_new_ones(scheduler_factory, tiny_model, tiny_tokenizer):
    scheduler = scheduler_factory()
    handles = [scheduler.submit(request) for request in REQUESTS[:5]]  # 4 run, 1 waits
    assert scheduler.stop(timeout_s=EVENT_TIMEOUT_S) is True
    for request, handle in zip(REQUESTS, handles):
        result = result_of(handle)
        assert result.finish_reason == FINISH_LENGTH
        assert result.token_ids == alone(tiny_model, tiny_tokenizer, request)
    with pytest.raises(ShuttingDown, match="^the verifier is shutting down; retry on another replica$"):
        scheduler.submit(REQUESTS[0])
    assert not scheduler._thread.is_alive()


def test_stop_with_an_idle_loop_returns_at_once(scheduler_factory):
    scheduler = scheduler_factory()
    assert scheduler.stop(timeout_s=EVENT_TIMEOUT_S) is True
    assert not scheduler._thread.is_alive()
    with pytest.raises(ShuttingDown, match="^the verifier is shutting down; retry on another replica$"):
        scheduler.submit(REQUESTS[0])


def test_stop_past_its_timeout_cancels_what_is_left(scheduler_factory, tiny_model, tiny_tokenizer):
    scheduler = scheduler_factory(batch=1, queued=4)
    gate = GatedStep(scheduler.engine)
    running = scheduler.submit(GenerationRequest(PROMPTS[1], 200, num_speculative_tokens=0))
    queued = scheduler.submit(REQUESTS[0])
    assert gate.parked.wait(EVENT_TIMEOUT_S)  # the loop is held inside its first step
    outcome = []
    stopper = threading.Thread(target=lambda: outcome.append(scheduler.stop(timeout_s=0.05)))
    stopper.start()
    wait_until(lambda: running.cancelled and queued.cancelled, "stop() cancels what is left")
    gate.release.set()
    stopper.join(EVENT_TIMEOUT_S)
    assert outcome == [False]  # not drained in time
    result = result_of(running)
    assert result.finish_reason == FINISH_CANCELLED
    # The step held at the gate was its prefill: its first token, then the cancel.
    assert result.token_ids == alone(tiny_model, tiny_tokenizer, GenerationRequest(PROMPTS[1], 1, num_speculative_tokens=0))
    with pytest.raises(Cancelled):  # never admitted
        result_of(queued)
