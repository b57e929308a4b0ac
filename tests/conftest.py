"""Shared fixtures: a tiny seeded random Llama for fast tests, the real default model for equality tests."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

TINY_VOCAB = 64
TINY_EOS = 1
# Examples per fuzzed service in tests/e2e/test_fuzz.py: bounded in `make test`.
DEFAULT_FUZZ_EXAMPLES = 60


def pytest_addoption(parser):
    parser.addoption(
        "--fuzz-examples",
        type=int,
        default=DEFAULT_FUZZ_EXAMPLES,
        help=f"examples each fuzz test sends (default {DEFAULT_FUZZ_EXAMPLES}; thousands for a long run)",
    )


def pytest_collection_modifyitems(config, items):
    """Markers by what a test needs, so ``make test-fast`` can leave out what is slow:
    ``e2e`` (tests/e2e: service processes), ``deploy`` (tests/deploy: validators and
    system tools), ``slow`` (the real model, or marked by hand)."""
    root = config.rootpath / "tests"
    for item in items:
        folder = item.path.relative_to(root).parts[0]
        if folder in ("e2e", "deploy"):
            item.add_marker(folder)
        if "real_model" in getattr(item, "fixturenames", ()):
            item.add_marker("slow")


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer over "t0".."t63": token id i decodes to "t{i}"."""
    vocab = {f"t{i}": i for i in range(TINY_VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=f"t{TINY_EOS}", unk_token="t0")


def build_tiny_model(seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=TINY_EOS,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    # A random init gives nearly uniform next-token distributions; scaling the
    # output layer makes them peaked, like a trained model's, so greedy paths
    # and acceptance are meaningful.
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    return model


@pytest.fixture(scope="session")
def tiny_model() -> LlamaForCausalLM:
    return build_tiny_model()


@pytest.fixture(scope="session")
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def real_model():
    """The default target (SmolLM2-135M-Instruct from its GGUF), converted once per cache folder."""
    from verifier_service.core.model_loading import load_model

    return load_model(device="cpu")
