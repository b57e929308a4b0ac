"""Drafter sessions: each in-flight request's context index, held between calls.

A session is opened with a request's prompt, extended with each step's new
tokens, drafts from its own context and a global table, and is closed when
the request ends. ``SessionTable`` holds them for the service: who opened
which (for per-caller limits), which are in use by a call (a session is
extended and drafted outside the table's lock, by one call at a time), the
limits, and the last draft's sources (what the verifier's feedback on it is
credited to). It knows nothing of gRPC: a request it cannot serve raises
``SessionError`` with a ``kind`` that the service maps to a status.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from drafter_service.ngram import ContextIndex, Draft, InMemoryNGramTable, NGramConfig, NGramSource

# SessionError kinds.
EXISTS = "exists"  # opened twice
UNKNOWN = "unknown"  # never opened, or closed
WRONG_VOCABULARY = "wrong_vocabulary"  # opened under another vocabulary
BUSY = "busy"  # in use by another call
FULL = "full"  # a limit on sessions or their tokens
BAD_FEEDBACK = "bad_feedback"  # feedback that cannot describe the previous draft


class SessionError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class SessionLimits:
    max_sessions: int
    max_sessions_per_caller: int
    max_session_tokens: int


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
    caller: str  # what the per-caller limit counts by
    context: ContextIndex
    last_used: float
    # Sources of the last draft, per token: the verifier's feedback on it
    # (verified/accepted counts in the next update) is credited to them.
    last_sources: list[str] = field(default_factory=list)
    busy: bool = False  # claimed by a call that is extending or drafting it (outside the lock)

    def draft(self, table: NGramSource, k: int) -> Draft:
        """Up to ``k`` draft tokens from the context, then ``table``; their sources are kept."""
        chain = self.context.propose(table, k)
        self.last_sources = [evidence.source for evidence in chain.evidence]
        return chain

    def feedback(self, verified: int, accepted: int) -> list[tuple[str, bool]]:
        """(source, accepted) of each of the last draft's tokens the verifier scored."""
        return [(source, position < accepted) for position, source in enumerate(self.last_sources[:verified])]


class SessionTable:
    def __init__(self, ngram: NGramConfig, limits: SessionLimits) -> None:
        self.ngram, self.limits = ngram, limits
        self._sessions: dict[str, Session] = {}
        self._by_caller: Counter[str] = Counter()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def held_by(self, caller: str) -> int:
        return self._by_caller[caller]

    def claim(self, vocabulary: str, caller: str, updates: Sequence[SessionUpdate]) -> list[Session]:
        """Check every update, then open or look up each one's session and mark it busy, all or none.

        Errors name the update as ``sequences[i]``. The caller extends and drafts the sessions
        outside the lock, then calls ``release``."""
        with self._lock:
            self._check(vocabulary, caller, updates)
            now = time.monotonic()
            claimed = []
            for update in updates:
                if update.open:
                    self._sessions[update.session_id] = Session(vocabulary, caller, ContextIndex(self.ngram), now)
                    self._by_caller[caller] += 1
                session = self._sessions[update.session_id]
                session.busy, session.last_used = True, now
                claimed.append(session)
            return claimed

    def release(self, updates: Sequence[SessionUpdate], sessions: Sequence[Session], drop_opened: bool) -> None:
        """The call is done with ``sessions``; with ``drop_opened``, those it opened are closed
        again (the call failed or its caller gave up, and will open them anew)."""
        with self._lock:
            for update, session in zip(updates, sessions):
                session.busy = False
                if drop_opened and update.open and self._sessions.get(update.session_id) is session:
                    self._forget(update.session_id)

    def close(self, session_ids: Sequence[str]) -> list[str]:
        """Close these sessions; returns those that were open."""
        with self._lock:
            return [sid for sid in session_ids if self._forget(sid)]

    def lookup(self, session_ids: Sequence[str]) -> dict[str, Session | None]:
        with self._lock:
            return {sid: self._sessions.get(sid) for sid in session_ids}

    def expire(self, idle_s: float) -> int:
        """Close sessions no call has touched for ``idle_s`` seconds; returns how many."""
        deadline = time.monotonic() - idle_s
        with self._lock:
            stale = [sid for sid, session in self._sessions.items() if session.last_used < deadline and not session.busy]
            for sid in stale:
                self._forget(sid)
        return len(stale)

    def _forget(self, session_id: str) -> bool:
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        self._by_caller[session.caller] -= 1
        if not self._by_caller[session.caller]:
            del self._by_caller[session.caller]
        return True

    def _check(self, vocabulary: str, caller: str, updates: Sequence[SessionUpdate]) -> None:
        # Runs per sequence on every step: each message is formatted only when its check fails.
        limits, opening = self.limits, 0
        for index, update in enumerate(updates):
            sid = update.session_id
            session = self._sessions.get(sid)
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
        held = self._by_caller[caller]
        if held + opening > limits.max_sessions_per_caller:
            raise SessionError(
                FULL,
                f"this caller ({caller}) holds {held} open sessions, limit {limits.max_sessions_per_caller} "
                "(--max-sessions-per-caller); close finished ones",
            )
        if len(self._sessions) + opening > limits.max_sessions:
            raise SessionError(FULL, f"too many open sessions ({len(self._sessions)}, limit {limits.max_sessions}); close finished ones")


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

    def close(self, session_id: str, observe: bool = True) -> None:
        session = self._sessions.pop(session_id, None)
        if session is not None and observe:
            self.global_table.observe(session.context.tokens)

    def _session(self, session_id: str) -> Session:
        try:
            return self._sessions[session_id]
        except KeyError:
            raise KeyError(f"unknown session {session_id!r}") from None
