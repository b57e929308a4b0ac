"""specdec.healthcheck, the container health-check command, against a real drafter."""

from __future__ import annotations

import subprocess
import sys
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from processes import free_port, running, running_tiny_verifier


def healthcheck(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdec.healthcheck", *args], capture_output=True, text=True, timeout=60)


def test_healthcheck_passes_on_a_serving_drafter_and_fails_on_nothing(tmp_path):
    with running("drafter_service", "--port", "0", "--db", str(tmp_path / "db"), "--metrics-port", "-1") as drafter:
        assert healthcheck(drafter.address).returncode == 0
        assert healthcheck(drafter.address, "specdec.v1.Drafter").returncode == 0
        unknown = healthcheck(drafter.address, "no.such.Service")
        assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr
    nothing = healthcheck(f"127.0.0.1:{free_port()}")
    assert nothing.returncode == 1 and "UNAVAILABLE" in nothing.stderr
    assert healthcheck().returncode == 2  # usage


# -- the health port answers whatever the service port's load -------------------------------

HEALTH = health_pb2.HealthCheckRequest()


def fill_with_stalled_calls(service, method: str, refused) -> tuple[list, threading.Event]:
    """Start calls of ``method`` on the service port that send their headers and never
    their request (each holds a worker thread and an RPC slot while the server waits for
    it, as a slow Generate would) until a health Check there fails as ``refused(error)``
    says it must. Reflection and Watch streams cannot fill a port: they have threads of their own."""
    health = health_pb2_grpc.HealthStub(service.channel)
    stalled = service.channel.stream_stream(method)  # the request is never sent: no serializer needed
    release, calls = threading.Event(), []

    def nothing():
        release.wait(120)
        yield from ()

    for _ in range(64):
        try:
            health.Check(HEALTH, timeout=2)
        except grpc.RpcError as error:
            assert refused(error), f"{error.code().name}: {error.details()}"
            return calls, release
        calls.append(stalled(nothing(), timeout=120))
    pytest.fail("the service port never filled up")


def assert_health_port_serves(port: int, service: str) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for name in ("", service):
            assert stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
    assert healthcheck(f"127.0.0.1:{port}").returncode == 0


def assert_health_port_answers_when_full(service, health_port: int, full_at: int, method: str, name: str) -> None:
    """Fill ``service``'s worker threads (``full_at`` stalled calls of ``method``, then a Check
    there waits past its deadline) and check that the health port still says SERVING."""
    service.wait_until_serving("", timeout_s=120)
    calls, release = fill_with_stalled_calls(service, method, lambda error: error.code() == grpc.StatusCode.DEADLINE_EXCEEDED)
    try:
        assert len(calls) == full_at
        assert_health_port_serves(health_port, name)
    finally:
        release.set()


def test_the_verifiers_health_port_answers_while_its_worker_threads_are_all_busy(tiny_model_dir):
    health_port = free_port()
    with running_tiny_verifier(
        tiny_model_dir,
        "--max-batch-size",
        "1",
        "--max-queued",
        "1",
        "--health-port",
        str(health_port),
    ) as verifier:
        # Worker threads: --max-batch-size + --max-queued + 8 = 10, all taken.
        assert_health_port_answers_when_full(verifier, health_port, 10, "/specdec.v1.Verifier/Generate", "specdec.v1.Verifier")
        # The start-up log says the configuration the flags made.
        assert "effective config" in verifier.log()
        log = verifier.log()
        assert "max_batch_size=1," in log and "SchedulerConfig(max_queued=1)" in log and f"health_port={health_port}" in log


def test_the_drafters_health_port_answers_while_its_worker_threads_are_all_busy(tmp_path):
    health_port = free_port()
    with running(
        "drafter_service",
        *("--port", "0", "--db", str(tmp_path / "db"), "--metrics-port", "-1", "--health-port", str(health_port)),
        *("--max-workers", "16"),
    ) as drafter:
        # All 16 worker threads taken: a Check on the service port waits past its deadline.
        assert_health_port_answers_when_full(drafter, health_port, 16, "/specdec.v1.Drafter/Stats", "specdec.v1.Drafter")
