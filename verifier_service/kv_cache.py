"""A batched KV cache whose rows have different lengths, with rollback.

Layout (our choice among padding and slot-based designs): every layer holds
keys and values as ``[batch, kv_heads, columns, head_dim]`` in a transformers
``DynamicCache``. Row ``b`` keeps its ``lengths[b]`` cached tokens *left-packed*
in columns ``[0, lengths[b])``; columns from there to ``columns`` are padding,
masked out of attention. A verification step appends ``q`` new columns for
every row (the model's own ``torch.cat``), with per-row positions
``lengths[b] + i`` so rotary embeddings see the true token positions.

After the step, ``commit`` keeps the first ``kept[b]`` of row b's new columns
(the last token and its accepted drafts), moves them down to
``[lengths[b], lengths[b] + kept[b])`` and crops the cache to the longest row.
Rejected drafts are thereby rolled back: nothing is recomputed, and the cache
never grows beyond the longest sequence.

Padding columns hold finite stale values (zeros or old rejected entries);
they are multiplied by exactly zero attention weight, so they never leak into
a row's result.

Row with lengths 3, columns 5, step with q = 3, kept = 2:

    before:   [a b c . .]            . = padding
    forward:  [a b c . . x y z]      x = last token, y z = drafts
    commit:   [a b c x y]            z rejected; columns cropped to 5
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


class BatchKVCache:
    def __init__(self) -> None:
        self.cache: DynamicCache | None = None
        self.lengths: list[int] = []  # cached tokens per row

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def columns(self) -> int:
        return self.cache.get_seq_length() if self.cache is not None else 0

    def _layers(self) -> list[DynamicLayer]:
        layers = self.cache.layers
        for layer in layers:
            if type(layer) is not DynamicLayer:
                raise TypeError(
                    f"batched speculative decoding needs full-attention cache layers; "
                    f"this model uses {type(layer).__name__} (sliding-window attention is not supported)"
                )
        return layers

    def add_row(self, row_cache: DynamicCache, length: int) -> None:
        """Append a prefilled single-row cache (``[1, heads, length, dim]``) as the last row."""
        assert row_cache.get_seq_length() == length, "a prefilled row must hold exactly its tokens"
        if self.cache is None or self.batch_size == 0:
            self.cache, self.lengths = row_cache, [length]
            self._layers()
            return
        width = max(self.columns, length)
        for layer, new in zip(self._layers(), row_cache.layers):
            layer.keys = torch.cat([_pad_columns(layer.keys, width), _pad_columns(new.keys, width)], dim=0)
            layer.values = torch.cat([_pad_columns(layer.values, width), _pad_columns(new.values, width)], dim=0)
        self.lengths.append(length)

    def keep_rows(self, rows: list[int]) -> None:
        """Drop every row not listed, in the listed order; crop to the longest kept row."""
        if not rows:
            self.cache, self.lengths = None, []
            return
        index = torch.tensor(rows, dtype=torch.long, device=self._layers()[0].keys.device)
        self.lengths = [self.lengths[row] for row in rows]
        width = max(self.lengths)
        for layer in self._layers():
            layer.keys = layer.keys.index_select(0, index)[:, :, :width]
            layer.values = layer.values.index_select(0, index)[:, :, :width]

    def step_inputs(self, query_lengths: list[int], width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention mask [batch, columns + width] and position ids [batch, width] for a step.

        Row b has ``query_lengths[b]`` real query tokens; the rest of its
        ``width`` are padding, masked like the padding columns of the cache.
        """
        assert len(query_lengths) == self.batch_size
        columns = self.columns
        lengths = torch.tensor(self.lengths, device=device)[:, None]
        cached = torch.arange(columns, device=device)[None, :] < lengths  # [batch, columns]
        offsets = torch.arange(width, device=device)[None, :]
        queried = offsets < torch.tensor(query_lengths, device=device)[:, None]  # [batch, width]
        attention_mask = torch.cat([cached, queried], dim=1).long()
        position_ids = lengths + offsets  # [batch, width]
        return attention_mask, position_ids

    def commit(self, old_columns: int, kept: list[int]) -> None:
        """Keep the first ``kept[b]`` new columns of each row, drop the rest (rollback)."""
        assert len(kept) == self.batch_size
        device = self._layers()[0].keys.device
        rows, sources, targets = [], [], []
        for row, (length, count) in enumerate(zip(self.lengths, kept)):
            if length != old_columns:  # rows already at the right edge need no move
                rows += [row] * count
                sources += range(old_columns, old_columns + count)
                targets += range(length, length + count)
        self.lengths = [length + count for length, count in zip(self.lengths, kept)]
        width = max(self.lengths)
        if rows:
            rows_t = torch.tensor(rows, device=device)
            sources_t = torch.tensor(sources, device=device)
            targets_t = torch.tensor(targets, device=device)
        for layer in self._layers():
            if rows:
                # Sources lie right of every target, so gather-then-scatter is safe.
                layer.keys[rows_t, :, targets_t] = layer.keys[rows_t, :, sources_t]
                layer.values[rows_t, :, targets_t] = layer.values[rows_t, :, sources_t]
            if layer.keys.shape[2] > width:
                layer.keys = layer.keys[:, :, :width]
                layer.values = layer.values[:, :, :width]


def _pad_columns(states: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - states.shape[2]
    if missing == 0:
        return states
    padding = states.new_zeros(states.shape[0], states.shape[1], missing, states.shape[3])
    return torch.cat([states, padding], dim=2)
