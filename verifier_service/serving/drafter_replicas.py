"""Which drafter replica a verifier talks to: the addresses ``--drafter`` lists, and the
choice among them. No gRPC here: ``drafter_client`` owns the channels and calls.

Drafter replicas share one learned state (one ordered log, each replica applying it), but a
session lives in the memory of the replica that opened it. So a verifier sticks to one
replica, chosen at random when it starts (many verifiers spread over the replicas), and
moves only when that one fails: to the next in the list that has not failed lately
(round-robin), reopening its sessions there. It never moves back while the current one
works; a replica that failed is a candidate again ``retry_after_s`` later.
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections.abc import Callable

FLAG = "--drafter"
# gRPC name-resolver schemes a target may start with: such a target is one channel, handed to
# gRPC whole (its own resolver may yield several addresses: "ipv4:10.0.0.1:50051,10.0.0.2:50051").
SCHEMES = ("dns", "ipv4", "ipv6", "unix", "unix-abstract", "vsock", "xds")
# Schemes whose addresses are HOST:PORT: gRPC would quietly dial 443 for a missing port.
ADDRESS_SCHEMES = ("dns", "ipv4", "ipv6")
_SCHEME = re.compile(rf"^({'|'.join(re.escape(scheme) for scheme in SCHEMES)}):(.*)$", re.DOTALL)
_HOST_PORT = re.compile(r"^([^\s:\[\]/,]+):(\d{1,5})$")
_IPV6_PORT = re.compile(r"^\[([0-9A-Fa-f:.]+(?:%[\w.-]+)?)\]:(\d{1,5})$")


def drafter_targets(text: str) -> tuple[str, ...]:
    """The gRPC targets ``--drafter`` names, one channel each; ValueError naming the flag.

    "a:50051,b:50051" -> ("a:50051", "b:50051") (replicas, each HOST:PORT, IPv6 in brackets:
    "[::1]:50051"); "dns:///drafter-headless:50051" -> ("dns:///drafter-headless:50051",) (one
    target with a scheme, which gRPC resolves itself); "a:50051,,b:50051", "a", "a:1,a:1" -> ValueError.
    """
    if _SCHEME.match(text.strip()):
        return (_scheme_target(text.strip()),)
    entries = [entry.strip() for entry in text.split(",")]
    seen: dict[str, int] = {}
    for position, entry in enumerate(entries, 1):
        where = f"{FLAG} {text!r}: entry {position}" if len(entries) > 1 else f"{FLAG} {text!r}"
        if not entry:
            raise ValueError(f"{where} is empty; give HOST:PORT,HOST:PORT (or one gRPC target such as dns:///NAME:PORT)")
        if _SCHEME.match(entry):
            scheme = entry.split(":", 1)[0]
            raise ValueError(f"{where}: a target with a scheme ({scheme}:) must be the only one; list replicas as HOST:PORT")
        _check_address(entry, where)
        key = entry.lower()
        if key in seen:
            raise ValueError(f"{where} repeats entry {seen[key]} ({entry}); list each replica once")
        seen[key] = position
    return tuple(entries)


def _scheme_target(target: str) -> str:
    scheme, rest = _SCHEME.match(target).groups()  # type: ignore[union-attr]
    if scheme not in ADDRESS_SCHEMES:
        if not rest.strip("/"):
            raise ValueError(f"{FLAG} {target!r} names no address after {scheme}:")
        return target
    if scheme == "dns" and rest.startswith("//"):  # dns://AUTHORITY/HOST:PORT: the DNS server to ask, then the name
        rest = rest[2:].partition("/")[2]
    if scheme == "dns" and "," in rest:
        raise ValueError(f"{FLAG} {target!r}: a dns: target names one name; list replicas as HOST:PORT,HOST:PORT")
    for address in rest.split(",") if scheme != "dns" else [rest]:
        _check_address(address, f"{FLAG} {target!r}")
    return target


def _check_address(address: str, where: str) -> None:
    match = _HOST_PORT.match(address) or _IPV6_PORT.match(address)
    if match is None:
        if address.count(":") > 1 and not address.startswith("["):
            raise ValueError(f"{where}: write an IPv6 address in brackets, as [::1]:50051 (got {address!r})")
        raise ValueError(f"{where}: {address!r} is not HOST:PORT (a port is required, e.g. drafter:50051)")
    if not 1 <= int(match.group(2)) <= 65535:
        raise ValueError(f"{where}: port {match.group(2)} of {address!r} is not in 1-65535")


class ReplicaChoice:
    """The replica in use among ``count``, and where to go when it fails. Thread-safe: the
    decoding thread and the observer thread both report failures.

    Replicas [a, b, c], current a: a fails -> b (returned: retry there now); b then works
    for an hour -> still b. b fails -> c; c fails at once -> a (a failed an hour ago). With
    a, b and c all failed within ``retry_after_s`` -> None: nowhere to go, current unchanged.
    """

    def __init__(self, count: int, retry_after_s: float, first: int | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        assert count >= 1, "at least one replica"
        self.count = count
        self.retry_after_s = retry_after_s
        self.current = random.randrange(count) if first is None else first
        self.failovers = 0  # moves from one replica to another
        self._clock = clock
        self._failed_at = [float("-inf")] * count
        self._lock = threading.Lock()

    def fail_over(self, failed: int) -> int | None:
        """Replica ``failed`` failed: the replica to retry on (now current), else None.
        When another thread has already moved on from ``failed``, that is the current one."""
        with self._lock:
            now = self._clock()
            self._failed_at[failed] = now
            if failed != self.current:
                return self.current
            for offset in range(1, self.count):
                candidate = (failed + offset) % self.count
                if now - self._failed_at[candidate] >= self.retry_after_s:
                    self.current = candidate
                    self.failovers += 1
                    return candidate
            return None
