"""Learning scopes: whose text a table holds, and who may read and write it. No gRPC here.

Every observation, successor prediction and draft lookup belongs to a scope, and a
draft comes only from its sequence's own scope (plus, read-only, the one scope a
verifier shares with every caller, and the request's own context). Each (vocabulary,
scope) has a table of its own (``table_name``), so one scope's flood evicts only its
own n-grams, and its budget (``--max-bytes``) is its own.

A scope id is the empty string (the default scope: a verifier with no authentication,
one user) or 32 lowercase hex digits that the verifier derives from its caller with a
keyed hash (HMAC-SHA256 under the verifier's ``--scope-secret``). The drafter never sees
a key, and nobody who lacks the key can compute its scope: the id is a capability, as
vLLM's ``cache_salt`` is for prefix caches.

Who may declare one (``ScopeGate``): with neither ``--client-token`` nor
``--verifier-identities`` configured, every client may (the capability is the
protection); with either, only a client that presents the token or a listed certificate
identity may. Any other client is kept in a scope of its own, derived from who it is
(``peer_scope``), and a call that declares a scope is refused: it can name no other.

    gate = ScopeGate(token="t0k", identities=())
    gate.resolve("", caller="10.0.0.7", trusted=False)          -> peer_scope("10.0.0.7")
    gate.resolve("ab" * 16, caller="10.0.0.7", trusted=False)   -> ScopeRefused
    gate.resolve("ab" * 16, caller="10.0.0.7", trusted=True)    -> "abab...ab"
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Sequence

DEFAULT_SCOPE = ""
SCOPE_HEX_DIGITS = 32  # 128 bits: unguessable, and short enough for a folder name
SCOPE_PATTERN = re.compile(r"[0-9a-f]{32}")  # always with fullmatch
# A table's folder under --db: the vocabulary fingerprint, then "-" and the scope for
# every scope but the default, whose table keeps the plain name (so tables written
# before scopes existed are the default scope's, unchanged).
TABLE_PATTERN = re.compile(r"([0-9a-f]{16})(?:-([0-9a-f]{32}))?")


class ScopeRefused(Exception):
    """A client declared a scope it may not use (PERMISSION_DENIED) or a malformed one (INVALID_ARGUMENT)."""

    def __init__(self, message: str, permission: bool) -> None:
        super().__init__(message)
        self.permission = permission


def table_name(vocabulary: str, scope: str) -> str:
    """The folder of a (vocabulary, scope) table: "0123456789abcdef" for the default scope,
    "0123456789abcdef-<32 hex digits>" for any other."""
    return vocabulary if scope == DEFAULT_SCOPE else f"{vocabulary}-{scope}"


def split_table_name(name: str) -> tuple[str, str] | None:
    """(vocabulary, scope) of a table folder's name, or None when it names no table."""
    match = TABLE_PATTERN.fullmatch(name)
    if match is None:
        return None
    return match.group(1), match.group(2) or DEFAULT_SCOPE


def peer_scope(caller: str) -> str:
    """The scope of a client that may not declare one: its own, from its identity (client
    certificate, else address). Two calls from one client share it; two clients never do."""
    return hashlib.sha256(b"specdec peer scope\0" + caller.encode("utf-8", "surrogatepass")).hexdigest()[:SCOPE_HEX_DIGITS]


def check_scope(scope: str, where: str) -> None:
    """ScopeRefused (not a permission matter) unless ``scope`` is "" or 32 lowercase hex digits."""
    if scope != DEFAULT_SCOPE and not SCOPE_PATTERN.fullmatch(scope):
        raise ScopeRefused(
            f"{where} must be empty (the default scope) or {SCOPE_HEX_DIGITS} lowercase hex digits (a verifier's "
            f"keyed hash of its caller), got {scope[:80]!r}",
            permission=False,
        )


class ScopeGate:
    """Which clients may declare scopes, and the scope each call gets."""

    def __init__(self, token: str | None, identities: Sequence[str]) -> None:
        # Compared as digests, in constant time, as the verifier compares API keys.
        self._token = hashlib.sha256(token.encode()).digest() if token else None
        self._identities = frozenset(identities)

    @property
    def restricted(self) -> bool:
        """Only some clients may declare scopes (a token or identities are configured)."""
        return self._token is not None or bool(self._identities)

    def trusts(self, token: str | None, certificate: str | None) -> bool:
        """A client may declare scopes: nothing is configured, or it presents the token or a
        listed certificate identity (``certificate``: its common name under mutual TLS)."""
        if not self.restricted:
            return True
        if certificate is not None and certificate in self._identities:
            return True
        if self._token is None or token is None:
            return False
        return hmac.compare_digest(hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest(), self._token)

    def resolve(self, declared: str, caller: str, trusted: bool, where: str = "scope") -> str:
        """The scope a call gets: what it declared, when it may declare; else its peer scope,
        and ScopeRefused if it declared one anyway."""
        check_scope(declared, where)
        if trusted:
            return declared
        if declared != DEFAULT_SCOPE:
            raise ScopeRefused(
                f"{where}: this drafter takes declared scopes only from verifiers that present its --client-token or a "
                "certificate named in --verifier-identities; this client has a scope of its own and can name no other",
                permission=True,
            )
        return peer_scope(caller)
