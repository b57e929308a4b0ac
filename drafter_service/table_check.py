"""Checking a drafter table against its format (``drafter_service.table_format``) without
changing it: the walk the drafter gives each table at start-up (``drafter_service.storage``)
and ``python -m drafter_service.check`` gives every table offline.

LMDB keeps no checksums and trusts its pages: a damaged one reads as an error
(``store.is_corruption``: MDB_CORRUPTED, MDB_PAGE_NOTFOUND, ...), as plausible but wrong
records, or aborts the process (an LMDB assertion; 5 of 60 tables given 20 random
pages did so here). ``walk_table`` reads every record of every sub-database through
its cursor, so every B-tree page holding one, and checks each against the format:
keys rising and shaped as specified; each ``ngrams`` value of version 1 with
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
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from concurrent import futures
from dataclasses import asdict, dataclass
from itertools import islice
from typing import Any

import lmdb

from drafter_service.table_format import (
    DATABASES_OF_VERSION,
    EPOCH_TOTAL,
    FORMAT_VERSION,
    MAX_CONTINUATIONS,
    MAX_N,
    MAX_NGRAM_KEY_BYTES,
    MAX_SUCCESSORS,
    META_EPOCH,
    META_LAYOUT,
    META_SUCCESSOR_TICK,
    META_VERSION,
    NAMESPACE_BYTES,
    OLDER_META_LAYOUT,
    PAIR_BYTES,
    PAIRS,
    REPLICA_META_LAYOUT,
    SUB_DATABASES,
    SUCCESSOR_HEADER,
    SUCCESSOR_VERSION,
    UINT32,
    UINT32_MAX,
    UNSTAMPED_SUCCESSOR_VERSION,
    VALUE_HEADER,
    VALUE_VERSION,
    file_problem,
)

# Records the drafter's start-up walk reads per table (walk_table's max_records): measured
# 0.85 s here with the file cached, 2.3 s from disk, so a drafter with a few big tables
# reaches SERVING in seconds, not minutes; a table of up to ~40 MB tracked (~44 bytes a
# record) holds fewer and is walked whole.
STARTUP_WALK_RECORDS = 1_000_000
# Signals LMDB dies of on a damaged page: an assertion (abort), or a pointer into nowhere.
_DAMAGE_SIGNALS = (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE)
_CHILD_WALK = "import sys; from drafter_service.table_check import _walk_in_child; _walk_in_child(sys.argv[1:])"


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
    the format (``table_format``). ``max_records`` is shared out in proportion to the sub-databases' sizes;
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
        if names not in DATABASES_OF_VERSION.values():
            raise _Unsound(f"its sub-databases are {sorted(names)}, not this store's")
        dbs = {name: self.env.open_db(name, txn=self.txn, create=False) for name in names}
        epoch, tick = self._meta(dbs[b"meta"])
        if names != DATABASES_OF_VERSION[self.version]:  # type: ignore[index]  # _meta set it
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
        version = records.get(META_VERSION)
        if version is None or len(version) != 1 or version[0] not in DATABASES_OF_VERSION:
            raise _Unsound(f"format version {version!r}; this code reads {FORMAT_VERSION} (and 1 to 3, migrating them)")
        self.version = version[0]
        layouts = (META_LAYOUT, REPLICA_META_LAYOUT) if self.version == FORMAT_VERSION else (OLDER_META_LAYOUT,)
        layout = {key: len(value) for key, value in records.items()}
        if layout not in layouts:
            raise _Unsound(f"its meta records are {sorted(records)}, not format {self.version}'s")
        self.meta_records = len(layout)
        tick = UINT32.unpack(records[META_SUCCESSOR_TICK])[0] if self.version == FORMAT_VERSION else None
        return UINT32.unpack(records[META_EPOCH])[0], tick

    def _cursor(self, db: Any, limit: int) -> Iterator[tuple[bytes, bytes]]:
        return islice(self.txn.cursor(db=db), limit)

    def _walked(self, what: str, walked: int, limit: int, entries: int) -> None:
        """Count a loop's records; a tree that ends before its header's count is damaged."""
        self.records += walked
        if walked < min(limit, entries):
            raise _Unsound(f"the {what} tree ends after {walked} records; its header counts {entries}")

    # The loops below run per record (millions): inlined checks, no helper calls.

    def _ngrams(self, db: Any, coldness: Any, limit: int, entries: int, epoch: int) -> None:
        get, previous, header, pair = self.txn.get, b"", VALUE_HEADER.size, PAIR_BYTES
        walked = 0
        for key, value in self._cursor(db, limit):
            walked += 1
            if key <= previous:  # a damaged tree can loop
                raise _Unsound(f"n-gram keys out of order at {key.hex()}")
            previous = key
            size = len(key)
            if size <= NAMESPACE_BYTES or size != NAMESPACE_BYTES + 1 + 4 * key[NAMESPACE_BYTES] or size > MAX_NGRAM_KEY_BYTES:
                raise _Unsound(f"n-gram key {key.hex()} is not namespace | n | n tokens")
            pairs, odd = divmod(len(value) - header, pair)
            if odd or not 0 < pairs <= MAX_CONTINUATIONS or value[0] != VALUE_VERSION:
                raise _Unsound(f"n-gram value of {key.hex()} is not version {VALUE_VERSION}, a header and 1..{MAX_CONTINUATIONS} pairs")
            _version, touched, total = VALUE_HEADER.unpack_from(value)
            if pairs == 1:
                count = UINT32.unpack_from(value, header + 4)[0]
                sound = touched <= epoch and total == count
            else:
                sound = touched <= epoch and _sound_pairs(PAIRS[pairs].unpack_from(value, header), total)
            if not sound:
                raise _Unsound(f"n-gram value of {key.hex()} breaks the format (epoch, total, or its continuations' order)")
            if get(EPOCH_TOTAL.pack(touched, total) + key, db=coldness) is None:
                raise _Unsound(f"n-gram record {key.hex()} has no coldness entry")
        self._walked("n-gram", walked, limit, entries)

    def _coldness(self, db: Any, limit: int, entries: int, epoch: int) -> None:
        previous, head = b"", EPOCH_TOTAL.size + NAMESPACE_BYTES + 1  # epoch, total, namespace, n
        walked = 0
        for key, value in self._cursor(db, limit):
            walked += 1
            if key <= previous:
                raise _Unsound(f"coldness keys out of order at {key.hex()}")
            previous = key
            size = len(key)
            if value or size < head or size != head + 4 * key[head - 1] or size > head + 4 * MAX_N:
                raise _Unsound(f"coldness entry {key.hex()} is not epoch | total | n-gram key, with no value")
            if UINT32.unpack_from(key)[0] > epoch:
                raise _Unsound(f"coldness entry {key.hex()} is from an epoch after the current {epoch}")
        self._walked("coldness", walked, limit, entries)

    def _applied(self, db: Any, limit: int, entries: int) -> None:
        previous, head = b"", UINT32.size + NAMESPACE_BYTES  # hour, namespace
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
        version, header = (SUCCESSOR_VERSION, SUCCESSOR_HEADER.size) if recency is not None else (UNSTAMPED_SUCCESSOR_VERSION, 1)
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
            if UINT32.unpack(stamp)[0] > tick:  # type: ignore[operator]  # format 4: a tick
                raise _Unsound(f"successor record {key.hex()} is stamped after the current tick {tick}")
            if get(stamp + key, db=recency) is None:
                raise _Unsound(f"successor record {key.hex()} has no successor-recency entry")
        self._walked("successor", walked, limit, entries)

    def _recency(self, db: Any, limit: int, entries: int, tick: int | None) -> None:
        previous, head = b"", UINT32.size + NAMESPACE_BYTES + 1  # stamp, namespace, n
        walked = 0
        for key, value in self._cursor(db, limit):
            walked += 1
            if key <= previous:
                raise _Unsound(f"successor-recency keys out of order at {key.hex()}")
            previous = key
            if value or len(key) < head or key[head - 1] not in (1, 2) or len(key) != head + 4 * key[head - 1]:
                raise _Unsound(f"successor-recency entry {key.hex()} is not stamp | successor key, with no value")
            if UINT32.unpack_from(key)[0] > tick:  # type: ignore[operator]  # format 4: a tick
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
