"""Per-tenant KV accounting: who holds which blocks, and block-seconds over time.

Occupancy is sampled (every step in debug mode, else every `sample_seconds`,
and before the first allocation after an idle spell) and integrated: between
samples a tenant is billed for the blocks it held at the later sample (right
Riemann sum; a change inside an interval is billed from the interval's start,
so the error is at most `sample_seconds` per change, never an idle spell).
"Held" means blocks its requests reference plus its leased cached blocks: the
ones kvlease keeps for it. Plain cached blocks are free to evict at any moment
and are not billed.

Cumulative counters (preemptions, evictions, recomputed tokens) are kept here,
exactly, whatever happens to the event buffer.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvlease.engine.events import TenantHolding

Tenant = str  # a tenant label (kvlease.engine.labels): bounded, unclassified requests included


class AccountingError(AssertionError):
    """The block books do not balance: a leak or double count in the pool."""


@dataclass
class Snapshot:
    at: float
    pool_blocks: int  # usable blocks (vLLM's null block excluded)
    free_blocks: int  # evictable: empty plus cached
    tenants: dict[Tenant, TenantHolding]


LEASE_OUTCOMES = ("reused", "lost")  # a leased next turn's prefix: served, or computed again


@dataclass
class TenantAccounting:
    """Cumulative per-tenant figures and the latest occupancy snapshot.

    Invariant (checked by `sample(check=True)`): distinct blocks referenced by
    requests + free blocks = usable pool.
    """

    block_seconds: defaultdict[Tenant, float] = field(default_factory=lambda: defaultdict(float))
    request_block_seconds: dict[str, float] = field(default_factory=dict)
    # (tenant, tier, reason, mode, by_tier): by_tier is the tier whose allocation caused it
    preemptions: Counter[tuple[Tenant, str | None, str, str, str]] = field(default_factory=Counter)
    preempted_blocks: Counter[tuple[Tenant, str | None, str]] = field(default_factory=Counter)
    recomputed_tokens: Counter[Tenant] = field(default_factory=Counter)
    evicted_blocks: Counter[tuple[Tenant, str | None, bool, str]] = field(default_factory=Counter)
    offloaded_blocks: Counter[Tenant] = field(default_factory=Counter)  # gauge: off-device now
    # (tier, "reused" or "lost", back inside its reservation window) -> prefix tokens a
    # lease covered at a session's next turn
    lease_reuse_tokens: Counter[tuple[str, str, bool]] = field(default_factory=Counter)
    # (tenant label, tier) -> [served, entitled] weighted tokens while backlogged
    fair_share_tokens: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    last: Snapshot | None = None

    def sample(
        self,
        now: float,
        pool_blocks: int,
        free_blocks: int,
        referenced_blocks: int,
        tenants: dict[Tenant, TenantHolding],
        request_blocks: Mapping[str, int],
        check: bool = False,
    ) -> Snapshot:
        if check and referenced_blocks + free_blocks != pool_blocks:
            raise AccountingError(
                f"KV books do not balance: {referenced_blocks} referenced + {free_blocks} free "
                f"!= {pool_blocks} in the pool"
            )
        dt = 0.0 if self.last is None else max(0.0, now - self.last.at)
        if dt:
            for tenant, held in tenants.items():
                if held.billable:
                    self.block_seconds[tenant] += dt * held.billable
            for request_id, blocks in request_blocks.items():
                self.request_block_seconds[request_id] = (
                    self.request_block_seconds.get(request_id, 0.0) + dt * blocks
                )
        self.last = Snapshot(now, pool_blocks, free_blocks, tenants)
        return self.last

    def request_done(self, request_id: str) -> float:
        """The request's block-seconds, forgotten here once reported."""
        return self.request_block_seconds.pop(request_id, 0.0)

    def count_preemption(
        self,
        tenant: Tenant,
        tier: str | None,
        reason: str,
        mode: str,
        blocks: int,
        tokens: int,
        by_tier: str,
    ) -> None:
        self.preemptions[(tenant, tier, reason, mode, by_tier)] += 1
        self.preempted_blocks[(tenant, tier, reason)] += blocks
        self.recomputed_tokens[tenant] += tokens

    def count_eviction(
        self, tenant: Tenant, tier: str | None, leased: bool, blocks: int, by_tier: str
    ) -> None:
        self.evicted_blocks[(tenant, tier, leased, by_tier)] += blocks

    def count_lease_reuse(self, tier: str, covered: int, cached: int, reserved: bool) -> None:
        """A leased session's next turn: of the `covered` prefix tokens its lease was to keep,
        those the prefix cache served (at most `cached`) were reused, the rest lost.
        `reserved`: the turn came back inside its session's reservation window, so the
        blocks were held from lower tiers; after the window only eviction order kept them."""
        reused = min(covered, max(0, cached))
        kept, lost = LEASE_OUTCOMES
        self.lease_reuse_tokens[(tier, kept, reserved)] += reused
        self.lease_reuse_tokens[(tier, lost, reserved)] += covered - reused
