"""Billing export: ledger records -> FinOps FOCUS v1.2 rows (or raw rows), streamed.

One FOCUS row per (tenant, model, charge period). Costs are exact decimals:
    (input - cached input)/1000 x input price + cached input/1000 x cached price
    + output/1000 x output price + KV block-hours x block-hour price,
priced per record by that record's tier. Recomputed tokens (work a preemption
threw away) are reported in `x_RecomputedTokens` and never billed. Rows are
produced one group at a time from records sorted by (tenant, model, end time),
so memory stays flat however many records there are.
"""

from __future__ import annotations

import calendar
import csv
import functools
import hashlib
import io
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import fields
from datetime import UTC, datetime
from decimal import Decimal

from engine.tenancy import Prices, TierTable
from exporters.ledger import UsageRecord

GRANULARITIES = ("hour", "day", "month")
FOCUS_COLUMNS = (
    "BilledCost",
    "BillingAccountId",
    "BillingAccountName",
    "BillingCurrency",
    "BillingPeriodEnd",
    "BillingPeriodStart",
    "ChargeCategory",
    "ChargeClass",
    "ChargeDescription",
    "ChargePeriodEnd",
    "ChargePeriodStart",
    "ConsumedQuantity",
    "ConsumedUnit",
    "ContractedCost",
    "EffectiveCost",
    "InvoiceIssuerName",
    "ListCost",
    "PricingQuantity",
    "PricingUnit",
    "ProviderName",
    "PublisherName",
    "ServiceCategory",
    "ServiceName",
    "SubAccountId",
    "Tags",
    "x_RowKey",
    "x_Tier",
    "x_Model",
    "x_Requests",
    "x_InputTokens",
    "x_CachedInputTokens",
    "x_OutputTokens",
    "x_RecomputedTokens",
    "x_BlockHours",
    "x_Preemptions",
)
RAW_COLUMNS = tuple(f.name for f in fields(UsageRecord))
THOUSAND = Decimal(1000)


def stamp(epoch: float) -> str:
    """FOCUS timestamps: UTC, `YYYY-MM-DDTHH:MM:SSZ`."""
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def period(epoch: float, granularity: str) -> tuple[float, float]:
    """[start, end) of the hour, day or month containing `epoch`, as epoch seconds."""
    t = datetime.fromtimestamp(epoch, UTC)
    if granularity == "hour":
        start = t.replace(minute=0, second=0, microsecond=0)
        return start.timestamp(), start.timestamp() + 3600
    if granularity == "day":
        start = t.replace(hour=0, minute=0, second=0, microsecond=0)
        return start.timestamp(), start.timestamp() + 86400
    if granularity == "month":
        start = t.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        days = calendar.monthrange(t.year, t.month)[1]
        return start.timestamp(), start.timestamp() + days * 86400
    raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")


class UnpricedRecord(ValueError):
    """A record the export cannot price: the message names it and says why."""


@functools.lru_cache(maxsize=256)
def _stored(basis: str) -> tuple[str, Prices]:
    return Prices.from_basis(basis)


def record_prices(record: UsageRecord, tiers: TierTable) -> Prices | None:
    """The prices a record is billed at: those stored with it when it was written;
    for records written before prices were stored, its tier's in `tiers`. None for
    unclassified traffic (no tier: no price). Raises UnpricedRecord otherwise."""
    if record.price_basis is not None:
        currency, prices = _stored(record.price_basis)
        if currency != tiers.currency:
            raise UnpricedRecord(
                f"record {record.request_id} was priced in {currency}; this export is in "
                f"{tiers.currency} (the tier table's currency)"
            )
        return prices
    if record.tier is None:
        return None
    if record.tier not in tiers:
        raise UnpricedRecord(
            f"record {record.request_id} has no stored prices and its tier {record.tier!r} is "
            f"not in the tier table ({tiers.source}): export with the table it was served with "
            "(--tiers)"
        )
    return tiers[record.tier].prices


def record_cost(record: UsageRecord, tiers: TierTable) -> Decimal:
    p = record_prices(record, tiers)
    if p is None:
        return Decimal(0)  # unclassified traffic has no price
    uncached = record.input_tokens - record.cached_input_tokens
    return (
        Decimal(uncached) / THOUSAND * p.input_per_1k
        + Decimal(record.cached_input_tokens) / THOUSAND * p.cached_input_per_1k
        + Decimal(record.output_tokens) / THOUSAND * p.output_per_1k
        + Decimal(repr(record.kv_block_seconds)) / Decimal(3600) * p.block_hour
    )


class _Group:
    __slots__ = (
        "block_seconds",
        "cached",
        "cost",
        "first",
        "input",
        "output",
        "preemptions",
        "recomputed",
        "requests",
        "tiers",
    )

    def __init__(self, first: UsageRecord) -> None:
        self.first = first
        self.cost = Decimal(0)
        self.input = self.cached = self.output = self.recomputed = 0
        self.preemptions = self.requests = 0
        self.block_seconds = Decimal(0)
        self.tiers: set[str] = set()

    def add(self, r: UsageRecord, tiers: TierTable) -> None:
        self.cost += record_cost(r, tiers)
        self.input += r.input_tokens
        self.cached += r.cached_input_tokens
        self.output += r.output_tokens
        self.recomputed += r.recomputed_tokens
        self.block_seconds += Decimal(repr(r.kv_block_seconds))
        self.preemptions += r.preemptions
        self.requests += 1
        self.tiers.add(r.tier or "unclassified")


def focus_rows(
    records: Iterable[UsageRecord], granularity: str, tiers: TierTable
) -> Iterator[dict[str, str]]:
    """FOCUS rows; `records` must come sorted by (tenant, model, ended_at)."""
    account_id = os.environ.get("KVLEASE_BILLING_ACCOUNT_ID", "kvlease")
    account_name = os.environ.get("KVLEASE_BILLING_ACCOUNT_NAME", account_id)
    provider = os.environ.get("KVLEASE_PROVIDER_NAME", "kvlease")
    key, group = None, None
    for record in records:
        if (
            key is not None
            and record.tenant_id == key[0]
            and record.model == key[1]
            and key[2][0] <= record.ended_at < key[2][1]
        ):
            group.add(record, tiers)  # same group: no need to work out the period again
            continue
        this = (record.tenant_id, record.model, period(record.ended_at, granularity))
        if this != key:
            if group is not None:
                yield _focus_row(group, key, granularity, tiers, account_id, account_name, provider)
            key, group = this, _Group(record)
        group.add(record, tiers)
    if group is not None:
        yield _focus_row(group, key, granularity, tiers, account_id, account_name, provider)


def _focus_row(g: _Group, key, granularity, tiers, account_id, account_name, provider):
    tenant, model, (start, end) = key
    billing = period(start, "month")
    consumed = g.input + g.output
    cost = str(g.cost.normalize()) if g.cost else "0"
    block_hours = g.block_seconds / Decimal(3600)
    tier = ",".join(sorted(g.tiers))
    return {
        "BilledCost": cost,
        "BillingAccountId": account_id,
        "BillingAccountName": account_name,
        "BillingCurrency": tiers.currency,
        "BillingPeriodEnd": stamp(billing[1]),
        "BillingPeriodStart": stamp(billing[0]),
        "ChargeCategory": "Usage",
        "ChargeClass": "",
        "ChargeDescription": f"LLM inference on {model} ({tier} tier): {g.input} input tokens "
        f"({g.cached} cached), {g.output} output tokens, {block_hours:.6f} KV block-hours",
        "ChargePeriodEnd": stamp(end),
        "ChargePeriodStart": stamp(start),
        "ConsumedQuantity": str(consumed),
        "ConsumedUnit": "Tokens",
        "ContractedCost": cost,
        "EffectiveCost": cost,
        "InvoiceIssuerName": provider,
        "ListCost": cost,
        "PricingQuantity": str(Decimal(consumed) / THOUSAND),
        "PricingUnit": "1K Tokens",
        "ProviderName": provider,
        "PublisherName": provider,
        "ServiceCategory": "AI and Machine Learning",
        "ServiceName": "kvlease LLM inference",
        "SubAccountId": tenant,
        "Tags": json.dumps({"kvlease/tier": tier, "kvlease/model": model}, sort_keys=True),
        "x_RowKey": hashlib.sha256(
            f"{tenant}\x1f{model}\x1f{granularity}\x1f{stamp(start)}".encode()
        ).hexdigest()[:32],
        "x_Tier": tier,
        "x_Model": model,
        "x_Requests": str(g.requests),
        "x_InputTokens": str(g.input),
        "x_CachedInputTokens": str(g.cached),
        "x_OutputTokens": str(g.output),
        "x_RecomputedTokens": str(g.recomputed),
        "x_BlockHours": f"{block_hours:.9f}",
        "x_Preemptions": str(g.preemptions),
    }


def raw_rows(records: Iterable[UsageRecord]) -> Iterator[dict[str, str]]:
    for r in records:
        row = {k: "" if v is None else str(v) for k, v in zip(RAW_COLUMNS, _values(r), strict=True)}
        row["started_at"], row["ended_at"] = stamp(r.started_at), stamp(r.ended_at)
        yield row


def _values(r: UsageRecord) -> list:
    return [getattr(r, name) for name in RAW_COLUMNS]


def csv_chunks(rows: Iterable[dict[str, str]], columns: tuple[str, ...]) -> Iterator[str]:
    """CSV text, header first, a chunk per 500 rows: for streamed HTTP responses and files."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for i, row in enumerate(rows, 1):
        writer.writerow(row)
        if i % 500 == 0:
            yield buffer.getvalue()
            buffer.seek(0)
            buffer.truncate()
    yield buffer.getvalue()


def export_chunks(
    records: Iterable[UsageRecord], fmt: str, granularity: str, tiers: TierTable
) -> Iterator[str]:
    """The export file, as `kvlease usage export` and `/admin/usage.csv` give it (the
    dashboard writes the same FOCUS rows with the same `csv_chunks`)."""
    if fmt == "raw":
        return csv_chunks(raw_rows(records), RAW_COLUMNS)
    return csv_chunks(focus_rows(records, granularity, tiers), FOCUS_COLUMNS)


def parse_window(start: str | None, end: str | None) -> tuple[float, float]:
    """[start, end) as epoch seconds from UTC dates or ISO times; default: this month."""

    def parse(value: str) -> float:
        try:
            moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise ValueError(f"not a date or ISO time: {value!r} (try 2026-11-01)") from None
        return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()

    this_month = period(datetime.now(UTC).timestamp(), "month")
    lo = parse(start) if start else this_month[0]
    hi = parse(end) if end else this_month[1]
    if hi <= lo:
        raise ValueError("--to must be after --from")
    return lo, hi
