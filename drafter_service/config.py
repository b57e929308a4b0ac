"""The drafter's settings: ``DrafterConfig``, one frozen dataclass whose fields are the
flags and SPECDEC_DRAFTER_* variables (``specdec.flags``). Imports no gRPC or LMDB,
so offline tools (``drafter_service.check``) and the store's lifecycle can use it."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path

from drafter_service.context_index import MAX_TOKEN_ID, MAX_TOKENS
from drafter_service.log_config import LogConfig
from drafter_service.ngram import NGramConfig
from specdec import settings
from specdec.flags import check_minimums, nested, setting
from specdec.limits import ConnectionLimits

# Beside Prometheus' own 9090 without clashing with the usual node exporters.
DEFAULT_METRICS_PORT = 9101
# --help groups (specdec.flags).
SERVER, STORAGE, CLIENTS, DRAFTING = "server", "storage", "scopes and clients", "drafting"
SESSIONS, CALLS, WRITER, CONNECTIONS = "sessions", "one call's limits", "the writer's queues", "gRPC connections"
LOG = "replication (--log-url)"
VOCABULARY_PATTERN = re.compile(r"[0-9a-f]{16}")  # always with fullmatch: "$" also matches before a final newline


@dataclass(frozen=True)
class DrafterConfig:
    """The drafter's settings; each field is a flag and a SPECDEC_DRAFTER_* variable
    (``specdec.flags``). Lower bounds hold in-process too."""

    port: int = setting(50051, group=SERVER, help="gRPC port (0: a free one; tests, several instances on one host)")
    host: str = setting("127.0.0.1", group=SERVER, help="address to bind")
    db: str = setting("data/drafter", group=STORAGE, help="directory of the LMDB tables, one per vocabulary fingerprint and learning scope")
    # 1 GiB is days of a busy service's n-grams. Each scope's table has its own bound, so
    # one scope's flood evicts only its own n-grams.
    max_bytes: int = setting(
        1 << 30, group=STORAGE, minimum=1 << 16, help="size bound of each table (one per vocabulary and scope), in bytes"
    )
    # A scope is a tenant (an API key, or an organisation's keys): 64 tables of at most
    # --max-bytes each; an operator with more tenants lowers --max-bytes and raises this.
    max_scopes: int = setting(
        64,
        group=STORAGE,
        minimum=1,
        help="scopes (tables) per vocabulary that writes may create; beyond, a new scope drafts from its contexts only",
    )
    # Not in the config's repr (the start-up log). With it (or --verifier-identities), only
    # clients that present it may declare a learning scope; others learn in their own.
    client_token: str | None = setting(
        None,
        group=CLIENTS,
        repr=False,
        help="token verifiers present ('authorization: Bearer TOKEN') to declare learning scopes; other clients get a scope of "
        "their own (none: any client may declare one). Prefer the variable or --client-token-file",
    )
    client_token_file: str | None = setting(None, group=CLIENTS, help="file holding --client-token (its first line)")
    # Common names of verifiers' client certificates (mutual TLS, --tls-client-ca).
    verifier_identities: str | None = setting(
        None, group=CLIENTS, help="client-certificate common names (comma-separated) that may declare learning scopes, under mutual TLS"
    )
    # A drafter reachable from a network with neither lets any client that can reach it
    # declare any scope: safe only when the network itself is the boundary.
    insecure: bool = setting(
        False, group=CLIENTS, help="serve on a non-loopback --host without --client-token or --verifier-identities (a private network only)"
    )
    ngram: NGramConfig = nested(NGramConfig, group=DRAFTING)
    # Verification cost grows with K, and n-gram chains rarely stay right for
    # more than a few dozen tokens.
    max_draft_tokens: int = setting(32, group=DRAFTING, minimum=1, help="draft tokens one sequence may ask for")
    # A tree costs the drafter ~a lookup per node; 256 nodes is more than a
    # GPU's verify pass wants per sequence.
    max_tree_nodes: int = setting(
        256, group=DRAFTING, minimum=1, help="draft tree nodes one sequence may ask for (SequenceUpdate.max_tree_nodes)"
    )
    # Above every real vocabulary (~260k), far below uint32 overflow, so a
    # corrupt id fails loudly instead of polluting the table.
    max_token_id: int = setting(1 << 24, group=CALLS, minimum=1, help="token ids must be below this")
    # Each is a small dict of its context's n-grams.
    max_sessions: int = setting(10_000, group=SESSIONS, minimum=1, help="sessions open at once")
    # A verifier needs one per in-flight request (a batch is at most a few
    # hundred), so no single client, broken or hostile, can take every session from the others.
    max_sessions_per_caller: int = setting(
        2048, group=SESSIONS, minimum=1, help="sessions one caller (client certificate, else peer address) holds at once"
    )
    # A 128K-token context.
    max_session_tokens: int = setting(1 << 17, group=SESSIONS, minimum=1, help="tokens one session may hold")
    # Context indexes, accounted before any token is indexed (sessions.session_bytes):
    # 1 GiB holds a full batch of 16 x 8K-token requests ~400 times over.
    max_session_bytes: int = setting(1 << 30, group=SESSIONS, minimum=1 << 16, help="bytes all sessions' context indexes may take")
    # A quarter of it: one client, broken or hostile, leaves the rest to the others.
    max_session_bytes_per_caller: int = setting(1 << 28, group=SESSIONS, minimum=1 << 16, help="bytes one caller's sessions may take")
    # Its verifier request is surely gone by then.
    session_idle_timeout_s: float = setting(600.0, group=SESSIONS, minimum=0.001, help="seconds after which an untouched session is closed")
    # A verifier batch is at most a few hundred.
    max_sequences_per_call: int = setting(1024, group=CALLS, minimum=1, help="sequences in one Propose or Observe")
    # A 128K-token context; bounds one call's memory and time.
    max_tokens_per_call: int = setting(1 << 17, group=CALLS, minimum=1, help="tokens in one Propose or Observe")
    max_pending_observations: int = setting(
        4096, group=WRITER, minimum=1, help="observations queued for the writer; beyond, Observe answers RESOURCE_EXHAUSTED"
    )
    # ~10 s of the writer's work here (~100k tokens/s), ~40 MB of queued ids.
    max_pending_write_tokens: int = setting(
        1 << 20, group=WRITER, minimum=1, help="tokens queued for the writer; beyond, Observe and CloseSessions answer RESOURCE_EXHAUSTED"
    )
    # A handler waits for its write no longer than its caller's deadline, nor than
    # this: the verifier's Observe deadline is 10 s, and a backlog of
    # --max-pending-write-tokens takes ~10 s to commit.
    max_write_wait_s: float = setting(30.0, group=WRITER, minimum=0.001, help="seconds a call waits for its write to be stored")
    # The successor table (the target's own predictions, SequenceUpdate.predictions):
    # a verifier sends one record per position it scored, a few dozen per
    # sequence per step. One key per token plus one per (previous, current) pair seen.
    max_successor_entries: int = setting(
        1 << 20, group=STORAGE, minimum=1, help="successor-table keys per table; beyond, the keys least recently written are evicted"
    )
    max_predicted_positions: int = setting(1024, group=CALLS, minimum=1, help="positions of predictions one sequence may send per call")
    # A batch of 16 sends ~16 x 40 positions x k 4 ~ 2,600 a step: 64K is 25 such steps in
    # one call, and bounds a call's successor work (~65K keys) apart from its tokens.
    max_predictions_per_call: int = setting(
        1 << 16, group=CALLS, minimum=1, help="predicted tokens (positions x k, over every sequence) one Propose may carry"
    )
    # Each position is two successor-table keys whatever its k: at k 1 the limit above
    # let one call carry 65K positions (131K keys), holding the interpreter long enough
    # that other callers' Propose missed their deadlines. A verifier sends at most 4,096
    # (drafter_client.PREDICTED_POSITIONS_PER_CALL), ~15 steps of a batch of 16's trees.
    max_predicted_positions_per_call: int = setting(
        16_384, group=CALLS, minimum=1, help="positions of predictions (over every sequence) one Propose may carry"
    )
    # ~one busy second of a batch of 16's predictions: the writer stores them within milliseconds.
    max_pending_successors: int = setting(
        1 << 16, group=WRITER, minimum=1, help="successor-table keys waiting for the writer; beyond, dropped (hints)"
    )
    # A quarter of each writer bound per scope (with room for one whole call): one scope's
    # flood never takes the queue from the others.
    max_pending_observations_per_scope: int | None = setting(
        None,
        group=WRITER,
        minimum=1,
        help="observations one scope may have queued for the writer (none: a quarter of --max-pending-observations)",
    )
    max_pending_write_tokens_per_scope: int | None = setting(
        None,
        group=WRITER,
        minimum=1,
        help="tokens one scope may have queued for the writer (none: a quarter of --max-pending-write-tokens)",
    )
    max_pending_successors_per_scope: int | None = setting(
        None, group=WRITER, minimum=1, help="successor-table keys one scope may have waiting (none: a quarter of --max-pending-successors)"
    )
    # 128K uint32 tokens encode to at most ~0.7 MB.
    max_message_bytes: int = setting(8 << 20, group=SERVER, minimum=1, help="gRPC message size cap, both ways, in bytes")
    grace_s: float = setting(5.0, group=SERVER, minimum=0.0, help="seconds SIGTERM gives in-flight calls")
    # Threads wait more than they compute (the GIL serialises the work): 32 let one
    # caller's half (--max-calls-per-caller) hold a 16-client burst, as the load bench sends.
    max_workers: int = setting(32, group=SERVER, minimum=2, help="gRPC worker threads: calls served at once")
    # Calls waiting on the writer hold a thread each: at most this many at once
    # (beyond, RESOURCE_EXHAUSTED), so the other threads always serve Propose.
    max_write_calls: int | None = setting(
        None,
        group=SERVER,
        minimum=1,
        help="Observe and observing CloseSessions calls served at once, below --max-workers (none: a quarter of them)",
    )
    # A verifier makes one Propose per step and one write at a time: half the
    # threads leave the other half to every other caller.
    max_calls_per_caller: int | None = setting(
        None, group=SERVER, minimum=1, help="calls one caller has running at once, at most --max-workers (none: half of them)"
    )
    # Calls beyond the threads wait for one; beyond this many in all, gRPC
    # answers RESOURCE_EXHAUSTED without holding a thread.
    max_concurrent_calls: int = setting(256, group=SERVER, minimum=1, help="calls accepted at once, running or waiting for a thread")
    connections: ConnectionLimits = nested(ConnectionLimits, group=CONNECTIONS)
    # Replicas sharing one learned state through an observation log on NATS JetStream.
    log: LogConfig = nested(LogConfig, prefix="log-", group=LOG)
    # One LMDB table each: 3 file descriptors and 8x max_bytes of address space;
    # a deployment serves one or two models.
    max_vocabularies: int = setting(8, group=STORAGE, minimum=1, help="tables (one per tokenizer fingerprint) the drafter creates")
    # A walk reads ~1 M records a second here (~2 s from a cold disk): a million keeps a
    # restart within a few seconds, and tables up to ~40 MB tracked are walked whole.
    max_startup_walk_records: int = setting(
        1_000_000,
        minimum=1,
        group=STORAGE,
        formerly=["startup-walk-records"],
        help="records of each table walked and checked at start-up, before SERVING (smaller tables: all)",
    )
    dedup_window_hours: int = setting(
        24, group=STORAGE, minimum=1, help="hours an observe_id is remembered, so that a retry is not counted twice"
    )
    # One commit of a 128K-token call dirties ~40 MB; as etcd's NOSPACE alarm,
    # Propose keeps serving, and writes resume once space is back.
    min_free_bytes: int = setting(
        64 << 20,
        minimum=1 << 20,
        group=STORAGE,
        help="bytes the disk holding --db keeps free: below, writes are refused (RESOURCE_EXHAUSTED) and drafts still served",
    )
    # When set, the main port refuses Stats and Backup (PERMISSION_DENIED), so
    # verifiers' network reaches only Propose, Observe, CloseSessions.
    admin_port: int | None = setting(
        None, group=SERVER, help="serve Stats and Backup on this port only, on --admin-host (0: a free one; none: on the main port)"
    )
    admin_host: str = setting("127.0.0.1", group=SERVER, help="address of the admin port")
    # One folder per backup, named by the caller. Never the --db directory or inside it.
    backup_dir: str | None = setting(None, group=STORAGE, help="directory the Backup RPC writes into, outside --db (none: Backup refused)")
    # The settings every service has (specdec.serving): health outside the worker pool.
    metrics_port: int | None = settings.metrics_port_setting(DEFAULT_METRICS_PORT)
    health_port: int | None = settings.health_port_setting()
    tls_cert: str | None = settings.tls_cert_setting()
    tls_key: str | None = settings.tls_key_setting()
    tls_client_ca: str | None = settings.tls_client_ca_setting()

    def __post_init__(self) -> None:
        check_minimums(self)
        settings.check_tls(self.tls_cert, self.tls_key, self.tls_client_ca, settings.SERVER_TLS_FLAGS, client=False)
        if self.max_token_id > MAX_TOKEN_ID + 1 or self.max_session_tokens > MAX_TOKENS:
            raise ValueError(
                f"a context index holds ids below {MAX_TOKEN_ID + 1} and at most {MAX_TOKENS} tokens: "
                f"--max-token-id {self.max_token_id} and --max-session-tokens {self.max_session_tokens} must fit"
            )
        if self.max_write_calls is not None and self.max_write_calls >= self.max_workers:
            raise ValueError(
                f"--max-write-calls ({self.max_write_calls}) must be below --max-workers ({self.max_workers}): "
                "Propose needs threads that writes cannot hold"
            )
        if self.max_calls_per_caller is not None and self.max_calls_per_caller > self.max_workers:
            raise ValueError(f"--max-calls-per-caller ({self.max_calls_per_caller}) cannot exceed --max-workers ({self.max_workers})")
        for share, name, call, call_flag in (
            (self.max_pending_observations_per_scope, "observations", self.max_sequences_per_call, "--max-sequences-per-call"),
            (self.max_pending_write_tokens_per_scope, "write-tokens", self.max_tokens_per_call, "--max-tokens-per-call"),
        ):
            if share is not None and share < call:
                raise ValueError(f"--max-pending-{name}-per-scope ({share}) must hold one call of {call_flag} ({call})")
        if self.verifier_identities is not None and self.tls_client_ca is None:
            raise ValueError("--verifier-identities names client certificates: it needs mutual TLS (--tls-client-ca)")
        if not self.insecure and not self.scope_gate_configured and not is_loopback(self.host):
            raise ValueError(
                f"--host {self.host} reaches beyond this machine, and without --client-token or --verifier-identities any client "
                "there could declare any learning scope: set one of them, or --insecure when the network itself is private"
            )
        self.token()  # fail fast: an unreadable token file is a usage error
        if self.backup_dir is not None:
            backups, db = Path(self.backup_dir).resolve(), Path(self.db).resolve()
            if backups == db or db in backups.parents:
                raise ValueError(f"the backup directory {self.backup_dir!r} must lie outside the table directory {self.db!r}")

    @property
    def pending_observations_per_scope(self) -> int:
        """--max-pending-observations-per-scope, or a quarter of --max-pending-observations but room
        for one call of --max-sequences-per-call, within the whole: 4,096 -> 1,024."""
        return self.max_pending_observations_per_scope or _share(self.max_pending_observations, self.max_sequences_per_call)

    @property
    def pending_write_tokens_per_scope(self) -> int:
        """--max-pending-write-tokens-per-scope, or a quarter of --max-pending-write-tokens but room
        for one call of --max-tokens-per-call, within the whole: 1 Mi -> 256 Ki."""
        return self.max_pending_write_tokens_per_scope or _share(self.max_pending_write_tokens, self.max_tokens_per_call)

    @property
    def pending_successors_per_scope(self) -> int:
        """--max-pending-successors-per-scope, or a quarter of --max-pending-successors: 64 Ki -> 16 Ki."""
        return self.max_pending_successors_per_scope or max(1, self.max_pending_successors // 4)

    @property
    def scope_gate_configured(self) -> bool:
        return bool(self.client_token or self.client_token_file or self.identities())

    def identities(self) -> tuple[str, ...]:
        """--verifier-identities as a tuple of names."""
        return tuple(name.strip() for name in (self.verifier_identities or "").split(",") if name.strip())

    def token(self) -> str | None:
        """--client-token, else the first line of --client-token-file (ValueError when unreadable or empty)."""
        return settings.secret(self.client_token, self.client_token_file, "--client-token")

    @property
    def write_calls(self) -> int:
        """--max-write-calls, or a quarter of the threads: 32 -> 8, 2 -> 1."""
        return self.max_write_calls if self.max_write_calls is not None else max(1, self.max_workers // 4)

    @property
    def calls_per_caller(self) -> int:
        """--max-calls-per-caller, or half the threads: 32 -> 16, 2 -> 1."""
        return self.max_calls_per_caller if self.max_calls_per_caller is not None else max(1, self.max_workers // 2)


def _share(whole: int, call: int) -> int:
    """A scope's default share of a writer bound: a quarter of ``whole``, at least one ``call``, at most ``whole``."""
    return min(whole, max(whole // 4, call))


def is_loopback(host: str) -> bool:
    """An address (or localhost) only this machine reaches: 127.0.0.0/8, ::1, localhost."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False
