"""SessionTable without gRPC: claiming is all or none, each refusal has its kind, limits count per caller."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from drafter_service.ngram import SOURCE_CONTEXT, InMemoryNGramTable, NGramConfig
from drafter_service.sessions import (
    BAD_FEEDBACK,
    BUSY,
    EXISTS,
    FULL,
    UNKNOWN,
    WRONG_VOCABULARY,
    SessionError,
    SessionLimits,
    SessionTable,
    charged_tokens,
    session_bytes,
)

VOCABULARY = "0123456789abcdef"


@dataclass
class Update:
    session_id: str
    open: bool = False
    new_tokens: tuple = ()
    verified_draft_tokens: int = 0
    accepted_draft_tokens: int = 0


def table(max_sessions=8, per_caller=4, tokens=64) -> SessionTable:
    return SessionTable(NGramConfig(), SessionLimits(max_sessions, per_caller, tokens))


def refusal(sessions: SessionTable, updates, vocabulary=VOCABULARY, caller="a") -> SessionError:
    with pytest.raises(SessionError) as refused:
        sessions.claim(vocabulary, caller, updates)
    return refused.value


def test_claim_opens_and_marks_busy_release_frees_and_close_forgets():
    sessions = table()
    [session] = sessions.claim(VOCABULARY, "a", [Update("s", open=True)])
    assert session.busy and ("a", "s") in sessions and sessions.held_by("a") == 1
    assert refusal(sessions, [Update("s")]).kind == BUSY
    sessions.release("a", [Update("s", open=True)], [session], drop_opened=False)
    assert not session.busy
    assert sessions.claim(VOCABULARY, "a", [Update("s")]) == [session]
    assert sessions.close("a", ["s", "never"]) == ["s"]
    assert len(sessions) == 0 and sessions.held_by("a") == 0


def test_a_refused_call_claims_nothing():
    sessions = table()
    error = refusal(sessions, [Update("new", open=True), Update("missing")])
    assert (error.kind, str(error)) == (UNKNOWN, "sequences[1]: unknown session 'missing' (open it first)")
    assert len(sessions) == 0


def test_release_with_drop_opened_closes_only_what_the_call_opened():
    sessions = table()
    [old] = sessions.claim(VOCABULARY, "a", [Update("old", open=True)])
    sessions.release("a", [Update("old", open=True)], [old], drop_opened=False)
    updates = [Update("old"), Update("new", open=True)]
    claimed = sessions.claim(VOCABULARY, "a", updates)
    sessions.release("a", updates, claimed, drop_opened=True)
    assert ("a", "old") in sessions and ("a", "new") not in sessions and sessions.held_by("a") == 1


@pytest.mark.parametrize(
    "update, kind, message",
    [
        (Update("s", open=True), EXISTS, "sequences[0]: session 's' is already open"),
        (Update("s", new_tokens=tuple(range(70))), FULL, "sequences[0]: session 's' would hold 72 tokens; the limit is 64"),
        (Update("s", verified_draft_tokens=1), BAD_FEEDBACK, "<= the previous draft's length (0)"),
    ],
)
def test_each_refusal_has_its_kind(update, kind, message):
    sessions = table()
    [session] = sessions.claim(VOCABULARY, "a", [Update("s", open=True, new_tokens=(1, 2))])
    session.context.extend([1, 2])
    sessions.release("a", [Update("s")], [session], drop_opened=False)
    error = refusal(sessions, [update])
    assert error.kind == kind and message in str(error)
    assert refusal(sessions, [Update("s")], vocabulary="f" * 16).kind == WRONG_VOCABULARY


def test_limits_per_caller_and_in_all():
    sessions = table(max_sessions=5, per_caller=3)
    sessions.claim(VOCABULARY, "a", [Update(f"a{i}", open=True) for i in range(3)])
    error = refusal(sessions, [Update("a3", open=True)])
    assert error.kind == FULL and "this caller (a) holds 3 open sessions, limit 3" in str(error)
    sessions.claim(VOCABULARY, "b", [Update("b0", open=True), Update("b1", open=True)])
    error = refusal(sessions, [Update("c0", open=True)], caller="c")
    assert error.kind == FULL and "too many open sessions (5, limit 5)" in str(error)


def test_expire_closes_idle_sessions_but_not_busy_ones():
    sessions = table()
    [busy] = sessions.claim(VOCABULARY, "a", [Update("busy", open=True)])
    [idle] = sessions.claim(VOCABULARY, "a", [Update("idle", open=True)])
    sessions.release("a", [Update("idle")], [idle], drop_opened=False)
    assert sessions.expire(idle_s=-1.0) == 1  # everything is older than "one second in the future"
    assert ("a", "busy") in sessions and ("a", "idle") not in sessions


def test_a_draft_keeps_its_sources_for_the_feedback_on_it():
    sessions = table()
    [session] = sessions.claim(VOCABULARY, "a", [Update("s", open=True)])
    session.context.extend([1, 2, 3, 1, 2, 3, 1, 2])
    draft = session.draft(InMemoryNGramTable(2, 4), 3)
    assert draft.tokens == [3, 1, 2] and session.last_sources == [SOURCE_CONTEXT] * 3
    assert session.feedback(verified=3, accepted=1) == [(SOURCE_CONTEXT, True), (SOURCE_CONTEXT, False), (SOURCE_CONTEXT, False)]


def test_a_session_belongs_to_its_caller_another_callers_id_is_unknown():
    # The same id from another caller is a session never opened: UNKNOWN, in the very
    # words a missing id gets, so a caller cannot even learn that the id exists.
    sessions = table()
    [mine] = sessions.claim(VOCABULARY, "victim", [Update("s", open=True, new_tokens=(1, 2, 3))])
    sessions.release("victim", [Update("s", open=True)], [mine], drop_opened=False)
    probe = refusal(sessions, [Update("s", new_tokens=(4,))], caller="thief")
    missing = refusal(sessions, [Update("s", new_tokens=(4,))], caller="nobody-opened-anything")
    assert (probe.kind, str(probe)) == (missing.kind, str(missing)) == (UNKNOWN, "sequences[0]: unknown session 's' (open it first)")
    assert sessions.close("thief", ["s"]) == []  # closing it is no more possible than reading it
    assert sessions.claim_to_close(VOCABULARY, "thief", ["s"]) == [None]
    # The thief may open its own "s": two sessions, neither sees the other's tokens.
    [theirs] = sessions.claim(VOCABULARY, "thief", [Update("s", open=True, new_tokens=(9,))])
    assert theirs is not mine and sessions.get("victim", "s") is mine and len(sessions) == 2
    assert sessions.close("victim", ["s"]) == ["s"] and sessions.get("thief", "s") is theirs


def test_claim_to_close_holds_the_sessions_so_they_are_observed_once():
    sessions = table()
    [session] = sessions.claim(VOCABULARY, "a", [Update("s", open=True)])
    sessions.release("a", [Update("s", open=True)], [session], drop_opened=False)
    assert sessions.claim_to_close(VOCABULARY, "a", ["s", "gone"]) == [session, None]
    with pytest.raises(SessionError) as second:  # a second close racing the first
        sessions.claim_to_close(VOCABULARY, "a", ["s"])
    assert second.value.kind == BUSY and str(second.value) == "session_ids[0]: session 's' is in use by another call; retry"
    assert refusal(sessions, [Update("s")]).kind == BUSY  # nor may a Propose extend it meanwhile
    sessions.unclaim([session, None])  # its tokens could not be stored: still open, retried later
    assert not session.busy and sessions.close("a", ["s"]) == ["s"]


def test_memory_is_charged_before_indexing_per_caller_and_in_all():
    config = NGramConfig()
    thousand = session_bytes(charged_tokens(1000), config)  # charged for 1,024 tokens
    limits = SessionLimits(100, 100, 10_000, max_bytes=3 * thousand, max_bytes_per_caller=2 * thousand)
    sessions = SessionTable(config, limits)
    sessions.claim(VOCABULARY, "a", [Update("a1", open=True, new_tokens=(1,) * 1000)])
    assert sessions.bytes_in_use == sessions.bytes_held_by("a") == thousand
    error = refusal(sessions, [Update("a2", open=True, new_tokens=(1,) * 1500)])
    assert error.kind == FULL and "over its budget of" in str(error) and "--max-session-bytes-per-caller" in str(error)
    assert len(sessions) == 1 and sessions.bytes_in_use == thousand  # the refused call was charged nothing
    sessions.claim(VOCABULARY, "b", [Update("b1", open=True, new_tokens=(1,) * 1000), Update("b2", open=True, new_tokens=(1,) * 1000)])
    error = refusal(sessions, [Update("c1", open=True, new_tokens=(1,) * 10)], caller="c")
    assert error.kind == FULL and "--max-session-bytes)" in str(error)
    assert sessions.close("b", ["b1"]) == ["b1"]
    assert sessions.bytes_in_use == 2 * thousand  # closing gives the bytes back


def test_what_a_session_is_charged_bounds_what_its_index_holds():
    import random

    config = NGramConfig()
    sessions = table(tokens=1 << 17)
    [session] = sessions.claim(VOCABULARY, "a", [Update("s", open=True, new_tokens=(0,) * 5000)])
    rng = random.Random(4)
    session.context.extend([rng.randrange(49_152) for _ in range(5000)])
    assert session.context.nbytes() <= session.charged_bytes == session_bytes(charged_tokens(5000), config)
    assert charged_tokens(5000) == 5120 and charged_tokens(512) == 512
    assert session_bytes(131_072, config) < 110 * 131_072  # under 110 bytes a context token
