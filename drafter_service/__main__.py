"""python -m drafter_service --port PORT --db PATH  (flags also from SPECDEC_DRAFTER_* variables)."""

from __future__ import annotations

import argparse
import logging
import sys

from drafter_service.ngram import NGramConfig
from drafter_service.server import DEFAULT_METRICS_PORT, LIMITS, DirectoryLocked, DrafterConfig, create_server
from specdec.serving import add_serving_flags, announce, env_default, serving_options, stop_on_signals

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
    for name, help_text in LIMITS:
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=int,
            default=int(env(name, getattr(defaults, name))),
            help=f"{help_text} ({ENV_PREFIX}{name.upper()}; default {getattr(defaults, name)})",
        )
    parser.add_argument(
        "--admin-port",
        type=int,
        default=_optional_int(env("admin_port", defaults.admin_port)),
        help="serve Stats and Backup on this port only (0: a free one), on --admin-host (SPECDEC_DRAFTER_ADMIN_PORT; "
        "default: on the main port)",
    )
    parser.add_argument("--admin-host", default=env("admin_host", defaults.admin_host), help="address of the admin port")
    parser.add_argument(
        "--backup-dir",
        default=env("backup_dir", defaults.backup_dir),
        help="directory the Backup RPC writes into, outside --db (SPECDEC_DRAFTER_BACKUP_DIR; default: Backup refused)",
    )
    add_serving_flags(parser, ENV_PREFIX, DEFAULT_METRICS_PORT)
    args = parser.parse_args(argv)
    serving = serving_options(parser, args)
    try:
        ngram = NGramConfig(n_min=args.n_min, n_max=args.n_max)
    except ValueError as error:
        parser.error(str(error))
    if args.max_bytes < 1 << 16:
        parser.error(f"--max-bytes must be at least 65536, got {args.max_bytes}")
    try:
        return DrafterConfig(
            port=args.port,
            host=args.host,
            db=args.db,
            max_bytes=args.max_bytes,
            ngram=ngram,
            grace_s=args.grace,
            session_idle_timeout_s=args.session_idle_timeout,
            backup_dir=args.backup_dir or None,
            admin_port=args.admin_port,
            admin_host=args.admin_host,
            **{name: getattr(args, name) for name, _ in LIMITS},
            **serving,
        )
    except ValueError as error:
        parser.error(str(error))


def _optional_int(value) -> int | None:
    return None if value in (None, "") else int(value)


def main(argv: list[str] | None = None) -> None:
    config = parse_config(argv)
    stopping = stop_on_signals()
    logging.info("effective config (flags, SPECDEC_DRAFTER_* variables, defaults): %s", config)
    try:
        drafter = create_server(config)
    except DirectoryLocked as locked:
        sys.exit(f"drafter: {locked}")
    announce("drafter", config.host, drafter.port, drafter.metrics_port, f"db {config.db}", drafter.health_port)
    if drafter.admin_port is not None:
        print(f"drafter admin on {config.admin_host}:{drafter.admin_port} (Stats, Backup)", flush=True)
    stopping.wait()
    drafter.stop()
    logging.info("stopped cleanly")
    sys.exit(0)


if __name__ == "__main__":
    main()
