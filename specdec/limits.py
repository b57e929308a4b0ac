"""Limits on what one gRPC connection or idle stream may hold, shared by both services'
configs. No gRPC import: a config (and the offline tools that read one) loads without it;
``specdec.serving`` applies them."""

from __future__ import annotations

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
