"""Draft trees in the engine: the ancestor mask, moving an accepted path into place,
exact greedy and sampled output, and drafts a faulty drafter might send.

On the tiny seeded Llama (and a sliding-window Mistral), against full recomputation.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from tests.verifier_service.test_engine_adaptive import FrozenStepCost, truth
from tests.verifier_service.test_model_support import SMALL, seeded
from verifier_service.core import kv_cache
from verifier_service.core.drafting import DraftRequest, ProposedDraft
from verifier_service.core.engine import EngineConfig, GenerationRequest, SpeculativeEngine
from verifier_service.core.kv_cache import partition_rows, tree_depths
from verifier_service.core.rejection import SamplingParams

VOCAB = 64
NO_EOS = frozenset()
PROMPTS = [[5, 6, 7], [9, 3, 3, 9, 3, 3, 9, 3], [12], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]]
FLAT = {1: 1.0, 1024: 1.0}  # every step costs the same: the planner verifies every node


def wrong(token: int, offset: int = 1) -> int:
    return (token + offset) % VOCAB


def branch_tree(path: list[int], depth: int) -> tuple[list[int], list[int]]:
    """A tree whose true path runs through second children only: at each level a wrong
    sibling comes first (with a wrong child of its own), then the true token."""
    tokens: list[int] = []
    parents: list[int] = []
    parent = -1
    for token in path[:depth]:
        tokens += [wrong(token), wrong(token, 2)]  # a wrong first child, and a child of it
        parents += [parent, len(tokens) - 2]
        tokens.append(token)
        parents.append(parent)
        parent = len(tokens) - 1
    return tokens, parents


@dataclass
class TreeProposer:
    """Drafts trees around ``reference(prompt)``'s continuation; what ``shape`` makes of it."""

    reference: callable
    shape: callable = branch_tree
    prompts: list[list[int]] = field(default_factory=lambda: PROMPTS)
    requests: list[DraftRequest] = field(default_factory=list)

    def propose(self, requests: list[DraftRequest]) -> list[ProposedDraft]:
        drafts = []
        for request in requests:
            self.requests.append(dataclasses.replace(request, tokens=list(request.tokens)))  # the engine's list grows
            prompt = next(p for p in self.prompts if request.tokens[: len(p)] == p)
            done = len(request.tokens) - len(prompt)
            tokens, parents = self.shape(self.reference(prompt)[done : done + request.k], request.k)
            drafts.append(ProposedDraft(tokens, parents=parents))
        return drafts

    def close(self, finished) -> None:
        pass


def engine_for(model, tokenizer, proposer, step_cost=None, **config) -> SpeculativeEngine:
    engine = SpeculativeEngine(model, tokenizer, proposer, EngineConfig(**config), step_cost=step_cost)
    engine.eos_token_ids = NO_EOS
    return engine


def prefill(engine: SpeculativeEngine, prompt: list[int]):
    """Add ``prompt`` and step until it decodes; returns its engine sequence."""
    handle = engine.add(GenerationRequest(prompt, 32, num_speculative_tokens=0))
    while handle not in engine.active:
        engine.step()
    return engine._sequence_of(handle)


# -- the ancestor mask -----------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "mistral-window-3"])
def test_every_tree_node_gets_the_logits_of_its_own_path(tiny_model, tiny_tokenizer, family):
    """One packed pass over a tree (siblings, a deep branch, a second row beside it):
    each node's logits are those of full recomputation over context + its path."""
    model = tiny_model
    if family != "llama":  # a window shorter than the context and the tree: both edges matter
        model = seeded(MistralForCausalLM, MistralConfig(**SMALL, sliding_window=3, max_position_embeddings=128))
    engine = engine_for(model, tiny_tokenizer, None)
    first, second = prefill(engine, [(3 * j) % 60 + 2 for j in range(9)]), prefill(engine, [7, 8, 9, 10])
    tokens = [11, 12, 13, 14, 15, 16, 17]
    parents = [-1, -1, 0, 0, 2, -1, 4]  # [last] + drafts: the root's parent is -1
    query_parents = [-1, *(p + 1 for p in parents)]
    rows = [(first.cached, [first.tokens[-1], *tokens]), (second.cached, [second.tokens[-1], 20, 21])]
    with torch.inference_mode():
        logits = engine.target.forward(rows, [], list(range(len(tokens) + 4)), trees=[query_parents, None])
    for node in range(len(tokens) + 1):
        path, walk = [], node
        while walk > 0:
            path.insert(0, tokens[walk - 1])
            walk = query_parents[walk]
        with torch.inference_mode():
            expected = model(input_ids=torch.tensor([first.tokens + path])).logits[0, -1]
        assert torch.allclose(logits[node], expected, atol=1e-4), f"node {node} (path {path})"
    with torch.inference_mode():
        for index, query in enumerate([[], [20], [20, 21]]):
            expected = model(input_ids=torch.tensor([second.tokens + query])).logits[0, -1]
            assert torch.allclose(logits[len(tokens) + 1 + index], expected, atol=1e-4)


def test_tree_depths_and_positions():
    assert tree_depths([-1, 0, 0, 1, -1]) == [0, 1, 1, 2, 0]


# -- greedy: exact, through second children -------------------------------------------


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_trees_equal_plain_decoding_and_accept_whole_paths(tiny_model, tiny_tokenizer, batch):
    """The true path is never a first child, so every accepted path is moved into place;
    with a flat cost every node is verified and each step accepts the full depth."""
    proposer = TreeProposer(lambda prompt: truth(tiny_model, prompt))
    engine = engine_for(tiny_model, tiny_tokenizer, proposer, FrozenStepCost(FLAT), max_adaptive_k=4, max_adaptive_nodes=12)
    prompts = PROMPTS[:batch]
    results = engine.generate([GenerationRequest(p, 31, num_speculative_tokens=None) for p in prompts])
    for prompt, result in zip(prompts, results):
        assert result.token_ids == truth(tiny_model, prompt)[:31]
        # 1 at prefill, then 6 steps of 4 accepted + 1: 31 tokens in 7 passes.
        assert result.stats.target_forward_passes == 7
        assert result.stats.accepted_tokens == 24
    assert all(request.max_nodes == 12 for request in proposer.requests)
    # Feedback is about the drafter's chain (the first nodes: two wrong ones here), never the branches.
    assert {request.accepted for request in proposer.requests} == {0}
    assert {request.verified for request in proposer.requests} <= {0, 1, 2}  # 1: the last step's depth-1 tree


def test_rows_cut_into_several_attention_calls_stay_exact(tiny_model, tiny_tokenizer, monkeypatch):
    """A 300-token prompt beside short ones, a tree on every row: the CPU cuts the decode
    rows into several attention calls (the long row alone), and the output is plain decoding's."""
    cuts = []

    def recording(counts, split=True):
        cuts.append(partition_rows(counts, split))
        return cuts[-1]

    monkeypatch.setattr(kv_cache, "partition_rows", recording)
    prompts = [*PROMPTS[:3], [(7 * j) % 60 + 2 for j in range(300)]]
    proposer = TreeProposer(lambda prompt: truth(tiny_model, prompt), prompts=prompts)
    engine = engine_for(tiny_model, tiny_tokenizer, proposer, FrozenStepCost(FLAT), max_adaptive_k=4, max_adaptive_nodes=12)
    results = engine.generate([GenerationRequest(p, 31, num_speculative_tokens=None) for p in prompts])
    for prompt, result in zip(prompts, results):
        assert result.token_ids == truth(tiny_model, prompt)[:31]
    assert any(len(cut) > 1 for cut in cuts)


def test_greedy_trees_with_joins_and_rejections_equal_plain_decoding(tiny_model, tiny_tokenizer):
    """Trees whose true path stops at a random depth (the rest wrong), 4 prompts through 2
    slots with 3-token prefill chunks: sequences join mid-run beside trees."""
    rng = random.Random(5)

    def partly_right(path: list[int], depth: int):
        cut = rng.randrange(depth + 1)
        return branch_tree(path[:cut] + [wrong(t, 3) for t in path[cut:]], depth)

    proposer = TreeProposer(lambda prompt: truth(tiny_model, prompt), partly_right)
    engine = engine_for(
        tiny_model, tiny_tokenizer, proposer, FrozenStepCost(FLAT), max_batch_size=2, prefill_chunk_tokens=3, max_adaptive_nodes=24
    )
    results = engine.generate([GenerationRequest(p, 40, num_speculative_tokens=None) for p in PROMPTS])
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == truth(tiny_model, prompt)[:40]
    assert 0 < sum(r.stats.accepted_tokens for r in results) < sum(r.stats.draft_tokens for r in results)


def test_the_planner_verifies_only_part_of_a_tree_when_tokens_cost(tiny_model, tiny_tokenizer):
    """A step's cost grows with its tokens: the planner keeps a subset, closed under
    ancestors (else the pass would score nodes whose parents it never saw), and the output
    is still exact."""
    proposer = TreeProposer(lambda prompt: truth(tiny_model, prompt))
    engine = engine_for(tiny_model, tiny_tokenizer, proposer, FrozenStepCost.linear(1.0, 0.1), max_adaptive_k=4, max_adaptive_nodes=12)
    results = engine.generate([GenerationRequest(p, 30, num_speculative_tokens=None) for p in PROMPTS])
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == truth(tiny_model, prompt)[:30]
    verified = sum(r.stats.draft_tokens for r in results)
    steps = sum(r.stats.verify_steps_with_drafts for r in results)
    assert 0 < verified < 12 * steps  # some nodes verified, never every node of every tree


def test_fixed_k_requests_ask_for_chains(tiny_model, tiny_tokenizer):
    proposer = TreeProposer(lambda prompt: truth(tiny_model, prompt))
    engine = engine_for(tiny_model, tiny_tokenizer, proposer, FrozenStepCost(FLAT))
    [result] = engine.generate([GenerationRequest(PROMPTS[0], 12, num_speculative_tokens=3)])
    assert result.token_ids == truth(tiny_model, PROMPTS[0])[:12]
    assert {request.max_nodes for request in proposer.requests} == {0}


# -- sampling: token for token what plain sampling gives -------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_sampled_trees_emit_exactly_what_plain_sampling_does(tiny_model, tiny_tokenizer, seed):
    """With a seed, the tree rule emits the draw of each position from the target's
    distribution given the tokens before it: the same tokens as plain sampling, whatever
    was drafted. Trees around plain sampling's own output get accepted often."""
    sampling = SamplingParams(temperature=1.3, top_k=20, seed=seed)
    plain = engine_for(tiny_model, tiny_tokenizer, None)
    expected = [r.token_ids for r in plain.generate([GenerationRequest(p, 30, sampling, num_speculative_tokens=0) for p in PROMPTS])]
    reference = {tuple(p): e for p, e in zip(PROMPTS, expected)}
    proposer = TreeProposer(lambda prompt: reference[tuple(prompt)])
    engine = engine_for(tiny_model, tiny_tokenizer, proposer, FrozenStepCost(FLAT), max_adaptive_k=4, max_adaptive_nodes=12)
    results = engine.generate([GenerationRequest(p, 30, sampling, num_speculative_tokens=None) for p in PROMPTS])
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats.accepted_tokens for r in results) > 0


# -- what a faulty drafter may send ----------------------------------------------------


def hostile_tree(path: list[int], depth: int):
    """The true path hidden among nodes the engine must drop: ids outside the vocabulary,
    parents after their child or out of range, children of dropped nodes, a repeated
    sibling (its subtree would be lost), and nodes deeper than asked."""
    tokens, parents = branch_tree(path, depth)
    n = len(tokens)
    tokens += [VOCAB + 5, 3, 4, tokens[0], 9, 9, 9]
    parents += [-1, n, n + 5, -1, 99, -3, n - 1]  # n: the bad id's child; n + 5: a later node
    deep = list(range(len(tokens) - 1, len(tokens) - 1 + depth + 1))
    tokens += [path[0]] * (depth + 1)
    parents += deep  # a chain under the true path's last node, past the depth asked
    return tokens, parents


def test_a_hostile_tree_changes_no_token(tiny_model, tiny_tokenizer):
    proposer = TreeProposer(lambda prompt: truth(tiny_model, prompt), hostile_tree)
    engine = engine_for(tiny_model, tiny_tokenizer, proposer, FrozenStepCost(FLAT), max_adaptive_k=4, max_adaptive_nodes=64)
    results = engine.generate([GenerationRequest(p, 25, num_speculative_tokens=None) for p in PROMPTS])
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == truth(tiny_model, prompt)[:25]
        assert result.stats.accepted_tokens > 0


def test_parents_that_do_not_match_the_tokens_make_no_draft(tiny_model, tiny_tokenizer):
    proposer = TreeProposer(lambda prompt: truth(tiny_model, prompt), lambda path, depth: (path[:depth], [-1] * (depth + 1)))
    engine = engine_for(tiny_model, tiny_tokenizer, proposer, FrozenStepCost(FLAT))
    [result] = engine.generate([GenerationRequest(PROMPTS[1], 10, num_speculative_tokens=None)])
    assert result.token_ids == truth(tiny_model, PROMPTS[1])[:10]
    assert result.stats.draft_tokens == 0


def test_the_usable_tree_keeps_valid_nodes_and_their_order(tiny_model, tiny_tokenizer):
    engine = engine_for(tiny_model, tiny_tokenizer, None)
    draft = ProposedDraft([1, 2, 3, 2, 70, 5, 6], parents=[-1, -1, 0, -1, 1, 4, 2])
    # node 3 repeats node 1 (a sibling, token 2); node 4 is outside the vocabulary, so its child 5 goes too.
    usable = engine.proposers.usable(draft, k=8, max_nodes=16)
    assert usable.tokens == [1, 2, 3, 6] and usable.parents == [-1, -1, 0, 2]
    assert engine.proposers.usable(draft, k=1, max_nodes=16)[:2] == ([1, 2], [-1, -1])  # depth 1: the root's children
    assert engine.proposers.usable(draft, k=8, max_nodes=2)[:2] == ([1, 2], [-1, -1])
    assert engine.proposers.usable(ProposedDraft([1, 2], parents=[-1]), k=8, max_nodes=16).tokens == []  # parents do not match


# -- the target's predictions, for the drafter's successor table -----------------------


def test_each_propose_carries_the_targets_top_predictions_at_the_positions_scored(tiny_model, tiny_tokenizer):
    proposer = TreeProposer(lambda prompt: truth(tiny_model, prompt))
    engine = engine_for(tiny_model, tiny_tokenizer, proposer, FrozenStepCost(FLAT), max_adaptive_k=3, max_adaptive_nodes=9)
    engine.generate([GenerationRequest(p, 20, num_speculative_tokens=None) for p in PROMPTS[:2]])
    by_session: dict[str, list[DraftRequest]] = {}
    for request in proposer.requests:
        by_session.setdefault(request.session_id, []).append(request)
    checked = 0
    for requests in by_session.values():
        assert requests[0].predictions is None  # nothing scored yet
        for before, after in zip(requests, requests[1:]):
            predictions = after.predictions
            assert predictions is not None and predictions.k == 8
            positions = len(predictions.current)
            assert len(predictions.previous) == positions and len(predictions.tokens) == 8 * positions
            # Position 0 is the last token the previous step fed; the target's top prediction there is
            # the greedy next token, which the sequence now holds.
            assert (predictions.previous[0], predictions.current[0]) == (before.tokens[-2], before.tokens[-1])
            assert predictions.tokens[0] == after.tokens[len(before.tokens)]
            assert len(set(predictions.tokens[:8])) == 8  # k distinct tokens, best first
            checked += 1
    assert checked > 5


def test_no_predictions_are_kept_when_switched_off(tiny_model, tiny_tokenizer):
    proposer = TreeProposer(lambda prompt: truth(tiny_model, prompt))
    engine = engine_for(tiny_model, tiny_tokenizer, proposer, FrozenStepCost(FLAT), successor_top_k=0)
    engine.generate([GenerationRequest(PROMPTS[0], 10, num_speculative_tokens=None)])
    assert all(request.predictions is None for request in proposer.requests)


def test_more_predictions_than_the_drafter_keeps_is_refused_at_configuration():
    with pytest.raises(ValueError, match=r"successor_top_k must be at most 16 \(what the drafter keeps\), got 17"):
        EngineConfig(successor_top_k=17)


def test_kept_rows_give_each_decode_row_its_root_and_nodes_then_the_prefill_positions():
    from verifier_service.core.step import KeptRows, PrefillChunk, Row, SequenceState

    rows = [Row(None, [1, 2, 3], [], True, verify=3), Row(None, [], [], False), Row(None, [4, 5], [], True, verify=1)]
    scored = SequenceState(GenerationRequest([5, 6, 7, 8], 4, prompt_logprobs=0), "a", 0, 3, [5, 6, 7, 8])
    plain = SequenceState(GenerationRequest([5, 6, 7], 4), "b", 0, 4, [5, 6, 7])
    # A prompt asking for its log-probabilities keeps every position; another its last alone, once complete.
    chunks = [PrefillChunk(scored, 0, 3), PrefillChunk(plain, 0, 2), PrefillChunk(plain, 2, 1)]
    kept = KeptRows.of(rows, chunks)
    assert kept.bounds == (0, 4, 5, 7) and kept.decoded == 7
    assert [kept.span(index) for index in range(3)] == [slice(0, 4), slice(4, 5), slice(5, 7)]
    assert kept.path(0, [0, 2]) == [0, 1, 3] and kept.path(2, []) == [5] and kept.root(1) == 4
    assert [kept.chunk(index) for index in range(3)] == [slice(7, 10), slice(10, 10), slice(10, 11)]
