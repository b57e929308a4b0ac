"""The on-disk format of a drafter table, specified: what each record of the LMDB environment
that ``drafter_service.store`` keeps means, in which version, and what opening an older
version changes. Constants, key and value encodings, decoders that assert the version on
read, and ``file_problem``, the check that ``data.mdb`` is whole before LMDB maps it. It
imports no LMDB: ``LMDBNGramStore`` reads, writes and migrates the records, and
``drafter_service.table_check`` walks a table against this specification.

On-disk format, version 4 (``FORMAT_VERSION``)
----------------------------------------------
One LMDB environment (a directory holding ``data.mdb`` and ``lock.mdb``) with
six named sub-databases. Every integer is big-endian, so byte order is
numeric order and keys sharing a prefix sort together. No pickle anywhere.

``meta``
    ``b"format_version"`` -> uint8, 4. ``b"epoch"`` -> uint32, the current
    epoch. ``b"epoch_tokens"`` -> uint64, tokens applied since it began.
    ``b"tracked_bytes"`` -> uint64, see *Size and eviction* in
    ``drafter_service.store``. ``b"evictions"`` -> uint64, records evicted so
    far. ``b"successor_tick"`` -> uint32, the successor clock (see *The
    successor table's bound*, there too). ``b"successor_tick_writes"`` ->
    uint64, successor keys written since that tick began.
    ``b"successor_evictions"`` -> uint64, successor records evicted so far.
    ``b"log_sequence"`` -> uint64, only in a table a replica writes from the shared
    observation log (``drafter_service.replica``): the sequence of the last log message
    applied to it, written in the same transaction as that message's records, so a
    message is never applied twice, whatever restarts, restores or replays follow.
``ngrams``
    key = namespace (8 bytes) | n (uint8) | n tokens (uint32 each).
    value = value version (uint8, 1: ``VALUE_VERSION``) | last-touched epoch (uint32) | total (uint32)
    | k pairs (token uint32, count uint32), 1 <= k <= max_continuations,
    count descending, ties in the order they were stored. Counts are as of
    the last-touched epoch; total is their sum (saturating at 2**32-1).
``coldness``
    key = last-touched epoch (uint32) | total (uint32) | the ``ngrams`` key;
    value empty. Exactly one per ``ngrams`` record: this sub-db's key order
    is the eviction order.
``applied``
    key = hour applied (uint32, hours since the Unix epoch) | namespace (8
    bytes) | observe id (UTF-8); value empty. Oldest first, so expiry and
    eviction read from the front.
``successors`` (the *successor table*: the target's own predictions)
    key = namespace (8 bytes) | n (uint8, 1 or 2) | n tokens (uint32 each):
    the current token, or the previous and the current one.
    value = value version (uint8, 2: ``SUCCESSOR_VERSION``) | stamp (uint32:
    the successor tick when the key was last written) | k tokens (uint32
    each), 1 <= k <= ``MAX_SUCCESSORS``: the target's top k predictions for
    the token after that key, best first, as a verifier last computed them.
    The newest replace what was there (Token Recycling's rule: the latest
    predictions are the best guess). Not in ``tracked_bytes``: bounded by
    count, ``max_successor_entries`` (see *The successor table's bound* in
    ``drafter_service.store``).
``successor_recency``
    key = stamp (uint32) | the ``successors`` key; value empty. Exactly one
    per ``successors`` record, under the stamp its value holds: this sub-db's
    key order (oldest tick first, then key bytes) is the successor table's
    eviction order.

Opening a file whose ``format_version`` is 4 reads it. Older ones are migrated
in place, in one transaction (all of it or nothing), as ``MIGRATIONS``
summarises: 3's successor values (version 1: the tokens without a stamp) are
rewritten as version 2 with stamp 0, each with its ``successor_recency``
entry, and the clock starts at tick 1, so every record migrated is older than
any written since and nothing learned is lost; 2 gains the two successor
sub-databases; 1 too, and its ``applied`` ids were keyed by decay epoch: those
ids are dropped, logged, so a retry in flight across the upgrade may be
counted twice. Every migration adds the three successor meta records.
Anything else, or a value whose version byte is not its sub-database's,
raises ``StoreFormatError``. Code before format 4 refuses a version 4 file
with that message.

Namespaces
----------
The namespace is a fingerprint of the tokenizer's vocabulary
(``specdec.vocabulary.vocabulary_fingerprint``): token 42 means different text under another
tokenizer, so a store reads and writes only keys with its own namespace.
Epochs, the size bound and eviction are shared by all namespaces in a file.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from itertools import chain

from specdec.vocabulary import FINGERPRINT_BYTES

FORMAT_VERSION = 4
# The older formats a store opens, migrating them in place (see the docstring).
MIGRATED_FORMAT_VERSION = 1
SUCCESSORLESS_FORMAT_VERSION = 2
UNSTAMPED_FORMAT_VERSION = 3
# What opening a table of an older format changes in it (the check tells operators).
MIGRATIONS = {
    MIGRATED_FORMAT_VERSION: "its observe ids are dropped, a successor table is added",
    SUCCESSORLESS_FORMAT_VERSION: "a successor table is added",
    UNSTAMPED_FORMAT_VERSION: "each successor record is stamped as the oldest, for eviction",
}
# Version byte of a ``successors`` value (format 3's, unstamped, is migrated), and the most predictions one holds.
SUCCESSOR_VERSION = 2
UNSTAMPED_SUCCESSOR_VERSION = 1
MAX_SUCCESSORS = 16
# Version byte of an ``ngrams`` value (its encoding has not changed since format 1).
VALUE_VERSION = 1
NAMESPACE_BYTES = FINGERPRINT_BYTES
UINT32_MAX = 0xFFFFFFFF

# LMDB's default build rejects keys over 511 bytes: an n-gram key is 9 + 4n
# bytes and an applied-id key 12 + the id's UTF-8 length.
LMDB_MAX_KEY_BYTES = 511
MAX_OBSERVE_ID_BYTES = LMDB_MAX_KEY_BYTES - 4 - NAMESPACE_BYTES
MAX_N = (LMDB_MAX_KEY_BYTES - NAMESPACE_BYTES - 1) // 4
# Continuations kept per key at most: a drafter uses the first; 255 is far
# beyond any useful ranking and bounds a value to 9 + 2040 bytes.
MAX_CONTINUATIONS = 255
# Named sub-databases: ngrams, coldness, applied, meta, successors, successor_recency.
SUB_DATABASES = 6

# The records' encodings (see the docstring), built once.
VALUE_HEADER = struct.Struct(">BII")  # version, last-touched epoch, total
PAIR_BYTES = 8
UINT32 = struct.Struct(">I")
EPOCH_TOTAL = struct.Struct(">II")
FIRST_PAIR = struct.Struct(">II")
# Packers for 0..MAX_CONTINUATIONS (token, count) pairs, built once: values are encoded per write.
PAIRS = [struct.Struct(f">{2 * n}I") for n in range(MAX_CONTINUATIONS + 1)]
UINT64 = struct.Struct(">Q")
# A successor key after its namespace (n, then n tokens), for n = 1, 2; a value's k tokens.
SUCCESSOR_KEYS = {n: struct.Struct(f">B{n}I") for n in (1, 2)}
SUCCESSOR_HEADER = struct.Struct(">BI")  # version, stamp
SUCCESSOR_TOKENS = [struct.Struct(f">{n}I") for n in range(MAX_SUCCESSORS + 1)]
META_VERSION = b"format_version"
META_EPOCH = b"epoch"
META_EPOCH_TOKENS = b"epoch_tokens"
META_TRACKED = b"tracked_bytes"
META_EVICTIONS = b"evictions"
META_SUCCESSOR_TICK = b"successor_tick"
META_SUCCESSOR_TICK_WRITES = b"successor_tick_writes"
META_SUCCESSOR_EVICTIONS = b"successor_evictions"
META_LOG_SEQUENCE = b"log_sequence"
# The meta records (see the docstring) and each one's length: formats 1-3, and this one.
OLDER_META_LAYOUT = {META_VERSION: 1, META_EPOCH: 4, META_EPOCH_TOKENS: 8, META_TRACKED: 8, META_EVICTIONS: 8}
META_LAYOUT = {**OLDER_META_LAYOUT, META_SUCCESSOR_TICK: 4, META_SUCCESSOR_TICK_WRITES: 8, META_SUCCESSOR_EVICTIONS: 8}
# A replica's table (format 4) has one more: the last log message applied.
REPLICA_META_LAYOUT = {**META_LAYOUT, META_LOG_SEQUENCE: 8}
# Sub-databases a store's main database names; anything else is not ours.
SUCCESSORLESS_DATABASES = {b"ngrams", b"coldness", b"applied", b"meta"}  # formats 1 and 2
UNSTAMPED_DATABASES = {*SUCCESSORLESS_DATABASES, b"successors"}  # format 3
OUR_DATABASES = {*UNSTAMPED_DATABASES, b"successor_recency"}
# The sub-databases of each format a store reads.
DATABASES_OF_VERSION = {
    MIGRATED_FORMAT_VERSION: SUCCESSORLESS_DATABASES,
    SUCCESSORLESS_FORMAT_VERSION: SUCCESSORLESS_DATABASES,
    UNSTAMPED_FORMAT_VERSION: UNSTAMPED_DATABASES,
    FORMAT_VERSION: OUR_DATABASES,
}
MAX_NGRAM_KEY_BYTES = NAMESPACE_BYTES + 1 + 4 * MAX_N


class StoreFormatError(RuntimeError):
    """The file was written in a format this code does not read, or is not ours, or is damaged."""


def encode_value(epoch: int, pairs: Sequence[tuple[int, int]], total: int | None = None) -> bytes:
    """The ``ngrams`` value: header, then (token, count) pairs as stored."""
    flat = list(chain.from_iterable(pairs))
    if total is None:
        total = total_count(pairs)
    return VALUE_HEADER.pack(VALUE_VERSION, epoch, total) + PAIRS[len(pairs)].pack(*flat)


def decode_value(value: bytes) -> tuple[int, int, list[tuple[int, int]]]:
    """(last-touched epoch, total, pairs) of an ``ngrams`` value; asserts the version."""
    if not value or value[0] != VALUE_VERSION:
        version = value[0] if value else None
        raise StoreFormatError(f"n-gram value has version {version}; this code reads version {VALUE_VERSION}")
    if len(value) < VALUE_HEADER.size + PAIR_BYTES or (len(value) - VALUE_HEADER.size) % PAIR_BYTES:
        raise StoreFormatError(f"n-gram value of {len(value)} bytes is not a header plus one or more whole pairs")
    _version, epoch, total = VALUE_HEADER.unpack_from(value)
    flat = struct.unpack_from(f">{(len(value) - VALUE_HEADER.size) // 4}I", value, VALUE_HEADER.size)
    return epoch, total, list(zip(flat[0::2], flat[1::2]))


def total_count(pairs: Sequence[tuple[int, int]]) -> int:
    total = sum(count for _token, count in pairs)
    return total if total < UINT32_MAX else UINT32_MAX


def coldness_key(epoch: int, total: int, ngram_key: bytes) -> bytes:
    return EPOCH_TOTAL.pack(epoch, total) + ngram_key


def applied_key(hour: int, namespace: bytes, observe_id: bytes) -> bytes:
    return UINT32.pack(hour) + namespace + observe_id


# LMDB's meta pages (lmdb.h, 64-bit): page header (16 bytes), then mm_magic,
# mm_version, mm_address, mm_mapsize, mm_dbs[2] (48 bytes each, the first's
# md_pad holding the page size), mm_last_pg, mm_txnid.
_LMDB_MAGIC = 0xBEEFC0DE
_LMDB_META = struct.Struct("<II")  # magic, version, at +16
_LMDB_PAGE_SIZE = struct.Struct("<I")  # at +40
_LMDB_LAST_PAGE_AND_TXN = struct.Struct("<QQ")  # at +136


def file_problem(path: str | os.PathLike[str]) -> str | None:
    """Why ``path/data.mdb`` cannot be opened safely, or None (also when there is none yet).

    Checked without mapping the file: LMDB maps it whole, and a page past the end
    of a truncated file kills the process with SIGBUS, which no handler catches.
    """
    data_file = os.path.join(path, "data.mdb")
    if not os.path.exists(data_file):
        return None
    size = os.path.getsize(data_file)
    with open(data_file, "rb") as handle:
        head = handle.read(2 * 65536)
    if len(head) < 4096 + 152:
        return f"data.mdb is {size} bytes: too short for LMDB's two meta pages"
    if _LMDB_META.unpack_from(head, 16)[0] != _LMDB_MAGIC:
        return "data.mdb is not an LMDB file (bad magic)"
    page_size = _LMDB_PAGE_SIZE.unpack_from(head, 40)[0]
    if page_size not in (4096, 8192, 16384, 32768, 65536) or len(head) < page_size + 152:
        return f"data.mdb has an implausible page size {page_size}"
    metas = [
        _LMDB_LAST_PAGE_AND_TXN.unpack_from(head, offset + 136)
        for offset in (0, page_size)
        if _LMDB_META.unpack_from(head, offset + 16)[0] == _LMDB_MAGIC
    ]
    last_page, _txn = max(metas, key=lambda meta: meta[1])
    if (last_page + 1) * page_size > size:
        return f"data.mdb is truncated: its last page ends at byte {(last_page + 1) * page_size}, the file has {size}"
    return None
