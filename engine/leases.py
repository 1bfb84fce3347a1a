"""Leases: how long a tenant session's KV cache stays protected.

A session's lease starts with its first request, renews with every later
one, and lasts `lease_seconds` after its last in-flight request finishes.
A tier with `lease_seconds == 0` never holds a lease. Expiry is exact: a lease
whose last request finished at t is active for every clock value < t +
lease_seconds and expired from t + lease_seconds on.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

Clock = Callable[[], float]
K = TypeVar("K", bound=Hashable)  # a session key: the scheduler's is (tenant id, session id)


@dataclass(slots=True)
class Lease(Generic[K]):
    """One session's lease. `expires_at` is None while a request is in flight."""

    session: K
    lease_seconds: float
    in_flight: int = 0
    expires_at: float | None = None

    def active(self, now: float) -> bool:
        return self.in_flight > 0 or (self.expires_at is not None and now < self.expires_at)


@dataclass(slots=True)
class LeaseChange(Generic[K]):
    session: K
    kind: str  # "start", "renew" or "expire"
    expires_at: float | None  # None while requests are in flight
    at: float


@dataclass
class LeaseBook(Generic[K]):
    """Leases by session key, with an expiry heap.

    Invariant: every leased session with no request in flight has exactly one
    live heap entry (expires_at, seq, session); stale entries are skipped on
    pop. Sessions whose lease has expired are forgotten, so memory is bounded
    by live sessions. Costs: start/finish O(log n), `expire()` O(k log n) for
    k expiries, `active()` O(1).
    """

    clock: Clock = time.monotonic
    _leases: dict[K, Lease[K]] = field(default_factory=dict)
    _heap: list[tuple[float, int, K]] = field(default_factory=list)
    _seq: int = 0

    def request_started(self, session: K, lease_seconds: float) -> LeaseChange[K] | None:
        """A request of `session` arrived. Returns the lease change, if leased."""
        if lease_seconds <= 0:
            return None
        now = self.clock()
        lease = self._leases.get(session)
        if lease is None or not lease.active(now):
            lease = self._leases[session] = Lease(session, lease_seconds)
            kind = "start"
        else:
            kind = "renew"
        lease.lease_seconds = lease_seconds
        lease.in_flight += 1
        lease.expires_at = None
        return LeaseChange(session, kind, None, now)

    def request_finished(self, session: K) -> LeaseChange[K] | None:
        """A request of `session` left the engine (finished or aborted)."""
        lease = self._leases.get(session)
        if lease is None or lease.in_flight == 0:
            return None
        lease.in_flight -= 1
        if lease.in_flight:
            return None
        now = self.clock()
        lease.expires_at = now + lease.lease_seconds
        self._seq += 1
        heapq.heappush(self._heap, (lease.expires_at, self._seq, session))
        return LeaseChange(session, "renew", lease.expires_at, now)

    def expire(self) -> list[LeaseChange[K]]:
        """Forget every lease that has run out by now; return their expiry changes."""
        now = self.clock()
        changes = []
        while self._heap and self._heap[0][0] <= now:
            expires_at, _, session = heapq.heappop(self._heap)
            lease = self._leases.get(session)
            if lease is None or lease.expires_at != expires_at or lease.active(now):
                continue  # renewed since this entry was pushed
            del self._leases[session]
            changes.append(LeaseChange(session, "expire", expires_at, now))
        return changes

    def active(self, session: K) -> bool:
        lease = self._leases.get(session)
        return lease is not None and lease.active(self.clock())

    def seconds_left(self, session: K) -> float | None:
        """None when not leased; inf while a request is in flight."""
        lease = self._leases.get(session)
        now = self.clock()
        if lease is None or not lease.active(now):
            return None
        if lease.in_flight:
            return float("inf")
        assert lease.expires_at is not None
        return lease.expires_at - now

    def sessions(self) -> list[K]:
        return list(self._leases)
