"""Fixtures for tests that run the services as processes."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

LONG_CONTEXT = 1 << 16


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
