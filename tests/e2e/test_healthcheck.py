"""specdec.healthcheck, the container health-check command, against a real drafter."""

from __future__ import annotations

import subprocess
import sys

from processes import free_port, running


def healthcheck(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdec.healthcheck", *args], capture_output=True, text=True, timeout=60)


def test_healthcheck_passes_on_a_serving_drafter_and_fails_on_nothing(tmp_path):
    with running("drafter_service", "--port", "0", "--db", str(tmp_path / "db"), "--metrics-port", "-1") as drafter:
        assert healthcheck(drafter.address).returncode == 0
        assert healthcheck(drafter.address, "specdec.v1.Drafter").returncode == 0
        unknown = healthcheck(drafter.address, "no.such.Service")
        assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr
    nothing = healthcheck(f"127.0.0.1:{free_port()}")
    assert nothing.returncode == 1 and "UNAVAILABLE" in nothing.stderr
    assert healthcheck().returncode == 2  # usage
