"""Finished requests, joined from their two halves in the API process.

vLLM's `FinishedRequestStats` (stat-logger plugin: tokens, latency) and the
scheduler's events over the engine channel (`RequestDone`: block-seconds,
preemptions; `Preemption` and `LeaseEvent` with their request id) reach the
API process separately and in either order. `RequestJoin` pairs them by the
`kvl-...` request id TenantMiddleware issued and hands each finished request
to its consumers (tracing, the usage ledger) once both halves are in, or
after `timeout` seconds with whichever half arrived.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from exporters.metrics import kvlease_id

logger = logging.getLogger("kvlease.requests")


@dataclass
class FinishedRequest:
    key: str  # kvl-... id
    created: float  # monotonic, for the timeout
    entry: Any = None  # engine.server.InFlight, when the stats came while it was in flight
    stats: Any = None  # vLLM FinishedRequestStats
    done: dict | None = None  # the scheduler's RequestDone event
    events: list[dict] = field(default_factory=list)  # Preemption and LeaseEvent events


Consumer = Callable[[FinishedRequest], None]


class RequestJoin:
    """Thread-safe: engine events come from the channel thread, stats from the event loop.
    Memory: at most `max_pending` unfinished joins (the oldest is dropped first)."""

    def __init__(self, timeout: float = 30.0, max_pending: int = 10_000) -> None:
        self.timeout = timeout
        self.max_pending = max_pending
        self.consumers: list[Consumer] = []
        self._pending: dict[str, FinishedRequest] = {}
        self._lock = threading.Lock()

    def engine_event(self, event: dict) -> None:
        kind = event.get("type")
        if kind not in ("Preemption", "LeaseEvent", "RequestDone"):
            return
        key = kvlease_id(event.get("request_id"))
        if key is None:
            return
        with self._lock:
            pending = self._get(key)
            if kind == "RequestDone":
                pending.done = event
            else:
                pending.events.append(event)
            ready = self._take(key, stale=False)
        self._deliver(ready)

    def request_stats(self, stats: Any, entry: Any) -> None:
        key = kvlease_id(stats.request_id)
        if key is None:
            return
        with self._lock:
            pending = self._get(key)
            pending.stats, pending.entry = stats, entry
            ready = self._take(key, stale=True)
        self._deliver(ready)

    def flush(self) -> None:
        """Deliver everything with at least one half (at shutdown)."""
        with self._lock:
            items = [p for p in self._pending.values() if p.stats or p.done]
            self._pending.clear()
        self._deliver(items)

    def _get(self, key: str) -> FinishedRequest:
        pending = self._pending.get(key)
        if pending is None:
            if len(self._pending) >= self.max_pending:
                self._pending.pop(next(iter(self._pending)))
            pending = self._pending[key] = FinishedRequest(key, time.monotonic())
        return pending

    def _take(self, key: str, stale: bool) -> list[FinishedRequest]:
        out = []
        pending = self._pending[key]
        if pending.stats is not None and pending.done is not None:
            out.append(self._pending.pop(key))
        if stale:
            cutoff = time.monotonic() - self.timeout
            old = [k for k, p in self._pending.items() if p.created < cutoff and k != key]
            out += [p for p in map(self._pending.pop, old) if p.stats or p.done]
        return out

    def _deliver(self, items: list[FinishedRequest]) -> None:
        for item in items:
            for consumer in self.consumers:
                try:
                    consumer(item)
                except Exception:  # one consumer's bug must not starve the others
                    logger.exception("kvlease: a finished-request consumer failed")


JOIN = RequestJoin()
