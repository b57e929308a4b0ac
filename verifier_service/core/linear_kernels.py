"""Linear layers computed as x @ W^T or as (W @ x^T)^T, whichever this machine runs
faster for the step's number of tokens, as measured when the engine calibrates.

On CPUs a decode step reads every weight once, and for a 135M-parameter model
in float32 that is ~540 MB: a one-token step is bound by memory bandwidth. A
few more tokens should then be nearly free, and that is what speculation
spends. But the BLAS kernel behind ``F.linear`` can cost far more for 2-16
rows than for one (it packs the weight matrix on every call), while the same
product taken as W @ x^T does not: measured on one 2-core AVX2 machine with
SmolLM2-135M, a whole 5-token step took 223 ms as x @ W^T and 127 ms as
W @ x^T, against 130 ms for one token. Which form wins depends on the BLAS
library, the CPU and the shapes, so ``calibrate_step_cost`` times whole steps
both ways at each token count up to ``MEASURED_UP_TO``, and W @ x^T is used
up to the count that saves the most time in all (``LinearKernels.choose``);
larger steps (long prefill chunks) use ``F.linear``, and so do GPUs.

Both forms compute the same dot products; only the order of the float
additions inside each may differ, as between any two BLAS kernels (and as
between a one-row and a many-row step already). The measured form is used
only inside ``engaged()``, which the engine enters for its own forward
passes, so any other use of the model (transformers' ``generate``, say)
runs unchanged.
"""

from __future__ import annotations

import contextlib
import threading
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from verifier_service.core.invariance import current_pass, invariant_linear

# Token counts above this always use F.linear (prefill-sized steps, where the
# GEMM kernel is efficient and timing both forms would slow start-up).
MEASURED_UP_TO = 128

_thread = threading.local()


@contextlib.contextmanager
def engaged():
    """Within it, this thread's forward passes use the measured form."""
    previous = getattr(_thread, "engaged", False)
    _thread.engaged = True
    try:
        yield
    finally:
        _thread.engaged = previous


class LinearKernels:
    """Which form each token count uses; shared by all of a model's linear layers.

    One threshold: W @ x^T up to ``up_to`` tokens, F.linear above. The physics
    is one crossover (packing the weights costs more, relatively, the fewer
    rows share it), and a single threshold chosen by the total time saved is
    robust to the noise of timing each count once or twice, where a choice
    per count would follow the noise.
    """

    def __init__(self) -> None:
        self.up_to = 0  # F.linear everywhere until measured
        self._forced: bool | None = None

    def choose(self, timings: dict[int, tuple[float, float]]) -> None:
        """From {token count: (seconds as x @ W^T, seconds as W @ x^T)}: the threshold
        (0: none) under which the measured steps would have taken least time in all."""
        best, saved, self.up_to = 0.0, 0.0, 0
        for count in sorted(count for count in timings if count <= MEASURED_UP_TO):
            linear, transposed = timings[count]
            saved += linear - transposed
            if saved > best:
                best, self.up_to = saved, count

    @contextlib.contextmanager
    def forcing(self, transposed: bool):
        """Every engaged call uses one form (for timing it)."""
        self._forced = transposed
        try:
            yield
        finally:
            self._forced = None

    def transposed(self, rows: int) -> bool:
        if self._forced is not None:
            return self._forced
        return rows <= self.up_to


class TransposableLinear(nn.Linear):
    """An nn.Linear (same parameters, same state dict) that follows its model's LinearKernels."""

    kernels: LinearKernels

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        invariant = current_pass()
        if invariant is not None:  # fixed shapes, whatever the measured form
            return invariant_linear(hidden, self.weight, self.bias, invariant)
        if getattr(_thread, "engaged", False) and self.kernels.transposed(hidden.numel() // hidden.shape[-1]):
            return linear_transposed(hidden, self.weight, self.bias)
        return F.linear(hidden, self.weight, self.bias)


def linear_transposed(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(hidden, weight, bias), computed as (weight @ hidden^T)^T."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    out = (weight @ flat.t()).t()
    if bias is not None:
        out = out + bias
    return out.reshape(*hidden.shape[:-1], weight.shape[0])


def use_linear_kernels(model: nn.Module) -> LinearKernels | None:
    """Make ``model``'s plain nn.Linear layers TransposableLinear, sharing one LinearKernels
    (which starts out choosing F.linear everywhere); the same object on a second call.
    None on a GPU, where F.linear is the tuned path, or when the model has no plain Linear."""
    if next(model.parameters()).device.type != "cpu":
        return None
    linears = [module for module in model.modules() if type(module) in (nn.Linear, TransposableLinear)]
    if not linears:
        return None
    kernels = next((module.kernels for module in linears if isinstance(module, TransposableLinear)), None) or LinearKernels()
    for module in linears:
        module.__class__ = TransposableLinear
        cast(TransposableLinear, module).kernels = kernels
    return kernels
