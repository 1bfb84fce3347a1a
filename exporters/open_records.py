"""Streams in flight, journaled so that a crash cannot leave their work unbilled.

A usage record is written when a request ends. A server killed mid-stream (kill -9, an
OOM kill, a lost node) would leave the tokens it had already streamed without a record.
So every `interval` seconds this thread writes an open record (`usage_open`) for each
request of this process that has streamed output, with its output so far, and turns the
open records of other processes that nobody has refreshed for `STALE_TICKS` intervals
(their server is gone; a live one refreshes every interval) into partial usage records,
outcome aborted (`UsageLedger.recover_open`). A process never recovers its own rows, so
a server starved of CPU cannot bill its own live streams as cut. A request's final
record deletes its open record in the same transaction, so it is counted once either
way; records are idempotent by request id, so two replicas recovering the same row
write it once.

Cost: one upsert a tick for the streams in flight, one indexed scan of `usage_open`.
What a recovered record bills: the output tokens streamed (SSE events carrying text, a
lower bound when vLLM batches tokens per event); its input is unknown to the API process
before the end, so it is 0 and the record is flagged `partial`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable

from kvlease.engine.tenancy import TierTable
from kvlease.exporters.join import InFlight
from kvlease.exporters.ledger import OpenRecord, UsageLedger, one_line

INTERVAL_ENV = "KVLEASE_OPEN_RECORD_SECONDS"
STALE_TICKS = 6
logger = logging.getLogger("kvlease.ledger")


def interval_seconds() -> float:
    return float(os.environ.get(INTERVAL_ENV, "5"))


def open_records(
    in_flight: Iterable[tuple[str, InFlight]], tiers: TierTable, now: float, owner: str
) -> list[OpenRecord]:
    """The open record of each request that has streamed output."""
    rows = []
    for request_id, entry in in_flight:
        if entry.streamed_tokens <= 0:
            continue
        ctx = entry.ctx
        tier = tiers.get(ctx.tier)
        rows.append(
            OpenRecord(
                request_id=request_id,
                tenant_id=ctx.tenant_id,
                tier=ctx.tier,
                session_id=ctx.session_id,
                model=entry.model or "unknown",
                started_at=entry.started_ns / 1e9,
                updated_at=now,
                output_tokens=entry.streamed_tokens,
                price_basis=tier.prices.basis(tiers.currency) if tier else None,
                owner=owner,
            )
        )
    return rows


class OpenRecords:
    """The journal thread of one API process (`start()`, `close()`): it snapshots the
    streams in flight and hands their rows to `journal` (the ledger writer's queue, so
    one thread writes), and recovers what stopped servers left."""

    def __init__(
        self,
        ledger: UsageLedger,
        tiers: TierTable,
        in_flight: Callable[[], list[tuple[str, InFlight]]],
        journal: Callable[[list[OpenRecord]], None],
        interval: float | None = None,
    ) -> None:
        self.ledger, self.tiers, self.in_flight, self.journal = ledger, tiers, in_flight, journal
        self.interval = interval if interval is not None else interval_seconds()
        self.recovered = 0
        self.owner = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvlease-open", daemon=True)

    def start(self) -> OpenRecords:
        self._thread.start()
        return self

    def tick(self) -> None:
        now = time.time()
        self.journal(open_records(self.in_flight(), self.tiers, now, self.owner))
        recovered = self.ledger.recover_open(now - STALE_TICKS * self.interval, self.owner)
        if recovered:
            self.recovered += recovered
            logger.warning(
                "kvlease ledger: %d streams cut by a stopped server billed as partial records",
                recovered,
            )

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.tick()
            except Exception as exc:  # the ledger may be down: the next tick tries again
                logger.error("kvlease ledger: open records not recovered: %s", one_line(exc))

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
