"""Billing export: ledger records -> FinOps FOCUS v1.2 rows (or raw rows), streamed.

One FOCUS row per (tenant, model, charge period). Costs are exact decimals:
    (input - cached input)/1000 x input price + cached input/1000 x cached price
    + output/1000 x output price + KV block-hours x block-hour price,
priced per record by that record's tier. Recomputed tokens (work a preemption
threw away) are reported in `x_RecomputedTokens` and never billed; what leasing
bought is in `x_LeaseCoveredTokens` (prefix tokens a running lease was keeping at
a session's next turn) and `x_LeaseReusedTokens` (those the cache served, billed
at the cached-input price like any cached token). Rows are
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
ACCOUNT_ID_ENV = "KVLEASE_BILLING_ACCOUNT_ID"
ACCOUNT_NAME_ENV = "KVLEASE_BILLING_ACCOUNT_NAME"
PROVIDER_ENV = "KVLEASE_PROVIDER_NAME"
FOCUS_COLUMNS = (  # FOCUS 1.2 columns that apply to an inference provider, then ours
    "AvailabilityZone",
    "BilledCost",
    "BillingAccountId",
    "BillingAccountName",
    "BillingAccountType",
    "BillingCurrency",
    "BillingPeriodEnd",
    "BillingPeriodStart",
    "CapacityReservationId",
    "CapacityReservationStatus",
    "ChargeCategory",
    "ChargeClass",
    "ChargeDescription",
    "ChargeFrequency",
    "ChargePeriodEnd",
    "ChargePeriodStart",
    "CommitmentDiscountCategory",
    "CommitmentDiscountId",
    "CommitmentDiscountName",
    "CommitmentDiscountQuantity",
    "CommitmentDiscountStatus",
    "CommitmentDiscountType",
    "CommitmentDiscountUnit",
    "ConsumedQuantity",
    "ConsumedUnit",
    "ContractedCost",
    "ContractedUnitPrice",
    "EffectiveCost",
    "InvoiceId",
    "InvoiceIssuerName",
    "ListCost",
    "ListUnitPrice",
    "PricingCategory",
    "PricingQuantity",
    "PricingUnit",
    "ProviderName",
    "PublisherName",
    "RegionId",
    "RegionName",
    "ResourceId",
    "ResourceName",
    "ResourceType",
    "ServiceCategory",
    "ServiceName",
    "ServiceSubcategory",
    "SkuId",
    "SkuMeter",
    "SkuPriceId",
    "SubAccountId",
    "SubAccountName",
    "SubAccountType",
    "Tags",
    "x_RowKey",
    "x_Tier",
    "x_Model",
    "x_Requests",
    "x_InputTokens",
    "x_CachedInputTokens",
    "x_OutputTokens",
    "x_RecomputedTokens",
    "x_LeaseCoveredTokens",
    "x_LeaseReusedTokens",
    "x_BlockHours",
    "x_Preemptions",
)
RAW_COLUMNS = tuple(f.name for f in fields(UsageRecord))
FORMULA_STARTS = frozenset("=+-@\t\r")
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


# The charges of one request, as FOCUS SKUs: (SkuId, PricingUnit, ConsumedUnit,
# description). Each is priced per PricingUnit by one of the tier's four prices.
SKUS = (
    ("input-tokens", "1K Tokens", "Tokens", "input tokens (not served from the prefix cache)"),
    ("cached-input-tokens", "1K Tokens", "Tokens", "input tokens served from the prefix cache"),
    ("output-tokens", "1K Tokens", "Tokens", "output tokens"),
    ("kv-block-hours", "Hours", "Block-Hours", "KV-cache block-hours held"),
)
SKU_METERS = ("Input Tokens", "Cached Input Tokens", "Output Tokens", "KV Cache Block-Hours")
# FOCUS columns that do not apply to per-request inference billing: null on every row.
NOT_APPLICABLE = (
    "AvailabilityZone",
    "CapacityReservationId",
    "CapacityReservationStatus",
    "CommitmentDiscountCategory",
    "CommitmentDiscountId",
    "CommitmentDiscountName",
    "CommitmentDiscountQuantity",
    "CommitmentDiscountStatus",
    "CommitmentDiscountType",
    "CommitmentDiscountUnit",
    "InvoiceId",  # kvlease meters; the invoice is issued elsewhere
    "RegionId",
    "RegionName",
)
ZERO = Decimal(0)


def _charges(r: UsageRecord, p: Prices | None) -> tuple[tuple[Decimal, Decimal, Decimal], ...]:
    """Per SKU of `SKUS`: (consumed quantity, pricing quantity, unit price)."""
    uncached = Decimal(r.input_tokens - r.cached_input_tokens)
    cached, output = Decimal(r.cached_input_tokens), Decimal(r.output_tokens)
    hours = Decimal(repr(r.kv_block_seconds)) / Decimal(3600)
    prices = (
        (p.input_per_1k, p.cached_input_per_1k, p.output_per_1k, p.block_hour)
        if p is not None
        else (ZERO,) * 4  # unclassified traffic has no price
    )
    return (
        (uncached, uncached / THOUSAND, prices[0]),
        (cached, cached / THOUSAND, prices[1]),
        (output, output / THOUSAND, prices[2]),
        (hours, hours, prices[3]),
    )


def record_cost(record: UsageRecord, tiers: TierTable) -> Decimal:
    charges = _charges(record, record_prices(record, tiers))
    return sum((quantity * price for _, quantity, price in charges), ZERO)


class _Group:
    """The records of one (tenant, model, charge period, tier, prices): four charge rows."""

    __slots__ = (
        "block_seconds",
        "cached",
        "consumed",
        "input",
        "lease_covered",
        "lease_reused",
        "output",
        "preemptions",
        "prices",
        "pricing",
        "recomputed",
        "requests",
    )

    def __init__(self, prices: tuple[Decimal, ...]) -> None:
        self.prices = prices
        self.consumed = [ZERO] * len(SKUS)
        self.pricing = [ZERO] * len(SKUS)
        self.input = self.cached = self.output = self.recomputed = 0
        self.lease_covered = self.lease_reused = 0
        self.preemptions = self.requests = 0
        self.block_seconds = ZERO

    def add(self, r: UsageRecord, charges) -> None:
        for i, (consumed, pricing, _) in enumerate(charges):
            self.consumed[i] += consumed
            self.pricing[i] += pricing
        self.input += r.input_tokens
        self.cached += r.cached_input_tokens
        self.output += r.output_tokens
        self.recomputed += r.recomputed_tokens
        self.lease_covered += r.lease_covered_tokens
        self.lease_reused += min(r.lease_covered_tokens, r.cached_input_tokens)
        self.block_seconds += Decimal(repr(r.kv_block_seconds))
        self.preemptions += r.preemptions
        self.requests += 1


def focus_rows(
    records: Iterable[UsageRecord],
    granularity: str,
    tiers: TierTable,
    window: tuple[float, float] | None = None,
) -> Iterator[dict[str, str]]:
    """FOCUS charge rows: per (tenant, model, charge period) and per SKU (input, cached
    input, output tokens, KV block-hours), at each unit price in force when the records
    were written. Charge periods are clipped to `window` ([from, to) of the export), so
    two partial exports of one month neither overlap nor share a row key.

    `records` must come sorted by (tenant, model, ended_at). Memory: the groups of one
    (tenant, model, period) at a time."""
    context = _Context(granularity, tiers, window)
    key, groups = None, {}
    for record in records:
        prices = record_prices(record, tiers)
        this = (record.tenant_id, record.model, period(record.ended_at, granularity))
        if this != key:
            yield from context.rows(key, groups)
            key, groups = this, {}
        charges = _charges(record, prices)
        basis = (record.tier or "unclassified", tuple(price for _, _, price in charges))
        group = groups.get(basis)
        if group is None:
            group = groups[basis] = _Group(basis[1])
        group.add(record, charges)
    yield from context.rows(key, groups)


class _Context:
    """What every row of one export shares."""

    def __init__(self, granularity: str, tiers: TierTable, window) -> None:
        self.granularity, self.currency, self.window = granularity, tiers.currency, window
        self.account_id = os.environ.get(ACCOUNT_ID_ENV, "kvlease")
        self.account_name = os.environ.get(ACCOUNT_NAME_ENV, self.account_id)
        self.provider = os.environ.get(PROVIDER_ENV, "kvlease")

    def rows(self, key, groups: dict) -> Iterator[dict[str, str]]:
        if key is None:
            return
        tenant, model, (start, end) = key
        if self.window is not None:
            start, end = max(start, self.window[0]), min(end, self.window[1])
        for (tier, prices), g in sorted(groups.items()):
            tags = json.dumps({"kvlease/tier": tier, "kvlease/model": model}, sort_keys=True)
            for i in range(len(SKUS)):
                yield self._row(tenant, model, (start, end), tier, tags, prices[i], g, i)

    def _row(self, tenant, model, charge_period, tier, tags, price, g: _Group, i: int):
        sku, pricing_unit, consumed_unit, what = SKUS[i]
        start, end = charge_period
        billing = period(start, "month")
        cost = _decimal(g.pricing[i] * price)
        primary = i == 0  # request-level figures ride on the input row; 0 elsewhere
        sku_price = f"{sku}:{tier}:{_decimal(price)}:{self.currency}"
        row_key = "\x1f".join(
            (tenant, model, self.granularity, stamp(start), stamp(end), sku_price)
        )
        return {
            **dict.fromkeys(NOT_APPLICABLE, ""),
            "BilledCost": cost,
            "BillingAccountId": self.account_id,
            "BillingAccountName": self.account_name,
            "BillingAccountType": "Billing Account",
            "BillingCurrency": self.currency,
            "BillingPeriodEnd": stamp(billing[1]),
            "BillingPeriodStart": stamp(billing[0]),
            "ChargeCategory": "Usage",
            "ChargeClass": "",
            "ChargeDescription": f"{what} on {model}, {tier} tier",
            "ChargeFrequency": "Usage-Based",
            "ChargePeriodEnd": stamp(end),
            "ChargePeriodStart": stamp(start),
            "ConsumedQuantity": _decimal(g.consumed[i]),
            "ConsumedUnit": consumed_unit,
            "ContractedCost": cost,
            "ContractedUnitPrice": _decimal(price),
            "EffectiveCost": cost,
            "InvoiceIssuerName": self.provider,
            "ListCost": cost,
            "ListUnitPrice": _decimal(price),
            "PricingCategory": "Standard",
            "PricingQuantity": _decimal(g.pricing[i]),
            "PricingUnit": pricing_unit,
            "ProviderName": self.provider,
            "PublisherName": self.provider,
            "ResourceId": f"{self.provider}/models/{model}",
            "ResourceName": model,
            "ResourceType": "LLM model",
            "ServiceCategory": "AI and Machine Learning",
            "ServiceName": "kvlease LLM inference",
            "ServiceSubcategory": "Generative AI",
            "SkuId": f"kvlease-{sku}",
            "SkuMeter": SKU_METERS[i],
            "SkuPriceId": sku_price,
            "SubAccountId": tenant,
            "SubAccountName": tenant,
            "SubAccountType": "Tenant",
            "Tags": tags,
            "x_RowKey": hashlib.sha256(row_key.encode()).hexdigest()[:32],
            "x_Tier": tier,
            "x_Model": model,
            "x_Requests": str(g.requests if primary else 0),
            "x_InputTokens": str(g.input if primary else 0),
            "x_CachedInputTokens": str(g.cached if primary else 0),
            "x_OutputTokens": str(g.output if primary else 0),
            "x_RecomputedTokens": str(g.recomputed if primary else 0),
            "x_LeaseCoveredTokens": str(g.lease_covered if primary else 0),
            "x_LeaseReusedTokens": str(g.lease_reused if primary else 0),
            "x_BlockHours": _decimal(g.block_seconds / Decimal(3600) if primary else ZERO),
            "x_Preemptions": str(g.preemptions if primary else 0),
        }


def _decimal(value: Decimal) -> str:
    """FOCUS decimals: plain notation (never `1E+1`), and always a decimal point, so a
    reader that infers types (pandas, the FinOps validator) reads a decimal column."""
    text = format(value.normalize(), "f") if value else "0"
    return text if "." in text else f"{text}.0"


def raw_rows(records: Iterable[UsageRecord]) -> Iterator[dict[str, str]]:
    for r in records:
        row = {k: "" if v is None else str(v) for k, v in zip(RAW_COLUMNS, _values(r), strict=True)}
        row["started_at"], row["ended_at"] = stamp(r.started_at), stamp(r.ended_at)
        yield row


def _values(r: UsageRecord) -> list:
    return [getattr(r, name) for name in RAW_COLUMNS]


def csv_chunks(rows: Iterable[dict[str, str]], columns: tuple[str, ...]) -> Iterator[str]:
    """CSV text, header first, a chunk per 500 rows: for streamed HTTP responses and files.
    A cell a spreadsheet would run as a formula (it starts with =, +, -, @, a tab or a
    carriage return: a tenant id or a model name may) is prefixed with a quote."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for i, row in enumerate(rows, 1):
        writer.writerow({k: _inert(v) for k, v in row.items()})
        if i % 500 == 0:
            yield buffer.getvalue()
            buffer.seek(0)
            buffer.truncate()
    yield buffer.getvalue()


def _inert(value: str) -> str:
    return f"'{value}" if value and value[0] in FORMULA_STARTS else value


def export_chunks(
    records: Iterable[UsageRecord],
    fmt: str,
    granularity: str,
    tiers: TierTable,
    window: tuple[float, float] | None = None,
) -> Iterator[str]:
    """The export file, as `kvlease usage export` and `/admin/usage.csv` give it (the
    dashboard writes the same FOCUS rows with the same `csv_chunks`)."""
    if fmt == "raw":
        return csv_chunks(raw_rows(records), RAW_COLUMNS)
    if fmt != "focus":
        raise ValueError(f"format must be focus or raw, got {fmt!r}")
    return csv_chunks(focus_rows(records, granularity, tiers, window), FOCUS_COLUMNS)


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
