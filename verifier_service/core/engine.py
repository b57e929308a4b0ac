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

Each step asks the proposers for every decoding sequence's draft in one
call (``proposing``: the drafter, and any proposer beside it, such as a draft
head, whose drafts are merged into one per sequence). A request with a fixed K verifies its whole draft, a chain; one that
leaves K to the engine (``num_speculative_tokens=None``) asks for a tree of
guesses (several continuations at the places the drafter is unsure) and
verifies the nodes ``planner.plan_verification`` finds worth their cost,
from their evidence and the measured cost of the step's tokens. A tree's
nodes are verified in one pass under an ancestor mask (``kv_cache``) and
accepted along the target's own path (``rejection.accept_tree_*``).

The stages live beside this loop: ``step`` (a step's rows, chunks and the
layout of its kept logits), ``proposing``, ``planner``, ``target`` (the packed
pass), ``acceptance`` and ``observer`` (what a step reports, and its cost).

``reference_greedy`` is the plain, obviously-correct path (full recompute, no
cache, no batching) that the tests hold the fast path against.
"""

from __future__ import annotations

import itertools
import logging
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import cast

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from verifier_service.core.acceptance import decide, first_token, pass_choices
from verifier_service.core.calibration import StepCostModel, calibrated_step_cost
from verifier_service.core.drafting import DraftProposer, DraftRequest, DraftStep, FinishedSequence, Predictions
from verifier_service.core.engine_config import DEFAULT_MAX_SEQUENCE_TOKENS, MAX_PREDICTIONS, EngineConfig, check_request
from verifier_service.core.generation import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    SOURCE_DRAFT,
    SOURCE_TARGET,
    GenerationRequest,
    GenerationResult,
    RejectedDraft,
    SequenceHandle,
    StepOutcome,
    StepReport,
)
from verifier_service.core.invariance import choose_invariance
from verifier_service.core.kv_cache import SlotKVCache, is_chain
from verifier_service.core.linear_kernels import use_linear_kernels
from verifier_service.core.observer import StepClock
from verifier_service.core.planner import Planner, draft_buckets
from verifier_service.core.processing import TokenLogprob, token_logprobs
from verifier_service.core.proposing import Proposers, leading_chain
from verifier_service.core.step import (
    KeptRows,
    PrefillChunk,
    Row,
    SequenceState,
    cache_reads,
    feature_rows,
    rejected_line,
)
from verifier_service.core.target import PackedModel
from verifier_service.core.text import StopStringMatcher

__all__ = ["EngineConfig", "EngineFull", "GenerationRequest", "SpeculativeEngine", "reference_greedy"]

log = logging.getLogger(__name__)

# RoPE variants whose frequencies depend on the longest position in the
# batch: a row's result would depend on its batch-mates.
BATCH_DEPENDENT_ROPE = ("dynamic", "longrope")


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
        beside: Sequence[DraftProposer] = (),
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        check_supported(model)
        self.kernels = use_linear_kernels(model)  # F.linear everywhere until calibrate_step_cost measures
        self.device = next(model.parameters()).device
        self.eos_token_ids = _eos_token_ids(model, tokenizer)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.context_length = context_length(model)
        capacity = self.config.max_sequence_tokens or min(self.context_length, DEFAULT_MAX_SEQUENCE_TOKENS)
        if capacity > self.context_length:
            raise ValueError(f"max_sequence_tokens {capacity} exceeds the model's context of {self.context_length}")
        self.cache = SlotKVCache(self.config.max_batch_size, capacity)
        self.target = PackedModel(model, self.cache, self.vocab_size)
        if self.config.batch_invariant != "off":
            # The largest pass: every slot verifying its most drafts, beside a full prefill chunk
            # and some padding tokens.
            drafts = max(self.config.max_speculative_tokens, self.config.max_adaptive_k, self.config.max_adaptive_nodes)
            most_rows = self.config.max_batch_size * (1 + drafts) + self.config.prefill_chunk_tokens + 64
            invariance = choose_invariance(model, most_rows)
            if self.config.batch_invariant == "on" or not invariance.linear_tile:
                self.target.invariance = invariance
            log.info(
                "batch-invariant passes %s (--batch-invariant %s)", "on" if self.target.invariance else "off", self.config.batch_invariant
            )
        # The drafter, then the proposers beside it (a draft head), asked in this order.
        self.proposers = Proposers(proposer, beside, self.vocab_size)
        if self.proposers.wants_features:
            self.target.capture_features()
        self._slots: list[SequenceState | None] = [None] * self.config.max_batch_size
        self._decoding = 0  # slots [0, _decoding) hold the decoding sequences
        self._prefilling: list[SequenceState] = []  # oldest first
        self._session_ids = (f"seq-{n}" for n in itertools.count())
        self.last_step: StepReport | None = None  # the latest step that ran a forward pass
        # Called after each step with (handle, features, tokens) per sequence that got tokens:
        # features[i] is the target's feature at the position that produced tokens[i] (head.train).
        self.feature_listener: Callable[[SequenceHandle, torch.Tensor, list[int]], None] | None = None
        self.target.check_slot_attention()
        # Measured here unless given (kept in calibration_folder across starts, when set).
        self.step_cost = step_cost or calibrated_step_cost(self, calibration_folder)
        self.target.padding = self.step_cost.padding
        self.planner = Planner(self.step_cost)

    @property
    def proposer(self) -> DraftProposer | None:
        """The drafter, asked first (``Proposers.drafter``); the proposers beside it stay when it is swapped."""
        return self.proposers.drafter

    @proposer.setter
    def proposer(self, proposer: DraftProposer | None) -> None:
        self.proposers.drafter = proposer

    @property
    def passes(self) -> str:
        """How every pass is shaped (fixed shapes, ``invariance``, or as each pass's kernels find
        fastest) and what computes it (``llama_pass`` or transformers' modules)."""
        invariance = self.target.invariance
        shapes = f"batch-invariant: {invariance.describe()}" if invariance else "free shapes"
        return f"{shapes}; computed by {'llama_pass' if self.target.lean is not None else 'transformers'}"

    @property
    def reads_per_token(self) -> bool:
        """Whether each token a pass verifies reads its row's cached tokens itself (decode
        attention a call entry per token, none shared by a row's tokens), not once per row:
        what an extra draft token costs then grows with its row's context (``step.cache_reads``)."""
        invariance = self.target.invariance
        return invariance is not None and invariance.token_attention and invariance.entry_tokens == 1

    @property
    def slot_count(self) -> int:
        """Cache slots: sequences that can run at once (``config.max_batch_size``)."""
        return len(self._slots)

    def run_pass(self, decode_rows: list[tuple[int, list[int]]], segments: list, keep: list[int]) -> torch.Tensor:
        """One packed forward pass outside any step, for measuring its cost (``calibration``):
        ``decode_rows``, ``segments`` and ``keep`` as ``PackedModel.forward`` takes them."""
        return self.target.forward(decode_rows, segments, keep)

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
    def _active(self) -> list[SequenceState]:
        return cast(list[SequenceState], self._slots[: self._decoding])  # slots below _decoding are never empty

    def listen_features(self, listener: Callable[[SequenceHandle, torch.Tensor, list[int]], None] | None) -> None:
        """Hand every step's features to ``listener`` (see ``feature_listener``); None stops."""
        if listener is not None:
            self.target.capture_features()
        self.feature_listener = listener

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
        """Every rule a request must meet (``engine_config.check_request``): an ``InvalidRequest``
        naming the field (and the flag that sets its limit), fit to show the client."""
        check_request(request, self.config, self.vocab_size, self.cache.capacity)

    def add(self, request: GenerationRequest) -> SequenceHandle:
        """Take a free slot and queue the request for prefill; its first token comes from a later ``step``."""
        self.validate(request)
        if not self.free_slots:
            raise EngineFull(f"all {len(self._slots)} cache slots are in use")
        slot = self._slots.index(None)
        seed = request.sampling.seed if request.sampling.seed is not None else secrets.randbits(63)
        sequence = SequenceState(request, next(self._session_ids), seed, slot, list(request.prompt_ids))
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

    def _sequence_of(self, handle: SequenceHandle) -> SequenceState | None:
        """The live sequence ``handle`` names (None once its slot freed)."""
        return next((seq for seq in self._slots if seq is not None and seq.handle is handle), None)

    def abort_all(self) -> list[SequenceHandle]:
        """Drop every sequence: recovery after a failed step. The cache memory stays allocated."""
        dropped = [sequence for sequence in self._slots if sequence is not None]
        self._slots = [None] * len(self._slots)
        self._decoding, self._prefilling = 0, []
        self._close_sessions(dropped)
        return [sequence.handle for sequence in dropped]

    def _fail(self, sequence: SequenceState, error: Exception) -> None:
        """End one sequence with ``error``; its slot frees at the end of the step, and its batch goes on."""
        log.error("request %r failed (its batch goes on)", sequence.request.request_id, exc_info=error)
        sequence.finish_reason, sequence.error = FINISH_ERROR, error

    def _alone(self, sequence: SequenceState, work: Callable, *args):
        """``work(*args)``: work that belongs to ``sequence`` alone. If it raises, that
        sequence fails (``_fail``) and this returns None; no other sequence is touched."""
        try:
            return work(*args)
        except Exception as error:
            self._fail(sequence, error)
            return None

    def _close_sessions(self, ended: list[SequenceState]) -> None:
        """Tell the proposers these sequences ended. Drafting is an optimisation: its failure is logged, never raised."""
        sessions = [FinishedSequence(seq.session_id, seq.tokens, seq.request.scope) for seq in ended if seq.proposed]
        if sessions:
            self.proposers.close(sessions)

    # -- the step ------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[StepOutcome]:
        """One round for the decoding sequences, with prefill chunks riding along:
        propose, plan, verify (one packed pass), accept, commit."""
        self.last_step = None
        outcomes = self._retire()  # cancelled since the last step
        if not self.busy:
            return outcomes
        rows, context = self.propose()
        chunks = self._plan_prefill()
        # Where each token reads its row's cache, every draft token verified reads it again.
        per_token = context / len(rows) if self.reads_per_token and rows else 0.0
        self.planner.plan(rows, sum(chunk.length for chunk in chunks), context, per_token)
        clock = StepClock(self.step_cost, len(rows))
        scored = self.target.score(rows, chunks, self._alone)
        clock.accepting()
        kept = KeptRows.of(scored.rows, scored.chunks)
        decisions = self.accept(scored.rows, scored.logits, kept)
        self._keep_predictions(scored.rows, scored.logits, kept)
        self.last_step = clock.report(scored, decisions, cache_reads(scored.rows, self.reads_per_token))
        self._keep_logprobs(scored.rows, scored.logits, decisions, kept)
        outcomes += self._commit_all(scored.rows, decisions)
        outcomes += self._finish_prefills(scored.chunks, scored.logits, kept)
        if scored.features is not None:
            self._use_features(scored.features, feature_rows(scored.rows, decisions, scored.chunks, kept), outcomes)
        self.planner.age()
        return outcomes + self._retire()

    def propose(self) -> tuple[list[Row], int]:
        """Every decoding sequence's row, with its draft from one call to the proposers for the
        whole batch, and the cached tokens the rows' attention reads (``step.cache_reads``)."""
        rows = [Row(sequence, [], [], False) for sequence in self._active]
        context = cache_reads(rows)
        asking = [row for row in rows if self._speculates(row.sequence)]
        if not asking:
            return rows, context
        step = DraftStep(len(rows), context, self.planner)
        requests = [self._draft_request(row.sequence, step) for row in asking]
        for row, draft in zip(asking, self.proposers.propose(requests)):
            row.sequence.proposed = row.asked = True
            row.draft, row.parents, row.evidence, row.chain = draft
            if self.target.invariance is not None:  # exact along a draft's leading chain only (``_draft_request``)
                keep = leading_chain(row.parents)
                row.draft, row.parents, row.evidence, row.chain = (
                    row.draft[:keep],
                    row.parents[:keep],
                    row.evidence[:keep],
                    min(row.chain, keep),
                )
            row.tree = not is_chain(row.parents)
            row.buckets = draft_buckets(row.evidence, row.parents)
        return rows, context

    def _draft_request(self, sequence: SequenceState, step: DraftStep) -> DraftRequest:
        """What the proposers are asked for one sequence; the feedback, predictions and feature
        it carries go once."""
        adaptive = sequence.request.num_speculative_tokens is None
        request = DraftRequest(
            sequence.session_id,
            sequence.tokens,
            self._draft_budget(sequence),
            verified=sequence.verified,
            accepted=sequence.accepted,
            # Batch-invariant passes draft chains: a tree node off its leading chain reads its
            # ancestors' cache columns with its siblings' between them, and CPU attention sums
            # columns in blocks whose bounds follow the columns a call reads, so it is not the
            # token plain decoding computes at its position.
            max_nodes=self.config.max_adaptive_nodes if adaptive and self.target.invariance is None else 0,
            predictions=sequence.predictions,
            scope=sequence.request.scope,
            feature=sequence.feature,
            adaptive=adaptive,
            calibration=sequence.calibration,
            step=step,
        )
        sequence.predictions = sequence.feature = None
        return request

    def _plan_prefill(self) -> list[PrefillChunk]:
        """This step's prefill chunks, oldest prompt first, within ``prefill_chunk_tokens``."""
        budget, chunks = self.config.prefill_chunk_tokens, []
        for sequence in self._prefilling:
            if budget <= 0:
                break
            if sequence.finish_reason is not None:
                continue
            length = min(budget, len(sequence.request.prompt_ids) - sequence.prefilled)
            chunks.append(PrefillChunk(sequence, sequence.prefilled, length))
            budget -= length
        return chunks

    def accept(self, rows: list[Row], logits: torch.Tensor, kept: KeptRows) -> list[tuple[list[int], int] | None]:
        """(accepted draft nodes, next_token) per row (``acceptance.decide``), or None for a row
        whose shaping or sampling failed (that sequence alone fails)."""
        choices = pass_choices(rows, logits[: kept.decoded])
        return [
            self._alone(row.sequence, decide, row, logits[kept.span(index)], choices[kept.span(index)], self.eos_token_ids)
            for index, row in enumerate(rows)
        ]

    def _commit_all(self, rows: list[Row], decisions: list[tuple[list[int], int] | None]) -> list[StepOutcome]:
        """Each decided row's accepted tokens into its sequence (``_commit``)."""
        outcomes = []
        for row, decision in zip(rows, decisions):
            if decision is not None:  # None: its sampling failed
                outcome = self._alone(row.sequence, self._commit, row, *decision)
                if outcome is not None:
                    outcomes.append(outcome)
        return outcomes

    def _use_features(self, features: torch.Tensor, produced: dict[SequenceState, list[int]], outcomes: list[StepOutcome]) -> None:
        """The step's features [kept, hidden]: to the listener, with the tokens they produced,
        and, for a proposer that drafts from them at the next propose, the feature that
        produced each still-decoding sequence's last token."""
        if self.feature_listener is not None:
            by_handle = {sequence.handle: sequence for sequence in produced}
            for outcome in outcomes:
                sequence = by_handle.get(outcome.sequence)
                if sequence is not None and outcome.tokens:
                    rows = produced[sequence][: len(outcome.tokens)]
                    self.feature_listener(outcome.sequence, features[rows], list(outcome.tokens))
        if not self.proposers.wants_features:
            return
        for sequence in self._active:
            if sequence in produced and sequence.finish_reason is None and self._speculates(sequence):
                sequence.feature = features[produced[sequence][-1]]

    def _keep_logprobs(self, rows: list[Row], logits: torch.Tensor, decisions: list[tuple[list[int], int] | None], kept: KeptRows) -> None:
        """For the rows whose requests ask, the target's log-probabilities of the tokens each
        decision emits, kept until ``_commit`` cuts them to what it emits."""
        for index, (row, decision) in enumerate(zip(rows, decisions)):
            top = row.sequence.request.logprobs
            if decision is not None and top is not None:
                path, token = decision
                tokens = [row.draft[node] for node in path] + [token]
                row.logprobs = self._alone(row.sequence, token_logprobs, logits[kept.path(index, path)], tokens, top)

    def _keep_predictions(self, rows: list[Row], logits: torch.Tensor, kept: KeptRows) -> None:
        """The target's top ``successor_top_k`` at each position the pass scored, for the
        drafter's successor table: one ``topk`` over the whole pass, kept per speculating
        row until its next propose (rejected nodes included: the target scored them too)."""
        k = min(self.config.successor_top_k, MAX_PREDICTIONS, self.vocab_size)
        if not k or not any(row.asked for row in rows):
            return
        top = logits[: kept.decoded].topk(k, dim=-1).indices.tolist()
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

    def _commit(self, row: Row, path: list[int], token: int) -> StepOutcome:
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

    def _finish_prefills(self, chunks: list[PrefillChunk], logits: torch.Tensor, kept: KeptRows) -> list[StepOutcome]:
        """Advance prefill progress, scoring the prompt tokens of the chunks whose requests ask;
        a completed prompt samples its first token and starts decoding (or, asked for no
        tokens, ends). ``logits``: the step's, each chunk's where ``kept`` says."""
        done = []
        for index, (sequence, first, length) in enumerate(chunks):  # all first: starting to decode may move another's slot
            chunk_logits = logits[kept.chunk(index)]
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
            sampled = self._alone(sequence, first_token, sequence, row_logits[None], self.eos_token_ids)
            if sampled is None:  # failed, still in the prefilling list: _retire frees its slot
                continue
            self._prefilling.remove(sequence)
            sequence.stats.target_forward_passes += 1
            self._start_decoding(sequence)
            emitted = self._alone(sequence, self._emit, sequence, [sampled])
            logprobs: tuple[TokenLogprob, ...] = ()
            if emitted is not None and sequence.request.logprobs is not None:
                logprobs = tuple(self._alone(sequence, token_logprobs, row_logits[None], emitted, sequence.request.logprobs) or ())
                sequence.logprobs += logprobs
            if emitted is not None:
                outcomes.append(
                    StepOutcome(sequence.handle, emitted, first=True, sources=(SOURCE_TARGET,) * len(emitted), logprobs=logprobs)
                )
        return outcomes

    def _keep_prompt_logprobs(self, sequence: SequenceState, first: int, logits: torch.Tensor) -> None:
        """The log-probabilities of the prompt tokens a chunk's ``logits`` [length, vocab] scored:
        position p's row scores token p + 1, so a chunk from ``first`` scores tokens first + 1
        on, and the prompt's last position, which scores the first generated token, none.
        Prompt [5, 6, 7] in chunks (0, 2), (2, 1): rows 0, 1 score 6, 7; row 2 nothing."""
        prompt = sequence.request.prompt_ids
        count = min(len(logits), len(prompt) - 1 - first)
        if count > 0:
            top = sequence.request.prompt_logprobs or 0
            sequence.prompt_logprobs += token_logprobs(logits[:count], prompt[first + 1 : first + 1 + count], top, ranks=True)

    def _start_decoding(self, sequence: SequenceState) -> None:
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

    def _speculates(self, sequence: SequenceState) -> bool:
        return bool(self.proposers) and sequence.request.num_speculative_tokens != 0

    def _draft_budget(self, sequence: SequenceState) -> int:
        # Never draft past max_new_tokens: the step always adds one token of
        # its own (recovered or bonus), so K drafts can fill at most K + 1.
        remaining = sequence.request.max_new_tokens - len(sequence.generated)
        k = sequence.request.num_speculative_tokens
        return max(0, min(self.config.max_adaptive_k if k is None else k, remaining - 1))

    def _emit(self, sequence: SequenceState, tokens: list[int]) -> list[int]:
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

    def _result(self, sequence: SequenceState) -> GenerationResult:
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
