"""The prompt's log-probabilities, computed in the prefill's own passes, against one plain forward pass."""

from __future__ import annotations

import pytest
import torch

from drafter_service.sessions import NGramDrafter
from verifier_service.core.drafting import SessionProposer
from verifier_service.core.engine import FINISH_LENGTH, EngineConfig, GenerationRequest, SpeculativeEngine
from verifier_service.core.errors import InvalidRequest

PROMPT = [40, 41, 7, 43, 9, 45, 46, 12, 48, 3, 50, 51, 5]  # 13 tokens: several chunks of 5
NO_EOS: frozenset[int] = frozenset()


@torch.inference_mode()
def recomputed(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: log_softmax of one plain forward pass; row p scores token p + 1."""
    logits = model(input_ids=torch.tensor([prompt]), use_cache=False).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def engine(model, tokenizer, **config) -> SpeculativeEngine:
    built = SpeculativeEngine(model, tokenizer, SessionProposer(NGramDrafter()), EngineConfig(**config))
    built.eos_token_ids = NO_EOS  # random weights: keep sequences running to max_new_tokens
    return built


def assert_scores(items, model, prompt, top):
    expected = recomputed(model, prompt)
    assert [item.token for item in items] == prompt[1:]  # the first token has no context, so no log-probability
    for position, item in enumerate(items):
        assert item.logprob == pytest.approx(float(expected[position, prompt[position + 1]]), abs=1e-5)
        values, ids = expected[position].topk(top)
        assert [token for token, _ in item.top] == ids.tolist()
        assert [value for _, value in item.top] == pytest.approx(values.tolist(), abs=1e-5)


@pytest.mark.parametrize("chunk", [3, 5, 256])
def test_prompt_logprobs_equal_a_plain_recompute_across_chunks(tiny_model, tiny_tokenizer, chunk):
    built = engine(tiny_model, tiny_tokenizer, prefill_chunk_tokens=chunk)
    [result] = built.generate([GenerationRequest(PROMPT, 4, prompt_logprobs=3)])
    assert_scores(result.prompt_logprobs, tiny_model, PROMPT, 3)
    plain = engine(tiny_model, tiny_tokenizer).generate([GenerationRequest(PROMPT, 4)])[0]
    assert result.token_ids == plain.token_ids  # asking changes nothing generated


def test_prompt_logprobs_beside_decoding_and_prefilling_batch_mates(tiny_model, tiny_tokenizer):
    """One prompt scored while another decodes with drafts and a third prefills in the same
    passes; each prompt's scores are its own, and the others' outputs are unchanged."""
    prompts = [[9, 3, 3, 9, 3, 3, 9, 3], PROMPT, [5, 6, 7, 8, 9, 10, 11]]
    requests = [
        GenerationRequest(prompts[0], 12, num_speculative_tokens=3),
        GenerationRequest(prompts[1], 5, prompt_logprobs=2, logprobs=1),
        GenerationRequest(prompts[2], 6, prompt_logprobs=0),
    ]
    results = engine(tiny_model, tiny_tokenizer, prefill_chunk_tokens=4).generate(requests)
    assert results[0].prompt_logprobs is None
    assert_scores(results[1].prompt_logprobs, tiny_model, prompts[1], 2)
    assert_scores(results[2].prompt_logprobs, tiny_model, prompts[2], 0)
    alone = [engine(tiny_model, tiny_tokenizer).generate([GenerationRequest(p, r.max_new_tokens)])[0] for p, r in zip(prompts, requests)]
    assert [result.token_ids for result in results] == [result.token_ids for result in alone]


def test_max_new_tokens_zero_scores_the_prompt_and_generates_nothing(tiny_model, tiny_tokenizer):
    built = engine(tiny_model, tiny_tokenizer, prefill_chunk_tokens=4)
    [result] = built.generate([GenerationRequest(PROMPT, 0, prompt_logprobs=1)])
    assert (result.token_ids, result.finish_reason) == ([], FINISH_LENGTH)
    assert_scores(result.prompt_logprobs, tiny_model, PROMPT, 1)
    assert built.free_slots == built.config.max_batch_size and not built.busy
    [one] = built.generate([GenerationRequest([7], 0, prompt_logprobs=0)])
    assert one.prompt_logprobs == []  # a one-token prompt has nothing to score


@pytest.mark.parametrize(
    ("request_", "field", "says"),
    [
        (GenerationRequest(PROMPT, 0), "max_new_tokens", "only to score the prompt"),
        (GenerationRequest(PROMPT, 1, prompt_logprobs=21), "prompt_logprobs", "[0, 20]"),
        (GenerationRequest(PROMPT, 1, prompt_logprobs=1), "prompt_logprobs", "--max-prompt-logprobs-tokens"),
    ],
)
def test_prompt_logprobs_bounds(tiny_model, tiny_tokenizer, request_, field, says):
    built = engine(tiny_model, tiny_tokenizer, max_prompt_logprobs_tokens=len(PROMPT) - 1 if request_.prompt_logprobs == 1 else 4096)
    with pytest.raises(InvalidRequest) as raised:
        built.add(request_)
    assert raised.value.field == field and says in str(raised.value)
    assert built.free_slots == built.config.max_batch_size


def test_a_failure_scoring_one_prompt_ends_that_request_alone(tiny_model, tiny_tokenizer, monkeypatch):
    built = engine(tiny_model, tiny_tokenizer)
    broken, kept = GenerationRequest(PROMPT, 3, prompt_logprobs=1), GenerationRequest([5, 6, 7], 3)
    original = built._keep_prompt_logprobs

    def fails_for_broken(sequence, first, logits):
        if sequence.request is broken:
            raise RuntimeError("out of memory")
        original(sequence, first, logits)

    monkeypatch.setattr(built, "_keep_prompt_logprobs", fails_for_broken)
    built.add(broken)
    handle = built.add(kept)
    outcomes = []
    while built.busy:
        outcomes += built.step()
    errors = [outcome for outcome in outcomes if outcome.error is not None]
    assert [outcome.sequence.request for outcome in errors] == [broken] and "out of memory" in str(errors[0].error)
    [finished] = [outcome.result for outcome in outcomes if outcome.sequence is handle and outcome.result is not None]
    assert len(finished.token_ids) == 3
