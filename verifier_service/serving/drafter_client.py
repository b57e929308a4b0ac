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
dropped (and counted); drafts get worse, outputs never do.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import uuid
from dataclasses import dataclass

import grpc

from specdec import serving, settings, telemetry
from specdec.flags import check_minimums, derived, setting
from specdec.v1 import drafter_pb2, drafter_pb2_grpc
from verifier_service.core.drafting import DraftEvidence, DraftRequest, FinishedSequence, Predictions, ProposedDraft
from verifier_service.core.planner import SOURCE_CONTEXT, SOURCE_GLOBAL, SOURCE_SUCCESSOR

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
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS),
]


@dataclass(frozen=True)
class DrafterClientConfig:
    """How a verifier reaches its drafter: each field a --drafter-* flag of the verifier's
    (``VerifierConfig.drafter``), but ``vocabulary``, which the loaded tokenizer decides."""

    target: str | None = setting(None, flag="drafter", help="host:port of the drafter service (none: no speculation)")
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
    timeout_s: float = setting(0.1, minimum=0.001, help="seconds a step waits for drafts")
    # After a failed call, steps skip the drafter for this long (gRPC reconnects
    # meanwhile, retrying every <= RECONNECT_MAX_MS): drafts are back within
    # ~0.5 s of the drafter serving again.
    backoff_s: float = setting(0.25, minimum=0.0, help="seconds steps skip the drafter after a failed call")
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

    def bearer(self) -> str | None:
        """--drafter-token, else the first line of --drafter-token-file (ValueError when unreadable or empty)."""
        return settings.secret(self.token, self.token_file, "--drafter-token")


class RemoteDrafter:
    def __init__(self, config: DrafterClientConfig) -> None:
        assert config.target, "a drafter link needs its target"
        self.config = config
        self.channel = serving.channel(config.target, config.tls_ca, RECONNECT_OPTIONS, config.tls_cert, config.tls_key)
        self.stub = drafter_pb2_grpc.DrafterStub(self.channel)
        token = config.bearer()
        self._auth: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        # This verifier's sessions are named <instance>-<sequence>-<generation>:
        # verifiers sharing a drafter never collide, and a re-opened session
        # never meets its stale namesake.
        self._instance = uuid.uuid4().hex[:12]
        self._generation = 0
        self._sent: dict[str, int] = {}  # sequence -> tokens the drafter's session holds
        self._skip_until = 0.0
        self.fallbacks = 0  # steps that ran without drafts because of the drafter
        self.dropped_observations = 0
        self._observations: collections.deque[drafter_pb2.ObserveRequest] = collections.deque()
        self._closing: list[str] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._worker = threading.Thread(target=self._observe_loop, name="drafter-observer", daemon=True)
        self._worker.start()

    # -- DraftProposer ------------------------------------------------------------

    def propose(self, requests: list[DraftRequest]) -> list[ProposedDraft]:
        if time.monotonic() < self._skip_until:
            self.fallbacks += 1
            return [ProposedDraft([]) for _ in requests]
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
        try:
            response = self.stub.Propose(
                drafter_pb2.ProposeRequest(vocabulary=self.config.vocabulary, sequences=updates, shared_scope=self.config.shared_scope),
                timeout=self.config.timeout_s + opening * self.config.open_seconds_per_token,
                metadata=(*telemetry.outgoing_metadata(), *self._auth),  # the drafter's span joins the caller's trace
            )
        except grpc.RpcError as error:
            self._on_error(error)
            return [ProposedDraft([]) for _ in requests]
        drafts = {}
        for request, message in zip(chosen, response.drafts):
            self._sent[request.session_id] = len(request.tokens)
            drafts[request.session_id] = _draft(message)
        return [drafts.get(request.session_id, ProposedDraft([])) for request in requests]

    def close(self, finished: list[FinishedSequence]) -> None:
        """Observe the finished sequences (each into its scope) and close their sessions, both in the background."""
        with self._wake:
            for session_id, tokens, scope in (FinishedSequence(*ended) for ended in finished):
                if session_id in self._sent:
                    self._closing.append(self._session(session_id))
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
        """Flush pending observations for up to ``timeout_s``, then close the channel."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._worker.join(timeout_s)
        self.channel.close()

    @property
    def pending_observations(self) -> int:
        return len(self._observations)

    # -- internals ----------------------------------------------------------------

    def _session(self, session_id: str) -> str:
        return f"{self._instance}-{session_id}-{self._generation}"

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

    def _on_error(self, error: grpc.RpcError) -> None:
        self.fallbacks += 1
        code = error.code()
        # Sessions may be gone (restart, idle expiry) or half-applied: start them
        # over under a new generation of ids. The old ones are closed in the
        # background (they would count against --max-sessions-per-caller until
        # they expire); a drafter that restarted answers that it had none.
        with self._wake:
            self._closing += [self._session(session_id) for session_id in self._sent]
            self._wake.notify()
        self._sent.clear()
        self._generation += 1
        if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS):
            return  # the drafter is up: re-open right away
        self._skip_until = time.monotonic() + self.config.backoff_s
        log.warning("drafter unavailable (%s: %s); decoding without drafts for %.1fs", code.name, error.details(), self.config.backoff_s)

    def _observe_loop(self) -> None:
        delay = 0.1
        while True:
            with self._wake:
                while not self._observations and not self._closing and not self._stopping:
                    self._wake.wait()
                if self._stopping and not self._observations:
                    return
                closing, self._closing = self._closing, []
                request = self._observations[0] if self._observations else None
            self._close_sessions(closing)
            if request is None:
                continue
            try:
                self.stub.Observe(request, timeout=self.config.observe_timeout_s, metadata=self._auth)
            except grpc.RpcError as error:
                if error.code() == grpc.StatusCode.INVALID_ARGUMENT:  # never succeeds: drop it
                    log.error("drafter refused an observation: %s", error.details())
                else:
                    with self._wake:  # retry the same observe_id: the drafter dedups
                        if self._stopping:
                            return
                        self._wake.wait(delay)
                    delay = min(delay * 2, 5.0)
                    continue
            delay = 0.1
            with self._wake:
                if self._observations and self._observations[0] is request:
                    self._observations.popleft()

    def _close_sessions(self, session_ids: list[str]) -> None:
        """Close these sessions, each id once, in calls within the drafter's --max-sequences-per-call."""
        unique = list(dict.fromkeys(session_ids))
        for start in range(0, len(unique), CLOSE_BATCH):
            try:  # best effort: the drafter expires idle sessions anyway
                self.stub.CloseSessions(
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
