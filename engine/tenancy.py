"""Tiers and tenants: what a tier promises, and who a request belongs to.

The tier table is the single source of priorities, lease lengths, leased-cache
caps and prices. The scheduler reads priorities and leases from it, the ledger
reads prices from it, and clients never supply any of these themselves: a
token names a tier, the table says what that tier means.
"""

from __future__ import annotations

import json
import math
import os
import re
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from decimal import ROUND_DOWN, Decimal, InvalidOperation
from importlib import resources
from pathlib import Path
from typing import Any

from kvlease.engine.policy import (
    lease_caps_error,
    leased_cap_blocks,
    tenant_cap_error,
    unreserved_blocks,
)
from kvlease.engine.reservations import ReservePolicy, reserve_mode

TIERS_ENV = "KVLEASE_TIERS"

_TOP_KEYS = frozenset({"currency", "tiers"})
_TIER_KEYS = frozenset({"priority", "lease_seconds", "leased_cache_cap", "prices"})
_OPTIONAL_TIER_KEYS = frozenset(
    {"max_concurrent_requests", "weight", "max_weight", "max_tenant_kv_share"}
    | {"reserve", "reserve_quantile", "reserve_max_seconds", "reserve_min_return"}
    | {"reserve_min_payback", "preempt_to_admit"}
)
_PRICE_KEYS = ("input_per_1k", "cached_input_per_1k", "output_per_1k", "block_hour")
# KV retention between turns (optional; a table or a price basis written before them has
# none): a reserved block costs what a held block does, a retained one nothing, unless set.
_RETENTION_KEYS = ("reserved_block_hour", "retained_block_hour")
_NAME_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
_CURRENCY_RE = re.compile(r"^[A-Z]{3}$")


class TierConfigError(ValueError):
    """The tier table cannot be used; the message names the file and the key."""


@dataclass(frozen=True)
class Prices:
    """Unit prices in the table's currency. Decimals, so bills never drift."""

    input_per_1k: Decimal
    cached_input_per_1k: Decimal
    output_per_1k: Decimal
    block_hour: Decimal
    reserved_block_hour: Decimal | None = None  # None: block_hour
    retained_block_hour: Decimal = Decimal(0)

    def __post_init__(self) -> None:
        if self.reserved_block_hour is None:
            object.__setattr__(self, "reserved_block_hour", self.block_hour)

    def basis(self, currency: str) -> str:
        """These prices as the ledger stores them with each record: a later change of
        the tier table never reprices history."""
        doc = {f.name: str(getattr(self, f.name)) for f in fields(self)}
        return json.dumps({"currency": currency, **doc}, sort_keys=True)

    @classmethod
    def from_basis(cls, basis: str) -> tuple[str, Prices]:
        """(currency, prices) from `basis()`'s text; ValueError if any price is not one
        `unit_price` accepts (an imported record's basis is input like any other)."""
        doc = json.loads(basis)
        if not isinstance(doc, dict) or not {"currency", *_PRICE_KEYS} <= set(doc) <= {
            "currency",
            *_PRICE_KEYS,
            *_RETENTION_KEYS,
        }:
            raise ValueError("a price basis names a currency and the four (or six) prices")
        currency = doc.pop("currency")
        if not isinstance(currency, str) or not currency.isalpha() or len(currency) != 3:
            raise ValueError(f"currency must be a three-letter code, got {currency!r}")
        return currency, cls(**{k: unit_price(v) for k, v in doc.items()})


# The largest unit price kvlease bills (per 1k tokens or per block-hour): far above any
# real price, small enough that no bill of 64-bit token counts overflows a decimal column.
MAX_UNIT_PRICE = Decimal(1_000_000)


def unit_price(raw: Any) -> Decimal:
    """A price as a Decimal: finite, >= 0, at most MAX_UNIT_PRICE, at most 12 decimal
    places; ValueError with the reason otherwise (NaN, sNaN, 1E+999999, -1000)."""
    if isinstance(raw, bool) or not isinstance(raw, str | int | float):
        raise ValueError(f"a price is a decimal string or number, got {raw!r}")
    try:
        price = Decimal(str(raw))
    except InvalidOperation:
        raise ValueError(f"not a decimal: {str(raw)[:40]!r}") from None
    if not price.is_finite() or not 0 <= price <= MAX_UNIT_PRICE:
        raise ValueError(f"a price must be a finite amount from 0 to {MAX_UNIT_PRICE}")
    if price != price.quantize(Decimal("1e-12"), rounding=ROUND_DOWN):
        raise ValueError("a price has at most 12 decimal places")
    return price


@dataclass(frozen=True)
class Tier:
    """One service tier. `priority` 0 is the most important (vLLM's convention)."""

    name: str
    priority: int
    lease_seconds: float
    leased_cache_cap: float
    prices: Prices
    max_concurrent_requests: int | None = None  # per tenant; None: unlimited
    weight: float = 1.0  # a tenant's fair-share weight within the tier (kvlease.engine.fairness)
    max_weight: float = 1.0  # the most a token's `weight` claim may ask for
    max_tenant_kv_share: float = 1.0  # fraction of the pool one tenant may hold (1: no cap)
    reservation: ReservePolicy = field(default_factory=ReservePolicy)  # kvlease.engine.reservations
    # May this tier's waiting request preempt running requests of lower tiers to be admitted
    # (stock vLLM never does)? Each preemption throws away the victim's computed tokens.
    preempt_to_admit: bool = True

    def tenant_weight(self, claimed: Any) -> float:
        """A request's weight: its token's claim, bounded by the table, else the default.
        A claim outside `valid_weight` (NaN, infinite, below MIN_WEIGHT) is ignored: its
        counter would become NaN or infinite and freeze fair share and the snapshot."""
        if claimed is None or not valid_weight(claimed):
            return self.weight
        return min(float(claimed), self.max_weight)


@dataclass(frozen=True)
class TenantContext:
    """The verified identity of a request: the only source of tenant fields.

    `extra_args()` is the wire contract with the scheduler: it becomes
    `SamplingParams.extra_args` (`vllm_xargs` on the HTTP API).
    """

    tenant_id: str
    tier: str
    roles: frozenset[str] = field(default_factory=frozenset)
    session_id: str | None = None

    weight: float | None = None  # the token's fair-share weight claim (the tier bounds it)

    def extra_args(self) -> dict[str, str | float]:
        args: dict[str, str | float] = {"tenant_id": self.tenant_id, "tier": self.tier}
        if self.session_id is not None:
            args["session_id"] = self.session_id
        if self.weight is not None:
            args["weight"] = self.weight
        return args


@dataclass(frozen=True)
class TierTable(Mapping[str, Tier]):
    """Tiers by name, in priority order (most important first).

    Invariant: names match `[a-z][a-z0-9_-]*`, priorities are distinct
    non-negative integers, every tier has all four prices.
    """

    currency: str
    tiers: Mapping[str, Tier]
    source: str

    def __getitem__(self, name: str) -> Tier:
        return self.tiers[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tiers)

    def __len__(self) -> int:
        return len(self.tiers)

    def leased_caps(self, pool_blocks: int) -> dict[str, int]:
        """Blocks each tier's leases may hold on a pool of `pool_blocks`, for the tiers
        that lease, least important first (the free queue's segment order)."""
        leasing = [t for t in reversed(list(self.tiers.values())) if t.lease_seconds > 0]
        return {t.name: leased_cap_blocks(t.leased_cache_cap, pool_blocks) for t in leasing}

    def tenant_kv_caps(self, pool_blocks: int) -> dict[str, int]:
        """Blocks one tenant may hold, for the tiers with a `max_tenant_kv_share` under 1."""
        return {
            t.name: int(t.max_tenant_kv_share * pool_blocks)
            for t in self.tiers.values()
            if t.max_tenant_kv_share < 1.0
        }

    def pool_error(self, pool_blocks: int, request_blocks: int) -> str | None:
        """Why this table cannot run on `pool_blocks` usable blocks with requests of up
        to `request_blocks`, or None: every tenant cap must hold one such request, and
        the lease caps must leave one unreserved. The one check, used by `kvlease serve`
        before the engine starts and by the scheduler when vLLM has sized the pool."""
        return self.tenant_caps_error(pool_blocks, request_blocks) or lease_caps_error(
            pool_blocks, self.leased_caps(pool_blocks), request_blocks
        )

    def tenant_caps_error(self, pool_blocks: int, request_blocks: int) -> str | None:
        """`pool_error`'s first half: a tier whose tenant cap cannot hold one request."""
        for tier, cap in self.tenant_kv_caps(pool_blocks).items():
            error = tenant_cap_error(tier, cap, pool_blocks, request_blocks)
            if error is not None:
                return error
        return None

    def max_request_tokens(self, pool_blocks: int, block_size: int) -> int:
        """The longest request (max_model_len) these caps allow on a pool of `pool_blocks`
        usable blocks: what no lease can ever hold."""
        return unreserved_blocks(pool_blocks, self.leased_caps(pool_blocks).values()) * block_size

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None) -> TierTable:
        """Load `path`, else `$KVLEASE_TIERS`, else the shipped default."""
        chosen = path or os.environ.get(TIERS_ENV)
        if chosen:
            file = Path(chosen)
            try:
                text = file.read_text(encoding="utf-8")
            except OSError as exc:
                raise TierConfigError(f"{file}: cannot read tier table: {exc.strerror}") from exc
            return cls.from_toml(text, source=str(file))
        return cls.shipped()

    @classmethod
    def shipped(cls) -> TierTable:
        """The default table shipped as engine/tiers.toml."""
        default = resources.files("kvlease.engine").joinpath("tiers.toml")
        return cls.from_toml(default.read_text(encoding="utf-8"), source="<shipped default>")

    @classmethod
    def from_toml(cls, text: str, source: str = "<string>") -> TierTable:
        try:
            doc = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise TierConfigError(f"{source}: not valid TOML: {exc}") from exc
        return cls.from_dict(doc, source)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], source: str = "<dict>") -> TierTable:
        def fail(msg: str) -> TierConfigError:
            return TierConfigError(f"{source}: {msg}")

        _reject_unknown(doc, _TOP_KEYS, "top level", fail)
        currency = doc.get("currency")
        if not isinstance(currency, str) or not _CURRENCY_RE.match(currency):
            raise fail("'currency' must be a three-letter ISO 4217 code such as \"USD\"")
        raw_tiers = doc.get("tiers")
        if not isinstance(raw_tiers, Mapping) or not raw_tiers:
            raise fail("'tiers' must be a table with at least one tier, e.g. [tiers.free]")

        parsed = [_parse_tier(name, body, fail) for name, body in raw_tiers.items()]
        by_priority: dict[int, str] = {}
        for tier in parsed:
            if tier.priority in by_priority:
                raise fail(
                    f"duplicate priority {tier.priority}: tiers '{by_priority[tier.priority]}' "
                    f"and '{tier.name}' (each tier needs its own priority)"
                )
            by_priority[tier.priority] = tier.name
        ordered = {t.name: t for t in sorted(parsed, key=lambda t: t.priority)}
        return cls(currency=currency, tiers=ordered, source=source)


def _reject_unknown(table: Mapping[str, Any], allowed: frozenset[str], where: str, fail) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise fail(f"unknown key '{unknown[0]}' in {where} (allowed: {', '.join(sorted(allowed))})")


# The smallest fair-share weight: a tenant's counter grows by tokens / weight, so a
# smaller weight (1e-320 is a valid float) overflows it to infinity.
MIN_WEIGHT = 0.001
MAX_WEIGHT = 1000.0


def valid_weight(value: Any) -> bool:
    """A finite number in [MIN_WEIGHT, MAX_WEIGHT] (not a bool)."""
    return (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and math.isfinite(value)
        and MIN_WEIGHT <= value <= MAX_WEIGHT
    )


def _number(value: Any, where: str, fail) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise fail(f"{where} must be a finite number, got {value!r}")
    return float(value)


def _parse_tier(name: str, body: Any, fail) -> Tier:
    where = f"tier '{name}'"
    if not _NAME_RE.match(name):
        raise fail(f"{where}: name must match [a-z][a-z0-9_-]* (at most 32 characters)")
    if not isinstance(body, Mapping):
        raise fail(f"{where} must be a table")
    _reject_unknown(body, _TIER_KEYS | _OPTIONAL_TIER_KEYS, where, fail)
    for key in sorted(_TIER_KEYS):
        if key not in body:
            raise fail(f"{where}: missing key '{key}'")

    priority = body["priority"]
    if isinstance(priority, bool) or not isinstance(priority, int) or priority < 0:
        raise fail(f"{where}: 'priority' must be a non-negative integer, got {priority!r}")
    lease = _number(body["lease_seconds"], f"{where}: 'lease_seconds'", fail)
    if lease < 0:
        raise fail(f"{where}: 'lease_seconds' must be >= 0, got {body['lease_seconds']!r}")
    cap = _number(body["leased_cache_cap"], f"{where}: 'leased_cache_cap'", fail)
    if not 0.0 <= cap <= 1.0:
        raise fail(f"{where}: 'leased_cache_cap' is a fraction of the pool, 0 to 1; got {cap!r}")
    limit = body.get("max_concurrent_requests")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise fail(f"{where}: 'max_concurrent_requests' must be an integer >= 1, got {limit!r}")
    weight = _number(body.get("weight", 1.0), f"{where}: 'weight'", fail)
    max_weight = _number(body.get("max_weight", weight), f"{where}: 'max_weight'", fail)
    if not (valid_weight(weight) and valid_weight(max_weight) and weight <= max_weight):
        raise fail(
            f"{where}: need {MIN_WEIGHT} <= 'weight' <= 'max_weight' <= {MAX_WEIGHT}, "
            f"got {weight!r} and {max_weight!r}"
        )
    share = _number(body.get("max_tenant_kv_share", 1.0), f"{where}: 'max_tenant_kv_share'", fail)
    if not 0.0 < share <= 1.0:
        raise fail(
            f"{where}: 'max_tenant_kv_share' is a fraction of the pool, above 0 and at "
            f"most 1; got {share!r}"
        )
    preempt = body.get("preempt_to_admit", True)
    if not isinstance(preempt, bool):
        raise fail(f"{where}: 'preempt_to_admit' must be true or false, got {preempt!r}")
    prices = _parse_prices(body["prices"], where, fail)
    reservation = _parse_reservation(body, where, fail)
    return Tier(
        name, priority, lease, cap, prices, limit, weight, max_weight, share, reservation, preempt
    )


def _parse_reservation(body: Mapping[str, Any], where: str, fail) -> ReservePolicy:
    default = ReservePolicy()
    try:
        mode = reserve_mode(body.get("reserve", default.mode))
    except ValueError as exc:
        raise fail(f"{where}: 'reserve' {exc}") from None
    quantile = _number(
        body.get("reserve_quantile", default.quantile), f"{where}: 'reserve_quantile'", fail
    )
    most = _number(
        body.get("reserve_max_seconds", default.max_seconds),
        f"{where}: 'reserve_max_seconds'",
        fail,
    )
    least = _number(
        body.get("reserve_min_return", default.min_return), f"{where}: 'reserve_min_return'", fail
    )
    payback = _number(
        body.get("reserve_min_payback", default.min_payback),
        f"{where}: 'reserve_min_payback'",
        fail,
    )
    if not (0.0 < quantile <= 1.0 and most >= 0.0 and 0.0 <= least <= 1.0 and payback >= 0.0):
        raise fail(
            f"{where}: need 0 < 'reserve_quantile' <= 1, 'reserve_max_seconds' >= 0, "
            f"0 <= 'reserve_min_return' <= 1 and 'reserve_min_payback' >= 0; got "
            f"{quantile!r}, {most!r}, {least!r}, {payback!r}"
        )
    return ReservePolicy(mode, quantile, most, least, payback)


def _parse_prices(body: Any, where: str, fail) -> Prices:
    if not isinstance(body, Mapping):
        raise fail(f"{where}: 'prices' must be a table")
    _reject_unknown(body, frozenset(_PRICE_KEYS + _RETENTION_KEYS), f"{where} prices", fail)
    values: dict[str, Decimal] = {}
    for key in _PRICE_KEYS + _RETENTION_KEYS:
        if key not in body:
            if key in _RETENTION_KEYS:
                continue
            raise fail(f"{where}: missing price '{key}'")
        try:
            values[key] = unit_price(body[key])
        except ValueError as exc:
            raise fail(f"{where}: price '{key}': {exc}") from None
    return Prices(**values)
