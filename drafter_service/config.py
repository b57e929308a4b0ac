"""The drafter's settings: ``DrafterConfig``, one frozen dataclass whose fields are the
flags and SPECDEC_DRAFTER_* variables (``specdec.flags``). Imports no gRPC or LMDB,
so offline tools (``drafter_service.check``) and the store's lifecycle can use it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from drafter_service.ngram import NGramConfig
from specdec.flags import check_minimums, setting

# Beside Prometheus' own 9090 without clashing with the usual node exporters.
DEFAULT_METRICS_PORT = 9101
VOCABULARY_PATTERN = re.compile(r"[0-9a-f]{16}")  # always with fullmatch: "$" also matches before a final newline


@dataclass(frozen=True)
class DrafterConfig:
    """The drafter's settings; each field is a flag and a SPECDEC_DRAFTER_* variable
    (``specdec.flags``), apart from SERVING_FIELDS. Lower bounds hold in-process too."""

    port: int = setting(50051, help="gRPC port (0: a free one; tests, several instances on one host)")
    host: str = setting("127.0.0.1", help="address to bind")
    db: str = setting("data/drafter", help="directory of the LMDB tables, one per vocabulary fingerprint")
    # 1 GiB is days of a busy service's n-grams.
    max_bytes: int = setting(1 << 30, minimum=1 << 16, help="size bound per vocabulary's table, in bytes")
    ngram: NGramConfig = field(default_factory=NGramConfig)
    # Verification cost grows with K, and n-gram chains rarely stay right for
    # more than a few dozen tokens.
    max_draft_tokens: int = setting(32, minimum=1, help="draft tokens one sequence may ask for")
    # Above every real vocabulary (~260k), far below uint32 overflow, so a
    # corrupt id fails loudly instead of polluting the table.
    max_token_id: int = setting(1 << 24, minimum=1, help="token ids must be below this")
    # Each is a small dict of its context's n-grams.
    max_sessions: int = setting(10_000, minimum=1, help="sessions open at once")
    # A verifier needs one per in-flight request (a batch is at most a few
    # hundred), so no single client, broken or hostile, can take every session from the others.
    max_sessions_per_caller: int = setting(
        2048, minimum=1, help="sessions one caller (client certificate, else peer address) holds at once"
    )
    # Indexed, ~600 bytes each: a 128K-token context, and ~80 MB per session at most.
    max_session_tokens: int = setting(1 << 17, minimum=1, help="tokens one session may hold")
    # Its verifier request is surely gone by then.
    session_idle_timeout_s: float = setting(600.0, minimum=0.001, help="seconds after which an untouched session is closed")
    # A verifier batch is at most a few hundred.
    max_sequences_per_call: int = setting(1024, minimum=1, help="sequences in one Propose or Observe")
    # A 128K-token context; bounds one call's memory and time.
    max_tokens_per_call: int = setting(1 << 17, minimum=1, help="tokens in one Propose or Observe")
    max_pending_observations: int = setting(
        4096, minimum=1, help="observations queued for the writer; beyond, Observe answers RESOURCE_EXHAUSTED"
    )
    # 128K uint32 tokens encode to at most ~0.7 MB.
    max_message_bytes: int = setting(8 << 20, minimum=1, help="gRPC message size cap, both ways, in bytes")
    grace_s: float = setting(5.0, minimum=0.0, help="seconds SIGTERM gives in-flight calls")
    max_workers: int = setting(16, minimum=1, help="gRPC worker threads: calls served at once")
    # One LMDB table each: 3 file descriptors and 8x max_bytes of address space;
    # a deployment serves one or two models.
    max_vocabularies: int = setting(8, minimum=1, help="tables (one per tokenizer fingerprint) the drafter creates")
    dedup_window_hours: int = setting(24, minimum=1, help="hours an observe_id is remembered, so that a retry is not counted twice")
    # One commit of a 128K-token call dirties ~40 MB; as etcd's NOSPACE alarm,
    # Propose keeps serving, and writes resume once space is back.
    min_free_mb: int = setting(
        64, minimum=1, help="MiB the disk holding --db keeps free: below, writes are refused (RESOURCE_EXHAUSTED) and drafts still served"
    )
    # When set, the main port refuses Stats and Backup (PERMISSION_DENIED), so
    # verifiers' network reaches only Propose, Observe, CloseSessions.
    admin_port: int | None = setting(
        None, help="serve Stats and Backup on this port only, on --admin-host (0: a free one; none: on the main port)"
    )
    admin_host: str = setting("127.0.0.1", help="address of the admin port")
    # One folder per backup, named by the caller. Never the --db directory or inside it.
    backup_dir: str | None = setting(None, help="directory the Backup RPC writes into, outside --db (none: Backup refused)")
    # The flags every service shares (serving.add_serving_flags):
    # Prometheus /metrics port (0: a free one; None: not served, the default
    # for in-process servers; the command line serves on DEFAULT_METRICS_PORT).
    metrics_port: int | None = None
    # Plaintext gRPC health Check outside the worker pool (serving.serve_health); None: not served.
    health_port: int | None = None
    # PEM certificate and key: serve over TLS when both are set.
    tls_cert: str | None = None
    tls_key: str | None = None
    # PEM CA: require client certificates it signed (mutual TLS).
    tls_client_ca: str | None = None

    def __post_init__(self) -> None:
        check_minimums(self)
        if self.backup_dir is not None:
            backups, db = Path(self.backup_dir).resolve(), Path(self.db).resolve()
            if backups == db or db in backups.parents:
                raise ValueError(f"the backup directory {self.backup_dir!r} must lie outside the table directory {self.db!r}")


SERVING_FIELDS = ("tls_cert", "tls_key", "tls_client_ca", "metrics_port", "health_port")
