"""One request's failure ends that request only: its batch-mates keep their exact tokens.

Faults are injected where they would strike in production: the forward
pass (a fault tied to one sequence's positions, so it strikes whichever pass
carries them), a row's sampling, and the proposer.
"""

from __future__ import annotations

import pytest

from drafter_service.sessions import NGramDrafter
from verifier_service.core import acceptance as acceptance_module
from verifier_service.core.calibration import StepCostModel
from verifier_service.core.drafting import SessionProposer
from verifier_service.core.engine import FINISH_LENGTH, GenerationRequest, SpeculativeEngine, reference_greedy
from verifier_service.core.rejection import SamplingParams
from verifier_service.serving.scheduler import Scheduler, SchedulerConfig

NO_EOS = frozenset()
# The victim's prompt is longer than any other sequence ever gets, so a fault
# at a position past the others' reach belongs to the victim alone.
VICTIM_PROMPT = list(range(30, 50))  # positions 0..19
OTHERS = [
    GenerationRequest([5, 6, 7], 10, num_speculative_tokens=3),  # positions up to 12
    GenerationRequest([9, 3, 3, 9, 3, 3, 9, 3], 6, num_speculative_tokens=None),  # up to 13
    GenerationRequest([12], 12, num_speculative_tokens=0),  # up to 12
]
IN_PREFILL, IN_DECODE = 15, 23  # inside the victim's prompt; past it, at its 4th generated token


class FaultAtPosition:
    """Makes the engine's model raise whenever a pass carries ``position`` (like a kernel
    fault tied to one sequence's data). Restores the model on exit."""

    def __init__(self, engine: SpeculativeEngine, position: int) -> None:
        self.target, self.position, self.strikes = engine.target, position, 0

    def __enter__(self):
        real = self.target.run

        def run(input_ids, layout, kept):
            if (layout.position_ids == self.position).any():
                self.strikes += 1
                raise RuntimeError(f"simulated fault at position {self.position}")
            return real(input_ids, layout, kept)

        self.target.run = run
        return self

    def __exit__(self, *exc):
        del self.target.run  # the instance attribute; the class's method shows again


def make_engine(model, tokenizer, drafter=None, seconds_per_token: float = 0.1) -> SpeculativeEngine:
    engine = SpeculativeEngine(
        model, tokenizer, SessionProposer(drafter or NGramDrafter()), step_cost=StepCostModel.linear(1.0, seconds_per_token)
    )
    engine.eos_token_ids = NO_EOS  # random weights: keep sequences running to max_new_tokens
    return engine


def run(engine, requests):
    """Step until done: (streamed tokens, result or error) per request."""
    sequences = [engine.add(request) for request in requests]
    streamed = {id(sequence): [] for sequence in sequences}
    ends = {}
    while engine.busy:
        for outcome in engine.step():
            streamed[id(outcome.sequence)] += outcome.tokens
            if outcome.error is not None:
                ends[id(outcome.sequence)] = outcome.error
            elif outcome.result is not None:
                ends[id(outcome.sequence)] = outcome.result
    return [(streamed[id(s)], ends[id(s)]) for s in sequences]


@pytest.mark.parametrize("position", [IN_PREFILL, IN_DECODE], ids=["prefill", "decode"])
def test_a_forward_fault_in_one_sequence_fails_only_that_sequence(tiny_model, tiny_tokenizer, position):
    engine = make_engine(tiny_model, tiny_tokenizer)
    victim = GenerationRequest(VICTIM_PROMPT, 10, num_speculative_tokens=4)
    with FaultAtPosition(engine, position) as fault:
        outcomes = run(engine, [victim, *OTHERS])
    assert fault.strikes >= 2  # the packed pass, then the victim's own
    (streamed, error), *others = outcomes
    assert isinstance(error, RuntimeError) and str(error) == f"simulated fault at position {position}"
    truth = reference_greedy(tiny_model, VICTIM_PROMPT, 10, NO_EOS)
    # What it streamed before the fault is right: nothing if the fault was in its prompt,
    # else at least the prefill's token and none fed at or past the faulting position.
    assert streamed == truth[: len(streamed)]
    if position < len(VICTIM_PROMPT):
        assert streamed == []
    else:
        assert 1 <= len(streamed) <= position + 1 - len(VICTIM_PROMPT)
    for request, (tokens, result) in zip(OTHERS, others):
        assert result.finish_reason == FINISH_LENGTH
        assert tokens == result.token_ids == reference_greedy(tiny_model, request.prompt_ids, request.max_new_tokens, NO_EOS)
    # Every slot is free and the cache serves a new request exactly.
    assert not engine.busy and engine.free_slots == engine.config.max_batch_size
    [again] = engine.generate([victim])
    assert again.token_ids == truth


@pytest.mark.parametrize("fail_at_call", [1, 4], ids=["first token", "decode"])
def test_a_sampling_fault_in_one_row_fails_only_that_row(tiny_model, tiny_tokenizer, monkeypatch, fail_at_call):
    doomed = SamplingParams(temperature=0.77, seed=3)
    real, calls = acceptance_module.warp_probs, []

    def warp_probs(logits, params):
        if params == doomed:
            calls.append(1)
            if len(calls) >= fail_at_call:
                raise FloatingPointError("simulated sampling fault")
        return real(logits, params)

    sampled = GenerationRequest([5, 6, 7], 12, SamplingParams(temperature=0.9, seed=11), num_speculative_tokens=3)
    alone = make_engine(tiny_model, tiny_tokenizer).generate([sampled])[0].token_ids
    monkeypatch.setattr(acceptance_module, "warp_probs", warp_probs)
    engine = make_engine(tiny_model, tiny_tokenizer)
    (streamed, error), (_, greedy), (_, other) = run(
        engine,
        [GenerationRequest([20, 21, 20, 21], 12, doomed, num_speculative_tokens=3), OTHERS[0], sampled],
    )
    assert isinstance(error, FloatingPointError)
    assert (streamed == []) if fail_at_call == 1 else (len(streamed) >= 1)  # in decode: after its first token
    assert greedy.token_ids == reference_greedy(tiny_model, OTHERS[0].prompt_ids, OTHERS[0].max_new_tokens, NO_EOS)
    assert other.token_ids == alone  # a seeded sampled batch-mate keeps its exact tokens too
    assert engine.free_slots == engine.config.max_batch_size


class FailingDrafter(NGramDrafter):
    """An in-process drafter that fails every propose and close."""

    def propose(self, session_id, new_tokens, k):
        raise ConnectionError("simulated drafter failure")

    def close(self, session_id, observe=True):
        raise ConnectionError("simulated drafter failure")


def test_a_failing_proposer_costs_drafts_never_requests(tiny_model, tiny_tokenizer):
    engine = make_engine(tiny_model, tiny_tokenizer, FailingDrafter())
    results = engine.generate(OTHERS)
    for request, result in zip(OTHERS, results):
        assert result.token_ids == reference_greedy(tiny_model, request.prompt_ids, request.max_new_tokens, NO_EOS)
        assert result.stats.draft_tokens == 0


def test_the_scheduler_fails_only_the_faulting_request(tiny_model, tiny_tokenizer):
    engine = make_engine(tiny_model, tiny_tokenizer)
    scheduler = Scheduler(engine, SchedulerConfig(max_queued=8))
    scheduler.start()
    try:
        with FaultAtPosition(engine, IN_DECODE):
            victim = scheduler.submit(GenerationRequest(VICTIM_PROMPT, 10, num_speculative_tokens=4))
            others = [scheduler.submit(request) for request in OTHERS]
            with pytest.raises(RuntimeError, match=f"^simulated fault at position {IN_DECODE}$"):
                victim.result(timeout_s=60)
            results = [handle.result(timeout_s=60) for handle in others]
    finally:
        scheduler.stop(timeout_s=30)
    for request, result in zip(OTHERS, results):
        assert result.token_ids == reference_greedy(tiny_model, request.prompt_ids, request.max_new_tokens, NO_EOS)
