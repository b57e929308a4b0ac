"""Adaptive K: which draft tokens each step verifies, from their odds and the step's cost.

A packed verify step (``kv_cache``) costs what its tokens cost, whichever
rows they belong to: ``StepCostModel`` maps the tokens of a forward pass
(plus the cached tokens attention reads) to seconds. So each (row, position)
draft token is a separate choice, and rows verify different numbers of
drafts in the same step.

Draft token j of a row is kept when it and every draft before it are
accepted. With *hazard* h_i = P(draft i accepted | drafts before it were),
its *survival* is s_j = h_1 h_2 ... h_j, and a step that verifies the
drafts ``chosen`` yields in expectation

    rows + sum of s over chosen          tokens

(every row yields its recovered or bonus token; Leviathan et al. 2023,
sec. 3.1, with a per-token rather than a constant acceptance rate).
``plan_verification`` ranks every candidate by survival, and keeps the
prefix of that ranking with the most expected tokens per second; since s
falls along a row, the kept set is a prefix of each row's draft (vLLM's and
SpecDec++'s adaptive verification do the same ranking under a budget).

Hazards come from evidence that needs no verification: the drafter tells
where each token came from (the request's own context or the global
table), how long a suffix matched, and whether the continuation always
followed that suffix. ``AcceptanceModel`` keeps acceptance counts per bucket
of that evidence and the token's position in its draft, learned from every
verified token and shared by all sequences; ``SequenceCalibration`` scales
them by how the sequence's own recent drafts fared against them (a quote
being copied out, or free text). Measured on the benchmark prompts, context
tokens whose continuation was unanimous and seen twice were accepted 99% of
the time, contested ones 30-60%, global-table ones 35-50%: the evidence
separates good drafts from bad before the target sees them.

Three things keep the estimates from getting stuck, which is what happens
to an estimate learned only from what it chose to verify. Planning is
optimistic about buckets with little evidence (an upper confidence bound),
so they are tried; evidence fades, so a bucket or a sequence judged
hopeless drifts back and is tried again; and a draft verified in full is
censored, not a verdict on later positions, which keep their own
(position-bucketed) estimates.

This module imports neither torch nor grpc.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Unverified buckets start at even odds, worth two observations: one
# accepted or rejected token moves the estimate by a third.
PRIOR_HAZARD = 0.5
PRIOR_WEIGHT = 2.0
# Each new observation in a bucket keeps this weight for the earlier ones:
# ~200 observations of memory, a few seconds of a busy batch...
BUCKET_RETENTION = 0.995
# ...and every step all buckets keep this weight, so one judged hopeless
# (and so never verified again) drifts back to the prior in ~1000 steps.
STEP_RETENTION = 0.999
# Planning adds this many standard errors to the top-level estimate (an
# upper confidence bound) while it has fewer than EXPLORE_BELOW
# observations: with next to no evidence, drafts look better than the prior,
# so they get verified and learned even where the prior alone would not pay
# (even odds never pay for widening a CPU step of 16 rows at 8 ms a token).
# Past that the estimates alone decide: optimism about every rarely seen
# bucket cost 3% of open-ended throughput at 16 sequences, verifying drafts
# that were as bad as their estimates said.
EXPLORATION = 1.0
EXPLORE_BELOW = 4.0
# Each verified draft of a sequence keeps this weight for the sequence's
# earlier ones: it follows the text as it changes (a quote ends, free text
# starts) within ~10 verified drafts...
SEQUENCE_RETENTION = 0.9
# ...and every step its evidence keeps this weight, so a sequence whose
# drafts were judged hopeless (and so are no longer verified) is tried again
# after tens of steps, and the longer its record of failures, the later: a
# bounded back-off. Fading per step alone (at 0.9) retried a failing
# sequence every 5-10 steps, and on open-ended text at one client those
# rejected verifications cost more than the drafts ever saved.
SEQUENCE_STEP_RETENTION = 0.99
# Pseudo-observations pulling a sequence's factor towards 1 (trust the buckets).
CALIBRATION_WEIGHT = 2.0
# A sequence that had drafts but verified none for this many steps verifies
# one anyway (a probe). Estimates learned only from what they chose to verify
# can get stuck: after a run of free text every bucket says drafts never pay,
# and when a quote starts, nothing would verify one and learn otherwise (seen
# in the service: a grounded request after open-ended ones verified no draft in
# 176 steps). A failed probe doubles the wait, up to PROBE_MAX_AFTER; an
# accepted token resets it, so a hopeless sequence pays for ~log2(steps / 8)
# probes, and a good one is found within 8 steps.
PROBE_AFTER = 8
PROBE_MAX_AFTER = 256
# No draft token is ever certain: an estimate of 1 would verify any length.
MAX_HAZARD = 0.99
# Positions past this share a bucket: acceptance barely changes beyond it.
POSITION_BUCKETS = 4
MATCH_LENGTH_BUCKETS = 4

SOURCE_CONTEXT = "context"  # the request's own prompt and output (the drafter's names for its sources)
SOURCE_GLOBAL = "global"  # the table learned across requests


def evidence_bucket(evidence, position: int, branch: bool = False) -> tuple:
    """The bucket of one draft token: (source, match length, confidence, position),
    and a trailing 1 for a tree node that is not its parent's first child (a
    branch: the drafter's second guess there, accepted less often).

    Confidence: 0 when other continuations also followed the suffix, 1 when
    this one alone followed it once, 2 when it alone followed it twice or more.
    Position is the token's depth in its draft (a chain's index).
    A context token matched on 4 tokens, seen 3 times out of 3, at position 0:
    ("context", 4, 2, 0). Drafts without evidence share one bucket per position.
    """
    if branch:
        return (*evidence_bucket(evidence, position), 1)
    if evidence is None:
        return ("", 0, 0, min(position, POSITION_BUCKETS - 1))
    if evidence.count < evidence.total:
        confidence = 0
    else:
        confidence = 1 if evidence.count == 1 else 2
    return (
        evidence.source,
        min(evidence.match_length, MATCH_LENGTH_BUCKETS),
        confidence,
        min(position, POSITION_BUCKETS - 1),
    )


class AcceptanceModel:
    """Hazard per evidence bucket: Beta posteriors over faded counts, shrunk towards
    coarser buckets (a hierarchical prior, as in empirical-Bayes smoothing).

    Three levels: all draft tokens; (source, position); the full bucket. Each
    level's estimate is the prior of the level below, worth PRIOR_WEIGHT
    observations, so a bucket never seen starts where its source at its
    position stands, not at even odds: on open-ended text, where most drafts
    fail, a new kind of draft is not verified on hope alone. The top level's
    prior is PRIOR_HAZARD, plus an exploration bonus while it has little evidence.
    """

    ROOT = ()

    def __init__(self) -> None:
        self._counts: dict[tuple, list[float]] = {}  # level key -> [accepted, reached]

    def hazard(self, bucket: tuple, optimism: float = 0.0) -> float:
        """Estimate for ``bucket``; with ``optimism``, the top level's standard error is
        added while it has fewer than EXPLORE_BELOW observations.

        Nothing learned yet, optimism 1: 0.5 + sqrt(0.25 / 2) = 0.85 at every level.
        """
        accepted, reached = self._counts.get(self.ROOT, (0.0, 0.0))
        weight = reached + PRIOR_WEIGHT
        estimate = (accepted + PRIOR_HAZARD * PRIOR_WEIGHT) / weight
        if reached < EXPLORE_BELOW:
            estimate += optimism * math.sqrt(estimate * (1.0 - estimate) / weight)
        for key in (_parent(bucket), bucket):
            accepted, reached = self._counts.get(key, (0.0, 0.0))
            estimate = (accepted + estimate * PRIOR_WEIGHT) / (reached + PRIOR_WEIGHT)
        return estimate

    def age(self) -> None:
        """One step passed: every level's evidence fades a little."""
        for counts in self._counts.values():
            counts[0] *= STEP_RETENTION
            counts[1] *= STEP_RETENTION

    def learn(self, buckets: Sequence[tuple], accepted: int) -> None:
        """A verified chain: ``buckets`` of its verified tokens, ``accepted`` of them kept.

        Tokens after the first rejection were never reached: they say nothing.
        """
        self.learn_outcomes([(bucket, position < accepted) for position, bucket in enumerate(buckets[: accepted + 1])])

    def learn_outcomes(self, outcomes: Sequence[tuple[tuple, bool]]) -> None:
        """(bucket, accepted) of each verified token that was reached: its parent was
        accepted (or it had none). In a tree, a reached node's siblings were reached too."""
        for bucket, accepted in outcomes:
            for key in (self.ROOT, _parent(bucket), bucket):
                counts = self._counts.setdefault(key, [0.0, 0.0])
                counts[0] = counts[0] * BUCKET_RETENTION + accepted
                counts[1] = counts[1] * BUCKET_RETENTION + 1.0


def _parent(bucket: tuple) -> tuple:
    """(source, position) of a full bucket (source, match length, confidence, position),
    with a branch's trailing 1 kept: branches have their own level."""
    return (bucket[0], bucket[3], *bucket[4:])


@dataclass
class SequenceCalibration:
    """How a sequence's drafts fare against the model's hazards: accepted / expected, faded."""

    accepted: float = 0.0
    expected: float = 0.0
    idle: int = 0  # steps since the sequence last verified a draft it had
    probe_after: int = PROBE_AFTER  # idle steps before it probes

    @property
    def factor(self) -> float:
        return (self.accepted + CALIBRATION_WEIGHT) / (self.expected + CALIBRATION_WEIGHT)

    @property
    def probe_due(self) -> bool:
        return self.idle >= self.probe_after

    def age(self) -> None:
        """One step passed."""
        self.accepted *= SEQUENCE_STEP_RETENTION
        self.expected *= SEQUENCE_STEP_RETENTION

    def skipped(self) -> None:
        """A step where the sequence had a draft and verified none of it."""
        self.idle += 1

    def learn(self, hazards: Sequence[float], accepted: int, probe: bool = False) -> None:
        """``hazards`` of the verified tokens (as predicted), ``accepted`` of them kept;
        ``probe``: verified because the sequence was due a probe, not because it paid."""
        self.learn_reached(hazards[: accepted + 1], accepted, probe)

    def learn_reached(self, reached: Sequence[float], accepted: int, probe: bool = False) -> None:
        """``learn`` for a tree: ``reached``, the predicted hazards of the verified
        tokens that were reached (siblings included), ``accepted`` of them kept."""
        self.accepted = self.accepted * SEQUENCE_RETENTION + accepted
        self.expected = self.expected * SEQUENCE_RETENTION + sum(reached)
        self.idle = 0
        if accepted:
            self.probe_after = PROBE_AFTER
        elif probe:
            self.probe_after = min(2 * self.probe_after, PROBE_MAX_AFTER)


def survival(hazards: Sequence[float], parents: Sequence[int] | None = None) -> list[float]:
    """P(each draft and all before it accepted): [0.5, 0.5, 1.0] -> [0.5, 0.25, 0.25].

    With ``parents`` (a tree: each node's parent, -1 for the root's children,
    parents first), a node survives with its path: hazards [0.5, 0.4, 0.5],
    parents [-1, -1, 0] -> [0.5, 0.4, 0.25]. Each node's survival is at most its
    parent's, so a choice ranked by survival is closed under ancestors.
    """
    if parents is None:
        out, alive = [], 1.0
        for hazard in hazards:
            alive *= hazard
            out.append(alive)
        return out
    tree: list[float] = []
    for hazard, parent in zip(hazards, parents):
        tree.append(hazard * (tree[parent] if parent >= 0 else 1.0))
    return tree


class StepCostModel:
    """Seconds per forward pass: ``tokens`` fed, plus ``context`` cached tokens read by attention.

    cost = g(tokens) + per_context_token * context, with g piecewise linear
    through measured points and extrapolated past them, and the context term
    measured once (attention reads the cache: a step over 16 sequences of 700
    tokens spends ~100 ms of a CPU's ~300 there). ``observe`` folds real step
    times into the points around the step's token count, so a start-up
    calibration follows the machine.

    ``cheapest(tokens)`` is the cost of the cheapest measured count at or
    above ``tokens``: CPU GEMMs can be slower at 2 or 3 rows than at 4, and
    padding a step up to such a count is then free. Nothing here assumes
    which counts those are; they are measured.
    """

    # Weight of a new step time against a point's running value.
    OBSERVE_WEIGHT = 0.1
    # Pad to a cheaper count only when it saves at least this fraction...
    PAD_MARGIN = 0.05
    # ...and adds at most this many tokens (beyond it, costs grow with tokens anyway).
    PAD_LIMIT = 8

    def __init__(self, points: dict[int, float], per_context_token: float = 0.0) -> None:
        if not points or any(tokens < 1 or seconds <= 0 for tokens, seconds in points.items()):
            raise ValueError(f"need at least one (tokens >= 1, seconds > 0) point, got {points}")
        self.tokens = sorted(points)
        self.seconds = [points[tokens] for tokens in self.tokens]
        self.per_context_token = per_context_token

    @classmethod
    def linear(cls, fixed_s: float, per_token_s: float) -> StepCostModel:
        return cls({1: fixed_s + per_token_s, 1024: fixed_s + 1024 * per_token_s})

    def points(self) -> dict[int, float]:
        return dict(zip(self.tokens, self.seconds))

    def cost(self, tokens: int, context: int = 0) -> float:
        return self._g(tokens) + self.per_context_token * context

    def _g(self, tokens: int) -> float:
        index = bisect.bisect_left(self.tokens, tokens)
        if index < len(self.tokens) and self.tokens[index] == tokens:
            return self.seconds[index]
        if len(self.tokens) == 1:
            return self.seconds[0] * max(1.0, tokens / self.tokens[0])
        low = min(max(index - 1, 0), len(self.tokens) - 2)  # extrapolate with the nearest segment
        t0, t1, s0, s1 = self.tokens[low], self.tokens[low + 1], self.seconds[low], self.seconds[low + 1]
        return max(s0 + (s1 - s0) * (tokens - t0) / (t1 - t0), 1e-6)

    def cheapest(self, tokens: int, context: int = 0) -> float:
        """The cost of a step of ``tokens``, padded to a measured count where that is cheaper."""
        return self.cost(tokens + self.padding(tokens), context)

    def padding(self, tokens: int) -> int:
        """Tokens to add so the step runs at a measurably cheaper count (0: none).

        Points {1: 1.0, 2: 1.6, 3: 1.7, 4: 1.3}: padding(2) -> 2, padding(1) -> 0.
        """
        best, best_cost = tokens, self._g(tokens) * (1 - self.PAD_MARGIN)
        start = bisect.bisect_right(self.tokens, tokens)
        for index in range(start, len(self.tokens)):
            if self.tokens[index] > tokens + self.PAD_LIMIT:
                break
            if self.seconds[index] < best_cost:
                best, best_cost = self.tokens[index], self.seconds[index]
        return best - tokens

    def observe(self, tokens: int, context: int, seconds: float) -> None:
        """A real step: move the points around ``tokens`` towards its time less the context term."""
        compute = max(seconds - self.per_context_token * context, 1e-6)
        index = bisect.bisect_left(self.tokens, tokens)
        if index < len(self.tokens) and self.tokens[index] == tokens:
            neighbours = [(index, 1.0)]
        elif 0 < index < len(self.tokens):  # between two points: each moves by its share
            t0, t1 = self.tokens[index - 1], self.tokens[index]
            share = (tokens - t0) / (t1 - t0)
            neighbours = [(index - 1, 1.0 - share), (index, share)]
        else:
            return  # outside the measured range: extrapolation stays as calibrated
        error = compute - self._g(tokens)
        for point, share in neighbours:
            self.seconds[point] = max(self.seconds[point] + self.OBSERVE_WEIGHT * share * error, 1e-6)


@dataclass
class VerifyPlan:
    counts: list[int]  # drafts each row verifies
    chosen: list[list[int]]  # which, per row: candidate indices, ascending (a chain's: a prefix)
    expected_tokens: float  # tokens the step yields, in expectation
    tokens: int  # tokens the forward pass feeds, padding excluded


def plan_verification(
    survivals: Sequence[Sequence[float]],
    base_tokens: int,
    base_expected: float,
    cost: Callable[[int], float],
    extra_tokens: int = 0,
) -> VerifyPlan:
    """How many of its candidate drafts each adaptive row verifies.

    survivals[b]: survival of adaptive row b's candidate drafts: non-increasing
    along a chain; in a tree, each node's at most its parent's, and parents
    come first, so ranking by survival then index keeps the chosen set closed
    under ancestors.
    base_tokens, base_expected: what the step feeds and yields without any of
    them (every row's last token and its own next token, fixed-K rows' drafts
    and their expected accepted tokens). extra_tokens: prefill tokens riding
    in the same pass. cost(tokens): seconds for a pass of that many tokens.

    The rate maximised is expected tokens per second of a decode-only step.
    When a prefill chunk rides along, that rate is the price: a draft joins
    if its survival pays for its marginal cost at the decode-only rate (the
    chunk's cost is paid anyway and must not make drafts look free).

    Two rows, survivals [0.9, 0.8] and [0.2], cost 1 + tokens/10:
    no drafts: 2 tokens / 1.2 s = 1.67/s; +0.9: 2.9 / 1.3 = 2.23/s;
    +0.8: 3.7 / 1.4 = 2.64/s; +0.2: 3.9 / 1.5 = 2.6/s -> counts [2, 0].
    """
    ranked = sorted(
        ((s, row, position) for row, candidates in enumerate(survivals) for position, s in enumerate(candidates)),
        key=lambda candidate: (-candidate[0], candidate[2]),
    )
    gains = [s for s, _, _ in ranked]
    chosen, rate = _best_prefix(gains, base_expected, base_tokens, cost)
    if extra_tokens:
        chosen = _best_marginal(gains, base_tokens + extra_tokens, cost, rate)
    picked: list[list[int]] = [[] for _ in survivals]
    for _, row, position in ranked[:chosen]:
        picked[row].append(position)
    for positions in picked:
        positions.sort()
    return VerifyPlan([len(positions) for positions in picked], picked, base_expected + sum(gains[:chosen]), base_tokens + chosen)


def _best_prefix(gains: list[float], base_expected: float, base_tokens: int, cost) -> tuple[int, float]:
    """(n, rate): verifying the first n gains maximises (base_expected + their sum) / cost."""
    best, best_rate, expected = 0, base_expected / cost(base_tokens), base_expected
    for n, gain in enumerate(gains, 1):
        expected += gain
        rate = expected / cost(base_tokens + n)
        if rate > best_rate:
            best, best_rate = n, rate
    return best, best_rate


def _best_marginal(gains: list[float], base_tokens: int, cost, price: float) -> int:
    """n maximising (sum of the first n gains) - price * (the cost n more tokens add)."""
    best, best_value, total, base_cost = 0, 0.0, 0.0, cost(base_tokens)
    for n, gain in enumerate(gains, 1):
        total += gain
        value = total - price * (cost(base_tokens + n) - base_cost)
        if value > best_value:
            best, best_value = n, value
    return best
