"""Which calls the drafter runs at once: per caller, and those that wait on the writer.

A synchronous gRPC server has a fixed pool of worker threads. Without a rule,
one caller's flood, or a pile of writes waiting for their commit, holds every
thread and every other caller's Propose waits behind them. ``Admission``
refuses at once (the service answers RESOURCE_EXHAUSTED, which callers retry
with back-off) a call beyond its caller's share, or a write beyond the
writes' share, so Propose always finds a thread. No gRPC here.
"""

from __future__ import annotations

import threading

from specdec.limits import PerCaller


class Refused(Exception):
    """The call is beyond a limit; the message names the flag."""


class Admission:
    def __init__(self, max_calls_per_caller: int, max_write_calls: int) -> None:
        self.max_calls_per_caller, self.max_write_calls = max_calls_per_caller, max_write_calls
        self._calls = PerCaller(max_calls_per_caller)
        self.writes = 0  # write calls running now
        self.refused = 0  # calls refused so far
        # A call takes its caller's place and a write place together or neither.
        self._lock = threading.Lock()

    def running(self, caller: str) -> int:
        return self._calls.in_flight(caller)

    def acquire(self, caller: str, write: bool = False) -> None:
        """Take one of ``caller``'s slots (and a write slot), or raise ``Refused``; ``release`` it after.

        max_calls_per_caller=2: a caller's third concurrent call is refused, another caller's is not."""
        with self._lock:
            if not self._calls.take(caller):
                self.refused += 1
                raise Refused(
                    f"this caller ({caller}) has {self._calls.in_flight(caller)} calls running, the limit (--max-calls-per-caller "
                    f"{self.max_calls_per_caller}); retry with back-off"
                )
            if write and self.writes >= self.max_write_calls:
                # Under self._lock: no other acquire or release sees the place taken for this instant.
                self._calls.give_back(caller)
                self.refused += 1
                raise Refused(
                    f"{self.writes} writes are waiting for the writer already, the limit (--max-write-calls "
                    f"{self.max_write_calls}); retry with back-off"
                )
            self.writes += write

    def release(self, caller: str, write: bool = False) -> None:
        with self._lock:
            self._calls.give_back(caller)
            self.writes -= write
