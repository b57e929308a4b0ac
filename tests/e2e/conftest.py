"""Fixtures for tests that run the services as processes."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_model, tiny_tokenizer) -> Path:
    """The tiny seeded Llama and its tokenizer on disk, for ``--model``."""
    directory = tmp_path_factory.mktemp("tiny-model")
    tiny_model.save_pretrained(directory)
    tiny_tokenizer.save_pretrained(directory)
    return directory
