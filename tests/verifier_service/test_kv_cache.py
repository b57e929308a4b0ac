"""The slot cache, the packed step layout and slot attention, on literal tensors.

One kv head of dimension one: each cached entry is a single number, so the
expected cache contents can be written out.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from verifier_service.core.invariance import Invariance
from verifier_service.core.kv_cache import (
    STEP_KWARG,
    SlotKVCache,
    _token_attention,
    _visible,
    partition_rows,
    plan_step,
    plan_token_calls,
    slot_attention,
)

CPU = torch.device("cpu")


def cache_with(rows: list[list[float]], capacity: int = 6) -> SlotKVCache:
    """A one-layer cache whose slot i holds ``rows[i]`` as keys (and their negatives as values)."""
    cache = SlotKVCache(slots=len(rows), capacity=capacity)
    keys, values = cache.layer(0, torch.zeros(1, 1, 1, 1))
    keys.zero_(), values.zero_()
    for slot, row in enumerate(rows):
        keys[slot, 0, : len(row), 0] = torch.tensor(row)
        values[slot, 0, : len(row), 0] = -torch.tensor(row)
        cache.wrote(slot, capacity)
    return cache


def keys_of(cache: SlotKVCache, slot: int, columns: int) -> list[float]:
    return cache.keys[0][slot, 0, :columns, 0].tolist()


# -- plan_step ------------------------------------------------------------------------


def test_plan_step_docstring_example():
    layout = plan_step(SlotKVCache(2, 8), [(3, 2), (5, 1)], [], CPU)
    assert layout.tokens == 3
    # Row 0 writes columns 3 and 4 of slot 0, row 1 column 5 of slot 1.
    assert layout.write_slots.tolist() == [0, 0, 1]
    assert layout.write_positions.tolist() == [3, 4, 5]
    assert layout.position_ids.tolist() == [[3, 4, 5]]
    # One group, width 2: row 1's padding query repeats its only token (packed index 2), at its position.
    [group] = layout.groups
    assert group.gather.tolist() == [[0, 1], [2, 2]]
    assert group.query_positions.tolist() == [[3, 4], [5, 5]]
    assert (layout.rows, group.width, group.columns, layout.decode_tokens) == (2, 2, 6, 3)
    assert group.scatter_rows.tolist() == [0, 0, 1]
    assert group.scatter_queries.tolist() == [0, 1, 0]


def test_plan_step_packs_prefill_segments_after_the_decode_rows():
    layout = plan_step(SlotKVCache(3, 16), [(4, 1)], [(2, 0, 3), (1, 6, 2)], CPU)
    # Decode token, then slot 2's positions 0-2, then slot 1's positions 6-7.
    assert layout.write_slots.tolist() == [0, 2, 2, 2, 1, 1]
    assert layout.write_positions.tolist() == [4, 0, 1, 2, 6, 7]
    assert [(s.slot, s.start, s.length, s.first_position) for s in layout.segments] == [(2, 1, 3, 0), (1, 4, 2, 6)]


def test_rows_are_cut_where_padding_would_cost_more_than_another_call():
    # The docstring's example: two one-token rows together, the wide row alone.
    assert partition_rows([(100, 1), (100, 1), (100, 9)]) == [(0, 2), (2, 3)]
    # Short rows of one width share a call; so does everything when splitting is off (GPUs).
    assert partition_rows([(3, 2), (5, 1)]) == [(0, 2)]
    assert partition_rows([(100, 1), (100, 1), (100, 9)], split=False) == [(0, 3)]
    # A long prompt beside short ones: the short rows stop reading its columns.
    assert partition_rows([(10, 1), (12, 1), (900, 1)]) == [(0, 2), (2, 3)]
    assert partition_rows([]) == []


def test_decode_mask_lets_each_query_see_its_own_columns_only():
    layout = plan_step(SlotKVCache(2, 8), [(2, 2), (0, 1)], [], CPU)
    mask = layout.groups[0].mask(groups=1, window=None)[:, 0].int().tolist()
    # Row 0: 2 cached tokens, queries at positions 2 and 3. Row 1: one query at position 0;
    # its padding query copies it. Columns run to 4 (the furthest write, + 1).
    assert mask == [
        [[1, 1, 1, 0], [1, 1, 1, 1]],
        [[1, 0, 0, 0], [1, 0, 0, 0]],
    ]


def test_decode_mask_repeats_once_per_query_head_of_a_kv_head():
    layout = plan_step(SlotKVCache(1, 8), [(1, 2)], [], CPU)
    mask = layout.groups[0].mask(groups=3, window=None)
    assert mask.shape == (1, 1, 6, 3)  # [rows, 1, groups * width, columns]
    assert mask[0, 0].int().tolist() == [[1, 1, 0], [1, 1, 1]] * 3


def test_sliding_window_keeps_the_last_window_positions():
    # transformers' rule: a query at position p sees columns p - window + 1 .. p.
    visible = _visible(torch.tensor([[3], [5]]), torch.arange(6), window=3)
    assert visible.int().tolist() == [[0, 1, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1]]


def test_a_first_prefill_chunk_without_a_window_needs_no_mask():
    layout = plan_step(SlotKVCache(2, 8), [], [(0, 0, 3), (1, 2, 2)], CPU)
    first, second = layout.segments
    assert layout.segment_mask(first, None) is None  # plain causal attention is exact
    # A later chunk sees the slot's earlier columns and its own causally.
    assert layout.segment_mask(second, None).int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert layout.segment_mask(first, 2).int().tolist() == [[1, 0, 0], [1, 1, 0], [0, 1, 1]]


# -- the cache ------------------------------------------------------------------------


def test_move_copies_a_slots_columns_and_swap_exchanges_two():
    cache = cache_with([[1, 2, 3], [4, 5], [6]])
    cache.move(0, 2, columns=3)
    assert keys_of(cache, 2, 3) == [1, 2, 3]
    assert cache.values[0][2, 0, :3, 0].tolist() == [-1, -2, -3]
    cache.swap(0, 1, first_columns=3, second_columns=2)
    assert keys_of(cache, 0, 2) == [4, 5]
    assert keys_of(cache, 1, 3) == [1, 2, 3]


def test_ensure_finite_zeroes_ahead_of_what_was_written_and_no_further_back():
    cache = SlotKVCache(slots=1, capacity=600)
    keys, values = cache.layer(0, torch.zeros(1, 1, 1, 1))
    keys.fill_(math.nan), values.fill_(math.nan)  # what torch.empty may hold
    keys[0, 0, :3, 0] = torch.tensor([1.0, 2.0, 3.0])
    cache.wrote(0, 3)
    cache.ensure_finite(0, 5)
    # The written columns stay; zeroing runs a whole block (256) ahead of them.
    assert keys[0, 0, :5, 0].tolist() == [1, 2, 3, 0, 0]
    assert torch.isfinite(keys[0, 0, : 3 + 256]).all() and torch.isfinite(values[0, 0, 3 : 3 + 256]).all()
    assert torch.isnan(keys[0, 0, 3 + 256 :]).all()
    assert cache.extent[0] == 259


def test_cache_rejects_an_empty_shape():
    with pytest.raises(ValueError, match=r"need slots >= 1 and capacity >= 1, got 0 x 8"):
        SlotKVCache(0, 8)


# -- slot attention -------------------------------------------------------------------


def attention_module(layer: int = 0):
    return SimpleNamespace(layer_idx=layer, num_key_value_groups=1, is_causal=True)


def reference_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Causal attention of the last len(query) positions over ``keys``: [q, heads, dim] -> [q, heads, dim]."""
    q_len, total = query.shape[0], keys.shape[0]
    mask = torch.ones(q_len, total, dtype=torch.bool).tril(total - q_len)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask
    )
    return out.transpose(0, 1)


def test_slot_attention_writes_in_place_and_each_row_attends_to_its_own_tokens_only():
    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 2, 8
    cache = SlotKVCache(slots=2, capacity=8)
    history = [torch.randn(3, kv_heads, dim), torch.randn(5, kv_heads, dim)]  # cached keys of slots 0 and 1
    keys, values = cache.layer(0, torch.zeros(1, kv_heads, 1, dim))
    keys.zero_(), values.zero_()
    for slot, past in enumerate(history):
        keys[slot, :, : len(past)] = past.transpose(0, 1)
        values[slot, :, : len(past)] = 2 * past.transpose(0, 1)
        cache.wrote(slot, len(past))
    # A step: slot 0 verifies 2 tokens, slot 1 decodes 1; slot 1 also has a stale entry at column 5.
    keys[1, :, 5] = 1e4
    layout = plan_step(cache, [(3, 2), (5, 1)], [], CPU)
    new_keys = torch.randn(1, kv_heads, 3, dim)
    query = torch.randn(1, heads, 3, dim)
    output, _ = slot_attention(attention_module(), query, new_keys, 2 * new_keys, None, **{STEP_KWARG: layout})
    assert output.shape == (1, 3, heads, dim)
    # The new keys went to columns 3, 4 of slot 0 and column 5 of slot 1 (overwriting the stale entry).
    assert torch.equal(keys[0, :, 3:5], new_keys[0, :, :2])
    assert torch.equal(keys[1, :, 5], new_keys[0, :, 2])
    # Each row equals attention over its own history and new tokens alone (query head h uses kv head h // 2).
    for row, (past, tokens) in enumerate(zip(history, [slice(0, 2), slice(2, 3)])):
        row_keys = torch.cat([past, new_keys[0, :, tokens].transpose(0, 1)]).repeat_interleave(2, dim=1)
        expected = reference_attention(query[0, :, tokens].transpose(0, 1), row_keys, 2 * row_keys)
        torch.testing.assert_close(output[0, tokens], expected)


def test_slot_attention_prefill_segment_sees_its_slot_only():
    torch.manual_seed(1)
    cache = SlotKVCache(slots=2, capacity=8)
    keys, values = cache.layer(0, torch.zeros(1, 1, 1, 4))
    keys.fill_(1e4), values.fill_(1e4)  # anything read outside the segment's columns would show
    first = torch.randn(1, 1, 2, 4)
    layout = plan_step(cache, [], [(1, 0, 2)], CPU)
    query = torch.randn(1, 1, 2, 4)
    out_first, _ = slot_attention(attention_module(), query, first, first, None, **{STEP_KWARG: layout})
    torch.testing.assert_close(
        out_first[0], reference_attention(query[0].transpose(0, 1), first[0].transpose(0, 1), first[0].transpose(0, 1))
    )
    # A second chunk at position 2 attends over the first chunk's columns too.
    second, query2 = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    layout = plan_step(cache, [], [(1, 2, 3)], CPU)
    out_second, _ = slot_attention(attention_module(), query2, second, second, None, **{STEP_KWARG: layout})
    both = torch.cat([first, second], dim=2)[0].transpose(0, 1)
    torch.testing.assert_close(out_second[0], reference_attention(query2[0].transpose(0, 1), both, both))


def test_slot_attention_refuses_soft_capping():
    layout = plan_step(SlotKVCache(1, 4), [], [(0, 0, 1)], CPU)
    x = torch.zeros(1, 1, 1, 2)
    with pytest.raises(NotImplementedError, match="soft-capping and attention sinks are not supported"):
        slot_attention(attention_module(), x, x, x, None, softcap=30.0, **{STEP_KWARG: layout})


def random_cache(slots: int, capacity: int, kv_heads: int, dim: int, seed: int, dtype: torch.dtype = torch.float32):
    """A one-layer cache of random keys and values in every column: (cache, keys, values)."""
    cache = SlotKVCache(slots=slots, capacity=capacity)
    keys, values = cache.layer(0, torch.zeros(1, kv_heads, 1, dim, dtype=dtype))
    generator = torch.Generator().manual_seed(seed)
    keys.copy_(torch.randn(keys.shape, generator=generator)), values.copy_(torch.randn(values.shape, generator=generator))
    return cache, keys, values


def test_split_decode_groups_attend_exactly_as_one_padded_call():
    """Rows of different lengths and widths, a tree among them: cut into several calls
    (the CPU's default here) or attended in one padded call, every token's output is the same."""
    torch.manual_seed(2)
    heads, kv_heads, dim = 4, 2, 8
    rows = [(300, 1), (10, 1), (290, 9), (5, 2)]
    trees = [None, None, [-1, 0, 0, 1, 1, 2, 0, 6, 7], None]
    new_keys = torch.randn(1, kv_heads, 13, dim)
    query = torch.randn(1, heads, 13, dim)
    outputs = []
    for split in (True, False):
        cache, _, _ = random_cache(4, 320, kv_heads, dim, seed=3)
        layout = plan_step(cache, rows, [], CPU, trees, split=split)
        assert len(layout.groups) == (3 if split else 1)
        output, _ = slot_attention(attention_module(), query, new_keys, 2 * new_keys, None, **{STEP_KWARG: layout})
        outputs.append(output)
    torch.testing.assert_close(outputs[0], outputs[1])


@pytest.mark.parametrize(
    "invariance", [None, Invariance(token_attention=False), Invariance(token_attention=True)], ids=["free", "query tiles", "token calls"]
)
def test_groups_of_equal_widths_read_and_write_their_tokens_as_gathering_them_would(invariance):
    """Rows all as wide as their group lie as [rows, width] in the packed order: reshaping
    them gives the bits that gathering and scattering them by index gives."""
    torch.manual_seed(4)
    heads, kv_heads, dim = 6, 2, 8
    rows = [(40, 3), (17, 3), (60, 3)]
    new_keys, query = torch.randn(1, kv_heads, 9, dim), torch.randn(1, heads, 9, dim)
    outputs = []
    for uniform in (True, False):
        cache, keys, values = random_cache(3, 80, kv_heads, dim, seed=5)
        layout = plan_step(cache, rows, [], CPU, split=False, invariance=invariance)
        assert [group.uniform for group in layout.groups] == [True]
        for group in layout.groups:
            group.uniform = uniform  # False: the gather and scatter every group can take
        output, _ = slot_attention(attention_module(), query, new_keys, 2 * new_keys, None, **{STEP_KWARG: layout})
        outputs.append(output)
    assert torch.equal(outputs[0], outputs[1])
    # and each row is its own attention
    start = 0
    for slot, (cached, width) in enumerate(rows):
        row_keys = torch.cat([keys[slot, :, :cached].transpose(0, 1), new_keys[0, :, start : start + width].transpose(0, 1)])
        row_values = torch.cat([values[slot, :, :cached].transpose(0, 1), 2 * new_keys[0, :, start : start + width].transpose(0, 1)])
        expected = reference_attention(
            query[0, :, start : start + width].transpose(0, 1), row_keys.repeat_interleave(3, dim=1), row_values.repeat_interleave(3, dim=1)
        )
        torch.testing.assert_close(outputs[0][0, start : start + width], expected)
        start += width


def test_a_group_with_a_narrower_row_is_not_uniform():
    layout = plan_step(SlotKVCache(2, 8), [(3, 2), (5, 1)], [], CPU, split=False)
    assert [(group.width, group.uniform) for group in layout.groups] == [(2, False)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_token_attention_with_the_additive_mask_is_bitwise_the_bool_masks(dtype):
    """The mask built once a step as the kernel adds it gives every token the bits that
    attention's own conversion of the bool mask gives in each call."""
    torch.manual_seed(6)
    kv_heads, dim = 2, 16
    rows = [(40, 1), (17, 1), (100, 1), (63, 1)]
    invariance = Invariance(token_attention=True)
    cache, keys, values = random_cache(4, 256, kv_heads, dim, seed=7, dtype=dtype)
    layout = plan_step(cache, rows, [], CPU, invariance=invariance)
    [group] = layout.groups
    queries = torch.randn(4, kv_heads, 4, dim, dtype=dtype)  # 3 query heads a key head, padded to 4
    visible = group.fixed_mask(3, None, invariance, 256)
    additive = group.additive_mask(3, None, invariance, 256, dtype)
    assert additive.dtype == dtype and torch.equal(additive == 0, visible)
    calls = group.token_calls(invariance.column_tile, 256)
    with_bool = _token_attention(queries, visible, keys, values, 0, 4, calls, None)
    with_additive = _token_attention(queries, additive, keys, values, 0, 4, calls, None)
    assert torch.equal(with_bool, with_additive)


def test_token_calls_span_the_rows_that_read_as_many_columns_without_computing_far_gaps():
    """Rows 0 and 15 read 640 columns, the 14 between them 64: one call over all 16 rows for
    640 would compute 14 dropped entries of 640 columns; two calls of one row cost less."""
    cpu = torch.device("cpu")
    far = plan_token_calls([[640], *[[64]] * 14, [640]], cpu)
    assert far.by_query
    assert sorted((columns, low, high) for _, columns, low, high, _, _ in far.calls) == [(64, 1, 15), (640, 0, 1), (640, 15, 16)]
    near = plan_token_calls([[320], [448], [320], [448]], cpu)  # a dropped entry of 320 columns costs less than a call, of 448 more
    assert sorted((columns, low, high) for _, columns, low, high, _, _ in near.calls) == [(320, 0, 3), (448, 1, 2), (448, 3, 4)]
    assert [index.tolist() for _, _, _, _, index, _ in near.calls if index is not None] == [[0, 2]]


def test_a_rows_tokens_in_shared_entries_make_calls_per_row_where_each_token_would_not():
    cpu = torch.device("cpu")
    reads = [[320] * 2] * 4  # four rows of two tokens reading as many columns
    assert plan_token_calls(reads, cpu).by_query  # two calls of four entries rather than four of two
    assert plan_token_calls(reads, cpu, entry_tokens=8).calls == [(row, 0, 2, 320) for row in range(4)]  # an entry a row
