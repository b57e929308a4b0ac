"""Adaptive K, cancellation and drafter feedback in the decode loop, on the tiny seeded Llama."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from verifier_service.core.calibration import StepCostModel
from verifier_service.core.drafting import DraftRequest, FinishedSequence, ProposedDraft
from verifier_service.core.engine import (
    FINISH_CANCELLED,
    FINISH_LENGTH,
    EngineConfig,
    GenerationRequest,
    SpeculativeEngine,
    reference_greedy,
)

PROMPTS = [[5, 6, 7], [9, 3, 3, 9, 3, 3, 9, 3], [12], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]]
NO_EOS = frozenset()
TRUTH_LENGTH = 64


class FrozenStepCost(StepCostModel):
    """A cost model that ignores measured step times, so the drafts chosen do not depend on the clock.
    Records the token count of every step, for the modelled cost of a run."""

    def __init__(self, points, per_context_token=0.0):
        super().__init__(points, per_context_token)
        self.steps: list[int] = []

    def observe(self, tokens: int, context: int, seconds: float) -> None:
        self.steps.append(tokens)

    def modelled_seconds(self) -> float:
        return sum(self.cost(tokens) for tokens in self.steps)


# A CPU-like step: 48 ms, plus 8 ms a token. At 16 rows a draft token must be
# accepted with probability >= 0.73 to pay for itself at the prior's rate.
CPU_COST = {1: 0.048 + 0.008, 1024: 0.048 + 1024 * 0.008}


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
    prompts: list[list[int]] = field(default_factory=lambda: PROMPTS)

    def propose(self, requests: list[DraftRequest]) -> list[ProposedDraft]:
        drafts = []
        for request in requests:
            prompt = next(p for p in self.prompts if request.tokens[: len(p)] == p)
            draft = list(self.guess(prompt, len(request.tokens) - len(prompt), request.k))[: request.k]
            # request.tokens is the engine's live list: keep a copy of what it held at this call.
            self.calls.append(Call(request.session_id, list(request.tokens), request.k, request.verified, request.accepted, draft))
            drafts.append(ProposedDraft(draft))
        return drafts

    def close(self, finished: list[FinishedSequence]) -> None:
        self.closed.extend((session_id, list(tokens)) for session_id, tokens, _ in finished)

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


def engine_for(model, tokenizer, proposer, step_cost=None, **config) -> SpeculativeEngine:
    engine = SpeculativeEngine(model, tokenizer, proposer, EngineConfig(**config), step_cost=step_cost)
    engine.eos_token_ids = NO_EOS  # random weights: keep sequences running to max_new_tokens
    return engine


# -- adaptive K keeps greedy output exact ----------------------------------------------


@pytest.mark.parametrize("drafter", [oracle, always_wrong])
def test_adaptive_k_greedy_equals_plain_decoding(tiny_model, tiny_tokenizer, drafter):
    # The engine's calibrated cost model, refined by real step times: whatever it verifies, outputs are exact.
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
    engine = engine_for(tiny_model, tiny_tokenizer, proposer, FrozenStepCost({1: 1.0, 1024: 1.0}), max_adaptive_k=8)
    [result] = engine.generate([GenerationRequest(PROMPTS[0], 28, num_speculative_tokens=None)])
    assert result.token_ids == truth(tiny_model, PROMPTS[0])[:28]
    # Every step costs the same, so each verifies all max_adaptive_k = 8 drafts:
    # prefill gives 1 token, then 3 steps of 8 accepted + 1 bonus give the other 27.
    assert [call.k for call in proposer.calls] == [8, 8, 8]
    assert result.stats.target_forward_passes == 1 + 3
    assert result.stats.draft_tokens == 24
    assert result.stats.accepted_tokens == 24


def test_flat_cost_and_oracle_in_a_batch_need_fewer_passes_than_tokens(tiny_model, tiny_tokenizer):
    flat = FrozenStepCost({1: 1.0, 1024: 1.0})
    engine = engine_for(tiny_model, tiny_tokenizer, RecordingProposer(oracle(tiny_model)), flat, max_adaptive_k=8)
    results = engine.generate([GenerationRequest(p, 40, num_speculative_tokens=None) for p in PROMPTS])
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == truth(tiny_model, prompt)[:40]
        # 1 at prefill, then 4 steps of 9 and one of 3 (the last budget is min(8, 3 - 1) = 2 drafts).
        assert result.stats.target_forward_passes == 6
        assert result.stats.draft_tokens == 4 * 8 + 2
        assert result.stats.acceptance_rate == 1.0


def test_steep_cost_verifies_always_wrong_drafts_only_as_probes(tiny_model, tiny_tokenizer):
    # Cost = tokens: a draft token costs as much as a whole row, and no draft is ever
    # certain, so the plan verifies nothing: plain decoding, one token a pass. Only
    # the probe after 8 idle steps verifies one token (the next is due 16 idle steps
    # later, past the 19 decode steps).
    proposer = RecordingProposer(always_wrong(tiny_model))
    engine = engine_for(tiny_model, tiny_tokenizer, proposer, FrozenStepCost.linear(0.0, 1.0))
    results = engine.generate([GenerationRequest(p, 20, num_speculative_tokens=None) for p in PROMPTS])
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == truth(tiny_model, prompt)[:20]
        assert result.stats.draft_tokens == 1
        assert result.stats.target_forward_passes == 20
    assert sorted(call.verified for call in proposer.calls)[-5:] == [0, 1, 1, 1, 1]


def test_every_speculating_row_asks_the_drafter_every_step(tiny_model, tiny_tokenizer):
    # Bad drafts cost nothing once their odds are learned, so nothing backs off the drafter.
    proposer = RecordingProposer(always_wrong(tiny_model))
    engine = engine_for(tiny_model, tiny_tokenizer, proposer, FrozenStepCost({1: 1.0, 1024: 1.0}))
    [adaptive, fixed] = engine.generate(
        [
            GenerationRequest(PROMPTS[1], 20, num_speculative_tokens=None),
            GenerationRequest(PROMPTS[0], 20, num_speculative_tokens=3),
        ]
    )
    for prompt, result in ((PROMPTS[1], adaptive), (PROMPTS[0], fixed)):
        asked_at = [len(c.tokens) - len(prompt) for c in proposer.calls if c.tokens[: len(prompt)] == prompt]
        assert asked_at == list(range(1, 20))  # 19 steps after prefill, one call each
        assert result.stats.accepted_tokens == 0
    assert fixed.stats.draft_tokens == 16 * 3 + 2 + 1  # budgets min(3, 19 - s) for s = 1..19


# -- adaptive K under load: it explores, and learns which drafts pay --------------------


BATCH_16 = [[5 + i, 6 + i, 7 + (i % 5)] for i in range(16)]


def batch_engine(model, tokenizer, drafter, cost: FrozenStepCost):
    proposer = RecordingProposer(drafter(model), prompts=BATCH_16)
    return engine_for(model, tokenizer, proposer, cost)


def test_oracle_drafts_at_batch_16_widen_steps_despite_a_steep_cpu_cost(tiny_model, tiny_tokenizer):
    """At batch 16 on the CPU-like cost, the prior's even odds never pay for a draft
    token (it needs 0.73); optimism about unverified buckets gets the first ones
    verified, and once their acceptance is learned, whole drafts are."""
    engine = batch_engine(tiny_model, tiny_tokenizer, oracle, FrozenStepCost(CPU_COST))
    results = engine.generate([GenerationRequest(p, 48, num_speculative_tokens=None) for p in BATCH_16])
    for prompt, result in zip(BATCH_16, results):
        assert result.token_ids == truth(tiny_model, prompt)[:48]
    tokens = sum(r.stats.generated_tokens for r in results)
    passes = sum(r.stats.target_forward_passes for r in results)
    assert tokens / passes >= 3.0


def test_always_wrong_drafts_at_batch_16_cost_at_most_5_percent_over_plain(tiny_model, tiny_tokenizer):
    plain_cost, adaptive_cost = FrozenStepCost(CPU_COST), FrozenStepCost(CPU_COST)
    plain = batch_engine(tiny_model, tiny_tokenizer, always_wrong, plain_cost)
    plain.generate([GenerationRequest(p, 48, num_speculative_tokens=0) for p in BATCH_16])
    adaptive = batch_engine(tiny_model, tiny_tokenizer, always_wrong, adaptive_cost)
    results = adaptive.generate([GenerationRequest(p, 48, num_speculative_tokens=None) for p in BATCH_16])
    for prompt, result in zip(BATCH_16, results):
        assert result.token_ids == truth(tiny_model, prompt)[:48]
    assert sum(r.stats.draft_tokens for r in results) > 0  # it did explore
    assert adaptive_cost.modelled_seconds() <= 1.05 * plain_cost.modelled_seconds()


def test_learned_odds_follow_the_drafts(tiny_model, tiny_tokenizer):
    flat = FrozenStepCost({1: 1.0, 1024: 1.0})
    engine = engine_for(tiny_model, tiny_tokenizer, RecordingProposer(always_wrong(tiny_model)), flat, max_adaptive_k=8)
    engine.generate([GenerationRequest(PROMPTS[1], 20, num_speculative_tokens=None)])
    first_token, fourth_token = ("", 0, 0, 0), ("", 0, 0, 3)  # drafts without evidence
    assert engine.planner.acceptance.hazard(first_token) < 0.1
    # Never reached (every draft failed at once): it has only what all drafts say.
    assert engine.planner.acceptance.hazard(fourth_token) == engine.planner.acceptance.hazard(("unseen", 0, 0, 0)) < 0.1
    engine.proposer.guess = oracle(tiny_model)
    engine.generate([GenerationRequest(p, 60, num_speculative_tokens=None) for p in PROMPTS])
    assert engine.planner.acceptance.hazard(first_token) > 0.5  # 19 rejections, then ~28 acceptances
    assert engine.planner.acceptance.hazard(fourth_token) > 0.95


# One row costs 100 ms and any wider step 160 ms (measured on a 2-core CPU, where
# a matrix-vector product is much cheaper than a small GEMM): at batch 1 a draft
# must be accepted with probability > ~0.4 to pay for itself.
GEMV_COST = {1: 0.100, 2: 0.160, 16: 0.160, 1024: 4.0}


def test_drafts_judged_hopeless_on_other_text_are_probed_and_verified_again(tiny_model, tiny_tokenizer):
    """After a run of drafts that all failed, every estimate says drafts never pay. When
    good drafts arrive, nothing would ever verify one and learn otherwise, unless
    sequences that stopped verifying probe a draft now and then."""
    proposer = RecordingProposer(always_wrong(tiny_model))
    engine = engine_for(tiny_model, tiny_tokenizer, proposer, FrozenStepCost(GEMV_COST))
    for prompt in PROMPTS:
        engine.generate([GenerationRequest(prompt, 40, num_speculative_tokens=None)])
    assert engine.planner.acceptance.hazard(("", 0, 0, 0)) < 0.1
    proposer.guess = oracle(tiny_model)
    [result] = engine.generate([GenerationRequest(PROMPTS[3], 48, num_speculative_tokens=None)])
    assert result.token_ids == truth(tiny_model, PROMPTS[3])[:48]
    assert result.stats.tokens_per_forward_pass >= 2.0


def test_a_sequence_whose_drafts_always_fail_probes_rarely(tiny_model, tiny_tokenizer):
    # The probes back off: over 60 steps of hopeless drafts at batch 1, a handful of
    # verified drafts beyond what the first estimates chose, not one every few steps.
    proposer = RecordingProposer(always_wrong(tiny_model))
    engine = engine_for(tiny_model, tiny_tokenizer, proposer, FrozenStepCost(GEMV_COST))
    engine.generate([GenerationRequest(PROMPTS[0], 20, num_speculative_tokens=None)])
    [result] = engine.generate([GenerationRequest(PROMPTS[1], 61, num_speculative_tokens=None)])
    assert result.token_ids == truth(tiny_model, PROMPTS[1])[:61]
    assert 0 < result.stats.verify_steps_with_drafts <= 6


def test_mixed_batch_of_fixed_and_adaptive_rows_stays_exact(tiny_model, tiny_tokenizer):
    proposer = RecordingProposer(oracle(tiny_model))
    engine = engine_for(tiny_model, tiny_tokenizer, proposer, FrozenStepCost.linear(0.0, 1.0))
    ks = [3, None, 0, None]
    results = engine.generate([GenerationRequest(p, 25, num_speculative_tokens=k) for p, k in zip(PROMPTS, ks)])
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == truth(tiny_model, prompt)[:25]
    # The K=3 row verifies its whole oracle draft every step, however steep the cost.
    assert results[0].stats.acceptance_rate == 1.0
    assert results[0].stats.draft_tokens == 6 * 3  # 3 accepted + bonus a step: 24 tokens after prefill
    # Adaptive: a token costs a row, so the plan verifies nothing; only probes (one
    # draft token after 8 idle steps, twice in 24 steps) verify, and are accepted.
    assert results[1].stats.draft_tokens == results[1].stats.accepted_tokens == 2
    assert results[2].stats.draft_tokens == 0  # K=0: never speculates


# -- cancel and abort_all ---------------------------------------------------------------


def add_all(engine, requests):
    sequences = [engine.add(request) for request in requests]
    assert [o.sequence for o in engine.step()] == sequences  # one step prefills them all: first tokens
    return sequences


def results_of(outcomes) -> dict:
    return {id(o.sequence): o.result for o in outcomes if o.result is not None}


def test_cancel_ends_a_sequence_at_the_next_step_and_the_others_stay_exact(tiny_model, tiny_tokenizer):
    proposer = RecordingProposer(oracle(tiny_model))
    engine = engine_for(tiny_model, tiny_tokenizer, proposer, max_adaptive_k=8)  # the adaptive row still runs after 2 steps
    sequences = add_all(engine, [GenerationRequest(p, 30, num_speculative_tokens=k) for p, k in zip(PROMPTS[:3], [2, None, 0])])
    for _ in range(2):
        assert all(o.result is None for o in engine.step())
    victim = sequences[1]
    state = engine._sequence_of(victim)  # white box: the engine's private record of it
    so_far = list(state.generated)
    engine.cancel(victim)
    assert victim in engine.active  # the row leaves at the step boundary, not at once
    outcomes = engine.step()
    result = results_of(outcomes)[id(victim)]
    assert result.finish_reason == FINISH_CANCELLED
    assert result.token_ids == so_far  # nothing generated for it after cancel
    assert result.token_ids == truth(tiny_model, PROMPTS[1])[: len(so_far)]
    assert result.text == tiny_tokenizer.decode(so_far, skip_special_tokens=True)
    assert victim not in engine.active
    assert len(engine.active) == 2 and engine.free_slots == engine.config.max_batch_size - 2
    assert (state.session_id, state.tokens) in proposer.closed
    rest = results_of(outcomes)
    while engine.busy:
        rest.update(results_of(engine.step()))
    for index in (0, 2):
        assert rest[id(sequences[index])].token_ids == truth(tiny_model, PROMPTS[index])[:30]
        assert rest[id(sequences[index])].finish_reason == FINISH_LENGTH
    assert engine.free_slots == engine.config.max_batch_size


def test_cancel_before_prefill_yields_no_tokens(tiny_model, tiny_tokenizer):
    proposer = RecordingProposer(oracle(tiny_model))
    engine = engine_for(tiny_model, tiny_tokenizer, proposer)
    sequence = engine.add(GenerationRequest(PROMPTS[0], 10, num_speculative_tokens=4))
    engine.cancel(sequence)
    [outcome] = engine.step()
    assert outcome.sequence is sequence and outcome.tokens == []
    assert outcome.result.finish_reason == FINISH_CANCELLED
    assert outcome.result.token_ids == []
    assert proposer.calls == [] and proposer.closed == []  # never proposed for, so no session to close
    assert not engine.busy and engine.free_slots == engine.config.max_batch_size


def test_cancel_after_prefill_yields_only_the_first_token(tiny_model, tiny_tokenizer):
    engine = engine_for(tiny_model, tiny_tokenizer, RecordingProposer(oracle(tiny_model)))
    [sequence] = add_all(engine, [GenerationRequest(PROMPTS[0], 10, num_speculative_tokens=4)])
    engine.cancel(sequence)
    [outcome] = engine.step()
    assert outcome.result.token_ids == truth(tiny_model, PROMPTS[0])[:1]
    assert engine.active == []


def test_cancel_after_finishing_keeps_the_real_finish_reason(tiny_model, tiny_tokenizer):
    engine = engine_for(tiny_model, tiny_tokenizer, RecordingProposer(oracle(tiny_model)))
    sequence = engine.add(GenerationRequest(PROMPTS[0], 3, num_speculative_tokens=0))
    outcomes = []
    while engine.busy:
        outcomes += engine.step()
    engine.cancel(sequence)  # already ended: nothing to do
    assert not engine.busy
    assert results_of(outcomes)[id(sequence)].finish_reason == FINISH_LENGTH


def test_step_on_an_empty_batch_returns_nothing(tiny_model, tiny_tokenizer):
    engine = engine_for(tiny_model, tiny_tokenizer, RecordingProposer(oracle(tiny_model)))
    assert engine.step() == []


def test_abort_all_empties_the_batch_and_closes_proposer_sessions(tiny_model, tiny_tokenizer):
    proposer = RecordingProposer(oracle(tiny_model))
    engine = engine_for(tiny_model, tiny_tokenizer, proposer)
    sequences = add_all(engine, [GenerationRequest(p, 30, num_speculative_tokens=k) for p, k in zip(PROMPTS, [3, None, 0, 2])])
    engine.step()
    states = [engine._sequence_of(sequence) for sequence in sequences]  # white box: their session ids
    dropped = engine.abort_all()
    assert sorted(map(id, dropped)) == sorted(map(id, sequences))
    assert engine.active == [] and not engine.busy
    assert engine.free_slots == engine.config.max_batch_size
    # The K=0 row (PROMPTS[2]) never opened a drafter session, so only three are closed.
    assert sorted(proposer.closed) == sorted((s.session_id, s.tokens) for s in (states[0], states[1], states[3]))
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
    sequences = add_all(
        engine, [GenerationRequest(PROMPTS[0], 30, num_speculative_tokens=3), GenerationRequest(PROMPTS[1], 30, num_speculative_tokens=2)]
    )
    sequences = [engine._sequence_of(sequence) for sequence in sequences]  # white box: session ids and verdicts
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


def test_feedback_reports_what_adaptive_k_verified_not_what_was_drafted(tiny_model, tiny_tokenizer):
    # Cost = tokens: adaptive rows verify nothing, so every call reports 0 verified of the 8 drafted.
    proposer = RecordingProposer(oracle(tiny_model))
    engine = engine_for(tiny_model, tiny_tokenizer, proposer, FrozenStepCost.linear(0.0, 1.0))
    engine.generate([GenerationRequest(PROMPTS[1], 6, num_speculative_tokens=None)])
    assert [len(c.draft) for c in proposer.calls] == [4, 3, 2, 1, 0]  # budgets: remaining - 1
    assert {(c.verified, c.accepted) for c in proposer.calls} == {(0, 0)}
