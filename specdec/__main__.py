"""specdec serve: the drafter and the verifier together, on the embedded defaults, until Ctrl-C.

    specdec serve [--data DIR] [--port 50052] [--http-port 8000] [--drafter-replicas N] [VERIFIER FLAGS...]
    python -m specdec serve ...

Starts the drafter (its learned tables under ``DIR/drafter``, kept between runs) on a
free loopback port and the verifier (the default model unless ``--model`` says
otherwise) pointed at it, prints where each door listens, then a ready line once the
model serves, and stays up until SIGINT or SIGTERM, which stops both and exits 0. Flags
it does not know go to the verifier (``specdec-verifier --help`` lists them); the
drafter takes its ``SPECDEC_DRAFTER_*`` variables. ``specdec-drafter`` and
``specdec-verifier`` run one service each.

With ``--drafter-replicas N`` (N >= 2) it starts N drafters sharing one learned state
through an observation log: a local nats-server with JetStream (its stream under
``DIR/nats``, written to disk before each acknowledgement), the first replica's tables
under ``DIR/drafter`` (where a single drafter keeps them) and the others' under
``DIR/drafter-1`` ... Each replica is waited for until it has applied the log, and the
verifier is given them all (``--drafter HOST:PORT,HOST:PORT``): it uses one and moves to
another when that one fails. SIGINT or SIGTERM stops the verifier first (it flushes what
it learned to its drafter), then the drafters, then nats-server.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from specdec.processes import LocalNatsServer, ServiceProcess, drafter_db, local_drafter

USAGE = "specdec serve [--data DIR] [--port PORT] [--http-port PORT] [--drafter-replicas N] [VERIFIER FLAGS...]"
POLL_S = 0.2  # how often the start-up and serving loops look at the signal flag and the children


def parser() -> argparse.ArgumentParser:
    """specdec serve's own flags; the rest go to the verifier (``docs/reference/serve.md`` is made from it)."""
    parser = argparse.ArgumentParser(prog="specdec serve", usage=USAGE, description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data",
        type=Path,
        default=Path("data"),
        metavar="DIR",
        help="folder of the drafter's learned tables, DIR/drafter (with replicas also DIR/drafter-1, ... and the log, DIR/nats; "
        "default data)",
    )
    parser.add_argument("--port", type=int, default=50052, help="the verifier's gRPC port (0: a free one; default %(default)s)")
    parser.add_argument(
        "--http-port", type=int, default=8000, help="the OpenAI-compatible HTTP API and live view (0: a free one; default %(default)s)"
    )
    parser.add_argument(
        "--drafter-replicas",
        type=int,
        default=1,
        metavar="N",
        help="drafters sharing one learned state through an observation log on a local nats-server with JetStream; the "
        "verifier uses one and moves to another when it fails (default 1: one drafter, no log)",
    )
    return parser


@dataclass
class Services:
    """What ``specdec serve`` started, to watch and to stop in order."""

    nats: LocalNatsServer | None = None
    drafters: list[ServiceProcess] = field(default_factory=list)
    verifier: ServiceProcess | None = None

    def check_running(self) -> None:
        """RuntimeError naming the first child that exited."""
        services = [*self.drafters, *([self.verifier] if self.verifier is not None else [])]
        for service in services:
            if service.process.poll() is not None:
                raise RuntimeError(f"{service.command[2]} exited with {service.process.returncode}; its log is above")
        if self.nats is not None and self.nats.process.poll() is not None:
            raise RuntimeError(f"nats-server exited with {self.nats.process.returncode}; the end of its log:\n{self.nats.log()}")

    def stop(self) -> None:
        """The verifier first (it flushes what it learned to its drafter), then the drafters
        (each sends what it holds for the log), then the log."""
        if self.verifier is not None:
            self.verifier.stop()
        for drafter in self.drafters:
            drafter.stop()
        if self.nats is not None:
            self.nats.stop()


def wait_until_serving(service: ServiceProcess, services: Services, stopping: threading.Event) -> bool:
    """Block until ``service``'s health says SERVING (True) or a signal came (False);
    RuntimeError when a child exits first or the service never serves."""
    failures: list[RuntimeError] = []

    def wait() -> None:
        try:
            service.wait_until_serving()
        except RuntimeError as failure:
            failures.append(failure)

    ready = threading.Thread(target=wait, daemon=True)
    ready.start()
    while ready.is_alive() and not stopping.wait(POLL_S):
        services.check_running()
    if failures:
        services.check_running()  # a child that exited says so in one line
        raise failures[0]
    return not stopping.is_set()


def start_drafters(data: Path, replicas: int, services: Services) -> None:
    """One drafter, or ``replicas`` of them following a local observation log, each announced."""
    log_url = None
    if replicas > 1:
        services.nats = LocalNatsServer(data / "nats")
        log_url = services.nats.url
        print(f"observation log: {log_url} (nats-server with JetStream, its stream under {data / 'nats'})", flush=True)
    for replica in range(replicas):
        drafter = local_drafter(data, replica, log_url)
        services.drafters.append(drafter)
        print(f"drafter: {drafter.address} (learned tables under {drafter_db(data, replica)})", flush=True)


def serve(argv: list[str]) -> int:
    command = parser()
    args, verifier_flags = command.parse_known_args(argv)
    if args.drafter_replicas < 1:
        command.error(f"--drafter-replicas must be at least 1, got {args.drafter_replicas}")
    stopping = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopping.set())
    services = Services()
    try:
        start_drafters(args.data, args.drafter_replicas, services)
        if services.nats is not None:  # a replica serves once it has applied the log
            for drafter in services.drafters:
                if not wait_until_serving(drafter, services, stopping):
                    return 0
        drafters = ",".join(drafter.address for drafter in services.drafters)
        services.verifier = verifier = ServiceProcess(
            "verifier_service",
            *("--port", str(args.port), "--http-port", str(args.http_port), "--drafter", drafters, *verifier_flags),
            inherit_stderr=True,
        )
        http = f"http://127.0.0.1:{verifier.announced_port('http')}"
        print(f"verifier: gRPC {verifier.address}, HTTP {http}/v1 (OpenAI API), live view {http}/", flush=True)
        print(
            "loading the model (a first start on this machine also converts it and measures its fastest form and step "
            "costs, each once and bounded, the verifier's log below says how long; later starts take seconds)...",
            flush=True,
        )
        if wait_until_serving(verifier, services, stopping):
            example = '{"prompt": "Hello", "max_tokens": 16, "temperature": 0}'
            print(f"ready: curl {http}/v1/completions -H 'Content-Type: application/json' -d '{example}'")
            print("Ctrl-C stops both." if services.nats is None else "Ctrl-C stops them all.", flush=True)
        while not stopping.wait(POLL_S):
            services.check_running()
        return 0
    except (RuntimeError, OSError, subprocess.SubprocessError) as failure:
        print(f"specdec serve: {failure}", file=sys.stderr)
        return 1
    finally:
        services.stop()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    if argv[0] != "serve":
        print(f"specdec: unknown command {argv[0]!r}; usage: {USAGE}", file=sys.stderr)
        return 2
    return serve(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
