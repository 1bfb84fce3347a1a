"""A replay's figures, per tier and per tenant, and what moves between two tables.

`summarize` turns a `kvlease.replay.simulate.Replay` into the JSON-ready figures that
`kvlease replay --json` writes (the README's "What-if replay" has the schema);
`movers` ranks the tenants whose TTFT p99 or cost moves most. Costs are billed
as `kvlease usage export` bills them (kvlease.exporters.pricing.cost) at the prices of
the table each side ran under.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from kvlease.engine.tenancy import TierTable
from kvlease.exporters.pricing import cost as billed
from kvlease.exporters.rollups import Rollup, block_us

if TYPE_CHECKING:  # the report reads a replay; it needs no engine to do so
    from kvlease.replay.simulate import Replay, Served

MOVERS = 10


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile: an observed value, never an interpolation."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def summarize(replay: Replay, tiers: TierTable) -> dict[str, Any]:
    """Figures for one side: the whole run, each tier, each tenant."""
    by_tier: dict[str, list[Served]] = defaultdict(list)
    by_tenant: dict[str, list[Served]] = defaultdict(list)
    for s in replay.served:
        by_tier[s.tier].append(s)
        by_tenant[s.tenant].append(s)
    ratios = _fair_share(replay.fair_share, by=1)
    tenant_ratios = _fair_share(replay.fair_share, by=0)
    tier_rows = {}
    for tier in tiers:  # the table's order: most important first
        if by_tier[tier]:
            row = _figures(by_tier[tier], tiers)
            row["fair_share_ratio"] = ratios.get(tier)
            tier_rows[tier] = row
    tenants = {
        tenant: {
            "tier": served[-1].tier,
            **_figures(served, tiers),
            "fair_share_ratio": tenant_ratios.get(tenant),
        }
        for tenant, served in sorted(by_tenant.items())
    }
    return {
        "requests": len(replay.served),
        "dropped_turns": replay.dropped,
        "engine_steps": replay.steps,
        "seconds": round(replay.seconds, 3),
        "currency": tiers.currency,
        "cost": round(sum(t["cost"] for t in tier_rows.values()), 6),
        "tiers": tier_rows,
        "tenants": tenants,
    }


def _figures(served: list[Served], tiers: TierTable) -> dict[str, Any]:
    steps = [s.ttft_steps for s in served]
    seconds = [s.ttft_s for s in served]
    leased = [s for s in served if s.leased]
    cacheable = sum(s.cacheable for s in leased)
    return {
        "requests": len(served),
        "ttft_p50_steps": percentile(steps, 50),
        "ttft_p99_steps": percentile(steps, 99),
        "ttft_p50_s": round(percentile(seconds, 50), 4),
        "ttft_p99_s": round(percentile(seconds, 99), 4),
        "preemptions": sum(s.preemptions for s in served),
        "recomputed_tokens": sum(s.recomputed_tokens for s in served),
        "leased_next_turns": len(leased),
        "leased_next_turn_hit": (
            round(sum(min(s.cached_tokens, s.cacheable) for s in leased) / cacheable, 4)
            if cacheable
            else None
        ),
        "kv_block_hours": round(sum(s.block_seconds for s in served) / 3600, 6),
        "kv_retention_hours": round(
            sum(s.reserved_seconds + s.retained_seconds for s in served) / 3600, 6
        ),
        "cost": float(round(_cost(served, tiers), 6)),
    }


def _cost(served: Iterable[Served], tiers: TierTable) -> Decimal:
    """What the requests are billed at their tiers' prices in `tiers`, summed per
    (tenant, tier) as a ledger rollup is."""
    sums: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0, 0, 0, 0, 0, 0.0, 0.0, 0.0])
    for s in served:
        row = sums[s.tenant, s.tier]
        row[0] += 1
        row[1] += s.prompt_tokens
        row[2] += s.cached_tokens
        row[3] += s.output_tokens
        row[4] += s.recomputed_tokens
        row[5] += s.preemptions
        row[6] += s.block_seconds
        row[7] += s.reserved_seconds
        row[8] += s.retained_seconds
    total = Decimal(0)
    for (tenant, tier), row in sums.items():
        n, inp, cached, out, recomputed, preempted, block_s, reserved_s, retained_s = row
        rollup = Rollup(
            tenant, "replay", 0, tier, None, n, inp, cached, out, recomputed, preempted, 0, 0,
            block_us(block_s), block_us(reserved_s), block_us(retained_s),
        )  # fmt: skip
        total += billed(rollup, tiers)
    return total


def _fair_share(books: dict[tuple[str, str], list[float]], by: int) -> dict[str, float]:
    """Per tenant (`by` 0) or tier (1): service received over service entitled while it
    waited (1.0: each backlogged tenant got its weighted share; kvlease.engine.fairness). The
    books are the engine's, keyed by (tenant label, tier)."""
    served: dict[str, float] = defaultdict(float)
    entitled: dict[str, float] = defaultdict(float)
    for key, (s, e) in books.items():
        served[key[by]] += s
        entitled[key[by]] += e
    return {k: round(served[k] / e, 4) for k, e in entitled.items() if e > 0}


def movers(current: dict[str, Any], proposed: dict[str, Any], n: int = MOVERS) -> dict:
    """The tenants whose TTFT p99 (seconds) and whose cost move most, largest first."""
    rows = []
    for tenant, new in proposed["tenants"].items():
        old = current["tenants"].get(tenant)
        if old is None:
            continue
        rows.append(
            {
                "tenant": tenant,
                "tier": [old["tier"], new["tier"]],
                "ttft_p99_s": [old["ttft_p99_s"], new["ttft_p99_s"]],
                "cost": [old["cost"], new["cost"]],
            }
        )

    def moved(key: str):
        return lambda r: abs(r[key][1] - r[key][0])

    return {
        "ttft_p99_s": sorted(rows, key=moved("ttft_p99_s"), reverse=True)[:n],
        "cost": sorted(rows, key=moved("cost"), reverse=True)[:n],
    }
