"""The drafter's one writer: ``ObservationWriter`` commits queued observations to
their tables in groups (group commit), then acknowledges them. Knows no gRPC: a
handler queues one call's ``_Pending`` items and waits on each one's ``done``.

Tables are served fairly: each transaction takes the tables' observations
round-robin (``next_group``), the tables served longest ago first, so one
table's many queued items never fill a transaction ahead of another table's
first; and each table may hold only its share of the queue.

Nothing waits without bound. The queue is bounded in observations and in
tokens, in all and per table (``submit`` refuses beyond any, all or none: the
caller retries).
A handler waits no longer than its caller's deadline (and the service's
maximum), then marks its items ``abandoned``; an item whose caller has given
up is dropped before its next chunk is committed, however few chunks it has,
so a write nobody waits for never holds the writer. Chunks already committed
stay (a retry under the same id skips them).

The writer also stores the target's predictions that verifiers send with
Propose (the successor table): ``submit_successors`` never blocks its caller,
keeps the newest predictions per key, and drops keys beyond its bound, in all
or for the table (counted); the writer commits what is pending before each group of
observations, in one transaction per table. Predictions are hints, resent
with every step, so a dropped or lost one costs a draft, never an output.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from drafter_service.storage import DiskFull, DiskSpace
from drafter_service.store import ApplyItem, LMDBNGramStore, StoreClosed, StoreFull, first_occurrences

log = logging.getLogger(__name__)

# A long observation is committed in chunks of this many tokens (~0.1 s each
# here), and one transaction takes at most WRITE_BATCH_TOKENS, so a 128K-token
# call (~4.5 s to commit whole) never holds the writer while small ones wait.
CHUNK_TOKENS = 4096
WRITE_BATCH_TOKENS = 8192
# Bytes an observe id keeps free for a chunk's "#<index>" suffix.
CHUNK_SUFFIX_BYTES = 8
# The default share of each queue bound (observations, tokens, successor keys) one table
# may hold: a flooding tenant leaves three quarters of the queue to the others, and still
# has ~2.5 s of the writer's work queued (a quarter of --max-pending-write-tokens).
TABLE_SHARE_OF_QUEUE = 4


@dataclass(eq=False)  # hashed by identity
class _Pending:
    store: LMDBNGramStore
    observe_id: str | None
    tokens: list[int]
    done: threading.Event = field(default_factory=threading.Event)
    applied: bool = False
    error: BaseException | None = None
    next_chunk: int = 0  # chunks before it are committed
    deadline: float | None = None  # time.monotonic() when its caller gives up; None: never
    abandoned: bool = False  # its handler stopped waiting (deadline, cancel, the service's maximum)
    # Per n, the positions whose n-gram counts: its call's first occurrences (store.first_occurrences);
    # None: the item is a call by itself (the store counts each n-gram once in it).
    counted: tuple[bytes, ...] | None = None

    def expired(self) -> bool:
        """Its caller has given up: nothing more of it is committed."""
        return self.abandoned or (self.deadline is not None and time.monotonic() > self.deadline)

    @property
    def chunks(self) -> int:
        return max(1, -(-len(self.tokens) // CHUNK_TOKENS))

    def chunk(self, index: int) -> ApplyItem:
        """Chunk ``index`` as the store applies it. Each chunk is de-duplicated under its
        own id, so a retry after a partial commit stores only the rest; it carries the
        n_max tokens before it as context (see count_ngrams), and the positions of it
        that count (``counted``: so the chunks together count each n-gram once)."""
        if self.chunks == 1:
            return ApplyItem(self.observe_id, self.tokens, 0, self.counted)
        if self.counted is None:  # a call of this one observation: its chunks are the parts
            config = self.store.config
            self.counted = first_occurrences([self.tokens], config.n_min, config.n_max)[0]
        low = index * CHUNK_TOKENS
        context = min(low, self.store.config.n_max)
        chunk_id = None if self.observe_id is None else f"{self.observe_id}#{index}"
        counted = tuple(mask[low - context : low + CHUNK_TOKENS] for mask in self.counted)
        return ApplyItem(chunk_id, self.tokens[low - context : low + CHUNK_TOKENS], context, counted)


class _Wake:
    """Queued to wake the writer for pending successor-table updates."""


_WAKE = _Wake()


class WriteQueueFull(Exception):
    """The queue, or the table's share of it, holds as many observations or tokens as it may; the message names the flag."""


class ObservationWriter(threading.Thread):
    """The only writer: commits queued observations in groups, then acknowledges them.

    Fair to tables and to small calls: each transaction takes the next chunk of the
    waiting observations that fit in WRITE_BATCH_TOKENS, round-robin over tables
    (``next_group``), so a small Observe is stored in the first transaction after it
    arrives, whatever long ones or other tables' floods are in progress, and long ones
    always advance. ``*_per_table`` bound what one table (one scope) may hold queued;
    None: a TABLE_SHARE_OF_QUEUE-th of the bound in all.
    """

    def __init__(
        self,
        max_pending: int,
        disk: DiskSpace,
        max_pending_tokens: int = 1 << 20,
        max_pending_successors: int = 1 << 16,
        max_pending_per_table: int | None = None,
        max_pending_tokens_per_table: int | None = None,
        max_pending_successors_per_table: int | None = None,
    ) -> None:
        super().__init__(name="drafter-writer", daemon=True)
        self.queue: queue.Queue[_Pending | _Wake | None] = queue.Queue()
        self.disk = disk
        self.max_pending, self.max_pending_tokens = max_pending, max_pending_tokens
        self.max_pending_per_table = _share(max_pending, max_pending_per_table)
        self.max_pending_tokens_per_table = _share(max_pending_tokens, max_pending_tokens_per_table)
        self.pending = self.pending_tokens = 0  # submitted and not yet done
        self._queued: dict[LMDBNGramStore, list[int]] = {}  # per table with items not yet done: [items, tokens]
        self.dropped = 0  # items dropped because their caller gave up
        self._accounting = threading.Lock()
        # Successor-table updates waiting for the writer: per table, key -> predictions (the newest).
        self.max_pending_successors = max_pending_successors
        self.max_pending_successors_per_table = _share(max_pending_successors, max_pending_successors_per_table)
        self._successors: dict[LMDBNGramStore, dict[tuple[int, ...], tuple[int, ...]]] = {}
        self._successor_keys = 0  # keys in _successors
        self._woken = False  # a _WAKE is queued and not yet taken
        self.dropped_successors = 0  # keys dropped: beyond a bound, the disk full, or the table gone
        self.stored_successors = 0
        self._turns: dict[LMDBNGramStore, int] = {}  # see next_group

    def submit_successors(self, store: LMDBNGramStore, updates: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
        """Queue the target's predictions for ``store`` (see the module docstring). Never blocks:
        a key beyond --max-pending-successors, or beyond the table's share of it, is dropped and counted."""
        if not updates:
            return
        with self._accounting:
            pending = self._successors.setdefault(store, {})
            for key, tokens in updates:
                if key not in pending:
                    if self._successor_keys >= self.max_pending_successors or len(pending) >= self.max_pending_successors_per_table:
                        self.dropped_successors += 1
                        continue
                    self._successor_keys += 1
                pending[key] = tokens
            wake, self._woken = not self._woken, True
        if wake:
            self.queue.put_nowait(_WAKE)

    def _store_successors(self) -> None:
        """Commit the pending successor-table updates, one transaction per table."""
        with self._accounting:
            tables, self._successors, self._successor_keys, self._woken = self._successors, {}, 0, False
        for store, updates in tables.items():
            if not updates:
                continue
            if self.disk.check():
                self.dropped_successors += len(updates)
                continue
            try:
                stored = store.record_successors(updates.items())
            except StoreClosed:  # set aside meanwhile: the next step's predictions go to its successor
                self.dropped_successors += len(updates)
                continue
            except Exception:  # never kills the writer; predictions are hints
                log.exception("storing %d successor-table predictions failed", len(updates))
                self.dropped_successors += len(updates)
                continue
            self.stored_successors += stored
            self.dropped_successors += len(updates) - stored

    def submit(self, items: list[_Pending]) -> None:
        """Queue one call's ``items``, all or none: ``WriteQueueFull`` beyond --max-pending-observations
        or --max-pending-write-tokens, or beyond a table's share of them (the caller answers
        RESOURCE_EXHAUSTED). The items are one call: together they count each n-gram once
        (store: *One vote per call*)."""
        tokens = sum(len(item.tokens) for item in items)
        per_table: dict[LMDBNGramStore, list[int]] = {}
        for item in items:
            added = per_table.setdefault(item.store, [0, 0])
            added[0] += 1
            added[1] += len(item.tokens)
        with self._accounting:
            self._check_room(len(items), tokens, per_table)
            self.pending += len(items)
            self.pending_tokens += tokens
            for store, (count, table_tokens) in per_table.items():
                queued = self._queued.setdefault(store, [0, 0])
                queued[0] += count
                queued[1] += table_tokens
        _mark_first_occurrences(items)  # before the writer can take any of them
        for item in items:
            self.queue.put_nowait(item)

    def _check_room(self, items: int, tokens: int, per_table: dict[LMDBNGramStore, list[int]]) -> None:
        """Raise WriteQueueFull, naming the flag, unless a call of ``items`` and ``tokens`` fits (under _accounting)."""
        if self.pending + items > self.max_pending:
            raise WriteQueueFull(
                f"the drafter's write queue is full ({self.pending} observations queued, --max-pending-observations "
                f"{self.max_pending}); retry with backoff"
            )
        if self.pending_tokens + tokens > self.max_pending_tokens:
            raise WriteQueueFull(
                f"the drafter's write queue is full ({self.pending_tokens} tokens queued, this call adds {tokens}, "
                f"--max-pending-write-tokens {self.max_pending_tokens}); retry with backoff, or send smaller calls"
            )
        for store, (added, added_tokens) in per_table.items():
            queued, queued_tokens = self._queued.get(store, (0, 0))
            if queued + added > self.max_pending_per_table:
                raise WriteQueueFull(
                    f"this scope's share of the drafter's write queue is full ({queued} observations queued for its table, "
                    f"this call adds {added}, --max-pending-observations-per-scope {self.max_pending_per_table}); retry with backoff"
                )
            if queued_tokens + added_tokens > self.max_pending_tokens_per_table:
                raise WriteQueueFull(
                    f"this scope's share of the drafter's write queue is full ({queued_tokens} tokens queued for its table, "
                    f"this call adds {added_tokens}, --max-pending-write-tokens-per-scope {self.max_pending_tokens_per_table}); "
                    "retry with backoff, or send smaller calls"
                )

    def _finish(self, item: _Pending) -> None:
        with self._accounting:
            self.pending -= 1
            self.pending_tokens -= len(item.tokens)
            queued = self._queued[item.store]
            queued[0] -= 1
            queued[1] -= len(item.tokens)
            if not queued[0]:
                del self._queued[item.store]
        item.done.set()

    def _drop_given_up(self, waiting: deque[_Pending]) -> None:
        """Fail, without committing anything more of them, the items whose caller gave up."""
        for item in [item for item in waiting if item.expired()]:
            waiting.remove(item)
            self.dropped += 1
            item.error = TimeoutError("the caller's deadline passed before the observation was stored whole")
            self._finish(item)

    def run(self) -> None:
        waiting: deque[_Pending] = deque()  # with chunks left, the longest-waiting first
        stopping = False
        while True:
            woken = False  # successor-table updates are pending
            while True:  # block only when there is nothing to do
                try:
                    item = self.queue.get(block=not (waiting or stopping or woken))
                except queue.Empty:
                    break
                if item is None:
                    stopping = True
                elif isinstance(item, _Wake):
                    woken = True
                else:
                    waiting.append(item)
            self._store_successors()
            self._drop_given_up(waiting)
            if not waiting:
                if stopping:
                    return
                continue
            group: list[tuple[_Pending, int]] = []
            try:
                group = next_group(waiting, self._turns)
                self._commit(group)
            except Exception as error:  # a bug here must never leave callers waiting forever
                log.exception("the observation writer failed; failing what it holds")
                group = [*group, *((item, 0) for item in waiting)]
                waiting.clear()
                for item, _ in group:
                    item.error = item.error or error
            for item in dict.fromkeys(item for item, _ in group):  # an item may have several chunks in it
                # With chunks left, it waits again (one whose caller has given up meanwhile is
                # dropped at the top of the loop; the chunks stored are kept, a retry skips them by id).
                if item.error is None and item.next_chunk < item.chunks:
                    waiting.append(item)
                else:
                    self._finish(item)

    def _commit(self, group: list[tuple[_Pending, int]]) -> None:
        by_store: dict[int, list[tuple[_Pending, int]]] = {}
        for item, index in group:
            by_store.setdefault(id(item.store), []).append((item, index))
        for chunks in by_store.values():
            self._commit_table(chunks)

    def _commit_table(self, chunks: list[tuple[_Pending, int]]) -> None:
        """Store one table's chunks; each item gets its outcome or its own error."""
        if self.disk.check():
            self._refuse(chunks)
            return
        try:
            self._apply(chunks)
        except StoreFull as full:  # those without room answer a retryable error; the rest are stored
            for (item, _), applied in zip(chunks, full.results):
                if applied is None:
                    item.error = full
                else:
                    item.applied |= applied
        except StoreClosed as gone:  # set aside (damaged) or closed: nothing written; a retry goes to a fresh table
            for item, _ in chunks:
                item.error = gone
        except Exception as error:
            if self.disk.check():  # the commit ran out of disk (LMDB: EIO or ENOSPC); nothing was written
                log.error("observation commit failed for want of disk space: %s", error)
                self._refuse(chunks)
                return
            for chunk in chunks:  # one item's fault must not fail the others' callers: each alone
                try:
                    self._apply([chunk])
                except Exception as error:  # reported to its caller, never kills the writer
                    log.exception("observation commit failed")
                    chunk[0].error = error

    def _refuse(self, chunks: list[tuple[_Pending, int]]) -> None:
        """Nothing of ``chunks`` is written: the disk is full (their callers retry)."""
        full = DiskFull(self.disk.refusal())
        for item, _ in chunks:
            item.error = full

    @staticmethod
    def _apply(chunks: list[tuple[_Pending, int]]) -> None:
        results = chunks[0][0].store.apply([item.chunk(index) for item, index in chunks])
        for (item, _), applied in zip(chunks, results):
            item.applied |= applied

    def stop(self) -> None:
        self.queue.put(None)
        self.join()


def next_group(waiting: deque[_Pending], turns: dict[LMDBNGramStore, int] | None = None) -> list[tuple[_Pending, int]]:
    """One transaction's chunks, within WRITE_BATCH_TOKENS, taken round-robin over the tables
    waiting: the next chunk of each table's longest-waiting observation, then of each one's
    second, and so on, so one table's many items never fill the batch ahead of another
    table's first (the first chunk is always taken). Then, with room left, more chunks of
    those taken. Those not taken keep their place in line.

    Tables go in the order of their turns: ``turns`` (the writer's, updated here) holds the
    number of the last group that took from each table waiting, and the tables served
    longest ago (or never) go first, so a table whose items did not fit leads the next group.
    Tables A (items a1, a2, a3 waiting, in that order) and B (b1, queued last), 3,000 tokens
    each: [a1, b1] (in plain waiting order it would be [a1, a2], b1 waiting a group more).
    """
    turns = {} if turns is None else turns
    lines: dict[LMDBNGramStore, deque[_Pending]] = {}
    for item in waiting:
        lines.setdefault(item.store, deque()).append(item)
    order = sorted(lines, key=lambda table: turns.get(table, -1))  # stable: ties in waiting order
    this_turn = max(turns.values(), default=-1) + 1
    for table in list(turns):
        if table not in lines:
            del turns[table]  # nothing waiting: it goes first when it has
    group: list[tuple[_Pending, int]] = []
    tokens = 0

    def size(item: _Pending) -> int:  # its next chunk's own tokens
        return min(len(item.tokens) - item.next_chunk * CHUNK_TOKENS, CHUNK_TOKENS)

    def take(item: _Pending) -> None:
        nonlocal tokens
        tokens += size(item)
        group.append((item, item.next_chunk))
        item.next_chunk += 1
        turns[item.store] = this_turn

    queues = [lines[table] for table in order]
    while queues:
        for line in queues:
            item = line.popleft()
            if not group or tokens + size(item) <= WRITE_BATCH_TOKENS:
                take(item)
        queues = [line for line in queues if line]
    taken = {item for item, _ in group}
    left = [item for item in waiting if item not in taken]
    waiting.clear()
    waiting.extend(left)
    for item in list(dict.fromkeys(item for item, _ in group)):
        while item.next_chunk < item.chunks and tokens + size(item) <= WRITE_BATCH_TOKENS:
            take(item)
    return group


def _share(bound: int, per_table: int | None) -> int:
    """A table's share of a queue bound: ``per_table``, or by default a TABLE_SHARE_OF_QUEUE-th of it."""
    if per_table is None:
        return max(1, bound // TABLE_SHARE_OF_QUEUE)
    if per_table < 1:
        raise ValueError(f"a table's share of the write queue must be >= 1, got {per_table}")
    return per_table


def _mark_first_occurrences(items: list[_Pending]) -> None:
    """Give the items of one call, when it has several parts (sequences or chunks), the
    positions that count (``counted``): so the call counts each n-gram once in all."""
    per_table: dict[LMDBNGramStore, list[_Pending]] = {}
    for item in items:
        per_table.setdefault(item.store, []).append(item)
    for store, parts in per_table.items():
        if len(parts) == 1 and parts[0].chunks == 1:
            continue  # one part: the store counts each n-gram once in it
        try:
            masks = first_occurrences([item.tokens for item in parts], store.config.n_min, store.config.n_max)
        except ValueError:
            continue  # a token id out of range: the store refuses the item, naming it
        for item, counted in zip(parts, masks):
            item.counted = counted
