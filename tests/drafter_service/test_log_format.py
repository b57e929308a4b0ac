"""The observation log's messages (drafter_service.log_format) and a table's log entries
(LMDBNGramStore.apply_log): exact round trips, refusals, and replay that applies nothing twice."""

from __future__ import annotations

import struct

import pytest

from drafter_service.log_format import (
    FORGET,
    LOG_FORMAT_VERSION,
    OBSERVE,
    SUCCESSORS,
    LogFormatError,
    admin_subject,
    decode,
    encode_forget,
    encode_observe,
    encode_successors,
    message_id,
    table_subject,
)
from drafter_service.store import ApplyItem, LMDBNGramStore, LogEntry, StoreConfig

VOCABULARY = "0123456789abcdef"
SCOPE = "ab" * 16


def test_an_observe_message_round_trips_its_call():
    payload = encode_observe(VOCABULARY, SCOPE, "req-1/é", [[1, 2, 3], [], [2**32 - 1]])
    message = decode(payload)
    assert (message.kind, message.vocabulary, message.scope, message.observe_id) == (OBSERVE, VOCABULARY, SCOPE, "req-1/é")
    assert message.sequences == [[1, 2, 3], [], [2**32 - 1]]


def test_successors_and_forget_round_trip():
    message = decode(encode_successors(VOCABULARY, "", [((7,), (8, 9)), ((6, 7), (8,))]))
    assert (message.kind, message.scope, message.successors) == (SUCCESSORS, "", [((7,), (8, 9)), ((6, 7), (8,))])
    forget = decode(encode_forget(VOCABULARY, SCOPE))
    assert (forget.kind, forget.vocabulary, forget.scope) == (FORGET, VOCABULARY, SCOPE)


def test_subjects_and_ids_keep_scopes_apart():
    assert table_subject("specdec.drafter", VOCABULARY, "") == f"specdec.drafter.obs.{VOCABULARY}._"
    assert table_subject("specdec.drafter", VOCABULARY, SCOPE) == f"specdec.drafter.obs.{VOCABULARY}.{SCOPE}"
    assert admin_subject("p") == "p.admin"
    # The same caller's id in two scopes is two messages: neither drops the other as a duplicate.
    assert message_id(VOCABULARY, "", "x") != message_id(VOCABULARY, SCOPE, "x")


@pytest.mark.parametrize(
    "payload, reason",
    [
        (b"", "no header"),
        (bytes([LOG_FORMAT_VERSION + 1]) + encode_forget(VOCABULARY, "")[1:], "version"),
        (bytes([LOG_FORMAT_VERSION, 9]) + encode_forget(VOCABULARY, "")[2:], "unknown message kind 9"),
        (encode_observe(VOCABULARY, "", "x", [[1, 2, 3]])[:-2], "runs past"),
        (encode_observe(VOCABULARY, "", "x", [[1, 2, 3]]) + b"\0", "1 bytes after"),
        (encode_forget(VOCABULARY, "") + b"junk", "4 bytes after"),
    ],
)
def test_a_payload_that_does_not_add_up_is_refused_with_why(payload, reason):
    with pytest.raises(LogFormatError, match=reason):
        decode(payload)


def test_a_sequence_count_past_the_payload_is_refused_not_allocated():
    head = encode_observe(VOCABULARY, "", "x", [])[:-4]  # up to the sequence count
    with pytest.raises(LogFormatError, match="ends at byte"):
        decode(head + struct.pack("<I", 2**31))


def _store(path, **overrides) -> LMDBNGramStore:
    return LMDBNGramStore(StoreConfig(path=str(path), namespace=bytes.fromhex(VOCABULARY), max_bytes=1 << 20, **overrides))


def _records(store: LMDBNGramStore) -> dict:
    with store._env.begin() as txn:  # every record of every sub-database, for equality
        return {
            name: dict(txn.cursor(db=db))
            for name, db in (("ngrams", store._ngrams), ("coldness", store._coldness), ("applied", store._applied), ("meta", store._meta))
        }


ENTRIES = [
    LogEntry(1, 480_000, observations=[ApplyItem("a/0", [1, 2, 3, 4, 5, 6])]),
    LogEntry(3, 480_001, successors=[((5,), (6, 7))]),
    LogEntry(4, 480_001, observations=[ApplyItem("b/0", [1, 2, 3, 4, 9]), ApplyItem("b/1", [3, 4, 9, 9])]),
    LogEntry(7, 480_002, observations=[ApplyItem("c/0", list(range(20, 40)))]),
]


def test_entries_applied_in_one_transaction_or_one_each_give_the_same_table(tmp_path):
    # Replicas group the log's messages into transactions as their fetches happen to come:
    # the table must not depend on it (each entry is merged as its own call, at its own hour).
    together, apart = _store(tmp_path / "together", epoch_observations=7), _store(tmp_path / "apart", epoch_observations=7)
    assert together.apply_log(ENTRIES) == [True] * 4
    assert [apart.apply_log([entry])[0] for entry in ENTRIES] == [True] * 4
    assert _records(together) == _records(apart)
    assert together.log_sequence() == apart.log_sequence() == 7
    assert together.successors((5,)) == (6, 7)


def test_a_replayed_entry_is_skipped_by_the_sequence_the_table_holds(tmp_path):
    store = _store(tmp_path / "t")
    store.apply_log(ENTRIES[:2])
    before = _records(store)
    # A replay from an older position (a crash before the position was saved): 1 and 3 are held.
    assert store.apply_log(ENTRIES) == [False, False, True, True]
    assert store.apply_log(ENTRIES) == [False] * 4
    after = _records(store)
    assert after["ngrams"] != before["ngrams"]
    assert store.log_sequence() == 7


def test_the_ids_clock_is_the_logs_hour_not_this_machines(tmp_path):
    # The same observe id 25 hours of log time later is outside the 24-hour window: counted again,
    # on every replica alike, whatever each replica's own clock says.
    store = _store(tmp_path / "t", clock=lambda: 0.0)
    first = LogEntry(1, 480_000, observations=[ApplyItem("same/0", [1, 2, 3, 4])])
    again = LogEntry(2, 480_010, observations=[ApplyItem("same/0", [1, 2, 3, 4])])
    late = LogEntry(3, 480_025, observations=[ApplyItem("same/0", [1, 2, 3, 4])])
    store.apply_log([first, again, late])
    assert store.continuations((1, 2, 3)) == {4: 2}  # the first and the late one; the retry within the window once


def test_a_table_with_a_log_mark_passes_the_start_up_walk(tmp_path):
    from drafter_service.table_check import walk_table

    store = _store(tmp_path / "t")
    store.apply_log(ENTRIES)
    store.close()
    assert walk_table(tmp_path / "t", None).problem is None


def test_an_entry_no_table_can_hold_is_skipped_alone_whatever_the_grouping(tmp_path):
    # A token id outside uint32 in the middle of a run: the entries around it are applied, and the
    # table is the one a replica that fetched them one at a time holds.
    bad = LogEntry(3, 480_001, observations=[ApplyItem("bad/0", [1, 2, 2**32, 4])])
    entries = [ENTRIES[0], bad, ENTRIES[2]]
    together, apart = _store(tmp_path / "together"), _store(tmp_path / "apart")
    assert together.apply_log(entries) == [True, None, True]
    assert [apart.apply_log([entry])[0] for entry in entries] == [True, None, True]
    assert _records(together) == _records(apart)
    assert together.log_sequence() == 4
    assert together.apply_log([bad]) == [False]  # a replay skips it by its sequence, as any other
    assert together.continuations((2, 3, 4)) == {5: 1, 9: 1}
