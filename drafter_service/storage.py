"""The store's lifecycle, apart from the gRPC service: the one-drafter-per-``--db``
lock, free disk space, and ``StoreRegistry`` (one ``LMDBNGramStore`` per vocabulary
fingerprint under ``--db``, opened, quarantined and closed here)."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import threading
import time
from pathlib import Path

import lmdb

from drafter_service.config import VOCABULARY_PATTERN, DrafterConfig
from drafter_service.store import LMDBNGramStore, StoreConfig, StoreFormatError

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
    pass


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
            f"--min-free-mb {self.min_free_bytes >> 20}: observations are refused until space is freed"
        )


class DirectoryLocked(RuntimeError):
    pass


# In --db: held (flock) by the one drafter process that serves the directory.
LOCK_FILE_NAME = "drafter.lock"


def _lock_directory(root: Path):
    """Hold ``root``'s lock file for this process's life (the kernel drops it when the process dies)."""
    handle = open(root / LOCK_FILE_NAME, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise DirectoryLocked(
            f"another drafter ({holder}) is serving --db {root}: two processes writing one store would corrupt it; "
            "stop that one, or give this one its own --db"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}\n")
    handle.flush()
    return handle


class StoreRegistry:
    """One store per vocabulary fingerprint, opened on first use and kept open.

    Only writes create a table (``get``); reads look one up (``find``), so a
    stranger's fingerprint in a read-only call costs nothing. At most
    ``max_vocabularies`` tables are created; those found at start-up always open.
    """

    def __init__(self, config: DrafterConfig) -> None:
        self.config = config
        self.root = Path(config.db)
        self.root.mkdir(parents=True, exist_ok=True)
        self._directory_lock = _lock_directory(self.root)
        self.disk = DiskSpace(self.root, config.min_free_mb << 20)
        self._stores: dict[str, LMDBNGramStore] = {}
        self._lock = threading.Lock()
        self.quarantined: list[str] = []  # tables set aside at start-up, as renamed
        for existing in sorted(self.root.iterdir()):  # reopen warm tables at start-up
            if not (existing.is_dir() and VOCABULARY_PATTERN.fullmatch(existing.name)):
                continue
            if _half_made(existing):
                log.warning(
                    "table %s was never completed (its creation was cut short, a full disk?): removed, it held nothing", existing.name
                )
                shutil.rmtree(existing)
                continue
            try:
                self.get(existing.name, create=False)
            except DiskFull as full:  # not the table's fault: opened on first write once there is room
                log.error("table %s not opened at start-up: %s", existing.name, full)
            except (StoreFormatError, lmdb.Error) as error:  # one bad table must not stop the others
                self._quarantine(existing, error)

    def _quarantine(self, table: Path, error: BaseException) -> None:
        aside = table.with_name(f"{table.name}.quarantined-{time.strftime('%Y%m%dT%H%M%S')}")
        table.rename(aside)
        self.quarantined.append(aside.name)
        log.error(
            "table %s cannot be served (%s); moved aside to %s, serving the others. python -m drafter_service.check --db %s says more",
            table.name,
            error,
            aside.name,
            self.root,
        )

    def find(self, vocabulary: str) -> LMDBNGramStore | None:
        return self._stores.get(vocabulary)

    def get(self, vocabulary: str, create: bool = True) -> LMDBNGramStore:
        store = self._stores.get(vocabulary)
        if store is not None:
            return store
        with self._lock:
            if vocabulary not in self._stores:
                if create and len(self._stores) >= self.config.max_vocabularies:
                    raise TooManyVocabularies(
                        f"the drafter already holds {len(self._stores)} vocabularies (limit {self.config.max_vocabularies}, "
                        f"--max-vocabularies); {vocabulary} gets no table"
                    )
                self._stores[vocabulary] = self._open(vocabulary)
            return self._stores[vocabulary]

    def _open(self, vocabulary: str) -> LMDBNGramStore:
        """Open (or create) a table, never on a full disk: LMDB writes its new files
        through a map, where running out of space is a SIGBUS rather than an error."""
        table = self.root / vocabulary
        new = not table.exists()
        if new and self.disk.check():  # an existing table opens read-mostly: reserve_lock_file guards it
            raise DiskFull(f"{self.disk.refusal()}; table {vocabulary} not opened")
        try:
            store_config = StoreConfig(
                path=str(table),
                namespace=bytes.fromhex(vocabulary),
                n_min=self.config.ngram.n_min,
                n_max=self.config.ngram.n_max,
                max_bytes=self.config.max_bytes,
                epoch_observations=epoch_tokens(self.config.max_bytes),
                dedup_window_hours=self.config.dedup_window_hours,
            )
            return LMDBNGramStore(store_config)
        except (OSError, lmdb.Error) as error:
            if new and table.exists():  # leave no half-made table behind
                shutil.rmtree(table, ignore_errors=True)
            if self.disk.check() or (isinstance(error, OSError) and error.errno == errno.ENOSPC):
                raise DiskFull(f"{self.disk.refusal()}; table {vocabulary} not opened") from error
            raise

    def all(self) -> dict[str, LMDBNGramStore]:
        return dict(self._stores)

    def close(self) -> None:
        with self._lock:
            for store in self._stores.values():
                store.close()
            self._stores.clear()
            if not self._directory_lock.closed:
                self._directory_lock.close()  # releases the flock


def _half_made(table: Path) -> bool:
    """A table folder whose creation was cut short: a lock file at most, no data."""
    data_file = table / "data.mdb"
    if data_file.exists() and data_file.stat().st_size > 0:
        return False
    return {entry.name for entry in table.iterdir()} <= {"lock.mdb", "data.mdb"}
