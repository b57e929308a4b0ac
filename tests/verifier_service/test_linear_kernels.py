"""Linear layers in two equal forms, chosen per token count (verifier_service.core.linear_kernels)."""

from __future__ import annotations

import torch
from torch import nn

from verifier_service.core.linear_kernels import MEASURED_UP_TO, TransposableLinear, engaged, use_linear_kernels


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8, bias=False))


def test_both_forms_compute_the_same_product_and_keep_parameters_and_state_dict():
    plain = model()
    swapped = model()
    keys = list(swapped.state_dict())
    kernels = use_linear_kernels(swapped)
    assert all(type(layer) is TransposableLinear for layer in (swapped[0], swapped[2]))
    assert list(swapped.state_dict()) == keys and isinstance(swapped[0], nn.Linear)
    assert use_linear_kernels(swapped) is kernels  # idempotent: one policy per model
    x = torch.randn(3, 5, 16)
    with engaged(), kernels.forcing(True):
        transposed = swapped(x)
    assert transposed.shape == (3, 5, 8)
    torch.testing.assert_close(transposed, plain(x), rtol=1e-5, atol=1e-6)


def test_the_measured_form_is_used_only_where_it_won_and_only_when_engaged(monkeypatch):
    swapped = model()
    kernels = use_linear_kernels(swapped)
    calls = []
    import verifier_service.core.linear_kernels as module

    real = module.linear_transposed
    monkeypatch.setattr(module, "linear_transposed", lambda *args: calls.append(args[0].shape) or real(*args))
    # Noisy timings: the threshold follows the total time saved, not each count's winner.
    kernels.choose({1: (1.0, 1.01), 2: (1.6, 1.0), 3: (1.5, 1.6), 4: (1.7, 1.1), 8: (1.2, 1.3), 16: (2.0, 2.5), MEASURED_UP_TO + 1: (9, 1)})
    assert kernels.up_to == 4
    assert [kernels.transposed(rows) for rows in (1, 2, 3, 4, 5, 8, MEASURED_UP_TO + 1)] == [True, True, True, True, False, False, False]
    kernels.choose({1: (1.0, 1.2), 2: (1.0, 1.1)})
    assert kernels.up_to == 0 and not kernels.transposed(1)  # never saves: F.linear everywhere
    kernels.choose({2: (1.6, 1.0)})
    swapped(torch.randn(2, 16))  # not engaged: F.linear, whatever was measured
    assert calls == []
    with engaged():
        swapped(torch.randn(2, 16))
        swapped(torch.randn(4, 16))
    assert len(calls) == 2  # both layers at 2 rows; none at 4
