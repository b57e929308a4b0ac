"""Draft trees from the n-gram sources: shape, evidence, and the Propose field that asks for them."""

from __future__ import annotations

import random

import grpc
import pytest
from test_hostile_callers import aborted, running  # noqa: F401  (a fixture)
from test_servicer_overload import VOCABULARY, FakeContext

from drafter_service.ngram import (
    SOURCE_CONTEXT,
    SOURCE_GLOBAL,
    Evidence,
    InMemoryNGramTable,
    NGramConfig,
    alternatives,
    propose_chain,
    propose_tree,
)
from drafter_service.sessions import ContextIndex
from specdec.v1 import drafter_pb2 as pb


def sources(context, config, global_table=None):
    index = ContextIndex(config)
    index.extend(context)
    table = global_table if global_table is not None else InMemoryNGramTable(config.n_min, config.n_max)
    return index, ((SOURCE_CONTEXT, index), (SOURCE_GLOBAL, table))


def test_propose_tree_docstring_example():
    config = NGramConfig(n_min=2, n_max=3)
    index, found = sources([1, 2, 3, 9, 1, 2, 4, 7, 9, 1, 2], config)
    draft = propose_tree(index.tokens, found, k=2, max_nodes=8, config=config)
    assert (draft.tokens, draft.parents) == ([4, 7, 3, 9], [-1, 0, -1, 2])
    assert draft.evidence[2] == Evidence(SOURCE_CONTEXT, 2, 1, 2)  # (1, 2): once 3, once 4


def test_the_global_table_offers_its_top_continuations_as_branches():
    config = NGramConfig(n_min=2, n_max=2)
    table = InMemoryNGramTable(2, 2)
    for following, times in ((5, 3), (6, 2), (8, 1)):
        for _ in range(times):
            table.observe([1, 2, following])
    assert alternatives([1, 2], ((SOURCE_GLOBAL, table),), config, exclude=5, limit=4) == [
        (6, Evidence(SOURCE_GLOBAL, 2, 2, 6)),
        (8, Evidence(SOURCE_GLOBAL, 2, 1, 6)),
    ]
    index, found = sources([7, 1, 2], config, table)
    draft = propose_tree(index.tokens, found, k=1, max_nodes=8, config=config)
    assert (draft.tokens, draft.parents) == ([5, 6, 8], [-1, -1, -1])  # the chain's 5, then the others by count


def random_context(rng: random.Random, length: int) -> list[int]:
    """Text-like ids: phrases from a small stock, so n-grams repeat with varied continuations."""
    phrases = [[rng.randrange(30) for _ in range(rng.randrange(2, 6))] for _ in range(8)]
    tokens: list[int] = []
    while len(tokens) < length:
        tokens += rng.choice(phrases)
    return tokens[:length]


@pytest.mark.parametrize("seed", range(20))
def test_trees_start_with_the_chain_and_keep_their_shape(seed):
    rng = random.Random(seed)
    config = NGramConfig()
    table = InMemoryNGramTable(config.n_min, config.n_max)
    for _ in range(3):
        table.observe(random_context(rng, 80))
    index, found = sources(random_context(rng, 120), config, table)
    k, max_nodes = rng.randrange(1, 9), rng.randrange(1, 40)
    chain = propose_chain(index.tokens, found, k, config)
    tree = propose_tree(index.tokens, found, k, max_nodes, config)
    assert len(tree.tokens) == len(tree.evidence) == len(tree.parents) <= max_nodes
    assert tree.tokens[: len(chain.tokens)] == chain.tokens[:max_nodes]  # the first nodes are the chain
    depths, children = [], set()
    for node, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
        assert -1 <= parent < node
        depths.append(depths[parent] + 1 if parent >= 0 else 1)
        assert depths[-1] <= k
        assert (parent, token) not in children, "siblings carry distinct tokens"
        children.add((parent, token))
        # Every node is what its source saw after the suffix it names.
        path = []
        walk = node
        while walk >= 0:
            path.insert(0, tree.tokens[walk])
            walk = tree.parents[walk]
        evidence = tree.evidence[node]
        key = tuple((list(index.tokens) + path[:-1])[-evidence.match_length :])
        source = index if evidence.source == SOURCE_CONTEXT else table
        seen = source.continuations(key) if evidence.source == SOURCE_GLOBAL else {source.best(key)[0]: 1}
        assert token in seen, (node, key)


# -- through the servicer ------------------------------------------------------------------


def tree_request(session_id, tokens, k, nodes, open_=True):
    update = pb.SequenceUpdate(session_id=session_id, new_tokens=tokens, open=open_, num_draft_tokens=k, max_tree_nodes=nodes)
    return pb.ProposeRequest(vocabulary=VOCABULARY, sequences=[update])


def test_propose_answers_a_tree_with_its_parents_and_a_chain_without(running):  # noqa: F811
    servicer, _ = running
    context = [1, 2, 3, 9, 1, 2, 4, 7, 9, 1, 2]
    chain = servicer.Propose(tree_request("chain", context, 2, 0), FakeContext()).drafts[0]
    assert list(chain.tokens) == [4, 7] and list(chain.parents) == []  # what a verifier before trees gets
    tree = servicer.Propose(tree_request("tree", context, 2, 8), FakeContext()).drafts[0]
    assert list(tree.tokens) == [4, 7, 3, 9] and list(tree.parents) == [-1, 0, -1, 2]
    assert list(tree.match_lengths) == [3, 4, 2, 3] and list(tree.sources) == [pb.DRAFT_SOURCE_CONTEXT] * 4


def test_propose_refuses_more_tree_nodes_than_the_limit(running):  # noqa: F811
    servicer, _ = running
    limit = servicer.config.max_tree_nodes
    context = aborted(servicer.Propose, tree_request("s", [1, 2, 3], 4, limit + 1), FakeContext())
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT
    assert context.details == f"sequences[0]: max_tree_nodes {limit + 1} is out of range [0, {limit}] (--max-tree-nodes)"
