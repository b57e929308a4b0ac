"""Linear layers in bfloat16 on a CPU, their weight held in oneDNN's own blocked layout.

``F.linear`` in bfloat16 on a CPU hands the weight to oneDNN as it is, and oneDNN copies it
into its blocked layout on every call before it multiplies: for the default model's output
layer (49,152 x 576, 56 MB) that copy is most of the call. A ``LaidOut`` weight is laid out
once, when the model takes its form, and computed by oneDNN's linear on the laid-out weight
(``torch.ops.mkldnn._reorder_linear_weight`` and ``_linear_pointwise``, the pair PyTorch's
own compiler uses for frozen CPU linear layers). One row of the default model's output
layer took 3.7 ms by ``F.linear`` and 1.6 ms laid out (2-core AMX CPU, two threads); 16
rows 4.4 and 2.3 ms.

Two places use it: the output layer of a bfloat16 form (``PackedLinear``: read once a pass
at every size of pass, where the copy costs most; laid out only where a start-up timing finds
it faster than ``F.linear`` on this machine, ``laid_out_pays``), and the bfloat16 copies int4 layers
compute prompt rows with (``weights.Int4Linear``). Their rows are probed as the other
layers' are (``row_probe``), every row of every count: on an AMX CPU the laid-out kernel
gives a row the same bits at any count up to 149 rows, then rounds about one row in twelve
of a 1,536-input layer apart, so calls stay within what the probe finds.
"""

from __future__ import annotations

import functools
import logging
import math
import time

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from verifier_service.core.invariance import current_pass, invariant_rows

log = logging.getLogger(__name__)


class LaidOut:
    """A weight [out, in] laid out for oneDNN's linear layer (an opaque tensor, ``tensor``).
    A copy lays the plain weight out again: an opaque tensor has no storage to copy."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)

    def to_dense(self) -> torch.Tensor:
        """The weight as a plain tensor, bitwise the one laid out."""
        return self.tensor.to_dense()

    def __deepcopy__(self, memo: dict) -> LaidOut:
        return LaidOut(self.to_dense())


def linear_laid_out(flat: torch.Tensor, weight: LaidOut, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(flat [rows, in], weight, bias) in bfloat16."""
    bias = None if bias is None else bias.detach()
    return torch.ops.mkldnn._linear_pointwise(flat.to(torch.bfloat16).contiguous(), weight.tensor, bias, "none", [], "")


class PackedLinear(nn.Module):
    """An ``nn.Linear`` in bfloat16 on the CPU computed from its weight laid out once for
    oneDNN. ``weight`` stays the layer's own (tied to the input embeddings where the
    model ties them); the laid-out copy beside it costs the weight's bytes again."""

    row_probe = True  # the batch-invariance probe runs this module itself (``invariance``)
    # A row comes out the same at any row count, alone included: set by the start-up probe.
    any_rows = False

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.packed = LaidOut(self.weight)

    def rows(self, flat: torch.Tensor) -> torch.Tensor:
        """[rows, in_features] -> [rows, out_features], in bfloat16."""
        return linear_laid_out(flat, self.packed, self.bias)

    prefill_rows = rows  # prompt rows are computed as any other (the probe checks both names)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, self.in_features)
        invariant = current_pass()
        if invariant is None or self.any_rows:
            out = self.rows(flat)
        else:
            out = invariant_rows(flat, self.rows, invariant)
        return out.reshape(*hidden.shape[:-1], self.out_features)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        """A move or cast lays the weight out again (the laid-out copy is no parameter)."""
        super()._apply(fn, recurse)
        if self.weight.dtype != torch.bfloat16 or self.weight.device.type != "cpu":
            raise ValueError("a PackedLinear computes in bfloat16 on the CPU; convert the model before laying it out")
        self.packed = LaidOut(self.weight)
        return self

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, laid out for oneDNN"


def packed_supported(device: torch.device) -> bool:
    """Whether a laid-out bfloat16 linear layer runs on ``device``: a CPU whose torch has
    oneDNN with bfloat16, and computes the ops' result as ``F.linear`` does within bfloat16.
    Checked once a process."""
    return device.type == "cpu" and _runs_on_cpu()


@functools.cache
def _runs_on_cpu() -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
        generator = torch.Generator().manual_seed(5)
        linear = nn.Linear(64, 32, bias=True).to(torch.bfloat16)
        inputs = torch.randn(3, 64, generator=generator).to(torch.bfloat16)
        with torch.inference_mode():
            got, expected = PackedLinear(linear).rows(inputs).float(), F.linear(inputs, linear.weight, linear.bias).float()
        return bool(torch.allclose(got, expected, rtol=2**-6, atol=2**-6))
    except (AttributeError, RuntimeError) as error:  # a build without the ops, or without their CPU kernels
        log.info("oneDNN's laid-out linear layers are not available: %s", error)
        return False


def use_packed_output(model: PreTrainedModel, measure: bool = True) -> bool:
    """Make ``model``'s output layer a ``PackedLinear`` where it is a bfloat16 ``nn.Linear`` on
    a CPU that runs one and (``measure``) its calls are faster laid out here (``laid_out_pays``);
    whether it did."""
    output = model.get_output_embeddings()
    if not isinstance(output, nn.Linear) or output.weight.dtype != torch.bfloat16 or not packed_supported(output.weight.device):
        return False
    packed = PackedLinear(output)
    if measure and not laid_out_pays(output, packed):
        return False
    model.set_output_embeddings(packed)
    return True


# Row counts the two ways of computing a layer are timed at: one stream's pass, a batch's.
LAYOUT_ROWS = (1, 16)
LAYOUT_REPEATS = 5


def laid_out_pays(linear: nn.Linear, packed: PackedLinear) -> bool:
    """Whether ``packed`` computes ``linear``'s rows faster than ``F.linear`` does on this
    machine: the geometric mean of their best call times at LAYOUT_ROWS. Which wins is the
    kernels' and the CPU's (oneDNN's layout was made for AMX and AVX-512; a CPU may
    multiply a plain weight as fast). Timed once a process per shape and thread count."""
    key = (linear.out_features, linear.in_features, linear.bias is not None, torch.get_num_threads())
    if key not in _pays:
        bias = None if linear.bias is None else linear.bias.detach()
        weight = linear.weight.detach()
        plain = _call_seconds(lambda rows: F.linear(rows, weight, bias), linear.in_features)
        laid = _call_seconds(packed.rows, linear.in_features)
        _pays[key] = math.prod(laid) <= math.prod(plain)
        log.info(
            "output layer %d x %d: %s (ms a call of %s rows: laid out for oneDNN %s, F.linear %s)",
            linear.out_features,
            linear.in_features,
            "laid out for oneDNN" if _pays[key] else "F.linear on its weight as it is",
            " and ".join(map(str, LAYOUT_ROWS)),
            " / ".join(f"{1000 * seconds:.2f}" for seconds in laid),
            " / ".join(f"{1000 * seconds:.2f}" for seconds in plain),
        )
    return _pays[key]


def _call_seconds(compute, in_features: int) -> list[float]:
    """``compute``'s best seconds a call over LAYOUT_REPEATS, at each of LAYOUT_ROWS (after one untimed)."""
    generator = torch.Generator().manual_seed(11)
    best = []
    with torch.inference_mode():
        for count in LAYOUT_ROWS:
            rows = torch.randn(count, in_features, generator=generator).to(torch.bfloat16)
            compute(rows)
            times = []
            for _ in range(LAYOUT_REPEATS):
                started = time.perf_counter()
                compute(rows)
                times.append(time.perf_counter() - started)
            best.append(min(times))
    return best


_pays: dict[tuple, bool] = {}  # (out, in, bias, threads) -> laid_out_pays


def output_kernel(model: nn.Module) -> str:
    """How the output layer is computed, for the keys of stored measurements: "laid out" or "linear"."""
    return "laid out" if any(isinstance(module, PackedLinear) for module in model.modules()) else "linear"
