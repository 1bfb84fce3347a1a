"""The API process's ledger writer: one usage record per finished request, group-committed.

It also writes the retention records (a leased session's blocks between two turns) the
engine reports for requests this process owned (`kvlease.engine.events.Retention`).

A `RequestJoin` consumer turns each finished request into a `UsageRecord`
and queues it; a writer thread commits queues in batches (group commit: one
transaction for everything that arrived together, up to 4,096 records), so the
event loop never waits on the database and a busy server pays one fsync for
thousands of records. TenantMiddleware holds a generation response's last
body chunk until the future `expect(request_id)` gave it resolves (the record
has committed), at most `KVLEASE_LEDGER_WAIT_SECONDS` (5): a client that
received a complete response can rely on its record being in the ledger,
even across a crash.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import threading
import time
from dataclasses import asdict
from pathlib import Path

from sqlalchemy.exc import DataError, IntegrityError

from kvlease.engine.events import Retention
from kvlease.engine.labels import UNCLASSIFIED
from kvlease.engine.paths import kvlease_home, private_file
from kvlease.engine.tenancy import TierTable
from kvlease.exporters.join import FinishedRequest, kvlease_id
from kvlease.exporters.ledger import (
    RETENTION,
    OpenRecord,
    UsageLedger,
    UsageRecord,
    causes_text,
    retention_key,
)
from kvlease.exporters.metrics import (
    LEDGER_DEAD_LETTERS,
    LEDGER_ERRORS,
    LEDGER_RECORDS,
    ProcessMetrics,
)

WAIT_ENV = "KVLEASE_LEDGER_WAIT_SECONDS"
DEAD_LETTER_FILE = "ledger-dead-letters.jsonl"  # under KVLEASE_HOME
DEAD_LETTER_MAX_ENV = "KVLEASE_DEAD_LETTER_MAX_BYTES"  # the file's bound (64 MiB)
logger = logging.getLogger("kvlease.ledger")


def to_record(p: FinishedRequest, tiers: TierTable | None = None) -> UsageRecord:
    """One HTTP request's record: its engine requests summed (fan-out is one record),
    with its tier's prices as they are now (`tiers`), so history is never repriced."""
    entry, done = p.entry, p.done[0] if p.done else None
    ctx = entry.ctx if entry is not None else None
    now = time.time()
    latency = p.e2e_latency
    started = entry.started_ns / 1e9 if entry is not None else now - (latency or 0.0)
    who = ctx if ctx is not None else done  # the middleware's view, else the engine's
    tier = who.tier if who is not None else None
    return UsageRecord(
        request_id=p.key,
        tenant_id=(who.tenant_id if who is not None else None) or UNCLASSIFIED,
        tier=tier,
        session_id=who.session_id if who is not None else None,
        model=(entry.model if entry is not None else None) or "unknown",
        started_at=started,
        ended_at=started + latency if latency is not None else (p.ended_at or now),
        input_tokens=p.prompt_tokens,
        cached_input_tokens=p.cached_tokens,
        output_tokens=p.output_tokens,
        recomputed_tokens=p.recomputed_tokens,
        preemptions=p.preemptions,
        kv_block_seconds=p.block_seconds,
        outcome=p.outcome,
        partial=p.partial,
        price_basis=_price_basis(tiers, tier),
        lease_covered_tokens=p.lease_covered_tokens,
        recomputed_by=causes_text(p.recomputed_by),
    )


def _price_basis(tiers: TierTable | None, tier: str | None) -> str | None:
    """The tier's prices as they are now, as the record keeps them (None: not priced)."""
    if tiers is None or tier is None or tier not in tiers:
        return None
    return tiers[tier].prices.basis(tiers.currency)


def retention_record(e: Retention, tiers: TierTable | None = None) -> UsageRecord:
    """The ledger's record of a session's time between turns: no tokens, its reserved and
    retained block-seconds, keyed by the request whose end opened it, priced at its tier's
    prices now."""
    to_wall = time.time() - time.monotonic()  # the engine stamps the monotonic clock
    return UsageRecord(
        request_id=retention_key(kvlease_id(e.request_id) or e.request_id),
        tenant_id=e.tenant_id,
        tier=e.tier,
        session_id=e.session_id,
        model=e.model,
        started_at=e.started + to_wall,
        ended_at=max(e.at, e.started) + to_wall,
        input_tokens=0,
        cached_input_tokens=0,
        output_tokens=0,
        recomputed_tokens=0,
        preemptions=0,
        kv_block_seconds=0.0,
        outcome=RETENTION,
        price_basis=_price_basis(tiers, e.tier),
        kv_reserved_block_seconds=e.reserved_block_seconds,
        kv_retained_block_seconds=e.retained_block_seconds,
    )


class LedgerWriter:
    """Queue in, batches out. Records are never dropped on a failed commit: the batch is
    retried (writes are idempotent) and `write_errors` counts the failures. A record the
    database refuses for its data (too long a value, a constraint) is set aside alone,
    to the dead-letter file, counted in `dead_letters`: it never blocks the others."""

    def __init__(
        self,
        ledger: UsageLedger,
        tiers: TierTable | None = None,
        batch: int = 4096,
        dead_letter_path: Path | None = None,
        metrics: ProcessMetrics | None = None,
    ) -> None:
        self.ledger = ledger
        self.tiers = tiers
        self.batch = batch
        self.dead_letter_path = dead_letter_path or kvlease_home() / DEAD_LETTER_FILE
        self.write_errors = 0
        self.dead_letters = 0
        self.metrics = metrics or ProcessMetrics()  # the same counts, for /metrics
        self._queue: queue.Queue[UsageRecord | list[OpenRecord] | None] = queue.Queue()
        self._waiters: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[bool]]] = {}
        self._committed_early: set[str] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kvlease-ledger", daemon=True)
        self._thread.start()

    def __call__(self, finished: FinishedRequest) -> None:
        self._queue.put(to_record(finished, self.tiers))

    def engine_event(self, event: object) -> None:
        """An engine listener (kvlease.exporters.view): queue the retention records."""
        if isinstance(event, Retention):
            self._queue.put(retention_record(event, self.tiers))

    def expect(self, request_id: str) -> asyncio.Future[bool]:
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

    def journal(self, rows: list[OpenRecord]) -> None:
        """Queue the open records of streams in flight (kvlease.exporters.open_records): written by
        this thread too, so they never wait on SQLite's write lock behind the records."""
        if rows:
            self._queue.put(rows)

    def _run(self) -> None:
        stop = False
        while not stop:
            first = self._queue.get()
            items = [] if first is None else [first]
            stop = first is None
            while len(items) < self.batch:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                items.append(item)
            batch = [item for item in items if isinstance(item, UsageRecord)]
            if batch:
                self._commit(batch)
            for rows in (item for item in items if isinstance(item, list)):
                try:
                    self.ledger.journal(rows)
                except Exception as exc:  # the next tick writes them again
                    logger.error("kvlease ledger: open records not written: %s", exc)

    def _commit(self, batch: list[UsageRecord]) -> None:
        delay = 0.5
        while True:
            try:
                self._write_isolating(batch)
                break
            except Exception:  # the database itself: retry the batch, never drop it
                self.write_errors += 1
                self.metrics[LEDGER_ERRORS].inc()
                logger.exception(
                    "kvlease ledger: commit of %d records failed; retrying", len(batch)
                )
                time.sleep(delay)
                delay = min(delay * 2, 10.0)
        self.metrics[LEDGER_RECORDS].inc(len(batch))
        with self._lock:
            for record in batch:
                waiter = self._waiters.pop(record.request_id, None)
                if waiter is None:
                    if record.outcome != RETENTION:  # no response waits for these
                        self._committed_early.add(record.request_id)
                    continue
                loop, future = waiter
                loop.call_soon_threadsafe(_resolve, future)
            if len(self._committed_early) > 100_000:  # records no response waited for
                self._committed_early.clear()

    def _write_isolating(self, batch: list[UsageRecord]) -> None:
        """Write `batch`; when the database refuses its data (not its connection), bisect it
        so each record that fails alone goes to the dead-letter file and the rest commit.
        O(log n) extra commits per bad record."""
        try:
            self.ledger.write(batch)
        except (DataError, IntegrityError) as exc:
            if len(batch) == 1:
                self._dead_letter(batch[0], exc)
                return
            middle = len(batch) // 2
            self._write_isolating(batch[:middle])
            self._write_isolating(batch[middle:])

    def _dead_letter(self, record: UsageRecord, exc: Exception) -> None:
        """Set aside a record the database will never take, with the reason: one JSON line
        each, appended and fsynced, for an operator to fix and replay (writes are idempotent)."""
        self.dead_letters += 1
        self.metrics[LEDGER_DEAD_LETTERS].inc()
        reason = str(getattr(exc, "orig", exc)).splitlines()[0][:500]
        logger.error(
            "kvlease ledger: record %s refused by the database (%s); set aside in %s",
            record.request_id[:64],
            reason,
            self.dead_letter_path,
        )
        line = json.dumps({"record": asdict(record), "reason": reason}) + "\n"
        path = private_file(self.dead_letter_path)
        if path.stat().st_size + len(line) > dead_letter_max_bytes():
            # Bounded: a flood of refused records must not fill the disk. The count and
            # the log line above still say what was refused.
            logger.error(
                "kvlease ledger: %s is full (%s bytes); record %s not set aside",
                path,
                dead_letter_max_bytes(),
                record.request_id[:64],
            )
            return
        with path.open("a", encoding="utf-8") as out:
            out.write(line)
            out.flush()
            os.fsync(out.fileno())

    def close(self, timeout: float = 10.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)


def _resolve(future: asyncio.Future[bool]) -> None:
    if not future.done():
        future.set_result(True)


def dead_letter_max_bytes() -> int:
    return int(os.environ.get(DEAD_LETTER_MAX_ENV, str(64 * 2**20)))


def wait_seconds() -> float:
    return float(os.environ.get(WAIT_ENV, "5"))
