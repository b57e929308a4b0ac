"""The replica's pieces that need no log: its position file, what a crash leaves in --db, and
how a log message becomes its table's entry (the log itself: tests/e2e/test_drafter_replication.py)."""

from __future__ import annotations

from drafter_service.config import DrafterConfig
from drafter_service.counting import first_occurrences
from drafter_service.log import Delivered
from drafter_service.log_format import decode, encode_observe, encode_successors
from drafter_service.replica import POSITION_FILE, Position, Replica, _entry
from drafter_service.storage import StoreRegistry

VOCABULARY = "0123456789abcdef"
HOUR_NS = 3600 * 10**9


class NoLog:
    """A replica's log link that is never reached: these tests run no NATS."""


def replica(tmp_path) -> tuple[Replica, StoreRegistry]:
    config = DrafterConfig(db=str(tmp_path / "db"), metrics_port=None)
    stores = StoreRegistry(config)
    return Replica(config, stores, NoLog(), lambda serving: None), stores  # type: ignore[arg-type]


def test_the_position_survives_a_restart_and_a_damaged_file_means_the_start(tmp_path):
    first, stores = replica(tmp_path)
    first.position = Position(41, "SPECDEC_DRAFTER", "2026-12-07T00:00:00+00:00")
    first._save()
    stores.close()
    again, stores = replica(tmp_path)
    assert again.position == Position(41, "SPECDEC_DRAFTER", "2026-12-07T00:00:00+00:00")
    stores.close()
    (tmp_path / "db" / POSITION_FILE).write_text('{"sequence": "x"')  # torn by hand: tables skip what they hold
    damaged, stores = replica(tmp_path)
    assert damaged.position == Position()
    stores.close()


def test_what_an_interrupted_hand_over_left_in_db_is_removed_at_start(tmp_path):
    root = tmp_path / "db"
    root.mkdir()
    for leftover in (".snapshot-out-1", ".bootstrap-2", ".replaced-3", f".dropped-{VOCABULARY}-4"):
        (root / leftover).mkdir()
        (root / leftover / "data.mdb").write_bytes(b"x")
    (root / ".snapshot-in-5.tar").write_bytes(b"x")
    (root / "notes.txt").write_text("an operator's")
    _, stores = replica(tmp_path)
    assert sorted(entry.name for entry in root.iterdir()) == ["drafter.lock", "notes.txt"]
    stores.close()


def test_a_message_of_several_sequences_is_one_call_counting_each_pair_once():
    config = DrafterConfig(metrics_port=None)
    sequences = [[1, 2, 3, 4, 5], [2, 3, 4, 5, 6]]
    message = decode(encode_observe(VOCABULARY, "", "call", sequences))
    entry = _entry(message, Delivered(9, 490_000 * HOUR_NS + 5, 0, "s", b""), config)
    assert (entry.sequence, entry.hour) == (9, 490_000)  # the log's hour, the same on every replica
    assert [item.observe_id for item in entry.observations] == ["call/0", "call/1"]
    expected = first_occurrences(sequences, config.ngram.n_min, config.ngram.n_max)
    assert [tuple(item.counted) for item in entry.observations] == expected
    alone = _entry(decode(encode_observe(VOCABULARY, "", "one", [[7, 8, 9]])), Delivered(10, 0, 0, "s", b""), config)
    assert alone.observations[0].counted is None  # a call by itself: the store counts each pair once in it
    successors = _entry(decode(encode_successors(VOCABULARY, "", [((7,), (8,))])), Delivered(11, 0, 0, "s", b""), config)
    assert successors.successors == [((7,), (8,))] and not successors.observations


def test_a_fetched_batch_is_applied_in_runs_of_bounded_payload():
    from drafter_service.replica import _groups

    sizes = [40, 40, 10, 90, 5]
    delivered = [Delivered(index + 1, 0, 0, "s", b"x" * size) for index, size in enumerate(sizes)]
    runs = _groups(delivered, 64)
    assert [[len(message.data) for message in run] for run in runs] == [[40], [40, 10], [90], [5]]
    assert [message.sequence for run in runs for message in run] == [1, 2, 3, 4, 5]  # in log order, none lost
