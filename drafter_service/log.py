"""The drafter's link to the shared observation log on NATS JetStream: ``ObservationLog``.

It owns one NATS connection, on an asyncio loop in a thread of its own, and gives the
drafter's threads blocking calls with deadlines: ``publish`` (Observe answers only after
the stream's acknowledgement: acknowledged means durable in the log), ``fetch`` (the
replica's ordered reads), ``purge``, ``stream_state``, and the snapshot hand-over between
replicas. Nothing here decides what a message means: ``drafter_service.log_format`` says
that, and ``drafter_service.replica`` applies it.

The stream (``--log-stream``) holds every subject under ``--log-subject-prefix`` in file
storage, with the retention and duplicate window of the flags; the first drafter that
connects creates it, and later ones bring its limits to their flags.

Outages: the client reconnects forever in the background. Meanwhile ``publish`` raises
``LogUnavailable`` after its timeout (the caller answers UNAVAILABLE; a retry with the
same message id is stored once), and ``fetch`` returns nothing: reads of the tables never
wait on the log.

Successor-table predictions are hints resent every step, so ``offer_successors`` never
blocks: it keeps the newest per key and table, at most ``--log-max-successor-keys`` per
table (beyond, dropped and counted), and one message per table goes out every
``--log-successor-interval-seconds``.

Snapshots (bootstrap of a replica the log has left behind): a replica that has caught up
answers requests on ``<prefix>.snapshot`` (a queue group: one peer per request). It
replies at once, writes its snapshot into the object store ``<stream>_SNAPSHOTS`` and
then tells the requester's inbox the object's name and the log sequence it reflects.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.js import api

from drafter_service.log_config import LogConfig
from drafter_service.log_format import admin_subject, encode_forget, encode_observe, encode_successors, message_id, table_subject

log = logging.getLogger(__name__)

T = TypeVar("T")

# Seconds between connection attempts while NATS is away at start-up (then nats-py reconnects).
CONNECT_RETRY_S = 0.5
# Seconds the JetStream API's own requests (stream info, purge, consumer creation) may take.
API_TIMEOUT_S = 5.0
# An ephemeral consumer nobody fetches from is removed by the server after this long.
CONSUMER_INACTIVE_S = 60.0
# Seconds a snapshot object outlives its hand-over, should the requester die mid-way.
SNAPSHOT_TTL_S = 3600.0
# Seconds a requester waits for the snapshot after a peer took the request: a big table's copy.
SNAPSHOT_READY_S = 600.0
# Successor keys per log message: at most 74 bytes each (2 key tokens, 16 predictions), so a
# message stays under 320 KB, within NATS' default max_payload of 1 MiB.
SUCCESSOR_KEYS_PER_MESSAGE = 4096


class LogUnavailable(Exception):
    """The log did not answer in time (down, or partitioned): nothing is known to be stored."""


class MessageTooLarge(ValueError):
    """A message over the NATS servers' max_payload: no retry can store it."""


@dataclass(frozen=True)
class Delivered:
    """One message read from the log."""

    sequence: int  # the stream's sequence number
    stored_ns: int  # when the stream stored it, nanoseconds since the Unix epoch (the same on every replica)
    pending: int  # messages after it the log held when it was read
    subject: str
    data: bytes


@dataclass(frozen=True)
class StreamState:
    first: int  # the first sequence the log still holds (last + 1 when it holds none)
    last: int  # the last sequence it assigned (0: none yet)
    created: str  # when the stream was created: a stream deleted and made again is another log


@dataclass(frozen=True)
class SnapshotOffer:
    """A peer's snapshot, downloaded: a tar file of table folders and the sequence it reflects."""

    path: str
    sequence: int
    created: str


class ObservationLog:
    """One NATS connection for the drafter (see the module docstring). Thread-safe."""

    def __init__(self, config: LogConfig) -> None:
        assert config.enabled, "an observation log needs --log-url"
        self.config = config
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="drafter-log", daemon=True)
        self._nc: Any = None
        self._js: Any = None
        self._sub: Any = None  # the replica's pull consumer
        self._snapshot_sub: Any = None
        self.ready = threading.Event()  # connected once and the stream exists
        self._closing = False
        self._successors: dict[tuple[str, str], dict[tuple[int, ...], tuple[int, ...]]] = {}
        self._successor_lock = threading.Lock()
        self.dropped_successors = 0  # keys beyond --log-max-successor-keys, or whose message failed
        self.published_successors = 0
        self.publish_failures = 0  # publishes that got no acknowledgement in time
        self.reconnects = 0

    # -- lifecycle

    def start(self) -> None:
        """Connect in the background (forever, until ``close``); ``ready`` is set once the stream exists."""
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._connect(), self._loop)
        asyncio.run_coroutine_threadsafe(self._send_successors_forever(), self._loop)

    def close(self) -> None:
        """Send the successor predictions held, close the connection and end the loop."""
        self._closing = True
        if self._thread.is_alive():
            try:
                self._call(self._close(), 5.0)
            except LogUnavailable:
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5.0)
            if not self._thread.is_alive():
                self._loop.close()

    async def _close(self) -> None:
        if self._nc is not None:
            await self._send_successors()
            try:
                await asyncio.wait_for(self._nc.close(), 2.0)
            except Exception:  # closing anyway
                pass
        others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    async def _connect(self) -> None:
        while not self._closing:
            try:
                self._nc = await nats.connect(**self._connect_options())
                self._js = self._nc.jetstream(timeout=API_TIMEOUT_S)
                await self._ensure_stream()
                self.ready.set()
                log.info("observation log: connected to %s, stream %s", self.config.url, self.config.stream)
                return
            except Exception as error:  # NATS away at start-up: keep trying, serving drafts meanwhile
                log.warning("observation log: cannot reach %s (%s); retrying", self.config.url, error)
                if self._nc is not None:
                    await self._nc.close()
                    self._nc = None
                await asyncio.sleep(CONNECT_RETRY_S)

    def _connect_options(self) -> dict[str, Any]:
        config = self.config

        async def disconnected() -> None:
            if not self._closing:
                log.warning("observation log: disconnected from NATS; reconnecting")

        async def reconnected() -> None:
            self.reconnects += 1
            log.warning("observation log: reconnected to NATS")

        async def error(failure: Exception) -> None:
            log.debug("observation log: %s", failure)

        options: dict[str, Any] = {
            "servers": config.servers(),
            "name": f"specdec-drafter-{os.getpid()}",
            "allow_reconnect": True,
            "max_reconnect_attempts": -1,
            "reconnect_time_wait": CONNECT_RETRY_S,
            "connect_timeout": 2,
            "disconnected_cb": disconnected,
            "reconnected_cb": reconnected,
            "error_cb": error,
        }
        if config.user:
            options["user"], options["password"] = config.user, config.secret()
        if config.nkey_file:
            options["nkeys_seed"] = config.nkey_file
        if config.tls_ca or any(server.startswith("tls://") for server in config.servers()):
            context = ssl.create_default_context(cafile=config.tls_ca)
            if config.tls_cert:
                context.load_cert_chain(config.tls_cert, config.tls_key)
            options["tls"] = context
        return options

    async def _ensure_stream(self) -> None:
        config = self.config
        wanted = api.StreamConfig(
            name=config.stream,
            subjects=[f"{config.subject_prefix}.obs.>", admin_subject(config.subject_prefix)],
            storage=api.StorageType.FILE,
            retention=api.RetentionPolicy.LIMITS,
            discard=api.DiscardPolicy.OLD,
            max_bytes=config.max_bytes,
            max_age=config.max_age_s,
            duplicate_window=config.duplicate_window_s,
            num_replicas=config.stream_replicas,
        )
        try:
            info = await self._js.stream_info(config.stream)
        except nats.js.errors.NotFoundError:
            await self._js.add_stream(wanted)
            log.info("observation log: created stream %s", config.stream)
            return
        held = info.config
        if (held.subjects, held.max_bytes, held.max_age, held.duplicate_window, held.num_replicas) != (
            wanted.subjects,
            wanted.max_bytes,
            wanted.max_age,
            wanted.duplicate_window,
            wanted.num_replicas,
        ):
            await self._js.update_stream(wanted)
            log.info("observation log: stream %s limits brought to this drafter's flags", config.stream)

    # -- calls from the drafter's threads

    def _call(self, coroutine: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coroutine`` on the log's loop; LogUnavailable when it does not finish in ``timeout``."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        done, _ = concurrent.futures.wait([future], timeout)
        if not done:  # this call's own deadline: a timeout inside the call is the call's failure, below
            future.cancel()
            raise LogUnavailable(f"the observation log did not answer within {timeout:g} s")
        try:
            return future.result()
        except (nats.errors.Error, nats.js.errors.Error, OSError, TimeoutError) as failure:
            raise LogUnavailable(f"the observation log failed: {type(failure).__name__}: {failure}") from None

    def _connected(self) -> Any:
        if not self.ready.is_set() or self._nc is None or not self._nc.is_connected:
            raise LogUnavailable("the drafter is not connected to its observation log (NATS) now")
        return self._js

    def publish(self, subject: str, payload: bytes, message_id: str | None = None) -> tuple[int, bool]:
        """Store one message; (its sequence, whether the log already held it under ``message_id``).
        Blocks until the stream acknowledges, at most --log-publish-timeout-seconds (LogUnavailable)."""
        js = self._connected()
        if len(payload) > self._nc.max_payload:
            raise MessageTooLarge(
                f"the call is {len(payload)} bytes in the log, over its servers' max_payload ({self._nc.max_payload}): "
                "send fewer tokens per call, or raise max_payload on the NATS servers"
            )
        headers = {"Nats-Msg-Id": message_id} if message_id else None
        timeout = self.config.publish_timeout_s
        try:
            ack = self._call(js.publish(subject, payload, timeout=timeout, stream=self.config.stream, headers=headers), timeout + 0.5)
        except LogUnavailable:
            self.publish_failures += 1
            raise
        return ack.seq, bool(ack.duplicate)

    def observe(self, vocabulary: str, scope: str, observe_id: str, sequences: list[list[int]]) -> tuple[int, bool]:
        """Publish one Observe call (``publish``): its sequence, and whether it was a retry the log held."""
        payload = encode_observe(vocabulary, scope, observe_id, sequences)
        subject = table_subject(self.config.subject_prefix, vocabulary, scope)
        return self.publish(subject, payload, message_id(vocabulary, scope, observe_id))

    def forget(self, vocabulary: str, scope: str) -> int:
        """Publish a FORGET for the scope's table, then purge the messages before it from its
        subject; the FORGET's sequence. Every replica drops the table when it applies it."""
        sequence, _ = self.publish(admin_subject(self.config.subject_prefix), encode_forget(vocabulary, scope))
        self.purge(table_subject(self.config.subject_prefix, vocabulary, scope), sequence)
        return sequence

    def purge(self, subject: str, before: int) -> None:
        """Remove the messages of ``subject`` with sequences below ``before``."""
        js = self._connected()
        self._call(js.purge_stream(self.config.stream, seq=before, subject=subject), API_TIMEOUT_S + 0.5)

    def stream_state(self) -> StreamState:
        js = self._connected()
        info = self._call(js.stream_info(self.config.stream), API_TIMEOUT_S + 0.5)
        created = info.created.isoformat() if info.created is not None else ""
        first = info.state.first_seq if info.state.messages else info.state.last_seq + 1
        return StreamState(first=first, last=info.state.last_seq, created=created)

    def open_reader(self, start: int) -> None:
        """Read the log in order from sequence ``start`` (replacing any earlier reader)."""
        js = self._connected()

        async def subscribe() -> None:
            if self._sub is not None:
                try:
                    await self._sub.unsubscribe()
                except Exception:  # gone with the connection: a new one follows
                    pass
                self._sub = None
            config = api.ConsumerConfig(
                deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
                opt_start_seq=start,
                ack_policy=api.AckPolicy.NONE,
                inactive_threshold=CONSUMER_INACTIVE_S,
                mem_storage=True,
            )
            config.filter_subjects = [f"{self.config.subject_prefix}.obs.>", admin_subject(self.config.subject_prefix)]
            self._sub = await js.pull_subscribe("", stream=self.config.stream, config=config)

        self._call(subscribe(), API_TIMEOUT_S + 0.5)

    def fetch(self, batch: int, wait_s: float) -> list[Delivered]:
        """Up to ``batch`` messages in log order, waiting up to ``wait_s`` for the first;
        [] when none came (caught up, or the log away). LogUnavailable when the reader is
        gone (the server restarted): reopen it where the replica stands."""
        sub = self._sub
        if sub is None:
            raise LogUnavailable("no reader open on the log")

        async def fetch() -> list[Delivered]:
            try:
                messages = await sub.fetch(batch, timeout=wait_s)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):  # nats-py raises either when none came
                await self._js.consumer_info(self.config.stream, sub._consumer)  # NotFoundError: the reader is gone
                return []
            delivered = []
            for message in messages:
                metadata = message.metadata
                stored = metadata.timestamp
                delivered.append(
                    Delivered(metadata.sequence.stream, int(stored.timestamp() * 1e9), metadata.num_pending, message.subject, message.data)
                )
            return delivered

        return self._call(fetch(), wait_s + API_TIMEOUT_S + 1.0)

    # -- successor-table predictions

    def offer_successors(self, vocabulary: str, scope: str, updates: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
        """Queue predictions for one table's log subject; never blocks (see the module docstring)."""
        bound = self.config.max_successor_keys
        with self._successor_lock:
            pending = self._successors.setdefault((vocabulary, scope), {})
            for key, tokens in updates:
                if key not in pending and len(pending) >= bound:
                    self.dropped_successors += 1
                    continue
                pending[key] = tokens

    async def _send_successors_forever(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.config.successor_interval_s)
            await self._send_successors()

    async def _send_successors(self) -> None:
        with self._successor_lock:
            tables, self._successors = self._successors, {}
        for (vocabulary, scope), pending in tables.items():
            held = list(pending.items())
            for start in range(0, len(held), SUCCESSOR_KEYS_PER_MESSAGE):
                part = held[start : start + SUCCESSOR_KEYS_PER_MESSAGE]
                try:
                    if self._nc is None or not self._nc.is_connected or not self.ready.is_set():
                        raise LogUnavailable("not connected")
                    await self._js.publish(
                        table_subject(self.config.subject_prefix, vocabulary, scope),
                        encode_successors(vocabulary, scope, part),
                        timeout=self.config.publish_timeout_s,
                        stream=self.config.stream,
                    )
                    self.published_successors += len(part)
                except Exception:  # hints: the next steps send fresh ones
                    self.dropped_successors += len(part)

    # -- snapshots between replicas

    def serve_snapshots(self, make: Callable[[], tuple[str, int, str]], ready: Callable[[], bool]) -> None:
        """Answer peers' snapshot requests with ``make()`` -> (tar file path, sequence it
        reflects, creation time of the stream it follows), run in a worker thread; the file is
        removed once uploaded. Once: later calls change nothing. While not
        ``ready()`` (bootstrapping, lagging), requests go unanswered: the peer asks again,
        and the queue group gives the request to another replica."""
        if self._snapshot_sub is not None:
            return
        js = self._connected()

        async def handle(message: Any) -> None:
            if not ready():
                return
            try:
                inbox = json.loads(message.data)["ready"]
            except (ValueError, KeyError, TypeError):
                return
            name = f"snapshot-{uuid.uuid4().hex}"
            await message.respond(json.dumps({"object": name}).encode())
            try:
                path, sequence, created = await asyncio.get_running_loop().run_in_executor(None, make)
                try:
                    store = await self._snapshot_store(js)
                    with open(path, "rb") as handle:
                        await store.put(name, handle)
                finally:
                    os.unlink(path)
                answer = {"object": name, "sequence": sequence, "created": created}
            except Exception as failure:
                log.exception("snapshot for a peer failed")
                answer = {"error": str(failure)}
            await self._nc.publish(inbox, json.dumps(answer).encode())

        async def subscribe() -> None:
            if self._snapshot_sub is None:
                self._snapshot_sub = await self._nc.subscribe(f"{self.config.subject_prefix}.snapshot", queue="snapshot", cb=handle)

        self._call(subscribe(), API_TIMEOUT_S + 0.5)

    async def _snapshot_store(self, js: Any) -> Any:
        try:
            return await js.object_store(self.config.snapshot_bucket)
        except nats.js.errors.BucketNotFoundError:
            config = api.ObjectStoreConfig(ttl=SNAPSHOT_TTL_S, storage=api.StorageType.FILE, replicas=self.config.stream_replicas)
            return await js.create_object_store(self.config.snapshot_bucket, config=config)

    def request_snapshot(self, into: str, wait_s: float) -> SnapshotOffer | None:
        """A peer's snapshot, downloaded to the file ``into``; None when no peer took the
        request within ``wait_s`` seconds, or the one that did failed."""
        js = self._connected()

        async def request() -> SnapshotOffer | None:
            ready = self._nc.new_inbox()
            answers: asyncio.Queue[bytes] = asyncio.Queue()

            async def arrived(message: Any) -> None:
                await answers.put(message.data)

            sub = await self._nc.subscribe(ready, cb=arrived)
            try:
                deadline = time.monotonic() + wait_s
                while True:  # a peer that is not caught up, or gone, leaves the request unanswered: ask again
                    try:
                        await self._nc.request(f"{self.config.subject_prefix}.snapshot", json.dumps({"ready": ready}).encode(), timeout=1.0)
                        break
                    except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
                        if time.monotonic() >= deadline:
                            return None
                        await asyncio.sleep(0.2)
                answer = json.loads(await asyncio.wait_for(answers.get(), SNAPSHOT_READY_S))
                if "error" in answer:
                    log.warning("a peer could not make a snapshot: %s", answer["error"])
                    return None
                store = await self._snapshot_store(js)
                with open(into, "wb") as handle:
                    await store.get(answer["object"], writeinto=handle)
                try:
                    await store.delete(answer["object"])
                except Exception:  # expires anyway (SNAPSHOT_TTL_S)
                    pass
                return SnapshotOffer(into, int(answer["sequence"]), str(answer["created"]))
            finally:
                await sub.unsubscribe()

        return self._call(request(), wait_s + SNAPSHOT_READY_S + 60.0)
