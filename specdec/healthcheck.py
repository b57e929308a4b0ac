"""python -m specdec.healthcheck HOST:PORT [SERVICE] — exit 0 when gRPC health says SERVING.

For container health checks (Docker's HEALTHCHECK runs a command; Kubernetes
probes gRPC health natively). Exit 1 with the reason on stderr otherwise.
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

TIMEOUT_S = 5.0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not 1 <= len(args) <= 2:
        print("usage: python -m specdec.healthcheck HOST:PORT [SERVICE]", file=sys.stderr)
        return 2
    target, service = args[0], args[1] if len(args) == 2 else ""
    with grpc.insecure_channel(target) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S)
        except grpc.RpcError as error:
            print(f"{target}: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    if response.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"{target}: {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
