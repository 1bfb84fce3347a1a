"""Prices: what each SKU counts, what it costs, and the exact arithmetic of a bill.

`SKUS` is the one list of what kvlease sells. Each `Sku` says what it counts (a
`Charges` figure), in which unit it is consumed and priced, which of a tier's prices
prices it, how its FOCUS row names it, and how Prometheus measures it for the Grafana
cost estimate; the FOCUS export (`billing`), the statement, the usage page and the
Grafana cost query all read it from here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Context, Decimal, localcontext

from kvlease.engine.tenancy import Prices, TierTable
from kvlease.exporters import metrics as m
from kvlease.exporters.ledger import UsageRecord, rollup_of
from kvlease.exporters.rollups import Rollup

ZERO = Decimal(0)
THOUSAND = Decimal(1000)
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


@dataclass(frozen=True)
class Sku:
    """One thing kvlease sells, as a FOCUS SKU. Tokens are priced per 1K tokens; KV
    block-microseconds per block-hour. KV retention has two prices (reserved, retained),
    hence two `Sku`s of one SkuId told apart by `state`."""

    id: str  # SkuId, without the kvlease- prefix
    description: str
    meter: str  # SkuMeter
    counts: str  # the Charges figure it bills
    price: str  # the Prices field that prices it
    state: str = ""  # tells one SkuId's prices apart (SkuPriceId)
    always: bool = True  # a row in every group; else only where it counts something
    # Prometheus: the counter that measures it (family, label matcher), in tokens or
    # block-seconds, and the price of another SKU whose counter also counts it (so the
    # Grafana estimate prices it at the difference)
    series: tuple[str, str] = ("", "")
    also_priced_as: str | None = None

    @property
    def tokens(self) -> bool:
        return not self.counts.endswith("_us")  # else block-microseconds

    @property
    def pricing_unit(self) -> str:
        return "1K Tokens" if self.tokens else "Hours"

    @property
    def consumed_unit(self) -> str:
        return "Tokens" if self.tokens else "Block-Hours"

    def quantities(self, units: int) -> tuple[Decimal, Decimal]:
        """(consumed quantity, pricing quantity) of `units` tokens or block-microseconds."""
        if self.tokens:
            consumed = Decimal(units)
            return consumed, consumed / THOUSAND
        hours = Decimal(units) / MICROS_PER_HOUR
        return hours, hours

    def cost(self, units: int, price: Decimal) -> Decimal:
        """Exact, under the EXACT context."""
        if self.tokens:
            return Decimal(units) * price / THOUSAND
        return Decimal(units) * per_block_us(price)


SKUS = (
    Sku("input-tokens", "input tokens (not served from the prefix cache)", "Input Tokens",
        "uncached", "input_per_1k", series=(m.TOKENS.name, 'kind="input"')),
    Sku("cached-input-tokens", "input tokens served from the prefix cache",
        "Cached Input Tokens", "cached", "cached_input_per_1k",
        series=(m.TOKENS.name, 'kind="cached_input"'), also_priced_as="input_per_1k"),
    Sku("output-tokens", "output tokens", "Output Tokens", "output", "output_per_1k",
        series=(m.TOKENS.name, 'kind="output"')),
    Sku("kv-block-hours", "KV-cache block-hours held", "KV Cache Block-Hours", "block_us",
        "block_hour", series=(m.BLOCK_SECONDS.name, "")),
    *(
        Sku("kv-retention", f"KV retention between turns, {state}", "KV Retention Block-Hours",
            f"{state}_us", f"{state}_block_hour", state=state, always=False,
            series=(m.RETENTION_BLOCK_SECONDS.name, f'state="{state}"'),
            also_priced_as="block_hour")
        for state in m.RETENTION_STATES
    ),
)  # fmt: skip


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


def unit_prices(usage: Rollup, tiers: TierTable) -> tuple[Decimal, ...]:
    """The prices of `SKUS` for `usage` (zero for unclassified traffic: no price)."""
    p = prices_of(usage, tiers)
    if p is None:
        return (ZERO,) * len(SKUS)
    assert p.reserved_block_hour is not None  # Prices fills it from block_hour when unset
    return tuple(getattr(p, sku.price) for sku in SKUS)


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

    @property
    def uncached(self) -> int:
        return self.input - self.cached

    def units(self) -> tuple[int, ...]:
        """Per SKU, what it counts, whole: tokens, or block-microseconds for the KV SKUs."""
        return tuple(getattr(self, sku.counts) for sku in SKUS)

    @property
    def block_hours(self) -> Decimal:
        return Decimal(self.block_us) / MICROS_PER_HOUR

    def quantities(self) -> tuple[tuple[Decimal, Decimal], ...]:
        """Per SKU: (consumed quantity, pricing quantity)."""
        return tuple(sku.quantities(getattr(self, sku.counts)) for sku in SKUS)

    def costs(self) -> tuple[Decimal, ...]:
        """Per SKU, its BilledCost, exact and additive: a sum of tokens times a price per
        1k, and whole block-microseconds times the block-hour price per microsecond
        (rounded once, to 30 places, `per_block_us`). So the cost of summed usage is the
        sum of the costs, to the last digit, at every granularity."""
        with localcontext(EXACT):
            return tuple(
                sku.cost(getattr(self, sku.counts), price)
                for sku, price in zip(SKUS, self.prices, strict=True)
            )

    @property
    def cost(self) -> Decimal:
        """The sum of the rows' BilledCost, exactly."""
        with localcontext(EXACT):
            return sum(self.costs(), ZERO)


def cost(usage: Rollup, tiers: TierTable) -> Decimal:
    """What `usage` alone is billed."""
    return Charges(unit_prices(usage, tiers)).add(usage).cost


def record_cost(record: UsageRecord, tiers: TierTable) -> Decimal:
    return cost(rollup_of(record), tiers)
