"""Start the services as real processes for end-to-end tests, and always stop them.

A service prints ``<name> listening on HOST:PORT (...)`` as its first line of
stdout once its port is bound; everything else it says goes to a log file
(never an unread pipe, which would block a chatty process once it fills).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import tempfile
from contextlib import contextmanager

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.processes import free_port  # noqa: F401 -- the tests import it from here

STOP_TIMEOUT_S = 60  # SIGTERM, then SIGKILL after this long
LISTENING_LINE = re.compile(r"listening on [\d.]+:(\d+)")


class ServiceProcess:
    """``python -m MODULE ARGS...``, its port read from the listening line."""

    def __init__(self, module: str, *args: str, env: dict[str, str] | None = None, prefix: tuple[str, ...] = ()) -> None:
        # prefix: a command that execs the rest (nsenter, to run inside another mount namespace).
        self.command = [*prefix, sys.executable, "-m", module, *args]
        # Append mode: the child's writes go to the end whatever offset log() leaves behind.
        self.log_file = tempfile.TemporaryFile("a+")
        self.channel: grpc.Channel | None = None
        self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=self.log_file, text=True, env=env)
        match = None
        for line in self.process.stdout:  # ends at EOF if the process dies first
            match = LISTENING_LINE.search(line)
            if match:
                break
        if not match:
            self.kill()
            raise RuntimeError(f"{module} did not start (exit code {self.process.returncode}):\n{self.log()}")
        self.port = int(match.group(1))
        self.address = f"127.0.0.1:{self.port}"
        self.channel = grpc.insecure_channel(self.address)

    def log(self) -> str:
        """What the process wrote to stderr so far (for failure messages)."""
        self.log_file.seek(0)
        return self.log_file.read()

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs, as in a crash or an OOM kill."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=STOP_TIMEOUT_S)
        self._close()

    def terminate(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM and wait for the exit code; SIGKILL (and raise) if it does not exit in time."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
                raise
        self._close()
        return self.process.returncode

    def stop(self) -> None:
        """Make sure the process is gone, however the test ended."""
        try:
            self.terminate()
        except subprocess.TimeoutExpired:
            pass
        finally:
            if self.process.poll() is None:
                self.kill()
            self._close()

    def _close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        self.process.stdout.close()


def wait_until_serving(process: ServiceProcess, service: str, timeout_s: float) -> None:
    """Block until health reports SERVING for ``service`` (Watch streams each change: no polling)."""
    health = health_pb2_grpc.HealthStub(process.channel)
    request = health_pb2.HealthCheckRequest(service=service)
    try:
        for response in health.Watch(request, timeout=timeout_s, wait_for_ready=True):
            if response.status == health_pb2.HealthCheckResponse.SERVING:
                return
    except grpc.RpcError as error:
        raise RuntimeError(f"{process.command} never reported SERVING ({error.code().name}):\n{process.log()}") from error
    raise RuntimeError(f"{process.command} closed its health stream before SERVING:\n{process.log()}")


@contextmanager
def running(module: str, *args: str, env: dict[str, str] | None = None):
    """A started service, stopped (SIGTERM, then SIGKILL) when the block ends."""
    process = ServiceProcess(module, *args, env=env)
    try:
        yield process
    finally:
        process.stop()


def running_tiny_verifier(model_dir, *args: str, env: dict[str, str] | None = None):
    """``running`` a verifier of ``model_dir`` on a free port, metrics off and no step-cost calibration."""
    return running("verifier_service", "--port", "0", "--metrics-port", "-1", "--model", str(model_dir), "--no-calibrate", *args, env=env)
