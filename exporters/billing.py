"""Billing export: ledger records -> FinOps FOCUS v1.2 rows (or raw rows), streamed.

One FOCUS row per (tenant, model, charge period). Costs are exact decimals:
    (input - cached input)/1000 x input price + cached input/1000 x cached price
    + output/1000 x output price + KV block-hours x block-hour price
    + reserved block-hours x reserved price + retained block-hours x retained price,
priced by the tier each record was served in (the last two are the "KV retention" SKU:
a leased session's blocks between its turns, from the ledger's retention records; its
rows appear only where there was retention), and summed from the ledger's rollups
(`kvlease.exporters.rollups`). Only integers are summed (tokens, KV block-microseconds) and
each row divides once, so an export is the same byte for byte whether it was summed
from rollups or from every record. Each row's cost is then written at 10 decimal places
and token quantities as integers (`kvlease.exporters.money`, the one rounding rule).
Recomputed tokens (work a preemption
threw away) are reported in `x_RecomputedTokens` and never billed; what leasing
bought is in `x_LeaseCoveredTokens` (prefix tokens a running lease was keeping at
a session's next turn) and `x_LeaseReusedTokens` (those the cache served, billed
at the cached-input price like any cached token). Rows are
produced one group at a time from rollups sorted by (tenant, model, time), so
memory stays flat however many records there are.
"""

from __future__ import annotations

import calendar
import csv
import functools
import hashlib
import io
import itertools
import json
import math
import operator
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from decimal import ROUND_HALF_EVEN, Context, Decimal, localcontext

from kvlease.engine.tenancy import Prices, TierTable
from kvlease.exporters import money
from kvlease.exporters.ledger import UsageLedger, UsageRecord, rollup_of
from kvlease.exporters.rollups import DAY, HOUR, Rollup

GRANULARITIES = ("hour", "day", "month")
ACCOUNT_ID_ENV = "KVLEASE_BILLING_ACCOUNT_ID"
ACCOUNT_NAME_ENV = "KVLEASE_BILLING_ACCOUNT_NAME"
PROVIDER_ENV = "KVLEASE_PROVIDER_NAME"
# What a person filters and sums by, first (FOCUS sets no column order); then the rest of
# the FOCUS 1.2 columns that apply to an inference provider, A to Z, then ours.
KEY_COLUMNS = (
    "SubAccountId",
    "ChargePeriodStart",
    "ChargePeriodEnd",
    "x_Tier",
    "x_Model",
    "SkuId",
    "ConsumedQuantity",
    "ConsumedUnit",
    "ListUnitPrice",
    "BilledCost",
    "BillingCurrency",
)
_FOCUS_1_2 = (
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
)
FOCUS_COLUMNS = (
    *KEY_COLUMNS,
    *(c for c in _FOCUS_1_2 if c not in KEY_COLUMNS),
    "x_RowKey",
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


@functools.lru_cache(maxsize=4096)  # an export stamps the same few period edges again and again
def stamp(epoch: float) -> str:
    """FOCUS timestamps: UTC, `YYYY-MM-DDTHH:MM:SSZ`."""
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def period(epoch: float, granularity: str) -> tuple[float, float]:
    """[start, end) of the hour, day or month containing `epoch`, as epoch seconds (UTC
    hours and days are whole multiples of seconds since the epoch: no calendar needed)."""
    if granularity in ("hour", "day"):
        length = HOUR if granularity == "hour" else DAY
        start = math.floor(epoch / length) * length
        return float(start), float(start + length)
    t = datetime.fromtimestamp(epoch, UTC)
    if granularity == "month":
        start = t.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        days = calendar.monthrange(t.year, t.month)[1]
        return start.timestamp(), start.timestamp() + days * 86400
    raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")


@dataclass(frozen=True)
class Account:
    """Who bills: the FOCUS billing account and provider, from the environment."""

    id: str
    name: str
    provider: str

    @classmethod
    def from_environment(cls) -> Account:
        account_id = os.environ.get(ACCOUNT_ID_ENV, "kvlease")
        return cls(
            account_id,
            os.environ.get(ACCOUNT_NAME_ENV, account_id),
            os.environ.get(PROVIDER_ENV, "kvlease"),
        )


class UnpricedRecord(ValueError):
    """A record the export cannot price: the message names it and says why."""


@functools.lru_cache(maxsize=256)
def _stored(basis: str) -> tuple[str, Prices]:
    return Prices.from_basis(basis)


def prices_of(usage: Rollup, tiers: TierTable) -> Prices | None:
    """The prices usage is billed at: those stored with its records when they were
    written; for records written before prices were stored, its tier's in `tiers`. None
    for unclassified traffic (no tier: no price). Raises UnpricedRecord otherwise."""
    if usage.price_basis is not None:
        currency, prices = _stored(usage.price_basis)
        if currency != tiers.currency:
            raise UnpricedRecord(
                f"{usage.what} were priced in {currency}; this export is in "
                f"{tiers.currency} (the tier table's currency)"
            )
        return prices
    if usage.tier is None:
        return None
    if usage.tier not in tiers:
        raise UnpricedRecord(
            f"{usage.what} have no stored prices and their tier {usage.tier!r} is not in "
            f"the tier table ({tiers.source}): export with the table they were served with "
            "(--tiers)"
        )
    return tiers[usage.tier].prices


# The charges, as FOCUS SKUs: (SkuId, PricingUnit, ConsumedUnit, description). Each is
# priced per PricingUnit by one of the tier's six prices; KV retention has two prices
# (reserved, retained), hence two SkuPriceIds of one SkuId.
SKUS = (
    ("input-tokens", "1K Tokens", "Tokens", "input tokens (not served from the prefix cache)"),
    ("cached-input-tokens", "1K Tokens", "Tokens", "input tokens served from the prefix cache"),
    ("output-tokens", "1K Tokens", "Tokens", "output tokens"),
    ("kv-block-hours", "Hours", "Block-Hours", "KV-cache block-hours held"),
    ("kv-retention", "Hours", "Block-Hours", "KV retention between turns, reserved"),
    ("kv-retention", "Hours", "Block-Hours", "KV retention between turns, retained"),
)
SKU_METERS = (
    "Input Tokens",
    "Cached Input Tokens",
    "Output Tokens",
    "KV Cache Block-Hours",
    "KV Retention Block-Hours",
    "KV Retention Block-Hours",
)
PRICE_STATES = ("", "", "", "", "reserved", "retained")  # tells the retention prices apart
ALWAYS = 4  # the request SKUs' rows are always written; retention rows where it is not 0
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


MICROS_PER_HOUR = Decimal(3_600_000_000)
# Wide enough that no product or sum of the bounded quantities and prices rounds: 2^63
# tokens (19 digits) times a price of 7 + 24 digits, summed.
EXACT = Context(prec=80)


@functools.lru_cache(maxsize=256)
def per_block_us(block_hour: Decimal) -> Decimal:
    """The block-hour price per block-microsecond, rounded once (half even, 30 places):
    the only rounding in a KV bill. Its error is below 5e-31 a microsecond, 1.8e-21 a
    block-hour."""
    with localcontext(EXACT):
        return (block_hour / MICROS_PER_HOUR).quantize(Decimal("1e-30"), ROUND_HALF_EVEN)


def unit_prices(usage: Rollup, tiers: TierTable) -> tuple[Decimal, ...]:
    """The six prices of `SKUS` for `usage` (zero for unclassified traffic: no price)."""
    p = prices_of(usage, tiers)
    if p is None:
        return (ZERO,) * len(SKUS)
    assert p.reserved_block_hour is not None
    return (
        p.input_per_1k,
        p.cached_input_per_1k,
        p.output_per_1k,
        p.block_hour,
        p.reserved_block_hour,
        p.retained_block_hour,
    )


class Charges:
    """The usage of one (tenant, model, charge period, tier, unit prices): four FOCUS rows,
    six with KV retention.

    Invariant: only integers are summed (tokens, KV block microseconds); every decimal is
    derived from the sums, once. So the rows, and the cost, are the same however the
    records were bucketed on the way (one by one, hourly rollups, daily sums). O(1) a
    rollup."""

    __slots__ = (
        "block_us",
        "cached",
        "input",
        "lease_covered",
        "lease_reused",
        "output",
        "preemptions",
        "prices",
        "recomputed",
        "requests",
        "reserved_us",
        "retained_us",
    )

    def __init__(self, prices: tuple[Decimal, ...]) -> None:
        self.prices = prices
        self.input = self.cached = self.output = self.recomputed = 0
        self.lease_covered = self.lease_reused = 0
        self.preemptions = self.requests = self.block_us = 0
        self.reserved_us = self.retained_us = 0

    def add(self, r: Rollup) -> Charges:
        self.input += r.input_tokens
        self.cached += r.cached_input_tokens
        self.output += r.output_tokens
        self.recomputed += r.recomputed_tokens
        self.lease_covered += r.lease_covered_tokens
        self.lease_reused += r.lease_reused_tokens
        self.block_us += r.kv_block_us
        self.reserved_us += r.kv_reserved_us
        self.retained_us += r.kv_retained_us
        self.preemptions += r.preemptions
        self.requests += r.requests
        return self

    def units(self) -> tuple[int, ...]:
        """Per SKU, what it counts, whole: tokens, or block-microseconds for the KV SKUs."""
        return (
            self.input - self.cached,
            self.cached,
            self.output,
            self.block_us,
            self.reserved_us,
            self.retained_us,
        )

    @property
    def block_hours(self) -> Decimal:
        return Decimal(self.block_us) / MICROS_PER_HOUR

    def quantities(self) -> tuple[tuple[Decimal, Decimal], ...]:
        """Per SKU: (consumed quantity, pricing quantity)."""
        uncached = Decimal(self.input - self.cached)
        cached, output, hours = Decimal(self.cached), Decimal(self.output), self.block_hours
        return (
            (uncached, uncached / THOUSAND),
            (cached, cached / THOUSAND),
            (output, output / THOUSAND),
            (hours, hours),
            *((h, h) for h in (Decimal(us) / MICROS_PER_HOUR for us in self._retention_us)),
        )

    @property
    def _retention_us(self) -> tuple[int, int]:
        return (self.reserved_us, self.retained_us)

    def costs(self) -> tuple[Decimal, ...]:
        """Per SKU, its BilledCost, exact and additive: a sum of tokens times a price per
        1k, and whole block-microseconds times the block-hour price per microsecond
        (rounded once, to 30 places, `per_block_us`). So the cost of summed usage is the
        sum of the costs, to the last digit, at every granularity."""
        uncached, cached, output, block_price, reserved, retained = self.prices
        with localcontext(EXACT):
            return (
                Decimal(self.input - self.cached) * uncached / THOUSAND,
                Decimal(self.cached) * cached / THOUSAND,
                Decimal(self.output) * output / THOUSAND,
                Decimal(self.block_us) * per_block_us(block_price),
                Decimal(self.reserved_us) * per_block_us(reserved),
                Decimal(self.retained_us) * per_block_us(retained),
            )

    @property
    def cost(self) -> Decimal:
        """The sum of the rows' BilledCost, exactly."""
        with localcontext(EXACT):
            return sum(self.costs(), ZERO)


@dataclass(frozen=True)
class ChargeGroup:
    tenant_id: str
    model: str
    start: float  # the charge period, clipped to the export's window
    end: float
    tier: str
    charges: Charges


def charge_groups(
    usage: Iterable[Rollup],
    granularity: str,
    tiers: TierTable,
    window: tuple[float, float] | None = None,
) -> Iterator[ChargeGroup]:
    """Usage summed per (tenant, model, charge period, tier, unit prices): what the FOCUS
    export bills, and what the usage page and budgets add up. Charge periods are clipped
    to `window`, so two partial exports of one month neither overlap nor share a row key.

    `usage` must come sorted by (tenant, model, time), as `UsageLedger.rollups` gives
    it; groups come in (tenant, model, period, tier, prices) order. Memory: the groups of
    one (tenant, model, period) at a time."""
    key, groups = None, {}
    for rollup in usage:
        this = (rollup.tenant_id, rollup.model, period(rollup.at, granularity))
        if this != key:
            yield from _emit(key, groups, window)
            key, groups = this, {}
        basis = (rollup.tier or "unclassified", unit_prices(rollup, tiers))
        group = groups.get(basis)
        if group is None:
            group = groups[basis] = Charges(basis[1])
        group.add(rollup)
    yield from _emit(key, groups, window)


def _emit(key, groups: dict, window) -> Iterator[ChargeGroup]:
    if key is None:
        return
    tenant, model, (start, end) = key
    if window is not None:
        start, end = max(start, window[0]), min(end, window[1])
    for (tier, _), charges in sorted(groups.items()):
        yield ChargeGroup(tenant, model, start, end, tier, charges)


def cost(usage: Rollup, tiers: TierTable) -> Decimal:
    """What `usage` alone is billed."""
    return Charges(unit_prices(usage, tiers)).add(usage).cost


def record_cost(record: UsageRecord, tiers: TierTable) -> Decimal:
    return cost(rollup_of(record), tiers)


def focus_rows(
    usage: Iterable[Rollup],
    granularity: str,
    tiers: TierTable,
    window: tuple[float, float] | None = None,
) -> Iterator[dict[str, str]]:
    """FOCUS charge rows as dicts: per `charge_groups` group and per SKU (input, cached
    input, output tokens, KV block-hours, KV retention where there was some), at each
    unit price in force when the records were written."""
    context = _Context(granularity, tiers, inert=False)
    for group in charge_groups(usage, granularity, tiers, window):
        for cells in context.cells(group):
            yield dict(zip(FOCUS_COLUMNS, cells, strict=True))


def focus_csv(
    usage: Iterable[Rollup],
    granularity: str,
    tiers: TierTable,
    window: tuple[float, float] | None = None,
) -> Iterator[str]:
    """`focus_rows` as CSV chunks, byte for byte what `csv_chunks` makes of them, without
    a dict or a csv call per row: the export's hot path (about 20 us a row)."""
    context = _Context(granularity, tiers, inert=True)
    lines = (
        ",".join(cells) + "\n"
        for group in charge_groups(usage, granularity, tiers, window)
        for cells in context.cells(group)
    )
    yield ",".join(FOCUS_COLUMNS) + "\n"
    while chunk := "".join(itertools.islice(lines, 500)):
        yield chunk


_COLUMN = {name: i for i, name in enumerate(FOCUS_COLUMNS)}


class _Context:
    """What every row of one export shares, built once; a group's cells are built once
    too, and each SKU's row is a copy with its own dozen cells set. With `inert` (for
    CSV), every text cell is made inert for spreadsheets and quoted as the csv module
    would, once a group; numbers and timestamps need neither."""

    def __init__(self, granularity: str, tiers: TierTable, inert: bool) -> None:
        self.granularity, self.currency = granularity, tiers.currency
        self.guard = _csv_cell if inert else str
        seller = Account.from_environment()
        self.provider = provider = seller.provider
        base = {
            **dict.fromkeys(NOT_APPLICABLE, ""),  # null: they do not apply
            "BillingAccountId": self.guard(seller.id),
            "BillingAccountName": self.guard(seller.name),
            "BillingAccountType": "Billing Account",
            "BillingCurrency": self.currency,
            "ChargeCategory": "Usage",
            "ChargeClass": "",  # null: not a correction
            "ChargeFrequency": "Usage-Based",
            "InvoiceIssuerName": self.guard(provider),
            "PricingCategory": "Standard",
            "ProviderName": self.guard(provider),
            "PublisherName": self.guard(provider),
            "ResourceType": "LLM model",
            "ServiceCategory": "AI and Machine Learning",
            "ServiceName": "kvlease LLM inference",
            "ServiceSubcategory": "Generative AI",
            "SubAccountType": "Tenant",
        }
        # None until a group's or a row's cells fill it: a column left unset breaks the
        # CSV join at once instead of writing an empty cell nobody chose.
        self.base = [base.get(c) for c in FOCUS_COLUMNS]

    def cells(self, group: ChargeGroup) -> Iterator[list[str]]:
        g, guard, model, tier = group.charges, self.guard, group.model, group.tier
        billing = period(group.start, "month")
        start, end = stamp(group.start), stamp(group.end)
        shared = list(self.base)
        for name, value in (
            ("BillingPeriodEnd", stamp(billing[1])),
            ("BillingPeriodStart", stamp(billing[0])),
            ("ChargePeriodEnd", end),
            ("ChargePeriodStart", start),
            ("ResourceId", guard(f"{self.provider}/models/{model}")),
            ("ResourceName", guard(model)),
            ("SubAccountId", guard(group.tenant_id)),
            ("SubAccountName", guard(group.tenant_id)),
            (
                "Tags",
                guard(json.dumps({"kvlease/tier": tier, "kvlease/model": model}, sort_keys=True)),
            ),
            ("x_Tier", guard(tier)),
            ("x_Model", guard(model)),
        ):
            shared[_COLUMN[name]] = value
        row_key = "\x1f".join((group.tenant_id, model, self.granularity, start, end))
        rows = zip(g.quantities(), g.costs(), strict=True)  # each computed once a group
        for i, ((consumed, pricing), cost) in enumerate(rows):
            if i >= ALWAYS and not consumed:
                continue
            yield self._row(shared, row_key, model, tier, g, i, consumed, pricing, cost)

    def _row(
        self, shared, row_key, model, tier, g: Charges, i, consumed, pricing, billed
    ) -> list[str]:
        sku, pricing_unit, consumed_unit, what = SKUS[i]
        price = g.prices[i]
        cost = money.focus_amount(billed)
        unit_price = money.plain(price)
        counted = consumed_unit == "Tokens"  # tokens are whole; hours are not
        primary = i == 0  # request-level figures ride on the input row; 0 elsewhere
        state = f":{PRICE_STATES[i]}" if PRICE_STATES[i] else ""
        sku_price = f"{sku}{state}:{tier}:{unit_price}:{self.currency}"
        row = list(shared)
        for name, value in (
            ("BilledCost", cost),
            ("ChargeDescription", self.guard(f"{what} on {model}, {tier} tier")),
            ("ConsumedQuantity", str(int(consumed)) if counted else money.focus_amount(consumed)),
            ("ConsumedUnit", consumed_unit),
            ("ContractedCost", cost),
            ("ContractedUnitPrice", unit_price),
            ("EffectiveCost", cost),
            ("ListCost", cost),
            ("ListUnitPrice", unit_price),
            ("PricingQuantity", money.focus_amount(pricing)),
            ("PricingUnit", pricing_unit),
            ("SkuId", f"kvlease-{sku}"),
            ("SkuMeter", SKU_METERS[i]),
            ("SkuPriceId", self.guard(sku_price)),
            ("x_RowKey", hashlib.sha256(f"{row_key}\x1f{sku_price}".encode()).hexdigest()[:32]),
            ("x_Requests", str(g.requests if primary else 0)),
            ("x_InputTokens", str(g.input if primary else 0)),
            ("x_CachedInputTokens", str(g.cached if primary else 0)),
            ("x_OutputTokens", str(g.output if primary else 0)),
            ("x_RecomputedTokens", str(g.recomputed if primary else 0)),
            ("x_LeaseCoveredTokens", str(g.lease_covered if primary else 0)),
            ("x_LeaseReusedTokens", str(g.lease_reused if primary else 0)),
            ("x_BlockHours", money.focus_amount(g.block_hours if primary else ZERO)),
            ("x_Preemptions", str(g.preemptions if primary else 0)),
        ):
            row[_COLUMN[name]] = value
        return row


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
    cells = operator.itemgetter(*columns)
    return _csv(([_inert(v) for v in cells(row)] for row in rows), columns)


def _csv(rows: Iterable[Sequence[str]], columns: tuple[str, ...]) -> Iterator[str]:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(columns)
    for i, row in enumerate(rows, 1):
        if "\r" in "".join(row):
            # csv.writer quotes only the characters of its line terminator ("\n"): a bare
            # carriage return would end the row in a spreadsheet and start a new one.
            buffer.write(",".join(map(_quoted, row)) + "\n")
        else:
            writer.writerow(row)
        if i % 500 == 0:
            yield buffer.getvalue()
            buffer.seek(0)
            buffer.truncate()
    yield buffer.getvalue()


def _inert(value: str) -> str:
    return f"'{value}" if value[:1] in FORMULA_STARTS else value


def _csv_cell(value: str) -> str:
    """`value` inert, then quoted."""
    return _quoted(_inert(value))


def _quoted(value: str) -> str:
    """`value` quoted as RFC 4180 needs: when it holds a comma, a quote or a line break."""
    if any(c in value for c in ',"\r\n'):
        return '"' + value.replace('"', '""') + '"'
    return value


def usage(
    ledger: UsageLedger, window: tuple[float, float], granularity: str, tenants=()
) -> Iterator[Rollup]:
    """The ledger's usage in `window`, in the buckets `granularity` needs (months are
    summed from days here: months are not whole multiples of anything in SQL)."""
    return ledger.rollups(*window, tenants, HOUR if granularity == "hour" else DAY)


def parse_time(value: str) -> float:
    """Epoch seconds of a UTC date or an ISO time (a time without a zone is UTC)."""
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"not a date or ISO time: {value!r} (try 2026-11-01)") from None
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def month_window(month: str) -> tuple[float, float]:
    """[first, next first) of a calendar month given as `YYYY-MM`, as epoch seconds."""
    try:
        first = datetime.strptime(month, "%Y-%m").replace(tzinfo=UTC)
    except ValueError:
        raise ValueError(f"a month is YYYY-MM, got {month!r} (try 2026-11)") from None
    return period(first.timestamp(), "month")


def parse_window(start: str | None, end: str | None) -> tuple[float, float]:
    """[start, end) as epoch seconds from UTC dates or ISO times; default: this month."""
    this_month = period(datetime.now(UTC).timestamp(), "month")
    lo = parse_time(start) if start else this_month[0]
    hi = parse_time(end) if end else this_month[1]
    if hi <= lo:
        raise ValueError("--to must be after --from")
    return lo, hi
