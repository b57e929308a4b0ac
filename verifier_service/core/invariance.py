"""Batch-invariant passes: a token's logits bitwise the same whatever else is in its pass.

A packed step's shape depends on everything in it: the token's own chain or tree, the
other sequences, a prefill chunk riding along. Matrix kernels pick their blocking, and
with it the order of their float additions, from the shapes they are given, so the same
token can come out of two passes a rounding apart: harmless in float32 so far, enough in
bfloat16 to flip a greedy choice, and so to make speculative output differ from plain.
Measured on a CPU (torch's oneDNN and MKL kernels):

* a GEMM's row depends on how many rows the call has (float32 at every count; bfloat16
  only between one row and more, or, on a CPU with AMX, from 33 rows on, where oneDNN
  switches to a kernel whose rows also depend on their place among the others; with the
  weight laid out for oneDNN, ``packed_linear``, from 150 rows on, and then only about one
  row in twelve), but not on the other rows' values or on its own place among them, when
  the count is fixed;
* scaled-dot-product attention's output for a query depends on how many queries the call
  has (its kernel cuts them into blocks of 32; within one block, in bfloat16 on the default
  model's shapes, not, but in float32 at two heads a key head already between one token's
  heads and two tokens') and on whether the columns it reads end in
  a whole 16-wide vector; not on hidden columns past that, nor on the other batch entries
  (on random inputs: on the model's own, a token read with more hidden columns than its own
  position needs could round apart, so token attention reads each token's own).

So, as the batch-invariant kernels of He et al. (2025) fix one configuration for every
batch size, a batch-invariant pass fixes the shapes (``Invariance``):

* linear layers run the decode rows in tiles of ``linear_tile`` rows, and the prefill
  rows in tiles of ``prefill_tile`` (padding the last), or, where a start-up probe finds
  the library's GEMM invariant from two rows on (``library_row_limit``), in calls of as
  many rows as it keeps so (all of them, or ``linear_rows``), a lone row padded to two
  unless a probe finds that layer shape computes a row alone as it does among others
  (``lone_shapes``), and the prefill rows then in calls of ``prefill_rows`` aligned to the prompt's
  positions where a probe finds a row past the limit depends only on its place and the
  call's count (``aligned_rows_invariant``);
* decode attention gives each token a call entry of its own, where a start-up probe finds
  that invariant (``token_attention``: the same query count in every call, whatever the
  row's width; a row's tokens reading as many columns share an entry where a third probe
  finds a query's output independent of its entry's query count, ``entry_tokens``), else
  pads each row's queries to a multiple of ``query_tile``; either way
  the columns read go to a multiple of ``column_tile``. Prefill attention runs each chunk
  in tiles of ``prefill_query_tile`` queries aligned to the prompt (``kv_cache``).

What this costs is measured by ``bench.bench_dtype --batch-invariant off on``; the tests
compare a token's logits bitwise across pass compositions.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

# Queries per attention block: the CPU kernel's own block for short query runs.
QUERY_TILE = 32
# Prompt positions a prefill attention call holds, aligned to the prompt's: its kernel still
# computes them in blocks of 32 queries, with fewer calls; 1,024 prompt tokens of the default
# model took 688 ms in tiles of 32, 621 in tiles of 128 (a chunk that ends inside a tile
# computes the whole tile, so larger tiles waste more where a busy batch cuts prompts).
PREFILL_QUERY_TILE = 128
# Columns an attention call reads, to a multiple of this many: a whole vector of the
# kernel's softmax (16 wide) holds every column a query sees, whatever else the call reads.
# Token attention reads each token's columns to the next multiple, and tokens reading as
# many share a call: coarser tiles read more hidden columns (up to 63 a token at 64) and
# make fewer calls, each of which costs ~35 us on a CPU however little it reads. 16 rows
# of one token at contexts 100 to 400 took 68.7 ms a pass at 16 (16 calls a layer), 61.3
# at 64 and 60.4 at 128; one row of 1 or 4 tokens the same at 16 and 64, 4-5% more at 256
# (int4 default model, 2 threads, AVX512-BF16).
COLUMN_TILE = 64
# Query heads per call entry of token attention, to a multiple of this many (the padding
# sees one column, its output dropped). With an odd count (SmolLM2: 3 query heads per key
# head) CPU flash attention's result for an entry depended on which thread computed it,
# rarely, by a bfloat16 step: on the default model's own inputs a token alone in its
# call (3 items on 2 threads) came out apart from the same token among others in 20 of
# 1,920 calls over 30 layers, 4 widths, 2-8 threads and 1-5 entries; with 4 queries in
# none. Random inputs never showed it (0 of 1,200 calls), which is why the probe below
# cannot be the only guard.
QUERY_MULTIPLE = 2
# Rows per GEMM call where the library's row results depend on the call's row count:
# decode passes are short (1 + drafts per sequence); prefill chunks are long, and reading
# the weights once per 64 prompt tokens keeps their cost near a single call's.
DECODE_LINEAR_TILE = 8
PREFILL_LINEAR_TILE = 64
# Prefill rows a call, aligned to the prompt's positions, where calls are limited and the
# library's rows past the limit depend only on their place and the call's count (oneDNN's
# bfloat16 on an AMX CPU): 256 prompt tokens' rows took 3.27 ms a layer in calls of 32,
# 1.63 in calls of 128 and 1.26 in one call (the default model, 2 threads); a chunk that
# starts or ends inside a tile computes the whole tile, so larger tiles waste more where a
# busy batch's prefill budget cuts prompts.
PREFILL_ALIGNED_ROWS = 128
# Row counts the start-up probes compare against two rows.
PROBED_ROWS = (3, 4, 5, 7, 8, 9, 13, 16, 17, 31, 33, 64, 100, 256)
# The library's GEMM is probed at every row count up to this many (a kernel may change at
# any count: oneDNN's on an AMX CPU at 33 rows), then at the PROBED_ROWS above it.
DENSE_ROWS = 64


@dataclass(frozen=True)
class Invariance:
    """The fixed shapes of a batch-invariant pass. ``linear_tile`` 0: the library's GEMM
    rows are invariant from two rows on, so a pass's rows go in one call (a lone row
    padded to two), or in calls of at most ``linear_rows`` where they are so only up to
    that many (0: any); else decode rows go in tiles of ``linear_tile`` and prefill rows
    in tiles of ``prefill_tile``."""

    linear_tile: int = DECODE_LINEAR_TILE
    prefill_tile: int = PREFILL_LINEAR_TILE
    query_tile: int = QUERY_TILE
    column_tile: int = COLUMN_TILE
    token_attention: bool = False  # decode attention one token per call entry (else query tiles)
    linear_rows: int = 0
    # Token attention: a row's tokens reading as many columns share a call entry, up to this
    # many (1: each token an entry of its own), where ``entry_tokens`` finds that invariant.
    entry_tokens: int = 1
    # Prefill rows, where calls are limited (``linear_rows``): in calls of exactly this many
    # rows aligned to the prompt's positions (tile t holds positions [t * n, (t + 1) * n),
    # the places no chunk fills zeros), where ``aligned_rows_invariant`` finds a row's result
    # depends on its place and the call's count only; 0: calls of ``linear_rows``.
    prefill_rows: int = 0
    prefill_query_tile: int = PREFILL_QUERY_TILE  # prefill attention's positions a call, aligned to the prompt's
    # Library calls of the linear layer shapes here ((out, in, dtype)) compute a lone row
    # alone: ``lone_linear_shapes`` finds the library gives it what it gives it among others.
    # Others pad it to two rows: a one-row call may take a matrix-vector kernel that sums
    # otherwise (bfloat16 with 1,536 inputs, on AVX-512 and AVX2 CPUs: 5 rows in 64).
    lone_shapes: frozenset[tuple[int, int, str]] = frozenset()

    def describe(self) -> str:
        if self.linear_tile:
            rows = f"tiles of {self.linear_tile} (prefill {self.prefill_tile})"
        else:
            rows = f"calls of 2 to {self.linear_rows} rows" if self.linear_rows else "one call, from two rows"
            if self.lone_shapes:
                rows += f" (from one for {len(self.lone_shapes)} shape{'s' * (len(self.lone_shapes) > 1)})"
            if self.prefill_rows:
                rows += f" (prefill {self.prefill_rows} aligned to the prompt)"
        if not self.token_attention:
            decode = f"queries in tiles of {self.query_tile}"
        elif self.entry_tokens > 1:
            decode = f"a call entry per token, or per up to {self.entry_tokens} of a row's tokens"
        else:
            decode = "a call entry per token"
        return (
            f"linear layers {rows}; decode attention {decode}, columns in tiles of {self.column_tile}; "
            f"prefill attention in tiles of {self.prefill_query_tile}"
        )


_thread = threading.local()


Chunks = tuple[tuple[int, int], ...]  # a pass's prefill chunks in order: (first position, tokens)


@dataclass(frozen=True)
class InvariantPass:
    """The pass a thread runs (``invariant_pass``): its shapes, its first ``decode`` rows
    decode rows, the rest its prefill ``chunks``' rows."""

    invariance: Invariance
    decode: int
    chunks: Chunks = ()


@contextlib.contextmanager
def invariant_pass(invariance: Invariance, decode_tokens: int, chunks: Chunks = ()) -> Iterator[None]:
    """Within it, this thread's linear layers run ``invariance``'s shapes; the pass's first
    ``decode_tokens`` rows are decode rows, the rest prefill rows of ``chunks``."""
    previous = getattr(_thread, "pass_", None)
    _thread.pass_ = InvariantPass(invariance, decode_tokens, chunks)
    try:
        yield
    finally:
        _thread.pass_ = previous


def current_pass() -> InvariantPass | None:
    return getattr(_thread, "pass_", None)


def invariant_linear(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pass_: InvariantPass) -> torch.Tensor:
    """F.linear(hidden, weight, bias) with each row computed by a call of fixed shape: the
    pass's decode rows as decode rows, the rest as prefill rows (``Invariance``)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    lone = (weight.shape[0], weight.shape[1], str(weight.dtype)) in pass_.invariance.lone_shapes
    out = invariant_rows(flat, lambda rows: F.linear(rows, weight, bias), pass_, lone=lone)
    return out.reshape(*hidden.shape[:-1], weight.shape[0])


Rows = Callable[[torch.Tensor], torch.Tensor]  # a linear layer's rows [n, in] -> [n, out]


def invariant_rows(flat: torch.Tensor, compute: Rows, pass_: InvariantPass, decode: int | None = None, lone: bool = False) -> torch.Tensor:
    """``compute`` (a linear layer's rows [n, in] -> [n, out]) over ``flat`` in calls of fixed
    shape: its first ``decode`` rows (the pass's) as decode rows, the rest as prefill rows
    (``Invariance``); a lone row computed alone where ``lone`` (``Invariance.lone_shapes``)."""
    invariance = pass_.invariance
    decode = min(pass_.decode if decode is None else decode, flat.shape[0])
    parts = []
    if decode:
        parts.append(_rows(flat[:decode], compute, invariance.linear_tile, invariance.linear_rows, lone))
    if decode < flat.shape[0]:
        prefill = flat[decode:]
        if invariance.linear_tile:
            parts.append(_rows(prefill, compute, invariance.prefill_tile))
        elif invariance.prefill_rows and sum(length for _, length in pass_.chunks) == prefill.shape[0]:
            parts.append(_aligned_rows(prefill, compute, invariance.prefill_rows, pass_.chunks))
        else:
            parts.append(_rows(prefill, compute, 0, invariance.linear_rows, lone))
    return torch.cat(parts) if len(parts) > 1 else parts[0] if parts else compute(flat)


def _aligned_rows(rows: torch.Tensor, compute: Rows, tile: int, chunks: Chunks) -> torch.Tensor:
    """Prefill ``rows`` (``chunks``' in order) in calls of exactly ``tile`` rows, tile t of a
    prompt holding its positions [t * tile, (t + 1) * tile), the places no chunk fills zeros:
    a position is computed at the same place of a call of the same count however its prompt
    was cut into chunks."""
    outputs, offset = [], 0
    for first, length in chunks:
        for start in range(first - first % tile, first + length, tile):
            low, high = max(start, first), min(start + tile, first + length)
            part = rows[offset + low - first : offset + high - first]
            if high - low == tile:
                outputs.append(compute(part))
                continue
            block = rows.new_zeros(tile, rows.shape[1])
            block[low - start : high - start] = part
            outputs.append(compute(block)[low - start : high - start])
        offset += length
    return torch.cat(outputs) if len(outputs) > 1 else outputs[0]


def _rows(rows: torch.Tensor, compute: Rows, tile: int, most: int = 0, lone: bool = False) -> torch.Tensor:
    count = rows.shape[0]
    if not tile:  # the library's rows are invariant from two on (up to ``most``, if not 0), or from one (``lone``)
        if most and count > most:
            return torch.cat([_rows(rows[start : start + most], compute, 0, 0, lone) for start in range(0, count, most)])
        return compute(torch.cat([rows, rows]))[:1] if count == 1 and not lone else compute(rows)
    padding = (-count) % tile
    if padding:
        rows = torch.cat([rows, rows.new_zeros(padding, rows.shape[1])])
    return torch.cat([compute(rows[start : start + tile]) for start in range(0, rows.shape[0], tile)])[:count]


def _in_calls_of(rows: torch.Tensor, compute: Rows, most: int) -> torch.Tensor:
    """``compute`` over ``rows`` (more than ``most``) in calls of ``most`` rows each; the rows
    past the last whole call come from a call of the last ``most`` rows."""
    count = rows.shape[0]
    parts = [compute(rows[start : start + most]) for start in range(0, count - most + 1, most)]
    done = len(parts) * most
    if done < count:
        parts.append(compute(rows[count - most :])[most - (count - done) :])
    return torch.cat(parts)


ProbedLayer = tuple[str, int, torch.dtype, torch.device, Rows]  # name, input features, dtype, device, its rows


def _probed_layers(model: nn.Module, generator: torch.Generator, kinds: tuple[str, ...]) -> list[ProbedLayer]:
    """What the linear-layer probes compute: each ``nn.Linear`` shape of ``model`` with a
    random weight (from ``generator``) in its dtype and device, then each shape of the layers
    of another form that probe themselves (one of each type and shape), through each of their
    ``kinds`` computations they have (``rows``: decode rows; ``prefill_rows``), once where two
    kinds are one computation (a laid-out output layer's prompt rows are its rows)."""
    layers: list[ProbedLayer] = []
    for (out_features, in_features), dtype, device in linear_shapes(model):
        weight = torch.randn(out_features, in_features, generator=generator).to(dtype=dtype, device=device)
        layers.append((f"{out_features} x {in_features} in {dtype}", in_features, dtype, device, partial(F.linear, weight=weight)))
    for module in {(type(module), module.out_features, module.in_features): module for module in other_layers(model)}.values():
        out_features, in_features = int(module.out_features), int(module.in_features)  # type: ignore[arg-type]
        computations: list[Rows] = []
        for kind in kinds:
            compute = getattr(module, kind, None)
            if compute is not None and compute not in computations:  # bound methods of one function compare equal
                computations.append(compute)
                name = f"{type(module).__name__} {out_features} x {in_features} ({kind})"
                layers.append((name, in_features, torch.bfloat16, torch.device("cpu"), compute))
    return layers


@torch.inference_mode()
def library_row_limit(model: nn.Module, most_rows: int = max(PROBED_ROWS)) -> int:
    """The most rows a call may have with every linear layer shape of ``model`` giving each
    of them bitwise what a call of two rows gives it, at every count from two up (probed
    at each count up to DENSE_ROWS, then at the PROBED_ROWS and ``most_rows`` above it):
    ``most_rows`` where every probed count keeps them, else the last count before the first
    that does not (2 where three rows do not). On random inputs in the model's dtype and
    device (the library, the CPU and the thread count decide). Layers of another form
    (int4: ``row_probe``) are probed through themselves."""
    generator = torch.Generator().manual_seed(0)
    layers = _probed_layers(model, generator, ("rows", "prefill_rows"))  # decode rows' computation, and prefill rows'
    dense = range(3, min(DENSE_ROWS, most_rows) + 1)
    counts = [*dense, *sorted({count for count in (*PROBED_ROWS, most_rows) if DENSE_ROWS < count <= most_rows})]
    limit = most_rows
    for name, in_features, dtype, device, compute in layers:
        inputs = torch.randn(max(counts, default=2), in_features, generator=generator).to(dtype=dtype, device=device)
        alone: dict[int, torch.Tensor] = {}

        def same(result: torch.Tensor, row: int) -> bool:
            if row not in alone:
                alone[row] = compute(inputs[[row, (row + 1) % len(inputs)]])[0]
            return torch.equal(result[row], alone[row])

        for count in counts:
            if count > limit:
                break
            result = compute(inputs[:count])
            # Every row: of a dense count against a call of two rows, of a larger one against
            # calls of DENSE_ROWS (themselves probed; a kernel may change at any count, and
            # only some rows round apart: oneDNN's laid-out bfloat16 from 150 rows, 1 in 12).
            if count <= DENSE_ROWS:
                kept = all(same(result, row) for row in range(count))
            else:
                kept = torch.equal(result, _in_calls_of(inputs[:count], compute, DENSE_ROWS))
            if not kept:
                limit = count - 1 if count <= DENSE_ROWS else min(limit, DENSE_ROWS)
                log.info("linear rows of %s depend on the call's row count (%d rows)", name, count)
                break
    return limit


@torch.inference_mode()
def aligned_rows_invariant(model: nn.Module, tile: int = PREFILL_ALIGNED_ROWS) -> bool:
    """Whether every prefill linear layer shape of ``model`` gives a row of a call of ``tile``
    rows the same bits whatever the call's other rows (random, or zeros), at its first,
    second, middle and last place: what ``Invariance.prefill_rows`` needs. On random inputs."""
    generator = torch.Generator().manual_seed(4)
    for name, in_features, dtype, device, compute in _probed_layers(model, generator, ("prefill_rows",)):
        inputs, others = (torch.randn(tile, in_features, generator=generator).to(dtype=dtype, device=device) for _ in range(2))
        result = compute(inputs)
        for place in sorted({0, 1, tile // 2, tile - 1}):
            for filling in (others.clone(), torch.zeros_like(others)):
                filling[place] = inputs[place]
                if not torch.equal(compute(filling)[place], result[place]):
                    log.info("linear rows of %s in a %d-row call depend on the call's other rows", name, tile)
                    return False
    return True


@torch.inference_mode()
def lone_linear_shapes(model: nn.Module, rows: int = DENSE_ROWS) -> frozenset[tuple[int, int, str]]:
    """The ``nn.Linear`` shapes of ``model`` ((out, in, dtype)) for which the library gives
    each of ``rows`` random rows computed alone bitwise what a call of two rows gives it.
    The rows are heavy-tailed, as a model's activations are, and many: a row sums apart
    only where its rounding crosses a bfloat16 step (5 rows in 64 for 576 x 1,536 on an
    AVX-512 CPU; 8 rows missed it as often as not)."""
    generator = torch.Generator().manual_seed(6)
    kept = set()
    for (out_features, in_features), dtype, device in linear_shapes(model):
        weight = torch.randn(out_features, in_features, generator=generator).to(dtype=dtype, device=device)
        scale = torch.exp(2 * torch.randn(rows, in_features, generator=generator))
        inputs = (torch.randn(rows, in_features, generator=generator) * scale).to(dtype=dtype, device=device)
        pair = [F.linear(inputs[[row, (row + 1) % rows]], weight)[0] for row in range(rows)]
        if all(torch.equal(F.linear(inputs[row : row + 1], weight)[0], pair[row]) for row in range(rows)):
            kept.add((out_features, in_features, str(dtype)))
        else:
            log.info(
                "a lone row of %d x %d in %s sums apart from the same row among others: padded to two", out_features, in_features, dtype
            )
    return frozenset(kept)


@torch.inference_mode()
def lone_row_invariant(module: nn.Module, rows: tuple[int, ...] = PROBED_ROWS) -> bool:
    """Whether a layer that probes itself (``row_probe``, with ``rows``) gives a row computed
    alone bitwise what it gives that row in a call of each count of ``rows``, on random inputs."""
    generator = torch.Generator().manual_seed(2)
    compute = cast(Rows, module.rows)
    inputs = torch.randn(max(rows), int(module.in_features), generator=generator).to(torch.bfloat16)  # type: ignore[arg-type]
    # Every row: a kernel may round only some rows apart at a count.
    alone = torch.cat([compute(inputs[row : row + 1]) for row in range(max(rows))])
    return all(torch.equal(compute(inputs[:count]), alone[:count]) for count in rows)


def linear_shapes(model: nn.Module) -> list[tuple[tuple[int, ...], torch.dtype, torch.device]]:
    shapes = {
        (tuple(module.weight.shape), module.weight.dtype, module.weight.device)
        for module in model.modules()
        if isinstance(module, nn.Linear)
    }
    return sorted(shapes, key=str)


def other_layers(model: nn.Module) -> list[nn.Module]:
    """Linear layers of another form than ``nn.Linear`` that probe themselves (``row_probe``)."""
    return [module for module in model.modules() if getattr(module, "row_probe", False)]


@torch.inference_mode()
def tokens_attention_invariant(dtype: torch.dtype, device: torch.device, kv_heads: int, groups: int, head_dim: int) -> bool:
    """Whether attention gives a token's query heads bitwise the same output as a call entry
    of their own (``kv_cache._token_attention``) whatever the other entries of the call (its
    row's other tokens, or other rows' tokens reading other cached rows) and however many
    hidden columns past a whole COLUMN_TILE it reads, on random inputs."""
    generator = torch.Generator().manual_seed(1)

    def random(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=generator)).to(dtype=dtype, device=device)

    keys, values = random(1, kv_heads, 400, head_dim, scale=3.0), random(1, kv_heads, 400, head_dim)
    token = random(kv_heads, groups, head_dim, scale=2.0)

    def attend(visible: int, columns: int, entries: int, at: int, shared: bool) -> torch.Tensor:
        """The token's output as entry ``at`` of a call of ``entries``, all reading the same
        cached row (a stride-0 view: a row's own tokens) or each its own (the rows of a batch)."""
        queries = random(entries, kv_heads, groups, head_dim, scale=2.0)
        queries[at] = token
        mask = torch.zeros(entries, 1, groups, columns, dtype=torch.bool, device=device)
        mask[..., :visible] = True
        if shared:
            expand = (entries, -1, -1, -1)
            entry_keys, entry_values = keys[..., :columns, :].expand(*expand), values[..., :columns, :].expand(*expand)
        else:
            entry_keys, entry_values = random(entries, kv_heads, 400, head_dim, scale=3.0), random(entries, kv_heads, 400, head_dim)
            entry_keys[at], entry_values[at] = keys[0], values[0]
            entry_keys, entry_values = entry_keys[..., :columns, :], entry_values[..., :columns, :]
        return F.scaled_dot_product_attention(queries, entry_keys, entry_values, attn_mask=mask)[at]

    for visible in (5, 38, 100, 300):
        least = visible + (-visible) % COLUMN_TILE
        alone = attend(visible, least, 1, 0, True)
        calls = ((least + COLUMN_TILE, 1, 0), (least, 4, 2), (least + 33, 9, 8), (400, 17, 0))
        for columns, entries, at, shared in [(*call, shared) for call in calls for shared in (True, False)]:
            if not torch.equal(alone, attend(visible, columns, entries, at, shared)):
                log.info("attention of one token per call entry depends on the call (%d visible columns)", visible)
                return False
    return True


@torch.inference_mode()
def entry_tokens(dtype: torch.dtype, device: torch.device, kv_heads: int, groups: int, head_dim: int) -> int:
    """How many of a row's tokens may share a call entry of token attention (their ``groups``
    query heads each, padded to a multiple of QUERY_MULTIPLE, head by head, all reading the
    same columns; ``kv_cache._shared_entries``) with each token's output bitwise what an
    entry of its own gives it: the most, up to one query tile, such that every count from two
    up keeps a token's output at its first, middle and last place, on random inputs; 1 where
    two tokens do not."""
    generator = torch.Generator().manual_seed(3)
    padded = groups + (-groups) % QUERY_MULTIPLE
    most = max(1, QUERY_TILE // padded)

    def random(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=generator)).to(dtype=dtype, device=device)

    keys, values = random(1, kv_heads, 1100, head_dim, scale=3.0), random(1, kv_heads, 1100, head_dim)
    for columns in (64, 128, 512, 576, 1088):
        tokens = random(kv_heads, padded, most, head_dim, scale=2.0)
        # Each token sees a different count of the last tile's columns, as a row's tokens do.
        visible = [columns - COLUMN_TILE + 1 + (index * 7) % COLUMN_TILE for index in range(most)]
        mask = torch.full((padded, most, columns), float("-inf"), dtype=dtype, device=device)
        for index, count in enumerate(visible):
            mask[:, index, :count] = 0
        mask[groups:, :, 1:] = float("-inf")  # padding heads see column 0 only

        def attend(low: int, high: int) -> torch.Tensor:
            attended = F.scaled_dot_product_attention(
                tokens[:, :, low:high].reshape(1, kv_heads, -1, head_dim),
                keys[..., :columns, :],
                values[..., :columns, :],
                attn_mask=mask[:, low:high].reshape(1, 1, -1, columns),
            )
            return attended[0].view(kv_heads, padded, high - low, head_dim)[:, :groups]

        alone = [attend(index, index + 1)[:, :, 0] for index in range(most)]
        for count in range(2, most + 1):
            together = attend(0, count)
            if not all(torch.equal(together[:, :, place], alone[place]) for place in {0, count // 2, count - 1}):
                log.info("a query's attention depends on its call entry's query count (%d tokens, %d columns)", count, columns)
                return count - 1
    return most


def choose_invariance(model: nn.Module, most_rows: int = max(PROBED_ROWS)) -> Invariance:
    """The cheapest fixed shapes this machine keeps a row's result under: one call per pass
    where the library's GEMM rows are invariant up to ``most_rows`` (the largest pass; probed
    once per process for each set of shapes, size and thread count), calls of as many rows
    as they are invariant up to where that is at least a tile, tiles otherwise."""
    shapes = (*linear_shapes(model), *sorted({(type(m).__name__, m.out_features, m.in_features) for m in other_layers(model)}))
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", 1)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or getattr(config, "hidden_size", 64) // heads
    parameter = next(model.parameters())
    key = (shapes, most_rows, torch.get_num_threads())
    if key not in _row_limits:
        _row_limits[key] = library_row_limit(model, most_rows)
    attention = ("attention", parameter.dtype, parameter.device, kv_heads, heads // kv_heads, head_dim, torch.get_num_threads())
    if attention not in _probed:
        _probed[attention] = tokens_attention_invariant(parameter.dtype, parameter.device, kv_heads, heads // kv_heads, head_dim)
    if _probed[attention] and attention not in _entry_tokens:  # only token attention shares entries
        _entry_tokens[attention] = entry_tokens(parameter.dtype, parameter.device, kv_heads, heads // kv_heads, head_dim)
    shared = _entry_tokens[attention] if _probed[attention] else 1
    for module in other_layers(model):  # layers whose rows need no fixed shapes at all
        lone = ("lone row", type(module).__name__, module.out_features, module.in_features, torch.get_num_threads())
        if lone not in _probed:
            _probed[lone] = lone_row_invariant(module)
        setattr(module, "any_rows", _probed[lone])  # noqa: B010 (a module attribute the probe sets)
    limit = _row_limits[key]
    if limit >= DECODE_LINEAR_TILE:  # the library's own calls: one a pass, or of up to ``limit`` rows
        rows = 0 if limit >= most_rows else limit
        prefill = 0
        if rows and rows < PREFILL_ALIGNED_ROWS <= most_rows:
            aligned = ("aligned", key)
            if aligned not in _probed:
                _probed[aligned] = aligned_rows_invariant(model)
            prefill = PREFILL_ALIGNED_ROWS if _probed[aligned] else 0
        if key not in _lone_shapes:
            _lone_shapes[key] = lone_linear_shapes(model)
        invariance = Invariance(
            linear_tile=0,
            linear_rows=rows,
            token_attention=_probed[attention],
            entry_tokens=shared,
            prefill_rows=prefill,
            lone_shapes=_lone_shapes[key],
        )
    else:
        invariance = Invariance(linear_tile=DECODE_LINEAR_TILE, token_attention=_probed[attention], entry_tokens=shared)
    log.info("batch-invariant shapes: %s", invariance.describe())
    return invariance


_row_limits: dict[tuple, int] = {}  # (linear shapes, most rows, threads) -> library_row_limit
_probed: dict[tuple, bool] = {}  # attention and lone-row probes -> whether invariant
_lone_shapes: dict[tuple, frozenset] = {}  # (linear shapes, most rows, threads) -> lone_linear_shapes
_entry_tokens: dict[tuple, int] = {}  # attention -> entry_tokens
