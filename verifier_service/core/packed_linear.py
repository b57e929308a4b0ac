"""The output layer in bfloat16 on a CPU, its weight held in oneDNN's own blocked layout.

``F.linear`` in bfloat16 on a CPU hands the weight to oneDNN as it is, and oneDNN copies it
into its blocked layout on every call before it multiplies: for the default model's output
layer (49,152 x 576, 56 MB) that copy is most of the call. ``PackedLinear`` lays the weight
out once, when the model takes its form, and calls oneDNN's linear on the laid-out weight
(``torch.ops.mkldnn._reorder_linear_weight`` and ``_linear_pointwise``, the pair PyTorch's
own compiler uses for frozen CPU linear layers). One row of the default model's output
layer took 3.7 ms by ``F.linear`` and 1.6 ms laid out (2-core AMX CPU, two threads); 16
rows 4.4 and 2.3 ms.

Its rows are probed like the int4 layers' (``row_probe``): a batch-invariant pass calls it
as rows come where a row comes out the same at every count, alone included
(``invariance.lone_row_invariant``), else in the fixed shapes of the other layers. Only the
output layer is laid out: it is read once a pass at every size of pass, it is where the
copy costs most, and its input is the last hidden state whatever computed the layers.
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from verifier_service.core.invariance import current_pass, invariant_rows

log = logging.getLogger(__name__)


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] in oneDNN's layout for a linear layer (an opaque tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


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
        self.packed = _pack(self.weight)

    def rows(self, flat: torch.Tensor) -> torch.Tensor:
        """[rows, in_features] -> [rows, out_features], in bfloat16."""
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(flat.to(torch.bfloat16).contiguous(), self.packed, bias, "none", [], "")

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
        self.packed = _pack(self.weight)
        return self

    def __deepcopy__(self, memo: dict) -> PackedLinear:
        """A copy with its own laid-out weight (an opaque tensor has no storage to copy)."""
        copied = PackedLinear.__new__(PackedLinear)
        memo[id(self)] = copied
        for name, value in self.__dict__.items():
            if name != "packed":
                copied.__dict__[name] = copy.deepcopy(value, memo)
        copied.packed = _pack(copied.weight)
        return copied

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, laid out for oneDNN"


def packed_supported(device: torch.device) -> bool:
    """Whether a laid-out bfloat16 linear layer runs on ``device``: a CPU whose torch has
    oneDNN with bfloat16, and computes the ops' result as ``F.linear`` does within bfloat16."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
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


def use_packed_output(model: PreTrainedModel) -> bool:
    """Make ``model``'s output layer a ``PackedLinear`` where it is a bfloat16 ``nn.Linear`` on
    a CPU that runs one; whether it did."""
    output = model.get_output_embeddings()
    if not isinstance(output, nn.Linear) or output.weight.dtype != torch.bfloat16 or not packed_supported(output.weight.device):
        return False
    model.set_output_embeddings(PackedLinear(output))
    return True


def output_kernel(model: nn.Module) -> str:
    """How the output layer is computed, for the keys of stored measurements: "laid out" or "linear"."""
    return "laid out" if any(isinstance(module, PackedLinear) for module in model.modules()) else "linear"
