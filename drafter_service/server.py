"""The drafter as a gRPC service: sessions in memory, the global table in LMDB.

Sessions (a request's prompt and output, indexed incrementally) live in this
process only: they are cheap to rebuild, and a restarted drafter answers
NOT_FOUND for them, which the verifier treats as "reopen". The global table
is an ``LMDBNGramStore`` per vocabulary fingerprint, under ``db/<fingerprint>``,
so what was learned survives restarts, redeploys and kill -9.

Writes never block ``Propose``: ``Observe`` and ``CloseSessions`` hand their
sequences to one writer thread, which commits whatever has queued in a single
transaction (group commit) and only then acknowledges: acknowledged means
durable. Reads run in their own LMDB read transactions and never wait.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import queue
import re
import shutil
import threading
import time
from collections import deque
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import lmdb
from grpc_health.v1 import health

from drafter_service.metrics import DrafterMetrics
from drafter_service.ngram import SOURCE_CONTEXT, SOURCE_GLOBAL, NGramConfig, NGramSource
from drafter_service.sessions import (
    BAD_FEEDBACK,
    BUSY,
    EXISTS,
    FULL,
    UNKNOWN,
    WRONG_VOCABULARY,
    Session,
    SessionError,
    SessionLimits,
    SessionTable,
)
from drafter_service.store import MAX_OBSERVE_ID_BYTES, LMDBNGramStore, StoreConfig, StoreFormatError, StoreFull
from specdec import serving, telemetry
from specdec.flags import check_minimums, setting
from specdec.v1 import drafter_pb2, drafter_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name
# Beside Prometheus' own 9090 without clashing with the usual node exporters.
DEFAULT_METRICS_PORT = 9101
VOCABULARY_PATTERN = re.compile(r"[0-9a-f]{16}")  # always with fullmatch: "$" also matches before a final newline
# A backup's name: one plain path component, nothing a filesystem reads specially.
BACKUP_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SOURCES = {SOURCE_CONTEXT: drafter_pb2.DRAFT_SOURCE_CONTEXT, SOURCE_GLOBAL: drafter_pb2.DRAFT_SOURCE_GLOBAL}
# What the caller hears when SessionTable refuses a call.
SESSION_STATUS = {
    EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    UNKNOWN: grpc.StatusCode.NOT_FOUND,
    WRONG_VOCABULARY: grpc.StatusCode.INVALID_ARGUMENT,
    BUSY: grpc.StatusCode.ABORTED,
    FULL: grpc.StatusCode.RESOURCE_EXHAUSTED,
    BAD_FEEDBACK: grpc.StatusCode.INVALID_ARGUMENT,
}


@dataclass(frozen=True)
class DrafterConfig:
    """The drafter's settings; each field is a flag and a SPECDEC_DRAFTER_* variable
    (``specdec.flags``), apart from SERVING_FIELDS. Lower bounds hold in-process too."""

    port: int = setting(50051, help="gRPC port (0: a free one; tests, several instances on one host)")
    host: str = setting("127.0.0.1", help="address to bind")
    db: str = setting("data/drafter", help="directory of the LMDB tables, one per vocabulary fingerprint")
    # 1 GiB is days of a busy service's n-grams.
    max_bytes: int = setting(1 << 30, minimum=1 << 16, help="size bound per vocabulary's table, in bytes")
    ngram: NGramConfig = field(default_factory=NGramConfig)
    # Verification cost grows with K, and n-gram chains rarely stay right for
    # more than a few dozen tokens.
    max_draft_tokens: int = setting(32, minimum=1, help="draft tokens one sequence may ask for")
    # Above every real vocabulary (~260k), far below uint32 overflow, so a
    # corrupt id fails loudly instead of polluting the table.
    max_token_id: int = setting(1 << 24, minimum=1, help="token ids must be below this")
    # Each is a small dict of its context's n-grams.
    max_sessions: int = setting(10_000, minimum=1, help="sessions open at once")
    # A verifier needs one per in-flight request (a batch is at most a few
    # hundred), so no single client, broken or hostile, can take every session from the others.
    max_sessions_per_caller: int = setting(
        2048, minimum=1, help="sessions one caller (client certificate, else peer address) holds at once"
    )
    # Indexed, ~600 bytes each: a 128K-token context, and ~80 MB per session at most.
    max_session_tokens: int = setting(1 << 17, minimum=1, help="tokens one session may hold")
    # Its verifier request is surely gone by then.
    session_idle_timeout_s: float = setting(600.0, minimum=0.001, help="seconds after which an untouched session is closed")
    # A verifier batch is at most a few hundred.
    max_sequences_per_call: int = setting(1024, minimum=1, help="sequences in one Propose or Observe")
    # A 128K-token context; bounds one call's memory and time.
    max_tokens_per_call: int = setting(1 << 17, minimum=1, help="tokens in one Propose or Observe")
    max_pending_observations: int = setting(
        4096, minimum=1, help="observations queued for the writer; beyond, Observe answers RESOURCE_EXHAUSTED"
    )
    # 128K uint32 tokens encode to at most ~0.7 MB.
    max_message_bytes: int = setting(8 << 20, minimum=1, help="gRPC message size cap, both ways, in bytes")
    grace_s: float = setting(5.0, minimum=0.0, help="seconds SIGTERM gives in-flight calls")
    max_workers: int = setting(16, minimum=1, help="gRPC worker threads: calls served at once")
    # One LMDB table each: 3 file descriptors and 8x max_bytes of address space;
    # a deployment serves one or two models.
    max_vocabularies: int = setting(8, minimum=1, help="tables (one per tokenizer fingerprint) the drafter creates")
    dedup_window_hours: int = setting(24, minimum=1, help="hours an observe_id is remembered, so that a retry is not counted twice")
    # One commit of a 128K-token call dirties ~40 MB; as etcd's NOSPACE alarm,
    # Propose keeps serving, and writes resume once space is back.
    min_free_mb: int = setting(
        64, minimum=1, help="MiB the disk holding --db keeps free: below, writes are refused (RESOURCE_EXHAUSTED) and drafts still served"
    )
    # When set, the main port refuses Stats and Backup (PERMISSION_DENIED), so
    # verifiers' network reaches only Propose, Observe, CloseSessions.
    admin_port: int | None = setting(
        None, help="serve Stats and Backup on this port only, on --admin-host (0: a free one; none: on the main port)"
    )
    admin_host: str = setting("127.0.0.1", help="address of the admin port")
    # One folder per backup, named by the caller. Never the --db directory or inside it.
    backup_dir: str | None = setting(None, help="directory the Backup RPC writes into, outside --db (none: Backup refused)")
    # The flags every service shares (serving.add_serving_flags):
    # Prometheus /metrics port (0: a free one; None: not served, the default
    # for in-process servers; the command line serves on DEFAULT_METRICS_PORT).
    metrics_port: int | None = None
    # Plaintext gRPC health Check outside the worker pool (serving.serve_health); None: not served.
    health_port: int | None = None
    # PEM certificate and key: serve over TLS when both are set.
    tls_cert: str | None = None
    tls_key: str | None = None
    # PEM CA: require client certificates it signed (mutual TLS).
    tls_client_ca: str | None = None

    def __post_init__(self) -> None:
        check_minimums(self)
        if self.backup_dir is not None:
            backups, db = Path(self.backup_dir).resolve(), Path(self.db).resolve()
            if backups == db or db in backups.parents:
                raise ValueError(f"the backup directory {self.backup_dir!r} must lie outside the table directory {self.db!r}")


SERVING_FIELDS = ("tls_cert", "tls_key", "tls_client_ca", "metrics_port", "health_port")


# Seconds between the janitor's rounds (idle sessions, dead readers' slots).
JANITOR_INTERVAL_S = 5.0
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


class _NoTable:
    """What Propose reads for a vocabulary with no table yet: no n-grams."""

    def best(self, key):
        return None

    def continuations(self, key):
        return None


_NO_TABLE = _NoTable()


# A long observation is committed in chunks of this many tokens (~0.1 s each
# here), and one transaction takes at most WRITE_BATCH_TOKENS, so a 128K-token
# call (~4.5 s to commit whole) never holds the writer while small ones wait.
CHUNK_TOKENS = 4096
WRITE_BATCH_TOKENS = 8192
# Bytes an observe id keeps free for a chunk's "#<index>" suffix.
CHUNK_SUFFIX_BYTES = 8


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

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    @property
    def chunks(self) -> int:
        return max(1, -(-len(self.tokens) // CHUNK_TOKENS))

    def chunk(self, index: int) -> tuple[str | None, list[int], int]:
        """Chunk ``index`` as the store applies it: (id, tokens, start). Each chunk is
        de-duplicated under its own id, so a retry after a partial commit stores only
        the rest; it carries the n_max tokens before it as context (see count_ngrams)."""
        if self.chunks == 1:
            return self.observe_id, self.tokens, 0
        low = index * CHUNK_TOKENS
        context = min(low, self.store.config.n_max)
        chunk_id = None if self.observe_id is None else f"{self.observe_id}#{index}"
        return chunk_id, self.tokens[low - context : low + CHUNK_TOKENS], context


class ObservationWriter(threading.Thread):
    """The only writer: commits queued observations in groups, then acknowledges them.

    Fair to small calls: each transaction takes the next chunk of every waiting
    observation that fits in WRITE_BATCH_TOKENS, round-robin, so a small Observe
    is stored in the first transaction after it arrives, whatever long ones are
    in progress, and long ones always advance.
    """

    def __init__(self, max_pending: int, disk: DiskSpace) -> None:
        super().__init__(name="drafter-writer", daemon=True)
        self.queue: queue.Queue[_Pending | None] = queue.Queue(maxsize=max_pending)
        self.disk = disk

    def submit(self, items: list[_Pending]) -> None:
        for item in items:
            self.queue.put_nowait(item)  # queue.Full -> the caller answers RESOURCE_EXHAUSTED

    def run(self) -> None:
        waiting: deque[_Pending] = deque()  # with chunks left, the longest-waiting first
        stopping = False
        while True:
            while True:  # block only when there is nothing to do
                try:
                    item = self.queue.get(block=not (waiting or stopping))
                except queue.Empty:
                    break
                if item is None:
                    stopping = True
                else:
                    waiting.append(item)
            if not waiting:
                if stopping:
                    return
                continue
            group: list[tuple[_Pending, int]] = []
            try:
                group = self._next_group(waiting)
                self._commit(group)
            except Exception as error:  # a bug here must never leave callers waiting forever
                log.exception("the observation writer failed; failing what it holds")
                group = [*group, *((item, 0) for item in waiting)]
                waiting.clear()
                for item, _ in group:
                    item.error = item.error or error
            for item in dict.fromkeys(item for item, _ in group):  # an item may have several chunks in it
                if item.error is None and item.next_chunk < item.chunks and item.expired():
                    # Its caller has given up: the chunks stored are kept (a retry skips them by id).
                    item.error = TimeoutError("the caller's deadline passed before the observation was stored whole")
                if item.error is None and item.next_chunk < item.chunks:
                    waiting.append(item)
                else:
                    item.done.set()

    @staticmethod
    def _next_group(waiting: deque[_Pending]) -> list[tuple[_Pending, int]]:
        """One transaction's chunks, within WRITE_BATCH_TOKENS: the next chunk of every
        waiting observation that fits, in waiting order (always the first); then, with
        room left, more chunks of those taken. Those that did not fit stay first in line."""
        group: list[tuple[_Pending, int]] = []
        tokens = 0

        def size(item: _Pending) -> int:  # its next chunk's own tokens
            return min(len(item.tokens) - item.next_chunk * CHUNK_TOKENS, CHUNK_TOKENS)

        def take(item: _Pending) -> None:
            nonlocal tokens
            tokens += size(item)
            group.append((item, item.next_chunk))
            item.next_chunk += 1

        skipped = []
        while waiting:
            item = waiting.popleft()
            if group and tokens + size(item) > WRITE_BATCH_TOKENS:
                skipped.append(item)
            else:
                take(item)
        waiting.extend(skipped)
        for item in list(dict.fromkeys(item for item, _ in group)):
            while item.next_chunk < item.chunks and tokens + size(item) <= WRITE_BATCH_TOKENS:
                take(item)
        return group

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


def _caller(context) -> str:
    """Who calls, for per-caller limits: the client certificate's common name under
    mutual TLS, else the peer's address without its port (which changes per connection)."""
    names = context.auth_context().get("x509_common_name")
    if names:
        return "certificate " + names[0].decode("utf-8", "replace")
    peer = context.peer() or "unknown"  # "ipv4:10.0.0.7:51234", "ipv6:[::1]:51234", "unix:/path"
    host, _, port = peer.rpartition(":")
    return host if host and port.isdigit() else peer


def _expired(context) -> bool:
    remaining = context.time_remaining()
    return remaining is not None and remaining <= 0


class InvalidRequest(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _check(condition: bool, message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> None:
    if not condition:
        raise InvalidRequest(code, message)


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(
        self, config: DrafterConfig, stores: StoreRegistry, writer: ObservationWriter, tracing: telemetry.Tracing | None = None
    ) -> None:
        self.config = config
        self.stores = stores
        self.writer = writer
        self.tracing = tracing or telemetry.Tracing("specdec-drafter")
        limits = SessionLimits(config.max_sessions, config.max_sessions_per_caller, config.max_session_tokens)
        self.sessions = SessionTable(config.ngram, limits)
        self.metrics = metrics = DrafterMetrics()
        self.registry = metrics.registry
        metrics.watch("dropped_spans", "Trace spans dropped (collector down or queue full)", lambda: self.tracing.dropped_spans)
        metrics.gauge("quarantined_tables", "Tables moved aside at start-up as unservable", lambda: len(stores.quarantined))
        metrics.gauge("disk_full", "1 while observations are refused for want of disk space (--min-free-mb)", lambda: int(stores.disk.full))
        metrics.gauge("disk_free_bytes", "Free bytes on the disk holding --db, as last read", lambda: stores.disk.free_bytes)
        metrics.gauge("open_sessions", "Open sessions", lambda: len(self.sessions))
        metrics.watch_tables(lambda: {vocabulary: store.stats() for vocabulary, store in stores.all().items()})

    # -- validation (always before any state changes) -------------------------

    def _check_vocabulary(self, vocabulary: str) -> None:
        _check(
            bool(VOCABULARY_PATTERN.fullmatch(vocabulary)),
            f"vocabulary must be the 16-hex-digit fingerprint of the tokenizer, got {vocabulary!r}",
        )

    def _check_tokens(self, tokens, where: str) -> None:
        limit = self.config.max_token_id
        if tokens and max(tokens) >= limit:  # max() runs in C; find the culprit only on failure
            bad = next(t for t in tokens if t >= limit)
            _check(False, f"{where}: token id {bad} is out of range (must be < {limit})")

    def _check_propose(self, request: drafter_pb2.ProposeRequest) -> None:
        """The request's shape; what it asks of sessions is SessionTable.claim's to check."""
        self._check_vocabulary(request.vocabulary)
        self._check_call_size(len(request.sequences), sum(len(s.new_tokens) for s in request.sequences))
        seen = set()
        # Runs per sequence on every step: each message is formatted only when its check fails.
        invalid, max_k = grpc.StatusCode.INVALID_ARGUMENT, self.config.max_draft_tokens
        for index, sequence in enumerate(request.sequences):
            sid, where = sequence.session_id, f"sequences[{index}]"
            if not sid:
                raise InvalidRequest(invalid, f"{where}: session_id is empty")
            if sid in seen:
                raise InvalidRequest(invalid, f"{where}: session {sid!r} appears twice in one call")
            seen.add(sid)
            if sequence.num_draft_tokens > max_k:
                raise InvalidRequest(invalid, f"{where}: num_draft_tokens {sequence.num_draft_tokens} is out of range [0, {max_k}]")
            self._check_tokens(sequence.new_tokens, where)

    def _check_observe_id(self, observe_id: str, items: int) -> None:
        """Each of ``items`` is stored under ``observe_id/index``: all of those must fit."""
        _check(bool(observe_id), "observe_id is empty: give each Observe a unique id so retries are not counted twice")
        longest = len(observe_id.encode()) + 1 + len(str(max(items - 1, 0))) + CHUNK_SUFFIX_BYTES
        _check(
            longest <= MAX_OBSERVE_ID_BYTES,
            f"observe_id is {len(observe_id.encode())} bytes; with its '/index' suffix it must fit in "
            f"{MAX_OBSERVE_ID_BYTES - CHUNK_SUFFIX_BYTES}",
        )

    def _table(self, vocabulary: str, context) -> LMDBNGramStore:
        """The vocabulary's table, created on first write, within --max-vocabularies."""
        try:
            return self.stores.get(vocabulary)
        except (TooManyVocabularies, DiskFull) as full:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(full))
            raise  # unreached: abort raises

    def _check_sequences(self, sequences) -> None:
        self._check_call_size(len(sequences), sum(len(sequence.tokens) for sequence in sequences))
        for index, sequence in enumerate(sequences):
            self._check_tokens(sequence.tokens, f"sequences[{index}]")

    def _check_call_size(self, sequences: int, tokens: int) -> None:
        limits = self.config
        _check(
            sequences <= limits.max_sequences_per_call,
            f"{sequences} sequences in one call; the limit is {limits.max_sequences_per_call}",
        )
        _check(tokens <= limits.max_tokens_per_call, f"{tokens} tokens in one call; the limit is {limits.max_tokens_per_call}")

    # -- RPCs -------------------------------------------------------------------

    def Propose(self, request, context):
        started = time.perf_counter()
        with self.tracing.server_span("specdec.drafter.propose", context, {"specdec.sequences": len(request.sequences)}) as span:
            response = self._propose(request, context)
            span.set_attribute("specdec.draft_tokens", sum(len(draft.tokens) for draft in response.drafts))
        self.metrics.propose_seconds.observe(time.perf_counter() - started)
        return response

    def _propose(self, request, context):
        """Validate and claim the call's sessions under the lock (cheap); index the new
        tokens and draft outside it (O(tokens): one caller's big call never stalls the
        others). A call whose deadline passed does no work and leaves no session."""
        if _expired(context):
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed before the call was served")
        try:
            self._check_propose(request)
            sessions = self.sessions.claim(request.vocabulary, _caller(context), request.sequences)
        except InvalidRequest as invalid:
            context.abort(invalid.code, str(invalid))
        except SessionError as refused:
            context.abort(SESSION_STATUS[refused.kind], str(refused))
        updates = list(zip(request.sequences, sessions))
        store = self.stores.find(request.vocabulary)
        try:
            for update, session in updates:
                if update.verified_draft_tokens:
                    self._credit_feedback(session.feedback(update.verified_draft_tokens, update.accepted_draft_tokens))
                session.context.extend(update.new_tokens)
            # Drafting reads only this call's sessions and one LMDB read transaction
            # (no table yet for this vocabulary: drafts come from the contexts alone).
            with store.snapshot() if store is not None else contextlib.nullcontext(_NO_TABLE) as table:
                drafts = [self._draft(update, session, table) for update, session in updates]
        except BaseException:
            self.sessions.release(request.sequences, sessions, drop_opened=True)  # a session half-extended is no session
            raise
        if _expired(context):  # the caller gave up: it will reopen, so keep nothing it opened
            self.sessions.release(request.sequences, sessions, drop_opened=True)
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed while drafting; no session was kept")
        self.sessions.release(request.sequences, sessions, drop_opened=False)
        self._count([session.last_sources for session in sessions], asked=[update.num_draft_tokens > 0 for update in request.sequences])
        return drafter_pb2.ProposeResponse(drafts=drafts)

    def _count(self, sources: list[list[str]], asked: list[bool]) -> None:
        """Counters for one call; ``sources``: each draft's per-token sources."""
        drafts = []
        for draft_sources in sources:
            context_hits = draft_sources.count(SOURCE_CONTEXT)
            drafts.append((context_hits, len(draft_sources) - context_hits))
        self.metrics.proposed_call(drafts, misses=sum(wanted and not draft for draft, wanted in zip(sources, asked)))

    def _credit_feedback(self, verdicts: list[tuple[str, bool]]) -> None:
        """Count the verifier's verdict on a session's previous draft, per source."""
        for source, accepted in verdicts:
            self.metrics.verified.labels(source).inc()
            if accepted:
                self.metrics.accepted.labels(source).inc()

    def _draft(self, update, session: Session, table: NGramSource) -> drafter_pb2.SequenceDraft:
        """The session's draft, as the proto's parallel arrays."""
        chain = session.draft(table, update.num_draft_tokens)
        if not chain.tokens:
            return drafter_pb2.SequenceDraft(session_id=update.session_id)
        sources, match_lengths, counts, totals = zip(*chain.evidence)
        return drafter_pb2.SequenceDraft(
            session_id=update.session_id,
            tokens=chain.tokens,
            sources=[_SOURCES[source] for source in sources],  # type: ignore[misc]  # DraftSource values, as ints
            match_lengths=match_lengths,
            counts=counts,
            totals=totals,
        )

    def Observe(self, request, context):
        with self.tracing.server_span("specdec.drafter.observe", context, {"specdec.sequences": len(request.sequences)}):
            return self._observe(request, context)

    def _observe(self, request, context):
        try:
            self._check_vocabulary(request.vocabulary)
            self._check_observe_id(request.observe_id, len(request.sequences))
            self._check_sequences(request.sequences)
        except InvalidRequest as invalid:
            context.abort(invalid.code, str(invalid))
        if self.stores.disk.full:  # the janitor clears it once space is back
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self.stores.disk.refusal())
        store = self._table(request.vocabulary, context)
        items = [
            _Pending(store, f"{request.observe_id}/{index}", list(sequence.tokens)) for index, sequence in enumerate(request.sequences)
        ]
        self._commit(items, context)
        self.metrics.observed_tokens.inc(sum(len(item.tokens) for item in items if item.applied))
        applied = sum(item.applied for item in items)
        return drafter_pb2.ObserveResponse(
            applied=bool(applied) or not items,
            applied_sequences=applied,
            duplicate_sequences=len(items) - applied,
        )

    def CloseSessions(self, request, context):
        """Close sessions of ``vocabulary``; with ``observe``, their tokens go into its table
        first, and a session is closed only once that is stored (a failed call can be retried)."""
        sessions = self.sessions.lookup(request.session_ids)
        try:
            self._check_vocabulary(request.vocabulary)
            if request.observe:
                self._check_observe_id(request.observe_id, len(request.session_ids))
            for index, (sid, session) in enumerate(sessions.items()):
                _check(
                    session is None or session.vocabulary == request.vocabulary,
                    f"session_ids[{index}]: session {sid!r} was opened under another vocabulary",
                )
        except InvalidRequest as invalid:
            context.abort(invalid.code, str(invalid))
        ids = [sid for sid in request.session_ids if sessions[sid] is not None]
        if request.observe and ids:
            store = self._table(request.vocabulary, context)
            items = [_Pending(store, f"{request.observe_id}/{i}", list(sessions[sid].context.tokens)) for i, sid in enumerate(ids)]  # type: ignore[union-attr]
            self._commit(items, context)
        closed = self.sessions.close(ids)
        return drafter_pb2.CloseSessionsResponse(closed=len(closed))

    def _commit(self, items: list[_Pending], context) -> None:
        remaining = context.time_remaining()
        if remaining is not None:
            for item in items:
                item.deadline = time.monotonic() + remaining
        try:
            self.writer.submit(items)
        except queue.Full:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the drafter's write queue is full; retry with backoff")
        for item in items:
            item.done.wait()
        for item in items:
            if isinstance(item.error, DiskFull):
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(item.error))
            if isinstance(item.error, TimeoutError):
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"{item.error}; retry with the same observe_id to store the rest")
            if isinstance(item.error, StoreFull):
                context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"{sum(item.error is not None for item in items)} of {len(items)} sequences were not stored: the table has "
                    "no room now (a long-lived reader holds old pages); retry with the same observe_id, "
                    "the stored ones are not counted twice",
                )
            if item.error is not None:
                context.abort(grpc.StatusCode.INTERNAL, f"could not store the observation: {item.error}")

    def Stats(self, request, context):
        if request.vocabulary:
            try:
                self._check_vocabulary(request.vocabulary)
            except InvalidRequest as invalid:
                context.abort(invalid.code, str(invalid))
            stores = [store] if (store := self.stores.find(request.vocabulary)) is not None else []
        else:
            stores = list(self.stores.all().values())
        totals = {"entries": 0, "bytes": 0, "file_bytes": 0, "evictions": 0}
        for store in stores:
            stats = store.stats()
            for name in totals:
                totals[name] += stats.get(name, 0)
        return drafter_pb2.StatsResponse(
            **totals, max_bytes=self.config.max_bytes * max(1, len(stores)), open_sessions=len(self.sessions), **self.metrics.stats()
        )

    def Backup(self, request, context):
        """A compact copy of one table in ``--backup-dir``/``destination``. Callers learn
        nothing about the filesystem beyond that directory: failures are logged here."""
        try:
            _check(
                self.config.backup_dir is not None,
                "backups are off: start the drafter with --backup-dir DIR to allow them",
                grpc.StatusCode.FAILED_PRECONDITION,
            )
            self._check_vocabulary(request.vocabulary)
            _check(
                bool(BACKUP_NAME_PATTERN.fullmatch(request.destination)),
                f"destination must be a plain name of 1-128 letters, digits, '.', '_' or '-' (not starting with "
                f"'.', '_' or '-'), got {request.destination[:200]!r}; the backup goes into the drafter's backup directory",
            )
            _check(
                self.stores.find(request.vocabulary) is not None, f"no table for vocabulary {request.vocabulary}", grpc.StatusCode.NOT_FOUND
            )
        except InvalidRequest as invalid:
            context.abort(invalid.code, str(invalid))
        destination = Path(self.config.backup_dir) / request.destination
        try:
            Path(self.config.backup_dir).mkdir(parents=True, exist_ok=True)
            destination.mkdir()  # exclusive: two callers never share a folder
        except FileExistsError:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, f"a backup named {request.destination!r} already exists; pick another name")
        except OSError:
            log.exception("could not create backup folder %s", destination)
            context.abort(grpc.StatusCode.INTERNAL, "could not create the backup; the drafter's log says why")
        try:
            self.stores.get(request.vocabulary).backup(str(destination))
            size = sum(f.stat().st_size for f in destination.iterdir())
        except Exception:
            log.exception("backup of %s into %s failed", request.vocabulary, destination)
            shutil.rmtree(destination, ignore_errors=True)
            context.abort(grpc.StatusCode.INTERNAL, "the backup failed and was removed; the drafter's log says why")
        return drafter_pb2.BackupResponse(bytes=size)

    def expire_idle_sessions(self) -> int:
        return self.sessions.expire(self.config.session_idle_timeout_s)


class _ServingOnly(drafter_pb2_grpc.DrafterServicer):
    """The main port's face when admin calls have a port of their own."""

    def __init__(self, servicer: DrafterServicer) -> None:
        self.Propose, self.Observe, self.CloseSessions = servicer.Propose, servicer.Observe, servicer.CloseSessions  # type: ignore[method-assign]

    def Stats(self, request, context):
        context.abort(grpc.StatusCode.PERMISSION_DENIED, "Stats is served on the drafter's admin port only")

    def Backup(self, request, context):
        context.abort(grpc.StatusCode.PERMISSION_DENIED, "Backup is served on the drafter's admin port only")


@dataclass
class DrafterServer:
    server: grpc.Server
    port: int
    servicer: DrafterServicer
    health: health.HealthServicer
    stores: StoreRegistry
    writer: ObservationWriter
    metrics_port: int | None = None  # where /metrics is served; None: not served
    admin_server: grpc.Server | None = None  # Stats and Backup, when --admin-port is set
    admin_port: int | None = None
    health_port: int | None = None  # where the health-only server listens; None: not served
    _metrics_server: Any = None  # telemetry.start_metrics_server's HTTP server
    _health_server: grpc.Server | None = None
    _stop_janitor: threading.Event = field(default_factory=threading.Event)

    def start_janitor(self) -> None:
        """Every few seconds: close idle sessions, re-read the free disk space, and free
        dead readers' slots (a reader killed with kill -9 would otherwise pin old pages until a restart)."""
        interval = max(0.1, min(JANITOR_INTERVAL_S, self.servicer.config.session_idle_timeout_s / 4))

        def loop() -> None:
            while not self._stop_janitor.wait(interval):
                self.servicer.expire_idle_sessions()
                self.servicer.stores.disk.check()  # clears the refusal once space is back
                for vocabulary, store in self.servicer.stores.all().items():
                    try:
                        if freed := store.check_readers():
                            log.warning("freed %d reader slot(s) of dead processes on table %s", freed, vocabulary)
                    except Exception:  # a closed or broken table: the next tick tries again
                        log.exception("reader check failed on table %s", vocabulary)

        threading.Thread(target=loop, name="drafter-janitor", daemon=True).start()

    def stop(self, grace: float | None = None) -> None:
        """NOT_SERVING, let in-flight calls finish, then flush writes and close the stores."""
        self.health.enter_graceful_shutdown()
        self._stop_janitor.set()
        grace = self.servicer.config.grace_s if grace is None else grace
        stopping = [server.stop(grace) for server in (self.server, self.admin_server) if server is not None]
        for stopped in stopping:
            stopped.wait()
        self.writer.stop()
        self.stores.close()
        if self._health_server is not None:
            self._health_server.stop(0).wait()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        self.servicer.tracing.shutdown()


def create_server(config: DrafterConfig) -> DrafterServer:
    options = serving.message_options(config.max_message_bytes)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=config.max_workers), options=options)
    health_servicer = serving.add_health_and_reflection(server, SERVICE_NAME)
    stores = StoreRegistry(config)  # first: a locked --db must fail before the port is taken
    admin_server = admin_port = None
    try:
        port = serving.bind(server, config.host, config.port, config.tls_cert, config.tls_key, config.tls_client_ca)
        if config.admin_port is not None:
            admin_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=options)
            admin_port = serving.bind(
                admin_server, config.admin_host, config.admin_port, config.tls_cert, config.tls_key, config.tls_client_ca
            )
    except BaseException:
        stores.close()
        raise
    writer = ObservationWriter(config.max_pending_observations, stores.disk)
    servicer = DrafterServicer(config, stores, writer)
    drafter_pb2_grpc.add_DrafterServicer_to_server(servicer if admin_server is None else _ServingOnly(servicer), server)
    if admin_server is not None:
        drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, admin_server)
    drafter = DrafterServer(server, port, servicer, health_servicer, stores, writer, admin_server=admin_server, admin_port=admin_port)
    if config.health_port is not None:
        drafter._health_server, drafter.health_port = serving.serve_health(health_servicer, config.host, config.health_port)
    if config.metrics_port is not None:
        drafter._metrics_server, drafter.metrics_port = telemetry.start_metrics_server(servicer.registry, config.host, config.metrics_port)
    writer.start()
    server.start()
    if admin_server is not None:
        admin_server.start()
    drafter.start_janitor()
    serving.set_serving(health_servicer, SERVICE_NAME, True)  # the stores are open: ready
    return drafter
