"""What the engine asks of a proposer: drafts for the whole batch in one call.

The engine hands the proposer each speculating sequence's whole token list
every step; the proposer keeps track of what its drafter has already seen and
sends only the rest (a drafter session is opened with everything so far). So
a drafter that forgot its sessions (a restart) is simply re-opened with the
full context, and the engine never knows.

``SessionProposer`` adapts an in-process session drafter (``NGramDrafter``);
``serving.drafter_client.RemoteDrafter`` is the gRPC one; ``head.proposer.HeadProposer``
drafts from the target's own features. The engine's proposers are peers
(``proposing.Proposers`` merges their drafts): each request tells a proposer what
the ones before it drafted (``DraftRequest.drafted``) and what the step's planner
prices tokens at (``DraftStep``), for one that drafts only where it pays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    import torch

    from verifier_service.core.planner import Planner, SequenceCalibration


@dataclass(frozen=True)
class Predictions:
    """The target's top-k predictions at the positions one step scored for a sequence:
    position i is the token ``current[i]`` (after ``previous[i]``), and
    ``tokens[i * k : (i + 1) * k]`` its k most likely next tokens, best first. The
    drafter keeps them as its successor table."""

    k: int
    previous: list[int]
    current: list[int]
    tokens: list[int]


@dataclass(frozen=True)
class DraftStep:
    """The step a propose call drafts for, the same for every request in it: its decoding
    rows, the cached tokens their attention reads, and the planner that prices its tokens."""

    rows: int
    context: int
    planner: Planner


@dataclass
class DraftRequest:
    """One sequence's part of a batched propose call."""

    session_id: str
    tokens: list[int]  # prompt + generated so far (the proposer sends what its drafter lacks)
    k: int  # draft tokens wanted: a chain's length, a tree's depth
    # Feedback on this sequence's previous draft: tokens of its chain (a tree's
    # first nodes, parents -1, 0, 1, ...) the target scored, and of those, accepted.
    verified: int = 0
    accepted: int = 0
    # Tree nodes wanted (0: a chain of k). The proposer may return fewer, or a chain.
    max_nodes: int = 0
    # The target's predictions at the positions scored since the previous call.
    predictions: Predictions | None = None
    # The learning scope it drafts from and is learned into (GenerationRequest.scope).
    scope: str = ""
    # The target's feature (the output layer's input) at the last token, from the step that
    # produced it, for a proposer that drafts from the target's own state (the draft head).
    feature: torch.Tensor | None = None
    # The request left K to the engine: the planner verifies what pays (else every draft token).
    adaptive: bool = False
    # The planner's record of this sequence's drafts (its hazards' scale), and the step.
    calibration: SequenceCalibration | None = None
    step: DraftStep | None = None
    # What the proposers before this one drafted for it, merged (None: it is the first).
    drafted: MergedDraft | None = None


class FinishedSequence(NamedTuple):
    """A sequence that ended, for ``DraftProposer.close``: the drafter learns its tokens
    into its scope. A plain (session_id, tokens) pair reads as the default scope's."""

    session_id: str
    tokens: list[int]
    scope: str = ""


class DraftEvidence(NamedTuple):
    """Why the drafter proposed one token (the drafter's ``Evidence``, as the engine reads it)."""

    source: str  # "context" (the request's own tokens), "global" (learned across requests), "successor", "head"
    match_length: int  # tokens of context suffix that matched
    count: int  # type: ignore[assignment]  # times this continuation followed that suffix (shadows tuple.count)
    total: int  # times any continuation followed it


@dataclass(frozen=True)
class ProposedDraft:
    """A chain of draft tokens, or a tree of them: node j is ``tokens[j]``, and its
    parent ``parents[j]`` (-1: it follows the sequence's last token; parents come
    before their children). No parents: a chain ([-1, 0, 1, ...]). A tree whose
    first child of each node is its best guess lets the planner tell branches apart."""

    tokens: list[int]
    # One record per token, or empty when the proposer has none; adaptive K
    # uses it to judge each token's odds before the target sees it.
    evidence: list[DraftEvidence] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)


class MergedDraft(NamedTuple):
    """One sequence's draft from every proposer: node j is ``tokens[j]`` with parent
    ``parents[j]`` (-1: the last token) and ``evidence[j]`` (None: none given); its first
    ``chain`` nodes are the first proposer's leading chain (parents -1, 0, 1, ...), what
    that proposer's feedback (``DraftRequest.verified``/``accepted``) is about."""

    tokens: list[int]
    parents: list[int]
    evidence: list[DraftEvidence | None]
    chain: int


class DraftProposer(Protocol):
    """A source of drafts: the drafter's client, a draft head. A proposer that drafts from
    the target's features says so with a true ``wants_features`` attribute."""

    def propose(self, requests: list[DraftRequest]) -> list[ProposedDraft]:
        """A draft (possibly empty) per request, in order; never raises for drafter trouble."""

    def close(self, finished: list[FinishedSequence]) -> None:
        """Sessions that ended, with their full tokens (the drafter learns from them, in their scopes)."""


class SessionDrafter(Protocol):
    def open(self, session_id: str, prompt_ids: Sequence[int]) -> None: ...

    def propose(self, session_id: str, new_tokens: Sequence[int], k: int): ...

    def close(self, session_id: str, observe: bool = True) -> None: ...


class SessionProposer:
    """A ``DraftProposer`` over an in-process drafter with open/propose/close sessions."""

    def __init__(self, drafter: SessionDrafter) -> None:
        self.drafter = drafter
        self._sent: dict[str, int] = {}  # session -> tokens the drafter has seen

    def propose(self, requests: list[DraftRequest]) -> list[ProposedDraft]:
        drafts = []
        for request in requests:
            new = self._new_tokens(request.session_id, request.tokens)
            if request.predictions is not None and hasattr(self.drafter, "record_predictions"):
                self.drafter.record_predictions(request.predictions)
            if request.max_nodes and hasattr(self.drafter, "propose_tree"):
                draft = self.drafter.propose_tree(request.session_id, new, request.k, request.max_nodes)
            else:
                draft = self.drafter.propose(request.session_id, new, request.k)
            evidence = [DraftEvidence(*e) for e in getattr(draft, "evidence", ())]
            drafts.append(ProposedDraft(list(draft.tokens), evidence, list(getattr(draft, "parents", ()))))
        return drafts

    def close(self, finished: list[FinishedSequence]) -> None:
        for session_id, tokens, _ in (FinishedSequence(*ended) for ended in finished):  # one process, one scope
            if session_id in self._sent:
                self.drafter.propose(session_id, self._new_tokens(session_id, tokens), 0)  # the last tokens too
                del self._sent[session_id]
                self.drafter.close(session_id, observe=True)

    def _new_tokens(self, session_id: str, tokens: list[int]) -> list[int]:
        sent = self._sent.get(session_id)
        self._sent[session_id] = len(tokens)
        if sent is None:
            self.drafter.open(session_id, tokens)
            return []
        return tokens[sent:]
