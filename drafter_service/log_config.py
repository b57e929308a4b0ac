"""The shared observation log's settings: ``LogConfig``, nested in ``DrafterConfig`` as the
``--log-*`` flags and ``SPECDEC_DRAFTER_LOG_*`` variables. No NATS here: the flags, their
defaults and their checks only (``drafter_service.log`` connects)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from drafter_service.log_format import PREFIX_PATTERN
from specdec import settings
from specdec.flags import check_minimums, setting

# A JetStream stream name: no dots, spaces, '*', '>' or path separators.
STREAM_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
URL_SCHEMES = ("nats", "tls")


@dataclass(frozen=True)
class LogConfig:
    """Where the log is, how long it keeps messages, and when a replica serves."""

    url: str | None = setting(
        None,
        help="NATS server(s) of the shared observation log, nats://HOST:PORT (comma-separated for a cluster; tls:// for TLS): "
        "replicas given the same log share one learned state (none: this drafter writes its tables directly, alone)",
    )
    stream: str = setting("SPECDEC_DRAFTER", help="JetStream stream of the log, created if missing")
    subject_prefix: str = setting("specdec.drafter", help="subjects of the log's messages: PREFIX.obs.VOCABULARY.SCOPE, PREFIX.admin")
    # One copy is all a single nats-server holds; a three-server JetStream cluster keeps three,
    # so a lost server loses nothing acknowledged.
    stream_replicas: int = setting(1, minimum=1, help="copies of the stream JetStream keeps (3 on a three-server cluster)")
    # Days of a busy service's observations; a replica left further behind bootstraps from a peer.
    max_bytes: int = setting(
        8 << 30, minimum=1 << 20, help="bytes the stream keeps; beyond, its oldest messages go (a replica that needs them bootstraps)"
    )
    max_age_s: float = setting(7 * 86400.0, minimum=1.0, help="seconds the stream keeps a message")
    # A verifier retries an Observe within seconds; JetStream's own default is two minutes.
    duplicate_window_s: float = setting(
        120.0, minimum=1.0, help="seconds within which JetStream stores a republished Observe (same observe_id) once"
    )
    # The verifier's Observe deadline is 10 s: an answer within it lets the verifier retry.
    publish_timeout_s: float = setting(
        5.0, minimum=0.001, help="seconds Observe waits for the log's acknowledgement; beyond, UNAVAILABLE (retry with the same id)"
    )
    # Acknowledging costs NATS a fraction of what applying costs a replica: without a bound, a
    # burst of Observe would put replicas minutes behind. Half a second keeps what one verifier
    # teaches in another's drafts within about a second.
    max_publish_lag_s: float = setting(
        0.5,
        minimum=0.0,
        help="seconds this replica may be behind the log and still publish at once; beyond, Observe waits for it (up to "
        "--log-publish-timeout-seconds, then RESOURCE_EXHAUSTED): the log grows no faster than replicas apply it",
    )
    # About a second of a busy drafter's writes: drafts from a replica this close are as warm.
    max_serving_lag: int = setting(1000, minimum=0, help="log messages a replica may be behind and still say SERVING (health, readiness)")
    bootstrap_wait_s: float = setting(
        10.0,
        minimum=0.1,
        help="seconds a replica the log has left behind waits for a peer's snapshot before it applies what the log still holds",
    )
    # Predictions are resent every step: half a second of them is one small message a table.
    successor_interval_s: float = setting(
        0.5, minimum=0.01, help="seconds between a drafter's coalesced successor-table messages (one per table)"
    )
    max_successor_keys: int = setting(
        1 << 14, minimum=1, help="successor keys a drafter holds for the log per table between messages; beyond, dropped (hints)"
    )
    # A transaction of a few hundred small messages commits in milliseconds, and one fsync
    # serves them all.
    apply_batch: int = setting(256, minimum=1, help="log messages a replica applies in one transaction at most")
    user: str | None = setting(None, help="user the drafter connects to NATS as (with --log-password or --log-password-file)")
    # Not in the config's repr (the start-up log).
    password: str | None = setting(None, repr=False, help="password of --log-user. Prefer the variable or --log-password-file")
    password_file: str | None = setting(None, help="file holding --log-password (its first line)")
    nkey_file: str | None = setting(None, help="file holding the drafter's NATS nkey seed (instead of a user and password)")
    tls_ca: str | None = setting(None, help="PEM root certificate: reach NATS over TLS")
    tls_cert: str | None = setting(None, help="PEM client certificate for NATS (with --log-tls-key)")
    tls_key: str | None = setting(None, help="PEM key of --log-tls-cert")

    def __post_init__(self) -> None:
        check_minimums(self)
        settings.check_tls(self.tls_cert, self.tls_key, self.tls_ca, ("--log-tls-cert", "--log-tls-key", "--log-tls-ca"), client=True)
        for server in self.servers():
            parts = urlsplit(server)
            if parts.scheme not in URL_SCHEMES or not parts.hostname or parts.path not in ("", "/"):
                raise ValueError(f"--log-url: {server!r} is not nats://HOST:PORT or tls://HOST:PORT")
            try:
                parts.port  # noqa: B018 (raises for a port out of range)
            except ValueError:
                raise ValueError(f"--log-url: {server!r} has a port out of range") from None
        if self.url is not None and not self.servers():
            raise ValueError("--log-url names no server")
        if not STREAM_PATTERN.fullmatch(self.stream):
            raise ValueError(f"--log-stream {self.stream!r}: 1-64 letters, digits, '_' or '-'")
        if not PREFIX_PATTERN.fullmatch(self.subject_prefix):
            raise ValueError(f"--log-subject-prefix {self.subject_prefix!r}: dot-separated words of letters, digits, '_' or '-'")
        if (self.password or self.password_file) and not self.user:
            raise ValueError("--log-password needs --log-user")
        if self.nkey_file and self.user:
            raise ValueError("--log-nkey-file and --log-user are two ways to sign in to NATS: give one")
        self.secret()  # fail fast: an unreadable password file is a usage error

    @property
    def enabled(self) -> bool:
        return self.url is not None

    def servers(self) -> list[str]:
        """--log-url as a list of server URLs."""
        return [server.strip() for server in (self.url or "").split(",") if server.strip()]

    def secret(self) -> str | None:
        """--log-password, else the first line of --log-password-file."""
        return settings.secret(self.password, self.password_file, "--log-password")

    @property
    def snapshot_bucket(self) -> str:
        """The object-store bucket replicas hand snapshots over in."""
        return f"{self.stream}_SNAPSHOTS"
