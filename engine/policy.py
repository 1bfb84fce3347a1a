"""The preemption and eviction policy, as plain functions over plain data.

Nothing here imports vLLM: the scheduler adapter (`kvlease.engine.vllm_scheduler`)
turns vLLM requests into `Candidate`s and asks this module what to do, so the
rules are testable in milliseconds and readable in one sitting.

Victim order among running requests (first = preempted first):
  1. unclassified requests (no tenant), newest admission first: vLLM's own choice,
     so an engine serving no tenant behaves exactly like stock vLLM,
  2. non-leased before leased,
  3. lower tier first (larger priority number),
  4. within a tier: the tenant furthest above its fair share first (the largest
     virtual token counter, kvlease.engine.fairness), then `least_work` (fewest computed
     tokens first: cheapest to recompute, the default) or `lru` (oldest activity
     first, the seed's rule),
  5. ties: the later admission first (vLLM's own LIFO choice).

Service order is not victim order: `running` is served in `service_key` order
(class, then admission: FCFS within a class) and the victim is chosen apart.

Leases protect by eviction order; while a session's reservation window runs
(kvlease.engine.reservations) its blocks are moreover reserved (`may_take`, `leases_yield`,
`lease_caps_error`): a block reserved by tier T goes only to a request of tier T or a
more important one, unless the engine would otherwise sit idle; each tier's reserved
blocks stay under its cap, and the caps leave room for one `max_model_len` request.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

UNCLASSIFIED_PRIORITY = 1 << 30  # below every tier


class VictimRule(enum.StrEnum):
    LRU = "lru"
    LEAST_WORK = "least_work"


@dataclass(frozen=True, slots=True)
class Candidate:
    """What the policy needs to know about one running request."""

    classified: bool
    leased: bool
    tier_priority: int
    last_activity: float
    computed_tokens: int
    seq: int  # arrival order, unique per request
    counter: float = 0.0  # its tenant's virtual token counter (0 without fair share)


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks `tokens` tokens take (a ceiling division, the one spelling of it here)."""
    return -(-tokens // block_size)


def victim_class(classified: bool, leased: bool, tier_priority: int) -> tuple[int, int, int]:
    """Coarse class of a request: smaller is more protected. Stable while it runs."""
    if not classified:
        return (1, 1, UNCLASSIFIED_PRIORITY)
    return (0, 0 if leased else 1, tier_priority)


def keep_key(c: Candidate, rule: VictimRule) -> tuple[object, ...]:
    """Sort key, ascending = keep first; the last element is the first victim.

    Total: `seq` is unique, so no two candidates compare equal. Unclassified
    requests keep vLLM's order (newest first), whatever the rule.
    """
    within = (
        within_class_key(rule, c.computed_tokens, c.last_activity, c.counter)
        if c.classified
        else (0.0, 0.0)
    )
    return (*victim_class(c.classified, c.leased, c.tier_priority), within, c.seq)


def within_class_key(
    rule: VictimRule, computed_tokens: int, last_activity: float, counter: float = 0.0
) -> tuple[float, float]:
    """Inside one class, larger = preempted first: the tenant furthest above its fair
    share (largest counter), then by `rule` (ties: the later admission first). Plain
    numbers, so the scheduler can scan `running` without building Candidates."""
    return (counter, -computed_tokens if rule is VictimRule.LEAST_WORK else -last_activity)


def victim_order(candidates: Iterable[Candidate], rule: VictimRule) -> list[Candidate]:
    """Candidates in the order they should be preempted."""
    return sorted(candidates, key=lambda c: keep_key(c, rule), reverse=True)


def service_key(rank: tuple[int, int, int], admitted: int) -> tuple[tuple[int, int, int], int]:
    """A request's place in `running`, which vLLM serves front to back and whose last
    element its FCFS preemption takes: class, then admission order (FCFS within a
    class, as vLLM appends). Fixed from admission to preemption or finish."""
    return (rank, admitted)


def admission_victims(
    head_class: tuple[int, int, int],
    need: int,
    free: int,
    candidates: Sequence[Candidate],
    rule: VictimRule,
    returns: Callable[[int], int],
) -> list[int]:
    """Which running requests to preempt so a waiting request of class `head_class` fits.

    `need` blocks are wanted (after its prefix-cache hit) and `free` are free to it;
    `returns(i)` is the blocks preempting candidate i would return, asked only of the
    candidates looked at, in victim order (it walks the request's blocks). Only requests
    of a strictly lower class may go, in victim order (so the least work is lost), and
    only as many as close the gap. Returns their indices, or [] when even all of them
    would not admit it: then nobody is preempted for nothing.
    """
    lower = [i for i, c in enumerate(candidates) if _class_of(c) > head_class]
    lower.sort(key=lambda i: keep_key(candidates[i], rule), reverse=True)
    chosen: list[int] = []
    for i in lower:
        if free >= need:
            break
        chosen.append(i)
        free += returns(i)
    return chosen if free >= need else []


def _class_of(c: Candidate) -> tuple[int, int, int]:
    return victim_class(c.classified, c.leased, c.tier_priority)


# --- leases as bounded reservations -------------------------------------------


def may_take(request_priority: int | None, lease_tier_priority: int) -> bool:
    """May a request (tier priority, None when unclassified) take a cached block that a
    running lease of a tier with `lease_tier_priority` protects? Only the same or a
    more important tier may."""
    return request_priority is not None and request_priority <= lease_tier_priority


def leases_yield(other_running: int) -> bool:
    """Work conservation: with nothing else running, a request may take leased blocks
    rather than leave the engine idle while it waits."""
    return other_running == 0


def unreserved_blocks(pool_blocks: int, caps: Iterable[int]) -> int:
    """Blocks no lease can ever hold: what is left of the pool under every cap full."""
    return pool_blocks - sum(caps)


def lease_caps_error(pool_blocks: int, caps: dict[str, int], request_blocks: int) -> str | None:
    """Why a tier table cannot run on this pool, or None.

    Every request must fit in the blocks no lease may hold, or a lower-tier request as
    long as the model allows could wait behind full leases for as long as they run.
    """
    free = unreserved_blocks(pool_blocks, caps.values())
    if free >= request_blocks:
        return None
    held = ", ".join(f"{tier} {n}" for tier, n in caps.items())
    return (
        f"the tier table's leased_cache_cap values reserve {sum(caps.values())} of "
        f"{pool_blocks} KV blocks ({held}), leaving {free}; one max_model_len request "
        f"needs {request_blocks}. Lower the caps, lower max_model_len, or give the "
        f"engine more KV-cache blocks"
    )


def tenant_cap_error(
    tier: str, cap_blocks: int, pool_blocks: int, request_blocks: int
) -> str | None:
    """Why a tier's `max_tenant_kv_share` cannot run on this pool, or None: a tenant must
    be able to hold one max_model_len request, or its request could wait for ever."""
    if cap_blocks >= request_blocks:
        return None
    return (
        f"tier {tier!r}: max_tenant_kv_share lets one tenant hold {cap_blocks} of "
        f"{pool_blocks} KV blocks; one max_model_len request needs {request_blocks}. "
        f"Raise the share, lower max_model_len, or give the engine more KV-cache blocks"
    )


# --- preemption mode: recompute or offload ----------------------------------

FALLBACK_OFFLOAD_MIN_BLOCKS = 128  # the seed's rule, used only without model numbers


@dataclass(frozen=True, slots=True)
class CostModel:
    """Model and machine numbers for the recompute-vs-offload decision.

    Any field may be None when unknown; the decision then falls back to a
    block-count threshold.
    """

    kv_bytes_per_token: int | None = None  # 2 (K,V) x layers x kv_heads x head_dim x dtype bytes
    params: int | None = None  # model parameters
    effective_flops: float | None = None  # achieved FLOP/s of a prefill
    host_link_bytes_per_s: float | None = None  # device<->host copy bandwidth, one way

    @property
    def complete(self) -> bool:
        return None not in (
            self.kv_bytes_per_token,
            self.params,
            self.effective_flops,
            self.host_link_bytes_per_s,
        )


@dataclass(frozen=True, slots=True)
class ModeDecision:
    mode: str  # "recompute" or "offload"
    recompute_seconds: float | None
    offload_seconds: float | None
    basis: str  # "cost_model", "fallback_threshold" or "offload_unavailable"


def preemption_mode(
    blocks: int,
    block_size: int,
    computed_tokens: int,
    cost: CostModel,
    offload_available: bool,
) -> ModeDecision:
    """Cheaper of recomputing the request's KV or offloading it and back.

    offload = 2 x bytes / bandwidth (out now, back in on resume), with
    bytes = blocks x block_size x kv_bytes_per_token;
    recompute = tokens x 2 x params / effective FLOPS (a forward pass is
    ~2 FLOPs per parameter per token).
    """
    recompute_s = offload_s = None
    if cost.complete:
        assert cost.kv_bytes_per_token and cost.params and cost.effective_flops
        assert cost.host_link_bytes_per_s
        kv_bytes = blocks * block_size * cost.kv_bytes_per_token
        offload_s = 2 * kv_bytes / cost.host_link_bytes_per_s
        recompute_s = computed_tokens * 2 * cost.params / cost.effective_flops
    if not offload_available:
        return ModeDecision("recompute", recompute_s, offload_s, "offload_unavailable")
    if recompute_s is not None and offload_s is not None:
        mode = "offload" if offload_s < recompute_s else "recompute"
        return ModeDecision(mode, recompute_s, offload_s, "cost_model")
    mode = "recompute" if blocks < FALLBACK_OFFLOAD_MIN_BLOCKS else "offload"
    return ModeDecision(mode, None, None, "fallback_threshold")


# --- cached-block eviction classes -------------------------------------------


class EvictionClass(enum.IntEnum):
    """Where a freed block waits in the free queue; lower is reused first.

    EMPTY blocks hold no reusable prefix. CACHED blocks hold a prefix nobody
    protects (plain LRU). RETAINED and RESERVED blocks hold the prefix of a tenant
    session whose lease is running; they go only after every EMPTY and CACHED block.
    RESERVED ones, while the session's reservation window runs (kvlease.engine.reservations),
    are moreover kept from lower tiers; RETAINED ones any request may take.
    """

    EMPTY = 0
    CACHED = 1
    RETAINED = 2
    RESERVED = 3


def eviction_class(has_prefix: bool, leased: bool, reserving: bool) -> EvictionClass:
    """Class of one block being freed: `reserving` when the session's reservation window
    runs and its tier may reserve at all (a cap above 0). At the tier's cap the queue
    makes room by retaining that tier's oldest reserved block, so the newest sessions
    (the likeliest to come back) keep their reservation."""
    if not has_prefix:
        return EvictionClass.EMPTY
    if not leased:
        return EvictionClass.CACHED
    return EvictionClass.RESERVED if reserving else EvictionClass.RETAINED


def leased_cap_blocks(cap_fraction: float, pool_blocks: int) -> int:
    """How many cached blocks one tier's leases may protect at once."""
    return math.floor(cap_fraction * pool_blocks)
