"""Reflection as stock clients use it, on both services as processes: grpcurl resolves the
service by server reflection on every run, so a burst of runs from one host is a burst of
reflection streams. They all succeed, even while idle streams hold every reflection thread."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from processes import running, running_tiny_verifier

GRPCURL = Path(sys.executable).parent / "grpcurl"
BURST = 32
IDLE = 8  # --max-auxiliary-streams' default: every reflection thread held
CALL_TIMEOUT_S = 120
VOCABULARY = "00112233445566aa"


def hold_idle_streams(address: str, count: int, release: threading.Event) -> tuple[list[threading.Thread], list[str]]:
    """``count`` reflection streams, each asking ListServices once and then silent until
    ``release``; returns their threads once all were answered, and their outcomes."""
    answered, outcomes = threading.Semaphore(0), []

    def requests():
        yield reflection_pb2.ServerReflectionRequest(list_services="")
        release.wait(CALL_TIMEOUT_S)

    def hold() -> None:
        with grpc.insecure_channel(address) as channel:
            try:
                for _ in reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(requests(), timeout=CALL_TIMEOUT_S):
                    answered.release()
                outcomes.append("OK")
            except grpc.RpcError as error:
                outcomes.append(error.code().name)

    threads = [threading.Thread(target=hold) for _ in range(count)]
    for thread in threads:
        thread.start()
    for _ in range(count):
        assert answered.acquire(timeout=CALL_TIMEOUT_S), "an idle stream was never answered"
    return threads, outcomes


def grpcurl_burst(address: str, calls: list[list[str]]) -> list[subprocess.CompletedProcess]:
    """``BURST`` grpcurl runs started at once, cycling through ``calls``, each on its own connection."""
    chosen = [calls[i % len(calls)] for i in range(BURST)]
    commands = [[str(GRPCURL), "-plaintext", "-max-time", "60", *call[:-1], address, call[-1]] for call in chosen]
    processes = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for command in commands]
    results = []
    for command, process in zip(commands, processes, strict=True):
        stdout, stderr = process.communicate(timeout=CALL_TIMEOUT_S)
        results.append(subprocess.CompletedProcess(command, process.returncode, stdout, stderr))
    return results


def assert_burst_succeeds_beside_idle_streams(address: str, calls: list[list[str]], service: str) -> list[subprocess.CompletedProcess]:
    release = threading.Event()
    threads, outcomes = hold_idle_streams(address, IDLE, release)
    try:
        results = grpcurl_burst(address, calls)
    finally:
        release.set()
        for thread in threads:
            thread.join(CALL_TIMEOUT_S)
    failed = [result.stderr for result in results if result.returncode != 0]
    assert not failed, f"{len(failed)} of {BURST} grpcurl runs failed: {failed[:3]}"
    listed = [result.stdout.split() for result in results if result.args[-1] == "list"]
    assert listed and all(service in names and "grpc.health.v1.Health" in names for names in listed)
    # The burst's streams took the idle ones' threads: those were cut (Was: every run refused).
    assert len(outcomes) == IDLE and "CANCELLED" in outcomes and set(outcomes) <= {"CANCELLED", "OK"}
    return results


def test_a_burst_of_grpcurl_runs_from_one_host_all_succeed_on_the_drafter(tmp_path):
    stats = ["-d", json.dumps({"vocabulary": VOCABULARY}), "specdec.v1.Drafter/Stats"]
    with running("drafter_service", "--port", "0", "--db", str(tmp_path / "db"), "--metrics-port", "-1") as drafter:
        drafter.wait_until_serving("specdec.v1.Drafter", CALL_TIMEOUT_S)
        results = assert_burst_succeeds_beside_idle_streams(drafter.address, [["list"], stats], "specdec.v1.Drafter")
        answers = [json.loads(result.stdout) for result in results if result.args[-1] == "specdec.v1.Drafter/Stats"]
        assert len(answers) == BURST // 2 and all(answer.get("entries", 0) == 0 for answer in answers)  # an empty drafter's Stats


def test_a_burst_of_grpcurl_runs_from_one_host_all_succeed_on_the_verifier(tiny_model_dir):
    with running_tiny_verifier(tiny_model_dir) as verifier:
        verifier.wait_until_serving("specdec.v1.Verifier", CALL_TIMEOUT_S)
        results = assert_burst_succeeds_beside_idle_streams(
            verifier.address, [["list"], ["grpc.health.v1.Health/Check"]], "specdec.v1.Verifier"
        )
        checks = [json.loads(result.stdout) for result in results if result.args[-1] == "grpc.health.v1.Health/Check"]
        assert checks == [{"status": "SERVING"}] * (BURST // 2)
