"""The verifier with a trained draft head: --draft-head FOLDER, auto from the cache folder,
and a head trained on another model refused at start-up with one clear line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec.v1 import verifier_pb2 as pb
from specdec.v1 import verifier_pb2_grpc as rpc
from tests.conftest import build_tiny_model
from tests.verifier_service.test_draft_head import TRAIN_TEXTS, collected
from verifier_service.core.engine import reference_greedy
from verifier_service.head import train as train_head
from verifier_service.head.model import (
    HEAD_FORMAT,
    MANIFEST,
    DraftHead,
    HeadDrafter,
    HeadManifest,
    cached_head_folder,
    save_head,
    target_fingerprint,
)

from processes import running_tiny_verifier

PROMPT = "t5 t9 t14 t20 t3"
START_TIMEOUT_S = 120


def head_for(model, tokenizer, folder, steps: int = 0):
    """A head for ``model``, trained ``steps`` on its greedy answers (untrained: its drafts
    are verified like any other, so exactness does not depend on what it guesses)."""
    torch.manual_seed(0)
    head = DraftHead(32, 32, 64, 64)
    head.vocab.copy_(torch.arange(64))
    if steps:
        traces = collected(model, tokenizer, TRAIN_TEXTS)
        drafter = HeadDrafter(head, model)
        head.requires_grad_(True)
        examples = train_head.Examples(traces, len(train_head.UNROLL_WEIGHTS))
        train_head.train(head, drafter, examples, train_head.Examples(traces[:2], 1), 600.0, 64, 3e-3, steps=steps)
    save_head(folder, head.eval(), HeadManifest(HEAD_FORMAT, target_fingerprint(model, tokenizer), "", 32, 32, 64, 64))
    return folder


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.mark.parametrize("how", ["folder", "auto"])
def test_a_verifier_with_the_head_answers_exactly_and_drafts_with_it(tiny_model_dir, loaded, tmp_path, how):
    model, tokenizer = loaded
    if how == "folder":
        args, env = ("--draft-head", str(head_for(model, tokenizer, tmp_path / "head", steps=300))), None
    else:  # where train_head stores it by default
        head_for(model, tokenizer, cached_head_folder(tmp_path / "cache", target_fingerprint(model, tokenizer)), steps=300)
        args, env = ("--draft-head", "auto"), {**os.environ, "SPECDEC_CACHE_DIR": str(tmp_path / "cache")}
    with running_tiny_verifier(tiny_model_dir, *args, env=env) as verifier:
        verifier.wait_until_serving("specdec.v1.Verifier", START_TIMEOUT_S)
        assert "draft head from" in verifier.log()
        response = rpc.VerifierStub(verifier.channel).Generate(
            pb.GenerateRequest(prompt=PROMPT, max_new_tokens=24), timeout=START_TIMEOUT_S
        )
        prompt_ids = tokenizer(PROMPT).input_ids
        assert list(response.token_ids) == reference_greedy(model, prompt_ids, 24, frozenset({tokenizer.eos_token_id}))
        assert response.stats.accepted_tokens > 0  # no drafter: every draft was the head's
        chunks = list(
            rpc.VerifierStub(verifier.channel).GenerateStream(pb.GenerateRequest(prompt=PROMPT, max_new_tokens=24), timeout=START_TIMEOUT_S)
        )
        assert [token for chunk in chunks for token in chunk.token_ids] == list(response.token_ids)
        sources = {source for chunk in chunks for source in chunk.token_sources}
        assert pb.TOKEN_SOURCE_HEAD in sources and sources <= {pb.TOKEN_SOURCE_HEAD, pb.TOKEN_SOURCE_TARGET}


def test_without_the_flag_a_cached_head_is_left_alone(tiny_model_dir, loaded, tmp_path):
    model, tokenizer = loaded
    head_for(model, tokenizer, cached_head_folder(tmp_path / "cache", target_fingerprint(model, tokenizer)))
    env = {**os.environ, "SPECDEC_CACHE_DIR": str(tmp_path / "cache")}
    with running_tiny_verifier(tiny_model_dir, env=env) as verifier:
        verifier.wait_until_serving("specdec.v1.Verifier", START_TIMEOUT_S)
        request = pb.GenerateRequest(prompt=PROMPT, max_new_tokens=12)
        assert rpc.VerifierStub(verifier.channel).Generate(request, timeout=START_TIMEOUT_S).stats.draft_tokens == 0
        assert "draft head from" not in verifier.log()


def refused_start(model_dir, head_folder) -> str:
    """Start a verifier with ``--draft-head head_folder``, which must exit 1; the last line it wrote."""
    process = subprocess.run(
        [sys.executable, "-m", "verifier_service", "--port", "0", "--metrics-port", "-1", "--no-calibrate",
         "--model", str(model_dir), "--draft-head", str(head_folder)],
        capture_output=True, text=True, timeout=START_TIMEOUT_S,
    )  # fmt: skip
    assert process.returncode == 1
    return process.stderr.strip().splitlines()[-1]


def test_a_head_trained_on_another_model_stops_the_start_with_one_clear_line(tiny_model_dir, tmp_path):
    folder = head_for(build_tiny_model(seed=3), AutoTokenizer.from_pretrained(tiny_model_dir), tmp_path / "foreign")
    last = refused_start(tiny_model_dir, folder)
    assert last.startswith(f"verifier: cannot serve --model {tiny_model_dir}: {folder} was trained on another target"), last


def widen(folder, width: int) -> None:
    """Rewrite the head's manifest with another ``width`` (its fingerprint stays right)."""
    record = json.loads((folder / MANIFEST).read_text())
    (folder / MANIFEST).write_text(json.dumps({**record, "width": width}))


def test_auto_serves_without_a_cached_head_whose_manifest_is_out_of_range(tiny_model_dir, loaded, tmp_path):
    model, tokenizer = loaded
    widen(head_for(model, tokenizer, cached_head_folder(tmp_path / "cache", target_fingerprint(model, tokenizer))), 2**40)
    env = {**os.environ, "SPECDEC_CACHE_DIR": str(tmp_path / "cache")}
    with running_tiny_verifier(tiny_model_dir, "--draft-head", "auto", env=env) as verifier:
        verifier.wait_until_serving("specdec.v1.Verifier", START_TIMEOUT_S)
        request = pb.GenerateRequest(prompt=PROMPT, max_new_tokens=12)
        assert rpc.VerifierStub(verifier.channel).Generate(request, timeout=START_TIMEOUT_S).stats.draft_tokens == 0
        [line] = [line for line in verifier.log().splitlines() if "draft head" in line]
        assert "the cached draft head is not usable, serving without one" in line and "field width is 1099511627776" in line, line


def test_a_named_head_folder_with_a_bad_manifest_stops_the_start_with_one_clear_line(tiny_model_dir, loaded, tmp_path):
    model, tokenizer = loaded
    folder = head_for(model, tokenizer, tmp_path / "head")
    widen(folder, -1)
    last = refused_start(tiny_model_dir, folder)
    assert last == f"verifier: cannot serve --model {tiny_model_dir}: {folder / MANIFEST}: field width is -1, expected >= 1", last
