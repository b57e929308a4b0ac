"""Incremental decoding and stop strings (verifier_service.core.text): right answers, in linear time."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from verifier_service.core.engine import FINISH_STOP, GenerationRequest, SpeculativeEngine, reference_greedy
from verifier_service.core.text import IncrementalDecoder, StopStringMatcher, _decoding_backend


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


# -- tokenizers' DecodeStream, where it decodes as tokenizer.decode does -------------------------


class DecodeOnly:
    """A tokenizer seen through its ``decode`` alone: IncrementalDecoder's own window decoding."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode


def pushes_and_peeks(decoder: IncrementalDecoder, tokens: list[int], chunk: int) -> list:
    """Each push's text for ``tokens`` in chunks of ``chunk``, each push preceded by a peek at the next two tokens."""
    out = []
    for start in range(0, len(tokens), chunk):
        out.append(decoder.peek(tokens[start : start + 2]))
        out.append(decoder.push(tokens[start : start + chunk]))
    return out


# Multi-byte characters that a byte-level BPE splits across tokens (SmolLM2 spells "語" and
# "😀" in three tokens each), accents, spaces and newlines.
TEXTS = ["Hello, world! café naïve — 日本語のテキスト 😀👍🏽", "  spaces   and\nnewlines\t tabs", "don't  . , ! ?  I'm"]


def test_the_default_models_tokenizer_decodes_with_decodestream_as_ours_does(real_model):
    tokenizer = real_model.tokenizer
    assert _decoding_backend(tokenizer) is tokenizer.backend_tokenizer
    assert _decoding_backend(DecodeOnly(tokenizer)) is None
    for text in TEXTS:
        # The tokenizer's end-of-text token (0) among them: skipped, as special tokens are.
        tokens = [*tokenizer(text, add_special_tokens=False).input_ids, 0, 28, 6417]
        for chunk in (1, 2, 3):
            streamed = pushes_and_peeks(IncrementalDecoder(tokenizer), tokens, chunk)
            assert streamed == pushes_and_peeks(IncrementalDecoder(DecodeOnly(tokenizer)), tokens, chunk)
        decoder = IncrementalDecoder(tokenizer)
        assert "".join(decoder.push([token]) for token in tokens) == tokenizer.decode(tokens, skip_special_tokens=True)


def test_a_character_split_across_tokens_comes_whole_from_decodestream(real_model):
    tokenizer = real_model.tokenizer
    tokens = tokenizer("語", add_special_tokens=False).input_ids
    assert len(tokens) == 3  # the character's three bytes, a token each
    decoder = IncrementalDecoder(tokenizer)
    assert [decoder.push([token]) for token in tokens] == ["", "", "語"]


def test_the_tiny_tokenizer_decodes_with_decodestream_as_ours_does(tiny_tokenizer):
    assert _decoding_backend(tiny_tokenizer) is tiny_tokenizer.backend_tokenizer
    tokens = [3, 5, 1, 12, 13, 1, 40]  # 1 is the EOS: skipped
    for chunk in (1, 2, 3):
        streamed = pushes_and_peeks(IncrementalDecoder(tiny_tokenizer), tokens, chunk)
        assert streamed == pushes_and_peeks(IncrementalDecoder(DecodeOnly(tiny_tokenizer)), tokens, chunk)
    decoder = IncrementalDecoder(tiny_tokenizer)
    assert [decoder.push([token]) for token in tokens] == ["t3", " t5", "", " t12", " t13", "", " t40"]


def rewriting_tokenizer() -> PreTrainedTokenizerFast:
    """A Rust tokenizer that is not prefix-stable: [a] decodes to "a", [a, b] to "XYZ"."""
    backend = Tokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2}, unk_token="a"))
    backend.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "XYZ")])
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def test_decodestream_waits_on_a_decode_that_rewrites_its_past_as_ours_does():
    """DecodeStream raises on such a decode; the decoder waits instead (nothing sent can be taken back)."""
    tokenizer = rewriting_tokenizer()
    assert _decoding_backend(tokenizer) is not None
    for chosen in (tokenizer, DecodeOnly(tokenizer)):
        decoder = IncrementalDecoder(chosen)
        assert [decoder.push([token]) for token in (0, 1, 2)] == ["a", "", ""]


def test_a_tokenizer_that_cleans_up_spaces_after_decoding_decodes_with_ours():
    """transformers' clean-up ("a ." -> "a.") runs in Python after the Rust decode, where DecodeStream cannot see it."""
    backend = Tokenizer(models.WordLevel({"a": 0, ".": 1}, unk_token="a"))
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=True)
    assert tokenizer.decode([0, 1]) == "a."  # the Rust decode's "a ."
    assert _decoding_backend(tokenizer) is None
    decoder = IncrementalDecoder(tokenizer)
    assert [decoder.push([token]) for token in (0, 1)] == ["a", "."]
