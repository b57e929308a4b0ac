"""python -m drafter_service --port PORT --db PATH  (flags also from SPECDEC_DRAFTER_* variables)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from drafter_service.ngram import NGramConfig
from drafter_service.server import DEFAULT_METRICS_PORT, DrafterConfig, create_server
from specdec.serving import env_default

ENV_PREFIX = "SPECDEC_DRAFTER_"


def parse_config(argv: list[str] | None = None) -> DrafterConfig:
    defaults = DrafterConfig()

    def env(name: str, default):
        return env_default(ENV_PREFIX, name, default)

    parser = argparse.ArgumentParser(prog="python -m drafter_service", description="n-gram drafter gRPC service")
    parser.add_argument("--host", default=env("host", defaults.host), help="address to bind (SPECDEC_DRAFTER_HOST)")
    parser.add_argument("--port", type=int, default=int(env("port", defaults.port)), help="0 picks a free port (SPECDEC_DRAFTER_PORT)")
    parser.add_argument("--db", default=env("db", defaults.db), help="directory of the LMDB tables (SPECDEC_DRAFTER_DB)")
    parser.add_argument("--max-bytes", type=int, default=int(env("max_bytes", defaults.max_bytes)), help="size bound per vocabulary table")
    parser.add_argument("--n-min", type=int, default=int(env("n_min", defaults.ngram.n_min)))
    parser.add_argument("--n-max", type=int, default=int(env("n_max", defaults.ngram.n_max)))
    parser.add_argument("--grace", type=float, default=float(env("grace", defaults.grace_s)), help="seconds SIGTERM gives in-flight calls")
    parser.add_argument("--session-idle-timeout", type=float, default=float(env("session_idle_timeout", defaults.session_idle_timeout_s)))
    parser.add_argument("--metrics-port", type=int, default=int(env("metrics_port", DEFAULT_METRICS_PORT)),
                        help="Prometheus /metrics port (0: a free one, -1: off)")
    parser.add_argument("--tls-cert", default=env("tls_cert", None), help="PEM certificate: serve over TLS (with --tls-key)")
    parser.add_argument("--tls-key", default=env("tls_key", None))
    args = parser.parse_args(argv)
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    try:
        ngram = NGramConfig(n_min=args.n_min, n_max=args.n_max)
    except ValueError as error:
        parser.error(str(error))
    if args.max_bytes < 1 << 16:
        parser.error(f"--max-bytes must be at least 65536, got {args.max_bytes}")
    return DrafterConfig(
        port=args.port, host=args.host, db=args.db, max_bytes=args.max_bytes, ngram=ngram,
        grace_s=args.grace, session_idle_timeout_s=args.session_idle_timeout,
        tls_cert=args.tls_cert, tls_key=args.tls_key, metrics_port=None if args.metrics_port < 0 else args.metrics_port,
    )


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = parse_config(argv)
    stopping = threading.Event()

    def on_signal(signum, _frame):
        logging.info("signal %s: draining", signum)
        stopping.set()

    # Before the port is announced: a supervisor may signal as soon as it reads it.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    drafter = create_server(config)
    print(f"drafter listening on {config.host}:{drafter.port} (db {config.db})", flush=True)
    if drafter.metrics_port is not None:
        print(f"drafter metrics on {config.host}:{drafter.metrics_port}", flush=True)
    stopping.wait()
    drafter.stop()
    logging.info("stopped cleanly")
    sys.exit(0)


if __name__ == "__main__":
    main()
