"""/v1/completions scoring prompts as lm-eval's ``local-completions`` asks: ``echo`` with
``logprobs`` (the prompt's log-probabilities, then the completion's), ``max_tokens`` 0, and a
list of prompts in one request, against one plain forward pass of the tiny model."""

from __future__ import annotations

import pytest
import torch

from tests.verifier_service.test_http_api import api, assert_openai_error, chat_tokenizer, completion, started
from verifier_service.core.engine import EngineConfig

__all__ = ["chat_tokenizer"]  # the fixture, shared

PROMPTS = [[5, 9, 14, 20, 7], [3, 8], [11, 12, 13]]


@pytest.fixture(scope="module")
def scoring_service(tiny_model, chat_tokenizer):
    """Places for 6 choices a request and a batch of 2, so a list's prompts queue behind each other."""
    service = started(tiny_model, chat_tokenizer, max_requests_per_caller=6, max_choices=6)
    yield service
    service.scheduler.stop(1.0)


@pytest.fixture(scope="module")
def scoring(scoring_service):
    return api(scoring_service)


@torch.inference_mode()
def logprobs_of(model, tokens: list[int]) -> list[float]:
    """Each token's log-probability after the ones before it, by one plain forward pass (the first's: none)."""
    full = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0].float(), dim=-1)
    return [float(full[position, tokens[position + 1]]) for position in range(len(tokens) - 1)]


def test_echo_with_logprobs_scores_the_prompt_then_the_completion(scoring, tiny_model):
    answer = scoring.post("/v1/completions", json=completion(prompt=PROMPTS[0], max_tokens=3, logprobs=2, echo=True)).json()
    [choice] = answer["choices"]
    logprobs = choice["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    plain = scoring.post("/v1/completions", json=completion(prompt=PROMPTS[0], max_tokens=3, logprobs=2)).json()["choices"][0]
    assert len(logprobs["tokens"]) == len(PROMPTS[0]) + 3 == answer["usage"]["total_tokens"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None  # the first token has no context
    prompt_part = logprobs["token_logprobs"][1 : len(PROMPTS[0])]
    assert prompt_part == pytest.approx(logprobs_of(tiny_model, PROMPTS[0]), abs=1e-5)
    assert all(len(top) == 2 for top in logprobs["top_logprobs"][1:])
    # The completion's part is what logprobs without echo gives.
    # (A token's text is what it adds after the tokens before it: after the prompt, the word-level
    # tokenizer's first completion token adds its separating space.)
    assert [text.strip() for text in logprobs["tokens"][len(PROMPTS[0]) :]] == [text.strip() for text in plain["logprobs"]["tokens"]]
    assert logprobs["token_logprobs"][len(PROMPTS[0]) :] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-5)
    assert choice["text"].endswith(plain["text"])
    assert logprobs["text_offset"] == [sum(map(len, logprobs["tokens"][:index])) for index in range(len(logprobs["tokens"]))]


def test_max_tokens_zero_with_echo_scores_the_prompt_alone(scoring, tiny_model):
    answer = scoring.post("/v1/completions", json=completion(prompt=PROMPTS[0], max_tokens=0, logprobs=1, echo=True)).json()
    [choice] = answer["choices"]
    assert choice["finish_reason"] == "length" and answer["usage"] == {"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5}
    scores = choice["logprobs"]["token_logprobs"]
    assert scores[0] is None and scores[1:] == pytest.approx(logprobs_of(tiny_model, PROMPTS[0]), abs=1e-5)
    bare = scoring.post("/v1/completions", json=completion(prompt=PROMPTS[0], max_tokens=0, echo=True)).json()["choices"][0]
    assert bare["text"] == choice["text"] and bare["logprobs"] is None  # the echo alone
    error = assert_openai_error(scoring.post("/v1/completions", json=completion(max_tokens=0)), 400)
    assert error["param"] == "max_tokens" and "echo" in error["message"]


def test_a_list_of_prompts_answers_a_choice_per_prompt_in_order(scoring, tiny_model):
    """As lm-eval sends them: token-id lists, max_tokens 1, logprobs 1, echo. Each choice is its own prompt's."""
    body = {"prompt": PROMPTS, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    answer = scoring.post("/v1/completions", json=body).json()
    assert [choice["index"] for choice in answer["choices"]] == [0, 1, 2]
    for prompt, choice in zip(PROMPTS, answer["choices"]):
        single = scoring.post("/v1/completions", json=body | {"prompt": prompt}).json()["choices"][0]
        assert choice["text"] == single["text"]
        assert choice["logprobs"]["token_logprobs"][1 : len(prompt)] == pytest.approx(logprobs_of(tiny_model, prompt), abs=1e-5)
    assert answer["usage"]["prompt_tokens"] == sum(map(len, PROMPTS)) and answer["usage"]["completion_tokens"] == 3


def test_strings_and_n_choices_per_prompt_in_vllms_order(scoring):
    answer = scoring.post("/v1/completions", json=completion(prompt=["t5 t9", [3, 8]], n=2, max_tokens=3, echo=True)).json()
    texts = [choice["text"] for choice in answer["choices"]]
    assert [choice["index"] for choice in answer["choices"]] == [0, 1, 2, 3]
    bodies = [completion(prompt=prompt, max_tokens=3, echo=True) for prompt in ("t5 t9", [3, 8])]
    singles = [scoring.post("/v1/completions", json=body).json() for body in bodies]
    # Greedy: a prompt's n choices agree, and prompt i's come at 2i and 2i+1.
    assert texts == [singles[0]["choices"][0]["text"]] * 2 + [singles[1]["choices"][0]["text"]] * 2
    assert answer["usage"]["prompt_tokens"] == sum(single["usage"]["prompt_tokens"] for single in singles)  # each prompt once


@pytest.mark.parametrize(
    ("prompt", "says"),
    [
        ([[5, 9], [5, 999]], "prompt[1]: prompt: token ids outside the vocabulary"),
        ([[5, 9], []], "prompt[1]: prompt is empty"),
        ([[5], 7], "prompt must be a string, a list of token ids, or a list of either"),
        ([[5], [True]], "prompt must be a string, a list of token ids, or a list of either"),
        (["t5", "t5 " * 400], "prompt[1]: prompt is 1200 characters"),
    ],
)
def test_a_bad_prompt_in_a_list_is_a_400_naming_it(scoring, prompt, says):
    error = assert_openai_error(scoring.post("/v1/completions", json=completion(prompt=prompt)), 400)
    assert error["param"] == "prompt" and says in error["message"], error


def test_a_list_counts_its_prompts_as_choices(scoring):
    error = assert_openai_error(scoring.post("/v1/completions", json=completion(prompt=[[5]] * 4, n=2)), 400)
    assert error["param"] == "prompt" and "at most 3" in error["message"], error


def test_streaming_echo_with_logprobs_is_refused_with_a_way_out(scoring):
    error = assert_openai_error(scoring.post("/v1/completions", json=completion(echo=True, logprobs=1, stream=True)), 400)
    assert error["param"] == "stream" and "set stream to false" in error["message"]


def test_prompt_logprobs_over_the_bound_are_a_400(tiny_model, chat_tokenizer):
    service = started(tiny_model, chat_tokenizer)
    service.engine.config = EngineConfig(max_batch_size=2, max_sequence_tokens=256, max_prompt_logprobs_tokens=4)
    try:
        error = assert_openai_error(api(service).post("/v1/completions", json=completion(prompt=PROMPTS[0], echo=True, logprobs=0)), 400)
        assert error["param"] == "prompt_logprobs" and "--max-prompt-logprobs-tokens" in error["message"], error
    finally:
        service.scheduler.stop(1.0)


def test_vllms_prompt_logprobs_field_in_vllms_shape(scoring, tiny_model, chat_tokenizer):
    """None first; then per prompt token a dict of token id -> {logprob, rank, decoded_token}:
    the prompt's own token (its true rank among the vocabulary) and the top 2 (ranks 1, 2)."""
    body = completion(prompt=PROMPTS[0], max_tokens=1, prompt_logprobs=2)
    choice = scoring.post("/v1/completions", json=body).json()["choices"][0]
    shown = choice["prompt_logprobs"]
    assert shown[0] is None and len(shown) == len(PROMPTS[0])
    with torch.inference_mode():
        full = torch.log_softmax(tiny_model(input_ids=torch.tensor([PROMPTS[0]])).logits[0].float(), dim=-1)
    for position, entries in enumerate(shown[1:]):
        token = PROMPTS[0][position + 1]
        row = full[position]
        own = entries[str(token)]
        assert own["logprob"] == pytest.approx(float(row[token]), abs=1e-5)
        assert own["rank"] == int((row >= row[token]).sum()) and own["decoded_token"] == chat_tokenizer.decode([token])
        best = row.topk(2).indices.tolist()
        assert [entries[str(best[0])]["rank"], entries[str(best[1])]["rank"]] == [1, 2]
        assert len(entries) == 3 - (token in best)
    assert "logprobs" in choice and choice["logprobs"] is None  # the legacy field only with logprobs
    plain = scoring.post("/v1/completions", json=completion(prompt=PROMPTS[0], max_tokens=1)).json()["choices"][0]
    assert "prompt_logprobs" not in plain and plain["text"] == choice["text"]


def test_echo_logprobs_and_prompt_logprobs_each_show_their_own_count(scoring):
    body = completion(prompt=PROMPTS[0], max_tokens=0, echo=True, logprobs=1, prompt_logprobs=3)
    choice = scoring.post("/v1/completions", json=body).json()["choices"][0]
    assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"][1:])
    assert all(len(entries) >= 3 for entries in choice["prompt_logprobs"][1:])
    legacy = choice["logprobs"]["token_logprobs"][1:]
    assert legacy == [entries[str(token)]["logprob"] for entries, token in zip(choice["prompt_logprobs"][1:], PROMPTS[0][1:])]
    streamed = scoring.post("/v1/completions", json=completion(prompt_logprobs=1, stream=True))
    assert assert_openai_error(streamed, 400)["param"] == "stream"
    assert assert_openai_error(scoring.post("/v1/completions", json=completion(prompt_logprobs=21)), 400)["param"] == "prompt_logprobs"
