"""The usage page's figures, from the ledger's rollups, for finance.

Every figure here is read from the hourly rollups (`kvlease.exporters.rollups`) and priced
with the export's own `kvlease.exporters.pricing.cost`, so a tenant's cost on the page is the
exact sum of its FOCUS rows' costs (shown in the currency's minor unit, as its statement
total is: `kvlease.exporters.money`), and a month of millions of records is a query over
thousands of rollups, not a read of every record.

Fetching (`load_finance`, `load_statement`, `export_csv`, `load_requests`,
`PrometheusTotals`) is separate from shaping (`finance_frames`, `tenant_table`,
`budget_status`, `statement_frame`, `requests_frame`, `reconcile`, `over_time`), which
are pure and unit-tested. Failures are `SourceError`s with one sentence for the banner.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

import httpx
import pandas as pd

from kvlease.dashboard.data import SourceError
from kvlease.engine.budgets import ALERT_RATIO
from kvlease.engine.labels import OTHER as OTHER_TENANT
from kvlease.engine.tenancy import TierTable
from kvlease.exporters import metrics as m
from kvlease.exporters import money
from kvlease.exporters.billing import charge_groups
from kvlease.exporters.exports import export_chunks
from kvlease.exporters.periods import period
from kvlease.exporters.pricing import MICROS_PER_HOUR, Charges
from kvlease.exporters.rollups import DAY, Rollup
from kvlease.exporters.statement import Statement, statement

COUNTS = (
    "requests",
    "input_tokens",
    "cached_input_tokens",
    "output_tokens",
    "recomputed_tokens",
    "lease_covered_tokens",
    "lease_reused_tokens",
    "preemptions",
)
# KV block-hours held by requests, then the KV retention between turns, reserved and retained
HOURS = ("block_hours", "reserved_hours", "retained_hours")
TENANT_COLUMNS = ["tenant_id", "tier", *COUNTS, *HOURS, "cost", "previous_cost", "change"]
DAILY_COLUMNS = ["day", "tenant_id", "tier", *COUNTS, *HOURS, "cost"]
_MICROS = ("block_us", "reserved_us", "retained_us")  # what HOURS are summed from
# Ledger figure -> (Prometheus counter, its label selector): both count finished requests.
RECONCILED = {
    "requests": (m.REQUESTS.name, ""),
    "input_tokens": (m.TOKENS.name, 'kind="input"'),
    "cached_input_tokens": (m.TOKENS.name, 'kind="cached_input"'),
    "output_tokens": (m.TOKENS.name, 'kind="output"'),
}


@dataclass(frozen=True)
class Finance:
    """One window's usage. `daily`: DAILY_COLUMNS, a row per (UTC day, tenant, tier);
    `tenants`: TENANT_COLUMNS, a row per tenant with the cost of the period before
    (`previous_window`: `previous_cost`) and the change. Costs are exact Decimals."""

    start: float
    end: float
    currency: str
    daily: pd.DataFrame
    tenants: pd.DataFrame


def _ledger(url: str):
    from kvlease.exporters.ledger import UsageLedger

    return UsageLedger(url, create=False)


def _readable(action):
    """Run `action`, turning every ledger failure into one banner sentence."""
    from kvlease.exporters.ledger import one_line

    try:
        return action()
    except SourceError:
        raise
    except Exception as exc:  # SQLAlchemy's errors vary by driver; the banner needs one line
        raise SourceError(f"The usage ledger is not readable ({one_line(exc)}).") from None


PRESETS = ("This month", "Last month", "Last 30 days", "Custom")
LAST_WEEK = "Last 7 days with records"


def last_week_with_records(url: str, today: date) -> tuple[date, date]:
    """The 7 UTC days ending with the newest record's day (the 7 days ending today for an
    empty ledger): a what-if needs traffic, and the last week may have none."""

    def read() -> tuple[date, date]:
        newest = _ledger(url).last_ended()
        last = datetime.fromtimestamp(newest, UTC).date() if newest else today
        return last - timedelta(days=6), last + timedelta(days=1)

    return _readable(read)


def billed(finance: Finance) -> dict[str, Any]:
    """The window's bill as the What if page reconciles a replay with it."""
    t = finance.tenants
    return {
        "requests": int(t["requests"].sum()),
        "block_hours": sum(t["block_hours"], Decimal(0)),
        "retention_hours": sum(t["reserved_hours"], Decimal(0))
        + sum(t["retained_hours"], Decimal(0)),
        "cost": sum(t["cost"], Decimal(0)),
    }


def preset_window(name: str, today: date) -> tuple[date, date]:
    """[from, to) UTC dates of a period preset ("Custom" starts as this month)."""
    first = today.replace(day=1)
    if name == "Last month":
        return (first - timedelta(days=1)).replace(day=1), first
    if name == "Last 30 days":
        return today - timedelta(days=29), today + timedelta(days=1)
    if name in ("This month", "Custom"):
        return first, (first + timedelta(days=32)).replace(day=1)
    raise ValueError(f"a period preset is one of {PRESETS}, got {name!r}")


def load_finance(url: str, start: float, end: float, tiers: TierTable) -> Finance:
    """The window [start, end) and, for the change column, the one before it
    (`previous_window`): two queries over the rollups, bucketed by day."""

    def read() -> Finance:
        ledger = _ledger(url)
        current = ledger.rollups(start, end, bucket=DAY)
        previous = ledger.rollups(*previous_window(start, end), bucket=DAY)
        return finance_frames(start, end, current, previous, tiers)

    return _readable(read)


def previous_window(start: float, end: float) -> tuple[float, float]:
    """The period to compare with: as many calendar months before when [start, end) is
    whole months (November against October), else the same length just before."""
    lo, hi = datetime.fromtimestamp(start, UTC), datetime.fromtimestamp(end, UTC)
    midnight_first = all(
        (t.day, t.hour, t.minute, t.second, t.microsecond) == (1, 0, 0, 0, 0) for t in (lo, hi)
    )
    if not midnight_first:
        return start - (end - start), start
    months = (hi.year - lo.year) * 12 + hi.month - lo.month
    index = lo.year * 12 + lo.month - 1 - months
    before = lo.replace(year=index // 12, month=index % 12 + 1)
    return before.timestamp(), start


def finance_frames(
    start: float, end: float, current: Iterable[Rollup], previous: Iterable[Rollup], tiers
) -> Finance:
    """Priced as the FOCUS export by day prices its rows (`charge_groups`), so a tenant's
    cost here is the sum of its rows in that export, to the digit. One pass: each group
    adds to its day's row and to its tenant's."""
    daily: dict[tuple[float, str, str], dict[str, Any]] = {}
    tenants: dict[str, dict[str, Any]] = {}
    for group in charge_groups(current, "day", tiers, (start, end)):
        key = (group.start - group.start % DAY, group.tenant_id, group.tier)
        cost = group.charges.cost
        if (day := daily.get(key)) is None:
            day = daily[key] = _zero()
        _add(day, group.charges, cost)
        if (tenant := tenants.get(group.tenant_id)) is None:
            tenant = tenants[group.tenant_id] = _zero() | {"tiers": set()}
        _add(tenant, group.charges, cost)
        tenant["tiers"].add(group.tier)
    before: dict[str, Decimal] = {}
    for group in charge_groups(previous, "day", tiers):
        before[group.tenant_id] = before.get(group.tenant_id, Decimal(0)) + group.charges.cost
    rows = [
        {"day": day, "tenant_id": tenant, "tier": tier} | _figures(v)
        for (day, tenant, tier), v in sorted(daily.items())
    ]
    frame = pd.DataFrame(rows, columns=DAILY_COLUMNS)
    frame["day"] = pd.to_datetime(frame["day"], unit="s", utc=True)
    return Finance(start, end, tiers.currency, frame, _by_tenant(tenants, before))


def _zero() -> dict[str, Any]:
    return dict.fromkeys(COUNTS + _MICROS, 0) | {"cost": Decimal(0)}


def _add(row: dict[str, Any], c: Charges, cost: Decimal) -> None:
    row["requests"] += c.requests
    row["input_tokens"] += c.input
    row["cached_input_tokens"] += c.cached
    row["output_tokens"] += c.output
    row["recomputed_tokens"] += c.recomputed
    row["lease_covered_tokens"] += c.lease_covered
    row["lease_reused_tokens"] += c.lease_reused
    row["preemptions"] += c.preemptions
    row["block_us"] += c.block_us
    row["reserved_us"] += c.reserved_us
    row["retained_us"] += c.retained_us
    row["cost"] += cost


def _figures(v: dict[str, Any]) -> dict[str, Any]:
    hours = {h: Decimal(v[us]) / MICROS_PER_HOUR for h, us in zip(HOURS, _MICROS, strict=True)}
    return {c: v[c] for c in COUNTS} | hours | {"cost": v["cost"]}


def _by_tenant(tenants: dict[str, dict[str, Any]], before: dict[str, Decimal]) -> pd.DataFrame:
    out = []
    for tenant, v in tenants.items():
        previous = before.get(tenant, Decimal(0))
        out.append(
            {"tenant_id": tenant, "tier": ",".join(sorted(v["tiers"]))}
            | _figures(v)
            | {"previous_cost": previous, "change": v["cost"] - previous}
        )
    for tenant, previous in before.items():  # gone quiet this period: a change too
        if tenant not in tenants:
            out.append(
                {"tenant_id": tenant, "tier": ""}
                | _figures(_zero())
                | {"previous_cost": previous, "change": -previous}
            )
    frame = pd.DataFrame(out, columns=TENANT_COLUMNS)
    return frame.sort_values(["cost", "tenant_id"], ascending=[False, True]).reset_index(drop=True)


# The tenants table as a person reads it: who and what they owe first, plain headers.
TENANT_HEADERS = {
    "tenant_id": "Tenant",
    "cost": "Cost",
    "change": "Change",
    "change_pct": "Change %",
    "budget": "Budget this month",
    "tier": "Tier",
    "requests": "Requests",
    "input_tokens": "Input tokens",
    "cached_input_tokens": "Cached input tokens",
    "output_tokens": "Output tokens",
    "recomputed_tokens": "Recomputed tokens (not billed)",
    "lease_covered_tokens": "Tokens a lease kept",
    "lease_reused_tokens": "Tokens a lease served",
    "preemptions": "Preemptions",
    "block_hours": "KV block-hours",
    "reserved_hours": "Retention reserved (block-hours)",
    "retained_hours": "Retention retained (block-hours)",
}
EMPTY = "-"


def tenant_table(
    tenants: pd.DataFrame, currency: str, budgets: pd.DataFrame | None = None
) -> pd.DataFrame:
    """`Finance.tenants` for the page: tenant and cost first, money in the minor unit
    (`kvlease.exporters.money`), `-` for a figure that does not exist (no change without a
    period before, no budget), counts left numeric for the table to sort and separate."""
    out = tenants.assign(
        cost=[money.shown(c, currency) for c in tenants["cost"]],
        change=[money.shown(c, currency, sign=True) for c in tenants["change"]],
        change_pct=[EMPTY if p is None else f"{p:+.1f}%" for p in change_percent(tenants)],
        tier=[t or EMPTY for t in tenants["tier"]],
        budget=EMPTY,
    ).astype(dict.fromkeys(HOURS, float))
    if budgets is not None and not budgets.empty:
        status = dict(zip(budgets["tenant_id"], budgets["status"], strict=True))
        out["budget"] = [status.get(t, EMPTY) for t in out["tenant_id"]]
    return out[list(TENANT_HEADERS)].rename(columns=TENANT_HEADERS)


def budget_status(
    tenants: pd.DataFrame, table, start: float, end: float, currency: str
) -> pd.DataFrame:
    """Each budgeted tenant's spend in [start, end) against its monthly budget, when the
    window is one calendar month (a budget covers one): tenant_id, spent, budget, used
    (a fraction), status (`62% of 500.00`, `nearly spent`, `exceeded`). Empty otherwise."""
    columns = ["tenant_id", "spent", "budget", "used", "status"]
    if table is None or period(start, "month") != (start, end):
        return pd.DataFrame(columns=columns)
    spent = dict(zip(tenants["tenant_id"], tenants["cost"], strict=True))
    rows = []
    for tenant, budget in sorted(table.budgets.items()):
        verdict = table.verdict(tenant, spent.get(tenant, Decimal(0)))
        used = verdict.ratio
        word = "exceeded" if verdict.exceeded else "nearly spent" if used >= ALERT_RATIO else ""
        shown = f"{used:.0%} of {money.shown(budget.monthly, currency)}"
        rows.append(
            {
                "tenant_id": tenant,
                "spent": verdict.spent,
                "budget": budget.monthly,
                "used": used,
                "status": f"{shown}, {word}" if word else shown,
            }
        )
    return pd.DataFrame(rows, columns=columns)


def change_percent(tenants: pd.DataFrame) -> list[float | None]:
    """Change over the previous period in percent (None where it had no cost)."""
    return [
        float(c / p * 100) if p else None
        for c, p in zip(tenants["change"], tenants["previous_cost"], strict=True)
    ]


def over_time(daily: pd.DataFrame, by: str = "tier", measure: str = "cost", top: int = 8):
    """Cost (float, for a chart only) or tokens (input + output) per UTC day, stacked by
    tier or by the `top` tenants of the window by that measure (the rest as "other"):
    columns day, series, value."""
    if daily.empty:
        return pd.DataFrame(columns=["day", "series", "value"])
    if measure == "cost":
        values = [float(c) for c in daily["cost"]]
    else:
        values = list(daily["input_tokens"] + daily["output_tokens"])
    frame = daily.assign(value=values)
    if by == "tier":
        frame = frame.assign(series=frame["tier"])
    else:
        totals = frame.groupby("tenant_id")["value"].sum().sort_values(ascending=False)
        keep = set(totals.index[:top])
        frame = frame.assign(series=[t if t in keep else "other" for t in frame["tenant_id"]])
    out = frame.groupby(["day", "series"], as_index=False)["value"].sum()
    return out.sort_values(["day", "series"]).reset_index(drop=True)


# -- one tenant's statement -----------------------------------------------------------------


def load_statement(url: str, tenant: str, start: float, end: float, tiers) -> Statement:
    def read() -> Statement:
        found = _ledger(url).rollups(start, end, [tenant], bucket=DAY)
        return statement(tenant, start, end, found, tiers)

    return _readable(read)


def statement_frame(s: Statement) -> pd.DataFrame:
    """The statement's lines as the page shows them: amounts in the minor unit."""
    return pd.DataFrame(
        [
            {
                "item": line.item,
                "model": line.model,
                "tier": line.tier,
                "quantity": f"{line.quantity:,} {line.unit}",
                "unit price": f"{money.plain(line.unit_price)} / {line.priced_per}",
                "amount": money.shown(line.exact, s.currency),
            }
            for line in s.lines
        ],
        columns=["item", "model", "tier", "quantity", "unit price", "amount"],
    )


def export_csv(url: str, start: float, end: float, fmt: str, granularity: str, tiers) -> bytes:
    """The file `kvlease usage export --format fmt` writes for this window."""

    def read() -> bytes:
        chunks = export_chunks(_ledger(url), (start, end), fmt, granularity, tiers)
        return "".join(chunks).encode()

    return _readable(read)


REQUEST_COLUMNS = {
    "ended_at": "Ended (UTC)",
    "request_id": "Request",
    "session_id": "Session",
    "model": "Model",
    "tier": "Tier",
    "outcome": "Outcome",
    "input_tokens": "Input tokens",
    "cached_input_tokens": "Cached input tokens",
    "output_tokens": "Output tokens",
    "recomputed_tokens": "Recomputed tokens",
    "recomputed_by": "Recomputed for (tier: tokens)",
    "preemptions": "Preemptions",
    "kv_block_seconds": "KV block-seconds",
}


def load_requests(url: str, tenant: str, start: float, end: float, limit: int) -> pd.DataFrame:
    """A tenant's newest `limit` records in the window, as the drill-down shows them."""
    return _readable(lambda: requests_frame(_ledger(url).latest(tenant, start, end, limit)))


def _causes(stored: str | None) -> str:
    """`{"premium":100,"free":20}` as `premium: 100, free: 20` (`-`: none, or unknown)."""
    if not stored:
        return EMPTY
    causes = json.loads(stored)
    return ", ".join(f"{tier}: {n:,}" for tier, n in sorted(causes.items(), key=lambda x: -x[1]))


def requests_frame(records) -> pd.DataFrame:
    rows = [
        {c: getattr(r, c) for c in REQUEST_COLUMNS} | {"recomputed_by": _causes(r.recomputed_by)}
        for r in records
    ]
    frame = pd.DataFrame(rows, columns=list(REQUEST_COLUMNS))
    frame["ended_at"] = pd.to_datetime(frame["ended_at"], unit="s", utc=True)
    frame = frame.fillna({"session_id": EMPTY, "tier": EMPTY})
    return frame.rename(columns=REQUEST_COLUMNS)


# -- reconciliation against Prometheus ------------------------------------------------------


class PrometheusTotals:
    """Per-tenant increases of kvlease's counters over a window, from Prometheus."""

    def __init__(self, url: str, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def totals(self, start: float, end: float) -> dict[str, dict[str, float]]:
        """{figure: {tenant label: increase over [start, end)}}, evaluated at `end`."""
        window = max(1, int(end - start))
        at = min(end, datetime.now(UTC).timestamp())
        out = {}
        for figure, (name, selector) in RECONCILED.items():
            query = f"sum by (tenant_id) (increase({name}{{{selector}}}[{window}s]))"
            out[figure] = {
                s["metric"].get("tenant_id", ""): float(s["value"][1])
                for s in self._query(query, at)
            }
        return out

    def _query(self, query: str, at: float) -> list[dict[str, Any]]:
        try:
            r = httpx.get(
                f"{self.url}/api/v1/query",
                params={"query": query, "time": at},
                timeout=self.timeout,
            )
            body = r.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise SourceError(f"Prometheus at {self.url} is not readable ({exc}).") from None
        if r.status_code != 200 or body.get("status") != "success":
            raise SourceError(f"Prometheus at {self.url} answered {r.status_code}.")
        return body["data"]["result"]


def reconcile(
    tenants: pd.DataFrame, prometheus: dict[str, dict[str, float]], labelled: Iterable[str] = ()
) -> pd.DataFrame:
    """Ledger totals against Prometheus's for the same window, a row per (tenant label,
    figure) and a total row per figure: ledger, prometheus, difference (prometheus -
    ledger). Tenants Prometheus has no label for (beyond the top-N) are compared under
    `__other__`, as the metrics group them. Prometheus's `increase` extrapolates to the
    window's edges and starts at the first scrape, so small differences are expected;
    a large one is records or samples lost."""
    labels = set(labelled) | {t for series in prometheus.values() for t in series}
    rows = []
    for figure in RECONCILED:
        ledger: dict[str, int] = {}
        for tenant, value in zip(tenants["tenant_id"], tenants[figure], strict=True):
            label = tenant if tenant in labels else OTHER_TENANT
            ledger[label] = ledger.get(label, 0) + int(value)
        seen = prometheus.get(figure, {})
        for label in sorted(set(ledger) | set(seen)):
            have, counted = ledger.get(label, 0), seen.get(label, 0.0)
            rows.append(_reconciled(label, figure, have, counted))
        rows.append(_reconciled("(all)", figure, sum(ledger.values()), sum(seen.values())))
    return pd.DataFrame(rows, columns=["tenant_id", "figure", "ledger", "prometheus", "difference"])


def _reconciled(label: str, figure: str, ledger: int, prometheus: float) -> dict[str, Any]:
    return {
        "tenant_id": label,
        "figure": figure,
        "ledger": ledger,
        "prometheus": round(prometheus, 1),
        "difference": round(prometheus - ledger, 1),
    }
