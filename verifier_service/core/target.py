"""The target model run over packed steps: one forward pass for every decode row and
prefill chunk of a step (``kv_cache`` lays them out), keeping only the logits asked for.

``PackedModel.score`` is a step's pass: every row's ``[last token] + verified drafts``,
then the prefill chunks, in one pass; if that pass raises, each sequence's part in a pass
of its own, so that only the sequences whose own pass raises fail. ``FeatureCapture``
keeps the output layer's input from each pass, for proposers that draft from the
target's own state and for training them.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from transformers import PreTrainedModel

from verifier_service.core.invariance import Invariance, invariant_pass
from verifier_service.core.kv_cache import STEP_KWARG, SlotKVCache, StepLayout, plan_step, use_slot_attention
from verifier_service.core.linear_kernels import engaged
from verifier_service.core.llama_pass import LlamaPass
from verifier_service.core.step import PrefillChunk, Row, kept_chunk_positions

log = logging.getLogger(__name__)

# One 4D tensor for every packed pass: a 4D mask makes transformers skip
# building its own (slot_attention masks from the StepLayout instead).
_NO_MASK = torch.ones((1, 1, 1, 1), dtype=torch.bool)


class FeatureCapture:
    """Keeps the input of the target's output layer (its last hidden state, at the positions
    whose logits are computed) from every forward pass: a hook, no extra computation."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.features: torch.Tensor | None = None
        self._handle = model.get_output_embeddings().register_forward_pre_hook(self._keep)

    def _keep(self, module, inputs) -> None:
        self.features = inputs[0].detach()

    def take(self) -> torch.Tensor | None:
        """The latest pass's features [positions, hidden], once."""
        features, self.features = self.features, None
        return None if features is None else features.reshape(-1, features.shape[-1])

    def remove(self) -> None:
        self._handle.remove()


class Scored(NamedTuple):
    """What a step's pass scored: the rows and chunks it scored (all of them, unless the
    packed pass failed and some sequences' own passes did too), their logits in
    ``step.KeptRows``'s layout, whether one packed pass did it, and that pass's features
    (None unless captured and packed: piecemeal passes leave the last one's alone)."""

    rows: list[Row]
    chunks: list[PrefillChunk]
    logits: torch.Tensor
    packed: bool
    features: torch.Tensor | None


class PackedModel:
    """The target model over a ``SlotKVCache``: packed passes that keep chosen logits."""

    def __init__(self, model: PreTrainedModel, cache: SlotKVCache, vocab_size: int) -> None:
        self.model, self.cache, self.vocab_size = model, cache, vocab_size
        self.device = next(model.parameters()).device
        use_slot_attention(model)
        # A model whose forward takes logits_to_keep runs its output layer only where asked.
        self.keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        # Tokens to pad a step of this many tokens with (the step cost's, once measured).
        self.padding: Callable[[int], int] = lambda tokens: 0
        self.capture: FeatureCapture | None = None
        # Fixed shapes for every pass, so that a token's logits do not depend on its
        # batch-mates (``invariance``); None: each pass as its kernels find fastest.
        self.invariance: Invariance | None = None
        # The model's forward in one function where it is a Llama (``llama_pass``), else transformers'.
        self.lean = LlamaPass.of(model, cache.capacity)

    def capture_features(self) -> None:
        """Keep every pass's features from now on (``Scored.features``)."""
        if not self.keeps_logits:
            raise ValueError(f"features need a model whose forward takes logits_to_keep; {type(self.model).__name__}'s does not")
        if self.capture is None:
            self.capture = FeatureCapture(self.model)

    def check_slot_attention(self) -> None:
        """One token through the scratch slot: allocates every cache layer, and proves
        that every attention layer reads the packed layout (refusing the model if not)."""
        name = type(self.model).__name__
        try:
            self.forward([], [(self.cache.scratch, 0, [0])], keep=[])
        except NotImplementedError as error:
            raise ValueError(f"{name} cannot be served: {error}") from error
        layers = getattr(self.model.config, "num_hidden_layers", None)
        if not self.cache.keys or (layers is not None and len(self.cache.keys) != layers):
            raise ValueError(
                f"{name}'s attention layers do not all receive the packed step layout "
                f"({len(self.cache.keys)} of {layers} did); it cannot be served"
            )

    def score(self, rows: list[Row], chunks: list[PrefillChunk], alone: Callable) -> Scored:
        """The step's pass (``verify``), or, if that packed pass raises, each sequence's part
        in a pass of its own; ``alone(sequence, work, *args)`` runs one sequence's and fails
        only that sequence if it raises (the cache is safe to redo: a pass writes only
        columns past each sequence's length until it returns)."""
        try:
            logits = self.verify(rows, chunks)
            return Scored(rows, chunks, logits, True, self.capture.take() if self.capture is not None else None)
        except Exception:
            log.exception("a pass of %d rows and %d prefill chunks failed; scoring each sequence alone", len(rows), len(chunks))
        scored_rows, scored_chunks, parts = [], [], []
        for row in rows:
            sequence = row.sequence
            if row.tree:  # a pass of its own is causal: verify the tree's leading chain only
                row.verify = next((node for node in range(row.verify) if row.parents[node] != node - 1), row.verify)
            query = [sequence.tokens[-1], *row.draft[: row.verify]]
            logits = alone(sequence, self.forward, [], [(sequence.slot, sequence.cached, query)], list(range(len(query))))
            if logits is not None:
                scored_rows.append(row)
                parts.append(logits)
        for chunk in chunks:
            sequence, first, length = chunk
            prompt = sequence.request.prompt_ids
            keep = kept_chunk_positions(sequence, first, length)
            logits = alone(sequence, self.forward, [], [(sequence.slot, first, prompt[first : first + length])], keep)
            if logits is not None:
                scored_chunks.append(chunk)
                parts.append(logits)
        if self.capture is not None:
            self.capture.take()  # the last piecemeal pass's alone: not the step's
        logits = torch.cat(parts) if parts else torch.empty((0, self.vocab_size), device=self.device)
        return Scored(scored_rows, scored_chunks, logits, False, None)

    def verify(self, rows: Sequence[Row], chunks: Sequence[PrefillChunk]) -> torch.Tensor:
        """One packed forward pass: every row's ``[last token] + verified drafts``, then the prefill chunks.

        Returns logits [kept, vocab] in ``step.KeptRows``'s layout: each row's 1 + verify
        positions in row order, then each chunk's ``kept_chunk_positions``.
        """
        queries = [[row.sequence.tokens[-1], *row.draft[: row.verify]] for row in rows]
        keep = list(range(sum(map(len, queries))))
        segments, position = [], len(keep)
        for sequence, first, length in chunks:
            prompt = sequence.request.prompt_ids
            segments.append((sequence.slot, first, prompt[first : first + length]))
            keep += [position + offset for offset in kept_chunk_positions(sequence, first, length)]
            position += length
        trees = [row.query_parents() for row in rows]
        return self.forward([(row.sequence.cached, query) for row, query in zip(rows, queries)], segments, keep, pad=True, trees=trees)

    def forward(
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
        padding = self.padding(len(input_ids)) if pad else 0
        if padding:
            placed.append((self.cache.scratch, 0, padding))
            input_ids += [0] * padding
        counts = [(cached, len(query)) for cached, query in decode_rows]
        columns = max((cached + count for cached, count in counts), default=0)
        invariance = self.invariance
        if invariance:  # attention reads whole column tiles, prefill chunks' too
            columns += (-columns) % invariance.column_tile
            for slot, first, length in placed:  # prefill tiles read to their end (kv_cache._tiled_segment)
                end = first + length
                self.cache.ensure_finite(slot, end + (-end) % invariance.prefill_query_tile)
        for slot in range(len(counts)):
            self.cache.ensure_finite(slot, columns)
        layout = plan_step(self.cache, counts, placed, self.device, trees, invariance=invariance)
        kept = torch.tensor(keep, dtype=torch.long, device=self.device) if self.keeps_logits else None
        decode_tokens = sum(count for _, count in counts)
        chunks = tuple((first, length) for _, first, length in placed)
        with engaged(), invariant_pass(invariance, decode_tokens, chunks) if invariance else contextlib.nullcontext():
            logits = self.run(torch.tensor([input_ids], device=self.device), layout, kept)
        for slot, (cached, count) in enumerate(counts):
            self.cache.wrote(slot, cached + count)
        for slot, first, length in placed:
            self.cache.wrote(slot, first + length)
        return logits if self.keeps_logits else logits[keep]

    def run(self, input_ids: torch.Tensor, layout: StepLayout, kept: torch.Tensor | None) -> torch.Tensor:
        """The model over ``input_ids`` [1, tokens] laid out by ``layout``: logits [kept (or
        every token), vocab]. ``llama_pass`` where it takes the model, else transformers' forward."""
        if self.lean is not None:
            return self.lean(input_ids, layout, kept)
        extra = {} if kept is None else {"logits_to_keep": kept}
        output = self.model(
            input_ids=input_ids,
            position_ids=layout.position_ids,
            attention_mask=_NO_MASK,
            use_cache=False,
            **{STEP_KWARG: layout},
            **extra,
        )
        return output.logits[0]
