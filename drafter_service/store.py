"""The persistent global n-gram table: an LMDB-backed ``NGramSource``.

``LMDBNGramStore`` holds what ``InMemoryNGramTable`` holds — for every n-gram
of earlier requests' outputs (n in [n_min, n_max]) the counts of the tokens
that followed it — but on disk: it survives restarts and kill -9, stays within
a configured size, forgets stale n-grams, and serves lookups from many threads
while one thread writes.

On-disk format, version 4 (``FORMAT_VERSION``)
----------------------------------------------
One LMDB environment (a directory holding ``data.mdb`` and ``lock.mdb``) with
six named sub-databases. Every integer is big-endian, so byte order is
numeric order and keys sharing a prefix sort together. No pickle anywhere.

``meta``
    ``b"format_version"`` -> uint8, 4. ``b"epoch"`` -> uint32, the current
    epoch. ``b"epoch_tokens"`` -> uint64, tokens applied since it began.
    ``b"tracked_bytes"`` -> uint64, see *Size*. ``b"evictions"`` -> uint64,
    records evicted so far. ``b"successor_tick"`` -> uint32, the successor
    clock (see *The successor table's bound*). ``b"successor_tick_writes"`` ->
    uint64, successor keys written since that tick began.
    ``b"successor_evictions"`` -> uint64, successor records evicted so far.
``ngrams``
    key = namespace (8 bytes) | n (uint8) | n tokens (uint32 each).
    value = value version (uint8, 1: ``VALUE_VERSION``) | last-touched epoch (uint32) | total (uint32)
    | k pairs (token uint32, count uint32), 1 <= k <= max_continuations,
    count descending, ties in the order they were stored. Counts are as of
    the last-touched epoch; total is their sum (saturating at 2**32-1).
``coldness``
    key = last-touched epoch (uint32) | total (uint32) | the ``ngrams`` key;
    value empty. Exactly one per ``ngrams`` record: this sub-db's key order
    is the eviction order.
``applied``
    key = hour applied (uint32, hours since the Unix epoch) | namespace (8
    bytes) | observe id (UTF-8); value empty. Oldest first, so expiry and
    eviction read from the front.
``successors`` (the *successor table*: the target's own predictions)
    key = namespace (8 bytes) | n (uint8, 1 or 2) | n tokens (uint32 each):
    the current token, or the previous and the current one.
    value = value version (uint8, 2: ``SUCCESSOR_VERSION``) | stamp (uint32:
    the successor tick when the key was last written) | k tokens (uint32
    each), 1 <= k <= ``MAX_SUCCESSORS``: the target's top k predictions for
    the token after that key, best first, as a verifier last computed them.
    The newest replace what was there (Token Recycling's rule: the latest
    predictions are the best guess). Not in ``tracked_bytes``: bounded by
    count, ``max_successor_entries`` (see *The successor table's bound*).
``successor_recency``
    key = stamp (uint32) | the ``successors`` key; value empty. Exactly one
    per ``successors`` record, under the stamp its value holds: this sub-db's
    key order (oldest tick first, then key bytes) is the successor table's
    eviction order.

Opening a file whose ``format_version`` is 4 reads it. Older ones are migrated
in place, in one transaction (all of it or nothing), as ``MIGRATIONS``
summarises: 3's successor values (version 1: the tokens without a stamp) are
rewritten as version 2 with stamp 0, each with its ``successor_recency``
entry, and the clock starts at tick 1, so every record migrated is older than
any written since and nothing learned is lost; 2 gains the two successor
sub-databases; 1 too, and its ``applied`` ids were keyed by decay epoch: those
ids are dropped, logged, so a retry in flight across the upgrade may be
counted twice. Every migration adds the three successor meta records.
Anything else, or a value whose version byte is not its sub-database's,
raises ``StoreFormatError``. Code before format 4 refuses a version 4 file
with that message.

De-duplication window
---------------------
An observe id is remembered for ``dedup_window_hours`` (24) to that plus an
hour, by the clock, whatever the traffic: a client's retries, however late
its back-off brings them, are skipped within it. (Version 1 kept ids for 4
decay epochs, which on a 1 MiB table is ~30 observations: 188 of 200 late
retries were applied twice.) Expired ids are deleted at the start of each
apply; ids count towards the size bound and are evicted last.

Namespaces
----------
The namespace is a fingerprint of the tokenizer's vocabulary
(``vocabulary_fingerprint``): token 42 means different text under another
tokenizer, so a store reads and writes only keys with its own namespace.
Epochs, the size bound and eviction are shared by all namespaces in a file.

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

Checking a table, and damage
----------------------------
LMDB keeps no checksums and trusts its pages: a damaged one reads as an error
(``is_corruption``: MDB_CORRUPTED, MDB_PAGE_NOTFOUND, ...), as plausible but wrong
records, or aborts the process (an LMDB assertion; 5 of 60 tables given 20 random
pages did so here). ``walk_table`` reads every record of every sub-database through
its cursor, so every B-tree page holding one, and checks each against the format
above: keys rising and shaped as specified; each ``ngrams`` value of version 1 with
1..255 pairs, distinct tokens, counts most frequent first summing to its total
(saturated), touched no later than the current epoch, and with its ``coldness``
entry; as many ``coldness`` entries as n-grams; empty ``coldness`` and ``applied``
values; the meta records of the file's version; each ``successors`` value of its
format's version with 1..16 tokens and (format 4) stamped no later than the current
tick, with its ``successor_recency`` entry; as many of those entries as successor
records. ``max_records`` bounds it (shared out in proportion to the sub-databases'
sizes, each walked from its first key): measured here ~1 s per million records
with the file cached, ~2 s from disk, so a 1 GiB table (~24 million records) takes
~25-50 s whole. ``walk_tables`` runs walks in child processes, so an abort condemns
the table, not the caller. The free-page database
is not walked (py-lmdb cannot open it): damage there surfaces at the next write.

A store given ``on_corruption`` reports a damaged page or record met by any call to
it; its owner may ``retire`` it (new calls raise ``StoreClosed``, the environment
closes when the last call in flight ends), and the call then raises ``StoreCorrupted``.

Durability and concurrency
--------------------------
Commits use LMDB's default durability (fsync on commit), so whatever
``apply`` acknowledged survives kill -9 without a repair step. Each
``continuations`` call reads in its own read transaction (MVCC: it never waits
for the writer) and copies the value out before it ends. Writes are serialised
by a lock, so any thread may call ``apply``.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent import futures
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from itertools import accumulate, chain, compress, islice
from operator import itemgetter
from typing import Any, NamedTuple

import lmdb

from drafter_service.ngram import Continuation, best_of
from specdec.vocabulary import FINGERPRINT_BYTES, vocabulary_fingerprint  # noqa: F401 (part of the store's API)

FORMAT_VERSION = 4
# The older formats a store opens, migrating them in place (see the docstring).
MIGRATED_FORMAT_VERSION = 1
SUCCESSORLESS_FORMAT_VERSION = 2
UNSTAMPED_FORMAT_VERSION = 3
# What opening a table of an older format changes in it (the check tells operators).
MIGRATIONS = {
    MIGRATED_FORMAT_VERSION: "its observe ids are dropped, a successor table is added",
    SUCCESSORLESS_FORMAT_VERSION: "a successor table is added",
    UNSTAMPED_FORMAT_VERSION: "each successor record is stamped as the oldest, for eviction",
}
# Version byte of a ``successors`` value (format 3's, unstamped, is migrated), and the most predictions one holds.
SUCCESSOR_VERSION = 2
UNSTAMPED_SUCCESSOR_VERSION = 1
MAX_SUCCESSORS = 16
# Successor-clock ticks per max_successor_entries keys written: eviction takes the oldest
# 1/256th of a table's worth of writes first, and a key rewritten within its tick (a
# common token, rewritten every step) costs no index update for that many writes.
SUCCESSOR_TICKS_PER_BOUND = 256
# Version byte of an ``ngrams`` value (its encoding has not changed since format 1).
VALUE_VERSION = 1
NAMESPACE_BYTES = FINGERPRINT_BYTES
UINT32_MAX = 0xFFFFFFFF

# LMDB's default build rejects keys over 511 bytes: an n-gram key is 9 + 4n
# bytes and an applied-id key 12 + the id's UTF-8 length.
LMDB_MAX_KEY_BYTES = 511
MAX_OBSERVE_ID_BYTES = LMDB_MAX_KEY_BYTES - 4 - NAMESPACE_BYTES
MAX_N = (LMDB_MAX_KEY_BYTES - NAMESPACE_BYTES - 1) // 4
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
# Continuations kept per key at most: a drafter uses the first; 255 is far
# beyond any useful ranking and bounds a value to 9 + 2040 bytes.
MAX_CONTINUATIONS = 255
# Named sub-databases: ngrams, coldness, applied, meta, successors, successor_recency.
SUB_DATABASES = 6
# Map bytes reserved per successor record: key 17 + value <= 69 and its recency
# entry's key 21, with LMDB's headers (~130 bytes), in pages about half full, with
# copy-on-write copies.
SUCCESSOR_MAP_BYTES = 640

_COUNT = itemgetter(1)  # of a (token, count) pair
_HEADER = struct.Struct(">BII")  # version, last-touched epoch, total
_PAIR_BYTES = 8
_UINT32 = struct.Struct(">I")
_EPOCH_TOTAL = struct.Struct(">II")
_FIRST_PAIR = struct.Struct(">II")
# Packers for 0..MAX_CONTINUATIONS (token, count) pairs, built once: values are encoded per write.
_PAIRS = [struct.Struct(f">{2 * n}I") for n in range(MAX_CONTINUATIONS + 1)]
_UINT64 = struct.Struct(">Q")
# A successor key after its namespace (n, then n tokens), for n = 1, 2; a value's k tokens.
_SUCCESSOR_KEYS = {n: struct.Struct(f">B{n}I") for n in (1, 2)}
_SUCCESSOR_HEADER = struct.Struct(">BI")  # version, stamp
_TOKENS = [struct.Struct(f">{n}I") for n in range(MAX_SUCCESSORS + 1)]
_META_VERSION = b"format_version"
_META_EPOCH = b"epoch"
_META_EPOCH_TOKENS = b"epoch_tokens"
_META_TRACKED = b"tracked_bytes"
_META_EVICTIONS = b"evictions"
_META_SUCCESSOR_TICK = b"successor_tick"
_META_SUCCESSOR_TICK_WRITES = b"successor_tick_writes"
_META_SUCCESSOR_EVICTIONS = b"successor_evictions"

log = logging.getLogger(__name__)


class StoreFull(RuntimeError):
    """Observations found no room in the map; nothing of them was written.

    ``results[i]``: item i's outcome, True applied, False a duplicate, None not
    stored (the caller retries it under the same id)."""

    def __init__(self, message: str, results: list[bool | None]) -> None:
        super().__init__(message)
        self.results = results


class StoreFormatError(RuntimeError):
    """The file was written in a format this code does not read, or is not ours, or is damaged."""


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


# LMDB's meta pages (lmdb.h, 64-bit): page header (16 bytes), then mm_magic,
# mm_version, mm_address, mm_mapsize, mm_dbs[2] (48 bytes each, the first's
# md_pad holding the page size), mm_last_pg, mm_txnid.
_LMDB_MAGIC = 0xBEEFC0DE
_LMDB_META = struct.Struct("<II")  # magic, version, at +16
_LMDB_PAGE_SIZE = struct.Struct("<I")  # at +40
_LMDB_LAST_PAGE_AND_TXN = struct.Struct("<QQ")  # at +136
# Sub-databases a store's main database names; anything else is not ours.
_SUCCESSORLESS_DATABASES = {b"ngrams", b"coldness", b"applied", b"meta"}  # formats 1 and 2
_UNSTAMPED_DATABASES = {*_SUCCESSORLESS_DATABASES, b"successors"}  # format 3
_OUR_DATABASES = {*_UNSTAMPED_DATABASES, b"successor_recency"}


def file_problem(path: str | os.PathLike[str]) -> str | None:
    """Why ``path/data.mdb`` cannot be opened safely, or None (also when there is none yet).

    Checked without mapping the file: LMDB maps it whole, and a page past the end
    of a truncated file kills the process with SIGBUS, which no handler catches.
    """
    data_file = os.path.join(path, "data.mdb")
    if not os.path.exists(data_file):
        return None
    size = os.path.getsize(data_file)
    with open(data_file, "rb") as handle:
        head = handle.read(2 * 65536)
    if len(head) < 4096 + 152:
        return f"data.mdb is {size} bytes: too short for LMDB's two meta pages"
    if _LMDB_META.unpack_from(head, 16)[0] != _LMDB_MAGIC:
        return "data.mdb is not an LMDB file (bad magic)"
    page_size = _LMDB_PAGE_SIZE.unpack_from(head, 40)[0]
    if page_size not in (4096, 8192, 16384, 32768, 65536) or len(head) < page_size + 152:
        return f"data.mdb has an implausible page size {page_size}"
    metas = [
        _LMDB_LAST_PAGE_AND_TXN.unpack_from(head, offset + 136)
        for offset in (0, page_size)
        if _LMDB_META.unpack_from(head, offset + 16)[0] == _LMDB_MAGIC
    ]
    last_page, _txn = max(metas, key=lambda meta: meta[1])
    if (last_page + 1) * page_size > size:
        return f"data.mdb is truncated: its last page ends at byte {(last_page + 1) * page_size}, the file has {size}"
    return None


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


# --- pure format and merge functions ------------------------------------------


def encode_value(epoch: int, pairs: Sequence[tuple[int, int]], total: int | None = None) -> bytes:
    """The ``ngrams`` value: header, then (token, count) pairs as stored."""
    flat = list(chain.from_iterable(pairs))
    if total is None:
        total = total_count(pairs)
    return _HEADER.pack(VALUE_VERSION, epoch, total) + _PAIRS[len(pairs)].pack(*flat)


def decode_value(value: bytes) -> tuple[int, int, list[tuple[int, int]]]:
    """(last-touched epoch, total, pairs) of an ``ngrams`` value; asserts the version."""
    if not value or value[0] != VALUE_VERSION:
        version = value[0] if value else None
        raise StoreFormatError(f"n-gram value has version {version}; this code reads version {VALUE_VERSION}")
    if len(value) < _HEADER.size + _PAIR_BYTES or (len(value) - _HEADER.size) % _PAIR_BYTES:
        raise StoreFormatError(f"n-gram value of {len(value)} bytes is not a header plus one or more whole pairs")
    _version, epoch, total = _HEADER.unpack_from(value)
    flat = struct.unpack_from(f">{(len(value) - _HEADER.size) // 4}I", value, _HEADER.size)
    return epoch, total, list(zip(flat[0::2], flat[1::2]))


def total_count(pairs: Sequence[tuple[int, int]]) -> int:
    total = sum(count for _token, count in pairs)
    return total if total < UINT32_MAX else UINT32_MAX


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


def record_bytes(key: bytes, value: bytes) -> int:
    return len(key) + len(value) + RECORD_OVERHEAD_BYTES


def coldness_key(epoch: int, total: int, ngram_key: bytes) -> bytes:
    return _EPOCH_TOTAL.pack(epoch, total) + ngram_key


def applied_key(hour: int, namespace: bytes, observe_id: bytes) -> bytes:
    return _UINT32.pack(hour) + namespace + observe_id


# --- the store --------------------------------------------------------------


class ApplyItem(NamedTuple):
    """One item of ``apply``: an observation, or one chunk or sequence of a larger call."""

    observe_id: str | None
    tokens: Sequence[int]
    start: int = 0  # tokens before it are a chunk's context (see count_ngrams)
    counted: Sequence[bytes] | None = None  # per n, the positions that count (first_occurrences); None: the item is a call


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
        if len(value) < _HEADER.size + _PAIR_BYTES:
            return best_of(self.continuations(key))  # damaged: decode_value says how
        version, last_touched, total = _HEADER.unpack_from(value)
        if version == VALUE_VERSION and last_touched == self._epoch:
            # Pairs are stored most frequent first: the head is the answer.
            # (A plain tuple: this runs per draft token, and unpacks like a Continuation.)
            return (*_FIRST_PAIR.unpack_from(value, _HEADER.size), total)  # type: ignore[return-value]
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
        ``walk_table`` reports it."""
        packer = _SUCCESSOR_KEYS.get(len(key))
        if packer is None:
            return None
        try:
            value = self._txn.get(self._namespace + packer.pack(len(key), *key), db=self._successors)
        except struct.error:
            return None
        if value is None:
            return None
        count, odd = divmod(len(value) - _SUCCESSOR_HEADER.size, 4)
        if odd or not 0 < count <= MAX_SUCCESSORS or value[0] != SUCCESSOR_VERSION:
            return None
        return _TOKENS[count].unpack_from(value, _SUCCESSOR_HEADER.size)

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
            epoch = _UINT32.unpack(txn.get(_META_EPOCH, db=self._meta))[0]  # type: ignore[arg-type]  # written at creation
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
        records: dict[bytes, bytes] = {}  # key -> its tokens, packed: the newest, in the order last given
        for key, tokens in updates:
            packer = _SUCCESSOR_KEYS.get(len(key))
            if packer is None or not 0 < len(tokens) <= MAX_SUCCESSORS:
                raise ValueError(f"a successor key has 1 or 2 tokens and 1..{MAX_SUCCESSORS} predictions, got {key} -> {len(tokens)}")
            try:
                packed = self.config.namespace + packer.pack(len(key), *key)
                records.pop(packed, None)
                records[packed] = _TOKENS[len(tokens)].pack(*tokens)
            except struct.error:
                raise ValueError(f"successor key {key} or its predictions hold a token id outside uint32") from None
        bound = self.config.max_successor_entries
        if len(records) > bound:
            records = dict(islice(records.items(), len(records) - bound, None))
        if not records:
            return 0
        with self._use() as env, self._write_lock, env.begin(write=True) as txn:
            meta = self._read_successor_meta(txn)
            stamps = {packed: self._successor_stamp(txn, packed) for packed in sorted(records)}  # key order: neighbours share pages
            excess = txn.stat(self._successors)["entries"] + sum(stamp is None for stamp in stamps.values()) - bound
            if excess > 0:
                self._evict_successors(txn, meta, excess, records)
            stamp = _UINT32.pack(meta.tick)
            for packed, held in stamps.items():
                if held != meta.tick:  # within its tick, a key keeps its recency entry
                    if held is not None:
                        txn.delete(_UINT32.pack(held) + packed, db=self._recency)
                    txn.put(stamp + packed, b"", db=self._recency)
                txn.put(packed, bytes((SUCCESSOR_VERSION,)) + stamp + records[packed], db=self._successors)
            ticks, meta.tick_writes = divmod(meta.tick_writes + len(records), self.config.successor_writes_per_tick)
            meta.tick = min(UINT32_MAX, meta.tick + ticks)
            self._write_successor_meta(txn, meta)
        return len(records)

    def _successor_stamp(self, txn: lmdb.Transaction, key: bytes) -> int | None:
        """The stamp of the successor record ``key``, or None when none is held."""
        value = txn.get(key, db=self._successors)
        if value is None:
            return None
        if len(value) < _SUCCESSOR_HEADER.size or value[0] != SUCCESSOR_VERSION:
            raise StoreFormatError(f"successor value of {key.hex()} is not version {SUCCESSOR_VERSION} with a stamp")
        return int(_SUCCESSOR_HEADER.unpack_from(value)[1])

    def _evict_successors(self, txn: lmdb.Transaction, meta: _SuccessorMeta, count: int, keep: Mapping[bytes, bytes]) -> int:
        """Evict up to ``count`` successor records, least recently written first, none of ``keep``."""
        removed = 0
        recency = txn.cursor(db=self._recency)
        found = recency.first()
        while found and removed < count:
            index_key = recency.key()
            key = index_key[_UINT32.size :]
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
                version = txn.get(_META_VERSION, db=self._env.open_db(b"meta", txn=txn, create=False))
        if names and (not names <= _OUR_DATABASES or version is None):
            raise StoreFormatError(f"{self.config.path} is an LMDB environment without this store's format record: not ours")

    def _initialise_meta(self, txn: lmdb.Transaction) -> None:
        version = txn.get(_META_VERSION, db=self._meta)
        if version is None:
            txn.put(_META_VERSION, bytes((FORMAT_VERSION,)), db=self._meta)
            self._write_meta(txn, _Meta(epoch=0, epoch_tokens=0, tracked_bytes=0, evictions=0))
            self._write_successor_meta(txn, _SuccessorMeta(tick=0, tick_writes=0, evictions=0))
        elif version[0] in MIGRATIONS and len(version) == 1:
            self._migrate(txn, version[0])
        elif version != bytes((FORMAT_VERSION,)):
            raise StoreFormatError(f"{self.config.path} has store format version {version[0]}; this code reads version {FORMAT_VERSION}")

    def _migrate(self, txn: lmdb.Transaction, version: int) -> None:
        """Bring a file of an older ``version`` to this format, in the opening transaction (see the docstring)."""
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
            oldest = _UINT32.pack(0)
            cursor = txn.cursor(db=self._successors)
            for key, value in cursor:
                if not value or value[0] != UNSTAMPED_SUCCESSOR_VERSION:
                    raise StoreFormatError(f"successor value of {key.hex()} is not version {UNSTAMPED_SUCCESSOR_VERSION}")
                cursor.put(key, bytes((SUCCESSOR_VERSION,)) + oldest + value[1:])
                txn.put(oldest + key, b"", db=self._recency)
                stamped += 1
        self._write_successor_meta(txn, _SuccessorMeta(tick=1, tick_writes=0, evictions=0))
        txn.put(_META_VERSION, bytes((FORMAT_VERSION,)), db=self._meta)
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
            epoch=get(_META_EPOCH, _UINT32),
            epoch_tokens=get(_META_EPOCH_TOKENS, _UINT64),
            tracked_bytes=get(_META_TRACKED, _UINT64),
            evictions=get(_META_EVICTIONS, _UINT64),
        )

    def _read_successor_meta(self, txn: lmdb.Transaction) -> _SuccessorMeta:
        def get(key: bytes, layout: struct.Struct) -> int:
            return layout.unpack(txn.get(key, db=self._meta))[0]  # type: ignore[arg-type]  # written at creation or migration

        return _SuccessorMeta(
            tick=get(_META_SUCCESSOR_TICK, _UINT32),
            tick_writes=get(_META_SUCCESSOR_TICK_WRITES, _UINT64),
            evictions=get(_META_SUCCESSOR_EVICTIONS, _UINT64),
        )

    def _write_successor_meta(self, txn: lmdb.Transaction, meta: _SuccessorMeta) -> None:
        txn.put(_META_SUCCESSOR_TICK, _UINT32.pack(meta.tick), db=self._meta)
        txn.put(_META_SUCCESSOR_TICK_WRITES, _UINT64.pack(meta.tick_writes), db=self._meta)
        txn.put(_META_SUCCESSOR_EVICTIONS, _UINT64.pack(meta.evictions), db=self._meta)

    def _write_meta(self, txn: lmdb.Transaction, meta: _Meta) -> None:
        txn.put(_META_EPOCH, _UINT32.pack(meta.epoch), db=self._meta)
        txn.put(_META_EPOCH_TOKENS, _UINT64.pack(meta.epoch_tokens), db=self._meta)
        txn.put(_META_TRACKED, _UINT64.pack(meta.tracked_bytes), db=self._meta)
        txn.put(_META_EVICTIONS, _UINT64.pack(meta.evictions), db=self._meta)

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
            meta = self._read_meta(txn)
            hour = int(self.config.clock() // 3600)
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
        while cursor.first() and _UINT32.unpack_from(cursor.key())[0] < cutoff:
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
            value = _HEADER.pack(VALUE_VERSION, meta.epoch, total) + _FIRST_PAIR.pack(token, total)
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
            ngram_key = index_key[2 * _UINT32.size :]
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


# --- checking a table: the start-up walk and drafter_service.check -------------------------

# Records the drafter's start-up walk reads per table (walk_table's max_records): measured
# 0.85 s here with the file cached, 2.3 s from disk, so a drafter with a few big tables
# reaches SERVING in seconds, not minutes; a table of up to ~40 MB tracked (~44 bytes a
# record) holds fewer and is walked whole.
STARTUP_WALK_RECORDS = 1_000_000
# The meta records (see the format above) and each one's length: formats 1-3, and this one.
_OLDER_META_LAYOUT = {_META_VERSION: 1, _META_EPOCH: 4, _META_EPOCH_TOKENS: 8, _META_TRACKED: 8, _META_EVICTIONS: 8}
_META_LAYOUT = {**_OLDER_META_LAYOUT, _META_SUCCESSOR_TICK: 4, _META_SUCCESSOR_TICK_WRITES: 8, _META_SUCCESSOR_EVICTIONS: 8}
# The sub-databases of each format a store reads.
_DATABASES_OF_VERSION = {
    MIGRATED_FORMAT_VERSION: _SUCCESSORLESS_DATABASES,
    SUCCESSORLESS_FORMAT_VERSION: _SUCCESSORLESS_DATABASES,
    UNSTAMPED_FORMAT_VERSION: _UNSTAMPED_DATABASES,
    FORMAT_VERSION: _OUR_DATABASES,
}
_NGRAM_KEY_MAX = NAMESPACE_BYTES + 1 + 4 * MAX_N
# Signals LMDB dies of on a damaged page: an assertion (abort), or a pointer into nowhere.
_DAMAGE_SIGNALS = (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE)
_CHILD_WALK = "import sys; from drafter_service.store import _walk_in_child; _walk_in_child(sys.argv[1:])"


@dataclass(frozen=True)
class TableWalk:
    """What ``walk_table`` found in one table."""

    problem: str | None  # why it cannot be served; None: every record walked is sound
    records: int = 0  # records walked, over all sub-databases
    entries: int = 0  # records the table holds (0 when unreadable)
    version: int | None = None  # format version read; None: unreadable, or a table never written

    @property
    def whole(self) -> bool:
        """Every record was walked (a bound left none unread)."""
        return self.records >= self.entries


class _Unsound(Exception):
    """A record that breaks the format: the walk stops at the first."""


class _Walker:
    """One read transaction's walk over a table: every record of every sub-database read
    through its cursor (so every B-tree page holding one), in key order, and checked against
    the format above. ``max_records`` is shared out in proportion to the sub-databases' sizes;
    each is walked from its first key."""

    def __init__(self, env: lmdb.Environment, max_records: int | None) -> None:
        self.env, self.max_records = env, max_records
        self.records = self.entries = self.meta_records = 0
        self.version: int | None = None

    def walk(self) -> None:
        with self.env.begin() as self.txn:
            self._walk()

    def _walk(self) -> None:
        names = set(self.txn.cursor().iternext(keys=True, values=False))
        if not names:
            return  # an environment never written (creation cut short): the store sets it up
        if names not in _DATABASES_OF_VERSION.values():
            raise _Unsound(f"its sub-databases are {sorted(names)}, not this store's")
        dbs = {name: self.env.open_db(name, txn=self.txn, create=False) for name in names}
        epoch, tick = self._meta(dbs[b"meta"])
        if names != _DATABASES_OF_VERSION[self.version]:  # type: ignore[index]  # _meta set it
            raise _Unsound(f"format version {self.version} with sub-databases {sorted(names)}")
        walked = (b"ngrams", b"coldness", b"applied", b"successors", b"successor_recency")
        sizes = {name: self.txn.stat(dbs[name])["entries"] for name in walked if name in dbs}
        self.entries = self.meta_records + sum(sizes.values())
        if sizes[b"ngrams"] != sizes[b"coldness"]:
            raise _Unsound(f"it holds {sizes[b'ngrams']} n-gram records but {sizes[b'coldness']} coldness entries (one each)")
        if b"successor_recency" in sizes and sizes[b"successors"] != sizes[b"successor_recency"]:
            raise _Unsound(
                f"it holds {sizes[b'successors']} successor records but {sizes[b'successor_recency']} successor-recency entries (one each)"
            )
        limits = dict(sizes)
        if self.max_records is not None and sum(sizes.values()) > self.max_records:
            # Rounded up: every sub-database holding records has some walked.
            limits = {name: -(-self.max_records * size // sum(sizes.values())) for name, size in sizes.items()}
        self._ngrams(dbs[b"ngrams"], dbs[b"coldness"], limits[b"ngrams"], sizes[b"ngrams"], epoch)
        self._coldness(dbs[b"coldness"], limits[b"coldness"], sizes[b"coldness"], epoch)
        self._applied(dbs[b"applied"], limits[b"applied"], sizes[b"applied"])
        if b"successors" in dbs:
            recency = dbs.get(b"successor_recency")
            self._successors(dbs[b"successors"], recency, limits[b"successors"], sizes[b"successors"], tick)
        if b"successor_recency" in dbs:
            self._recency(dbs[b"successor_recency"], limits[b"successor_recency"], sizes[b"successor_recency"], tick)

    def _meta(self, db: Any) -> tuple[int, int | None]:
        """Check the meta records; the current epoch and successor tick (None before format 4)."""
        records = dict(self.txn.cursor(db=db))
        self.records += len(records)
        version = records.get(_META_VERSION)
        if version is None or len(version) != 1 or version[0] not in _DATABASES_OF_VERSION:
            raise _Unsound(f"format version {version!r}; this code reads {FORMAT_VERSION} (and 1 to 3, migrating them)")
        self.version = version[0]
        layout = _META_LAYOUT if self.version == FORMAT_VERSION else _OLDER_META_LAYOUT
        if {key: len(value) for key, value in records.items()} != layout:
            raise _Unsound(f"its meta records are {sorted(records)}, not format {self.version}'s")
        self.meta_records = len(layout)
        tick = _UINT32.unpack(records[_META_SUCCESSOR_TICK])[0] if self.version == FORMAT_VERSION else None
        return _UINT32.unpack(records[_META_EPOCH])[0], tick

    def _cursor(self, db: Any, limit: int) -> Iterator[tuple[bytes, bytes]]:
        return islice(self.txn.cursor(db=db), limit)

    def _walked(self, what: str, walked: int, limit: int, entries: int) -> None:
        """Count a loop's records; a tree that ends before its header's count is damaged."""
        self.records += walked
        if walked < min(limit, entries):
            raise _Unsound(f"the {what} tree ends after {walked} records; its header counts {entries}")

    # The loops below run per record (millions): inlined checks, no helper calls.

    def _ngrams(self, db: Any, coldness: Any, limit: int, entries: int, epoch: int) -> None:
        get, previous, header, pair = self.txn.get, b"", _HEADER.size, _PAIR_BYTES
        walked = 0
        for key, value in self._cursor(db, limit):
            walked += 1
            if key <= previous:  # a damaged tree can loop
                raise _Unsound(f"n-gram keys out of order at {key.hex()}")
            previous = key
            size = len(key)
            if size <= NAMESPACE_BYTES or size != NAMESPACE_BYTES + 1 + 4 * key[NAMESPACE_BYTES] or size > _NGRAM_KEY_MAX:
                raise _Unsound(f"n-gram key {key.hex()} is not namespace | n | n tokens")
            pairs, odd = divmod(len(value) - header, pair)
            if odd or not 0 < pairs <= MAX_CONTINUATIONS or value[0] != VALUE_VERSION:
                raise _Unsound(f"n-gram value of {key.hex()} is not version {VALUE_VERSION}, a header and 1..{MAX_CONTINUATIONS} pairs")
            _version, touched, total = _HEADER.unpack_from(value)
            if pairs == 1:
                count = _UINT32.unpack_from(value, header + 4)[0]
                sound = touched <= epoch and total == count
            else:
                sound = touched <= epoch and _sound_pairs(_PAIRS[pairs].unpack_from(value, header), total)
            if not sound:
                raise _Unsound(f"n-gram value of {key.hex()} breaks the format (epoch, total, or its continuations' order)")
            if get(_EPOCH_TOTAL.pack(touched, total) + key, db=coldness) is None:
                raise _Unsound(f"n-gram record {key.hex()} has no coldness entry")
        self._walked("n-gram", walked, limit, entries)

    def _coldness(self, db: Any, limit: int, entries: int, epoch: int) -> None:
        previous, head = b"", _EPOCH_TOTAL.size + NAMESPACE_BYTES + 1  # epoch, total, namespace, n
        walked = 0
        for key, value in self._cursor(db, limit):
            walked += 1
            if key <= previous:
                raise _Unsound(f"coldness keys out of order at {key.hex()}")
            previous = key
            size = len(key)
            if value or size < head or size != head + 4 * key[head - 1] or size > head + 4 * MAX_N:
                raise _Unsound(f"coldness entry {key.hex()} is not epoch | total | n-gram key, with no value")
            if _UINT32.unpack_from(key)[0] > epoch:
                raise _Unsound(f"coldness entry {key.hex()} is from an epoch after the current {epoch}")
        self._walked("coldness", walked, limit, entries)

    def _applied(self, db: Any, limit: int, entries: int) -> None:
        previous, head = b"", _UINT32.size + NAMESPACE_BYTES  # hour, namespace
        walked = 0
        for key, value in self._cursor(db, limit):
            walked += 1
            if key <= previous:
                raise _Unsound(f"applied-id keys out of order at {key.hex()}")
            previous = key
            if value or len(key) <= head:
                raise _Unsound(f"applied id {key.hex()} is not hour | namespace | observe id, with no value")
            try:
                key[head:].decode("utf-8")
            except UnicodeDecodeError:
                raise _Unsound(f"applied id {key.hex()} is not UTF-8") from None
        self._walked("applied-id", walked, limit, entries)

    def _successors(self, db: Any, recency: Any, limit: int, entries: int, tick: int | None) -> None:
        """Format 4's successor records (``recency`` given), or format 3's unstamped ones."""
        get, previous, head = self.txn.get, b"", NAMESPACE_BYTES + 1  # namespace, n
        version, header = (SUCCESSOR_VERSION, _SUCCESSOR_HEADER.size) if recency is not None else (UNSTAMPED_SUCCESSOR_VERSION, 1)
        walked = 0
        for key, value in self._cursor(db, limit):
            walked += 1
            if key <= previous:
                raise _Unsound(f"successor keys out of order at {key.hex()}")
            previous = key
            count, odd = divmod(len(value) - header, 4)
            if len(key) < head or key[head - 1] not in (1, 2) or len(key) != head + 4 * key[head - 1]:
                raise _Unsound(f"successor key {key.hex()} is not namespace | n (1 or 2) | n tokens")
            if odd or not 0 < count <= MAX_SUCCESSORS or value[0] != version:
                raise _Unsound(f"successor value of {key.hex()} is not version {version} and 1..{MAX_SUCCESSORS} tokens")
            if recency is None:
                continue
            stamp = value[1:header]
            if _UINT32.unpack(stamp)[0] > tick:  # type: ignore[operator]  # format 4: a tick
                raise _Unsound(f"successor record {key.hex()} is stamped after the current tick {tick}")
            if get(stamp + key, db=recency) is None:
                raise _Unsound(f"successor record {key.hex()} has no successor-recency entry")
        self._walked("successor", walked, limit, entries)

    def _recency(self, db: Any, limit: int, entries: int, tick: int | None) -> None:
        previous, head = b"", _UINT32.size + NAMESPACE_BYTES + 1  # stamp, namespace, n
        walked = 0
        for key, value in self._cursor(db, limit):
            walked += 1
            if key <= previous:
                raise _Unsound(f"successor-recency keys out of order at {key.hex()}")
            previous = key
            if value or len(key) < head or key[head - 1] not in (1, 2) or len(key) != head + 4 * key[head - 1]:
                raise _Unsound(f"successor-recency entry {key.hex()} is not stamp | successor key, with no value")
            if _UINT32.unpack_from(key)[0] > tick:  # type: ignore[operator]  # format 4: a tick
                raise _Unsound(f"successor-recency entry {key.hex()} is stamped after the current tick {tick}")
        self._walked("successor-recency", walked, limit, entries)


def _sound_pairs(flat: tuple[int, ...], total: int) -> bool:
    """(token, count) pairs as stored: distinct tokens, counts most frequent first, summing to total (saturated)."""
    counts = flat[1::2]
    return total == min(sum(counts), UINT32_MAX) and all(a >= b for a, b in zip(counts, counts[1:])) and len(set(flat[0::2])) == len(counts)


def walk_table(path: str | os.PathLike[str], max_records: int | None = None) -> TableWalk:
    """Check a table (a directory holding data.mdb) without changing it: whole when
    ``max_records`` is None, else about that many records (see ``_Walker``).

    In this process: LMDB trusts its pages, and on some damaged ones aborts the process
    (an assertion) instead of raising. The drafter and the checker use ``walk_tables``.
    """
    problem = file_problem(path)
    if problem is not None:
        return TableWalk(problem)
    try:
        env = lmdb.open(os.fspath(path), readonly=True, max_dbs=SUB_DATABASES, readahead=False)
    except lmdb.Error as error:
        return TableWalk(f"LMDB cannot open it: {error}")
    walker = _Walker(env, max_records)
    try:
        walker.walk()
        problem = None
    except _Unsound as unsound:
        problem = str(unsound)
    except Exception as error:  # damaged pages (lmdb.CorruptedError, PageNotFoundError), undecodable records
        problem = f"unreadable: {type(error).__name__}: {error}"
    finally:
        env.close()
    return TableWalk(problem, walker.records, walker.entries, walker.version)


def walk_tables(paths: Sequence[str | os.PathLike[str]], max_records: int | None = None) -> list[TableWalk]:
    """``walk_table`` of each path, each in a child process (several at once), so that a page
    on which LMDB aborts or faults condemns its table, not the caller.

    Raises RuntimeError when a walk could not run at all (the child failed otherwise than
    by one of those signals): that says nothing about the table.
    """
    if not paths:
        return []
    with futures.ThreadPoolExecutor(max_workers=min(len(paths), os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda path: _walk_in_a_child(path, max_records), paths))


def _walk_in_a_child(path: str | os.PathLike[str], max_records: int | None) -> TableWalk:
    # The package's own root first, wherever the caller was started from.
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (package_root, os.environ.get("PYTHONPATH"))))}
    command = [sys.executable, "-c", _CHILD_WALK, os.fspath(path), str(max_records)]
    child = subprocess.run(command, capture_output=True, text=True, env=environment, check=False)
    if child.returncode == 0:
        return TableWalk(**json.loads(child.stdout.splitlines()[-1]))
    last_words = (child.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
    if -child.returncode in _DAMAGE_SIGNALS:
        name = signal.Signals(-child.returncode).name
        return TableWalk(f"reading it crashed LMDB ({name}: {last_words}): its pages are damaged")
    raise RuntimeError(f"the walk of {os.fspath(path)} could not run (exit status {child.returncode}): {last_words}")


def _walk_in_child(argv: list[str]) -> None:
    """The child's side of ``walk_tables``: one TableWalk as JSON on stdout."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # an abort here is a finding, not a crash to debug
    path, max_records = argv
    walk = walk_table(path, None if max_records == "None" else int(max_records))
    print(json.dumps(asdict(walk)), flush=True)
