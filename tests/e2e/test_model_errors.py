"""A model that cannot be served stops the verifier at start-up with one clear line, never half-serving."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

START_TIMEOUT_S = 120


def broken_copies(tiny_model_dir, root):
    """(name, --model, what the last line must say) for models that cannot be served."""

    def copy(name):
        target = root / name
        shutil.copytree(tiny_model_dir, target)
        return target

    garbage = copy("garbage-config")
    (garbage / "config.json").write_text("{not json")
    truncated = copy("truncated-weights")
    for weights in truncated.glob("*.safetensors"):
        weights.write_bytes(weights.read_bytes()[:1000])
    dynamic = copy("dynamic-rope")
    config = json.loads((dynamic / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}
    (dynamic / "config.json").write_text(json.dumps(config))
    return [
        ("missing", root / "no-such-model", f"no such directory: {root / 'no-such-model'}"),
        ("garbage config", garbage, "is not a valid JSON file"),
        ("truncated weights", truncated, "Error while deserializing header"),
        ("batch-dependent RoPE", dynamic, "uses 'dynamic' RoPE scaling"),
    ]


def watch_until_gone(port: int) -> list[int]:
    """Every status the verifier's health reports until the process is gone."""
    statuses = []
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            for response in health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=START_TIMEOUT_S):
                statuses.append(response.status)
        except grpc.RpcError as error:
            assert error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), error
    return statuses


def test_each_unservable_model_ends_the_process_with_one_clear_last_line(tiny_model_dir, tmp_path):
    cases = broken_copies(tiny_model_dir, tmp_path)
    processes = [  # all at once: each spends most of its time importing
        subprocess.Popen(
            [sys.executable, "-m", "verifier_service", "--port", "0", "--metrics-port", "-1", "--no-calibrate", "--model", str(model)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _, model, _ in cases
    ]
    try:
        for (name, model, says), process in zip(cases, processes):
            port = int(process.stdout.readline().rsplit(":", 1)[1].split()[0])  # "verifier listening on HOST:PORT (...)"
            statuses = watch_until_gone(port)
            _, stderr = process.communicate(timeout=START_TIMEOUT_S)
            assert process.returncode == 1, (name, stderr)
            assert health_pb2.HealthCheckResponse.SERVING not in statuses, name
            last = stderr.strip().splitlines()[-1]
            assert last.startswith(f"verifier: cannot serve --model {model}: "), (name, last)
            assert says in last, (name, last)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
