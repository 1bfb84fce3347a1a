"""One tenant's statement for one period: a document finance can send.

A line per priced item: (SKU, model, tier, unit price), its quantity, unit price and
amount. Lines are summed over the period from the same charge groups the FOCUS export
by month writes (`billing.charge_groups`), so a line's exact cost is the sum of its
FOCUS rows' exact costs. Amounts follow `kvlease.exporters.money`: each line and the total in
the currency's minor unit, and a rounding line where the rounded lines do not add up
to the rounded total.

`summary_chunks` writes one row per tenant: its statement's total and what it counts.

The statement number is stable: the same account, tenant and period always give the
same number, so a statement generated twice is recognisably the same document.
"""

from __future__ import annotations

import hashlib
import html
import itertools
import operator
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from kvlease.engine.tenancy import TierTable
from kvlease.exporters import money
from kvlease.exporters.billing import Account, charge_groups, csv_chunks
from kvlease.exporters.periods import stamp
from kvlease.exporters.pricing import MICROS_PER_HOUR, SKUS
from kvlease.exporters.rollups import Rollup

# How each SKU's quantity reads on a statement: (unit, divisor of its whole units, places).
# Tokens are counted whole and priced per 1K; KV time is counted in block-microseconds and
# priced per block-hour.
_QUANTITY = {
    "1K Tokens": ("tokens", Decimal(1), 0),
    "Hours": ("block-hours", MICROS_PER_HOUR, 4),
}


def _quantity(units: int, pricing_unit: str) -> Decimal:
    """Whole units (tokens, block-microseconds) as a statement reads them."""
    _, divisor, places = _QUANTITY[pricing_unit]
    return (Decimal(units) / divisor).quantize(Decimal(1).scaleb(-places))


_PRICED_PER = {"1K Tokens": "1K tokens", "Hours": "block-hour"}
CSV_COLUMNS = (
    "row_type",  # line, rounding or total: sum `amount` over line and rounding rows
    "statement_number",
    "account_name",
    "tenant_id",
    "period_start",
    "period_end",
    "currency",
    "item",
    "model",
    "tier",
    "quantity",
    "unit",
    "unit_price",
    "priced_per",
    "amount",
)


@dataclass(frozen=True)
class Line:
    """One priced item: what it is, how much, at what price; `exact` is its exact cost."""

    sku: str  # a SkuId of pricing.SKUS, without the kvlease- prefix
    item: str
    model: str
    tier: str
    units: int  # tokens, or block-microseconds
    pricing_unit: str  # a PricingUnit of pricing.SKUS
    unit_price: Decimal
    exact: Decimal

    @property
    def quantity(self) -> Decimal:
        return _quantity(self.units, self.pricing_unit)

    @property
    def unit(self) -> str:
        return _QUANTITY[self.pricing_unit][0]

    @property
    def priced_per(self) -> str:
        return _PRICED_PER[self.pricing_unit]


@dataclass(frozen=True)
class Statement:
    account: Account
    tenant_id: str
    start: float
    end: float
    currency: str
    lines: tuple[Line, ...]
    requests: int
    recomputed_tokens: int  # never billed; said on the statement

    def units(self, sku: str) -> int:
        """What the lines of `sku` count together (tokens or block-microseconds)."""
        return sum(line.units for line in self.lines if line.sku == sku)

    @property
    def exact(self) -> Decimal:
        """The exact total: the sum of the tenant's FOCUS rows for the period, unrounded."""
        return sum((line.exact for line in self.lines), Decimal(0))

    @property
    def total(self) -> Decimal:
        """What the tenant owes, in the minor unit: the figure the pages show too."""
        return money.in_minor_units(self.exact, self.currency)

    def amount(self, line: Line) -> Decimal:
        return money.in_minor_units(line.exact, self.currency)

    @property
    def rounding(self) -> Decimal:
        return money.rounding([line.exact for line in self.lines], self.exact, self.currency)

    @property
    def number(self) -> str:
        """`KVL-YYYYMM-XXXXXXXX`: the period's first month and a digest of the account,
        tenant and period: the same inputs, the same number."""
        key = "\x1f".join((self.account.id, self.tenant_id, stamp(self.start), stamp(self.end)))
        digest = hashlib.sha256(key.encode()).hexdigest()[:8].upper()
        return f"KVL-{datetime.fromtimestamp(self.start, UTC):%Y%m}-{digest}"

    @property
    def period(self) -> str:
        return period_name(self.start, self.end)


def statement(
    tenant: str,
    start: float,
    end: float,
    usage: Iterable[Rollup],
    tiers: TierTable,
    account: Account | None = None,
) -> Statement:
    """`usage` (rollups of `tenant`, sorted as `UsageLedger.rollups` gives them) priced
    as the FOCUS export by month prices it, a line per (model, tier, SKU, unit price)."""
    sums: dict[tuple[str, str, int, Decimal], list[Any]] = {}  # [units, exact cost]
    requests = recomputed = 0
    for group in charge_groups(usage, "month", tiers, (start, end)):
        c = group.charges
        requests += c.requests
        recomputed += c.recomputed
        for i, (units, exact) in enumerate(zip(c.units(), c.costs(), strict=True)):
            if units:
                key = (group.model, group.tier, i, c.prices[i])
                acc = sums.setdefault(key, [0, Decimal(0)])
                acc[0] += units
                acc[1] += exact
    lines = tuple(
        Line(
            sku=SKUS[i].id,
            item=_sentence(SKUS[i].description),
            model=model,
            tier=tier,
            units=units,
            pricing_unit=SKUS[i].pricing_unit,
            unit_price=price,
            exact=exact,
        )
        for (model, tier, i, price), (units, exact) in sorted(sums.items())
    )
    return Statement(
        account or Account.from_environment(),
        tenant,
        start,
        end,
        tiers.currency,
        lines,
        requests,
        recomputed,
    )


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def period_name(start: float, end: float) -> str:
    """`November 2026` for a whole calendar month, else `3 Nov 2026 to 9 Nov 2026` (the
    last day included; a period not at midnight shows its times, UTC)."""
    lo, hi = datetime.fromtimestamp(start, UTC), datetime.fromtimestamp(end, UTC)
    midnight = all((t.hour, t.minute, t.second, t.microsecond) == (0, 0, 0, 0) for t in (lo, hi))
    if midnight and lo.day == 1 and hi.day == 1 and (hi - lo).days in (28, 29, 30, 31):
        return f"{lo:%B %Y}"
    if midnight:
        last = hi - timedelta(days=1)
        return f"{lo.day} {lo:%b %Y} to {last.day} {last:%b %Y}"
    return f"{lo:%Y-%m-%d %H:%M} to {hi:%Y-%m-%d %H:%M} UTC"


def _price(value: Decimal) -> str:
    """A unit price on the page: as the tier table states it, `0` when free."""
    return format(value.normalize(), "f") if value else "0"


def to_csv(s: Statement) -> bytes:
    """The statement as CSV: a `line` row per priced item, a `rounding` row when there is
    one, and a `total` row; the total is in `amount` of its own row type, never in a data
    column (the spreadsheet guard applies)."""
    head = {
        "statement_number": s.number,
        "account_name": s.account.name,
        "tenant_id": s.tenant_id,
        "period_start": stamp(s.start),
        "period_end": stamp(s.end),
        "currency": s.currency,
    }
    blank = dict.fromkeys(CSV_COLUMNS, "")
    rows = [
        blank
        | head
        | {
            "row_type": "line",
            "item": line.item,
            "model": line.model,
            "tier": line.tier,
            "quantity": str(line.quantity),
            "unit": line.unit,
            "unit_price": money.plain(line.unit_price),
            "priced_per": line.priced_per,
            "amount": str(s.amount(line)),
        }
        for line in s.lines
    ]
    if s.rounding:
        rows.append(blank | head | {"row_type": "rounding", "amount": str(s.rounding)})
    rows.append(blank | head | {"row_type": "total", "amount": str(s.total)})
    return "".join(csv_chunks(rows, CSV_COLUMNS)).encode()


_STYLE = (
    "@page{size:A4 portrait;margin:15mm}"
    "body{font:10pt/1.4 sans-serif;color:#111;margin:0 auto;max-width:180mm}"
    "header{display:flex;justify-content:space-between;gap:8mm}header>div{flex:1;min-width:55mm}"
    "h1{font-size:16pt;margin:0 0 2mm}dl{margin:0;display:grid;"
    "grid-template-columns:auto auto;gap:0 4mm}dt{color:#555}dd{margin:0}"
    "table{width:100%;border-collapse:collapse;margin:6mm 0;table-layout:fixed}"
    "th,td{padding:1.5mm 2mm;border-bottom:1px solid #ccc;vertical-align:top;"
    "overflow-wrap:anywhere}th{text-align:left;border-bottom:1.5px solid #111}"
    ".n{text-align:right;white-space:nowrap}tfoot td{border:0}tfoot .t{font-weight:bold;"
    "border-top:1.5px solid #111}col.item{width:40%}col.q,col.p{width:23%}small{color:#555}"
)


def to_html(s: Statement, generated: float | None = None) -> str:
    """A printable, self-contained page that fits A4 portrait: no script, no external
    asset; every text the ledger holds is escaped."""
    e = html.escape
    c = s.currency
    rows = "".join(
        f"<tr><td>{e(line.item)}<br><small>{e(line.model)}, {e(line.tier)} tier</small></td>"
        f"<td class=n>{line.quantity:,} {e(line.unit)}</td>"
        f"<td class=n>{_price(line.unit_price)} / {e(line.priced_per)}</td>"
        f"<td class=n>{money.shown(line.exact, c)}</td></tr>"
        for line in s.lines
    )
    subtotal = s.total - s.rounding
    foot = (
        f"<tr><td colspan=3 class=n>Subtotal</td><td class=n>{money.shown(subtotal, c)}</td></tr>"
    )
    if s.rounding:
        foot += (
            "<tr><td colspan=3 class=n>Rounding</td>"
            f"<td class=n>{money.shown(s.rounding, c, sign=True)}</td></tr>"
        )
    foot += (
        f"<tr><td colspan=3 class='n t'>Total ({e(c)})</td>"
        f"<td class='n t'>{money.shown(s.total, c)}</td></tr>"
    )
    when = stamp(generated if generated is not None else datetime.now(UTC).timestamp())
    return (
        "<!doctype html><html lang=en><head><meta charset='utf-8'>"
        f"<title>Statement {e(s.number)}: {e(s.tenant_id)}, {e(s.period)}</title>"
        f"<style>{_STYLE}</style></head><body>"
        f"<header><div><h1>Usage statement</h1>{e(s.account.name)}<br>"
        f"<small>account {e(s.account.id)}</small></div><dl>"
        f"<dt>Statement</dt><dd>{e(s.number)}</dd>"
        f"<dt>Tenant</dt><dd><b>{e(s.tenant_id)}</b></dd>"
        f"<dt>Period</dt><dd>{e(s.period)}</dd>"
        f"<dt>Currency</dt><dd>{e(c)}</dd></dl></header>"
        "<table><colgroup><col class=item><col class=q><col class=p><col></colgroup><thead><tr>"
        "<th>Item</th><th class=n>Quantity</th><th class=n>Unit price</th>"
        f"<th class=n>Amount</th></tr></thead><tbody>{rows}</tbody><tfoot>{foot}</tfoot></table>"
        f"<p><small>Period {e(stamp(s.start))} to {e(stamp(s.end))} (UTC, end excluded). "
        f"Amounts are rounded half to even to the {e(c)} minor unit; the exact total, "
        f"the sum of this period's FOCUS rows, is {e(money.focus_amount(s.exact))} {e(c)}. "
        f"{s.recomputed_tokens:,} tokens computed again after preemptions are not billed. "
        f"Generated {e(when)} from the kvlease usage ledger.</small></p></body></html>"
    )


SUMMARY_COLUMNS = (
    "tenant_id",
    "amount",
    "currency",
    "period",
    "statement_number",
    "requests",
    "input_tokens",
    "cached_input_tokens",
    "output_tokens",
    "recomputed_tokens",
    "kv_block_hours",
    "kv_retention_block_hours",
    "period_start",
    "period_end",
)


def summary_row(s: Statement) -> dict[str, str]:
    """One tenant's line of the summary export: its statement's total and counts."""
    hours = _quantity(s.units("kv-block-hours"), "Hours")
    retention = _quantity(s.units("kv-retention"), "Hours")
    cached = s.units("cached-input-tokens")
    return {
        "tenant_id": s.tenant_id,
        "amount": str(s.total),
        "currency": s.currency,
        "period": s.period,
        "statement_number": s.number,
        "requests": str(s.requests),
        "input_tokens": str(s.units("input-tokens") + cached),
        "cached_input_tokens": str(cached),
        "output_tokens": str(s.units("output-tokens")),
        "recomputed_tokens": str(s.recomputed_tokens),
        "kv_block_hours": str(hours),
        "kv_retention_block_hours": str(retention),
        "period_start": stamp(s.start),
        "period_end": stamp(s.end),
    }


def summaries(
    usage: Iterable[Rollup], window: tuple[float, float], tiers: TierTable
) -> Iterator[Statement]:
    """A statement per tenant of `usage` (rollups sorted by tenant first, as
    `UsageLedger.rollups` gives them); memory: one tenant's lines at a time."""
    account = Account.from_environment()
    for tenant, rollups in itertools.groupby(usage, operator.attrgetter("tenant_id")):
        yield statement(tenant, *window, rollups, tiers, account)


def summary_chunks(
    usage: Iterable[Rollup], window: tuple[float, float], tiers: TierTable
) -> Iterator[str]:
    """The summary export: a CSV row per tenant, header first."""
    rows = (summary_row(s) for s in summaries(usage, window, tiers))
    return csv_chunks(rows, SUMMARY_COLUMNS)
