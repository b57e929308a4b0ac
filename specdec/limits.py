"""Limits both services share: what one gRPC connection or idle stream may hold
(``ConnectionLimits``, nested in both configs; ``specdec.serving`` applies them), and the
places each caller holds at once (``PerCaller``: the drafter's calls, the verifier's
requests). No gRPC import: a config (and the offline tools that read one) loads without it."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from specdec.flags import check_minimums, setting


@dataclass(frozen=True)
class ConnectionLimits:
    """What one connection, or one idle stream, may hold of a gRPC server (both services
    nest it in their config, so each field is a flag and a variable of each)."""

    # HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS: a client that wants more waits
    # client-side; one connection cannot take every RPC slot of the server.
    max_streams_per_connection: int = setting(64, minimum=1, help="concurrent streams one connection may open")
    # A connection with no RPC for this long is closed (GOAWAY); clients reconnect on their next call.
    connection_idle_s: float = setting(300.0, minimum=0.001, help="seconds a connection without calls stays open")
    # Every connection is recycled after this long (GOAWAY: new calls go to a new
    # connection), then cut after the grace, which bounds how long any stream on it
    # can be held. The grace outlasts the longest honest call: a 4,096-token
    # stream at ~10 tokens/s on a CPU is ~7 minutes.
    connection_age_s: float = setting(1800.0, minimum=0.001, help="seconds after which a connection is asked to close")
    connection_age_grace_s: float = setting(900.0, minimum=0.0, help="seconds a connection asked to close may finish its calls")
    # Keepalive: the server pings an idle connection this often and closes it when
    # the ping goes unanswered for keepalive_timeout_s, so dead peers free their streams.
    keepalive_s: float = setting(60.0, minimum=0.001, help="seconds between the server's keepalive pings on a quiet connection")
    keepalive_timeout_s: float = setting(20.0, minimum=0.001, help="seconds a keepalive ping may go unanswered")
    # Keepalive enforcement: a client that pings more often than this (twice) is
    # sent GOAWAY, so pings cannot be a flood. gRPC clients' keepalive defaults are minutes.
    min_client_ping_interval_s: float = setting(10.0, minimum=0.001, help="shortest interval between a client's pings")
    # Server reflection and health Watch streams wait on their client, each holding
    # a thread for as long as it stays open: they run on threads of their own, never
    # the service's, so idle ones cannot take the threads or slots calls need...
    max_auxiliary_streams: int = setting(
        8, minimum=1, help="reflection and health Watch streams served at once, on threads of their own (not the service's)"
    )
    # ...and a stream beyond waits for one of those threads, holding none: a burst of
    # grpcurl runs (each opens a reflection stream, asks 1-3 questions within
    # milliseconds and closes it) waits its turn instead of being refused. Each
    # waiting stream holds an RPC slot (added to the server's limit, not taken from
    # the service's calls), so they are bounded too.
    max_waiting_auxiliary_streams: int = setting(
        64, minimum=0, help="reflection and health Watch streams waiting for one of those threads; beyond, RESOURCE_EXHAUSTED"
    )
    # A stream ends when its client has been silent this long (a Watch sends
    # nothing after its request: it lasts this long, and watchers re-open it)...
    auxiliary_stream_idle_s: float = setting(
        60.0, minimum=0.001, help="seconds a reflection or health Watch stream may wait for its client"
    )
    # ...or this long while another stream waits for its thread: grpcurl asks its
    # questions milliseconds apart, and asks again on a new stream if its old one
    # was cut, so a second of silence means it is done asking.
    auxiliary_stream_quiet_s: float = setting(
        1.0, minimum=0.001, help="seconds of silence after which a reflection or health Watch stream gives its thread to a waiting one"
    )

    def __post_init__(self) -> None:
        check_minimums(self)

    def options(self) -> list[tuple[str, int]]:
        """gRPC core's channel arguments for these limits."""
        ms = lambda seconds: max(1, int(seconds * 1000))  # noqa: E731
        return [
            ("grpc.max_concurrent_streams", self.max_streams_per_connection),
            ("grpc.max_connection_idle_ms", ms(self.connection_idle_s)),
            ("grpc.max_connection_age_ms", ms(self.connection_age_s)),
            ("grpc.max_connection_age_grace_ms", ms(self.connection_age_grace_s)),
            ("grpc.keepalive_time_ms", ms(self.keepalive_s)),
            ("grpc.keepalive_timeout_ms", ms(self.keepalive_timeout_s)),
            ("grpc.http2.min_ping_interval_without_data_ms", ms(self.min_client_ping_interval_s)),
            ("grpc.http2.max_ping_strikes", 2),
            ("grpc.keepalive_permit_without_calls", 1),
        ]


class PerCaller:
    """Places each caller holds at once, at most ``limit`` each; safe from any thread.
    It counts and refuses; each service words its own refusal, naming its own flag.

    limit=2: take("a"), take("a") -> True, True; take("a") -> False (a's third at once);
    take("b") -> True (another caller's first); give_back("a"); take("a") -> True.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._in_flight: Counter[str] = Counter()  # callers holding none are absent, so 10,000 past callers cost nothing
        self._lock = threading.Lock()

    def in_flight(self, caller: str) -> int:
        return self._in_flight[caller]

    def take(self, caller: str) -> bool:
        """One of ``caller``'s places (``give_back`` it after), or False when it holds ``limit``."""
        with self._lock:
            if self._in_flight[caller] >= self.limit:
                return False
            self._in_flight[caller] += 1
            return True

    def give_back(self, caller: str) -> None:
        """Return a place ``take`` gave; a ValueError when ``caller`` holds none, since a count
        gone below zero would let the caller exceed its limit from then on."""
        with self._lock:
            if not self._in_flight[caller]:
                raise ValueError(f"{caller} gives back a place it does not hold")
            self._in_flight[caller] -= 1
            if not self._in_flight[caller]:
                del self._in_flight[caller]

    def hold(self, caller: str) -> Callable[[], None] | None:
        """``take``, as a function that gives the place back once however often it is called
        (a request that ends in several ways may call it from each), or None at the limit."""
        if not self.take(caller):
            return None
        # A latch: the first call acquires it and nobody releases it, so later calls do nothing.
        unreturned = threading.Lock()

        def give_back_once() -> None:
            if unreturned.acquire(blocking=False):
                self.give_back(caller)

        return give_back_once
