"""Fixtures for tests that run the services as processes."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
from transformers import AutoTokenizer

LONG_CONTEXT = 1 << 16
# Joins the messages' contents: the tiny tokenizer reads "t5 t9" as tokens [5, 9].
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
HTTP_PORT_VARIABLE = "SPECDEC_VERIFIER_HTTP_PORT"


@pytest.fixture(scope="module", autouse=True)
def no_http_api_unless_asked():
    """Verifiers these tests start serve no HTTP API unless a test passes --http-port:
    several at once would all try the default port, 8000. Per module, so the variable
    is gone again for the tests outside tests/e2e that run after them."""
    previous = os.environ.get(HTTP_PORT_VARIABLE)
    os.environ[HTTP_PORT_VARIABLE] = "-1"
    yield
    if previous is None:
        del os.environ[HTTP_PORT_VARIABLE]
    else:
        os.environ[HTTP_PORT_VARIABLE] = previous


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_model, tiny_tokenizer) -> Path:
    """The tiny seeded Llama and its tokenizer on disk, for ``--model``."""
    directory = tmp_path_factory.mktemp("tiny-model")
    tiny_model.save_pretrained(directory)
    tiny_tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def long_tiny_model_dir(tmp_path_factory, tiny_model, tiny_tokenizer) -> Path:
    """The same weights with a 64k context: Llama's rotary positions do not depend on the limit."""
    directory = tmp_path_factory.mktemp("tiny-model-long")
    model = copy.deepcopy(tiny_model)
    model.config.max_position_embeddings = LONG_CONTEXT
    model.save_pretrained(directory)
    tiny_tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory, long_tiny_model_dir) -> Path:
    """The long-context tiny model with a chat template, for the HTTP API's chat completions."""
    directory = tmp_path_factory.mktemp("tiny-chat")
    for path in long_tiny_model_dir.iterdir():
        (directory / path.name).write_bytes(path.read_bytes())
    tokenizer = AutoTokenizer.from_pretrained(long_tiny_model_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory
