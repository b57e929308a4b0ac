"""The trained draft head as a proposer beside the drafter (``head.model`` is its model).

The engine asks the drafter first; ``HeadProposer.draft`` then drafts, batched, for the
rows whose drafter draft is weak, from the target's feature each ``DraftRequest``
carries (the output layer's input at the sequence's last token, from the step before),
and merges its chains into those rows' drafts (``add_head_draft``). What its levels cost
and what its drafts brought (``HeadRecord``) decide, with the planner's prices, whether
a level runs at all: the planner prices every other source the same way.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from verifier_service.core.drafting import DraftEvidence, DraftRequest
from verifier_service.core.planner import HEAD_PROBABILITY_BUCKETS, SOURCE_HEAD, Planner, evidence_bucket
from verifier_service.head.model import HeadDrafter

log = logging.getLogger(__name__)

# A head token's evidence: its probability as a count out of this many (the planner's bands read it).
HEAD_EVIDENCE_TOTAL = 1000


class HeadProposer:
    """The draft head's drafts for a step, merged into the rows the engine proposes
    (each row's ``draft``, ``parents`` and ``evidence``, its ``sequence`` and whether it is
    ``adaptive``)."""

    def __init__(self, head: HeadDrafter, depth: int, planner: Planner, vocab_size: int) -> None:
        self.head = head
        self.depth = depth  # tokens deep a chain goes at most (--draft-head-depth; 0: none)
        self.planner = planner
        self.vocab_size = vocab_size
        self.record = HeadRecord()

    def settle(self, rows: Sequence[Any], decisions: Sequence[tuple[list[int], int] | None]) -> None:
        """Record what the head's tokens brought in the step it drafted for (``HeadRecord.settle``)."""
        if self.record.pending is not None:
            self.record.settle(*head_tokens(rows, decisions))

    def draft(self, rows: Sequence[Any], asking: Sequence[Any], requests: Sequence[DraftRequest], context: int) -> None:
        """The draft head's chains, merged into the drafts of the rows that need them.

        The head drafts, batched, only for the rows whose drafter draft is weak: a
        chain request's when it is empty, a tree's when none of its first tokens is
        expected to be accepted as often as the head's first tokens are (the planner's
        measure of each). Each level, a row keeps the head's guess only while its
        survival (the planner's hazard of each guess's probability band, multiplied
        down the chain) could still pay for verifying it (``Planner.floor``: little
        at one row, much at 16, where every verified token costs); the rows that stop
        leave the batch, and the next level runs only while the survival it can add
        is worth the measured time of a level. Fixed-K rows take the head's chain to
        their K, as they verify every draft token.
        """
        if not self.depth:
            return
        self.record.pending = None
        chosen = []
        for row, request in zip(asking, requests):
            sequence = row.sequence
            feature = request.feature
            depth, tree = min(request.k, self.depth), bool(request.max_nodes)
            if feature is None or depth <= 0 or (row.draft and not tree):
                continue
            if row.draft and self._drafter_hazard(row) >= self.planner.source_hazard(SOURCE_HEAD, sequence.calibration):
                continue
            chosen.append((row, feature, depth, tree))
        if not chosen:
            return
        planner, record = self.planner, self.record
        floor, realism = planner.floor(len(rows), context), planner.realism(SOURCE_HEAD)
        rate = len(rows) / planner.cost.cheapest(len(rows), context)  # tokens a second without drafts
        surplus = sum(
            record.first_surplus(lambda band: planner.hazard((SOURCE_HEAD, band, 0, 0), row.sequence.calibration) * realism - floor)
            if row.adaptive
            else 1.0
            for row, _, _, _ in chosen
        )
        if surplus < rate * record.level_seconds(len(chosen)):
            return  # its first guesses would not pay for the level that makes them
        if all(row.adaptive for row, _, _, _ in chosen) and not record.pays(len(rows)):
            return  # at this many rows its drafts have not paid for what they cost
        spent = 0.0
        chains: list[tuple[list[int], list[float]]] = [([], []) for _ in chosen]  # tokens, probabilities
        second_guesses = [(-1, 0.0)] * len(chosen)  # the root's second guess, when it may pay
        survival = [1.0] * len(chosen)
        alive = list(range(len(chosen)))
        features = torch.stack([feature for _, feature, _, _ in chosen])
        tokens = torch.tensor([row.sequence.tokens[-1] for row, _, _, _ in chosen], device=features.device)
        for level in range(max(depth for _, _, depth, _ in chosen)):
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
            for batch_row, index in enumerate(alive):
                row, _, depth, tree = chosen[index]
                calibration = row.sequence.calibration
                if level == 0 and tree and row.adaptive:
                    bucket = evidence_bucket(head_evidence(odds[batch_row][1]), 0, branch=True)
                    if planner.hazard(bucket, calibration) * realism >= floor:
                        second_guesses[index] = (ids[batch_row][1], odds[batch_row][1])
                survival[index] *= planner.hazard(evidence_bucket(head_evidence(odds[batch_row][0]), level), calibration)
                if row.adaptive and survival[index] * realism < floor:
                    continue  # this guess would not be verified; deeper ones even less
                chains[index][0].append(ids[batch_row][0])
                chains[index][1].append(odds[batch_row][0])
                if level + 1 < depth:
                    going.append(batch_row)
                    gain += survival[index] * realism - floor if row.adaptive else 1.0
            if not going or gain < rate * record.level_seconds(len(going)):
                break
            keep = torch.tensor(going, device=features.device)
            features, tokens = features[keep], guesses[keep, 0]
            alive = [alive[batch_row] for batch_row in going]
        for (row, _, _, tree), chain, second in zip(chosen, chains, second_guesses):
            add_head_draft(row, (*chain, *second), len(chain[0]), tree, self.vocab_size)
        record.pending = (len(rows), rate * spent, floor)

    def _drafter_hazard(self, row: Any) -> float:
        """The best planning hazard among the first tokens of the drafter's draft (0: none)."""
        best, seen_first = 0.0, False
        for parent, evidence in zip(row.parents, row.evidence):
            if parent < 0:
                bucket = evidence_bucket(evidence, 0, branch=seen_first)
                best, seen_first = max(best, self.planner.hazard(bucket, row.sequence.calibration)), True
        return best


def add_head_draft(row: Any, head_draft: tuple[list[int], list[float], int, float], depth: int, tree: bool, vocab_size: int) -> None:
    """Merge the head's chain (and its second guess for the first token, on a tree) into the
    row's draft: where a node already holds the head's token the head's chain follows it,
    elsewhere it adds nodes. A chain request takes the head's chain only when the drafter
    offered nothing (a chain cannot branch)."""
    tokens, probabilities, second, second_probability = head_draft
    if not tree and row.draft:
        return

    parent = -1
    for token, probability in zip(tokens[:depth], probabilities):
        child = next((node for node, (up, held) in enumerate(zip(row.parents, row.draft)) if up == parent and held == token), None)
        if child is None:
            child = len(row.draft)
            row.draft.append(token)
            row.parents.append(parent)
            row.evidence.append(head_evidence(probability))
        parent = child
    if tree and depth and 0 <= second < vocab_size and not any(up == -1 and held == second for up, held in zip(row.parents, row.draft)):
        row.draft.append(second)
        row.parents.append(-1)
        row.evidence.append(head_evidence(second_probability))


class HeadRecord:
    """What the draft head's levels cost and what its first guesses look like, faded:
    ``HeadProposer.draft`` runs a level only where the guesses it can expect would pay for it.

    A level's time depends on how many rows it drafts for (at 16 rows on a CPU about
    three times one row's), so it is kept per row count; a count never timed costs
    nothing, so it gets timed. The first guesses' probabilities are kept as shares
    of the head's probability bands, the planner's buckets for its tokens.

    Those predict; the record of what the head's drafts actually brought checks the
    prediction (``pays``, ``settle``): per step width, the head's tokens accepted less
    what verifying them and drafting them cost, in tokens. Where that comes out a loss
    (16 rows of open text on a CPU, where a guess must be right half the time to pay
    for its place and few are), the head stops there but for a probe now and then.
    """

    RETENTION = 0.8  # a level's time: each new one weighs 0.2
    GUESS_RETENTION = 0.98  # the bands' shares: per level-0 run (~50 runs of memory)
    NET_RETENTION = 0.95  # what the head's drafts brought, per step they ran (~20 steps of memory)
    NET_TRUSTED = 4.0  # faded steps before a loss can stop the head
    PROBE_EVERY = 16  # steps a stopped head skips before it drafts once more, to measure again

    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}
        self._bands = [0.0] * HEAD_PROBABILITY_BUCKETS
        # Per step width (rows.bit_length()): faded [net tokens, their squares, steps] of the
        # steps the head drafted in, and steps skipped since it last drafted there.
        self._net: dict[int, list[float]] = {}
        self._skipped: dict[int, int] = {}
        self.pending: tuple[int, float, float] | None = None  # this step's (rows, cost in tokens, floor)

    def pays(self, rows: int) -> bool:
        """Whether the head drafts in a step of ``rows`` decoding rows: yes until its steps
        at about this width have been measured, then unless what they brought is a clear
        loss (its mean more than a standard error below zero: one step's outcome varies
        by a token or more, and a few unlucky ones must not stop a head that pays), and
        once every PROBE_EVERY steps even so, to measure again."""
        width = rows.bit_length()
        total, squares, steps = self._net.get(width, (0.0, 0.0, 0.0))
        mean = total / steps if steps else 0.0
        error = math.sqrt(max(squares / steps - mean * mean, 0.0) / steps) if steps else 0.0
        if steps < self.NET_TRUSTED or mean + error >= 0 or self._skipped.get(width, 0) + 1 >= self.PROBE_EVERY:
            self._skipped[width] = 0
            return True
        self._skipped[width] = self._skipped.get(width, 0) + 1
        return False

    def settle(self, verified: int, accepted: int) -> None:
        """The outcome of the step the head drafted in (``pending``): its tokens ``verified``
        and ``accepted``. What they brought: the tokens accepted, less what verifying each
        cost (the step's floor, in tokens) and what the levels cost (their time at the
        step's rate)."""
        if self.pending is None:
            return
        rows, cost, floor = self.pending
        self.pending = None
        net = accepted - floor * verified - cost
        record = self._net.setdefault(rows.bit_length(), [0.0, 0.0, 0.0])
        record[0] = record[0] * self.NET_RETENTION + net
        record[1] = record[1] * self.NET_RETENTION + net * net
        record[2] = record[2] * self.NET_RETENTION + 1.0

    def level_seconds(self, rows: int) -> float:
        return self._seconds.get(rows, 0.0)

    def timed(self, rows: int, seconds: float) -> None:
        known = self._seconds.get(rows)
        self._seconds[rows] = seconds if known is None else self.RETENTION * known + (1 - self.RETENTION) * seconds

    def guessed(self, probabilities: list[float]) -> None:
        """The head's first guesses (their probabilities) for one level-0 run."""
        self._bands = [count * self.GUESS_RETENTION for count in self._bands]
        for probability in probabilities:
            self._bands[evidence_bucket(head_evidence(probability), 0)[1]] += 1

    def first_surplus(self, value: Callable[[int], float]) -> float:
        """What a row's first guess is expected to add, where ``value(band)`` is what a guess
        in that band yields beyond its cost (at most 0 counts 0: it would not be verified).
        Before any guess is seen, 1 (the head is tried)."""
        total = sum(self._bands)
        if not total:
            return 1.0
        return sum(count * max(0.0, value(band)) for band, count in enumerate(self._bands) if count) / total


def head_tokens(rows: Sequence[Any], decisions: Sequence[tuple[list[int], int] | None]) -> tuple[int, int]:
    """(verified, accepted): the draft head's tokens a step verified, and those it accepted."""
    verified = accepted = 0
    for row, decision in zip(rows, decisions):
        nodes = [node for node in range(row.verify) if (item := row.evidence[node]) is not None and item.source == SOURCE_HEAD]
        verified += len(nodes)
        if decision is not None:
            accepted += len(set(nodes).intersection(decision[0]))
    return verified, accepted


def head_evidence(probability: float) -> DraftEvidence:
    """A draft head token's evidence: its probability under the head, as a count out of HEAD_EVIDENCE_TOTAL."""
    return DraftEvidence(SOURCE_HEAD, 0, round(probability * HEAD_EVIDENCE_TOTAL), HEAD_EVIDENCE_TOTAL)
