"""Verifiers started on a busy machine: without a stored step-cost calibration one measures
within its budget and serves; with one it reports SERVING from it, and neither measures it
again nor overwrites it (a complete one is not even probed; one cut short by its budget is
probed, and a probe under load is no evidence against it)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from processes import STOP_TIMEOUT_S, running

# Two spinners keep the test machine's two cores busy, as a neighbour's build would.
HOG_PROCESSES = 2
# Each spinner ends by itself after this long, even if the test is killed before it stops them.
HOG_LIMIT_S = 240
SPIN = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"
# A stored calibration this much faster than any real pass: every probe disagrees with it,
# as a probe on a loaded machine disagrees with costs measured on an idle one.
STORED_SPEEDUP = 1e4
SERVING_TIMEOUT_S = 300


@contextlib.contextmanager
def cpu_hog(processes: int = HOG_PROCESSES, limit_s: float = HOG_LIMIT_S) -> Iterator[None]:
    """``processes`` processes spinning on the CPU for at most ``limit_s`` seconds, stopped when the block ends."""
    spinners: list[subprocess.Popen] = []
    try:
        for _ in range(processes):
            spinners.append(subprocess.Popen([sys.executable, "-c", SPIN, str(limit_s)]))
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
        for spinner in spinners:
            spinner.wait(timeout=STOP_TIMEOUT_S)


def calibrating_verifier(model_dir: Path, cache: Path):
    """A verifier of ``model_dir`` measuring (or reusing) its step cost under ``cache``."""
    env = {**os.environ, "SPECDEC_CACHE_DIR": str(cache)}
    return running("verifier_service", "--port", "0", "--metrics-port", "-1", "--model", str(model_dir), env=env)


def test_busy_starts_serve_and_never_store_what_a_loaded_probe_measures(tiny_model_dir, tmp_path):
    with cpu_hog():
        with calibrating_verifier(tiny_model_dir, tmp_path) as verifier:  # nothing stored: measured within the budget
            verifier.wait_until_serving("specdec.v1.Verifier", SERVING_TIMEOUT_S)
        [path] = sorted((tmp_path / "calibration").glob("step-cost-*.json"))
        record = json.loads(path.read_text())
        assert record["points"]["1"] > 0 and isinstance(record["complete"], bool)
        complete = record["complete"]
        record["points"] = {count: seconds / STORED_SPEEDUP for count, seconds in record["points"].items()}
        path.write_text(json.dumps(record))
        stored = path.read_bytes()

        with calibrating_verifier(tiny_model_dir, tmp_path) as verifier:
            verifier.wait_until_serving("specdec.v1.Verifier", SERVING_TIMEOUT_S)
            log = verifier.log()
    if complete:  # served without a forward pass: nothing a loaded machine could spoil
        assert "served at once" in log and "now," not in log, log
    else:  # cut short by its budget under the hog: probed, and the probe found the machine busier
        assert "kept; the machine is busier than when it was measured" in log, log
    assert "step cost (tokens -> ms)" not in log, log  # nothing measured again
    assert path.read_bytes() == stored  # the loaded probe's numbers are not written over it
    assert sorted((tmp_path / "calibration").iterdir()) == [path]  # no other file (or leftover) beside it
