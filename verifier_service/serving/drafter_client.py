"""The verifier's side of the drafter service: a ``DraftProposer`` over gRPC.

Nothing here may fail a request. ``propose`` has a short deadline; on any
error it returns empty drafts (the step runs as plain decoding), counts a
fallback, and leaves the drafter alone for a back-off period while gRPC
reconnects in the background. A drafter that restarted has forgotten our
sessions: every session is then re-opened, under a fresh id, with its whole
context, so the new drafter answers from the first step after it is back.

Each sequence drafts from, and is learned into, its request's learning scope
(``DraftRequest.scope``: an opaque id, ``verifier_service.serving.scopes``), and every
sequence also reads the verifier's shared scope, if it has one. With
``--drafter-token`` every call carries it (``authorization: Bearer``), which a
drafter with ``--client-token`` requires before it takes declared scopes.

Finished sequences are observed into the drafter's global table by a
background thread, off the decoding path, with a unique ``observe_id`` per
sequence that makes retries idempotent. The queue is bounded: when the
drafter stays away long enough to fill it, the oldest observations are
dropped (and counted); drafts get worse, outputs never do. An observation the
drafter refuses (INVALID_ARGUMENT, PERMISSION_DENIED) never succeeds: it is
dropped, logged and counted; any other error is retried.

``--drafter`` may list replicas (HOST:PORT,HOST:PORT), which share one learned
state but each hold their own sessions: the verifier uses one, picked at random
(``drafter_replicas``), over a channel per replica. When it goes away
(UNAVAILABLE; DEADLINE_EXCEEDED while its channel is not connected, or on
TIMEOUTS_BEFORE_FAILOVER steps in a row) the same step's call is made once more
on the next replica, every session reopened there with its whole context; only
when that fails too does the step run without drafts and back off. Observations
follow the replica in use (the replicas share one log and drop an observe_id
they have applied) and move it themselves when its channel is down, and
CloseSessions go to the replica holding the sessions. One target with a scheme
(``dns:///drafter-headless:50051``) is a single channel: gRPC's pick_first,
addresses shuffled, keeps it on one address until that fails and then moves it
to another, whose first answer (NOT_FOUND: it holds no such session) reopens them.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import grpc

from specdec import serving, settings, telemetry
from specdec.flags import check_minimums, derived, setting
from specdec.v1 import drafter_pb2, drafter_pb2_grpc
from verifier_service.core.drafting import DraftEvidence, DraftRequest, FinishedSequence, Predictions, ProposedDraft
from verifier_service.core.planner import SOURCE_CONTEXT, SOURCE_GLOBAL, SOURCE_SUCCESSOR
from verifier_service.serving.drafter_replicas import ReplicaChoice, drafter_targets

log = logging.getLogger(__name__)


# gRPC's default reconnect back-off grows to 120 s: a drafter back after a
# restart would then wait that long for its verifiers. Retry every 100-500 ms.
RECONNECT_MAX_MS = 500
# Sessions closed per CloseSessions call: a quarter of the drafter's default
# --max-sequences-per-call (1024), so one call never exceeds it.
CLOSE_BATCH = 256
# Predicted positions one Propose carries at most: a quarter of the drafter's default
# --max-predicted-positions-per-call (16,384), so a big batch's call is never refused for
# them; the rest of a step's predictions are left out (hints: the next step sends fresh ones).
PREDICTED_POSITIONS_PER_CALL = 4096
# gRPC's default policy, pick_first, with the resolved addresses shuffled: a target that
# resolves to several replicas (dns:///drafter-headless:50051) puts each verifier on one at
# random and keeps it there until it fails, as a list of replicas does.
STICKY_SERVICE_CONFIG = json.dumps({"loadBalancingConfig": [{"pick_first": {"shuffleAddressList": True}}]})
DRAFTER_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS),
    ("grpc.service_config", STICKY_SERVICE_CONFIG),
]
# Propose calls that time out on a connected replica (busy, or hung behind a live TCP
# connection) before the verifier moves to another: one slow step is no reason to reopen
# every session elsewhere; three in a row, each after a back-off, are.
TIMEOUTS_BEFORE_FAILOVER = 3
# Observe errors that no retry cures: the observation is dropped (and counted).
REFUSED_OBSERVATION = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED)
# A retried observation waits this long first, doubling up to OBSERVE_RETRY_MAX_S.
OBSERVE_RETRY_FIRST_S = 0.1
OBSERVE_RETRY_MAX_S = 5.0


@dataclass(frozen=True)
class DrafterClientConfig:
    """How a verifier reaches its drafter: each field a --drafter-* flag of the verifier's
    (``VerifierConfig.drafter``), but ``vocabulary``, which the loaded tokenizer decides."""

    # Several replicas spread verifiers over them, and keep drafts coming while one is down.
    target: str | None = setting(
        None,
        flag="drafter",
        help="the drafter service: HOST:PORT, replicas sharing one learned state as HOST:PORT,HOST:PORT (each verifier "
        "uses one, picked at random, and moves to the next when it fails; IPv6 as [::1]:50051), or one gRPC target such "
        "as dns:///NAME:PORT, whose addresses gRPC resolves (none: no speculation)",
    )
    vocabulary: str = derived("")  # 16-hex-digit fingerprint of the verifier's tokenizer
    shared_scope: str = derived("")  # the drafter's id of --shared-scope ("": none), read by every sequence
    # Not in the config's repr (the start-up log).
    token: str | None = setting(
        None,
        repr=False,
        help="token sent to the drafter ('authorization: Bearer TOKEN'), for a drafter started with --client-token. "
        "Prefer the variable or --drafter-token-file",
    )
    token_file: str | None = setting(None, help="file holding --drafter-token (its first line)")
    # Per Propose: a step costs >= ~50 ms on CPU (a few ms on a GPU) and the
    # drafter answers in ~2 ms, so waiting longer than this costs more than drafts save.
    # A step whose replica is gone waits up to this long again on the next replica.
    timeout_s: float = setting(0.1, minimum=0.001, help="seconds a step waits for drafts")
    # After a failed call, steps skip the drafter for this long (gRPC reconnects
    # meanwhile, retrying every <= RECONNECT_MAX_MS): drafts are back within
    # ~0.5 s of the drafter serving again. A replica that failed is passed over
    # for as long when another one fails (drafter_replicas.ReplicaChoice).
    backoff_s: float = setting(
        0.25, minimum=0.0, help="seconds steps skip the drafter after a failed call, and a failed replica is not moved to"
    )
    # Opening sessions costs the drafter ~3-4 us a token (16 x 8K tokens: ~390 ms
    # here): one call opens at most this many tokens, and its deadline grows by
    # open_seconds_per_token for each, so reopening a whole batch after an
    # outage takes a few steps instead of timing out forever.
    open_tokens_per_call: int = setting(16_384, minimum=1, help="context tokens one Propose call may open sessions with")
    open_seconds_per_token: float = setting(
        10e-6, minimum=0.0, help="seconds a Propose call's deadline grows for each context token it opens a session with"
    )
    observe_timeout_s: float = setting(10.0, minimum=0.001, help="seconds an Observe call (finished sequences) may take")
    max_pending_observations: int = setting(
        1024, minimum=1, help="finished sequences kept for the drafter while it is away (the oldest dropped beyond)"
    )
    tls_ca: str | None = setting(None, help="PEM root certificate: reach the drafter over TLS")
    tls_cert: str | None = setting(
        None, help="PEM client certificate for a drafter that requires one (with --drafter-tls-key and --drafter-tls-ca)"
    )
    tls_key: str | None = setting(None, help="PEM key of --drafter-tls-cert")

    def __post_init__(self) -> None:
        check_minimums(self)
        settings.check_tls(
            self.tls_cert, self.tls_key, self.tls_ca, ("--drafter-tls-cert", "--drafter-tls-key", "--drafter-tls-ca"), client=True
        )
        self.bearer()  # fail fast: an unreadable token file is a usage error
        self.targets()  # and so is an address list with an empty entry, a missing port or a duplicate

    def targets(self) -> tuple[str, ...]:
        """The gRPC targets --drafter names, a channel each (none without --drafter)."""
        return () if self.target is None else drafter_targets(self.target)

    def bearer(self) -> str | None:
        """--drafter-token, else the first line of --drafter-token-file (ValueError when unreadable or empty)."""
        return settings.secret(self.token, self.token_file, "--drafter-token")


@dataclass
class Replica:
    """One --drafter target: its channel, and the channel's last reported connectivity."""

    target: str
    channel: grpc.Channel
    stub: Any  # a drafter_pb2_grpc.DrafterStub (tests put a recorder in its place)
    state: grpc.ChannelConnectivity = grpc.ChannelConnectivity.IDLE  # followed only with several replicas

    def record_state(self, state: grpc.ChannelConnectivity) -> None:
        self.state = state


class RemoteDrafter:
    def __init__(self, config: DrafterClientConfig) -> None:
        targets = config.targets()
        assert targets, "a drafter link needs its target"
        self.config = config
        self.replicas = [self._connect(target) for target in targets]
        if len(self.replicas) > 1:
            # Every replica's channel is kept connected (reconnecting as its back-off allows), so a
            # failover does not wait for a connection, and its state tells gone from slow.
            for replica in self.replicas:
                replica.channel.subscribe(replica.record_state, try_to_connect=True)
        self._choice = ReplicaChoice(len(self.replicas), config.backoff_s)
        token = config.bearer()
        self._auth: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        # This verifier's sessions are named <instance>-<sequence>-<generation>:
        # verifiers sharing a drafter never collide, and a re-opened session
        # never meets its stale namesake.
        self._instance = uuid.uuid4().hex[:12]
        self._generation = 0
        self._sent: dict[str, int] = {}  # sequence -> tokens the drafter's session holds
        self._sessions_on = self._choice.current  # the replica holding the sessions in _sent
        self._timeouts_in_a_row = 0  # Propose calls of the replica in use that timed out on a connected channel
        self._skip_until = 0.0
        self.fallbacks = 0  # steps that ran without drafts because of the drafter
        self.dropped_observations = 0
        self._observations: collections.deque[drafter_pb2.ObserveRequest] = collections.deque()
        self._closing: dict[int, list[str]] = {}  # replica -> sessions to close there
        self._wake = threading.Condition()
        self._stopping = False
        self._worker = threading.Thread(target=self._observe_loop, name="drafter-observer", daemon=True)
        self._worker.start()

    def _connect(self, target: str) -> Replica:
        config = self.config
        channel = serving.channel(target, config.tls_ca, DRAFTER_CHANNEL_OPTIONS, config.tls_cert, config.tls_key)
        return Replica(target, channel, drafter_pb2_grpc.DrafterStub(channel))

    @property
    def replica_index(self) -> int:
        """The position in --drafter of the replica in use (0 with one target)."""
        return self._choice.current

    @property
    def failovers(self) -> int:
        """Moves from a failed replica to another."""
        return self._choice.failovers

    # -- DraftProposer ------------------------------------------------------------

    def propose(self, requests: list[DraftRequest]) -> list[ProposedDraft]:
        if time.monotonic() < self._skip_until:
            self.fallbacks += 1
            return [ProposedDraft([]) for _ in requests]
        replica = self._choice.current
        try:
            return self._propose_on(replica, requests)
        except grpc.RpcError as error:
            retry = self._fail_over(replica, error)
            if retry is None:
                self._on_error(error, replica)
                return [ProposedDraft([]) for _ in requests]
        try:  # once, on another replica, within the same step
            return self._propose_on(retry, requests)
        except grpc.RpcError as error:
            self._on_error(error, retry)
            return [ProposedDraft([]) for _ in requests]

    def close(self, finished: list[FinishedSequence]) -> None:
        """Observe the finished sequences (each into its scope) and close their sessions, both in the background."""
        with self._wake:
            for session_id, tokens, scope in (FinishedSequence(*ended) for ended in finished):
                if session_id in self._sent:
                    self._closing.setdefault(self._sessions_on, []).append(self._session(session_id))
                    del self._sent[session_id]
                self._observations.append(
                    drafter_pb2.ObserveRequest(
                        vocabulary=self.config.vocabulary,
                        observe_id=f"{self._instance}-{uuid.uuid4().hex}",
                        sequences=[drafter_pb2.TokenSequence(tokens=tokens)],
                        scope=scope,
                    )
                )
                while len(self._observations) > self.config.max_pending_observations:
                    self._observations.popleft()
                    self.dropped_observations += 1
            self._wake.notify()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Flush pending observations for up to ``timeout_s``, then close the channels."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._worker.join(timeout_s)
        for replica in self.replicas:
            replica.channel.close()

    @property
    def pending_observations(self) -> int:
        return len(self._observations)

    # -- internals ----------------------------------------------------------------

    def _session(self, session_id: str) -> str:
        return f"{self._instance}-{session_id}-{self._generation}"

    def _propose_on(self, replica: int, requests: list[DraftRequest]) -> list[ProposedDraft]:
        """One Propose on ``replica`` (grpc.RpcError when it fails), opening there the sessions it does not hold."""
        self._follow(replica)
        sent = dict(self._sent)
        chosen, opening = [], 0
        for request in requests:
            if request.session_id not in sent:  # opened with its whole context: within the call's budget
                if opening and opening + len(request.tokens) > self.config.open_tokens_per_call:
                    continue  # opened by a later step; decodes without drafts until then
                opening += len(request.tokens)
            chosen.append(request)
        if not chosen:
            return [ProposedDraft([]) for _ in requests]
        updates = [self._update(request, sent) for request in chosen]
        _within_prediction_budget(updates)
        response = self.replicas[replica].stub.Propose(
            drafter_pb2.ProposeRequest(vocabulary=self.config.vocabulary, sequences=updates, shared_scope=self.config.shared_scope),
            timeout=self.config.timeout_s + opening * self.config.open_seconds_per_token,
            metadata=(*telemetry.outgoing_metadata(), *self._auth),  # the drafter's span joins the caller's trace
        )
        self._timeouts_in_a_row = 0
        drafts = {}
        for request, message in zip(chosen, response.drafts):
            self._sent[request.session_id] = len(request.tokens)
            drafts[request.session_id] = _draft(message)
        return [drafts.get(request.session_id, ProposedDraft([])) for request in requests]

    def _follow(self, replica: int) -> None:
        """Sessions held by another replica are opened afresh on ``replica``, under a new generation
        of ids. The old ones are closed only where that replica is still connected: one that is
        gone took them with it, and one that is unreachable expires them."""
        if replica == self._sessions_on:
            return
        old = self.replicas[self._sessions_on]
        if self._sent and old.state == grpc.ChannelConnectivity.READY:
            with self._wake:
                self._closing.setdefault(self._sessions_on, []).extend(self._session(session_id) for session_id in self._sent)
                self._wake.notify()
        self._sent.clear()
        self._generation += 1
        self._sessions_on = replica
        self._timeouts_in_a_row = 0

    def _fail_over(self, replica: int, error: grpc.RpcError) -> int | None:
        """The replica to retry a failed Propose on in the same step, when ``replica`` is gone and another is left."""
        if len(self.replicas) == 1:
            return None
        code = error.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and self.replicas[replica].state == grpc.ChannelConnectivity.READY:
            self._timeouts_in_a_row += 1  # connected: slow rather than gone, until it happens too often
            if self._timeouts_in_a_row < TIMEOUTS_BEFORE_FAILOVER:
                return None
        elif not self._gone(replica, code):
            return None
        return self._move_from(replica, error)

    def _move_from(self, replica: int, error: grpc.RpcError) -> int | None:
        """The replica in use instead of ``replica``, which failed with ``error`` (None: none to go to)."""
        moved = self._choice.fail_over(replica)
        if moved is not None:
            log.warning(
                "drafter replica %s failed (%s: %s); moving to %s, its sessions reopened there",
                self.replicas[replica].target,
                error.code().name,
                error.details(),
                self.replicas[moved].target,
            )
        return moved

    def _gone(self, replica: int, code: grpc.StatusCode, answered: bool = False) -> bool:
        """Is ``replica`` away, not just refusing or slow, with another one there to go to? A Propose
        that fails UNAVAILABLE never reached a drafter (it has no such answer); an Observe may be
        answered UNAVAILABLE (``answered``: the log is down, on every replica alike)."""
        if len(self.replicas) == 1 or code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return False
        connected = self.replicas[replica].state == grpc.ChannelConnectivity.READY
        return not connected or code == grpc.StatusCode.UNAVAILABLE and not answered

    def _update(self, request: DraftRequest, sent: dict[str, int]) -> drafter_pb2.SequenceUpdate:
        known = sent.get(request.session_id)
        if known is None:  # new, or re-opened after the drafter forgot it: the whole context
            return drafter_pb2.SequenceUpdate(
                session_id=self._session(request.session_id),
                new_tokens=request.tokens,
                open=True,
                num_draft_tokens=request.k,
                max_tree_nodes=request.max_nodes,
                predictions=_predictions(request.predictions),
                scope=request.scope,
            )
        return drafter_pb2.SequenceUpdate(
            session_id=self._session(request.session_id),
            new_tokens=request.tokens[known:],
            num_draft_tokens=request.k,
            verified_draft_tokens=request.verified,
            accepted_draft_tokens=request.accepted,
            max_tree_nodes=request.max_nodes,
            predictions=_predictions(request.predictions),
        )

    def _on_error(self, error: grpc.RpcError, replica: int) -> None:
        self.fallbacks += 1
        code = error.code()
        # Sessions may be gone (restart, idle expiry) or half-applied: start them
        # over under a new generation of ids. The old ones are closed in the
        # background (they would count against --max-sessions-per-caller until
        # they expire); a drafter that restarted answers that it had none.
        with self._wake:
            self._closing.setdefault(replica, []).extend(self._session(session_id) for session_id in self._sent)
            self._wake.notify()
        self._sent.clear()
        self._generation += 1
        if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS):
            return  # the drafter is up: re-open right away
        self._skip_until = time.monotonic() + self.config.backoff_s
        log.warning("drafter unavailable (%s: %s); decoding without drafts for %.1fs", code.name, error.details(), self.config.backoff_s)

    def _observe_loop(self) -> None:
        delay = OBSERVE_RETRY_FIRST_S
        while True:
            with self._wake:
                while not self._observations and not self._closing and not self._stopping:
                    self._wake.wait()
                if self._stopping and not self._observations:
                    return
                closing, self._closing = self._closing, {}
                request = self._observations[0] if self._observations else None
            for replica, session_ids in closing.items():
                self._close_sessions(session_ids, replica)
            if request is None:
                continue
            # The replica in use, read at each try: after a failover the new one, which drops
            # an observe_id it has applied (the replicas share one log), so a retry is safe.
            replica = self._choice.current
            try:
                self.replicas[replica].stub.Observe(request, timeout=self.config.observe_timeout_s, metadata=self._auth)
            except grpc.RpcError as error:
                code = error.code()
                if code not in REFUSED_OBSERVATION:
                    if self._gone(replica, code, answered=True) and self._move_from(replica, error) is not None:
                        delay = OBSERVE_RETRY_FIRST_S  # a fresh replica: retry soon
                    with self._wake:  # retry the same observe_id: the drafter dedups
                        if self._stopping:
                            return
                        self._wake.wait(delay)
                    delay = min(delay * 2, OBSERVE_RETRY_MAX_S)
                    continue
                log.error("drafter refused an observation: %s (%s; dropped)", error.details(), code.name)
                with self._wake:
                    self.dropped_observations += 1
            delay = OBSERVE_RETRY_FIRST_S
            with self._wake:
                if self._observations and self._observations[0] is request:
                    self._observations.popleft()

    def _close_sessions(self, session_ids: list[str], replica: int) -> None:
        """Close these sessions on ``replica``, each id once, in calls within the drafter's --max-sequences-per-call."""
        unique = list(dict.fromkeys(session_ids))
        for start in range(0, len(unique), CLOSE_BATCH):
            try:  # best effort: the drafter expires idle sessions anyway
                self.replicas[replica].stub.CloseSessions(
                    drafter_pb2.CloseSessionsRequest(vocabulary=self.config.vocabulary, session_ids=unique[start : start + CLOSE_BATCH]),
                    timeout=self.config.observe_timeout_s,
                    metadata=self._auth,
                )
            except grpc.RpcError:
                pass


_SOURCES = {
    drafter_pb2.DRAFT_SOURCE_CONTEXT: SOURCE_CONTEXT,
    drafter_pb2.DRAFT_SOURCE_GLOBAL: SOURCE_GLOBAL,
    drafter_pb2.DRAFT_SOURCE_SUCCESSOR: SOURCE_SUCCESSOR,
}


def _within_prediction_budget(updates: list[drafter_pb2.SequenceUpdate]) -> None:
    """Leave out the predictions of the updates past PREDICTED_POSITIONS_PER_CALL positions in all."""
    positions = 0
    for update in updates:
        positions += len(update.predictions.current)
        if positions > PREDICTED_POSITIONS_PER_CALL:
            update.ClearField("predictions")


def _predictions(predictions: Predictions | None) -> drafter_pb2.Predictions | None:
    if predictions is None or not predictions.current:
        return None
    return drafter_pb2.Predictions(k=predictions.k, previous=predictions.previous, current=predictions.current, tokens=predictions.tokens)


def _draft(message: drafter_pb2.SequenceDraft) -> ProposedDraft:
    """A ``SequenceDraft`` with its per-token evidence (none when the arrays do not match
    the tokens) and its tree's parents (the engine drops a tree whose parents do not)."""
    tokens, parents = list(message.tokens), list(message.parents)
    columns = (message.sources, message.match_lengths, message.counts, message.totals)
    if any(len(column) != len(tokens) for column in columns):
        return ProposedDraft(tokens, parents=parents)
    evidence = [DraftEvidence(_SOURCES.get(source, ""), match, count, total) for source, match, count, total in zip(*columns)]
    return ProposedDraft(tokens, evidence, parents)
