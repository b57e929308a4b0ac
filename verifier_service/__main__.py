"""python -m verifier_service --port PORT --drafter HOST:PORT [--model NAME_OR_PATH]

Every field of VerifierConfig (the engine's and scheduler's nested) is a flag,
also read from a SPECDEC_VERIFIER_* environment variable (flag name in upper
case, dashes as underscores: SPECDEC_VERIFIER_MAX_BATCH_SIZE); see specdec.flags.
"""

from __future__ import annotations

import logging
import sys
import threading

from specdec.serving import announce, parse_service_config, stop_on_signals, wait_for_stop
from verifier_service.core.default_model import DefaultModelUnavailable
from verifier_service.serving.config import VerifierConfig
from verifier_service.serving.server import create_server

ENV_PREFIX = "SPECDEC_VERIFIER_"


def parse_config(argv: list[str] | None = None) -> VerifierConfig:
    # VerifierConfig's own checks (TLS settings that go together, API keys, origins) are usage errors too.
    _, config = parse_service_config(
        VerifierConfig, "python -m verifier_service", "speculative-decoding verifier gRPC service", ENV_PREFIX, argv
    )
    return config


def main(argv: list[str] | None = None) -> None:
    config = parse_config(argv)
    stopping = stop_on_signals()
    logging.info("effective config (flags, SPECDEC_VERIFIER_* variables, defaults): %s", config)
    try:
        verifier = create_server(config)
    except (OSError, RuntimeError) as error:  # a port taken, a certificate unreadable: one line, exit 1
        sys.exit(f"verifier: cannot start: {error}")
    # Health answers NOT_SERVING from here on while the model loads.
    announce("verifier", config.host, verifier.port, verifier.metrics_port, f"model {config.model}", verifier.health_port)
    if verifier.http_port is not None:
        print(f"verifier http on {config.host}:{verifier.http_port} (OpenAI API under /v1, live view at /)", flush=True)
    failures: list[Exception] = []

    def load() -> None:
        try:
            verifier.load()
        except Exception as error:  # a bad model path, no memory: say so and exit, never hang NOT_SERVING
            if not isinstance(error, DefaultModelUnavailable):  # its one line says all; a traceback would bury it
                logging.exception("could not load model %s", config.model)
            failures.append(error)
            stopping.set()

    threading.Thread(target=load, name="verifier-load", daemon=True).start()
    wait_for_stop(stopping)
    drained = verifier.stop()
    if failures:  # the last line, for whoever reads a failed start: exit 1
        reason = " ".join(str(failures[0]).split()) or type(failures[0]).__name__
        sys.exit(f"verifier: cannot serve --model {config.model}: {reason}")
    logging.info("stopped %s", "cleanly" if drained else "after cancelling requests past the grace period")
    sys.exit(0)


if __name__ == "__main__":
    main()
