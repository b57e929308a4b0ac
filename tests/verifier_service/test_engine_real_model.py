"""Greedy equality with transformers' generate on the real default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import inspect
import textwrap

import pytest
import torch

from drafter_service.sessions import NGramDrafter
from verifier_service.core.drafting import SessionProposer
from verifier_service.core.engine import EngineConfig, GenerationRequest, SpeculativeEngine
from verifier_service.core.model_loading import chat_prompt_ids

MAX_NEW_TOKENS = 40
PROMPTS = [
    "What is the capital of France?",
    "Repeat exactly: the cat sat on the mat, the cat sat on the mat.",
    "Rewrite this function with `text` renamed to `source`:\n" + textwrap.dedent(inspect.getsource(textwrap.indent)),
    "Write a haiku about autumn.",
    "List the first ten prime numbers, separated by commas.",
    "Add a docstring to this function:\n" + textwrap.dedent(inspect.getsource(textwrap.dedent)),
    "Explain in two sentences why leaves are green.",
    "Translate to French: good morning, my friend.",
]


@pytest.fixture(scope="module")
def prompts_and_references(real_model):
    model, tokenizer = real_model.model, real_model.tokenizer
    cases = []
    for prompt in PROMPTS:
        ids = chat_prompt_ids(tokenizer, prompt)
        output = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )
        cases.append((ids, output[0, len(ids) :].tolist()))
    return cases


@pytest.mark.parametrize("k", [0, 1, 3, 5, 8, None])
def test_batch_of_8_joining_mid_run_equals_transformers_generate(real_model, prompts_and_references, k):
    """8 requests through 5 cache slots: three join as others finish, and their prompts
    prefill in 64-token chunks inside steps that decode the others."""
    config = EngineConfig(max_batch_size=5, prefill_chunk_tokens=64)
    engine = SpeculativeEngine(real_model.model, real_model.tokenizer, SessionProposer(NGramDrafter()), config)
    results = engine.generate([GenerationRequest(ids, MAX_NEW_TOKENS, num_speculative_tokens=k) for ids, _ in prompts_and_references])
    for (_, expected), result in zip(prompts_and_references, results):
        assert result.token_ids == expected
    if k != 0:  # the copy-heavy prompts must really have exercised acceptance
        assert sum(r.stats.accepted_tokens for r in results) > 0


@pytest.mark.parametrize("k", [3, None])
def test_single_requests_equal_transformers_generate(real_model, prompts_and_references, k):
    engine = SpeculativeEngine(real_model.model, real_model.tokenizer, SessionProposer(NGramDrafter()))
    results = [
        engine.generate([GenerationRequest(ids, MAX_NEW_TOKENS, num_speculative_tokens=k)])[0] for ids, _ in prompts_and_references[:4]
    ]
    assert [r.token_ids for r in results] == [expected for _, expected in prompts_and_references[:4]]
    assert sum(r.stats.accepted_tokens for r in results) > 0


def test_plain_path_equals_transformers_generate(real_model, prompts_and_references):
    engine = SpeculativeEngine(real_model.model, real_model.tokenizer, SessionProposer(NGramDrafter()))
    results = engine.generate([GenerationRequest(ids, MAX_NEW_TOKENS, num_speculative_tokens=0) for ids, _ in prompts_and_references])
    assert [r.token_ids for r in results] == [expected for _, expected in prompts_and_references]
    assert all(r.stats.draft_tokens == 0 for r in results)


def test_converted_cache_matches_loading_the_gguf_directly(real_model):
    """The cached safetensors conversion gives the same logits as transformers' own GGUF load."""
    from transformers import AutoModelForCausalLM

    from verifier_service.core.model_loading import find_default_gguf

    gguf = find_default_gguf()
    direct = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = torch.tensor([chat_prompt_ids(real_model.tokenizer, "Hello")])
    with torch.inference_mode():
        assert torch.equal(real_model.model(ids).logits, direct(ids).logits)


@pytest.mark.parametrize("k", [0, 5])
def test_linear_layers_as_w_times_x_transposed_equal_transformers_generate(real_model, prompts_and_references, k):
    # Calibration picks that form where this machine runs it faster; force it
    # everywhere (prefill chunks too) so the exactness check does not depend on the machine.
    config = EngineConfig(max_batch_size=5, prefill_chunk_tokens=64)
    engine = SpeculativeEngine(real_model.model, real_model.tokenizer, SessionProposer(NGramDrafter()), config)
    assert engine.kernels is not None
    with engine.kernels.forcing(True):
        results = engine.generate([GenerationRequest(ids, MAX_NEW_TOKENS, num_speculative_tokens=k) for ids, _ in prompts_and_references])
    assert [r.token_ids for r in results] == [expected for _, expected in prompts_and_references]
