"""Tests for drafter_service.table_format: the namespace and the records' encodings, as the format specifies them."""

from __future__ import annotations

import pytest

from drafter_service.table_format import StoreFormatError, decode_value
from specdec.vocabulary import vocabulary_fingerprint


def test_vocabulary_fingerprint_hashes_the_sorted_vocabulary():
    # Golden value: sha256(uint32 0 | uint32 1 | "a" | uint32 1 | uint32 1 | "b")[:8].
    # If it changes, every stored table is orphaned, so the change must be deliberate.
    assert vocabulary_fingerprint([("a", 0), ("b", 1)]).hex() == "55a99400f7af5c63"
    assert vocabulary_fingerprint([("b", 1), ("a", 0)]).hex() == "55a99400f7af5c63"  # item order is irrelevant
    assert vocabulary_fingerprint([("a", 1), ("b", 0)]).hex() == "650457edecc9ca4d"  # ids matter


def test_a_value_too_short_for_one_pair_is_a_format_error():
    with pytest.raises(StoreFormatError, match="1 bytes is not a header plus one or more whole pairs"):
        decode_value(b"\x01")  # (1 - 9) % 8 == 0: once taken for a header and no pairs, then a struct.error
