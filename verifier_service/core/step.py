"""What one step is made of: the sequences, each decoding sequence's row, the prefill
chunks riding along, and the layout of the logits the pass keeps (``KeptRows``).

A step (``engine.SpeculativeEngine.step``) turns each decoding ``SequenceState`` into a
``Row`` (its draft, as the proposers offered it and the planner cut it), feeds every
row's ``[last token] + verified drafts`` and the ``PrefillChunk``s in one packed pass,
and keeps logits in ``KeptRows``'s layout: each row's ``verify + 1``, in row order,
then the chunks' ``kept_chunk_positions``. Acceptance, log-probabilities, predictions
and features read that layout through ``KeptRows``; nothing else walks it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from verifier_service.core.drafting import DraftEvidence, Predictions
from verifier_service.core.generation import GenerationRequest, GenerationStats, SequenceHandle
from verifier_service.core.planner import SequenceCalibration
from verifier_service.core.processing import TokenHistory, TokenLogprob
from verifier_service.core.text import StopStringMatcher


@dataclass(eq=False)
class SequenceState:
    """One request as the engine runs it: its tokens, its slot, and what it carries from step to step."""

    request: GenerationRequest
    session_id: str
    seed: int
    slot: int
    tokens: list[int]  # prompt + generated, including the last (uncached) token
    generated: list[int] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)
    prefilled: int = 0  # prompt tokens in the cache; all of them once decoding
    calibration: SequenceCalibration = field(default_factory=SequenceCalibration)
    # The previous step's verdict on this sequence's draft, fed back to the drafter.
    verified: int = 0
    accepted: int = 0
    predictions: Predictions | None = None  # the target's at the positions the previous step scored, for the drafter
    feature: torch.Tensor | None = None  # the target's feature at its last token, for a proposer that drafts from it
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per generated token, when the request asks
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # per prompt token after the first scored so far
    history: TokenHistory = field(default_factory=TokenHistory)  # its prompt and output as penalties read them
    proposed: bool = False  # the proposer has a session for it
    stops: StopStringMatcher | None = None
    finish_reason: str | None = None
    stop_text: str | None = None  # output text cut before the stop string that ended it
    error: Exception | None = None  # why it ended, when finish_reason is FINISH_ERROR
    handle: SequenceHandle = field(init=False)

    def __post_init__(self) -> None:
        self.handle = SequenceHandle(self.request)

    @property
    def decoding(self) -> bool:
        return bool(self.generated)

    @property
    def cached(self) -> int:
        """Tokens of this sequence in its cache slot."""
        return len(self.tokens) - 1 if self.generated else self.prefilled


@dataclass
class Row:
    """One decoding sequence's part in a step."""

    sequence: SequenceState
    draft: list[int]  # what the proposers offered, merged (``proposing.Proposers``)
    buckets: list[tuple]  # planner.evidence_bucket of each draft token
    asked: bool  # the proposer was asked this step (feedback goes back next time)
    evidence: list[DraftEvidence | None] = field(default_factory=list)  # the drafter's, per draft token (None: none given)
    parents: list[int] = field(default_factory=list)  # each draft token's parent (-1: the last token); a chain's [-1, 0, 1, ...]
    tree: bool = False  # the draft branches
    chain: int = 0  # its first tokens that are the first proposer's chain (parents -1, 0, 1, ...): what feedback is about
    verify: int = 0  # draft tokens this step verifies: the first ``verify``, closed under ancestors
    probe: bool = False  # verified as a probe (adaptive.PROBE_AFTER), not because the plan said it pays
    logprobs: list[TokenLogprob] | None = None  # of the tokens this step's decision emits, when the request asks

    @property
    def adaptive(self) -> bool:
        return self.sequence.request.num_speculative_tokens is None

    @property
    def calibration(self) -> SequenceCalibration:
        return self.sequence.calibration

    def query_parents(self) -> list[int] | None:
        """The verified queries' parents ([last token] + drafts, so each index + 1), or None for a chain."""
        return [-1, *(parent + 1 for parent in self.parents[: self.verify])] if self.tree else None

    def choose(self, chosen: list[int]) -> None:
        """Verify the draft tokens ``chosen`` (ascending, closed under ancestors): they become the first."""
        if chosen == list(range(len(chosen))):
            self.verify = len(chosen)
            return
        self.chain = next((index for index, node in enumerate(chosen) if node != index or index >= self.chain), len(chosen))
        position = {node: index for index, node in enumerate(chosen)}
        self.parents = [-1 if self.parents[node] < 0 else position[self.parents[node]] for node in chosen]
        self.draft = [self.draft[node] for node in chosen]
        self.buckets = [self.buckets[node] for node in chosen]
        self.evidence = [self.evidence[node] for node in chosen]
        self.verify = len(chosen)


class PrefillChunk(NamedTuple):
    """``length`` prompt tokens of ``sequence`` from position ``first``, prefilled in one step."""

    sequence: SequenceState
    first: int
    length: int


@dataclass(frozen=True)
class KeptRows:
    """Which of a step's kept logits (and features) belong to which decode row and draft
    node, and to which prefill chunk.

    Each decode row owns ``verify + 1`` of them, in row order: its last token's, then each
    verified node's (node i's gave the token after node i). The prefill chunks' kept
    positions (``kept_chunk_positions``) follow, from ``decoded`` on, in chunk order.
    Built once a step is scored; acceptance, log-probabilities, predictions, features and
    prefill ask it instead of walking the rows.
    """

    bounds: tuple[int, ...]  # row i owns [bounds[i], bounds[i + 1])
    chunk_bounds: tuple[int, ...] = ()  # chunk i owns [chunk_bounds[i], chunk_bounds[i + 1])

    @classmethod
    def of(cls, rows: Sequence[Row], chunks: Sequence[PrefillChunk] = ()) -> KeptRows:
        bounds = tuple(itertools.accumulate((row.verify + 1 for row in rows), initial=0))
        kept = (len(kept_chunk_positions(*chunk)) for chunk in chunks)
        return cls(bounds, tuple(itertools.accumulate(kept, initial=bounds[-1])))

    @property
    def decoded(self) -> int:
        """The decode rows' positions together: the prefill chunks' start here."""
        return self.bounds[-1]

    def span(self, row: int) -> slice:
        return slice(self.bounds[row], self.bounds[row + 1])

    def root(self, row: int) -> int:
        """The position of row ``row``'s last token (the first token it emits came from it)."""
        return self.bounds[row]

    def path(self, row: int, nodes: Sequence[int]) -> list[int]:
        """The positions that produced the tokens of an accepted path: the root's, then each node's."""
        start = self.bounds[row]
        return [start, *(start + 1 + node for node in nodes)]

    def chunk(self, index: int) -> slice:
        """Prefill chunk ``index``'s kept positions (empty for a chunk that keeps none)."""
        return slice(self.chunk_bounds[index], self.chunk_bounds[index + 1])


def rejected_line(parents: list[int], verified: int, path: list[int]) -> list[int]:
    """The verified draft nodes the target turned down where the accepted ``path`` ends: the
    first child of its last node (of the root when nothing was accepted), that node's first
    child, and so on; the drafter's best guess from there on, which the step's own token
    replaced. ``parents`` as ``Row.parents``; only the first ``verified`` nodes were scored.

    Chain [-1, 0, 1, 2], 4 verified, path [0] -> [1, 2, 3]. Tree [-1, -1, 0, 0, 2], 5
    verified, path [0] -> [2, 4] (node 3, 0's second child, is another branch; node 1 is
    the root's). Everything verified accepted -> [].
    """
    line, parent = [], path[-1] if path else -1
    while (child := next((node for node in range(verified) if parents[node] == parent), None)) is not None:
        line.append(child)
        parent = child
    return line


def kept_chunk_positions(sequence: SequenceState, first: int, length: int) -> list[int]:
    """The positions of a prefill chunk (from 0) whose logits a step keeps: every one when
    its request asks for the prompt's log-probabilities, else a completing prompt's last
    alone (it samples the first token), else none."""
    if sequence.request.prompt_logprobs is not None:
        return list(range(length))
    return [length - 1] if first + length == len(sequence.request.prompt_ids) else []


def feature_rows(
    rows: Sequence[Row], decisions: Sequence[tuple[list[int], int] | None], chunks: Sequence[PrefillChunk], kept: KeptRows
) -> dict[SequenceState, list[int]]:
    """Per sequence that got tokens from a step, the rows of the step's kept positions (its
    logits, its features) that produced them: a decode row's root and accepted nodes, a
    completed prompt's last position (after the decode rows')."""
    produced: dict[SequenceState, list[int]] = {}
    for index, (row, decision) in enumerate(zip(rows, decisions)):
        if decision is not None:
            produced[row.sequence] = kept.path(index, decision[0])
    for index, (sequence, first, length) in enumerate(chunks):
        if first + length == len(sequence.request.prompt_ids):
            produced[sequence] = [kept.chunk(index).stop - 1]
    return produced


def cache_reads(rows: Sequence[Row], per_token: bool = False) -> int:
    """Cached tokens a step's decode rows read in attention, about: each row its own (a CPU
    cuts the rows into attention calls where reading a longer row's columns would cost more),
    or, ``per_token``, each token of a row its row's (batch-invariant decode attention gives
    every token a call entry of its own: ``SpeculativeEngine.reads_per_token``). A prefill
    chunk adds its slot's earlier tokens (``PrefillChunk.first``)."""
    return sum(row.sequence.cached * (1 + row.verify if per_token else 1) for row in rows)
