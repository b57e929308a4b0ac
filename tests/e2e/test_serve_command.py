"""``specdec serve``: both services from one command, answering over each door, stopped by Ctrl-C;
with ``--drafter-replicas``, drafters sharing what they learn through a local observation log."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx

from specdec.v1 import drafter_pb2, drafter_pb2_grpc
from specdec.v1 import verifier_pb2 as pb
from specdec.v1 import verifier_pb2_grpc as rpc

# Upper bounds on waiting (the tiny model loads in seconds); never pass/fail thresholds.
READY_TIMEOUT_S = 300
STOP_TIMEOUT_S = 60
REPLICATED_TIMEOUT_S = 60  # for an observation to reach every replica's table through the log


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


@contextlib.contextmanager
def specdec_serve(data: Path, model_dir: Path, *flags: str) -> Iterator[subprocess.Popen]:
    """``specdec serve`` of the tiny model on free ports, in a process group of its own: whatever
    the test does, every process it started is gone at the end (SIGKILL to the group)."""
    command = [sys.executable, "-m", "specdec", "serve", "--data", str(data), "--port", "0", "--http-port", "0", *flags]
    command += ["--model", str(model_dir), "--no-calibrate", "--metrics-port", "-1"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):  # none left: it stopped them all
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def test_serve_starts_both_services_answers_on_each_door_and_stops_on_ctrl_c(tiny_model_dir, tmp_path):
    with specdec_serve(tmp_path / "data", tiny_model_dir) as process:
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
    assert (tmp_path / "data" / "drafter").is_dir()  # the drafter's tables, kept for the next run


def table_entries(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return drafter_pb2_grpc.DrafterStub(channel).Stats(drafter_pb2.StatsRequest(), timeout=10).entries


def test_serve_with_two_drafter_replicas_teaches_both_what_one_was_told(tiny_model_dir, tmp_path):
    data = tmp_path / "data"
    with specdec_serve(data, tiny_model_dir, "--drafter-replicas", "2") as process:
        printed = "".join(read_until_ready(lines_of(process)))
        drafters = re.findall(r"^drafter: (127\.0\.0\.1:\d+) \(learned tables under (\S+)\)$", printed, re.MULTILINE)
        # The first replica keeps a single drafter's tables; the second has its own.
        assert [folder for _, folder in drafters] == [str(data / "drafter"), str(data / "drafter-1")], printed
        assert re.search(r"^observation log: nats://127\.0\.0\.1:\d+ ", printed, re.MULTILINE), printed
        verifier = re.search(r"verifier: gRPC (\S+),", printed)
        assert verifier is not None, printed
        with grpc.insecure_channel(verifier.group(1)) as channel:
            answer = rpc.VerifierStub(channel).Generate(pb.GenerateRequest(prompt_token_ids=[5, 9, 14], max_new_tokens=16), timeout=60)
        assert len(answer.token_ids) == 16
        # The verifier observes the finished sequence into the one replica it uses; the log
        # brings it to the other, which then holds the same n-grams.
        deadline = time.monotonic() + REPLICATED_TIMEOUT_S
        while (entries := [table_entries(address) for address, _ in drafters])[0] == 0 or len(set(entries)) > 1:
            assert time.monotonic() < deadline, f"the replicas' tables never agreed: {entries} n-grams"
            time.sleep(0.2)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=STOP_TIMEOUT_S) == 0
    assert (data / "drafter-1").is_dir() and (data / "nats" / "jetstream").is_dir()  # kept for the next run


def test_serve_refuses_fewer_than_one_drafter(tmp_path):
    refused = subprocess.run(
        [sys.executable, "-m", "specdec", "serve", "--data", str(tmp_path), "--drafter-replicas", "0"], capture_output=True, text=True
    )
    assert refused.returncode == 2
    assert "--drafter-replicas must be at least 1, got 0" in refused.stderr
    assert not any(tmp_path.iterdir())  # nothing started, nothing written
