"""Write the command-line reference under ``docs/reference/`` from the programs themselves.

    python -m tools.reference          # (re)write the pages
    python -m tools.reference --check  # exit 1 naming each page that differs (make test runs it)

The services' pages are made from their config dataclasses (``specdec.flags``): each
flag with its variable, default and meaning, in its ``--help`` group, and the names it
replaced. The other programs' pages are their ``--help``. So a flag cannot be added,
renamed or re-defaulted without its reference changing with it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from drafter_service import check
from drafter_service.__main__ import ENV_PREFIX as DRAFTER_PREFIX
from drafter_service.config import DrafterConfig
from specdec import __main__ as serve
from specdec import healthcheck
from specdec.flags import flags
from verifier_service import client
from verifier_service.__main__ import ENV_PREFIX as VERIFIER_PREFIX
from verifier_service.head import train as train_head
from verifier_service.serving.config import VerifierConfig

ROOT = Path(__file__).resolve().parent.parent
FOLDER = ROOT / "docs" / "reference"
HELP_COLUMNS = "100"  # --help wraps at the terminal's width: one width for every machine
HEADER = "<!-- Made by `python -m tools.reference` (make reference) from the programs' flags: edit those, not this page. -->\n\n"

RULES = """\
Every flag is also an environment variable: `{prefix}` and the flag's name in upper case,
dashes as underscores (`{example}` is `{prefix}{variable}`). A flag on the
command line wins over its variable. An on/off flag's variable takes `1`, `true` or `yes`
(and `0`, `false`, `no`). A setting whose default is `none` takes `none` (or an empty
variable) for it. Sizes in bytes take `65536`, `64KiB`, `8MiB`, `1GiB` (binary) or `8MB`
(decimal); durations are in seconds. A variable with the prefix that names no flag is
reported at start-up, as is a flag or variable given by a former name.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("*", "\\*").replace("<", "&lt;")


def _service_page(title: str, command: str, cls: type, prefix: str, intro: str) -> str:
    found = flags(cls)
    example = next(flag for flag in found if flag.name.startswith("max-"))
    rules = RULES.format(prefix=prefix, example=example.option, variable=example.variable(""))
    lines = [HEADER, f"# {title}\n\n", f"{intro}\n\n", f"    {command} --help\n\n", rules, "\n"]
    groups: dict[str, list] = {}
    for flag in found:
        groups.setdefault(flag.group, []).append(flag)
    lines.append("Groups: " + ", ".join(f"[{name}](#{_anchor(name)})" for name in groups) + ".\n")
    for name, members in groups.items():
        lines.append(f"\n## {name}\n\n| flag | variable | default | meaning |\n|---|---|---|---|\n")
        for flag in members:
            default = "off" if flag.kind is bool else flag.shown_default()
            value = "{" + ",".join(flag.choices) + "}" if flag.choices else flag.metavar
            option = flag.option + ("" if flag.kind is bool else " " + value)
            lines.append(f"| `{option}` | `{flag.variable(prefix)}` | `{default}` | {_cell(flag.help)} |\n")
    renamed = [(old, flag) for flag in found for old in flag.formerly]
    if renamed:
        lines.append("\n## Former names\n\nStill accepted, with a warning; they will be removed.\n\n| former | now |\n|---|---|\n")
        for old, flag in sorted(renamed, key=lambda pair: pair[0]):
            lines.append(f"| `--{old}` | `{flag.option}` |\n")
    return "".join(lines)


def _anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces as dashes."""
    kept = "".join(char for char in title.lower() if char.isalnum() or char in " -_")
    return kept.replace(" ", "-")


def _help(make: Callable[[], argparse.ArgumentParser]) -> str:
    return make().format_help().rstrip() + "\n"


def _tools_page() -> str:
    parts = [
        HEADER,
        "# Tools\n\n",
        "The programs beside the two services, each with its `--help`.\n",
    ]
    for title, make, what in (
        ("The command-line client", client.parser, "Calls the verifier's gRPC `Generate` (or `GenerateStream`)."),
        ("The health check", healthcheck.parser, "What the images' `HEALTHCHECK` runs: exit 0 when gRPC health says SERVING."),
        ("The drafter's store check", check.parser, "Checks a drafter's `--db` offline and lists its quarantined tables."),
        ("The draft head's trainer", train_head.parser, "Trains the opt-in draft head for a target model (`--draft-head`)."),
    ):
        parts.append(f"\n## {title}\n\n{what}\n\n```text\n{_help(make)}```\n")
    return "".join(parts)


def _serve_page() -> str:
    return (
        HEADER
        + "# specdec serve\n\n"
        + "Starts a drafter and a verifier together on the embedded defaults and stays up until Ctrl-C.\n"
        + "Its own flags are below; every other flag goes to the verifier ([verifier.md](verifier.md)),\n"
        + "and the drafter takes its `SPECDEC_DRAFTER_*` variables ([drafter.md](drafter.md)).\n\n"
        + f"```text\n{_help(serve.parser)}```\n"
    )


def pages() -> dict[str, str]:
    """Each reference page's name and text."""
    os.environ["COLUMNS"] = HELP_COLUMNS
    return {
        "verifier.md": _service_page(
            "Verifier flags",
            "specdec-verifier",
            VerifierConfig,
            VERIFIER_PREFIX,
            "`specdec-verifier` (or `python -m verifier_service`) runs the target model behind the gRPC "
            "service and the OpenAI-compatible HTTP API.",
        ),
        "drafter.md": _service_page(
            "Drafter flags",
            "specdec-drafter",
            DrafterConfig,
            DRAFTER_PREFIX,
            "`specdec-drafter` (or `python -m drafter_service`) keeps the learned n-gram and successor tables and "
            "answers the verifiers' `Propose` and `Observe`.",
        ),
        "serve.md": _serve_page(),
        "tools.md": _tools_page(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.reference", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a page differs from what it would be")
    args = parser.parse_args(argv)
    stale = []
    for name, text in pages().items():
        path = FOLDER / name
        if path.exists() and path.read_text() == text:
            continue
        stale.append(path.relative_to(ROOT))
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if args.check and stale:
        print("stale reference pages (run make reference): " + ", ".join(map(str, stale)), file=sys.stderr)
        return 1
    for path in stale if not args.check else ():
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
