"""What both services share: binding a port (optionally with TLS), opening a
channel to a peer, and reading flags' defaults from environment variables."""

from __future__ import annotations

import os
from pathlib import Path

import grpc

# Both services cap messages alike: a long prompt plus its output as uint32
# ids is well under 1 MB; 8 MB leaves room and still bounds a hostile client.
MAX_MESSAGE_BYTES = 8 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


def bind(server: grpc.Server, host: str, port: int, tls_cert: str | None = None, tls_key: str | None = None) -> int:
    """Add the listening port (TLS when a certificate and key are given); returns the bound port."""
    address = f"{host}:{port}"
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("TLS needs both a certificate and a key (got only one)")
    if tls_cert:
        credentials = grpc.ssl_server_credentials([(Path(tls_key).read_bytes(), Path(tls_cert).read_bytes())])
        bound = server.add_secure_port(address, credentials)
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise RuntimeError(f"could not bind {address}")
    return bound


def channel(target: str, tls_ca: str | None = None) -> grpc.Channel:
    """A channel to a peer service; TLS, trusting ``tls_ca``, when one is given."""
    if not tls_ca:
        return grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
    credentials = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes())
    return grpc.secure_channel(target, credentials, options=CHANNEL_OPTIONS)


def env_default(prefix: str, name: str, default):
    """The environment's value for a flag (``prefix`` + NAME), else ``default``."""
    return os.environ.get(prefix + name.upper(), default)
