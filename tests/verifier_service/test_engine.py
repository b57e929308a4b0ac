"""The decode loop on a tiny seeded random Llama: exactness, drafters, edge cases."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

from drafter_service.sessions import NGramDrafter
from verifier_service.core.calibration import StepCostModel
from verifier_service.core.drafting import SessionProposer
from verifier_service.core.engine import (
    FINISH_LENGTH,
    FINISH_STOP,
    EngineConfig,
    EngineFull,
    GenerationRequest,
    SpeculativeEngine,
    reference_greedy,
)
from verifier_service.core.rejection import SamplingParams, warp_probs

TINY_VOCAB = 64
PROMPTS = [[5, 6, 7], [9, 3, 3, 9, 3, 3, 9, 3], [12], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]]
NO_EOS = frozenset()


@dataclass
class ScriptedDraft:
    tokens: list[int]


@dataclass
class ScriptedProposer:
    """Proposes from a function of the full context; records every call."""

    guess: callable
    contexts: dict = field(default_factory=dict)
    calls: list = field(default_factory=list)
    closed: list = field(default_factory=list)

    def open(self, session_id, prompt_ids):
        self.contexts[session_id] = list(prompt_ids)

    def propose(self, session_id, new_tokens, k):
        self.contexts[session_id].extend(new_tokens)
        self.calls.append((session_id, list(new_tokens), k))
        return ScriptedDraft(self.guess(self.contexts[session_id], k)[:k])

    def close(self, session_id, observe=True):
        self.closed.append(session_id)


def greedy_truth(model, prompt, length):
    return reference_greedy(model, prompt, length, NO_EOS)


def oracle(model, length=64):
    """Drafts the true greedy continuation of any context it is shown."""
    truths = {}

    def guess(context, k):
        for prompt in PROMPTS:
            if context[: len(prompt)] == prompt:
                if tuple(prompt) not in truths:
                    truths[tuple(prompt)] = greedy_truth(model, prompt, length)
                truth = truths[tuple(prompt)]
                done = len(context) - len(prompt)
                return truth[done : done + k]
        raise AssertionError("oracle asked about an unknown prompt")

    return guess


def engine_without_eos(model, tokenizer, proposer):
    engine = SpeculativeEngine(model, tokenizer, SessionProposer(proposer))
    engine.eos_token_ids = NO_EOS  # random weights: keep sequences running to max_new_tokens
    return engine


@pytest.mark.parametrize("k", [0, 1, 3, 5, 8])
@pytest.mark.parametrize("batched", [False, True])
def test_greedy_matches_reference_for_every_k_and_batching(tiny_model, tiny_tokenizer, k, batched):
    engine = engine_without_eos(tiny_model, tiny_tokenizer, NGramDrafter())
    requests = [GenerationRequest(p, 24, num_speculative_tokens=k) for p in PROMPTS]
    results = engine.generate(requests) if batched else [engine.generate([r])[0] for r in requests]
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == greedy_truth(tiny_model, prompt, 24)
        assert result.finish_reason == FINISH_LENGTH


def test_greedy_matches_transformers_generate(tiny_model, tiny_tokenizer):
    engine = engine_without_eos(tiny_model, tiny_tokenizer, NGramDrafter())
    results = engine.generate([GenerationRequest(p, 20, num_speculative_tokens=4) for p in PROMPTS])
    for prompt, result in zip(PROMPTS, results):
        expected = tiny_model.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)[
            0, len(prompt) :
        ]
        assert result.token_ids == expected.tolist()


def test_oracle_drafts_are_all_accepted(tiny_model, tiny_tokenizer):
    proposer = ScriptedProposer(oracle(tiny_model))
    engine = engine_without_eos(tiny_model, tiny_tokenizer, proposer)
    [result] = engine.generate([GenerationRequest(PROMPTS[0], 21, num_speculative_tokens=4)])
    assert result.token_ids == greedy_truth(tiny_model, PROMPTS[0], 21)
    # Prefill gives token 1; each step then accepts 4 drafts plus a bonus: 20 more tokens in 4 steps.
    assert result.stats.target_forward_passes == 1 + 4
    assert result.stats.acceptance_rate == 1.0
    assert result.stats.mean_accepted_length == 4.0


def test_wrong_drafts_leave_output_unchanged(tiny_model, tiny_tokenizer):
    truth = greedy_truth(tiny_model, PROMPTS[1], 24)

    def always_wrong(context, k):
        # The true next token is truth[len(context) - len(prompt)]; shift it to be certainly wrong.
        done = len(context) - len(PROMPTS[1])
        return [(truth[done + i] + 1) % 64 if done + i < len(truth) else 0 for i in range(k)]

    engine = engine_without_eos(tiny_model, tiny_tokenizer, ScriptedProposer(always_wrong))
    [result] = engine.generate([GenerationRequest(PROMPTS[1], 24, num_speculative_tokens=5)])
    assert result.token_ids == truth
    assert result.stats.accepted_tokens == 0
    assert result.stats.target_forward_passes == 24  # one token per pass, like plain decoding


def test_batch_mixes_oracle_wrong_and_empty_drafts(tiny_model, tiny_tokenizer):
    right = oracle(tiny_model)

    def mixed(context, k):
        if context[:1] == [5]:
            return right(context, k)
        if context[:1] == [9]:
            return [63] * k  # rejected at once (63 never follows in these greedy paths)
        return []  # empty draft: plain step for this row

    engine = engine_without_eos(tiny_model, tiny_tokenizer, ScriptedProposer(mixed))
    results = engine.generate([GenerationRequest(p, 30, num_speculative_tokens=6) for p in PROMPTS])
    assert [r.token_ids for r in results] == [greedy_truth(tiny_model, p, 30) for p in PROMPTS]
    assert results[0].stats.acceptance_rate == 1.0
    assert results[2].stats.draft_tokens == 0


def test_out_of_vocabulary_drafts_are_cut_not_fed_to_the_model(tiny_model, tiny_tokenizer):
    truth = greedy_truth(tiny_model, PROMPTS[0], 12)

    def foreign(context, k):
        done = len(context) - len(PROMPTS[0])
        return truth[done : done + 2] + [64, -3, 10_000]  # two right, then ids the model has no row for

    engine = engine_without_eos(tiny_model, tiny_tokenizer, ScriptedProposer(foreign))
    [result] = engine.generate([GenerationRequest(PROMPTS[0], 12, num_speculative_tokens=5)])
    assert result.token_ids == truth
    assert result.stats.acceptance_rate == 1.0  # only the two in-vocabulary drafts were ever verified


def test_never_overshoots_max_new_tokens(tiny_model, tiny_tokenizer):
    engine = engine_without_eos(tiny_model, tiny_tokenizer, ScriptedProposer(oracle(tiny_model)))
    for length in (1, 2, 5, 9, 10):
        [result] = engine.generate([GenerationRequest(PROMPTS[0], length, num_speculative_tokens=8)])
        assert len(result.token_ids) == length
        assert result.finish_reason == FINISH_LENGTH


def test_draft_budget_never_exceeds_remaining_tokens(tiny_model, tiny_tokenizer):
    proposer = ScriptedProposer(oracle(tiny_model))
    engine = engine_without_eos(tiny_model, tiny_tokenizer, proposer)
    engine.generate([GenerationRequest(PROMPTS[0], 7, num_speculative_tokens=8)])
    # After prefill 6 tokens remain, so 5 drafts + 1 bonus fill them exactly
    # (the last call, k=0, hands the drafter the final tokens at close).
    assert [k for _, _, k in proposer.calls] == [5, 0]


def test_max_new_tokens_one_is_prefill_only(tiny_model, tiny_tokenizer):
    proposer = ScriptedProposer(oracle(tiny_model))
    engine = engine_without_eos(tiny_model, tiny_tokenizer, proposer)
    [result] = engine.generate([GenerationRequest(PROMPTS[0], 1, num_speculative_tokens=5)])
    assert result.token_ids == greedy_truth(tiny_model, PROMPTS[0], 1)
    assert result.stats.target_forward_passes == 1
    assert proposer.calls == []  # finished at prefill: never drafted, never opened
    assert engine.active == []


def test_eos_inside_accepted_drafts_stops_there(tiny_model, tiny_tokenizer):
    truth = greedy_truth(tiny_model, PROMPTS[0], 12)
    eos = truth[5]  # pretend the 6th greedy token is EOS
    first_eos = truth.index(eos)
    engine = SpeculativeEngine(tiny_model, tiny_tokenizer, SessionProposer(ScriptedProposer(oracle(tiny_model))))
    engine.eos_token_ids = frozenset([eos])
    [result] = engine.generate([GenerationRequest(PROMPTS[0], 12, num_speculative_tokens=8)])
    # The oracle drafts past EOS and all drafts are accepted, yet nothing after EOS is emitted.
    assert result.token_ids == truth[: first_eos + 1]
    assert result.finish_reason == FINISH_STOP


def test_stop_string_cuts_text_and_tokens(tiny_model, tiny_tokenizer):
    truth = greedy_truth(tiny_model, PROMPTS[0], 12)
    stop = f"t{truth[3]}"  # the word for the 4th greedy token
    cut = next(i for i, t in enumerate(truth) if f"t{t}" == stop)
    engine = engine_without_eos(tiny_model, tiny_tokenizer, ScriptedProposer(oracle(tiny_model)))
    [result] = engine.generate([GenerationRequest(PROMPTS[0], 12, stop=(stop,), num_speculative_tokens=8)])
    assert result.token_ids == truth[: cut + 1]  # up to the token that completed the stop string
    assert result.text == tiny_tokenizer.decode(truth[:cut]) + " "  # text ends before it
    assert result.finish_reason == FINISH_STOP


def test_prompt_shorter_than_ngram_and_single_token(tiny_model, tiny_tokenizer):
    engine = engine_without_eos(tiny_model, tiny_tokenizer, NGramDrafter())
    [result] = engine.generate([GenerationRequest([12], 16, num_speculative_tokens=5)])
    assert result.token_ids == greedy_truth(tiny_model, [12], 16)


def test_proposer_receives_only_new_tokens(tiny_model, tiny_tokenizer):
    proposer = ScriptedProposer(lambda context, k: [])
    engine = engine_without_eos(tiny_model, tiny_tokenizer, proposer)
    [result] = engine.generate([GenerationRequest(PROMPTS[0], 4, num_speculative_tokens=3)])
    # The session opens with the prompt and prefill's token; then empty drafts
    # mean one new token per step, and closing sends the last one.
    assert proposer.contexts[proposer.calls[0][0]] == PROMPTS[0] + result.token_ids
    assert [new for _, new, _ in proposer.calls] == [[], [result.token_ids[1]], [result.token_ids[2]], [result.token_ids[3]]]
    assert proposer.closed == [proposer.calls[0][0]]


def test_sequences_join_and_leave_between_steps(tiny_model, tiny_tokenizer):
    engine = engine_without_eos(tiny_model, tiny_tokenizer, NGramDrafter())
    engine.add(GenerationRequest(PROMPTS[3], 10, num_speculative_tokens=3))
    outcomes = []
    for _ in range(2):
        outcomes += engine.step()
    engine.add(GenerationRequest(PROMPTS[1], 30, num_speculative_tokens=3))
    engine.add(GenerationRequest(PROMPTS[2], 5, num_speculative_tokens=0))
    while engine.busy:
        outcomes += engine.step()
    outputs = {tuple(o.sequence.request.prompt_ids): o.result.token_ids for o in outcomes if o.result is not None}
    for prompt, length in ((PROMPTS[3], 10), (PROMPTS[1], 30), (PROMPTS[2], 5)):
        assert outputs[tuple(prompt)] == greedy_truth(tiny_model, prompt, length)
    assert engine.free_slots == engine.config.max_batch_size


def test_outcomes_stream_each_sequences_tokens_in_order(tiny_model, tiny_tokenizer):
    engine = engine_without_eos(tiny_model, tiny_tokenizer, ScriptedProposer(oracle(tiny_model)))
    sequences = [engine.add(GenerationRequest(p, 12, num_speculative_tokens=k)) for p, k in zip(PROMPTS, (0, 3, 5, 8))]
    streamed = {id(sequence): [] for sequence in sequences}
    firsts, results = [], {}
    while engine.busy:
        for outcome in engine.step():
            streamed[id(outcome.sequence)] += outcome.tokens
            if outcome.first:
                firsts.append(outcome.sequence)
                assert len(outcome.tokens) == 1 and outcome.verified == 0
            if outcome.result is not None:
                results[id(outcome.sequence)] = outcome.result
    assert sorted(map(id, firsts)) == sorted(map(id, sequences))  # one first-token outcome each
    for sequence, prompt in zip(sequences, PROMPTS):
        assert streamed[id(sequence)] == results[id(sequence)].token_ids == greedy_truth(tiny_model, prompt, 12)


@dataclass
class LabelledDraft:
    tokens: list[int]
    evidence: list


class GlobalOracle(ScriptedProposer):
    """The oracle's drafts, each token's evidence saying it came from the global table."""

    def propose(self, session_id, new_tokens, k):
        tokens = super().propose(session_id, new_tokens, k).tokens
        return LabelledDraft(tokens, [("global", 4, 2, 2)] * len(tokens))


def test_outcomes_say_where_each_token_came_from(tiny_model, tiny_tokenizer):
    """An accepted draft token is labelled with the source its evidence names ("draft"
    when the drafter gave none); the step's own token and a prefill's first token "target"."""
    for proposer, draft_source in ((GlobalOracle(oracle(tiny_model)), "global"), (ScriptedProposer(oracle(tiny_model)), "draft")):
        engine = engine_without_eos(tiny_model, tiny_tokenizer, proposer)
        engine.add(GenerationRequest(PROMPTS[1], 40, num_speculative_tokens=4))
        labelled = []
        while engine.busy:
            for outcome in engine.step():
                assert len(outcome.sources) == len(outcome.tokens)
                if outcome.tokens:
                    assert outcome.sources[-1] == "target" or outcome.result is not None  # a stop may cut the step's own token
                    assert outcome.sources[: outcome.accepted] == (draft_source,) * min(outcome.accepted, len(outcome.tokens))
                    assert set(outcome.sources[outcome.accepted :]) == {"target"}
                labelled += outcome.sources
        assert labelled.count(draft_source) > 0 and labelled[0] == "target"


def test_a_prompt_finishing_prefill_trades_slots_with_a_younger_one_mid_prefill(tiny_model, tiny_tokenizer):
    """Decoding sequences sit in slots [0, n): a prompt that completes in a higher slot
    trades places with the prompt in slot n. Here that prompt got its first chunk in the
    same step, and its chunk must travel with it."""
    engine = SpeculativeEngine(tiny_model, tiny_tokenizer, None, EngineConfig(max_batch_size=3, prefill_chunk_tokens=8))
    engine.eos_token_ids = NO_EOS
    a = engine.add(GenerationRequest([5, 6, 7], 20))  # slot 0
    engine.add(GenerationRequest([9, 3], 1))  # slot 1: done at its prefill, freeing the slot
    b = engine.add(GenerationRequest(list(range(20, 30)), 20))  # slot 2, 10 tokens: 3 this step
    a, b = engine._sequence_of(a), engine._sequence_of(b)  # white box: slots and prefill progress
    outcomes = engine.step()
    assert (a.slot, b.prefilled, engine.free_slots) == (0, 3, 1)
    c = engine._sequence_of(engine.add(GenerationRequest(list(range(40, 52)), 20)))  # younger, but in the lower slot 1
    assert c.slot == 1
    outcomes += engine.step()  # b gets 7 tokens and completes; c gets 1
    assert (b.slot, c.slot, c.prefilled) == (1, 2, 1)
    while engine.busy:
        outcomes += engine.step()
    results = {id(o.sequence): o.result.token_ids for o in outcomes if o.result is not None}
    for sequence in (a.handle, b.handle, c.handle):
        assert results[id(sequence)] == greedy_truth(tiny_model, sequence.request.prompt_ids, 20)


def test_more_requests_than_slots_wait_for_one_to_free(tiny_model, tiny_tokenizer):
    engine = SpeculativeEngine(tiny_model, tiny_tokenizer, SessionProposer(NGramDrafter()), EngineConfig(max_batch_size=2))
    engine.eos_token_ids = NO_EOS
    engine.add(GenerationRequest(PROMPTS[0], 3))
    engine.add(GenerationRequest(PROMPTS[1], 3))
    with pytest.raises(EngineFull, match="^all 2 cache slots are in use$"):
        engine.add(GenerationRequest(PROMPTS[2], 3))
    # generate() feeds them through as slots free, and each equals its reference.
    results = engine.generate([GenerationRequest(p, 9, num_speculative_tokens=2) for p in PROMPTS])
    assert [r.token_ids for r in results] == [greedy_truth(tiny_model, p, 9) for p in PROMPTS]


@pytest.mark.parametrize(
    "request_, message",
    [
        (GenerationRequest([], 5), "prompt is empty"),
        (GenerationRequest([1, 64], 5), "outside the vocabulary"),
        (GenerationRequest([1, -1], 5), "outside the vocabulary"),
        (GenerationRequest([1], 0), r"max_new_tokens 0 generates nothing; it is taken only to score the prompt"),
        (GenerationRequest([1], -1), r"max_new_tokens must be in \[1, 4096\] \(the server's --max-new-tokens\), got -1"),
        (GenerationRequest([1], 4097), r"max_new_tokens must be in \[1, 4096\] \(the server's --max-new-tokens\), got 4097"),
        (GenerationRequest([1], 5, stop=("a",) * 17), r"stop takes at most 16 strings \(--max-stop-strings\), got 17"),
        (GenerationRequest([1], 5, stop=("a", "")), r"stop\[1\] is empty"),
        (GenerationRequest([1], 5, stop=("x" * 257,)), r"stop\[0\] is 257 characters; at most 256"),
        (GenerationRequest([1], 5, num_speculative_tokens=-1), "num_speculative_tokens"),
        (GenerationRequest([1], 5, num_speculative_tokens=17), "num_speculative_tokens"),
        (GenerationRequest([1], 5, SamplingParams(temperature=float("nan"))), "temperature"),
        (GenerationRequest([1], 5, SamplingParams(temperature=1.0, top_p=1.5)), "top_p"),
        (GenerationRequest([1] * 60, 5), r"needs 65 cache positions; this server holds at most 64 per request"),
    ],
)
def test_bad_requests_are_refused_before_any_model_work(tiny_model, tiny_tokenizer, request_, message):
    engine = SpeculativeEngine(tiny_model, tiny_tokenizer, SessionProposer(NGramDrafter()), EngineConfig(max_sequence_tokens=64))
    with pytest.raises(ValueError, match=message):
        engine.add(request_)
    assert not engine.busy and engine.free_slots == engine.config.max_batch_size


SAMPLING = SamplingParams(temperature=0.9, top_k=20, top_p=0.95)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_seeded_sampling_gives_the_same_tokens_with_and_without_drafts(tiny_model, tiny_tokenizer, k):
    """Coupled per-position randomness: the draft never changes a seeded output."""
    engine = engine_without_eos(tiny_model, tiny_tokenizer, ScriptedProposer(oracle(tiny_model)))
    for seed in range(8):
        params = SamplingParams(SAMPLING.temperature, SAMPLING.top_k, SAMPLING.top_p, seed=seed)
        plain, spec = engine.generate(
            [
                GenerationRequest(PROMPTS[0], 16, params, num_speculative_tokens=0),
                GenerationRequest(PROMPTS[0], 16, params, num_speculative_tokens=k),
            ]
        )
        assert spec.token_ids == plain.token_ids
        assert spec.stats.draft_tokens > 0


def warped(model, context, params):
    with torch.inference_mode():
        return warp_probs(model(torch.tensor([context])).logits[0, -1:], params)[0]


def exact_marginal(model, prompt, position, params):
    """P(token at output ``position``), summed exactly over every earlier path the sampler can take."""
    marginal = torch.zeros(TINY_VOCAB, dtype=torch.float64)

    def walk(context, weight, depth):
        probs = warped(model, context, params).double()
        if depth == position:
            marginal.add_(weight * probs)
            return
        for token in probs.nonzero().flatten().tolist():
            walk(context + [token], weight * probs[token], depth + 1)

    walk(list(prompt), 1.0, 0)
    return marginal


def sample_tokens(engine, params, seeds, k, length=4):
    requests = [GenerationRequest(PROMPTS[0], length, dataclasses.replace(params, seed=seed), num_speculative_tokens=k) for seed in seeds]
    return engine.generate(requests)


def goodness_of_fit_pvalue(tokens, expected_probs):
    counts = np.bincount(tokens, minlength=TINY_VOCAB)
    expected = expected_probs.numpy() * len(tokens)
    # Pool the cells too sparse for the chi-square approximation into one.
    sparse = expected < 5
    observed = np.append(counts[~sparse], counts[sparse].sum())
    expected = np.append(expected[~sparse], expected[sparse].sum())
    return chisquare(observed, expected * observed.sum() / expected.sum()).pvalue


# 3000 samples: the position-2 marginal has ~40 cells above 5 expected counts,
# enough power to reject temperature 1.2 for 0.9 (see the companion test),
# and the whole file still runs in seconds on the tiny model.
SAMPLES = 3000


@pytest.mark.slow  # seconds of sampling: left out of make test-fast
def test_speculative_sampling_matches_the_exact_marginal(tiny_model, tiny_tokenizer):
    """Token at output position 2 (made by a verification step) vs its exactly enumerated law."""
    engine = engine_without_eos(tiny_model, tiny_tokenizer, ScriptedProposer(oracle(tiny_model)))
    results = sample_tokens(engine, SAMPLING, range(SAMPLES), k=3)
    # The rejection path and the acceptance path both ran, many times each.
    accepted = sum(r.stats.accepted_tokens for r in results)
    drafted = sum(r.stats.draft_tokens for r in results)
    assert 0.1 * drafted < accepted < 0.9 * drafted
    exact = exact_marginal(tiny_model, PROMPTS[0], 2, SAMPLING)
    assert goodness_of_fit_pvalue([r.token_ids[2] for r in results], exact) > 0.001


@pytest.mark.slow  # seconds of sampling: left out of make test-fast
def test_speculative_sampling_matches_plain_sampling(tiny_model, tiny_tokenizer):
    """Token at output position 3: speculative vs plain (K=0) sampling, on disjoint seeds."""
    engine = engine_without_eos(tiny_model, tiny_tokenizer, ScriptedProposer(oracle(tiny_model)))
    speculative = sample_tokens(engine, SAMPLING, range(SAMPLES), k=3)
    plain = sample_tokens(engine, SAMPLING, range(SAMPLES, 2 * SAMPLES), k=0)
    table = np.stack(
        [
            np.bincount([r.token_ids[3] for r in speculative], minlength=TINY_VOCAB),
            np.bincount([r.token_ids[3] for r in plain], minlength=TINY_VOCAB),
        ]
    )
    table = table[:, table.sum(axis=0) >= 10]  # drop cells too sparse for the chi-square approximation
    assert chi2_contingency(table).pvalue > 0.001


@pytest.mark.slow  # seconds of sampling: left out of make test-fast
def test_distribution_harness_detects_a_wrong_sampler(tiny_model, tiny_tokenizer):
    """The same harness rejects sampling at temperature 1.2 when 0.9 is the law."""
    engine = engine_without_eos(tiny_model, tiny_tokenizer, ScriptedProposer(oracle(tiny_model)))
    results = sample_tokens(engine, dataclasses.replace(SAMPLING, temperature=1.2), range(SAMPLES), k=3)
    exact = exact_marginal(tiny_model, PROMPTS[0], 2, SAMPLING)
    assert goodness_of_fit_pvalue([r.token_ids[2] for r in results], exact) < 0.001


# -- what each forward pass computes ------------------------------------------------------


class LMHeadRows:
    """Records how many positions the LM head computes in each forward pass."""

    def __init__(self, model):
        self.rows: list[int] = []
        self.handle = model.get_output_embeddings().register_forward_hook(
            lambda module, inputs, output: self.rows.append(inputs[0].shape[-2])
        )

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


class TokensFed:
    """Records the token count of every forward pass (what the linear layers compute)."""

    def __init__(self, model):
        self.counts: list[int] = []
        self.handle = model.get_input_embeddings().register_forward_hook(
            lambda module, inputs, output: self.counts.append(inputs[0].numel())
        )

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def test_prefill_computes_logits_for_the_last_prompt_token_only(tiny_model, tiny_tokenizer):
    engine = engine_without_eos(tiny_model, tiny_tokenizer, NGramDrafter())
    engine.add(GenerationRequest(PROMPTS[3], 4, num_speculative_tokens=0))  # 12 tokens
    with LMHeadRows(tiny_model) as head:
        [outcome] = engine.step()
    assert outcome.first and outcome.tokens == greedy_truth(tiny_model, PROMPTS[3], 1)
    assert head.rows == [1]  # not 12


def test_batched_prefill_gives_the_tokens_of_single_prefills_in_one_pass(tiny_model, tiny_tokenizer):
    # A cost that grows with tokens, so the pass is never padded (the calibration might pad it).
    engine = SpeculativeEngine(tiny_model, tiny_tokenizer, None, step_cost=StepCostModel.linear(1.0, 0.1))
    for prompt in PROMPTS:
        engine.add(GenerationRequest(prompt, 1))
    with TokensFed(tiny_model) as fed, LMHeadRows(tiny_model) as head:
        outcomes = engine.step()
    assert fed.counts == [sum(map(len, PROMPTS))]  # every prompt in one packed pass...
    assert head.rows == [len(PROMPTS)]  # ...with one logit row each
    assert [o.tokens for o in outcomes if o.first] == [greedy_truth(tiny_model, p, 1) for p in PROMPTS]


def test_plain_decoding_of_three_sequences_feeds_three_tokens(tiny_model, tiny_tokenizer):
    # A cost that grows with tokens: nothing is cheaper than 3, so nothing is padded.
    engine = SpeculativeEngine(tiny_model, tiny_tokenizer, None, step_cost=StepCostModel.linear(1.0, 0.1))
    engine.eos_token_ids = NO_EOS
    for prompt in PROMPTS[:3]:
        engine.add(GenerationRequest(prompt, 6, num_speculative_tokens=0))
    engine.step()  # prefill
    with TokensFed(tiny_model) as fed:
        while engine.busy:
            engine.step()
    assert fed.counts == [3] * 5


def test_steps_are_padded_to_a_count_measured_as_cheaper(tiny_model, tiny_tokenizer):
    # Measured: 3 tokens cost more than 4 (as MKL's GEMMs do on some CPUs). The pass
    # runs at 4, the fourth token in the scratch slot; the logits are still 3 rows.
    cost = StepCostModel({1: 1.0, 2: 1.6, 3: 1.7, 4: 1.3, 64: 10.0})
    engine = SpeculativeEngine(tiny_model, tiny_tokenizer, None, step_cost=cost)
    engine.eos_token_ids = NO_EOS
    for prompt in PROMPTS[:3]:
        engine.add(GenerationRequest(prompt, 6, num_speculative_tokens=0))
    engine.step()
    outcomes = []
    with TokensFed(tiny_model) as fed, LMHeadRows(tiny_model) as head:
        while engine.busy:
            outcomes += engine.step()
    assert fed.counts == [4] * 5 and head.rows == [3] * 5
    results = [o.result.token_ids for o in outcomes if o.result is not None]
    assert sorted(results) == sorted(greedy_truth(tiny_model, p, 6) for p in PROMPTS[:3])


def test_each_slot_holds_exactly_its_sequences_keys_through_joins_leaves_and_rollbacks(tiny_model, tiny_tokenizer):
    """After sequences join (chunked prefill, slot trades), leave (the last row moves into
    the gap) and have drafts rejected (rolled back by overwriting), every decoding slot's
    cached keys equal those of its tokens prefilled from scratch."""
    truths = {tuple(p): greedy_truth(tiny_model, p, 40) for p in PROMPTS}

    def half_right(context, k):  # right, right, then wrong: every step rejects a draft
        prompt = next(p for p in PROMPTS if context[: len(p)] == p)
        done = len(context) - len(prompt)
        true = truths[tuple(prompt)][done : done + k]
        return true[:2] + [(t + 1) % 64 for t in true[2:]]

    config = EngineConfig(max_batch_size=3, prefill_chunk_tokens=5)
    engine = SpeculativeEngine(tiny_model, tiny_tokenizer, SessionProposer(ScriptedProposer(half_right)), config)
    engine.eos_token_ids = NO_EOS
    waiting = [GenerationRequest(p, n, num_speculative_tokens=4) for p, n in zip(PROMPTS, (9, 40, 14, 40))]
    for _ in range(3):
        engine.add(waiting.pop(0))
    for _ in range(12):
        engine.step()
        if waiting and engine.free_slots:
            engine.add(waiting.pop(0))  # slot reuse
    assert not waiting and len(engine.active) >= 2
    reference = SpeculativeEngine(tiny_model, tiny_tokenizer, None, EngineConfig(max_batch_size=1))
    for sequence in engine._active:
        cached = sequence.cached
        assert sequence.stats.draft_tokens > sequence.stats.accepted_tokens  # rollbacks happened
        reference.add(GenerationRequest(sequence.tokens[:cached], 1))
        reference.step()  # prefill the same tokens into the reference's slot 0
        for layer in engine.cache.layers:
            torch.testing.assert_close(engine.cache.keys[layer][sequence.slot, :, :cached], reference.cache.keys[layer][0, :, :cached])
            torch.testing.assert_close(engine.cache.values[layer][sequence.slot, :, :cached], reference.cache.values[layer][0, :, :cached])


def test_a_temperature_near_zero_decodes_greedily_beside_a_greedy_request(tiny_model, tiny_tokenizer):
    # T = 1e-44 (a float32 subnormal) passes validation (finite, >= 0); sampled, logits / T
    # overflowed, softmax gave NaN and torch.multinomial raised inside the step, failing
    # every request in the batch.
    engine = SpeculativeEngine(tiny_model, tiny_tokenizer, None, step_cost=StepCostModel.linear(1.0, 0.1))
    prompt = [5, 9, 13, 2, 7]
    greedy, tiny = engine.generate(
        [
            GenerationRequest(prompt, 12),
            GenerationRequest(prompt, 12, SamplingParams(temperature=1e-44, seed=1)),
        ]
    )
    assert tiny.token_ids == greedy.token_ids and len(greedy.token_ids) == 12
