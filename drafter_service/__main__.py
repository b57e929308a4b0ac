"""python -m drafter_service --port PORT --db PATH

Every field of DrafterConfig is a flag, also read from a SPECDEC_DRAFTER_* variable
(flag name in upper case, dashes as underscores); see specdec.flags.
"""

from __future__ import annotations

import logging
import sys

from drafter_service.config import DrafterConfig
from drafter_service.server import create_server
from drafter_service.storage import DirectoryLocked
from specdec.serving import announce, parse_service_config, stop_on_signals, wait_for_stop

ENV_PREFIX = "SPECDEC_DRAFTER_"


def parse_config(argv: list[str] | None = None) -> DrafterConfig:
    # DrafterConfig's own checks (n_min <= n_max, --backup-dir outside --db) are usage errors too.
    _, config = parse_service_config(DrafterConfig, "python -m drafter_service", "n-gram drafter gRPC service", ENV_PREFIX, argv)
    return config


def main(argv: list[str] | None = None) -> None:
    config = parse_config(argv)
    stopping = stop_on_signals()
    logging.info("effective config (flags, SPECDEC_DRAFTER_* variables, defaults): %s", config)
    try:
        drafter = create_server(config)
    except DirectoryLocked as locked:
        sys.exit(f"drafter: {locked}")
    except (OSError, RuntimeError) as error:  # a port taken, a certificate unreadable: one line, exit 1
        sys.exit(f"drafter: cannot start: {error}")
    announce("drafter", config.host, drafter.port, drafter.metrics_port, f"db {config.db}", drafter.health_port)
    if drafter.admin_port is not None:
        print(f"drafter admin on {config.admin_host}:{drafter.admin_port} (Stats, Backup, Forget)", flush=True)
    wait_for_stop(stopping)
    drafter.stop()
    logging.info("stopped cleanly")
    sys.exit(0)


if __name__ == "__main__":
    main()
