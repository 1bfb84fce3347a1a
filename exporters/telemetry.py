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

import atexit
import logging
import os
import threading
from typing import Any

from prometheus_client.core import REGISTRY

from kvlease.engine.budgets import BUDGETS_ENV
from kvlease.engine.labels import TenantLabels
from kvlease.engine.tenancy import TierTable
from kvlease.exporters import tracing
from kvlease.exporters.join import RequestJoin
from kvlease.exporters.ledger import DB_ENV, UsageLedger
from kvlease.exporters.metrics import JOIN_OVERFLOWS, TenantMetrics
from kvlease.exporters.open_records import OpenRecords
from kvlease.exporters.spend import SpendTracker
from kvlease.exporters.view import EngineView
from kvlease.exporters.writer import LedgerWriter

logger = logging.getLogger("kvlease.telemetry")


class Telemetry:
    def __init__(self) -> None:
        self.view = EngineView()
        self.join = RequestJoin()
        self.metrics: TenantMetrics | None = None
        self.writer: LedgerWriter | None = None
        self.budgets: SpendTracker | None = None
        self.open_records: OpenRecords | None = None
        self._tracer_provider: Any = None
        self._lock = threading.Lock()
        self._stopped = False

    def start(self) -> Telemetry:
        """Bind the channel, register the metrics, and start the ledger writer, spans and
        the join's sweep where configured. Safe to call more than once."""
        with self._lock:
            if self.metrics is not None:
                return self
            self.view.start()
            tiers = TierTable.load()
            metrics = TenantMetrics(self.view, tiers, TenantLabels.from_env(), self._budget_used)
            REGISTRY.register(metrics)
            self.metrics = metrics
            self.view.add_listener(metrics.engine_event)
            self.join.on_overflow = metrics.process[JOIN_OVERFLOWS].inc
            if os.environ.get(DB_ENV):
                ledger = UsageLedger(os.environ[DB_ENV])
                self.writer = LedgerWriter(ledger, tiers, metrics=metrics.process)
                self.join.consumers.append(self.writer)
                self.view.add_listener(self.writer.engine_event)  # retention records
                in_flight = lambda: list(self.join.in_flight.items())  # noqa: E731
                self.open_records = OpenRecords(
                    ledger, tiers, in_flight, self.writer.journal
                ).start()
                if os.environ.get(BUDGETS_ENV):
                    path = os.environ[BUDGETS_ENV]
                    self.budgets = SpendTracker(self.writer.ledger, tiers, path).start()
            elif os.environ.get(BUDGETS_ENV):
                logger.error("kvlease: %s is set but no usage ledger: budgets off", BUDGETS_ENV)
            self._tracer_provider = tracing.install(self.join)
            if self.join.consumers:
                self.view.add_listener(self.join.engine_event)
                self.join.start()
            atexit.register(self.stop)  # vLLM's extra API processes simply exit
            return self

    def stop(self) -> None:
        """At shutdown, after the engine has stopped: nothing queued is lost. Once."""
        with self._lock:
            if self._stopped or self.metrics is None:
                return
            self._stopped = True
        self.view.stop()
        if self.budgets is not None:
            self.budgets.close()
        if self.open_records is not None:
            self.open_records.close()
        self.join.flush()  # pending spans and usage records go out now
        if self.writer is not None:
            self.writer.close()  # commit what is queued
        if self._tracer_provider is not None:
            self._tracer_provider.shutdown()  # flush the span exporter

    def ledger(self) -> UsageLedger:
        """The ledger this process writes, or the configured one, for reads only: a
        `LedgerError` if there is none (a reader never creates one)."""
        return self.writer.ledger if self.writer is not None else UsageLedger(create=False)

    def _budget_used(self) -> dict[str, float]:
        if self.budgets is None:
            return {}
        return {t: v.ratio for t, v in self.budgets.verdicts().items()}


TELEMETRY = Telemetry()
