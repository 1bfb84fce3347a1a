"""The whole of several data-parallel ranks, from each rank's `EngineState`.

Under `--data-parallel-size N` every rank is an engine with its own pool and its own
scheduler; `/admin/state`, the history and the counters show their sum.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvlease.engine.events import EngineState, LeaseSummary, TenantHolding, Totals


def _sum_rows(rows: Iterable[tuple[Any, ...]], values: int = 1) -> list[tuple[Any, ...]]:
    """Rows (key..., value...) with equal keys summed: ranks' cumulative totals."""
    out: dict[tuple[Any, ...], list[Any]] = {}
    for row in rows:
        key, vals = row[:-values], row[-values:]
        acc = out.setdefault(key, [0] * values)
        for i, v in enumerate(vals):
            acc[i] += v
    return [(*k, *v) for k, v in out.items()]


def merge_states(states: list[EngineState]) -> EngineState:
    """The whole of several data-parallel ranks: blocks, requests, leases and every
    cumulative total summed; the snapshot time is the oldest rank's. One rank is itself."""
    if len(states) == 1:
        return states[0]
    tenants: dict[str, TenantHolding] = {}
    summary: dict[str, LeaseSummary] = {}
    waiting: dict[str, int] = {}
    for s in states:
        for tenant, h in s.tenants.items():
            t = tenants.setdefault(tenant, TenantHolding())
            t.running, t.cached_leased, t.cached = (
                t.running + h.running,
                t.cached_leased + h.cached_leased,
                t.cached + h.cached,
            )
        for tenant, lease in s.lease_summary.items():
            m = summary.setdefault(tenant, LeaseSummary())
            m.active += lease.active
            m.seconds_left_max = max(m.seconds_left_max, lease.seconds_left_max)
        for tier, n in s.waiting_by_tier.items():
            waiting[tier] = waiting.get(tier, 0) + n
    totals = [s.totals for s in states]
    return EngineState(
        at=min(s.at for s in states),
        pool_blocks=sum(s.pool_blocks for s in states),
        free_blocks=sum(s.free_blocks for s in states),
        tenants=tenants,
        tenant_tiers={k: v for s in states for k, v in s.tenant_tiers.items()},
        leases=[lease for s in states for lease in s.leases],
        leases_total=sum(s.leases_total for s in states),
        lease_summary=summary,
        running=sum(s.running for s in states),
        waiting=sum(s.waiting for s in states),
        waiting_by_tier=waiting,
        events_dropped=sum(s.events_dropped for s in states),
        totals=Totals(
            **{
                field: _sum_rows(
                    (row for t in totals for row in getattr(t, field)),
                    2 if field == "fair_share_tokens" else 1,
                )
                for field in Totals.__struct_fields__
            }
        ),
        fair_share=[row for s in states for row in s.fair_share],
        reserved_caps={
            tier: sum(s.reserved_caps.get(tier, 0) for s in states)
            for tier in {tier for s in states for tier in s.reserved_caps}
        },
    )
