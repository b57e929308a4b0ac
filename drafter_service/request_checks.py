"""What a drafter call may ask, checked before any state changes: ``InvalidRequest`` carries
the gRPC status a refusal answers with, and ``check`` raises it."""

from __future__ import annotations

import grpc


class InvalidRequest(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def check(condition: bool, message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> None:
    """Raise InvalidRequest(code, message) unless ``condition``."""
    if not condition:
        raise InvalidRequest(code, message)
