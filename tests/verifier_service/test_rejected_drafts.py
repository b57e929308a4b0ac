"""What a step reports about its draft, for the live view: each accepted token's evidence,
and the draft the target turned down (``rejected_line``), on chains and trees, in the
engine and in the HTTP stream's ``specdec`` extension."""

from __future__ import annotations

import contextlib
import copy
import json
from concurrent import futures

import grpc
import pytest
from starlette.testclient import TestClient

from specdec import telemetry
from specdec.v1 import verifier_pb2 as pb
from specdec.v1 import verifier_pb2_grpc as rpc
from tests.verifier_service.test_engine_adaptive import FrozenStepCost, truth
from tests.verifier_service.test_http_api import CAPACITY, completion
from tests.verifier_service.test_trees import FLAT, PROMPTS, engine_for, wrong
from verifier_service.core.drafting import DraftEvidence, ProposedDraft
from verifier_service.core.engine import EngineConfig, GenerationRequest, SpeculativeEngine
from verifier_service.core.generation import SOURCE_DRAFT, SOURCE_TARGET, RejectedDraft
from verifier_service.core.step import rejected_line
from verifier_service.serving.config import VerifierConfig
from verifier_service.serving.metrics import VerifierMetrics
from verifier_service.serving.openai_api import OpenAIApi
from verifier_service.serving.scheduler import Scheduler, SchedulerConfig
from verifier_service.serving.server import VerifierServicer
from verifier_service.serving.service import VerifierService


@pytest.mark.parametrize(
    ("parents", "verified", "path", "line"),
    [
        ([-1, 0, 1, 2], 4, [0], [1, 2, 3]),  # a chain: the rest of it after the accepted token
        ([-1, 0, 1, 2], 2, [0], [1]),  # only what was verified
        ([-1, 0, 1, 2], 4, [], [0, 1, 2, 3]),  # nothing accepted: the whole chain
        ([-1, 0, 1, 2], 4, [0, 1, 2, 3], []),  # everything accepted: nothing turned down
        ([-1, -1, 0, 0, 2], 5, [0], [2, 4]),  # a tree: 0's first child and its first child; 3 is another branch
        ([-1, -1, 0, 0, 2], 5, [1], []),  # the root's second child, accepted: it has no child
    ],
)
def test_rejected_line_is_the_best_guess_after_the_accepted_path(parents, verified, path, line):
    assert rejected_line(parents, verified, path) == line


class ScriptedTrees:
    """Drafts ``shape(the true continuation)`` with evidence for each node: (context, node + 1, 1, 1)."""

    def __init__(self, model, shape):
        self.model, self.shape = model, shape

    def propose(self, requests):
        drafts = []
        for request in requests:
            prompt = next(p for p in PROMPTS if request.tokens[: len(p)] == p)
            tokens, parents = self.shape(truth(self.model, prompt)[len(request.tokens) - len(prompt) :])
            evidence = [DraftEvidence("context", node + 1, 1, 1) for node in range(len(tokens))]
            drafts.append(ProposedDraft(tokens, evidence, parents))
        return drafts

    def close(self, finished) -> None:
        pass


def outcomes_of(engine: SpeculativeEngine, request: GenerationRequest):
    handle, outcomes = engine.add(request), []
    while engine.busy:
        outcomes += [outcome for outcome in engine.step() if outcome.sequence is handle and outcome.tokens and not outcome.first]
    return outcomes


def test_a_chain_reports_what_it_accepted_and_what_it_turned_down(tiny_model, tiny_tokenizer):
    # Two true tokens, then three wrong ones: each step accepts 2 and turns 3 down.
    def shape(path):
        return [path[0], path[1], wrong(path[2]), wrong(path[3]), wrong(path[4])], [-1, 0, 1, 2, 3]

    engine = engine_for(tiny_model, tiny_tokenizer, ScriptedTrees(tiny_model, shape))
    outcomes = outcomes_of(engine, GenerationRequest(PROMPTS[0], 16, num_speculative_tokens=5))
    done = 1
    for outcome in outcomes[:4]:  # 1 token at prefill, then 3 a step; the fifth step has room for 2 drafts only
        path = truth(tiny_model, PROMPTS[0])[done:]
        assert outcome.tokens == path[:3] and outcome.sources == ("context", "context", SOURCE_TARGET)
        assert outcome.evidence == (DraftEvidence("context", 1, 1, 1), DraftEvidence("context", 2, 1, 1), None)
        # Proposed where the target's own token (path[2]) went: the wrong chain from there.
        assert outcome.rejected == tuple(
            RejectedDraft(wrong(path[index]), "context", DraftEvidence("context", index + 1, 1, 1)) for index in (2, 3, 4)
        )
        done += 3


def test_a_tree_turns_down_the_best_guess_after_its_path_and_counts_the_other_branches(tiny_model, tiny_tokenizer):
    # Node 0 true; node 1 (its first child) and node 3 (node 1's child) wrong; node 2 another wrong branch.
    def shape(path):
        return [path[0], wrong(path[1]), wrong(path[1], 2), wrong(path[2])], [-1, 0, 0, 1]

    engine = engine_for(tiny_model, tiny_tokenizer, ScriptedTrees(tiny_model, shape), FrozenStepCost(FLAT), max_adaptive_k=4)
    outcomes = outcomes_of(engine, GenerationRequest(PROMPTS[1], 11, num_speculative_tokens=None))
    done = 1
    for outcome in outcomes[:3]:  # while the tree's depth fits in what is left to generate
        assert outcome.verified == 4  # a flat cost verifies every node
        path = truth(tiny_model, PROMPTS[1])[done:]
        assert outcome.tokens == path[:2] and outcome.accepted == 1
        assert [draft.token for draft in outcome.rejected] == [wrong(path[1]), wrong(path[2])]  # nodes 1 and 3
        assert outcome.verified - outcome.accepted - len(outcome.rejected) == 1  # node 2, on another branch
        done += 2


def test_drafts_without_evidence_are_reported_as_drafts_of_no_source(tiny_model, tiny_tokenizer):
    class Bare(ScriptedTrees):
        def propose(self, requests):
            return [ProposedDraft(draft.tokens, parents=draft.parents) for draft in super().propose(requests)]

    def shape(path):
        return [path[0], wrong(path[1])], [-1, 0]

    engine = engine_for(tiny_model, tiny_tokenizer, Bare(tiny_model, shape))
    [first, *_] = outcomes_of(engine, GenerationRequest(PROMPTS[2], 5, num_speculative_tokens=2))
    assert first.evidence == (None, None) and first.sources == (SOURCE_DRAFT, SOURCE_TARGET)
    assert [(draft.source, draft.evidence) for draft in first.rejected] == [(SOURCE_DRAFT, None)]


@contextlib.contextmanager
def serving_wrong_tails(model, tokenizer):
    """A started service whose drafter offers, each step, the true next token and then two
    wrong ones (context evidence), so every full step accepts one draft and turns down two."""

    def shape(path):
        return [path[0], wrong(path[1]), wrong(path[2])], [-1, 0, 1]

    config = VerifierConfig(engine=EngineConfig(max_batch_size=2, max_sequence_tokens=CAPACITY))
    service = VerifierService(config, telemetry.Tracing("test"), VerifierMetrics(config.model))
    engine = SpeculativeEngine(model, copy.deepcopy(tokenizer), ScriptedTrees(model, shape), config.engine)
    engine.eos_token_ids = frozenset()
    scheduler = Scheduler(engine, SchedulerConfig())
    scheduler.start()
    service.attach(engine, scheduler)
    try:
        yield service
    finally:
        scheduler.stop(1.0)


def test_the_http_stream_carries_each_steps_rejected_draft_and_evidence(tiny_model, tiny_tokenizer):
    with serving_wrong_tails(tiny_model, tiny_tokenizer) as service:
        client = TestClient(OpenAIApi(service, service.config.model).app, base_url="http://localhost")  # a name 127.0.0.1 answers to
        body = completion(prompt=PROMPTS[0], max_tokens=13, stream=True, num_speculative_tokens=3)
        with client.stream("POST", "/v1/completions", json=body) as response:
            lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: {")]
    steps = [chunk["specdec"] for chunk in map(json.loads, lines) if chunk.get("specdec", {}).get("verified")]
    assert len(steps) == 6  # 1 token at prefill, then 2 a step
    decode = tiny_tokenizer.decode
    done = 1
    for step in steps[:4]:  # while the whole draft fits in what is left to generate
        path = truth(tiny_model, PROMPTS[0])[done:]
        assert step["token_ids"] == path[:2] and step["sources"] == ["context", "target"]
        assert step["evidence"] == [{"match_length": 1, "count": 1, "total": 1}, None]
        assert step["rejected_token_ids"] == [wrong(path[1]), wrong(path[2])]
        assert step["rejected_sources"] == ["context", "context"]
        assert step["rejected_evidence"] == [{"match_length": 2, "count": 1, "total": 1}, {"match_length": 3, "count": 1, "total": 1}]
        # Each rejected token's text as it would have read after the accepted one.
        context = PROMPTS[0] + truth(tiny_model, PROMPTS[0])[: done + 1]
        before = decode(context)
        assert "".join(step["rejected_token_texts"]) == decode(context + step["rejected_token_ids"])[len(before) :]
        done += 2


@contextlib.contextmanager
def grpc_door(service):
    """``service``'s gRPC front door on a loopback port, for the duration: a stub to it."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    rpc.add_VerifierServicer_to_server(VerifierServicer(service), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield rpc.VerifierStub(channel)
    finally:
        server.stop(grace=None)


def test_the_grpc_stream_carries_each_steps_rejected_draft(tiny_model, tiny_tokenizer):
    with serving_wrong_tails(tiny_model, tiny_tokenizer) as service, grpc_door(service) as stub:
        request = pb.GenerateRequest(prompt_token_ids=PROMPTS[0], max_new_tokens=13, num_speculative_tokens=3)
        chunks = list(stub.GenerateStream(request, timeout=60))
    truth_path = truth(tiny_model, PROMPTS[0])
    assert [token for chunk in chunks for token in chunk.token_ids] == truth_path[:13]
    steps = [chunk for chunk in chunks if len(chunk.token_ids) == 2]
    assert len(steps) == 6  # 1 token at prefill, then 2 a step
    done = 1
    for chunk in steps[:4]:  # while the whole draft fits in what is left to generate
        path = truth_path[done:]
        assert list(chunk.token_sources) == [pb.TOKEN_SOURCE_CONTEXT, pb.TOKEN_SOURCE_TARGET]
        assert list(chunk.rejected_token_ids) == [wrong(path[1]), wrong(path[2])]
        assert chunk.rejected_token_ids[0] != chunk.token_ids[-1]  # turned down for the target's own token
        assert list(chunk.rejected_token_sources) == [pb.TOKEN_SOURCE_CONTEXT] * 2
        done += 2
    assert not chunks[0].rejected_token_ids  # the prefill's token: no draft
