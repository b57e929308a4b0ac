"""The decode loop: prefill, propose, verify, accept, for a batch of sequences.

One loop serves every strategy. Each ``step`` is one packed forward pass of
the target (``kv_cache``) carrying, for every decoding sequence, its last
token and the drafts chosen for verification, and chunks of the prompts
waiting to be prefilled. A sequence with no drafts (``num_speculative_tokens
= 0``, or a proposer with nothing to say) feeds one token and samples one:
plain decoding. With drafts it feeds ``[last token] + drafts`` and keeps
what ``rejection`` accepts. The words accepted / rejected / recovered /
bonus are defined in ``rejection``.

Prefill is chunked and batched (Sarathi-Serve's stall-free batching): a
step carries at most ``prefill_chunk_tokens`` prompt tokens, from as many
waiting prompts as fit, oldest first, so a long prompt delays the running
sequences by one chunk's compute per step instead of stopping them for its
whole length. Only a prompt's last token gets logits (the LM head over the
vocabulary is ~20% of a token's compute); the step that feeds it samples the
sequence's first token. A request that asks for its prompt's log-probabilities
(``prompt_logprobs``) keeps the logits of every position of its chunks, and
each chunk is turned into log-probabilities in the step that feeds it, so the
logits a step holds stay within its ``prefill_chunk_tokens`` positions however
long the prompt; position p's logits score prompt token p + 1.

Sequences ``add`` (into a free cache slot) and leave when they finish or are
cancelled, so a scheduler can run continuous batching on top of ``step``,
which reports what happened to each sequence as a ``StepOutcome``;
``generate`` is the simple driver.

Each step asks the proposer for every decoding sequence's draft in one
call. A request with a fixed K verifies its whole draft, a chain; one that
leaves K to the engine (``num_speculative_tokens=None``) asks for a tree of
guesses (several continuations at the places the drafter is unsure) and
verifies the nodes ``planner.plan_verification`` finds worth their cost,
from their evidence and the measured cost of the step's tokens. A tree's
nodes are verified in one pass under an ancestor mask (``kv_cache``) and
accepted along the target's own path (``rejection.accept_tree_*``).

``reference_greedy`` is the plain, obviously-correct path (full recompute, no
cache, no batching) that the tests hold the fast path against.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdec.flags import setting
from verifier_service.core.calibration import StepCostModel, calibrated_step_cost
from verifier_service.core.drafting import DraftEvidence, DraftProposer, DraftRequest, FinishedSequence, Predictions, ProposedDraft
from verifier_service.core.errors import InvalidRequest
from verifier_service.core.generation import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    SOURCE_DRAFT,
    SOURCE_TARGET,
    GenerationRequest,
    GenerationResult,
    GenerationStats,
    RejectedDraft,
    SequenceHandle,
    StepOutcome,
    StepReport,
)
from verifier_service.core.kv_cache import STEP_KWARG, SlotKVCache, is_chain, plan_step, tree_depths, use_slot_attention
from verifier_service.core.linear_kernels import engaged, use_linear_kernels
from verifier_service.core.planner import Planner, SequenceCalibration, evidence_bucket
from verifier_service.core.processing import Prefixes, TokenHistory, TokenLogprob, chain_paths, shape_logits, token_logprobs, tree_paths
from verifier_service.core.rejection import (
    accept_greedy,
    accept_sampled,
    accept_tree_greedy,
    accept_tree_sampled,
    warp_probs,
)
from verifier_service.core.text import StopStringMatcher
from verifier_service.head.model import FeatureCapture, HeadDrafter
from verifier_service.head.proposer import HeadProposer

log = logging.getLogger(__name__)

# Cache positions per slot when neither the flag nor a shorter model context
# says otherwise: 16 slots x 4096 tokens of the default model is 3 GB of
# float32 cache, touched on the CPU only as far as requests reach.
DEFAULT_MAX_SEQUENCE_TOKENS = 4096
# The most predictions per position the drafter keeps (its successor table's bound).
MAX_PREDICTIONS = 16
# RoPE variants whose frequencies depend on the longest position in the
# batch: a row's result would depend on its batch-mates.
BATCH_DEPENDENT_ROPE = ("dynamic", "longrope")

# One 4D tensor for every packed pass: a 4D mask makes transformers skip
# building its own (slot_attention masks from the StepLayout instead).
_NO_MASK = torch.ones((1, 1, 1, 1), dtype=torch.bool)


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings; each is also a flag of the service (``specdec.flags``)."""

    # Hard cap on K per step: the verify pass widens with K, and on CPU the
    # cost of scoring more than ~9 tokens a row stops being nearly free.
    max_speculative_tokens: int = setting(16, minimum=0, help="the most draft tokens a request may ask to verify per step")
    # n-gram chains past ~8 tokens are rarely all right (bench: K=8 ~ best K).
    max_adaptive_k: int = setting(
        8, minimum=1, formerly=["adaptive-max-k"], help="draft depth asked for when K is adaptive; the planner verifies what pays"
    )
    # The planner picks from these by expected tokens per second of step, so
    # asking for more costs the drafter's time, not the target's: on a GPU a
    # pass of 64 tokens costs about what one of 1 does, and wide trees pay.
    max_adaptive_nodes: int = setting(
        16,
        minimum=0,
        formerly=["adaptive-max-nodes"],
        help="draft tree nodes asked for when K is adaptive (0: chains only); the planner verifies those worth their cost",
    )
    # On a 2-core CPU a step of 16 rows costs ~2x a step of 1; more rows stop
    # paying long before memory runs out.
    max_batch_size: int = setting(16, minimum=1, help="cache slots: sequences decoding or prefilling at once")
    # None: the model's context, at most DEFAULT_MAX_SEQUENCE_TOKENS. Memory:
    # max_batch_size x this x the model's bytes per token.
    max_sequence_tokens: int | None = setting(
        None, minimum=1, help="KV cache positions per request, prompt + max_new_tokens (none: the model's context, at most 4096)"
    )
    # Bounds a request's hold on a batch slot.
    max_new_tokens_limit: int = setting(
        4096, minimum=1, flag="max-new-tokens", formerly=["max-new-tokens-limit"], help="the longest generation one request may ask for"
    )
    # Each stop string is searched for in every new piece of output, and
    # streaming holds back up to its length.
    max_stop_strings: int = setting(16, minimum=1, formerly=["stop-strings-limit"], help="stop strings one request may give")
    max_stop_string_length: int = setting(256, minimum=1, formerly=["stop-string-length-limit"], help="characters per stop string")
    # Larger chunks use the GEMMs better (per-token cost falls ~2x from 64 to
    # 256 tokens on CPU) but stall the running sequences longer; 256 costs
    # them about a 2-3 decode steps' time.
    prefill_chunk_tokens: int = setting(256, minimum=1, help="prompt tokens one step may prefill alongside the running sequences")
    # Readiness waits on it only when no calibration is stored: ~21 s measures
    # every count for the default model on an idle 2-core CPU; on a busy one the
    # coarse counts come first, and real steps refine the rest (calibration.py).
    calibration_budget_s: float = setting(
        30.0, minimum=0.0, help="seconds a start without a stored step-cost calibration may spend measuring one"
    )
    # The target's own top predictions at every position a step scores, sent to
    # the drafter (its successor table, which drafts where n-grams find nothing).
    # Top-8 after a token pair held the next token 44% of the time on open text.
    successor_top_k: int = setting(
        8, minimum=0, help="the target's top predictions per scored position sent to the drafter (0: none; at most 16)"
    )

    # Each level is one small batched matmul chain; the planner verifies only the
    # head tokens whose measured acceptance pays for their place in the pass.
    draft_head_depth: int = setting(
        4, minimum=0, formerly=["head-depth"], help="tokens deep the trained draft head (--draft-head) drafts per step (0: none)"
    )

    # Each entry costs a column write at every verified position of the request.
    max_logit_bias: int = setting(300, minimum=0, formerly=["logit-bias-limit"], help="logit_bias entries one request may give")
    # Each asked-for alternative costs a top-k per emitted token; OpenAI allows 20.
    max_logprobs: int = setting(20, minimum=0, help="the most alternatives per token a request may ask log-probabilities of")
    # A prompt's log-probabilities are kept per position (1 + alternatives values) until the
    # request ends and then rendered into its answer; the logits behind them never exceed one
    # prefill chunk. 4096 covers the default cache's longest prompt.
    max_prompt_logprobs_tokens: int = setting(
        4096, minimum=0, help="the longest prompt (in tokens) whose log-probabilities one request may ask for (prompt_logprobs, echo)"
    )

    def __post_init__(self) -> None:
        if self.successor_top_k > MAX_PREDICTIONS:
            raise ValueError(f"successor_top_k must be at most {MAX_PREDICTIONS} (what the drafter keeps), got {self.successor_top_k}")

    def check_logit_bias_count(self, entries: int) -> None:
        """``InvalidRequest`` for a ``logit_bias`` of more than --max-logit-bias entries. The
        front doors call it on the count alone, before converting or checking any entry (a
        600k-entry map took its conversion's time first), and ``validate`` again."""
        if entries > self.max_logit_bias:
            limit = self.max_logit_bias
            raise InvalidRequest("logit_bias", f"{{field}} takes at most {limit} tokens (--max-logit-bias), got {entries}")


@dataclass(eq=False)
class _Sequence:
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
    head_feature: torch.Tensor | None = None  # the target's feature at its last token, for the draft head's next step
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
class _Row:
    """One decoding sequence's part in a step."""

    sequence: _Sequence
    draft: list[int]  # what the proposer offered (the nodes the engine can use: _usable)
    buckets: list[tuple]  # adaptive.evidence_bucket of each draft token
    asked: bool  # the proposer was asked this step (feedback goes back next time)
    evidence: list[DraftEvidence | None] = field(default_factory=list)  # the drafter's, per draft token (None: none given)
    parents: list[int] = field(default_factory=list)  # each draft token's parent (-1: the last token); a chain's [-1, 0, 1, ...]
    tree: bool = False  # the draft branches
    chain: int = 0  # its first tokens that are the drafter's chain (parents -1, 0, 1, ...): what feedback is about
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


@dataclass(frozen=True)
class KeptRows:
    """Which of a step's kept logits (and features) belong to which decode row and draft node.

    Each decode row owns ``verify + 1`` of them, in row order: its last token's, then each
    verified node's (node i's gave the token after node i). The prefill chunks' kept
    positions follow, from ``decoded`` on. Built once a step is scored; acceptance,
    log-probabilities, predictions and features ask it instead of walking the rows.
    """

    bounds: tuple[int, ...]  # row i owns [bounds[i], bounds[i + 1])

    @classmethod
    def of(cls, rows: Sequence[_Row]) -> KeptRows:
        return cls(tuple(itertools.accumulate((row.verify + 1 for row in rows), initial=0)))

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


def rejected_line(parents: list[int], verified: int, path: list[int]) -> list[int]:
    """The verified draft nodes the target turned down where the accepted ``path`` ends: the
    first child of its last node (of the root when nothing was accepted), that node's first
    child, and so on; the drafter's best guess from there on, which the step's own token
    replaced. ``parents`` as ``_Row.parents``; only the first ``verified`` nodes were scored.

    Chain [-1, 0, 1, 2], 4 verified, path [0] -> [1, 2, 3]. Tree [-1, -1, 0, 0, 2], 5
    verified, path [0] -> [2, 4] (node 3, 0's second child, is another branch; node 1 is
    the root's). Everything verified accepted -> [].
    """
    line, parent = [], path[-1] if path else -1
    while (child := next((node for node in range(verified) if parents[node] == parent), None)) is not None:
        line.append(child)
        parent = child
    return line


class EngineFull(Exception):
    """No free cache slot: the caller queues the request until one frees."""


class SpeculativeEngine:
    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        proposer: DraftProposer | None = None,
        config: EngineConfig | None = None,
        step_cost: StepCostModel | None = None,
        calibration_folder: Path | None = None,
        head: HeadDrafter | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.proposer = proposer
        self.config = config or EngineConfig()
        check_supported(model)
        use_slot_attention(model)
        self.kernels = use_linear_kernels(model)  # F.linear everywhere until calibrate_step_cost measures
        self.device = next(model.parameters()).device
        self.eos_token_ids = _eos_token_ids(model, tokenizer)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.context_length = context_length(model)
        capacity = self.config.max_sequence_tokens or min(self.context_length, DEFAULT_MAX_SEQUENCE_TOKENS)
        if capacity > self.context_length:
            raise ValueError(f"max_sequence_tokens {capacity} exceeds the model's context of {self.context_length}")
        self.cache = SlotKVCache(self.config.max_batch_size, capacity)
        self._slots: list[_Sequence | None] = [None] * self.config.max_batch_size
        self._decoding = 0  # slots [0, _decoding) hold the decoding sequences
        self._prefilling: list[_Sequence] = []  # oldest first
        self._session_ids = (f"seq-{n}" for n in itertools.count())
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.last_step: StepReport | None = None  # the latest step that ran a forward pass
        # The draft head drafts from the features of each pass (the input of the output layer).
        self.head = head
        if head is not None and not self._keeps_logits:
            raise ValueError(f"a draft head needs a model whose forward takes logits_to_keep; {type(model).__name__}'s does not")
        self._capture = FeatureCapture(model) if head is not None else None
        # Called after each step with (handle, features, tokens) per sequence that got tokens:
        # features[i] is the target's feature at the position that produced tokens[i] (train_head).
        self.feature_listener: Callable[[SequenceHandle, torch.Tensor, list[int]], None] | None = None
        self._check_slot_attention()
        # Measured here unless given (kept in calibration_folder across starts, when set).
        self.step_cost = step_cost or calibrated_step_cost(self, calibration_folder)
        self.planner = Planner(self.step_cost)
        # A proposer beside the drafter, priced by the same planner.
        self.head_proposer = HeadProposer(head, self.config.draft_head_depth, self.planner, self.vocab_size) if head else None

    @property
    def slot_count(self) -> int:
        """Cache slots: sequences that can run at once (``config.max_batch_size``)."""
        return len(self._slots)

    def run_pass(self, decode_rows: list[tuple[int, list[int]]], segments: list, keep: list[int]) -> torch.Tensor:
        """One packed forward pass outside any step, for measuring its cost (``calibration``):
        ``decode_rows``, ``segments`` and ``keep`` as ``_forward`` takes them."""
        return self._forward(decode_rows, segments, keep)

    def _check_slot_attention(self) -> None:
        """One token through the scratch slot: allocates every cache layer, and proves
        that every attention layer reads the packed layout (refusing the model if not)."""
        name = type(self.model).__name__
        try:
            self._forward([], [(self.cache.scratch, 0, [0])], keep=[])
        except NotImplementedError as error:
            raise ValueError(f"{name} cannot be served: {error}") from error
        layers = getattr(self.model.config, "num_hidden_layers", None)
        if not self.cache.keys or (layers is not None and len(self.cache.keys) != layers):
            raise ValueError(
                f"{name}'s attention layers do not all receive the packed step layout "
                f"({len(self.cache.keys)} of {layers} did); it cannot be served"
            )

    # -- public driver -------------------------------------------------------

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Run requests to completion, as many at once as slots allow; results in request order."""
        for request in requests:
            self.validate(request)
        waiting = list(enumerate(requests))[::-1]
        index_of: dict[SequenceHandle, int] = {}
        results: dict[int, GenerationResult] = {}
        while waiting or self.busy:
            while waiting and self.free_slots:
                index, request = waiting.pop()
                index_of[self.add(request)] = index
            for outcome in self.step():
                if outcome.error is not None:
                    self.abort_all()
                    raise outcome.error
                if outcome.result is not None and outcome.sequence in index_of:
                    results[index_of[outcome.sequence]] = outcome.result
        return [results[index] for index in range(len(requests))]

    # -- membership ----------------------------------------------------------

    @property
    def active(self) -> list[SequenceHandle]:
        """The decoding sequences, in slot order."""
        return [sequence.handle for sequence in self._active]

    @property
    def _active(self) -> list[_Sequence]:
        return cast(list[_Sequence], self._slots[: self._decoding])  # slots below _decoding are never empty

    def listen_features(self, listener: Callable[[SequenceHandle, torch.Tensor, list[int]], None] | None) -> None:
        """Hand every step's features to ``listener`` (see ``feature_listener``); None stops."""
        if listener is not None and not self._keeps_logits:
            raise ValueError(f"features need a model whose forward takes logits_to_keep; {type(self.model).__name__}'s does not")
        self.feature_listener = listener
        if listener is not None and self._capture is None:
            self._capture = FeatureCapture(self.model)

    @property
    def busy(self) -> bool:
        return bool(self._decoding or self._prefilling)

    @property
    def free_slots(self) -> int:
        return self._slots.count(None)

    def cache_usage(self) -> tuple[float, float]:
        """(share of the cache's token positions held, share of its slots in use), 0 to 1.
        Safe from any thread (for metrics): it reads a copy, so it may be a step old."""
        held = [sequence for sequence in list(self._slots) if sequence is not None]
        return sum(sequence.cached for sequence in held) / (self.cache.slots * self.cache.capacity), len(held) / self.cache.slots

    def validate(self, request: GenerationRequest) -> None:
        """Every rule a request must meet, in one place: an ``InvalidRequest`` naming the
        field (and the flag that sets its limit), fit to show the client."""
        config = self.config
        if not request.prompt_ids:
            raise InvalidRequest("prompt_ids", "prompt is empty: set prompt (text) or prompt_token_ids")
        bad = [t for t in request.prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest("prompt_ids", f"{{field}}: token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if request.max_new_tokens == 0 and request.prompt_logprobs is None:
            raise InvalidRequest(
                "max_new_tokens", "{field} 0 generates nothing; it is taken only to score the prompt (its log-probabilities asked for)"
            )
        if not 0 <= request.max_new_tokens <= config.max_new_tokens_limit:
            raise InvalidRequest(
                "max_new_tokens",
                f"{{field}} must be in [1, {config.max_new_tokens_limit}] (the server's --max-new-tokens), got {request.max_new_tokens}",
            )
        needed = len(request.prompt_ids) + request.max_new_tokens
        if needed > self.cache.capacity:
            raise InvalidRequest(
                "max_new_tokens",
                f"prompt ({len(request.prompt_ids)} tokens) + {{field}} ({request.max_new_tokens}) needs {needed} "
                f"cache positions; this server holds at most {self.cache.capacity} per request",
            )
        if request.num_speculative_tokens is not None and not 0 <= request.num_speculative_tokens <= config.max_speculative_tokens:
            raise InvalidRequest(
                "num_speculative_tokens",
                f"{{field}} must be in [0, {config.max_speculative_tokens}] (unset = adaptive), got {request.num_speculative_tokens}",
            )
        if len(request.stop) > config.max_stop_strings:
            raise InvalidRequest(
                "stop", f"{{field}} takes at most {config.max_stop_strings} strings (--max-stop-strings), got {len(request.stop)}"
            )
        for index, stop in enumerate(request.stop):
            if not stop:
                raise InvalidRequest("stop", f"{{field}}[{index}] is empty; stop strings must be non-empty")
            if len(stop) > config.max_stop_string_length:
                raise InvalidRequest(
                    "stop",
                    f"{{field}}[{index}] is {len(stop)} characters; at most {config.max_stop_string_length} (--max-stop-string-length)",
                )
        sampling = request.sampling
        config.check_logit_bias_count(len(sampling.logit_bias))
        sampling.validate()
        outside = [token for token, _ in sampling.logit_bias if not 0 <= token < self.vocab_size]
        if outside:
            raise InvalidRequest("logit_bias", f"{{field}} names token ids outside the vocabulary [0, {self.vocab_size}): {outside[:5]}")
        if sampling.min_tokens > request.max_new_tokens:
            raise InvalidRequest(
                "min_tokens", f"{{field}} ({sampling.min_tokens}) must not exceed the tokens asked for ({request.max_new_tokens})"
            )
        if request.logprobs is not None and not 0 <= request.logprobs <= config.max_logprobs:
            raise InvalidRequest(
                "logprobs", f"{{field}} must be in [0, {config.max_logprobs}] alternatives (--max-logprobs), got {request.logprobs}"
            )
        self._validate_prompt_logprobs(request)

    def _validate_prompt_logprobs(self, request: GenerationRequest) -> None:
        config, top = self.config, request.prompt_logprobs
        if top is None:
            return
        if not 0 <= top <= config.max_logprobs:
            raise InvalidRequest(
                "prompt_logprobs", f"{{field}} must be in [0, {config.max_logprobs}] alternatives (--max-logprobs), got {top}"
            )
        if len(request.prompt_ids) > config.max_prompt_logprobs_tokens:
            raise InvalidRequest(
                "prompt_logprobs",
                f"the prompt's log-probabilities ({{field}}) are computed for prompts of at most {config.max_prompt_logprobs_tokens} "
                f"tokens (--max-prompt-logprobs-tokens); this one has {len(request.prompt_ids)}",
            )

    def add(self, request: GenerationRequest) -> SequenceHandle:
        """Take a free slot and queue the request for prefill; its first token comes from a later ``step``."""
        self.validate(request)
        if not self.free_slots:
            raise EngineFull(f"all {len(self._slots)} cache slots are in use")
        slot = self._slots.index(None)
        seed = request.sampling.seed if request.sampling.seed is not None else secrets.randbits(63)
        sequence = _Sequence(request, next(self._session_ids), seed, slot, list(request.prompt_ids))
        if request.stop:
            sequence.stops = StopStringMatcher(self.tokenizer, request.stop)
        self._slots[slot] = sequence
        self._prefilling.append(sequence)
        return sequence.handle

    def cancel(self, handle: SequenceHandle) -> None:
        """End a sequence at the next step boundary (its slot frees then); one that
        already ended is left alone."""
        sequence = self._sequence_of(handle)
        if sequence is not None and sequence.finish_reason is None:
            sequence.finish_reason = FINISH_CANCELLED

    def _sequence_of(self, handle: SequenceHandle) -> _Sequence | None:
        """The live sequence ``handle`` names (None once its slot freed)."""
        return next((seq for seq in self._slots if seq is not None and seq.handle is handle), None)

    def abort_all(self) -> list[SequenceHandle]:
        """Drop every sequence: recovery after a failed step. The cache memory stays allocated."""
        dropped = [sequence for sequence in self._slots if sequence is not None]
        self._slots = [None] * len(self._slots)
        self._decoding, self._prefilling = 0, []
        self._close_sessions(dropped)
        return [sequence.handle for sequence in dropped]

    def _fail(self, sequence: _Sequence, error: Exception) -> None:
        """End one sequence with ``error``; its slot frees at the end of the step, and its batch goes on."""
        log.error("request %r failed (its batch goes on)", sequence.request.request_id, exc_info=error)
        sequence.finish_reason, sequence.error = FINISH_ERROR, error

    def _alone(self, sequence: _Sequence, work: Callable, *args):
        """``work(*args)``: work that belongs to ``sequence`` alone. If it raises, that
        sequence fails (``_fail``) and this returns None; no other sequence is touched."""
        try:
            return work(*args)
        except Exception as error:
            self._fail(sequence, error)
            return None

    def _close_sessions(self, ended: list[_Sequence]) -> None:
        """Tell the proposer these sequences ended. Drafting is an optimisation: its failure is logged, never raised."""
        sessions = [FinishedSequence(seq.session_id, seq.tokens, seq.request.scope) for seq in ended if seq.proposed]
        if sessions and self.proposer is not None:
            try:
                self.proposer.close(sessions)
            except Exception:
                log.exception("closing %d drafter sessions failed", len(sessions))

    # -- stages --------------------------------------------------------------

    def propose(self) -> list[_Row]:
        """Drafts for every decoding sequence, from one proposer call for the whole batch."""
        rows = [_Row(sequence, [], [], False) for sequence in self._active]
        asking = [row for row in rows if self._speculates(row.sequence)]
        if not asking:
            return rows
        requests = []
        for row in asking:
            sequence = row.sequence
            sequence.proposed = row.asked = True
            max_nodes = self.config.max_adaptive_nodes if sequence.request.num_speculative_tokens is None else 0
            requests.append(
                DraftRequest(
                    sequence.session_id,
                    sequence.tokens,
                    self._draft_budget(sequence),
                    verified=sequence.verified,
                    accepted=sequence.accepted,
                    max_nodes=max_nodes,
                    predictions=sequence.predictions,
                    scope=sequence.request.scope,
                    feature=sequence.head_feature,
                )
            )
            sequence.predictions = sequence.head_feature = None  # each drafts once
        drafts = [ProposedDraft([]) for _ in requests]
        if self.proposer is not None:
            try:
                drafts = self.proposer.propose(requests)
            except Exception:  # drafts are an optimisation: the step goes on without them
                log.exception("the proposer failed; this step verifies no drafts from it")
        for row, request, draft in zip(asking, requests, drafts):
            nodes, row.parents = self._usable(draft, request.k, request.max_nodes)
            row.draft = [draft.tokens[node] for node in nodes]
            row.chain = next((node for node, parent in enumerate(row.parents) if parent != node - 1), len(row.parents))
            # None given: each token's bucket is its depth's.
            row.evidence = [draft.evidence[node] if node < len(draft.evidence) else None for node in nodes]
        if self.head_proposer is not None:
            self.head_proposer.draft(rows, asking, requests, _cache_reads(rows, []))
        for row in asking:
            row.tree = not is_chain(row.parents)
            firsts: set[int] = set()  # parents whose first child has been seen
            row.buckets = []
            for item, parent, depth in zip(row.evidence, row.parents, tree_depths(row.parents)):
                row.buckets.append(evidence_bucket(item, depth, branch=parent in firsts))
                firsts.add(parent)
        return rows

    def _plan_prefill(self) -> list[tuple[_Sequence, int, int]]:
        """(sequence, first position, length) chunks for this step, oldest prompt first."""
        budget, chunks = self.config.prefill_chunk_tokens, []
        for sequence in self._prefilling:
            if budget <= 0:
                break
            if sequence.finish_reason is not None:
                continue
            length = min(budget, len(sequence.request.prompt_ids) - sequence.prefilled)
            chunks.append((sequence, sequence.prefilled, length))
            budget -= length
        return chunks

    def verify(self, rows: list[_Row], chunks: list[tuple[_Sequence, int, int]]) -> torch.Tensor:
        """One packed forward pass: every row's ``[last token] + verified drafts``, then the prefill chunks.

        Returns logits [kept, vocab]: each row's 1 + verify positions in row
        order, then each chunk's ``_kept_chunk_positions``.
        """
        queries = [[row.sequence.tokens[-1], *row.draft[: row.verify]] for row in rows]
        keep = list(range(sum(map(len, queries))))
        segments, position = [], len(keep)
        for sequence, first, length in chunks:
            prompt = sequence.request.prompt_ids
            segments.append((sequence.slot, first, prompt[first : first + length]))
            keep += [position + offset for offset in _kept_chunk_positions(sequence, first, length)]
            position += length
        trees = [row.query_parents() for row in rows]
        return self._forward([(row.sequence.cached, query) for row, query in zip(rows, queries)], segments, keep, pad=True, trees=trees)

    def _score(self, rows: list[_Row], chunks: list[tuple[_Sequence, int, int]]):
        """``verify``, or, if that packed pass raises, each sequence's part in a pass of its own,
        failing only the sequences whose own pass raises (the cache is safe to redo: a
        pass writes only columns past each sequence's length until it returns).

        Returns (rows, chunks, logits, packed): the rows and chunks that were
        scored, their logits laid out as ``verify``'s, and whether one pass did it.
        """
        try:
            return rows, chunks, self.verify(rows, chunks), True
        except Exception:
            log.exception("a pass of %d rows and %d prefill chunks failed; scoring each sequence alone", len(rows), len(chunks))
        scored_rows, scored_chunks, parts = [], [], []
        for row in rows:
            sequence = row.sequence
            if row.tree:  # a pass of its own is causal: verify the tree's leading chain only
                row.verify = next((node for node in range(row.verify) if row.parents[node] != node - 1), row.verify)
            query = [sequence.tokens[-1], *row.draft[: row.verify]]
            logits = self._alone(sequence, self._forward, [], [(sequence.slot, sequence.cached, query)], list(range(len(query))))
            if logits is not None:
                scored_rows.append(row)
                parts.append(logits)
        for chunk in chunks:
            sequence, first, length = chunk
            prompt = sequence.request.prompt_ids
            keep = _kept_chunk_positions(sequence, first, length)
            logits = self._alone(sequence, self._forward, [], [(sequence.slot, first, prompt[first : first + length])], keep)
            if logits is not None:
                scored_chunks.append(chunk)
                parts.append(logits)
        logits = torch.cat(parts) if parts else torch.empty((0, self.vocab_size), device=self.device)
        return scored_rows, scored_chunks, logits, False

    def accept(self, rows: list[_Row], logits: torch.Tensor, kept: KeptRows) -> list[tuple[list[int], int] | None]:
        """(accepted draft nodes, next_token) per row, or None for a row whose shaping or
        sampling failed (that sequence alone fails); greedy rows whose logits need no
        shaping (``processing``) from one argmax over the whole pass."""
        plain_greedy = any(row.sequence.request.sampling.greedy and not row.sequence.request.sampling.shapes_logits for row in rows)
        choices: list[int] = logits.argmax(dim=-1).tolist() if plain_greedy else []
        decisions: list[tuple[list[int], int] | None] = []
        for index, row in enumerate(rows):
            draft = row.draft[: row.verify]
            sampling = row.sequence.request.sampling
            row_logits: torch.Tensor | None = logits[kept.span(index)]
            row_choices = choices[kept.span(index)]
            if sampling.shapes_logits:
                row_logits = self._alone(row.sequence, self._shape, row, row_logits)
                if row_logits is None:
                    decisions.append(None)
                    continue
                row_choices = row_logits.argmax(dim=-1).tolist() if sampling.greedy else []
            if not sampling.greedy:
                decisions.append(self._alone(row.sequence, self._sample, row, row_logits))
            elif row.tree:
                decisions.append(accept_tree_greedy(row_choices, draft, row.parents[: row.verify]))
            else:
                accepted, token = accept_greedy(row_choices, draft)
                decisions.append((list(range(accepted)), token))
        return decisions

    def _shape(self, row: _Row, logits: torch.Tensor) -> torch.Tensor:
        """One row's logits [verify + 1, vocab] shaped by its request (``processing``), each
        position from its own prefix."""
        sequence, draft = row.sequence, row.draft[: row.verify]
        paths = tree_paths(draft, row.parents[: row.verify]) if row.tree else chain_paths(draft)
        where = Prefixes(sequence.request.prompt_ids, sequence.generated, paths, sequence.history)
        return shape_logits(logits, sequence.request.sampling, where, self.eos_token_ids)

    @torch.inference_mode()
    def step(self) -> list[StepOutcome]:
        """One propose-verify-accept round for the decoding sequences, with a prefill chunk riding along."""
        self.last_step = None
        outcomes = self._retire()  # cancelled since the last step
        if not self.busy:
            return outcomes
        rows = self.propose()
        chunks = self._plan_prefill()
        self.planner.plan(rows, sum(length for _, _, length in chunks), _cache_reads(rows, []))
        decoding = len(rows)
        scoring, started = time.time_ns(), time.perf_counter()
        rows, chunks, logits, packed = self._score(rows, chunks)
        features = self._capture.take() if self._capture is not None else None
        if not packed:  # scored piecemeal: the last pass's features alone, not the step's
            features = None
        accepting = time.time_ns()
        kept = KeptRows.of(rows)
        decoded = kept.decoded
        decisions = self.accept(rows, logits[:decoded], kept)
        if self.head_proposer is not None:
            self.head_proposer.settle(rows, decisions)
        self._keep_predictions(rows, logits[:decoded], kept)
        done = time.time_ns()
        verified = sum(row.verify for row in rows)
        tokens = len(rows) + verified + sum(length for _, _, length in chunks)
        if packed:  # a step scored piecemeal says nothing about a packed step's cost
            self.step_cost.observe(tokens + self.step_cost.padding(tokens), _cache_reads(rows, chunks), time.perf_counter() - started)
        self._keep_logprobs(rows, logits[:decoded], decisions, kept)
        accepted = sum(len(decision[0]) for decision in decisions if decision is not None)
        width = 1 + max((row.verify for row in rows), default=0)
        self.last_step = StepReport(decoding, verified, accepted, width, tokens, scoring, accepting, done)
        for row, decision in zip(rows, decisions):
            if decision is None:  # its sampling failed
                continue
            outcome = self._alone(row.sequence, self._commit, row, *decision)
            if outcome is not None:
                outcomes.append(outcome)
        outcomes += self._finish_prefills(chunks, logits[decoded:])
        if features is not None:
            self._use_features(features, _feature_rows(rows, decisions, chunks, kept), outcomes)
        self.planner.age()
        return outcomes + self._retire()

    def _use_features(self, features: torch.Tensor, produced: dict[_Sequence, list[int]], outcomes: list[StepOutcome]) -> None:
        """The step's features [kept, hidden]: to the listener, with the tokens they produced,
        and, for the head to draft from at the next propose, the feature that produced each
        still-decoding sequence's last token."""
        if self.feature_listener is not None:
            by_handle = {sequence.handle: sequence for sequence in produced}
            for outcome in outcomes:
                sequence = by_handle.get(outcome.sequence)
                if sequence is not None and outcome.tokens:
                    rows = produced[sequence][: len(outcome.tokens)]
                    self.feature_listener(outcome.sequence, features[rows], list(outcome.tokens))
        if self.head is None or not self.config.draft_head_depth:
            return
        for sequence in self._active:
            if sequence in produced and sequence.finish_reason is None and self._speculates(sequence):
                sequence.head_feature = features[produced[sequence][-1]]

    def _keep_logprobs(self, rows: list[_Row], logits: torch.Tensor, decisions: list[tuple[list[int], int] | None], kept: KeptRows) -> None:
        """For the rows whose requests ask, the target's log-probabilities of the tokens each
        decision emits, kept until ``_commit`` cuts them to what it emits."""
        for index, (row, decision) in enumerate(zip(rows, decisions)):
            top = row.sequence.request.logprobs
            if decision is not None and top is not None:
                path, token = decision
                tokens = [row.draft[node] for node in path] + [token]
                row.logprobs = self._alone(row.sequence, token_logprobs, logits[kept.path(index, path)], tokens, top)

    def _keep_predictions(self, rows: list[_Row], logits: torch.Tensor, kept: KeptRows) -> None:
        """The target's top ``successor_top_k`` at each position the pass scored, for the
        drafter's successor table: one ``topk`` over the whole pass, kept per speculating
        row until its next propose (rejected nodes included: the target scored them too)."""
        k = min(self.config.successor_top_k, MAX_PREDICTIONS, self.vocab_size)
        if not k or not any(row.asked for row in rows):
            return
        top = logits.topk(k, dim=-1).indices.tolist()
        for index, row in enumerate(rows):
            if row.asked:
                tokens = row.sequence.tokens
                current = [tokens[-1], *row.draft[: row.verify]]
                previous = [tokens[-2] if len(tokens) > 1 else -1, *(current[parent + 1] for parent in row.parents[: row.verify])]
                scored = [node for node, token in enumerate(previous) if token >= 0]  # a one-token prompt's first has none
                row.sequence.predictions = Predictions(
                    k,
                    [previous[node] for node in scored],
                    [current[node] for node in scored],
                    [token for node in scored for token in top[kept.root(index) + node]],
                )

    # -- helpers -------------------------------------------------------------

    def _forward(
        self,
        decode_rows: list[tuple[int, list[int]]],
        segments: list[tuple[int, int, list[int]]],
        keep: list[int],
        pad: bool = False,
        trees: list[list[int] | None] | None = None,
    ) -> torch.Tensor:
        """Run the model over one packed step and return the logits of the ``keep`` positions [kept, vocab].

        decode_rows: (cached length, query tokens) for slots 0, 1, ...;
        trees: per decode row, its queries' parents, or None for a chain;
        segments: (slot, first position, tokens) for prefill chunks. With
        ``pad``, a step whose token count is measurably slower than a slightly
        larger one is padded to it, the extra tokens going to the scratch slot.
        """
        input_ids = [token for _, query in decode_rows for token in query]
        for _, _, tokens in segments:
            input_ids += tokens
        placed = [(slot, first, len(tokens)) for slot, first, tokens in segments]
        padding = self.step_cost.padding(len(input_ids)) if pad else 0
        if padding:
            placed.append((self.cache.scratch, 0, padding))
            input_ids += [0] * padding
        counts = [(cached, len(query)) for cached, query in decode_rows]
        columns = max((cached + count for cached, count in counts), default=0)
        for slot in range(len(counts)):
            self.cache.ensure_finite(slot, columns)
        layout = plan_step(self.cache, counts, placed, self.device, trees)
        extra = {"logits_to_keep": torch.tensor(keep, dtype=torch.long, device=self.device)} if self._keeps_logits else {}
        with engaged():
            output = self.model(
                input_ids=torch.tensor([input_ids], device=self.device),
                position_ids=layout.position_ids,
                attention_mask=_NO_MASK,
                use_cache=False,
                **{STEP_KWARG: layout},
                **extra,
            )
        for slot, (cached, count) in enumerate(counts):
            self.cache.wrote(slot, cached + count)
        for slot, first, length in placed:
            self.cache.wrote(slot, first + length)
        logits = output.logits[0]  # [kept (or every token), vocab]
        return logits if self._keeps_logits else logits[keep]

    def _commit(self, row: _Row, path: list[int], token: int) -> StepOutcome:
        """Keep the accepted draft nodes ``path`` and the target's ``token`` after them."""
        sequence, stats = row.sequence, row.sequence.stats
        count = len(path)
        stats.target_forward_passes += 1
        if row.asked:  # feedback on the drafter's chain (a tree's first nodes), sent when it is next asked
            on_chain = next((index for index, node in enumerate(path) if node != index or index >= row.chain), len(path))
            sequence.verified, sequence.accepted = min(row.verify, row.chain), on_chain
        if row.verify:
            stats.draft_tokens += row.verify
            stats.accepted_tokens += count
            stats.verify_steps_with_drafts += 1
            stats.steps_with_accepted_drafts += count > 0
        self.planner.learn(row, path)
        if row.tree:  # the path's keys and values into the columns after the last token's
            self.cache.compact(sequence.slot, sequence.cached + 1, path)
        emitted = self._emit(sequence, [row.draft[node] for node in path] + [token])
        sources = [row.buckets[node][0] or SOURCE_DRAFT for node in path] + [SOURCE_TARGET]
        evidence = [row.evidence[node] for node in path] + [None]
        logprobs = tuple((row.logprobs or [])[: len(emitted)])
        sequence.logprobs += logprobs
        rejected = tuple(
            RejectedDraft(row.draft[node], row.buckets[node][0] or SOURCE_DRAFT, row.evidence[node])
            for node in rejected_line(row.parents, row.verify, path)
        )
        return StepOutcome(
            sequence.handle,
            emitted,
            row.verify,
            count,
            sources=tuple(sources[: len(emitted)]),
            logprobs=logprobs,
            evidence=tuple(evidence[: len(emitted)]),
            rejected=rejected if len(emitted) > count else (),  # cut at a stop before the step's own token: nothing was turned down
        )

    def _finish_prefills(self, chunks, logits: torch.Tensor) -> list[StepOutcome]:
        """Advance prefill progress, scoring the prompt tokens of the chunks whose requests ask;
        a completed prompt samples its first token and starts decoding (or, asked for no
        tokens, ends). ``logits``: each chunk's ``_kept_chunk_positions``, in chunk order."""
        done, start = [], 0
        for sequence, first, length in chunks:  # all first: starting to decode may move another's slot
            kept = len(_kept_chunk_positions(sequence, first, length))
            chunk_logits, start = logits[start : start + kept], start + kept
            sequence.prefilled = first + length
            if sequence.request.prompt_logprobs is not None:
                self._alone(sequence, self._keep_prompt_logprobs, sequence, first, chunk_logits)
            if sequence.prefilled == len(sequence.request.prompt_ids) and sequence.finish_reason is None:
                done.append((sequence, chunk_logits[-1]))
        outcomes = []
        for sequence, row_logits in done:
            if sequence.request.max_new_tokens == 0:  # only its prompt was to be scored: _retire frees its slot
                sequence.stats.target_forward_passes += 1
                sequence.finish_reason = FINISH_LENGTH
                continue
            sampled = self._alone(sequence, self._sample_first, sequence, row_logits[None])
            if sampled is None:  # failed, still in the prefilling list: _retire frees its slot
                continue
            self._prefilling.remove(sequence)
            sequence.stats.target_forward_passes += 1
            self._start_decoding(sequence)
            emitted = self._alone(sequence, self._emit, sequence, [sampled[1]])
            logprobs: tuple[TokenLogprob, ...] = ()
            if emitted is not None and sequence.request.logprobs is not None:
                logprobs = tuple(self._alone(sequence, token_logprobs, row_logits[None], emitted, sequence.request.logprobs) or ())
                sequence.logprobs += logprobs
            if emitted is not None:
                outcomes.append(
                    StepOutcome(sequence.handle, emitted, first=True, sources=(SOURCE_TARGET,) * len(emitted), logprobs=logprobs)
                )
        return outcomes

    def _keep_prompt_logprobs(self, sequence: _Sequence, first: int, logits: torch.Tensor) -> None:
        """The log-probabilities of the prompt tokens a chunk's ``logits`` [length, vocab] scored:
        position p's row scores token p + 1, so a chunk from ``first`` scores tokens first + 1
        on, and the prompt's last position, which scores the first generated token, none.
        Prompt [5, 6, 7] in chunks (0, 2), (2, 1): rows 0, 1 score 6, 7; row 2 nothing."""
        prompt = sequence.request.prompt_ids
        count = min(len(logits), len(prompt) - 1 - first)
        if count > 0:
            top = sequence.request.prompt_logprobs or 0
            sequence.prompt_logprobs += token_logprobs(logits[:count], prompt[first + 1 : first + 1 + count], top, ranks=True)

    def _start_decoding(self, sequence: _Sequence) -> None:
        """Move a fully prefilled sequence to slot ``_decoding``, the end of the decoding block."""
        target = self._decoding
        other = self._slots[target]
        if sequence.slot != target:
            if other is None:
                self.cache.move(sequence.slot, target, sequence.prefilled)
            else:  # a prompt still prefilling sits there: they trade places
                self.cache.swap(sequence.slot, target, sequence.prefilled, other.cached)
                other.slot = sequence.slot
            self._slots[sequence.slot], self._slots[target] = other, sequence
            sequence.slot = target
        self._decoding += 1

    def _retire(self) -> list[StepOutcome]:
        """Free the slots of finished and cancelled sequences; their outcomes carry the results."""
        finished = [seq for seq in self._slots if seq is not None and seq.finish_reason is not None]
        if not finished:
            return []
        self._close_sessions(finished)
        for sequence in finished:
            if sequence.slot < self._decoding:  # slots [0, _decoding) hold exactly the decoding sequences
                last = self._slots[self._decoding - 1]
                assert last is not None  # slots below _decoding are never empty
                if last is not sequence:  # the last decoding row fills the gap
                    self.cache.move(last.slot, sequence.slot, last.cached)
                    self._slots[sequence.slot], last.slot = last, sequence.slot
                self._slots[self._decoding - 1] = None
                self._decoding -= 1
            else:
                self._slots[sequence.slot] = None
                if sequence in self._prefilling:
                    self._prefilling.remove(sequence)
        return [
            StepOutcome(sequence.handle, [], error=sequence.error)
            if sequence.error is not None
            else StepOutcome(sequence.handle, [], result=self._result(sequence))
            for sequence in finished
        ]

    def _speculates(self, sequence: _Sequence) -> bool:
        return (self.proposer is not None or self.head is not None) and sequence.request.num_speculative_tokens != 0

    def _draft_budget(self, sequence: _Sequence) -> int:
        # Never draft past max_new_tokens: the step always adds one token of
        # its own (recovered or bonus), so K drafts can fill at most K + 1.
        remaining = sequence.request.max_new_tokens - len(sequence.generated)
        k = sequence.request.num_speculative_tokens
        return max(0, min(self.config.max_adaptive_k if k is None else k, remaining - 1))

    def _usable(self, draft: ProposedDraft, k: int, max_nodes: int) -> tuple[list[int], list[int]]:
        """The draft's nodes the engine can verify, and their parents among them.

        A faulty or foreign drafter may slow a step down but must never crash
        the model or change the output: a node is dropped, with its subtree,
        when its id is outside the vocabulary, its parent is not an earlier
        kept node, it lies deeper than ``k``, or a sibling carries the same
        token; at most ``max_nodes`` nodes are kept (``k`` for a chain).
        Parents that do not match the tokens in number make the draft unusable.
        """
        parents_given = draft.parents
        if parents_given and len(parents_given) != len(draft.tokens):
            return [], []
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
        return nodes, parents

    def _sample(self, row: _Row, logits: torch.Tensor) -> tuple[list[int], int]:
        """Sampled acceptance for one row. logits: [row.verify + 1, vocab]."""
        sequence, draft = row.sequence, row.draft[: row.verify]
        probs = warp_probs(logits, sequence.request.sampling)
        if row.tree:
            return accept_tree_sampled(probs, draft, row.parents[: row.verify], sequence.seed, first_position=len(sequence.generated))
        accepted, token = accept_sampled(probs, draft, sequence.seed, first_position=len(sequence.generated))
        return list(range(accepted)), token

    def _sample_first(self, sequence: _Sequence, logits: torch.Tensor) -> tuple[int, int]:
        """A prompt's first token from its last position's logits [1, vocab]."""
        sampling = sequence.request.sampling
        logits = shape_logits(logits, sampling, Prefixes(sequence.request.prompt_ids, [], [[]], sequence.history), self.eos_token_ids)
        if sampling.greedy:
            return 0, int(logits[0].argmax())
        return accept_sampled(warp_probs(logits, sampling), [], sequence.seed, first_position=len(sequence.generated))

    def _emit(self, sequence: _Sequence, tokens: list[int]) -> list[int]:
        """Append tokens, stopping exactly at EOS, a stop string or max_new_tokens; returns those appended."""
        request, emitted = sequence.request, []
        for token in tokens:
            sequence.generated.append(token)
            sequence.tokens.append(token)
            emitted.append(token)
            if token in self.eos_token_ids:
                sequence.finish_reason = FINISH_STOP
            elif (
                sequence.stops is not None
                and (text := sequence.stops.push(token)) is not None
                and len(sequence.generated) >= request.sampling.min_tokens
            ):  # stop strings count from min_tokens on (vLLM's rule); the text before is kept
                sequence.finish_reason, sequence.stop_text = FINISH_STOP, text
            elif len(sequence.generated) >= request.max_new_tokens:
                sequence.finish_reason = FINISH_LENGTH
            if sequence.finish_reason is not None:
                break
        sequence.stats.generated_tokens = len(sequence.generated)
        return emitted

    def _result(self, sequence: _Sequence) -> GenerationResult:
        assert sequence.finish_reason is not None, "only a finished sequence has a result"
        text = sequence.stop_text
        if text is None:
            text = str(self.tokenizer.decode(sequence.generated, skip_special_tokens=True))
        request = sequence.request
        logprobs = list(sequence.logprobs) if request.logprobs is not None else None
        prompt_logprobs = list(sequence.prompt_logprobs) if request.prompt_logprobs is not None else None
        return GenerationResult(
            request.request_id, list(sequence.generated), text, sequence.finish_reason, sequence.stats, logprobs, prompt_logprobs
        )


def _kept_chunk_positions(sequence: _Sequence, first: int, length: int) -> list[int]:
    """The positions of a prefill chunk (from 0) whose logits a step keeps: every one when
    its request asks for the prompt's log-probabilities, else a completing prompt's last
    alone (it samples the first token), else none."""
    if sequence.request.prompt_logprobs is not None:
        return list(range(length))
    return [length - 1] if first + length == len(sequence.request.prompt_ids) else []


def _feature_rows(
    rows: list[_Row], decisions: list[tuple[list[int], int] | None], chunks: list[tuple[_Sequence, int, int]], kept: KeptRows
) -> dict[_Sequence, list[int]]:
    """Per sequence that got tokens from a step, the rows of the step's kept positions (its
    logits, its features) that produced them: a decode row's root and accepted nodes, a
    completed prompt's last position (after the decode rows')."""
    produced: dict[_Sequence, list[int]] = {}
    for index, (row, decision) in enumerate(zip(rows, decisions)):
        if decision is not None:
            produced[row.sequence] = kept.path(index, decision[0])
    decoded = kept.decoded
    for sequence, first, length in chunks:
        decoded += len(_kept_chunk_positions(sequence, first, length))
        if first + length == len(sequence.request.prompt_ids):
            produced[sequence] = [decoded - 1]
    return produced


def _cache_reads(rows: list[_Row], chunks: list[tuple[_Sequence, int, int]]) -> int:
    """Cached tokens a step's attention reads, about: each decode row its own (a CPU cuts
    the rows into attention calls where reading a longer row's columns would cost more),
    a prefill chunk its slot's earlier tokens."""
    return sum(row.sequence.cached for row in rows) + sum(first for _, first, _ in chunks)


def context_length(model: PreTrainedModel) -> int:
    """Positions the model can attend over (learned position tables end there)."""
    config = model.config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 1 << 20


def check_supported(model: PreTrainedModel) -> None:
    """Refuse models whose rows would not be computed independently of their batch-mates."""
    parameters = getattr(model.config, "rope_parameters", None) or getattr(model.config, "rope_scaling", None) or {}
    candidates = [parameters, *(value for value in parameters.values() if isinstance(value, dict))]
    for candidate in candidates:
        rope_type = candidate.get("rope_type") or candidate.get("type")
        if rope_type in BATCH_DEPENDENT_ROPE:
            raise ValueError(
                f"{type(model).__name__} uses {rope_type!r} RoPE scaling, whose frequencies depend on the longest "
                "position in the batch; batched verification would change a request's output, so it is not served"
            )


def _eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return frozenset()
    return frozenset([ids] if isinstance(ids, int) else ids)


@torch.inference_mode()
def reference_greedy(model: PreTrainedModel, prompt_ids: list[int], max_new_tokens: int, eos_token_ids: frozenset[int]) -> list[int]:
    """Plain greedy decoding by full recomputation: slow, and obviously right."""
    device = next(model.parameters()).device
    tokens = list(prompt_ids)
    generated: list[int] = []
    while len(generated) < max_new_tokens:
        logits = model(input_ids=torch.tensor([tokens], device=device), use_cache=False).logits[0, -1]
        token = int(logits.argmax())
        generated.append(token)
        tokens.append(token)
        if token in eos_token_ids:
            break
    return generated
