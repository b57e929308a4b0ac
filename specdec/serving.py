"""What both services share: binding a port (optionally with TLS), the health
port, opening a channel to a peer, and reading flags' defaults from environment variables."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.flags import add_flags, from_args
from specdec.limits import ConnectionLimits
from specdec.settings import check_tls

# Both services cap messages alike: a long prompt plus its output as uint32
# ids is well under 1 MB; 8 MB leaves room and still bounds a hostile client.
MAX_MESSAGE_BYTES = 8 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


def bind(
    server: grpc.Server, host: str, port: int, tls_cert: str | None = None, tls_key: str | None = None, tls_client_ca: str | None = None
) -> int:
    """Add the listening port (TLS when a certificate and key are given; mutual TLS,
    requiring a client certificate that ``tls_client_ca`` signed, when that is given too);
    returns the bound port."""
    address = f"{host}:{port}"
    check_tls(tls_cert, tls_key, tls_client_ca, ("tls_cert", "tls_key", "tls_client_ca"), client=False)
    if tls_cert and tls_key:
        credentials = grpc.ssl_server_credentials(
            [(Path(tls_key).read_bytes(), Path(tls_cert).read_bytes())],
            root_certificates=Path(tls_client_ca).read_bytes() if tls_client_ca else None,
            require_client_auth=bool(tls_client_ca),
        )
        bound = server.add_secure_port(address, credentials)
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise RuntimeError(f"could not bind {address}")
    return bound


def message_options(max_bytes: int) -> list[tuple[str, int]]:
    """gRPC server options capping messages both ways at ``max_bytes``."""
    return [("grpc.max_receive_message_length", max_bytes), ("grpc.max_send_message_length", max_bytes)]


# The streams that wait on their client and that every port offers: server
# reflection (bidirectional) and health Watch (one request, then updates).
AUXILIARY_STREAM_PREFIXES = ("/grpc.reflection.", "/grpc.health.v1.Health/Watch")
# How often the guard looks for streams silent too long.
AUXILIARY_SWEEP_S = 0.5


class AuxiliaryStreamGuard(grpc.ServerInterceptor):
    """Bounds the reflection and health Watch streams: at most ``max_auxiliary_streams`` at once
    (RESOURCE_EXHAUSTED beyond, before any worker waits), each cancelled once its client has
    been silent for ``auxiliary_stream_idle_s``. Other calls pass untouched.

    An idle stream holds one of a synchronous server's worker threads for as long as
    its client keeps it open: 16 such streams took every thread of the drafter, and 88
    every RPC slot of the verifier. A sweeper thread cancels the silent ones."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._open: dict[int, list] = {}  # id -> [context, last heard from (monotonic)]
        self._next_id = 0
        self.refused = 0  # streams refused for want of a slot
        self.ended_idle = 0  # streams cancelled for silence
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None

    @property
    def open_streams(self) -> int:
        return len(self._open)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(AUXILIARY_STREAM_PREFIXES):
            return handler
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                self._guarded(handler.stream_stream, streaming_requests=True), handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._guarded(handler.unary_stream, streaming_requests=False), handler.request_deserializer, handler.response_serializer
            )
        return handler

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

        return guarded

    def _enter(self, context) -> int:
        with self._lock:
            if len(self._open) >= self.limits.max_auxiliary_streams:
                self.refused += 1
                full = True
            else:
                full = False
                self._next_id += 1
                stream_id = self._next_id
                self._open[stream_id] = [context, time.monotonic()]
            if self._sweeper is None:
                self._sweeper = threading.Thread(target=self._sweep, name="auxiliary-stream-sweeper", daemon=True)
                self._sweeper.start()
        if full:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.limits.max_auxiliary_streams} reflection or health Watch streams are open already "
                "(--max-auxiliary-streams); retry later, or use health Check",
            )
        return stream_id

    def _heard(self, stream_id: int, requests):
        for request in requests:
            with self._lock:
                if stream_id in self._open:
                    self._open[stream_id][1] = time.monotonic()
            yield request

    def _sweep(self) -> None:
        while not self._stop.wait(AUXILIARY_SWEEP_S):
            silent_since = time.monotonic() - self.limits.auxiliary_stream_idle_s
            with self._lock:
                silent = [context for context, heard in self._open.values() if heard < silent_since]
            for context in silent:
                self.ended_idle += 1
                context.cancel()

    def stop(self) -> None:
        self._stop.set()


def grpc_server(
    limits: ConnectionLimits, workers: int, max_concurrent_rpcs: int, max_message_bytes: int
) -> tuple[grpc.Server, AuxiliaryStreamGuard]:
    """A synchronous gRPC server with ``workers`` threads that accepts at most
    ``max_concurrent_rpcs`` calls at once (running or waiting for a thread; beyond,
    RESOURCE_EXHAUSTED from gRPC itself, holding no thread), messages capped at
    ``max_message_bytes``, and ``limits`` on connections and auxiliary streams."""
    guard = AuxiliaryStreamGuard(limits)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers),
        interceptors=[guard],
        maximum_concurrent_rpcs=max_concurrent_rpcs,
        options=message_options(max_message_bytes) + limits.options(),
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
    bound = bind(server, host, port)
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


def parse_service_config(
    cls: type, prog: str, description: str, env_prefix: str, argv: list[str] | None
) -> tuple[argparse.ArgumentParser, Any]:
    """A service's command line: a flag per field of config dataclass ``cls`` (``specdec.flags``).
    Returns the parser too; a rule a config's own checks enforce (ValueError) is a usage error."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_flags(parser, cls, env_prefix)
    args = parser.parse_args(argv)
    try:
        return parser, from_args(parser, cls, args)
    except ValueError as error:
        parser.error(str(error))


def stop_on_signals() -> threading.Event:
    """Logging set up, and an event that SIGTERM or SIGINT sets. Call it before
    announcing the port: a supervisor may signal as soon as it reads it."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stopping = threading.Event()

    def on_signal(signum, _frame) -> None:
        logging.info("signal %s: draining", signum)
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stopping


def announce(name: str, host: str, port: int, metrics_port: int | None, detail: str, health_port: int | None = None) -> None:
    """The lines supervisors and tests read: the gRPC port first, then the metrics and health ports."""
    print(f"{name} listening on {host}:{port} ({detail})", flush=True)
    if metrics_port is not None:
        print(f"{name} metrics on {host}:{metrics_port}", flush=True)
    if health_port is not None:
        print(f"{name} health on {host}:{health_port}", flush=True)
