"""The usage page's figures, from the ledger's rollups, for finance.

Every figure here is read from the hourly rollups (`exporters.rollups`) and priced
with the export's own `exporters.billing.cost`, so a tenant's cost on the page is the
sum of its FOCUS rows to the digit, and a month of millions of records is a query
over thousands of rollups, not a read of every record.

Fetching (`load_finance`, `load_statement`, `focus_csv`, `PrometheusTotals`) is separate
from shaping (`finance_frames`, `statement_lines`, `reconcile`, `over_time`), which
are pure and unit-tested. Failures are `SourceError`s with one sentence for the banner.
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import httpx
import pandas as pd

from dashboard.data import SourceError
from engine.labels import OTHER as OTHER_TENANT
from engine.tenancy import TierTable
from exporters import metrics as m
from exporters.billing import (
    MICROS_PER_HOUR,
    Charges,
    charge_groups,
    csv_chunks,
    export_chunks,
    stamp,
)
from exporters.rollups import DAY, Rollup

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
LINE_COLUMNS = ["model", "tier", *COUNTS, *HOURS, "cost"]
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
    from exporters.ledger import UsageLedger

    return UsageLedger(url, create=False)


def _readable(action):
    """Run `action`, turning every ledger failure into one banner sentence."""
    from exporters.ledger import one_line

    try:
        return action()
    except SourceError:
        raise
    except Exception as exc:  # SQLAlchemy's errors vary by driver; the banner needs one line
        raise SourceError(f"The usage ledger is not readable ({one_line(exc)}).") from None


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


@dataclass(frozen=True)
class Statement:
    """One tenant, one period: a line per (model, tier) with LINE_COLUMNS, and totals."""

    tenant_id: str
    start: float
    end: float
    currency: str
    lines: pd.DataFrame

    @property
    def total(self) -> Decimal:
        return sum(self.lines["cost"], Decimal(0))


def load_statement(url: str, tenant: str, start: float, end: float, tiers) -> Statement:
    def read() -> Statement:
        found = _ledger(url).rollups(start, end, [tenant], bucket=DAY)
        return statement_lines(tenant, start, end, found, tiers)

    return _readable(read)


def statement_lines(tenant: str, start, end, usage: Iterable[Rollup], tiers) -> Statement:
    """Priced as the FOCUS export by month prices its rows: the total is their sum."""
    lines: dict[tuple[str, str], dict[str, Any]] = {}
    for group in charge_groups(usage, "month", tiers, (start, end)):
        _add(
            lines.setdefault((group.model, group.tier), _zero()), group.charges, group.charges.cost
        )
    rows = [
        {"model": model, "tier": tier} | _figures(v) for (model, tier), v in sorted(lines.items())
    ]
    return Statement(tenant, start, end, tiers.currency, pd.DataFrame(rows, columns=LINE_COLUMNS))


def statement_csv(s: Statement) -> bytes:
    """The statement's lines and a total line, as CSV (the spreadsheet guard applies)."""
    columns = ("tenant_id", "period_start", "period_end", "currency", *LINE_COLUMNS)
    head = {
        "tenant_id": s.tenant_id,
        "period_start": stamp(s.start),
        "period_end": stamp(s.end),
        "currency": s.currency,
    }
    rows = [head | {c: str(v) for c, v in line.items()} for line in s.lines.to_dict("records")]
    totals = {c: str(int(s.lines[c].sum())) for c in COUNTS}
    hours = {h: str(sum(s.lines[h], Decimal(0))) for h in HOURS}
    rows.append(head | {"model": "TOTAL", "tier": ""} | totals | hours | {"cost": str(s.total)})
    return "".join(csv_chunks(rows, columns)).encode()


def statement_html(s: Statement) -> str:
    """A printable, self-contained page: no script, no external asset."""
    e = html.escape
    head = "".join(f"<th>{e(c.replace('_', ' '))}</th>" for c in LINE_COLUMNS)
    body = "".join(
        "<tr>" + "".join(f"<td>{e(str(line[c]))}</td>" for c in LINE_COLUMNS) + "</tr>"
        for line in s.lines.to_dict("records")
    )
    period = f"{_day(s.start)} to {_day(s.end)} (UTC, end exclusive)"
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>Statement {e(s.tenant_id)} {e(period)}</title><style>"
        "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #999;padding:4px 8px;text-align:right}"
        "@media print{button{display:none}}</style></head><body>"
        f"<h1>Usage statement</h1><p>Tenant <b>{e(s.tenant_id)}</b>, {e(period)}</p>"
        f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
        f"<p><b>Total: {e(str(s.total))} {e(s.currency)}</b></p>"
        f"<p>Generated {e(stamp(datetime.now(UTC).timestamp()))} from the kvlease usage "
        "ledger. Recomputed tokens are never billed.</p></body></html>"
    )


def _day(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M")


def focus_csv(url: str, start: float, end: float, granularity: str, tiers) -> bytes:
    """The file `kvlease usage export` writes for this window and granularity."""

    def read() -> bytes:
        chunks = export_chunks(_ledger(url), (start, end), "focus", granularity, tiers)
        return "".join(chunks).encode()

    return _readable(read)


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
