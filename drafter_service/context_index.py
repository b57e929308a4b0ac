"""A compact n-gram index over one sequence: what ``ContextIndex`` drafts from.

Every n-gram of the sequence, for n in [n_min, n_max + 1], is named by the end
position of its first occurrence, its *id*: tokens[id - n : id] is the n-gram.
Per length (a *level*, 0 for n_min), with N tokens, arrays of uint32 indexed
by id (the entries at other positions stay 0):

* ``occurrences``: [N + 1] how often the n-gram occurs (the one ending the
  sequence, not followed yet, included);
* ``best`` (n <= n_max): [N + 1] the id of the (n+1)-gram "this n-gram + its
  best continuation", 0 while nothing followed it;
* ``links`` (n > n_min): [N + 1] the id of its suffix, the (n-1)-gram ending
  at the same position;
* ``slots``: [capacity] an open-addressing table (linear probing) of ids,
  each slot (id << TAG_BITS) | tag, for finding an n-gram by hashing.

tokens [5, 6, 5, 6, 7], n 1..3: (5,) has id 1 and occurs twice; (5, 6) has id
2, occurs twice, followed by 5 then by 7, each once, 5 first, so best[2] = 3,
the id of (5, 6, 5). Drafting from key (5, 6) answers (5, count 1, total 2):
the token ending the best (n+1)-gram, that (n+1)-gram's occurrences, and the
key's occurrences that were followed.

The best continuation is the one that first reached the highest count (a
later tie does not displace it), the rule of ``InMemoryNGramTable.extend``:
when the (n+1)-gram ``key + t`` occurs, it displaces the best only with
strictly more occurrences than the best's (n+1)-gram.

Two more arrays, by position, chain the occurrences of each n_max-gram, newest
first (``longest_copy``): ``latest`` (by id: where it last ended) and
``earlier`` (by end position: where the same n-gram ended before, 0 if
nowhere).

Memory, with L = n_max - n_min + 2 lengths and N tokens: 4 bytes per token
for the tokens and for each of the 3L per-id arrays, and 4 bytes per
slot; a table doubles before it is half full, and two consecutive lengths
hold at most 1.5 (N + 1) n-grams in slots (see ``max_bytes_for_lengths``);
every array carries CPython's 1/16 growth slack. For the default n 2..4, at
131,072 tokens: at most 4.3 + 51.0 + 51 = 106.4 bytes per token (plus ~6 KB
per index); measured with tracemalloc, 72.3 on random ids, 74.4 on the
standard library's source, 55.3 on a short pattern repeated, 63.8 on a text
repeated twice, 76.5 on 2-grams followed by many tokens (an
InMemoryNGramTable takes ~550 on random ids, ~270 on text).

The walk (``_walk``) and the per-token loop share one rule: the n-gram ending
at a position is its prefix's continuation, found without hashing when it is
the prefix's best one, and known absent when the prefix only ever had
another; only the other cases hash.

Hashing: token ids come from network callers, and Python's int and tuple
hashes are not randomized, so an n-gram is hashed as ``hash(salt + its 4n
bytes)``: SipHash (keyed per process, unless PYTHONHASHSEED is fixed) of the
bytes behind a secret 16-byte salt drawn per index, so that even a caller who
knows the process's key cannot compute where an n-gram lands (a salt combined
after hashing would not do: n-grams crafted to collide under one salt would
collide under every salt). slot = the low log2(capacity) bits, tag = bits
56..63. Probes that meet another n-gram's slot are counted (``collisions``);
should they exceed ``COLLISIONS_PER_PROBE`` per n-gram hashed (past an
allowance that doubles each time), the index draws a new salt and rebuilds.
"""

from __future__ import annotations

import os
import struct
import sys
from array import array
from collections.abc import Callable, Iterable, Sequence

import numpy as np

TOKEN_BYTES = 4
assert array("I").itemsize == TOKEN_BYTES, "array('I') must hold 4-byte unsigned ints"
MAX_TOKEN_ID = (1 << 32) - 1  # tokens are stored as array('I'): 0 <= id <= MAX_TOKEN_ID
# A slot holds (id << TAG_BITS) | tag, the tag being 8 more bits of the n-gram's
# hash: a probe that meets another n-gram almost never compares tokens.
TAG_BITS = 8
TAG_MASK = (1 << TAG_BITS) - 1
TAG_SHIFT = 56  # the tag is bits 56..63 of the hash; the slot comes from the low bits
MAX_TOKENS = (1 << (32 - TAG_BITS)) - 1  # ids (end positions) must fit beside the tag

# A table doubles before it is more than half full: linear probing then meets
# ~0.5 other n-grams per lookup, for 4-8 bytes per n-gram it holds.
MAX_LOAD_NUMERATOR, MAX_LOAD_DENOMINATOR = 1, 2
# No table is smaller (4 x 512 bytes for a short context), so that a new index
# takes GROWTH_MARGIN_TOKENS tokens before its first table grows.
MIN_SLOTS = 128
# The per-id arrays grow by at least this many positions (then to what CPython
# allocated, 1/16 ahead): a call of a few tokens rarely grows ten arrays.
RESERVE_MIN_POSITIONS = 16
# Indexing a call of at least this many tokens, and at least as many as the
# index holds, rebuilds the whole index with numpy (sorting, ~1 us a token)
# instead of the per-token loop (~3-4 us a token); below, numpy's fixed cost
# (~0.4 ms) loses (measured crossover: ~100 tokens).
BULK_INDEX_MIN_TOKENS = 96
# A table grows when it could not take this many more tokens' n-grams, so that
# one near full is not re-examined at every call (2 KB more at most).
GROWTH_MARGIN_TOKENS = 16
# At half load a probe meets ~0.5 other n-grams on average; 8 per n-gram
# hashed (past a start-up allowance) only happens to hashing gone wrong,
# which a new salt fixes.
COLLISIONS_PER_PROBE = 8
COLLISION_ALLOWANCE = 4096
# Copies: the earlier occurrences of the last n_max tokens tried, newest first, and the
# longest match counted (a match that long picks one version of a text over another; a
# longer one would only cost comparisons). Compared MATCH_BLOCK tokens at a time.
COPY_CANDIDATES = 16
COPY_LONGEST = 256
MATCH_BLOCK = 16
SALT_BYTES = 16  # a secret SipHash prefix: not guessable, one SipHash block more
# Bytes of Python objects an index holds besides its arrays' buffers (the
# object, its lists, the row tuples its loops unpack), per index and per
# length: measured 1.8 KB at the default four lengths (3.3 KB at nine),
# bounded with room.
FIXED_OVERHEAD_BYTES = 4096
OVERHEAD_BYTES_PER_LENGTH = 512


# Packers for n tokens into the bytes array('I') holds (native 4-byte unsigned
# ints), shared by every index (made up front: not part of any index's bytes).
_ARRAY_HEADER = sys.getsizeof(array("I"))  # an array's bytes besides its items

_PACKERS: dict[int, Callable[..., bytes]] = {n: struct.Struct(f"={n}I").pack for n in range(1, 17)}


def _packer(n: int) -> Callable[..., bytes]:
    if n not in _PACKERS:
        _PACKERS[n] = struct.Struct(f"={n}I").pack
    return _PACKERS[n]


def capacity_for(held: int) -> int:
    """Slots of a table holding ``held`` n-grams: a power of two at most half full."""
    capacity = MIN_SLOTS
    while held * MAX_LOAD_DENOMINATOR > capacity * MAX_LOAD_NUMERATOR:
        capacity *= 2
    return capacity


def _array_bytes_bound(items: int, itemsize: int) -> int:
    """sys.getsizeof of an array of ``items`` at most, whatever appends built it:
    CPython's array grows to n + n/16 + 7 items (more for tiny ones)."""
    return sys.getsizeof(array("I")) + itemsize * (items + (items >> 4) + 8)


def place(homes: np.ndarray, values: np.ndarray, capacity: int) -> array:
    """A linear-probing table of ``capacity`` slots holding ``values``, each
    reachable from its home slot (every slot between them occupied).

    homes [1, 1, 2], values [7, 8, 9], capacity 4 -> slots [0, 7, 8, 9]: 8 moves
    one past its home, which pushes 9 on too; a run past the end wraps to slot 0.
    """
    order = np.argsort(homes, kind="stable")
    sorted_homes, sorted_values = homes[order], values[order]
    rank = np.arange(len(order))
    # In home order each value takes its home or the slot after the previous
    # value's, whichever is later: rank + the running max of (home - rank).
    positions = np.maximum.accumulate(sorted_homes - rank) + rank if len(order) else rank
    table = np.zeros(capacity, dtype=np.uint32)
    inside = positions < capacity
    table[positions[inside]] = sorted_values[inside]
    free = 0
    for value in sorted_values[~inside].tolist():  # the few that ran past the end
        while table[free]:
            free += 1
        table[free] = value
        free += 1
    return _to_array(table)


class Tokens(array):
    """array('I') of a sequence's tokens that also equals the list of them (a
    context's ``tokens`` used to be a list; slices are plain arrays)."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, list):
            return self.tolist() == other
        return super().__eq__(other)


class CompactNGramIndex:
    """Every n-gram (n_min..n_max+1) of a growing sequence, with what drafting asks of it.

    index = CompactNGramIndex(2, 2); index.extend([1, 2, 3, 1, 2, 4])
    index.best((1, 2)) -> (3, 1, 2): (1, 2) was followed twice, by 3 and by 4
    once each, 3 first. index.best((2, 4)) -> None: (2, 4) ends the sequence.

    The n-grams form a trie, read both ways. Forward, an (n+1)-gram is (its
    n-gram prefix, one token): a prefix's best continuation is ``best``, and
    the others hold slots. Backward, ``links`` names each n-gram's suffix one
    token shorter. To index a token, or to walk a draft (``walk``), the longest
    n-gram ending there is found through its prefix (no hashing when the token
    is the prefix's best continuation, or when the prefix never had another)
    and the shorter ones are read off the links.

    Which n-grams hold a slot: every one of the shortest length and of n_max
    (the lengths looked up by hashing); in between and at n_max + 1, only the
    continuations of a prefix that has had two or more different ones (a
    prefix with one continuation reaches it through ``best``).
    """

    __slots__ = (
        "n_min",
        "n_max",
        "tokens",
        "collisions",
        "_salt",
        "_packers",
        "_lengths",
        "_complete",
        "_per_token",
        "_occurrences",
        "_best",
        "_links",
        "_slots",
        "_distinct",
        "_suffix",
        "_positions",
        "_room",
        "_walk_rows",
        "_index_rows",
        "probes",
        "_allowance",
        "_bulk_min_tokens",
        "_latest",
        "_earlier",
    )

    def __init__(self, n_min: int, n_max: int, *, salt: bytes | None = None, bulk_min_tokens: int = BULK_INDEX_MIN_TOKENS) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.tokens = Tokens("I")  # [N] the sequence itself
        self._lengths = list(range(n_min, n_max + 2))  # L lengths; the last one only counts continuations
        levels = range(len(self._lengths))
        self._complete = [level in (0, len(levels) - 2) for level in levels]  # every n-gram holds a slot
        # New slots one token can take per length: one n-gram, or (where only
        # continuations of prefixes with several hold one) a prefix's second and first.
        self._per_token = [1 if complete else 2 for complete in self._complete]
        # Secret per index (a test may fix it): combined into every n-gram's hash.
        self._salt = _new_salt() if salt is None else salt
        self._packers = [_packer(n) for n in self._lengths]
        self._occurrences = [array("I") for _ in levels]  # L x [positions + 1], by id
        self._best = [array("I") for _ in levels[:-1]]  # (L - 1) x [positions + 1]: the best continuation's id
        self._links = [array("I") for _ in levels]  # L x [positions + 1]: the suffix's id ([0] stays empty)
        # The occurrences of each n_max-gram, newest first (``longest_copy``): by id, where
        # it last ended; by end position, where the same n-gram ended before (0: nowhere).
        self._latest = array("I")  # [positions + 1]
        self._earlier = array("I")  # [positions + 1]
        self._slots = [array("I", bytes(TOKEN_BYTES * MIN_SLOTS)) for _ in levels]  # L x [capacity]
        self._distinct = [0 for _ in levels]  # n-grams holding a slot, per length
        self._suffix = [0 for _ in levels]  # ids of the n-grams ending the sequence (0: shorter than n)
        self._positions = -1  # end positions the per-id arrays cover (they grow ahead)
        self._room = 0  # tokens the tables can take before one must grow
        self.probes = 0  # n-grams hashed (looked up or given a slot) since the salt was drawn
        self.collisions = 0  # and the other n-grams' slots those probes met
        self._allowance = COLLISION_ALLOWANCE  # collisions tolerated past COLLISIONS_PER_PROBE per probe
        self._bulk_min_tokens = bulk_min_tokens
        self._walk_rows: tuple[list, list] = ([], [])
        self._index_rows: tuple = ()
        self._reserve_positions(0)
        self._refresh_rows()

    def __len__(self) -> int:
        return len(self.tokens)

    def _per_id_arrays(self) -> tuple[array, ...]:
        return (*self._occurrences, *self._best, *self._links[1:], self._latest, self._earlier)

    # --- memory -------------------------------------------------------------------

    def nbytes(self) -> int:
        """An upper bound on the bytes this index holds, in O(1): its arrays'
        allocations (sys.getsizeof) plus a bound on its other objects."""
        arrays = (self.tokens, *self._per_id_arrays(), *self._slots)
        return _overhead(len(self._lengths)) + sum(sys.getsizeof(held) for held in arrays)

    @staticmethod
    def max_bytes_for_lengths(tokens: int, n_min: int, n_max: int) -> int:
        """The most ``nbytes()`` can be once ``tokens`` tokens are indexed, however they arrived.

        Per id, 3L arrays of 4 bytes (with their growth slack). Slots: a table
        is at most half full, so at most 4 slots per n-gram it holds (a few more
        while small). Two consecutive lengths hold at most 1.5 (N + 1) n-grams
        between them: the longer one's either hold no slot, or belong to a
        prefix that occurred twice or more, or to a length that holds all (then
        the shorter one holds only those of a repeated prefix); and of d
        distinct prefixes among N + 1 occurrences at least 2d - (N + 1) occur
        once, which leaves at most 2 (N + 1) - 2d occurrences to continue.
        """
        lengths = len(range(n_min, n_max + 2))
        per_id = _array_bytes_bound(tokens + 1 + RESERVE_MIN_POSITIONS, TOKEN_BYTES) * (3 * lengths)
        held = (tokens + 1) * 3 * (lengths // 2) // 2 + (tokens + 1) * (lengths % 2)  # n-grams in all tables
        margin = 2 * GROWTH_MARGIN_TOKENS * lengths  # a table grows that much ahead
        slots = 2 * MAX_LOAD_DENOMINATOR * (held + margin) // MAX_LOAD_NUMERATOR + 2 * MIN_SLOTS * lengths
        # Each table is an array too, with its growth slack: one bound over all of them.
        tables = _array_bytes_bound(slots, TOKEN_BYTES) + (lengths - 1) * _array_bytes_bound(0, TOKEN_BYTES)
        return _overhead(lengths) + _array_bytes_bound(tokens, TOKEN_BYTES) + per_id + tables

    # --- lookup -------------------------------------------------------------------

    def best(self, key: Sequence[int]) -> tuple[int, int, int] | None:
        """(token, count, total) for the continuation of ``key`` that first reached
        the highest count; None when nothing in the sequence followed ``key``."""
        level = len(key) - self.n_min
        if not 0 <= level < len(self._best):
            return None
        found = self._lookup(level, key)
        if not found:
            return None
        chosen = self._best[level][found]
        if not chosen:  # its one occurrence ends the sequence
            return None
        # The sequence's own last n-gram has not been followed yet.
        total = self._occurrences[level][found] - (found == self._suffix[level])
        return self.tokens[chosen - 1], self._occurrences[level + 1][chosen], total

    def longest_copy(self, candidates: int = COPY_CANDIDATES, longest: int = COPY_LONGEST) -> tuple[int, int]:
        """(end, length): where the sequence's longest suffix occurred before, as the end
        position of that occurrence, and how many tokens long it is (at most ``longest``);
        (0, 0) when the sequence's last n_max tokens never occurred before.

        The candidates are the newest ``candidates`` earlier occurrences of the last n_max
        tokens (the occurrence chain); of those matching longest, the newest wins, so a
        text returned with edits is copied from its latest version.

        tokens [7, 1, 2, 3, 4, 8, 9, 1, 2, 3, 4, 5, 9, 1, 2, 3, 4], n 2..4: the last 4-gram
        (1, 2, 3, 4) ended at 11 and at 5 before; ending at 11 it is preceded by 9 as the
        sequence's is, so (11, 5): tokens[11] = 5 comes next in the copy.
        """
        size = len(self.tokens)
        if not self._suffix[len(self._lengths) - 2]:
            return 0, 0
        toks, earlier = self.tokens, self._earlier
        end, found, matched = earlier[size], 0, 0
        for _ in range(candidates):
            if not end:
                break
            length = _match_back(toks, end, size, self.n_max, min(longest, end))
            if length > matched:
                found, matched = end, length
            end = earlier[end]
        return found, matched

    def walk(self, context: object, drafted: list[int]) -> Callable[[Sequence[int]], tuple[int, int, int] | None] | None:
        """For ``propose_chain``: a ``best`` that walks ``context`` (when it is this
        index's own sequence; else None) and then ``drafted`` as it grows."""
        return _walk(self, drafted) if context is self.tokens else None

    def _lookup(self, level: int, key: Sequence[int]) -> int:
        """The id of ``key`` (an n-gram of ``level``), 0 if it never occurred: hashed
        when its length holds every n-gram, else its shortest prefix, then
        continuation after continuation."""
        try:
            if self._complete[level]:
                return self._find(level, self._packers[level](*key))
            found = self._find(0, self._packers[0](*key[: self.n_min]))
        except struct.error:  # an id no array('I') holds: in no sequence
            return 0
        for step in range(1, level + 1):
            if not found:
                return 0
            found = self._child(step, found, key[: self.n_min + step])
        return found

    def _child(self, level: int, prefix: int, gram: Sequence[int]) -> int:
        """The id of ``gram`` (at ``level``): ``prefix`` (the id of its first n - 1
        tokens) followed by gram[-1]; 0 if it never occurred."""
        chosen = self._best[level - 1][prefix]
        if not chosen:
            return 0
        if self.tokens[chosen - 1] == gram[-1]:
            return chosen
        # The sequence's last (n-1)-gram has not been followed yet.
        followed = self._occurrences[level - 1][prefix] - (prefix == self._suffix[level - 1])
        if self._occurrences[level][chosen] == followed:
            return 0  # the prefix was only ever followed by its best continuation
        try:
            return self._find(level, self._packers[level](*gram))
        except struct.error:
            return 0

    def _find(self, level: int, packed: bytes) -> int:
        """The id of the n-gram whose tokens' bytes are ``packed`` if it holds a slot, else 0."""
        slots, n, toks = self._slots[level], self._lengths[level], self.tokens
        hashed = hash(self._salt + packed)
        mask = len(slots) - 1
        slot, tag = hashed & mask, hashed >> TAG_SHIFT & TAG_MASK
        self.probes += 1
        entry = slots[slot]
        while entry:
            if entry & TAG_MASK == tag:
                found = entry >> TAG_BITS
                if toks[found - n : found].tobytes() == packed:
                    return found
            self.collisions += 1
            slot = (slot + 1) & mask
            entry = slots[slot]
        return 0

    def _insert(self, level: int, gram_id: int, packed: bytes) -> None:
        """Give the n-gram ``gram_id`` (tokens' bytes ``packed``; it holds no slot yet) a slot."""
        slots = self._slots[level]
        hashed = hash(self._salt + packed)
        mask = len(slots) - 1
        slot = hashed & mask
        self.probes += 1
        while slots[slot]:
            self.collisions += 1
            slot = (slot + 1) & mask
        slots[slot] = gram_id << TAG_BITS | hashed >> TAG_SHIFT & TAG_MASK
        self._distinct[level] += 1

    def _refresh_rows(self) -> None:
        """The per-length tuples the loops unpack, built again whenever an array is
        replaced; and the room the tables leave."""
        occurrences, bests = self._occurrences, self._best
        answers: list = [None] * self.n_min + [
            (level, best, occurrences[level], occurrences[level + 1]) for level, best in enumerate(bests)
        ]
        steps = [
            (level, bests[level - 1], occurrences[level], occurrences[level - 1], self._lengths[level])
            for level in range(len(bests) - 1, 0, -1)
        ]
        self._walk_rows = (answers, steps)
        # For the indexing loop. Per length above the shortest: (level, n, its bytes,
        # occurrences, the prefixes' occurrences, the prefixes' best), longest first;
        # the same with links, slots, slot mask and whether all hold a slot, shortest first.
        rows = [
            (level, n, TOKEN_BYTES * n, occurrences[level], occurrences[level - 1], bests[level - 1])
            for level, n in enumerate(self._lengths)
            if level
        ]
        upward = [(*row, self._links[row[0]], self._slots[row[0]], len(self._slots[row[0]]) - 1, self._complete[row[0]]) for row in rows]
        self._index_rows = (rows, rows[::-1], upward, occurrences, [None, *bests], self._links)
        self._room = self._exact_room()

    def _exact_room(self) -> int:
        """Tokens the tables can take before one must grow."""
        return min(
            (len(slots) * MAX_LOAD_NUMERATOR // MAX_LOAD_DENOMINATOR - held) // per_token
            for slots, held, per_token in zip(self._slots, self._distinct, self._per_token)
        )

    # --- indexing -----------------------------------------------------------------

    def extend(self, new_tokens: Iterable[int]) -> None:
        """Append tokens and index the n-grams they complete. ValueError, and nothing
        appended, for an id outside [0, MAX_TOKEN_ID] or past MAX_TOKENS tokens."""
        try:
            new = array("I", new_tokens)
        except OverflowError:
            raise ValueError(f"token ids must be in [0, {MAX_TOKEN_ID}]") from None
        added, start = len(new), len(self.tokens)
        if not added:
            return
        if start + added > MAX_TOKENS:
            raise ValueError(f"a context holds at most {MAX_TOKENS} tokens; this one would hold {start + added}")
        self.tokens.extend(new)
        if added >= self._bulk_min_tokens and added >= start:
            self._rebuild()
            return
        if start + added > self._positions:
            self._reserve_positions(start + added)
        stop = start + added
        while start < stop:  # in chunks the tables can take, so that none grows before it must
            if self._room < 1:
                self._make_room()
            chunk = min(stop - start, self._room)
            self._room -= chunk
            self._index_positions(start, start + chunk)
            start += chunk
        if self.collisions > COLLISIONS_PER_PROBE * self.probes + self._allowance:
            # Hashing gone wrong: bad luck, or a caller who knows the keys. The
            # allowance doubles, so that rebuilds stay a small part of the work.
            self._salt, self._allowance = _new_salt(), 2 * self._allowance
            self._rebuild()

    def _reserve_positions(self, positions: int) -> None:
        """Grow the per-id arrays to cover end positions up to ``positions``, and on to
        what the arrays allocated anyway (CPython's 1/16 ahead): few calls grow them."""
        for grown in self._per_id_arrays():
            grown.frombytes(bytes(TOKEN_BYTES * max(0, positions + 1 + RESERVE_MIN_POSITIONS - len(grown))))
        self._fill_allocation()

    def _fill_allocation(self) -> None:
        """Lengthen the per-id arrays (all the same length) to what they hold allocated."""
        arrays = self._per_id_arrays()
        allocated = min((sys.getsizeof(grown) - _ARRAY_HEADER) // TOKEN_BYTES for grown in arrays)
        for grown in arrays:
            if len(grown) < allocated:
                grown.frombytes(bytes(TOKEN_BYTES * (allocated - len(grown))))
        self._positions = min(len(grown) for grown in arrays) - 1

    def _make_room(self) -> None:
        """Double every table that could not take ``GROWTH_MARGIN_TOKENS`` more tokens'
        n-grams, then work out the room left."""
        grew = False
        for level, (slots, held, per_token) in enumerate(zip(self._slots, self._distinct, self._per_token)):
            wanted = held + per_token * GROWTH_MARGIN_TOKENS
            if wanted * MAX_LOAD_DENOMINATOR > len(slots) * MAX_LOAD_NUMERATOR:
                self._slots[level] = self._table(level, _ids_in(slots), capacity_for(wanted))
                grew = True
        if grew:
            self._refresh_rows()
        else:
            self._room = self._exact_room()

    def _index_positions(self, start: int, stop: int) -> None:
        """For each end position in (start, stop]: the longest n-gram ending there that
        occurred before (the longer ones are new), then every length's count, and
        each n-gram as its prefix's continuation (strictly more occurrences
        displace the best: on a tie the one that got there first stays)."""
        toks, find, insert, salt, distinct = self.tokens, self._find, self._insert, self._salt, self._distinct
        rows, downward, upward, counts_of, chosen_of_level, links_of = self._index_rows
        n_min, collisions = self.n_min, 0
        latest, earlier, key_level = self._latest, self._earlier, len(counts_of) - 2
        base_slots = self._slots[0]
        base_mask = len(base_slots) - 1
        base_counts = counts_of[0]
        base = max(0, start + 1 - self._lengths[-1])  # the window holds every n-gram ending at a new position
        window = toks[base:stop].tobytes()
        previous, current = self._suffix, [0] * len(counts_of)
        for end in range(start + 1, stop + 1):
            token = toks[end - 1]
            right = TOKEN_BYTES * (end - base)
            # The longest n-gram ending here that occurred before: its prefix's best
            # continuation, or one of the others, which hold slots.
            for level, n, width, counts, prefix_counts, chosen_of in downward:
                if end >= n:
                    prefix = previous[level - 1]
                    found = chosen_of[prefix]
                    if found:
                        if toks[found - 1] == token:
                            break
                        if counts[found] != prefix_counts[prefix] - 1:  # other continuations hold slots
                            found = find(level, window[right - width : right])
                            if found:
                                break
            else:
                if end < n_min:
                    continue  # no n-gram ends here yet (``current`` stays all 0)
                # The shortest length holds every n-gram: find it, or the free slot for it.
                packed = window[right - TOKEN_BYTES * n_min : right]
                hashed = hash(salt + packed)
                slot, tag = hashed & base_mask, hashed >> TAG_SHIFT & TAG_MASK
                found = 0
                entry = base_slots[slot]
                while entry:
                    if entry & TAG_MASK == tag:
                        found = entry >> TAG_BITS
                        if toks[found - n_min : found].tobytes() == packed:
                            break
                        found = 0
                    collisions += 1
                    slot = (slot + 1) & base_mask
                    entry = base_slots[slot]
                level = 0
                if not found:
                    base_slots[slot] = end << TAG_BITS | tag
                    distinct[0] += 1
                    current[0] = end
                    base_counts[end] = 1
                    level = -1  # every length's n-gram is new here (the shortest has its slot)
            if level >= 0:
                current[level] = found
                for shorter in range(level, 0, -1):  # its suffixes occurred before too
                    found = current[shorter - 1] = links_of[shorter][found]
            # Longer n-grams are new: their id is this end position.
            for longer, n, width, counts, prefix_counts, chosen_of, links, slots, mask, complete in upward[max(level, 0) :]:
                if end < n:
                    for rest in range(longer, len(counts_of)):
                        current[rest] = 0
                    break
                current[longer] = end
                counts[end] = 1
                links[end] = current[longer - 1]
                prefix = previous[longer - 1]
                chosen = chosen_of[prefix]
                if not chosen:  # the prefix's first continuation, reached through ``best``
                    chosen_of[prefix] = end
                    if not complete:
                        continue
                elif not complete and counts[chosen] == prefix_counts[prefix] - 1:
                    # The prefix's second continuation: its first takes a slot too.
                    insert(longer, chosen, toks[chosen - n : chosen].tobytes())
                hashed = hash(salt + window[right - width : right])
                slot = hashed & mask
                while slots[slot]:
                    collisions += 1
                    slot = (slot + 1) & mask
                slots[slot] = end << TAG_BITS | hashed >> TAG_SHIFT & TAG_MASK
                distinct[longer] += 1
            # The n-grams that occurred before: one more occurrence each, which may make
            # it its prefix's best continuation.
            if level >= 0:
                base_counts[current[0]] += 1
                for gram, prefix, counts, chosen_of in zip(current[1 : level + 1], previous, counts_of[1:], chosen_of_level[1:]):
                    count = counts[gram] + 1
                    counts[gram] = count
                    chosen = chosen_of[prefix]
                    if chosen != gram and count > counts[chosen]:
                        chosen_of[prefix] = gram
            gram = current[key_level]  # the n_max-gram ending here, newest of its occurrences
            if gram:
                earlier[end] = latest[gram]
                latest[gram] = end
            previous, current = current, previous
        self._suffix = previous
        self.collisions += collisions
        self.probes += stop - start

    def _table(self, level: int, ids: np.ndarray, capacity: int) -> array:
        """A table of ``capacity`` slots holding the n-grams ``ids`` (end positions, int64)."""
        n, held, salt = self._lengths[level], self.tokens.tobytes(), self._salt
        starts, ends = (TOKEN_BYTES * (ids - n)).tolist(), (TOKEN_BYTES * ids).tolist()
        hashed = np.array([hash(salt + held[start:end]) for start, end in zip(starts, ends)], dtype=np.int64)
        tags = (hashed >> TAG_SHIFT) & TAG_MASK
        self.probes += len(ids)
        return place(hashed & (capacity - 1), ((ids << TAG_BITS) | tags).astype(np.uint32), capacity)

    # --- indexing a long call at once ---------------------------------------------

    def _rebuild(self) -> None:
        """Index the whole sequence at once with numpy: the same ids, counts, best
        continuations and links as the per-token loop."""
        tokens = np.frombuffer(self.tokens, dtype=np.uint32).astype(np.uint64)
        size = len(tokens)
        if self.n_min == 1:  # by end position: the empty 0-gram has id 0
            first, previous_ids = 1, np.zeros(size + 1, dtype=np.uint64)
        else:  # 1-grams need no ids of their own: the token tells one from another
            first, previous_ids = 2, np.concatenate([np.zeros(1, dtype=np.uint64), tokens])
        grams: dict[int, _Grams | None] = {}
        for n in range(first, self._lengths[-1] + 1):
            found = None if n > size else _Grams.of(tokens, previous_ids, n)
            grams[n] = found
            if found is not None:
                previous_ids = found.id_at
        self._positions = size
        self.collisions = self.probes = 0
        for level, n in enumerate(self._lengths):
            self._install(level, n, grams[n], grams.get(n + 1), size)
        self._install_occurrences(grams[self.n_max], size)
        self._fill_allocation()
        self._refresh_rows()

    def _install_occurrences(self, grams: _Grams | None, size: int) -> None:
        """``_latest`` and ``_earlier`` of the rebuilt n_max-grams: each occurrence's
        predecessor in its n-gram's run of end positions, and each run's last."""
        latest, earlier = np.zeros(size + 1, dtype=np.uint32), np.zeros(size + 1, dtype=np.uint32)
        if grams is not None:
            ends = np.arange(self.n_max, size + 1)
            ids = grams.id_at[ends].astype(np.int64)
            order = np.lexsort((ends, ids))  # by n-gram, then by end position
            ends, ids = ends[order], ids[order]
            same = ids[1:] == ids[:-1]
            earlier[ends[1:][same]] = ends[:-1][same]
            lasts = np.r_[~same, True]
            latest[ids[lasts]] = ends[lasts]
        self._latest, self._earlier = _to_array(latest), _to_array(earlier)

    def _install(self, level: int, n: int, grams: _Grams | None, longer: _Grams | None, size: int) -> None:
        """Replace one length's arrays by those of the rebuilt ``grams`` (and, for a
        key length, the best continuation of each key among the ``longer`` ones)."""
        positions = self._positions + 1
        occurrences, links = np.zeros(positions, dtype=np.uint32), np.zeros(positions, dtype=np.uint32)
        in_table = np.zeros(0, dtype=np.int64)
        self._suffix[level] = 0
        if grams is not None:
            occurrences[grams.first_ends] = grams.counts
            links[grams.first_ends] = grams.previous_id_at[grams.first_ends]
            self._suffix[level] = int(grams.id_at[size])
            in_table = grams.first_ends
            if not self._complete[level]:  # only the continuations of a prefix with two or more
                keys = grams.keys()
                in_table = grams.first_ends[np.bincount(keys, minlength=size + 1)[keys] >= 2]
        if level < len(self._best):
            best = np.zeros(positions, dtype=np.uint32)
            if longer is not None:
                keys = longer.keys()
                # Per key, the most occurrences, then the earliest last occurrence:
                # the continuation that reached that count first.
                order = np.lexsort((longer.last_ends, -longer.counts, keys))
                leads = np.r_[True, keys[order][1:] != keys[order][:-1]]
                best[keys[order][leads]] = longer.first_ends[order][leads]
            self._best[level] = _to_array(best)
        self._occurrences[level] = _to_array(occurrences)
        if level:
            self._links[level] = _to_array(links)
        self._distinct[level] = len(in_table)
        self._slots[level] = self._table(level, in_table, capacity_for(len(in_table)))


def _match_back(tokens: array, end: int, size: int, known: int, most: int) -> int:
    """How many tokens ending at ``end`` equal those ending at ``size`` (end < size), given
    that the last ``known`` do, at most ``most``: compared a block at a time, then token by
    token in the block that differs."""
    matched = known
    while matched < most:
        block = min(most, matched + MATCH_BLOCK)
        if tokens[end - block : end - matched] == tokens[size - block : size - matched]:
            matched = block
            continue
        while tokens[end - matched - 1] == tokens[size - matched - 1]:
            matched += 1
        break
    return matched


UNKNOWN = -1  # a walk's n-gram id not worked out (0: known not to occur)


def _walk(index: CompactNGramIndex, drafted: list[int]) -> Callable[[Sequence[int]], tuple[int, int, int] | None]:
    """A ``best`` for ``propose_chain`` that walks the draft instead of hashing each key.

    It keeps, per key length, the id of the n-gram ending the context and the
    tokens ``drafted`` so far (0: it does not occur; UNKNOWN: not worked out).
    When the draft has grown since the last call it steps along: each prefix to
    its continuation (``best``; a slot for a prefix that had several; nothing
    for one that only ever had another), the shorter n-grams off the links;
    what only hashing could tell stays UNKNOWN until a key of that length is
    asked. It answers as ``CompactNGramIndex.best`` for key = the last len(key)
    tokens walked, and only for those.

    context [1, 2, 3, 1, 2], n 2..2: the walk starts at (1, 2) (id 2); once 3 is
    drafted it follows (1, 2)'s best continuation to (2, 3) (id 3) without
    hashing, and best((2, 3)) -> (1, 1, 1).
    """
    ids = index._suffix[:-1]  # per key length, the n-gram ending the walk
    answers, steps = index._walk_rows
    toks, ending, links, find, lookup = index.tokens, index._suffix, index._links, index._find, index._lookup
    walked = 0  # how many drafted tokens the ids account for

    def best(key: Sequence[int]) -> tuple[int, int, int] | None:
        nonlocal walked
        while walked < len(drafted):  # step along the tokens drafted since the last call
            token = drafted[walked]
            walked += 1
            for level, chosen_of, counts, prefix_counts, n in steps:  # the longest first
                prefix = ids[level - 1]  # ends before this token
                if prefix <= 0:  # UNKNOWN stays so; nothing continues an n-gram that does not occur
                    ids[level] = prefix
                    continue
                found = chosen_of[prefix]
                if found and toks[found - 1] != token:
                    if counts[found] == prefix_counts[prefix] - (prefix == ending[level - 1]):
                        found = 0  # the prefix was only ever followed by its best continuation
                    else:
                        try:
                            found = find(level, toks[prefix - n + 1 : prefix].tobytes() + _ONE(token))
                        except struct.error:  # an id no array('I') holds: in no sequence
                            found = 0
                ids[level] = found
                if found:
                    for shorter in range(level, 0, -1):  # its suffixes
                        found = ids[shorter - 1] = links[shorter][found]
                    break
            else:
                ids[0] = UNKNOWN  # the shortest n-gram: only hashing can tell
        level, chosen_of, counts, continuations = answers[len(key)]
        found = ids[level]
        if found == UNKNOWN:
            found = ids[level] = lookup(level, key)
            suffix = found
            for shorter in range(level, 0, -1) if found else ():  # its suffixes
                suffix = ids[shorter - 1] = links[shorter][suffix]
        if not found:
            return None
        chosen = chosen_of[found]
        if not chosen:  # its one occurrence ends the context
            return None
        return toks[chosen - 1], continuations[chosen], counts[found] - (found == ending[level])

    return best


class _Grams:
    """The distinct n-grams of one length in a whole sequence (numpy, int64 by end position)."""

    def __init__(
        self, first_ends: np.ndarray, last_ends: np.ndarray, counts: np.ndarray, id_at: np.ndarray, previous_id_at: np.ndarray
    ) -> None:
        self.first_ends = first_ends  # [distinct] the id of each
        self.last_ends = last_ends  # [distinct] where each occurs last
        self.counts = counts  # [distinct] how often each occurs
        self.id_at = id_at  # [N + 1] the id of the n-gram ending at each position (0 below n)
        self.previous_id_at = previous_id_at  # [N + 1] the same for the (n-1)-grams

    @classmethod
    def of(cls, tokens: np.ndarray, previous_id_at: np.ndarray, n: int) -> _Grams:
        """tokens: [N] uint64; previous_id_at: [N + 1] the (n-1)-gram ids by end position."""
        size = len(tokens)
        ends = np.arange(n, size + 1)
        # The n-gram ending at e is (the (n-1)-gram ending at e - 1, token e - 1).
        codes = (previous_id_at[ends - 1] << np.uint64(32)) | tokens[ends - 1]
        order = np.argsort(codes, kind="stable")  # stable: the earliest end leads its group
        sorted_codes = codes[order]
        leads = np.r_[True, sorted_codes[1:] != sorted_codes[:-1]]
        starts = np.flatnonzero(leads)
        first_ends = ends[order[starts]]
        last_ends = ends[order[np.r_[starts[1:] - 1, len(codes) - 1]]]
        id_at = np.zeros(size + 1, dtype=np.uint64)
        id_at[ends[order]] = first_ends[np.cumsum(leads) - 1].astype(np.uint64)
        return cls(first_ends, last_ends, np.diff(np.r_[starts, len(codes)]), id_at, previous_id_at)

    def keys(self) -> np.ndarray:
        """[distinct] int64: the id of each n-gram's first n - 1 tokens (its key)."""
        return self.previous_id_at[self.first_ends - 1].astype(np.int64)


def _to_array(values: np.ndarray) -> array:
    """array('I') with the values of a uint32 numpy array (a copy, free to grow)."""
    result = array("I")
    result.frombytes(values.astype(np.uint32).tobytes())
    return result


def _ids_in(slots: array) -> np.ndarray:
    """[held] int64: the ids a table's slots hold."""
    entries = np.frombuffer(slots, dtype=np.uint32)
    return (entries[entries != 0] >> np.uint32(TAG_BITS)).astype(np.int64)  # a copy: the buffer export ends here


_ONE = _packer(1)  # one token's bytes


def _overhead(lengths: int) -> int:
    """A bound on an index's bytes outside its arrays' buffers."""
    return FIXED_OVERHEAD_BYTES + OVERHEAD_BYTES_PER_LENGTH * lengths


def _new_salt() -> bytes:
    return os.urandom(SALT_BYTES)
