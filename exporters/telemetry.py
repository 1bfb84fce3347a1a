"""Everything kvlease runs in vLLM's API process, started and stopped in one place.

vLLM builds the middleware, the stat-logger plugin and the admin plugin itself,
each with no way to be handed an object, so they meet at the one `TELEMETRY`
of the process:

- `view`: the engine channel's receiving end and the latest scheduler snapshot;
- `join`: the in-flight registry and the request join (stats + engine events);
- `metrics`: the Prometheus collector;
- `writer`: the usage-ledger writer, when a ledger is configured (`KVLEASE_USAGE_DB`);
- `budgets`: the month-to-date spend of budgeted tenants, when a budget file is
  configured (`KVLEASE_BUDGETS`; it needs the ledger);
- a TracerProvider, when tracing is on (`KVLEASE_OTEL`).

`start()` is idempotent (the admin plugin and the stat logger both call it, in
either order); `stop()` drains in the only safe order: stop receiving, deliver
half-joined requests, commit queued records, flush spans.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from prometheus_client.core import REGISTRY

from engine.budgets import BUDGETS_ENV
from engine.labels import TenantLabels
from engine.tenancy import TierTable
from exporters import tracing
from exporters.join import RequestJoin
from exporters.ledger import DB_ENV, UsageLedger
from exporters.metrics import ProcessCounts, TenantMetrics
from exporters.spend import SpendTracker
from exporters.view import EngineView
from exporters.writer import LedgerWriter

logger = logging.getLogger("kvlease.telemetry")


class Telemetry:
    def __init__(self) -> None:
        self.view = EngineView()
        self.join = RequestJoin()
        self.metrics: TenantMetrics | None = None
        self.writer: LedgerWriter | None = None
        self.budgets: SpendTracker | None = None
        self._tracer_provider: Any = None
        self._lock = threading.Lock()

    def start(self) -> Telemetry:
        """Bind the channel, register the metrics, and start the ledger writer, spans and
        the join's sweep where configured. Safe to call more than once."""
        with self._lock:
            if self.metrics is not None:
                return self
            self.view.start()
            tiers = TierTable.load()
            self.metrics = TenantMetrics(self.view, tiers, TenantLabels.from_env(), self._counts)
            REGISTRY.register(self.metrics)
            if os.environ.get(DB_ENV):
                self.writer = LedgerWriter(UsageLedger(os.environ[DB_ENV]), tiers)
                self.join.consumers.append(self.writer)
                if os.environ.get(BUDGETS_ENV):
                    path = os.environ[BUDGETS_ENV]
                    self.budgets = SpendTracker(self.writer.ledger, tiers, path).start()
            elif os.environ.get(BUDGETS_ENV):
                logger.error("kvlease: %s is set but no usage ledger: budgets off", BUDGETS_ENV)
            self._tracer_provider = tracing.install(self.join)
            if self.join.consumers:
                self.view.add_listener(self.join.engine_event)
                self.join.start()
            return self

    def stop(self) -> None:
        """At shutdown, after the engine has stopped: nothing queued is lost."""
        self.view.stop()
        if self.budgets is not None:
            self.budgets.close()
        self.join.flush()  # pending spans and usage records go out now
        if self.writer is not None:
            self.writer.close()  # commit what is queued
        if self._tracer_provider is not None:
            self._tracer_provider.shutdown()  # flush the span exporter

    def ledger(self) -> UsageLedger:
        """The ledger this process writes, or the configured one, for reads only: a
        `LedgerError` if there is none (a reader never creates one)."""
        return self.writer.ledger if self.writer is not None else UsageLedger(create=False)

    def _counts(self) -> ProcessCounts:
        writer, overflows = self.writer, self.join.overflowed
        if writer is None:
            return ProcessCounts(join_overflows=overflows)
        used = {}
        if self.budgets is not None:
            used = {t: v.ratio for t, v in self.budgets.verdicts().items()}
        return ProcessCounts(
            writer.written, writer.write_errors, writer.dead_letters, overflows, used
        )


TELEMETRY = Telemetry()
