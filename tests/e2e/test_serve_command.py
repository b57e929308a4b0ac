"""``specdec serve``: both services from one command, answering over each door, stopped by Ctrl-C."""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import httpx

from specdec.v1 import verifier_pb2 as pb
from specdec.v1 import verifier_pb2_grpc as rpc

# Upper bounds on waiting (the tiny model loads in seconds); never pass/fail thresholds.
READY_TIMEOUT_S = 300
STOP_TIMEOUT_S = 60


def lines_of(process: subprocess.Popen) -> queue.Queue[str | None]:
    """Its stdout, a line at a time, drained until it exits (None at the end)."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def read_until_ready(lines: queue.Queue[str | None]) -> list[str]:
    printed: list[str] = []
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not printed or not printed[-1].startswith("ready:"):
        line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        assert line is not None, f"specdec serve exited before it was ready: {printed}"
        printed.append(line)
    return printed


def test_serve_starts_both_services_answers_on_each_door_and_stops_on_ctrl_c(tiny_model_dir, tmp_path):
    command = [sys.executable, "-m", "specdec", "serve", "--data", str(tmp_path / "data"), "--port", "0", "--http-port", "0"]
    command += ["--model", str(tiny_model_dir), "--no-calibrate", "--metrics-port", "-1"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        printed = read_until_ready(lines_of(process))
        doors = re.search(r"verifier: gRPC (\S+), HTTP (\S+)/v1", "".join(printed))
        assert doors is not None, printed
        assert any(line.startswith("drafter: 127.0.0.1:") for line in printed)
        grpc_address, http = doors.groups()
        with grpc.insecure_channel(grpc_address) as channel:
            answer = rpc.VerifierStub(channel).Generate(pb.GenerateRequest(prompt_token_ids=[5, 9, 14], max_new_tokens=4), timeout=60)
        assert len(answer.token_ids) == 4
        body = {"prompt": [5, 9, 14], "max_tokens": 4, "temperature": 0}
        completion = httpx.post(f"{http}/v1/completions", json=body, timeout=60).json()
        assert completion["choices"][0]["text"] == answer.text  # both doors, the same greedy answer
        assert httpx.get(f"{http}/health", timeout=10).json()["drafter"].startswith("127.0.0.1:")  # it speculates
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=STOP_TIMEOUT_S) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert (tmp_path / "data" / "drafter").is_dir()  # the drafter's tables, kept for the next run
