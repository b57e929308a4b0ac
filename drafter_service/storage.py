"""The store's lifecycle, apart from the gRPC service: the one-drafter-per-``--db``
lock, free disk space, and ``StoreRegistry`` (one ``LMDBNGramStore`` per vocabulary
fingerprint and learning scope under ``--db``, opened, quarantined and closed here).

Tables
------
A table is a folder of ``--db`` named for its vocabulary and scope (``scopes.table_name``):
``<fingerprint>`` for the default scope, ``<fingerprint>-<scope>`` for any other. Tables
written before scopes existed are therefore the default scope's, as they were: nothing
learned is lost, and nothing is migrated. Each table has its own size bound
(``--max-bytes``), successor-table bound and eviction, so one scope's flood never
evicts another scope's n-grams. ``--max-vocabularies`` bounds the vocabularies and
``--max-scopes`` the tables per vocabulary that writes may create.

Quarantine
----------
A table that cannot be served safely is moved aside, renamed
``<table>.quarantined-<time>`` in ``--db`` (kept for an operator: never deleted), and
the others go on serving; a later write to its vocabulary and scope creates a fresh table. At
start-up, before health says SERVING: each table is walked (``table_check.walk_tables``: every
record through its cursor and checked against the format, in a child process so that a
page on which LMDB aborts condemns the table rather than the drafter; tables above
``startup_walk_records`` are walked that far), and one whose walk finds a problem, or that
fails to open, is quarantined. While serving: a read or write that meets a damaged page or
record (``is_corruption``) quarantines its table there and then (``quarantine``); the
call gets ``StoreCorrupted`` and later calls find no table, or a fresh one.

A folder is deleted only when it provably never held data: no ``data.mdb`` at all, at most
a ``lock.mdb`` (LMDB's reader table, no data). That is what a creation cut short leaves
before LMDB creates the data file (the lock file is set up first). An empty ``data.mdb``
is quarantined: an emptied table (truncated, a botched restore) looks the same as a
creation cut in the instant between creating the file and writing its meta pages.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, NamedTuple

import lmdb

from drafter_service.config import DrafterConfig
from drafter_service.scopes import DEFAULT_SCOPE, split_table_name, table_name
from drafter_service.store import (  # noqa: F401 (StoreCorrupted, is_corruption: re-exported for the registry's callers)
    LMDBNGramStore,
    StoreClosed,
    StoreConfig,
    StoreCorrupted,
    is_corruption,
)
from drafter_service.table_check import STARTUP_WALK_RECORDS, walk_tables
from drafter_service.table_format import StoreFormatError
from specdec.flags import format_size

log = logging.getLogger(__name__)

# Observed tokens cost about this many table bytes (3 n-gram records with
# their coldness entries, measured ~250-300 bytes on fresh text).
TABLE_BYTES_PER_TOKEN = 300
# Epochs a full table spans: eviction takes the oldest epoch first, so with
# several epochs per table the newest n-grams are the last to go.
EPOCHS_PER_TABLE = 4


def epoch_tokens(max_bytes: int) -> int:
    """Tokens per decay epoch for a table of ``max_bytes``: 1 GiB -> 894,784."""
    return max(1000, max_bytes // (TABLE_BYTES_PER_TOKEN * EPOCHS_PER_TABLE))


class TooManyVocabularies(Exception):
    """No table is created: --max-vocabularies or --max-scopes is reached (the message says which)."""


class DiskFull(Exception):
    """Writes are refused: the disk holding --db is (nearly) full."""


class DiskSpace:
    """Free space on the disk holding --db, and whether writes are refused for want of it.

    Read before every commit and every table creation (a statvfs call), and by
    the janitor, which clears the refusal once an operator has freed space.
    """

    def __init__(self, root: Path, min_free_bytes: int) -> None:
        self.root, self.min_free_bytes = root, min_free_bytes
        self.full = False
        self.free_bytes = 0
        self._lock = threading.Lock()
        self.check()

    def check(self) -> bool:
        """Re-read the free space; True while writes are refused."""
        stat = os.statvfs(self.root)
        with self._lock:
            self.free_bytes = stat.f_bavail * stat.f_frsize
            full = self.free_bytes < self.min_free_bytes
            if full and not self.full:
                log.error("%s; drafts are still served", self.refusal())
            elif self.full and not full:
                log.warning("the disk holding %s has %d MiB free again: observations are written again", self.root, self.free_bytes >> 20)
            self.full = full
        return full

    def refusal(self) -> str:
        return (
            f"the disk holding the drafter's tables ({self.root}) has {self.free_bytes >> 20} MiB free, below "
            f"--min-free-bytes {format_size(self.min_free_bytes)}: observations are refused until space is freed"
        )


class DirectoryLocked(RuntimeError):
    pass


# In --db: the pid of the drafter that serves the directory, for the message a second one
# prints. Information only: the lock is the directory's own (see _DirectoryLock).
LOCK_FILE_NAME = "drafter.lock"


class _DirectoryLock:
    """``root`` held for this process's life: flock on the directory itself, which the kernel
    drops when the process dies and which no file deletion can undo (a lock on a file inside
    is lost with the file: a second drafter recreates it and locks that). The pid file is
    locked too, so that drafters of older versions, which lock only it, still exclude this one."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._directory = os.open(root, os.O_RDONLY | os.O_DIRECTORY)  # not inherited by children (PEP 446)
        self._pid_file: IO[str] | None = None
        try:
            fcntl.flock(self._directory, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._pid_file = open(root / LOCK_FILE_NAME, "a+")
            fcntl.flock(self._pid_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.close()
            raise DirectoryLocked(
                f"another drafter ({self._holder()}) is serving --db {root}: two processes writing one store would corrupt it; "
                "stop that one, or give this one its own --db"
            ) from None
        except BaseException:
            self.close()
            raise
        self._pid_file.seek(0)
        self._pid_file.truncate()
        self._pid_file.write(f"pid {os.getpid()}\n")
        self._pid_file.flush()

    def _holder(self) -> str:
        try:
            return (self.root / LOCK_FILE_NAME).read_text().strip() or "another process"
        except OSError:  # deleted: the directory's lock still holds
            return "another process"

    @property
    def closed(self) -> bool:
        return self._directory < 0

    def close(self) -> None:
        """Release the lock (closing the descriptors drops the flocks)."""
        if self._pid_file is not None:
            self._pid_file.close()
            self._pid_file = None
        if self._directory >= 0:
            os.close(self._directory)
            self._directory = -1


class Quarantined(NamedTuple):
    """A table set aside: its name (``scopes.table_name``), the folder's new name (None: it
    could not be renamed, and is refused until restart), why, and whether at start-up."""

    table: str
    aside: str | None
    reason: str
    at_startup: bool


# listener(table, reason): told of each table set aside (the table's name, ``scopes.table_name``).
QuarantineListener = Callable[[str, str], None]


class StoreRegistry:
    """One store per (vocabulary fingerprint, scope), opened on first use and kept open.

    Only writes create a table (``get``); reads look one up (``find``), so a
    stranger's fingerprint or scope in a read-only call costs nothing. Tables are
    created for at most ``max_vocabularies`` vocabularies and ``max_scopes`` scopes of
    each; those found at start-up always open (after their walk: see the module
    docstring; ``startup_walk_records`` None walks them whole). Tables are named by
    ``scopes.table_name`` here: ``all``, ``quarantine`` and the listeners use that name.
    """

    def __init__(self, config: DrafterConfig, startup_walk_records: int | None = STARTUP_WALK_RECORDS) -> None:
        self.config = config
        self.root = Path(config.db)
        self.root.mkdir(parents=True, exist_ok=True)
        self._directory_lock = _DirectoryLock(self.root)
        self.disk = DiskSpace(self.root, config.min_free_bytes)
        self._stores: dict[str, LMDBNGramStore] = {}
        self._lock = threading.Lock()  # guards _stores, _refused, quarantined, _listeners
        self._refused: dict[str, str] = {}  # table -> why: set aside but not renamed
        self.quarantined: list[Quarantined] = []  # every table set aside, in order
        self._listeners: list[QuarantineListener] = []
        try:
            self._open_existing(startup_walk_records)
        except BaseException:
            self.close()
            raise

    def _open_existing(self, walk_records: int | None) -> None:
        """Reopen the warm tables found in --db, each after its walk; quarantine the unservable."""
        tables = [entry for entry in sorted(self.root.iterdir()) if entry.is_dir() and split_table_name(entry.name) is not None]
        for table in [table for table in tables if _never_held_data(table)]:
            log.warning("table %s was never completed (its creation was cut short, a full disk?): removed, it held nothing", table.name)
            shutil.rmtree(table)
            tables.remove(table)
        for table, walk in zip(tables, walk_tables(tables, walk_records)):
            if walk.problem is not None:
                self._set_aside(table.name, walk.problem, at_startup=True)
                continue
            if not walk.whole:
                log.info(
                    "table %s: walked %d of its %d records at start-up (the first of each sub-database); the rest are "
                    "checked as they are read, and by python -m drafter_service.check",
                    table.name,
                    walk.records,
                    walk.entries,
                )
            try:
                self.get(*_split(table.name), create=False)
            except DiskFull as full:  # not the table's fault: opened on first write once there is room
                log.error("table %s not opened at start-up: %s", table.name, full)
            except (StoreFormatError, lmdb.Error) as error:  # one bad table must not stop the others
                self._set_aside(table.name, f"{type(error).__name__}: {error}", at_startup=True)

    # -- quarantine

    def quarantine(self, table: str, error: BaseException | str, store: LMDBNGramStore | None = None) -> bool:
        """Set the table named ``table`` aside: forgotten here (a later write creates a fresh one),
        closed once the calls still in it end, its folder renamed. Thread-safe and idempotent:
        True if this call set it aside; False if it was already (or never open), or if ``store``
        is given and is no longer the table served (a late report about one already replaced)."""
        reason = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        with self._lock:
            current = self._stores.get(table)
            if current is None or (store is not None and store is not current):
                return False
            del self._stores[table]
            current.retire(f"was set aside as unservable ({reason})")
            record = self._move_aside(table, reason, at_startup=False)  # under the lock: no get() reopens it first
        self._tell(record)
        return True

    def _on_corruption(self, store: LMDBNGramStore, error: BaseException) -> None:
        """A store's report of a damaged page or record, met by one of its calls."""
        self.quarantine(Path(store.config.path).name, error, store=store)

    def add_quarantine_listener(self, listener: QuarantineListener) -> None:
        """Call ``listener(table, reason)`` for each table set aside: at once for those
        already (at start-up), then as it happens (from the thread that found the damage)."""
        with self._lock:
            self._listeners.append(listener)
            past = list(self.quarantined)
        for record in past:
            self._tell_one(listener, record)

    def _tell(self, record: Quarantined) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            self._tell_one(listener, record)

    @staticmethod
    def _tell_one(listener: QuarantineListener, record: Quarantined) -> None:
        try:
            listener(record.table, record.reason)
        except Exception:  # a listener's bug must not fail the call that found the damage
            log.exception("quarantine listener failed for table %s", record.table)

    def _set_aside(self, name: str, reason: str, at_startup: bool) -> None:
        with self._lock:
            record = self._move_aside(name, reason, at_startup)
        self._tell(record)

    def _move_aside(self, name: str, reason: str, at_startup: bool) -> Quarantined:
        """Rename the table's folder (the caller holds the lock)."""
        table = self.root / name
        stamp = time.strftime("%Y%m%dT%H%M%S")
        aside = table.with_name(f"{name}.quarantined-{stamp}")
        for attempt in range(2, 1000):  # twice in one second: another name, never over the first
            if not aside.exists():
                break
            aside = table.with_name(f"{name}.quarantined-{stamp}-{attempt}")
        try:
            table.rename(aside)
        except OSError as failure:
            self._refused[name] = f"was set aside as unservable ({reason}) but could not be moved aside ({failure})"
            record = Quarantined(name, None, reason, at_startup)
            log.error("table %s cannot be served (%s) and could not be moved aside (%s): refused until restart", name, reason, failure)
        else:
            record = Quarantined(name, aside.name, reason, at_startup)
            log.error(
                "table %s cannot be served (%s); moved aside to %s, serving the others. python -m drafter_service.check --db %s says more",
                name,
                reason,
                aside.name,
                self.root,
            )
        self.quarantined.append(record)
        return record

    # -- tables

    def find(self, vocabulary: str, scope: str = DEFAULT_SCOPE) -> LMDBNGramStore | None:
        return self._stores.get(table_name(vocabulary, scope))

    def get(self, vocabulary: str, scope: str = DEFAULT_SCOPE, create: bool = True) -> LMDBNGramStore:
        name = table_name(vocabulary, scope)
        store = self._stores.get(name)
        if store is not None:
            return store
        with self._lock:
            if name in self._refused:
                raise StoreClosed(f"table {name} {self._refused[name]}")
            if name not in self._stores:
                if create:
                    self._check_room(vocabulary, scope)
                self._stores[name] = self._open(name, vocabulary)
            return self._stores[name]

    def _check_room(self, vocabulary: str, scope: str) -> None:
        """TooManyVocabularies unless a table for (vocabulary, scope) may be created (the caller holds the lock)."""
        held = [_split(name) for name in self._stores]
        vocabularies = {held_vocabulary for held_vocabulary, _ in held}
        if vocabulary not in vocabularies and len(vocabularies) >= self.config.max_vocabularies:
            raise TooManyVocabularies(
                f"the drafter already holds {len(vocabularies)} vocabularies (limit {self.config.max_vocabularies}, "
                f"--max-vocabularies); {vocabulary} gets no table"
            )
        scopes = sum(held_vocabulary == vocabulary for held_vocabulary, _ in held)
        if scopes >= self.config.max_scopes:
            raise TooManyVocabularies(
                f"the drafter already holds {scopes} scopes of vocabulary {vocabulary} (limit {self.config.max_scopes}, "
                "--max-scopes): this scope learns nothing, and drafts from its requests' own contexts"
            )

    def check_room(self, vocabulary: str, scope: str) -> None:
        """TooManyVocabularies unless (vocabulary, scope) has a table or may get one. Creates
        nothing (a replica's tables are created as it applies the log)."""
        with self._lock:
            if table_name(vocabulary, scope) not in self._stores:
                self._check_room(vocabulary, scope)

    def drop(self, vocabulary: str, scope: str) -> bool:
        """Delete the (vocabulary, scope) table, its data with it (an operator's Forget): True if
        there was one. Calls in it finish first; later ones find no table."""
        name = table_name(vocabulary, scope)
        with self._lock:
            store = self._stores.pop(name, None)
            if store is not None:
                store.close()
            folder = self.root / name
            if not folder.exists():
                return store is not None
            doomed = self.root / f".dropped-{name}-{time.time_ns()}"
            folder.rename(doomed)  # atomic: no half-deleted table is ever opened
        shutil.rmtree(doomed, ignore_errors=True)
        log.warning("table %s dropped (forgotten)", name)
        return True

    def replace_tables(self, staging: Path) -> None:
        """Serve the table folders in ``staging`` (a peer's snapshot) instead of those held:
        the held ones are closed and deleted, the new ones moved in and opened."""
        with self._lock:
            for store in self._stores.values():
                store.close()
            self._stores.clear()
            trash = self.root / f".replaced-{time.time_ns()}"
            trash.mkdir()
            for entry in self.root.iterdir():
                if entry.is_dir() and split_table_name(entry.name) is not None:
                    entry.rename(trash / entry.name)
            for entry in sorted(staging.iterdir()):
                if entry.is_dir() and split_table_name(entry.name) is not None:
                    entry.rename(self.root / entry.name)
        shutil.rmtree(trash, ignore_errors=True)
        for entry in sorted(self.root.iterdir()):
            if entry.is_dir() and split_table_name(entry.name) is not None:
                try:
                    self.get(*_split(entry.name), create=False)
                except (StoreFormatError, lmdb.Error) as error:
                    self._set_aside(entry.name, f"{type(error).__name__}: {error}", at_startup=False)

    def scopes(self) -> int:
        """Tables served (one per vocabulary and scope)."""
        return len(self._stores)

    def _open(self, name: str, vocabulary: str) -> LMDBNGramStore:
        """Open (or create) a table, never on a full disk: LMDB writes its new files
        through a map, where running out of space is a SIGBUS rather than an error."""
        table = self.root / name
        new = not table.exists()
        if new and self.disk.check():  # an existing table opens read-mostly: reserve_lock_file guards it
            raise DiskFull(f"{self.disk.refusal()}; table {name} not opened")
        try:
            store_config = StoreConfig(
                path=str(table),
                namespace=bytes.fromhex(vocabulary),
                n_min=self.config.ngram.n_min,
                n_max=self.config.ngram.n_max,
                max_bytes=self.config.max_bytes,
                epoch_observations=epoch_tokens(self.config.max_bytes),
                dedup_window_hours=self.config.dedup_window_hours,
                max_successor_entries=self.config.max_successor_entries,
            )
            return LMDBNGramStore(store_config, on_corruption=self._on_corruption)
        except (OSError, lmdb.Error) as error:
            if new and table.exists():  # leave no half-made table behind
                shutil.rmtree(table, ignore_errors=True)
            if self.disk.check() or (isinstance(error, OSError) and error.errno == errno.ENOSPC):
                raise DiskFull(f"{self.disk.refusal()}; table {name} not opened") from error
            raise

    def all(self) -> dict[str, LMDBNGramStore]:
        return dict(self._stores)

    def tables_of(self, vocabulary: str) -> dict[str, LMDBNGramStore]:
        """The vocabulary's tables served now (one per scope), by name."""
        return {name: store for name, store in self.all().items() if _split(name)[0] == vocabulary}

    def table_stats(self) -> dict[str, dict[str, int]]:
        """Per vocabulary, its tables' ``stats()`` summed over its scopes, with ``scopes`` (how
        many tables); a table set aside meanwhile is left out (for /metrics and Stats, which
        count scopes and never name them)."""
        stats: dict[str, dict[str, int]] = {}
        for name, store in self.all().items():
            try:
                table = store.stats()
            except StoreClosed:
                continue
            summed = stats.setdefault(_split(name)[0], {"scopes": 0})
            summed["scopes"] += 1
            for stat in SUMMED_STATS:
                summed[stat] = summed.get(stat, 0) + table.get(stat, 0)
        return stats

    def close(self) -> None:
        with self._lock:
            for store in self._stores.values():
                store.close()
            self._stores.clear()
            if not self._directory_lock.closed:
                self._directory_lock.close()  # releases the flock


# The stats of a table that add up over a vocabulary's scopes.
SUMMED_STATS = ("entries", "bytes", "page_bytes", "file_bytes", "evictions", "successor_entries", "successor_evictions")


def _split(name: str) -> tuple[str, str]:
    """(vocabulary, scope) of a table this registry holds (its names always split)."""
    split = split_table_name(name)
    assert split is not None, f"not a table name: {name!r}"
    return split


def _never_held_data(table: Path) -> bool:
    """A table folder that provably never held data: no data.mdb, at most LMDB's lock file."""
    return {entry.name for entry in table.iterdir()} <= {"lock.mdb"}
