"""Streamed text deltas (text.IncrementalText): prefix-safe pieces that join to the final text."""

from __future__ import annotations

import logging

import pytest

from verifier_service.core.engine import GenerationRequest, SpeculativeEngine, reference_greedy
from verifier_service.core.text import IncrementalText, _stop_prefix_at_end


class ByteTokenizer:
    """Token i is the bytes PIECES[i]; decoding joins them as UTF-8, an incomplete character as U+FFFD."""

    PIECES = {
        0: b"ab",
        1: b"<e",
        2: b"nd",
        3: b"d>",
        4: b"x",
        5: b"caf",
        6: b"\xc3",  # first byte of "é" (c3 a9)
        7: b"\xa9",
        8: b"\xe2",  # "€" is e2 82 ac
        9: b"\x82",
        10: b"\xac",
        11: b" ",
    }

    def decode(self, tokens, skip_special_tokens=False):
        return b"".join(self.PIECES[t] for t in tokens).decode("utf-8", errors="replace")


class RewritingTokenizer:
    """Not prefix-stable: [0] decodes to "x", but [0, 1] to "yz"."""

    def decode(self, tokens, skip_special_tokens=False):
        return {(): "", (0,): "x", (0, 1): "yz"}[tuple(tokens)]


def stream(tokenizer, stop, chunks, final_text):
    """Deltas for each pushed chunk, then finish's."""
    text = IncrementalText(tokenizer, stop)
    return [text.push(chunk) for chunk in chunks] + [text.finish(final_text)]


# -- _stop_prefix_at_end ---------------------------------------------------------------


@pytest.mark.parametrize(
    "text, stop, expected",
    [
        ("ab<", "<end>", 1),  # the docstring example
        ("ab<en", "<end>", 3),
        ("ab<end", "<end>", 4),  # the longest proper prefix
        ("<e", "<end>", 2),  # the whole text
        ("ab<end>", "<end>", 0),  # the whole stop string is not a *proper* prefix
        ("ab", "<end>", 0),
        ("", "<end>", 0),
        ("abc", "c", 0),  # a one-character stop string has no proper prefix
        ("xaa", "aab", 2),  # "aa", not just "a"
        ("<e<", "<e<e>", 3),  # overlapping prefixes: the longest tail wins
    ],
)
def test_stop_prefix_at_end(text, stop, expected):
    assert _stop_prefix_at_end(text, stop) == expected


# -- the tiny tokenizer: token i is the word "t{i}", words joined by spaces ----------------


def test_deltas_join_to_the_final_text(tiny_tokenizer):
    deltas = stream(tiny_tokenizer, (), [[3], [5], [12, 13]], "t3 t5 t12 t13")
    assert deltas == ["t3", " t5", " t12 t13", ""]


def test_special_tokens_are_skipped(tiny_tokenizer):
    # Token 1 is the tiny tokenizer's EOS: decoded with skip_special_tokens, it adds nothing.
    assert stream(tiny_tokenizer, (), [[3], [1], [5]], "t3 t5") == ["t3", "", " t5", ""]


def test_a_tail_that_may_start_a_stop_string_is_held_then_released(tiny_tokenizer):
    # "t3 t5" ends with "t5", the start of "t5 t6": only "t3 " is safe; "t7" shows it was not the stop.
    deltas = stream(tiny_tokenizer, ("t5 t6",), [[3], [5], [7]], "t3 t5 t7")
    assert deltas == ["t3", " ", "t5 t7", ""]


def test_finish_sends_a_held_tail_when_no_stop_string_followed(tiny_tokenizer):
    # max_new_tokens ended the generation while "t5" was held back.
    assert stream(tiny_tokenizer, ("t5 t6",), [[3], [5]], "t3 t5") == ["t3", " ", "t5"]


def test_a_completed_stop_string_is_never_streamed(tiny_tokenizer):
    """The engine emits the token that completes a stop string (it is in token_ids) and
    returns the text cut before the stop string, here "t3 ". Streaming must not send "t5 t6"."""
    deltas = stream(tiny_tokenizer, ("t5 t6",), [[3], [5], [6]], "t3 ")
    assert "".join(deltas) == "t3 "


@pytest.mark.parametrize("stop_words", [1, 2])
def test_stream_of_an_engine_generation_ending_at_a_stop_string_joins_to_its_text(tiny_model, tiny_tokenizer, stop_words):
    """The real pair: the engine's tokens, pushed one event per token as the scheduler does."""
    prompt = [5, 6, 7]
    truth = reference_greedy(tiny_model, prompt, 12, frozenset())
    stop = " ".join(f"t{t}" for t in truth[4 - stop_words : 4])  # ends with the 4th greedy token's word
    engine = SpeculativeEngine(tiny_model, tiny_tokenizer)
    engine.eos_token_ids = frozenset()
    [result] = engine.generate([GenerationRequest(prompt, 12, stop=(stop,), num_speculative_tokens=0)])
    assert result.finish_reason == "stop"
    assert stop not in result.text
    deltas = stream(tiny_tokenizer, (stop,), [[token] for token in result.token_ids], result.text)
    assert "".join(deltas) == result.text


# -- a byte-level tokenizer whose decode we control ----------------------------------------


def test_a_partial_utf8_character_is_held_until_complete():
    deltas = stream(ByteTokenizer(), (), [[5], [6], [7]], "café")
    assert deltas == ["caf", "", "é", ""]  # "caf\ufffd" sends nothing new


def test_a_three_byte_character_arriving_a_byte_at_a_time():
    deltas = stream(ByteTokenizer(), (), [[11], [8], [9], [10]], " €")
    assert deltas == [" ", "", "", "€", ""]


def test_finish_sends_what_the_final_text_has_past_the_streamed_part():
    # The generation ended on half a character: the final text has the replacement character.
    assert stream(ByteTokenizer(), (), [[5], [6]], "caf\ufffd") == ["caf", "", "\ufffd"]


def test_stop_prefix_split_across_tokens_is_held_then_released():
    # "ab<e" may become "ab<end>": hold "<e"; "ab<ex" cannot, so "<ex" goes out.
    assert stream(ByteTokenizer(), ("<end>",), [[0], [1], [4]], "ab<ex") == ["ab", "", "<ex", ""]


def test_the_longest_hold_among_several_stop_strings_wins():
    # "ab<e": "<end>" holds 2 characters, "b<e>" holds 3 ("b<e"): only "a" is safe.
    assert stream(ByteTokenizer(), ("<end>", "b<e>"), [[0, 1]], "ab<e") == ["a", "b<e"]


def test_a_partial_character_and_a_stop_prefix_together():
    # "ab<e" + half an "é": a push that ends on half a character is held whole
    # (its window is decoded again once the character completes); here the
    # generation ended there, so finish sends the final text.
    assert stream(ByteTokenizer(), ("<end>",), [[0, 1, 6]], "ab<e\ufffd") == ["", "ab<e\ufffd"]


def test_a_stop_string_completed_across_tokens_is_never_streamed():
    # "ab" + "<e" + "nd" + "d>" decodes to "ab<endd>"; with stop "<endd>" the final text is "ab".
    deltas = stream(ByteTokenizer(), ("<endd>",), [[0], [1], [2], [3]], "ab")
    assert "".join(deltas) == "ab"


def test_text_that_rewrites_what_was_streamed_sends_nothing(caplog):
    text = IncrementalText(RewritingTokenizer(), ())
    assert text.push([0]) == "x"
    assert text.push([1]) == ""  # "yz" does not extend "x": never send a delta that contradicts the past
    with caplog.at_level(logging.WARNING, logger="verifier_service.serving.server"):
        assert text.finish("yz") == ""
    assert "streamed text is not a prefix of the final text" in caplog.text


def test_each_push_decodes_a_short_window_not_the_whole_stream(tiny_tokenizer):
    """Incremental decoding: a long stream costs linear time, so no decode call may
    see more than the last couple of pushes' tokens."""
    windows = []

    class Counting:
        def decode(self, tokens, skip_special_tokens=False):
            windows.append(len(tokens))
            return tiny_tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    tokens = [3 + i % 50 for i in range(300)]
    deltas = stream(Counting(), (), [[token] for token in tokens], tiny_tokenizer.decode(tokens))
    assert "".join(deltas) == tiny_tokenizer.decode(tokens)
    assert max(windows) <= 2  # the previous push's token and the new one


def test_each_push_searches_only_the_text_not_yet_sent(tiny_tokenizer, monkeypatch):
    """Stop strings are sought in the held tail plus the new piece, never in what was
    streamed before: a 2,000-token stream with a 200-character stop string that never
    appears hands the prefix check at most 199 + one piece's characters per push."""
    from verifier_service.core import text as module

    seen = []
    real = module._stop_prefix_at_end

    def recording(text, stop):
        seen.append(len(text))
        return real(text, stop)

    monkeypatch.setattr(module, "_stop_prefix_at_end", recording)
    tokens = [3 + i % 50 for i in range(2000)]
    stop = "t3 " * 66 + "xy"  # 200 characters; its prefixes keep appearing in the stream
    deltas = stream(tiny_tokenizer, (stop,), [[token] for token in tokens], tiny_tokenizer.decode(tokens))
    assert "".join(deltas) == tiny_tokenizer.decode(tokens)
    longest_piece = max(len(tiny_tokenizer.decode([token])) + 1 for token in set(tokens))
    assert len(seen) == 2000 and max(seen) <= len(stop) - 1 + longest_piece
