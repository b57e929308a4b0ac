"""The slot KV cache, and the packed forward pass that reads and writes it.

Cache layout (as gpt-fast's static cache, with a slot per sequence): every
layer holds keys and values as ``[slots + 1, kv_heads, capacity, head_dim]``,
allocated once. A sequence owns one slot; its cached token at position p sits
in column p. Writing a step's new keys is an in-place ``index_put`` at each
row's own positions, rolling back rejected drafts is bookkeeping (the
sequence's length simply does not cover them; the next step overwrites
them), and nothing is ever concatenated or reallocated. The last slot is
scratch: padding tokens write there.

A forward pass is *packed* (as vLLM's): every token of the step, from every
sequence, is one row of a single ``[1, tokens]`` input, so the model's linear
layers see exactly the tokens that need computing, however many each
sequence brings (one for plain decoding, 1 + drafts for verification, a
chunk of prompt for prefill). Only attention needs to know which token
belongs to whom, and ``slot_attention`` (registered with transformers'
``AttentionInterface``) does that from the ``StepLayout`` passed down as a
keyword argument. Two kinds of segment:

* **decode rows**, the sequences in slots ``[0, rows)``: one batched SDPA
  call per group of consecutive rows (``partition_rows``: all of them in one
  on a GPU; on a CPU, cut where padding would cost more than another call),
  each row's queries padded to the group's widest row and masked to
  ``column <= its own position``. Grouped-query heads are folded into the
  query axis (``[rows, kv_heads, groups * width, dim]``), so the cached keys
  are read in place: no ``repeat_kv`` copy of the cache.
* **prefill chunks**: one SDPA call per chunk, causal over its own slot's
  columns ``[0, first_position + length)``.

Row b of a decode group with 3 cached tokens verifying [x, d1, d2]: the new
keys go to columns 3, 4, 5; query x sees columns 0..3, d1 sees 0..4, d2 0..5.
If only d1 is accepted, the sequence's length becomes 5 (x and d1 cached),
and column 5 is overwritten by the next step.

**Tree rows** (a decode row whose drafts branch, parents given per query):
query i of a row sits at position ``cached + depth(i)`` (the position ids
RoPE sees) but writes column ``cached + i``, and sees the cached columns
plus the columns of its own ancestors and itself, nothing of its siblings'
subtrees (SpecInfer's tree attention). Row b with 3 cached tokens verifying
x with children d1 and d2 (parents [-1, 0, 0]): d1 and d2 both sit at
position 4, write columns 4 and 5, and each sees columns 0..3 and its own.
A chain is the tree whose parents are [-1, 0, 1, ...]; a step with no
branching row builds the mask exactly as before. After acceptance, a path
whose nodes are not in consecutive columns is moved into place
(``SlotKVCache.compact``), so the cache again holds the accepted tokens in
column order.

Columns a row does not own but an SDPA call reads (a decode group reads
``[0, its longest row's)`` for every row) are masked out; they must still hold finite
numbers, since a masked weight of exactly 0 times NaN is NaN. Each slot
tracks how many leading columns hold finite values (``extent``) and zeroes
ahead of it in blocks before they are read.

Sliding-window layers (Mistral, and the sliding layers of mixed models) get
the window in their masks from the ``sliding_window`` argument transformers
passes to attention; soft-capping and attention sinks are refused.

Called without a ``StepLayout`` (transformers' own ``generate``, the
reference path), ``slot_attention`` is exactly transformers' SDPA attention,
so a model switched to it behaves as before for every other caller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from verifier_service.core.invariance import QUERY_MULTIPLE, Invariance

ATTENTION_NAME = "specdec_slots"
STEP_KWARG = "specdec_step"  # the keyword that carries a StepLayout down to attention
# Columns zeroed ahead of a slot's extent at a time: zeroing is one fill per
# layer, so doing it in blocks keeps it off almost every step.
ZERO_BLOCK_COLUMNS = 256


class SlotKVCache:
    """Per-layer key and value tensors ``[slots + 1, kv_heads, capacity, head_dim]``.

    Layers are allocated at their first write, from the shapes the model
    gives them (so any head count and head dim works), as ``torch.empty``:
    memory a slot never reaches is never touched on the CPU.
    """

    def __init__(self, slots: int, capacity: int) -> None:
        if slots < 1 or capacity < 1:
            raise ValueError(f"need slots >= 1 and capacity >= 1, got {slots} x {capacity}")
        self.slots, self.capacity = slots, capacity
        self.scratch = slots  # the extra slot padding tokens write to
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.extent = [0] * (slots + 1)  # leading columns of each slot holding finite values

    def layer(self, index: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's (keys, values), allocated on first use like ``like`` ([1, kv_heads, tokens, dim])."""
        keys = self.keys.get(index)
        if keys is None:
            shape = (self.slots + 1, like.shape[1], self.capacity, like.shape[3])
            keys = self.keys[index] = torch.empty(shape, dtype=like.dtype, device=like.device)
            self.values[index] = torch.empty(shape, dtype=like.dtype, device=like.device)
            # A new layer has no finite columns anywhere, whatever other layers hold.
            if len(self.keys) == 1:
                self.extent = [0] * (self.slots + 1)
        return keys, self.values[index]

    @property
    def layers(self) -> list[int]:
        return sorted(self.keys)

    def ensure_finite(self, slot: int, columns: int) -> None:
        """Make columns ``[0, columns)`` of ``slot`` finite in every layer (zeros where never written)."""
        start = self.extent[slot]
        if start >= columns:
            return
        stop = min(self.capacity, max(columns, start + ZERO_BLOCK_COLUMNS))
        for index in self.keys:
            self.keys[index][slot, :, start:stop].zero_()
            self.values[index][slot, :, start:stop].zero_()
        self.extent[slot] = stop

    def wrote(self, slot: int, columns: int) -> None:
        """Record that a forward pass wrote ``slot`` up to column ``columns``."""
        self.extent[slot] = max(self.extent[slot], columns)

    def move(self, source: int, target: int, columns: int) -> None:
        """Copy the first ``columns`` columns of ``source`` into ``target`` (every layer)."""
        if source == target or columns == 0:
            return
        for index in self.keys:
            self.keys[index][target, :, :columns] = self.keys[index][source, :, :columns]
            self.values[index][target, :, :columns] = self.values[index][source, :, :columns]
        self.extent[target] = max(self.extent[target], columns)

    def compact(self, slot: int, start: int, sources: list[int]) -> None:
        """Move columns ``start + sources[i]`` of ``slot`` to ``start + i`` (every layer): an
        accepted tree path into consecutive columns. ``sources`` increases, so no move
        overwrites a column a later one reads; columns already in place are not copied.

        compact(0, 10, [0, 2, 5]): column 12 goes to 11, 15 to 12; column 10 stays.
        """
        first = next((i for i, source in enumerate(sources) if source != i), len(sources))
        if first == len(sources):
            return
        assert all(a < b for a, b in zip(sources, sources[1:])), f"sources must increase, got {sources}"
        device = next(iter(self.keys.values())).device if self.keys else None
        index = torch.tensor([start + source for source in sources[first:]], device=device)
        stop = start + len(sources)
        for layer in self.keys:
            self.keys[layer][slot, :, start + first : stop] = self.keys[layer][slot, :, index]
            self.values[layer][slot, :, start + first : stop] = self.values[layer][slot, :, index]

    def swap(self, first: int, second: int, first_columns: int, second_columns: int) -> None:
        """Exchange two slots' contents, through the scratch slot."""
        self.move(first, self.scratch, first_columns)
        self.move(second, first, second_columns)
        self.move(self.scratch, second, first_columns)


@dataclass(frozen=True)
class Segment:
    """Tokens ``[start, start + length)`` of the packed input: one sequence's prefill chunk
    (or padding), at positions ``first_position ...`` of slot ``slot``."""

    slot: int
    start: int
    length: int
    first_position: int


# Splitting the decode rows into several attention calls (CPU only, see
# ``partition_rows``): a query of a row costs about a third of reading the
# row's cached keys and values once (measured with SmolLM2's 3 kv heads of 64
# on a 2-core AVX-512 CPU: 0.23 us per row and column to read, 0.076 more per
# query), and one more call costs about what this many (row, column, query)
# units do, in its SDPA, gather and scatter per layer.
READ_QUERIES = 3
CALL_UNITS = 1500


@dataclass
class DecodeGroup:
    """Decode rows ``[first, first + rows)`` of a step, attended in one SDPA call: each
    row's queries padded to ``width``, the keys read up to ``columns``."""

    first: int
    rows: int
    width: int
    columns: int  # the furthest column any of its rows writes, + 1
    start: int  # packed index of its first decode token (its rows' tokens are consecutive)
    tokens: int  # its decode tokens
    gather: torch.Tensor  # [rows, width] packed token of each (row, query); padding repeats the last
    query_positions: torch.Tensor  # [rows, width] position of each (row, query)
    scatter_rows: torch.Tensor  # [tokens] row (in the group) of each of its decode tokens
    scatter_queries: torch.Tensor  # [tokens] its query index in the row
    widths: list[int]  # [rows] each row's own query count (the rest of ``width`` is padding)
    cached_rows: list[int]  # [rows] each row's cached length: its query i writes column cached + i
    # Only when some row of the group branches: [rows, width, width] bool, query i
    # sees query j's column (j is i or an ancestor), and each row's cached length [rows].
    ancestors: torch.Tensor | None = None
    cached: torch.Tensor | None = None
    # Every row as wide as ``width`` (from ``widths``): its tokens lie as [rows, width] in the
    # packed order, so reshapes take the place of ``gather`` and the scatter.
    uniform: bool = field(init=False)
    _masks: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.uniform = all(count == self.width for count in self.widths)

    def mask(self, groups: int, window: int | None) -> torch.Tensor:
        """[rows, 1, groups * width, columns] bool, True = attend; one per (groups, window)."""
        key = (groups, window)
        mask = self._masks.get(key)
        if mask is None:
            if self.ancestors is None:
                mask = _visible(self.query_positions[:, :, None], torch.arange(self.columns, device=self.query_positions.device), window)
            else:
                mask = self._tree_mask(window)
            mask = self._masks[key] = mask[:, None].repeat(1, 1, groups, 1)
        return mask

    def fixed_mask(self, groups: int, window: int | None, invariance: Invariance, capacity: int) -> torch.Tensor:
        """``mask`` as a batch-invariant pass reads it, built once for every layer: queries
        padded to a multiple of ``query_tile`` (unless each token is a call entry of its own),
        columns to a multiple of ``column_tile``, hidden."""
        key = (groups, window, invariance, capacity)
        mask = self._masks.get(key)
        if mask is None:
            mask = self.mask(groups, window)
            if invariance.token_attention:
                mask = _pad_group_mask(mask, groups, self.width)
            else:
                mask = _pad_query_mask(mask, invariance.query_tile)
            mask = self._masks[key] = _pad_columns(mask, invariance.column_tile, capacity)[0]
        return mask

    def additive_mask(self, groups: int, window: int | None, invariance: Invariance, capacity: int, dtype: torch.dtype) -> torch.Tensor:
        """``fixed_mask`` as the kernel adds it to the scores (0 where a query attends, -inf
        elsewhere), in ``dtype``, built once for every layer: what attention makes of a bool
        mask in each call, the same bits."""
        key = ("additive", groups, window, invariance, capacity, dtype)
        mask = self._masks.get(key)
        if mask is None:
            visible = self.fixed_mask(groups, window, invariance, capacity)
            mask = self._masks[key] = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))
        return mask

    def token_calls(self, column_tile: int, capacity: int, entry_tokens: int = 1) -> TokenCalls:
        """The calls token attention makes for this group (``plan_token_calls``), built once
        for every layer: token i of a row reads its write column + 1, to a whole
        ``column_tile`` (at most ``capacity``)."""
        key = ("token calls", column_tile, capacity, entry_tokens)
        calls = self._masks.get(key)
        if calls is None:
            reads = [
                [min(capacity, column + (-column) % column_tile) for column in range(cached + 1, cached + 1 + count)]
                for cached, count in zip(self.cached_rows, self.widths)
            ]
            calls = self._masks[key] = plan_token_calls(reads, self.query_positions.device, entry_tokens)
        return calls

    def _tree_mask(self, window: int | None) -> torch.Tensor:
        """[rows, width, columns]: each query sees its row's cached columns and its
        ancestors' (and its own) new column; under a window, only those whose
        positions are within it."""
        assert self.ancestors is not None and self.cached is not None
        rows, width, device = self.rows, self.width, self.query_positions.device
        # Room for every row's new columns, then cut to the columns read.
        span = self.columns + width
        columns = torch.arange(span, device=device)
        visible = (columns[None, None, :] < self.cached[:, None, None]).expand(rows, width, span).clone()
        new_columns = self.cached[:, None] + torch.arange(width, device=device)[None, :]  # [rows, width]
        visible.scatter_(2, new_columns[:, None, :].expand(rows, width, width), self.ancestors)
        if window is not None:
            # A cached column's position is its index; a new column's, its query's position.
            column_positions = columns[None, :].repeat(rows, 1)
            column_positions.scatter_(1, new_columns, self.query_positions)
            visible &= column_positions[:, None, :] > self.query_positions[:, :, None] - window
        return visible[:, :, : self.columns]


@dataclass
class StepLayout:
    """Where each packed token of one forward pass belongs. Built by ``plan_step``."""

    cache: SlotKVCache
    tokens: int
    write_slots: torch.Tensor  # [tokens]
    write_positions: torch.Tensor  # [tokens]
    position_ids: torch.Tensor  # [1, tokens]
    # Decode rows: slots [0, rows), in groups of consecutive rows, one attention call each.
    rows: int
    decode_tokens: int
    groups: list[DecodeGroup]
    segments: list[Segment]
    # Batch-invariant attention (``invariance``; None: off): fixed query counts per call and
    # columns read to a multiple of its ``column_tile``, hidden past each query's own.
    invariance: Invariance | None = None
    _masks: dict = field(default_factory=dict)

    def tile_mask(self, tile: int, window: int | None, capacity: int) -> torch.Tensor:
        """[prefill_query_tile, columns] bool: the causal mask of prefill tile ``tile``, positions
        [tile * prefill_query_tile, (tile + 1) * prefill_query_tile) (slots a chunk does not fill are padding,
        each seeing as its position would), reading the columns up to the tile's end (at
        most ``capacity``), whichever chunk fills it; built once for every layer."""
        assert self.invariance is not None
        key = ("tile", tile, window)
        mask = self._masks.get(key)
        if mask is None:
            device, size = self.position_ids.device, self.invariance.prefill_query_tile
            positions = tile * size + torch.arange(size, device=device)
            columns = min(capacity, (tile + 1) * size)
            mask = self._masks[key] = _visible(positions[:, None].clamp(max=columns - 1), torch.arange(columns, device=device), window)
        return mask

    def segment_mask(self, segment: Segment, window: int | None) -> torch.Tensor | None:
        """[length, first_position + length] bool, or None when plain causal attention is exact."""
        if segment.first_position == 0 and window is None:
            return None
        key = (segment.start, window)
        mask = self._masks.get(key)
        if mask is None:
            device = self.position_ids.device
            positions = segment.first_position + torch.arange(segment.length, device=device)
            columns = torch.arange(segment.first_position + segment.length, device=device)
            mask = self._masks[key] = _visible(positions[:, None], columns, window)
        return mask


def partition_rows(counts: list[tuple[int, int]], split: bool = True) -> list[tuple[int, int]]:
    """Consecutive (first, stop) row ranges, one attention call each, from each decode
    row's (cached length, queries).

    One call pads every row's queries to the widest row's and reads every row's
    keys up to the longest row's columns. When one row verifies a deep tree
    beside rows verifying one token, or prompts differ in length, most of that
    is padding: on a CPU each padded (row, column, query) costs as a real one,
    and attention over 16 rows of 300 cached tokens took 2.1 ms a layer at
    width 1 and 9.7 ms at width 16. So on a CPU (``split``) the rows are cut
    into the consecutive ranges that minimise the estimated work, each
    (row, column) costing READ_QUERIES + width units and each call CALL_UNITS
    (dynamic programming over the cut points, O(rows^2)). On a GPU one
    padded call is cheaper than several small ones (``split`` False).

    [(100, 1), (100, 1), (100, 9)]: one call would cost 3 * 101-109 columns * 12;
    the first two rows together (2 * 101 * 4) and the third alone (109 * 12) cost less.
    """
    rows = len(counts)
    if rows <= 1 or not split:
        return [(0, rows)] if rows else []
    best = [0.0] + [math.inf] * rows  # best[i]: the cheapest cut of rows [0, i)
    cut = [0] * (rows + 1)
    for stop in range(1, rows + 1):
        width = columns = 0
        for first in range(stop - 1, -1, -1):  # group [first, stop), grown backwards
            cached, count = counts[first]
            width, columns = max(width, count), max(columns, cached + count)
            cost = best[first] + CALL_UNITS + (stop - first) * columns * (READ_QUERIES + width)
            if cost < best[stop]:
                best[stop], cut[stop] = cost, first
    ranges, stop = [], rows
    while stop:
        ranges.append((cut[stop], stop))
        stop = cut[stop]
    return ranges[::-1]


def _visible(positions: torch.Tensor, columns: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal visibility of cache columns from queries at ``positions`` (transformers'
    sliding window keeps the last ``window`` positions, the query's own included)."""
    visible = columns <= positions
    if window is not None:
        visible &= columns > positions - window
    return visible


def tree_depths(parents: list[int]) -> list[int]:
    """Depth of each query of a tree row (parents: each query's parent index, -1 for
    the root, every parent before its child): [-1, 0, 0, 1] -> [0, 1, 1, 2]."""
    depths: list[int] = []
    for parent in parents:
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return depths


def is_chain(parents: list[int]) -> bool:
    return all(parent == index - 1 for index, parent in enumerate(parents))


def plan_step(
    cache: SlotKVCache,
    decode_rows: list[tuple[int, int]],
    segments: list[tuple[int, int, int]],
    device: torch.device,
    trees: list[list[int] | None] | None = None,
    split: bool | None = None,
    invariance: Invariance | None = None,
) -> StepLayout:
    """Lay out one packed forward pass.

    decode_rows: (cached length, query tokens) for slots 0, 1, ... in order;
    segments: (slot, first position, length) for prefill chunks and padding,
    packed after the decode rows. trees: per decode row, the parent of each
    query (-1 for the first, each parent before its child), or None for a
    chain; rows whose parents form a chain are chains. The decode rows are
    grouped for attention by ``partition_rows`` (``split``: by default on a
    CPU only).

    decode_rows [(3, 2), (5, 1)], no segments: 3 tokens; row 0 writes
    columns 3, 4 of slot 0 and row 1 column 5 of slot 1; in one group,
    width 2, and row 1's padding query repeats its only token (packed index 2).
    """
    parents_of = [tree if tree is not None and not is_chain(tree) else None for tree in (trees or [None] * len(decode_rows))]
    assert len(parents_of) == len(decode_rows), "one tree (or None) per decode row"
    slots: list[int] = []
    columns_written: list[int] = []
    positions: list[int] = []
    for row, ((length, count), parents) in enumerate(zip(decode_rows, parents_of)):
        slots += [row] * count
        columns_written += range(length, length + count)
        if parents is None:
            positions += range(length, length + count)
        else:
            assert len(parents) == count, f"row {row}: {len(parents)} parents for {count} queries"
            positions += [length + depth for depth in tree_depths(parents)]
    decode_tokens = len(slots)
    packed = []
    for slot, first, length in segments:
        packed.append(Segment(slot, len(slots), length, first))
        slots += [slot] * length
        columns_written += range(first, first + length)
        positions += range(first, first + length)
    starts = [0]
    for _, count in decode_rows:
        starts.append(starts[-1] + count)
    groups = [
        _decode_group(decode_rows, parents_of, positions, starts, first, stop, device)
        for first, stop in partition_rows(decode_rows, split=device.type == "cpu" if split is None else split)
    ]
    positions_t = torch.tensor(positions, device=device)
    return StepLayout(
        cache=cache,
        tokens=len(slots),
        write_slots=torch.tensor(slots, device=device),
        write_positions=torch.tensor(columns_written, device=device),
        position_ids=positions_t[None],
        rows=len(decode_rows),
        decode_tokens=decode_tokens,
        groups=groups,
        segments=packed,
        invariance=invariance,
    )


def _decode_group(decode_rows, parents_of, positions: list[int], starts: list[int], first: int, stop: int, device) -> DecodeGroup:
    """The ``DecodeGroup`` of rows ``[first, stop)``; ``starts[row]``: the row's first packed token."""
    counts = decode_rows[first:stop]
    width = max(count for _, count in counts)
    gather_list: list[list[int]] = []
    query_list: list[list[int]] = []
    rows_list: list[int] = []
    queries_list: list[int] = []
    for row, (_, count) in enumerate(counts):
        start = starts[first + row]
        gather_list.append([start + min(i, count - 1) for i in range(width)])
        query_list.append([positions[start + min(i, count - 1)] for i in range(width)])
        rows_list += [row] * count
        queries_list += range(count)
    ancestors = cached = None
    if any(parents is not None for parents in parents_of[first:stop]):
        ancestors = _ancestor_matrix([(count, parents) for (_, count), parents in zip(counts, parents_of[first:stop])], width, device)
        cached = torch.tensor([length for length, _ in counts], device=device)
    return DecodeGroup(
        first=first,
        rows=stop - first,
        width=width,
        columns=max(length + count for length, count in counts),
        start=starts[first],
        tokens=starts[stop] - starts[first],
        gather=torch.tensor(gather_list, device=device),
        query_positions=torch.tensor(query_list, device=device),
        scatter_rows=torch.tensor(rows_list, device=device),
        scatter_queries=torch.tensor(queries_list, device=device),
        widths=[count for _, count in counts],
        cached_rows=[length for length, _ in counts],
        ancestors=ancestors,
        cached=cached,
    )


def _ancestor_matrix(rows: list[tuple[int, list[int] | None]], width: int, device: torch.device) -> torch.Tensor:
    """[rows, width, width] bool: query i of a row sees query j's column when j is i or an
    ancestor of i (a chain's queries: j <= i). A padding query repeats its row's last."""
    matrix = torch.zeros((len(rows), width, width), dtype=torch.bool)
    for row, (count, parents) in enumerate(rows):
        if parents is None:
            matrix[row, :count, :count] = torch.ones((count, count), dtype=torch.bool).tril()
        else:
            for query, parent in enumerate(parents):
                if parent >= 0:
                    matrix[row, query] = matrix[row, parent]
                matrix[row, query, query] = True
        matrix[row, count:] = matrix[row, count - 1]
    return matrix.to(device)


def slot_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers attention over the slot cache. query [1, heads, tokens, dim],
    key/value [1, kv_heads, tokens, dim] -> ([1, tokens, heads, dim], None)."""
    step: StepLayout | None = kwargs.pop(STEP_KWARG, None)
    if step is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError("attention soft-capping and attention sinks are not supported by the slot cache")
    window = kwargs.get("sliding_window")
    scale = kwargs.get("scaling")
    assert query.shape[0] == 1 and query.shape[2] == step.tokens, f"packed query expected, got {tuple(query.shape)}"
    heads, dim = query.shape[1], query.shape[3]
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    cache = step.cache
    keys, values = cache.layer(module.layer_idx, key)
    keys[step.write_slots, :, step.write_positions] = key[0].transpose(0, 1)
    values[step.write_slots, :, step.write_positions] = value[0].transpose(0, 1)
    output = query.new_empty(step.tokens, heads, dim)
    for group in step.groups:
        rows, width = group.rows, group.width
        if width == 1:  # a token a row: the rows' tokens lie packed in row order
            queries = query[0, :, group.start : group.start + rows].transpose(0, 1).reshape(rows, kv_heads, groups, dim)
        else:
            if group.uniform:
                queries = query[0, :, group.start : group.start + group.tokens].reshape(heads, rows, width, dim)
            else:
                queries = query[0][:, group.gather]  # [heads, rows, width, dim]
            queries = queries.permute(1, 0, 2, 3).reshape(rows, kv_heads, groups * width, dim)
        stop = group.first + rows
        mask, columns = group.mask(groups, window), group.columns
        invariance = step.invariance
        if invariance is not None:  # fixed query and column multiples: the kernel's blocks do not depend on the pass
            mask = group.fixed_mask(groups, window, invariance, cache.capacity)
            columns = mask.shape[-1]
            if invariance.token_attention:  # each token a call entry of its own
                mask = group.additive_mask(groups, window, invariance, cache.capacity, query.dtype)
                padded = _pad_groups(queries, groups, width)
                calls = group.token_calls(invariance.column_tile, cache.capacity, invariance.entry_tokens)
                attended = _token_attention(
                    padded, mask, keys, values, group.first, padded.shape[2] // width, calls, scale, invariance.entry_tokens
                )
                attended = attended.view(rows, kv_heads, -1, width, dim)[:, :, :groups]
                if width == 1:
                    output[group.start : group.start + rows].view(rows, kv_heads, groups, dim).copy_(attended[..., 0, :])
                else:
                    _scatter(output, group, attended.reshape(rows, heads, width, dim))
                continue
            queries = _pad_queries(queries, invariance.query_tile)
        attended = F.scaled_dot_product_attention(
            queries,
            keys[group.first : stop, :, :columns],
            values[group.first : stop, :, :columns],
            attn_mask=mask,
            scale=scale,
        )[:, :, : groups * width]  # [rows, kv_heads, groups * width, dim]
        _scatter(output, group, attended.reshape(rows, heads, width, dim))
    for segment in step.segments:
        if step.invariance is not None:
            _tiled_segment(query, keys, values, output, step, segment, window, scale, groups)
            continue
        end = segment.first_position + segment.length
        mask = step.segment_mask(segment, window)
        attended = F.scaled_dot_product_attention(
            query[:, :, segment.start : segment.start + segment.length],
            keys[segment.slot : segment.slot + 1, :, :end],
            values[segment.slot : segment.slot + 1, :, :end],
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=groups > 1,
        )  # [1, heads, length, dim]
        output[segment.start : segment.start + segment.length] = attended[0].transpose(0, 1)
    return output[None], None


def _scatter(output: torch.Tensor, group: DecodeGroup, attended: torch.Tensor) -> None:
    """A group's attention [rows, heads, width, dim] into ``output`` [tokens, heads, dim] at
    its packed tokens (a padding query's dropped)."""
    if group.uniform:
        rows, heads, width, dim = attended.shape
        output[group.start : group.start + group.tokens].view(rows, width, heads, dim).copy_(attended.transpose(1, 2))
    else:
        output[group.start : group.start + group.tokens] = attended[group.scatter_rows, :, group.scatter_queries]


def _pad_queries(queries: torch.Tensor, tile: int) -> torch.Tensor:
    """Queries [rows, kv_heads, count, dim] padded with zeros to a multiple of ``tile``
    queries (their mask: ``_pad_query_mask``); the padding's output is dropped."""
    padding = (-queries.shape[2]) % tile
    return F.pad(queries, (0, 0, 0, padding)) if padding else queries


def _pad_query_mask(mask: torch.Tensor, tile: int) -> torch.Tensor:
    """A mask [rows, 1, count, columns] padded to a multiple of ``tile`` queries, as
    ``_pad_queries`` pads them; a padding query sees column 0 (a row of nothing but masked
    columns would be NaN)."""
    padding = (-mask.shape[2]) % tile
    if not padding:
        return mask
    extra = torch.zeros(mask.shape[0], 1, padding, mask.shape[3], dtype=torch.bool, device=mask.device)
    extra[..., 0] = True
    return torch.cat([mask, extra], dim=2)


def _pad_groups(queries: torch.Tensor, groups: int, width: int) -> torch.Tensor:
    """Folded queries [rows, kv_heads, groups * width, dim] with zero query heads added to a
    multiple of ``QUERY_MULTIPLE`` per key head (their mask: ``_pad_group_mask``)."""
    padding = (-groups) % QUERY_MULTIPLE
    if not padding:
        return queries
    rows, kv_heads, _, dim = queries.shape
    return F.pad(queries.view(rows, kv_heads, groups, width, dim), (0, 0, 0, 0, 0, padding)).view(rows, kv_heads, -1, dim)


def _pad_group_mask(mask: torch.Tensor, groups: int, width: int) -> torch.Tensor:
    """A mask [rows, 1, groups * width, columns] for ``_pad_groups``' queries: a padding
    head sees column 0 (a row of nothing but masked columns would be NaN)."""
    padding = (-groups) % QUERY_MULTIPLE
    if not padding:
        return mask
    rows, _, _, columns = mask.shape
    extra = torch.zeros(rows, 1, padding, width, columns, dtype=torch.bool, device=mask.device)
    extra[..., 0] = True
    return torch.cat([mask.view(rows, 1, groups, width, columns), extra], dim=2).view(rows, 1, -1, columns)


def _pad_columns(mask: torch.Tensor, tile: int, capacity: int) -> tuple[torch.Tensor, int]:
    """A mask [..., columns] widened with hidden columns to a multiple of ``tile`` (at most
    ``capacity``), and its new width."""
    columns = mask.shape[-1]
    wanted = min(capacity, columns + (-columns) % tile)
    if wanted == columns:
        return mask, columns
    return F.pad(mask, (0, wanted - columns), value=False), wanted


@dataclass(frozen=True)
class TokenCalls:
    """The attention calls of a decode group's tokens (``plan_token_calls``). ``by_query``:
    one per (query index, columns read), as (query, columns, first row, stop row, the rows
    that have that token among them or None when all do, the same less the first row);
    else one per (row, columns read), as (row, first token, stop token, columns)."""

    by_query: bool
    calls: list[tuple]


def plan_token_calls(reads: list[list[int]], device: torch.device, entry_tokens: int = 1) -> TokenCalls:
    """``reads[row][i]``: the columns token i of the row reads. Per query index i, calls over
    the rows that have a token i and read as many columns, each from one of them to another
    (entries between them of other rows are computed and dropped, where that costs less than
    one more call); or per row, a call over its tokens that read as many columns (reads grow
    along a row), their entries shared up to ``entry_tokens`` at a time; whichever costs
    less, each entry costing READ_QUERIES + its tokens units per column read and each call
    CALL_UNITS (``partition_rows``).

    reads [[16, 16], [32]]: per query (query 0 reads 16 and 32 columns, query 1 16: three
    calls) against per row (two calls) -> per row, [(0, 0, 2, 16), (1, 0, 1, 32)]."""
    by_query: list[dict[int, list[int]]] = [{} for _ in range(max(map(len, reads), default=0))]
    for row, row_reads in enumerate(reads):
        for query, columns in enumerate(row_reads):
            by_query[query].setdefault(columns, []).append(row)
    per_row = [
        (row, row_reads.index(columns), row_reads.index(columns) + row_reads.count(columns), columns)
        for row, row_reads in enumerate(reads)
        for columns in dict.fromkeys(row_reads)
    ]
    per_row_units = 0
    for _, start, stop, columns in per_row:
        tokens = stop - start
        if entry_tokens > 1:
            entries = math.ceil(tokens / entry_tokens)
            per_row_units += entries * CALL_UNITS + columns * (entries * READ_QUERIES + tokens)
        else:
            per_row_units += CALL_UNITS + tokens * columns * (READ_QUERIES + 1)
    spans: list[tuple[int, int, list[int]]] = []  # (query, columns, rows): one call each
    for query, groups in enumerate(by_query):
        for columns, having in groups.items():
            span = [having[0]]
            for row in having[1:]:
                if (row - span[-1] - 1) * columns * (READ_QUERIES + 1) >= CALL_UNITS:  # the gap costs more than a call
                    spans.append((query, columns, span))
                    span = []
                span.append(row)
            spans.append((query, columns, span))
    by_query_units = sum(CALL_UNITS + (rows[-1] + 1 - rows[0]) * columns * (READ_QUERIES + 1) for _, columns, rows in spans)
    if by_query_units > per_row_units:
        return TokenCalls(False, per_row)
    calls = []
    for query, columns, having in spans:
        low, high = having[0], having[-1] + 1
        index = None if high - low == len(having) else torch.tensor(having, device=device)
        calls.append((query, columns, low, high, index, None if index is None else index - low))
    return TokenCalls(True, calls)


def _token_attention(queries, mask, keys, values, first: int, groups: int, plan: TokenCalls, scale, entry_tokens: int = 1) -> torch.Tensor:
    """Decode attention with each token of each row a call entry of its own: its ``groups``
    query heads against its row's cached keys, read in place, each token reading the columns
    its own column needs (``DecodeGroup.token_calls``): CPU flash attention sums a row's
    columns in blocks whose bounds follow the columns a call reads, hidden ones too, so a
    token read with a wider call can round apart. Every call has the same query count per
    entry whatever the row's width or the pass's rows: per query index over the rows' slots
    as they lie, or per row over its slot as a stride-0 view (``plan``). Per row, up to
    ``entry_tokens`` of its tokens reading as many columns share one entry instead, their
    query heads side by side (``Invariance.entry_tokens``: where a probe finds a query's
    output independent of the entry's query count and its place in it), so its cached
    columns are read once for them. Padding queries (past a row's own tokens) are not
    computed: their output is left unset. queries [rows,
    kv_heads, groups * width, dim] (head-major, as folded), mask (bool, or added to the
    scores: ``DecodeGroup.additive_mask``) [rows, 1, groups * width,
    columns] -> [rows, kv_heads, groups * width, dim]."""
    rows, kv_heads, folded, dim = queries.shape
    width = folded // groups
    out = torch.empty_like(queries)
    if plan.by_query:
        for query, columns, low, high, index, local in plan.calls:
            attended = F.scaled_dot_product_attention(
                queries[low:high, :, query::width],
                keys[first + low : first + high, :, :columns],
                values[first + low : first + high, :, :columns],
                attn_mask=mask[low:high, :, query::width, :columns],
                scale=scale,
            )  # [high - low, kv_heads, groups, dim]
            if index is None:
                out[low:high, :, query::width] = attended
            else:
                out[index, :, query::width] = attended[local]
        return out
    if entry_tokens > 1:
        for row, start, stop, columns in plan.calls:
            _shared_entries(
                queries[row], mask[row], keys, values, first + row, out[row], (start, stop, columns), groups, entry_tokens, scale
            )
        return out
    for row, start, stop, columns in plan.calls:
        tokens = queries[row].view(kv_heads, groups, width, dim).permute(2, 0, 1, 3)  # [width, kv_heads, groups, dim]
        visible = mask[row].view(1, groups, width, -1).permute(2, 0, 1, 3)  # [width, 1, groups, columns]
        slot = first + row
        attended = F.scaled_dot_product_attention(
            tokens[start:stop],
            keys[slot : slot + 1, :, :columns].expand(stop - start, -1, -1, -1),
            values[slot : slot + 1, :, :columns].expand(stop - start, -1, -1, -1),
            attn_mask=visible[start:stop, ..., :columns],
            scale=scale,
        )  # [stop - start, kv_heads, groups, dim]
        out[row].view(kv_heads, groups, width, dim)[:, :, start:stop] = attended.permute(1, 2, 0, 3)
    return out


def _shared_entries(queries, mask, keys, values, slot: int, out, call: tuple[int, int, int], groups: int, most: int, scale) -> None:
    """Tokens [start, stop) of one row, each reading ``columns``, as call entries of up to
    ``most`` tokens, their ``groups`` query heads each: queries [kv_heads, groups * width,
    dim] and mask [1, groups * width, columns] of the row (head-major, as folded: a whole
    row's mask is read in place); their output into ``out``, laid out as the queries."""
    start, stop, columns = call
    kv_heads, folded, dim = queries.shape
    width = folded // groups
    tokens = queries.view(kv_heads, groups, width, dim)
    visible = mask.view(groups, width, -1)
    placed = out.view(kv_heads, groups, width, dim)
    for low in range(start, stop, most):
        high = min(stop, low + most)
        attended = F.scaled_dot_product_attention(
            tokens[:, :, low:high].reshape(1, kv_heads, -1, dim),
            keys[slot : slot + 1, :, :columns],
            values[slot : slot + 1, :, :columns],
            attn_mask=visible[:, low:high, :columns].reshape(1, 1, -1, columns),
            scale=scale,
        )  # [1, kv_heads, groups * (high - low), dim]
        placed[:, :, low:high] = attended[0].view(kv_heads, groups, high - low, dim)


def _tiled_segment(query, keys, values, output, step: StepLayout, segment: Segment, window: int | None, scale, groups: int) -> None:
    """A prefill chunk's attention in tiles of ``prefill_query_tile`` positions aligned to the
    prompt's (tile t holds positions [t * size, (t + 1) * size)), each a call
    of exactly that many queries, a position always in the same place among them, reading
    the slot's columns up to the tile's end under an explicit causal mask: a prompt token's
    output does not depend on how the prompt was cut into chunks. (The kernel's blocks
    follow the columns a call reads, so reading up to a chunk's own end rounded apart.)"""
    assert step.invariance is not None
    size = step.invariance.prefill_query_tile
    first, stop = segment.first_position, segment.first_position + segment.length
    for tile in range(first // size, (stop - 1) // size + 1):
        low, high = max(first, tile * size), min(stop, (tile + 1) * size)  # the positions this chunk fills
        mask = step.tile_mask(tile, window, keys.shape[2])
        end = mask.shape[-1]
        packed = segment.start + low - first
        tokens = query[:, :, packed : packed + high - low]
        if high - low < size:
            tokens = F.pad(tokens, (0, 0, low - tile * size, (tile + 1) * size - high))
        attended = F.scaled_dot_product_attention(
            tokens,
            keys[segment.slot : segment.slot + 1, :, :end],
            values[segment.slot : segment.slot + 1, :, :end],
            attn_mask=mask,
            scale=scale,
            enable_gqa=groups > 1,
        )  # [1, heads, size, dim]
        output[packed : packed + high - low] = attended[0, :, low - tile * size : high - tile * size].transpose(0, 1)


def use_slot_attention(model: PreTrainedModel) -> None:
    """Switch ``model`` to ``slot_attention`` (SDPA for any call without a StepLayout)."""
    AttentionInterface.register(ATTENTION_NAME, slot_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)
    if model.config._attn_implementation == ATTENTION_NAME:
        return
    if not model._can_set_attn_implementation():
        raise ValueError(
            f"{type(model).__name__} does not route attention through transformers' AttentionInterface, "
            "which batched verification needs; it cannot be served"
        )
    model.set_attn_implementation(ATTENTION_NAME)
