"""Learning scopes, from the verifier's side: which scope each caller's requests learn
in and draft from, and the opaque id the drafter is told. No gRPC and no HTTP here.

A caller's scope is, in order: its API key's (each key its own scope, unless the key
file puts it in a named one: ``KEY scope=NAME``, so an organisation's keys share what
they learn); else, under mutual TLS, its client certificate's common name; else the
default scope (a server with no authentication: one user). The drafter never sees a
key or a name: it is told ``HMAC-SHA256(secret, kind | value)``, cut to 128 bits, as
32 hex digits. Without the secret nobody can compute a scope's id, not even from a weak
key, so a client that reaches the drafter directly cannot name another caller's scope.

Verifiers that share a drafter and serve the same keys share what they learn only if
they share the secret (``--scope-secret`` or ``--scope-secret-file``). Without one the
verifier keeps a random secret in its cache folder (``$SPECDEC_CACHE_DIR/scope-secret``),
so a restart keeps every scope, and verifiers on one machine share it.

    ids = ScopeIds(b"secret")
    ids.of_key("sk-alice", None) != ids.of_key("sk-bob", None)
    ids.of_key("sk-alice", "acme") == ids.of_key("sk-bob", "acme") == ids.of_name("acme")
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import time
from pathlib import Path
from typing import NamedTuple

from specdec import settings

log = logging.getLogger(__name__)

DEFAULT_SCOPE = ""
SCOPE_ID_BYTES = 16  # 128 bits, 32 hex digits: what the drafter's scope ids are
# A scope's name in the key file: plain and short.
SCOPE_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
SECRET_FILE_NAME = "scope-secret"
SECRET_BYTES = 32
# A secret shorter than this is too easy to guess, and with it every scope's id.
MIN_SECRET_CHARS = 16


class KeyEntry(NamedTuple):
    """One API key and the named scope it learns in (None: a scope of its own)."""

    key: str
    scope: str | None


def parse_key_line(line: str, where: str) -> KeyEntry:
    """A key file's line: ``KEY`` or ``KEY scope=NAME`` (ValueError naming ``where``, never the key).

    "sk-1" -> ("sk-1", None); "sk-1 scope=acme" -> ("sk-1", "acme")."""
    key, *options = line.split()
    scope = None
    for option in options:
        name, equals, value = option.partition("=")
        if name != "scope" or not equals:
            raise ValueError(f"{where}: after the key, only scope=NAME may follow (got an option {name[:40]!r})")
        if scope is not None:
            raise ValueError(f"{where}: scope= is given twice")
        if not SCOPE_NAME_PATTERN.fullmatch(value):
            raise ValueError(f"{where}: a scope's name is 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit")
        scope = value
    return KeyEntry(key, scope)


class ScopeIds:
    """The drafter's scope ids, keyed by the server's secret (see the module docstring)."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def _id(self, kind: bytes, value: str) -> str:
        digest = hmac.new(self._secret, kind + b"\0" + value.encode("utf-8", "surrogatepass"), hashlib.sha256).digest()
        return digest[:SCOPE_ID_BYTES].hex()

    def of_key(self, key: str, scope: str | None) -> str:
        """The scope of an API key: its named scope's, else its own."""
        return self.of_name(scope) if scope is not None else self._id(b"key", key)

    def of_name(self, name: str) -> str:
        """The scope named ``name`` in the key file."""
        return self._id(b"scope", name)

    def of_certificate(self, common_name: str) -> str:
        """The scope of a client certificate's common name (mutual TLS, no API keys)."""
        return self._id(b"certificate", common_name)


def load_secret(secret: str | None, secret_file: str | None, cache_folder: Path) -> bytes:
    """The secret scope ids are keyed with: ``given_secret``, else the one kept in
    ``cache_folder`` (made there, readable by its owner only, on first use)."""
    given = given_secret(secret, secret_file)
    return given if given is not None else _kept_secret(cache_folder / SECRET_FILE_NAME)


def given_secret(secret: str | None, secret_file: str | None) -> bytes | None:
    """``secret``, else ``secret_file``'s first line, else None. ValueError for one too
    short, or a file that cannot be read."""
    secret = settings.secret(secret, secret_file, "--scope-secret")
    if secret is None:
        return None
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"the scope secret must be at least {MIN_SECRET_CHARS} characters (e.g. openssl rand -hex 32)")
    return secret.encode()


def _kept_secret(path: Path) -> bytes:
    """The secret in ``path``, made there first if there is none (O_EXCL: two verifiers
    starting at once agree on one)."""
    try:
        return _read_kept(path)
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    made = secrets.token_hex(SECRET_BYTES)
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another verifier made it meanwhile
        return _read_kept(path)
    with os.fdopen(descriptor, "w") as file:
        file.write(made + "\n")
        file.flush()
        os.fsync(file.fileno())
    log.info(
        "made a scope secret in %s: verifiers that share a drafter and serve the same keys share what they learn only "
        "with one secret (--scope-secret-file)",
        path,
    )
    return made.encode()


def _read_kept(path: Path) -> bytes:
    for _ in range(50):  # a file another verifier is still writing reads empty for an instant
        text = path.read_text(encoding="utf-8").strip()
        if text:
            return text.encode()
        time.sleep(0.01)
    raise ValueError(f"the scope secret file {path} is empty: remove it and restart, or give --scope-secret-file")
