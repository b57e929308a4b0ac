"""What both services share: binding a port (optionally with TLS), the health
port, opening a channel to a peer, and reading flags' defaults from environment variables."""

from __future__ import annotations

import argparse
import faulthandler
import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.flags import add_flags, from_args, warn_unknown_variables
from specdec.limits import ConnectionLimits
from specdec.settings import cannot_listen, check_tls

# Both services cap messages alike: a long prompt plus its output as uint32
# ids is well under 1 MB; 8 MB leaves room and still bounds a hostile client.
MAX_MESSAGE_BYTES = 8 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


def bind(
    server: grpc.Server,
    host: str,
    port: int,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    tls_client_ca: str | None = None,
    flag: str = "--port",
) -> int:
    """Add the listening port (TLS when a certificate and key are given; mutual TLS,
    requiring a client certificate that ``tls_client_ca`` signed, when that is given too);
    returns the bound port. RuntimeError naming ``flag`` where the port cannot be had."""
    address = f"{host}:{port}"
    check_tls(tls_cert, tls_key, tls_client_ca, ("tls_cert", "tls_key", "tls_client_ca"), client=False)
    if tls_cert and tls_key:
        credentials = grpc.ssl_server_credentials(
            [(Path(tls_key).read_bytes(), Path(tls_cert).read_bytes())],
            root_certificates=Path(tls_client_ca).read_bytes() if tls_client_ca else None,
            require_client_auth=bool(tls_client_ca),
        )
        add = functools.partial(server.add_secure_port, server_credentials=credentials)
    else:
        add = server.add_insecure_port
    try:
        bound = add(address)
    except RuntimeError:  # grpcio raises where older releases returned 0; its own message points at its debug log
        bound = 0
    if bound == 0:
        raise RuntimeError(cannot_listen("gRPC", address, "in use, or not an address of this host", flag))
    return bound


def message_options(max_bytes: int) -> list[tuple[str, int]]:
    """gRPC server options capping messages both ways at ``max_bytes``."""
    return [("grpc.max_receive_message_length", max_bytes), ("grpc.max_send_message_length", max_bytes)]


# The streams that wait on their client and that every port offers: server
# reflection (bidirectional) and health Watch (one request, then updates).
AUXILIARY_STREAM_PREFIXES = ("/grpc.reflection.", "/grpc.health.v1.Health/Watch")
# How often the guard looks for streams silent too long: well under --auxiliary-stream-quiet-seconds's 1 s.
AUXILIARY_SWEEP_S = 0.25


class AuxiliaryStreamPool(futures.ThreadPoolExecutor):
    """The auxiliary streams' threads; counts the streams submitted and not yet finished
    (``pending``: running, or waiting for a thread), those not yet started (``waiting``,
    holding no thread), and the threads that cuts will free for them (``owed``)."""

    def __init__(self, workers: int) -> None:
        super().__init__(max_workers=workers, thread_name_prefix="auxiliary-stream")
        self._count_lock = threading.Lock()
        self.pending = 0
        self.waiting = 0
        # Threads freed by the guard's cuts and not yet taken by a waiting stream: the next sweep need not cut again for them.
        self.owed = 0

    def submit(self, fn, /, *args, **kwargs):
        started = threading.Event()

        def run():
            with self._count_lock:
                self.waiting -= 1
                self.owed = max(0, self.owed - 1)
                started.set()
            return fn(*args, **kwargs)

        def done(_future) -> None:  # however the call ends, run or not
            with self._count_lock:
                self.pending -= 1
                if not started.is_set():
                    self.waiting -= 1

        with self._count_lock:
            self.pending += 1
            self.waiting += 1
        try:
            future = super().submit(run)
        except BaseException:
            done(None)
            raise
        future.add_done_callback(done)
        return future


@dataclass
class _Stream:
    context: Any
    heard: float  # when its client last sent something, or it started (monotonic)
    cut: bool = False  # cancelled by the guard, not yet gone


class AuxiliaryStreamGuard(grpc.ServerInterceptor):
    """Serves the reflection and health Watch streams on threads of their own, never the
    service's: ``max_auxiliary_streams`` at once; one beyond waits for a thread, holding
    none, and beyond ``max_waiting_auxiliary_streams`` waiting it is RESOURCE_EXHAUSTED.
    A stream is cancelled once its client has been silent for ``auxiliary_stream_idle_s``,
    or for ``auxiliary_stream_quiet_s`` while another stream waits for its thread
    (the longest silent first). Other calls pass untouched.

    A synchronous server gives each stream a thread for as long as its client keeps it
    open: 16 idle streams took every thread of the drafter, and 88 every RPC slot of the
    verifier. A cap on open streams on the service's threads stopped that but refused
    bursts: of 16 grpcurl runs at once (each opens a reflection stream, asks within
    milliseconds, closes it when it exits), 8 failed. Here idle streams, from one caller
    or many, hold only this pool's threads, and only until someone else needs them."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.pool = AuxiliaryStreamPool(limits.max_auxiliary_streams)
        self._lock = threading.Lock()
        self._open: dict[int, _Stream] = {}
        self._next_id = 0
        self.refused = 0  # streams refused for want of room to wait
        self.ended_idle = 0  # streams cancelled for silence (idle, or quiet while others waited)
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None

    @property
    def open_streams(self) -> int:
        """Streams running on the pool's threads."""
        return len(self._open)

    @property
    def room(self) -> int:
        """Streams that may be running or waiting at once."""
        return self.limits.max_auxiliary_streams + self.limits.max_waiting_auxiliary_streams

    def intercept_service(self, continuation, handler_call_details):
        # Runs on the server's one polling thread, just before it submits the call: the
        # pool's count includes every stream admitted before this one.
        handler = continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(AUXILIARY_STREAM_PREFIXES):
            return handler
        if self.pool.pending >= self.room:
            self.refused += 1
            return self._refusal(handler)
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                self._guarded(handler.stream_stream, streaming_requests=True), handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._guarded(handler.unary_stream, streaming_requests=False), handler.request_deserializer, handler.response_serializer
            )
        return handler

    def _refusal(self, handler):
        """A handler that refuses at once, on a service thread (for microseconds): the
        pool's threads may all be held by streams waiting on their clients."""
        message = (
            f"{self.room} reflection or health Watch streams are open or waiting already "
            "(--max-auxiliary-streams, --max-waiting-auxiliary-streams); retry later, or use health Check"
        )

        def refuse(_request, context):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
            yield  # pragma: no cover - abort raises

        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(refuse, handler.request_deserializer, handler.response_serializer)
        return grpc.unary_stream_rpc_method_handler(refuse, handler.request_deserializer, handler.response_serializer)

    def _guarded(self, behaviour, streaming_requests: bool):
        def guarded(request, context):
            stream_id = self._enter(context)

            def leave() -> None:  # idempotent: both the callback and the finally call it
                with self._lock:
                    self._open.pop(stream_id, None)

            context.add_callback(leave)  # however the call ends, even if this generator is never closed
            try:
                yield from behaviour(self._heard(stream_id, request) if streaming_requests else request, context)
            finally:
                leave()

        # grpcio runs a behaviour on the pool its ``experimental_thread_pool`` names, instead of the server's.
        guarded.experimental_thread_pool = self.pool  # type: ignore[attr-defined]
        return guarded

    def _enter(self, context) -> int:
        with self._lock:
            self._next_id += 1
            stream_id = self._next_id
            self._open[stream_id] = _Stream(context, time.monotonic())
            if self._sweeper is None:
                self._sweeper = threading.Thread(target=self._sweep, name="auxiliary-stream-sweeper", daemon=True)
                self._sweeper.start()
        return stream_id

    def _heard(self, stream_id: int, requests):
        for request in requests:
            with self._lock:
                stream = self._open.get(stream_id)
                if stream is not None:
                    stream.heard = time.monotonic()
            yield request

    def _sweep(self) -> None:
        while not self._stop.wait(AUXILIARY_SWEEP_S):
            for context in self.silent_streams(time.monotonic()):
                self.ended_idle += 1
                context.cancel()

    def silent_streams(self, now: float) -> list:
        """The contexts to cancel now: those silent past the idle limit, and, for each stream
        waiting for a thread that no earlier cut frees, the longest silent past the quiet limit.

        E.g. idle 60 s, quiet 1 s, 2 waiting, open streams silent for 0.2, 3, 5 and 70 s:
        the 70 s one (idle) and the 5 s one (quiet; with the 70 s one's, two threads freed)."""
        with self._lock, self.pool._count_lock:
            if self.pool.waiting == 0:
                self.pool.owed = 0  # no one waits for the threads cut streams free
            live = [stream for stream in self._open.values() if not stream.cut]
            idle = [stream for stream in live if stream.heard < now - self.limits.auxiliary_stream_idle_s]
            quiet = sorted(
                (stream for stream in live if stream.heard < now - self.limits.auxiliary_stream_quiet_s and stream not in idle),
                key=lambda stream: stream.heard,
            )
            chosen = idle + quiet[: max(0, self.pool.waiting - self.pool.owed - len(idle))]
            for stream in chosen:
                stream.cut = True
            self.pool.owed += len(chosen)
        return [stream.context for stream in chosen]

    def stop(self) -> None:
        """Stop cutting silent streams (the server's stop ends them all)."""
        self._stop.set()


def grpc_server(
    limits: ConnectionLimits, workers: int, max_concurrent_rpcs: int, max_message_bytes: int
) -> tuple[grpc.Server, AuxiliaryStreamGuard]:
    """A synchronous gRPC server with ``workers`` threads that accepts at most
    ``max_concurrent_rpcs`` calls at once (running or waiting for a thread; beyond,
    RESOURCE_EXHAUSTED from gRPC itself, holding no thread), messages capped at
    ``max_message_bytes``, and ``limits`` on connections and auxiliary streams.
    Reflection and health Watch streams run on the guard's own threads, and gRPC's
    limit counts them on top of ``max_concurrent_rpcs``: they take neither from calls."""
    guard = AuxiliaryStreamGuard(limits)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers),
        interceptors=[guard],
        maximum_concurrent_rpcs=max_concurrent_rpcs + guard.room,
        # grpcio binds with SO_REUSEPORT by default: a second service on a taken port would
        # start and share its connections. Off, that start fails with the port named.
        options=[*message_options(max_message_bytes), *limits.options(), ("grpc.so_reuseport", 0)],
    )
    return server, guard


def peer_host(peer: str) -> str:
    """A gRPC peer's host, as HTTP names it: "ipv4:10.0.0.7:51234" -> "10.0.0.7",
    "ipv6:[::1]:51234" -> "::1"; anything else (a unix socket) as it is."""
    kind, _, address = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return peer
    host, _, port = address.rpartition(":")
    return host.strip("[]") if host and port.isdigit() else address


# How caller_identity names a caller known by its client certificate.
CERTIFICATE_CALLER = "certificate "


def bearer(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` value; None for any other value."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


def caller_identity(context) -> str:
    """Who calls, for per-caller ownership and limits: the client certificate's common name
    under mutual TLS, else the peer's host (its port changes per connection)."""
    names = context.auth_context().get("x509_common_name")
    if names:
        return CERTIFICATE_CALLER + names[0].decode("utf-8", "replace")
    return peer_host(context.peer() or "unknown")


def add_health_and_reflection(server: grpc.Server, service_name: str) -> health.HealthServicer:
    """What every service port offers beside its service: grpc.health.v1, NOT_SERVING for
    the whole server ("") and ``service_name`` until ``set_serving``, and server reflection."""
    health_servicer = health.HealthServicer()
    set_serving(health_servicer, service_name, False)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return health_servicer


def set_serving(health_servicer: health.HealthServicer, service_name: str, serving: bool) -> None:
    """Health for the whole server ("") and ``service_name``, together."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", service_name):
        health_servicer.set(name, status)


# Threads of the health port: a Check takes microseconds, and a Watch holds none.
HEALTH_WORKERS = 4


def serve_health(source: health.HealthServicer, host: str, port: int) -> tuple[grpc.Server, int]:
    """A second, plaintext gRPC server with only the health service (``source``, the
    service port's own, so both say the same), on threads of its own; returns it
    started, and its port.

    The service port's health shares that port's limits (the verifier's
    ``maximum_concurrent_rpcs``, the drafter's worker threads), so a busy
    service would fail its liveness probe and be restarted for being busy.
    Kubernetes' gRPC probes speak neither TLS nor client certificates, so
    this port is plaintext; it tells only SERVING or NOT_SERVING.
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=HEALTH_WORKERS, thread_name_prefix="health"))
    health_pb2_grpc.add_HealthServicer_to_server(source, server)
    bound = bind(server, host, port, flag="--health-port")
    server.start()
    return server, bound


def channel(
    target: str,
    tls_ca: str | os.PathLike | None = None,
    options: Sequence[tuple[str, object]] = (),
    tls_cert: str | os.PathLike | None = None,
    tls_key: str | os.PathLike | None = None,
) -> grpc.Channel:
    """A channel to a peer service: TLS, trusting ``tls_ca``, when one is given, presenting
    the client certificate ``tls_cert``/``tls_key`` when given (mutual TLS); ``options`` add to CHANNEL_OPTIONS."""
    options = CHANNEL_OPTIONS + list(options)
    check_tls(tls_cert, tls_key, tls_ca, ("tls_cert", "tls_key", "tls_ca"), client=True)
    if not tls_ca:
        return grpc.insecure_channel(target, options=options)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=Path(tls_ca).read_bytes(),
        private_key=Path(tls_key).read_bytes() if tls_key else None,
        certificate_chain=Path(tls_cert).read_bytes() if tls_cert else None,
    )
    return grpc.secure_channel(target, credentials, options=options)


def service_parser(cls: type, prog: str, description: str, env_prefix: str) -> argparse.ArgumentParser:
    """A service's command line, unparsed: ``--help`` groups its flags (and ``docs/reference`` is made from it)."""
    parser = argparse.ArgumentParser(prog=prog, description=description, usage="%(prog)s [-h] [--FLAG VALUE ...]")
    add_flags(parser, cls, env_prefix)
    return parser


def parse_service_config(
    cls: type, prog: str, description: str, env_prefix: str, argv: list[str] | None
) -> tuple[argparse.ArgumentParser, Any]:
    """A service's command line: a flag per field of config dataclass ``cls`` (``specdec.flags``).
    Returns the parser too; a rule a config's own checks enforce (ValueError) is a usage error."""
    parser = service_parser(cls, prog, description, env_prefix)
    warn_unknown_variables(parser, cls, env_prefix)
    args = parser.parse_args(argv)
    try:
        return parser, from_args(parser, cls, args)
    except ValueError as error:
        parser.error(str(error))


def stop_on_signals() -> threading.Event:
    """Logging set up, and an event that SIGTERM or SIGINT sets; SIGUSR1 prints every
    thread's stack. Call it before announcing the port: a supervisor may signal as soon
    as it reads it."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stopping = threading.Event()

    def on_signal(signum, _frame) -> None:
        logging.info("signal %s: draining", signum)
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # kill -USR1 prints every thread's stack to stderr and goes on: what a stuck process is doing.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    return stopping


# How often a service's main thread wakes while it waits for SIGTERM or SIGINT. The kernel may
# hand a signal sent to the process to any of its threads; Python's handler then runs only when
# the main thread next runs bytecode, which a wait without a timeout never lets it do, so such a
# service slept through its SIGTERM.
SIGNAL_POLL_S = 0.5


def wait_for_stop(stopping: threading.Event) -> None:
    """Return once ``stopping`` (``stop_on_signals``) is set, on the main thread, in short waits."""
    while not stopping.wait(SIGNAL_POLL_S):
        pass


def announce(name: str, host: str, port: int, metrics_port: int | None, detail: str, health_port: int | None = None) -> None:
    """The lines supervisors and tests read: the gRPC port first, then the metrics and health ports."""
    print(f"{name} listening on {host}:{port} ({detail})", flush=True)
    if metrics_port is not None:
        print(f"{name} metrics on {host}:{metrics_port}", flush=True)
    if health_port is not None:
        print(f"{name} health on {host}:{health_port}", flush=True)
