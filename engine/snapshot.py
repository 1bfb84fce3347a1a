"""The scheduler's read side: what it tells the API process, built from its state.

`sample` walks the blocks requests and sessions hold (occupancy by tenant and state,
block-seconds, the books' check); `engine_state` is the snapshot `/admin/state`, the
metrics and the dashboard read. Both read a `KvleaseState` and whatever of vLLM's the
adapter hands them (block lists, queue sizes), so nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from kvlease.engine.accounting import Snapshot
from kvlease.engine.events import (
    EngineState,
    Lease,
    LeaseSummary,
    TenantHolding,
    Totals,
)
from kvlease.engine.labels import UNCLASSIFIED
from kvlease.engine.scheduler_state import KvleaseState

MAX_LEASES_LISTED = 1000  # /admin/state lists at most this many; lease_summary covers all


def sample(
    kv: KvleaseState,
    get_blocks: Callable[[str], Iterable[Iterable[Any]]],
    deferred: Iterable[tuple[Any, Any]],
) -> Snapshot:
    """Occupancy by tenant and state now; integrates block-seconds; checks the books.

    `get_blocks(request_id)`: the request's blocks, per KV cache group (vLLM's
    coordinator); `deferred`: vLLM's deferred frees, (fence, blocks) entries. O(blocks
    held), the one per-block walk, off the step path (every `sample_seconds`)."""
    now = kv.clock()
    kv.last_sample = now
    kv.sample_unsent = True
    tenants: dict[str, TenantHolding] = {}
    seen: set[int] = set()
    request_blocks: dict[str, int] = {}
    # O(blocks held), the one per-block loop off the step path: kept tight, no lists.
    for request_id, t in kv.tenancy.items():
        held_by_request = first_seen = 0
        for group in get_blocks(request_id):
            for block in group:
                if block.is_null:
                    continue
                held_by_request += 1
                if block.block_id not in seen:  # a shared prefix block counts once
                    seen.add(block.block_id)
                    first_seen += 1
        if held_by_request:
            request_blocks[request_id] = held_by_request
            held = tenants.setdefault(kv.label(t.tenant_id), TenantHolding())
            held.running += first_seen
    # Blocks vLLM has not returned yet (a connector still reads them, or a step in
    # flight may still write them) are held: by their session's tenant.
    pending = [(h, get_blocks(r)) for r, h in kv.delayed.items()]
    pending += [(kv.deferred_owner.get(id(b)), (b,)) for _, b in deferred]
    for holder, groups in pending:
        first_seen = 0
        for group in groups:
            for block in group:
                if not block.is_null and block.block_id not in seen:
                    seen.add(block.block_id)
                    first_seen += 1
        if first_seen:
            tenant = holder.tenant_id if holder is not None else None
            tenants.setdefault(kv.label(tenant), TenantHolding()).running += first_seen
    kv.retention.integrate_all(now, kv.label)
    for holder in kv.holders.values():
        if holder.cached or holder.leased:
            held = tenants.setdefault(kv.label(holder.tenant_id), TenantHolding())
            held.cached += holder.cached
            held.cached_leased += holder.leased
    return kv.accounting.sample(
        now,
        pool_blocks=kv.pool.num_gpu_blocks - 1,
        free_blocks=kv.pool.get_num_free_blocks(),
        referenced_blocks=len(seen),
        tenants=tenants,
        request_blocks=request_blocks,
        check=kv.settings.debug_accounting,
    )


def engine_state(
    kv: KvleaseState, snap: Snapshot, running: int, waiting: int, waiting_by_bucket: list[int]
) -> EngineState:
    """The pool, leases, queues and cumulative totals, for the API process.

    `expires_at` is on the machine's monotonic clock, which every process
    shares, so a reader can count seconds left itself; `seconds_left` is
    as of `at` (None while a request of the session is in flight).
    """
    now = kv.clock()
    leases, summary = lease_listing(kv, now)
    fair = kv.settle_fair_share()  # before the totals: it adds to them
    acc = kv.accounting
    return EngineState(
        at=now,
        pool_blocks=snap.pool_blocks,
        free_blocks=snap.free_blocks,
        tenants=snap.tenants,
        tenant_tiers=dict(kv.tenant_tiers),
        leases=leases,
        leases_total=len(kv.leases.sessions()),
        lease_summary=summary,
        running=running,
        waiting=waiting,
        waiting_by_tier=dict(
            zip(
                [*kv.settings.tiers, UNCLASSIFIED],
                waiting_by_bucket,
                strict=True,
            )
        ),
        events_dropped=kv.events.dropped,
        totals=Totals(
            preemptions=[(*k, n) for k, n in acc.preemptions.items()],
            preempted_blocks=[(*k, n) for k, n in acc.preempted_blocks.items()],
            recomputed_tokens=list(acc.recomputed_tokens.items()),
            evicted_blocks=[(*k, n) for k, n in acc.evicted_blocks.items()],
            block_seconds=list(acc.block_seconds.items()),
            offloaded_blocks=list(acc.offloaded_blocks.items()),
            lease_reuse_tokens=[(*k, n) for k, n in acc.lease_reuse_tokens.items()],
            fair_share_tokens=[
                (tenant, tier, served, entitled)
                for (tenant, tier), (served, entitled) in acc.fair_share_tokens.items()
            ],
            retention_block_seconds=[(*k, v) for k, v in kv.retention.totals.items()],
        ),
        fair_share=fair,
        reserved_caps=dict(zip(kv.lease_index, kv.payback.caps, strict=True)),
    )


def lease_listing(kv: KvleaseState, now: float) -> tuple[list[Lease], dict[str, LeaseSummary]]:
    """The first MAX_LEASES_LISTED leases, and a summary per tenant label of all."""
    leases: list[Lease] = []
    summary: dict[str, LeaseSummary] = {}
    for session in kv.leases.sessions():
        tenant_id, session_id = session
        assert tenant_id is not None  # unclassified requests hold no lease
        holder = kv.holders.get(session)
        left = kv.leases.seconds_left(session)
        in_flight = left == float("inf")
        tenant = summary.setdefault(kv.label(tenant_id), LeaseSummary())
        tenant.active += 1
        full = kv.settings.tiers[holder.tier].lease_seconds if holder and holder.tier else 0.0
        tenant.seconds_left_max = max(tenant.seconds_left_max, full if in_flight else (left or 0.0))
        if len(leases) < MAX_LEASES_LISTED:
            leases.append(
                Lease(
                    tenant_id=tenant_id,
                    session_id=session_id,
                    tier=holder.tier if holder else None,
                    in_flight=in_flight,
                    expires_at=None if left is None or in_flight else now + left,
                    seconds_left=None if in_flight else left,
                    cached_leased_blocks=holder.leased if holder else 0,
                )
            )
    return leases, summary
