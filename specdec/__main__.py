"""specdec serve: the drafter and the verifier together, on the embedded defaults, until Ctrl-C.

    specdec serve [--data DIR] [--port 50052] [--http-port 8000] [VERIFIER FLAGS...]
    python -m specdec serve ...

Starts the drafter (its learned tables under ``DIR/drafter``, kept between runs) on a
free loopback port and the verifier (the default model unless ``--model`` says
otherwise) pointed at it, prints where each door listens, then a ready line once the
model serves, and stays up until SIGINT or SIGTERM, which stops both and exits 0. Flags
it does not know go to the verifier (``specdec-verifier --help`` lists them); the
drafter takes its ``SPECDEC_DRAFTER_*`` variables. ``specdec-drafter`` and
``specdec-verifier`` run one service each.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from specdec.processes import ServiceProcess, local_drafter

USAGE = "specdec serve [--data DIR] [--port PORT] [--http-port PORT] [VERIFIER FLAGS...]"


def parser() -> argparse.ArgumentParser:
    """specdec serve's own flags; the rest go to the verifier (``docs/reference/serve.md`` is made from it)."""
    parser = argparse.ArgumentParser(prog="specdec serve", usage=USAGE, description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", type=Path, default=Path("data"), help="folder of the drafter's learned tables, DIR/drafter (default data)"
    )
    parser.add_argument("--port", type=int, default=50052, help="the verifier's gRPC port (0: a free one; default %(default)s)")
    parser.add_argument(
        "--http-port", type=int, default=8000, help="the OpenAI-compatible HTTP API and live view (0: a free one; default %(default)s)"
    )
    return parser


def serve(argv: list[str]) -> int:
    args, verifier_flags = parser().parse_known_args(argv)
    stopping = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopping.set())
    processes: list[ServiceProcess] = []
    try:
        drafter = local_drafter(args.data)
        processes.append(drafter)
        verifier = ServiceProcess(
            "verifier_service",
            *("--port", str(args.port), "--http-port", str(args.http_port), "--drafter", drafter.address, *verifier_flags),
            inherit_stderr=True,
        )
        processes.append(verifier)
        http = f"http://127.0.0.1:{verifier.announced_port('http')}"
        print(f"drafter: {drafter.address} (learned tables under {args.data / 'drafter'})", flush=True)
        print(f"verifier: gRPC {verifier.address}, HTTP {http}/v1 (OpenAI API), live view {http}/", flush=True)
        print("loading the model...", flush=True)
        ready = threading.Thread(target=verifier.wait_until_serving, daemon=True)
        ready.start()
        while ready.is_alive() and not stopping.wait(0.2):
            if verifier.process.poll() is not None or drafter.process.poll() is not None:
                raise RuntimeError("a service exited before the model served; its log is above")
        if not stopping.is_set():
            example = '{"prompt": "Hello", "max_tokens": 16, "temperature": 0}'
            print(f"ready: curl {http}/v1/completions -H 'Content-Type: application/json' -d '{example}'")
            print("Ctrl-C stops both.", flush=True)
        while not stopping.wait(0.5):
            for process in processes:
                if process.process.poll() is not None:
                    raise RuntimeError(f"{process.command[2]} exited with {process.process.returncode}; its log is above")
        return 0
    except RuntimeError as failure:
        print(f"specdec serve: {failure}", file=sys.stderr)
        return 1
    finally:
        for process in reversed(processes):  # the verifier first: it flushes what it learned to the drafter
            process.stop()


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
