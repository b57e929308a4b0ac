"""Weight-only int4 and int8: linear layers held as integers, computed by PyTorch's CPU kernels
(int8 at the end of this module).

int4: each weight row is cut along its inputs into groups of ``GROUP`` (32); a group holds its
values as integers q in [0, 15] with one scale and one zero, w = (q - 8) * scale + zero,
and ``torch.ops.aten._weight_int4pack_mm_for_cpu`` multiplies bfloat16 activations by the
packed integers, reading a quarter of bfloat16's weight bytes.

The default model's GGUF stores its linear layers as Q4_1: groups of 32 with w = d * q + m
(float16 d and m, q in [0, 15]). Loading dequantizes them; ``quantize`` finds the same q
again (m is a group's least value and d * 15 its range, as Q4_1's quantizer sets them), so
the integers are exactly the file's, and only the scale and zero move: the kernel wants
them in bfloat16, which rounds scale and zero by up to 2^-8 of their size (``error_bound``). A
weight that did not come from 4 bits is quantized, with the error of 4 bits.

The output layer keeps its form (the GGUF's is 8-bit), and so do layers whose sizes the
kernel does not take (inputs a multiple of 32, outputs of 16).

The kernel is fast for a few rows and slow for many (it unpacks the weight again for every
four), so in the engine's batch-invariant passes prompt chunks run on a bfloat16 copy of
each weight instead (``Int4Linear``): bfloat16's weight bytes beside the int4 ones in memory
(212 MB for the default model), for prompts read 1.5-1.9 times as fast at 256 tokens. The
copy is laid out once for oneDNN where it runs so (``packed_linear``): 1,024 prompt tokens
of the default model took 603 ms with a plain copy, 526 laid out (2-core AMX CPU).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from verifier_service.core.invariance import PROBED_ROWS, current_pass, invariant_rows
from verifier_service.core.packed_linear import LaidOut, linear_laid_out, packed_supported

log = logging.getLogger(__name__)

GROUP = 32  # inputs per scale and zero
LEVELS = 15  # the largest integer of 4 bits
OUTPUTS_MULTIPLE = 16  # the kernel packs outputs in blocks of this many


def _no_kernel(*args: object) -> torch.Tensor:
    raise RuntimeError("this torch build has no int4 CPU kernel (aten._weight_int4pack_mm_for_cpu)")


# The kernel's overload, looked up once: a lookup per call costs a tenth of a small layer's product.
_KERNEL = getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None)
_int4_mm: Callable[..., torch.Tensor] = _KERNEL.default if _KERNEL is not None else _no_kernel


class WeightOnlyLinear(nn.Module):
    """An ``nn.Linear`` whose weight is held as integers and multiplied by a CPU kernel with
    bfloat16 activations (``rows``), with a bfloat16 copy of the weight it stands for, for
    prompt rows (``prefill_rows``).

    In a batch-invariant pass (``invariance``) the decode rows go through the kernel and the
    prefill rows through the copy: the kernels are fast for a few rows and slow for many
    (the int4 one unpacks the weight again for every four rows, so a 64-token prompt chunk
    cost 2.4 times what the bfloat16 GEMM costs: a 1,536 x 576 layer, 767 against 319 us on
    a 2-core AVX512-BF16 CPU), while up to four rows they are the faster. A position is
    always computed by one of the two (a prompt token by prefill, a generated one by
    decode), so the two never meet in one token's logits; the copy costs bfloat16's bytes
    beside the integers, and is held laid out for oneDNN (``laid_out``, ``dense`` None)
    where that runs here (``packed_linear``)."""

    row_probe = True  # the batch-invariance probe runs this module itself (``invariance``)
    # A row comes out the same at any row count, alone included, so a batch-invariant pass
    # calls it as it comes: set by the start-up probe (``invariance.lone_row_invariant``).
    any_rows = False
    in_features: int
    out_features: int
    bias: torch.Tensor | None
    dense: torch.Tensor | None
    laid_out: LaidOut | None
    # A part of a joined layer that holds no copy of its own: (the joined layer, its outputs' slice).
    within: tuple[Int4Linear, int, int]

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)

    def rows(self, flat: torch.Tensor) -> torch.Tensor:
        """[rows, in_features] -> [rows, out_features], in bfloat16, by the kernel."""
        out = self._product(flat.to(torch.bfloat16).contiguous())
        return out if self.bias is None else out + self.bias

    def _product(self, flat: torch.Tensor) -> torch.Tensor:
        """The kernel's product of ``flat`` [rows, in_features] (bfloat16, contiguous) and the weight."""
        raise NotImplementedError

    def _keep_copy(self, dense: torch.Tensor) -> None:
        """Hold ``dense`` as this layer's bfloat16 copy: laid out (``laid_out``, with ``dense``
        None) where laid-out layers run here, else as it is."""
        self.laid_out = LaidOut(dense) if packed_supported(dense.device) else None
        self.register_buffer("dense", None if self.laid_out is not None else dense, persistent=False)

    def copy_weight(self) -> torch.Tensor:
        """The bfloat16 copy [out, in] as a plain tensor."""
        if self.laid_out is not None:
            return self.laid_out.to_dense()
        if self.dense is None:
            joined, start, stop = self.within
            return joined.copy_weight()[start:stop]
        return self.dense

    def prefill_rows(self, flat: torch.Tensor) -> torch.Tensor:
        """[rows, in_features] -> [rows, out_features], in bfloat16, by the bfloat16 GEMM."""
        if self.laid_out is not None:
            return linear_laid_out(flat, self.laid_out, self.bias)
        if self.dense is None:  # a part of a joined layer whose laid-out copy computes its prompt rows
            joined, start, stop = self.within
            return joined.prefill_rows(flat)[:, start:stop]
        return F.linear(flat.to(torch.bfloat16), self.dense, self.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, self.in_features)
        invariant = current_pass()
        if invariant is None or (self.any_rows and invariant.decode >= flat.shape[0]):
            out = self.rows(flat)  # outside the engine's passes, or decode rows only that need no fixed shape
        else:
            decode = min(invariant.decode, flat.shape[0])
            parts = []
            if decode:
                head = flat[:decode]
                parts.append(self.rows(head) if self.any_rows else invariant_rows(head, self.rows, invariant))
            if decode < flat.shape[0]:
                parts.append(invariant_rows(flat[decode:], self.prefill_rows, invariant, decode=0))
            out = torch.cat(parts) if len(parts) > 1 else parts[0]
        return out.reshape(*hidden.shape[:-1], self.out_features)


class Int4Linear(WeightOnlyLinear):
    """An ``nn.Linear`` whose weight is int4 in groups of GROUP inputs (``quantize``), computed
    by ``_weight_int4pack_mm_for_cpu`` (``WeightOnlyLinear``). Its bfloat16 copy holds the
    same integers, scales and zeros, rounded to bfloat16."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        integers, scales, zeros = quantize(linear.weight.detach())
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(integers, 1))
        # [groups, outputs, (scale, zero)], as the kernel reads them.
        self.register_buffer("scales_and_zeros", torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16))
        # The weight the kernel computes with, rounded to bfloat16, for prompt chunks: laid out
        # for oneDNN where it runs so (``packed_linear``), else as a tensor.
        self._keep_copy(rebuilt(integers, scales.to(torch.bfloat16), zeros.to(torch.bfloat16)).to(torch.bfloat16))

    def _product(self, flat: torch.Tensor) -> torch.Tensor:
        return _int4_mm(flat, self.packed, GROUP, self.scales_and_zeros)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {GROUP}"


class JoinedInt4Linear(Int4Linear):
    """Int4 layers that read the same input computed as one (``join``): their outputs side
    by side, from one kernel call instead of one each. The parts' weights become views of
    the joined ones, so joining costs no memory."""

    def __init__(self, parts: Sequence[Int4Linear]) -> None:
        nn.Module.__init__(self)  # not Int4Linear's: the parts' integers as they are, not quantized again
        self.in_features, self.out_features = parts[0].in_features, sum(part.out_features for part in parts)
        self.splits = [part.out_features for part in parts]
        self.parts = list(parts)  # a list, not submodules: the model holds them
        self.register_buffer("packed", torch.cat([part.packed for part in parts]))
        self.register_buffer("scales_and_zeros", torch.cat([part.scales_and_zeros for part in parts], dim=1))
        biases = [part.bias for part in parts]
        self.bias = None if biases[0] is None else torch.cat(cast(list[torch.Tensor], biases))
        self._keep_copy(torch.cat([part.copy_weight() for part in parts]))
        # Prompt rows computed part by part: the joined bfloat16 GEMM rounds apart from the
        # parts' at some row count (oneDNN on an AMX CPU, the q/k/v sizes at 256 rows).
        self.prefill_apart = False

    def copy_weight(self) -> torch.Tensor:
        if self.laid_out is None and self.dense is None:  # the parts hold the copies (``share``)
            return torch.cat([part.copy_weight() for part in self.parts])
        return super().copy_weight()

    def prefill_rows(self, flat: torch.Tensor) -> torch.Tensor:
        if self.prefill_apart:
            return torch.cat([part.prefill_rows(flat) for part in self.parts], dim=-1)
        return super().prefill_rows(flat)

    @property  # type: ignore[override]
    def any_rows(self) -> bool:  # set on the parts by the start-up probe
        return all(part.any_rows for part in self.parts)

    def share(self) -> None:
        """Make the parts' integers and bfloat16 copies views of the joined ones. Laid-out
        copies have no views: the ones that compute prompt rows are kept (the parts' where
        ``prefill_apart``, else the joined one, whose outputs a part then takes its slice of:
        the same bits, ``join`` checked), the others dropped."""
        start = 0
        for part in self.parts:
            stop = start + part.out_features
            part.packed = self.packed[start:stop]
            if self.dense is not None:
                part.dense = self.dense[start:stop]
            elif not self.prefill_apart:
                part.laid_out, part.within = None, (self, start, stop)
            start = stop
        if self.laid_out is not None and self.prefill_apart:
            self.laid_out = None


def join(parts: Sequence[nn.Module]) -> JoinedInt4Linear | None:
    """``parts`` (linear layers of one input) as one ``JoinedInt4Linear``, or None unless they
    are all ``Int4Linear`` with biases alike and the joined layer computes each part's
    outputs bitwise as the part does by the int4 kernel at every row count a pass may give
    it (``invariance.PROBED_ROWS``; checked once for each set of sizes); prompt rows are
    computed joined where the bfloat16 GEMM is exact that way too, else part by part."""
    if len(parts) < 2 or any(type(part) is not Int4Linear for part in parts):
        return None
    layers = cast(list[Int4Linear], list(parts))
    if len({layer.in_features for layer in layers}) > 1 or len({layer.bias is None for layer in layers}) > 1:
        return None
    joined = JoinedInt4Linear(layers)
    key = (joined.in_features, tuple(joined.splits), layers[0].bias is None, torch.get_num_threads())
    if key not in _joins_exact:
        _joins_exact[key] = (_computes_as_parts(joined, "rows"), _computes_as_parts(joined, "prefill_rows"))
        if not all(_joins_exact[key]):
            computed = "are computed apart" if not _joins_exact[key][0] else "are computed apart for prompts"
            log.info("int4 layers of %s outputs %s: joined, they round differently", joined.splits, computed)
    rows_exact, prefill_exact = _joins_exact[key]
    if not rows_exact:
        return None
    joined.prefill_apart = not prefill_exact
    joined.share()
    return joined


_joins_exact: dict[tuple, tuple[bool, bool]] = {}  # -> (int4 rows joined exact, prompt rows joined exact)


@torch.inference_mode()
def _computes_as_parts(joined: JoinedInt4Linear, kind: str) -> bool:
    """Whether ``joined``'s ``kind`` computation (``rows``, ``prefill_rows``) gives each part's
    outputs bitwise at every row count probed."""
    generator = torch.Generator().manual_seed(3)
    inputs = torch.randn(max(PROBED_ROWS), joined.in_features, generator=generator).to(torch.bfloat16)
    for count in (1, 2, *PROBED_ROWS):
        rows = inputs[:count]
        apart = torch.cat([getattr(part, kind)(rows) for part in joined.parts], dim=-1)
        if not torch.equal(getattr(joined, kind)(rows), apart):
            return False
    return True


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(integers [out, in] int32 in [0, 15], scales [out, groups], zeros [out, groups]) with
    weight ~ (integers - 8) * scale + zero per group of GROUP inputs, in float32.

    A group from Q4_1 (d = 0.5, m = -1: values -1, -0.5, ..., 6.5) gives back its integers
    0..15, scale 0.5 and zero m + 8 d = 3."""
    outputs, inputs = weight.shape
    groups = weight.float().reshape(outputs, inputs // GROUP, GROUP)
    least, most = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((most - least) / LEVELS).clamp(min=torch.finfo(torch.float32).tiny)
    integers = ((groups - least[..., None]) / scales[..., None]).round().clamp(0, LEVELS).to(torch.int32)
    return integers.reshape(outputs, inputs), scales, least + 8 * scales


def rebuilt(integers: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The weight [out, in] that ``quantize``'s integers, scales and zeros stand for, in float32."""
    outputs, inputs = integers.shape
    return ((integers.reshape(outputs, -1, GROUP) - 8) * scales[..., None].float() + zeros[..., None].float()).reshape(outputs, inputs)


def stored(weight: torch.Tensor) -> torch.Tensor:
    """The weight [out, in] an ``Int4Linear`` of ``weight`` computes with: its integers, and
    its scales and zeros as the kernel holds them (bfloat16), in float32."""
    integers, scales, zeros = quantize(weight)
    return rebuilt(integers, scales.to(torch.bfloat16), zeros.to(torch.bfloat16))


def error_bound(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The most a weight of each group moves when its scale and zero (``quantize``) are
    stored in bfloat16, as the kernel wants them: each rounds by at most 2^-8 of itself
    (8 significant bits), and w = (q - 8) scale + zero has |q - 8| <= 8."""
    return (8 * scales.abs() + zeros.abs()) * 2.0**-8


def int4_supported(device: torch.device) -> bool:
    """Whether int4 weights run on ``device``: a CPU whose torch has the kernel and computes with it."""
    if device.type != "cpu" or not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return False
    try:
        linear = Int4Linear(nn.Linear(GROUP, OUTPUTS_MULTIPLE, bias=False))
        return bool(torch.isfinite(linear.rows(torch.ones(1, GROUP))).all())
    except RuntimeError:  # a build without the kernel's CPU implementation
        return False


def use_int4_weights(model: nn.Module) -> int:
    """Replace ``model``'s linear layers (not its output layer) by ``Int4Linear`` where the
    kernel takes their sizes; returns how many. CPU only."""
    return use_quantized_weights(
        model, Int4Linear, lambda linear: linear.in_features % GROUP == 0 and linear.out_features % OUTPUTS_MULTIPLE == 0, "int4"
    )


def use_quantized_weights(model: nn.Module, layer: type[WeightOnlyLinear], takes: Callable[[nn.Linear], bool], name: str) -> int:
    """Replace ``model``'s linear layers (not its output layer) that ``takes`` by ``layer``
    (``name``: int4, int8); returns how many. CPU only."""
    if next(model.parameters()).device.type != "cpu":
        raise ValueError(f"{name} weights run on the CPU kernel; on a GPU use --weights float")
    output = model.get_output_embeddings() if isinstance(model, PreTrainedModel) else None
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child is not output and takes(child):
                setattr(parent, name, layer(child))
                replaced += 1
    return replaced


def weights_form(model: nn.Module) -> str:
    """ "int4" or "int8" when some linear layer is, else "float" (the model's dtype)."""
    for module in model.modules():
        if isinstance(module, Int4Linear):
            return "int4"
        if isinstance(module, Int8Linear):
            return "int8"
    return "float"


# -- int8 -------------------------------------------------------------------------------
#
# Weight-only int8 with one scale per output, w = q * scale with q in [-127, 127], computed
# by ``torch.ops.aten._weight_int8pack_mm`` (PyTorch's own CPU kernel) with bfloat16
# activations: half bfloat16's weight bytes, and for a model not shipped in 4 bits far
# closer to its weights than int4 (an error of at most half a scale, 1/254 of a row's
# largest weight). There is no library kernel for int8 in blocks of 32, as GGUF's Q8_0
# holds them, so a Q8_0 tensor is quantized again per output (as any float weight is).
# The kernel multiplies every row in turn (a 1,536 x 576 layer on a 2-core AMX CPU: 26 us
# for one row, 223 for 16, 898 for 64, against 30, 37 and 70 for the bfloat16 GEMM), so
# prompts run on a bfloat16 copy as with int4 (``WeightOnlyLinear``), and the form is
# served only when named (``--weights int8``): the start-up choice never weighs it.
#
# The kernel reads its inputs in vectors: on an AVX512 CPU 24 inputs gave wrong products
# and 33 crashed the process, so only layers of a multiple of GROUP inputs are converted,
# and each size is checked against a float product first (``_int8_computes``).

INT8_LEVEL = 127  # the largest integer magnitude


def _no_int8_kernel(*args: object) -> torch.Tensor:
    raise RuntimeError("this torch build has no int8 CPU kernel (aten._weight_int8pack_mm)")


_INT8_KERNEL = getattr(torch.ops.aten, "_weight_int8pack_mm", None)
_int8_mm: Callable[..., torch.Tensor] = _INT8_KERNEL.default if _INT8_KERNEL is not None else _no_int8_kernel


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(integers [out, in] int8 in [-127, 127], scales [out] bfloat16) with weight ~ integers
    * scale per output, off by at most half a scale: each scale is the row's largest
    magnitude over 127, rounded to bfloat16 first, so the integers are chosen for the scale
    the kernel computes with.

    A row [-1, 0.5, 0.25] gives scale 1/127 (in bfloat16) and integers [-127, 64, 32]."""
    weight = weight.detach().float()
    scales = (weight.abs().amax(dim=1) / INT8_LEVEL).clamp(min=torch.finfo(torch.bfloat16).tiny).to(torch.bfloat16)
    integers = (weight / scales.float()[:, None]).round().clamp(-INT8_LEVEL, INT8_LEVEL).to(torch.int8)
    return integers, scales


class Int8Linear(WeightOnlyLinear):
    """An ``nn.Linear`` whose weight is int8 with a scale per output (``quantize_int8``),
    computed by ``_weight_int8pack_mm`` (``WeightOnlyLinear``). Its bfloat16 copy holds the
    same integers times their scales, rounded to bfloat16."""

    integers: torch.Tensor
    scales: torch.Tensor

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        integers, scales = quantize_int8(linear.weight)
        self.register_buffer("integers", integers)
        self.register_buffer("scales", scales)
        self._keep_copy((integers.float() * scales.float()[:, None]).to(torch.bfloat16))

    def _product(self, flat: torch.Tensor) -> torch.Tensor:
        return _int8_mm(flat, self.integers, self.scales)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 a scale per output"


_int8_sizes: dict[tuple[int, int], bool] = {}  # (out, in) -> the kernel's product is right


@torch.inference_mode()
def _int8_computes(outputs: int, inputs: int) -> bool:
    """Whether the int8 kernel multiplies a layer of these sizes right (within bfloat16's
    rounding of a float32 product), on random integers; checked once per size."""
    key = (outputs, inputs)
    if key not in _int8_sizes:
        generator = torch.Generator().manual_seed(4)
        integers = torch.randint(-INT8_LEVEL, INT8_LEVEL + 1, (outputs, inputs), generator=generator, dtype=torch.int8)
        scales = torch.rand(outputs, generator=generator).add(0.5).to(torch.bfloat16)
        rows = torch.randn(3, inputs, generator=generator).to(torch.bfloat16)
        expected = rows.float() @ (integers.float() * scales.float()[:, None]).t()
        got = _int8_mm(rows, integers, scales).float()
        _int8_sizes[key] = bool(torch.allclose(got, expected, rtol=2e-2, atol=2e-2 * float(expected.abs().max())))
    return _int8_sizes[key]


def int8_supported(device: torch.device) -> bool:
    """Whether int8 weights run on ``device``: a CPU whose torch has the kernel and computes right with it."""
    if device.type != "cpu" or _INT8_KERNEL is None:
        return False
    try:
        return _int8_computes(OUTPUTS_MULTIPLE, GROUP)
    except RuntimeError:  # a build without the kernel's CPU implementation
        return False


def use_int8_weights(model: nn.Module) -> int:
    """Replace ``model``'s linear layers (not its output layer) by ``Int8Linear`` where the
    kernel takes their sizes; returns how many. CPU only."""
    return use_quantized_weights(
        model,
        Int8Linear,
        lambda linear: linear.in_features % GROUP == 0 and _int8_computes(linear.out_features, linear.in_features),
        "int8",
    )
