"""A packed step through a Llama in one function (``core/llama_pass.py``): transformers'
logits bitwise, in every form and with or without fixed shapes; other models keep
transformers' forward; int4 layers of one input joined only where that is exact."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tests.verifier_service.test_batch_invariance import build, engine_for, filled, prompts
from verifier_service.core import weights
from verifier_service.core.invariance import PROBED_ROWS
from verifier_service.core.llama_pass import LlamaPass
from verifier_service.core.weights import Int4Linear, JoinedInt4Linear, join, use_int4_weights

FORMS = {"float32": (torch.float32, False), "bfloat16": (torch.bfloat16, False), "bfloat16, int4 weights": (torch.bfloat16, True)}


@pytest.mark.parametrize("invariant", [True, False], ids=["fixed shapes", "free shapes"])
@pytest.mark.parametrize("form", FORMS)
def test_a_step_through_the_llama_pass_gives_transformers_logits_bitwise(tiny_tokenizer, form, invariant):
    dtype, int4 = FORMS[form]
    model = build(dtype)
    if int4:
        use_int4_weights(model)
    engines = [engine_for(model, tiny_tokenizer, invariant) for _ in range(2)]
    lean, transformers_engine = engines
    assert lean.target.lean is not None
    if int4:  # the default model's case: every layer's projections joined
        assert all(qkv is not None and gate_up is not None for qkv, gate_up in lean.target.lean.joined)
    transformers_engine.target.lean = None
    texts = prompts(4)
    results = []
    for engine in engines:
        filled(engine, texts[:3])
        rows = [(len(texts[0]), [5, 6, 7]), (len(texts[1]), [8]), (len(texts[2]), [9, 10, 11, 12])]
        segments = [(3, 0, texts[3])]  # a prompt chunk beside them
        keep = [*range(8), 8 + len(texts[3]) - 1]
        with torch.inference_mode():
            logits = engine.target.forward(rows, segments, keep, trees=[None, None, [-1, 0, 0, 1]])
            after = engine.target.forward([(len(texts[0]) + 3, [4])], [], [0])  # reads what the first pass cached
        results.append((logits, after))
    (logits, after), (expected, expected_after) = results
    assert logits.shape == (9, model.config.vocab_size)
    assert torch.equal(logits, expected) and torch.equal(after, expected_after)


def test_models_it_does_not_compute_exactly_keep_transformers_forward():
    assert LlamaPass.of(build(torch.float32), 64) is not None
    qwen = Qwen2ForCausalLM(
        Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    )
    assert LlamaPass.of(qwen, 64) is None
    dynamic = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    )
    assert LlamaPass.of(LlamaForCausalLM(dynamic), 64) is None  # its angles change with the sequence's length


def int4_layers(*outputs: int, bias: bool = False) -> list[Int4Linear]:
    torch.manual_seed(5)
    return [Int4Linear(nn.Linear(96, count, bias=bias)) for count in outputs]


def test_joined_int4_layers_compute_each_part_bitwise_and_hold_no_second_copy():
    parts = int4_layers(128, 64, 64, bias=True)
    before = [(part.packed.clone(), part.copy_weight().clone()) for part in parts]
    inputs = torch.randn(max(PROBED_ROWS), 96).to(torch.bfloat16)
    calls = [(kind, count) for kind in ("rows", "prefill_rows") for count in (1, 5)]
    expected = {(kind, count): [getattr(part, kind)(inputs[:count]) for part in parts] for kind, count in calls}
    joined = join(parts)
    assert isinstance(joined, JoinedInt4Linear) and joined.out_features == 256
    for (kind, count), apart in expected.items():
        together = getattr(joined, kind)(inputs[:count]).split(joined.splits, dim=-1)
        assert all(torch.equal(a, b) for a, b in zip(together, apart))
    for part, (packed, copied) in zip(parts, before):  # the parts read the joined weights, unchanged
        assert torch.equal(part.packed, packed)
        assert part.packed.untyped_storage().data_ptr() == joined.packed.untyped_storage().data_ptr()
        if joined.dense is not None:
            assert torch.equal(part.dense, copied)
            assert part.dense.untyped_storage().data_ptr() == joined.dense.untyped_storage().data_ptr()
    if joined.dense is None:  # laid out for oneDNN: one bfloat16 copy is kept, the one prompts are computed with
        kept = [part.laid_out is not None for part in parts]
        assert kept == [joined.prefill_apart] * 3 and (joined.laid_out is not None) != joined.prefill_apart
        assert torch.equal(joined.prefill_rows(inputs[:5]), torch.cat([expected["prefill_rows", 5]][0], dim=-1))
    # Every copy reads back as the weight it was made from, whichever layer holds it.
    assert all(torch.equal(part.copy_weight(), copied) for part, (_, copied) in zip(parts, before))
    assert torch.equal(joined.copy_weight(), torch.cat([copied for _, copied in before]))


def test_layers_are_joined_only_where_the_joined_layer_computes_their_bits(monkeypatch):
    assert join(int4_layers(64)) is None  # nothing to join
    assert join([*int4_layers(64), nn.Linear(96, 64)]) is None  # not all int4
    assert join([*int4_layers(64), *int4_layers(64, bias=True)]) is None  # biases unlike
    assert isinstance(join(int4_layers(128, 64)), JoinedInt4Linear)  # as the kernel computes here

    real = JoinedInt4Linear.rows

    def rounding_apart(self, flat):  # a kernel whose joined call rounds a part's outputs differently
        out = real(self, flat)
        return out + (out.abs() * 2**-7) * (flat.shape[0] > 3)

    monkeypatch.setattr(weights, "_joins_exact", {})
    monkeypatch.setattr(JoinedInt4Linear, "rows", rounding_apart)
    parts = int4_layers(128, 64)
    assert join(parts) is None
    assert len({part.packed.untyped_storage().data_ptr() for part in parts}) == 2  # each still its own


def test_prompt_rows_are_computed_part_by_part_where_only_the_joined_bfloat16_gemm_rounds_apart(monkeypatch):
    """As oneDNN on an AMX CPU computes the q/k/v sizes joined at 256 rows: the int4 kernel's
    rows are joined, the prompt rows' bfloat16 GEMM is not."""

    def joined_apart(real):
        def compute(x, weight, bias=None):
            out = real(x, weight, bias)
            return out + (out.abs() * 2**-7) * (out.shape[-1] == 192 and x.shape[0] > 100)

        return compute

    monkeypatch.setattr(weights, "_joins_exact", {})
    # Whichever computes prompt rows here: F.linear, or oneDNN's laid-out weights.
    monkeypatch.setattr(torch.nn.functional, "linear", joined_apart(torch.nn.functional.linear))
    monkeypatch.setattr(weights, "linear_laid_out", joined_apart(weights.linear_laid_out))
    parts = int4_layers(128, 64)
    joined = join(parts)
    assert isinstance(joined, JoinedInt4Linear) and joined.prefill_apart
    rows = torch.randn(256, parts[0].in_features).to(torch.bfloat16)
    assert torch.equal(joined.prefill_rows(rows), torch.cat([part.prefill_rows(rows) for part in parts], dim=-1))
    assert torch.equal(joined.rows(rows), torch.cat([part.rows(rows) for part in parts], dim=-1))
    assert torch.equal(joined.copy_weight(), torch.cat([part.copy_weight() for part in parts]))
