"""Dtypes: which hardware computes bfloat16 natively, and greedy exactness within one dtype."""

from __future__ import annotations

import copy

import pytest
import torch

from drafter_service.sessions import NGramDrafter
from verifier_service.core import model_loading
from verifier_service.core.drafting import SessionProposer
from verifier_service.core.engine import GenerationRequest, SpeculativeEngine
from verifier_service.core.model_loading import has_fast_bfloat16, resolve_dtype

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "flags, expected",
    [
        ({"avx2", "fma"}, False),  # emulated bf16 is slower than float32
        ({"avx2", "avx512f", "avx512_bf16"}, True),
        ({"avx512f", "amx_tile", "amx_bf16"}, True),
        (set(), False),  # unknown CPU
    ],
)
def test_bfloat16_counts_as_fast_only_on_cpus_with_native_bf16(monkeypatch, flags, expected):
    monkeypatch.setattr(model_loading, "cpu_flags", lambda: frozenset(flags))
    assert has_fast_bfloat16(CPU) is expected


def test_dtypes_are_taken_by_name():
    assert resolve_dtype("float32") == torch.float32
    assert resolve_dtype("bfloat16") == torch.bfloat16


def test_an_unknown_dtype_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"dtype must be one of \['bfloat16', 'float32'\], got 'float8'"):
        resolve_dtype("float8")


def test_cpu_flags_reads_this_machines_cpu():
    flags = model_loading.cpu_flags()
    assert isinstance(flags, frozenset)
    assert not flags or any(flag.startswith(("sse", "avx", "neon", "fp", "asimd")) for flag in flags)


def test_bfloat16_speculation_equals_bfloat16_plain_decoding(tiny_model, tiny_tokenizer):
    """Exactness within a dtype: speculative greedy output equals plain greedy output in bf16."""
    model = copy.deepcopy(tiny_model).to(torch.bfloat16)
    engine = SpeculativeEngine(model, tiny_tokenizer, SessionProposer(NGramDrafter()))
    engine.eos_token_ids = frozenset()
    prompts = [[5, 6, 7], [9, 3, 3, 9, 3, 3, 9, 3], [12], [40, 41, 42, 43, 44, 45, 46, 47]]
    plain = engine.generate([GenerationRequest(p, 24, num_speculative_tokens=0) for p in prompts])
    for k in (3, None):
        spec = engine.generate([GenerationRequest(p, 24, num_speculative_tokens=k) for p in prompts])
        assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert engine.cache.keys[0].dtype == torch.bfloat16
