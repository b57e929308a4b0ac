"""The decode loop: prefill, propose, verify, accept, for a batch of sequences.

One loop serves every strategy. A request with ``num_speculative_tokens = 0``
(or a proposer with nothing to say) takes the plain path: each step feeds one
token and samples one. With drafts, each step feeds ``[last token] + drafts``
through the target once and keeps what ``rejection`` accepts. The words
accepted / rejected / recovered / bonus are defined in ``rejection``.

Sequences join with ``add`` (prefilled alone, then merged into the batch
cache) and leave when they finish or are cancelled, so a scheduler can run
continuous batching on top of ``step``; ``generate`` is the simple
static-batch driver.

Each step asks the proposer for the whole batch's drafts in one call. A
request with a fixed K verifies its whole draft; a request that leaves K to
the engine (``num_speculative_tokens=None``) verifies as much of it as
``adaptive.choose_width`` finds worth its cost at this batch size.

``reference_greedy`` is the plain, obviously-correct path (full recompute, no
cache, no batching) that the tests hold the fast path against.
"""

from __future__ import annotations

import contextlib
import itertools
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicCache

from verifier_service.adaptive import AcceptanceEstimate, StepCostModel, choose_width
from verifier_service.drafting import DraftProposer, DraftRequest
from verifier_service.kv_cache import BatchKVCache
from verifier_service.rejection import SamplingParams, accept_greedy, accept_sampled, warp_probs

# An adaptive sequence whose drafts keep missing (none found, or none
# accepted) skips the drafter for 1, 2, 4, ... up to this many steps: on
# open-ended text the drafter round trip (~2-3 ms) is otherwise paid every
# step for nothing, ~5% of a CPU step. A hit resets the back-off.
MAX_PROPOSE_BACKOFF_STEPS = 8

# CPU GEMMs (MKL, AVX-512) for the [rows, hidden] x [hidden, vocab] LM head
# run 2-3x slower at 2, 3, 6 or 7 rows than at 4 or 8 (measured: 22 and 33 ms
# at 2 and 3 rows vs 16 ms at 4). Padding the step's rows (batch x width) to a
# multiple of this makes a wider step cheaper than a narrower one.
GEMM_ROW_MULTIPLE = 4

FINISH_STOP = "stop"  # EOS token or a stop string
FINISH_LENGTH = "length"  # max_new_tokens reached
FINISH_CANCELLED = "cancelled"  # the caller gave up (cancel, deadline)


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


@dataclass
class GenerationStats:
    target_forward_passes: int = 0  # prefill included: it yields the first token
    draft_tokens: int = 0
    accepted_tokens: int = 0
    generated_tokens: int = 0
    verify_steps_with_drafts: int = 0

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


class _NoSpan:
    def set_attribute(self, key: str, value) -> None:
        pass


def no_stage_spans(name: str, attributes: dict) -> contextlib.AbstractContextManager:
    """The default stage hook: nothing recorded. The service passes one that opens
    a tracing span per stage (this module stays free of any tracing library)."""
    return contextlib.nullcontext(_NoSpan())


StageSpans = Callable[[str, dict], contextlib.AbstractContextManager]


@dataclass(frozen=True)
class EngineConfig:
    # Hard cap on K per step: the verify pass widens with K, and on CPU the
    # cost of scoring more than ~9 tokens stops being nearly free.
    max_speculative_tokens: int = 16
    # Drafts asked for when K is adaptive; choose_width then verifies a prefix.
    # n-gram chains past ~8 tokens are rarely all right (bench: K=8 ~ best K).
    adaptive_max_k: int = 8


@dataclass
class _Sequence:
    request: GenerationRequest
    session_id: str
    seed: int
    tokens: list[int]  # prompt + generated, including the last (uncached) token
    generated: list[int] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    # The previous step's verdict on this sequence's draft, fed back to the drafter.
    verified: int = 0
    accepted: int = 0
    proposed: bool = False  # the proposer has a session for it
    misses: int = 0  # consecutive steps whose draft gave nothing accepted
    skip_proposals: int = 0  # steps left before the proposer is asked again
    finish_reason: str | None = None
    stop_text: str | None = None  # output text cut before the stop string that ended it


class SpeculativeEngine:
    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        proposer: DraftProposer | None = None,
        config: EngineConfig | None = None,
        step_cost: StepCostModel | None = None,
        stage_spans: StageSpans = no_stage_spans,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.proposer = proposer
        self.config = config or EngineConfig()
        self.device = next(model.parameters()).device
        self.eos_token_ids = _eos_token_ids(model, tokenizer)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.cache = BatchKVCache()
        self.active: list[_Sequence] = []
        self._session_ids = (f"seq-{n}" for n in itertools.count())
        # Measured on this 2-core CPU with the default model: ~48 ms a step plus
        # ~8 ms a row. The service replaces it with a start-up calibration.
        self.step_cost = step_cost or StepCostModel.linear(0.048, 0.008)
        self.stage_spans = stage_spans

    # -- public driver -------------------------------------------------------

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Run requests as one batch to completion; results in request order."""
        results: dict[int, GenerationResult] = {}
        pending = {}
        for index, request in enumerate(requests):
            sequence, finished = self.add(request)
            if finished is not None:
                results[index] = finished
            else:
                pending[id(sequence)] = index
        while self.active:
            for sequence, result in self.step():
                results[pending[id(sequence)]] = result
        return [results[index] for index in range(len(requests))]

    # -- stages --------------------------------------------------------------

    def validate(self, request: GenerationRequest) -> None:
        if not request.prompt_ids:
            raise ValueError("prompt is empty")
        bad = [t for t in request.prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if request.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
        if request.num_speculative_tokens is not None and not 0 <= request.num_speculative_tokens <= self.config.max_speculative_tokens:
            raise ValueError(
                f"num_speculative_tokens must be in [0, {self.config.max_speculative_tokens}], "
                f"got {request.num_speculative_tokens}"
            )
        request.sampling.validate()

    @torch.inference_mode()
    def add(self, request: GenerationRequest) -> tuple[_Sequence, GenerationResult | None]:
        """Prefill a request and emit its first token; join the batch unless already finished."""
        self.validate(request)
        seed = request.sampling.seed if request.sampling.seed is not None else secrets.randbits(63)
        sequence = _Sequence(request, next(self._session_ids), seed, list(request.prompt_ids))
        row_cache = DynamicCache()
        input_ids = torch.tensor([request.prompt_ids], device=self.device)
        logits = self.model(input_ids=input_ids, cache=row_cache, use_cache=True).logits[0, -1:]
        sequence.stats.target_forward_passes += 1
        first = self._sample(sequence, logits, draft=[])[1]
        self._emit(sequence, [first])
        if sequence.finish_reason is not None:
            return sequence, self._result(sequence)
        self.cache.add_row(row_cache, len(request.prompt_ids))
        self.active.append(sequence)
        return sequence, None

    def abort_all(self) -> list[_Sequence]:
        """Drop every active sequence and the batch cache: recovery after a failed step."""
        dropped, self.active, self.cache = self.active, [], BatchKVCache()
        ended = [(seq.session_id, seq.tokens) for seq in dropped if seq.proposed]
        if ended:
            self.proposer.close(ended)
        return dropped

    def cancel(self, sequence: _Sequence) -> None:
        """End a sequence at the next step boundary (its row leaves the batch then)."""
        if sequence.finish_reason is None:
            sequence.finish_reason = FINISH_CANCELLED

    def propose(self) -> tuple[list[list[int]], list[bool]]:
        """Drafts for every active row, from one proposer call for the whole batch,
        and which rows the proposer was asked for (the others are backed off or plain)."""
        rows = [i for i, sequence in enumerate(self.active) if self._speculates(sequence) and self._due(sequence)]
        drafts: list[list[int]] = [[] for _ in self.active]
        asked = [False] * len(self.active)
        if not rows:
            return drafts, asked
        requests = []
        for i in rows:
            sequence = self.active[i]
            sequence.proposed = True
            requests.append(DraftRequest(
                sequence.session_id, sequence.tokens, self._draft_budget(sequence), sequence.verified, sequence.accepted
            ))
        for i, request, draft in zip(rows, requests, self.proposer.propose(requests)):
            drafts[i] = self._usable_prefix(draft[: request.k])
            asked[i] = True
        return drafts, asked

    @staticmethod
    def _due(sequence: _Sequence) -> bool:
        if sequence.skip_proposals:
            sequence.skip_proposals -= 1
            return False
        return True

    @staticmethod
    def _back_off(sequence: _Sequence, accepted: int) -> None:
        """After a proposal: reset on a hit, else skip the next 1, 2, 4, ... steps (adaptive K only)."""
        if accepted or sequence.request.num_speculative_tokens is not None:
            sequence.misses = 0
            return
        sequence.misses += 1
        sequence.skip_proposals = min(MAX_PROPOSE_BACKOFF_STEPS, 1 << (sequence.misses - 1))

    def fit_drafts(self, drafts: list[list[int]]) -> list[list[int]]:
        """Cut adaptive rows' drafts to the width worth verifying at this batch size."""
        adaptive = [seq.request.num_speculative_tokens is None for seq in self.active]
        if not any(adaptive) or not any(drafts):
            return drafts
        fixed_width = 1 + max((len(d) for d, a in zip(drafts, adaptive) if not a), default=0)
        alphas = [seq.acceptance.alpha for seq in self.active]
        width = choose_width([len(d) for d in drafts], alphas, self.step_cost.cost, padded_width, fixed_width)
        return [draft[: width - 1] if is_adaptive else draft for draft, is_adaptive in zip(drafts, adaptive)]

    def _usable_prefix(self, tokens: Sequence[int]) -> list[int]:
        """The draft up to its first id outside the vocabulary: a faulty or
        foreign drafter may slow a step down but must never crash the model."""
        usable = []
        for token in tokens:
            if not 0 <= token < self.vocab_size:
                break
            usable.append(token)
        return usable

    @torch.inference_mode()
    def verify(self, drafts: list[list[int]]) -> torch.Tensor:
        """One target forward pass over every row's ``[last token] + draft``.

        Returns logits [batch, width, vocab], width = 1 + longest draft.
        """
        width = padded_width(len(drafts), 1 + max(len(draft) for draft in drafts))
        rows = [[seq.tokens[-1], *draft] + [0] * (width - 1 - len(draft)) for seq, draft in zip(self.active, drafts)]
        input_ids = torch.tensor(rows, device=self.device)  # [batch, width]
        attention_mask, position_ids = self.cache.step_inputs([1 + len(d) for d in drafts], width, self.device)
        output = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=self.cache.cache,
            use_cache=True,
        )
        return output.logits

    def accept(self, drafts: list[list[int]], logits: torch.Tensor) -> list[tuple[int, int]]:
        """(num_accepted, next_token) per row; greedy rows in one vectorised call."""
        decisions: list[tuple[int, int] | None] = [None] * len(drafts)
        greedy_rows = [i for i, seq in enumerate(self.active) if seq.request.sampling.greedy]
        if greedy_rows:
            width = logits.shape[1]
            padded = torch.tensor([drafts[i] + [-1] * (width - 1 - len(drafts[i])) for i in greedy_rows], device=logits.device)
            lengths = torch.tensor([len(drafts[i]) for i in greedy_rows], device=logits.device)
            counts, tokens = accept_greedy(logits[greedy_rows], padded.view(len(greedy_rows), width - 1), lengths)
            for i, count, token in zip(greedy_rows, counts.tolist(), tokens.tolist()):
                decisions[i] = (count, token)
        for i, sequence in enumerate(self.active):
            if decisions[i] is None:
                decisions[i] = self._sample(sequence, logits[i, : len(drafts[i]) + 1], drafts[i])
        return decisions

    @torch.inference_mode()
    def step(self) -> list[tuple[_Sequence, GenerationResult]]:
        """One propose-verify-accept round for the whole batch; returns finished sequences."""
        if not self.active:
            return []
        finished = self._retire_finished()  # cancelled since the last step
        if not self.active:
            return finished
        with self.stage_spans("specdec.propose", {"specdec.batch_size": len(self.active)}) as span:
            drafts, asked = self.propose()
            drafts = self.fit_drafts(drafts)
            span.set_attribute("specdec.sequences", sum(asked))
            span.set_attribute("specdec.draft_tokens", sum(map(len, drafts)))
        old_columns = self.cache.columns
        started = time.perf_counter()
        with self.stage_spans("specdec.score", {"specdec.batch_size": len(self.active)}) as span:
            logits = self.verify(drafts)
            span.set_attribute("specdec.width", logits.shape[1])
            span.set_attribute("specdec.tokens_scored", logits.shape[0] * logits.shape[1])
        with self.stage_spans("specdec.accept", {"specdec.draft_tokens": sum(map(len, drafts))}) as span:
            decisions = self.accept(drafts, logits)
            span.set_attribute("specdec.accepted", sum(count for count, _ in decisions))
        self.step_cost.observe(logits.shape[0] * logits.shape[1], time.perf_counter() - started)
        self.cache.commit(old_columns, [1 + count for count, _ in decisions])
        for sequence, draft, (count, token), was_asked in zip(self.active, drafts, decisions, asked):
            stats = sequence.stats
            stats.target_forward_passes += 1
            if was_asked:  # feedback on the drafter's draft, sent when it is next asked
                sequence.verified, sequence.accepted = len(draft), count
                self._back_off(sequence, count)
            if draft:
                stats.draft_tokens += len(draft)
                stats.accepted_tokens += count
                stats.verify_steps_with_drafts += 1
            # Without a draft this only ages the evidence, so a sequence that stopped
            # speculating (low alpha) drifts back to the prior and tries again.
            sequence.acceptance.update(len(draft), count)
            self._emit(sequence, draft[:count] + [token])
        return finished + self._retire_finished()

    # -- helpers -------------------------------------------------------------

    def _speculates(self, sequence: _Sequence) -> bool:
        return self.proposer is not None and sequence.request.num_speculative_tokens != 0

    def _draft_budget(self, sequence: _Sequence) -> int:
        # Never draft past max_new_tokens: the step always adds one token of
        # its own (recovered or bonus), so K drafts can fill at most K + 1.
        remaining = sequence.request.max_new_tokens - len(sequence.generated)
        k = sequence.request.num_speculative_tokens
        return max(0, min(self.config.adaptive_max_k if k is None else k, remaining - 1))

    def _sample(self, sequence: _Sequence, logits: torch.Tensor, draft: list[int]) -> tuple[int, int]:
        """Acceptance for one row. logits: [len(draft) + 1, vocab]."""
        sampling = sequence.request.sampling
        if sampling.greedy:  # the batch's own rule, on a batch of one
            drafts = torch.tensor(draft, dtype=torch.long, device=logits.device).view(1, len(draft))
            counts, tokens = accept_greedy(logits[None], drafts, torch.tensor([len(draft)], device=logits.device))
            return int(counts[0]), int(tokens[0])
        probs = warp_probs(logits, sampling)
        return accept_sampled(probs, draft, sequence.seed, first_position=len(sequence.generated))

    def _emit(self, sequence: _Sequence, tokens: list[int]) -> None:
        """Append tokens, stopping exactly at EOS, a stop string or max_new_tokens."""
        request = sequence.request
        for token in tokens:
            sequence.generated.append(token)
            sequence.tokens.append(token)
            if token in self.eos_token_ids:
                sequence.finish_reason = FINISH_STOP
            elif request.stop and self._hits_stop_string(sequence):
                sequence.finish_reason = FINISH_STOP
            elif len(sequence.generated) >= request.max_new_tokens:
                sequence.finish_reason = FINISH_LENGTH
            if sequence.finish_reason is not None:
                break
        sequence.stats.generated_tokens = len(sequence.generated)

    def _hits_stop_string(self, sequence: _Sequence) -> bool:
        text = self.tokenizer.decode(sequence.generated, skip_special_tokens=True)
        positions = [text.find(stop) for stop in sequence.request.stop if stop in text]
        if not positions:
            return False
        sequence.stop_text = text[: min(positions)]  # the stop string itself is not returned
        return True

    def _retire_finished(self) -> list[tuple[_Sequence, GenerationResult]]:
        finished = [(seq, self._result(seq)) for seq in self.active if seq.finish_reason is not None]
        ended = [(seq.session_id, seq.tokens) for seq, _ in finished if seq.proposed]
        if ended:
            self.proposer.close(ended)
        if finished:
            keep = [i for i, seq in enumerate(self.active) if seq.finish_reason is None]
            self.cache.keep_rows(keep)
            self.active = [self.active[i] for i in keep]
        return finished

    def _result(self, sequence: _Sequence) -> GenerationResult:
        text = sequence.stop_text
        if text is None:
            text = self.tokenizer.decode(sequence.generated, skip_special_tokens=True)
        return GenerationResult(sequence.request.request_id, list(sequence.generated), text, sequence.finish_reason, sequence.stats)


def padded_width(batch: int, width: int) -> int:
    """Smallest width >= ``width`` whose ``batch * width`` rows suit the GEMM.

    A single row (plain decoding of one sequence) stays a fast GEMV.
    padded_width(1, 2) -> 4; padded_width(1, 6) -> 8; padded_width(2, 3) -> 4.
    """
    if batch * width == 1:
        return 1
    while (batch * width) % GEMM_ROW_MULTIPLE:
        width += 1
    return width


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
