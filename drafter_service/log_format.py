"""The observation log's messages, specified: what a drafter publishes to the shared log
and every replica applies, in log order, into its own tables. Pure: no NATS, no LMDB.

Subjects
--------
``<prefix>.obs.<vocabulary>.<scope>``: the observations and successor-table predictions of
one table (``<scope>`` is the scope's 32 hex digits, or ``_`` for the default scope), so
forgetting a scope is a purge of its subject. ``<prefix>.admin``: calls every replica
applies that name no table's subject (forgetting a scope).

Message ids
-----------
An observation's JetStream message id (the ``Nats-Msg-Id`` header) is
``<vocabulary>.<scope>.<observe_id>``: a retry of one call within the stream's duplicate
window is stored once, and one caller's id never drops another scope's observation. A
retry later than the window is still applied once: each sequence is stored under
``<observe_id>/<index>`` in its table's remembered ids, as without a log.

Payload, version 1 (``LOG_FORMAT_VERSION``); integers little-endian
--------------------------------------------------------------------
    version (uint8) | kind (uint8) | vocabulary (8 bytes) | scope length (uint8) | scope (ASCII)
    | body

``OBSERVE`` (1) body: observe id length (uint16) | observe id (UTF-8) | sequences (uint32)
| per sequence: tokens (uint32) | tokens (uint32 each). One message per call.

``SUCCESSORS`` (2) body: keys (uint32) | per key: n (uint8, 1 or 2) | k (uint8, 1..16)
| n key tokens | k predicted tokens (uint32 each). The target's predictions for one table,
coalesced (newest per key) over a short interval by the drafter that received them.

``FORGET`` (3) body: empty. Published on ``<prefix>.admin``: each replica drops the
scope's table if the table holds nothing applied after this message.

A replica refuses (``LogFormatError``) a payload of another version or kind, or one whose
lengths do not add up: it skips that message, counted, and never guesses.

    encode_observe("0123456789abcdef", "", "req-1", [[1, 2, 3]])
    decode(...) -> LogMessage(kind=OBSERVE, vocabulary="0123456789abcdef", scope="",
                               observe_id="req-1", sequences=[[1, 2, 3]])
"""

from __future__ import annotations

import re
import struct
import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

LOG_FORMAT_VERSION = 1
OBSERVE, SUCCESSORS, FORGET = 1, 2, 3
KINDS = {OBSERVE: "observe", SUCCESSORS: "successors", FORGET: "forget"}
# The default scope's subject token: a subject token may not be empty.
DEFAULT_SCOPE_TOKEN = "_"
# A subject prefix: NATS subject tokens of letters, digits, '-' and '_', joined by dots.
PREFIX_PATTERN = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")

_HEADER = struct.Struct("<BB8sB")  # version, kind, vocabulary, scope length
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_KEY_HEAD = struct.Struct("<BB")  # n, k
_LITTLE = sys.byteorder == "little"


class LogFormatError(ValueError):
    """A payload this code does not read: another version or kind, or lengths that do not add up."""


@dataclass(frozen=True)
class LogMessage:
    """One decoded log message (see the module docstring for each kind's fields)."""

    kind: int
    vocabulary: str
    scope: str
    observe_id: str = ""
    sequences: list[list[int]] = field(default_factory=list)
    successors: list[tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)


def table_subject(prefix: str, vocabulary: str, scope: str) -> str:
    """The subject of one (vocabulary, scope) table: 'specdec.drafter.obs.0123456789abcdef._'."""
    return f"{prefix}.obs.{vocabulary}.{scope or DEFAULT_SCOPE_TOKEN}"


def admin_subject(prefix: str) -> str:
    return f"{prefix}.admin"


def message_id(vocabulary: str, scope: str, observe_id: str) -> str:
    """The JetStream message id of an observation (see *Message ids*)."""
    return f"{vocabulary}.{scope or DEFAULT_SCOPE_TOKEN}.{observe_id}"


def _tokens_bytes(tokens: Sequence[int]) -> bytes:
    packed = array("I", tokens)  # OverflowError for ids outside uint32: callers checked them
    if not _LITTLE:
        packed.byteswap()
    return packed.tobytes()


def _tokens_of(payload: bytes | memoryview, offset: int, count: int) -> list[int]:
    end = offset + 4 * count
    if end > len(payload):
        raise LogFormatError(f"a token list of {count} runs past the payload's {len(payload)} bytes")
    tokens = array("I")
    tokens.frombytes(payload[offset:end])
    if not _LITTLE:
        tokens.byteswap()
    return tokens.tolist()


def _head(kind: int, vocabulary: str, scope: str) -> bytes:
    return _HEADER.pack(LOG_FORMAT_VERSION, kind, bytes.fromhex(vocabulary), len(scope)) + scope.encode("ascii")


def encode_observe(vocabulary: str, scope: str, observe_id: str, sequences: Iterable[Sequence[int]]) -> bytes:
    """One Observe call's payload: its sequences, to be stored under ``observe_id``/index."""
    sequences = list(sequences)
    identity = observe_id.encode("utf-8")
    parts = [_head(OBSERVE, vocabulary, scope), _U16.pack(len(identity)), identity, _U32.pack(len(sequences))]
    for tokens in sequences:
        parts += (_U32.pack(len(tokens)), _tokens_bytes(tokens))
    return b"".join(parts)


def encode_successors(vocabulary: str, scope: str, successors: Sequence[tuple[Sequence[int], Sequence[int]]]) -> bytes:
    """Predictions for one table: (key of 1 or 2 tokens, predicted tokens best first) each."""
    parts = [_head(SUCCESSORS, vocabulary, scope), _U32.pack(len(successors))]
    for key, tokens in successors:
        parts += (_KEY_HEAD.pack(len(key), len(tokens)), _tokens_bytes([*key, *tokens]))
    return b"".join(parts)


def encode_forget(vocabulary: str, scope: str) -> bytes:
    return _head(FORGET, vocabulary, scope)


def decode(payload: bytes | memoryview) -> LogMessage:
    """A message's fields; LogFormatError for anything this version does not read."""
    if len(payload) < _HEADER.size:
        raise LogFormatError(f"a payload of {len(payload)} bytes holds no header")
    version, kind, vocabulary, scope_length = _HEADER.unpack_from(payload)
    if version != LOG_FORMAT_VERSION:
        raise LogFormatError(f"log format version {version}; this code reads version {LOG_FORMAT_VERSION}")
    if kind not in KINDS:
        raise LogFormatError(f"unknown message kind {kind}")
    offset = _HEADER.size + scope_length
    try:
        scope = bytes(payload[_HEADER.size : offset]).decode("ascii")
    except UnicodeDecodeError:
        raise LogFormatError("the scope is not ASCII") from None
    if len(scope) != scope_length:
        raise LogFormatError("the scope runs past the payload")
    head = LogMessage(kind, vocabulary.hex(), scope)
    if kind == FORGET:
        _check_end(payload, offset)
        return head
    if kind == OBSERVE:
        return _decode_observe(payload, offset, head)
    return _decode_successors(payload, offset, head)


def _decode_observe(payload: bytes | memoryview, offset: int, head: LogMessage) -> LogMessage:
    (length,) = _unpack(_U16, payload, offset)
    offset += _U16.size
    try:
        observe_id = bytes(payload[offset : offset + length]).decode("utf-8")
    except UnicodeDecodeError:
        raise LogFormatError("the observe id is not UTF-8") from None
    offset += length
    (count,) = _unpack(_U32, payload, offset)
    offset += _U32.size
    sequences = []
    for _ in range(count):
        (tokens,) = _unpack(_U32, payload, offset)
        offset += _U32.size
        sequences.append(_tokens_of(payload, offset, tokens))
        offset += 4 * tokens
    _check_end(payload, offset)
    return LogMessage(OBSERVE, head.vocabulary, head.scope, observe_id=observe_id, sequences=sequences)


def _decode_successors(payload: bytes | memoryview, offset: int, head: LogMessage) -> LogMessage:
    (count,) = _unpack(_U32, payload, offset)
    offset += _U32.size
    successors = []
    for _ in range(count):
        n, k = _unpack(_KEY_HEAD, payload, offset)
        offset += _KEY_HEAD.size
        tokens = _tokens_of(payload, offset, n + k)
        offset += 4 * (n + k)
        successors.append((tuple(tokens[:n]), tuple(tokens[n:])))
    _check_end(payload, offset)
    return LogMessage(SUCCESSORS, head.vocabulary, head.scope, successors=successors)


def _unpack(layout: struct.Struct, payload: bytes | memoryview, offset: int) -> tuple[int, ...]:
    if offset + layout.size > len(payload):
        raise LogFormatError(f"the payload ends at byte {len(payload)}, inside a field at {offset}")
    return layout.unpack_from(payload, offset)


def _check_end(payload: bytes | memoryview, offset: int) -> None:
    if offset != len(payload):
        raise LogFormatError(f"{len(payload) - offset} bytes after the message's last field")
