"""The end-to-end tests' process helpers: ``specdec.processes``, plus a tiny verifier."""

from __future__ import annotations

from specdec.processes import STOP_TIMEOUT_S, ServiceProcess, free_port, running

__all__ = ["STOP_TIMEOUT_S", "ServiceProcess", "free_port", "running", "running_tiny_verifier"]


def running_tiny_verifier(model_dir, *args: str, env: dict[str, str] | None = None):
    """``running`` a verifier of ``model_dir`` on a free port, metrics off and no step-cost calibration."""
    return running("verifier_service", "--port", "0", "--metrics-port", "-1", "--model", str(model_dir), "--no-calibrate", *args, env=env)
