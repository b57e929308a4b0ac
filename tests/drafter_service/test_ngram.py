"""Unit tests for drafter_service.ngram: counting, suffix lookup, chains, sessions."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from drafter_service.ngram import (
    SOURCE_CONTEXT,
    SOURCE_GLOBAL,
    Draft,
    Evidence,
    InMemoryNGramTable,
    NGramConfig,
    best_of,
    lookup_longest,
    most_frequent,
    propose_chain,
)
from drafter_service.sessions import NGramDrafter


class LiteralSource:
    """An n-gram source whose counts are written out literally in the test."""

    def __init__(self, counts: dict[tuple[int, ...], dict[int, int]]) -> None:
        self.counts = counts

    def continuations(self, key: tuple[int, ...]) -> dict[int, int] | None:
        return self.counts.get(key)

    def best(self, key: tuple[int, ...]):
        return best_of(self.counts.get(key))

    def observe(self, tokens: Sequence[int]) -> None:
        raise AssertionError("lookups must not write to a source")


def table_contents(table: InMemoryNGramTable, keys: list[tuple[int, ...]]) -> dict[tuple[int, ...], dict[int, int]]:
    """The table as a dict, checked to hold exactly ``keys`` (no other n-gram)."""
    assert len(table) == len(keys), f"table has {len(table)} keys, expected {len(keys)}"
    return {key: table.continuations(key) for key in keys}


# --- InMemoryNGramTable -------------------------------------------------------


def test_extend_counts_every_ngram_from_n_min_to_n_max_with_its_next_token():
    table = InMemoryNGramTable(n_min=1, n_max=2)
    table.extend([5, 6, 7], start=1)
    # The class docstring's example: (5,)->6, (6,)->7, (5, 6)->7, and nothing
    # for the last token (it has no next token yet).
    assert table_contents(table, [(5,), (6,), (5, 6)]) == {
        (5,): {6: 1},
        (6,): {7: 1},
        (5, 6): {7: 1},
    }
    assert table.continuations((7,)) is None
    assert table.continuations((6, 7)) is None


def test_observe_accumulates_repeated_ngrams():
    table = InMemoryNGramTable(n_min=1, n_max=2)
    table.observe([1, 2, 1, 2, 1])
    # (1,) is followed by 2 at positions 1 and 3; (2,) by 1 at 2 and 4;
    # (1, 2) by 1 twice (positions 2 and 4); (2, 1) by 2 once (position 3).
    assert table_contents(table, [(1,), (2,), (1, 2), (2, 1)]) == {
        (1,): {2: 2},
        (2,): {1: 2},
        (1, 2): {1: 2},
        (2, 1): {2: 1},
    }


def test_observe_keeps_distinct_continuations_in_first_seen_order():
    table = InMemoryNGramTable(n_min=2, n_max=2)
    table.observe([3, 4, 9, 3, 4, 8, 3, 4, 8])
    # (3, 4) was followed by 9 first, then by 8 twice; only n=2 keys exist.
    assert list(table.continuations((3, 4)).items()) == [(9, 1), (8, 2)]
    assert table.continuations((4,)) is None


def test_extend_with_n_max_longer_than_the_prefix_uses_only_available_lengths():
    table = InMemoryNGramTable(n_min=1, n_max=4)
    table.observe([1, 2, 3])
    # Position 1 has a 1-token prefix only; position 2 has 1- and 2-token ones.
    assert table_contents(table, [(1,), (2,), (1, 2)]) == {(1,): {2: 1}, (2,): {3: 1}, (1, 2): {3: 1}}


def test_incremental_extend_from_the_old_length_does_not_double_count():
    tokens = [1, 2, 1]
    incremental = InMemoryNGramTable(n_min=1, n_max=2)
    incremental.extend(tokens, start=1)
    old_length = len(tokens)
    tokens += [2, 1]
    incremental.extend(tokens, start=old_length)
    # Same counts as indexing [1, 2, 1, 2, 1] once (see the observe test above).
    assert table_contents(incremental, [(1,), (2,), (1, 2), (2, 1)]) == {
        (1,): {2: 2},
        (2,): {1: 2},
        (1, 2): {1: 2},
        (2, 1): {2: 1},
    }


def test_extend_from_the_end_adds_nothing_and_start_zero_equals_start_one():
    table = InMemoryNGramTable(n_min=1, n_max=2)
    table.extend([5, 6, 7], start=0)  # position 0 has no prefix: same as start=1
    table.extend([5, 6, 7], start=3)  # no new position
    assert table_contents(table, [(5,), (6,), (5, 6)]) == {(5,): {6: 1}, (6,): {7: 1}, (5, 6): {7: 1}}


# --- most_frequent -------------------------------------------------------------


def test_most_frequent_returns_the_highest_count():
    assert most_frequent({4: 2, 9: 3, 1: 1}) == (9, 3)


@pytest.mark.parametrize(
    "counts, expected",
    [
        # 9 and 1 tie at 3; 9 was recorded first.
        ({4: 2, 9: 3, 1: 3}, (9, 3)),
        # Same counts, other insertion order: the first recorded wins each time.
        ({2: 1, 3: 1}, (2, 1)),
        ({3: 1, 2: 1}, (3, 1)),
    ],
)
def test_most_frequent_breaks_ties_by_first_recorded(counts, expected):
    assert most_frequent(counts) == expected


# --- lookup_longest --------------------------------------------------------------


def test_lookup_longest_docstring_example_prefers_the_longest_match():
    context = LiteralSource({(1, 2): {3: 1}, (2,): {4: 5}})
    config = NGramConfig(n_min=1, n_max=3)
    # (9, 1, 2) is unknown; (1, 2) matches before the more frequent (2,).
    assert lookup_longest([9, 1, 2], [(SOURCE_CONTEXT, context)], config) == (3, Evidence(SOURCE_CONTEXT, 2, 1, 1))


def test_lookup_longest_backs_off_to_a_shorter_suffix():
    context = LiteralSource({(2,): {4: 5, 6: 2}})
    config = NGramConfig(n_min=1, n_max=3)
    # Neither (9, 1, 2) nor (1, 2) is known; (2,) is, with 4 seen 5 of 7 times.
    assert lookup_longest([9, 1, 2], [(SOURCE_CONTEXT, context)], config) == (4, Evidence(SOURCE_CONTEXT, 1, 5, 7))


def test_lookup_longest_returns_none_below_n_min():
    context = LiteralSource({(2,): {4: 5}})
    # The only match is 1 token long, shorter than n_min=2.
    assert lookup_longest([9, 1, 2], [(SOURCE_CONTEXT, context)], NGramConfig(n_min=2, n_max=3)) is None


def test_lookup_longest_returns_none_when_the_tail_is_shorter_than_n_min():
    context = LiteralSource({(2,): {4: 5}})
    assert lookup_longest([2], [(SOURCE_CONTEXT, context)], NGramConfig(n_min=2, n_max=3)) is None


def test_lookup_longest_never_looks_past_n_max():
    context = LiteralSource({(9, 1, 2): {7: 1}, (1, 2): {3: 1}})
    # With n_max=2 the 3-token key (9, 1, 2) is not consulted: (1, 2) -> 3.
    assert lookup_longest([9, 1, 2], [(SOURCE_CONTEXT, context)], NGramConfig(n_min=1, n_max=2)) == (
        3,
        Evidence(SOURCE_CONTEXT, 2, 1, 1),
    )


def test_lookup_longest_treats_empty_counts_as_no_match():
    context = LiteralSource({(1, 2): {}, (2,): {4: 1}})
    assert lookup_longest([1, 2], [(SOURCE_CONTEXT, context)], NGramConfig(n_min=1, n_max=2)) == (
        4,
        Evidence(SOURCE_CONTEXT, 1, 1, 1),
    )


def test_context_wins_over_global_at_the_same_length():
    context = LiteralSource({(1, 2): {3: 1}})
    global_table = LiteralSource({(1, 2): {5: 9}})
    sources = [(SOURCE_CONTEXT, context), (SOURCE_GLOBAL, global_table)]
    # Both match (1, 2); the context is asked first, even though the global
    # continuation is far more frequent.
    assert lookup_longest([1, 2], sources, NGramConfig(n_min=2, n_max=2)) == (3, Evidence(SOURCE_CONTEXT, 2, 1, 1))


def test_a_longer_global_match_beats_a_shorter_context_match():
    context = LiteralSource({(2,): {4: 1}})
    global_table = LiteralSource({(1, 2): {5: 2}})
    sources = [(SOURCE_CONTEXT, context), (SOURCE_GLOBAL, global_table)]
    # Lengths are tried longest first across both sources: global (1, 2)
    # is found before context (2,) is considered.
    assert lookup_longest([1, 2], sources, NGramConfig(n_min=1, n_max=2, min_global_count=2)) == (
        5,
        Evidence(SOURCE_GLOBAL, 2, 2, 2),
    )


def test_global_hits_below_min_global_count_are_skipped():
    context = LiteralSource({(2,): {4: 1}})
    global_table = LiteralSource({(1, 2): {5: 1}})
    sources = [(SOURCE_CONTEXT, context), (SOURCE_GLOBAL, global_table)]
    # Global (1, 2) -> 5 was seen once, below min_global_count=2, so the
    # lookup backs off to the context's (2,) -> 4.
    assert lookup_longest([1, 2], sources, NGramConfig(n_min=1, n_max=2, min_global_count=2)) == (
        4,
        Evidence(SOURCE_CONTEXT, 1, 1, 1),
    )


def test_min_global_count_applies_to_the_best_continuation_not_the_total():
    global_table = LiteralSource({(1, 2): {5: 1, 6: 1}, (2,): {7: 3, 8: 1}})
    sources = [(SOURCE_GLOBAL, global_table)]
    # (1, 2) was seen twice in all, but its best continuation only once: skipped.
    # (2,) -> 7 was seen 3 times of 4.
    assert lookup_longest([1, 2], sources, NGramConfig(n_min=1, n_max=2, min_global_count=2)) == (
        7,
        Evidence(SOURCE_GLOBAL, 1, 3, 4),
    )


def test_min_global_count_does_not_filter_the_context():
    context = LiteralSource({(1, 2): {3: 1}})
    # The context's own text is trusted once, whatever min_global_count is.
    assert lookup_longest([1, 2], [(SOURCE_CONTEXT, context)], NGramConfig(n_min=2, n_max=2, min_global_count=5)) == (
        3,
        Evidence(SOURCE_CONTEXT, 2, 1, 1),
    )


# --- propose_chain -----------------------------------------------------------------


def context_source(context: list[int], config: NGramConfig) -> list[tuple[str, InMemoryNGramTable]]:
    table = InMemoryNGramTable(config.n_min, config.n_max)
    table.observe(context)
    return [(SOURCE_CONTEXT, table)]


def test_propose_chain_docstring_example():
    config = NGramConfig(n_min=2, n_max=2)
    context = [1, 2, 3, 4, 2, 3]
    draft = propose_chain(context, context_source(context, config), k=3, config=config)
    # (2, 3) was followed by 4; then (3, 4) by 2; then (4, 2) by 3.
    assert draft.tokens == [4, 2, 3]
    assert draft.evidence == [Evidence(SOURCE_CONTEXT, 2, 1, 1)] * 3


def test_propose_chain_follows_the_context_around_a_cycle_up_to_k():
    config = NGramConfig(n_min=2, n_max=2)
    context = [1, 2, 3, 4, 2, 3]
    draft = propose_chain(context, context_source(context, config), k=5, config=config)
    # After [4, 2, 3] the tail is (2, 3) again, so the chain repeats 4, 2.
    assert draft.tokens == [4, 2, 3, 4, 2]


def test_propose_chain_stops_when_no_suffix_matches():
    source = LiteralSource({(1, 2): {3: 1}})
    draft = propose_chain([8, 1, 2], [(SOURCE_CONTEXT, source)], k=3, config=NGramConfig(n_min=2, n_max=2))
    # (1, 2) -> 3; then the tail (2, 3) is unknown, so the chain ends at 1 of 3.
    assert draft == Draft([3], [Evidence(SOURCE_CONTEXT, 2, 1, 1)])


def test_propose_chain_stops_when_global_evidence_is_too_weak():
    global_table = LiteralSource({(1, 2): {3: 2}, (2, 3): {4: 1}})
    draft = propose_chain([1, 2], [(SOURCE_GLOBAL, global_table)], k=3, config=NGramConfig(n_min=2, n_max=2, min_global_count=2))
    # (1, 2) -> 3 was seen twice: kept. (2, 3) -> 4 only once: the chain stops.
    assert draft == Draft([3], [Evidence(SOURCE_GLOBAL, 2, 2, 2)])


def test_propose_chain_records_evidence_per_link_from_both_sources():
    context = LiteralSource({(1, 2): {3: 1}})
    global_table = LiteralSource({(2, 3): {4: 5, 6: 2}})
    sources = [(SOURCE_CONTEXT, context), (SOURCE_GLOBAL, global_table)]
    draft = propose_chain([8, 1, 2], sources, k=3, config=NGramConfig(n_min=2, n_max=2, min_global_count=2))
    # Link 1 from the context ((1, 2) -> 3, once of once); link 2 from the
    # global table ((2, 3) -> 4, 5 of 7); (3, 4) is unknown, so it stops.
    assert draft.tokens == [3, 4]
    assert draft.evidence == [Evidence(SOURCE_CONTEXT, 2, 1, 1), Evidence(SOURCE_GLOBAL, 2, 5, 7)]


def test_propose_chain_links_use_the_drafted_tokens_as_context():
    source = LiteralSource({(7, 1, 2): {5: 1}, (1, 2): {9: 1}, (2, 5): {6: 1}, (1, 2, 5): {0: 1}})
    draft = propose_chain([7, 1, 2], [(SOURCE_CONTEXT, source)], k=2, config=NGramConfig(n_min=2, n_max=3))
    # (7, 1, 2) -> 5 beats (1, 2) -> 9; the next tail is (1, 2, 5), whose
    # 3-token match gives 0, not the 2-token (2, 5) -> 6.
    assert draft == Draft([5, 0], [Evidence(SOURCE_CONTEXT, 3, 1, 1), Evidence(SOURCE_CONTEXT, 3, 1, 1)])


def test_propose_chain_with_k_zero_is_empty():
    config = NGramConfig(n_min=2, n_max=2)
    context = [1, 2, 3, 4, 2, 3]
    # The docstring context would draft [4, 2, 3], but no link is asked for.
    assert propose_chain(context, context_source(context, config), k=0, config=config) == Draft([], [])


@pytest.mark.parametrize("context", [[], [1]])
def test_propose_chain_with_context_shorter_than_n_min_is_empty(context):
    # (1,) -> 2 is known, but 1-token suffixes are below n_min=2.
    source = LiteralSource({(1,): {2: 4}})
    assert propose_chain(context, [(SOURCE_CONTEXT, source)], k=3, config=NGramConfig(n_min=2, n_max=3)) == Draft([], [])


def test_draft_requires_one_evidence_per_token():
    with pytest.raises(AssertionError, match="one evidence record per draft token"):
        Draft([1, 2], [Evidence(SOURCE_CONTEXT, 2, 1, 1)])


# --- NGramDrafter ------------------------------------------------------------------


def test_drafter_proposes_from_the_prompt_plus_new_tokens():
    drafter = NGramDrafter(NGramConfig(n_min=2, n_max=2))
    drafter.open("a", [1, 2, 3, 4])
    # The session context becomes the docstring example [1, 2, 3, 4, 2, 3].
    draft = drafter.propose("a", [2, 3], k=3)
    assert draft == Draft([4, 2, 3], [Evidence(SOURCE_CONTEXT, 2, 1, 1)] * 3)


def test_drafter_indexes_new_tokens_incrementally_without_double_counting():
    drafter = NGramDrafter(NGramConfig(n_min=2, n_max=2))
    drafter.open("a", [1, 2, 3, 4])
    # Context [1, 2, 3, 4]: the tail (3, 4) has never been followed by anything.
    assert drafter.propose("a", [], k=3) == Draft([], [])
    # Context [1, 2, 3, 4, 2]: tail (4, 2) is new too.
    assert drafter.propose("a", [2], k=3) == Draft([], [])
    # Context [1, 2, 3, 4, 2, 3]: (2, 3) -> 4 once.
    assert drafter.propose("a", [3], k=1) == Draft([4], [Evidence(SOURCE_CONTEXT, 2, 1, 1)])
    # No new tokens: asking again must not count (2, 3) -> 4 a second time.
    assert drafter.propose("a", [], k=1) == Draft([4], [Evidence(SOURCE_CONTEXT, 2, 1, 1)])
    # Context [1, 2, 3, 4, 2, 3, 4, 2, 3]: (2, 3) has now really been followed
    # by 4 twice (positions 3 and 6). The context repeats its last 5 tokens, longer
    # than the keys: the draft is their copy.
    assert drafter.propose("a", [4, 2, 3], k=1) == Draft([4], [Evidence(SOURCE_CONTEXT, 5, 1, 1)])
    assert drafter._session("a").context.best((2, 3)) == (4, 2, 2)


def test_drafter_propose_with_k_zero_still_records_the_new_tokens():
    drafter = NGramDrafter(NGramConfig(n_min=2, n_max=2))
    drafter.open("a", [1, 2, 3, 4])
    assert drafter.propose("a", [2, 3], k=0) == Draft([], [])
    # The [2, 3] sent with k=0 is part of the context: the docstring draft follows.
    assert drafter.propose("a", [], k=3).tokens == [4, 2, 3]


def test_drafter_accepts_new_tokens_as_any_iterable():
    drafter = NGramDrafter(NGramConfig(n_min=2, n_max=2))
    drafter.open("a", [1, 2, 3, 4])
    assert drafter.propose("a", iter([2, 3]), k=3).tokens == [4, 2, 3]


def test_closed_session_output_is_observed_into_the_global_table():
    global_table = InMemoryNGramTable(n_min=2, n_max=2)
    drafter = NGramDrafter(NGramConfig(n_min=2, n_max=2, min_global_count=1), global_table)
    drafter.open("a", [1, 2, 3])
    drafter.propose("a", [4], k=1)
    drafter.close("a")
    # The whole session text [1, 2, 3, 4] was observed.
    assert table_contents(global_table, [(1, 2), (2, 3)]) == {(1, 2): {3: 1}, (2, 3): {4: 1}}

    drafter.open("b", [7, 1, 2])
    # b's own context has no continuation for (1, 2); the global table gives
    # (1, 2) -> 3, then (2, 3) -> 4; (3, 4) is unknown.
    # The second link follows the first along the table's best continuations: a match of 3.
    assert drafter.propose("b", [], k=3) == Draft([3, 4], [Evidence(SOURCE_GLOBAL, 2, 1, 1), Evidence(SOURCE_GLOBAL, 3, 1, 1)])


def test_close_without_observe_does_not_learn():
    global_table = InMemoryNGramTable(n_min=2, n_max=2)
    drafter = NGramDrafter(NGramConfig(n_min=2, n_max=2, min_global_count=1), global_table)
    drafter.open("a", [1, 2, 3, 4])
    drafter.close("a", observe=False)
    assert len(global_table) == 0
    drafter.open("b", [7, 1, 2])
    # Same setup as the test above, which drafts [3, 4] when a is observed.
    assert drafter.propose("b", [], k=3) == Draft([], [])


def test_default_min_global_count_needs_two_sessions_to_agree():
    drafter = NGramDrafter()  # n_min=2, n_max=4, min_global_count=2, trusted match 4
    drafter.open("a", [1, 2, 3, 4])
    drafter.close("a")
    drafter.open("b", [7, 1, 2])
    # Every global continuation was seen once, below min_global_count=2, and
    # the matches (2 and 3 tokens) are shorter than the trusted length 4.
    assert drafter.propose("b", [], k=3) == Draft([], [])

    drafter.open("c", [1, 2, 3, 4])
    drafter.close("c")
    # Now (1, 2) -> 3 has count 2; then the tail [7, 1, 2, 3] matches the
    # 3-token (1, 2, 3) -> 4 (count 2); nothing ever followed (3, 4).
    assert drafter.propose("b", [], k=3) == Draft([3, 4], [Evidence(SOURCE_GLOBAL, 2, 2, 2), Evidence(SOURCE_GLOBAL, 3, 2, 2)])


def test_a_long_global_match_is_trusted_after_one_sighting():
    drafter = NGramDrafter()  # n_min=2, n_max=4, min_global_count=2, trusted match 4
    drafter.open("a", [1, 2, 3, 4, 5, 6])
    drafter.close("a")
    drafter.open("b", [9, 1, 2, 3, 4])
    # (1, 2, 3, 4) -> 5 was seen once, but a 4-token match is trusted; then
    # (2, 3, 4, 5) -> 6 likewise; nothing followed (3, 4, 5, 6) or shorter.
    assert drafter.propose("b", [], k=3) == Draft([5, 6], [Evidence(SOURCE_GLOBAL, 4, 1, 1), Evidence(SOURCE_GLOBAL, 5, 1, 1)])


def test_sessions_do_not_share_context():
    drafter = NGramDrafter(NGramConfig(n_min=2, n_max=2))
    drafter.open("a", [1, 2, 3, 4, 2, 3])
    drafter.open("b", [9, 2, 3])
    # a's (2, 3) -> 4 lives only in a's context until a is closed.
    assert drafter.propose("b", [], k=3) == Draft([], [])
    assert drafter.propose("a", [], k=1).tokens == [4]


def test_propose_on_an_unknown_session_raises_key_error():
    drafter = NGramDrafter()
    with pytest.raises(KeyError, match="unknown session 'nope'"):
        drafter.propose("nope", [1], k=3)


def test_propose_after_close_raises_key_error():
    drafter = NGramDrafter()
    drafter.open("a", [1, 2, 3])
    drafter.close("a")
    with pytest.raises(KeyError, match="unknown session 'a'"):
        drafter.propose("a", [], k=3)


def test_opening_an_open_session_again_raises():
    drafter = NGramDrafter(NGramConfig(n_min=2, n_max=2))
    drafter.open("a", [1, 2, 3, 4, 2, 3])
    with pytest.raises(KeyError, match="session 'a' is already open"):
        drafter.open("a", [5, 6])
    # The first session is untouched by the refused open.
    assert drafter.propose("a", [], k=3).tokens == [4, 2, 3]


# --- NGramConfig -------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n_min": 0, "n_max": 4}, r"need 1 <= n_min <= n_max, got n_min=0, n_max=4"),
        ({"n_min": 3, "n_max": 2}, r"need 1 <= n_min <= n_max, got n_min=3, n_max=2"),
        ({"min_global_count": 0}, r"min_global_count must be >= 1, got 0"),
    ],
)
def test_config_rejects_invalid_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NGramConfig(**kwargs)


def test_config_accepts_n_min_equal_to_n_max():
    config = NGramConfig(n_min=3, n_max=3, min_global_count=1)
    assert (config.n_min, config.n_max, config.min_global_count) == (3, 3, 1)


@given(st.lists(st.integers(0, 4), max_size=60), st.integers(0, 60))
def test_table_matches_plain_counting_however_the_tokens_arrive(tokens, split):
    """Full counts are kept only for keys with two or more continuations; whatever
    the order and chunking, continuations and best equal plain counting."""
    table = InMemoryNGramTable(n_min=1, n_max=3)
    split = min(split, len(tokens))
    table.extend(tokens[:split], start=1)
    table.extend(tokens, start=split)  # the rest, incrementally
    expected: dict[tuple[int, ...], dict[int, int]] = {}
    for position in range(1, len(tokens)):
        for n in range(1, min(3, position) + 1):
            counts = expected.setdefault(tuple(tokens[position - n : position]), {})
            counts[tokens[position]] = counts.get(tokens[position], 0) + 1
    assert len(table) == len(expected)
    for key, counts in expected.items():
        assert table.continuations(key) == counts
        token, count, total = table.best(key)
        # On a tie the incumbent best stays (which of the tied tokens that is
        # depends on the order counts grew), so check the count and membership.
        assert (count, total) == (max(counts.values()), sum(counts.values()))
        assert counts[token] == count
