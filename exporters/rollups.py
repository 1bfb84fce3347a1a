"""Usage rollups: the ledger's sums per (tenant, tier, model, hour, price basis).

Exports at hour, day or month granularity, the usage page and budgets read these
instead of every record: a month of a busy service is millions of records but at
most (tenants x models x tiers x 720 hours) rollups, and one `GROUP BY` over them
answers a month in about a second.

Invariant: for every hour the raw records still cover (those after the prune horizon),
each rollup equals the sums over its records, exactly. It holds because the ledger
adds a batch's new records to the rollups in the same transaction that inserts them
(`INSERT_ROLLUPS`, over only the records that were new), and `kvlease usage
rebuild-rollups` recomputes them with the very same statement over the records.
Integer sums only: a record's KV block-seconds count as whole microseconds
(`block_us`), so sums are exact in SQL and equal the per-record billing to the digit.

The hour and block-microsecond expressions exist three times (Python, SQLite,
PostgreSQL); each is one floating-point operation that IEEE 754 rounds the same way
everywhere, and the tests compare them on the same records.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

HOUR = 3600
DAY = 86400


def hour_of(ended_at: float) -> int:
    """The start of the UTC hour a record ended in (records are billed where they end)."""
    return math.floor(ended_at / HOUR) * HOUR


def block_us(kv_block_seconds: float) -> int:
    """KV block-seconds as whole microseconds, half up: what is billed and summed."""
    return math.floor(kv_block_seconds * 1e6 + 0.5)


@dataclass(frozen=True)
class Rollup:
    """Sums of the records of one (tenant, model, bucket, tier, price basis). `at` is the
    bucket's start (epoch seconds); a bucket is an hour as stored, or a day or more as
    read. `tier` and `price_basis` are None where the records had none."""

    tenant_id: str
    model: str
    at: int
    tier: str | None
    price_basis: str | None
    requests: int
    input_tokens: int
    cached_input_tokens: int
    output_tokens: int
    recomputed_tokens: int
    preemptions: int
    lease_covered_tokens: int
    lease_reused_tokens: int
    kv_block_us: int
    kv_reserved_us: int = 0  # KV retention between turns (retention records), reserved
    kv_retained_us: int = 0  # ... and retained

    @property
    def what(self) -> str:
        """How an error names these records."""
        at = datetime.fromtimestamp(self.at, UTC).strftime("%Y-%m-%dT%H:%MZ")
        return f"the records of tenant {self.tenant_id!r} from {at}"


SUMS_V5 = (  # the sums schema version 5 created (its migration must stay as it ran)
    "requests",
    "input_tokens",
    "cached_input_tokens",
    "output_tokens",
    "recomputed_tokens",
    "preemptions",
    "lease_covered_tokens",
    "lease_reused_tokens",
    "kv_block_us",
)
SUMS = (*SUMS_V5, "kv_reserved_us", "kv_retained_us")  # version 7 added KV retention
KEY = ("hour", "tenant_id", "tier", "model", "price_basis")


def create(dialect: str, sums: tuple[str, ...] = SUMS) -> tuple[str, ...]:
    """The rollups' tables. The key starts with the hour, so a window is one range of the
    key; on SQLite the table is clustered by it (WITHOUT ROWID): a month's rollups are
    read in one sequential pass, half the time of an index plus row lookups. Queries
    for given tenants (statements, budgets) use the (tenant, hour) index."""
    clustered = " WITHOUT ROWID" if dialect == "sqlite" else ""
    return (
        "CREATE TABLE IF NOT EXISTS usage_rollups ("
        " hour BIGINT NOT NULL, tenant_id VARCHAR(128) NOT NULL, tier VARCHAR(32) NOT NULL,"
        " model VARCHAR(200) NOT NULL, price_basis TEXT NOT NULL, "
        + ", ".join(f"{name} BIGINT NOT NULL" for name in sums)
        + f", PRIMARY KEY ({', '.join(KEY)})){clustered}",
        "CREATE INDEX IF NOT EXISTS usage_rollups_tenant ON usage_rollups (tenant_id, hour)",
        # The prune horizon: records ended before it are gone, their rollups kept.
        "CREATE TABLE IF NOT EXISTS usage_retention (pruned_before BIGINT NOT NULL)",
    )


# Per dialect: (hour of ended_at, block microseconds of a column, the smaller of two
# integers).
_EXPRESSIONS = {
    "sqlite": (
        "CAST(ended_at / 3600 AS INTEGER) * 3600",  # a cast truncates: floor, as times are > 0
        "CAST({} * 1000000 + 0.5 AS INTEGER)",
        "min",
    ),
    "postgresql": (
        "CAST(floor(ended_at / 3600) AS BIGINT) * 3600",
        "CAST(floor({} * 1000000 + 0.5) AS BIGINT)",
        "least",
    ),
}


def insert_rollups(
    dialect: str, source: str, where: str = "true", sums: tuple[str, ...] = SUMS
) -> str:
    """Add the sums of `source`'s records (a table or subquery) to the rollups. The one
    statement that both maintains rollups on write and rebuilds them. A retention record
    is not a request: it adds to the retention sums only."""
    hour, micros, smaller = _EXPRESSIONS[dialect]
    expression = {
        "requests": "sum(CASE WHEN outcome = 'retention' THEN 0 ELSE 1 END)",
        "input_tokens": "sum(input_tokens)",
        "cached_input_tokens": "sum(cached_input_tokens)",
        "output_tokens": "sum(output_tokens)",
        "recomputed_tokens": "sum(recomputed_tokens)",
        "preemptions": "sum(preemptions)",
        "lease_covered_tokens": "sum(lease_covered_tokens)",
        "lease_reused_tokens": f"sum({smaller}(lease_covered_tokens, cached_input_tokens))",
        "kv_block_us": f"sum({micros.format('kv_block_seconds')})",
        "kv_reserved_us": f"sum({micros.format('kv_reserved_block_seconds')})",
        "kv_retained_us": f"sum({micros.format('kv_retained_block_seconds')})",
    }
    return (
        f"INSERT INTO usage_rollups ({', '.join(KEY + sums)}) "
        f"SELECT {hour} AS bucket, tenant_id, coalesce(tier, ''), model, "
        f"coalesce(price_basis, ''), {', '.join(expression[name] for name in sums)} "
        f"FROM {source} AS r WHERE {where} "
        "GROUP BY bucket, tenant_id, coalesce(tier, ''), model, coalesce(price_basis, '') "
        "ORDER BY 1, 2, 3, 4, 5 "  # one lock order for concurrent writers (PostgreSQL)
        f"ON CONFLICT ({', '.join(KEY)}) DO UPDATE SET "
        + ", ".join(f"{name} = usage_rollups.{name} + excluded.{name}" for name in sums)
    )


def select_rollups(bucket_seconds: int, tenants: int) -> str:
    """Rollups of [:start, :end) summed into buckets of `bucket_seconds` (3600 or 86400:
    UTC days are whole multiples of hours), sorted by (tenant, model, bucket), for
    `tenants` bound parameters :t0.. (0: every tenant)."""
    bucket = "hour" if bucket_seconds == HOUR else f"hour - (hour % {bucket_seconds})"
    only = f" AND tenant_id IN ({', '.join(f':t{i}' for i in range(tenants))})" if tenants else ""
    return (
        f"SELECT tenant_id, model, {bucket} AS bucket, tier, price_basis, "
        + ", ".join(f"sum({name})" for name in SUMS)
        + f" FROM usage_rollups WHERE hour >= :start AND hour < :end{only}"
        " GROUP BY tenant_id, model, bucket, tier, price_basis"
        " ORDER BY tenant_id, model, bucket, tier, price_basis"
    )


def from_row(row: Sequence[Any]) -> Rollup:
    tenant, model, at, tier, basis, *sums = row
    return Rollup(tenant, model, int(at), tier or None, basis or None, *map(int, sums))
