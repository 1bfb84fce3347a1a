"""The API process's ledger writer: one usage record per finished request, group-committed.

A `RequestJoin` consumer turns each finished request into a `UsageRecord`
and queues it; a writer thread commits queues in batches (group commit: one
transaction for everything that arrived together), so the event loop never
waits on the database. TenantMiddleware holds a generation response's last
body chunk until the future `expect(request_id)` gave it resolves (the record
has committed), at most `KVLEASE_LEDGER_WAIT_SECONDS` (5): a client that
received a complete response can rely on its record being in the ledger,
even across a crash.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time

from engine.labels import UNCLASSIFIED
from exporters.join import FinishedRequest, finish_outcome, status_outcome
from exporters.ledger import UsageLedger, UsageRecord

WAIT_ENV = "KVLEASE_LEDGER_WAIT_SECONDS"
logger = logging.getLogger("kvlease.ledger")


def to_record(p: FinishedRequest) -> UsageRecord:
    stats, done, entry = p.stats, p.done, p.entry
    ctx = entry.ctx if entry is not None else None
    now = time.time()
    started = (
        entry.started_ns / 1e9 if entry is not None else now - (stats.e2e_latency if stats else 0.0)
    )
    if stats is not None:
        outcome = finish_outcome(stats.finish_reason)
    else:
        outcome = status_outcome(done.status) if done else "completed"
    return UsageRecord(
        request_id=p.key,
        tenant_id=(ctx.tenant_id if ctx else done and done.tenant_id) or UNCLASSIFIED,
        tier=ctx.tier if ctx else done and done.tier,
        session_id=ctx.session_id if ctx else done and done.session_id,
        model=(entry.model if entry is not None else None) or "unknown",
        started_at=started,
        ended_at=started + stats.e2e_latency if stats else (p.ended_at or now),
        input_tokens=stats.num_prompt_tokens if stats else done.prompt_tokens if done else 0,
        cached_input_tokens=stats.num_cached_tokens if stats else 0,
        output_tokens=stats.num_generation_tokens if stats else done.output_tokens if done else 0,
        recomputed_tokens=done.recomputed_tokens if done else 0,
        preemptions=stats.num_preemptions if stats else done.preemptions if done else 0,
        kv_block_seconds=done.block_seconds if done else 0.0,
        outcome=outcome,
    )


class LedgerWriter:
    """Queue in, batches out. Records are never dropped on a failed commit: the batch is
    retried (writes are idempotent) and `write_errors` counts the failures."""

    def __init__(self, ledger: UsageLedger, batch: int = 512) -> None:
        self.ledger = ledger
        self.batch = batch
        self.write_errors = 0
        self.written = 0
        self._queue: queue.Queue[UsageRecord | None] = queue.Queue()
        self._waiters: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._committed_early: set[str] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kvlease-ledger", daemon=True)
        self._thread.start()

    def __call__(self, finished: FinishedRequest) -> None:
        self._queue.put(to_record(finished))

    def expect(self, request_id: str) -> asyncio.Future:
        """A future resolved when `request_id`'s record commits (call on the event loop)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if request_id in self._committed_early:
                self._committed_early.discard(request_id)
                future.set_result(True)
            else:
                self._waiters[request_id] = (loop, future)
        return future

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._waiters.pop(request_id, None)
            self._committed_early.discard(request_id)

    def _run(self) -> None:
        stop = False
        while not stop:
            first = self._queue.get()
            batch = [] if first is None else [first]
            stop = first is None
            while len(batch) < self.batch:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                batch.append(item)
            if batch:
                self._commit(batch)

    def _commit(self, batch: list[UsageRecord]) -> None:
        delay = 0.5
        while True:
            try:
                self.ledger.write(batch)
                break
            except Exception:
                self.write_errors += 1
                logger.exception(
                    "kvlease ledger: commit of %d records failed; retrying", len(batch)
                )
                time.sleep(delay)
                delay = min(delay * 2, 10.0)
        self.written += len(batch)
        with self._lock:
            for record in batch:
                waiter = self._waiters.pop(record.request_id, None)
                if waiter is None:
                    self._committed_early.add(record.request_id)
                    continue
                loop, future = waiter
                loop.call_soon_threadsafe(_resolve, future)
            if len(self._committed_early) > 100_000:  # records no response waited for
                self._committed_early.clear()

    def close(self, timeout: float = 10.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(True)


def wait_seconds() -> float:
    return float(os.environ.get(WAIT_ENV, "5"))
