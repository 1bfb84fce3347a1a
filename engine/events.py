"""What the scheduler tells the rest of kvlease: typed events, a typed state snapshot,
and the bounded buffer events go through.

The scheduler runs inside vLLM's engine loop, so it never blocks on a
consumer: events go into a fixed-size buffer, and when consumers fall behind
the newest events are dropped and counted. Exact totals never depend on
events: `kvlease.engine.accounting` keeps cumulative counters, sent in every snapshot.

Events and snapshots cross from the EngineCore process to the API process
(`kvlease.engine.channel`) as msgspec Structs: the same classes encode on one side and
decode on the other, so a field renamed on one side is a decode error at the
boundary, not a silent `KeyError` (or a silent zero) in some reader.
"""

from __future__ import annotations

from collections import deque

import msgspec

# A preemption or eviction no allocation caused (a prefix-cache reset), as `by_tier`.
NO_CAUSE = "none"

# Events a scheduler keeps for kvlease's API process between two sends (and for a send
# backlog), unless its `event_capacity` setting says otherwise.
EVENT_CAPACITY = 65536


class Preemption(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    at: float  # the machine's monotonic clock, shared by every process
    request_id: str
    tenant_id: str | None  # None: unclassified
    tier: str | None
    session_id: str | None
    reason: str  # "kv_pressure", "admit_higher_tier" or "cache_reset"
    mode: str  # "recompute" or "offload"
    blocks: int  # KV blocks the request held
    recomputed_tokens: int  # computed tokens thrown away (to be computed again)
    api_server: int = 0  # the API process that owns the request (vLLM's client index)
    by_tier: str = NO_CAUSE  # whose allocation caused it: its tier (or "unclassified")
    by_tenant: str | None = None  # and its tenant


class Eviction(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """Cached prefix blocks of one tenant evicted to make room for one allocation (or,
    with no cause known, within one step)."""

    at: float
    tenant_id: str | None
    tier: str | None
    leased: bool
    blocks: int
    by_tier: str = NO_CAUSE  # whose allocation evicted them: its tier
    by_tenant: str | None = None  # and its tenant


class LeaseEvent(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    at: float
    tenant_id: str
    session_id: str | None
    tier: str
    kind: str  # "start", "renew" or "expire"
    expires_at: float | None  # clock value; None while a request is in flight
    request_id: str | None = None  # the request whose arrival or finish changed it
    api_server: int = 0  # the API process that owns that request


class RequestDone(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """A request left the engine (finished, aborted or failed)."""

    at: float
    request_id: str
    tenant_id: str | None
    tier: str | None
    session_id: str | None
    status: str  # vLLM's RequestStatus name, lower case: "finished_stopped", ...
    preemptions: int
    recomputed_tokens: int
    block_seconds: float
    prompt_tokens: int = 0
    output_tokens: int = 0
    lease_covered_tokens: int = 0  # prefix tokens its session's running lease was to keep
    api_server: int = 0  # the API process that owns the request (vLLM's client index)
    # its recomputed tokens by the tier whose allocation preempted it (NO_CAUSE: none known)
    recomputed_by: dict[str, int] = msgspec.field(default_factory=dict)


class Retention(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """A leased session's blocks between two turns (kvlease.engine.retention): the ledger's
    "KV retention" record, written by the API process that owned the turn's request."""

    at: float  # when the episode closed (next turn, lease end), monotonic clock
    request_id: str  # the request whose end opened the episode
    tenant_id: str
    tier: str
    session_id: str | None
    model: str
    started: float  # monotonic clock
    reserved_block_seconds: float  # held in a RESERVED segment: lower tiers kept out
    retained_block_seconds: float  # held in a RETAINED segment: evicted last
    api_server: int = 0


Event = Preemption | Eviction | LeaseEvent | RequestDone | Retention


class TenantHolding(msgspec.Struct):
    """KV blocks one tenant label holds now, by state."""

    running: int = 0  # referenced by its requests
    cached_leased: int = 0  # its cached prefixes, protected by a running lease
    cached: int = 0  # its cached prefixes, evictable

    @property
    def billable(self) -> int:
        """Blocks kvlease keeps for the tenant: plain cached blocks may go at any moment."""
        return self.running + self.cached_leased


class Lease(msgspec.Struct):
    tenant_id: str
    session_id: str | None
    tier: str | None
    in_flight: bool  # a request of the session is in the engine: the lease is full
    expires_at: float | None  # monotonic clock; None while in flight
    seconds_left: float | None  # as of the snapshot's `at`
    cached_leased_blocks: int


class LeaseSummary(msgspec.Struct):
    active: int = 0
    seconds_left_max: float = 0.0


class Totals(msgspec.Struct):
    """Cumulative counters since the engine started, keyed by tenant label (and tier,
    reason, mode): what Prometheus counters are built from, exact whatever events drop."""

    # tenant, tier, reason, mode, by_tier (the tier whose allocation caused it)
    preemptions: list[tuple[str, str | None, str, str, str, int]]
    preempted_blocks: list[tuple[str, str | None, str, int]]  # tenant, tier, reason
    recomputed_tokens: list[tuple[str, int]]
    evicted_blocks: list[tuple[str, str | None, bool, str, int]]  # tenant, tier, leased, by_tier
    block_seconds: list[tuple[str, float]]
    offloaded_blocks: list[tuple[str, int]]
    # tier, "reused" or "lost", whether the turn came back inside its reservation window
    lease_reuse_tokens: list[tuple[str, str, bool, int]] = []
    # tenant, tier, weighted tokens served and entitled while backlogged (kvlease.engine.fairness)
    fair_share_tokens: list[tuple[str, str, float, float]] = []
    # tenant, tier, "reserved" or "retained": block-seconds held between turns
    retention_block_seconds: list[tuple[str, str, str, float]] = []


class FairShareRow(msgspec.Struct, kw_only=True):
    """One tenant's place in its tier's fair share (kvlease.engine.fairness), at a snapshot."""

    tenant_id: str  # a label (kvlease.engine.labels)
    tier: str
    counter: float  # virtual token counter: weighted service / weight
    ratio: float | None  # served / entitled since the last snapshot, while it waited
    waiting: int  # its requests in the waiting queue


class EngineState(msgspec.Struct):
    """One scheduler's picture of the pool, leases, queues and totals, at `at`."""

    at: float  # monotonic clock
    pool_blocks: int
    free_blocks: int
    tenants: dict[str, TenantHolding]
    tenant_tiers: dict[str, str]  # tenant label -> the tier it last came with
    leases: list[Lease]  # at most MAX_LEASES_LISTED; lease_summary covers all
    leases_total: int
    lease_summary: dict[str, LeaseSummary]
    running: int
    waiting: int
    waiting_by_tier: dict[str, int]  # requests without tenant fields under "__unclassified__"
    events_dropped: int
    totals: Totals
    fair_share: list[FairShareRow] = []  # every tenant each tier's fair share tracks
    reserved_caps: dict[str, int] = {}  # leasing tier -> blocks its reservations may hold now


class Message(msgspec.Struct):
    """One channel message from one engine: the events since its last message, sent at
    the end of a step that finished a request or took a sample, and with a sample its
    state (every `sample_seconds` while busy, and at idle). `engine` is the
    data-parallel rank of the scheduler that sent it."""

    events: list[Event] = []
    state: EngineState | None = None
    engine: int = 0


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Message)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(raw: bytes) -> Message:
    """Raises msgspec.ValidationError (a ValueError) for a message of another shape."""
    return _decoder.decode(raw)


class EventBuffer:
    """A FIFO of at most `capacity` events; overflow drops the newest and counts it.
    Capacity 0 keeps nothing and counts nothing: nobody reads this scheduler's events
    (`kvlease.engine.settings.SchedulerSettings.events_kept`).

    Invariant: len(self) <= capacity; `dropped` only grows. push and drain are
    O(1) per event.
    """

    def __init__(self, capacity: int = EVENT_CAPACITY) -> None:
        if capacity < 0:
            raise ValueError("event buffer capacity must be 0 or more")
        self.capacity = capacity
        self.dropped = 0
        self._events: deque[Event] = deque()

    @property
    def wanted(self) -> bool:
        """Whether anything reads these events; if not, callers build none (the scheduler
        builds each at its source, in the step)."""
        return self.capacity > 0

    def push(self, event: Event) -> None:
        if len(self._events) >= self.capacity:
            if self.capacity:
                self.dropped += 1
            return
        self._events.append(event)

    def drain(self, limit: int | None = None) -> list[Event]:
        n = len(self._events) if limit is None else min(limit, len(self._events))
        return [self._events.popleft() for _ in range(n)]

    def __len__(self) -> int:
        return len(self._events)
