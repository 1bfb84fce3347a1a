"""Month-to-date spend of the tenants with a budget, kept fresh away from the request path.

Invariant: `verdict()` never touches the database. It reads the last refresh, a dict
replaced whole, plus what requests in flight hold, so a request pays two lookups. A
hold (`hold()`, `release()`) counts until the first refresh that starts after its
request ended: by then the request's record is in the ledger (the middleware answers
its last byte only once the record has committed), so the spend includes it. A thread
refreshes every `refresh_seconds` of the budget file: one rollups query restricted to the budgeted
tenants (through the rollups' (tenant, hour) index, so it reads only their rows),
priced with the export's own `pricing.cost`. With a shared PostgreSQL ledger the spend
is the fleet's. The budget file is re-read when it changes; a file that no longer loads
keeps the last good table, with an error in the log.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal

from kvlease.engine.budgets import BudgetConfigError, BudgetTable, Verdict
from kvlease.engine.tenancy import TierTable
from kvlease.exporters.ledger import UsageLedger, one_line
from kvlease.exporters.periods import period
from kvlease.exporters.pricing import cost
from kvlease.exporters.rollups import DAY

logger = logging.getLogger("kvlease.budgets")


@dataclass(eq=False)
class Hold:
    """What one admitted request holds against its tenant's budget (hashed by identity:
    two requests holding the same amount are two holds)."""

    tenant_id: str
    amount: Decimal
    ended_at: float | None = None  # monotonic; None while in flight


class SpendTracker:
    def __init__(
        self,
        ledger: UsageLedger,
        tiers: TierTable,
        path: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.ledger, self.tiers, self.path, self.clock = ledger, tiers, path, clock
        self.table = BudgetTable.load(path)  # a bad file at start is the caller's error
        self._mtime = _mtime(path)
        self._verdicts: dict[str, Verdict] = {}
        self._holds: set[Hold] = set()  # in flight, or ended since the last refresh
        self._held: dict[str, Decimal] = {}  # per tenant, the sum of its holds
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def verdict(self, tenant_id: str) -> Verdict | None:
        """The tenant's month so far, with what its requests in flight hold, against its
        budget; None without a budget. O(1)."""
        verdict = self._verdicts.get(tenant_id)
        held = self._held.get(tenant_id)
        if verdict is None or not held:
            return verdict
        return Verdict(verdict.budget, verdict.spent + held)

    def hold(self, tenant_id: str, amount: Decimal) -> Hold | None:
        """Hold `amount` against a budgeted tenant's spend (None: no budget, or the budget
        refuses it: `Verdict.refuses`, checked and held under one lock, so concurrent
        requests cannot all pass on the same spend). O(1)."""
        with self._lock:
            verdict = self.verdict(tenant_id)
            if verdict is None or verdict.refuses(amount):
                return None
            hold = Hold(tenant_id, amount)
            self._holds.add(hold)
            self._held[tenant_id] = self._held.get(tenant_id, Decimal(0)) + amount
            return hold

    def release(self, hold: Hold) -> None:
        """The request ended: its hold stays until a refresh has read its record."""
        hold.ended_at = time.monotonic()

    def verdicts(self) -> dict[str, Verdict]:
        return self._verdicts

    def refresh(self) -> None:
        """Re-read the file if it changed, then the budgeted tenants' spend this month."""
        self._reload()
        started = time.monotonic()
        budgets = self.table.budgets
        spent = dict.fromkeys(budgets, Decimal(0))
        if budgets:
            start, end = period(self.clock(), "month")
            for rollup in self.ledger.rollups(start, end, list(budgets), DAY):
                spent[rollup.tenant_id] += cost(rollup, self.tiers)
        with self._lock:
            self._verdicts = {t: Verdict(budgets[t], s) for t, s in spent.items()}
            for hold in [h for h in self._holds if h.ended_at is not None and h.ended_at < started]:
                self._holds.remove(hold)  # its record is in the spend just read
                self._held[hold.tenant_id] -= hold.amount
            self._held = {t: v for t, v in self._held.items() if v}

    def _reload(self) -> None:
        mtime = _mtime(self.path)
        if mtime == self._mtime:
            return
        self._mtime = mtime
        try:
            self.table = BudgetTable.load(self.path)
            logger.info("kvlease: budgets reloaded from %s", self.path)
        except BudgetConfigError as exc:
            logger.error("kvlease: budgets file changed but does not load, kept: %s", exc)

    def start(self) -> SpendTracker:
        self._thread = threading.Thread(target=self._run, name="kvlease-budgets", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.refresh()
            except Exception as exc:  # the ledger may be down: keep the last spend, retry
                logger.error("kvlease: budget spend not refreshed: %s", one_line(exc))
            self._stop.wait(self.table.refresh_seconds)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)


def _mtime(path: str) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None
