"""Unit tests for drafter_service.context_index: the compact context index drafts
exactly as the dict-based one it replaced, within its memory bound, and stays
cheap on inputs crafted to collide."""

from __future__ import annotations

import json
import random
import re
import struct
import tracemalloc
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drafter_service import context_index
from drafter_service.context_index import MAX_TOKEN_ID, CompactNGramIndex, place
from drafter_service.ngram import (
    GLOBAL_RUN_LONGEST,
    SOURCE_CONTEXT,
    SOURCE_GLOBAL,
    ContextIndex,
    Draft,
    Evidence,
    InMemoryNGramTable,
    NGramConfig,
    NGramSource,
    propose_chain,
)


def corpus_tokens(limit: int) -> list[int]:
    """Word ids over the standard library's source (bench_drafter's stream): real, repetitive text."""
    ids: dict[str, int] = {}
    tokens: list[int] = []
    for path in sorted(Path(json.__file__).parent.parent.glob("*.py")):
        for word in re.findall(r"\w+|[^\w\s]", path.read_text(errors="replace")):
            tokens.append(ids.setdefault(word, len(ids)))
            if len(tokens) >= limit:
                return tokens
    return tokens


# --- the reference: the context index as it was before the compact one ---------------


def reference_propose_chain(
    context: Sequence[int], sources: Sequence[tuple[str, NGramSource]], k: int, config: NGramConfig, run: int = 0
) -> Draft:
    """propose_chain before the compact index (no walk): one ``best`` per source and length;
    a global link on an n_max key reports n_max + the global links on such keys before it + ``run``."""
    n_max, min_global, trusted = config.n_max, config.min_global_count, config.global_trusted_match_length
    lookups = [(name, source.best, name == SOURCE_GLOBAL) for name, source in sources]
    tail = tuple(context[-n_max:]) if context else ()
    lengths = range(min(n_max, len(tail)), config.n_min - 1, -1)
    tokens: list[int] = []
    evidence: list[Evidence] = []
    for _ in range(k):
        hit = None
        for n in lengths:
            key = tail[-n:]
            for name, best, is_global in lookups:
                hit = best(key)
                if hit is not None and (not is_global or n >= trusted or hit[1] >= min_global):
                    break
                hit = None
            if hit is not None:
                break
        if hit is None:
            break
        token, count, total = hit
        tokens.append(token)
        on_global_key = is_global and n == n_max
        evidence.append(Evidence(name, n + run if on_global_key else n, count, total))
        run = run + 1 if on_global_key else 0
        tail = (tail + (token,))[-n_max:]
        if len(tail) > lengths.start:
            lengths = range(len(tail), config.n_min - 1, -1)
    return Draft(tokens, evidence)


def reference_copy(tokens: Sequence[int], config: NGramConfig, k: int) -> Draft:
    """ContextIndex.copy by brute force: the newest 16 earlier occurrences of the last n_max
    tokens, the longest match (at most 256, ties to the newest), copied when over n_max."""
    n_max, size = config.n_max, len(tokens)
    key = list(tokens[size - n_max :])
    ends = [end for end in range(size - 1, n_max - 1, -1) if list(tokens[end - n_max : end]) == key][: context_index.COPY_CANDIDATES]
    found, matched = 0, 0
    for end in ends:
        longest = min(context_index.COPY_LONGEST, end)
        length = max(m for m in range(longest + 1) if list(tokens[end - m : end]) == list(tokens[size - m : size]))
        if length > matched:
            found, matched = end, length
    if matched <= n_max or size < n_max:
        return Draft([], [])
    copied = list(tokens)
    for at in range(found, found + k):
        copied.append(copied[at])
    return Draft(copied[size:], [Evidence(SOURCE_CONTEXT, matched + i, 1, 1) for i in range(k)])


def reference_global_run(tokens: Sequence[int], table: NGramSource, config: NGramConfig) -> int:
    """ContextIndex.global_run by counting back from the end (the table does not change here)."""
    n_max, run = config.n_max, 0
    for position in range(len(tokens) - 1, max(n_max, len(tokens) - GLOBAL_RUN_LONGEST) - 1, -1):
        hit = table.best(tuple(tokens[position - n_max : position]))
        if hit is None or hit[0] != tokens[position]:
            break
        run += 1
    return run


class ReferenceContextIndex:
    """ContextIndex before the compact index: the context's n-grams in an InMemoryNGramTable."""

    def __init__(self, config: NGramConfig) -> None:
        self.config = config
        self.tokens: list[int] = []
        self.table = InMemoryNGramTable(config.n_min, config.n_max)

    def extend(self, new_tokens: Sequence[int]) -> None:
        start = len(self.tokens)
        self.tokens.extend(new_tokens)
        self.table.extend(self.tokens, start=start)

    def propose(self, global_table: NGramSource, k: int) -> Draft:
        if k <= 0:
            return Draft([], [])
        copied = reference_copy(self.tokens, self.config, k)
        run = reference_global_run(self.tokens, global_table, self.config)
        if copied.tokens and copied.evidence[0].match_length > self.config.n_max + run:
            return copied
        sources = ((SOURCE_CONTEXT, self.table), (SOURCE_GLOBAL, global_table))
        if run >= self.config.n_max:
            sources = sources[::-1]
        return reference_propose_chain(self.tokens, sources, k, self.config, run)


# --- literal examples -------------------------------------------------------------------


COPY_EXAMPLE = [7, 1, 2, 3, 4, 8, 9, 1, 2, 3, 4, 5, 9, 1, 2, 3, 4]


@pytest.mark.parametrize("bulk_min_tokens", [1, 10**9])
def test_longest_copy_docstring_example(bulk_min_tokens):
    index = ContextIndex(NGramConfig(), bulk_min_tokens=bulk_min_tokens)
    for token in COPY_EXAMPLE:
        index.extend([token])
    # (1, 2, 3, 4) ended at 11 and at 5; at 11 it is preceded by 9, as the context's is.
    assert index.longest_copy() == (11, 5)


def test_copy_docstring_examples():
    index = ContextIndex(NGramConfig())
    index.extend(COPY_EXAMPLE)
    assert index.copy(3) == Draft([5, 9, 1], [Evidence(SOURCE_CONTEXT, 5 + i, 1, 1) for i in range(3)])
    assert index.propose(InMemoryNGramTable(2, 4), 3) == index.copy(3)
    repeating = ContextIndex(NGramConfig())
    repeating.extend([1, 2] * 6 + [1])
    assert repeating.copy(3).tokens == [2, 1, 2]


def test_a_match_no_longer_than_the_keys_is_not_copied():
    index = ContextIndex(NGramConfig())
    index.extend([7, 1, 2, 3, 4, 5, 8, 1, 2, 3, 4])  # (1, 2, 3, 4) again, after 8 instead of 7
    assert index.longest_copy() == (5, 4)
    assert index.copy(3) == Draft([])
    assert index.propose(InMemoryNGramTable(2, 4), 1).tokens == [5]  # the n-gram chain's


def text_versions(seed: int, length: int, versions: int) -> list[list[int]]:
    """A random text and its later versions, each with one token changed from the one before."""
    generator = random.Random(seed)
    text = [generator.randrange(1000) for _ in range(length)]
    found = [text]
    for _ in range(versions - 1):
        text = list(text)
        text[generator.randrange(length)] = 1000 + generator.randrange(1000)
        found.append(text)
    return found


def test_a_text_returned_with_edits_is_copied_from_its_latest_version():
    """Three versions of a text, then the start of a fourth: the copy follows the third,
    where a 4-gram's most frequent continuation comes from whichever version came first."""
    first, second, third = text_versions(3, 200, 3)
    changed = next(at for at in range(200) if second[at] != third[at])
    index = ContextIndex(NGramConfig())
    index.extend(first + second + third + third[: changed - 10])
    copied = index.copy(20)
    assert copied.tokens == third[changed - 10 : changed + 10]
    assert copied.evidence[0].match_length >= changed - 10


def test_global_run_docstring_example_and_its_bound():
    table = InMemoryNGramTable(2, 4)
    table.observe([1, 2, 3, 4, 5, 6])
    index = ContextIndex(NGramConfig())
    index.extend([9, 1, 2, 3, 4, 5, 6])
    assert index.global_run(table) == 2
    index.extend([7])  # not what the table learned after (3, 4, 5, 6)
    assert index.global_run(table) == 0
    learned = list(range(100, 300))
    table.observe(learned)
    index.extend(learned[:150])
    assert index.global_run(table) == GLOBAL_RUN_LONGEST


def test_a_global_chain_reports_the_run_it_extends():
    """Global links on n_max keys report n_max + the run before them; a context link resets it."""
    table = InMemoryNGramTable(2, 4)
    learned = list(range(100, 140))
    table.observe(learned)
    index = ContextIndex(NGramConfig())
    index.extend([5, 6] + learned[:10])  # the last 6 tokens each followed their 4-gram in the table
    draft = index.propose(table, 3)
    assert draft.tokens == learned[10:13]
    assert [e.match_length for e in draft.evidence] == [4 + 6, 4 + 7, 4 + 8]
    assert {e.source for e in draft.evidence} == {SOURCE_GLOBAL}


def test_class_docstring_example():
    index = CompactNGramIndex(2, 2)
    index.extend([1, 2, 3, 1, 2, 4])
    # (1, 2) was followed by 3 and by 4, once each; 3 got there first.
    assert index.best((1, 2)) == (3, 1, 2)
    # (2, 4) only ends the sequence: nothing followed it yet.
    assert index.best((2, 4)) is None


def test_module_docstring_example():
    index = CompactNGramIndex(1, 3)
    index.extend([5, 6, 5, 6, 7])
    # (5, 6) was followed by 5, then by 7: one each, 5 first; 2 followed occurrences.
    assert index.best((5, 6)) == (5, 1, 2)
    # (5,) was followed by 6 twice.
    assert index.best((5,)) == (6, 2, 2)


def test_a_later_tie_does_not_displace_the_continuation_that_got_there_first():
    index = CompactNGramIndex(1, 1)
    index.extend([7, 1, 7, 2, 7, 2, 7, 1, 7])
    # 7 was followed by 1, 2, 2, 1: 2 reached two sightings first (position 5),
    # 1 only at position 7, so 2 stays best although 1 was recorded first.
    assert index.best((7,)) == (2, 2, 4)
    reference = InMemoryNGramTable(1, 1)
    reference.observe([7, 1, 7, 2, 7, 2, 7, 1, 7])
    assert index.best((7,)) == reference.best((7,))


def test_context_index_docstring_example():
    index = ContextIndex(NGramConfig(n_min=2, n_max=2))
    index.extend([1, 2, 3, 4, 2, 3])
    assert index.propose(InMemoryNGramTable(2, 2), 3) == Draft([4, 2, 3], [Evidence(SOURCE_CONTEXT, 2, 1, 1)] * 3)


def test_walk_docstring_example_steps_through_best_continuations():
    index = ContextIndex(NGramConfig(n_min=2, n_max=2))
    index.extend([1, 2, 3, 1, 2])
    # (1, 2) -> 3, then the walk is at (2, 3) -> 1, then at (3, 1) -> 2.
    assert index.propose(InMemoryNGramTable(2, 2), 3) == Draft([3, 1, 2], [Evidence(SOURCE_CONTEXT, 2, 1, 1)] * 3)


def test_place_docstring_example():
    # 8 shares 7's home and takes the next slot, which pushes 9 past its own home.
    slots = place(np.array([1, 1, 2]), np.array([7, 8, 9], dtype=np.uint32), 4)
    assert list(slots) == [0, 7, 8, 9]


def test_place_wraps_a_run_past_the_end_to_the_start():
    slots = place(np.array([3, 3, 0]), np.array([7, 8, 9], dtype=np.uint32), 4)
    # 9 keeps its home 0 and 7 takes slot 3; 8 runs past the end and wraps to
    # the first free slot, 1 (a lookup from its home 3 walks 3, 0, 1).
    assert list(slots) == [9, 8, 0, 7]


def test_keys_of_other_lengths_and_ids_outside_uint32_are_never_found():
    index = CompactNGramIndex(2, 3)
    index.extend([1, 2, 3, 1, 2, 3])
    assert index.best((1,)) is None  # shorter than n_min
    assert index.best((1, 2, 3, 1)) is None  # longer than n_max
    assert index.best((-1, 2)) is None
    assert index.best((1, MAX_TOKEN_ID + 1)) is None
    assert index.best((1, 2)) == (3, 2, 2)


@pytest.mark.parametrize("bad", [[1, -1], [1, MAX_TOKEN_ID + 1]])
def test_extend_refuses_ids_outside_uint32_and_appends_nothing(bad):
    index = ContextIndex(NGramConfig(n_min=2, n_max=2))
    index.extend([1, 2, 3])
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 4294967295\]"):
        index.extend(bad)
    assert list(index.tokens) == [1, 2, 3]
    assert index.propose(InMemoryNGramTable(2, 2), 2) == Draft([], [])


def test_extend_refuses_more_tokens_than_ids_can_name(monkeypatch):
    monkeypatch.setattr(context_index, "MAX_TOKENS", 5)
    index = CompactNGramIndex(2, 2)
    index.extend([1, 2, 3])
    with pytest.raises(ValueError, match="a context holds at most 5 tokens; this one would hold 6"):
        index.extend([4, 5, 6])
    assert list(index.tokens) == [1, 2, 3]


def test_a_foreign_context_is_not_walked_but_looked_up():
    index = ContextIndex(NGramConfig(n_min=2, n_max=2))
    index.extend([1, 2, 3, 4, 2, 3])
    # The index drafts for another context through ``best``, as any source.
    draft = propose_chain([9, 2, 3], [(SOURCE_CONTEXT, index)], 3, NGramConfig(n_min=2, n_max=2))
    assert draft == Draft([4, 2, 3], [Evidence(SOURCE_CONTEXT, 2, 1, 1)] * 3)
    assert index.walk([9, 2, 3], []) is None


# --- the same drafts as the reference ---------------------------------------------------------

configs = st.builds(
    lambda n_min, extra, min_global, trusted: NGramConfig(
        n_min=n_min, n_max=n_min + extra, min_global_count=min_global, global_trusted_match_length=trusted
    ),
    st.integers(1, 3),
    st.integers(0, 3),
    st.integers(1, 3),
    st.integers(1, 5),
)


@st.composite
def token_streams(draw) -> list[int]:
    """Random tokens over small and large vocabularies, a short pattern repeated
    (with slips), and a random text repeated (every n-gram twice)."""
    kind = draw(st.sampled_from(["small", "large", "pattern", "twice"]))
    if kind == "small":
        return draw(st.lists(st.integers(0, draw(st.integers(1, 4))), max_size=120))
    if kind == "large":
        return draw(st.lists(st.integers(0, MAX_TOKEN_ID), max_size=80))
    if kind == "pattern":
        pattern = draw(st.lists(st.integers(0, 6), min_size=1, max_size=5))
        tokens = pattern * draw(st.integers(1, 25))
        for position in draw(st.lists(st.integers(0, max(len(tokens) - 1, 0)), max_size=4)):
            tokens[position] = draw(st.integers(0, 6))
        return tokens
    half = draw(st.lists(st.integers(0, 30), max_size=60))
    return half + half


@settings(max_examples=300, deadline=None)
@given(
    configs,
    token_streams(),
    st.lists(st.integers(1, 40), min_size=1, max_size=12),
    st.lists(st.integers(0, 12), min_size=1, max_size=12),
    st.lists(st.tuples(st.integers(0, 200), st.integers(0, 6)), max_size=12),
    st.sampled_from([1, 8, 10**9]),
)
def test_propose_matches_the_reference_however_the_tokens_arrive(config, tokens, chunks, ks, edits, bulk_min_tokens):
    """After every extend (chunks of random sizes, the per-token loop or the numpy
    rebuild), the draft for every k is the reference's, token for token and
    evidence for evidence. The global table holds the same text with a few
    tokens changed, so that drafts leave the context and come back."""
    global_text = list(tokens)
    for position, token in edits:
        if global_text:
            global_text[position % len(global_text)] = token
    global_table = InMemoryNGramTable(config.n_min, config.n_max)
    global_table.observe(global_text)
    global_table.observe(global_text[::-1])
    index, reference = ContextIndex(config, bulk_min_tokens=bulk_min_tokens), ReferenceContextIndex(config)
    position = 0
    for step, size in enumerate(chunks * (1 + len(tokens) // max(sum(chunks), 1))):
        if position >= len(tokens):
            break
        index.extend(tokens[position : position + size])
        reference.extend(tokens[position : position + size])
        position += size
        k = ks[step % len(ks)]
        assert index.propose(global_table, k) == reference.propose(global_table, k)
    assert list(index.tokens) == reference.tokens


@settings(max_examples=300, deadline=None)
@given(configs, token_streams(), st.lists(st.integers(1, 40), min_size=1, max_size=6), st.sampled_from([1, 8, 10**9]))
def test_best_matches_the_reference_for_every_key(config, tokens, chunks, bulk_min_tokens):
    """Every n-gram of the context (and keys that never occurred) gets the
    reference table's (token, count, total), or None alike."""
    index, reference = ContextIndex(config, bulk_min_tokens=bulk_min_tokens), ReferenceContextIndex(config)
    position = 0
    for size in chunks * (1 + len(tokens) // sum(chunks)):
        if position >= len(tokens):
            break
        index.extend(tokens[position : position + size])
        reference.extend(tokens[position : position + size])
        position += size
        seen = reference.tokens
        keys = {tuple(seen[start : start + n]) for n in range(config.n_min, config.n_max + 1) for start in range(len(seen) - n + 1)}
        keys |= {(MAX_TOKEN_ID,) * n for n in range(config.n_min, config.n_max + 1)}
        for key in keys:
            assert index.best(key) == reference.table.best(key), key


def test_propose_matches_the_reference_on_the_benchmark_workload():
    """The bench_drafter stream: 32 sessions of real text, a global table of the
    same text, K=8, 1-3 new tokens per step (the walk leaves the context and
    comes back on every draft)."""
    tokens = corpus_tokens(120_000)
    config = NGramConfig()
    global_table = InMemoryNGramTable(config.n_min, config.n_max)
    global_table.observe(tokens[:60_000])
    for session in range(8):
        at = 70_000 + 5_000 * session
        index, reference = ContextIndex(config), ReferenceContextIndex(config)
        index.extend(tokens[at - 512 : at])
        reference.extend(tokens[at - 512 : at])
        for step in range(60):
            new = tokens[at : at + 1 + step % 3]
            at += len(new)
            index.extend(new)
            reference.extend(new)
            assert index.propose(global_table, 8) == reference.propose(global_table, 8)


# --- memory -----------------------------------------------------------------------------


def traced_bytes(build):
    """(bytes tracemalloc sees the built object hold, the object). An index is
    built first, untraced, so that what every index shares (numpy's and the
    module's caches) is not counted."""
    warm = ContextIndex(NGramConfig())
    warm.extend(range(300))
    warm.extend([1, 2])
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        built = build()
        return tracemalloc.get_traced_memory()[0] - before, built
    finally:
        tracemalloc.stop()


def built(tokens: list[int], chunk: int | None = None) -> ContextIndex:
    index = ContextIndex(NGramConfig())
    if chunk is None:
        index.extend(tokens)
    else:
        for start in range(0, len(tokens), chunk):
            index.extend(tokens[start : start + chunk])
    return index


def random_ids(seed: int, count: int, below: int) -> list[int]:
    generator = random.Random(seed)
    return [generator.randrange(below) for _ in range(count)]


SESSION_TOKENS = 131_072
half_text = random_ids(0, SESSION_TOKENS // 2, 49_152)
MEMORY_CASES = {
    "uniform random ids below 49,152": lambda: random_ids(1, SESSION_TOKENS, 49_152),
    "the standard library's source": lambda: corpus_tokens(SESSION_TOKENS),
    "a 7-token pattern repeated": lambda: [i % 7 for i in range(SESSION_TOKENS)],
    "a random text twice (every n-gram twice)": lambda: half_text + half_text,
    "2-grams each followed by many tokens": lambda: [
        token for i in range(SESSION_TOKENS // 4) for token in (i % 4096, 5000 + (i * 7919) % 65536, i % 4096, 70000 + i % 3)
    ],
}


@pytest.mark.parametrize("case", list(MEMORY_CASES))
def test_a_131k_token_context_takes_at_most_110_bytes_per_token(case):
    tokens = MEMORY_CASES[case]()
    assert len(tokens) == SESSION_TOKENS
    held, index = traced_bytes(lambda: built(tokens))
    assert held <= 110 * SESSION_TOKENS, f"{held / SESSION_TOKENS:.1f} bytes per token"
    # nbytes bounds what tracemalloc sees, and max_bytes_for bounds nbytes.
    assert held <= index.nbytes() <= ContextIndex.max_bytes_for(SESSION_TOKENS, NGramConfig())
    assert ContextIndex.max_bytes_for(SESSION_TOKENS, NGramConfig()) <= 110 * SESSION_TOKENS


@pytest.mark.parametrize("chunk", [1, 3, 50, 700])
@pytest.mark.parametrize("config", [NGramConfig(), NGramConfig(n_min=1, n_max=6), NGramConfig(n_min=3, n_max=3)])
def test_nbytes_bounds_what_an_index_holds_however_it_grew(chunk, config):
    tokens = corpus_tokens(6_000)[-3_000:] + [i % 5 for i in range(1_000)] + random_ids(2, 1_000, 10**6)

    def grow() -> ContextIndex:
        index = ContextIndex(config)
        for start in range(0, len(tokens), chunk):
            index.extend(tokens[start : start + chunk])
        return index

    held, index = traced_bytes(grow)
    assert held <= index.nbytes() <= ContextIndex.max_bytes_for(len(tokens), config)


def test_max_bytes_for_grows_with_the_tokens_and_bounds_an_empty_index():
    config = NGramConfig()
    bounds = [ContextIndex.max_bytes_for(tokens, config) for tokens in (0, 1, 100, 10_000, 131_072)]
    assert bounds == sorted(bounds)
    assert ContextIndex(config).nbytes() <= bounds[0]
    # A longest key length adds per-id arrays and a table: more bytes.
    assert ContextIndex.max_bytes_for(10_000, NGramConfig(n_max=6)) > bounds[3]


# --- hash flooding --------------------------------------------------------------------------

FLOOD_SALT = bytes(range(16))
FLOOD_MASK = 4095  # the slot bits of a 4096-slot table (and so of every smaller one)


def colliding_pairs(salt: bytes, count: int) -> list[tuple[int, int]]:
    """2-grams whose salted hashes share their low 12 bits: all aimed at one slot
    of an index hashing with ``salt`` (found by trying, as an attacker who knew
    the salt and the process's hash key would)."""
    pack, pairs, second = struct.Struct("=2I").pack, [], 0
    target = hash(salt + pack(1, 0)) & FLOOD_MASK
    for first in range(1, 1 + count):
        while hash(salt + pack(first, second)) & FLOOD_MASK != target:
            second += 1
        pairs.append((first, second))
    return pairs


def flood(pairs: list[tuple[int, int]]) -> list[int]:
    return [token for pair in pairs for token in pair]


def test_crafted_collisions_cost_quadratic_probes_under_the_salt_they_were_made_for(monkeypatch):
    """The crafted 2-grams do collide (else the next test proves nothing): with
    their salt and the safety valve off, each new one walks past all before it."""
    monkeypatch.setattr(context_index, "COLLISIONS_PER_PROBE", 10**9)
    pairs = colliding_pairs(FLOOD_SALT, 150)
    index = CompactNGramIndex(2, 2, salt=FLOOD_SALT, bulk_min_tokens=10**9)
    for start in range(0, 300, 6):
        index.extend(flood(pairs)[start : start + 6])
    assert index.collisions >= 150 * 149 // 4


def test_a_flood_for_one_salt_is_detected_and_costs_linear_probes():
    pairs = colliding_pairs(FLOOD_SALT, 150)
    index = CompactNGramIndex(2, 2, salt=FLOOD_SALT, bulk_min_tokens=10**9)
    most = 0
    for start in range(0, 300, 6):
        index.extend(flood(pairs)[start : start + 6])
        most = max(most, index.collisions)
    # The valve noticed the collisions and drew a new salt...
    assert index._salt != FLOOD_SALT
    # ...before probing exceeded its budget by more than one call's worth (6
    # tokens, each passing at most 150 crafted n-grams).
    assert most <= context_index.COLLISIONS_PER_PROBE * 2 * 300 + context_index.COLLISION_ALLOWANCE + 6 * 150
    # Under the new salt, looking up every crafted 2-gram meets few others.
    before = index.collisions
    for pair in pairs[:-1]:
        assert index.best(pair) is not None
    assert index.collisions - before <= len(pairs)


def test_a_flood_for_one_salt_meets_few_other_n_grams_under_another():
    """The salt is inside what SipHash reads: n-grams crafted to collide under one
    salt land anywhere under another."""
    pairs = colliding_pairs(FLOOD_SALT, 150)
    index = CompactNGramIndex(2, 4, bulk_min_tokens=10**9)  # a salt of its own
    for start in range(0, 300, 6):
        index.extend(flood(pairs)[start : start + 6])
    # At most half full, a probe meets ~0.5 other n-grams (150 crafted ones in
    # one slot would cost ~11,000).
    assert index.collisions <= index.probes
    before_collisions, before_probes = index.collisions, index.probes
    for pair in pairs[:-1]:
        assert index.best(pair) is not None
    assert index.collisions - before_collisions <= index.probes - before_probes


def test_ids_that_collide_under_python_int_hashing_do_not_collide_here():
    """Multiples of 2**16 all share their low 16 bits, which pick the slot of an
    int-keyed table of up to 65,536 slots; here they spread like any ids."""
    rng = random.Random(3)
    tokens = [rng.randrange(256) << 16 for _ in range(4_000)]
    index = CompactNGramIndex(2, 4, bulk_min_tokens=10**9)
    for start in range(0, len(tokens), 4):
        index.extend(tokens[start : start + 4])
    assert index.collisions <= index.probes


def test_once_the_table_has_followed_the_context_it_drafts_before_the_context():
    """The context's (5, 6, 7, 8) was followed by 50; the table learned it followed by 9, and has
    predicted each of the context's last 4 tokens: the table's continuation comes first."""
    table = InMemoryNGramTable(2, 4)
    table.observe([1, 2, 3, 4, 5, 6, 7, 8, 9])
    index = ContextIndex(NGramConfig())
    index.extend([5, 6, 7, 8, 50, 1, 2, 3, 4, 5, 6, 7, 8])
    assert index.global_run(table) == 4
    assert index.propose(table, 1) == Draft([9], [Evidence(SOURCE_GLOBAL, 4 + 4, 1, 1)])
    # The same end after a token the table never saw there: no run, the context's own first.
    other = ContextIndex(NGramConfig())
    other.extend([5, 6, 7, 8, 50, 1, 2, 3, 99, 5, 6, 7, 8])
    assert other.global_run(table) == 0
    assert other.propose(table, 1) == Draft([50], [Evidence(SOURCE_CONTEXT, 4, 1, 1)])
