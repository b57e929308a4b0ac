"""Abusive clients for bench_load's hostile phase: each kind one function that runs until told to stop.

    python -m bench.hostile KIND [KIND ...] --verifier HOST:PORT --drafter HOST:PORT --http-port N
        --vocabulary HEX [--clients 8] [--seconds 30] [--drafter-arg "FLAGS"]

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

Tenant abusers (``TENANT_KINDS``) go after what the drafter learns, as a
client that reaches the drafter directly with no token: it declares no
scope (so a drafter with ``--client-token`` keeps it in a scope of its own,
and an open one puts it in the default scope) unless said otherwise:

* ``prediction_flood``: ``Propose`` on sessions of its own carrying as many
  predicted tokens as the drafter takes in one call (``--max-predictions-per-call``,
  k 16, ``--max-predicted-positions`` a sequence), made-up ids, no draft
  asked; every ``OVER_LIMIT_EVERY``-th call one predicted token more, which
  must be refused (INVALID_ARGUMENT);
* ``successor_fill``: the same budget at k 1, each position a new made-up
  (previous, current) pair: as many new successor-table keys a call as
  allowed; it declares a scope of its own making first and, refused
  (PERMISSION_DENIED), goes on in the scope it is given;
* ``observe_flood``: ``Observe`` of random tokens, ``OBSERVE_FLOOD_SEQUENCES``
  x ``OBSERVE_FLOOD_TOKENS`` a call, a new ``observe_id`` each;
* ``poisoning``: one ``Observe`` holding ``POISON_COPIES`` copies of an honest
  client's n-gram (``Targets.honest_ngrams``: what an attacker holding a key
  of its own learns by asking the same greedy prompts) each followed by the
  same ``POISON_JUNK_TOKENS`` junk tokens (always the same for that n-gram,
  so its count adds up over calls), the next n-gram each call: where honest
  drafts read that table, they would draft the junk.

Every abuser is one thread with at most one call or connection open at a
time, on 127.0.0.1 only, starting one at most every ``MIN_ATTEMPT_INTERVAL_S``;
it looks at ``stop`` at least every ``STOP_POLL_S`` and returns within
``STOP_BOUND_S`` of it being set. HTTP abusers send a wrong API key (half of
each kind's) or none. Outcomes are counted per
kind: a gRPC method and status name, ``HTTP <code> <message>``, ``cut``
(the server closed first) or an exception's type; held streams and
connections also record how long the server let them stay, and tenant
abusers the tokens the drafter answered OK for (``Tally.taken``: Observe's
are stored, acknowledged meaning durable; predictions are hints it keeps or
drops). On loopback every client is the caller "127.0.0.1" to the drafter,
the verifier included: abusers draw on the verifier's per-caller limits
there, which separate hosts (or client certificates) would not.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import random
import secrets
import select
import shlex
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2_grpc

from drafter_service.config import DrafterConfig
from drafter_service.table_format import MAX_SUCCESSORS
from specdec.v1 import drafter_pb2, drafter_pb2_grpc

LOOPBACK = "127.0.0.1"
STOP_POLL_S = 0.5  # how often a waiting abuser looks at ``stop``
# An abuser's attempts at most 20 a second: refused at once, 64 tight loops on a 2-core machine
# would measure this benchmark's own CPU more than the services' (still ~1,000 attempts a second).
MIN_ATTEMPT_INTERVAL_S = 0.05
SOCKET_TIMEOUT_S = 5.0  # one connect, send or recv; bounds how long an abuser can miss ``stop``
STOP_BOUND_S = SOCKET_TIMEOUT_S + 2 * STOP_POLL_S + 5.0  # plus a gRPC call's own deadline (CALL_TIMEOUT_S)
CALL_TIMEOUT_S = 5.0  # the abusers' gRPC calls but CloseSessions', Observe's and the held streams
# An Observe waits for the writer up to the drafter's --max-write-wait-seconds (30 s): beyond it, so that the
# outcome counted is the drafter's answer. The call is cancelled at the stop, as the held streams are.
OBSERVE_DEADLINE_S = 40.0
CLOSE_CONTEXT_TOKENS = 4096  # a long context: each repeat of its id costs the drafter this many tokens
CLOSE_REPEATS = 300  # one session id this many times in one CloseSessions
CLOSE_DEADLINE_S = 1.0
TOKEN_ID_RANGE = 49_000  # below SmolLM2's vocabulary: token ids any of our models' drafter tables accept
# Just under the default --max-message-bytes (8 MiB), so the body is read, parsed and tokenized, not refused at the door.
HUGE_BODY_BYTES = 7 * 2**20
SEND_CHUNK_BYTES = 256 * 2**10  # a huge body goes out in chunks, ``stop`` looked at between them
ANSWER_WAIT_S = 60.0  # a huge body's answer: longer than any tokenizing of 7 MiB should take
SLOW_BODY_DECLARED_BYTES = 6 * 2**20
SLOW_BODY_UNDER_CAP_BYTES = 900 * 2**10  # under the 1 MiB --max-http-body-bytes: only a body timeout ends it
TRICKLE_BYTES = 4  # a second
BOGUS_SESSIONS_PER_CALL = 64
WORDS = ("the", "model", "token", "draft", "verify", "accept", "batch", "cache", "t7", "t42", "1234", "naïve", "Ωmega", "{}", "\\n")
OVER_LIMIT_EVERY = 10  # one prediction flood call in this many asks one predicted token over the limit
# Observe's flood: half of the default --max-tokens-per-call (128K) a call, 64x the writer's
# ~100K tokens/s at the attempt rate: the write queue, not the abuser, sets the pace.
OBSERVE_FLOOD_SEQUENCES = 64
OBSERVE_FLOOD_TOKENS = 1024
POISON_COPIES = 1024  # the default --max-sequences-per-call: one call's worth of copies
POISON_JUNK_TOKENS = 8  # a whole draft's worth (K=8) of junk after each copy


@dataclass(frozen=True)
class DrafterLimits:
    """The drafter's per-call bounds that the tenant abusers fill to the brim (DrafterConfig's fields)."""

    predictions_per_call: int
    predicted_positions: int  # a sequence's, per call
    sequences_per_call: int
    tokens_per_call: int

    @classmethod
    def of(cls, config: DrafterConfig) -> DrafterLimits:
        return cls(
            config.max_predictions_per_call, config.max_predicted_positions, config.max_sequences_per_call, config.max_tokens_per_call
        )


@dataclass(frozen=True)
class Targets:
    """Where the abusers go: the services' loopback ports, and the vocabulary the drafter's calls name."""

    verifier: str  # HOST:PORT, gRPC
    drafter: str  # HOST:PORT, gRPC
    http_port: int | None  # the verifier's HTTP API; None: the HTTP kinds idle
    vocabulary: str
    limits: DrafterLimits = field(default_factory=lambda: DrafterLimits.of(DrafterConfig()))
    # n-grams (the drafter's longest, n_max tokens) of honest clients' answers, for ``poisoning``;
    # none: it has nothing to copy and says so.
    honest_ngrams: tuple[tuple[int, ...], ...] = ()


class Tally:
    """Outcomes per kind, and the longest time a server let each kind of held call or connection stay."""

    def __init__(self) -> None:
        self.outcomes: dict[str, Counter] = {}
        self.longest_held_s: dict[str, float] = {}
        self.tokens_taken: Counter = Counter()  # per kind: tokens in calls the drafter answered OK
        self._lock = threading.Lock()

    def add(self, kind: str, outcome: str) -> None:
        with self._lock:
            self.outcomes.setdefault(kind, Counter())[outcome] += 1

    def held(self, what: str, seconds: float) -> None:
        with self._lock:
            self.longest_held_s[what] = max(self.longest_held_s.get(what, 0.0), seconds)

    def taken(self, kind: str, tokens: int) -> None:
        with self._lock:
            self.tokens_taken[kind] += tokens

    def summary(self) -> dict:
        with self._lock:
            return {
                "outcomes": {kind: dict(counts.most_common()) for kind, counts in sorted(self.outcomes.items())},
                "longest_held_s": {what: round(seconds, 1) for what, seconds in sorted(self.longest_held_s.items())},
                "tokens_taken": dict(sorted(self.tokens_taken.items())),
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


# -- tenant abusers: what the drafter learns ---------------------------------------------------


def prediction_shapes(total: int, positions_cap: int, k: int) -> list[tuple[int, int]]:
    """(positions, k) of each sequence's predictions so that they carry ``total`` predicted tokens
    in all, no sequence over ``positions_cap`` positions: full sequences at ``k``, the rest at k 1.

    65_536 tokens, 1,024 positions, k 16 -> 4 x (1024, 16); 65_537 -> the same and (1, 1);
    40, 2, 16 -> (2, 16) and 4 x (2, 1)."""
    assert total >= 0 and positions_cap >= 1 and k >= 1
    shapes, left = [], total
    while left >= k:
        positions = min(positions_cap, left // k)
        shapes.append((positions, k))
        left -= positions * k
    while left:
        shapes.append((min(positions_cap, left), 1))
        left -= shapes[-1][0]
    return shapes


def made_up_predictions(shapes: list[tuple[int, int]], rng: np.random.Generator) -> list[drafter_pb2.Predictions]:
    """One Predictions message per shape, every id made up (below TOKEN_ID_RANGE)."""

    def ids(count: int) -> list[int]:
        return rng.integers(0, TOKEN_ID_RANGE, count, dtype=np.uint32).tolist()

    return [drafter_pb2.Predictions(k=k, previous=ids(n), current=ids(n), tokens=ids(n * k)) for n, k in shapes]


def predicting_request(
    vocabulary: str, sessions: list[str], predictions: list[drafter_pb2.Predictions], opened: set[str], declared: str
) -> drafter_pb2.ProposeRequest:
    """A prediction-only Propose (no draft asked) of ``sessions``, each with its predictions: those not in
    ``opened`` are opened on a few tokens, in scope ``declared`` ("": none declared)."""
    updates = [
        drafter_pb2.SequenceUpdate(
            session_id=session,
            new_tokens=[] if session in opened else [1, 2, 3],
            open=session not in opened,
            num_draft_tokens=0,
            predictions=prediction,
            scope=declared,
        )
        for session, prediction in zip(sessions, predictions, strict=True)
    ]
    return drafter_pb2.ProposeRequest(vocabulary=vocabulary, sequences=updates)


def _predicting(targets: Targets, index: int, stop: threading.Event, tally: Tally, kind: str, k: int, declare: bool) -> None:
    """Prediction-only Propose calls on sessions of this abuser's own (opened by the first call that
    names them, closed at the end), each carrying the whole --max-predictions-per-call budget at ``k``;
    with ``declare``, in a scope of its own making until the drafter refuses it that."""
    limits, rng = targets.limits, np.random.default_rng(index)
    declared = secrets.token_hex(16) if declare else ""
    opened: set[str] = set()
    with _channel(targets.drafter) as channel:
        stub = drafter_pb2_grpc.DrafterStub(channel)
        for n in _attempts(stop):
            over = kind == "prediction_flood" and n % OVER_LIMIT_EVERY == OVER_LIMIT_EVERY - 1
            total = limits.predictions_per_call + over
            predictions = made_up_predictions(prediction_shapes(total, limits.predicted_positions, k), rng)
            sessions = [f"{kind}-{index}-{i}" for i in range(len(predictions))]
            what = f"{total:,} predicted tokens" if kind == "prediction_flood" else ("declared scope" if declared else "own scope")
            try:
                stub.Propose(predicting_request(targets.vocabulary, sessions, predictions, opened, declared), timeout=CALL_TIMEOUT_S)
                opened.update(sessions)
                tally.taken(kind, total)
                tally.add(kind, f"Propose OK ({what})")
            except grpc.RpcError as error:
                tally.add(kind, f"Propose {error.code().name} ({what})")
                if error.code() == grpc.StatusCode.PERMISSION_DENIED:
                    declared = ""  # the drafter keeps this client in its own scope: go on there
                elif error.code() == grpc.StatusCode.NOT_FOUND:
                    opened.clear()  # sessions idled out (or the drafter restarted): reopen them
        if opened:
            with contextlib.suppress(grpc.RpcError):
                request = drafter_pb2.CloseSessionsRequest(vocabulary=targets.vocabulary, session_ids=sorted(opened))
                stub.CloseSessions(request, timeout=CALL_TIMEOUT_S)


def prediction_flood(targets: Targets, index: int, stop: threading.Event, tally: Tally) -> None:
    _predicting(targets, index, stop, tally, "prediction_flood", MAX_SUCCESSORS, declare=False)


def successor_fill(targets: Targets, index: int, stop: threading.Event, tally: Tally) -> None:
    _predicting(targets, index, stop, tally, "successor_fill", 1, declare=True)


def _observing(targets: Targets, stop: threading.Event, tally: Tally, kind: str, sequences_of: Callable[[int], list[list[int]]]) -> None:
    """Observe ``sequences_of(attempt)`` under a new observe_id each attempt (no scope declared),
    counting the tokens of the sequences the drafter stored."""
    with _channel(targets.drafter) as channel:
        stub = drafter_pb2_grpc.DrafterStub(channel)
        for n in _attempts(stop):
            sequences = sequences_of(n)
            request = drafter_pb2.ObserveRequest(
                vocabulary=targets.vocabulary,
                observe_id=f"{kind}-{secrets.token_hex(8)}",
                sequences=[drafter_pb2.TokenSequence(tokens=tokens) for tokens in sequences],
            )
            call = stub.Observe.future(request, timeout=OBSERVE_DEADLINE_S)
            while not call.done():
                if stop.wait(STOP_POLL_S):
                    call.cancel()
                    break
            try:
                answer = call.result()
                tally.taken(kind, answer.applied_sequences * len(sequences[0]))  # the sequences are of one length
                tally.add(kind, "Observe OK")
            except grpc.FutureCancelledError:
                tally.add(kind, "Observe cancelled at the end")
            except grpc.RpcError as error:
                tally.add(kind, f"Observe {error.code().name}")


def observe_flood(targets: Targets, index: int, stop: threading.Event, tally: Tally) -> None:
    rng = np.random.default_rng(1000 + index)
    sequences = min(OBSERVE_FLOOD_SEQUENCES, targets.limits.sequences_per_call)
    length = min(OBSERVE_FLOOD_TOKENS, targets.limits.tokens_per_call // sequences)

    def random_sequences(attempt: int) -> list[list[int]]:
        return rng.integers(0, TOKEN_ID_RANGE, (sequences, length), dtype=np.uint32).tolist()

    _observing(targets, stop, tally, "observe_flood", random_sequences)


def poison_sequences(ngram: tuple[int, ...], junk: list[int], copies: int) -> list[list[int]]:
    """``copies`` sequences, each an honest n-gram then the same junk: (5, 6), [9], 2 -> [[5, 6, 9], [5, 6, 9]]."""
    return [[*ngram, *junk] for _ in range(copies)]


def poisoning(targets: Targets, index: int, stop: threading.Event, tally: Tally) -> None:
    if not targets.honest_ngrams:
        tally.add("poisoning", "no honest n-gram to copy")
        return
    copies, ngrams = min(POISON_COPIES, targets.limits.sequences_per_call), targets.honest_ngrams

    def copied(attempt: int) -> list[list[int]]:
        ngram = ngrams[(7 * index + attempt) % len(ngrams)]
        junk_of = random.Random(repr(ngram))  # an n-gram's junk is always the same, so its copies add up over calls
        return poison_sequences(ngram, [junk_of.randrange(TOKEN_ID_RANGE) for _ in range(POISON_JUNK_TOKENS)], copies)

    _observing(targets, stop, tally, "poisoning", copied)


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


def drafter_config(flags: list[str]) -> DrafterConfig:
    """The drafter's settings from its command line and SPECDEC_DRAFTER_* variables, as it reads them."""
    from drafter_service.__main__ import parse_config

    return parse_config(flags)


Abuser = Callable[[Targets, int, threading.Event, Tally], None]
KINDS: dict[str, Abuser] = {
    "idle_streams": idle_streams,
    "repeated_closes": repeated_closes,
    "huge_bodies": huge_bodies,
    "slow_bodies": slow_bodies,
    "idle_http": idle_http,
    "bogus_propose": bogus_propose,
    "prediction_flood": prediction_flood,
    "successor_fill": successor_fill,
    "observe_flood": observe_flood,
    "poisoning": poisoning,
}
TENANT_KINDS = ("prediction_flood", "successor_fill", "observe_flood", "poisoning")
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


@dataclass(frozen=True)
class Mix:
    """Abusers run together: their kinds (spread evenly) and how many (None: the run's default)."""

    kinds: tuple[str, ...]
    clients: int | None = None

    def __str__(self) -> str:
        return ("" if self.clients is None else f"{self.clients}:") + ",".join(self.kinds)


def parse_mix(text: str) -> Mix:
    """``--hostile-mix``: [CLIENTS:]KIND,KIND... "idle_streams,huge_bodies" -> both kinds, the default
    number of abusers; "4:observe_flood" -> 4 of that kind."""
    count, colon, listed = text.rpartition(":")
    kinds = tuple(kind.strip() for kind in listed.split(",") if kind.strip())
    unknown = [kind for kind in kinds if kind not in KINDS]
    if not kinds or unknown or (colon and not (count.strip().isdigit() and int(count) > 0)):
        raise argparse.ArgumentTypeError(f"a mix is [CLIENTS:]KIND,KIND... of {', '.join(KINDS)} (got {text!r})")
    return Mix(kinds, int(count) if colon else None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kinds", nargs="+", choices=sorted(KINDS))
    parser.add_argument("--verifier", required=True, help="HOST:PORT of the verifier's gRPC port (127.0.0.1 only)")
    parser.add_argument("--drafter", required=True, help="HOST:PORT of the drafter (127.0.0.1 only)")
    parser.add_argument("--http-port", type=int, default=None, help="the verifier's HTTP API port")
    parser.add_argument("--vocabulary", required=True, help="the verifier's vocabulary fingerprint (hex)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--drafter-arg", action="append", default=[], help="the drafter's flags that set its limits, as it was started")
    args = parser.parse_args(argv)
    limits = DrafterLimits.of(drafter_config([flag for line in args.drafter_arg for flag in shlex.split(line)]))
    targets = Targets(args.verifier, args.drafter, args.http_port, args.vocabulary, limits)
    stop, tally = threading.Event(), Tally()
    threads = start_abusers(targets, tuple(args.kinds), args.clients, stop, tally)
    try:
        time.sleep(args.seconds)
    finally:
        left = stop_abusers(threads, stop)
    print(json.dumps(tally.summary() | {"still_running": left}, indent=2))


if __name__ == "__main__":
    main()
