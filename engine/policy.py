"""The preemption and eviction policy, as plain functions over plain data.

Nothing here imports vLLM: the scheduler adapter (`engine.vllm_scheduler`)
turns vLLM requests into `Candidate`s and asks this module what to do, so the
rules are testable in milliseconds and readable in one sitting.

Victim order among running requests (first = preempted first):
  1. unclassified requests (no tenant),
  2. non-leased before leased,
  3. lower tier first (larger priority number),
  4. within a tier: `lru` (oldest activity first) or `least_work` (fewest
     computed tokens first: cheapest to recompute),
  5. ties: the later arrival first (vLLM's own LIFO choice).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
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


def protection_rank(classified: bool, leased: bool, tier_priority: int) -> tuple[int, int, int]:
    """Coarse class of a request: smaller is more protected. Stable while it runs."""
    if not classified:
        return (1, 1, UNCLASSIFIED_PRIORITY)
    return (0, 0 if leased else 1, tier_priority)


def keep_key(c: Candidate, rule: VictimRule) -> tuple:
    """Sort key, ascending = keep first; the last element is the first victim.

    Total: `seq` is unique, so no two candidates compare equal.
    """
    within = -c.computed_tokens if rule is VictimRule.LEAST_WORK else -c.last_activity
    return (*protection_rank(c.classified, c.leased, c.tier_priority), within, c.seq)


def victim_order(candidates: Iterable[Candidate], rule: VictimRule) -> list[Candidate]:
    """Candidates in the order they should be preempted."""
    return sorted(candidates, key=lambda c: keep_key(c, rule), reverse=True)


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
    protects (plain LRU). LEASED blocks hold the prefix of a tenant session
    whose lease is running; they go only after every EMPTY and CACHED block.
    """

    EMPTY = 0
    CACHED = 1
    LEASED = 2


def eviction_class(has_prefix: bool, leased: bool, tier_cap: int) -> EvictionClass:
    """Class of one block being freed. A leased block is LEASED whenever its tier may lease
    at all; at the tier's cap the queue makes room by demoting that tier's oldest leased
    block, so the newest leases (the sessions likeliest to come back) keep their prefixes."""
    if not has_prefix:
        return EvictionClass.EMPTY
    if leased and tier_cap > 0:
        return EvictionClass.LEASED
    return EvictionClass.CACHED


def leased_cap_blocks(cap_fraction: float, pool_blocks: int) -> int:
    """How many cached blocks one tier's leases may protect at once."""
    return math.floor(cap_fraction * pool_blocks)
