"""Text from a growing list of tokens, in time linear in its length.

``IncrementalDecoder`` turns tokens into text as they arrive (as vLLM's
detokenizer does): each push decodes a short window of tokens ending at the
new ones and keeps the difference to the window without them. Decoding the
whole output after every token would cost quadratic time. For a Hugging Face
fast tokenizer that decodes in Rust alone, ``tokenizers``' own
``DecodeStream`` (the same algorithm, one call a push) does it.

``IncrementalText`` turns a stream's tokens into text deltas that are safe
to send: never a half character, a stop string or what may become one.

``StopStringMatcher`` finds the first stop string in that text, searching
only the tail where a new match can be: a stop string of length n that
ends in the new text starts at most n - 1 characters before it.
"""

from __future__ import annotations

import copy
import logging

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerFast

log = logging.getLogger(__name__)


class IncrementalDecoder:
    """Text as tokens arrive, special tokens skipped: what each push adds to the decoded whole."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._backend = _decoding_backend(tokenizer)  # None: ours decodes
        self._stream = DecodeStream(skip_special_tokens=True)
        # Without DecodeStream, ours: tokens[prefix:read] is the decoded context window.
        self.tokens: list[int] = []
        self._prefix_offset = self._read_offset = 0

    def push(self, tokens: list[int]) -> str:
        """The text the new tokens add ("" while they end on half a character)."""
        if self._backend is not None:
            return _step(self._stream, self._backend, tokens)
        self.tokens.extend(tokens)
        decode = self.tokenizer.decode
        before = decode(self.tokens[self._prefix_offset : self._read_offset], skip_special_tokens=True)
        after = decode(self.tokens[self._prefix_offset :], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith("\ufffd") or not after.startswith(before):
            return ""  # nothing yet, half a character, or a decode that rewrote its past: wait
        self._prefix_offset, self._read_offset = self._read_offset, len(self.tokens)
        return after[len(before) :]

    def peek(self, tokens: list[int]) -> list[str]:
        """What pushing ``tokens`` one at a time would add, each, leaving the decoder as it was
        (the text of a draft the target turned down, where it was proposed)."""
        if self._backend is not None:
            stream = copy.copy(self._stream)
            return [_step(stream, self._backend, [token]) for token in tokens]
        kept, prefix, read = len(self.tokens), self._prefix_offset, self._read_offset
        try:
            return [self.push([token]) for token in tokens]
        finally:
            del self.tokens[kept:]
            self._prefix_offset, self._read_offset = prefix, read


def _decoding_backend(tokenizer) -> Tokenizer | None:
    """The Rust tokenizer whose decode is all of ``tokenizer.decode``, so that DecodeStream's text
    is ``tokenizer.decode``'s: a transformers fast tokenizer that neither decodes its own way (a
    model's subclass may) nor cleans up spaces after decoding. None for any other (the tests'
    stand-ins, a slow tokenizer): ours decodes with ``tokenizer.decode`` itself."""
    if not isinstance(tokenizer, PreTrainedTokenizerFast) or tokenizer.clean_up_tokenization_spaces:
        return None
    kind = type(tokenizer)
    if kind.decode is not PreTrainedTokenizerFast.decode or kind._decode is not PreTrainedTokenizerFast._decode:
        return None
    return tokenizer.backend_tokenizer


def _step(stream: DecodeStream, backend: Tokenizer, tokens: list[int]) -> str:
    """DecodeStream's push: as ours, "" while the tokens end on half a character or rewrite the
    text before them (DecodeStream raises then, with its state as it was, so it waits as ours does)."""
    try:
        return stream.step(backend, tokens) or ""
    except Exception as error:  # tokenizers raises a plain Exception
        if not str(error).startswith("Invalid prefix"):
            raise
        return ""


class StopStringMatcher:
    """The output text up to the first stop string, checked token by token.

    stops ("</s>",): pushing tokens that decode to "ab", "</", "s>c" returns
    None, None, then "ab" (the text before the stop string).
    """

    def __init__(self, tokenizer, stops: tuple[str, ...]) -> None:
        assert stops and all(stops), "stop strings must be non-empty"
        self.stops = stops
        self.decoder = IncrementalDecoder(tokenizer)
        self._pieces: list[str] = []  # the text so far, as decoded (joined only at a match)
        self._length = 0
        self._reach = max(map(len, stops)) - 1  # how far back a new match can start
        self._tail = ""  # the text's last _reach characters

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    def push(self, token: int) -> str | None:
        """The text before the first stop string once one has appeared, else None."""
        new = self.decoder.push([token])
        if not new:
            return None
        window, offset = self._tail + new, self._length - len(self._tail)
        self._pieces.append(new)
        self._length += len(new)
        self._tail = window[-self._reach :] if self._reach else ""
        found = [position for position in (window.find(stop) for stop in self.stops) if position >= 0]
        return self.text[: offset + min(found)] if found else None


class IncrementalText:
    """Text deltas for a stream of tokens, each a prefix-safe piece of the final text.

    Holds back a trailing partial UTF-8 character (decoded as U+FFFD) and any
    tail that could be the start of a stop string, since the final text ends
    before the stop string. ``finish`` sends the rest of the final text.
    Decoding is incremental (``text.IncrementalDecoder``) and stop strings are
    sought only in the text not yet sent (the held tail, shorter than the
    longest stop string, plus the new piece), so a long stream costs linear,
    not quadratic, time.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...]) -> None:
        self.stop = stop
        self.decoder = IncrementalDecoder(tokenizer)
        self.held = ""  # decoded, not yet sent
        self._sent: list[str] = []  # the deltas sent, in order

    @property
    def sent(self) -> str:
        """The prefix of the text already streamed."""
        return "".join(self._sent)

    def push(self, tokens: list[int]) -> str:
        text = self.held + self.decoder.push(tokens)
        # The final text ends before the first stop string: never send one, nor a
        # tail that may yet become one. None can start inside what was sent
        # (that would have been held), so only the unsent text is searched.
        safe = len(text)
        for stop in self.stop:
            found = text.find(stop)
            if found >= 0:
                safe = min(safe, found)
        safe -= max((_stop_prefix_at_end(text[:safe], stop) for stop in self.stop), default=0)
        delta, self.held = text[:safe], text[safe:]
        if delta:
            self._sent.append(delta)
        return delta

    def finish(self, final_text: str) -> str:
        sent = self.sent
        if not final_text.startswith(sent):  # cannot happen for prefix-stable tokenizers
            log.warning("streamed text is not a prefix of the final text")
            return ""
        return final_text[len(sent) :]


def _stop_prefix_at_end(text: str, stop: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``stop``: ("ab<", "<end>") -> 1.

    Only tails that start with ``stop``'s first character are compared.
    """
    start = text.find(stop[0], max(0, len(text) - len(stop) + 1))
    while start >= 0:
        if stop.startswith(text[start:]):
            return len(text) - start
        start = text.find(stop[0], start + 1)
    return 0
