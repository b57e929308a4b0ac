"""A model that cannot be served stops the verifier at start-up with one clear line, never half-serving."""

from __future__ import annotations

import json
import shutil

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.processes import ServiceProcess
from tests.taken_ports import start_on_a_taken_port

START_TIMEOUT_S = 120
# No port but the gRPC one (free): several start at once.
VERIFIER_ARGS = ("--port", "0", "--metrics-port", "-1", "--http-port", "-1", "--no-calibrate")


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


def last_line(process: ServiceProcess) -> str:
    process.process.wait(timeout=START_TIMEOUT_S)
    return process.log().strip().splitlines()[-1]


def test_each_unservable_model_ends_the_process_with_one_clear_last_line(tiny_model_dir, tmp_path):
    cases = broken_copies(tiny_model_dir, tmp_path)
    processes: list[ServiceProcess] = []
    try:
        for _, model, _ in cases:  # each started before the last is read: most of a start is importing
            processes.append(ServiceProcess("verifier_service", *VERIFIER_ARGS, "--model", str(model)))
        for (name, model, says), process in zip(cases, processes):
            statuses = watch_until_gone(process.port)
            last = last_line(process)
            assert process.process.returncode == 1, (name, process.log())
            assert health_pb2.HealthCheckResponse.SERVING not in statuses, name
            assert last.startswith(f"verifier: cannot serve --model {model}: "), (name, last)
            assert says in last, (name, last)
    finally:
        for process in processes:
            process.kill()


@pytest.mark.parametrize("flag", ["--port", "--http-port", "--metrics-port", "--health-port"])
def test_a_port_already_taken_ends_the_process_with_one_line_naming_its_flag(tiny_model_dir, flag):
    flags = {**dict(zip(VERIFIER_ARGS[::2], VERIFIER_ARGS[1::2])), "--http-port": "0", "--model": str(tiny_model_dir)}
    last, port = start_on_a_taken_port("verifier_service", flags, flag, START_TIMEOUT_S)
    assert last.startswith("verifier: cannot start: cannot listen for "), last
    assert f"127.0.0.1:{port}" in last and f"({flag}: 0 takes a free port" in last, last
