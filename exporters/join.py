"""A request's two halves, joined in the API process by the request id kvlease issued.

A tenant request is known in the API process three ways, each in its own place:
- while it is in flight, by the middleware's `InFlight` entry (tenant, route, start,
  `traceparent`, model), kept in `RequestJoin.in_flight` under its `kvl-...` id;
- when vLLM finishes it, by the stat-logger plugin's `FinishedRequestStats` (tokens,
  latencies, finish reason);
- from the scheduler, over the engine channel: `RequestDone` (block-seconds,
  recomputed tokens), and `Preemption` / `LeaseEvent` with its request id.

The last two reach this process separately and in either order. `RequestJoin` pairs
them by the `kvl-...` id (vLLM's engine request ids contain it) and hands each
finished request to its consumers (the usage-ledger writer, the span builder) once
both halves are in.

A request the client abandoned has only the engine half: vLLM's API process drops
its state on abort and reports no stats for it. So a background sweep delivers an
aborted `RequestDone` after `abort_grace` seconds without stats, and anything else
half-joined after `timeout` seconds. The middleware hands over the `InFlight` entry
when a response ends early (`request_left`), so the record of an aborted request
still knows its model and start time.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.events import LeaseEvent, Preemption, RequestDone
from engine.tenancy import TenantContext

logger = logging.getLogger("kvlease.join")

_REQUEST_ID = re.compile(r"kvl-[0-9a-f]{32}")
# vLLM's FinishReason (vllm/v1/engine/__init__.py) by value: the OpenAI finish reason.
FINISH_REASONS = {0: "stop", 1: "length", 2: "abort", 3: "error", 4: "repetition"}
# What a finished request was, for the ledger and the requests counter.
OUTCOMES = ("completed", "aborted", "failed")
_OUTCOME_OF_FINISH = {"abort": "aborted", "error": "failed"}
_OUTCOME_OF_STATUS = {"finished_aborted": "aborted", "finished_error": "failed"}


def new_request_id() -> str:
    """The id the middleware gives a tenant request (sent to vLLM as `X-Request-Id`)."""
    return f"kvl-{uuid.uuid4().hex}"


def kvlease_id(request_id: str | None) -> str | None:
    """The `kvl-...` id inside a vLLM engine request id (vLLM adds prefixes and suffixes)."""
    match = _REQUEST_ID.search(request_id or "")
    return match.group(0) if match else None


def finish_outcome(finish_reason: int) -> str:
    """`OUTCOMES` member for a vLLM finish reason (an unknown one counts as failed)."""
    reason = FINISH_REASONS.get(int(finish_reason))
    return "failed" if reason is None else _OUTCOME_OF_FINISH.get(reason, "completed")


def status_outcome(status: str) -> str:
    """`OUTCOMES` member for the scheduler's request status (`RequestDone.status`)."""
    return _OUTCOME_OF_STATUS.get(status, "completed")


@dataclass
class InFlight:
    """What the API process knows of one tenant request while it is in flight."""

    ctx: TenantContext
    path: str
    started_ns: int  # wall clock
    traceparent: str | None = None
    model: str | None = None


@dataclass
class FinishedRequest:
    key: str  # kvl-... id
    created: float  # monotonic, for the timeout
    entry: InFlight | None = None
    stats: Any = None  # vLLM FinishedRequestStats
    done: RequestDone | None = None
    done_at: float = 0.0  # monotonic arrival of `done`, for the abort grace
    ended_at: float | None = None  # wall clock when the engine half arrived
    events: list[Preemption | LeaseEvent] = field(default_factory=list)

    @property
    def joined(self) -> bool:
        return self.stats is not None and self.done is not None

    @property
    def deliverable(self) -> bool:
        return self.stats is not None or self.done is not None


Consumer = Callable[[FinishedRequest], None]


class RequestJoin:
    """Thread-safe: engine events come from the channel thread, stats and entries from the
    event loop, the sweep from its own thread. Memory: `in_flight` holds one entry per
    request in this process; at most `max_pending` unfinished joins (the oldest is dropped
    first); a sweep is O(pending)."""

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
        self.in_flight: dict[str, InFlight] = {}  # kvl- id -> entry, while in this process
        self._pending: dict[str, FinishedRequest] = {}
        self._lock = threading.Lock()
        self._sweeper: threading.Thread | None = None

    def entry(self, request_id: str | None) -> InFlight | None:
        """The middleware's entry for an engine request id, while the request is here."""
        key = kvlease_id(request_id)
        return self.in_flight.get(key) if key else None

    def engine_event(self, event: Any) -> None:
        if not isinstance(event, Preemption | LeaseEvent | RequestDone):
            return
        key = kvlease_id(event.request_id)
        if key is None or not self.consumers:
            return
        with self._lock:
            pending = self._get(key)
            if isinstance(event, RequestDone):
                pending.done, pending.done_at, pending.ended_at = event, self.clock(), time.time()
            else:
                pending.events.append(event)
            ready = self._take_if_joined(key)
        self._deliver(ready)

    def request_stats(self, stats: Any, entry: InFlight | None) -> None:
        key = kvlease_id(stats.request_id)
        if key is None or not self.consumers:
            return
        with self._lock:
            pending = self._get(key)
            pending.stats, pending.entry = stats, entry or pending.entry
            ready = self._take_if_joined(key)
        self._deliver(ready)

    def request_left(self, request_id: str, entry: InFlight) -> None:
        """The response ended before its last byte (client gone): keep the entry for the
        engine half that is still to come. Dropped after `timeout` if nothing comes."""
        key = kvlease_id(request_id)
        if key is None or not self.consumers:
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
                    and status_outcome(p.done.status) == "aborted"
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
