"""N-gram drafting: propose chains of draft tokens by longest-suffix lookup.

A *draft* is a chain of up to K consecutive tokens guessed for the positions
right after a sequence's context. Each link is found the same way: take the
longest suffix of the (context + chain so far) that has been seen before,
backing off from ``n_max`` to ``n_min`` tokens, and append its most frequent
continuation. The chain stops early when no suffix matches or when the
evidence for the next link is weaker than the configured minimum.

Two sources of n-grams are consulted, in this order at each suffix length:

* ``context``: the request's own prompt and generated text (prompt lookup).
  It is indexed incrementally, each step adding only the new tokens, in a
  ``ContextIndex`` (compact arrays, under 107 bytes a token: context_index.py).
* ``global``: a table learned from earlier requests' outputs. Anything with
  ``continuations`` and ``observe`` (the ``NGramSource`` protocol) can serve
  as the global table: ``InMemoryNGramTable`` here, an LMDB-backed store in
  the drafter service.

This module imports neither grpc nor lmdb; the service wraps it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from drafter_service.context_index import BULK_INDEX_MIN_TOKENS, CompactNGramIndex
from specdec.flags import setting

SOURCE_CONTEXT = "context"
SOURCE_GLOBAL = "global"
SOURCE_SUCCESSOR = "successor"  # the target's own earlier predictions (the successor table)


@dataclass(frozen=True)
class NGramConfig:
    # Longer keys are more specific (fewer wrong drafts) but match later; 4
    # covers identifiers and short phrases.
    n_max: int = setting(4, flag="max-ngram", formerly=["n-max"], help="longest suffix looked up, in tokens")
    # Single-token keys fire on almost every token of open-ended text and are
    # usually wrong, which costs a wider forward pass.
    n_min: int = setting(2, flag="min-ngram", formerly=["n-min"], help="shortest suffix trusted, in tokens")
    # Short n-grams from other requests are weak evidence...
    min_global_count: int = setting(2, help="sightings a global-table continuation needs before it is drafted")
    # ...unless the matched suffix is long: a 4-token match is specific enough
    # to trust one earlier sighting, which is what lets a repeated request
    # draft its previous answer. The context is always trusted.
    global_trusted_match_length: int = setting(4, help="suffix length from which one global sighting is trusted")

    def __post_init__(self) -> None:
        if not 1 <= self.n_min <= self.n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got n_min={self.n_min}, n_max={self.n_max}")
        if self.min_global_count < 1:
            raise ValueError(f"min_global_count must be >= 1, got {self.min_global_count}")


class Evidence(NamedTuple):
    """Why one draft token was proposed (a NamedTuple: built once per draft token, on the hot path)."""

    source: str  # SOURCE_CONTEXT or SOURCE_GLOBAL
    match_length: int  # length of the suffix that matched
    count: int  # type: ignore[assignment]  # times this continuation followed that suffix (shadows tuple.count)
    total: int  # times any continuation followed that suffix


@dataclass(frozen=True)
class Draft:
    tokens: list[int]
    evidence: list[Evidence] = field(default_factory=list)
    # A tree's parent of each token (-1: it follows the context; parents first, and
    # each node's first child is its best guess); empty for a chain.
    parents: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        assert len(self.tokens) == len(self.evidence), "one evidence record per draft token"
        assert not self.parents or len(self.parents) == len(self.tokens), "one parent per tree node"


class Continuation(NamedTuple):
    token: int  # the most frequent token after the key (ties: the first recorded)
    count: int  # type: ignore[assignment]  # how often it followed (shadows tuple.count)
    total: int  # how often anything followed


class BestSource(Protocol):
    """What ``propose_chain`` asks of a source."""

    def best(self, key: tuple[int, ...]) -> Continuation | tuple[int, int, int] | None:
        """The most frequent continuation of ``key`` (token, count, total): what
        drafting needs, and cheaper than ``continuations`` for a store that keeps
        counts sorted."""


class NGramSource(BestSource, Protocol):
    def continuations(self, key: tuple[int, ...]) -> dict[int, int] | None:
        """Next-token counts seen after ``key``, or None when never seen."""

    def observe(self, tokens: Sequence[int]) -> None:
        """Count every n-gram of ``tokens`` (n_min..n_max) with its next token."""


class InMemoryNGramTable:
    """Counts of next tokens per n-gram, for n in [n_min, n_max].

    tokens [5, 6, 7] with n_min=1, n_max=2 records
    (5,)->6, (6,)->7, (5, 6)->7.
    """

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        # Per key: (best token, its count, total), replaced by extend so that
        # drafting costs one dict lookup: ``best`` is that dict's own ``get``
        # (a plain tuple unpacks and compares like a Continuation).
        self._best: dict[tuple[int, ...], tuple[int, int, int]] = {}
        self.best: Callable[[tuple[int, ...]], Continuation | None] = self._best.get  # type: ignore[assignment]
        # Full next-token counts, only for keys followed by two or more distinct
        # tokens; for the rest (most n-grams of a context) the summary is the count.
        self._counts: dict[tuple[int, ...], dict[int, int]] = {}

        # The successor table: (current,) and (previous, current) -> the target's latest top predictions.
        self._successors: dict[tuple[int, ...], tuple[int, ...]] = {}

    def __len__(self) -> int:
        return len(self._best)

    def successors(self, key: tuple[int, ...]) -> tuple[int, ...] | None:
        return self._successors.get(key)

    def record_successors(self, updates) -> int:
        """The target's top predictions after each key, best first: the newest replace the old."""
        count = 0
        for key, tokens in updates:
            self._successors[tuple(key)] = tuple(tokens)
            count += 1
        return count

    def continuations(self, key: tuple[int, ...]) -> dict[int, int] | None:
        counts = self._counts.get(key)
        if counts is not None:
            return counts
        summary = self._best.get(key)
        return None if summary is None else {summary[0]: summary[1]}

    def observe(self, tokens: Sequence[int]) -> None:
        self.extend(tokens, start=1)

    def extend(self, tokens: Sequence[int], start: int) -> None:
        """Record the n-grams ending just before each position >= ``start``.

        Used incrementally: after appending new tokens to a context, call with
        ``start`` = the old length so earlier positions are not counted twice.
        """
        all_counts, best = self._counts, self._best
        for position in range(max(start, 1), len(tokens)):
            following = tokens[position]
            for n in range(self.n_min, min(self.n_max, position) + 1):
                key = tuple(tokens[position - n : position])
                summary = best.get(key)
                if summary is None:  # a new n-gram, the commonest case
                    best[key] = (following, 1, 1)
                    continue
                token, top, total = summary
                if token == following and top == total:  # still its only continuation
                    best[key] = (token, top + 1, total + 1)
                    continue
                counts = all_counts.get(key)
                if counts is None:  # a second distinct continuation: keep full counts from now on
                    counts = all_counts[key] = {token: top}
                count = counts[following] = counts.get(following, 0) + 1
                # Strictly more: on a tie the current best stays (the first to
                # reach that count), so drafts do not flip between tied tokens.
                best[key] = (following, count, total + 1) if count > top else (token, top, total + 1)


def most_frequent(counts: dict[int, int]) -> tuple[int, int]:
    """(token, count) with the highest count; ties go to the token seen first.

    Dicts keep insertion order, and max() returns the first maximum, so among
    equal counts the earliest-recorded continuation wins: deterministic, and
    for the context it is the continuation of the first occurrence.
    """
    token = max(counts, key=counts.__getitem__)
    return token, counts[token]


def best_of(counts: dict[int, int] | None) -> Continuation | None:
    """Continuation(token, count, total) of a counts dict; {4: 2, 9: 3} -> (9, 3, 5)."""
    if not counts:
        return None
    token, count = most_frequent(counts)
    return Continuation(token, count, sum(counts.values()))


def lookup_longest(
    tail: Sequence[int],
    sources: Sequence[tuple[str, BestSource]],
    config: NGramConfig,
) -> tuple[int, Evidence] | None:
    """The continuation of the longest matching suffix of ``tail``: a one-link chain.

    tail [9, 1, 2], context table holding (1, 2)->3 and (2,)->4, n_max=3:
    (9, 1, 2) is unknown, (1, 2) matches -> (3, match_length 2).
    """
    draft = propose_chain(tail, sources, 1, config)
    return (draft.tokens[0], draft.evidence[0]) if draft.tokens else None


def propose_chain(
    context: Sequence[int],
    sources: Sequence[tuple[str, BestSource]],
    k: int,
    config: NGramConfig,
    prefix: Sequence[int] = (),
    run: int = 0,
) -> Draft:
    """Up to ``k`` draft tokens continuing ``context`` (then ``prefix``, tokens taken
    as already drafted: a tree's branch), one lookup per link.

    context [1, 2, 3, 4, 2, 3] indexed as its own source, n_min=n_max=2, k=3:
    suffix (2, 3) was followed by 4 -> 4; (3, 4) by 2 -> 2; (4, 2) by 3 -> 3;
    the draft is [4, 2, 3].

    Each link takes the longest suffix (n_max down to n_min) that any source
    knows, sources in the given order at each length. A global-table link
    needs ``min_global_count`` sightings unless its suffix is at least
    ``global_trusted_match_length`` long. This loop runs per draft token on
    the service's hot path, so the lookup is written inline.

    A global-table link on an n_max-token key reports as its match the suffix
    along which the table's best continuations chain: n_max + the links before
    it that did the same + ``run``, the context's own last tokens that did
    (``ContextIndex.global_run``). Where the context repeats a text the table
    learned whole (a request sent again), that length grows token by token, as
    a copy's does, and the planner trusts it as far as it has been right.
    """
    n_max, min_global, trusted = config.n_max, config.min_global_count, config.global_trusted_match_length
    tokens: list[int] = list(prefix)
    lookups = []
    for name, source in sources:
        # A context index over this very context answers from a walk along the
        # draft: the same answers as its ``best``, without hashing each key.
        walk = source.walk(context, tokens) if isinstance(source, CompactNGramIndex) else None
        lookups.append((name, source.best if walk is None else walk, name == SOURCE_GLOBAL))
    tail = (tuple(context[-n_max:]) + tuple(prefix))[-n_max:]  # slices of a tuple are the keys themselves
    lengths = range(min(n_max, len(tail)), config.n_min - 1, -1)  # longest suffix first
    evidence: list[Evidence] = []
    streak = run if not prefix else 0  # the links so far along the global table's best continuations
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
        if is_global and n == n_max:
            evidence.append(Evidence(name, n + streak, count, total))
            streak += 1
        else:
            evidence.append(Evidence(name, n, count, total))
            streak = 0
        tail = (tail + (token,))[-n_max:]
        if len(tail) > lengths.start:  # a short context grew: longer suffixes exist now
            lengths = range(len(tail), config.n_min - 1, -1)
    return Draft(tokens[len(prefix) :], evidence)


def alternatives(
    tail: Sequence[int],
    sources: Sequence[tuple[str, BestSource]],
    config: NGramConfig,
    exclude: int | None,
    limit: int,
) -> list[tuple[int, Evidence]]:
    """Up to ``limit`` distinct next tokens after ``tail`` other than ``exclude``, best first:
    each suffix length from the longest, each source in order, a source with counts
    (the global table) giving its top continuations, the context its best at that
    length. A tree's branches where its chain may be wrong.

    Any match of ``n_min`` or more qualifies: the chain's trust rules decide what
    is drafted in a line, and the verifier's planner weighs each branch by its
    evidence (match length, count of total) before scoring any.
    """
    found: list[tuple[int, Evidence]] = []
    seen = {exclude}
    tail = tuple(tail[-config.n_max :])
    for n in range(len(tail), config.n_min - 1, -1):
        key = tail[-n:]
        for name, source in sources:
            counts = source.continuations(key) if name == SOURCE_GLOBAL and hasattr(source, "continuations") else None
            if counts:
                total = sum(counts.values())
                candidates = sorted(counts.items(), key=lambda item: -item[1])[: limit + 1]
                options = [(token, Evidence(name, n, count, total)) for token, count in candidates]
            else:
                hit = source.best(key)
                options = [] if hit is None else [(hit[0], Evidence(name, n, hit[1], hit[2]))]
            for token, evidence in options:
                if token not in seen:
                    seen.add(token)
                    found.append((token, evidence))
                    if len(found) >= limit:
                        return found
    return found


class LayeredSource:
    """Two tables read as one: ``own`` first, then ``shared`` where ``own`` has nothing.

    own has (1, 2) -> 3 and shared (1, 2) -> 4 and (2, 5) -> 6: best((1, 2)) is own's
    (3, ...), best((2, 5)) shared's (6, ...). A scope's drafts read its own table and, after
    it, the one scope its verifier shares with every caller; nothing is written through this.
    """

    def __init__(self, own: NGramSource, shared: NGramSource) -> None:
        self.own, self.shared = own, shared

    def best(self, key: tuple[int, ...]) -> Continuation | tuple[int, int, int] | None:
        return self.own.best(key) or self.shared.best(key)

    def continuations(self, key: tuple[int, ...]) -> dict[int, int] | None:
        return self.own.continuations(key) or self.shared.continuations(key)

    def successors(self, key: tuple[int, ...]) -> tuple[int, ...] | None:
        for table in (self.own, self.shared):
            lookup = getattr(table, "successors", None)
            found = lookup(key) if lookup is not None else None
            if found:
                return found
        return None

    def observe(self, tokens: Sequence[int]) -> None:
        raise TypeError("a layered source is read-only: observations go to one scope's table")


def successor_options(table: object, tail: Sequence[int]) -> list[tuple[int, Evidence]]:
    """The successor table's predictions after ``tail``: keyed by its last two tokens,
    else its last one; best first. Evidence: (SOURCE_SUCCESSOR, key length, k - rank, k),
    so the top prediction reads as unanimous and the others as contested."""
    lookup = getattr(table, "successors", None)
    if lookup is None:
        return []
    for n in (2, 1):
        if len(tail) >= n:
            found = lookup(tuple(tail[-n:]))
            if found:
                k = len(found)
                return [(token, Evidence(SOURCE_SUCCESSOR, n, k - rank, k)) for rank, token in enumerate(found)]
    return []


def successor_updates(predictions) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """A verifier's predictions (``k``, ``previous``, ``current``, ``tokens``: the proto's
    ``Predictions`` or ``drafting.Predictions``) as successor-table updates: each
    position's k predictions under (current,) and under (previous, current)."""
    k, tokens = predictions.k, predictions.tokens
    updates = []
    for index, (previous, current) in enumerate(zip(predictions.previous, predictions.current)):
        predicted = tuple(tokens[index * k : (index + 1) * k])
        updates += [((current,), predicted), ((previous, current), predicted)]
    return updates


def propose_chain_or_successors(
    context: Sequence[int],
    sources: Sequence[tuple[str, BestSource]],
    k: int,
    config: NGramConfig,
    prefix: Sequence[int] = (),
    run: int = 0,
) -> Draft:
    """``propose_chain``, where each link the n-gram sources cannot make is the successor
    table's top prediction (the global source's ``successors``, when it has them): the
    n-gram chain, else the target's own earlier guess, then n-grams again."""
    table = next((source for name, source in sources if name == SOURCE_GLOBAL), None)
    tokens: list[int] = []
    evidence: list[Evidence] = []
    tail = list(context[-config.n_max :]) + list(prefix)
    while len(tokens) < k:
        link = propose_chain(context, sources, k - len(tokens), config, prefix=[*prefix, *tokens], run=run)
        tokens += link.tokens
        evidence += link.evidence
        if len(tokens) >= k:
            break
        options = successor_options(table, tail + tokens)
        if not options:
            break
        tokens.append(options[0][0])
        evidence.append(options[0][1])
    return Draft(tokens, evidence)


# Alternatives tried at each position of the chain, from the n-gram sources and
# from the successor table, and how deep a branch's own chain goes: a branch is
# a second guess, so its continuation is cut short to leave nodes for guesses
# at the chain's later positions.
BRANCHES_PER_POSITION = 2
SUCCESSOR_BRANCHES_PER_POSITION = 2
BRANCH_DEPTH = 3


def propose_tree(
    context: Sequence[int],
    sources: Sequence[tuple[str, BestSource]],
    k: int,
    max_nodes: int,
    config: NGramConfig,
    chain: Draft | None = None,
    run: int = 0,
) -> Draft:
    """A tree of at most ``max_nodes`` draft tokens, none deeper than ``k``.

    Its first nodes are the chain (``propose_chain_or_successors``: the
    n-gram chain, its gaps filled from the successor table; so each node's
    first child is the best guess). Then, for each position of the chain from
    the first, up to BRANCHES_PER_POSITION other tokens that an n-gram source
    saw after the same suffix (``alternatives``), then up to
    SUCCESSOR_BRANCHES_PER_POSITION of the target's own earlier predictions
    there (``successor_options``), become siblings of the chain's token,
    each followed by its own chain of up to BRANCH_DEPTH tokens, while nodes
    are left. Parents come before their children.

    context [1, 2, 3, 9, 1, 2, 4, 7, 9, 1, 2], n 2..3, k=2, 8 nodes: the
    chain is [4, 7] ((9, 1, 2) went to 4, then (1, 2, 4) to 7); the shorter
    (1, 2) first went to 3, so 3 is a sibling of 4, followed by 9 (after
    (2, 3)): tokens [4, 7, 3, 9], parents [-1, 0, -1, 2].

    ``chain``: the chain to branch from instead (a copy of an earlier occurrence);
    ``run``: ``propose_chain``'s, for the chain.
    """
    if chain is None:
        chain = propose_chain_or_successors(context, sources, k, config, run=run)
    tokens, evidence = list(chain.tokens), list(chain.evidence)
    parents = list(range(-1, len(tokens) - 1))
    if max_nodes <= len(tokens):
        return Draft(tokens[:max_nodes], evidence[:max_nodes], parents[:max_nodes])
    table = next((source for name, source in sources if name == SOURCE_GLOBAL), None)
    tail = list(context[-config.n_max :])
    for position in range(min(len(chain.tokens) + 1, k)):
        here = tail + chain.tokens[:position]
        taken = {chain.tokens[position]} if position < len(chain.tokens) else set()
        options = alternatives(here, sources, config, chain.tokens[position] if taken else None, BRANCHES_PER_POSITION)
        taken |= {token for token, _ in options}
        options += [option for option in successor_options(table, here) if option[0] not in taken][:SUCCESSOR_BRANCHES_PER_POSITION]
        for token, found in options:
            if len(tokens) >= max_nodes:
                return Draft(tokens, evidence, parents)
            parents.append(position - 1)
            tokens.append(token)
            evidence.append(found)
            depth = min(BRANCH_DEPTH, k - position - 1, max_nodes - len(tokens))
            branch = propose_chain_or_successors(here, sources, depth, config, prefix=[token]) if depth > 0 else Draft([])
            parents += range(len(tokens) - 1, len(tokens) - 1 + len(branch.tokens))
            tokens += branch.tokens
            evidence += branch.evidence
    return Draft(tokens, evidence, parents)


# ``ContextIndex.global_run`` counts at most this many tokens back: past it, a longer
# run says nothing more to the planner (whose longest match bucket is 32).
GLOBAL_RUN_LONGEST = 64


class ContextIndex(CompactNGramIndex):
    """One request's own tokens (prompt and output), indexed as they arrive.

    A ``CompactNGramIndex`` of the config's n_min..n_max (``tokens``, ``extend``,
    ``best``) that drafts with ``propose``, with the same drafts as indexing the
    context in an ``InMemoryNGramTable`` (kept as the reference in the tests)
    where it does not copy (``copy``).

    Memory, for the service's per-caller budget: ``nbytes()`` bounds what an
    index holds now, in O(1); ``max_bytes_for(tokens, config)`` what one may
    hold once it has ``tokens`` tokens, so that a call can be refused before it
    is indexed. For the default n 2..4 the bound is 106.4 bytes per token at
    131,072 tokens (plus ~6 KB per index); measured, 55-77 (an
    ``InMemoryNGramTable`` takes ~270 on text, ~550 on random ids).

    context [1, 2, 3, 4, 2, 3], n 2..2: propose(empty table, 3) -> [4, 2, 3],
    each token once of once from the context.
    """

    __slots__ = ("config", "_run", "_run_checked")

    def __init__(self, config: NGramConfig, *, bulk_min_tokens: int = BULK_INDEX_MIN_TOKENS) -> None:
        super().__init__(config.n_min, config.n_max, bulk_min_tokens=bulk_min_tokens)
        self.config = config
        self._run = 0  # ``global_run`` as of position _run_checked
        self._run_checked = 0

    @staticmethod
    def max_bytes_for(tokens: int, config: NGramConfig) -> int:  # type: ignore[override]
        """The most ``nbytes()`` of a context of ``config`` can be once it holds
        ``tokens`` tokens, however they arrived (to refuse a call before indexing it)."""
        return CompactNGramIndex.max_bytes_for_lengths(tokens, config.n_min, config.n_max)

    def propose(self, global_table: NGramSource, k: int, max_nodes: int = 0) -> Draft:
        """A chain of up to ``k`` tokens: the copy (``copy``) where the context's suffix
        matched longer than n_max tokens and longer than the global table has followed
        the context (``global_run``), else from this context first, then the global table
        (the table first once it has followed the context's last n_max tokens or more);
        with ``max_nodes``, a tree of that many nodes at most (``propose_tree``)."""
        if k <= 0:
            return Draft([], [])
        sources: tuple[tuple[str, BestSource], ...] = ((SOURCE_CONTEXT, self), (SOURCE_GLOBAL, global_table))
        end, length = self.longest_copy()
        run = self.global_run(global_table)
        # A copy where its match is longer than the table has followed the text (and so than n_max).
        copied = self._copied(end, length, k) if length > self.n_max + run else Draft([])
        if run >= self.n_max:  # the context is following a text the table learned: the table leads
            sources = ((SOURCE_GLOBAL, global_table), (SOURCE_CONTEXT, self))
        if max_nodes:
            return propose_tree(self.tokens, sources, k, max_nodes, self.config, copied if copied.tokens else None, run)
        return copied if copied.tokens else propose_chain(self.tokens, sources, k, self.config, run=run)

    def global_run(self, table: BestSource) -> int:
        """How many of the context's last tokens were each the best continuation ``table``
        gives their n_max tokens before (at most GLOBAL_RUN_LONGEST): how far the context
        has followed a text the table learned. Worked out for the tokens added since the
        last call (the last GLOBAL_RUN_LONGEST of them), one lookup each, against the table
        of each call: a session's table is its scope's, read through a new snapshot each
        call, and learning as it is read; the run is evidence for the planner, not a draft.

        table learned [1, 2, 3, 4, 5, 6]; context [9, 1, 2, 3, 4, 5, 6], n 2..4: 5 and 6
        followed their 4-grams as the table's best, 4 did not (9, 1, 2, 3 is unknown): 2.
        """
        toks, n_max, size = self.tokens, self.n_max, len(self.tokens)
        start = max(self._run_checked, size - GLOBAL_RUN_LONGEST, n_max)
        if start > self._run_checked:
            self._run = 0  # the skipped tokens are not checked
        run, best = self._run, table.best
        for position in range(start, size):
            hit = best(tuple(toks[position - n_max : position]))
            run = run + 1 if hit is not None and hit[0] == toks[position] else 0
        self._run, self._run_checked = min(run, GLOBAL_RUN_LONGEST), size
        return self._run

    def copy(self, k: int) -> Draft:
        """``k`` tokens copied from after the latest earlier occurrence of the context's
        longest suffix (``longest_copy``), when it is longer than n_max: where the context
        repeats a text (a file returned with an edit, a quoted tool result), n-grams of
        n_max tokens cannot tell its versions apart, and a copy follows one. Token i's
        evidence is the match it extends, length + i tokens, seen once.

        context [7, 1, 2, 3, 4, 8, 9, 1, 2, 3, 4, 5, 9, 1, 2, 3, 4], n 2..4, k 3: the
        suffix (9, 1, 2, 3, 4) occurred ending at 11, so the copy is [5, 9, 1].
        A copy that reaches the context's end goes on from its own first tokens (a text
        repeating itself: [1, 2] * 6 + [1], k 3 -> [2, 1, 2]).
        """
        end, length = self.longest_copy()
        return self._copied(end, length, k) if length > self.n_max else Draft([])

    def _copied(self, end: int, length: int, k: int) -> Draft:
        """``k`` tokens from ``end`` on, the copy of a match of ``length`` tokens ending there."""
        toks, size = self.tokens, len(self.tokens)
        tokens: list[int] = []
        for at in range(end, end + k):
            tokens.append(toks[at] if at < size else tokens[at - size])
        return Draft(tokens, [Evidence(SOURCE_CONTEXT, length + i, 1, 1) for i in range(k)])
