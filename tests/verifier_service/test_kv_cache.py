"""BatchKVCache on literal tensors: one head, one dim, so each cached entry is a single number."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache

from verifier_service.kv_cache import BatchKVCache


def row(values: list[float], layers: int = 2) -> DynamicCache:
    """A single-row cache whose entries are ``values`` (keys) and their negatives (values)."""
    keys = torch.tensor(values).view(1, 1, len(values), 1)
    return DynamicCache(ddp_cache_data=[(keys.clone(), -keys.clone()) for _ in range(layers)])


def entries(cache: BatchKVCache, layer: int = 0) -> list[list[float]]:
    return cache.cache.layers[layer].keys[:, 0, :, 0].tolist()


def append_step(cache: BatchKVCache, new: list[list[float]]) -> int:
    """What the model's forward does: concatenate every row's new columns. Returns the old width."""
    old = cache.columns
    for layer in cache.cache.layers:
        block = torch.tensor(new).view(len(new), 1, len(new[0]), 1)
        layer.keys = torch.cat([layer.keys, block], dim=2)
        layer.values = torch.cat([layer.values, -block], dim=2)
    return old


def test_rows_of_different_lengths_are_left_packed_and_zero_padded():
    cache = BatchKVCache()
    cache.add_row(row([1, 2, 3]), 3)
    cache.add_row(row([4]), 1)
    cache.add_row(row([5, 6, 7, 8]), 4)
    # Every row is padded with zeros to the longest row (4 columns).
    assert entries(cache) == [[1, 2, 3, 0], [4, 0, 0, 0], [5, 6, 7, 8]]
    assert cache.lengths == [3, 1, 4]
    assert entries(cache, layer=1) == entries(cache)


def test_step_inputs_mask_padding_and_give_true_positions():
    cache = BatchKVCache()
    cache.add_row(row([1, 2, 3]), 3)
    cache.add_row(row([4]), 1)
    mask, positions = cache.step_inputs([2, 1], width=2, device=torch.device("cpu"))
    # Columns: 3 cached + 2 new. Row 1 has 1 cached token and 1 real query.
    assert mask.tolist() == [[1, 1, 1, 1, 1], [1, 0, 0, 1, 0]]
    # New tokens sit right after each row's own cached tokens.
    assert positions.tolist() == [[3, 4], [1, 2]]


def test_commit_moves_kept_columns_down_and_drops_rejected_ones():
    cache = BatchKVCache()
    cache.add_row(row([1, 2, 3]), 3)
    cache.add_row(row([4]), 1)
    old = append_step(cache, [[10, 11, 12], [20, 21, 22]])
    cache.commit(old, kept=[1, 3])
    # Row 0 keeps 10 (11, 12 rejected); row 1 keeps 20, 21, 22, moved from
    # columns 3..5 down to 1..3. The cache is cropped to the longest row (4).
    assert cache.lengths == [4, 4]
    assert entries(cache) == [[1, 2, 3, 10], [4, 20, 21, 22]]
    assert (cache.cache.layers[1].values == -cache.cache.layers[1].keys).all()


def test_keep_rows_reorders_and_crops_to_the_longest_survivor():
    cache = BatchKVCache()
    cache.add_row(row([1, 2, 3, 4]), 4)
    cache.add_row(row([5]), 1)
    cache.add_row(row([6, 7]), 2)
    cache.keep_rows([2, 1])
    assert cache.lengths == [2, 1]
    assert entries(cache) == [[6, 7], [5, 0]]  # the 4-long row left, so 2 columns remain
    cache.keep_rows([])
    assert cache.batch_size == 0 and cache.columns == 0


def test_a_row_added_after_steps_joins_with_padding_on_either_side():
    cache = BatchKVCache()
    cache.add_row(row([1]), 1)
    old = append_step(cache, [[2, 3]])
    cache.commit(old, kept=[2])
    cache.add_row(row([7, 8, 9, 6]), 4)
    # The existing row (3 long) is padded to the newcomer's 4 columns.
    assert entries(cache) == [[1, 2, 3, 0], [7, 8, 9, 6]]
