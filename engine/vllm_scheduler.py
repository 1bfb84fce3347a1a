"""kvlease inside vLLM 0.32's V1 scheduler: the scheduler adapter.

One of the three modules that import vLLM (besides the version check in
`engine.runtime`): this one, the launcher `server.serve` and the stat-logger
plugin `exporters.stat_logger`. The policy it applies lives in plain Python
(`engine.policy`, `engine.leases`, `engine.free_queue`, `engine.waiting_queue`).

Load it with `scheduler_cls="engine.vllm_scheduler.TenantAwareScheduler"`; where
vLLM schedules asynchronously that builds `TenantAwareAsyncScheduler`. It overrides
as little of vLLM as it can and copies none of `schedule()`:

- `running` is kept in keep-first order (`engine.policy.keep_key`), so vLLM's
  own FCFS preemption, which always takes `running[-1]`, takes the policy's
  victim. New requests are inserted in order (O(log n) search); under
  `least_work` the list is re-sorted, in O(n) on an almost sorted list, only
  in steps where the pool may run short.
- `waiting` is a `TenantWaitingQueue`: tier order, FIFO within a tier.
- Before delegating to `Scheduler.schedule()`, a waiting request of a higher
  class than the worst running one may preempt running lower-class requests
  when the pool (or the running set) cannot admit it. Those victims sit out
  the step, so they are not re-admitted in it.
- The block pool's free queue becomes a `TenantFreeBlockQueue`, which evicts
  leased prefixes only after every unleased block.
- `_preempt_request`, `_free_request` and `_free_request_blocks` are wrapped
  to record events, leases and accounting.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from engine.runtime import require_vllm

require_vllm()  # a clear error before any vLLM internals are touched

from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.request_queue import RequestQueue, SchedulingPolicy  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from engine.accounting import TenantAccounting  # noqa: E402
from engine.channel import Publisher  # noqa: E402
from engine.events import (  # noqa: E402
    EngineState,
    EventBuffer,
    Eviction,
    Lease,
    LeaseEvent,
    LeaseSummary,
    Message,
    Preemption,
    RequestDone,
    TenantHolding,
    Totals,
)
from engine.free_queue import FIRST_LEASED, Holder, TenantFreeBlockQueue  # noqa: E402
from engine.labels import UNCLASSIFIED, TenantLabels  # noqa: E402
from engine.leases import LeaseBook  # noqa: E402
from engine.policy import (  # noqa: E402
    Candidate,
    CostModel,
    VictimRule,
    keep_key,
    leased_cap_blocks,
    preemption_mode,
    protection_rank,
)
from engine.settings import SchedulerSettings  # noqa: E402
from engine.waiting_queue import TenantWaitingQueue  # noqa: E402

logger = logging.getLogger("kvlease.scheduler")

RequestQueue.register(TenantWaitingQueue)
MAX_LEASES_LISTED = 1000  # /admin/state lists at most this many; lease_summary covers all


@dataclass(slots=True)
class Tenancy:
    """What kvlease knows about one request, from its `SamplingParams.extra_args`."""

    tenant_id: str | None
    tier: str | None
    session_id: str | None
    rank: tuple[int, int, int]  # engine.policy.protection_rank
    bucket: int  # waiting-queue rank: tier order, unclassified last
    seq: int
    holder: Holder | None
    recomputed_tokens: int = 0
    offloaded_blocks: int = 0  # set while preempted in "offload" mode
    lru_key: tuple | None = None  # keep_key under `lru`: fixed for the request's life

    @property
    def session(self) -> Hashable:
        return (self.tenant_id, self.session_id)


class _RunningList(list):
    """vLLM's `running`, kept so that `running[-1]` is the policy's first victim.

    `append` is vLLM's admission of a waiting request: it inserts in keep-first
    order (O(log n) search, O(n) memmove) and tells the scheduler.
    """

    __slots__ = ("_key", "_on_admit")

    def __init__(self, key, on_admit, items=()) -> None:
        super().__init__(items)
        self._key = key
        self._on_admit = on_admit

    def append(self, request: Request) -> None:
        bisect.insort(self, request, key=self._key)
        self._on_admit(request)


class TenantSchedulingMixin:
    """Tenant-aware preemption, lease-protected prefixes and accounting for a vLLM Scheduler.

    State and its invariants (checked by the synthetic and real-engine tests; with
    `debug_accounting` the block books are checked every step):
    - `_tenancy`: request id -> `Tenancy`, for exactly the requests vLLM holds (waiting,
      running or preempted); added in `add_request`, removed in `_free_request`. O(1) per
      lookup; memory O(requests).
    - `_holders`: (tenant, session) -> `Holder`, the owner of that session's cached blocks in
      the free queue. A holder exists while it has a request in flight, a running lease, or
      cached blocks (`_forget_if_idle` drops it otherwise), so memory is O(live sessions +
      sessions with cached blocks), never O(sessions ever seen).
    - `running`: a `_RunningList` in keep-first order (`engine.policy.keep_key`), so
      `running[-1]` is always the policy's first victim. Admission is an O(log n) search
      plus an O(n) memmove; under `lru` each request's key is computed once.
    - `waiting`: a `TenantWaitingQueue` (tier order, FIFO within a tier): add and prepend
      O(1), peek and pop O(tiers), remove O(its tier's bucket).
    - `accounting` holds cumulative totals, exact whatever happens to `events`
      (bounded; overflow counted in `events.dropped`).
    Per step the mixin adds O(1) work plus, only when the pool may run short, the
    admission check over the tail of `running`; sampling walks held blocks every
    `sample_seconds`, off the per-step path.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.settings = SchedulerSettings.load(self.vllm_config.additional_config)
        tiers = self.settings.tiers
        self.clock = time.monotonic
        self.leases = LeaseBook(clock=lambda: self.clock())
        self.events = EventBuffer(self.settings.event_capacity)
        self.accounting = TenantAccounting()
        self._label = TenantLabels.from_env()  # bounded tenant keys for totals and snapshots
        self._tenant_tiers: dict[str, str] = {}  # tenant label -> the tier it last came with
        self._tenancy: dict[str, Tenancy] = {}
        self._holders: dict[Hashable, Holder] = {}
        self._seq = itertools.count()
        self._preempt_reason = "kv_pressure"
        self._last_sample = float("-inf")
        self._bucket = {name: i for i, name in enumerate(tiers)}  # tiers are in priority order

        # Victims come from our ordering of `running`, through vLLM's FCFS path.
        self.policy = SchedulingPolicy.FCFS
        self.waiting = TenantWaitingQueue(self._bucket_of, len(tiers) + 1)
        self.running = []

        pool = self.kv_cache_manager.block_pool
        self._pool = pool
        leased = [t for t in reversed(list(tiers.values())) if t.lease_seconds > 0]
        self._lease_segment = {t.name: FIRST_LEASED + i for i, t in enumerate(leased)}
        usable = pool.num_gpu_blocks - 1  # vLLM's null block is never handed out
        self._caps = [leased_cap_blocks(t.leased_cache_cap, usable) for t in leased]
        self._free_queue = self._install_free_queue()
        self._cost = _cost_model(self.vllm_config, self.settings)
        self._publisher = Publisher.from_env()
        self._unsent: list[Message] = []
        self._offload_available = self.vllm_config.kv_transfer_config is not None
        logger.info(
            "kvlease scheduler: tiers %s, victim rule %s, pool %d blocks, leased caps %s",
            list(tiers),
            self.settings.victim_rule.value,
            usable,
            dict(zip(self._lease_segment, self._caps, strict=True)),
        )
        if self._publisher is not None:
            self._publish(with_state=True)  # so /admin/state answers before the first step

    def _install_free_queue(self) -> TenantFreeBlockQueue:
        """Replace the pool's free queue with a tenant queue holding the same blocks, in order."""
        pool = self._pool
        queue = TenantFreeBlockQueue.replacing(pool.free_block_queue, len(pool.blocks), self._caps)
        pool.free_block_queue = queue
        return queue

    # -- the running list ----------------------------------------------------

    @property
    def running(self) -> _RunningList:
        return self._kvl_running

    @running.setter
    def running(self, value: list[Request]) -> None:
        # vLLM reassigns `running` after filtering finished requests; order survives.
        if not isinstance(value, _RunningList):
            value = _RunningList(self._keep_key, self._admitted, value)
        self._kvl_running = value

    def _keep_key(self, request: Request) -> tuple:
        """The request's place in `running`. Under `lru` every part of it is fixed while the
        request lives (its class, arrival, seq), so it is computed once: admission is a
        binary search over cached keys."""
        t = self._tenancy[request.request_id]
        lru = self.settings.victim_rule is VictimRule.LRU
        if lru and t.lru_key is not None:
            return t.lru_key
        key = keep_key(
            Candidate(
                classified=t.tenant_id is not None,
                leased=t.rank[1] == 0,
                tier_priority=t.rank[2],
                last_activity=request.arrival_time,
                computed_tokens=request.num_computed_tokens,
                seq=t.seq,
            ),
            self.settings.victim_rule,
        )
        if lru:
            t.lru_key = key
        return key

    def _admitted(self, request: Request) -> None:
        self._restore_offloaded(self._tenancy[request.request_id])

    def _restore_offloaded(self, t: Tenancy) -> None:
        """An offloaded request is running again (or gone): its blocks are no longer off-device."""
        if t.offloaded_blocks:
            self.accounting.offloaded_blocks[self._label(t.tenant_id)] -= t.offloaded_blocks
            t.offloaded_blocks = 0

    def _bucket_of(self, request: Request) -> int:
        return self._tenancy[request.request_id].bucket

    # -- requests in -----------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id not in self._tenancy:
            self._expire_leases()
            self._tenancy[request.request_id] = self._classify(request)
        super().add_request(request)

    def _classify(self, request: Request) -> Tenancy:
        args = (request.sampling_params.extra_args or {}) if request.sampling_params else {}
        tenant_id, tier_name = args.get("tenant_id"), args.get("tier")
        session_id = args.get("session_id")
        tiers = self.settings.tiers
        if not isinstance(tenant_id, str) or not tenant_id or tier_name not in tiers:
            if tenant_id is not None:
                logger.warning(
                    "request %s: tenant fields %r are incomplete or name an unknown tier; "
                    "treating it as unclassified",
                    request.request_id,
                    {k: args.get(k) for k in ("tenant_id", "tier", "session_id")},
                )
            rank = protection_rank(False, False, 0)
            return Tenancy(None, None, None, rank, len(tiers), next(self._seq), None)
        session_id = session_id if isinstance(session_id, str) else None
        tier = tiers[tier_name]
        self._tenant_tiers[self._label(tenant_id)] = tier.name
        leased = tier.lease_seconds > 0
        tenancy = Tenancy(
            tenant_id,
            tier.name,
            session_id,
            protection_rank(True, leased, tier.priority),
            self._bucket[tier.name],
            next(self._seq),
            None,
        )
        holder = self._holders.get(tenancy.session)
        if holder is None:
            holder = self._holders[tenancy.session] = Holder(
                tenant_id, tier.name, session_id, self._lease_segment.get(tier.name)
            )
        holder.in_flight += 1
        tenancy.holder = holder
        change = self.leases.request_started(tenancy.session, tier.lease_seconds)
        if change is not None:
            holder.protected = True
            self._lease_event(holder, change.kind, change.expires_at, change.at, request.request_id)
        return tenancy

    # -- scheduling ------------------------------------------------------------

    def schedule(self, *args: Any, **kwargs: Any):
        if self.clock() - self._last_sample >= self.settings.sample_seconds:
            # Close the interval before this step allocates: after an idle spell the
            # holdings now are what the idle engine held, not what this step will take.
            self.sample_accounting()
        self._expire_leases()
        if self.settings.victim_rule is VictimRule.LEAST_WORK and self._pool_may_run_short():
            self.running.sort(key=self._keep_key)
        held = self._make_room_for_waiting()
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            if held:
                self.waiting.prepend_requests(held)
        self._report_evictions()
        return output

    def update_from_output(self, *args: Any, **kwargs: Any):
        outputs = super().update_from_output(*args, **kwargs)
        # Sample on the clock, and whenever the engine goes idle: no step follows
        # to report the final picture.
        sample_due = (
            self.clock() - self._last_sample >= self.settings.sample_seconds
            or not self.has_requests()
        )
        if self.settings.debug_accounting or sample_due:
            self.sample_accounting()
        if self._publisher is not None:
            self._publish(with_state=sample_due)
        return outputs

    def finish_requests(self, *args: Any, **kwargs: Any):
        """Aborts arrive here, between steps; report them even if no step follows."""
        finished = super().finish_requests(*args, **kwargs)
        if self._publisher is not None and finished:
            self._publish(with_state=not self.has_requests(), fresh=True)
        return finished

    def _publish(self, with_state: bool, fresh: bool = False) -> None:
        """Send this step's events (and a snapshot when due) to the API process.

        `fresh` samples the accounting for the snapshot; update_from_output has
        just sampled, an abort between steps has not.
        """
        events = self.events.drain()
        if not (events or with_state or self._unsent):
            return
        message = Message(events, self.state(sample=fresh) if with_state else None)
        pending = [*self._unsent, message]
        while pending and self._publisher.send(pending[0]):
            pending.pop(0)
        overflow = sum(len(m.events) for m in pending) - self.settings.event_capacity
        while overflow > 0 and pending:  # the API process is not reading: bound the backlog
            self.events.dropped += len(pending[0].events)
            overflow -= len(pending.pop(0).events)
        self._unsent = pending

    def _pool_may_run_short(self) -> bool:
        """True unless this step cannot possibly need a preemption."""
        worst_case = (
            len(self.running)
            + -(-self.max_num_scheduled_tokens // self.block_size)
            + self.kv_cache_manager.watermark_blocks
        )
        return self._pool.get_num_free_blocks() < worst_case

    def _make_room_for_waiting(self) -> list[Request]:
        """Preempt running requests of a lower class than the waiting head, if that admits it.

        Stock vLLM never preempts to admit a waiting request (vLLM issue #40004).
        Returns the victims, which are kept out of the waiting queue for this step.
        """
        if not self.waiting or not self.running:
            return []
        head = self.waiting.peek_request()
        head_rank = self._tenancy[head.request_id].rank
        tokens = min(head.num_tokens, self.max_num_scheduled_tokens) + self.num_lookahead_tokens
        need = -(-tokens // self.block_size) + self.kv_cache_manager.watermark_blocks
        free = self._pool.get_num_free_blocks()
        slot_short = len(self.running) >= self.max_num_active_reqs
        if free >= need and not slot_short:
            return []
        victims: list[Request] = []
        reclaim = 0
        for request in reversed(self.running):
            if self._tenancy[request.request_id].rank <= head_rank:
                break
            if not self._request_blocks_can_be_freed(request):
                break
            victims.append(request)
            reclaim += self._num_blocks(request)
            if free + reclaim >= need:
                break
        if not victims or free + reclaim < need:
            return []  # preempting could not admit the head: leave everyone running
        now = time.monotonic()
        self._preempt_reason = "admit_higher_tier"
        try:
            for victim in victims:
                assert self.running.pop() is victim
                self._preempt_request(victim, now, drop_stale_output=self.requires_kv_delivery)
                self.waiting.remove_request(victim)
        finally:
            self._preempt_reason = "kv_pressure"
        return victims

    # -- preemption, finish and free hooks -------------------------------------

    def _preempt_request(self, request: Request, timestamp: float, drop_stale_output: bool = False):
        t = self._tenancy[request.request_id]
        blocks = self._num_blocks(request)
        tokens = request.num_computed_tokens
        decision = preemption_mode(
            blocks, self.block_size, tokens, self._cost, self._offload_available
        )
        super()._preempt_request(request, timestamp, drop_stale_output=drop_stale_output)
        t.recomputed_tokens += tokens
        if decision.mode == "offload":
            t.offloaded_blocks = blocks
            self.accounting.offloaded_blocks[self._label(t.tenant_id)] += blocks
        self.accounting.count_preemption(
            self._label(t.tenant_id), t.tier, self._preempt_reason, decision.mode, blocks, tokens
        )
        self.events.push(
            Preemption(
                self.clock(),
                request.request_id,
                t.tenant_id,
                t.tier,
                t.session_id,
                self._preempt_reason,
                decision.mode,
                blocks,
                tokens,
            )
        )

    def _free_request_blocks(self, request: Request) -> None:
        t = self._tenancy.get(request.request_id)
        self._free_queue.owner = t.holder if t is not None else None
        try:
            super()._free_request_blocks(request)
        finally:
            self._free_queue.owner = None

    def _free_request(self, request: Request, delay_free_blocks: bool = False):
        t = self._tenancy.get(request.request_id)
        if t is not None:
            self._integrate_request(request)
        result = super()._free_request(request, delay_free_blocks=delay_free_blocks)
        if t is None:
            return result
        self._restore_offloaded(t)
        del self._tenancy[request.request_id]
        now = self.clock()
        holder = t.holder
        if holder is not None:
            holder.in_flight -= 1
            change = self.leases.request_finished(t.session)
            if change is not None:
                self._lease_event(
                    holder, change.kind, change.expires_at, change.at, request.request_id
                )
            self._forget_if_idle(t.session, holder)
        self.events.push(
            RequestDone(
                now,
                request.request_id,
                t.tenant_id,
                t.tier,
                t.session_id,
                request.status.name.lower(),
                request.num_preemptions,
                t.recomputed_tokens,
                self.accounting.request_done(request.request_id),
                request.num_prompt_tokens,
                request.num_output_tokens,
            )
        )
        return result

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        self._preempt_reason = "cache_reset"
        try:
            ok = super().reset_prefix_cache(*args, **kwargs)
        finally:
            self._preempt_reason = "kv_pressure"
        if ok:  # no free block holds a prefix any more: nobody owns cached blocks
            self._free_queue = self._install_free_queue()
            for session, holder in list(self._holders.items()):
                holder.cached = holder.leased = 0
                self._forget_if_idle(session, holder)
        return ok

    # -- leases and evictions --------------------------------------------------

    def _expire_leases(self) -> None:
        for change in self.leases.expire():
            holder = self._holders.get(change.session)
            if holder is None:
                continue
            self._free_queue.release(holder)
            self._lease_event(holder, "expire", change.expires_at, change.at)
            self._forget_if_idle(change.session, holder)

    def _lease_event(
        self,
        holder: Holder,
        kind: str,
        expires_at: float | None,
        at: float,
        request_id: str | None = None,
    ) -> None:
        assert holder.tenant_id is not None and holder.tier is not None
        self.events.push(
            LeaseEvent(
                at, holder.tenant_id, holder.session_id, holder.tier, kind, expires_at, request_id
            )
        )

    def _forget_if_idle(self, session: Hashable, holder: Holder) -> None:
        if not (holder.in_flight or holder.protected or holder.cached or holder.leased):
            self._holders.pop(session, None)

    def _report_evictions(self) -> None:
        now = self.clock()
        for holder in self._free_queue.take_evictions():
            for leased, blocks in ((False, holder.pending_cached), (True, holder.pending_leased)):
                if blocks:
                    self.accounting.count_eviction(
                        self._label(holder.tenant_id), holder.tier, leased, blocks
                    )
                    self.events.push(Eviction(now, holder.tenant_id, holder.tier, leased, blocks))
            holder.pending_cached = holder.pending_leased = 0
            self._forget_if_idle((holder.tenant_id, holder.session_id), holder)

    # -- accounting ------------------------------------------------------------

    def _blocks(self, request_id: str) -> list:
        return [
            b
            for group in self.kv_cache_manager.coordinator.get_blocks(request_id)
            for b in group
            if not b.is_null
        ]

    def _num_blocks(self, request: Request) -> int:
        return len(self._blocks(request.request_id))

    def _integrate_request(self, request: Request) -> None:
        """Close a finishing request's block-seconds up to now."""
        if self.accounting.last is None:
            return
        dt = max(0.0, self.clock() - self.accounting.last.at)
        blocks = self._num_blocks(request)
        self.accounting.request_block_seconds[request.request_id] = (
            self.accounting.request_block_seconds.get(request.request_id, 0.0) + dt * blocks
        )

    def sample_accounting(self):
        """Occupancy by tenant and state now; integrates block-seconds; checks the books."""
        now = self.clock()
        self._last_sample = now
        tenants: dict[str, TenantHolding] = {}
        seen: set[int] = set()
        request_blocks: dict[str, int] = {}
        get_blocks = self.kv_cache_manager.coordinator.get_blocks
        # O(blocks held), the one per-block loop off the step path: kept tight, no lists.
        for request_id, t in self._tenancy.items():
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
                held = tenants.setdefault(self._label(t.tenant_id), TenantHolding())
                held.running += first_seen
        for holder in self._holders.values():
            if holder.cached or holder.leased:
                held = tenants.setdefault(self._label(holder.tenant_id), TenantHolding())
                held.cached += holder.cached
                held.cached_leased += holder.leased
        return self.accounting.sample(
            now,
            pool_blocks=self._pool.num_gpu_blocks - 1,
            free_blocks=self._pool.get_num_free_blocks(),
            referenced_blocks=len(seen),
            tenants=tenants,
            request_blocks=request_blocks,
            check=self.settings.debug_accounting,
        )

    def state(self, sample: bool = True) -> EngineState:
        """The pool, leases, queues and cumulative totals, for the API process.

        `expires_at` is on the machine's monotonic clock, which every process
        shares, so a reader can count seconds left itself; `seconds_left` is
        as of `at` (None while a request of the session is in flight).
        """
        snap = self.accounting.last
        if sample or snap is None:
            snap = self.sample_accounting()
        now = self.clock()
        leases, summary = self._leases(now)
        acc = self.accounting
        return EngineState(
            at=now,
            pool_blocks=snap.pool_blocks,
            free_blocks=snap.free_blocks,
            tenants=snap.tenants,
            tenant_tiers=dict(self._tenant_tiers),
            leases=leases,
            leases_total=len(self.leases.sessions()),
            lease_summary=summary,
            running=len(self.running),
            waiting=len(self.waiting),
            waiting_by_tier=dict(
                zip([*self.settings.tiers, UNCLASSIFIED], self.waiting.bucket_sizes(), strict=True)
            ),
            events_dropped=self.events.dropped,
            totals=Totals(
                preemptions=[(*k, n) for k, n in acc.preemptions.items()],
                preempted_blocks=[(*k, n) for k, n in acc.preempted_blocks.items()],
                recomputed_tokens=list(acc.recomputed_tokens.items()),
                evicted_blocks=[(*k, n) for k, n in acc.evicted_blocks.items()],
                block_seconds=list(acc.block_seconds.items()),
                offloaded_blocks=list(acc.offloaded_blocks.items()),
            ),
        )

    def _leases(self, now: float) -> tuple[list[Lease], dict[str, LeaseSummary]]:
        """The first MAX_LEASES_LISTED leases, and a summary per tenant label of all."""
        leases: list[Lease] = []
        summary: dict[str, LeaseSummary] = {}
        for session in self.leases.sessions():
            tenant_id, session_id = session
            holder = self._holders.get(session)
            left = self.leases.seconds_left(session)
            in_flight = left == float("inf")
            tenant = summary.setdefault(self._label(tenant_id), LeaseSummary())
            tenant.active += 1
            full = self.settings.tiers[holder.tier].lease_seconds if holder and holder.tier else 0.0
            tenant.seconds_left_max = max(
                tenant.seconds_left_max, full if in_flight else (left or 0.0)
            )
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


def _cost_model(vllm_config: Any, settings: SchedulerSettings) -> CostModel:
    """Model numbers for the recompute-vs-offload decision, from vLLM's config."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    try:
        layers = model.get_num_layers(parallel)
        kv_heads = model.get_num_kv_heads(parallel)
        head = model.get_head_size()
        hidden = model.get_hidden_size()
        vocab = model.get_vocab_size()
        itemsize = model.dtype.itemsize
    except (AttributeError, TypeError, ValueError):
        return CostModel()
    heads = getattr(model.hf_text_config, "num_attention_heads", None)
    inter = getattr(model.hf_text_config, "intermediate_size", None)
    params = None
    if heads and inter:
        attention = hidden * head * (2 * heads + 2 * kv_heads)
        params = layers * (attention + 3 * hidden * inter) + 2 * vocab * hidden
    return CostModel(
        kv_bytes_per_token=2 * layers * kv_heads * head * itemsize,
        params=params,
        effective_flops=settings.effective_tflops * 1e12 if settings.effective_tflops else None,
        host_link_bytes_per_s=settings.host_link_gbps * 1e9 if settings.host_link_gbps else None,
    )


class TenantAwareScheduler(TenantSchedulingMixin, Scheduler):
    """kvlease on vLLM's scheduler: the one name to pass as `scheduler_cls`.

    vLLM decides whether it schedules asynchronously (GPU: by default) before
    it builds the scheduler, and a plain `Scheduler` subclass would silently
    turn that off. So constructing this class where
    `scheduler_config.async_scheduling` is on returns a
    `TenantAwareAsyncScheduler` instead. Subclasses are built as they are.
    """

    def __new__(cls, *args: Any, **kwargs: Any):
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        if cls is TenantAwareScheduler and vllm_config.scheduler_config.async_scheduling:
            cls = TenantAwareAsyncScheduler
        return super().__new__(cls)


class TenantAwareAsyncScheduler(TenantAwareScheduler, AsyncScheduler):
    """kvlease on vLLM's async scheduler (what `TenantAwareScheduler` becomes where
    vLLM schedules asynchronously)."""
