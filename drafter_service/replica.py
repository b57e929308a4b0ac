"""A drafter replica: applies the shared observation log, in order, into its own tables.

One ordered log is the source of truth (``drafter_service.log``); LMDB does not replicate
itself, and the tables' updates are not commutative (top-k cuts, decay epochs, eviction),
so every replica applies every message in the log's order, each message as one call at
the hour the log stored it (``LMDBNGramStore.apply_log``). Replicas given the same log
therefore hold the same tables.

Exactly once
------------
Each table records the sequence of the last message applied to it in the same
transaction as that message's records (``log_sequence``), and skips any message at or
below it. The replica's position (``log-position.json`` in --db: the last sequence every
table has taken or skipped) is written after each batch: after a crash it resumes from
there, and the tables skip what they already hold. Nothing is applied twice, and nothing
acknowledged is missed, whatever the crash point.

Bootstrap
---------
At start, and whenever the log's retention has dropped messages this replica still
needs (the stream's first sequence is past its position + 1):
- the log still holds everything after the position: apply it (an empty store replays
  the whole log);
- otherwise ask a peer for a snapshot (``ObservationLog.request_snapshot``: its tables,
  each with its own ``log_sequence``, and the position they reflect), replace the tables
  with it, and apply the log after it;
- with no peer within --log-bootstrap-wait-seconds, apply what the log still holds (what
  only the dropped messages held is lost to this replica: drafts, never outputs).
A stream deleted and made again is another log: the tables keep what they hold and
their marks are reset, so the new log is applied from its start.

Health: NOT_SERVING until the replica has established its position and is within
--log-max-serving-lag messages of the log's end; a log outage does not change it (the
tables still serve drafts, and the lag cannot be known).

Forget
------
A ``FORGET`` message drops its scope's table if the table holds nothing applied after
the message (a table re-created by later messages is kept), so a replay never drops
what came after.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tarfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from drafter_service.config import DrafterConfig
from drafter_service.counting import first_occurrences
from drafter_service.log import Delivered, LogUnavailable, ObservationLog, StreamState
from drafter_service.log_format import FORGET, OBSERVE, LogFormatError, LogMessage, decode
from drafter_service.scopes import split_table_name
from drafter_service.storage import DiskFull, StoreRegistry, TooManyVocabularies
from drafter_service.store import ApplyItem, LogEntry, StoreClosed

log = logging.getLogger(__name__)

POSITION_FILE = "log-position.json"
# What a snapshot's hand-over, a bootstrap, a forget or a table swap leaves in --db while it
# runs (hidden names no table has): a crash mid-way leaves it, and the next start removes it.
WORK_PREFIXES = (".snapshot-", ".bootstrap-", ".replaced-", ".dropped-")
# Seconds a fetch waits for the next message when caught up: the lag is known this often.
FETCH_WAIT_S = 0.5
# Payload bytes one transaction applies at most (~16K tokens, ~0.2 s here): under load the
# lag is known, and Observe's backpressure released, at least this often.
APPLY_GROUP_BYTES = 64 << 10
# Seconds between retries while the disk is full or the log away.
RETRY_S = 1.0
NS_PER_HOUR = 3600 * 10**9


@dataclass
class Position:
    """Where the replica stands in which log."""

    sequence: int = 0  # every message up to it is applied (or skipped)
    stream: str = ""  # --log-stream
    created: str = ""  # the stream's creation time: another stream of the same name is another log


class Replica:
    """Follows the log into ``stores`` (see the module docstring). ``on_health(serving)`` is
    told each change of whether this replica may serve."""

    def __init__(self, config: DrafterConfig, stores: StoreRegistry, log_link: ObservationLog, on_health: Callable[[bool], None]) -> None:
        self._thread = threading.Thread(target=self._run, name="drafter-replica", daemon=True)
        self.config, self.stores, self.log = config, stores, log_link
        self._on_health = on_health
        self._path = Path(config.db) / POSITION_FILE
        self.position = _read_position(self._path)
        _remove_leftovers(Path(config.db))
        self.lag_messages: int | None = None  # None: not known yet
        self.lag_seconds = 0.0
        self.applied = 0  # messages applied to a table
        self.skipped = 0  # messages not applied: already held, refused by a bound, unreadable
        self.bootstraps = 0  # times this replica caught up from a peer's snapshot (or found none)
        self.serving = False
        self._established = False  # the position is established against the log
        self._applying = threading.Lock()  # held while a batch is applied: snapshots read the position between batches
        self._advanced = threading.Condition()
        self._stopping = threading.Event()

    # -- the loop

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping.is_set():
            if not self.log.ready.wait(RETRY_S):
                continue
            try:
                self._start()
                self._follow()
            except LogUnavailable as away:
                log.warning("observation log unavailable (%s); drafts are served from the tables as they are", away)
                self._stopping.wait(RETRY_S)
            except Exception:  # never dies: the next round starts over from the position on disk
                log.exception("the replica failed applying the log; starting over from its position")
                self._stopping.wait(RETRY_S)

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(10.0)

    def _start(self) -> None:
        """Establish the position against the log, bootstrapping where the log cannot bring it up to date."""
        state = self.log.stream_state()
        if self.position.created and (self.position.stream, self.position.created) != (self.config.log.stream, state.created):
            log.warning(
                "the log's stream %s is not the one this replica followed (created %s, now %s): the tables keep what they "
                "hold, and the new log is applied from its start",
                self.config.log.stream,
                self.position.created,
                state.created,
            )
            self._reset_marks()
            self.position = Position()
        self.position.stream, self.position.created = self.config.log.stream, state.created
        if state.first > self.position.sequence + 1:
            self._bootstrap(state)
        self._save()
        self._established = True
        self.log.serve_snapshots(self.make_snapshot, lambda: self.serving)

    def _follow(self) -> None:
        self.log.open_reader(self.position.sequence + 1)
        while not self._stopping.is_set():
            delivered = self.log.fetch(self.config.log.apply_batch, FETCH_WAIT_S)
            if not delivered:
                self._set_lag(0, 0.0)
                continue
            if delivered[0].sequence > self.position.sequence + 1 and self._left_behind():
                return  # bootstrapped from a peer: _start reopens the reader where it stands now
            for group in _groups(delivered, APPLY_GROUP_BYTES):
                self._set_lag(group[-1].pending + len(group), _age(group[0]))  # its first is the oldest not applied
                self._apply(group)
            last = delivered[-1]
            self._set_lag(last.pending, _age(last) if last.pending else 0.0)

    def _left_behind(self) -> bool:
        """Whether the log's retention dropped messages after the position (a purge's gaps are fine)."""
        state = self.log.stream_state()
        if state.first <= self.position.sequence + 1:
            return False
        self._set_serving(False)
        self._bootstrap(state)
        self._save()
        return True

    # -- applying

    def _apply(self, delivered: list[Delivered]) -> None:
        """Apply ``delivered`` (in log order) and move the position past it. A full disk
        holds the batch back until there is room: skipping it would leave this replica apart."""
        while not self._stopping.is_set():
            try:
                with self._applying:
                    self._apply_batch(delivered)
                    self.position.sequence = delivered[-1].sequence
                    self._save()
                break
            except DiskFull as full:
                log.error("%s; the log is applied once there is room", full)
                self._stopping.wait(RETRY_S)
        with self._advanced:
            self._advanced.notify_all()

    def _apply_batch(self, delivered: list[Delivered]) -> None:
        pending: dict[tuple[str, str], list[LogEntry]] = {}  # per table, its entries of this batch in order
        for message in delivered:
            if message.sequence <= self.position.sequence:
                self.skipped += 1
                continue
            try:
                decoded = decode(message.data)
            except LogFormatError as unreadable:
                log.error("log message %d skipped: %s", message.sequence, unreadable)
                self.skipped += 1
                continue
            table = (decoded.vocabulary, decoded.scope)
            if decoded.kind == FORGET:
                self._flush(pending)  # what came before it first
                self._forget(table, message.sequence)
                continue
            pending.setdefault(table, []).append(_entry(decoded, message, self.config))
        self._flush(pending)

    def _flush(self, pending: dict[tuple[str, str], list[LogEntry]]) -> None:
        for (vocabulary, scope), entries in pending.items():
            try:
                store = self.stores.get(vocabulary, scope)
            except TooManyVocabularies as refused:  # the same on every replica: the same tables, in the same order
                log.warning("%d log messages skipped: %s", len(entries), refused)
                self.skipped += len(entries)
                continue
            try:
                results = store.apply_log(entries)  # a message no table can hold is skipped alone, logged
            except StoreClosed:  # set aside meanwhile: a fresh table takes them
                results = self.stores.get(vocabulary, scope).apply_log(entries)
            self.applied += sum(result is True for result in results)
            self.skipped += sum(result is not True for result in results)
        pending.clear()

    def _forget(self, table: tuple[str, str], sequence: int) -> None:
        store = self.stores.find(*table)
        try:
            held = store.log_sequence() if store is not None else None
        except StoreClosed:
            held = None
        if held is not None and held < sequence:
            self.stores.drop(*table)
            self.applied += 1
        else:
            self.skipped += 1

    def wait_for(self, sequence: int, timeout_s: float) -> bool:
        """Block until the position reaches ``sequence``; False after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._advanced:
            while self.position.sequence < sequence:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._advanced.wait(left)
        return True

    # -- lag and health

    def _set_lag(self, messages: int, seconds: float) -> None:
        with self._advanced:
            self.lag_messages, self.lag_seconds = messages, seconds
            self._advanced.notify_all()
        self._set_serving(self._established and messages <= self.config.log.max_serving_lag)

    def admits_writes(self, timeout_s: float) -> bool:
        """Whether this replica is within --log-max-publish-lag-seconds of the log's end, waiting
        up to ``timeout_s`` for it: the backpressure that keeps the log from growing faster
        than replicas apply it (acknowledging is cheaper than applying). A lag not known yet,
        or a log away, holds nothing back: the publish itself answers then."""
        bound = self.config.log.max_publish_lag_s
        deadline = time.monotonic() + timeout_s
        with self._advanced:
            while self.lag_messages and self.lag_seconds > bound:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._advanced.wait(left)
        return True

    def _set_serving(self, serving: bool) -> None:
        if serving != self.serving:
            self.serving = serving
            log.info(
                "replica %s at log sequence %d (lag %s)", "SERVING" if serving else "NOT_SERVING", self.position.sequence, self.lag_messages
            )
            self._on_health(serving)

    # -- bootstrap and snapshots

    def _bootstrap(self, state: StreamState) -> None:
        self.bootstraps += 1
        log.warning(
            "the log holds sequences from %d; this replica stands at %d: asking a peer for a snapshot", state.first, self.position.sequence
        )
        download = Path(self.config.db) / f".snapshot-in-{uuid.uuid4().hex}.tar"
        try:
            offer = self.log.request_snapshot(str(download), self.config.log.bootstrap_wait_s)
            if offer is not None and offer.created == state.created and offer.sequence >= state.first - 1:
                self._install(offer.path)
                self.position.sequence = offer.sequence
                log.warning("bootstrapped from a peer's snapshot at log sequence %d", offer.sequence)
                return
        finally:
            download.unlink(missing_ok=True)
        log.warning(
            "no peer's snapshot reaches the log's first sequence %d: applying what the log holds; what only the dropped "
            "messages held is lost to this replica (drafts, never outputs)",
            state.first,
        )
        self.position.sequence = state.first - 1

    def _install(self, tar_path: str) -> None:
        """Replace the tables with a snapshot's (only table folders' data files are taken from it)."""
        staging = Path(self.config.db) / f".bootstrap-{uuid.uuid4().hex}"
        staging.mkdir()
        try:
            with tarfile.open(tar_path) as archive:
                for member in archive.getmembers():
                    table, _, name = member.name.partition("/")
                    if not member.isfile() or name != "data.mdb" or split_table_name(table) is None:
                        continue
                    (staging / table).mkdir(exist_ok=True)
                    source = archive.extractfile(member)
                    assert source is not None  # a regular file
                    with source, open(staging / table / "data.mdb", "wb") as target:
                        shutil.copyfileobj(source, target)
                        target.flush()
                        os.fsync(target.fileno())
            with self._applying:
                self.stores.replace_tables(staging)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def make_snapshot(self) -> tuple[str, int, str]:
        """A tar file of every table's compact copy, the position they reflect, and the log's
        creation time (a peer's bootstrap). The position is read between batches; tables copied later may hold more,
        which their own marks make the peer skip."""
        with self._applying:
            sequence, created, tables = self.position.sequence, self.position.created, self.stores.all()
        root = Path(self.config.db)
        work = root / f".snapshot-out-{uuid.uuid4().hex}"
        try:
            for name, store in tables.items():
                try:
                    store.backup(work / name)
                except StoreClosed:  # forgotten or set aside meanwhile
                    continue
            path = str(work) + ".tar"
            with tarfile.open(path, "w") as archive:
                for folder in sorted(work.iterdir()) if work.exists() else ():
                    archive.add(folder / "data.mdb", arcname=f"{folder.name}/data.mdb")
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return path, sequence, created

    def _reset_marks(self) -> None:
        for store in self.stores.all().values():
            try:
                store.reset_log_sequence()
            except StoreClosed:
                continue

    def _save(self) -> None:
        """Write the position durably: a temporary file, fsync, rename."""
        temporary = self._path.with_suffix(".tmp")
        with open(temporary, "w") as handle:
            json.dump(asdict(self.position), handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, self._path)


def _groups(delivered: list[Delivered], max_bytes: int) -> list[list[Delivered]]:
    """``delivered`` in order, cut into runs of at most ``max_bytes`` of payload (a message
    larger than that alone): sizes [40K, 40K, 10K, 90K], 64K -> [[40K], [40K, 10K], [90K]]."""
    groups: list[list[Delivered]] = []
    size = 0
    for message in delivered:
        if not groups or size + len(message.data) > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(message)
        size += len(message.data)
    return groups


def _age(message: Delivered) -> float:
    """Seconds since the log stored ``message``."""
    return max(0.0, time.time() - message.stored_ns / 1e9)


def _entry(message: LogMessage, delivered: Delivered, config: DrafterConfig) -> LogEntry:
    """A decoded OBSERVE or SUCCESSORS message as its table's ``LogEntry``."""
    hour = delivered.stored_ns // NS_PER_HOUR
    if message.kind != OBSERVE:
        return LogEntry(delivered.sequence, hour, successors=message.successors)
    sequences = message.sequences
    counted: list[tuple[bytes, ...] | None] = [None] * len(sequences)
    if len(sequences) > 1:  # one call: each pair counts once over all its sequences
        counted = list(first_occurrences(sequences, config.ngram.n_min, config.ngram.n_max))
    items = [ApplyItem(f"{message.observe_id}/{index}", tokens, 0, mask) for index, (tokens, mask) in enumerate(zip(sequences, counted))]
    return LogEntry(delivered.sequence, hour, observations=items)


def _remove_leftovers(root: Path) -> None:
    for entry in root.iterdir():
        if entry.name.startswith(WORK_PREFIXES):
            log.warning("removing %s, left in --db by an interrupted snapshot, bootstrap or forget", entry.name)
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def _read_position(path: Path) -> Position:
    try:
        held = json.loads(path.read_text())
        return Position(int(held["sequence"]), str(held["stream"]), str(held["created"]))
    except FileNotFoundError:
        return Position()
    except (OSError, ValueError, KeyError, TypeError) as damaged:
        log.error("%s is unreadable (%s): the log is applied from its start; the tables skip what they hold", path, damaged)
        return Position()
