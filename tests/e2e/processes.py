"""The end-to-end tests' process helpers: ``specdec.processes``, plus a tiny verifier
and one that serves the OpenAI-compatible HTTP API."""

from __future__ import annotations

import openai

from specdec.processes import STOP_TIMEOUT_S, ServiceProcess, free_port, running
from specdec.v1 import verifier_pb2 as pb
from specdec.v1 import verifier_pb2_grpc as rpc

__all__ = ["STOP_TIMEOUT_S", "HttpVerifier", "ServiceProcess", "free_port", "running", "running_tiny_verifier"]

CALL_TIMEOUT_S = 120


def running_tiny_verifier(model_dir, *args: str, env: dict[str, str] | None = None):
    """``running`` a verifier of ``model_dir`` on a free port, metrics off and no step-cost calibration."""
    return running("verifier_service", "--port", "0", "--metrics-port", "-1", "--model", str(model_dir), "--no-calibrate", *args, env=env)


class HttpVerifier:
    """A verifier of ``model_dir`` with its HTTP API on a free port (read from its output),
    an ``openai`` client for it, and a gRPC stub to hold its answers against."""

    def __init__(self, model_dir, *args: str) -> None:
        self.model = str(model_dir)
        self.process = ServiceProcess(
            "verifier_service",
            *("--port", "0", "--metrics-port", "-1", "--http-port", "0", "--model", self.model, "--no-calibrate", *args),
        )
        try:
            self.base = f"http://127.0.0.1:{self.process.announced_port('http')}"
            self.process.wait_until_serving("specdec.v1.Verifier", CALL_TIMEOUT_S)
        except BaseException:
            self.process.stop()
            raise
        self.client = openai.OpenAI(base_url=self.base + "/v1", api_key="not-checked", max_retries=0, timeout=CALL_TIMEOUT_S)
        self.stub = rpc.VerifierStub(self.process.channel)

    def generate(self, **fields) -> pb.GenerateResponse:
        """gRPC Generate (greedy unless ``temperature`` is set)."""
        return self.stub.Generate(pb.GenerateRequest(**fields), timeout=CALL_TIMEOUT_S)
