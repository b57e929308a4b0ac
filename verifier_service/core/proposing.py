"""The step's proposers as peers, and their drafts merged into one per sequence.

``Proposers`` asks each proposer in turn for the whole batch (``DraftProposer.propose``):
the drafter first, then the proposers beside it (a draft head), each seeing what those
before it drafted (``DraftRequest.drafted``). Every draft is cleaned (``usable``) and
merged into the sequence's tree (``merge``): a node that repeats a node already there
(same parent, same token) joins it, any other is added. A request for a chain (no
``max_nodes``) keeps the first non-empty draft whole: a chain cannot branch.

Drafts are an optimisation: a proposer that raises or answers out of turn costs its
drafts for that step, never the step.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from verifier_service.core.drafting import DraftProposer, DraftRequest, FinishedSequence, MergedDraft, ProposedDraft

log = logging.getLogger(__name__)


class Proposers:
    """Every proposer of an engine: the drafter (None: none), asked first, then those
    ``beside`` it, in order. The drafter can be swapped (a benchmark runs a fresh one)."""

    def __init__(self, drafter: DraftProposer | None, beside: Sequence[DraftProposer], vocab_size: int) -> None:
        self.drafter = drafter
        self.beside = list(beside)
        self.vocab_size = vocab_size

    @property
    def proposers(self) -> list[DraftProposer]:
        """In the order they are asked."""
        return [self.drafter, *self.beside] if self.drafter is not None else list(self.beside)

    def __bool__(self) -> bool:
        return self.drafter is not None or bool(self.beside)

    @property
    def wants_features(self) -> bool:
        """Some proposer drafts from the target's features (``DraftRequest.feature``)."""
        return any(getattr(proposer, "wants_features", False) for proposer in self.proposers)

    def propose(self, requests: list[DraftRequest]) -> list[MergedDraft]:
        """Each request's draft from every proposer, merged."""
        merged = [MergedDraft([], [], [], 0) for _ in requests]
        for turn, proposer in enumerate(self.proposers):
            asked = requests if turn == 0 else [dataclasses.replace(request, drafted=draft) for request, draft in zip(requests, merged)]
            try:
                drafts = proposer.propose(asked)
                if len(drafts) != len(requests):
                    raise ValueError(f"{len(drafts)} drafts for {len(requests)} requests")
            except Exception:  # drafts are an optimisation: the step goes on without these
                log.exception("the proposer %s failed; this step verifies no drafts from it", type(proposer).__name__)
                continue
            for index, (request, draft) in enumerate(zip(requests, drafts)):
                merged[index] = merge(
                    merged[index], self.usable(draft, request.k, request.max_nodes), tree=bool(request.max_nodes), first=turn == 0
                )
        return merged

    def close(self, finished: list[FinishedSequence]) -> None:
        """Tell every proposer these sequences ended. Their failures are logged, never raised."""
        for proposer in self.proposers:
            try:
                proposer.close(finished)
            except Exception:
                log.exception("closing %d sessions with %s failed", len(finished), type(proposer).__name__)

    def usable(self, draft: ProposedDraft, k: int, max_nodes: int) -> MergedDraft:
        """The draft's nodes the engine can verify, their parents among them, and their evidence.

        A faulty or foreign proposer may slow a step down but must never crash
        the model or change the output: a node is dropped, with its subtree,
        when its id is outside the vocabulary, its parent is not an earlier
        kept node, it lies deeper than ``k``, or a sibling carries the same
        token; at most ``max_nodes`` nodes are kept (``k`` for a chain).
        Parents that do not match the tokens in number make the draft unusable.
        """
        parents_given = draft.parents
        if parents_given and len(parents_given) != len(draft.tokens):
            return MergedDraft([], [], [], 0)
        limit = max_nodes or k
        kept: dict[int, int] = {}  # the draft's node -> its index among the kept
        nodes: list[int] = []
        parents: list[int] = []
        depths: list[int] = []
        siblings: set[tuple[int, int]] = set()  # (kept parent, token)
        for node, token in enumerate(draft.tokens):
            if len(nodes) >= limit:
                break
            parent = parents_given[node] if parents_given else node - 1
            if not 0 <= token < self.vocab_size or not -1 <= parent < node or (parent >= 0 and parent not in kept):
                continue
            new_parent = kept[parent] if parent >= 0 else -1
            depth = depths[new_parent] + 1 if new_parent >= 0 else 1
            if depth > k or (new_parent, token) in siblings:
                continue
            siblings.add((new_parent, token))
            kept[node] = len(nodes)
            nodes.append(node)
            parents.append(new_parent)
            depths.append(depth)
        evidence = [draft.evidence[node] if node < len(draft.evidence) else None for node in nodes]
        return MergedDraft([draft.tokens[node] for node in nodes], parents, evidence, leading_chain(parents))


def merge(base: MergedDraft, extra: MergedDraft, tree: bool, first: bool = False) -> MergedDraft:
    """``extra``'s nodes merged into ``base``: a node whose parent and token match a node
    already there joins it, any other is added (its evidence with it). A chain keeps
    ``base`` when it has any nodes. ``first``: ``extra`` is the first proposer's, whose
    leading chain the feedback is about.

    base [5, 6] (a chain), extra [5, 9] as a chain, tree -> [5, 6, 9] with parents
    [-1, 0, 0]: extra's 5 joins base's, its 9 becomes 5's second child.
    """
    if not extra.tokens or (base.tokens and not tree):
        return base
    tokens, parents, evidence = list(base.tokens), list(base.parents), list(base.evidence)
    placed: list[int] = []  # extra's node -> its node in the merged draft
    for token, parent, item in zip(extra.tokens, extra.parents, extra.evidence):
        at = placed[parent] if parent >= 0 else -1
        node = next((node for node, (up, held) in enumerate(zip(parents, tokens)) if up == at and held == token), None)
        if node is None:
            node = len(tokens)
            tokens.append(token)
            parents.append(at)
            evidence.append(item)
        placed.append(node)
    return MergedDraft(tokens, parents, evidence, extra.chain if first else base.chain)


def leading_chain(parents: Sequence[int]) -> int:
    """Nodes before the first whose parent is not the node before it."""
    return next((node for node, parent in enumerate(parents) if parent != node - 1), len(parents))
