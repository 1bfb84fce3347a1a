"""What the scheduler tells the rest of kvlease, and the bounded buffer it goes through.

The scheduler runs inside vLLM's engine loop, so it never blocks on a
consumer: events go into a fixed-size buffer, and when consumers fall behind
the newest events are dropped and counted. Exact totals never depend on
events: `engine.accounting` keeps cumulative counters beside them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class Preemption:
    at: float
    request_id: str
    tenant_id: str | None  # None: unclassified
    tier: str | None
    session_id: str | None
    reason: str  # "kv_pressure" or "admit_higher_tier"
    mode: str  # "recompute" or "offload"
    blocks: int  # KV blocks the request held
    discarded_tokens: int  # computed tokens thrown away (recompute upper bound)


@dataclass(frozen=True, slots=True)
class Eviction:
    """Cached prefix blocks of one tenant evicted to make room, within one step."""

    at: float
    tenant_id: str | None
    tier: str | None
    leased: bool
    blocks: int


@dataclass(frozen=True, slots=True)
class LeaseEvent:
    at: float
    tenant_id: str
    session_id: str | None
    tier: str
    kind: str  # "start", "renew" or "expire"
    expires_at: float | None  # clock value; None while a request is in flight
    request_id: str | None = None  # the request whose arrival or finish changed it


@dataclass(frozen=True, slots=True)
class RequestDone:
    """A request left the engine (finished, aborted or failed)."""

    at: float
    request_id: str
    tenant_id: str | None
    tier: str | None
    session_id: str | None
    status: str
    preemptions: int
    discarded_tokens: int
    block_seconds: float
    prompt_tokens: int = 0
    output_tokens: int = 0


Event = Preemption | Eviction | LeaseEvent | RequestDone


def event_dict(event: Event) -> dict:
    """A JSON-ready dict with a `type` field, for channels out of the engine process."""
    return {"type": type(event).__name__, **asdict(event)}


class EventBuffer:
    """A FIFO of at most `capacity` events; overflow drops the newest and counts it.

    Invariant: len(self) <= capacity; `dropped` only grows. push and drain are
    O(1) per event.
    """

    def __init__(self, capacity: int = 65536) -> None:
        if capacity <= 0:
            raise ValueError("event buffer capacity must be positive")
        self.capacity = capacity
        self.dropped = 0
        self._events: deque[Event] = deque()

    def push(self, event: Event) -> None:
        if len(self._events) >= self.capacity:
            self.dropped += 1
            return
        self._events.append(event)

    def drain(self, limit: int | None = None) -> list[Event]:
        n = len(self._events) if limit is None else min(limit, len(self._events))
        return [self._events.popleft() for _ in range(n)]

    def __len__(self) -> int:
        return len(self._events)
