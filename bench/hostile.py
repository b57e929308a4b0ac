"""Abusive clients for bench_load's hostile phase: each kind one function that runs until told to stop.

    python -m bench.hostile KIND [KIND ...] --verifier HOST:PORT --drafter HOST:PORT --http-port N
        --vocabulary HEX [--clients 8] [--seconds 30]

runs ``--clients`` abusers of the given kinds (spread evenly) against services
already running on this host, and prints what they met. Kinds (``KINDS``):

* ``idle_streams``: a bidirectional reflection stream
  (``ServerReflection/ServerReflectionInfo``) or a health ``Watch``, to the
  verifier or the drafter (abuser i: target i mod 2, method i // 2 mod 2),
  that sends nothing and reads nothing, held as long as the server allows and
  reopened when cut;
* ``repeated_closes``: a drafter session opened with ``CLOSE_CONTEXT_TOKENS``
  tokens of its own, then ``CloseSessions(observe=true)`` naming it
  ``CLOSE_REPEATS`` times in one call, with a 1 s deadline, in a loop;
* ``huge_bodies``: ``POST /v1/chat/completions`` with a ~7 MiB JSON body (one
  long message), one connection per request, in a loop;
* ``slow_bodies``: headers announcing a body of ``SLOW_BODY_DECLARED_BYTES``
  (abusers 0, 1, 4, 5, ...) or ``SLOW_BODY_UNDER_CAP_BYTES`` (2, 3, 6, 7, ...),
  then the body trickled ``TRICKLE_BYTES`` a second (even abusers) or not at
  all (odd ones), holding the connection until the server closes it;
* ``idle_http``: a TCP connection to the HTTP port that never sends a request;
* ``bogus_propose``: ``Propose`` continuing made-up session ids, in a loop.

Every abuser is one thread with at most one call or connection open at a
time, on 127.0.0.1 only, starting one at most every ``MIN_ATTEMPT_INTERVAL_S``;
it looks at ``stop`` at least every ``STOP_POLL_S`` and returns within
``STOP_BOUND_S`` of it being set. HTTP abusers send a wrong API key (half of
each kind's) or none. Outcomes are counted per
kind: a gRPC method and status name, ``HTTP <code> <message>``, ``cut``
(the server closed first) or an exception's type; held streams and
connections also record how long the server let them stay.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import random
import secrets
import select
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2_grpc

from specdec.v1 import drafter_pb2, drafter_pb2_grpc

LOOPBACK = "127.0.0.1"
STOP_POLL_S = 0.5  # how often a waiting abuser looks at ``stop``
# An abuser's attempts at most 20 a second: refused at once, 64 tight loops on a 2-core machine
# would measure this benchmark's own CPU more than the services' (still ~1,000 attempts a second).
MIN_ATTEMPT_INTERVAL_S = 0.05
SOCKET_TIMEOUT_S = 5.0  # one connect, send or recv; bounds how long an abuser can miss ``stop``
STOP_BOUND_S = SOCKET_TIMEOUT_S + 2 * STOP_POLL_S + 5.0  # plus a gRPC call's own deadline (CALL_TIMEOUT_S)
CALL_TIMEOUT_S = 5.0  # the abusers' gRPC calls but CloseSessions' and the held streams
CLOSE_CONTEXT_TOKENS = 4096  # a long context: each repeat of its id costs the drafter this many tokens
CLOSE_REPEATS = 300  # one session id this many times in one CloseSessions
CLOSE_DEADLINE_S = 1.0
TOKEN_ID_RANGE = 49_000  # below SmolLM2's vocabulary: token ids any of our models' drafter tables accept
# Just under the default --max-message-bytes (8 MiB), so the body is read, parsed and tokenized, not refused at the door.
HUGE_BODY_BYTES = 7 * 2**20
SEND_CHUNK_BYTES = 256 * 2**10  # a huge body goes out in chunks, ``stop`` looked at between them
ANSWER_WAIT_S = 60.0  # a huge body's answer: longer than any tokenizing of 7 MiB should take
SLOW_BODY_DECLARED_BYTES = 6 * 2**20
SLOW_BODY_UNDER_CAP_BYTES = 900 * 2**10  # under the 1 MiB --http-max-body-bytes: only a body timeout ends it
TRICKLE_BYTES = 4  # a second
BOGUS_SESSIONS_PER_CALL = 64
WORDS = ("the", "model", "token", "draft", "verify", "accept", "batch", "cache", "t7", "t42", "1234", "naïve", "Ωmega", "{}", "\\n")


@dataclass(frozen=True)
class Targets:
    """Where the abusers go: the services' loopback ports, and the vocabulary the drafter's calls name."""

    verifier: str  # HOST:PORT, gRPC
    drafter: str  # HOST:PORT, gRPC
    http_port: int | None  # the verifier's HTTP API; None: the HTTP kinds idle
    vocabulary: str


class Tally:
    """Outcomes per kind, and the longest time a server let each kind of held call or connection stay."""

    def __init__(self) -> None:
        self.outcomes: dict[str, Counter] = {}
        self.longest_held_s: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, kind: str, outcome: str) -> None:
        with self._lock:
            self.outcomes.setdefault(kind, Counter())[outcome] += 1

    def held(self, what: str, seconds: float) -> None:
        with self._lock:
            self.longest_held_s[what] = max(self.longest_held_s.get(what, 0.0), seconds)

    def summary(self) -> dict:
        with self._lock:
            return {
                "outcomes": {kind: dict(counts.most_common()) for kind, counts in sorted(self.outcomes.items())},
                "longest_held_s": {what: round(seconds, 1) for what, seconds in sorted(self.longest_held_s.items())},
            }


def _channel(address: str) -> grpc.Channel:
    """A channel with a connection of its own (channels with equal arguments otherwise share one)."""
    assert address.startswith(f"{LOOPBACK}:"), f"abusers stay on loopback, not {address}"
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


# -- gRPC ----------------------------------------------------------------------------------


def _nothing_until(ended: threading.Event) -> Iterator:
    """A request stream that sends nothing and never half-closes: it ends once its call has ended
    (``_hold`` cancels it at the stop), so gRPC's thread that reads it never outlives the call."""
    ended.wait()
    return
    yield


def _attempts(stop: threading.Event) -> Iterator[int]:
    """0, 1, 2, ... until ``stop``, at most one per MIN_ATTEMPT_INTERVAL_S."""
    for attempt in itertools.count():
        if stop.is_set():
            return
        next_at = time.monotonic() + MIN_ATTEMPT_INTERVAL_S
        yield attempt
        stop.wait(max(0.0, next_at - time.monotonic()))


def _hold(call, stop: threading.Event, ended: threading.Event) -> str:
    """Wait until the server ends ``call`` (its status) or ``stop`` (cancel it: "held to the end")."""
    call.add_done_callback(lambda _: ended.set())
    while not ended.wait(STOP_POLL_S):
        if stop.is_set():
            call.cancel()
            return "held to the end"
    return f"cut by the server: {call.code().name}"


def idle_streams(targets: Targets, index: int, stop: threading.Event, tally: Tally) -> None:
    service, address = (("verifier", targets.verifier), ("drafter", targets.drafter))[index % 2]
    method = ("reflection", "watch")[index // 2 % 2]
    what = f"{method}@{service}"
    with _channel(address) as channel:
        for _ in _attempts(stop):
            ended = threading.Event()
            if method == "reflection":
                call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(_nothing_until(ended))
            else:
                call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
            opened = time.monotonic()
            outcome = _hold(call, stop, ended)
            tally.held(what, time.monotonic() - opened)
            tally.add("idle_streams", f"{what} {outcome}")


def repeated_closes(targets: Targets, index: int, stop: threading.Event, tally: Tally) -> None:
    rng = random.Random(index)
    own = [rng.randrange(TOKEN_ID_RANGE) for _ in range(CLOSE_CONTEXT_TOKENS)]
    with _channel(targets.drafter) as channel:
        stub = drafter_pb2_grpc.DrafterStub(channel)
        for n in _attempts(stop):
            session = f"hostile-close-{index}-{n}-{secrets.token_hex(4)}"
            turn = n * 7 % CLOSE_CONTEXT_TOKENS  # a new context each time, for what it costs this process: a rotation
            tokens = own[turn:] + own[:turn]
            update = drafter_pb2.SequenceUpdate(session_id=session, new_tokens=tokens, open=True, num_draft_tokens=0)
            try:
                stub.Propose(drafter_pb2.ProposeRequest(vocabulary=targets.vocabulary, sequences=[update]), timeout=CALL_TIMEOUT_S)
            except grpc.RpcError as error:
                tally.add("repeated_closes", f"Propose {error.code().name}")
                continue
            request = drafter_pb2.CloseSessionsRequest(
                vocabulary=targets.vocabulary, session_ids=[session] * CLOSE_REPEATS, observe=True, observe_id=session
            )
            try:
                closed = stub.CloseSessions(request, timeout=CLOSE_DEADLINE_S).closed
                tally.add("repeated_closes", f"CloseSessions OK (closed={closed})")
            except grpc.RpcError as error:
                tally.add("repeated_closes", f"CloseSessions {error.code().name}")


def bogus_propose(targets: Targets, index: int, stop: threading.Event, tally: Tally) -> None:
    with _channel(targets.drafter) as channel:
        stub = drafter_pb2_grpc.DrafterStub(channel)
        for n in _attempts(stop):
            updates = [
                drafter_pb2.SequenceUpdate(session_id=f"{index}-{n}-{i}", new_tokens=[i], num_draft_tokens=8)
                for i in range(BOGUS_SESSIONS_PER_CALL)
            ]
            try:
                stub.Propose(drafter_pb2.ProposeRequest(vocabulary=targets.vocabulary, sequences=updates), timeout=CALL_TIMEOUT_S)
                tally.add("bogus_propose", "Propose OK")
            except grpc.RpcError as error:
                tally.add("bogus_propose", f"Propose {error.code().name}")


# -- HTTP over plain sockets ------------------------------------------------------------------


def _connect(targets: Targets) -> socket.socket:
    assert targets.http_port is not None
    connection = socket.create_connection((LOOPBACK, targets.http_port), timeout=SOCKET_TIMEOUT_S)
    connection.settimeout(SOCKET_TIMEOUT_S)
    return connection


def _head(targets: Targets, length: int, wrong_key: bool) -> bytes:
    """Request headers for ``POST /v1/chat/completions`` with a body of ``length`` bytes, and a wrong API key or none."""
    key = f"Authorization: Bearer wrong-key-{secrets.token_hex(4)}\r\n" if wrong_key else ""
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {LOOPBACK}:{targets.http_port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n{key}Connection: close\r\n\r\n"
    ).encode()


@functools.cache
def huge_body() -> bytes:
    """One chat message of words in no order (no tokenizer cache helps), HUGE_BODY_BYTES in all; built once."""
    rng = random.Random(0)

    def body(content: str) -> bytes:
        return json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 1, "temperature": 0}).encode()

    room = HUGE_BODY_BYTES - len(body(""))
    escaped = {word: len(json.dumps(word + " ")) - 2 for word in WORDS}  # bytes each adds inside the JSON string
    words, size = [], 0
    while size < room - max(escaped.values()):
        word = rng.choice(WORDS)
        words.append(word)
        size += escaped[word]
    return body(" ".join(words))


def _answer(connection: socket.socket, stop: threading.Event, wait_s: float) -> str:
    """The server's answer as an outcome: ``HTTP <code> <message>``, "cut" if it closed first, "no answer" after ``wait_s``."""
    received, give_up = b"", time.monotonic() + wait_s
    while b"\r\n\r\n" not in received:
        if stop.is_set() or time.monotonic() > give_up:
            return f"no answer within {wait_s:.0f} s" if not stop.is_set() else "no answer before the end"
        ready, _, _ = select.select([connection], [], [], STOP_POLL_S)
        if ready:
            piece = connection.recv(65536)
            if not piece:
                return "cut (closed without an answer)"
            received += piece
    head, _, body = received.partition(b"\r\n\r\n")
    status = head.split(b" ", 2)[1].decode()
    with_body = time.monotonic() + SOCKET_TIMEOUT_S
    while len(body) < 2048 and time.monotonic() < with_body and select.select([connection], [], [], STOP_POLL_S)[0]:
        piece = connection.recv(65536)
        if not piece:
            break
        body += piece
    return f"HTTP {status} {_error_message(body)}".rstrip()


def _error_message(body: bytes) -> str:
    """An OpenAI-shaped error's message, digits dropped (so counts do not split by a number), 70 characters."""
    try:
        message = str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = body[:70].decode(errors="replace")
    return "".join("#" if c.isdigit() else c for c in message)[:70]


def huge_bodies(targets: Targets, index: int, stop: threading.Event, tally: Tally) -> None:
    if targets.http_port is None:
        return
    payload = memoryview(_head(targets, len(huge_body()), wrong_key=index % 2 == 1) + huge_body())
    for _ in _attempts(stop):
        try:
            with _connect(targets) as connection:
                try:
                    for start in range(0, len(payload), SEND_CHUNK_BYTES):
                        if stop.is_set():
                            return
                        connection.sendall(payload[start : start + SEND_CHUNK_BYTES])
                except OSError as error:  # the server may answer (401, 413) and close before reading it all
                    answer = _answer(connection, stop, SOCKET_TIMEOUT_S)
                    early = answer.startswith("HTTP")
                    tally.add("huge_bodies", f"{answer} (before the whole body)" if early else f"{type(error).__name__}; {answer}")
                    continue
                tally.add("huge_bodies", _answer(connection, stop, ANSWER_WAIT_S))
        except OSError as error:
            tally.add("huge_bodies", type(error).__name__)


def _held_connection(
    targets: Targets, stop: threading.Event, tally: Tally, kind: str, what: str, first: bytes, trickle: Iterator[bytes] | None
) -> None:
    """One connection that sends ``first``, then a piece of ``trickle`` a second (or nothing), until the server
    answers or closes it (the outcome) or ``stop``."""
    opened = time.monotonic()
    try:
        with _connect(targets) as connection:
            if first:
                connection.sendall(first)
            while not stop.is_set():
                if select.select([connection], [], [], 1.0)[0]:
                    outcome = _answer(connection, stop, SOCKET_TIMEOUT_S)
                    break
                if trickle is not None:
                    connection.sendall(next(trickle))
            else:
                outcome = "held to the end"
    except OSError as error:
        outcome = type(error).__name__
    tally.held(what, time.monotonic() - opened)
    tally.add(kind, f"{what} {outcome}")


def _trickled_body() -> Iterator[bytes]:
    """A chat body's opening, then letters: TRICKLE_BYTES at a time."""
    opening = b'{"messages": [{"role": "user", "content": "'
    for start in range(0, len(opening), TRICKLE_BYTES):
        yield opening[start : start + TRICKLE_BYTES]
    while True:
        yield b"a" * TRICKLE_BYTES


def slow_bodies(targets: Targets, index: int, stop: threading.Event, tally: Tally) -> None:
    if targets.http_port is None:
        return
    declared = SLOW_BODY_DECLARED_BYTES if index // 2 % 2 == 0 else SLOW_BODY_UNDER_CAP_BYTES
    what = f"{'stalled' if index % 2 else 'trickled'} {declared >> 10} KiB"
    for _ in _attempts(stop):
        body = None if index % 2 else _trickled_body()
        _held_connection(targets, stop, tally, "slow_bodies", what, _head(targets, declared, wrong_key=index // 4 % 2 == 1), body)


def idle_http(targets: Targets, index: int, stop: threading.Event, tally: Tally) -> None:
    if targets.http_port is None:
        return
    for _ in _attempts(stop):
        _held_connection(targets, stop, tally, "idle_http", "silent", b"", None)


Abuser = Callable[[Targets, int, threading.Event, Tally], None]
KINDS: dict[str, Abuser] = {
    "idle_streams": idle_streams,
    "repeated_closes": repeated_closes,
    "huge_bodies": huge_bodies,
    "slow_bodies": slow_bodies,
    "idle_http": idle_http,
    "bogus_propose": bogus_propose,
}
DEFAULT_MIX = ("idle_streams", "repeated_closes", "huge_bodies", "slow_bodies")


def _guarded(kind: str, abuser: Abuser, targets: Targets, index: int, stop: threading.Event, tally: Tally) -> None:
    """An abuser whose own bug is counted, not lost with its thread."""
    try:
        abuser(targets, index, stop, tally)
    except Exception as error:
        tally.add(kind, f"abuser crashed: {type(error).__name__}: {error}"[:120])


def start_abusers(targets: Targets, kinds: tuple[str, ...], clients: int, stop: threading.Event, tally: Tally) -> list[threading.Thread]:
    """``clients`` abuser threads, spread evenly over ``kinds`` (abuser i: kinds[i mod len])."""
    if "huge_bodies" in kinds:
        huge_body()  # built before the clock starts, not by the first abuser
    threads = []
    for client in range(clients):
        kind = kinds[client % len(kinds)]
        index = client // len(kinds)
        thread = threading.Thread(
            target=_guarded, args=(kind, KINDS[kind], targets, index, stop, tally), name=f"hostile-{kind}-{index}", daemon=True
        )
        thread.start()
        threads.append(thread)
    return threads


def stop_abusers(threads: list[threading.Thread], stop: threading.Event, bound_s: float = STOP_BOUND_S) -> list[str]:
    """Tell every abuser to stop and join them all within ``bound_s`` together; the names of those still running."""
    stop.set()
    give_up = time.monotonic() + bound_s
    for thread in threads:
        thread.join(max(0.0, give_up - time.monotonic()))
    return [thread.name for thread in threads if thread.is_alive()]


def parse_mix(text: str) -> tuple[str, ...]:
    """``--hostile-mix``: kinds separated by commas. "idle_streams,huge_bodies" -> ("idle_streams", "huge_bodies")."""
    kinds = tuple(kind.strip() for kind in text.split(",") if kind.strip())
    unknown = [kind for kind in kinds if kind not in KINDS]
    if not kinds or unknown:
        raise argparse.ArgumentTypeError(f"kinds must be some of {', '.join(KINDS)} (got {text!r})")
    return kinds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kinds", nargs="+", choices=sorted(KINDS))
    parser.add_argument("--verifier", required=True, help="HOST:PORT of the verifier's gRPC port (127.0.0.1 only)")
    parser.add_argument("--drafter", required=True, help="HOST:PORT of the drafter (127.0.0.1 only)")
    parser.add_argument("--http-port", type=int, default=None, help="the verifier's HTTP API port")
    parser.add_argument("--vocabulary", required=True, help="the verifier's vocabulary fingerprint (hex)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=30)
    args = parser.parse_args(argv)
    targets = Targets(args.verifier, args.drafter, args.http_port, args.vocabulary)
    stop, tally = threading.Event(), Tally()
    threads = start_abusers(targets, tuple(args.kinds), args.clients, stop, tally)
    try:
        time.sleep(args.seconds)
    finally:
        left = stop_abusers(threads, stop)
    print(json.dumps(tally.summary() | {"still_running": left}, indent=2))


if __name__ == "__main__":
    main()
