"""The persistent global n-gram table: an LMDB-backed ``NGramSource``.

``LMDBNGramStore`` holds what ``InMemoryNGramTable`` holds — for every n-gram
of earlier requests' outputs (n in [n_min, n_max]) the counts of the tokens
that followed it — but on disk: it survives restarts and kill -9, stays within
a configured size, forgets stale n-grams, and serves lookups from many threads
while one thread writes.

The file's layout (keys, values, the format version and its migrations) is specified in
``drafter_service.table_format``; ``drafter_service.table_check`` walks a table against it.

De-duplication window
---------------------
An observe id is remembered for ``dedup_window_hours`` (24) to that plus an
hour, by the clock, whatever the traffic: a client's retries, however late
its back-off brings them, are skipped within it. (Version 1 kept ids for 4
decay epochs, which on a 1 MiB table is ~30 observations: 188 of 200 late
retries were applied twice.) Expired ids are deleted at the start of each
apply; ids count towards the size bound and are evicted last.

Epochs and decay
----------------
The epoch advances by one per ``epoch_observations`` tokens applied (items
skipped as already applied do not count), checked at the end of each apply:
counting tokens, not calls, keeps decay independent of how clients batch.
A stored count c that is ``a`` epochs old is worth ``max(1, c >> (a *
decay_shift_per_epoch))`` (halved per epoch by default, never below 1):
decay ranks continuations by recent frequency, and never forgets one.
Forgetting is eviction's job (oldest epoch first), so every record the table
holds can draft: with decay to 0, n-grams seen once became unreadable one
epoch later while still taking their room (~3/4 of a 4-epoch table). Reads
apply the decay on the fly; writes store it (lazy decay).

Merging an apply (one write transaction; E is the epoch it started in)
----------------------------------------------------------------------
1. Ids applied before the window (hour < now - ``dedup_window_hours``)
   are deleted. Each item with an observe id still remembered (or earlier in
   the same batch) is skipped and reported False; the others are recorded
   under the current hour.
2. The epoch advances by the new items' tokens, to E'. First, so that a
   batch crossing a boundary is merged fresh at E', not aged as it lands.
3. The new items' n-grams are counted together (per key: next-token counts
   in first-seen order), each (n-gram, next token) pair at most once per
   call (see *One vote per call*).
4. Per key: decay the stored pairs to E', add the new counts (tokens not yet
   stored go after the stored ones), sort by count descending (stable) and
   keep the first ``max_continuations``; last-touched becomes E'.
5. Eviction (below), in the same transaction.
An empty batch does nothing.

One vote per call
-----------------
A call adds at most 1 to any (n-gram, next token) count, however often the
pair occurs in it: 50 copies of [1, 2, 3, 4, 9] in one call count
(1, 2, 3, 4) -> 9 once, as one copy does. Counts are votes of calls, so one
call's repetitions cannot outvote what other calls observed (an Observe
holding 50 copies of another caller's 4-gram followed by junk used to turn
that caller's 8-token draft into the junk). An apply item is one call by
itself; an item that is one part of a call (one of its sequences, or one
chunk of a long one) carries ``counted``: per n in [n_min, n_max], a mask
over its tokens marking the positions whose pair occurs there first in the
whole call (``first_occurrences``), and only those count. So a call counts
each pair once whether its parts land in one transaction or several, and a
retry counts only the pairs first seen in the parts not yet applied.
(``InMemoryNGramTable``, the in-process table of benchmarks and of a drafter
without a store, counts every occurrence.)

Size and eviction
-----------------
``tracked_bytes`` = sum over the ``ngrams``, ``coldness`` and ``applied``
records of len(key) + len(value) + ``RECORD_OVERHEAD_BYTES``: what the B-tree
leaves must hold, maintained in each write transaction, so it is exact and
deterministic (a page count would depend on LMDB's page splits). Records are
evicted in ``coldness`` order — oldest last-touched epoch first, then lowest
total, then key bytes; only when no n-gram is left, the oldest applied ids.
Each apply, after merging, evicts while tracked_bytes > low-water
(``low_water_fraction * max_bytes``), at most ``eviction_chunk_records``
records, and beyond that limit only while tracked_bytes > high-water
(``high_water_fraction * max_bytes``). So after every apply tracked_bytes <=
high-water; under steady load it drains towards low-water at a bounded cost
per apply instead of in one long stall. Because this happens in the apply's
own transaction, no crash leaves the table above the high-water mark. (A
store reopened with a smaller max_bytes evicts in chunked transactions.)

The file (``data.mdb``) is larger than ``tracked_bytes``: B-tree pages are
partly full (live pages measured ~1.3-1.6x tracked_bytes), and copy-on-write
keeps the pages the last two transactions replaced out of reuse. LMDB reuses
freed pages, so the file stops growing at about the live pages plus two
transactions' copies, and never shrinks (``backup`` writes a compact copy).
Measured with random tokens: ~2.4x max_bytes for a 4 MiB table fed
100-token applies; ~4.7x for a 256 KiB table that every transaction rewrites
whole; 5.8x when each apply adds 60% of max_bytes. ``FILE_BYTES_PER_MAX_BYTE``
(6) is the documented bound for applies up to a quarter of max_bytes. The map is reserved
once, sparse, and never resized; if a transaction still hits
``MapFullError`` (a long-lived reader, another process's read transaction or
a dead reader's slot, keeps freed pages from reuse, so the file grows), apply
aborts it, frees dead readers' slots, retries once, then applies the items one
transaction each. An item that still finds no room is not stored and
``StoreFull`` says which: the caller retries it under the same id. Nothing is
evicted below the low-water mark because of it: readers, not data, take the room.

The successor table's bound
---------------------------
Successor keys are made up by callers as easily as real ones, so the table is
never left to fill and freeze: it keeps the ``max_successor_entries`` keys
written most recently. A clock stamps them: ``successor_tick`` advances by one
per ``successor_writes_per_tick`` keys written (``max_successor_entries //
SUCCESSOR_TICKS_PER_BOUND``, at least 1), checked at the end of each call,
and saturates at 2**32-1. Each ``record_successors`` call, in one transaction:
1. Keeps the newest predictions per key of the call and, if it holds more keys
   than the bound, only its last ``max_successor_entries`` of them.
2. Evicts, while the table's records plus the call's new keys exceed the bound,
   the first ``successor_recency`` entry and its record, passing over the keys
   the call writes: the keys least recently written go first.
3. Writes each key's value stamped with the current tick; a key already stamped
   with it keeps its ``successor_recency`` entry (rewriting a key within a tick
   touches no index entry), any other moves to the current tick.
So after every call the table holds at most ``max_successor_entries`` records,
and a call costs at most one eviction and one skipped entry per key it writes
(an eviction per new key, a skipped entry per held one).
A table reopened under a smaller bound is trimmed to it when it opens, in
transactions of ``eviction_chunk_records``.

Damage
------
LMDB keeps no checksums and trusts its pages (``drafter_service.table_check`` says what
damage looks like, and walks a table for it). A store given ``on_corruption`` reports a
damaged page or record met by any call to it (``is_corruption``); its owner may ``retire``
it (new calls raise ``StoreClosed``, the environment closes when the last call in flight
ends), and the call then raises ``StoreCorrupted``.

Durability and concurrency
--------------------------
Commits use LMDB's default durability (fsync on commit), so whatever
``apply`` acknowledged survives kill -9 without a repair step. Each
``continuations`` call reads in its own read transaction (MVCC: it never waits
for the writer) and copies the value out before it ends. Writes are serialised
by a lock, so any thread may call ``apply``.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import islice
from typing import Any, NamedTuple

import lmdb

from drafter_service.counting import (  # noqa: F401 (first_occurrences: re-exported for the writer)
    _ranked,
    count_ngrams,
    decayed,
    first_occurrences,
    merge_continuations,
)
from drafter_service.ngram import Continuation, best_of
from drafter_service.table_format import (
    FIRST_PAIR,
    FORMAT_VERSION,
    MAX_CONTINUATIONS,
    MAX_N,
    MAX_OBSERVE_ID_BYTES,
    MAX_SUCCESSORS,
    META_EPOCH,
    META_EPOCH_TOKENS,
    META_EVICTIONS,
    META_LOG_SEQUENCE,
    META_SUCCESSOR_EVICTIONS,
    META_SUCCESSOR_TICK,
    META_SUCCESSOR_TICK_WRITES,
    META_TRACKED,
    META_VERSION,
    MIGRATED_FORMAT_VERSION,
    MIGRATIONS,
    NAMESPACE_BYTES,
    OUR_DATABASES,
    PAIR_BYTES,
    SUB_DATABASES,
    SUCCESSOR_HEADER,
    SUCCESSOR_KEYS,
    SUCCESSOR_TOKENS,
    SUCCESSOR_VERSION,
    UINT32,
    UINT32_MAX,
    UINT64,
    UNSTAMPED_FORMAT_VERSION,
    UNSTAMPED_SUCCESSOR_VERSION,
    VALUE_HEADER,
    VALUE_VERSION,
    StoreFormatError,
    applied_key,
    coldness_key,
    decode_value,
    encode_value,
    file_problem,
    total_count,
)

# Successor-clock ticks per max_successor_entries keys written: eviction takes the oldest
# 1/256th of a table's worth of writes first, and a key rewritten within its tick (a
# common token, rewritten every step) costs no index update for that many writes.
SUCCESSOR_TICKS_PER_BOUND = 256
# Charged per record on top of key and value: LMDB's 8-byte leaf-node header
# plus the record's 2-byte slot in its page's offset array.
RECORD_OVERHEAD_BYTES = 10
# Documented bound on data.mdb per byte of max_bytes: live pages (<= ~1.6x
# tracked) plus two transactions' copy-on-write copies of them, when a
# transaction rewrites the whole tree (small tables); measured <= 4.7x.
FILE_BYTES_PER_MAX_BYTE = 6
# Default map per byte of max_bytes: above the file bound, with room for one
# oversized batch; a sparse map costs address space only.
MAP_BYTES_PER_MAX_BYTE = 8
# Smallest default map: small tables with big batches need room for a whole
# batch's dirty pages, and 64 MiB of address space is free.
MIN_MAP_BYTES = 64 << 20
# Map bytes reserved per successor record: key 17 + value <= 69 and its recency
# entry's key 21, with LMDB's headers (~130 bytes), in pages about half full, with
# copy-on-write copies.
SUCCESSOR_MAP_BYTES = 640

log = logging.getLogger(__name__)


class StoreFull(RuntimeError):
    """Observations found no room in the map; nothing of them was written.

    ``results[i]``: item i's outcome, True applied, False a duplicate, None not
    stored (the caller retries it under the same id)."""

    def __init__(self, message: str, results: list[bool | None]) -> None:
        super().__init__(message)
        self.results = results


class StoreClosed(RuntimeError):
    """The store no longer serves: closed, or set aside (``retire``). Nothing of the call
    was read or written; a retry finds another table (a registry opens a fresh one)."""


class StoreCorrupted(StoreClosed):
    """A read or write found the table's pages or records damaged, and the store's owner
    (``on_corruption``) set it aside; nothing of the call was read or written."""


# What LMDB raises on damaged pages (lmdb.h): MDB_CORRUPTED (a page of the wrong type),
# MDB_PAGE_NOTFOUND (a page number past the end), MDB_PROBLEM (an inconsistency found
# inside a transaction), MDB_BAD_CHECKSUM (LMDB 1.0), and MDB_BAD_TXN: this code never
# goes on in a transaction after an error, so a transaction blocked under it was blocked
# by LMDB itself on a damaged page (LMDB 0.9's mdb_cursor_init drops the MDB_CORRUPTED of
# a named database's first lookup, and the call reports MDB_BAD_TXN instead). Not
# MDB_PANIC (a failed meta write: the environment is unusable until reopened, the file
# is not known to be damaged), nor MDB_BAD_VALSIZE (an oversized key from the caller:
# this code bounds every key).
_LMDB_CORRUPTION = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.ProblemError, lmdb.BadChecksumError, lmdb.BadTxnError)


def is_corruption(error: BaseException) -> bool:
    """Whether ``error`` says the table's file is damaged (not the caller's fault, not the disk's
    being full): LMDB's corruption errors, and a stored record that does not decode."""
    return isinstance(error, (*_LMDB_CORRUPTION, StoreFormatError))


# Upper bounds on LMDB's lock file layout (lmdb.h: MDB_txninfo's header is two
# cache lines, each MDB_reader slot one).
_LOCK_HEADER_BYTES = 4096
_LOCK_READER_BYTES = 64


def reserve_lock_file(path: str | os.PathLike[str], max_readers: int) -> None:
    """Give ``path/lock.mdb`` real disk blocks before LMDB maps it.

    LMDB sizes the lock file with ftruncate, a sparse file, and writes it through
    the map: on a full disk the first store to a page with no block behind it is
    a SIGBUS, which kills the process (and every restart after, while the disk
    stays full). posix_fallocate raises OSError(ENOSPC) instead. A larger file
    only gives LMDB more reader slots.
    """
    descriptor = os.open(os.path.join(path, "lock.mdb"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        wanted = _LOCK_HEADER_BYTES + max_readers * _LOCK_READER_BYTES
        os.posix_fallocate(descriptor, 0, max(wanted, os.fstat(descriptor).st_size))
    finally:
        os.close(descriptor)


@dataclass(frozen=True)
class StoreConfig:
    # Directory of the LMDB environment (data.mdb, lock.mdb); created if missing.
    path: str
    # vocabulary_fingerprint() of the tokenizer. No default: a shared default
    # would silently mix token ids of different vocabularies.
    namespace: bytes
    # Same suffix range as NGramConfig's: keys outside it are never looked up.
    n_min: int = 2
    n_max: int = 4
    # Bound on tracked_bytes (see module docstring). 1 GiB holds roughly ten
    # million n-grams with a few continuations each: days of a busy service.
    max_bytes: int = 1 << 30
    # The drafter uses the most frequent continuation; keeping 8 lets
    # runners-up overtake it, and bounds a value to 9 + 64 bytes.
    max_continuations: int = 8
    # Ceiling on tracked_bytes after every apply, as a fraction of max_bytes:
    # 1.0 makes max_bytes itself the bound an operator sets.
    high_water_fraction: float = 1.0
    # Soft target each apply evicts towards (eviction_chunk_records at a time):
    # a 10% margin means most applies stay under the ceiling without evicting
    # past their chunk, so eviction cost is spread out instead of bursting.
    low_water_fraction: float = 0.9
    # Tokens per epoch: ~minutes of a busy service's output, so an n-gram
    # unseen for an hour or so counts next to nothing against fresh ones.
    epoch_observations: int = 1_000_000
    # Counts shift right this many bits per epoch of age: 1 halves them; 0
    # disables decay. An integer shift keeps decay exact and reproducible.
    decay_shift_per_epoch: int = 1
    # Hours an observe id is remembered (see *De-duplication window*): longer
    # than any client's retries, and expiry keeps the applied-id table bounded.
    dedup_window_hours: int = 24
    # Seconds since the Unix epoch (tests move it).
    clock: Callable[[], float] = time.time
    # LMDB map in bytes, reserved once and never resized; None means
    # max(MAP_BYTES_PER_MAX_BYTE * max_bytes, MIN_MAP_BYTES).
    map_size: int | None = None
    # Records one apply evicts beyond what the high-water mark demands (~100
    # KB): drains towards low-water within a few applies at a bounded cost each.
    eviction_chunk_records: int = 1024
    # Reader slots: each concurrent continuations() call holds one briefly,
    # so this must cover the serving thread pool.
    max_readers: int = 512
    # Successor-table keys: one per token (49K for the default model) plus one
    # per (previous, current) pair seen; 1 Mi pairs is ~130 MB of pages. Beyond,
    # the keys least recently written are evicted.
    max_successor_entries: int = 1 << 20

    def __post_init__(self) -> None:
        if len(self.namespace) != NAMESPACE_BYTES:
            raise ValueError(f"namespace must be {NAMESPACE_BYTES} bytes (vocabulary_fingerprint), got {len(self.namespace)}")
        if not 1 <= self.n_min <= self.n_max <= MAX_N:
            raise ValueError(f"need 1 <= n_min <= n_max <= {MAX_N}, got n_min={self.n_min}, n_max={self.n_max}")
        if self.max_continuations > MAX_CONTINUATIONS:
            raise ValueError(f"max_continuations must be <= {MAX_CONTINUATIONS}, got {self.max_continuations}")
        positive = ("max_continuations", "epoch_observations", "max_bytes", "eviction_chunk_records", "max_successor_entries")
        if any(getattr(self, name) < 1 for name in positive):
            raise ValueError(f"{', '.join(positive)} must be >= 1")
        if self.decay_shift_per_epoch < 0 or self.dedup_window_hours < 0:
            raise ValueError("decay_shift_per_epoch and dedup_window_hours must be >= 0")
        if not 0.0 < self.low_water_fraction <= self.high_water_fraction <= 1.0:
            raise ValueError(
                f"need 0 < low_water_fraction <= high_water_fraction <= 1, " f"got {self.low_water_fraction}, {self.high_water_fraction}"
            )
        if self.map_size is not None and self.map_size < self.max_bytes:
            raise ValueError(f"map_size {self.map_size} is below max_bytes {self.max_bytes}")

    @property
    def map_size_bytes(self) -> int:
        if self.map_size is not None:
            return self.map_size
        return max(MAP_BYTES_PER_MAX_BYTE * self.max_bytes, MIN_MAP_BYTES) + SUCCESSOR_MAP_BYTES * self.max_successor_entries

    @property
    def successor_writes_per_tick(self) -> int:
        """Successor keys written per tick of the successor clock (see the module docstring)."""
        return max(1, self.max_successor_entries // SUCCESSOR_TICKS_PER_BOUND)

    @property
    def high_water_bytes(self) -> int:
        return int(self.max_bytes * self.high_water_fraction)

    @property
    def low_water_bytes(self) -> int:
        return int(self.max_bytes * self.low_water_fraction)


def record_bytes(key: bytes, value: bytes) -> int:
    return len(key) + len(value) + RECORD_OVERHEAD_BYTES


# --- the store --------------------------------------------------------------


class ApplyItem(NamedTuple):
    """One item of ``apply``: an observation, or one chunk or sequence of a larger call."""

    observe_id: str | None
    tokens: Sequence[int]
    start: int = 0  # tokens before it are a chunk's context (see count_ngrams)
    counted: Sequence[bytes] | None = None  # per n, the positions that count (first_occurrences); None: the item is a call


class LogEntry(NamedTuple):
    """One log message for this table (``apply_log``): an Observe call's sequences, or successor-table predictions."""

    sequence: int  # the log's sequence number: entries come in increasing order
    hour: int  # hours since the Unix epoch when the log stored it: the de-duplication window's clock
    observations: Sequence[ApplyItem] = ()
    successors: Sequence[tuple[tuple[int, ...], Sequence[int]]] = ()


@dataclass
class _Meta:
    epoch: int
    epoch_tokens: int
    tracked_bytes: int
    evictions: int


@dataclass
class _SuccessorMeta:
    tick: int
    tick_writes: int
    evictions: int


class _Observation(NamedTuple):
    observe_id: bytes | None  # UTF-8
    tokens: list[int]
    packed: bytes  # tokens as big-endian uint32
    start: int  # the first index whose n-grams count (see count_ngrams)
    counted: tuple[bytes, ...] | None  # per n, the positions that count (see first_occurrences); None: all


class StoreSnapshot:
    """An ``NGramSource`` view of the store inside one read transaction."""

    def __init__(self, store: LMDBNGramStore, txn: lmdb.Transaction, epoch: int) -> None:
        self._config, self._db, self._txn, self._epoch = store.config, store._ngrams, txn, epoch
        self._packers = store._key_packers
        self._successors, self._namespace = store._successors, store.config.namespace

    def continuations(self, key: tuple[int, ...]) -> dict[int, int] | None:
        value = self._value(key)
        if value is None:
            return None
        last_touched, _total, pairs = decode_value(value)
        if last_touched == self._epoch:  # nothing to decay: the usual case
            return dict(pairs)
        return dict(decayed(pairs, self._epoch - last_touched, self._config.decay_shift_per_epoch))

    def best(self, key: tuple[int, ...]) -> Continuation | None:
        value = self._value(key)
        if value is None:
            return None
        if len(value) < VALUE_HEADER.size + PAIR_BYTES:
            return best_of(self.continuations(key))  # damaged: decode_value says how
        version, last_touched, total = VALUE_HEADER.unpack_from(value)
        if version == VALUE_VERSION and last_touched == self._epoch:
            # Pairs are stored most frequent first: the head is the answer.
            # (A plain tuple: this runs per draft token, and unpacks like a Continuation.)
            return (*FIRST_PAIR.unpack_from(value, VALUE_HEADER.size), total)  # type: ignore[return-value]
        return best_of(self.continuations(key))  # decay, or a bad version (raises)

    def _value(self, key: tuple[int, ...]) -> bytes | None:
        packer = self._packers.get(len(key))
        if packer is None:
            return None  # outside [n_min, n_max]: never stored
        prefix, tokens = packer
        try:
            ngram_key = prefix + tokens.pack(*key)
        except struct.error:
            return None  # a token id outside uint32 was never stored
        return self._txn.get(ngram_key, db=self._db)

    def successors(self, key: tuple[int, ...]) -> tuple[int, ...] | None:
        """The target's latest top predictions after ``key`` ((current,) or (previous, current)),
        best first, or None. A value this code cannot read is None too: drafts are hints, and
        ``table_check.walk_table`` reports it."""
        packer = SUCCESSOR_KEYS.get(len(key))
        if packer is None:
            return None
        try:
            value = self._txn.get(self._namespace + packer.pack(len(key), *key), db=self._successors)
        except struct.error:
            return None
        if value is None:
            return None
        count, odd = divmod(len(value) - SUCCESSOR_HEADER.size, 4)
        if odd or not 0 < count <= MAX_SUCCESSORS or value[0] != SUCCESSOR_VERSION:
            return None
        return SUCCESSOR_TOKENS[count].unpack_from(value, SUCCESSOR_HEADER.size)

    def observe(self, tokens: Sequence[int]) -> None:
        raise TypeError("a snapshot is read-only; observe through the store")


class LMDBNGramStore:
    """The global n-gram table on disk; an ``NGramSource`` (see module docstring)."""

    def __init__(self, config: StoreConfig, on_corruption: Callable[[LMDBNGramStore, BaseException], None] | None = None) -> None:
        """``on_corruption(store, error)``: called when a read or write finds the table damaged
        (``is_corruption``), before the error reaches the caller; a registry sets the table
        aside there (``retire``), and the caller then gets ``StoreCorrupted``."""
        self.config = config
        self.on_corruption = on_corruption
        self._write_lock = threading.Lock()
        # Guards _users and _closed: calls in flight, and why no new one may start (None: serving).
        self._state = threading.Lock()
        self._users = 0
        self._closed: str | None = None
        # n -> (key prefix, packer for n tokens): built once, used by every lookup.
        self._key_packers = {n: (config.namespace + bytes((n,)), struct.Struct(f">{n}I")) for n in range(config.n_min, config.n_max + 1)}
        os.makedirs(config.path, exist_ok=True)
        problem = file_problem(config.path)
        if problem is not None:
            raise StoreFormatError(f"{config.path}: {problem}")
        reserve_lock_file(config.path, config.max_readers)
        self._env = lmdb.open(
            config.path,
            map_size=config.map_size_bytes,
            max_dbs=SUB_DATABASES,
            max_readers=config.max_readers,
            readahead=False,  # random point reads: readahead would only evict useful pages
            lock=True,
        )
        try:
            self._env.reader_check()  # free slots left by killed readers
            self._check_ours()
            with self._env.begin(write=True) as txn:
                self._ngrams = self._env.open_db(b"ngrams", txn=txn)
                self._coldness = self._env.open_db(b"coldness", txn=txn)
                self._applied = self._env.open_db(b"applied", txn=txn)
                self._meta = self._env.open_db(b"meta", txn=txn)
                self._successors = self._env.open_db(b"successors", txn=txn)
                self._recency = self._env.open_db(b"successor_recency", txn=txn)
                self._initialise_meta(txn)
        except BaseException:  # not ours, another version, damaged: leave nothing open
            self._env.close()
            raise
        self._evict_if_needed()  # a file last written under a larger max_bytes

    # -- NGramSource

    def continuations(self, key: tuple[int, ...]) -> dict[int, int] | None:
        """Decayed next-token counts after ``key``, most frequent first, or None."""
        with self.snapshot() as snapshot:
            return snapshot.continuations(key)

    def best(self, key: tuple[int, ...]) -> Continuation | None:
        with self.snapshot() as snapshot:
            return snapshot.best(key)

    @contextmanager
    def snapshot(self) -> Iterator[StoreSnapshot]:
        """One read transaction for many lookups (a whole Propose batch): a
        consistent view, and no per-lookup transaction cost. Never blocks the writer."""
        with self._use() as env, env.begin() as txn:
            epoch = UINT32.unpack(txn.get(META_EPOCH, db=self._meta))[0]  # type: ignore[arg-type]  # written at creation
            yield StoreSnapshot(self, txn, epoch)

    def observe(self, tokens: Sequence[int]) -> None:
        self.apply([(None, tokens)])

    # -- writing

    def apply(self, batch: Sequence[ApplyItem | tuple[str | None, Sequence[int]] | tuple[str | None, Sequence[int], int]]) -> list[bool]:
        """Count a batch of (observe id or None, tokens[, start[, counted]]) in one transaction.

        With ``start``, the tokens before index ``start`` are context only: a long
        observation is applied in chunks (each under its own id), a chunk carrying
        the n_max tokens before it so that no n-gram is lost or counted twice. Each
        item is one call (each pair counts once in it) unless it carries ``counted``,
        its positions that count as part of a larger call (``first_occurrences``).

        Returns per item True if counted now, False if its id was already
        applied (a retry). Raises StoreFull when items found no room in the map
        (it says which; the others are stored), and ValueError, writing nothing,
        for a token id outside uint32 or an id longer than MAX_OBSERVE_ID_BYTES.
        """
        observations = [self._validate(*item) for item in batch]
        if not observations:
            return []
        with self._use(), self._write_lock:
            return self._commit_with_recovery(observations)

    def apply_log(self, entries: Sequence[LogEntry]) -> list[bool | None]:
        """Apply log messages in order, in one transaction that also records the last one's
        sequence (``log_sequence``): an entry at or below the sequence held is skipped, so
        no replay applies a message twice. Each entry is merged as its own call, at the hour
        the log stored it (not this machine's clock), so every replica applying the same log
        holds the same records however its transactions group the entries.

        Per entry: True applied, False skipped (applied before), None not stored: refused alone
        (a token id outside uint32, predictions it cannot hold), or without room in the map
        even alone; logged, and the sequence moves past it.
        """
        prepared, refused = [], set()
        for index, entry in enumerate(entries):
            try:
                prepared.append((entry, [self._validate(*item) for item in entry.observations], self._successor_records(entry.successors)))
            except ValueError as error:
                log.error("log message %d skipped: %s", entry.sequence, error)
                prepared.append((entry, [], {}))  # its sequence only
                refused.add(index)
        with self._use(), self._write_lock:
            try:
                results = self._commit_log(prepared)
            except lmdb.MapFullError:
                self.check_readers()
                results = [self._commit_alone(one) for one in prepared]  # those that fit are stored
        return [None if index in refused and result else result for index, result in enumerate(results)]

    def _commit_alone(self, one: tuple[LogEntry, list[_Observation], dict[bytes, bytes]]) -> bool | None:
        try:
            return self._commit_log([one])[0]
        except lmdb.MapFullError:
            log.error("log message %d does not fit in the %d-byte map now; skipped", one[0].sequence, self.config.map_size_bytes)
            self._commit_log([(one[0], [], {})])  # its sequence only: the log moves on
            return None

    def log_sequence(self) -> int:
        """The sequence of the last log message applied to this table (0: none)."""
        with self._use() as env, env.begin() as txn:
            return self._log_sequence(txn)

    def reset_log_sequence(self) -> None:
        """Forget which log messages this table holds (its data stays): another log follows."""
        with self._use() as env, self._write_lock, env.begin(write=True) as txn:
            txn.delete(META_LOG_SEQUENCE, db=self._meta)

    def _log_sequence(self, txn: lmdb.Transaction) -> int:
        held = txn.get(META_LOG_SEQUENCE, db=self._meta)
        return 0 if held is None else UINT64.unpack(held)[0]

    def _commit_log(self, prepared: list[tuple[LogEntry, list[_Observation], dict[bytes, bytes]]]) -> list[bool | None]:
        results: list[bool | None] = []
        with self._env.begin(write=True) as txn:
            held = self._log_sequence(txn)
            for entry, observations, successors in prepared:
                if entry.sequence <= held:
                    results.append(False)
                    continue
                if observations:
                    self._merge_call(txn, observations, entry.hour)
                if successors:
                    self._store_successor_records(txn, successors)
                held = entry.sequence
                results.append(True)
            txn.put(META_LOG_SEQUENCE, UINT64.pack(held), db=self._meta)
        return results

    def successors(self, key: tuple[int, ...]) -> tuple[int, ...] | None:
        with self.snapshot() as snapshot:
            return snapshot.successors(key)

    def record_successors(self, updates: Iterable[tuple[tuple[int, ...], Sequence[int]]]) -> int:
        """Store the target's top predictions after each key ((current,) or (previous,
        current)), best first, in one transaction: the newest replace what was held, and
        beyond ``max_successor_entries`` the keys least recently written are evicted (see
        *The successor table's bound*). Returns how many keys were stored: all distinct keys
        but, of a call holding more than the bound, its oldest. Raises ValueError, writing
        nothing, for a key or prediction list it cannot hold.
        """
        records = self._successor_records(updates)
        if not records:
            return 0
        with self._use() as env, self._write_lock, env.begin(write=True) as txn:
            self._store_successor_records(txn, records)
        return len(records)

    def _successor_records(self, updates: Iterable[tuple[tuple[int, ...], Sequence[int]]]) -> dict[bytes, bytes]:
        """Packed key -> packed tokens, the newest per key, at most the bound (the last); ValueError for what the table cannot hold."""
        records: dict[bytes, bytes] = {}
        for key, tokens in updates:
            packer = SUCCESSOR_KEYS.get(len(key))
            if packer is None or not 0 < len(tokens) <= MAX_SUCCESSORS:
                raise ValueError(f"a successor key has 1 or 2 tokens and 1..{MAX_SUCCESSORS} predictions, got {key} -> {len(tokens)}")
            try:
                packed = self.config.namespace + packer.pack(len(key), *key)
                records.pop(packed, None)
                records[packed] = SUCCESSOR_TOKENS[len(tokens)].pack(*tokens)
            except struct.error:
                raise ValueError(f"successor key {key} or its predictions hold a token id outside uint32") from None
        bound = self.config.max_successor_entries
        if len(records) > bound:
            records = dict(islice(records.items(), len(records) - bound, None))
        return records

    def _store_successor_records(self, txn: lmdb.Transaction, records: dict[bytes, bytes]) -> None:
        """Write ``records`` (``_successor_records``) in ``txn``, evicting beyond the bound (see the module docstring)."""
        bound = self.config.max_successor_entries
        meta = self._read_successor_meta(txn)
        stamps = {packed: self._successor_stamp(txn, packed) for packed in sorted(records)}  # key order: neighbours share pages
        excess = txn.stat(self._successors)["entries"] + sum(stamp is None for stamp in stamps.values()) - bound
        if excess > 0:
            self._evict_successors(txn, meta, excess, records)
        stamp = UINT32.pack(meta.tick)
        for packed, held in stamps.items():
            if held != meta.tick:  # within its tick, a key keeps its recency entry
                if held is not None:
                    txn.delete(UINT32.pack(held) + packed, db=self._recency)
                txn.put(stamp + packed, b"", db=self._recency)
            txn.put(packed, bytes((SUCCESSOR_VERSION,)) + stamp + records[packed], db=self._successors)
        ticks, meta.tick_writes = divmod(meta.tick_writes + len(records), self.config.successor_writes_per_tick)
        meta.tick = min(UINT32_MAX, meta.tick + ticks)
        self._write_successor_meta(txn, meta)

    def _successor_stamp(self, txn: lmdb.Transaction, key: bytes) -> int | None:
        """The stamp of the successor record ``key``, or None when none is held."""
        value = txn.get(key, db=self._successors)
        if value is None:
            return None
        if len(value) < SUCCESSOR_HEADER.size or value[0] != SUCCESSOR_VERSION:
            raise StoreFormatError(f"successor value of {key.hex()} is not version {SUCCESSOR_VERSION} with a stamp")
        return int(SUCCESSOR_HEADER.unpack_from(value)[1])

    def _evict_successors(self, txn: lmdb.Transaction, meta: _SuccessorMeta, count: int, keep: Mapping[bytes, bytes]) -> int:
        """Evict up to ``count`` successor records, least recently written first, none of ``keep``."""
        removed = 0
        recency = txn.cursor(db=self._recency)
        found = recency.first()
        while found and removed < count:
            index_key = recency.key()
            key = index_key[UINT32.size :]
            if key in keep:
                found = recency.next()
                continue
            txn.delete(key, db=self._successors)
            recency.delete()
            removed += 1
            found = recency.set_range(index_key)  # the entry after the one deleted
        meta.evictions += removed
        return removed

    def advance_epoch(self, epochs: int = 1) -> None:
        """Age every count by ``epochs`` epochs now (tests; a time-based policy)."""
        if epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {epochs}")
        with self._use() as env, self._write_lock, env.begin(write=True) as txn:
            meta = self._read_meta(txn)
            self._advance_epoch(txn, meta, epochs)
            self._write_meta(txn, meta)

    # -- inspection and lifecycle

    def stats(self) -> dict[str, int]:
        with self._use() as env, env.begin() as txn:
            meta = self._read_meta(txn)
            entries = txn.stat(self._ngrams)["entries"]
            applied_ids = txn.stat(self._applied)["entries"]
            successor_entries = txn.stat(self._successors)["entries"]
            successor = self._read_successor_meta(txn)
            dbs = (None, self._ngrams, self._coldness, self._applied, self._meta, self._successors, self._recency)
            pages = sum(_tree_pages(txn.stat(db) if db is not None else txn.stat()) for db in dbs)
        return {
            "entries": entries,  # n-gram keys, all namespaces
            "bytes": meta.tracked_bytes,  # what max_bytes bounds
            "page_bytes": pages * env.stat()["psize"],  # live B-tree pages
            "file_bytes": os.path.getsize(os.path.join(self.config.path, "data.mdb")),
            "epoch": meta.epoch,
            "epoch_tokens": meta.epoch_tokens,
            "evictions": meta.evictions,
            "applied_ids": applied_ids,
            "successor_entries": successor_entries,  # keys, all namespaces: at most max_successor_entries
            "successor_evictions": successor.evictions,
        }

    def backup(self, destination_path: str | os.PathLike[str]) -> None:
        """A consistent, compacted copy in ``destination_path`` (created; must be empty), while serving."""
        os.makedirs(destination_path, exist_ok=True)
        with self._use() as env:
            env.copy(os.fspath(destination_path), compact=True)

    def close(self) -> None:
        """Refuse new calls (``StoreClosed``) and close the environment once those in flight end."""
        self.retire("is closed")

    def retire(self, reason: str) -> None:
        """Refuse new calls with ``StoreClosed`` naming ``reason`` ("was set aside: ...") and close
        the environment when the last call in flight ends (now, if none is). Safe from any thread,
        idempotent: closing an LMDB environment under a thread still in one of its transactions
        would unmap pages that thread is reading."""
        with self._state:
            if self._closed is None:
                self._closed = reason
            last = self._users == 0
        if last:
            self._close_environment()

    @property
    def closed(self) -> bool:
        return self._closed is not None

    @contextmanager
    def _use(self) -> Iterator[lmdb.Environment]:
        """The environment for one call: counted, so that ``retire`` never closes it under the call;
        a damaged page or record met on the way is reported to ``on_corruption``."""
        with self._state:
            if self._closed is not None:
                raise StoreClosed(f"table {self.config.path} {self._closed}")
            self._users += 1
        try:
            yield self._env
        except Exception as error:
            if self.on_corruption is None or not is_corruption(error):
                raise
            self.on_corruption(self, error)  # the owner sets it aside (retire), or lets it serve on
            if self._closed is None:
                raise
            raise StoreCorrupted(
                f"table {self.config.path} is damaged ({type(error).__name__}: {error}) and was set aside; "
                "nothing of this call was read or written"
            ) from error
        finally:
            with self._state:
                self._users -= 1
                last = self._users == 0 and self._closed is not None
            if last:
                self._close_environment()

    def _close_environment(self) -> None:
        with self._state:
            env, self._env = self._env, None  # type: ignore[assignment]  # closed: _use refuses every later call
        if env is not None:
            try:
                env.sync(True)  # commits are already durable (fsync per commit): belt and braces
            finally:
                env.close()

    def __enter__(self) -> LMDBNGramStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals: meta

    def _check_ours(self) -> None:
        """An environment that holds data but not our format record is someone else's: never take it over."""
        with self._env.begin() as txn:
            names = set(txn.cursor().iternext(keys=True, values=False))
            version = None
            if b"meta" in names:
                version = txn.get(META_VERSION, db=self._env.open_db(b"meta", txn=txn, create=False))
        if names and (not names <= OUR_DATABASES or version is None):
            raise StoreFormatError(f"{self.config.path} is an LMDB environment without this store's format record: not ours")

    def _initialise_meta(self, txn: lmdb.Transaction) -> None:
        version = txn.get(META_VERSION, db=self._meta)
        if version is None:
            txn.put(META_VERSION, bytes((FORMAT_VERSION,)), db=self._meta)
            self._write_meta(txn, _Meta(epoch=0, epoch_tokens=0, tracked_bytes=0, evictions=0))
            self._write_successor_meta(txn, _SuccessorMeta(tick=0, tick_writes=0, evictions=0))
        elif version[0] in MIGRATIONS and len(version) == 1:
            self._migrate(txn, version[0])
        elif version != bytes((FORMAT_VERSION,)):
            raise StoreFormatError(f"{self.config.path} has store format version {version[0]}; this code reads version {FORMAT_VERSION}")

    def _migrate(self, txn: lmdb.Transaction, version: int) -> None:
        """Bring a file of an older ``version`` to this format, in the opening transaction (see ``table_format``)."""
        dropped = 0
        if version == MIGRATED_FORMAT_VERSION:  # ids keyed by decay epoch: drop them
            meta = self._read_meta(txn)
            cursor = txn.cursor(db=self._applied)
            while cursor.first():
                meta.tracked_bytes -= record_bytes(cursor.key(), b"")
                cursor.delete()
                dropped += 1
            self._write_meta(txn, meta)
        stamped = 0
        if version == UNSTAMPED_FORMAT_VERSION:  # every record gets stamp 0: older than anything written from now on
            oldest = UINT32.pack(0)
            cursor = txn.cursor(db=self._successors)
            for key, value in cursor:
                if not value or value[0] != UNSTAMPED_SUCCESSOR_VERSION:
                    raise StoreFormatError(f"successor value of {key.hex()} is not version {UNSTAMPED_SUCCESSOR_VERSION}")
                cursor.put(key, bytes((SUCCESSOR_VERSION,)) + oldest + value[1:])
                txn.put(oldest + key, b"", db=self._recency)
                stamped += 1
        self._write_successor_meta(txn, _SuccessorMeta(tick=1, tick_writes=0, evictions=0))
        txn.put(META_VERSION, bytes((FORMAT_VERSION,)), db=self._meta)
        log.log(
            logging.WARNING if dropped else logging.INFO,
            "%s: migrated store format %d to %d (%s: dropped %d observe ids kept by epoch, stamped %d successor records)",
            self.config.path,
            version,
            FORMAT_VERSION,
            MIGRATIONS[version],
            dropped,
            stamped,
        )

    def _read_meta(self, txn: lmdb.Transaction) -> _Meta:
        def get(key: bytes, layout: struct.Struct) -> int:
            return layout.unpack(txn.get(key, db=self._meta))[0]  # type: ignore[arg-type]  # written at creation

        return _Meta(
            epoch=get(META_EPOCH, UINT32),
            epoch_tokens=get(META_EPOCH_TOKENS, UINT64),
            tracked_bytes=get(META_TRACKED, UINT64),
            evictions=get(META_EVICTIONS, UINT64),
        )

    def _read_successor_meta(self, txn: lmdb.Transaction) -> _SuccessorMeta:
        def get(key: bytes, layout: struct.Struct) -> int:
            return layout.unpack(txn.get(key, db=self._meta))[0]  # type: ignore[arg-type]  # written at creation or migration

        return _SuccessorMeta(
            tick=get(META_SUCCESSOR_TICK, UINT32),
            tick_writes=get(META_SUCCESSOR_TICK_WRITES, UINT64),
            evictions=get(META_SUCCESSOR_EVICTIONS, UINT64),
        )

    def _write_successor_meta(self, txn: lmdb.Transaction, meta: _SuccessorMeta) -> None:
        txn.put(META_SUCCESSOR_TICK, UINT32.pack(meta.tick), db=self._meta)
        txn.put(META_SUCCESSOR_TICK_WRITES, UINT64.pack(meta.tick_writes), db=self._meta)
        txn.put(META_SUCCESSOR_EVICTIONS, UINT64.pack(meta.evictions), db=self._meta)

    def _write_meta(self, txn: lmdb.Transaction, meta: _Meta) -> None:
        txn.put(META_EPOCH, UINT32.pack(meta.epoch), db=self._meta)
        txn.put(META_EPOCH_TOKENS, UINT64.pack(meta.epoch_tokens), db=self._meta)
        txn.put(META_TRACKED, UINT64.pack(meta.tracked_bytes), db=self._meta)
        txn.put(META_EVICTIONS, UINT64.pack(meta.evictions), db=self._meta)

    # -- internals: applying

    def _validate(
        self, observe_id: str | None, tokens: Sequence[int], start: int = 0, counted: Sequence[bytes] | None = None
    ) -> _Observation:
        id_bytes = None if observe_id is None else observe_id.encode("utf-8")
        if id_bytes is not None and not 0 < len(id_bytes) <= MAX_OBSERVE_ID_BYTES:
            raise ValueError(f"observe id must be 1..{MAX_OBSERVE_ID_BYTES} UTF-8 bytes, got {len(id_bytes)}")
        tokens = list(tokens)
        try:
            packed = struct.pack(f">{len(tokens)}I", *tokens)
        except struct.error:
            raise ValueError(f"token ids must be integers in [0, 2**32), got {tokens[:8]}...") from None
        if not 0 <= start <= len(tokens):
            raise ValueError(f"start {start} is outside the {len(tokens)} tokens")
        if counted is not None:
            counted = tuple(counted)
            masks = self.config.n_max - self.config.n_min + 1
            if len(counted) != masks or any(len(mask) != len(tokens) for mask in counted):
                raise ValueError(f"counted must hold {masks} masks (n {self.config.n_min}..{self.config.n_max}) of {len(tokens)} bytes")
        return _Observation(id_bytes, tokens, packed, start, counted)

    def _commit_with_recovery(self, observations: list[_Observation]) -> list[bool]:
        for attempt in range(2):
            try:
                return self._commit_batch(observations)
            except lmdb.MapFullError:
                log.warning("n-gram store map full applying %d items (attempt %d)", len(observations), attempt + 1)
                self.check_readers()  # a dead reader's slot pins old pages: free it, retry once
        if len(observations) == 1:
            log.error(
                "an observation of %d tokens does not fit in the %d-byte map now; refused (a long-lived reader keeps "
                "freed pages from reuse, or the observation is too large)",
                len(observations[0].tokens),
                self.config.map_size_bytes,
            )
            raise StoreFull("the table has no room for this observation now", [None])
        results: list[bool | None] = []
        for observation in observations:  # one transaction each: those that fit are stored
            try:
                results += self._commit_with_recovery([observation])
            except StoreFull:
                results.append(None)
        if None in results:
            raise StoreFull(f"{results.count(None)} of {len(results)} observations found no room in the table now", results)
        return [result is True for result in results]

    def check_readers(self) -> int:
        """Free the reader slots of dead processes (their snapshots pin pages the writer
        could reuse); returns how many. Cheap: the drafter calls it every few seconds."""
        with self._use() as env:
            return env.reader_check()

    def _commit_batch(self, observations: list[_Observation]) -> list[bool]:
        with self._env.begin(write=True) as txn:
            return self._merge_call(txn, observations, int(self.config.clock() // 3600))

    def _merge_call(self, txn: lmdb.Transaction, observations: list[_Observation], hour: int) -> list[bool]:
        """Steps 1-5 of *Merging an apply* in ``txn``, with ``hour`` as the ids' clock; per item, whether it was new."""
        meta = self._read_meta(txn)
        self._expire_ids(txn, meta, hour - self.config.dedup_window_hours)
        results = self._claim_ids(txn, observations, meta, hour)
        fresh = [(item.tokens, item.packed, item.start, item.counted) for item, new in zip(observations, results) if new]
        # The epoch first: a batch that crosses a boundary lands fresh in the new one.
        meta.epoch_tokens += sum(len(tokens) - start for tokens, _packed, start, _counted in fresh)
        epochs, meta.epoch_tokens = divmod(meta.epoch_tokens, self.config.epoch_observations)
        if epochs:
            self._advance_epoch(txn, meta, epochs)
        counts = count_ngrams(fresh, self.config.namespace, self.config.n_min, self.config.n_max)
        for key in sorted(counts):  # key order: neighbouring writes share pages
            self._merge_key(txn, key, counts[key], meta)
        # Same transaction: no crash leaves the table above the high-water mark.
        config = self.config
        self._evict(txn, meta, config.low_water_bytes, config.eviction_chunk_records, config.high_water_bytes)
        self._write_meta(txn, meta)
        return results

    def _claim_ids(self, txn: lmdb.Transaction, observations: list[_Observation], meta: _Meta, hour: int) -> list[bool]:
        results = []
        for item in observations:
            if item.observe_id is not None and self._id_applied(txn, item.observe_id, hour):
                results.append(False)
                continue
            if item.observe_id is not None:
                key = applied_key(hour, self.config.namespace, item.observe_id)
                self._put_record(txn, self._applied, key, meta)
            results.append(True)
        return results

    def _id_applied(self, txn: lmdb.Transaction, observe_id: bytes, hour: int) -> bool:
        # Ids live under the hour that applied them; only the window's hours can hold one
        # (and a clock set back: a later hour's ids count too, up to a window ahead).
        window, namespace = self.config.dedup_window_hours, self.config.namespace
        keys = (applied_key(applied, namespace, observe_id) for applied in range(max(0, hour - window), hour + window + 1))
        return any(txn.get(key, db=self._applied) is not None for key in keys)

    def _expire_ids(self, txn: lmdb.Transaction, meta: _Meta, cutoff: int) -> None:
        """Delete the ids applied before hour ``cutoff`` (the key order is the hour's)."""
        cursor = txn.cursor(db=self._applied)
        while cursor.first() and UINT32.unpack_from(cursor.key())[0] < cutoff:
            meta.tracked_bytes -= record_bytes(cursor.key(), cursor.value())
            cursor.delete()

    def _merge_key(self, txn: lmdb.Transaction, key: bytes, additions: dict[int, int], meta: _Meta) -> None:
        # The hot loop of every apply (one call per distinct n-gram), hence the
        # inlined record_bytes/_put_record arithmetic.
        config = self.config
        old = txn.get(key, db=self._ngrams)
        if old is None and len(additions) == 1:
            # The commonest case under fresh text: a new n-gram seen once in this
            # batch (counts are < UINT32_MAX: one batch holds < 2^32 tokens).
            ((token, total),) = additions.items()
            value = VALUE_HEADER.pack(VALUE_VERSION, meta.epoch, total) + FIRST_PAIR.pack(token, total)
        else:
            if old is None:  # nothing to decay or merge
                pairs = _ranked(additions.items())[: config.max_continuations]
            else:
                old_epoch, old_total, stored = decode_value(old)
                self._delete_record(txn, self._coldness, coldness_key(old_epoch, old_total, key), meta)
                meta.tracked_bytes -= record_bytes(key, old)
                pairs = merge_continuations(
                    stored, meta.epoch - old_epoch, additions, config.decay_shift_per_epoch, config.max_continuations
                )
            total = total_count(pairs)
            value = encode_value(meta.epoch, pairs, total)
        cold = coldness_key(meta.epoch, total, key)
        txn.put(key, value, db=self._ngrams)
        txn.put(cold, b"", db=self._coldness)
        meta.tracked_bytes += len(key) + len(value) + len(cold) + 2 * RECORD_OVERHEAD_BYTES

    def _advance_epoch(self, txn: lmdb.Transaction, meta: _Meta, epochs: int) -> None:
        if meta.epoch + epochs > UINT32_MAX:
            raise OverflowError("epoch counter exhausted")
        meta.epoch += epochs

    def _put_record(self, txn: lmdb.Transaction, db: Any, key: bytes, meta: _Meta) -> None:
        txn.put(key, b"", db=db)
        meta.tracked_bytes += record_bytes(key, b"")

    def _delete_record(self, txn: lmdb.Transaction, db: Any, key: bytes, meta: _Meta) -> None:
        if txn.delete(key, db=db):
            meta.tracked_bytes -= record_bytes(key, b"")

    # -- internals: eviction

    def _evict_if_needed(self) -> None:
        with self._env.begin() as txn:
            tracked = self._read_meta(txn).tracked_bytes
            successors = txn.stat(self._successors)["entries"]
        if tracked > self.config.high_water_bytes:
            self._evict_to(self.config.low_water_bytes)
        if successors > self.config.max_successor_entries:
            self._trim_successors()

    def _trim_successors(self) -> None:
        """Evict the successor records beyond max_successor_entries, least recently written
        first, one bounded transaction at a time (a file last written under a larger bound)."""
        chunk = self.config.eviction_chunk_records
        while True:
            with self._env.begin(write=True) as txn:
                excess = txn.stat(self._successors)["entries"] - self.config.max_successor_entries
                meta = self._read_successor_meta(txn)
                self._evict_successors(txn, meta, min(excess, chunk), {})
                self._write_successor_meta(txn, meta)
            if excess <= chunk:
                return

    def _evict_to(self, target_bytes: int) -> None:
        """Evict coldest-first, one bounded transaction at a time, until tracked <= target."""
        chunk = self.config.eviction_chunk_records
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    meta = self._read_meta(txn)
                    removed = self._evict(txn, meta, target_bytes, chunk, ceiling_bytes=None)
                    self._write_meta(txn, meta)
            except lmdb.MapFullError:
                if chunk == 1:
                    log.error("n-gram store map full even for a one-record eviction; eviction stopped")
                    return
                chunk = max(1, chunk // 2)  # deletions need copy-on-write pages too
                continue
            if removed < chunk:
                return

    def _evict(self, txn: lmdb.Transaction, meta: _Meta, target_bytes: int, limit: int, ceiling_bytes: int | None) -> int:
        """Evict coldest-first while above ``target_bytes``: ``limit`` records, more while above the ceiling."""

        def more() -> bool:
            if meta.tracked_bytes <= target_bytes:
                return False
            return removed < limit or (ceiling_bytes is not None and meta.tracked_bytes > ceiling_bytes)

        removed = 0
        coldness = txn.cursor(db=self._coldness)
        while more() and coldness.first():
            index_key = coldness.key()
            ngram_key = index_key[2 * UINT32.size :]
            value = txn.pop(ngram_key, db=self._ngrams)
            if value is not None:
                meta.tracked_bytes -= record_bytes(ngram_key, value)
            meta.tracked_bytes -= record_bytes(index_key, b"")
            coldness.delete()
            removed += 1
        applied = txn.cursor(db=self._applied)
        while more() and applied.first():
            meta.tracked_bytes -= record_bytes(applied.key(), b"")
            applied.delete()
            removed += 1
        meta.evictions += removed
        return removed


def _tree_pages(stat: Mapping[str, Any]) -> int:
    return stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]
