"""The output layer laid out for oneDNN (``packed_linear``): the same products as
``F.linear`` within bfloat16's rounding, tied to the embeddings as before, copied and moved
safely, and named in the keys of stored measurements."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from verifier_service.core import packed_linear
from verifier_service.core.calibration import calibration_key
from verifier_service.core.forms import Form, in_form
from verifier_service.core.invariance import Invariance, _probed_layers, invariant_pass, lone_row_invariant
from verifier_service.core.packed_linear import PackedLinear, output_kernel, packed_supported, use_packed_output
from verifier_service.core.weights import Int4Linear

pytestmark = pytest.mark.skipif(
    not packed_supported(torch.device("cpu")), reason="this CPU's torch has no oneDNN bfloat16 linear layers to lay out"
)


def tied_llama() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    torch.manual_seed(11)
    return LlamaForCausalLM(config).eval()


def layer(bias: bool = True) -> nn.Linear:
    torch.manual_seed(3)
    return nn.Linear(64, 48, bias=bias).to(torch.bfloat16)


@pytest.mark.parametrize("bias", [True, False])
def test_rows_are_the_linear_layers_products_within_bfloat16(bias):
    linear = layer(bias)
    inputs = torch.randn(5, 64).to(torch.bfloat16)
    with torch.inference_mode():
        got = PackedLinear(linear)(inputs[None])[0].float()
        expected = F.linear(inputs.float(), linear.weight.float(), None if linear.bias is None else linear.bias.float())
    assert got.shape == (5, 48)
    torch.testing.assert_close(got, expected, rtol=2**-7, atol=2**-5)


def test_the_output_layer_stays_tied_to_the_embeddings_and_the_float32_model_is_left_alone():
    model = tied_llama().to(torch.bfloat16)
    assert use_packed_output(model, measure=False)
    output = model.get_output_embeddings()
    assert isinstance(output, PackedLinear) and output.weight is model.model.embed_tokens.weight
    assert output_kernel(model) == "laid out"
    float_model = tied_llama()
    assert not use_packed_output(float_model)
    assert type(float_model.get_output_embeddings()) is nn.Linear and output_kernel(float_model) == "linear"


def test_a_served_bfloat16_form_lays_its_output_layer_out_and_its_logits_follow_the_float_ones(monkeypatch):
    monkeypatch.setattr(packed_linear, "laid_out_pays", lambda linear, packed: True)  # whatever this CPU times
    source = tied_llama()
    ids = torch.tensor([[3, 17, 40, 5, 88]])
    formed = in_form(source, Form("bfloat16", "float", 1), keep=True)
    assert output_kernel(formed) == "laid out" and output_kernel(source) == "linear"
    with torch.inference_mode():
        laid_out = formed(ids).logits.float()
        expected = source(ids).logits
    torch.testing.assert_close(laid_out, expected, rtol=0.05, atol=0.05)


def test_a_copy_computes_as_the_original_with_its_own_weight_and_laid_out_copy():
    original = PackedLinear(layer())
    copied = copy.deepcopy(original)
    assert copied.weight is not original.weight and copied.packed is not original.packed
    inputs = torch.randn(2, 64).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(copied.rows(inputs), original.rows(inputs))


def test_casting_it_out_of_bfloat16_is_refused_with_a_reason():
    with pytest.raises(ValueError, match="bfloat16 on the CPU"):
        PackedLinear(layer()).to(torch.float32)


def test_its_rows_come_out_the_same_at_every_count_where_the_probe_says_so():
    packed = PackedLinear(layer())
    inputs = torch.randn(40, 64).to(torch.bfloat16)
    invariant = lone_row_invariant(packed, (3, 8, 33, 40))
    with torch.inference_mode():
        alone = torch.cat([packed.rows(inputs[row : row + 1]) for row in range(40)])
        together = packed.rows(inputs)
    assert torch.equal(alone, together) or not invariant


def test_in_a_batch_invariant_pass_without_the_probes_word_rows_go_in_the_passes_fixed_shapes():
    packed = PackedLinear(layer())
    calls: list[int] = []
    rows = packed.rows
    packed.rows = lambda flat: (calls.append(flat.shape[0]), rows(flat))[1]  # type: ignore[method-assign]
    inputs = torch.randn(1, 3, 64).to(torch.bfloat16)
    with torch.inference_mode(), invariant_pass(Invariance(linear_tile=8, prefill_tile=64), decode_tokens=3):
        packed.any_rows = False
        packed(inputs)
        packed.any_rows = True
        packed(inputs)
    assert calls == [8, 3]  # decode rows padded to a tile, then as they come


def test_stored_measurements_are_keyed_by_how_the_output_layer_is_computed(monkeypatch):
    monkeypatch.setattr(packed_linear, "laid_out_pays", lambda linear, packed: True)  # whatever this CPU times

    class Probe:
        def __init__(self, model):
            self.model, self.passes, self.reads_per_token = model, "fixed", False
            self.device, self.slot_count = torch.device("cpu"), 2
            self.cache = type("Cache", (), {"capacity": 64})()

    laid_out = in_form(tied_llama(), Form("bfloat16", "float", 1), keep=True)
    plain = tied_llama().to(torch.bfloat16)
    assert calibration_key(Probe(laid_out))["output"] == "laid out"
    assert calibration_key(Probe(plain))["output"] == "linear"


def test_the_row_probes_compute_each_computation_once_and_each_layer_type_of_a_shape():
    """Its prompt rows are its rows: probed once. An int4 layer of the same shape is another
    computation, probed too."""
    layers = nn.Sequential(PackedLinear(layer()), Int4Linear(nn.Linear(64, 48)))
    probed = _probed_layers(layers, torch.Generator().manual_seed(0), ("rows", "prefill_rows"))
    assert [name for name, *_ in probed] == [
        "PackedLinear 48 x 64 (rows)",
        "Int4Linear 48 x 64 (rows)",
        "Int4Linear 48 x 64 (prefill_rows)",
    ]


@pytest.mark.parametrize("laid_out_faster", [True, False])
def test_the_output_layer_is_laid_out_only_where_its_calls_are_timed_faster_laid_out(monkeypatch, caplog, laid_out_faster):
    """Timed once a process per shape: here the timings are given (the test times nothing)."""
    timed = []

    def seconds(compute, in_features):
        laid_out = getattr(compute, "__self__", None) is not None  # PackedLinear.rows, a bound method
        timed.append(laid_out)
        return [0.001, 0.002] if laid_out == laid_out_faster else [0.002, 0.003]

    monkeypatch.setattr(packed_linear, "_call_seconds", seconds)
    monkeypatch.setattr(packed_linear, "_pays", {})
    caplog.set_level("INFO", logger="verifier_service.core.packed_linear")
    model = tied_llama().to(torch.bfloat16)
    assert use_packed_output(model) is laid_out_faster
    assert output_kernel(model) == ("laid out" if laid_out_faster else "linear")
    assert sorted(timed) == [False, True]
    assert ("laid out for oneDNN (ms" if laid_out_faster else "F.linear on its weight as it is") in caplog.text
    # A second model of the shape takes the answer without timing again.
    assert use_packed_output(tied_llama().to(torch.bfloat16)) is laid_out_faster and len(timed) == 2
