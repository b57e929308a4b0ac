"""The vocabulary fingerprint that keeps drafts in the verifier's own token ids.

Token 42 means different text under another tokenizer, so the drafter keeps
one table per fingerprint and the verifier names its fingerprint in every
call: a verifier never reads drafts made of foreign ids.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable

FINGERPRINT_BYTES = 8
_UINT32 = struct.Struct(">I")


def vocabulary_fingerprint(items: Iterable[tuple[str, int]]) -> bytes:
    """8 bytes of the sha256 of the vocabulary, independent of item order.

    Hashes, in id order, uint32 id | uint32 length | UTF-8 token per item, so
    {"a": 0, "b": 1} and {"a": 1, "b": 0} differ.
    """
    digest = hashlib.sha256()
    for token, token_id in sorted(items, key=lambda item: (item[1], item[0])):
        encoded = token.encode("utf-8")
        digest.update(_UINT32.pack(token_id) + _UINT32.pack(len(encoded)) + encoded)
    return digest.digest()[:FINGERPRINT_BYTES]


def tokenizer_fingerprint(tokenizer) -> str:
    """The fingerprint of a transformers tokenizer (added tokens included), as 16 hex digits."""
    return vocabulary_fingerprint(tokenizer.get_vocab().items()).hex()
