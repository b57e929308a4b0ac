"""python -m specdec.healthcheck [--tls-ca PEM [--tls-cert PEM --tls-key PEM] [--tls-server-name NAME]] HOST:PORT [SERVICE]

Exit 0 when gRPC health says SERVING; exit 1 with the reason on stderr otherwise.
For container health checks (Docker's HEALTHCHECK runs a command; Kubernetes
probes gRPC health natively). The images check the plaintext health port
(``--health-port``), which needs none of the TLS flags. A service port
serving TLS is checked over TLS:
``--tls-ca`` (the CA that signed its certificate, or the certificate itself
when self-signed), a client certificate when it requires one (mutual TLS),
and ``--tls-server-name`` when the certificate names the service rather than
the address checked (127.0.0.1 inside its container). Each flag defaults to
``SPECDEC_HEALTHCHECK_<FLAG>`` from the environment, so a container's fixed
HEALTHCHECK command follows its TLS settings.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec import serving

TIMEOUT_S = 5.0
ENV_PREFIX = "SPECDEC_HEALTHCHECK_"


TLS_FLAGS = {
    "tls-ca": "the CA (PEM) that signed the server's certificate, or that certificate itself: check over TLS",
    "tls-cert": "client certificate (PEM) for a server that requires one (mutual TLS; with --tls-key)",
    "tls-key": "the key of --tls-cert (PEM)",
    "tls-server-name": "the name the server's certificate is checked against, when not the address checked",
}


def parser() -> argparse.ArgumentParser:
    """The health check's command line (``docs/reference/tools.md`` is made from it)."""
    parser = argparse.ArgumentParser(prog="python -m specdec.healthcheck", description="exit 0 when gRPC health says SERVING")
    parser.add_argument("target", help="HOST:PORT")
    parser.add_argument("service", nargs="?", default="", help="service name (default: the whole server)")
    for flag, meaning in TLS_FLAGS.items():
        parser.add_argument("--" + flag, default=None, help=f"{meaning} (${ENV_PREFIX}{flag.replace('-', '_').upper()}; default: none)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    for flag in TLS_FLAGS:  # the variables are read here: --help shows no environment's values
        name = flag.replace("-", "_")
        setattr(args, name, getattr(args, name) or os.environ.get(ENV_PREFIX + name.upper()) or None)
    options = [("grpc.ssl_target_name_override", args.tls_server_name)] if args.tls_server_name else []
    try:
        channel = serving.channel(args.target, args.tls_ca, options, args.tls_cert, args.tls_key)
    except (OSError, ValueError) as error:  # unreadable files, a certificate without its key
        print(f"{args.target}: {error}", file=sys.stderr)
        return 1
    with channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=args.service), timeout=TIMEOUT_S)
        except grpc.RpcError as error:
            print(f"{args.target}: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    if response.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"{args.target}: {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
