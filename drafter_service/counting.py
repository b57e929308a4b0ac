"""Pure counting for the n-gram tables: decay, merging a key's continuations, and an
observation's n-gram counts, each pair counted once per call. No LMDB: ``drafter_service.store``
applies these inside its write transactions (its docstring says when each runs), and the
benchmarks and tests call them directly."""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from itertools import accumulate, chain, compress
from operator import itemgetter

from drafter_service.table_format import UINT32_MAX

_COUNT = itemgetter(1)  # of a (token, count) pair


def decayed(pairs: Sequence[tuple[int, int]], age: int, decay_shift: int) -> list[tuple[int, int]]:
    """Pairs after ``age`` epochs, each worth at least 1: [(7, 8), (9, 1)], age 2, shift 1 -> [(7, 2), (9, 1)]."""
    shift = age * decay_shift
    return [(token, (count >> shift) or 1) for token, count in pairs]


def merge_continuations(
    stored: Sequence[tuple[int, int]],
    age: int,
    additions: dict[int, int],
    decay_shift: int,
    max_continuations: int,
) -> list[tuple[int, int]]:
    """Stored pairs decayed by ``age`` epochs plus ``additions``, top-k by count.

    stored [(7, 4), (9, 1)] two epochs old, shift 1: 7 and 9 are worth 1;
    additions {8: 1, 9: 1} -> [(9, 2), (7, 1), (8, 1)] (a stable sort keeps
    stored before new, new in first-seen order); max_continuations 2 ->
    [(9, 2), (7, 1)].
    """
    merged = dict(stored) if age == 0 else dict(decayed(stored, age, decay_shift))  # age 0: the usual case
    for token, count in additions.items():
        merged[token] = min(UINT32_MAX, merged.get(token, 0) + count)
    return _ranked(merged.items())[:max_continuations]


def _ranked(pairs: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Pairs by count, highest first; equal counts keep their order (reverse sorts are stable)."""
    return sorted(pairs, key=_COUNT, reverse=True)


def count_ngrams(
    sequences: Iterable[tuple[Sequence[int], bytes, int, Sequence[bytes] | None]], namespace: bytes, n_min: int, n_max: int
) -> dict[bytes, dict[int, int]]:
    """Next-token counts per ``ngrams`` key over (tokens, packed tokens, start, counted)
    tuples, each sequence adding at most 1 per (key, next token) pair (see *One vote per call*).

    tokens [5, 6, 7], n_min=1, n_max=2 counts (5,)->6, (6,)->7, (5, 6)->7, keyed by
    namespace | n | tokens. tokens [1, 2, 1, 2, 1, 3], n_min=n_max=1 counts (1,)->2 once
    though it occurs twice: {(1,): {2: 1, 3: 1}, (2,): {1: 1}}. Only n-grams whose next
    token is at index >= start count: the tokens before are a chunk's context, whose own
    n-grams an earlier chunk counted. With ``counted`` (per n, a mask over the tokens: see
    ``first_occurrences``), only the positions it marks count.
    """
    counts: dict[bytes, dict[int, int]] = {}
    for tokens, packed, start, counted in sequences:
        for n in range(n_min, n_max + 1):
            prefix = namespace + bytes((n,))
            first = max(n, start)
            positions: Iterable[int] = range(first, len(tokens))
            following: Iterable[int] = tokens[first:]
            if counted is not None:
                positions, following = compress(positions, counted[n - n_min][first:]), compress(following, counted[n - n_min][first:])
            keys = [prefix + packed[4 * (position - n) : 4 * position] for position in positions]
            # dict.fromkeys: each pair once, in first-seen order, so each key's
            # continuations stay in the order they first followed it.
            for key, token in dict.fromkeys(zip(keys, following)):
                continuation = counts.setdefault(key, {})
                continuation[token] = continuation.get(token, 0) + 1
    return counts


def first_occurrences(sequences: Sequence[Sequence[int]], n_min: int, n_max: int) -> list[tuple[bytes, ...]]:
    """Per sequence of one call, per n in [n_min, n_max], a mask over its tokens: 1 at each
    position p >= n whose pair (tokens[p-n:p], tokens[p]) occurs there first in the call
    (its sequences in order), else 0. ``apply`` counts only the positions marked.

    [[1, 2, 1, 2], [2, 1, 3]], n_min=n_max=1: (1,)->2 first at 1, (2,)->1 at 2, (1,)->2
    again at 3 -> bytes([0, 1, 1, 0]); then (2,)->1 is not new, (1,)->3 is -> bytes([0, 0, 1]).
    Raises ValueError for a token id outside uint32.
    """
    try:
        packed = [struct.pack(f">{len(tokens)}I", *tokens) for tokens in sequences]
    except struct.error:
        raise ValueError("token ids must be integers in [0, 2**32)") from None
    offsets = list(accumulate((len(tokens) for tokens in sequences), initial=0))  # of each sequence, in the call
    masks = []
    for n in range(n_min, n_max + 1):
        pairs = chain.from_iterable(
            (sequence[4 * (position - n) : 4 * (position + 1)] for position in range(n, len(sequence) // 4)) for sequence in packed
        )
        where = chain.from_iterable(range(offset + n, end) for offset, end in zip(offsets, offsets[1:]))
        # Built backwards, a dict keeps each pair's last assignment: its first position.
        first = dict(zip(reversed(list(pairs)), reversed(list(where))))
        mask = bytearray(offsets[-1])
        for position in first.values():
            mask[position] = 1
        masks.append(mask)
    return [tuple(bytes(mask[low:high]) for mask in masks) for low, high in zip(offsets, offsets[1:])]
