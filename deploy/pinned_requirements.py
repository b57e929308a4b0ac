"""Print the exact pins pyproject.toml gives the named distributions, one per line.

    python deploy/pinned_requirements.py [--pyproject PATH] NAME...

The images install subsets of the project's dependencies (the drafter needs
no torch; the verifier takes torch from the PyTorch index): this keeps
pyproject.toml the one place versions are written. Standard library only, so
it runs in a bare ``python`` image before anything is installed.

    $ python deploy/pinned_requirements.py torch lmdb
    torch==2.13.0
    lmdb==3.0.0

Fails (exit 2, naming the distribution) when a name is not in
``[project].dependencies`` or is not pinned with ``==``: an image built from a
range would not be the one the tests ran against.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

# "name==version", optionally with extras; anything looser (>=, ~=, markers) is refused.
EXACT_PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*==\s*([A-Za-z0-9.+!_-]+)\s*$")


def normalize(name: str) -> str:
    """PEP 503 name normalization: 'Grpcio_Health.Checking' -> 'grpcio-health-checking'."""
    return re.sub(r"[-_.]+", "-", name).lower()


def exact_pins(pyproject: Path) -> dict[str, str]:
    """{normalized name: 'name==version'} for every exactly pinned runtime dependency."""
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    pins = {}
    for requirement in dependencies:
        match = EXACT_PIN.match(requirement)
        if match:
            pins[normalize(match.group(1))] = f"{match.group(1)}=={match.group(3)}"
    return pins


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pyproject", type=Path, default=Path("pyproject.toml"))
    parser.add_argument("names", nargs="+")
    args = parser.parse_args(argv)
    pins = exact_pins(args.pyproject)
    missing = [name for name in args.names if normalize(name) not in pins]
    if missing:
        print(f"not pinned with == in {args.pyproject} [project].dependencies: {', '.join(missing)}", file=sys.stderr)
        return 2
    print("\n".join(pins[normalize(name)] for name in args.names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
