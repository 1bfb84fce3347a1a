"""Billing export: ledger records -> FinOps FOCUS v1.2 rows (or raw rows), streamed.

One FOCUS row per (tenant, model, charge period). Costs are exact decimals:
    (input - cached input)/1000 x input price + cached input/1000 x cached price
    + output/1000 x output price + KV block-hours x block-hour price
    + reserved block-hours x reserved price + retained block-hours x retained price,
priced (`kvlease.exporters.pricing`: one `Sku` record per thing sold) by the tier each
record was served in (the last two are the "KV retention" SKU: a leased session's blocks
between its turns, from the ledger's retention records; its rows appear only where
there was retention), and summed from the ledger's rollups
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

import csv
import hashlib
import io
import itertools
import json
import operator
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from decimal import Decimal
from typing import Any

from kvlease.engine.tenancy import TierTable
from kvlease.exporters import money
from kvlease.exporters.ledger import UsageLedger, UsageRecord
from kvlease.exporters.periods import period, stamp
from kvlease.exporters.pricing import SKUS, ZERO, Charges, Sku, unit_prices
from kvlease.exporters.rollups import DAY, HOUR, Rollup

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
# The FOCUS 1.2 columns that apply to an inference provider (NOT_APPLICABLE: the rest).
_APPLICABLE = (
    "BilledCost",
    "BillingAccountId",
    "BillingAccountName",
    "BillingAccountType",
    "BillingCurrency",
    "BillingPeriodEnd",
    "BillingPeriodStart",
    "ChargeCategory",
    "ChargeClass",
    "ChargeDescription",
    "ChargeFrequency",
    "ChargePeriodEnd",
    "ChargePeriodStart",
    "ConsumedQuantity",
    "ConsumedUnit",
    "ContractedCost",
    "ContractedUnitPrice",
    "EffectiveCost",
    "InvoiceIssuerName",
    "ListCost",
    "ListUnitPrice",
    "PricingCategory",
    "PricingQuantity",
    "PricingUnit",
    "ProviderName",
    "PublisherName",
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
_FOCUS_1_2 = tuple(sorted((*_APPLICABLE, *NOT_APPLICABLE)))
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


@dataclass(frozen=True)
class ChargeGroup:
    tenant_id: str
    model: str
    start: float  # the charge period, clipped to the export's window
    end: float
    tier: str
    charges: Charges


Charged = tuple[str, str, tuple[float, float]]  # tenant, model, charge period [start, end)
Basis = tuple[str, tuple[Decimal, ...]]  # tier, unit prices of SKUS


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
    key: Charged | None = None
    groups: dict[Basis, Charges] = {}
    for rollup in usage:
        this = (rollup.tenant_id, rollup.model, period(rollup.at, granularity))
        if this != key:
            yield from _emit(key, groups, window)
            key, groups = this, {}
        basis: Basis = (rollup.tier or "unclassified", unit_prices(rollup, tiers))
        group = groups.get(basis)
        if group is None:
            group = groups[basis] = Charges(basis[1])
        group.add(rollup)
    yield from _emit(key, groups, window)


def _emit(
    key: Charged | None, groups: dict[Basis, Charges], window: tuple[float, float] | None
) -> Iterator[ChargeGroup]:
    if key is None:
        return
    tenant, model, (start, end) = key
    if window is not None:
        start, end = max(start, window[0]), min(end, window[1])
    for (tier, _), charges in sorted(groups.items()):
        yield ChargeGroup(tenant, model, start, end, tier, charges)


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
        rows = zip(SKUS, g.prices, g.quantities(), g.costs(), strict=True)  # once a group
        for i, (sku, price, (consumed, pricing), cost) in enumerate(rows):
            if not sku.always and not consumed:
                continue
            yield self._row(shared, row_key, model, tier, g, i == 0, sku, price, consumed,
                            pricing, cost)  # fmt: skip

    def _row(
        self, shared: list[str | None], row_key: str, model: str, tier: str, g: Charges,
        primary: bool, sku: Sku, price: Decimal, consumed: Decimal, pricing: Decimal,
        billed: Decimal,
    ) -> list[str]:  # fmt: skip
        """One SKU's row; request-level figures ride on the group's first (`primary`)."""
        cost = money.focus_amount(billed)
        unit_price = money.plain(price)
        state = f":{sku.state}" if sku.state else ""
        sku_price = f"{sku.id}{state}:{tier}:{unit_price}:{self.currency}"
        row: list[Any] = list(shared)  # every None filled below (or the CSV join fails)
        for name, value in (
            ("BilledCost", cost),
            ("ChargeDescription", self.guard(f"{sku.description} on {model}, {tier} tier")),
            (
                "ConsumedQuantity",
                str(int(consumed)) if sku.tokens else money.focus_amount(consumed),
            ),
            ("ConsumedUnit", sku.consumed_unit),
            ("ContractedCost", cost),
            ("ContractedUnitPrice", unit_price),
            ("EffectiveCost", cost),
            ("ListCost", cost),
            ("ListUnitPrice", unit_price),
            ("PricingQuantity", money.focus_amount(pricing)),
            ("PricingUnit", sku.pricing_unit),
            ("SkuId", f"kvlease-{sku.id}"),
            ("SkuMeter", sku.meter),
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


def _values(r: UsageRecord) -> list[Any]:
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
    ledger: UsageLedger,
    window: tuple[float, float],
    granularity: str,
    tenants: Sequence[str] = (),
) -> Iterator[Rollup]:
    """The ledger's usage in `window`, in the buckets `granularity` needs (months are
    summed from days here: months are not whole multiples of anything in SQL)."""
    return ledger.rollups(*window, tenants, HOUR if granularity == "hour" else DAY)
