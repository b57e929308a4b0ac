"""Penalties, ``logit_bias``, ``min_tokens`` and log-probabilities, per verified position.

The engine shapes each position of a verify pass from that position's own
prefix, so its output equals plain decoding's with the same rules: checked
against a reference written independently here (full recomputation, the
rules applied with Python loops and transformers' own repetition penalty),
at K = 0, 5, adaptive chains and trees, greedy and seeded sampling.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from drafter_service.sessions import NGramDrafter
from tests.verifier_service.test_engine_adaptive import FrozenStepCost
from tests.verifier_service.test_trees import FLAT, PROMPTS, TreeProposer, branch_tree, engine_for, wrong
from verifier_service.core.drafting import SessionProposer
from verifier_service.core.engine import EngineConfig, GenerationRequest, SpeculativeEngine
from verifier_service.core.processing import Prefixes, TokenHistory, chain_paths, shape_logits, token_logprobs, tree_paths
from verifier_service.core.rejection import MIN_SAMPLING_TEMPERATURE, REPETITION_PENALTY_RANGE, SamplingParams, warp_probs

EOS = 1
LENGTH = 24
RULES = {
    "repetition": SamplingParams(repetition_penalty=1.8),
    "frequency": SamplingParams(frequency_penalty=1.5),
    "presence": SamplingParams(presence_penalty=2.0),
    "bias": SamplingParams(logit_bias=((7, 5.0), (9, -100.0), (30, 3.5))),
    "all": SamplingParams(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=-0.5, logit_bias=((12, 2.0),), min_tokens=6),
}


def reference_shaped(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int], eos: frozenset[int]):
    """The rules for one position, written out one token at a time."""
    logits = logits.clone().float()
    for token, bias in params.logit_bias:
        logits[token] += bias
    if len(output) < params.min_tokens:
        for token in eos:
            logits[token] = float("-inf")
    if params.repetition_penalty != 1.0:
        logits = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(torch.tensor([prompt + output]), logits[None])[0]
    for token, count in Counter(output).items():
        logits[token] -= params.frequency_penalty * count + params.presence_penalty
    return logits


@torch.inference_mode()
def reference_decode(model, prompt: list[int], params: SamplingParams, length: int, eos: frozenset[int] = frozenset()):
    """Plain greedy decoding with the rules, by full recomputation."""
    output: list[int] = []
    while len(output) < length:
        logits = model(torch.tensor([prompt + output])).logits[0, -1]
        token = int(reference_shaped(logits, params, prompt, output, eos).argmax())
        output.append(token)
        if token in eos:
            break
    return output


# -- the rules, position by position -----------------------------------------------------


def test_paths_of_chains_and_trees():
    assert chain_paths([7, 8]) == [[], [7], [7, 8]]
    assert tree_paths([7, 4, 8], [-1, -1, 0]) == [[], [7], [4], [7, 8]]


@pytest.mark.parametrize("name", sorted(RULES))
def test_each_position_is_shaped_from_its_own_prefix(name):
    """A tree's five positions, each shaped as the reference shapes it alone."""
    params, prompt, generated = RULES[name], [3, 7, 7, 20], [7, 9, 9, 12, 5]
    tokens, parents = [9, 7, 12, 9], [-1, 0, 0, 2]
    paths = tree_paths(tokens, parents)
    logits = torch.randn(len(paths), 64, generator=torch.Generator().manual_seed(1)) * 4
    shaped = shape_logits(logits, params, Prefixes(prompt, generated, paths), frozenset({EOS}))
    for row, path in enumerate(paths):
        expected = reference_shaped(logits[row], params, prompt, generated + path, frozenset({EOS}))
        torch.testing.assert_close(shaped[row], expected, rtol=0, atol=1e-6)
    assert not torch.equal(shaped, logits)  # the rule did something


def test_a_sequences_history_reads_each_token_once_and_shapes_bit_for_bit_as_the_lists_do():
    """Penalties read from the token lists took the whole prompt and output at every step (a
    100k-token prompt cost milliseconds per row per step); a sequence's TokenHistory reads the
    prompt once and each output token once, and shapes exactly as the lists do."""
    params = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=-0.5)
    prompt, generated, history = [3, 7, 7, 20] * 50, [], TokenHistory()
    random = torch.Generator().manual_seed(2)
    for step in range(6):
        paths = tree_paths([9, 12, 9], [-1, 0, -1])
        logits = torch.randn(len(paths), 64, generator=random) * 4
        kept = shape_logits(logits, params, Prefixes(prompt, generated, paths, history), frozenset({EOS}))
        assert torch.equal(kept, shape_logits(logits, params, Prefixes(prompt, generated, paths), frozenset({EOS})))
        assert history.tokens_read == len(prompt) + len(generated)  # nothing read twice
        generated += [10 + step % 3, 9]  # as the engine's output grows: appended to


@pytest.mark.parametrize("penalty", [REPETITION_PENALTY_RANGE[0], REPETITION_PENALTY_RANGE[1]])
def test_at_the_ends_of_every_range_sampling_probabilities_stay_finite(penalty):
    """The worst a request may ask (rejection.REPETITION_PENALTY_RANGE's reasoning): logits of
    +-1e4 (a model's are tens), biased by 100, penalised, sharpened by the smallest sampling
    temperature: finite probabilities, no NaN."""
    params = SamplingParams(
        temperature=MIN_SAMPLING_TEMPERATURE,
        repetition_penalty=penalty,
        frequency_penalty=2.0,
        presence_penalty=2.0,
        logit_bias=((5, 100.0), (6, -100.0)),
    )
    logits = torch.tensor([[1e4, -1e4] * 32, [-1e4, 1e4] * 32])
    shaped = shape_logits(logits, params, Prefixes(list(range(64)), [5, 6, 5], [[], [6]]), frozenset({EOS}))
    probs = warp_probs(shaped, params)
    assert torch.isfinite(shaped).all() and torch.isfinite(probs).all()
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(2))


def test_min_tokens_masks_end_of_sequence_only_while_the_prefix_is_short():
    params = SamplingParams(min_tokens=3)
    logits = torch.zeros(3, 8)
    shaped = shape_logits(logits, params, Prefixes([4], [5], chain_paths([6, 7])), frozenset({1, 2}))
    assert torch.isinf(shaped[:2, 1:3]).all()  # 1 and 2 tokens before: masked
    assert torch.equal(shaped[2], logits[2])  # 3 before: free
    assert torch.equal(shaped[:, [0, 3, 4, 5, 6, 7]], logits[:, [0, 3, 4, 5, 6, 7]])


def test_no_rule_returns_the_logits_untouched():
    logits = torch.randn(2, 8)
    assert shape_logits(logits, SamplingParams(temperature=0.7), Prefixes([1], [], [[], [3]]), frozenset({1})) is logits


def test_token_logprobs_are_log_softmax_with_the_top_alternatives():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 0.0]])
    first, second = token_logprobs(logits, [1, 2], top=2)
    expected = torch.log_softmax(logits, dim=-1)
    assert first.token == 1 and first.logprob == pytest.approx(float(expected[0, 1]))
    assert [token for token, _ in first.top] == [0, 1]
    assert second.top[0] == (2, pytest.approx(float(expected[1, 2])))
    assert token_logprobs(logits, [1, 2], top=0)[0].top == ()


# -- the engine: greedy output is plain decoding's with the same rules -----------------


def ngram_engine(model, tokenizer, **config):
    engine = SpeculativeEngine(model, tokenizer, SessionProposer(NGramDrafter()), EngineConfig(**config))
    engine.eos_token_ids = frozenset()
    return engine


@pytest.mark.parametrize("name", sorted(RULES))
@pytest.mark.parametrize("k", [0, 5, None])
def test_greedy_with_rules_equals_plain_decoding_with_them(tiny_model, tiny_tokenizer, name, k):
    params = RULES[name]
    engine = ngram_engine(tiny_model, tiny_tokenizer)
    results = engine.generate([GenerationRequest(p, LENGTH, params, num_speculative_tokens=k) for p in PROMPTS])
    expected = [reference_decode(tiny_model, p, params, LENGTH) for p in PROMPTS]
    assert [r.token_ids for r in results] == expected
    unshaped = [reference_decode(tiny_model, p, SamplingParams(), LENGTH) for p in PROMPTS]
    assert expected != unshaped  # the rule changes this output, so the equality means something


@pytest.mark.parametrize("name", ["repetition", "frequency", "all"])
def test_greedy_trees_with_rules_accept_along_the_shaped_path(tiny_model, tiny_tokenizer, name):
    """Trees drafted around the penalised output, its true path always a second child: whole
    paths are accepted, so every node must have been shaped from its own path."""
    params = RULES[name]
    references = {tuple(p): reference_decode(tiny_model, p, params, 64) for p in PROMPTS}
    proposer = TreeProposer(lambda prompt: references[tuple(prompt)])
    engine = engine_for(tiny_model, tiny_tokenizer, proposer, FrozenStepCost(FLAT), max_adaptive_k=4, max_adaptive_nodes=12)
    results = engine.generate([GenerationRequest(p, 31, params, num_speculative_tokens=None) for p in PROMPTS])
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == references[tuple(prompt)][:31]
        assert result.stats.accepted_tokens == 24  # 6 steps of 4 accepted + 1, after the first token


def test_a_tree_whose_siblings_differ_only_by_a_repeat_is_shaped_per_branch(tiny_model, tiny_tokenizer):
    """Wrong siblings carry tokens that are already in the output: a penalty computed from
    the wrong branch's tokens would move the argmax of the true branch."""
    params = SamplingParams(frequency_penalty=2.0, presence_penalty=2.0)
    references = {tuple(p): reference_decode(tiny_model, p, params, 64) for p in PROMPTS}

    def repeat_siblings(path, depth):
        tokens, parents = branch_tree(path, depth)
        return [path[0] if index % 3 != 2 and path else token for index, token in enumerate(tokens)], parents

    proposer = TreeProposer(lambda prompt: references[tuple(prompt)], repeat_siblings)
    engine = engine_for(tiny_model, tiny_tokenizer, proposer, FrozenStepCost(FLAT), max_adaptive_k=4, max_adaptive_nodes=12)
    results = engine.generate([GenerationRequest(p, 30, params, num_speculative_tokens=None) for p in PROMPTS])
    assert [r.token_ids for r in results] == [references[tuple(p)][:30] for p in PROMPTS]


def test_min_tokens_holds_back_end_of_sequence_and_stop_strings(tiny_model, tiny_tokenizer):
    """A prompt whose greedy output reaches EOS early, then one whose stop string comes early:
    min_tokens makes both run on, exactly as plain decoding with EOS masked."""
    engine = SpeculativeEngine(tiny_model, tiny_tokenizer, SessionProposer(NGramDrafter()))
    eos = engine.eos_token_ids
    finishing = [(p, reference_decode(tiny_model, p, SamplingParams(), 40, eos)) for p in ([5, 6, 7], *([t] for t in range(2, 64)))]
    prompt, short = next((p, out) for p, out in finishing if out[-1] in eos and len(out) < 30)
    params = SamplingParams(min_tokens=len(short) + 4)
    [result] = engine.generate([GenerationRequest(prompt, 40, params, num_speculative_tokens=5)])
    assert len(result.token_ids) >= len(short) + 4
    assert result.token_ids == reference_decode(tiny_model, prompt, params, 40, eos)
    # A stop string met before min_tokens is passed over; the next one after it ends the output.
    plain = reference_decode(tiny_model, PROMPTS[3], SamplingParams(), 30)
    stop = tiny_tokenizer.decode([plain[2]])
    [early] = engine.generate([GenerationRequest(PROMPTS[3], 30, stop=(stop,), num_speculative_tokens=5)])
    [late] = engine.generate([GenerationRequest(PROMPTS[3], 30, SamplingParams(min_tokens=6), stop=(stop,), num_speculative_tokens=5)])
    assert len(early.token_ids) == 3
    assert len(late.token_ids) >= 6 and late.token_ids == plain[: len(late.token_ids)]
    assert late.text.startswith(tiny_tokenizer.decode(plain[:3]))  # the stop string passed over stays in the text


# -- sampling ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_seeded_sampling_with_rules_is_plain_samplings_token_for_token(tiny_model, tiny_tokenizer, seed):
    """With a seed, each position's token is the draw from the shaped distribution given its
    prefix: speculative (chains and trees) gives exactly plain sampling's tokens, so it keeps
    the shaped distribution whatever was drafted."""
    params = dataclasses.replace(RULES["all"], temperature=1.1, top_k=30, seed=seed)
    plain = engine_for(tiny_model, tiny_tokenizer, None)
    expected = [r.token_ids for r in plain.generate([GenerationRequest(p, 30, params, num_speculative_tokens=0) for p in PROMPTS])]
    references = {tuple(p): e for p, e in zip(PROMPTS, expected)}
    proposer = TreeProposer(lambda prompt: references[tuple(prompt)])
    trees = engine_for(tiny_model, tiny_tokenizer, proposer, FrozenStepCost(FLAT), max_adaptive_k=4, max_adaptive_nodes=12)
    results = trees.generate([GenerationRequest(p, 30, params, num_speculative_tokens=None) for p in PROMPTS])
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats.accepted_tokens for r in results) > 0
    chains = ngram_engine(tiny_model, tiny_tokenizer)
    chains = chains.generate([GenerationRequest(p, 30, params, num_speculative_tokens=5) for p in PROMPTS])
    assert [r.token_ids for r in chains] == expected


def test_plain_sampling_with_a_bias_draws_from_the_shaped_distribution(tiny_model, tiny_tokenizer):
    """The first token's frequencies under a strong bias follow the shaped softmax."""
    params = SamplingParams(temperature=1.0, logit_bias=((11, 9.0), (13, 8.0)))
    engine = engine_for(tiny_model, tiny_tokenizer, None)
    seeds = range(400)
    requests = [GenerationRequest(PROMPTS[0], 1, dataclasses.replace(params, seed=s), num_speculative_tokens=0) for s in seeds]
    results = engine.generate(requests)
    with torch.inference_mode():
        logits = tiny_model(torch.tensor([PROMPTS[0]])).logits[0, -1:]
    probs = warp_probs(reference_shaped(logits[0], params, PROMPTS[0], [], frozenset())[None], params)[0]
    share = sum(r.token_ids[0] in (11, 13) for r in results) / len(seeds)
    assert abs(share - float(probs[11] + probs[13])) < 0.08  # ~4 standard deviations at 400 draws
    assert float(probs[11] + probs[13]) > 0.5


# -- log-probabilities ------------------------------------------------------------------


@pytest.mark.parametrize("k", [5, None])
def test_logprobs_equal_plain_decodings_and_the_models_own(tiny_model, tiny_tokenizer, k):
    """Every emitted token's log-probability, accepted drafts included, equals plain
    decoding's within 1e-5 in float32, and the model's log-softmax by full recomputation."""
    engine = ngram_engine(tiny_model, tiny_tokenizer)
    plain = engine.generate([GenerationRequest(p, LENGTH, num_speculative_tokens=0, logprobs=3) for p in PROMPTS])
    spec = engine.generate([GenerationRequest(p, LENGTH, num_speculative_tokens=k, logprobs=3) for p in PROMPTS])
    assert sum(r.stats.accepted_tokens for r in spec) > 0
    for prompt, ours, theirs in zip(PROMPTS, spec, plain):
        assert ours.token_ids == theirs.token_ids
        assert [item.token for item in ours.logprobs] == ours.token_ids
        for a, b in zip(ours.logprobs, theirs.logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-5)
        with torch.inference_mode():
            full = torch.log_softmax(tiny_model(torch.tensor([prompt + ours.token_ids])).logits[0].float(), dim=-1)
        for index, item in enumerate(ours.logprobs):
            assert item.logprob == pytest.approx(float(full[len(prompt) - 1 + index, item.token]), abs=1e-5)
            assert item.top[0][0] == item.token  # greedy: the chosen token is the most likely


def test_logprobs_stream_with_their_tokens_and_stay_off_unless_asked(tiny_model, tiny_tokenizer):
    engine = ngram_engine(tiny_model, tiny_tokenizer)
    handle = engine.add(GenerationRequest(PROMPTS[1], LENGTH, num_speculative_tokens=None, logprobs=0))
    streamed, result = [], None
    while result is None:
        for outcome in engine.step():
            if outcome.sequence is handle:
                assert len(outcome.logprobs) == len(outcome.tokens)
                streamed += outcome.logprobs
                result = outcome.result or result
    assert streamed == result.logprobs and all(item.top == () for item in streamed)
    [quiet] = engine.generate([GenerationRequest(PROMPTS[1], 4)])
    assert quiet.logprobs is None


def test_rejected_drafts_leave_no_logprobs(tiny_model, tiny_tokenizer):
    """Drafts that are always wrong: each step's one log-probability is the target's token's."""
    truth = reference_decode(tiny_model, PROMPTS[0], SamplingParams(), 64)
    proposer = TreeProposer(lambda prompt: [wrong(t) for t in truth], lambda path, depth: (path[:depth], list(range(-1, depth - 1))))
    engine = engine_for(tiny_model, tiny_tokenizer, proposer, FrozenStepCost(FLAT))
    [result] = engine.generate([GenerationRequest(PROMPTS[0], 12, num_speculative_tokens=None, logprobs=1)])
    assert result.token_ids == truth[:12] and result.stats.accepted_tokens == 0
    assert [item.token for item in result.logprobs] == truth[:12]


# -- refusals ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (GenerationRequest([5], 4, SamplingParams(presence_penalty=2.5)), "presence_penalty must be in [-2, 2]"),
        (GenerationRequest([5], 4, SamplingParams(frequency_penalty=float("nan"))), "frequency_penalty must be in [-2, 2]"),
        (GenerationRequest([5], 4, SamplingParams(repetition_penalty=0.0)), "repetition_penalty must be in [0.01, 100]"),
        (GenerationRequest([5], 4, SamplingParams(logit_bias=((3, 101.0),))), "logit_bias[3] must be in [-100, 100]"),
        (GenerationRequest([5], 4, SamplingParams(logit_bias=((3, 1.0), (3, 2.0)))), "logit_bias names a token twice"),
        (GenerationRequest([5], 4, SamplingParams(logit_bias=((64, 1.0),))), "logit_bias names token ids outside the vocabulary"),
        (GenerationRequest([5], 4, SamplingParams(logit_bias=tuple((t, 1.0) for t in range(4)))), "--max-logit-bias"),
        (GenerationRequest([5], 4, SamplingParams(min_tokens=5)), "min_tokens (5) must not exceed the tokens asked for (4)"),
        (GenerationRequest([5], 4, logprobs=6), "logprobs must be in [0, 5]"),
    ],
)
def test_bad_rules_are_refused_with_a_message_naming_the_field(tiny_model, tiny_tokenizer, request_, message):
    engine = SpeculativeEngine(tiny_model, tiny_tokenizer, None, EngineConfig(max_logit_bias=3, max_logprobs=5))
    with pytest.raises(ValueError) as caught:
        engine.validate(request_)
    assert message in str(caught.value)
