"""python -m drafter_service --port PORT --db PATH

Every field of DrafterConfig is a flag, also read from a SPECDEC_DRAFTER_* variable
(flag name in upper case, dashes as underscores); see specdec.flags.
"""

from __future__ import annotations

import argparse
import logging
import sys

from drafter_service.server import DEFAULT_METRICS_PORT, SERVING_FIELDS, DirectoryLocked, DrafterConfig, create_server
from specdec.flags import add_flags, from_args
from specdec.serving import add_serving_flags, announce, serving_options, stop_on_signals

ENV_PREFIX = "SPECDEC_DRAFTER_"


def parse_config(argv: list[str] | None = None) -> DrafterConfig:
    parser = argparse.ArgumentParser(prog="python -m drafter_service", description="n-gram drafter gRPC service")
    add_flags(parser, DrafterConfig, ENV_PREFIX, skip=SERVING_FIELDS)
    add_serving_flags(parser, ENV_PREFIX, DEFAULT_METRICS_PORT)
    args = parser.parse_args(argv)
    serving = serving_options(parser, args)
    try:
        return from_args(parser, DrafterConfig, args, skip=SERVING_FIELDS, **serving)
    except ValueError as error:  # rules across fields: n_min <= n_max, --backup-dir outside --db
        parser.error(str(error))


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
