"""Adaptive K: how many draft tokens each step verifies, from acceptance and cost.

A verify step feeds every row ``[last token] + drafts`` padded to one width W,
so its cost is the cost of ``batch x W`` rows however long each row's draft
is. A row whose drafts are accepted one by one with probability ``alpha``
(the geometric model of Leviathan et al. 2023, sec. 3.1) yields in
expectation

    1 + alpha + alpha^2 + ... + alpha^j      tokens, for j = min(draft, W - 1)

(the 1 is the recovered or bonus token every step yields). Each step picks
the W that maximises expected tokens per second over the whole batch; W = 1
is plain decoding. With a cost model that is flat in rows (a GPU, or a CPU at
small batch) long drafts pay; at large batch on a CPU, where cost grows with
rows, only rows with high acceptance justify widening the step, and open-ended
text (low acceptance, or no drafts at all) falls back to W = 1.

``alpha`` is estimated per sequence from its own verified drafts, with a
prior, and older evidence fades, so a sequence that stopped speculating after
bad drafts tries again later (its estimate drifts back to the prior).

This module imports neither torch nor grpc.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Prior acceptance (as pseudo-counts of accepted and rejected drafts): even
# odds, worth two observations, so real evidence dominates after a step or two.
PRIOR_ACCEPTED = 1.0
PRIOR_REJECTED = 1.0
# Per step, earlier evidence keeps this weight: the estimate follows the text
# as it changes (a quote ends, free text starts) within ~20 steps.
EVIDENCE_DECAY = 0.95


@dataclass
class AcceptanceEstimate:
    """Per-token acceptance probability of one sequence's drafts."""

    accepted: float = 0.0
    rejected: float = 0.0

    @property
    def alpha(self) -> float:
        return (self.accepted + PRIOR_ACCEPTED) / (self.accepted + self.rejected + PRIOR_ACCEPTED + PRIOR_REJECTED)

    def update(self, verified: int, accepted: int) -> None:
        """One step: ``accepted`` of ``verified`` drafts kept (a prefix, so at most one rejection)."""
        self.accepted *= EVIDENCE_DECAY
        self.rejected *= EVIDENCE_DECAY
        self.accepted += accepted
        self.rejected += accepted < verified


def expected_tokens(alpha: float, drafts: int) -> float:
    """Tokens one step yields for a row verifying ``drafts`` tokens: 1 + alpha + ... + alpha^drafts.

    expected_tokens(0.5, 2) -> 1.75; expected_tokens(0.9, 0) -> 1.0.
    """
    return sum(alpha**i for i in range(drafts + 1))


class StepCostModel:
    """Seconds per verify step as a function of the rows it feeds (batch x width).

    Piecewise linear through measured points, extrapolated linearly past the
    last one. ``observe`` folds real step times into the nearest point, so a
    start-up calibration is refined by what the service actually sees.
    """

    # Weight of a new step time against the point's running value.
    OBSERVE_WEIGHT = 0.1

    def __init__(self, points: dict[int, float]) -> None:
        if not points or any(rows < 1 or seconds <= 0 for rows, seconds in points.items()):
            raise ValueError(f"need at least one (rows >= 1, seconds > 0) point, got {points}")
        self.rows = sorted(points)
        self.seconds = [points[rows] for rows in self.rows]

    @classmethod
    def linear(cls, fixed_s: float, per_row_s: float) -> StepCostModel:
        return cls({1: fixed_s + per_row_s, 1024: fixed_s + 1024 * per_row_s})

    def cost(self, rows: int) -> float:
        index = bisect.bisect_left(self.rows, rows)
        if index < len(self.rows) and self.rows[index] == rows:
            return self.seconds[index]
        if len(self.rows) == 1:
            return self.seconds[0] * max(1.0, rows / self.rows[0])
        low = min(max(index - 1, 0), len(self.rows) - 2)  # extrapolate with the nearest segment
        r0, r1, s0, s1 = self.rows[low], self.rows[low + 1], self.seconds[low], self.seconds[low + 1]
        return max(s0 + (s1 - s0) * (rows - r0) / (r1 - r0), 1e-6)

    def observe(self, rows: int, seconds: float) -> None:
        index = min(range(len(self.rows)), key=lambda i: abs(self.rows[i] - rows))
        if abs(self.rows[index] - rows) > 0.25 * rows:
            return  # no point near enough: calibration covers the range that matters
        self.seconds[index] += self.OBSERVE_WEIGHT * (seconds - self.seconds[index])


def choose_width(
    draft_lengths: Sequence[int],
    alphas: Sequence[float],
    step_cost: Callable[[int], float],
    padded_width: Callable[[int, int], int],
    min_width: int = 1,
) -> int:
    """The verify width W (1 + drafts per row) with the most expected tokens per second.

    Row i verifies min(draft_lengths[i], W - 1) drafts. ``padded_width(batch, W)``
    gives the width the step really runs at (row padding for fast GEMMs), and
    ``min_width`` is what rows with a fixed K require.

    Two rows with 4 drafts each, alphas [0.9, 0.9], cost 1 + rows/8 s:
    W=1: 2 tokens / 1.25 s = 1.6/s; W=5: 2 x 4.10 tokens / 2.25 s = 3.6/s -> 5.
    With alphas [0.1, 0.1]: W=1 1.6/s beats W=2 2.2 / 1.5 = 1.47/s -> 1.
    """
    assert len(draft_lengths) == len(alphas), "one alpha per row"
    batch = len(draft_lengths)
    longest = max(draft_lengths, default=0)
    best_width, best_rate = min_width, -1.0
    for width in range(min_width, max(min_width, longest + 1) + 1):
        tokens = sum(expected_tokens(alpha, min(length, width - 1)) for length, alpha in zip(draft_lengths, alphas))
        rate = tokens / step_cost(batch * padded_width(batch, width))
        if rate > best_rate:
            best_width, best_rate = width, rate
    return best_width
