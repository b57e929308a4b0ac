"""Batch-invariant passes (``--batch-invariant``): a token's logits are bitwise the same
whatever else shares its pass (alone, in a chain or a tree, beside 15 other sequences,
beside a prefill chunk) and a prompt's however it is cut into chunks, in float32 and
bfloat16; and so speculative output is plain output, token for token, in both."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency
from transformers import LlamaConfig, LlamaForCausalLM

from tests.verifier_service.test_engine_adaptive import FrozenStepCost
from tests.verifier_service.test_trees import FLAT, NO_EOS, TreeProposer, branch_tree, wrong
from verifier_service.core import invariance as invariance_module
from verifier_service.core.engine import EngineConfig, GenerationRequest, SpeculativeEngine
from verifier_service.core.invariance import (
    Invariance,
    InvariantPass,
    aligned_rows_invariant,
    entry_tokens,
    invariant_linear,
    library_row_limit,
    lone_linear_shapes,
    tokens_attention_invariant,
)
from verifier_service.core.kv_cache import (
    _pad_columns,
    _pad_group_mask,
    _pad_groups,
    _pad_queries,
    _pad_query_mask,
    _token_attention,
    plan_token_calls,
)
from verifier_service.core.packed_linear import use_packed_output
from verifier_service.core.rejection import SamplingParams

VOCAB = 64
ROWS = 17


def build(dtype: torch.dtype) -> LlamaForCausalLM:
    """A seeded Llama wide enough for the kernels' vector and block paths (64-wide heads)."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(7)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # peaked distributions, as a trained model's
    return model.to(dtype)


@pytest.fixture(scope="module", params=["float32", "bfloat16", "bfloat16, output laid out"])
def model(request):
    """Each dtype; bfloat16 also with its output layer laid out for oneDNN, as a served form has it."""
    built = build(getattr(torch, request.param.split(",")[0]))
    if request.param.endswith("laid out") and not use_packed_output(built, measure=False):
        pytest.skip("this CPU's torch has no oneDNN bfloat16 linear layers to lay out")
    return built


def engine_for(model, tokenizer, invariant: bool = True, proposer=None, **config) -> SpeculativeEngine:
    engine = SpeculativeEngine(
        copy.deepcopy(model),
        tokenizer,
        proposer,
        EngineConfig(max_batch_size=ROWS, batch_invariant="on" if invariant else "off", **config),
        step_cost=FrozenStepCost(FLAT),
    )
    engine.eos_token_ids = NO_EOS
    return engine


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (9 + 13 * index,), generator=generator).tolist() for index in range(count)]


def filled(engine: SpeculativeEngine, texts: list[list[int]]) -> None:
    """Each prompt into the slot of its index, prefilled in a pass of its own."""
    with torch.inference_mode():
        for slot, prompt in enumerate(texts):
            engine.target.forward([], [(slot, 0, prompt)], keep=[])


@pytest.mark.parametrize("attention", ["chosen", "query tiles", "a call entry per token"])
def test_a_tokens_logits_are_the_same_whatever_shares_its_pass(model, tiny_tokenizer, attention):
    """With the decode attention the start-up probe chooses, and with each of the two: query
    tiles everywhere; a call entry per token where the probe finds it invariant (else the
    probe must not have chosen it)."""
    engine = engine_for(model, tiny_tokenizer)
    chosen = engine.target.invariance
    assert chosen is not None
    if attention == "query tiles":
        engine.target.invariance = dataclasses.replace(chosen, token_attention=False)
    elif attention == "a call entry per token":
        config = model.config
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        parameter = next(model.parameters())
        if not tokens_attention_invariant(parameter.dtype, parameter.device, kv_heads, heads // kv_heads, config.head_dim):
            assert not chosen.token_attention
            return
        engine.target.invariance = dataclasses.replace(chosen, token_attention=True)
    texts = prompts(ROWS)
    filled(engine, texts)
    cached, token = len(texts[0]), 5
    forward = engine.target.forward

    def first(rows, segments=(), trees=None):
        keep = list(range(sum(len(query) for _, query in rows)))
        with torch.inference_mode():
            return forward(rows, list(segments), keep, trees=trees)[0].clone()

    alone = first([(cached, [token])])
    others = [(len(text), [10 + index]) for index, text in enumerate(texts[1:])]
    wide = [(len(text), [10 + index, 3, 4, 5, 6, 7, 8]) for index, text in enumerate(texts[1:])]
    compositions = {
        "a chain of 4": first([(cached, [token, 7, 8, 9])]),
        "a chain of 17": first([(cached, [token, *range(20, 36)])]),
        "a tree": first([(cached, [token, 7, 8, 9, 10])], trees=[[-1, 0, 0, 1, 2]]),
        "beside 16 sequences": first([(cached, [token]), *others]),
        "beside 16 wide sequences": first([(cached, [token, 2, 3]), *wide]),
        "beside a prefill chunk": first([(cached, [token])], [(ROWS, 0, [2 + index % 60 for index in range(58)])]),
        "beside both": first([(cached, [token, 4]), *others], [(ROWS, 0, [2 + index % 60 for index in range(198)])]),
    }
    assert {name: torch.equal(logits, alone) for name, logits in compositions.items()} == dict.fromkeys(compositions, True)


def test_a_prompts_logits_are_the_same_however_it_is_cut_into_chunks(model, tiny_tokenizer):
    prompt = prompts(1, seed=3)[0] * 5  # 45 tokens
    last = []
    for cuts in ([45], [1, 44], [16, 29], [32, 13], [7, 7, 7, 24]):
        engine = engine_for(model, tiny_tokenizer)
        start = 0
        with torch.inference_mode():
            for length in cuts:
                beside = [(1, 0, [2 + index % 60 for index in range(3 * length)])]  # another prompt's chunk in the same pass
                logits = engine.target.forward([], [(0, start, prompt[start : start + length]), *beside], keep=[length - 1])
                start += length
        last.append(logits[0])
    assert all(torch.equal(logits, last[0]) for logits in last[1:])


def test_greedy_speculative_output_is_plain_output_in_every_dtype(model, tiny_tokenizer):
    """Drafts partly right, as trees (adaptive K) and as chains with every third token wrong
    (K = 4), all requests in one batch: the tokens are plain decoding's, one request at a
    time, in the same dtype."""
    texts = prompts(6, seed=11)
    plain = engine_for(model, tiny_tokenizer)
    expected = [plain.generate([GenerationRequest(text, 24, num_speculative_tokens=0)])[0].token_ids for text in texts]
    truth = {tuple(text): tokens for text, tokens in zip(texts, expected)}

    def every_third_wrong(path: list[int], depth: int) -> tuple[list[int], list[int]]:
        return [token if index % 3 != 2 else (token + 1) % VOCAB for index, token in enumerate(path)], []

    def third_wrong_with_branches(path: list[int], depth: int) -> tuple[list[int], list[int]]:
        tokens, _ = every_third_wrong(path, depth)
        chain = list(range(-1, len(tokens) - 1))
        return tokens + [wrong(token) for token in tokens], chain + chain  # a wrong sibling beside every node

    for k, shape in ((None, branch_tree), (None, third_wrong_with_branches), (4, every_third_wrong)):
        proposer = TreeProposer(lambda prompt: truth[tuple(prompt)], shape, texts)
        engine = engine_for(model, tiny_tokenizer, proposer=proposer)
        results = engine.generate([GenerationRequest(text, 24, num_speculative_tokens=k) for text in texts])
        assert [result.token_ids for result in results] == expected
        assert all(request.max_nodes == 0 for request in proposer.requests)  # chains asked for, and verified
        if shape is not branch_tree:  # its true tokens lie off the leading chain, which is not verified
            assert sum(result.stats.accepted_tokens for result in results) > 0


def test_the_linear_layers_tiles_give_each_row_what_a_call_of_its_own_tile_gives():
    torch.manual_seed(0)
    weight, bias, hidden = torch.randn(48, 32), torch.randn(48), torch.randn(1, 21, 32)
    out = invariant_linear(hidden, weight, bias, InvariantPass(Invariance(linear_tile=8, prefill_tile=16), 5))
    assert out.shape == (1, 21, 48)
    decode = torch.cat([hidden[0, :5], torch.zeros(3, 32)])
    assert torch.equal(out[0, :5], torch.nn.functional.linear(decode, weight, bias)[:5])  # the first decode tile, padded
    assert torch.equal(out[0, 5:21], torch.nn.functional.linear(hidden[0, 5:21], weight, bias))  # one prefill tile of 16
    lone = invariant_linear(hidden[:, :1], weight, bias, InvariantPass(Invariance(linear_tile=0), 1))  # library rows: a lone row as two
    assert torch.equal(lone[0, 0], torch.nn.functional.linear(hidden[0, [0, 0]], weight, bias)[0])


def switching_at(rows: int, original=torch.nn.functional.linear):
    """F.linear as a library computes it that switches kernels past ``rows`` rows a call (as
    oneDNN does at 33 on a CPU with AMX): its rows then come out a rounding apart."""
    return lambda x, weight, bias=None: original(x, weight, bias) + (x.reshape(-1, x.shape[-1]).shape[0] > rows) * 1e-2


def row_by_row(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A linear layer whose rows never depend on the call: each summed on its own."""
    out = (x.unsqueeze(-2).double() * weight.double()).sum(-1)
    return (out if bias is None else out + bias.double()).to(x.dtype)


def test_the_probe_finds_how_many_rows_a_call_may_have(monkeypatch):
    limit = library_row_limit(torch.nn.Linear(8, 8), most_rows=100)  # this machine's library decides
    assert 2 <= limit <= 100
    monkeypatch.setattr(torch.nn.functional, "linear", row_by_row)
    assert library_row_limit(torch.nn.Linear(8, 8), most_rows=100) == 100
    monkeypatch.setattr(torch.nn.functional, "linear", switching_at(2, row_by_row))
    assert library_row_limit(torch.nn.Linear(8, 8), most_rows=100) == 2
    monkeypatch.setattr(torch.nn.functional, "linear", switching_at(32, row_by_row))
    assert library_row_limit(torch.nn.Linear(8, 8), most_rows=100) == 32
    monkeypatch.setattr(torch.nn.functional, "linear", switching_at(80, row_by_row))  # past the counts probed one by one
    assert library_row_limit(torch.nn.Linear(8, 8), most_rows=100) == invariance_module.DENSE_ROWS
    monkeypatch.setattr(torch.nn.functional, "linear", some_rows_apart_past(80, row_by_row))
    assert library_row_limit(torch.nn.Linear(8, 8), most_rows=100) == invariance_module.DENSE_ROWS


def some_rows_apart_past(rows: int, original=torch.nn.functional.linear):
    """F.linear as oneDNN's laid-out bfloat16 computes K=1,536 past 149 rows a call: only a
    few rows (here the 30th of every 31) come out a rounding apart."""

    def linear(x, weight, bias=None):
        out = original(x, weight, bias)
        count = x.reshape(-1, x.shape[-1]).shape[0]
        places = torch.arange(count).reshape(*out.shape[:-1], 1)
        return out + ((places % 31 == 29) & (count > rows)) * 1e-2

    return linear


def test_calls_of_limited_rows_give_each_row_what_a_call_of_its_own_part_gives(monkeypatch):
    torch.manual_seed(0)
    weight, hidden = torch.randn(48, 32), torch.randn(1, 21, 32)
    calls: list[int] = []
    original = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w, b=None: calls.append(x.shape[0]) or original(x, w, b))
    out = invariant_linear(hidden, weight, None, InvariantPass(Invariance(linear_tile=0, linear_rows=4), 9))
    assert calls == [4, 4, 2, 4, 4, 4]  # decode rows 4, 4 and a lone one as two; prefill rows 4 at a time
    parts = [hidden[0, :4], hidden[0, 4:8], hidden[0, [8, 8]], *(hidden[0, start : start + 4] for start in range(9, 21, 4))]
    assert torch.equal(out[0], torch.cat([original(part, weight) for part in parts])[torch.arange(22) != 9])


def test_a_lone_row_is_computed_alone_only_for_the_shapes_the_probe_finds_it_comes_out_as_among_others(monkeypatch):
    torch.manual_seed(0)
    weight, other, hidden = torch.randn(48, 32), torch.randn(40, 32), torch.randn(1, 9, 32)
    calls: list[int] = []
    original = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w, b=None: calls.append(x.shape[0]) or original(x, w, b))
    invariance = Invariance(linear_tile=0, lone_shapes=frozenset({(48, 32, "torch.float32")}))
    lone = invariant_linear(hidden[:, :1], weight, None, InvariantPass(invariance, 1))
    invariant_linear(hidden[:, :1], other, None, InvariantPass(invariance, 1))  # another shape: padded to two
    # Calls of at most 4: the decode rows' last part is one row, computed as it is.
    invariant_linear(hidden, weight, None, InvariantPass(dataclasses.replace(invariance, linear_rows=4), 9))
    assert calls == [1, 2, 4, 4, 1]
    assert torch.equal(lone[0, 0], original(hidden[0, :1], weight)[0])
    # The probe: a library whose one-row calls sum otherwise for 16 inputs (a matrix-vector kernel) keeps their padding.
    monkeypatch.setattr(
        torch.nn.functional,
        "linear",
        lambda x, weight, bias=None: row_by_row(x, weight, bias) + (x.shape[0] == 1 and x.shape[1] == 16) * 1e-2,
    )
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(16, 4))
    assert lone_linear_shapes(model) == {(8, 8, "torch.float32")}


def test_a_library_that_switches_kernels_past_some_rows_keeps_a_tokens_logits(tiny_tokenizer, monkeypatch):
    """A pass of more rows than the library keeps invariant (here 56 decode rows and a prompt
    chunk of 40 tokens) computes each token as a pass of its own does."""
    monkeypatch.setattr(invariance_module, "_row_limits", {})
    monkeypatch.setattr(torch.nn.functional, "linear", switching_at(32))
    engine = engine_for(build(torch.bfloat16), tiny_tokenizer)
    assert engine.target.invariance is not None and engine.target.invariance.linear_rows == 32
    texts = prompts(ROWS)
    filled(engine, texts)
    keep = list(range(1 + 3 * (ROWS - 1)))
    with torch.inference_mode():
        alone = engine.target.forward([(len(texts[0]), [5])], [], [0])[0].clone()
        others = [(len(text), [10 + index, 3, 4]) for index, text in enumerate(texts[1:])]
        beside = engine.target.forward([(len(texts[0]), [5]), *others], [(ROWS, 0, list(range(2, 42)))], keep)[0]
    assert torch.equal(alone, beside)


def placed_past(rows: int, original=torch.nn.functional.linear):
    """F.linear as oneDNN computes bfloat16 on a CPU with AMX: past ``rows`` rows a call, each
    row comes out a rounding apart that depends on its place among the others."""

    def linear(x, weight, bias=None):
        out = original(x, weight, bias)
        count = x.reshape(-1, x.shape[-1]).shape[0]
        if count <= rows:
            return out
        places = torch.arange(count, dtype=out.dtype).reshape(*out.shape[:-1], 1)
        return out + (places % 7) * 1e-2

    return linear


def test_the_aligned_tile_probe_tells_place_from_neighbours(monkeypatch):
    layer = torch.nn.Linear(16, 8)
    monkeypatch.setattr(torch.nn.functional, "linear", placed_past(32, row_by_row))
    assert aligned_rows_invariant(layer, 64)
    neighbours = lambda x, weight, bias=None: row_by_row(x, weight, bias) + x.reshape(-1, x.shape[-1]).mean() * 1e-2  # noqa: E731
    monkeypatch.setattr(torch.nn.functional, "linear", neighbours)
    assert not aligned_rows_invariant(layer, 64)


def test_prefill_tiles_aligned_to_the_prompt_keep_its_logits_however_it_is_cut(tiny_tokenizer, monkeypatch):
    """With a library whose rows past 32 a call depend on their place (oneDNN's bfloat16 on an
    AMX CPU), prefill rows run in calls of 128 aligned to the prompt's positions, and a
    300-token prompt's logits are the same however it is cut into chunks and whatever shares
    its passes."""
    monkeypatch.setattr(invariance_module, "_row_limits", {})
    monkeypatch.setattr(invariance_module, "_probed", {})
    monkeypatch.setattr(torch.nn.functional, "linear", placed_past(32))
    model = build(torch.bfloat16)
    prompt = (prompts(1, seed=5)[0] * 40)[:300]
    keep = [100, 299]
    logits = []
    for cuts in ([300], [100, 200], [77, 51, 172], [128, 128, 44]):
        engine = engine_for(model, tiny_tokenizer, max_sequence_tokens=512)
        assert engine.target.invariance is not None and engine.target.invariance.prefill_rows == 128
        start, kept = 0, []
        with torch.inference_mode():
            for length in cuts:
                beside = [(1, 0, [2 + index % 60 for index in range(length // 3 + 1)])]  # another prompt's chunk in the same pass
                wanted = [index - start for index in keep if start <= index < start + length]
                out = engine.target.forward([], [(0, start, prompt[start : start + length]), *beside], keep=wanted)
                kept += [out[index].clone() for index in range(len(wanted))]
                start += length
        logits.append(torch.stack(kept))
    assert all(torch.equal(cut, logits[0]) for cut in logits[1:])


def entries_switching_past(queries: int, original=torch.nn.functional.scaled_dot_product_attention):
    """Attention as a library computes it whose kernel changes past ``queries`` queries a call
    entry: its outputs then come out a rounding apart."""

    def attention(query, key, value, attn_mask=None, **kwargs):
        return original(query, key, value, attn_mask=attn_mask, **kwargs) + (query.shape[-2] > queries) * 1e-2

    return attention


def query_by_query(query, key, value, attn_mask=None, scale=None, **kwargs):
    """Attention whose queries never depend on the call: each computed on its own, in float64."""
    if kwargs.get("enable_gqa"):
        key, value = (part.repeat_interleave(query.shape[-3] // part.shape[-3], dim=-3) for part in (key, value))
    scores = query.double() @ key.double().transpose(-1, -2) * (scale or query.shape[-1] ** -0.5)
    if attn_mask is not None:
        scores = scores + attn_mask.double() if attn_mask.dtype != torch.bool else scores.masked_fill(~attn_mask, float("-inf"))
    return (scores.softmax(-1) @ value.double()).to(query.dtype)


def test_the_entry_probe_finds_how_many_tokens_a_call_entry_may_hold(monkeypatch):
    cpu = torch.device("cpu")
    assert 1 <= entry_tokens(torch.bfloat16, cpu, 2, 3, 64) <= 8  # this machine's library decides: 3 heads padded to 4
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", query_by_query)
    assert entry_tokens(torch.bfloat16, cpu, 2, 3, 64) == 8
    assert entry_tokens(torch.float32, cpu, 2, 2, 64) == 16
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", entries_switching_past(4 * 3, query_by_query))
    assert entry_tokens(torch.bfloat16, cpu, 2, 3, 64) == 3
    assert entry_tokens(torch.float32, cpu, 2, 2, 64) == 6
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", entries_switching_past(4, query_by_query))
    assert entry_tokens(torch.bfloat16, cpu, 2, 3, 64) == 1


def test_a_chains_tokens_are_what_plain_decoding_computes_one_at_a_time_in_shared_entries(tiny_tokenizer, monkeypatch):
    """With a library whose attention changes past 3 tokens' queries an entry, the probe lets a
    row's tokens share entries of up to 3, and each token of a chain of 7 comes out as a pass
    of its own computes it after the ones before it."""
    monkeypatch.setattr(invariance_module, "_entry_tokens", {})
    monkeypatch.setattr(invariance_module, "_probed", {})
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", entries_switching_past(3 * 2, query_by_query))
    model = build(torch.bfloat16)
    chained, plain = engine_for(model, tiny_tokenizer), engine_for(model, tiny_tokenizer)
    assert chained.target.invariance is not None and chained.target.invariance.entry_tokens == 3
    assert not chained.reads_per_token
    prompt, chain = prompts(1)[0], [5, 9, 11, 2, 7, 30, 4]
    filled(chained, [prompt])
    filled(plain, [prompt])
    with torch.inference_mode():
        together = chained.target.forward([(len(prompt), chain)], [], list(range(len(chain)))).clone()
        one_at_a_time = torch.stack(
            [plain.target.forward([(len(prompt) + index, [token])], [], [0])[0] for index, token in enumerate(chain)]
        )
    assert torch.equal(together, one_at_a_time)


def test_padding_queries_and_columns_hides_what_was_added():
    queries, mask = torch.randn(2, 3, 5, 8), torch.ones(2, 1, 5, 7, dtype=torch.bool)
    padded, padded_mask = _pad_queries(queries, 4), _pad_query_mask(mask, 4)
    assert padded.shape == (2, 3, 8, 8) and torch.equal(padded[:, :, :5], queries) and not padded[:, :, 5:].any()
    assert padded_mask[:, :, 5:].sum() == 2 * 3 and padded_mask[:, :, 5:, 0].all()  # padding sees column 0 alone
    widened, columns = _pad_columns(mask, 16, capacity=12)
    assert columns == 12 and widened.shape[-1] == 12 and not widened[..., 7:].any()  # never past the cache
    same, columns = _pad_columns(mask[..., :4], 4, capacity=12)
    assert columns == 4 and same.shape[-1] == 4  # a multiple already: nothing added


@pytest.mark.parametrize("token_attention", [False, True])
def test_fixed_shapes_compute_the_same_attention_as_free_ones_up_to_rounding(tiny_tokenizer, token_attention):
    """The fixed shapes change the rounding, never the function: a pass's logits with and
    without them agree to float32 rounding, tokens of chains, trees and prefill included."""
    model = build(torch.float32)
    free, fixed = engine_for(model, tiny_tokenizer, invariant=False), engine_for(model, tiny_tokenizer)
    fixed.target.invariance = dataclasses.replace(fixed.target.invariance, token_attention=token_attention)
    texts = prompts(3, seed=5)
    outputs = []
    for engine in (free, fixed):
        filled(engine, texts)
        rows = [(len(texts[0]), [5, 6, 7, 8]), (len(texts[1]), [9]), (len(texts[2]), [10, 11, 12])]
        with torch.inference_mode():
            logits = engine.target.forward(
                rows, [(3, 0, texts[1])], list(range(8)) + [8 + len(texts[1]) - 1], trees=[[-1, 0, 0, 1], None, None]
            )
        outputs.append(logits)
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-4, atol=1e-4)


SAMPLING = SamplingParams(temperature=0.9, top_k=20, top_p=0.95)


def guessing(model, tokenizer, texts, length):
    """A proposer drafting each prompt's plain greedy continuation (partly what sampling draws)."""
    plain = engine_for(model, tokenizer)
    truth = {tuple(text): plain.generate([GenerationRequest(text, length, num_speculative_tokens=0)])[0].token_ids for text in texts}
    return TreeProposer(lambda prompt: truth[tuple(prompt)], branch_tree, texts)


def test_seeded_sampling_gives_plain_samplings_tokens_in_every_dtype(model, tiny_tokenizer):
    """Coupled randomness: with a seed, speculative sampling draws exactly what plain sampling
    draws, batched beside other requests, when the logits are the same bits."""
    texts = prompts(4, seed=13)
    engine = engine_for(model, tiny_tokenizer, proposer=guessing(model, tiny_tokenizer, texts, 24))
    for seed in range(3):
        params = dataclasses.replace(SAMPLING, seed=seed)
        plain = engine.generate([GenerationRequest(text, 16, params, num_speculative_tokens=0) for text in texts])
        speculative = engine.generate([GenerationRequest(text, 16, params, num_speculative_tokens=None) for text in texts])
        assert [result.token_ids for result in speculative] == [result.token_ids for result in plain]
        assert sum(result.stats.draft_tokens for result in speculative) > 0


@pytest.mark.slow  # seconds of sampling: left out of make test-fast
def test_sampled_speculation_keeps_the_targets_distribution_in_bfloat16(tiny_tokenizer):
    """Token at output position 3, speculative against plain sampling on disjoint seeds, in
    bfloat16 with fixed shapes: one distribution (chi-square)."""
    model = build(torch.bfloat16)
    text = prompts(1, seed=17)[0]
    engine = engine_for(model, tiny_tokenizer, proposer=guessing(model, tiny_tokenizer, [text], 8))
    samples = 1500

    def position_3(seeds, k):
        requests = [GenerationRequest(text, 4, dataclasses.replace(SAMPLING, seed=seed), num_speculative_tokens=k) for seed in seeds]
        return [result.token_ids[3] for result in engine.generate(requests)]

    table = np.stack(
        [
            np.bincount(position_3(range(samples), 3), minlength=VOCAB),
            np.bincount(position_3(range(samples, 2 * samples), 0), minlength=VOCAB),
        ]
    )
    table = table[:, table.sum(axis=0) >= 10]
    assert table.shape[1] >= 2 and chi2_contingency(table).pvalue > 0.001


def test_a_token_alone_in_its_attention_call_is_the_token_among_others_on_the_default_models_own_inputs():
    """Decode attention inputs captured from the default model (one token's 3 query heads
    per key head over 67 cached columns, bfloat16) where CPU flash attention computed the
    token alone in its call (3 items on 2 threads) a bfloat16 step apart from the same
    token among others. Token attention pads an entry's query heads to an even count
    (``QUERY_MULTIPLE``), as ``slot_attention`` does here, and the token comes out the
    same however many rows its call has. Random inputs never showed the difference."""
    case = torch.load(Path(__file__).parent / "fixtures" / "token_attention_case.pt")
    queries, keys, values = case["queries"], case["keys"], case["values"]  # [kv, groups, dim], [kv, 67, dim] x 2
    kv_heads, groups, dim = queries.shape
    padded = _pad_groups(queries[None], groups, 1)
    mask, columns = _pad_columns(_pad_group_mask(torch.ones(1, 1, groups, keys.shape[1], dtype=torch.bool), groups, 1), 16, 4096)
    cached = torch.zeros(4, kv_heads, columns, dim, dtype=keys.dtype)
    cached_values = torch.zeros_like(cached)
    cached[:, :, : keys.shape[1]], cached_values[:, :, : keys.shape[1]] = keys, values  # every row the same cache
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        outputs = [
            _token_attention(
                padded.expand(rows, -1, -1, -1),
                mask.expand(rows, -1, -1, -1),
                cached,
                cached_values,
                0,
                padded.shape[2],
                plan_token_calls([[columns]] * rows, torch.device("cpu")),
                case["scale"],
            )[0, :, :groups]
            for rows in (1, 2, 3, 4)
        ]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(output, outputs[0]) for output in outputs[1:])
