"""Everything kvlease keeps on a vLLM scheduler, in one object: `scheduler.kvlease`.

The scheduler adapter (`kvlease.engine.vllm_scheduler`) subclasses vLLM's scheduler, so
every attribute it set would live in vLLM's own namespace, where a later vLLM could
define the same name. It sets one, `kvlease`, an instance of `KvleaseState`; the
containers it replaces for vLLM (`running`, `waiting`, `deferred_frees`) stay vLLM's.

Nothing here imports vLLM. The replay and the benchmarks read this object: its
attributes are read-only to them, its queries (`fair_share_rows`, `held_blocks`) never
mutate, and the one settlement that does (`settle_fair_share`) is its own call.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from typing import Any

from kvlease.engine.accounting import TenantAccounting
from kvlease.engine.events import EventBuffer, FairShareRow
from kvlease.engine.fairness import FairShare
from kvlease.engine.free_queue import Holder, TenantFreeBlockQueue
from kvlease.engine.labels import TenantLabels
from kvlease.engine.leases import LeaseBook
from kvlease.engine.payback import PaybackTuner
from kvlease.engine.policy import CostModel
from kvlease.engine.reservations import ReservePolicy, ReturnModel
from kvlease.engine.retention import RetentionMeter
from kvlease.engine.settings import SchedulerSettings

Session = tuple[str | None, str | None]  # a session's key: (tenant id, session id)


class KvleaseState:
    """kvlease's state on one scheduler (one data-parallel rank), and its invariants
    (checked by the synthetic and real-engine tests; with `debug_accounting` the block
    books are checked every step):

    - `tenancy`: request id -> `Tenancy`, for exactly the requests vLLM holds (waiting,
      running or preempted); added in `add_request` (or on first sight, for a request
      vLLM's own code puts in `running` directly), removed in `_free_request`. O(1) per
      lookup; memory O(requests).
    - `holders`: (tenant, session) -> `Holder`, the owner of that session's cached blocks
      in the free queue. A holder exists while it has a request in flight, a running
      lease, or cached blocks (`_forget_if_idle` drops it otherwise), so memory is
      O(live sessions + sessions with cached blocks), never O(sessions ever seen).
    - `deferred_owner`: id(blocks list) -> Holder for each deferred free vLLM still
      holds; emptied as vLLM drains them. `delayed`: finished requests whose blocks a
      connector still reads -> their Holder. `awaiting_hit`: leased next turns not yet
      scheduled (their prefix-cache hit is read when they are). Each O(requests concerned).
    - `returns`: turns, returns and think times by session (forgotten with its lease),
      tenant label and tier (kvlease.engine.reservations). `windows`: a heap of
      reservation ends (until, seq, session); an entry whose holder has since renewed
      its window (`reserved_until` differs) is skipped. O(log n) per turn.
    - `payback`: each leasing tier's reservation cap and what its reservation has
      returned and cost (kvlease.engine.payback); O(tiers) a step.
    - `retention`: the open time-between-turns of each leased session, metered into
      reserved and retained block-seconds (kvlease.engine.retention); O(open episodes)
      a sample.
    - `accounting` holds cumulative totals, exact whatever happens to `events`
      (bounded; overflow counted in `events.dropped`; none kept where nothing reads them).
    - `sample_unsent`: a sample was taken (`last_sample`) that the channel has not sent;
      `done_unsent`: a request finished whose `RequestDone` the channel has not sent. The
      end of the step sends either with every event since the last message, so a busy
      engine sends once a sample and once a step that finished a request, not every step.
    - `cause`: the request whose allocation (or admission) is under way: what a
      preemption or eviction it causes is attributed to; None outside one.

    Slots, not a dict: the hot path reads these attributes every allocation.
    """

    __slots__ = (
        "accounting",
        "admissions",
        "allocate",
        "awaiting_hit",
        "block_unit",
        "bucket",
        "caps",
        "cause",
        "clock",
        "cost",
        "deferred_owner",
        "delayed",
        "done_unsent",
        "events",
        "free_queue",
        "holders",
        "kv_caps",
        "label",
        "last_sample",
        "lease_index",
        "leases",
        "offload_available",
        "payback",
        "pool",
        "preempt_reason",
        "publisher",
        "rank",
        "request_blocks",
        "reserve_from",
        "reserve_policy",
        "retention",
        "returns",
        "sample_unsent",
        "seq",
        "settings",
        "shares",
        "step_blocks",
        "steps",
        "tenancy",
        "tenant_tiers",
        "windows",
        "wrapped_allocate",
    )

    def __init__(self, settings: SchedulerSettings, model_name: str, published: bool) -> None:
        tiers = settings.tiers
        self.settings = settings
        self.clock: Callable[[], float] = time.monotonic
        self.leases: LeaseBook[Session] = LeaseBook(clock=lambda: self.clock())
        self.returns = ReturnModel()  # when sessions come back: the reservation window
        override = settings.reserve  # KVLEASE_RESERVE: every tier's mode at once
        self.reserve_policy: dict[str, ReservePolicy] = {
            name: tier.reservation
            if override is None
            else dataclasses.replace(tier.reservation, mode=override)
            for name, tier in tiers.items()
        }
        self.windows: list[tuple[float, int, Session]] = []  # reservation ends, a heap
        self.seq = itertools.count()  # ties in `windows`
        self.retention = RetentionMeter(model_name)
        self.events = EventBuffer(settings.events_kept(published))  # `published`: a channel
        self.accounting = TenantAccounting()
        self.label = TenantLabels.from_env()  # bounded tenant keys for totals and snapshots
        self.tenant_tiers: dict[str, str] = {}  # tenant label -> the tier it last came with
        self.tenancy: dict[str, Any] = {}  # request id -> Tenancy (the adapter's record)
        self.holders: dict[Session, Holder] = {}
        self.admissions = itertools.count()
        self.preempt_reason = "kv_pressure"
        self.last_sample = float("-inf")
        self.sample_unsent = False  # a sample taken since the channel's last message
        self.done_unsent = False  # a RequestDone pushed since the channel's last message
        self.steps = 0  # schedule() calls: generated tokens are charged every CHARGE_STEPS
        self.bucket = {name: i for i, name in enumerate(tiers)}  # tiers in priority order
        self.shares = {name: FairShare() for name in tiers}
        self.deferred_owner: dict[int, Holder | None] = {}  # id(blocks) -> their session
        self.delayed: dict[str, Holder | None] = {}  # finished, blocks kept for a connector
        self.awaiting_hit: dict[str, Any] = {}  # leased next turns not yet scheduled
        self.cause: Any = None
        # Set by the adapter once vLLM's pool exists:
        self.kv_caps: dict[str, int] = {}  # blocks one tenant may hold, per capped tier
        self.pool: Any = None  # vLLM's BlockPool
        self.lease_index: dict[str, int] = {}  # leasing tier -> its free-queue segment
        self.caps: list[int] = []  # leased blocks each leasing tier may keep
        self.reserve_from: dict[str, int] = {}  # tier -> leasing tiers it may take from
        self.payback: PaybackTuner
        self.free_queue: TenantFreeBlockQueue
        self.allocate: Callable[..., Any]  # vLLM's allocate_slots, bound
        self.wrapped_allocate: Callable[..., Any]  # the adapter's, one bound method,
        # compared by identity
        self.step_blocks = 0  # blocks one step can take beyond one per running request
        # A running request's next tokens take no blocks but those they begin (block_unit):
        # the block size on an engine with one KV cache group that counts blocks as vLLM's
        # base manager does; 0 where no bound is that cheap (hybrid models, Mamba), so
        # every allocation takes the full path (the adapter's `_block_unit`).
        self.block_unit = 0
        self.cost = CostModel()
        self.rank = 0  # this engine's data-parallel rank
        self.publisher: Any = None  # the channel to the API processes (None: in-process)
        self.offload_available = False
        # request id -> (blocks it holds, whether it runs): a read of vLLM's block tables
        self.request_blocks: Callable[[str], tuple[int, bool]] = lambda _: (0, False)

    # -- queries: never mutate -------------------------------------------------

    def fair_share_rows(self) -> list[FairShareRow]:
        """Every tracked tenant's counter, and each waiting tenant's fair-share ratio since
        the last settlement."""
        return self._fair_share_rows({tier: s.shares() for tier, s in self.shares.items()})

    def _fair_share_rows(
        self, waiting_by_tier: dict[str, dict[str, tuple[float, float, float]]]
    ) -> list[FairShareRow]:
        rows = []
        for tier, share in self.shares.items():
            waiting = waiting_by_tier[tier]
            for tenant, account in share.accounts.items():
                ratio = None
                if tenant in waiting:
                    _, served, entitled = waiting[tenant]
                    ratio = served / entitled if entitled > 0 else None
                rows.append(
                    FairShareRow(
                        tenant_id=self.label(tenant),
                        tier=tier,
                        counter=account.counter,
                        ratio=ratio,
                        waiting=account.waiting,
                    )
                )
        return rows

    def held_blocks(self, account: Any) -> tuple[int, bool]:
        """Blocks a tenant holds in one tier (its requests' blocks and the leased blocks of
        their sessions), and whether any of its requests runs. O(its requests); only tiers
        with a `max_tenant_kv_share` below 1 ask."""
        held, runs, holders = 0, False, set()
        for request_id in account.requests:
            blocks, running = self.request_blocks(request_id)
            held += blocks
            runs = runs or running
            holder = self.tenancy[request_id].holder
            if holder is not None and holder not in holders:
                holders.add(holder)
                held += holder.leased
        return held, runs

    # -- settlement ------------------------------------------------------------

    def settle_fair_share(self) -> list[FairShareRow]:
        """Add each waiting tenant's service and entitlement since the last settlement to
        the cumulative totals (`accounting.fair_share_tokens`), and start anew; the rows
        `fair_share_rows` gave just before (a snapshot reads them from here, so each
        window's shares are worked out once)."""
        books = self.accounting.fair_share_tokens
        settled = {}
        for tier, share in self.shares.items():
            for tenant in share.accounts:
                books.setdefault((self.label(tenant), tier), [0.0, 0.0])  # a series from start
            settled[tier] = share.settle()
            for tenant, (_, served, entitled) in settled[tier].items():
                book = books.setdefault((self.label(tenant), tier), [0.0, 0.0])  # or forgotten
                book[0] += served
                book[1] += entitled
        return self._fair_share_rows(settled)
