"""Weight-only int8 (``--weights int8``): integers with a scale per output, PyTorch's CPU kernel."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.verifier_service.test_batch_invariance import FLAT, build, engine_for
from tests.verifier_service.test_engine_adaptive import FrozenStepCost
from tests.verifier_service.test_weights import assert_logits_independent_of_the_pass, assert_speculative_output_is_plain
from verifier_service.core import weights
from verifier_service.core.weights import GROUP, Int8Linear, int8_supported, quantize_int8, use_int8_weights, weights_form

pytestmark = pytest.mark.skipif(not int8_supported(torch.device("cpu")), reason="this torch has no int8 CPU kernel")


def test_a_rows_integers_and_scale_stand_for_it_within_half_a_scale():
    integers, scales = quantize_int8(torch.tensor([[-1.0, 0.5, 0.25]]))
    assert scales.dtype == torch.bfloat16 and scales.item() == torch.tensor(1 / 127).to(torch.bfloat16).item()
    assert integers.dtype == torch.int8 and integers.tolist() == [[-127, 64, 32]]
    weight = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 64)[:, None]
    integers, scales = quantize_int8(weight)
    error = (weight - integers.float() * scales.float()[:, None]).abs()
    assert (error <= scales.float()[:, None] / 2 + 1e-12).all()
    assert integers.abs().max() == 127  # each row's largest magnitude lands on the last level


def test_the_kernel_computes_with_the_integers_and_the_prompt_copy_holds_the_same_weight():
    layer = Int8Linear(nn.Linear(96, 48, bias=True))
    stored = layer.integers.float() * layer.scales.float()[:, None]
    assert torch.equal(layer.copy_weight().float(), stored.to(torch.bfloat16).float())
    rows = torch.randn(5, 96).to(torch.bfloat16)
    expected = rows.float() @ stored.t() + layer.bias.float()
    assert torch.allclose(layer.rows(rows).float(), expected, rtol=2e-2, atol=2e-2)
    assert torch.allclose(layer.prefill_rows(rows).float(), expected, rtol=2e-2, atol=2e-2)


def test_the_output_layer_and_inputs_the_kernel_reads_wrong_keep_their_form():
    model = build(torch.bfloat16)
    model.model.layers[0].mlp.down_proj = nn.Linear(520, 256, bias=False).to(torch.bfloat16)  # 520 inputs: not a multiple of 32
    assert use_int8_weights(model) == 2 * 7 - 1 and weights_form(model) == "int8"
    assert type(model.lm_head) is nn.Linear and type(model.model.layers[0].mlp.down_proj) is nn.Linear


def test_sizes_whose_products_the_kernel_gets_wrong_are_not_converted(monkeypatch):
    monkeypatch.setattr(weights, "_int8_sizes", {})
    monkeypatch.setattr(weights, "_int8_mm", lambda rows, integers, scales: torch.zeros(rows.shape[0], integers.shape[0], dtype=rows.dtype))
    model = build(torch.bfloat16)
    assert use_int8_weights(model) == 0 and weights_form(model) == "float"
    assert not int8_supported(torch.device("cpu"))


def int8_model():
    model = build(torch.bfloat16)
    use_int8_weights(model)
    return model


def test_with_int8_weights_a_tokens_logits_are_the_same_whatever_shares_its_pass(tiny_tokenizer):
    engine = engine_for(int8_model(), tiny_tokenizer)
    assert engine.target.invariance is not None
    assert_logits_independent_of_the_pass(engine)


def test_int8_layers_run_prompt_chunks_on_their_copy_and_decode_rows_on_the_kernel(tiny_tokenizer, monkeypatch):
    engine = engine_for(int8_model(), tiny_tokenizer)
    calls: list[tuple[str, int]] = []
    rows, prefill_rows = Int8Linear.rows, Int8Linear.prefill_rows
    monkeypatch.setattr(Int8Linear, "rows", lambda self, flat: calls.append(("kernel", flat.shape[0])) or rows(self, flat))
    monkeypatch.setattr(Int8Linear, "prefill_rows", lambda self, flat: calls.append(("copy", flat.shape[0])) or prefill_rows(self, flat))
    with torch.inference_mode():
        engine.target.forward([(0, [5, 6, 7])], [(1, 0, list(range(2, 12)))], [0])
    assert {kind for kind, _ in calls} == {"kernel", "copy"}
    assert sum(count for kind, count in calls if kind == "kernel") % 3 == 0  # the decode rows: 3 a layer (or padded tiles of them)
    assert all(count >= 10 for kind, count in calls if kind == "copy")  # the prompt chunk's 10 rows, whole


def test_greedy_speculative_output_is_plain_output_with_int8_weights(tiny_tokenizer):
    assert_speculative_output_is_plain(int8_model(), tiny_tokenizer, seed=23)


def test_int8_weights_with_float32_activations_are_refused_with_the_flag_to_change():
    from verifier_service.serving.config import VerifierConfig

    with pytest.raises(ValueError, match=r"--weights int8 computes with bfloat16 activations: start it with --dtype bfloat16"):
        VerifierConfig(weights="int8", dtype="float32")
    assert VerifierConfig(weights="int8", dtype="bfloat16").weights == "int8"
    assert GROUP == 32


@pytest.mark.slow  # the default model, 64 tokens twice
def test_the_default_model_with_int8_weights_speculates_plain_decodings_tokens():
    from bench.bench_core import run_fresh
    from bench.workloads import workloads
    from verifier_service.core.engine import SpeculativeEngine
    from verifier_service.core.forms import Form, in_form
    from verifier_service.core.model_loading import chat_prompt_ids, load_model

    loaded = load_model(dtype="float32")
    model = in_form(loaded.model, Form("bfloat16", "int8", 2))
    assert weights_form(model) == "int8"
    chosen = next(item for item in workloads() if item.name == "code_edit")
    ids = chat_prompt_ids(loaded.tokenizer, chosen.prompts[1])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        # A flat step cost: no calibration to wait for, and the planner verifies every draft it may.
        plain, _, _ = run_fresh(SpeculativeEngine(model, loaded.tokenizer, step_cost=FrozenStepCost(FLAT)), ids, 64, 0, chosen.repeated)
        engine = SpeculativeEngine(model, loaded.tokenizer, step_cost=FrozenStepCost(FLAT))
        adaptive, stats, _ = run_fresh(engine, ids, 64, None, chosen.repeated)
    finally:
        torch.set_num_threads(before)
    assert adaptive == plain
    assert stats.accepted_tokens > 0
