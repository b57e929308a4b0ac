"""The engine's public value types: what a caller hands it and what it reports back.

A ``GenerationRequest`` goes in (``SpeculativeEngine.add`` or ``generate``);
each step reports a ``StepOutcome`` per sequence (named by the
``SequenceHandle`` that ``add`` returned) and a ``StepReport`` for the step
as a whole; a finished sequence's outcome carries its ``GenerationResult``.
The service layers (scheduler, gRPC, HTTP, observability) import these from
here; only the engine imports the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from verifier_service.core.drafting import DraftEvidence
from verifier_service.core.processing import TokenLogprob
from verifier_service.core.rejection import SamplingParams

FINISH_STOP = "stop"  # EOS token or a stop string
FINISH_LENGTH = "length"  # max_new_tokens reached
FINISH_CANCELLED = "cancelled"  # the caller gave up (cancel, deadline)
# Where each emitted token came from (StepOutcome.sources): the target's own
# (sampled, recovered or bonus), or an accepted draft: its proposer's source
# ("context", "global", "successor", "head"), SOURCE_DRAFT when it gave none.
SOURCE_TARGET = "target"
SOURCE_DRAFT = "draft"
FINISH_ERROR = "error"  # a failure that belonged to this sequence alone (StepOutcome.error says which)


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    # K: draft tokens per step; 0 disables speculation for this request, None
    # lets the engine choose each step (adaptive K).
    num_speculative_tokens: int | None = 5
    request_id: str = ""
    # None: no log-probabilities; n: each generated token's, with the target's top n.
    logprobs: int | None = None
    # None: none; n: each prompt token's after the first (which has no context to be
    # predicted from), with the target's top n, from the prefill's own logits.
    # Then max_new_tokens may be 0: the prompt is scored and nothing generated.
    prompt_logprobs: int | None = None
    # The learning scope its drafts come from and its text is learned into: its caller's,
    # as the front door found it (verifier_service.serving.scopes); "" is the default scope.
    scope: str = ""


@dataclass
class GenerationStats:
    target_forward_passes: int = 0  # prefill included, once however many chunks: it yields the first token
    draft_tokens: int = 0
    accepted_tokens: int = 0
    generated_tokens: int = 0
    verify_steps_with_drafts: int = 0
    steps_with_accepted_drafts: int = 0  # steps that kept at least one draft token

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Accepted drafts per step that carried drafts."""
        return self.accepted_tokens / self.verify_steps_with_drafts if self.verify_steps_with_drafts else 0.0

    @property
    def tokens_per_forward_pass(self) -> float:
        return self.generated_tokens / self.target_forward_passes if self.target_forward_passes else 0.0


@dataclass
class GenerationResult:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None  # per token of token_ids, when the request asked
    # Per prompt token after the first (len(prompt_ids) - 1 of them), when the request asked.
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True, eq=False)
class SequenceHandle:
    """What ``add`` returns: names one sequence to ``cancel`` and in ``StepOutcome``;
    it carries the request and none of the engine's state, which stays private."""

    request: GenerationRequest


@dataclass(frozen=True)
class StepOutcome:
    """What one step did for one sequence."""

    sequence: SequenceHandle  # what ``add`` returned
    tokens: list[int]  # appended to the output (accepted drafts + the step's own, cut at a stop)
    verified: int = 0  # draft tokens the target scored
    accepted: int = 0  # of those, accepted
    first: bool = False  # the step finished its prefill: ``tokens`` is its first token
    sources: tuple[str, ...] = ()  # per token of ``tokens``: SOURCE_TARGET or the accepted draft's source
    result: GenerationResult | None = None  # set when the sequence finished
    error: Exception | None = None  # set instead when it failed (tokens streamed before stay valid)
    logprobs: tuple[TokenLogprob, ...] = ()  # per token of ``tokens``, when the request asked
    # Why each token of ``tokens`` was drafted (None: the target's own, or no evidence given).
    evidence: tuple[DraftEvidence | None, ...] = ()
    rejected: tuple[RejectedDraft, ...] = ()  # the draft the target turned down (engine.rejected_line)


@dataclass(frozen=True)
class RejectedDraft:
    """A draft token the target scored and turned down, proposed where the step's own token went."""

    token: int
    source: str  # the drafter's source, or SOURCE_DRAFT when it gave none
    evidence: DraftEvidence | None


@dataclass(frozen=True)
class StepReport:
    """One step as a whole: what its stages did, and when (``time.time_ns()``), for
    whoever traces or measures steps (the service's observer); the engine keeps none of it."""

    decoding: int  # sequences decoding
    verified: int  # draft tokens the forward pass scored
    accepted: int  # of those, accepted
    width: int  # 1 + the most drafts one sequence verified
    tokens: int  # tokens the forward pass fed, prefill chunks included
    scoring_ns: int  # the forward pass began
    accepting_ns: int  # acceptance began
    done_ns: int  # acceptance ended
