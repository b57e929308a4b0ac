"""Incremental decoding and stop strings (verifier_service.text): right answers, in linear time."""

from __future__ import annotations

from verifier_service.engine import FINISH_STOP, GenerationRequest, SpeculativeEngine, reference_greedy
from verifier_service.text import IncrementalDecoder, StopStringMatcher


class Pieces:
    """Token i decodes to PIECES[i]; counts the tokens every decode call is given."""

    PIECES = {0: "ab", 1: "</", 2: "s>c", 3: "x", 4: "<", 5: "/s>"}

    def __init__(self):
        self.decoded = 0

    def decode(self, tokens, skip_special_tokens=False):
        self.decoded += len(tokens)
        return "".join(self.PIECES[t] for t in tokens)


def test_stop_string_matcher_docstring_example():
    matcher = StopStringMatcher(Pieces(), ("</s>",))
    assert [matcher.push(t) for t in (0, 1, 2)] == [None, None, "ab"]


def test_the_earliest_stop_string_wins_when_several_appear_at_once():
    matcher = StopStringMatcher(Pieces(), ("c", "</s>"))
    assert matcher.push(0) is None and matcher.push(1) is None
    assert matcher.push(2) == "ab"  # "</s>" starts at 2, "c" at 5


def test_a_stop_string_split_over_many_tokens_is_found():
    matcher = StopStringMatcher(Pieces(), ("x</s>",))
    assert [matcher.push(t) for t in (3, 3, 4, 5)] == [None, None, None, "x"]


def test_checking_a_long_output_costs_linear_time():
    """Each push decodes a window of at most two tokens and the one before it, so
    10,000 tokens cost ~30,000 token decodes, not the ~50 million of decoding the
    whole text each time."""
    tokenizer = Pieces()
    matcher = StopStringMatcher(tokenizer, ("never here",))
    for _ in range(10_000):
        assert matcher.push(3) is None
    assert tokenizer.decoded <= 3 * 10_000
    assert len(matcher.text) == 10_000


def test_incremental_decoder_waits_for_a_whole_character():
    class Bytes:
        def decode(self, tokens, skip_special_tokens=False):
            return b"".join({0: b"caf", 1: b"\xc3", 2: b"\xa9"}[t] for t in tokens).decode("utf-8", errors="replace")

    decoder = IncrementalDecoder(Bytes())
    assert [decoder.push([t]) for t in (0, 1, 2)] == ["caf", "", "\u00e9"]


def test_engine_stops_at_a_stop_string_far_into_a_long_output(tiny_model, tiny_tokenizer):
    truth = reference_greedy(tiny_model, [5, 6, 7], 300, frozenset())
    stop = " ".join(f"t{t}" for t in truth[280:283])  # three words, first seen at output token 280 or earlier
    engine = SpeculativeEngine(tiny_model, tiny_tokenizer)
    engine.eos_token_ids = frozenset()
    [result] = engine.generate([GenerationRequest([5, 6, 7], 300, stop=(stop,), num_speculative_tokens=0)])
    text = tiny_tokenizer.decode(truth)
    assert result.finish_reason == FINISH_STOP
    assert result.text == text[: text.index(stop)]
    assert stop not in tiny_tokenizer.decode(result.token_ids[:-1])  # it ended at the token completing the stop string
