"""Verifiers on drafter replicas that share one observation log (nats-server with JetStream,
fsync before every acknowledgement): what one verifier teaches its replica drafts warm for a
verifier on another, and a verifier whose replica is killed keeps warm drafts on the survivor.
Every process is started on loopback and stopped by the test."""

from __future__ import annotations

import time

from specdec.processes import LocalNatsServer
from specdec.v1 import drafter_pb2, drafter_pb2_grpc
from specdec.v1 import verifier_pb2 as pb
from specdec.v1 import verifier_pb2_grpc as rpc

from processes import ServiceProcess, running_tiny_verifier

# Prompts whose greedy continuations on the tiny model do not repeat themselves early: drafts
# from the request's own context land little, drafts from what another request taught land.
PROMPTS = [[3, 17, 29, 41, 8, 52], [13, 27, 4, 61, 35, 19], [44, 2, 58, 31, 10, 23]]
NEW_TOKENS = 32
CALL_TIMEOUT_S = 120  # guards against a hang, not a speed requirement
STARTUP_S = 120


def generate(stub, prompt: list[int], k: int | None = 4) -> pb.GenerateResponse:
    request = pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=NEW_TOKENS)
    if k is not None:
        request.num_speculative_tokens = k
    return stub.Generate(request, timeout=CALL_TIMEOUT_S)


def stats(drafter: ServiceProcess) -> drafter_pb2.StatsResponse:
    return drafter_pb2_grpc.DrafterStub(drafter.channel).Stats(drafter_pb2.StatsRequest(), timeout=10)


def replica(tmp_path, nats: LocalNatsServer, name: str) -> ServiceProcess:
    drafter = ServiceProcess("drafter_service", "--port", "0", "--metrics-port", "-1", "--db", str(tmp_path / name), "--log-url", nats.url)
    drafter.wait_until_serving("", STARTUP_S)
    return drafter


def wait_until(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def learned(drafters: list[ServiceProcess]) -> None:
    """Wait until every replica's tables hold the same n-grams, some (applied from the log)."""
    wait_until(lambda: all(stats(drafter).entries > 0 for drafter in drafters), "the replicas to apply the log")
    wait_until(lambda: len({stats(drafter).entries for drafter in drafters}) == 1, "the replicas to hold the same n-grams")


def test_what_a_verifier_teaches_its_replica_drafts_warm_for_a_verifier_on_another(tiny_model_dir, tmp_path):
    nats = LocalNatsServer(tmp_path / "nats")
    drafters: list[ServiceProcess] = []
    try:
        drafters = [replica(tmp_path, nats, name) for name in ("a", "b")]
        with (
            running_tiny_verifier(tiny_model_dir, "--drafter", drafters[0].address) as on_a,
            running_tiny_verifier(tiny_model_dir, "--drafter", drafters[1].address) as on_b,
        ):
            on_a.wait_until_serving("", STARTUP_S)
            on_b.wait_until_serving("", STARTUP_S)
            a, b = rpc.VerifierStub(on_a.channel), rpc.VerifierStub(on_b.channel)
            plain = [list(generate(b, prompt, k=0).token_ids) for prompt in PROMPTS]  # k 0 asks no drafter: teaches nothing
            taught = [generate(a, prompt) for prompt in PROMPTS]
            assert [list(answer.token_ids) for answer in taught] == plain
            learned(drafters)
            hits_before = stats(drafters[1]).global_hits
            warm = [generate(b, prompt) for prompt in PROMPTS]
            assert [list(answer.token_ids) for answer in warm] == plain  # the text is identical
            assert stats(drafters[1]).global_hits > hits_before  # B drafted from what A's verifier taught
            assert sum(answer.stats.accepted_tokens for answer in warm) > sum(answer.stats.accepted_tokens for answer in taught)
    finally:
        for drafter in drafters:
            drafter.stop()
        nats.stop()


def test_a_verifier_whose_replica_is_killed_keeps_serving_with_warm_drafts_on_the_survivor(tiny_model_dir, tmp_path):
    nats = LocalNatsServer(tmp_path / "nats")
    drafters: list[ServiceProcess] = []
    try:
        drafters = [replica(tmp_path, nats, name) for name in ("a", "b")]
        listed = ",".join(drafter.address for drafter in drafters)
        with running_tiny_verifier(tiny_model_dir, "--drafter", listed) as verifier:
            verifier.wait_until_serving("", STARTUP_S)
            stub = rpc.VerifierStub(verifier.channel)
            plain = [list(generate(stub, prompt, k=0).token_ids) for prompt in PROMPTS]
            assert [list(generate(stub, prompt).token_ids) for prompt in PROMPTS] == plain  # teaches the log
            learned(drafters)
            [used] = [index for index, drafter in enumerate(drafters) if stats(drafter).propose_calls]
            survivor = drafters[1 - used]
            hits_before = stats(survivor).global_hits
            drafters[used].kill()  # SIGKILL
            after = [generate(stub, prompt) for prompt in PROMPTS]  # no request may fail
            assert [list(answer.token_ids) for answer in after] == plain
            assert stats(survivor).global_hits > hits_before  # warm: the survivor learned it all from the log
            assert sum(answer.stats.accepted_tokens for answer in after) > 0
    finally:
        for drafter in drafters:
            drafter.stop()
        nats.stop()
