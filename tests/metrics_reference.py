"""docs/reference/metrics.md against what a service's /metrics exposes: the metrics
reference must list every metric, and only those (tests of each service use both)."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path


def documented_metrics(section: str) -> set[str]:
    """The metric names of a section's table in docs/reference/metrics.md (each row's first cell)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "reference" / "metrics.md").read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([a-z_:]+)` \|", body, flags=re.MULTILINE))


def exposed_metrics(port: int) -> set[str]:
    """The metric families a /metrics endpoint exposes (not client_python's *_created gauges)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")} - {
        name for name in re.findall(r"^# TYPE (\S+_created) gauge$", text, flags=re.MULTILINE)
    }
