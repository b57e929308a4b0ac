"""What a step did and when (``StepReport``), and what its pass cost, for the step cost model.

``StepClock`` marks a step's stages as they start; once it is accepted, ``report``
measures it, feeds a packed pass's time to the step cost model (``calibration``:
real steps refine what start-up measured), and returns the report the service's
observer traces and meters. The engine keeps none of it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from verifier_service.core.generation import StepReport
from verifier_service.core.target import Scored


class StepClock:
    """One step's clock, started as its pass begins."""

    def __init__(self, step_cost, decoding: int) -> None:
        self.step_cost, self.decoding = step_cost, decoding
        self.scoring_ns, self.started = time.time_ns(), time.perf_counter()
        self.accepting_ns = 0

    def accepting(self) -> None:
        self.accepting_ns = time.time_ns()

    def report(self, scored: Scored, decisions: Sequence[tuple[list[int], int] | None], context: int) -> StepReport:
        """The step as a whole, once accepted; ``context``: the cached tokens its decode rows
        read (``step.cache_reads``). A pass scored piecemeal says nothing about a packed
        one's cost, so only a packed pass is observed."""
        done = time.time_ns()
        verified = sum(row.verify for row in scored.rows)
        tokens = len(scored.rows) + verified + sum(chunk.length for chunk in scored.chunks)
        if scored.packed:
            reads = context + sum(chunk.first for chunk in scored.chunks)
            self.step_cost.observe(tokens + self.step_cost.padding(tokens), reads, time.perf_counter() - self.started)
        accepted = sum(len(decision[0]) for decision in decisions if decision is not None)
        width = 1 + max((row.verify for row in scored.rows), default=0)
        return StepReport(self.decoding, verified, accepted, width, tokens, self.scoring_ns, self.accepting_ns, done)
