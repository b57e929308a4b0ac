"""int4 weights (``core/weights.py``): the integers of a 4-bit checkpoint found again exactly,
the kernel computing what the stored weight says, and the engine exact in that form."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.verifier_service.test_batch_invariance import ROWS, TreeProposer, branch_tree, build, engine_for, prompts
from verifier_service.core.engine import GenerationRequest
from verifier_service.core.invariance import Invariance, InvariantPass, invariant_rows, lone_row_invariant
from verifier_service.core.weights import GROUP, Int4Linear, error_bound, quantize, rebuilt, stored, use_int4_weights, weights_form


def q4_1(outputs: int, inputs: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight as a Q4_1 file holds it (w = d q + m, float16 d and m, q in [0, 15], each
    group's least q 0 and greatest 15, as the quantizer makes them), and its integers."""
    generator = torch.Generator().manual_seed(seed)
    groups = inputs // GROUP
    integers = torch.randint(0, 16, (outputs, groups, GROUP), generator=generator)
    integers[..., 0], integers[..., 1] = 0, 15
    d = (torch.rand(outputs, groups, 1, generator=generator) * 0.05 + 0.001).half()
    m = (-torch.rand(outputs, groups, 1, generator=generator) * 0.4).half()
    return (d.float() * integers + m.float()).reshape(outputs, inputs), integers.reshape(outputs, inputs)


def test_the_integers_of_a_4_bit_weight_are_found_again_exactly():
    weight, integers = q4_1(64, 128)
    found, scales, zeros = quantize(weight)
    assert torch.equal(found, integers.to(torch.int32))
    torch.testing.assert_close(rebuilt(found, scales, zeros), weight, rtol=0, atol=1e-6)


def test_the_kernel_computes_with_the_stored_weight_and_it_moves_within_the_stated_bound():
    weight, _ = q4_1(48, 96, seed=1)
    linear = nn.Linear(96, 48, bias=True)
    with torch.no_grad():
        linear.weight.copy_(weight)
    module = Int4Linear(linear)
    held = stored(weight)
    _, scales, zeros = quantize(weight)
    moved = (held - weight).abs().reshape(48, 3, GROUP).amax(-1)
    assert bool((moved <= error_bound(scales, zeros)).all()) and moved.max() > 0  # bfloat16 scales do move it
    inputs = torch.randn(5, 96).to(torch.bfloat16)
    expected = torch.nn.functional.linear(inputs.float(), held, linear.bias.detach())
    torch.testing.assert_close(module(inputs).float(), expected, rtol=1e-2, atol=1e-2)  # bfloat16 output
    wrong = torch.nn.functional.linear(inputs.float(), held.roll(1, 0), linear.bias.detach())
    assert not torch.allclose(module(inputs).float(), wrong, rtol=1e-2, atol=1e-2)


def test_the_output_layer_and_sizes_the_kernel_refuses_keep_their_form():
    model = build(torch.bfloat16)
    model.model.layers[0].mlp.gate_proj = nn.Linear(256, 40, bias=False).to(torch.bfloat16)  # 40 outputs: not a multiple of 16
    replaced = use_int4_weights(model)
    assert replaced == 2 * 7 - 1 and weights_form(model) == "int4"
    assert type(model.lm_head) is nn.Linear and type(model.model.layers[0].mlp.gate_proj) is nn.Linear
    assert weights_form(build(torch.bfloat16)) == "float"


def int4_model():
    model = build(torch.bfloat16)
    use_int4_weights(model)
    return model


def test_with_int4_weights_a_tokens_logits_are_the_same_whatever_shares_its_pass(tiny_tokenizer):
    assert_logits_independent_of_the_pass(engine_for(int4_model(), tiny_tokenizer))


def assert_logits_independent_of_the_pass(engine) -> None:
    """A token's logits alone, and beside other rows' chains and a prompt chunk: bitwise equal."""
    texts = prompts(ROWS)
    with torch.inference_mode():
        for slot, prompt in enumerate(texts):
            engine.target.forward([], [(slot, 0, prompt)], keep=[])
        cached = len(texts[0])
        alone = engine.target.forward([(cached, [5])], [], [0])[0].clone()
        others = [(len(text), [10 + index, 3, 4]) for index, text in enumerate(texts[1:])]
        beside = engine.target.forward([(cached, [5, 7, 8]), *others], [(ROWS, 0, [2 + i % 60 for i in range(70)])], [0])[0]
    assert torch.equal(alone, beside)


def test_int4_layers_run_rows_as_they_come_where_the_probe_finds_them_invariant(tiny_tokenizer, monkeypatch):
    engine = engine_for(int4_model(), tiny_tokenizer)
    layers = [module for module in engine.model.modules() if isinstance(module, Int4Linear)]
    assert layers and all(module.any_rows for module in layers)  # the kernel's rows: the same at every count
    assert engine.target.invariance is not None and engine.target.invariance.linear_tile == 0
    calls: list[int] = []
    rows = Int4Linear.rows
    monkeypatch.setattr(Int4Linear, "rows", lambda self, flat: calls.append(flat.shape[0]) or rows(self, flat))
    with torch.inference_mode():
        engine.target.forward([(0, [5])], [], [0])  # one decode row: not padded to two
        assert set(calls) == {1}
        calls.clear()
        engine.target.forward([(0, [5, 6, 7])], [(1, 0, list(range(2, 12)))], [0])  # the decode rows: one call
        assert set(calls) == {3}


def test_int4_layers_run_prompt_chunks_on_their_bfloat16_copy_and_decode_rows_on_the_kernel(tiny_tokenizer, monkeypatch):
    engine = engine_for(int4_model(), tiny_tokenizer)
    layer = next(module for module in engine.model.modules() if isinstance(module, Int4Linear))
    kernel: list[int] = []
    dense: list[int] = []
    rows, prefill_rows = Int4Linear.rows, Int4Linear.prefill_rows
    monkeypatch.setattr(Int4Linear, "rows", lambda self, flat: kernel.append(flat.shape[0]) or rows(self, flat))
    monkeypatch.setattr(Int4Linear, "prefill_rows", lambda self, flat: dense.append(flat.shape[0]) or prefill_rows(self, flat))
    with torch.inference_mode():
        engine.target.forward([(0, [5, 6])], [(1, 0, list(range(2, 12)))], [0])
    assert kernel and set(kernel) == {2}
    assert dense and set(dense) == {10}
    # The copy holds the weight the kernel computes with, rounded to bfloat16.
    probe = torch.randn(3, layer.in_features).to(torch.bfloat16)
    assert torch.allclose(layer.prefill_rows(probe).float(), layer.rows(probe).float(), rtol=0.02, atol=0.02)


class LoneRowDiffers(nn.Module):
    """A layer whose lone row comes out a rounding apart from the same row among others."""

    row_probe = True
    in_features, out_features = 32, 16

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []

    def rows(self, flat: torch.Tensor) -> torch.Tensor:
        self.calls.append(flat.shape[0])
        out = flat[:, :16].float() * 3
        return out + 1e-3 if flat.shape[0] == 1 else out


class MiddleRowDiffers(nn.Module):
    """A layer whose rows come out the same alone as among others, but for one row in the
    middle of calls of more than 40 rows."""

    row_probe = True
    in_features, out_features = 32, 16

    def rows(self, flat: torch.Tensor) -> torch.Tensor:
        out = flat[:, : self.out_features] * 2
        if flat.shape[0] > 40:
            out[20] += 1e-2
        return out


def test_a_layer_whose_rows_differ_only_in_the_middle_of_a_call_is_not_taken_as_any_rows():
    assert not lone_row_invariant(MiddleRowDiffers())


def test_a_layer_whose_lone_row_differs_is_found_so_and_its_lone_rows_are_padded():
    layer = LoneRowDiffers()
    assert not lone_row_invariant(layer)
    invariance = Invariance(linear_tile=0)
    row = torch.ones(1, 32)
    layer.calls.clear()
    assert torch.equal(invariant_rows(row, layer.rows, InvariantPass(invariance, 1)), layer.rows(torch.cat([row, row]))[:1])
    assert layer.calls[0] == 2  # padded to two


def test_greedy_speculative_output_is_plain_output_with_int4_weights(tiny_tokenizer):
    assert_speculative_output_is_plain(int4_model(), tiny_tokenizer, seed=21)


def assert_speculative_output_is_plain(model, tokenizer, seed: int) -> None:
    """Greedy speculative output equals plain output, with drafts from a proposer that knows
    plain decoding's tokens, as trees and as chains wrong at every second token."""
    texts = prompts(5, seed=seed)
    plain = engine_for(copy.deepcopy(model), tokenizer)
    expected = [plain.generate([GenerationRequest(text, 20, num_speculative_tokens=0)])[0].token_ids for text in texts]
    truth = {tuple(text): tokens for text, tokens in zip(texts, expected)}
    for shape in (branch_tree, every_second_wrong):
        engine = engine_for(copy.deepcopy(model), tokenizer, proposer=TreeProposer(lambda prompt: truth[tuple(prompt)], shape, texts))
        results = engine.generate([GenerationRequest(text, 20, num_speculative_tokens=None) for text in texts])
        assert [result.token_ids for result in results] == expected
    assert sum(result.stats.accepted_tokens for result in results) > 0  # the chains, partly right


def every_second_wrong(path: list[int], depth: int) -> tuple[list[int], list[int]]:
    return [token if index % 2 == 0 else (token + 1) % 64 for index, token in enumerate(path)], []


def test_int4_weights_with_float32_activations_are_refused_with_the_flag_to_change():
    from verifier_service.serving.config import VerifierConfig

    with pytest.raises(ValueError, match=r"--weights int4 computes with bfloat16 activations: start it with --dtype bfloat16"):
        VerifierConfig(weights="int4", dtype="float32")
    assert VerifierConfig(weights="int4", dtype="bfloat16").weights == "int4"


@pytest.mark.slow  # loads the default model twice
def test_the_default_models_int4_layers_keep_its_ggufs_integers():
    """The default GGUF's linear layers are Q4_1: loaded in float32 each lies exactly on its
    4-bit grid, and loaded in bfloat16 (as --weights int4 runs) gives the same integers."""
    from verifier_service.core.model_loading import load_model

    float32, bfloat16 = load_model(dtype="float32").model, load_model(dtype="bfloat16").model
    output = float32.get_output_embeddings()
    pairs = [(a, b) for a, b in zip(float32.modules(), bfloat16.modules()) if isinstance(a, nn.Linear) and a is not output]
    assert len(pairs) == 30 * 7
    for a, b in pairs:
        integers, scales, zeros = quantize(a.weight.detach())
        torch.testing.assert_close(rebuilt(integers, scales, zeros), a.weight.detach(), rtol=0, atol=1e-6)
        assert torch.equal(quantize(b.weight.detach())[0], integers)


@pytest.mark.slow  # the default model, 128 tokens four times
@pytest.mark.parametrize(("workload", "index"), [("open_ended", 1), ("code_edit", 2)])
def test_the_default_model_with_int4_weights_speculates_plain_decodings_tokens_where_its_attention_once_rounded_apart(workload, index):
    """Two benchmark prompts whose adaptive output once left plain decoding's in this form:
    a token alone in its attention call (an odd count of query heads per entry, computed
    on another thread) and a token read with its row's wider columns came out a bfloat16
    step apart, and a near-tie later flipped."""
    from bench.bench_core import run_fresh
    from bench.workloads import workloads
    from verifier_service.core.engine import SpeculativeEngine
    from verifier_service.core.forms import Form, in_form
    from verifier_service.core.model_loading import chat_prompt_ids, load_model

    loaded = load_model(dtype="float32")
    model = in_form(loaded.model, Form("bfloat16", "int4", 2))
    chosen = next(item for item in workloads() if item.name == workload)
    ids = chat_prompt_ids(loaded.tokenizer, chosen.prompts[index])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        plain, _, _ = run_fresh(SpeculativeEngine(model, loaded.tokenizer), ids, 128, 0, chosen.repeated)
        adaptive, stats, _ = run_fresh(SpeculativeEngine(model, loaded.tokenizer), ids, 128, None, chosen.repeated)
    finally:
        torch.set_num_threads(before)
    assert adaptive == plain
    assert stats.accepted_tokens > 0


@pytest.mark.slow  # the default model
def test_the_default_models_prompt_logits_in_the_int4_form_do_not_depend_on_how_the_prompt_is_chunked():
    """A 231-token code-edit prompt, prefilled whole and cut four other ways: its last
    logits are bitwise the same. With prefill tiles placed from each chunk's start (reading
    columns to the chunk's own end), cutting it at 7 tokens rounded them apart."""
    from bench.workloads import workloads
    from verifier_service.core.engine import SpeculativeEngine
    from verifier_service.core.forms import Form, in_form
    from verifier_service.core.model_loading import chat_prompt_ids, load_model

    loaded = load_model(dtype="float32")
    engine = SpeculativeEngine(in_form(loaded.model, Form("bfloat16", "int4", 2)), loaded.tokenizer)
    ids = chat_prompt_ids(loaded.tokenizer, next(item for item in workloads() if item.name == "code_edit").prompts[0])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    last = []
    try:
        for cuts in ([len(ids)], [7, len(ids) - 7], [40, 50, len(ids) - 90], [100, len(ids) - 100], [33, 31, 64, len(ids) - 128]):
            start = 0
            with torch.inference_mode():
                for length in cuts:
                    logits = engine.target.forward([], [(0, start, ids[start : start + length])], keep=[length - 1])
                    start += length
            last.append(logits[0].clone())
    finally:
        torch.set_num_threads(before)
    assert len(ids) > 200 and all(torch.equal(logits, last[0]) for logits in last[1:])
