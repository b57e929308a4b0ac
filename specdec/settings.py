"""The settings every service has (its /metrics and health ports, its TLS files), declared
by each service's config dataclass with these so that ``--help`` lists them like every
other flag; and the TLS rules, written once for servers and clients. No gRPC here: the
drafter's offline ``check`` reads its config without importing gRPC."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specdec.flags import setting

TLS = "TLS"  # the --help group of the TLS flags


def metrics_port_setting(default: int) -> Any:
    return setting(default, minimum=0, off=-1, group="server", help="Prometheus /metrics port (0: a free one; -1 or none: off)")


def cannot_listen(protocol: str, address: str, reason: str, flag: str, off: str | None = None) -> str:
    """The line a service stops with when one of its ports cannot be had: which, why, and
    the flag that moves it (``off``: what turns that port off, where something does)."""
    advice = f"{flag}: 0 takes a free port" + (f", {off}" if off else "")
    return f"cannot listen for {protocol} on {address}: {reason} ({advice})"


def health_port_setting() -> Any:
    return setting(
        None,
        minimum=0,
        off=-1,
        group="server",
        help="plaintext gRPC health service on threads of its own, answered at any load: for liveness and "
        "readiness probes (0: a free one; -1 or none: off, health on the service port only)",
    )


def tls_cert_setting() -> Any:
    return setting(None, group=TLS, help="PEM certificate: serve over TLS (with --tls-key)")


def tls_key_setting() -> Any:
    return setting(None, group=TLS, help="PEM key of --tls-cert")


def tls_client_ca_setting() -> Any:
    return setting(None, group=TLS, help="PEM CA: require client certificates it signed (mutual TLS; needs --tls-cert)")


def check_tls(cert: object, key: object, trust: object, names: tuple[str, str, str], client: bool) -> None:
    """The TLS rules, for a server's settings or a client's: a certificate and its key go
    together; a server checks client certificates (``trust``: their CA) only over TLS of its
    own; a client presents a certificate only over TLS (``trust``: the server's CA).
    ``names`` are the three settings' names as the user wrote them. ValueError otherwise."""
    cert_name, key_name, trust_name = names
    if bool(cert) != bool(key):
        raise ValueError(f"{cert_name} and {key_name} go together")
    if client and cert and not trust:
        raise ValueError(f"{cert_name} needs {trust_name}: a client certificate is sent over TLS only")
    if not client and trust and not cert:
        raise ValueError(f"{trust_name} needs {cert_name} and {key_name}: client certificates are checked over TLS only")


SERVER_TLS_FLAGS = ("--tls-cert", "--tls-key", "--tls-client-ca")


def secret(value: str | None, path: str | None, flag: str) -> str | None:
    """A secret given as ``value`` (a flag or variable), else as the first line of the file
    ``path`` (``flag``-file), else None; ValueError naming the flag when the file cannot be
    read or its first line is empty. Files keep secrets off command lines and out of logs."""
    if value:
        return value.strip()
    if not path:
        return None
    try:
        first = Path(path).read_text(encoding="utf-8").partition("\n")[0].strip()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"cannot read {flag}-file {path}: {error}") from None
    if not first:
        raise ValueError(f"{flag}-file {path} holds nothing on its first line")
    return first
