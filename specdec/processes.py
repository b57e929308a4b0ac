"""Running the services as child processes: start, read the announced port,
wait for health SERVING, stop. Used by the local demo and the benchmarks."""

from __future__ import annotations

import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

DRAFTER_PORT_LINE = re.compile(r"drafter listening on [\d.]+:(\d+)")
VERIFIER_PORT_LINE = re.compile(r"verifier listening on [\d.]+:(\d+)")
# The drafter opens its tables in well under a second; the verifier loads (on a
# first run also converts) the model after announcing its port.
STARTUP_TIMEOUT_S = 120
HEALTH_TIMEOUT_S = 600
STOP_GRACE_S = 30


def read_lines_in_background(process: subprocess.Popen) -> queue.Queue:
    """Drain the process's stdout forever (a full pipe would block it); lines go to the queue, None at EOF."""
    lines: queue.Queue = queue.Queue()

    def pump():
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def wait_for_port(process: subprocess.Popen, pattern: re.Pattern, timeout_s: float, name: str) -> int:
    lines = read_lines_in_background(process)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise RuntimeError(f"{name} printed no port within {timeout_s} s") from None
        if line is None:
            raise RuntimeError(f"{name} exited with {process.wait()} before printing its port")
        match = pattern.search(line)
        if match:
            return int(match.group(1))


def free_port() -> int:
    """A loopback port that was free a moment ago (for a service that must come back on the same port)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_process(
    name: str, args: list[str], pattern: re.Pattern, timeout_s: float = STARTUP_TIMEOUT_S, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, int]:
    # stderr (the services' logs) goes to our stderr; stdout carries the port line.
    process = subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.PIPE, text=True, env=env)
    try:
        return process, wait_for_port(process, pattern, timeout_s, name)
    except BaseException:
        stop_process(process)
        raise


def stop_process(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def wait_for_serving(target: str, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
    """Poll grpc.health.v1 (service "") until SERVING."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError as error:
                if error.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
            if time.monotonic() > deadline:
                raise RuntimeError(f"{target} not SERVING after {timeout_s} s")
            time.sleep(0.5)
