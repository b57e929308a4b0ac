"""Starting a service with one of its ports already taken by another listener."""

from __future__ import annotations

import socket
import subprocess
import sys


def start_on_a_taken_port(module: str, flags: dict[str, str], flag: str, timeout_s: float = 120) -> tuple[str, int]:
    """``python -m MODULE`` with ``flags`` and ``flag`` set to a port another socket listens
    on; checks that it exits 1 without announcing a port, and returns (its last stderr line, the port)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        arguments = [item for pair in {**flags, flag: str(port)}.items() for item in pair]
        result = subprocess.run([sys.executable, "-m", module, *arguments], capture_output=True, text=True, timeout=timeout_s)
    assert result.returncode == 1, result.stderr
    assert "listening on" not in result.stdout
    return result.stderr.strip().splitlines()[-1], port
