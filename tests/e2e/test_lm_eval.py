"""lm-eval's ``local-completions`` against a live verifier: a tiny multiple-choice task scored
by log-likelihood (``echo``, ``logprobs: 1``, ``max_tokens: 1``, a list of token-id prompts a
request), each choice's log-likelihood equal to transformers' own within 1e-4."""

from __future__ import annotations

import json
import math

import lm_eval
import pytest
import torch
from lm_eval.api.registry import get_model
from lm_eval.tasks import TaskManager

from processes import HttpVerifier

# Contexts and choices in the tiny tokenizer's words ("t5 t9" reads as [5, 9]).
DOCS = [
    {"context": "t5 t9 t14", "choices": ["t20", "t7", "t33 t2"], "answer": 0},
    {"context": "t3 t8", "choices": ["t11", "t12 t13"], "answer": 1},
    {"context": "t40 t41 t42 t43 t44", "choices": ["t45", "t1", "t60"], "answer": 2},
    {"context": "t6", "choices": ["t6 t6", "t9"], "answer": 0},
]
TASK = "specdec_tiny_choice"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    verifier = HttpVerifier(tiny_model_dir, "--max-choices", "8", "--max-requests-per-caller", "16")
    try:
        yield verifier
    finally:
        verifier.process.stop()


def task_folder(folder) -> str:
    """A task of DOCS as a local JSON data set: lm-eval's YAML config, the data beside it."""
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    config = {
        "task": TASK,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{context}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}",
        "metric_list": [{"metric": "acc"}],
    }
    (folder / f"{TASK}.yaml").write_text(json.dumps(config))  # JSON is YAML
    return str(folder)


def test_local_completions_log_likelihoods_equal_transformers(server, tiny_model, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    lm = get_model("local-completions")(
        base_url=server.base + "/v1/completions",
        model=server.model,
        tokenizer=str(tiny_model_dir),
        tokenizer_backend="huggingface",
        batch_size=4,  # four prompts a request: the list of token-id lists vLLM takes
        max_retries=1,
    )
    results = lm_eval.simple_evaluate(
        model=lm, tasks=[TASK], task_manager=TaskManager(include_path=task_folder(tmp_path)), log_samples=True
    )
    samples = results["samples"][TASK]
    assert len(samples) == len(DOCS)
    checked = 0
    for sample in samples:
        # Per choice: its (context, continuation), and the responses to it: [(log-likelihood, greedy)].
        for (context, continuation), [(loglikelihood, _)] in zip(sample["arguments"], sample["resps"]):
            context_ids, continuation_ids = lm._encode_pair(context, continuation)
            assert context_ids and continuation_ids
            tokens = context_ids + continuation_ids
            with torch.inference_mode():
                full = torch.log_softmax(tiny_model(input_ids=torch.tensor([tokens])).logits[0].float(), dim=-1)
            expected = sum(float(full[len(context_ids) - 1 + index, token]) for index, token in enumerate(continuation_ids))
            assert math.isclose(float(loglikelihood), expected, abs_tol=1e-4), (context, continuation, loglikelihood, expected)
            checked += 1
    assert checked == sum(len(doc["choices"]) for doc in DOCS)
    assert 0.0 <= results["results"][TASK]["acc,none"] <= 1.0
