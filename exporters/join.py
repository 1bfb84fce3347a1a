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
finished HTTP request to its consumers (the usage-ledger writer, the span builder)
once both halves of every engine request it became are in.

One HTTP request may become several engine requests (fan-out): `n > 1`, a list of
prompts on `/v1/completions`, `/v1/chat/completions/batch`, the sub-requests of
`/v1/responses`. All carry its `kvl-` id, so the join collects every half under it
and the consumers see one `FinishedRequest` with the children summed. How many to
wait for: the middleware counts them from the body (`InFlight.engine_requests`);
where it cannot (`/v1/responses`) the count is open. Either way the join waits for the
response's end (`request_ended`) and then for as many stats as engine halves, at least
the count: a fan-out the body did not show is billed whole, not cut at the count.

A request the client abandoned has only the engine half: vLLM's API process drops
its state on abort and reports no stats for it. So a background sweep delivers an
aborted `RequestDone` after `abort_grace` seconds without stats, and anything else
half-joined after `timeout` seconds. The middleware hands over the `InFlight` entry
when a response ends early (`request_ended`), so the record of an aborted request
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

from kvlease.engine.events import LeaseEvent, Preemption, RequestDone
from kvlease.engine.tenancy import TenantContext

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
    engine_requests: int | None = 1  # engine requests it becomes; None: known at its end
    streamed_tokens: int = 0  # output streamed so far (kvlease.exporters.open_records journals it)


@dataclass
class FinishedRequest:
    """One HTTP request's halves: a vLLM `FinishedRequestStats` and a scheduler
    `RequestDone` per engine request, summed by the properties below."""

    key: str  # kvl-... id
    created: float  # monotonic, for the timeout
    entry: InFlight | None = None
    stats: list[Any] = field(default_factory=list)  # vLLM FinishedRequestStats
    done: list[RequestDone] = field(default_factory=list)
    done_at: float = 0.0  # monotonic arrival of the latest `done`, for the abort grace
    ended_at: float | None = None  # wall clock when the latest engine half arrived
    events: list[Preemption | LeaseEvent] = field(default_factory=list)
    response_ended: bool = False  # the middleware saw the response's end
    partial: bool = False  # delivered before every half arrived (timeout, overflow, shutdown)

    @property
    def joined(self) -> bool:
        """Every engine request the response became has both halves. The response's end
        comes first: by then vLLM has run every engine request it made of the body,
        however many that was (a count the middleware could not foresee, a future
        fan-out), and the count from the body is only a floor for halves still on the
        way. vLLM names its `n` children apart only inside the engine, so halves are
        matched by number, not by id."""
        if not self.response_ended:
            return False
        expected = self.entry.engine_requests if self.entry is not None else None
        halves = len(self.done)
        return 0 < halves == len(self.stats) and (expected is None or halves >= expected)

    @property
    def deliverable(self) -> bool:
        return bool(self.stats or self.done)

    @property
    def aborted_without_stats(self) -> bool:
        """vLLM reports no stats for an abandoned request: the engine half is all there is."""
        return (
            not self.stats
            and bool(self.done)
            and all(status_outcome(d.status) == "aborted" for d in self.done)
        )

    # The children summed (one engine request: its own figures).
    @property
    def prompt_tokens(self) -> int:
        if self.stats:
            return sum(s.num_prompt_tokens for s in self.stats)
        return sum(d.prompt_tokens for d in self.done)

    @property
    def cached_tokens(self) -> int:
        return sum(s.num_cached_tokens for s in self.stats)

    @property
    def output_tokens(self) -> int:
        if self.stats:
            return sum(s.num_generation_tokens for s in self.stats)
        return sum(d.output_tokens for d in self.done)

    @property
    def preemptions(self) -> int:
        if self.stats:
            return sum(s.num_preemptions for s in self.stats)
        return sum(d.preemptions for d in self.done)

    @property
    def recomputed_tokens(self) -> int:
        return sum(d.recomputed_tokens for d in self.done)

    @property
    def recomputed_by(self) -> dict[str, int]:
        """Its recomputed tokens by the tier whose allocation preempted it."""
        out: dict[str, int] = {}
        for d in self.done:
            for tier, n in d.recomputed_by.items():
                out[tier] = out.get(tier, 0) + n
        return out

    @property
    def block_seconds(self) -> float:
        return sum(d.block_seconds for d in self.done)

    @property
    def lease_covered_tokens(self) -> int:
        return sum(d.lease_covered_tokens for d in self.done)

    @property
    def e2e_latency(self) -> float | None:
        """The longest child's engine latency (the request took as long as its slowest)."""
        return max((s.e2e_latency for s in self.stats), default=None)

    @property
    def outcome(self) -> str:
        """The worst child's: failed over aborted over completed."""
        found = {finish_outcome(s.finish_reason) for s in self.stats}
        found |= {status_outcome(d.status) for d in self.done}
        return next((o for o in ("failed", "aborted") if o in found), "completed")


Consumer = Callable[[FinishedRequest], None]


class RequestJoin:
    """Thread-safe: engine events come from the channel thread, stats and entries from the
    event loop, the sweep from its own thread. Memory: `in_flight` holds one entry per
    request in this process; at most `max_pending` unfinished joins: past that the oldest
    is delivered as it is, flagged partial and counted in `overflowed`, never dropped
    unseen. A sweep is O(pending)."""

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
        self.overflowed = 0  # deliveries forced by max_pending
        self.on_overflow: Callable[[int], None] = lambda n: None  # the metrics' counter
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
            pending, ready = self._get(key)
            if isinstance(event, RequestDone):
                pending.done.append(event)
                pending.done_at, pending.ended_at = self.clock(), time.time()
            else:
                pending.events.append(event)
            ready += self._take_if_joined(key)
        self._deliver(ready)

    def request_stats(self, stats: Any, entry: InFlight | None) -> None:
        key = kvlease_id(stats.request_id)
        if key is None or not self.consumers:
            return
        with self._lock:
            pending, ready = self._get(key)
            pending.stats.append(stats)
            pending.entry = pending.entry or entry
            ready += self._take_if_joined(key)
        self._deliver(ready)

    def request_ended(self, request_id: str, entry: InFlight) -> None:
        """The response is complete, or ended early (client gone): every engine request it
        became has produced its output, and its halves may be counted. The entry is kept
        for halves still to come (an aborted request's model and start time); a join with
        no half is dropped after `timeout`."""
        key = kvlease_id(request_id)
        if key is None or not self.consumers:
            return
        with self._lock:
            pending, ready = self._get(key)
            pending.entry = pending.entry or entry
            pending.response_ended = True
            ready += self._take_if_joined(key)
        self._deliver(ready)

    def sweep(self) -> None:
        """Deliver aborted requests past their grace and half-joins past the timeout."""
        now = self.clock()
        with self._lock:
            ready = []
            for key in list(self._pending):
                p = self._pending[key]
                if p.aborted_without_stats and now - p.done_at >= self.abort_grace:
                    ready.append(self._pending.pop(key))
                elif now - p.created >= self.timeout:
                    ready += self._release(key)
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
            items = [p for key in list(self._pending) for p in self._release(key)]
        self._deliver(items)

    def _get(self, key: str) -> tuple[FinishedRequest, list[FinishedRequest]]:
        """The pending join for `key` (created with its in-flight entry), and what had to be
        released to make room for it."""
        released: list[FinishedRequest] = []
        pending = self._pending.get(key)
        if pending is None:
            if len(self._pending) >= self.max_pending:
                released = self._release(next(iter(self._pending)))
                self.overflowed += len(released)
                self.on_overflow(len(released))
            pending = FinishedRequest(key, self.clock(), self.in_flight.get(key))
            self._pending[key] = pending
        return pending, released

    def _release(self, key: str) -> list[FinishedRequest]:
        """Take `key` out unjoined: delivered flagged partial if it has a half, else gone."""
        p = self._pending.pop(key)
        p.partial = not p.aborted_without_stats
        return [p] if p.deliverable else []

    def _take_if_joined(self, key: str) -> list[FinishedRequest]:
        return [self._pending.pop(key)] if self._pending[key].joined else []

    def _deliver(self, items: list[FinishedRequest]) -> None:
        for item in items:
            for consumer in self.consumers:
                try:
                    consumer(item)
                except Exception:  # one consumer's bug must not starve the others
                    logger.exception("kvlease: a finished-request consumer failed")
