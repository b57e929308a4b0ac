"""Adaptive K, cancellation and drafter feedback in the decode loop, on the tiny seeded Llama."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from verifier_service.adaptive import StepCostModel
from verifier_service.drafting import DraftRequest
from verifier_service.engine import (
    FINISH_CANCELLED,
    FINISH_LENGTH,
    GenerationRequest,
    SpeculativeEngine,
    reference_greedy,
)

PROMPTS = [[5, 6, 7], [9, 3, 3, 9, 3, 3, 9, 3], [12], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]]
NO_EOS = frozenset()
TRUTH_LENGTH = 64


class FrozenStepCost(StepCostModel):
    """A cost model that ignores measured step times, so the widths chosen do not depend on the clock."""

    def observe(self, rows: int, seconds: float) -> None:
        pass


@dataclass
class Call:
    session_id: str
    tokens: list[int]
    k: int
    verified: int
    accepted: int
    draft: list[int]


@dataclass
class RecordingProposer:
    """A batched ``DraftProposer``: drafts from ``guess(prompt, done, k)``; records every request and close."""

    guess: callable
    calls: list[Call] = field(default_factory=list)
    closed: list[tuple[str, list[int]]] = field(default_factory=list)

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        drafts = []
        for request in requests:
            prompt = next(p for p in PROMPTS if request.tokens[: len(p)] == p)
            draft = list(self.guess(prompt, len(request.tokens) - len(prompt), request.k))[: request.k]
            # request.tokens is the engine's live list: keep a copy of what it held at this call.
            self.calls.append(Call(request.session_id, list(request.tokens), request.k, request.verified, request.accepted, draft))
            drafts.append(draft)
        return drafts

    def close(self, finished: list[tuple[str, list[int]]]) -> None:
        self.closed.extend((session_id, list(tokens)) for session_id, tokens in finished)

    def calls_for(self, session_id: str) -> list[Call]:
        return [call for call in self.calls if call.session_id == session_id]


_truths: dict[tuple[int, ...], list[int]] = {}


def truth(model, prompt: list[int]) -> list[int]:
    """The plain greedy continuation of ``prompt`` (EOS ignored), computed once per prompt."""
    if tuple(prompt) not in _truths:
        _truths[tuple(prompt)] = reference_greedy(model, prompt, TRUTH_LENGTH, NO_EOS)
    return _truths[tuple(prompt)]


def oracle(model):
    """Drafts the true greedy continuation."""
    return lambda prompt, done, k: truth(model, prompt)[done : done + k]


def always_wrong(model):
    """Drafts whose first token is never the true next one, so nothing is ever accepted."""
    return lambda prompt, done, k: [(t + 1) % 64 for t in truth(model, prompt)[done : done + k]]


def engine_for(model, tokenizer, proposer, step_cost=None) -> SpeculativeEngine:
    engine = SpeculativeEngine(model, tokenizer, proposer, step_cost=step_cost)
    engine.eos_token_ids = NO_EOS  # random weights: keep sequences running to max_new_tokens
    return engine


# -- adaptive K keeps greedy output exact ----------------------------------------------


@pytest.mark.parametrize("drafter", [oracle, always_wrong])
def test_adaptive_k_greedy_equals_plain_decoding(tiny_model, tiny_tokenizer, drafter):
    # The engine's default cost model, refined by real step times: whatever widths it picks, outputs are exact.
    engine = engine_for(tiny_model, tiny_tokenizer, RecordingProposer(drafter(tiny_model)))
    results = engine.generate([GenerationRequest(p, 24, num_speculative_tokens=None) for p in PROMPTS])
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == truth(tiny_model, prompt)[:24]
        assert result.finish_reason == FINISH_LENGTH


def test_adaptive_k_single_requests_equal_plain_decoding(tiny_model, tiny_tokenizer):
    engine = engine_for(tiny_model, tiny_tokenizer, RecordingProposer(oracle(tiny_model)))
    for prompt in PROMPTS:
        [result] = engine.generate([GenerationRequest(prompt, 17, num_speculative_tokens=None)])
        assert result.token_ids == truth(tiny_model, prompt)[:17]


def test_flat_cost_and_oracle_verify_the_whole_adaptive_draft(tiny_model, tiny_tokenizer):
    proposer = RecordingProposer(oracle(tiny_model))
    engine = engine_for(tiny_model, tiny_tokenizer, proposer, FrozenStepCost({1: 1.0, 1024: 1.0}))
    [result] = engine.generate([GenerationRequest(PROMPTS[0], 28, num_speculative_tokens=None)])
    assert result.token_ids == truth(tiny_model, PROMPTS[0])[:28]
    # Every width costs the same, so each step verifies all adaptive_max_k = 8 drafts:
    # prefill gives 1 token, then 3 steps of 8 accepted + 1 bonus give the other 27.
    assert [call.k for call in proposer.calls] == [8, 8, 8]
    assert result.stats.target_forward_passes == 1 + 3
    assert result.stats.draft_tokens == 24
    assert result.stats.accepted_tokens == 24


def test_flat_cost_and_oracle_in_a_batch_need_fewer_passes_than_tokens(tiny_model, tiny_tokenizer):
    engine = engine_for(tiny_model, tiny_tokenizer, RecordingProposer(oracle(tiny_model)), FrozenStepCost({1: 1.0, 1024: 1.0}))
    results = engine.generate([GenerationRequest(p, 40, num_speculative_tokens=None) for p in PROMPTS])
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == truth(tiny_model, prompt)[:40]
        # 1 at prefill, then 4 steps of 9 and one of 3 (the last budget is min(8, 3 - 1) = 2 drafts).
        assert result.stats.target_forward_passes == 6
        assert result.stats.draft_tokens == 4 * 8 + 2
        assert result.stats.acceptance_rate == 1.0


def test_steep_cost_never_verifies_always_wrong_drafts(tiny_model, tiny_tokenizer):
    # Cost = rows: W rows of cost buy fewer than W expected tokens per row whenever alpha < 1,
    # so adaptive rows verify no drafts at all: plain decoding, one token a pass.
    proposer = RecordingProposer(always_wrong(tiny_model))
    engine = engine_for(tiny_model, tiny_tokenizer, proposer, FrozenStepCost.linear(0.0, 1.0))
    results = engine.generate([GenerationRequest(p, 20, num_speculative_tokens=None) for p in PROMPTS])
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == truth(tiny_model, prompt)[:20]
        assert result.stats.draft_tokens == 0
        assert result.stats.target_forward_passes == 20
    assert {call.verified for call in proposer.calls} == {0}
    # A cut-to-nothing draft is a miss, so the drafter is asked ever more rarely:
    # steps 1, 3, 6 and 11 (skipping 1, 2, then 4 steps, then 8 until the end at step 19).
    for prompt in PROMPTS:
        asked_at = [len(c.tokens) - len(prompt) for c in proposer.calls if c.tokens[: len(prompt)] == prompt]
        assert asked_at == [1, 3, 6, 11]


def test_adaptive_row_skips_the_drafter_for_1_2_4_8_8_steps_after_misses(tiny_model, tiny_tokenizer):
    # Flat cost: every draft the drafter gives is verified, and every one is rejected at once.
    proposer = RecordingProposer(always_wrong(tiny_model))
    engine = engine_for(tiny_model, tiny_tokenizer, proposer, FrozenStepCost({1: 1.0, 1024: 1.0}))
    [result] = engine.generate([GenerationRequest(PROMPTS[1], 40, num_speculative_tokens=None)])
    assert result.token_ids == truth(tiny_model, PROMPTS[1])[:40]
    # Step s starts with s tokens generated. Asked at 1, skip 1; 3, skip 2; 6, skip 4; 11, skip 8;
    # 20, skip 8 (the cap); 29, skip 8; 38, with 2 tokens left: a 1-token budget.
    assert [len(c.tokens) - len(PROMPTS[1]) for c in proposer.calls] == [1, 3, 6, 11, 20, 29, 38]
    assert [c.k for c in proposer.calls] == [8, 8, 8, 8, 8, 8, 1]
    assert result.stats.draft_tokens == 6 * 8 + 1
    assert result.stats.accepted_tokens == 0
    assert result.stats.target_forward_passes == 40  # one token a pass, like plain decoding


def test_fixed_k_rows_never_skip_the_drafter(tiny_model, tiny_tokenizer):
    proposer = RecordingProposer(always_wrong(tiny_model))
    engine = engine_for(tiny_model, tiny_tokenizer, proposer, FrozenStepCost({1: 1.0, 1024: 1.0}))
    [result] = engine.generate([GenerationRequest(PROMPTS[1], 20, num_speculative_tokens=3)])
    assert result.token_ids == truth(tiny_model, PROMPTS[1])[:20]
    # 19 steps after prefill, one call each (the last with a 0-token budget).
    assert [len(c.tokens) - len(PROMPTS[1]) for c in proposer.calls] == list(range(1, 20))
    assert result.stats.draft_tokens == 16 * 3 + 2 + 1  # budgets min(3, 19 - s) for s = 1..19


def test_a_hit_resets_the_drafter_back_off(tiny_model, tiny_tokenizer):
    right_on_calls = {1, 2}

    def sometimes_right(prompt, done, k):
        true = truth(tiny_model, prompt)[done : done + k]
        return true if len(proposer.calls) in right_on_calls else [(t + 1) % 64 for t in true]

    proposer = RecordingProposer(sometimes_right)
    engine = engine_for(tiny_model, tiny_tokenizer, proposer, FrozenStepCost({1: 1.0, 1024: 1.0}))
    [result] = engine.generate([GenerationRequest(PROMPTS[0], 40, num_speculative_tokens=None)])
    assert result.token_ids == truth(tiny_model, PROMPTS[0])[:40]
    # Tokens generated at each call: 1 (miss: +1, skip 1 step: +1) -> 3 (hit: 8 + bonus) -> 12 (hit) -> 21
    # (miss: +1, skip 1 step, not 4: the hits reset the count) -> 23 (miss: +1, skip 2) -> 26.
    assert [len(c.tokens) - len(PROMPTS[0]) for c in proposer.calls[:6]] == [1, 3, 12, 21, 23, 26]


def test_adaptive_estimate_ages_on_steps_without_a_draft(tiny_model, tiny_tokenizer):
    """Cost 1 s + 0.1 s a row (linear(1.0, 0.1)): at alpha 0.5 one row verifies 3 of 8 drafts
    (W=4, padded to 4 rows: 1.875 / 1.4 s beats 1 / 1.1 s); all are rejected."""
    proposer = RecordingProposer(always_wrong(tiny_model))
    engine = engine_for(tiny_model, tiny_tokenizer, proposer, FrozenStepCost.linear(1.0, 0.1))
    [sequence] = add_all(engine, [GenerationRequest(PROMPTS[1], 30, num_speculative_tokens=None)])
    rejected = []
    for _ in range(5):
        engine.step()
        rejected.append(sequence.acceptance.rejected)
    assert sequence.acceptance.accepted == 0.0
    # Step 1: 3 verified, rejected -> 1. Step 2: skipped (back-off), so only decay -> 0.95.
    # Step 3: asked again (alpha 1/2.95 still pays for W=4), rejected -> 0.95 * 0.95 + 1 = 1.9025.
    # Steps 4 and 5: skipped, decay -> 1.807375, 1.71700625: alpha drifts back towards the prior.
    assert rejected == pytest.approx([1.0, 0.95, 1.9025, 1.807375, 1.71700625])
    assert sequence.stats.draft_tokens == 6


# -- fit_drafts ----------------------------------------------------------------------


def add_all(engine, requests):
    sequences = []
    for request in requests:
        sequence, finished = engine.add(request)
        assert finished is None
        sequences.append(sequence)
    return sequences


def test_fit_drafts_cuts_adaptive_rows_to_the_fixed_rows_width_and_leaves_fixed_rows_alone(tiny_model, tiny_tokenizer):
    """Cost = rows, both rows at the prior alpha 0.5; the fixed row needs W >= 6.

    W=6 (12 rows): 2 x 1.969 / 12 = 0.33/s; W=7 or 8 (padded to 16 rows): at most 3.96 / 16 = 0.25/s -> 6.
    """
    engine = engine_for(tiny_model, tiny_tokenizer, RecordingProposer(oracle(tiny_model)), FrozenStepCost.linear(0.0, 1.0))
    add_all(engine, [GenerationRequest(PROMPTS[0], 20, num_speculative_tokens=5), GenerationRequest(PROMPTS[1], 20, num_speculative_tokens=None)])
    fixed, adaptive = [10, 11, 12, 13, 14], [20, 21, 22, 23, 24, 25, 26, 27]
    assert engine.fit_drafts([fixed, adaptive]) == [[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]]


def test_fit_drafts_never_cuts_a_fixed_row_even_when_drafts_are_expensive(tiny_model, tiny_tokenizer):
    engine = engine_for(tiny_model, tiny_tokenizer, RecordingProposer(oracle(tiny_model)), FrozenStepCost.linear(0.0, 1.0))
    add_all(engine, [
        GenerationRequest(PROMPTS[0], 20, num_speculative_tokens=None),
        GenerationRequest(PROMPTS[1], 20, num_speculative_tokens=3),
        GenerationRequest(PROMPTS[2], 20, num_speculative_tokens=None),
    ])
    # The fixed row's 3 drafts set W >= 4; cost = rows makes W=4 (12 rows) the cheapest allowed.
    assert engine.fit_drafts([[1, 2, 3, 4, 5, 6], [7, 8, 9], [10]]) == [[1, 2, 3], [7, 8, 9], [10]]


def test_fit_drafts_with_flat_cost_keeps_every_adaptive_draft(tiny_model, tiny_tokenizer):
    engine = engine_for(tiny_model, tiny_tokenizer, RecordingProposer(oracle(tiny_model)), FrozenStepCost({1: 1.0, 1024: 1.0}))
    add_all(engine, [GenerationRequest(PROMPTS[0], 20, num_speculative_tokens=2), GenerationRequest(PROMPTS[1], 20, num_speculative_tokens=None)])
    assert engine.fit_drafts([[1, 2], [3, 4, 5, 6, 7, 8, 9]]) == [[1, 2], [3, 4, 5, 6, 7, 8, 9]]


def test_fit_drafts_without_adaptive_rows_returns_the_drafts_unchanged(tiny_model, tiny_tokenizer):
    engine = engine_for(tiny_model, tiny_tokenizer, RecordingProposer(oracle(tiny_model)), FrozenStepCost.linear(0.0, 1.0))
    add_all(engine, [GenerationRequest(PROMPTS[0], 20, num_speculative_tokens=8), GenerationRequest(PROMPTS[1], 20, num_speculative_tokens=1)])
    drafts = [[1, 2, 3, 4, 5, 6, 7, 8], [9]]
    assert engine.fit_drafts(drafts) == [[1, 2, 3, 4, 5, 6, 7, 8], [9]]


def test_mixed_batch_of_fixed_and_adaptive_rows_stays_exact(tiny_model, tiny_tokenizer):
    proposer = RecordingProposer(oracle(tiny_model))
    engine = engine_for(tiny_model, tiny_tokenizer, proposer, FrozenStepCost.linear(0.0, 1.0))
    ks = [3, None, 0, None]
    results = engine.generate([GenerationRequest(p, 25, num_speculative_tokens=k) for p, k in zip(PROMPTS, ks)])
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == truth(tiny_model, prompt)[:25]
    # The K=3 row verifies its whole oracle draft every step it has a full budget: 3 accepted + bonus.
    assert results[0].stats.acceptance_rate == 1.0
    assert results[0].stats.draft_tokens == results[0].stats.accepted_tokens > 0
    assert results[2].stats.draft_tokens == 0  # K=0: never speculates


# -- cancel and abort_all ---------------------------------------------------------------


def test_cancel_ends_a_sequence_at_the_next_step_and_the_others_stay_exact(tiny_model, tiny_tokenizer):
    proposer = RecordingProposer(oracle(tiny_model))
    engine = engine_for(tiny_model, tiny_tokenizer, proposer)
    sequences = add_all(engine, [GenerationRequest(p, 30, num_speculative_tokens=k) for p, k in zip(PROMPTS[:3], [2, None, 0])])
    for _ in range(2):
        assert engine.step() == []
    victim = sequences[1]
    so_far = list(victim.generated)
    engine.cancel(victim)
    assert victim in engine.active  # the row leaves at the step boundary, not at once
    finished = engine.step()
    [(sequence, result)] = [(s, r) for s, r in finished if s is victim]
    assert result.finish_reason == FINISH_CANCELLED
    assert result.token_ids == so_far  # nothing generated for it after cancel
    assert result.token_ids == truth(tiny_model, PROMPTS[1])[: len(so_far)]
    assert result.text == tiny_tokenizer.decode(so_far, skip_special_tokens=True)
    assert victim not in engine.active
    assert engine.cache.batch_size == 2
    assert (victim.session_id, victim.tokens) in proposer.closed
    rest = {id(s): r for s, r in finished if s is not victim}
    while engine.active:
        rest.update({id(s): r for s, r in engine.step()})
    for index in (0, 2):
        assert rest[id(sequences[index])].token_ids == truth(tiny_model, PROMPTS[index])[:30]
        assert rest[id(sequences[index])].finish_reason == FINISH_LENGTH
    assert engine.cache.batch_size == 0


def test_cancel_before_any_step_yields_only_the_prefill_token(tiny_model, tiny_tokenizer):
    proposer = RecordingProposer(oracle(tiny_model))
    engine = engine_for(tiny_model, tiny_tokenizer, proposer)
    [sequence] = add_all(engine, [GenerationRequest(PROMPTS[0], 10, num_speculative_tokens=4)])
    engine.cancel(sequence)
    [(finished, result)] = engine.step()
    assert finished is sequence
    assert result.finish_reason == FINISH_CANCELLED
    assert result.token_ids == truth(tiny_model, PROMPTS[0])[:1]
    assert proposer.calls == [] and proposer.closed == []  # never proposed for, so no session to close
    assert engine.active == []


def test_cancel_after_finishing_keeps_the_real_finish_reason(tiny_model, tiny_tokenizer):
    engine = engine_for(tiny_model, tiny_tokenizer, RecordingProposer(oracle(tiny_model)))
    [sequence] = add_all(engine, [GenerationRequest(PROMPTS[0], 3, num_speculative_tokens=0)])
    finished = []
    while engine.active:
        finished += engine.step()
    engine.cancel(sequence)
    assert sequence.finish_reason == FINISH_LENGTH
    assert finished[0][1].finish_reason == FINISH_LENGTH


def test_step_on_an_empty_batch_returns_nothing(tiny_model, tiny_tokenizer):
    engine = engine_for(tiny_model, tiny_tokenizer, RecordingProposer(oracle(tiny_model)))
    assert engine.step() == []


def test_abort_all_empties_the_batch_and_closes_proposer_sessions(tiny_model, tiny_tokenizer):
    proposer = RecordingProposer(oracle(tiny_model))
    engine = engine_for(tiny_model, tiny_tokenizer, proposer)
    sequences = add_all(engine, [GenerationRequest(p, 30, num_speculative_tokens=k) for p, k in zip(PROMPTS, [3, None, 0, 2])])
    engine.step()
    dropped = engine.abort_all()
    assert [id(s) for s in dropped] == [id(s) for s in sequences]
    assert engine.active == []
    assert engine.cache.batch_size == 0
    # The K=0 row (PROMPTS[2]) never opened a drafter session, so only three are closed.
    assert proposer.closed == [(s.session_id, s.tokens) for s in (sequences[0], sequences[1], sequences[3])]
    # The engine serves new requests exactly after the reset.
    [result] = engine.generate([GenerationRequest(PROMPTS[3], 12, num_speculative_tokens=None)])
    assert result.token_ids == truth(tiny_model, PROMPTS[3])[:12]


def test_abort_all_on_an_empty_engine_closes_nothing(tiny_model, tiny_tokenizer):
    proposer = RecordingProposer(oracle(tiny_model))
    engine = engine_for(tiny_model, tiny_tokenizer, proposer)
    assert engine.abort_all() == []
    assert proposer.closed == []


# -- feedback to the proposer ------------------------------------------------------------


def test_feedback_on_each_call_is_the_previous_steps_verdict(tiny_model, tiny_tokenizer):
    right_per_call = [1, 3, 0, 4, 2, 4]

    def partly_right(prompt, done, k):
        # Call n drafts right_per_call[n] true tokens, then wrong ones up to k = 4.
        n = len(proposer.calls)
        true = truth(tiny_model, prompt)[done : done + k]
        right = right_per_call[n] if n < len(right_per_call) else 0
        return true[:right] + [(t + 1) % 64 for t in true[right:]]

    proposer = RecordingProposer(partly_right)
    engine = engine_for(tiny_model, tiny_tokenizer, proposer)
    [result] = engine.generate([GenerationRequest(PROMPTS[0], 40, num_speculative_tokens=4)])
    assert result.token_ids == truth(tiny_model, PROMPTS[0])[:40]
    feedback = [(call.verified, call.accepted) for call in proposer.calls[:7]]
    # Call 0 has no previous draft; then each call reports the 4 drafts verified and right_per_call[n-1] accepted.
    assert feedback == [(0, 0), (4, 1), (4, 3), (4, 0), (4, 4), (4, 2), (4, 4)]
    # Tokens per step are accepted + 1: the context grows by 2, 4, 1, 5, 3, 5 between calls.
    lengths = [len(call.tokens) - len(PROMPTS[0]) for call in proposer.calls[:7]]
    assert lengths == [1, 3, 7, 8, 13, 16, 21]


def test_feedback_is_per_sequence_in_a_batch(tiny_model, tiny_tokenizer):
    def by_prompt(prompt, done, k):
        true = truth(tiny_model, prompt)[done : done + k]
        if prompt == PROMPTS[0]:
            return true  # all accepted
        return true[:1] + [(t + 1) % 64 for t in true[1:]]  # one accepted

    proposer = RecordingProposer(by_prompt)
    engine = engine_for(tiny_model, tiny_tokenizer, proposer)
    sequences = add_all(engine, [GenerationRequest(PROMPTS[0], 30, num_speculative_tokens=3), GenerationRequest(PROMPTS[1], 30, num_speculative_tokens=2)])
    for _ in range(3):
        engine.step()
    first = [(c.verified, c.accepted) for c in proposer.calls_for(sequences[0].session_id)]
    second = [(c.verified, c.accepted) for c in proposer.calls_for(sequences[1].session_id)]
    assert first == [(0, 0), (3, 3), (3, 3)]
    assert second == [(0, 0), (2, 1), (2, 1)]
    # The engine keeps the latest verdict for the next call.
    assert (sequences[0].verified, sequences[0].accepted) == (3, 3)
    assert (sequences[1].verified, sequences[1].accepted) == (2, 1)


def test_feedback_counts_what_was_verified_after_cutting_out_of_vocabulary_ids(tiny_model, tiny_tokenizer):
    def foreign(prompt, done, k):
        true = truth(tiny_model, prompt)[done : done + k]
        return true[:2] + [64, 3]  # two right, then an id the model has no row for: the rest is cut

    proposer = RecordingProposer(foreign)
    engine = engine_for(tiny_model, tiny_tokenizer, proposer)
    [result] = engine.generate([GenerationRequest(PROMPTS[0], 12, num_speculative_tokens=4)])
    assert result.token_ids == truth(tiny_model, PROMPTS[0])[:12]
    assert [(c.verified, c.accepted) for c in proposer.calls[:3]] == [(0, 0), (2, 2), (2, 2)]


def test_feedback_after_skipped_steps_still_reports_the_last_drafts_verdict(tiny_model, tiny_tokenizer):
    """DraftRequest.verified/accepted are 'feedback on this sequence's previous draft'.

    Flat cost, always-wrong drafts, adaptive K: call 0 (step 1) drafts 8, all verified, none
    accepted; step 2 skips the drafter (back-off); call 1 (step 3) should report (8, 0),
    and so on for the calls at steps 6 and 11.
    """
    proposer = RecordingProposer(always_wrong(tiny_model))
    engine = engine_for(tiny_model, tiny_tokenizer, proposer, FrozenStepCost({1: 1.0, 1024: 1.0}))
    engine.generate([GenerationRequest(PROMPTS[1], 14, num_speculative_tokens=None)])
    assert [len(c.tokens) - len(PROMPTS[1]) for c in proposer.calls] == [1, 3, 6, 11]
    # The draft of the call at 6 generated tokens was budgeted 7 (8 tokens left, one
    # of them the step's own), so the last call reports (7, 0).
    assert [(c.verified, c.accepted) for c in proposer.calls] == [(0, 0), (8, 0), (8, 0), (7, 0)]
