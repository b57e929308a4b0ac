"""The trained draft head as a proposer beside the drafter (``head.model`` is its model).

The engine's proposers are peers (``core.proposing``): the drafter is asked first, then
``HeadProposer``, which drafts, batched, for the requests whose drafter draft is weak,
from the target's feature each ``DraftRequest`` carries (the output layer's input at the
sequence's last token, from the step before). Its chains are merged into those drafts.
What its levels cost and what its drafts brought (``planner.HeadRecord``), with the
planner's prices, decide whether a level runs at all: the planner prices every other
source the same way.
"""

from __future__ import annotations

import logging
import time
from typing import cast

import torch

from verifier_service.core.drafting import DraftEvidence, DraftRequest, FinishedSequence, MergedDraft, ProposedDraft
from verifier_service.core.planner import HEAD_EVIDENCE_TOTAL, SOURCE_HEAD, Planner, SequenceCalibration, evidence_bucket, head_bucket
from verifier_service.head.model import HeadDrafter

log = logging.getLogger(__name__)

# Levels the head drafts at most (--draft-head-depth): each is one small batched matmul chain.
DEFAULT_HEAD_DEPTH = 4


class HeadProposer:
    """The draft head's drafts for a step, as a ``DraftProposer``."""

    def __init__(self, head: HeadDrafter, depth: int) -> None:
        self.head = head
        self.depth = depth  # tokens deep a chain goes at most (--draft-head-depth; 0: none)
        self.wants_features = depth > 0

    def close(self, finished: list[FinishedSequence]) -> None:
        """Nothing: the head keeps no sessions."""

    def propose(self, requests: list[DraftRequest]) -> list[ProposedDraft]:
        """The draft head's chains, for the requests that need them.

        The head drafts, batched, only for the requests whose drafter draft is weak: a
        chain request's when it is empty, a tree's when none of its first tokens is
        expected to be accepted as often as the head's first tokens are (the planner's
        measure of each). Each level, a request keeps the head's guess only while its
        survival (the planner's hazard of each guess's probability band, multiplied
        down the chain) could still pay for verifying it (``Planner.floor``: little
        at one row, much at 16, where every verified token costs); the requests that
        stop leave the batch, and the next level runs only while the survival it can
        add is worth the measured time of a level. Fixed-K requests take the head's
        chain to their K, as they verify every draft token. A tree's request also gets
        the head's second guess for its first token, when that may pay.
        """
        drafts = [ProposedDraft([]) for _ in requests]
        step = requests[0].step if requests else None
        if not self.depth or step is None:
            return drafts
        planner = step.planner
        record = planner.head
        record.pending = None
        chosen = []  # (index, request, depth, tree, calibration)
        for index, request in enumerate(requests):
            depth, tree = min(request.k, self.depth), bool(request.max_nodes)
            drafted = request.drafted or MergedDraft([], [], [], 0)
            calibration = request.calibration or SequenceCalibration()
            if request.feature is None or depth <= 0 or (drafted.tokens and not tree):
                continue
            if drafted.tokens and drafter_hazard(drafted, planner, calibration) >= planner.source_hazard(SOURCE_HEAD, calibration):
                continue
            chosen.append((index, request, depth, tree, calibration))
        if not chosen:
            return drafts
        floor, realism = planner.floor(step.rows, step.context), planner.realism(SOURCE_HEAD)
        rate = step.rows / planner.cost.cheapest(step.rows, step.context)  # tokens a second without drafts
        surplus = sum(
            record.first_surplus(lambda band: planner.hazard(head_bucket(band, 0), calibration) * realism - floor)
            if request.adaptive
            else 1.0
            for _, request, _, _, calibration in chosen
        )
        if surplus < rate * record.level_seconds(len(chosen)):
            return drafts  # its first guesses would not pay for the level that makes them
        if all(request.adaptive for _, request, _, _, _ in chosen) and not record.pays(step.rows):
            return drafts  # at this many rows its drafts have not paid for what they cost
        spent = 0.0
        chains: list[tuple[list[int], list[float]]] = [([], []) for _ in chosen]  # tokens, probabilities
        second_guesses = [(-1, 0.0)] * len(chosen)  # the root's second guess, when it may pay
        survival = [1.0] * len(chosen)
        alive = list(range(len(chosen)))
        features = torch.stack([cast(torch.Tensor, request.feature) for _, request, _, _, _ in chosen])  # chosen: all have one
        tokens = torch.tensor([request.tokens[-1] for _, request, _, _, _ in chosen], device=features.device)
        for level in range(max(depth for _, _, depth, _, _ in chosen)):
            started = time.perf_counter()
            try:
                features, guesses, probabilities = self.head.level(features, tokens)
                ids, odds = guesses.tolist(), probabilities.tolist()
            except Exception:  # drafts are an optimisation: the step goes on with what it has
                log.exception("the draft head failed; this step goes on without its drafts")
                break
            seconds = time.perf_counter() - started
            record.timed(len(alive), seconds)
            spent += seconds
            if level == 0:
                record.guessed([pair[0] for pair in odds])
            going, gain = [], 0.0
            for batch_row, which in enumerate(alive):
                _, request, depth, tree, calibration = chosen[which]
                if level == 0 and tree and request.adaptive:
                    bucket = evidence_bucket(head_evidence(odds[batch_row][1]), 0, branch=True)
                    if planner.hazard(bucket, calibration) * realism >= floor:
                        second_guesses[which] = (ids[batch_row][1], odds[batch_row][1])
                survival[which] *= planner.hazard(evidence_bucket(head_evidence(odds[batch_row][0]), level), calibration)
                if request.adaptive and survival[which] * realism < floor:
                    continue  # this guess would not be verified; deeper ones even less
                chains[which][0].append(ids[batch_row][0])
                chains[which][1].append(odds[batch_row][0])
                if level + 1 < depth:
                    going.append(batch_row)
                    gain += survival[which] * realism - floor if request.adaptive else 1.0
            if not going or gain < rate * record.level_seconds(len(going)):
                break
            keep = torch.tensor(going, device=features.device)
            features, tokens = features[keep], guesses[keep, 0]
            alive = [alive[batch_row] for batch_row in going]
        for (index, _, _, tree, _), (chain, odds_of_chain), second in zip(chosen, chains, second_guesses):
            drafts[index] = head_draft(chain, odds_of_chain, second if tree else (-1, 0.0))
        record.pending = (step.rows, rate * spent, floor)
        return drafts


def head_draft(tokens: list[int], probabilities: list[float], second: tuple[int, float]) -> ProposedDraft:
    """The head's chain, and its second guess for the first token (a branch at the root; -1:
    none), as a draft: [10, 12] with second guess 30 -> tokens [10, 12, 30], parents [-1, 0, -1]."""
    evidence = [head_evidence(probability) for probability in probabilities]
    parents = [index - 1 for index in range(len(tokens))]
    token, probability = second
    if tokens and token >= 0:
        return ProposedDraft([*tokens, token], [*evidence, head_evidence(probability)], [*parents, -1])
    return ProposedDraft(list(tokens), evidence, parents)


def drafter_hazard(drafted: MergedDraft, planner: Planner, calibration: SequenceCalibration) -> float:
    """The best planning hazard among the first tokens of the draft so far (0: none)."""
    best, seen_first = 0.0, False
    for parent, evidence in zip(drafted.parents, drafted.evidence):
        if parent < 0:
            bucket = evidence_bucket(evidence, 0, branch=seen_first)
            best, seen_first = max(best, planner.hazard(bucket, calibration)), True
    return best


def head_evidence(probability: float) -> DraftEvidence:
    """A draft head token's evidence: its probability under the head, as a count out of HEAD_EVIDENCE_TOTAL."""
    return DraftEvidence(SOURCE_HEAD, 0, round(probability * HEAD_EVIDENCE_TOTAL), HEAD_EVIDENCE_TOTAL)
