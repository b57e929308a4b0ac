"""Greedy equality with transformers' generate on the real default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import inspect
import textwrap

import pytest
import torch

from drafter_service.ngram import NGramDrafter
from verifier_service.drafting import SessionProposer
from verifier_service.engine import GenerationRequest, SpeculativeEngine
from verifier_service.model_loading import chat_prompt_ids

MAX_NEW_TOKENS = 40
PROMPTS = [
    "What is the capital of France?",
    "Repeat exactly: the cat sat on the mat, the cat sat on the mat.",
    "Rewrite this function with `text` renamed to `source`:\n" + textwrap.dedent(inspect.getsource(textwrap.indent)),
    "Write a haiku about autumn.",
]


@pytest.fixture(scope="module")
def prompts_and_references(real_model):
    model, tokenizer = real_model.model, real_model.tokenizer
    cases = []
    for prompt in PROMPTS:
        ids = chat_prompt_ids(tokenizer, prompt)
        output = model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=MAX_NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.eos_token_id,
        )
        cases.append((ids, output[0, len(ids) :].tolist()))
    return cases


@pytest.mark.parametrize("k", [1, 3, 5, 8])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_greedy_output_equals_transformers_generate(real_model, prompts_and_references, k, batch_size):
    engine = SpeculativeEngine(real_model.model, real_model.tokenizer, SessionProposer(NGramDrafter()))
    requests = [GenerationRequest(ids, MAX_NEW_TOKENS, num_speculative_tokens=k) for ids, _ in prompts_and_references]
    if batch_size == 1:
        results = [engine.generate([request])[0] for request in requests]
    else:
        results = engine.generate(requests)
    for (_, expected), result in zip(prompts_and_references, results):
        assert result.token_ids == expected
    # The copy-heavy prompts must really have exercised acceptance.
    assert sum(r.stats.accepted_tokens for r in results) > 0


def test_plain_path_equals_transformers_generate(real_model, prompts_and_references):
    engine = SpeculativeEngine(real_model.model, real_model.tokenizer, SessionProposer(NGramDrafter()))
    results = engine.generate([GenerationRequest(ids, MAX_NEW_TOKENS, num_speculative_tokens=0) for ids, _ in prompts_and_references])
    assert [r.token_ids for r in results] == [expected for _, expected in prompts_and_references]
    assert all(r.stats.draft_tokens == 0 for r in results)


def test_converted_cache_matches_loading_the_gguf_directly(real_model):
    """The cached safetensors conversion gives the same logits as transformers' own GGUF load."""
    from transformers import AutoModelForCausalLM

    from verifier_service.model_loading import find_default_gguf

    gguf = find_default_gguf()
    direct = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = torch.tensor([chat_prompt_ids(real_model.tokenizer, "Hello")])
    with torch.inference_mode():
        assert torch.equal(real_model.model(ids).logits, direct(ids).logits)
