"""Finished requests, joined from their two halves in the API process.

vLLM's `FinishedRequestStats` (stat-logger plugin: tokens, latency) and the
scheduler's events over the engine channel (`RequestDone`: block-seconds,
preemptions; `Preemption` and `LeaseEvent` with their request id) reach the
API process separately and in either order. `RequestJoin` pairs them by the
`kvl-...` request id TenantMiddleware issued and hands each finished request
to its consumers (tracing, the usage ledger) once both halves are in.

A request the client abandoned has only the engine half: vLLM's API process
drops its state on abort and reports no stats for it. So a background sweep
delivers an aborted `RequestDone` after `abort_grace` seconds without stats,
and anything else that is half-joined after `timeout` seconds. The middleware
hands over the request's `InFlight` entry when a response ends early
(`request_left`), so the record of an aborted request still knows its model
and start time.
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
ABORTED = "finished_aborted"


@dataclass
class FinishedRequest:
    key: str  # kvl-... id
    created: float  # monotonic, for the timeout
    entry: Any = None  # engine.server.InFlight, when known
    stats: Any = None  # vLLM FinishedRequestStats
    done: dict | None = None  # the scheduler's RequestDone event
    done_at: float = 0.0  # monotonic arrival of `done`, for the abort grace
    ended_at: float | None = None  # wall clock when the engine half arrived
    events: list[dict] = field(default_factory=list)  # Preemption and LeaseEvent events

    @property
    def joined(self) -> bool:
        return self.stats is not None and self.done is not None

    @property
    def deliverable(self) -> bool:
        return self.stats is not None or self.done is not None


Consumer = Callable[[FinishedRequest], None]


class RequestJoin:
    """Thread-safe: engine events come from the channel thread, stats and entries from the
    event loop, the sweep from its own thread. Memory: at most `max_pending` unfinished
    joins (the oldest is dropped first); a sweep is O(pending)."""

    def __init__(
        self,
        timeout: float = 30.0,
        abort_grace: float = 2.0,
        max_pending: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout = timeout
        self.abort_grace = abort_grace
        self.max_pending = max_pending
        self.clock = clock
        self.consumers: list[Consumer] = []
        self._pending: dict[str, FinishedRequest] = {}
        self._lock = threading.Lock()
        self._sweeper: threading.Thread | None = None

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
                pending.done, pending.done_at, pending.ended_at = event, self.clock(), time.time()
            else:
                pending.events.append(event)
            ready = self._take_if_joined(key)
        self._deliver(ready)

    def request_stats(self, stats: Any, entry: Any) -> None:
        key = kvlease_id(stats.request_id)
        if key is None:
            return
        with self._lock:
            pending = self._get(key)
            pending.stats, pending.entry = stats, entry or pending.entry
            ready = self._take_if_joined(key)
        self._deliver(ready)

    def request_left(self, request_id: str, entry: Any) -> None:
        """The response ended before its last byte (client gone): keep the entry for the
        engine half that is still to come. Dropped after `timeout` if nothing comes."""
        key = kvlease_id(request_id)
        if key is None:
            return
        with self._lock:
            pending = self._get(key)
            pending.entry = pending.entry or entry

    def sweep(self) -> None:
        """Deliver aborted requests past their grace and half-joins past the timeout."""
        now = self.clock()
        with self._lock:
            due = [
                key
                for key, p in self._pending.items()
                if now - p.created >= self.timeout
                or (
                    p.stats is None
                    and p.done is not None
                    and p.done.get("status") == ABORTED
                    and now - p.done_at >= self.abort_grace
                )
            ]
            ready = [p for p in map(self._pending.pop, due) if p.deliverable]
        self._deliver(ready)

    def start(self, interval: float = 1.0) -> None:
        """Sweep every `interval` seconds from a daemon thread (once per process)."""
        if self._sweeper is not None:
            return

        def run() -> None:
            while True:
                time.sleep(interval)
                try:
                    self.sweep()
                except Exception:  # the sweep must outlive one bad record
                    logger.exception("kvlease: the request-join sweep failed")

        self._sweeper = threading.Thread(target=run, name="kvlease-join-sweep", daemon=True)
        self._sweeper.start()

    def flush(self) -> None:
        """Deliver everything with at least one half (at shutdown)."""
        with self._lock:
            items = [p for p in self._pending.values() if p.deliverable]
            self._pending.clear()
        self._deliver(items)

    def _get(self, key: str) -> FinishedRequest:
        pending = self._pending.get(key)
        if pending is None:
            if len(self._pending) >= self.max_pending:
                self._pending.pop(next(iter(self._pending)))
            pending = self._pending[key] = FinishedRequest(key, self.clock())
        return pending

    def _take_if_joined(self, key: str) -> list[FinishedRequest]:
        return [self._pending.pop(key)] if self._pending[key].joined else []

    def _deliver(self, items: list[FinishedRequest]) -> None:
        for item in items:
            for consumer in self.consumers:
                try:
                    consumer(item)
                except Exception:  # one consumer's bug must not starve the others
                    logger.exception("kvlease: a finished-request consumer failed")


JOIN = RequestJoin()
