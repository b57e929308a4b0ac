"""Drafter sessions: each in-flight request's context index, held between calls.

A session is opened with a request's prompt, extended with each step's new
tokens, drafts from its own context and a global table, and is closed when
the request ends. ``SessionTable`` holds them for the service: who opened
which, which are in use by a call (a session is extended and drafted outside
the table's lock, by one call at a time), the limits, and the last draft's
sources (what the verifier's feedback on it is credited to). It knows
nothing of gRPC: a request it cannot serve raises ``SessionError`` with a
``kind`` that the service maps to a status.

A session belongs to the caller that opened it: sessions are keyed by
(caller, session id), so another caller's id is simply unknown to a caller,
indistinguishable from an id never opened (UNKNOWN either way). Two callers
may use the same id without meeting. It drafts from, and is observed into, the
learning scope it was opened in (``scopes``): a later call may repeat that
scope or leave it unsaid, never change it (WRONG_SCOPE).

Memory is accounted in bytes, before any token is indexed: each session is
charged ``session_bytes`` for the tokens it holds or a call is about to add
(rounded up to ``CHARGE_GRANULE_TOKENS``), an upper bound of its context
index, against a budget in all and one per caller.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from drafter_service.ngram import ContextIndex, Draft, InMemoryNGramTable, NGramConfig, NGramSource, successor_updates

# SessionError kinds.
EXISTS = "exists"  # opened twice
UNKNOWN = "unknown"  # never opened, closed, or another caller's
WRONG_VOCABULARY = "wrong_vocabulary"  # opened under another vocabulary
BUSY = "busy"  # in use by another call
FULL = "full"  # a limit on sessions or their tokens
BAD_FEEDBACK = "bad_feedback"  # feedback that cannot describe the previous draft
WRONG_SCOPE = "wrong_scope"  # a later call names another scope than the session was opened in

# What one session costs beside its context index (the Session object, its
# lists, the table's entry for it): measured ~1 KB, rounded up.
SESSION_OVERHEAD_BYTES = 2048


# Sessions are charged for their tokens rounded up to a multiple of this, so the
# bound is recomputed once per 512 tokens a session grows, not on every step.
CHARGE_GRANULE_TOKENS = 512


def charged_tokens(tokens: int) -> int:
    """The tokens a session holding ``tokens`` is charged for: 1 -> 512, 512 -> 512, 513 -> 1024."""
    return -(-tokens // CHARGE_GRANULE_TOKENS) * CHARGE_GRANULE_TOKENS


def session_bytes(tokens: int, config: NGramConfig) -> int:
    """What a session of ``tokens`` tokens is charged: the most its context index can take
    (``ContextIndex.max_bytes_for``, under 100 bytes a token at the defaults) and its own
    overhead, so that the budget is an upper bound of what sessions really hold."""
    return SESSION_OVERHEAD_BYTES + ContextIndex.max_bytes_for(tokens, config)


class SessionError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class SessionLimits:
    max_sessions: int
    max_sessions_per_caller: int
    max_session_tokens: int
    # Bytes of sessions (session_bytes), in all and per caller; None: unbounded.
    max_bytes: int | None = None
    max_bytes_per_caller: int | None = None


class SessionUpdate(Protocol):
    """One sequence's part of a call (the drafter proto's SequenceUpdate has these fields)."""

    session_id: str
    open: bool
    new_tokens: Sequence[int]
    verified_draft_tokens: int
    accepted_draft_tokens: int


@dataclass(eq=False)
class Session:
    vocabulary: str
    caller: str  # whose it is: the key's first half, and what the per-caller limits count by
    context: ContextIndex
    last_used: float
    # Sources of the last draft, per token: the verifier's feedback on it
    # (verified/accepted counts in the next update) is credited to them.
    last_sources: list[str] = field(default_factory=list)
    busy: bool = False  # claimed by a call that is extending, drafting or closing it (outside the lock)
    charged_bytes: int = 0  # what the memory budget counts for it: session_bytes(charged_for)
    charged_for: int = 0  # tokens it is charged for: those claimed so far, rounded up (charged_tokens)
    scope: str = ""  # the learning scope it drafts from and is observed into (scopes.DEFAULT_SCOPE: "")

    def draft(self, table: NGramSource, k: int, max_nodes: int = 0) -> Draft:
        """Up to ``k`` draft tokens from the context, then ``table`` (a tree of up to
        ``max_nodes`` when that is set); their sources are kept."""
        draft = self.context.propose(table, k, max_nodes)
        self.last_sources = [evidence.source for evidence in draft.evidence]
        return draft

    def feedback(self, verified: int, accepted: int) -> list[tuple[str, bool]]:
        """(source, accepted) of each of the last draft's tokens the verifier scored."""
        return [(source, position < accepted) for position, source in enumerate(self.last_sources[:verified])]


class SessionTable:
    def __init__(self, ngram: NGramConfig, limits: SessionLimits) -> None:
        self.ngram, self.limits = ngram, limits
        self._sessions: dict[tuple[str, str], Session] = {}  # (caller, session id) -> session
        self._by_caller: Counter[str] = Counter()
        self._bytes_by_caller: Counter[str] = Counter()
        self.bytes_in_use = 0  # sum of charged_bytes
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, key: tuple[str, str]) -> bool:
        """``(caller, session_id) in table``."""
        return key in self._sessions

    def get(self, caller: str, session_id: str) -> Session | None:
        return self._sessions.get((caller, session_id))

    def held_by(self, caller: str) -> int:
        return self._by_caller[caller]

    def bytes_held_by(self, caller: str) -> int:
        return self._bytes_by_caller[caller]

    def claim(
        self, vocabulary: str, caller: str, updates: Sequence[SessionUpdate], scopes: Sequence[str | None] | None = None
    ) -> list[Session]:
        """Check every update, then open or look up each one's session and mark it busy, all or none.

        ``scopes``: per update, the scope an opening update opens its session in, and the one a
        later update names (None: it names none); None for all: the default scope. Errors name
        the update as ``sequences[i]``. The caller extends and drafts the sessions outside the
        lock, then calls ``release``. The tokens the updates add are charged now."""
        scopes = scopes if scopes is not None else [None] * len(updates)
        with self._lock:
            self._check(vocabulary, caller, updates, scopes)
            now = time.monotonic()
            claimed = []
            for update, scope in zip(updates, scopes):
                key = (caller, update.session_id)
                if update.open:
                    self._sessions[key] = Session(vocabulary, caller, ContextIndex(self.ngram), now, scope=scope or "")
                    self._by_caller[caller] += 1
                session = self._sessions[key]
                session.busy, session.last_used = True, now
                tokens = len(session.context.tokens) + len(update.new_tokens)
                if tokens > session.charged_for:  # past what it is charged for: charge the next granule
                    self._charge(session, charged_tokens(tokens))
                claimed.append(session)
            return claimed

    def release(self, caller: str, updates: Sequence[SessionUpdate], sessions: Sequence[Session], drop_opened: bool) -> None:
        """The call is done with ``sessions``; with ``drop_opened``, those it opened are closed
        again (the call failed or its caller gave up, and will open them anew)."""
        with self._lock:
            for update, session in zip(updates, sessions):
                session.busy = False
                if drop_opened and update.open and self._sessions.get((caller, update.session_id)) is session:
                    self._forget(caller, update.session_id)

    def claim_to_close(self, vocabulary: str, caller: str, session_ids: Sequence[str]) -> list[Session | None]:
        """The caller's sessions among ``session_ids`` (None where it has none of that id), marked
        busy so that no other call extends, observes or closes them meanwhile, all or none.
        Then ``close`` them, or ``unclaim`` them if their tokens could not be stored."""
        with self._lock:
            found = [self._sessions.get((caller, sid)) for sid in session_ids]
            for index, (sid, session) in enumerate(zip(session_ids, found)):
                if session is None:
                    continue
                if session.vocabulary != vocabulary:
                    raise SessionError(WRONG_VOCABULARY, f"session_ids[{index}]: session {sid!r} was opened under another vocabulary")
                if session.busy:
                    raise SessionError(BUSY, f"session_ids[{index}]: session {sid!r} is in use by another call; retry")
            for session in found:
                if session is not None:
                    session.busy = True
            return found

    def unclaim(self, sessions: Iterable[Session | None]) -> None:
        with self._lock:
            for session in sessions:
                if session is not None:
                    session.busy = False

    def close(self, caller: str, session_ids: Sequence[str]) -> list[str]:
        """Close the caller's sessions of these ids; returns those that were open."""
        with self._lock:
            return [sid for sid in session_ids if self._forget(caller, sid)]

    def expire(self, idle_s: float) -> int:
        """Close sessions no call has touched for ``idle_s`` seconds; returns how many."""
        deadline = time.monotonic() - idle_s
        with self._lock:
            stale = [key for key, session in self._sessions.items() if session.last_used < deadline and not session.busy]
            for caller, sid in stale:
                self._forget(caller, sid)
        return len(stale)

    def _charge(self, session: Session, tokens: int) -> None:
        charged = session_bytes(tokens, self.ngram)
        grown = charged - session.charged_bytes
        session.charged_for, session.charged_bytes = tokens, charged
        self._bytes_by_caller[session.caller] += grown
        self.bytes_in_use += grown

    def _forget(self, caller: str, session_id: str) -> bool:
        session = self._sessions.pop((caller, session_id), None)
        if session is None:
            return False
        self._by_caller[caller] -= 1
        if not self._by_caller[caller]:
            del self._by_caller[caller]
        self._bytes_by_caller[caller] -= session.charged_bytes
        if not self._bytes_by_caller[caller]:
            del self._bytes_by_caller[caller]
        self.bytes_in_use -= session.charged_bytes
        return True

    def _check(self, vocabulary: str, caller: str, updates: Sequence[SessionUpdate], scopes: Sequence[str | None]) -> None:
        # Runs per sequence on every step: each message is formatted only when its check fails.
        limits, opening, growth = self.limits, 0, 0
        for index, (update, scope) in enumerate(zip(updates, scopes)):
            sid = update.session_id
            session = self._sessions.get((caller, sid))
            held = drafted = 0  # what an open session holds: its tokens, and its last draft's length
            if update.open:
                opening += 1
                if session is not None:
                    raise SessionError(EXISTS, f"sequences[{index}]: session {sid!r} is already open")
            elif session is None:
                raise SessionError(UNKNOWN, f"sequences[{index}]: unknown session {sid!r} (open it first)")
            elif session.vocabulary != vocabulary:
                raise SessionError(WRONG_VOCABULARY, f"sequences[{index}]: session {sid!r} was opened under another vocabulary")
            elif session.busy:
                raise SessionError(BUSY, f"sequences[{index}]: session {sid!r} is in use by another call; retry")
            elif scope is not None and scope != session.scope:
                raise SessionError(WRONG_SCOPE, f"sequences[{index}]: session {sid!r} was opened in another scope; it keeps that one")
            else:
                held, drafted = len(session.context.tokens), len(session.last_sources)
            if held + len(update.new_tokens) > limits.max_session_tokens:
                raise SessionError(
                    FULL,
                    f"sequences[{index}]: session {sid!r} would hold {held + len(update.new_tokens)} tokens; the limit is "
                    f"{limits.max_session_tokens} (--max-session-tokens)",
                )
            if not update.accepted_draft_tokens <= update.verified_draft_tokens <= drafted:
                raise SessionError(
                    BAD_FEEDBACK,
                    f"sequences[{index}]: feedback needs accepted_draft_tokens ({update.accepted_draft_tokens}) <= "
                    f"verified_draft_tokens ({update.verified_draft_tokens}) <= the previous draft's length ({drafted})",
                )
            tokens = held + len(update.new_tokens)
            if session is None or tokens > session.charged_for:
                growth += session_bytes(charged_tokens(tokens), self.ngram) - (session.charged_bytes if session is not None else 0)
        held = self._by_caller[caller]
        if held + opening > limits.max_sessions_per_caller:
            raise SessionError(
                FULL,
                f"this caller ({caller}) holds {held} open sessions, limit {limits.max_sessions_per_caller} "
                "(--max-sessions-per-caller); close finished ones",
            )
        if len(self._sessions) + opening > limits.max_sessions:
            raise SessionError(FULL, f"too many open sessions ({len(self._sessions)}, limit {limits.max_sessions}); close finished ones")
        self._check_bytes(caller, max(growth, 0))

    def _check_bytes(self, caller: str, growth: int) -> None:
        limits = self.limits
        mine = self._bytes_by_caller[caller]
        if limits.max_bytes_per_caller is not None and mine + growth > limits.max_bytes_per_caller:
            raise SessionError(
                FULL,
                f"this caller's ({caller}) sessions would take {(mine + growth) >> 20} MiB of context indexes, over its budget of "
                f"{limits.max_bytes_per_caller >> 20} MiB (--max-session-bytes-per-caller); close finished sessions or send shorter ones",
            )
        if limits.max_bytes is not None and self.bytes_in_use + growth > limits.max_bytes:
            raise SessionError(
                FULL,
                f"the drafter's sessions would take {(self.bytes_in_use + growth) >> 20} MiB of context indexes, over the budget of "
                f"{limits.max_bytes >> 20} MiB (--max-session-bytes); retry later",
            )


class NGramDrafter:
    """The in-process form of the drafter service, on the same ``Session``s (no limits, one caller).

    ``open`` a session with its prompt, call ``propose`` each step with only
    the tokens appended since the previous call, ``close`` it when the request
    ends (its output is then observed into the global table).
    """

    def __init__(self, config: NGramConfig | None = None, global_table: NGramSource | None = None) -> None:
        self.config = config or NGramConfig()
        self.global_table = global_table if global_table is not None else InMemoryNGramTable(self.config.n_min, self.config.n_max)
        self._sessions: dict[str, Session] = {}

    def open(self, session_id: str, prompt_ids: Sequence[int]) -> None:
        if session_id in self._sessions:
            raise KeyError(f"session {session_id!r} is already open")
        session = Session("", "", ContextIndex(self.config), time.monotonic())
        session.context.extend(prompt_ids)
        self._sessions[session_id] = session

    def propose(self, session_id: str, new_tokens: Iterable[int], k: int) -> Draft:
        session = self._session(session_id)
        session.context.extend(new_tokens)
        return session.draft(self.global_table, k)

    def record_predictions(self, predictions) -> None:
        """The target's top predictions at scored positions (``drafting.Predictions``) into the
        global table's successor table, as the service's writer stores them."""
        record = getattr(self.global_table, "record_successors", None)
        if record is not None:
            record(successor_updates(predictions))

    def propose_tree(self, session_id: str, new_tokens: Iterable[int], k: int, max_nodes: int) -> Draft:
        """``propose``, as a tree of up to ``max_nodes`` tokens none deeper than ``k``."""
        session = self._session(session_id)
        session.context.extend(new_tokens)
        return session.draft(self.global_table, k, max_nodes)

    def close(self, session_id: str, observe: bool = True) -> None:
        session = self._sessions.pop(session_id, None)
        if session is not None and observe:
            self.global_table.observe(session.context.tokens)

    def _session(self, session_id: str) -> Session:
        try:
            return self._sessions[session_id]
        except KeyError:
            raise KeyError(f"unknown session {session_id!r}") from None
