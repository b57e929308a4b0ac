"""Adaptive K: which draft tokens each step verifies, from their odds and the step's cost.

A packed verify step (``kv_cache``) costs what its tokens cost, whichever
rows they belong to: ``calibration.StepCostModel`` maps the tokens of a forward pass
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
from dataclasses import dataclass, field
from typing import Protocol

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
# A probe that widens a step opens what the kernels charge for at once (int4
# weights are read once per four rows: a 17th token costs what a 20th does),
# so the tokens that cost at most this fraction more than the probe's own fill
# with the probes of the rows due soonest (at least PROBE_EARLY of the way to
# theirs) and then with the probing rows' further drafts. At 16 open-ended
# sequences this made probes four to a block instead of one.
PROBE_FREE = 0.02
PROBE_EARLY = 0.5
# No draft token is ever certain: an estimate of 1 would verify any length.
MAX_HAZARD = 0.99
# The planner's own record: what the draft tokens it chose yielded against what
# it expected of them. The per-token estimates are calibrated on the tokens
# that were reached, but the ones chosen are those whose estimates came out
# highest, so their expectation runs high (the winner's curse): at 16
# sequences on Spec-Bench the chosen tokens were expected to yield 24-69% more
# than they did, and where a step of 16 rows barely pays for one more token,
# that alone made verification slower than none. Each step keeps this weight
# for the earlier ones (~20 steps of memory), and the record starts as
# REALISM_WEIGHT expected tokens all realised (trusting the estimates).
REALISM_RETENTION = 0.95
REALISM_WEIGHT = 4.0
# Positions past this share a bucket: acceptance barely changes beyond it.
POSITION_BUCKETS = 4
# Match lengths 1-4 (n-gram keys) bucket apart; past that, copies of an earlier
# occurrence bucket by octave (5-7, 8-15, 16-31, 32+): the further a copy has
# matched, the likelier its next token, and a long copy's deep drafts pay.
MATCH_LENGTH_BUCKETS = (1, 2, 3, 4, 5, 8, 16, 32)

SOURCE_CONTEXT = "context"  # the request's own prompt and output (the drafter's names for its sources)
SOURCE_GLOBAL = "global"  # the table learned across requests
SOURCE_SUCCESSOR = "successor"  # the target's own earlier predictions (the drafter's successor table)
SOURCE_HEAD = "head"  # the verifier's trained draft head (draft_head)
# A head token's bucket is its probability under the head, in this many equal bands.
HEAD_PROBABILITY_BUCKETS = 5
# A head token's evidence: its probability as a count out of this many (the bands read it).
HEAD_EVIDENCE_TOTAL = 1000


def head_bucket(band: int, position: int) -> tuple:
    """The bucket of a draft head token in probability band ``band`` at ``position``."""
    return (SOURCE_HEAD, band, 0, min(position, POSITION_BUCKETS - 1))


def evidence_bucket(evidence, position: int, branch: bool = False) -> tuple:
    """The bucket of one draft token: (source, match length, confidence, position),
    and a trailing 1 for a tree node that is not its parent's first child (a
    branch: the drafter's second guess there, accepted less often).

    Confidence: 0 when other continuations also followed the suffix, 1 when
    this one alone followed it once, 2 when it alone followed it twice or more.
    Position is the token's depth in its draft (a chain's index). A draft head's
    token (SOURCE_HEAD) is bucketed by its probability under the head instead:
    ("head", band of HEAD_PROBABILITY_BUCKETS, 0, position).
    A context token matched on 4 tokens, seen 3 times out of 3, at position 0:
    ("context", 4, 2, 0). Drafts without evidence share one bucket per position.
    """
    if branch:
        return (*evidence_bucket(evidence, position), 1)
    if evidence is None:
        return ("", 0, 0, min(position, POSITION_BUCKETS - 1))
    if evidence.source == SOURCE_HEAD:  # count / total is the head's probability of the token
        band = min(HEAD_PROBABILITY_BUCKETS * evidence.count // max(evidence.total, 1), HEAD_PROBABILITY_BUCKETS - 1)
        return head_bucket(band, position)
    if evidence.count < evidence.total:
        confidence = 0
    else:
        confidence = 1 if evidence.count == 1 else 2
    return (
        evidence.source,
        match_bucket(evidence.match_length),
        confidence,
        min(position, POSITION_BUCKETS - 1),
    )


def match_bucket(length: int) -> int:
    """The lower end of ``length``'s bucket in MATCH_LENGTH_BUCKETS: 3 -> 3, 6 -> 5, 40 -> 32."""
    at = bisect.bisect_right(MATCH_LENGTH_BUCKETS, length)  # per draft token, each step
    return MATCH_LENGTH_BUCKETS[at - 1] if at else 0


def draft_buckets(evidence: Sequence, parents: Sequence[int]) -> list[tuple]:
    """Each draft node's ``evidence_bucket``: its depth from its parents, a branch when its
    parent's first child came before it. Parents [-1, 0, 0]: depths 0, 1, 1; node 2 a branch."""
    buckets: list[tuple] = []
    depths: list[int] = []
    firsts: set[int] = set()  # parents whose first child has been seen
    for item, parent in zip(evidence, parents):
        depths.append(depths[parent] + 1 if parent >= 0 else 0)
        buckets.append(evidence_bucket(item, depths[-1], branch=parent in firsts))
        firsts.add(parent)
    return buckets


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
        return self._estimate((_parent(bucket), bucket), optimism)

    def source_hazard(self, source: str, position: int, optimism: float = 0.0) -> float:
        """The estimate for ``source``'s tokens at ``position`` whatever their evidence
        (the middle level): what a draft from that source can expect before it is seen."""
        return self._estimate(((source, min(position, POSITION_BUCKETS - 1)),), optimism)

    def _estimate(self, keys: tuple[tuple, ...], optimism: float) -> float:
        accepted, reached = self._counts.get(self.ROOT, (0.0, 0.0))
        weight = reached + PRIOR_WEIGHT
        estimate = (accepted + PRIOR_HAZARD * PRIOR_WEIGHT) / weight
        if reached < EXPLORE_BELOW:
            estimate += optimism * math.sqrt(estimate * (1.0 - estimate) / weight)
        for key in keys:
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
    """How a sequence's drafts fare against the model's hazards: accepted / expected, faded,
    per source. Per source because a sequence may copy its context well while the
    target's earlier predictions (or the global table) miss on the same text: one
    factor for all would let one source's failures stop the others being verified."""

    idle: int = 0  # steps since the sequence last verified a draft it had
    probe_after: int = PROBE_AFTER  # idle steps before it probes
    _record: dict[str, list[float]] = field(default_factory=dict)  # source -> [accepted, expected]

    @property
    def factor(self) -> float:
        """The factor of drafts that name no source (``learn``'s)."""
        return self.factor_of("")

    def factor_of(self, source: str) -> float:
        accepted, expected = self._record.get(source, (0.0, 0.0))
        return (accepted + CALIBRATION_WEIGHT) / (expected + CALIBRATION_WEIGHT)

    @property
    def probe_due(self) -> bool:
        return self.idle >= self.probe_after

    def age(self) -> None:
        """One step passed."""
        for record in self._record.values():
            record[0] *= SEQUENCE_STEP_RETENTION
            record[1] *= SEQUENCE_STEP_RETENTION

    def skipped(self) -> None:
        """A step where the sequence had a draft and verified none of it."""
        self.idle += 1

    def learn(self, hazards: Sequence[float], accepted: int, probe: bool = False) -> None:
        """``hazards`` of the verified tokens of a chain naming no source (as predicted),
        ``accepted`` of them kept; ``probe``: verified because the sequence was due a
        probe, not because it paid."""
        self.learn_reached([("", hazard, index < accepted) for index, hazard in enumerate(hazards[: accepted + 1])], probe)

    def learn_reached(self, reached: Sequence[tuple[str, float, bool]], probe: bool = False) -> None:
        """``learn`` for any draft: (source, predicted hazard, accepted) of each verified
        token that was reached (its parent accepted; siblings included)."""
        touched = set()
        for source, hazard, accepted in reached:
            record = self._record.setdefault(source, [0.0, 0.0])
            if source not in touched:  # one verified draft is one observation of each source in it
                record[0] *= SEQUENCE_RETENTION
                record[1] *= SEQUENCE_RETENTION
                touched.add(source)
            record[0] += accepted
            record[1] += hazard
        self.idle = 0
        if any(accepted for _, _, accepted in reached):
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


class PlannedRow(Protocol):
    """What the planner reads and sets on one decoding row of a step (``step.Row``)."""

    draft: list[int]  # its draft tokens, parents before children
    buckets: list[tuple]  # evidence_bucket of each
    parents: list[int]  # each token's parent (-1: the row's last token)
    tree: bool  # the draft branches
    verify: int  # set by the planner: the first ``verify`` tokens are verified
    probe: bool

    @property
    def adaptive(self) -> bool:
        """The request left K to the engine (else it verifies its whole draft)."""

    @property
    def calibration(self) -> SequenceCalibration: ...

    def choose(self, chosen: list[int]) -> None:
        """Verify the tokens ``chosen`` (ascending, closed under ancestors): they become the first."""


class Planner:
    """Adaptive K in one place: which draft tokens each step verifies, and what
    their outcomes teach. ``plan`` chooses, ``learn`` takes one row's outcome,
    ``age`` fades the shared estimates once a step.

    It holds the shared ``AcceptanceModel``; each sequence's
    ``SequenceCalibration`` travels with its row. ``cost`` prices a step
    (``cheapest(tokens, context)`` and ``padding(tokens)``, a
    ``calibration.StepCostModel``), so the same rule picks small trees on a CPU,
    where every token costs, and wide ones where a pass of 64 costs what one of 1 does.

    It also keeps its own record per source (``realism``): the tokens its plans
    chose yielded so many per token it expected. Choosing by estimate picks the
    estimates that came out high, so that ratio runs below 1, most where little
    pays (many rows, open text); every survival is scaled by its source's. Per
    source because one source's over-estimates (a draft head's guesses on open
    text) must not stop the others' tokens being verified.
    """

    def __init__(self, cost) -> None:
        self.cost = cost
        self.acceptance = AcceptanceModel()
        self._record: dict[str, list[float]] = {}  # source -> faded [accepted, expected] of the tokens plans chose
        self._step: dict[str, list[float]] = {}  # the same for this step, folded in by ``age``
        self._expected: dict[int, dict[str, float]] = {}  # id of a planned row -> its chosen tokens' expectation, per source
        self.head = HeadRecord()  # the draft head's levels and what its drafts brought
        self._head_step = [0, 0]  # this step's head tokens verified and accepted, settled by ``age``

    def realism(self, source: str) -> float:
        """What chosen draft tokens from ``source`` yielded per token expected, at most 1:
        planning scales their survivals by it (fewer of them pay for their cost)."""
        accepted, expected = self._record.get(source, (0.0, 0.0))
        return min(1.0, (accepted + REALISM_WEIGHT) / (expected + REALISM_WEIGHT))

    def hazard(self, bucket: tuple, calibration: SequenceCalibration) -> float:
        """What planning expects of a draft token in ``bucket`` whose parent was accepted,
        for the sequence ``calibration`` belongs to."""
        return min(MAX_HAZARD, self.acceptance.hazard(bucket, EXPLORATION) * calibration.factor_of(bucket[0]))

    def source_hazard(self, source: str, calibration: SequenceCalibration) -> float:
        """``hazard`` of a first draft token from ``source`` before its evidence is known."""
        return min(MAX_HAZARD, self.acceptance.source_hazard(source, 0, EXPLORATION) * calibration.factor_of(source))

    def floor(self, rows: int, context: int) -> float:
        """The least expected yield (survival scaled by ``realism``) a draft token needs for
        verifying it to pay, in a decode step of ``rows`` rows that reads ``context``
        cached tokens: one more token in the pass costs that share of the tokens the
        step yields without it."""
        base = self.cost.cheapest(rows, context)
        return max(0.0, rows * (self.cost.cheapest(rows + 1, context) - base) / base)

    def plan(self, rows: Sequence[PlannedRow], prefill_tokens: int, context: int, reads_per_token: float = 0.0) -> None:
        """Set what each row verifies: a fixed-K row its whole draft, adaptive rows the
        tokens whose survival pays for their cost in a step of ``prefill_tokens`` more
        tokens, whose attention reads ``context`` cached tokens, and ``reads_per_token``
        more for each token beyond one a row (where every token reads its row's cache)."""
        adaptive, survivals = [], []
        base_tokens, base_expected = len(rows), float(len(rows))
        for row in rows:
            calibration = row.calibration
            hazards = [self.hazard(bucket, calibration) for bucket in row.buckets]
            survivals_of_row = survival(hazards, row.parents if row.tree else None)
            if row.adaptive:
                adaptive.append(row)
                survivals.append(survivals_of_row)
            else:
                row.verify = len(row.draft)
                base_tokens += row.verify
                base_expected += sum(survivals_of_row)
        self._expected = {}
        if not any(survivals):
            self._probe(adaptive, base_tokens + prefill_tokens)
            return
        scaled = [self._scaled(row, row_survivals) for row, row_survivals in zip(adaptive, survivals)]

        def cost(tokens: int) -> float:  # the tokens past one a row read again (a prefill chunk's too: a constant)
            return self.cost.cheapest(tokens, round(context + max(0, tokens - len(rows)) * reads_per_token))

        plan = plan_verification(scaled, base_tokens, base_expected, cost, prefill_tokens)
        for row, chosen, row_survivals in zip(adaptive, plan.chosen, survivals):
            if chosen:
                expected: dict[str, float] = {}
                for node in chosen:
                    source = row.buckets[node][0]
                    expected[source] = expected.get(source, 0.0) + row_survivals[node]
                self._expected[id(row)] = expected
            row.choose(chosen)
        self._probe(adaptive, plan.tokens + prefill_tokens)

    def _scaled(self, row: PlannedRow, survivals: list[float]) -> list[float]:
        """``survivals`` scaled by each token's source's ``realism``, each at most its
        parent's (as ``plan_verification`` needs: sources can differ down one branch)."""
        realism = {source: self.realism(source) for source in {bucket[0] for bucket in row.buckets}}
        scaled: list[float] = []
        for value, bucket, parent in zip(survivals, row.buckets, row.parents):
            scaled.append(min(value * realism[bucket[0]], scaled[parent] if parent >= 0 else 1.0))
        return scaled

    def _probe(self, rows: list[PlannedRow], tokens: int) -> None:
        """Rows due a probe verify their first draft token, in a step of ``tokens`` without
        them; the tokens then free (``PROBE_FREE``) go to the first draft tokens of the rows
        whose probes come soonest, as probes brought forward, and then to the probing rows'
        next draft tokens (a tree's next nodes: parents come first, so any first few are
        closed under ancestors)."""
        waiting = [row for row in rows if row.draft and not row.verify]
        due = [row for row in waiting if row.calibration.probe_due]
        if not due:
            return
        soon = sorted(
            (row for row in waiting if not row.calibration.probe_due and row.calibration.idle >= PROBE_EARLY * row.calibration.probe_after),
            key=lambda row: row.calibration.probe_after - row.calibration.idle,
        )
        tokens += len(due)
        limit = self.cost.cheapest(tokens) * (1 + PROBE_FREE)
        probing = list(due)
        for row in soon:
            if self.cost.cheapest(tokens + 1) > limit:
                break
            probing.append(row)
            tokens += 1
        for row in probing:
            row.verify, row.probe = 1, True
        for row in probing:
            while row.verify < len(row.draft) and self.cost.cheapest(tokens + 1) <= limit:
                row.verify += 1
                tokens += 1

    def learn(self, row: PlannedRow, path: list[int]) -> None:
        """One row's outcome: ``path``, the verified tokens accepted. Every verified token
        whose parent was accepted (or that had none) was reached and says whether it was
        right; the others say nothing."""
        calibration = row.calibration
        calibration.age()
        expected = self._expected.pop(id(row), None)
        if expected is not None and not row.probe:
            for source, value in expected.items():
                self._step.setdefault(source, [0.0, 0.0])[1] += value
            for node in path:
                self._step.setdefault(row.buckets[node][0], [0.0, 0.0])[0] += 1
        if row.verify:
            on_path = set(path)
            outcomes = [
                (row.buckets[node], node in on_path) for node in range(row.verify) if row.parents[node] < 0 or row.parents[node] in on_path
            ]
            calibration.learn_reached([(bucket[0], self.acceptance.hazard(bucket), accepted) for bucket, accepted in outcomes], row.probe)
            self.acceptance.learn_outcomes(outcomes)
            head = [node for node in range(row.verify) if row.buckets[node][0] == SOURCE_HEAD]
            self._head_step[0] += len(head)
            self._head_step[1] += len(on_path.intersection(head))
        elif row.draft and row.adaptive:
            calibration.skipped()

    def age(self) -> None:
        """A step passed: its rows' outcomes (``learn``) join the planner's record."""
        self.acceptance.age()
        self.head.settle(*self._head_step)
        self._head_step = [0, 0]
        for source in self._record.keys() | self._step.keys():
            record, step = self._record.setdefault(source, [0.0, 0.0]), self._step.get(source, [0.0, 0.0])
            record[0] = record[0] * REALISM_RETENTION + step[0]
            record[1] = record[1] * REALISM_RETENTION + step[1]
        self._step = {}


class HeadRecord:
    """The draft head's economics, kept by the planner beside every other source's: what
    its levels cost and what its first guesses look like, faded; the head's proposer
    (``head.proposer``) runs a level only where the guesses it can expect would pay for it.

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
        and ``accepted`` (``Planner.age`` tells it). What they brought: the tokens accepted, less what verifying each
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
            self._bands[head_band(probability)] += 1

    def first_surplus(self, value: Callable[[int], float]) -> float:
        """What a row's first guess is expected to add, where ``value(band)`` is what a guess
        in that band yields beyond its cost (at most 0 counts 0: it would not be verified).
        Before any guess is seen, 1 (the head is tried)."""
        total = sum(self._bands)
        if not total:
            return 1.0
        return sum(count * max(0.0, value(band)) for band, count in enumerate(self._bands) if count) / total


def head_band(probability: float) -> int:
    """The probability band of a draft head token (its bucket's second field, as
    ``evidence_bucket`` reads the head's evidence: a count out of HEAD_EVIDENCE_TOTAL)."""
    count = round(probability * HEAD_EVIDENCE_TOTAL)
    return min(HEAD_PROBABILITY_BUCKETS * count // HEAD_EVIDENCE_TOTAL, HEAD_PROBABILITY_BUCKETS - 1)


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
