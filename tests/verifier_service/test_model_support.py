"""Model families beyond Llama: exact where served, refused at load where rows would not be independent.

Tiny seeded models of each family, checked against ``reference_greedy``
(full recomputation through transformers' own attention and masks).
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from drafter_service.sessions import NGramDrafter
from verifier_service.core.drafting import SessionProposer
from verifier_service.core.engine import EngineConfig, GenerationRequest, SpeculativeEngine, reference_greedy

VOCAB = 64
NO_EOS = frozenset()
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=0,
)


def seeded(model_class, config, seed: int = 0):
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():  # peaked next-token distributions, as in tests/conftest.py
        model.get_output_embeddings().weight.mul_(40.0)
    return model


def engine_for(model, tokenizer, **config) -> SpeculativeEngine:
    engine = SpeculativeEngine(model, tokenizer, SessionProposer(NGramDrafter()), EngineConfig(**config))
    engine.eos_token_ids = NO_EOS
    return engine


def assert_exact(engine, model, prompts, max_new_tokens, ks=(0, 3, None)):
    for k in ks:
        results = engine.generate([GenerationRequest(p, n, num_speculative_tokens=k) for p, n in zip(prompts, max_new_tokens)])
        for prompt, n, result in zip(prompts, max_new_tokens, results):
            assert result.token_ids == reference_greedy(model, prompt, n, NO_EOS), f"K={k}, prompt {prompt}"


def test_gpt2_learned_positions_work_up_to_the_last_one(tiny_tokenizer):
    """16 positions in all: each request fills its context to the last position, beside
    others of other lengths. A position past the table would raise IndexError."""
    config = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=1)
    model = seeded(GPT2LMHeadModel, config)
    engine = engine_for(model, tiny_tokenizer)
    assert engine.cache.capacity == 16
    prompts = [[5, 6, 7], [9, 3, 3, 9, 3, 3, 9, 3], [12], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53]]
    assert_exact(engine, model, prompts, [16 - len(p) for p in prompts], ks=(0, 3, 8, None))
    with pytest.raises(ValueError, match=r"needs 17 cache positions; this server holds at most 16 per request"):
        engine.add(GenerationRequest([5], 16))


@pytest.mark.parametrize("chunk", [256, 3])
def test_mistral_sliding_window_is_applied_in_decode_and_in_chunked_prefill(tiny_tokenizer, chunk):
    # A 4-token window over 20-token prompts: every step attends past the window's edge.
    model = seeded(MistralForCausalLM, MistralConfig(**SMALL, sliding_window=4, max_position_embeddings=128))
    engine = engine_for(model, tiny_tokenizer, prefill_chunk_tokens=chunk)
    prompts = [[(7 * i + j) % 60 + 2 for j in range(20)] for i in range(3)]
    assert_exact(engine, model, prompts, [24, 17, 30])


def test_qwen2_with_sliding_and_full_layers_mixed(tiny_tokenizer):
    config = Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=3, max_window_layers=1, max_position_embeddings=128)
    assert config.layer_types == ["full_attention", "sliding_attention"]
    model = seeded(Qwen2ForCausalLM, config)
    engine = engine_for(model, tiny_tokenizer, prefill_chunk_tokens=5)
    prompts = [[(5 * i + j) % 60 + 2 for j in range(12)] for i in range(3)]
    assert_exact(engine, model, prompts, [20, 26, 9])


def test_batch_dependent_rope_is_refused_at_load(tiny_tokenizer):
    config = LlamaConfig(
        **SMALL, max_position_embeddings=64, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    )
    model = seeded(LlamaForCausalLM, config)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM uses 'dynamic' RoPE scaling, whose frequencies depend on the longest position"):
        SpeculativeEngine(model, tiny_tokenizer)


def test_attention_soft_capping_is_refused_at_load(tiny_tokenizer):
    config = Gemma2Config(**SMALL, head_dim=8, attn_logit_softcapping=50.0, max_position_embeddings=64)
    model = seeded(Gemma2ForCausalLM, config)
    with pytest.raises(
        ValueError, match=r"Gemma2ForCausalLM cannot be served: attention soft-capping and attention sinks are not supported"
    ):
        SpeculativeEngine(model, tiny_tokenizer)
