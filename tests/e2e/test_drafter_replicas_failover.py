"""Drafter replicas: a verifier listing two drafter processes keeps answering, with the same
tokens, while the replica it uses is killed with SIGKILL under continuous traffic."""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from specdec.v1 import drafter_pb2, drafter_pb2_grpc
from specdec.v1 import verifier_pb2 as pb
from specdec.v1 import verifier_pb2_grpc as rpc

from processes import ServiceProcess, free_port, running_tiny_verifier

# Prompts whose greedy continuations on the tiny model cycle without EOS (repetition: drafts to accept).
PROMPTS = [[5, 9, 14, 20], [7, 33, 21, 40, 12], [11, 22, 33, 44], [2, 4, 6, 8]]
NEW_TOKENS = 24
CLIENTS = 4  # requests in flight at once
TRAFFIC_BEFORE_KILL_S = 1.0  # seconds of traffic on the first replica, then as long on the survivor
CALL_TIMEOUT_S = 120  # guards against a hang, not a speed requirement
STARTUP_S = 120


def generate(stub, prompt: list[int], k: int) -> list[int]:
    request = pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=NEW_TOKENS, num_speculative_tokens=k)
    return list(stub.Generate(request, timeout=CALL_TIMEOUT_S).token_ids)


def propose_calls(drafter: ServiceProcess) -> int:
    return drafter_pb2_grpc.DrafterStub(drafter.channel).Stats(drafter_pb2.StatsRequest(), timeout=10).propose_calls


def scraped(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    [value] = re.findall(rf"^{name}\{{[^}}]*\}} (\S+)$", text, flags=re.MULTILINE)
    return float(value)


class Traffic:
    """``CLIENTS`` threads sending greedy requests one after another until ``stop``; every answer and error kept."""

    def __init__(self, stub) -> None:
        self.stub, self.stopping = stub, threading.Event()
        self.answers: list[tuple[int, list[int], float]] = []  # (prompt index, tokens, when the request was sent)
        self.errors: list[BaseException] = []
        self.pool = ThreadPoolExecutor(CLIENTS)

    def start(self) -> None:
        for client in range(CLIENTS):
            self.pool.submit(self._loop, client)

    def _loop(self, client: int) -> None:
        turn = client
        while not self.stopping.is_set():
            index, sent = turn % len(PROMPTS), time.monotonic()
            try:
                self.answers.append((index, generate(self.stub, PROMPTS[index], 4), sent))
            except BaseException as error:  # every failure is the test's to report
                self.errors.append(error)
            turn += 1

    def stop(self) -> None:
        self.stopping.set()
        self.pool.shutdown(wait=True)


def test_killing_the_replica_in_use_fails_no_request_and_changes_no_output(tiny_model_dir, tmp_path):
    drafters: list[ServiceProcess] = []
    metrics_port = free_port()
    try:
        for index in range(2):
            drafters.append(ServiceProcess("drafter_service", "--port", "0", "--metrics-port", "-1", "--db", str(tmp_path / f"db{index}")))
            drafters[-1].wait_until_serving("", STARTUP_S)
        listed = ",".join(drafter.address for drafter in drafters)
        with running_tiny_verifier(tiny_model_dir, "--drafter", listed, "--metrics-port", str(metrics_port)) as verifier:
            verifier.wait_until_serving("", STARTUP_S)
            stub = rpc.VerifierStub(verifier.channel)
            plain = [generate(stub, prompt, 0) for prompt in PROMPTS]
            assert [generate(stub, prompt, 4) for prompt in PROMPTS] == plain  # greedy: drafts never change output
            calls = [propose_calls(drafter) for drafter in drafters]
            [used] = [index for index, count in enumerate(calls) if count]  # the verifier sticks to one replica
            survivor = 1 - used
            assert scraped(metrics_port, "specdec_verifier_drafter_replica") == used

            traffic = Traffic(stub)
            traffic.start()
            try:
                time.sleep(TRAFFIC_BEFORE_KILL_S)
                drafters[used].kill()  # SIGKILL: no goodbye to its clients
                killed_at = time.monotonic()
                time.sleep(TRAFFIC_BEFORE_KILL_S)
            finally:
                traffic.stop()

            assert traffic.errors == []
            assert [tokens for index, tokens, _ in traffic.answers] == [plain[index] for index, _, _ in traffic.answers]
            assert any(sent > killed_at for _, _, sent in traffic.answers), "no request was sent after the kill"
            assert propose_calls(drafters[survivor]) > calls[survivor]  # drafts came from the survivor
            assert scraped(metrics_port, "specdec_verifier_drafter_failovers_total") == 1
            assert scraped(metrics_port, "specdec_verifier_drafter_replica") == survivor
    finally:
        for drafter in drafters:
            drafter.stop()
