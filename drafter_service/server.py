"""The drafter as a gRPC service: sessions in memory, the global tables in LMDB.

Sessions (a request's prompt and output, indexed incrementally) live in this
process only: they are cheap to rebuild, and a restarted drafter answers
NOT_FOUND for them, which the verifier treats as "reopen". The global tables
are an ``LMDBNGramStore`` per vocabulary fingerprint and learning scope, under
``db/<fingerprint>[-<scope>]``, so what was learned survives restarts, redeploys
and kill -9. Each call's scopes are resolved first (``scopes.ScopeGate``: who may
declare one); a session drafts from its scope's table (and the request's shared
scope, read only), and its observations and predictions go to that table only.

Writes never block ``Propose``: ``Observe`` and ``CloseSessions`` hand their
sequences to one writer thread, which commits whatever has queued in a single
transaction (group commit) and only then acknowledges: acknowledged means
durable. Reads run in their own LMDB read transactions and never wait.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

from drafter_service.admin import AdminCalls
from drafter_service.admission import Admission, Refused
from drafter_service.config import VOCABULARY_PATTERN, DrafterConfig
from drafter_service.log import LogUnavailable, MessageTooLarge, ObservationLog
from drafter_service.metrics import DrafterMetrics
from drafter_service.ngram import SOURCE_CONTEXT, SOURCE_GLOBAL, SOURCE_SUCCESSOR, LayeredSource, NGramSource, successor_updates
from drafter_service.replica import Replica
from drafter_service.request_checks import InvalidRequest, check
from drafter_service.scopes import DEFAULT_SCOPE, ScopeGate, ScopeRefused, split_table_name
from drafter_service.sessions import (
    BAD_FEEDBACK,
    BUSY,
    EXISTS,
    FULL,
    UNKNOWN,
    WRONG_SCOPE,
    WRONG_VOCABULARY,
    Session,
    SessionError,
    SessionLimits,
    SessionTable,
)
from drafter_service.storage import DiskFull, StoreRegistry, TooManyVocabularies
from drafter_service.store import LMDBNGramStore, StoreClosed, StoreFull
from drafter_service.table_format import MAX_OBSERVE_ID_BYTES, MAX_SUCCESSORS
from drafter_service.writer import CHUNK_SUFFIX_BYTES, ObservationWriter, WriteQueueFull, _Pending
from specdec import serving, telemetry
from specdec.v1 import drafter_pb2, drafter_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name
# Seconds between the janitor's rounds (idle sessions, dead readers' slots).
JANITOR_INTERVAL_S = 5.0
# Threads of the admin port: Stats and Backup are an operator's, one at a time.
ADMIN_WORKERS = 2
_SOURCES = {
    SOURCE_CONTEXT: drafter_pb2.DRAFT_SOURCE_CONTEXT,
    SOURCE_GLOBAL: drafter_pb2.DRAFT_SOURCE_GLOBAL,
    SOURCE_SUCCESSOR: drafter_pb2.DRAFT_SOURCE_SUCCESSOR,
}
# What the caller hears when SessionTable refuses a call.
SESSION_STATUS = {
    EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    UNKNOWN: grpc.StatusCode.NOT_FOUND,
    WRONG_VOCABULARY: grpc.StatusCode.INVALID_ARGUMENT,
    BUSY: grpc.StatusCode.ABORTED,
    FULL: grpc.StatusCode.RESOURCE_EXHAUSTED,
    BAD_FEEDBACK: grpc.StatusCode.INVALID_ARGUMENT,
    WRONG_SCOPE: grpc.StatusCode.INVALID_ARGUMENT,
}


class _NoTable:
    """What Propose reads for a vocabulary with no table yet: no n-grams."""

    def best(self, key):
        return None

    def continuations(self, key):
        return None

    def observe(self, tokens) -> None:
        raise TypeError("no table to observe into: writes go through the store registry")


_NO_TABLE = _NoTable()


def _expired(context) -> bool:
    remaining = context.time_remaining()
    return remaining is not None and remaining <= 0


class DrafterServicer(AdminCalls, drafter_pb2_grpc.DrafterServicer):
    def __init__(
        self,
        config: DrafterConfig,
        stores: StoreRegistry,
        writer: ObservationWriter,
        tracing: telemetry.Tracing | None = None,
        log_link: ObservationLog | None = None,
        replica: Replica | None = None,
    ) -> None:
        self.config = config
        self.stores = stores
        self.writer = writer  # without a log: the one writer of the tables; with one, the replica is
        self.log, self.replica = log_link, replica
        self.tracing = tracing or telemetry.Tracing("specdec-drafter")
        limits = SessionLimits(
            config.max_sessions,
            config.max_sessions_per_caller,
            config.max_session_tokens,
            config.max_session_bytes,
            config.max_session_bytes_per_caller,
        )
        self.sessions = SessionTable(config.ngram, limits)
        self.admission = Admission(config.calls_per_caller, config.write_calls)
        self.gate = ScopeGate(config.token(), config.identities())
        self.health: health.HealthServicer | None = None  # each table's health name, once watch_health is called
        self._healthy: dict[str, LMDBNGramStore] = {}
        self.metrics = metrics = DrafterMetrics()
        self.registry = metrics.registry
        metrics.watch("dropped_spans", "Trace spans dropped (collector down or queue full)", lambda: self.tracing.dropped_spans)
        metrics.gauge(
            "quarantined_tables", "Tables moved aside as unservable (at start-up or when found damaged)", lambda: len(stores.quarantined)
        )
        metrics.gauge(
            "disk_full", "1 while observations are refused for want of disk space (--min-free-bytes)", lambda: int(stores.disk.full)
        )
        metrics.gauge("disk_free_bytes", "Free bytes on the disk holding --db, as last read", lambda: stores.disk.free_bytes)
        metrics.gauge("open_sessions", "Open sessions", lambda: len(self.sessions))
        metrics.gauge(
            "session_bytes", "Bytes charged to open sessions' context indexes (--max-session-bytes)", lambda: self.sessions.bytes_in_use
        )
        metrics.gauge("write_queue_tokens", "Tokens queued for the writer (--max-pending-write-tokens)", lambda: writer.pending_tokens)
        metrics.watch("dropped_writes", "Queued observations dropped because their caller gave up first", lambda: writer.dropped)
        metrics.watch("refused_calls", "Calls refused over --max-calls-per-caller or --max-write-calls", lambda: self.admission.refused)
        metrics.watch_tables(stores.table_stats)
        if replica is not None and log_link is not None:
            metrics.watch_replication(replica, log_link)
        self.refused_scopes = 0  # calls refused for declaring a scope (ScopeRefused.permission)
        metrics.watch("refused_scopes", "Calls refused for declaring a scope their client may not name", lambda: self.refused_scopes)

    # -- validation (always before any state changes) -------------------------

    def _check_vocabulary(self, vocabulary: str) -> None:
        check(
            bool(VOCABULARY_PATTERN.fullmatch(vocabulary)),
            f"vocabulary must be the 16-hex-digit fingerprint of the tokenizer, got {vocabulary!r}",
        )

    def _check_tokens(self, tokens, where: str) -> None:
        limit = self.config.max_token_id
        if tokens and max(tokens) >= limit:  # max() runs in C; find the culprit only on failure
            bad = next(t for t in tokens if t >= limit)
            check(False, f"{where}: token id {bad} is out of range (must be < {limit})")

    def _check_propose(self, request: drafter_pb2.ProposeRequest) -> None:
        """The request's shape; what it asks of sessions is SessionTable.claim's to check."""
        self._check_vocabulary(request.vocabulary)
        self._check_call_size(len(request.sequences), sum(len(s.new_tokens) for s in request.sequences))
        predicted = sum(len(s.predictions.tokens) for s in request.sequences)
        check(
            predicted <= self.config.max_predictions_per_call,
            f"{predicted} predicted tokens in one call; the limit is {self.config.max_predictions_per_call} "
            "(--max-predictions-per-call): send fewer positions or a smaller k",
        )
        positions = sum(len(s.predictions.current) for s in request.sequences)
        check(
            positions <= self.config.max_predicted_positions_per_call,
            f"{positions} predicted positions in one call; the limit is {self.config.max_predicted_positions_per_call} "
            "(--max-predicted-positions-per-call): send fewer positions",
        )
        seen = set()
        # Runs per sequence on every step: each message is formatted only when its check fails.
        invalid, max_k, max_nodes = grpc.StatusCode.INVALID_ARGUMENT, self.config.max_draft_tokens, self.config.max_tree_nodes
        for index, sequence in enumerate(request.sequences):
            sid, where = sequence.session_id, f"sequences[{index}]"
            if not sid:
                raise InvalidRequest(invalid, f"{where}: session_id is empty")
            if sid in seen:
                raise InvalidRequest(invalid, f"{where}: session {sid!r} appears twice in one call")
            seen.add(sid)
            if sequence.num_draft_tokens > max_k:
                raise InvalidRequest(invalid, f"{where}: num_draft_tokens {sequence.num_draft_tokens} is out of range [0, {max_k}]")
            if sequence.max_tree_nodes > max_nodes:
                raise InvalidRequest(
                    invalid, f"{where}: max_tree_nodes {sequence.max_tree_nodes} is out of range [0, {max_nodes}] (--max-tree-nodes)"
                )
            self._check_tokens(sequence.new_tokens, where)
            if sequence.predictions.current or sequence.predictions.tokens or sequence.predictions.previous:
                self._check_predictions(sequence.predictions, f"{where}.predictions")

    def _check_predictions(self, predictions: drafter_pb2.Predictions, where: str) -> None:
        positions, k = len(predictions.current), predictions.k
        check(1 <= k <= MAX_SUCCESSORS, f"{where}: k {k} is out of range [1, {MAX_SUCCESSORS}]")
        check(
            positions <= self.config.max_predicted_positions,
            f"{where}: {positions} positions, more than {self.config.max_predicted_positions} (--max-predicted-positions)",
        )
        check(
            len(predictions.previous) == positions and len(predictions.tokens) == positions * k,
            f"{where}: {len(predictions.previous)} previous and {len(predictions.tokens)} tokens for {positions} positions of "
            f"k {k} (need {positions} and {positions * k})",
        )
        for name in ("previous", "current", "tokens"):
            self._check_tokens(getattr(predictions, name), f"{where}.{name}")

    def _check_observe_id(self, observe_id: str, items: int) -> None:
        """Each of ``items`` is stored under ``observe_id/index``: all of those must fit."""
        check(bool(observe_id), "observe_id is empty: give each Observe a unique id so retries are not counted twice")
        longest = len(observe_id.encode()) + 1 + len(str(max(items - 1, 0))) + CHUNK_SUFFIX_BYTES
        check(
            longest <= MAX_OBSERVE_ID_BYTES,
            f"observe_id is {len(observe_id.encode())} bytes; with its '/index' suffix it must fit in "
            f"{MAX_OBSERVE_ID_BYTES - CHUNK_SUFFIX_BYTES}",
        )

    def _table(self, vocabulary: str, scope: str, context) -> LMDBNGramStore:
        """The table a write goes to (``_writable_table``); RESOURCE_EXHAUSTED when there is none."""
        try:
            return self._writable_table(vocabulary, scope)
        except (TooManyVocabularies, DiskFull) as full:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(full))
            raise  # unreached: abort raises

    def _writable_table(self, vocabulary: str, scope: str) -> LMDBNGramStore:
        """The table a write goes to, created on first write, within --max-vocabularies and
        --max-scopes (else TooManyVocabularies); none while the disk is full (DiskFull; the
        janitor clears that once space is back)."""
        if self.stores.disk.full:
            raise DiskFull(self.stores.disk.refusal())
        store = self.stores.get(vocabulary, scope)
        if scope == DEFAULT_SCOPE and store is not self._healthy.get(vocabulary) and self.health is not None:
            self._healthy[vocabulary] = store  # a new table (or a fresh one after a quarantine)
            self.health.set(table_health_name(vocabulary), health_pb2.HealthCheckResponse.SERVING)
        return store

    def watch_health(self, health_servicer: health.HealthServicer) -> None:
        """Each vocabulary's default-scope table has a health name that says SERVING while it
        serves and NOT_SERVING once it is set aside (the drafter as a whole, and its other
        tables, still serve): "specdec.v1.Drafter/<vocabulary>". Other scopes' tables have
        none: health is open to anyone, and a scope's id is its tenant's capability."""
        self.health = health_servicer
        for name, store in self.stores.all().items():
            if split_table_name(name) == (name, DEFAULT_SCOPE):
                self._healthy[name] = store
                health_servicer.set(table_health_name(name), health_pb2.HealthCheckResponse.SERVING)

        def quarantined(name: str, reason: str) -> None:
            if split_table_name(name) == (name, DEFAULT_SCOPE):
                self._healthy.pop(name, None)
                health_servicer.set(table_health_name(name), health_pb2.HealthCheckResponse.NOT_SERVING)

        self.stores.add_quarantine_listener(quarantined)

    # -- scopes ---------------------------------------------------------------

    def _trusted(self, context) -> bool:
        """The client may declare scopes (``ScopeGate.trusts``): its bearer token or certificate."""
        if not self.gate.restricted:
            return True
        values = [value for name, value in context.invocation_metadata() if name == "authorization"]
        token = serving.bearer(values[0]) if values else None
        names = context.auth_context().get("x509_common_name")
        certificate = names[0].decode("utf-8", "replace") if names else None
        return self.gate.trusts(token, certificate)

    def _resolve(self, declared: str, caller: str, trusted: bool, where: str) -> str:
        """``ScopeGate.resolve``, counting refusals (raises ScopeRefused)."""
        try:
            return self.gate.resolve(declared, caller, trusted, where)
        except ScopeRefused as refused:
            if refused.permission:
                self.refused_scopes += 1
            raise

    def _propose_scopes(self, request, caller: str, context) -> tuple[list[str | None], str]:
        """Per sequence, the scope it opens in (opening calls) or names (later ones; None:
        none), and the request's shared scope ("": none). Raises ScopeRefused."""
        trusted = self._trusted(context)
        scopes: list[str | None] = []
        for index, sequence in enumerate(request.sequences):
            if sequence.open or sequence.scope:
                scopes.append(self._resolve(sequence.scope, caller, trusted, f"sequences[{index}].scope"))
            else:
                scopes.append(None)
        shared = request.shared_scope
        if shared:
            shared = self._resolve(shared, caller, trusted, "shared_scope")
        return scopes, shared

    @staticmethod
    def _abort_refused(context, refused: ScopeRefused) -> None:
        code = grpc.StatusCode.PERMISSION_DENIED if refused.permission else grpc.StatusCode.INVALID_ARGUMENT
        context.abort(code, str(refused))

    def _check_sequences(self, sequences) -> None:
        self._check_call_size(len(sequences), sum(len(sequence.tokens) for sequence in sequences))
        for index, sequence in enumerate(sequences):
            self._check_tokens(sequence.tokens, f"sequences[{index}]")

    def _check_call_size(self, sequences: int, tokens: int) -> None:
        limits = self.config
        check(
            sequences <= limits.max_sequences_per_call,
            f"{sequences} sequences in one call; the limit is {limits.max_sequences_per_call}",
        )
        check(tokens <= limits.max_tokens_per_call, f"{tokens} tokens in one call; the limit is {limits.max_tokens_per_call}")

    # -- RPCs -------------------------------------------------------------------

    def Propose(self, request, context):
        started = time.perf_counter()
        with self.tracing.server_span("specdec.drafter.propose", context, {"specdec.sequences": len(request.sequences)}) as span:
            response = self._propose(request, context)
            span.set_attribute("specdec.draft_tokens", sum(len(draft.tokens) for draft in response.drafts))
        self.metrics.propose_seconds.observe(time.perf_counter() - started)
        return response

    def _propose(self, request, context):
        caller = serving.caller_identity(context)
        with self._admitted(caller, context, write=False):
            return self._propose_admitted(request, context, caller)

    def _propose_admitted(self, request, context, caller: str):
        """Validate and claim the call's sessions under the lock (cheap); index the new
        tokens and draft outside it (O(tokens): one caller's big call never stalls the
        others). A call whose deadline passed does no work and leaves no session."""
        if _expired(context):
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed before the call was served")
        try:
            self._check_propose(request)
            scopes, shared = self._propose_scopes(request, caller, context)
            sessions = self.sessions.claim(request.vocabulary, caller, request.sequences, scopes)
        except InvalidRequest as invalid:
            context.abort(invalid.code, str(invalid))
        except ScopeRefused as refused:
            self._abort_refused(context, refused)
        except SessionError as refused:
            context.abort(SESSION_STATUS[refused.kind], str(refused))
        updates = list(zip(request.sequences, sessions))
        try:
            for update, session in updates:
                if update.verified_draft_tokens:
                    self._credit_feedback(session.feedback(update.verified_draft_tokens, update.accepted_draft_tokens))
                session.context.extend(update.new_tokens)
            drafts = self._drafts(request.vocabulary, updates, shared)
        except BaseException:
            self.sessions.release(caller, request.sequences, sessions, drop_opened=True)  # a session half-extended is no session
            raise
        if _expired(context):  # the caller gave up: it will reopen, so keep nothing it opened
            self.sessions.release(caller, request.sequences, sessions, drop_opened=True)
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed while drafting; no session was kept")
        self.sessions.release(caller, request.sequences, sessions, drop_opened=False)
        self._count([session.last_sources for session in sessions], asked=[update.num_draft_tokens > 0 for update in request.sequences])
        self._keep_predictions(request.vocabulary, updates)
        return drafter_pb2.ProposeResponse(drafts=drafts)

    def _keep_predictions(self, vocabulary: str, updates: list[tuple[Any, Session]]) -> None:
        """Queue the call's predictions for each session's scope's successor table (newest per
        key); nothing for a scope no table can take them for now (a full disk, --max-vocabularies
        or --max-scopes reached): they are hints."""
        by_scope: dict[str, list] = {}
        for update, session in updates:
            if update.predictions.current:
                by_scope.setdefault(session.scope, []).extend(successor_updates(update.predictions))
        for scope, predictions in by_scope.items():
            if self.log is not None:  # through the log, so every replica's successor table learns them
                self.log.offer_successors(vocabulary, scope, predictions)
                continue
            try:
                store = self._writable_table(vocabulary, scope)
            except (TooManyVocabularies, DiskFull):
                continue
            except Exception:  # a table that cannot be opened now must not fail the drafts already made
                log.exception("no table for %d successor-table predictions; dropped", len(predictions))
                continue
            self.writer.submit_successors(store, predictions)

    def _drafts(self, vocabulary: str, updates: list[tuple[Any, Session]], shared: str) -> list[drafter_pb2.SequenceDraft]:
        """Each session drafts from its context and its scope's table (then ``shared``'s, read
        only), in one LMDB read transaction per table. A scope with no table (none yet, or one
        just set aside as damaged: the registry logs it and says so in health and metrics)
        drafts from the contexts alone."""
        by_scope: dict[str, list[int]] = {}
        for index, (_, session) in enumerate(updates):
            by_scope.setdefault(session.scope, []).append(index)
        drafts: list[drafter_pb2.SequenceDraft] = [None] * len(updates)  # type: ignore[list-item]  # each filled below
        for scope, indexes in by_scope.items():
            stores = [self.stores.find(vocabulary, scope)]
            if shared and shared != scope:
                stores.append(self.stores.find(vocabulary, shared))
            for index, draft in zip(indexes, self._scope_drafts([updates[index] for index in indexes], stores)):
                drafts[index] = draft
        return drafts

    def _scope_drafts(self, updates: list[tuple[Any, Session]], stores: list[LMDBNGramStore | None]) -> list[drafter_pb2.SequenceDraft]:
        """One scope's drafts, from ``stores`` (its own table, then the shared one; None: no table)."""
        with contextlib.ExitStack() as snapshots:
            tables: list[NGramSource] = []
            for store in stores:
                if store is not None:
                    try:
                        tables.append(snapshots.enter_context(store.snapshot()))
                    except StoreClosed:  # set aside meanwhile: drafts without it
                        pass
            table: NGramSource = _NO_TABLE if not tables else tables[0] if len(tables) == 1 else LayeredSource(*tables)
            try:
                return [self._draft(update, session, table) for update, session in updates]
            except StoreClosed:  # drafting is pure but for each session's last sources, which this redoes
                pass
        return [self._draft(update, session, _NO_TABLE) for update, session in updates]

    def _count(self, sources: list[list[str]], asked: list[bool]) -> None:
        """Counters for one call; ``sources``: each draft's per-token sources."""
        drafts = [Counter(draft_sources) for draft_sources in sources]
        self.metrics.proposed_call(drafts, misses=sum(wanted and not draft for draft, wanted in zip(sources, asked)))

    def _credit_feedback(self, verdicts: list[tuple[str, bool]]) -> None:
        """Count the verifier's verdict on a session's previous draft, per source."""
        for source, accepted in verdicts:
            self.metrics.verified.labels(source).inc()
            if accepted:
                self.metrics.accepted.labels(source).inc()

    def _draft(self, update, session: Session, table: NGramSource) -> drafter_pb2.SequenceDraft:
        """The session's draft (a tree when the update asks for one), as the proto's parallel arrays."""
        draft = session.draft(table, update.num_draft_tokens, update.max_tree_nodes)
        if not draft.tokens:
            return drafter_pb2.SequenceDraft(session_id=update.session_id)
        sources, match_lengths, counts, totals = zip(*draft.evidence)
        return drafter_pb2.SequenceDraft(
            session_id=update.session_id,
            tokens=draft.tokens,
            sources=[_SOURCES[source] for source in sources],  # type: ignore[misc]  # DraftSource values, as ints
            match_lengths=match_lengths,
            counts=counts,
            totals=totals,
            parents=draft.parents,
        )

    def Observe(self, request, context):
        with self.tracing.server_span("specdec.drafter.observe", context, {"specdec.sequences": len(request.sequences)}):
            return self._observe(request, context)

    def _observe(self, request, context):
        caller = serving.caller_identity(context)
        try:
            self._check_vocabulary(request.vocabulary)
            self._check_observe_id(request.observe_id, len(request.sequences))
            self._check_sequences(request.sequences)
            scope = self._resolve(request.scope, caller, self._trusted(context), "scope")
        except InvalidRequest as invalid:
            context.abort(invalid.code, str(invalid))
        except ScopeRefused as refused:
            self._abort_refused(context, refused)
        with self._admitted(caller, context, write=True):
            return self._observe_admitted(request, scope, context)

    def _observe_admitted(self, request, scope: str, context):
        if self.log is not None:
            duplicate = self._publish(request.vocabulary, scope, request.observe_id, [list(s.tokens) for s in request.sequences], context)
            return drafter_pb2.ObserveResponse(
                applied=not duplicate,
                applied_sequences=0 if duplicate else len(request.sequences),
                duplicate_sequences=len(request.sequences) if duplicate else 0,
            )
        store = self._table(request.vocabulary, scope, context)
        items = [
            _Pending(store, f"{request.observe_id}/{index}", list(sequence.tokens)) for index, sequence in enumerate(request.sequences)
        ]
        self._commit(items, context)
        self.metrics.observed_tokens.inc(sum(len(item.tokens) for item in items if item.applied))
        applied = sum(item.applied for item in items)
        return drafter_pb2.ObserveResponse(
            applied=bool(applied) or not items,
            applied_sequences=applied,
            duplicate_sequences=len(items) - applied,
        )

    def _publish(self, vocabulary: str, scope: str, observe_id: str, sequences: list[list[int]], context) -> bool:
        """One call's sequences into the log, answered once the log holds them (acknowledged
        means durable there); whether the log already held them (a retry)."""
        log_link, replica, settings = self.log, self.replica, self.config.log
        assert log_link is not None and replica is not None, "publishing needs a log"
        try:
            self.stores.check_room(vocabulary, scope)  # the bound every replica applies
        except TooManyVocabularies as full:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(full))
        remaining = context.time_remaining()
        if not replica.admits_writes(settings.publish_timeout_s if remaining is None else min(remaining, settings.publish_timeout_s)):
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this replica is {replica.lag_seconds:.1f} s behind the observation log (--log-max-publish-lag-seconds "
                f"{settings.max_publish_lag_s:g}); retry with backoff and the same observe_id",
            )
        started = time.perf_counter()
        with self.tracing.tracer.start_as_current_span("specdec.drafter.log_publish", attributes={"specdec.sequences": len(sequences)}):
            try:
                _, duplicate = log_link.observe(vocabulary, scope, observe_id, sequences)
            except LogUnavailable as away:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"{away}; retry with the same observe_id: it is stored once")
            except MessageTooLarge as large:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(large))
        self.metrics.log_publish_seconds.observe(time.perf_counter() - started)
        self.metrics.observed_tokens.inc(0 if duplicate else sum(len(tokens) for tokens in sequences))
        return duplicate

    def CloseSessions(self, request, context):
        """Close the caller's sessions of ``vocabulary``; with ``observe``, their tokens go into its
        table first, and a session is closed only once that is stored (a failed call can be retried
        under the same ``observe_id``; a session closed is observed once, never again)."""
        caller = serving.caller_identity(context)
        try:
            self._check_vocabulary(request.vocabulary)
            self._check_close(request)
        except InvalidRequest as invalid:
            context.abort(invalid.code, str(invalid))
        if not request.observe:  # no writer involved: nothing to wait for
            try:
                self.sessions.claim_to_close(request.vocabulary, caller, request.session_ids)  # checks vocabulary and busy
            except SessionError as refused:
                context.abort(SESSION_STATUS[refused.kind], str(refused))
            return drafter_pb2.CloseSessionsResponse(closed=len(self.sessions.close(caller, request.session_ids)))
        with self._admitted(caller, context, write=True):
            return self._close_observing(request, context, caller)

    def _close_observing(self, request, context, caller: str):
        try:
            found = self.sessions.claim_to_close(request.vocabulary, caller, request.session_ids)
        except SessionError as refused:
            context.abort(SESSION_STATUS[refused.kind], str(refused))
        try:
            sessions = [session for session in found if session is not None]
            tokens = sum(len(session.context.tokens) for session in sessions)
            if tokens > self.config.max_tokens_per_call:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"these sessions hold {tokens} tokens, over the {self.config.max_tokens_per_call} one call may observe "
                    "(--max-tokens-per-call); close them in several calls",
                )
            ids = [sid for sid, session in zip(request.session_ids, found) if session is not None]
            if ids and self.log is not None:  # one message per scope (each is its table's)
                by_scope: dict[str, list[list[int]]] = {}
                for session in sessions:
                    by_scope.setdefault(session.scope, []).append(list(session.context.tokens))
                for scope, sequences in by_scope.items():
                    self._publish(request.vocabulary, scope, request.observe_id, sequences, context)
            elif ids:  # each into the table of the scope it was opened in
                items = [
                    _Pending(
                        self._table(request.vocabulary, session.scope, context), f"{request.observe_id}/{i}", list(session.context.tokens)
                    )
                    for i, session in enumerate(sessions)
                ]
                self._commit(items, context)
        except BaseException:
            self.sessions.unclaim(found)  # not stored: still open, the call can be retried
            raise
        closed = self.sessions.close(caller, ids)
        return drafter_pb2.CloseSessionsResponse(closed=len(closed))

    def _check_close(self, request) -> None:
        """CloseSessions obeys Observe's limits: its ids count as sequences, none twice."""
        ids = request.session_ids
        check(
            len(ids) <= self.config.max_sequences_per_call,
            f"{len(ids)} sessions in one call; the limit is {self.config.max_sequences_per_call} (--max-sequences-per-call)",
        )
        seen: set[str] = set()
        for index, sid in enumerate(ids):
            if sid in seen:
                check(False, f"session_ids[{index}]: session {sid[:200]!r} appears twice in one call")
            seen.add(sid)
        if request.observe:
            self._check_observe_id(request.observe_id, len(ids))

    @contextlib.contextmanager
    def _admitted(self, caller: str, context, write: bool):
        """Run the body in one of ``caller``'s slots (and a write slot): RESOURCE_EXHAUSTED beyond."""
        try:
            self.admission.acquire(caller, write)
        except Refused as refused:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(refused))
        try:
            yield
        finally:
            self.admission.release(caller, write)

    def _commit(self, items: list[_Pending], context) -> None:
        """Queue ``items`` and wait until they are stored: no longer than the caller's deadline
        nor --max-write-wait-seconds, nor past the caller cancelling. Items the handler stops waiting
        for are abandoned: the writer commits nothing more of them (a retry stores the rest)."""
        remaining = context.time_remaining()
        wait_s = self.config.max_write_wait_s if remaining is None else min(remaining, self.config.max_write_wait_s)
        deadline = time.monotonic() + wait_s
        for item in items:
            item.deadline = deadline
        try:
            self.writer.submit(items)
        except WriteQueueFull as full:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(full))

        def abandon() -> None:
            for item in items:
                item.abandoned = True

        context.add_callback(abandon)  # the caller cancelled or went away: stop committing its items
        for item in items:
            if not item.done.wait(max(0.0, deadline - time.monotonic())):
                abandon()
                if remaining is not None and remaining <= self.config.max_write_wait_s:
                    context.abort(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        "the deadline passed before the observation was stored; retry with the same observe_id",
                    )
                context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"the observation was not stored within {self.config.max_write_wait_s:g} s (--max-write-wait-seconds); "
                    "retry with the same observe_id, what was stored is not counted twice",
                )
        for item in items:
            if isinstance(item.error, DiskFull):
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(item.error))
            if isinstance(item.error, StoreClosed):
                context.abort(grpc.StatusCode.UNAVAILABLE, f"{item.error}; retry with the same observe_id")
            if isinstance(item.error, TimeoutError):
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"{item.error}; retry with the same observe_id to store the rest")
            if isinstance(item.error, StoreFull):
                context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"{sum(item.error is not None for item in items)} of {len(items)} sequences were not stored: the table has "
                    "no room now (a long-lived reader holds old pages); retry with the same observe_id, "
                    "the stored ones are not counted twice",
                )
            if item.error is not None:
                context.abort(grpc.StatusCode.INTERNAL, f"could not store the observation: {item.error}")

    def watch_streams(self, guard: serving.AuxiliaryStreamGuard) -> None:
        """Metrics of the main port's reflection and health Watch streams."""
        self.metrics.gauge(
            "auxiliary_streams", "Reflection and health Watch streams open (--max-auxiliary-streams)", lambda: guard.open_streams
        )
        self.metrics.watch(
            "auxiliary_streams_refused", "Reflection and health Watch streams refused for want of a slot", lambda: guard.refused
        )
        self.metrics.watch(
            "auxiliary_streams_ended_idle", "Reflection and health Watch streams ended for silence", lambda: guard.ended_idle
        )

    def expire_idle_sessions(self) -> int:
        return self.sessions.expire(self.config.session_idle_timeout_s)


class _ServingOnly(drafter_pb2_grpc.DrafterServicer):
    """The main port's face when admin calls have a port of their own."""

    def __init__(self, servicer: DrafterServicer) -> None:
        self.Propose, self.Observe, self.CloseSessions = servicer.Propose, servicer.Observe, servicer.CloseSessions  # type: ignore[method-assign]

    def Stats(self, request, context):
        context.abort(grpc.StatusCode.PERMISSION_DENIED, "Stats is served on the drafter's admin port only")

    def Backup(self, request, context):
        context.abort(grpc.StatusCode.PERMISSION_DENIED, "Backup is served on the drafter's admin port only")

    def Forget(self, request, context):
        context.abort(grpc.StatusCode.PERMISSION_DENIED, "Forget is served on the drafter's admin port only")


@dataclass
class DrafterServer:
    server: grpc.Server
    port: int
    servicer: DrafterServicer
    health: health.HealthServicer
    stores: StoreRegistry
    writer: ObservationWriter
    metrics_port: int | None = None  # where /metrics is served; None: not served
    admin_server: grpc.Server | None = None  # Stats and Backup, when --admin-port is set
    admin_port: int | None = None
    health_port: int | None = None  # where the health-only server listens; None: not served
    _metrics_server: Any = None  # telemetry.start_metrics_server's HTTP server
    _health_server: grpc.Server | None = None
    guard: serving.AuxiliaryStreamGuard | None = None  # the main port's reflection and health Watch streams
    _stop_janitor: threading.Event = field(default_factory=threading.Event)

    def start_janitor(self) -> None:
        """Every few seconds: close idle sessions, re-read the free disk space, and free
        dead readers' slots (a reader killed with kill -9 would otherwise pin old pages until a restart)."""
        interval = max(0.1, min(JANITOR_INTERVAL_S, self.servicer.config.session_idle_timeout_s / 4))

        def loop() -> None:
            while not self._stop_janitor.wait(interval):
                self.servicer.expire_idle_sessions()
                self.servicer.stores.disk.check()  # clears the refusal once space is back
                for vocabulary, store in self.servicer.stores.all().items():
                    try:
                        if freed := store.check_readers():
                            log.warning("freed %d reader slot(s) of dead processes on table %s", freed, vocabulary)
                    except StoreClosed:  # set aside since the list was read
                        continue
                    except Exception:  # a broken table: the next tick tries again
                        log.exception("reader check failed on table %s", vocabulary)

        threading.Thread(target=loop, name="drafter-janitor", daemon=True).start()

    def stop(self, grace: float | None = None) -> None:
        """NOT_SERVING, let in-flight calls finish, then flush writes and close the stores."""
        self.health.enter_graceful_shutdown()
        self._stop_janitor.set()
        if self.guard is not None:
            self.guard.stop()
        grace = self.servicer.config.grace_s if grace is None else grace
        stopping = [server.stop(grace) for server in (self.server, self.admin_server) if server is not None]
        for stopped in stopping:
            stopped.wait()
        if self.servicer.replica is not None and self.servicer.log is not None:
            self.servicer.replica.stop()
            self.servicer.log.close()
        self.writer.stop()
        self.stores.close()
        if self._health_server is not None:
            self._health_server.stop(0).wait()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        self.servicer.tracing.shutdown()


def table_health_name(vocabulary: str) -> str:
    """The health service name of one vocabulary's table."""
    return f"{SERVICE_NAME}/{vocabulary}"


def create_server(config: DrafterConfig) -> DrafterServer:
    server, guard = serving.grpc_server(config.connections, config.max_workers, config.max_concurrent_calls, config.max_message_bytes)
    health_servicer = serving.add_health_and_reflection(server, SERVICE_NAME)
    # First: a locked --db fails before the port is taken.
    stores = StoreRegistry(config, startup_walk_records=config.max_startup_walk_records)
    admin_server = admin_port = None
    try:
        port = serving.bind(server, config.host, config.port, config.tls_cert, config.tls_key, config.tls_client_ca)
        if config.admin_port is not None:
            admin_server, _ = serving.grpc_server(config.connections, ADMIN_WORKERS, 4 * ADMIN_WORKERS, config.max_message_bytes)
            admin_port = serving.bind(
                admin_server, config.admin_host, config.admin_port, config.tls_cert, config.tls_key, config.tls_client_ca, "--admin-port"
            )
    except BaseException:
        stores.close()
        raise
    writer = ObservationWriter(
        config.max_pending_observations,
        stores.disk,
        config.max_pending_write_tokens,
        config.max_pending_successors,
        max_pending_per_table=config.pending_observations_per_scope,
        max_pending_tokens_per_table=config.pending_write_tokens_per_scope,
        max_pending_successors_per_table=config.pending_successors_per_scope,
    )
    log_link = replica = None
    if config.log.enabled:
        log_link = ObservationLog(config.log)
        replica = Replica(config, stores, log_link, lambda ready: serving.set_serving(health_servicer, SERVICE_NAME, ready))
    servicer = DrafterServicer(config, stores, writer, log_link=log_link, replica=replica)
    servicer.watch_streams(guard)
    drafter_pb2_grpc.add_DrafterServicer_to_server(servicer if admin_server is None else _ServingOnly(servicer), server)
    if admin_server is not None:
        drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, admin_server)
    drafter = DrafterServer(
        server, port, servicer, health_servicer, stores, writer, admin_server=admin_server, admin_port=admin_port, guard=guard
    )
    try:
        if config.health_port is not None:
            drafter._health_server, drafter.health_port = serving.serve_health(health_servicer, config.host, config.health_port)
        if config.metrics_port is not None:
            metrics_server = telemetry.start_metrics_server(servicer.registry, config.host, config.metrics_port)
            drafter._metrics_server, drafter.metrics_port = metrics_server
    except BaseException:  # a port taken: nothing serves yet, the tables close
        if drafter._health_server is not None:
            drafter._health_server.stop(0)
        stores.close()
        raise
    writer.start()
    server.start()
    if admin_server is not None:
        admin_server.start()
    drafter.start_janitor()
    servicer.watch_health(health_servicer)
    if log_link is not None and replica is not None:  # ready once caught up with the log (the replica says when)
        serving.set_serving(health_servicer, SERVICE_NAME, False)
        log_link.start()
        replica.start()
    else:
        serving.set_serving(health_servicer, SERVICE_NAME, True)  # the stores are open: ready
    return drafter
