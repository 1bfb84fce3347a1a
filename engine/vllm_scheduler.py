"""kvlease inside vLLM 0.32's V1 scheduler: the scheduler adapter.

One of the modules that import vLLM (the README's architecture lists them;
tests/test_layers.py keeps the list true). The policy it applies lives in plain Python
(`policy`, `leases`, `free_queue`, `waiting_queue` in `kvlease.engine`).

Load it with `scheduler_cls="kvlease.engine.vllm_scheduler.TenantAwareScheduler"`; where
vLLM schedules asynchronously that builds `TenantAwareAsyncScheduler`. It overrides
as little of vLLM as it can and copies none of `schedule()`:

- `running` is served in `kvlease.engine.policy.service_key` order: class, then admission
  (FCFS within a class, as vLLM appends). vLLM's FCFS preemption takes
  `running[-1]`, so it always takes from the lowest class; when an allocation fails,
  the adapter first moves that class's cheapest victim (`kvlease.engine.policy.keep_key`)
  to the end. Service order is never re-sorted for victims.
- `waiting` is a `TenantWaitingQueue`: tier order, then vLLM's own queue per tier
  (FCFS, or priority under `--scheduling-policy priority`).
- Before delegating to `Scheduler.schedule()`, a waiting request of a higher
  class than the worst running one may preempt running lower-class requests
  for the blocks it lacks after its prefix-cache hit. Those victims sit out
  the step, so they are not re-admitted in it.
- The block pool's free queue becomes a `TenantFreeBlockQueue`: leased prefixes
  are evicted last, and while a request allocates, the prefixes more important
  tiers reserve are hidden from it (unless nothing else runs). A session's
  prefix is reserved after a turn only for its window (`kvlease.engine.reservations`,
  decided in `_end_turn`), then retained until its lease ends. Each tier's
  reservation cap shrinks while it turns away more work than its reuse saves
  (`kvlease.engine.payback`: refusals counted in `_allocate_leasing`, caps set in `schedule`).
- `_preempt_request`, `_free_request`, `_free_request_blocks` and the deferred
  frees are wrapped to record events, leases and accounting.
"""

from __future__ import annotations

import bisect
import heapq
import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from itertools import compress
from typing import TYPE_CHECKING, Any, cast

from kvlease.engine.runtime import require_vllm

require_vllm()  # a clear error before any vLLM internals are touched

from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.request_queue import (  # noqa: E402
    RequestQueue,
    SchedulingPolicy,
    create_request_queue,
)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from kvlease.engine import channel, processes, snapshot  # noqa: E402
from kvlease.engine.channel import Publisher  # noqa: E402
from kvlease.engine.events import (  # noqa: E402
    NO_CAUSE,
    EngineState,
    Eviction,
    LeaseEvent,
    Message,
    Preemption,
    RequestDone,
)
from kvlease.engine.fairness import INPUT_COST, OUTPUT_COST, Account  # noqa: E402
from kvlease.engine.free_queue import Holder, TenantFreeBlockQueue  # noqa: E402
from kvlease.engine.labels import UNCLASSIFIED  # noqa: E402
from kvlease.engine.payback import PaybackTuner  # noqa: E402
from kvlease.engine.policy import (  # noqa: E402
    Candidate,
    CostModel,
    admission_victims,
    blocks_for,
    leases_yield,
    may_take,
    preemption_mode,
    service_key,
    victim_class,
    within_class_key,
)
from kvlease.engine.reservations import ReturnModel  # noqa: E402
from kvlease.engine.scheduler_state import KvleaseState, Session  # noqa: E402
from kvlease.engine.settings import SchedulerSettings, SettingsError  # noqa: E402
from kvlease.engine.waiting_queue import FairBucket, TenantWaitingQueue  # noqa: E402

logger = logging.getLogger("kvlease.scheduler")
RUNNING = RequestStatus.RUNNING

# The vLLM surface this adapter relies on beyond vLLM's documented `scheduler_cls` hook:
# every private name, replaced container and behaviour, and why. Each row is checked on
# vLLM 0.32.0 and 0.33.0 (tests/test_vllm_surface.py; `make test-vllm-next`): a name
# must exist, a method must take these leading parameters, a behaviour must still be
# in the named source. Read it before upgrading vLLM.
# (where, what, leading parameters or source text, why)
VLLM_SURFACE: tuple[tuple[str, str, tuple[str, ...], str], ...] = (
    # methods kvlease overrides or calls
    ("Scheduler", "_preempt_request", ("request", "timestamp", "drop_stale_output"),
     "every preemption passes here: wrapped to record events, leases and accounting"),
    ("Scheduler", "_free_request", ("request", "delay_free_blocks"),
     "a request's end: its session's lease and turn are closed here"),
    ("Scheduler", "_free_request_blocks", ("request",),
     "its blocks go back to the pool: filed under the session that held them"),
    ("Scheduler", "_request_blocks_can_be_freed", ("request",),
     "called: whether a finished request's blocks go now or are deferred"),
    ("Scheduler", "schedule", (), "overridden: admission preemption, then vLLM's own"),
    ("Scheduler", "update_from_output", ("scheduler_output", "model_runner_output"),
     "overridden: vLLM replaces `running` with a plain list in it"),
    ("Scheduler", "finish_requests", ("request_ids", "finished_status"),
     "overridden: vLLM replaces `running` with a plain list in it"),
    ("Scheduler", "reset_prefix_cache", (), "overridden: its preemptions say `cache_reset`"),
    ("KVCacheManager", "allocate_slots", ("request", "num_new_tokens",
     "num_new_computed_tokens", "new_computed_blocks", "num_lookahead_tokens"),
     "rebound each step to kvlease's wrapper, which reads args[0] and num_lookahead_tokens"),
    ("KVCacheManager", "get_computed_blocks", ("request",),
     "a waiting head's prefix-cache hit, for the blocks it lacks"),
    ("FreeKVCacheBlockQueue", "popleft", (), "the free queue kvlease replaces keeps its API"),
    ("FreeKVCacheBlockQueue", "popleft_n", ("n",), "the same"),
    ("FreeKVCacheBlockQueue", "remove", ("block",), "the same"),
    ("FreeKVCacheBlockQueue", "append", ("block",), "the same"),
    ("FreeKVCacheBlockQueue", "append_n", ("blocks",), "the same"),
    ("FreeKVCacheBlockQueue", "prepend_n", ("blocks",), "the same"),
    ("FreeKVCacheBlockQueue", "get_all_free_blocks", (), "the same"),
    ("request_queue", "create_request_queue", ("policy",),
     "builds vLLM's own queue inside each tier's bucket"),
    # attributes of a built scheduler that kvlease reads or replaces
    ("scheduler", "running", (), "replaced by _RunningList, kept in service order"),
    ("scheduler", "waiting", (), "replaced by TenantWaitingQueue (a RequestQueue)"),
    ("scheduler", "deferred_frees", (), "replaced by _DeferredFrees; see the behaviour below"),
    ("scheduler", "requests", (), "request id -> Request"),
    ("scheduler", "policy", (), "SchedulingPolicy: FCFS victims are kvlease's to place"),
    ("scheduler", "max_num_scheduled_tokens", (), "a step's token budget, in blocks"),
    ("scheduler", "num_lookahead_tokens", (), "blocks a waiting head needs"),
    ("scheduler", "max_num_active_reqs", (), "a slot-short step admits nobody"),
    ("scheduler", "requires_kv_delivery", (), "passed on as drop_stale_output"),
    ("kv_cache_manager", "block_pool", (), "its free_block_queue is replaced"),
    ("kv_cache_manager", "coordinator", (), "coordinator.get_blocks(request id): blocks held; "
     "single_type_managers: one manager of the base kind allows the cheap bound"),
    ("SingleTypeKVCacheManager", "get_num_blocks_to_allocate", ("request_id", "num_tokens"),
     "the base count, cdiv(tokens, block_size) less those held, is the cheap bound's"),
    ("SingleTypeKVCacheManager", "allocate_new_blocks", ("request_id", "num_tokens"),
     "the same"),
    ("kv_cache_manager", "watermark_blocks", (), "part of a step's worst case"),
    ("block_pool", "free_block_queue", (), "replaced by TenantFreeBlockQueue"),
    ("block_pool", "blocks", (), "the pool's size, for the replacement queue"),
    ("block_pool", "num_gpu_blocks", (), "the pool, null block included"),
    # a step's output: which request each new block went to (evictions' cause)
    ("SchedulerOutput", "scheduled_new_reqs", (), "NewRequestData per newly scheduled request"),
    ("SchedulerOutput", "scheduled_cached_reqs", (), "CachedRequestData of the others"),
    ("NewRequestData", "req_id", (), "the request its block_ids went to"),
    ("NewRequestData", "block_ids", (), "every block it holds: one list per KV cache group"),
    ("CachedRequestData", "req_ids", (), "in step with new_block_ids"),
    ("CachedRequestData", "new_block_ids", (), "the blocks each got this step (or None)"),
    ("ParallelConfig", "_api_process_count", (),
     "how many API processes get every message (read with a default of 1)"),
    ("ParallelConfig", "data_parallel_index", (),
     "this engine's rank (read with data_parallel_rank as the default)"),
    # behaviours: source text that must still be there
    ("Scheduler.schedule", "behaviour", ("self.running[-1]",),
     "FCFS preemption takes running[-1]: kvlease moves its victim there"),
    ("Scheduler", "behaviour", ("self.deferred_frees.popleft()",),
     "vLLM drains deferred frees with popleft(): _DeferredFrees files each entry's "
     "blocks (keyed by id(list)) under their session as it pops"),
    ("Scheduler", "behaviour", ("self.running = ",),
     "vLLM rebinds running to a plain list: kvlease wraps it again after those calls"),
    ("Request", "behaviour", ("return len(self._all_token_ids)",),
     "num_tokens is _all_token_ids' length: `_may_run_short` reads it without the property"),
    ("scheduler", "num_spec_tokens", (), "speculative decoding: each request's drafts count"),
    ("Scheduler.schedule", "behaviour", ("request.num_tokens_with_spec",
     "+ request.num_output_placeholders", "- request.num_computed_tokens"),
     "a running request's next tokens: the sharper bound of `_may_run_short` counts them so"),
    ("SingleTypeKVCacheManager.get_num_blocks_to_allocate", "behaviour",
     ("cdiv(num_tokens, self.block_size)",), "the cheap bound is this count's"),
)  # fmt: skip

RequestQueue.register(TenantWaitingQueue)


@dataclass(slots=True)
class Tenancy:
    """What kvlease knows about one request, from its `SamplingParams.extra_args`."""

    tenant_id: str | None
    tier: str | None
    session_id: str | None
    victim_class: tuple[int, int, int]  # kvlease.engine.policy.victim_class
    bucket: int  # its waiting-queue bucket: tier order, unclassified last
    holder: Holder | None
    reserve_from: int  # leasing tiers whose reservations it may take (free queue `reserve`)
    key: tuple  # kvlease.engine.policy.service_key, renewed at each admission into `running`
    lease_covered: int = 0  # prefix tokens of its session's last context a lease was keeping
    lease_reserved: bool = False  # it came back inside its session's reservation window
    lease_cached: int = -1  # its prefix-cache hit when first scheduled (-1: not yet)
    recomputed_tokens: int = 0
    recomputed_by: dict[str, int] | None = None  # those tokens by the tier that caused them
    offloaded_blocks: int = 0  # set while preempted in "offload" mode
    account: Account | None = None  # its tenant's fair-share account in its tier
    charged_until: int = 0  # its tokens charged to the account so far (prompt at admission)
    admitted: bool = False  # admitted into `running` at least once

    @property
    def session(self) -> Session:
        return (self.tenant_id, self.session_id)

    @property
    def cause(self) -> tuple[str, str | None]:
        """(tier, tenant), as a preemption or eviction names what it made room for."""
        return self.tier or UNCLASSIFIED, self.tenant_id

    def candidate(self, request: Request, counter: float) -> Candidate:
        return Candidate(
            classified=self.tenant_id is not None,
            leased=self.victim_class[1] == 0,
            tier_priority=self.victim_class[2],
            last_activity=request.arrival_time,
            computed_tokens=request.num_computed_tokens,
            seq=self.key[1],
            counter=counter,
        )


CHARGE_STEPS = 8  # generated tokens reach the fair-share counters every this many steps
_ONE_CLASS = (0, 0, 0)  # every request's service class with class-ordered service off


class _RunningList(list):
    """vLLM's `running`, in `kvlease.engine.policy.service_key` order (class, then admission).

    `append` is vLLM's admission of a waiting request: the scheduler gives it its key,
    and it goes behind every request of its class. That is O(1) when its class is the
    last one present (always, on an engine with no tenants) and otherwise an
    O(log n) search plus an O(n) memmove. Keys live on the `Tenancy`, so nothing
    is allocated per lookup.
    """

    __slots__ = ("_admit", "_key")

    def __init__(self, admit, key, items=()) -> None:
        super().__init__(items)
        self._admit = admit
        self._key = key

    def append(self, request: Request) -> None:
        key = self._admit(request)
        if not self or key >= self._key(self[-1]):
            list.append(self, request)
        else:
            bisect.insort(self, request, key=self._key)


class _DeferredFrees(deque):
    """vLLM's deferred block frees, `(fence, blocks)` entries; `popleft` tells the
    scheduler which entry vLLM is about to return to the pool, so its blocks are
    filed under the session that held them."""

    def __init__(self, on_pop) -> None:
        super().__init__()
        self._on_pop = on_pop

    def popleft(self):
        entry = super().popleft()
        self._on_pop(entry)
        return entry


# For the type checker the mixin is a Scheduler (it only ever runs as one); at run time
# it is a plain mixin, applied to both of vLLM's scheduler classes.
if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput

    _SchedulerBase = Scheduler
else:
    _SchedulerBase = object


class TenantSchedulingMixin(_SchedulerBase):
    """Tenant-aware preemption, lease reservations and accounting for a vLLM Scheduler.

    Its state is one attribute, `self.kvlease` (`KvleaseState`: its fields and their
    invariants are listed there), so nothing of kvlease's lands in vLLM's namespace but
    that name and the containers it replaces for vLLM:
    - `running`: a `_RunningList` in service order (class, then admission). Admission is
      O(1) when the request joins the last class present, else O(log n) + memmove. The
      victim is chosen only when vLLM's allocation fails: O(requests of the lowest class).
    - `waiting`: a `TenantWaitingQueue` (tier order, then vLLM's queue per tier): add and
      prepend O(1) (FCFS) or O(log n) (priority), peek and pop O(tiers) more.
    - `deferred_frees`: a `_DeferredFrees`, telling the state whose blocks vLLM returns.
    Per step the mixin adds O(1) work (plus one wrapper call per allocation in a step that
    may run short, and O(new blocks) in a step that evicted cached blocks); the admission
    check looks past `running[-1]` only when a lower class runs than the waiting head;
    sampling walks held blocks every `sample_seconds`, off the per-step path.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        processes.stop_with_parent()  # this engine core ends with the process that started it
        additional = self.vllm_config.additional_config
        settings = SchedulerSettings.load(additional if isinstance(additional, dict) else None)
        model_name = self.vllm_config.model_config.served_model_name
        assert isinstance(model_name, str)  # ModelConfig keeps the first of a list
        kv = self.kvlease = KvleaseState(settings, model_name, channel.configured())
        tiers = settings.tiers
        pool = kv.pool = self.kv_cache_manager.block_pool
        usable = pool.num_gpu_blocks - 1  # vLLM's null block is never handed out
        request_blocks = blocks_for(self.max_model_len, self.block_size)

        # vLLM's policy stays: each tenant's waiting requests are in its order, and under
        # PRIORITY vLLM picks its own victims by (priority, arrival) as stock does.
        # Within a tier, tenants take turns by fair share (kvlease.engine.fairness).
        kv.kv_caps = tiers.tenant_kv_caps(usable)
        self.waiting = TenantWaitingQueue(  # type: ignore[assignment]  # a virtual RequestQueue
            self._bucket_of, len(tiers) + 1, self._make_bucket
        )
        self.running = _RunningList(self._admitted, self._service_key)

        caps = tiers.leased_caps(usable)  # least important leasing tier first
        kv.lease_index = {name: i for i, name in enumerate(caps)}
        kv.caps = list(caps.values())
        kv.reserve_from = {  # a tier's requests may take the reservations of these tiers
            tier.name: sum(1 for name in caps if may_take(tier.priority, tiers[name].priority))
            for tier in tiers.values()
        }
        self._check_pool(usable, request_blocks)
        paybacks = [kv.reserve_policy[name].min_payback for name in caps]
        if not settings.reserve_payback:
            paybacks = [0.0] * len(paybacks)
        kv.payback = PaybackTuner(kv.caps, self.block_size, paybacks)
        kv.free_queue = self._install_free_queue()
        kv.allocate = self.kv_cache_manager.allocate_slots  # vLLM's, bound
        kv.wrapped_allocate = self._allocate_slots  # one bound method, compared by identity
        kv.request_blocks = self._request_blocks
        # Blocks one step can take beyond one per running request: its token budget, the
        # watermark and one whole request's prefix-cache hit.
        kv.step_blocks = (
            blocks_for(self.max_num_scheduled_tokens, self.block_size)
            + self.kv_cache_manager.watermark_blocks
            + request_blocks
        )
        kv.block_unit = _block_unit(self.kv_cache_manager.coordinator.single_type_managers)
        self.deferred_frees = _DeferredFrees(self._deferred_popped)
        kv.cost = _cost_model(self.vllm_config, settings)
        parallel = self.vllm_config.parallel_config
        # This engine's data-parallel rank: vLLM resets data_parallel_rank to 0 on each
        # independent (non-MoE) rank and keeps the rank in data_parallel_index.
        kv.rank = getattr(parallel, "data_parallel_index", parallel.data_parallel_rank)
        # vLLM's count of API processes (`--api-server-count`): each gets every message.
        api_servers = getattr(parallel, "_api_process_count", 1)
        kv.publisher = Publisher.from_env(api_servers, kv.events.capacity)
        kv.offload_available = self.vllm_config.kv_transfer_config is not None
        logger.info(
            "kvlease scheduler (rank %d): tiers %s, victim rule %s, pool %d blocks, leased caps %s",
            kv.rank,
            list(tiers),
            settings.victim_rule.value,
            usable,
            dict(zip(kv.lease_index, kv.caps, strict=True)),
        )
        if kv.publisher is not None:
            self._publish(fresh=True)  # so /admin/state answers before the first step

    def _check_pool(self, usable: int, request_blocks: int) -> None:
        """Refuse caps that leave a tenant, or the blocks no lease can hold, less than one
        `max_model_len` request (`TierTable.pool_error`, as `kvlease serve` checks first).

        vLLM's engine refuses to start unless the pool holds one `max_model_len` request;
        kvlease asks the same of the blocks no lease can hold. A scheduler built by hand on
        a pool smaller than one request (vLLM's unit tests do) cannot keep that bound with
        any lease at all: there leases reserve nothing, and the log says so.
        """
        kv = self.kvlease
        tiers = kv.settings.tiers
        if request_blocks > usable:
            error = tiers.tenant_caps_error(usable, request_blocks)
            if error is not None:
                raise SettingsError(error)
            if any(kv.caps):
                logger.warning(
                    "kvlease: %d KV blocks hold less than one max_model_len request (%d "
                    "blocks); leases reserve nothing on this pool",
                    usable,
                    request_blocks,
                )
            kv.caps = [0] * len(kv.caps)
            return
        error = tiers.pool_error(usable, request_blocks)
        if error is not None:
            raise SettingsError(error)

    def _install_free_queue(self) -> TenantFreeBlockQueue:
        """Replace the pool's free queue with a tenant queue holding the same blocks, in order."""
        kv = self.kvlease
        pool = kv.pool
        queue = TenantFreeBlockQueue.replacing(
            pool.free_block_queue,
            len(pool.blocks),
            kv.payback.caps,
            kv.settings.lease_order,
        )
        kv.payback.rebase(queue.reserved_left, queue.reserved_reused)  # it counts anew
        pool.free_block_queue = queue
        return queue

    def _make_bucket(self, bucket: int) -> Any:
        """Bucket `bucket`'s waiting queue: per tenant by fair share for a tier (unless
        `fair_share` is off), vLLM's own queue for unclassified requests."""
        kv = self.kvlease
        tiers = list(kv.settings.tiers)
        vllm_queue = lambda: create_request_queue(self.policy)  # noqa: E731
        if bucket >= len(tiers) or not kv.settings.fair_share:
            return vllm_queue()
        tier = tiers[bucket]
        skip = self._at_kv_cap if tier in kv.kv_caps else None
        return FairBucket(
            kv.shares[tier], self._account_of, vllm_queue, skip, kv.settings.fair_slack
        )

    def _account_of(self, request: Request) -> Account:
        account = self._tenancy_of(request).account
        assert account is not None, "only classified requests wait in a tier's bucket"
        return account

    # -- per-tenant KV cap -------------------------------------------------------

    def _request_blocks(self, request_id: str) -> tuple[int, bool]:
        """Blocks the request holds and whether it runs (`KvleaseState.held_blocks`)."""
        request = self.requests[request_id]
        return self._num_blocks(request), request.status is RUNNING

    def _over_kv_cap(self, t: Tenancy, new_blocks: int) -> bool:
        """Would `new_blocks` more take the tenant past its tier's cap? A tenant with
        nothing running is never held back (the cap holds one max_model_len request), so
        a capped tenant always makes progress and never waits on itself."""
        kv = self.kvlease
        assert t.account is not None and t.tier is not None
        held, runs = kv.held_blocks(t.account)
        return runs and held + new_blocks > kv.kv_caps[t.tier]

    def _at_kv_cap(self, account: Account, head: Request) -> bool:
        """Skip this tenant's waiting head for now (`FairBucket`): it would pass the cap."""
        t = self._tenancy_of(head)
        return self._over_kv_cap(t, blocks_for(head.num_tokens, self.block_size))

    # -- the running list ----------------------------------------------------

    def _keep_running_list(self) -> None:
        """vLLM replaces `running` with a plain list when it filters out finished requests
        (in `update_from_output` and `finish_requests`); wrap it again, order intact.
        A plain attribute, not a property: vLLM reads `running` thousands of times a step."""
        if type(self.running) is not _RunningList:
            self.running = _RunningList(self._admitted, self._service_key, self.running)

    def _service_class(self, klass: tuple[int, int, int]) -> tuple[int, int, int]:
        """The class `running` is served in: the request's own, or one for every request
        with class-ordered service off (an ablation: vLLM's first come, first served)."""
        return klass if self.kvlease.settings.class_service else _ONE_CLASS

    def _service_key(self, request: Request) -> tuple:
        t = self.kvlease.tenancy.get(request.request_id) or self._tenancy_of(request)
        return t.key

    def _admitted(self, request: Request) -> tuple:
        """vLLM admits `request` into `running`: give it its place (behind its class)."""
        t = self._tenancy_of(request)
        self._restore_offloaded(t)
        self._no_longer_returning(t)
        t.key = service_key(self._service_class(t.victim_class), next(self.kvlease.admissions))
        if t.account is not None:  # the prompt (or what a preemption lost) is charged now,
            # so the next admission in this step already sees it (VTC charges at dispatch)
            t.account.charge(INPUT_COST * (request.num_tokens - request.num_computed_tokens))
            t.charged_until = request.num_tokens
        return t.key

    def _restore_offloaded(self, t: Tenancy) -> None:
        """An offloaded request is running again (or gone): its blocks are no longer off-device."""
        kv = self.kvlease
        if t.offloaded_blocks:
            kv.accounting.offloaded_blocks[kv.label(t.tenant_id)] -= t.offloaded_blocks
            t.offloaded_blocks = 0

    def _bucket_of(self, request: Request) -> int:
        return self._tenancy_of(request).bucket

    def _tenancy_of(self, request: Request) -> Tenancy:
        kv = self.kvlease
        t = kv.tenancy.get(request.request_id)
        if t is None:  # vLLM's own code (or a test) put it in a queue without add_request
            t = kv.tenancy[request.request_id] = self._classify(request)
        return t

    # -- requests in -----------------------------------------------------------

    def add_request(self, request: Request) -> None:
        kv = self.kvlease
        if request.request_id not in kv.tenancy:
            self._expire_leases()
            kv.tenancy[request.request_id] = self._classify(request)
        super().add_request(request)

    def _classify(self, request: Request) -> Tenancy:
        kv = self.kvlease
        args = (request.sampling_params.extra_args or {}) if request.sampling_params else {}
        tenant_id, tier_name = args.get("tenant_id"), args.get("tier")
        session_id = args.get("session_id")
        tiers = kv.settings.tiers
        tier = tiers.tiers.get(tier_name) if isinstance(tier_name, str) else None
        if not (isinstance(tenant_id, str) and tenant_id) or tier is None:
            if tenant_id is not None:
                logger.warning(
                    "request %s: tenant fields %r are incomplete or name an unknown tier; "
                    "treating it as unclassified",
                    request.request_id,
                    {k: args.get(k) for k in ("tenant_id", "tier", "session_id")},
                )
            klass = victim_class(False, False, 0)
            key = service_key(self._service_class(klass), next(kv.admissions))
            return Tenancy(
                tenant_id=None,
                tier=None,
                session_id=None,
                victim_class=klass,
                bucket=len(tiers),
                holder=None,
                reserve_from=0,
                key=key,
            )
        session_id = session_id if isinstance(session_id, str) else None
        kv.tenant_tiers[kv.label(tenant_id)] = tier.name
        klass = victim_class(True, tier.lease_seconds > 0, tier.priority)
        tenancy = Tenancy(
            tenant_id=tenant_id,
            tier=tier.name,
            session_id=session_id,
            victim_class=klass,
            bucket=kv.bucket[tier.name],
            holder=None,
            reserve_from=kv.reserve_from[tier.name],
            key=service_key(self._service_class(klass), next(kv.admissions)),
        )
        holder = kv.holders.get(tenancy.session)
        if holder is None:
            holder = kv.holders[tenancy.session] = Holder(
                tenant_id, tier.name, session_id, kv.lease_index.get(tier.name)
            )
        holder.in_flight += 1
        holder.returning += 1
        tenancy.holder = holder
        if holder.in_flight == 1:
            self._close_retention(holder)  # its next turn: the blocks are in use again
        tenancy.account = kv.shares[tier.name].account(
            tenant_id, tier.tenant_weight(args.get("weight")), request.request_id
        )
        change = kv.leases.request_started(tenancy.session, tier.lease_seconds)
        if change is not None:
            if change.kind == "renew":
                if holder.in_flight == 1:  # back between turns: how long it took
                    label = kv.label(tenant_id)
                    kv.returns.turn_started(tenancy.session, label, tier.name, change.at)
                tenancy.lease_covered = self._lease_covered(holder, request)
                tenancy.lease_reserved = holder.reserving  # `_expire_leases` ran first
                if tenancy.lease_covered:
                    kv.awaiting_hit[request.request_id] = tenancy
            holder.protected = True
            self._lease_event(holder, change.kind, change.expires_at, change.at, request)
        return tenancy

    def _lease_covered(self, holder: Holder, request: Request) -> int:
        """Prefix tokens of `request` that its session's running lease was keeping: the
        blocks it shares with the session's last context, up to what a prefix-cache hit
        can serve (vLLM always computes the last prompt token). O(blocks)."""
        last = holder.last_hashes
        if not last:
            return 0
        hashes = request.block_hashes
        limit = min(len(last), len(hashes), (request.num_prompt_tokens - 1) // self.block_size)
        shared = 0
        while shared < limit and last[shared] == hashes[shared]:
            shared += 1
        return shared * self.block_size

    # -- scheduling ------------------------------------------------------------

    def schedule(self, *args: Any, **kwargs: Any):
        kv = self.kvlease
        self._expire_leases()  # first: windows and leases end at their own times
        queue = kv.free_queue
        if kv.payback.update(queue.reserved_left, queue.reserved_reused):
            queue.set_caps(kv.payback.caps)
        if kv.clock() - kv.last_sample >= kv.settings.sample_seconds:
            # Close the interval before this step allocates: after an idle spell the
            # holdings now are what the idle engine held, not what this step will take.
            self.sample_accounting()
        self._keep_running_list()
        held = self._make_room_for_waiting()
        try:
            # after the room-making: its victims' blocks may have joined a reservation
            self._choose_allocator()
            output = super().schedule(*args, **kwargs)
        finally:
            if held:
                self.waiting.prepend_requests(held)
        kv.steps += 1
        if kv.steps % CHARGE_STEPS == 0:
            self._charge_running()
        if kv.awaiting_hit:
            self._note_lease_hits()
        self._report_evictions(output)
        kv.cause = kv.free_queue.taker = None  # no request outlives its step here
        return output

    def _charge_running(self, ahead: int = 0) -> None:
        """Charge the generated tokens of every running request to its tenant (the prompt
        was charged at admission, `_admitted`). Every CHARGE_STEPS steps, and for one request
        when it is preempted or finishes, so its tokens are all charged: between two, an
        admission sees each running request's last few tokens uncharged (VTC's bound grows
        by that much), for an eighth of the per-step cost. `ahead`: tokens each has computed
        beyond `num_computed_tokens` (`account_stride`). O(running requests), one charge
        per tenant: the tokens are summed first (charges add up; fairness.Account)."""
        tenancy = self.kvlease.tenancy
        tokens: dict[Account, int] = {}
        for request in self.running:
            t = tenancy.get(request.request_id)
            if t is None or t.account is None:
                continue
            computed = request.num_computed_tokens + ahead
            new = computed - t.charged_until  # generated since its last charge
            if new > 0:
                t.charged_until = computed
                tokens[t.account] = tokens.get(t.account, 0) + new
        for account, new in tokens.items():
            account.charge(OUTPUT_COST * new)

    @staticmethod
    def _charge(request: Request, t: Tenancy, ahead: int = 0) -> None:
        """Charge what `request` generated since its last charge, up to its computed
        tokens plus `ahead`."""
        account = t.account
        if account is not None:
            computed = request.num_computed_tokens + ahead
            new = computed - t.charged_until  # generated since last charge
            if new > 0:
                account.charge(OUTPUT_COST * new)
                t.charged_until = computed

    def account_stride(self, steps: int) -> None:
        """The last `schedule()` stood for `steps` engine steps in which every running
        request decoded one token a step (`kvlease replay`'s strides, which compute a
        stride's tokens at the next step): count those steps, and charge fair share as
        their schedule() calls would have, up to the last CHARGE_STEPS step among them, so
        the next admission sees the counters the engine would. O(running requests)."""
        kv = self.kvlease
        first = kv.steps  # the stride's first step, already counted
        kv.steps += steps - 1
        last = kv.steps - kv.steps % CHARGE_STEPS
        if last > first:  # at step `last` each had computed `last - first` tokens more
            self._charge_running(ahead=last - first)

    def _note_lease_hits(self) -> None:
        """A leased next turn just scheduled for the first time: keep its prefix-cache hit
        (vLLM's own figure, which it hands on with the first token)."""
        kv = self.kvlease
        for request_id, t in list(kv.awaiting_hit.items()):
            request = self.requests.get(request_id)
            if request is None or request.status is not RUNNING or request.prefill_stats is None:
                continue
            t.lease_cached = request.prefill_stats.num_cached_tokens
            del kv.awaiting_hit[request_id]

    def update_from_output(self, *args: Any, **kwargs: Any):
        kv = self.kvlease
        outputs = super().update_from_output(*args, **kwargs)
        self._keep_running_list()
        # Sample on the clock, and whenever the engine goes idle: no step follows
        # to report the final picture.
        if (
            kv.settings.debug_accounting
            or kv.clock() - kv.last_sample >= kv.settings.sample_seconds
            or not self.has_requests()
        ):
            self.sample_accounting()
        if kv.publisher is not None and (kv.sample_unsent or kv.done_unsent):
            self._publish()
        return outputs

    def finish_requests(self, *args: Any, **kwargs: Any):
        """Aborts (and stop strings the API process found) arrive here, between steps:
        their usage records are waited for, so their events go now."""
        finished = super().finish_requests(*args, **kwargs)
        self._keep_running_list()
        if self.kvlease.publisher is not None and finished:
            self._publish(fresh=not self.has_requests())
        return finished

    def _publish(self, fresh: bool = False) -> None:
        """Send the events since the last message to the API processes, with the state
        when a sample has been taken since (`fresh`: take one now).

        Called at the end of a step that took a sample (every `sample_seconds`, and at
        idle) or finished a request, not at every step: each send wakes the API
        process's receiver, and evictions, preemptions and lease changes are no more use
        to it a step early. A finished request's `RequestDone` is: its response holds
        its last byte until its usage record, which needs it, has committed.
        """
        kv = self.kvlease
        state = self.state(sample=fresh) if fresh or kv.sample_unsent else None
        message = Message(kv.events.drain(), state, kv.rank)
        kv.sample_unsent = kv.done_unsent = False
        kv.events.dropped += kv.publisher.publish(message)

    # -- allocation: lease reservations and the victim -------------------------

    def _choose_allocator(self) -> None:
        """Use kvlease's allocation wrapper only in steps where it can matter: where this
        step could run out of blocks no lease holds (so a reservation or a victim choice
        could come into play). Otherwise vLLM allocates exactly as stock, at stock cost,
        and the step's evictions are attributed from its output (`_report_evictions`).

        Two bounds, the cheap one first. A step takes at most one block per running
        request plus `step_blocks`: with that many free unreserved blocks nothing can run
        short. Under pressure that is rarely so, and the sharper bound decides: the blocks
        the running requests' next tokens can begin (`_may_run_short`; most decodes
        begin none). Within it no running allocation fails, so vLLM preempts nobody and no
        block changes hands within the step; admissions then need the wrapper only to keep
        them off reserved blocks, when some are reserved and a step's worth more may not
        fit. The wrapper is a frame on each of vLLM's calls, one per running request a
        step (a third of kvlease's extra scheduler work under pressure): the sharper bound
        spares it in most steps under steady pressure, for one pass over `running`."""
        kv = self.kvlease
        manager = self.kv_cache_manager
        if manager.allocate_slots not in (kv.allocate, kv.wrapped_allocate):
            return  # somebody else's wrapper (a test's, a connector's): leave it in place
        free = kv.free_queue.free_unreserved
        tight = free < len(self.running) + kv.step_blocks and self._may_run_short(free)
        manager.allocate_slots = (  # type: ignore[method-assign]  # VLLM_SURFACE: rebound
            kv.wrapped_allocate if tight or kv.kv_caps else kv.allocate
        )

    def _may_run_short(self, free: int) -> bool:
        """Whether this step's allocations may want more than `free` unreserved blocks:
        the blocks the running requests' next tokens can begin (their tokens counted as
        vLLM's `schedule()` counts them, token budget aside), and, where blocks are
        reserved, a step's worth more for the requests it may admit. True without the
        cheap bound (`block_unit` 0).

        O(running requests), ending at the first request past `free`; about 1,100
        instructions a request (callgrind) where a call of the wrapper costs about 2,700.
        Without drafts or placeholders a request's tokens are read as `_all_token_ids`'
        length: reading the `num_tokens_with_spec` property instead cost as much as the
        wrapper calls spared (bytecodes counted), and the same sums in C over `map`s of
        attribute getters cost 1,745 instructions a request (a fifth of this saving)."""
        kv = self.kvlease
        unit = kv.block_unit
        reserved = kv.free_queue.reserved_blocks
        if not unit or (reserved and free < kv.step_blocks):
            return True  # no cheap bound; or admissions alone may reach reserved blocks
        # blocks_for(end) - blocks_for(computed) per request, inline (a hot path)
        need = 0
        if self.num_spec_tokens or self.num_lookahead_tokens or isinstance(self, AsyncScheduler):
            ahead = self.num_lookahead_tokens
            for request in self.running:
                end = request.num_tokens_with_spec + request.num_output_placeholders + ahead
                need += -request.num_computed_tokens // unit - -end // unit
                if need > free:
                    return True
        else:
            for request in self.running:  # VLLM_SURFACE: num_tokens is _all_token_ids' length
                need += -request.num_computed_tokens // unit - -len(request._all_token_ids) // unit
                if need > free:
                    return True
        return bool(reserved) and free < need + kv.step_blocks

    def _allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        *args: Any,
        num_lookahead_tokens: int = 0,
        **kwargs: Any,
    ):
        """vLLM's `allocate_slots` in a step that may run short, noting whose allocation
        evicts: the free queue logs each evicted block with it (a preemption later in the
        step may free a block and hand it on, so the step's output would not say who took
        it from the cache; the log is reported at the end of the step). A running request whose
        next tokens fit in blocks nobody reserves goes to vLLM's call from this one frame:
        there a reservation changes nothing and the allocation cannot fail. One whose tokens
        take no new block (most decodes) is not even noted as the taker: it evicts nothing.
        vLLM makes that call (tokens, lookahead) for every running request every step: it is
        forwarded without packing the arguments again (the frame's cost a call: 0.16 us,
        0.47 us with it).

        The most new blocks the tokens can take (`most`): a running request holds the blocks
        of its computed tokens, so only the blocks its new tokens begin are new, and a decode
        inside its last block takes none, however short the pool (most steps' decodes); a
        waiting request at most tokens // size + 1, its prefix hit aside. 0 `block_unit`: no
        bound that cheap (`_block_unit`), every allocation takes the full path."""
        kv = self.kvlease
        unit = kv.block_unit
        if unit and request.status is RUNNING and not (args or kwargs or kv.kv_caps):
            # vLLM's call for a running request (tokens, lookahead), no KV cap to check.
            # blocks_for(done + tokens) - blocks_for(done), inline (a hot path):
            done = request.num_computed_tokens
            most = -done // unit - -(done + num_new_tokens + num_lookahead_tokens) // unit
            if most:  # it may take blocks: note whose allocation evicts
                queue = kv.free_queue
                kv.cause = request
                queue.taker = request.request_id
                if most > queue.free_unreserved:
                    kwargs["num_lookahead_tokens"] = num_lookahead_tokens
                    return self._allocate_leasing(request, True, most, (num_new_tokens,), kwargs)
            return kv.allocate(request, num_new_tokens, num_lookahead_tokens=num_lookahead_tokens)
        running = request.status is RUNNING  # a waiting request, a capped tier, ...
        if not unit:
            most = 1 << 62
        elif running:
            done = request.num_computed_tokens
            most = -done // unit - -(done + num_new_tokens + num_lookahead_tokens) // unit
        else:
            most = (num_new_tokens + num_lookahead_tokens) // unit + 1
        kv.cause = request
        kv.free_queue.taker = request.request_id
        kwargs["num_lookahead_tokens"] = num_lookahead_tokens
        return self._allocate_leasing(request, running, most, (num_new_tokens, *args), kwargs)

    def _allocate_leasing(
        self, request: Request, running: bool, most: int, args: tuple, kwargs: dict
    ):
        """vLLM's `allocate_slots`, with the leases of more important tiers reserved from
        `request` (unless nothing else runs), and, when a running request gets no blocks,
        the lowest class's cheapest victim moved to where vLLM's FCFS preemption looks."""
        kv = self.kvlease
        queue = kv.free_queue
        if kv.kv_caps and self._refused_by_kv_cap(request, running, args, kwargs):
            return None
        if queue.reserved_blocks and not leases_yield(len(self.running) - running):
            t = kv.tenancy.get(request.request_id) or self._tenancy_of(request)
            queue.reserve(t.reserve_from)
            try:
                blocks = kv.allocate(request, *args, **kwargs)
            finally:
                queue.unreserve()
            if blocks is None and most <= queue.num_free_blocks:  # the reservation refused
                kv.payback.refused(kv.steps, t.reserve_from, queue.reserved_sizes())
        else:  # nothing is reserved: vLLM's call as it is (the common, cheap case)
            blocks = kv.allocate(request, *args, **kwargs)
        if blocks is None and running and self.policy == SchedulingPolicy.FCFS:
            self._place_victim(request)
        return blocks

    def _refused_by_kv_cap(
        self, request: Request, running: bool, args: tuple, kwargs: dict
    ) -> bool:
        """The per-tenant KV cap: a tenant at its cap gets no new block. Its running request
        then preempts the tenant's own cheapest request (maybe itself), never another's."""
        t = self._tenancy_of(request)
        if t.tier not in self.kvlease.kv_caps or not args:
            return False
        tokens = args[0] + kwargs.get("num_lookahead_tokens", 0)
        hit = kwargs.get("num_new_computed_tokens", 0)
        whole = blocks_for(request.num_computed_tokens + hit + tokens, self.block_size)
        if not self._over_kv_cap(t, whole - self._num_blocks(request)):
            return False
        if running and self.policy == SchedulingPolicy.FCFS:
            self._move_victim_to_end(request, account=t.account)  # its own, maybe itself
        return True

    def _counter(self, t: Tenancy) -> float:
        """The victim rule's fair-share term: the tenant's counter, 0 with fair share off."""
        return (
            t.account.counter if t.account is not None and self.kvlease.settings.fair_share else 0.0
        )

    def _place_victim(self, request: Request) -> None:
        """Among the requests of the lowest class that vLLM has not yet served this step
        (`request` and those behind it), move the cheapest to lose to the end. vLLM stops
        serving `running` for the step once it preempts the request it is allocating for,
        so `request` itself counts one more token of loss per request behind it (each
        left unserved for the step): it is its own victim only when nobody behind it can
        be, or when that still costs less than the cheapest victim behind it.

        Unclassified requests keep vLLM's own victim (the newest), so an engine that serves
        no tenant preempts exactly as stock vLLM does. O(requests of that class).
        """
        last = self._tenancy_of(self.running[-1])
        if last.tenant_id is not None:
            if self.kvlease.settings.class_service:
                self._move_victim_to_end(request, klass=last.key[0])
            else:  # `running` is not in class order: the lowest class is searched for
                self._move_victim_to_end(request, by_class=True)

    def _move_victim_to_end(
        self,
        request: Request,
        klass: tuple | None = None,
        account: Account | None = None,
        by_class: bool = False,
    ) -> None:
        """Scanning `running` from the end back to `request`, within class `klass` (the
        scan stops at another class) or among `account`'s requests, move the first victim
        by `within_class_key` (furthest above its fair share, then the victim rule);
        `by_class`: the lowest class first, then that key. `request` itself competes at
        its computed tokens plus one per request behind it (see `_place_victim`).

        It runs at every preemption under pressure, over up to every running request of a
        class, so each one looked at costs a dict lookup and one key; whether a request's
        blocks can be freed now (vLLM's check) is asked only of a new best."""
        running, kv = self.running, self.kvlease
        tenancy, rule, fair = kv.tenancy, kv.settings.victim_rule, kv.settings.fair_share
        best = -1
        best_key: tuple[Any, ...] | None = None
        key: tuple[Any, ...]  # within_class_key's, or (victim class, that) `by_class`
        for i, candidate in zip(range(len(running) - 1, -1, -1), reversed(running), strict=True):
            t = tenancy.get(candidate.request_id) or self._tenancy_of(candidate)
            if klass is not None and t.key[0] != klass:
                break
            if account is None or t.account is account:
                if candidate is request and best >= 0:
                    behind = len(running) - 1 - i  # unserved this step if it is preempted
                    if candidate.num_computed_tokens + behind >= running[best].num_computed_tokens:
                        break
                # `_counter`, inline: this line runs for every request the scan looks at
                counter = t.account.counter if fair and t.account is not None else 0.0
                key = within_class_key(
                    rule, candidate.num_computed_tokens, candidate.arrival_time, counter
                )
                if by_class:
                    key = (t.victim_class, key)
                if (best_key is None or key > best_key) and self._request_blocks_can_be_freed(
                    candidate
                ):
                    best, best_key = i, key
            if candidate is request:
                break
        if best >= 0:
            list.append(running, running.pop(best))

    def _make_room_for_waiting(self) -> list[Request]:
        """Preempt running requests of a lower class than the waiting head, if that admits it
        and the head's tier may (`preempt_to_admit` in the tier table).

        Stock vLLM never preempts to admit a waiting request (vLLM issue #40004). Only the
        blocks the head lacks after its prefix-cache hit are reclaimed, from the lowest
        classes first and the least work first within one (`policy.admission_victims`).
        Returns the victims, which are kept out of the waiting queue for this step.
        """
        kv = self.kvlease
        if not self.waiting or not self.running or not kv.settings.admission_preemption:
            return []
        head = self.waiting.peek_request()
        head_t = self._tenancy_of(head)
        if head_t.tier is None or not kv.settings.tiers[head_t.tier].preempt_to_admit:
            return []  # its tier waits, as on stock vLLM (an unclassified head: nobody is below)
        ordered = kv.settings.class_service  # else (an ablation) every request is looked at
        if ordered and self._tenancy_of(self.running[-1]).victim_class <= head_t.victim_class:
            return []  # `running` is in class order: nobody below the head runs
        slot_short = len(self.running) >= self.max_num_active_reqs
        need, free = self._admission_gap(head, head_t)
        if free >= need and not slot_short:
            return []
        lower: list[Request] = []
        candidates: list[Candidate] = []
        for request in reversed(self.running):
            t = self._tenancy_of(request)
            if t.victim_class <= head_t.victim_class:
                if ordered:
                    break
                continue
            if self._request_blocks_can_be_freed(request):
                lower.append(request)
                candidates.append(t.candidate(request, self._counter(t)))
        rule = kv.settings.victim_rule
        chosen = admission_victims(
            head_t.victim_class, need, free, candidates, rule, lambda i: self._reclaimable(lower[i])
        )
        if slot_short and not chosen and free >= need and candidates:
            chosen = admission_victims(head_t.victim_class, 1, 0, candidates, rule, lambda i: 1)
        if not chosen:
            return []  # preempting could not admit the head: leave everyone running
        victims = [lower[i] for i in chosen]
        now = time.monotonic()
        kv.preempt_reason = "admit_higher_tier"
        kv.cause = head
        try:
            for victim in victims:
                self.running.remove(victim)
                self._preempt_request(victim, now, drop_stale_output=self.requires_kv_delivery)
                self.waiting.remove_request(victim)
        finally:
            kv.preempt_reason = "kv_pressure"
        return victims

    def _admission_gap(self, head: Request, t: Tenancy) -> tuple[int, int]:
        """(blocks the waiting head needs to be admitted, free blocks it may take).

        The whole request is tried first; the hit (a lookup over the head's block hashes,
        no side effects) only when that does not fit. A hit block still in the free queue
        takes a free slot like a new one; a hit block another request holds does not.
        """
        free = self.kvlease.free_queue.free_for(t.reserve_from)
        watermark = self.kv_cache_manager.watermark_blocks
        whole = blocks_for(head.num_tokens + self.num_lookahead_tokens, self.block_size) + watermark
        if free >= whole:  # even the whole request fits: no need to look up its hit
            return whole, free
        hit_blocks, hit_tokens, _ = self.kv_cache_manager.get_computed_blocks(head)
        chunk = min(head.num_tokens - hit_tokens, self.max_num_scheduled_tokens)
        chunk += self.num_lookahead_tokens
        held = sum(1 for group in hit_blocks.blocks for b in group if b.ref_cnt > 0)
        need = blocks_for(hit_tokens + chunk, self.block_size) - held + watermark
        return need, free

    def _reclaimable(self, request: Request) -> int:
        """Blocks that preempting `request` returns to the pool: those nobody else holds."""
        return sum(1 for b in self._blocks(request.request_id) if b.ref_cnt == 1)

    # -- preemption, finish and free hooks -------------------------------------

    def _preempt_request(self, request: Request, timestamp: float, drop_stale_output: bool = False):
        kv = self.kvlease
        t = kv.tenancy[request.request_id]
        self._charge(request, t)  # what it generated before it loses its computed tokens
        blocks = self._num_blocks(request)
        tokens = request.num_computed_tokens
        decision = preemption_mode(blocks, self.block_size, tokens, kv.cost, kv.offload_available)
        super()._preempt_request(request, timestamp, drop_stale_output=drop_stale_output)
        by_tier, by_tenant = self._cause_of()
        t.recomputed_tokens += tokens
        if tokens:
            t.recomputed_by = t.recomputed_by or {}
            t.recomputed_by[by_tier] = t.recomputed_by.get(by_tier, 0) + tokens
        if decision.mode == "offload":
            t.offloaded_blocks = blocks
            kv.accounting.offloaded_blocks[kv.label(t.tenant_id)] += blocks
        kv.accounting.count_preemption(
            kv.label(t.tenant_id),
            t.tier,
            kv.preempt_reason,
            decision.mode,
            blocks,
            tokens,
            by_tier,
        )
        if not kv.events.wanted:
            return
        kv.events.push(
            Preemption(
                at=kv.clock(),
                request_id=request.request_id,
                tenant_id=t.tenant_id,
                tier=t.tier,
                session_id=t.session_id,
                reason=kv.preempt_reason,
                mode=decision.mode,
                blocks=blocks,
                recomputed_tokens=tokens,
                api_server=request.client_index,
                by_tier=by_tier,
                by_tenant=by_tenant,
            )
        )

    def _cause_of(self) -> tuple[str, str | None]:
        """(tier, tenant) of the allocation under way, which a preemption makes room for
        (NO_CAUSE when none is: a cache reset)."""
        kv = self.kvlease
        if kv.cause is None:
            return NO_CAUSE, None
        return (kv.tenancy.get(kv.cause.request_id) or self._tenancy_of(kv.cause)).cause

    def _free_request_blocks(self, request: Request) -> None:
        """File the blocks under their session, now or, when vLLM defers the free past an
        in-flight step, when it drains them (`_deferred_popped`)."""
        kv = self.kvlease
        t = kv.tenancy.get(request.request_id)
        holder = t.holder if t is not None else kv.delayed.pop(request.request_id, None)
        if holder is not None and holder.leased and holder.in_flight <= 1:
            kv.free_queue.demote(holder)  # what its latest request did not reuse is stale
        deferred = len(self.deferred_frees)
        kv.free_queue.owner = holder
        try:
            super()._free_request_blocks(request)
        finally:
            kv.free_queue.owner = None
        if len(self.deferred_frees) > deferred:
            kv.deferred_owner[id(self.deferred_frees[-1][1])] = holder
            if holder is not None:
                holder.deferred += 1
        if holder is not None and t is None:
            holder.deferred -= 1  # the delayed free of a finished request is done
            self._forget_if_idle((holder.tenant_id, holder.session_id), holder)

    def _deferred_popped(self, entry: tuple[int, list]) -> None:
        """vLLM returns one deferred entry's blocks to the pool next: file them under
        their session (None for vLLM's own copy-on-write retentions)."""
        kv = self.kvlease
        holder = kv.deferred_owner.pop(id(entry[1]), None)
        kv.free_queue.owner = holder
        if holder is not None:
            holder.deferred -= 1

    def _drain_deferred_frees(self) -> None:
        try:
            super()._drain_deferred_frees()
        finally:
            self.kvlease.free_queue.owner = None

    def _free_request(self, request: Request, delay_free_blocks: bool = False):
        kv = self.kvlease
        t = kv.tenancy.get(request.request_id)
        if t is not None:
            self._charge(request, t)  # its last generated tokens
            self._integrate_request(request)
            self._no_longer_returning(t)  # an abort before its admission
            if t.holder is not None and t.holder.in_flight == 1 and t.holder.protected:
                self._end_turn(t, request)  # before its blocks are freed: they go where it decides
        result = super()._free_request(request, delay_free_blocks=delay_free_blocks)
        if t is None:
            return result
        if request.request_id in self.requests:  # a connector still reads its blocks
            kv.delayed[request.request_id] = t.holder
            if t.holder is not None:
                t.holder.deferred += 1
        self._restore_offloaded(t)
        del kv.tenancy[request.request_id]
        if t.account is not None:
            kv.shares[t.tier].released(t.account, request.request_id)
        now = kv.clock()
        holder = t.holder
        if holder is not None:
            kv.awaiting_hit.pop(request.request_id, None)
            if t.lease_covered and t.lease_cached >= 0:  # it was scheduled
                kv.accounting.count_lease_reuse(
                    holder.tier, t.lease_covered, t.lease_cached, t.lease_reserved
                )
            holder.last_hashes = request.block_hashes
            holder.in_flight -= 1
            change = kv.leases.request_finished(t.session)
            if change is not None:
                self._lease_event(holder, change.kind, change.expires_at, change.at, request)
            self._forget_if_idle(t.session, holder)
        block_seconds = kv.accounting.request_done(request.request_id)
        if not kv.events.wanted:
            return result
        kv.done_unsent = True
        kv.events.push(
            RequestDone(
                at=now,
                request_id=request.request_id,
                tenant_id=t.tenant_id,
                tier=t.tier,
                session_id=t.session_id,
                status=request.status.name.lower(),
                preemptions=request.num_preemptions,
                recomputed_tokens=t.recomputed_tokens,
                block_seconds=block_seconds,
                prompt_tokens=request.num_prompt_tokens,
                output_tokens=request.num_output_tokens,
                lease_covered_tokens=t.lease_covered,
                api_server=request.client_index,
                recomputed_by=t.recomputed_by or {},
            )
        )
        return result

    def forget_history(self) -> None:
        """Forget the think times sessions have shown, what reservations returned and the
        tenants' fair-share counters, as a freshly started server knows none of them
        (benchmark runs and tests sharing an engine: a counter left from an earlier run
        reorders the next one). Only between runs, with nothing in flight."""
        kv = self.kvlease
        kv.returns = ReturnModel()
        for share in kv.shares.values():
            share.forget()
        queue = kv.free_queue
        kv.payback.forget()
        kv.payback.rebase(queue.reserved_left, queue.reserved_reused)
        queue.set_caps(kv.payback.caps)

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        kv = self.kvlease
        kv.preempt_reason = "cache_reset"
        kv.cause = None
        try:
            ok = super().reset_prefix_cache(*args, **kwargs)
        finally:
            kv.preempt_reason = "kv_pressure"
        if ok:  # no free block holds a prefix any more: nobody owns cached blocks
            kv.retention.integrate_all(kv.clock(), kv.label)
            kv.free_queue = self._install_free_queue()
            for session, holder in list(kv.holders.items()):
                holder.cached = holder.leased = holder.reserved = 0
                self._forget_if_idle(session, holder)
        return ok

    # -- leases and evictions --------------------------------------------------

    def _end_turn(self, t: Tenancy, request: Request) -> None:
        """The session's last request in flight ends: how long are its blocks reserved?
        (kvlease.engine.reservations; the window never outlives the lease)."""
        kv = self.kvlease
        holder = t.holder
        assert holder is not None and t.tenant_id is not None and t.tier is not None
        tier = kv.settings.tiers[t.tier]
        now = kv.clock()
        tenant = kv.label(t.tenant_id)
        kv.returns.turn_ended(t.session, tenant, tier.name, now)
        policy = kv.reserve_policy[tier.name]
        window = kv.returns.window(t.session, tenant, tier.name, tier.lease_seconds, policy)
        holder.reserving = window > 0
        holder.reserved_until = now + window if window < tier.lease_seconds else math.inf
        kv.retention.open(holder, now, request.request_id, request.client_index)
        if holder.reserving and holder.reserved_until < math.inf:
            heapq.heappush(kv.windows, (holder.reserved_until, next(kv.seq), t.session))
        for session in kv.returns.take_withdrawn():  # the sessions it was given: Session
            other = kv.holders.get(cast(Session, session))
            if other is not None and other.reserving:
                self._close_window(other, now)

    def _expire_leases(self) -> None:
        kv = self.kvlease
        now = kv.clock()
        while kv.windows and kv.windows[0][0] <= now:
            until, _, session = heapq.heappop(kv.windows)
            holder = kv.holders.get(session)
            if (
                holder is not None
                and holder.reserving
                and holder.reserved_until == until
                and not holder.returning  # else its admission closes it (`_no_longer_returning`)
            ):
                self._close_window(holder, until)
        for change in kv.leases.expire():
            kv.returns.forget(change.session)
            holder = kv.holders.get(change.session)
            if holder is None:
                continue
            self._close_retention(holder, change.expires_at)
            kv.free_queue.release(holder)
            self._lease_event(holder, "expire", change.expires_at, change.at)
            self._forget_if_idle(change.session, holder)

    def _no_longer_returning(self, t: Tenancy) -> None:
        """`t`'s request is admitted for the first time, or leaves without ever being
        admitted: a reservation window that ended while the session's returning turn
        waited for blocks closes now, once no request of the session still waits for its
        first admission. So a turn that came back within its window finds the blocks the
        window kept, however long it waits for the rest. O(1) but for the close."""
        holder = t.holder
        if t.admitted or holder is None:
            return
        t.admitted = True
        holder.returning -= 1
        if not holder.returning and holder.reserving:
            now = self.kvlease.clock()
            if holder.reserved_until <= now:
                self._close_window(holder, now)

    def _close_window(self, holder: Holder, at: float) -> None:
        """The holder's reservation window closes at `at`: its reserved time is billed up to
        then, and its blocks are protected by eviction order only from now on."""
        kv = self.kvlease
        holder.reserved_until = at
        kv.retention.integrate(holder, at, kv.label(holder.tenant_id))
        kv.free_queue.retain(holder)

    def _close_retention(self, holder: Holder, at: float | None = None) -> None:
        """End the holder's time between turns (at `at`, else now) and report it."""
        kv = self.kvlease
        event = kv.retention.close(
            holder, kv.clock() if at is None else at, kv.label(holder.tenant_id), kv.events.wanted
        )
        if event is not None:
            kv.events.push(event)

    def _lease_event(
        self,
        holder: Holder,
        kind: str,
        expires_at: float | None,
        at: float,
        request: Request | None = None,
    ) -> None:
        assert holder.tenant_id is not None and holder.tier is not None
        if not self.kvlease.events.wanted:
            return
        request_id, api_server = (
            (None, 0) if request is None else (request.request_id, request.client_index)
        )
        self.kvlease.events.push(
            LeaseEvent(
                at=at,
                tenant_id=holder.tenant_id,
                session_id=holder.session_id,
                tier=holder.tier,
                kind=kind,
                expires_at=expires_at,
                request_id=request_id,
                api_server=api_server,
            )
        )

    def _forget_if_idle(self, session: Session, holder: Holder) -> None:
        busy = holder.in_flight or holder.protected or holder.deferred
        if not (busy or holder.cached or holder.leased):
            self.kvlease.holders.pop(session, None)

    def _report_evictions(self, output: SchedulerOutput) -> None:
        """The step's evictions, each attributed to the allocation that took its block: the
        one the free queue logged with it (kvlease's wrapper allocating), else the request
        `output` hands the block to as a new block (a step that cannot run short, where
        vLLM allocates alone). NO_CAUSE when neither names one. O(evictions + new blocks)."""
        kv = self.kvlease
        evictions = kv.free_queue.take_evictions()
        if not evictions:
            return
        takers: dict[int, str] | None = None  # from the output, looked up once if needed
        blocks: dict[tuple[Holder, bool, str | None], int] = {}
        for holder, leased, block_id, taker in evictions:
            if taker is None:
                if takers is None:
                    takers = _block_takers(output)
                taker = takers.get(block_id)
            key = (holder, leased, taker)
            blocks[key] = blocks.get(key, 0) + 1
        now = kv.clock()
        tenancy = kv.tenancy
        labels: dict[Holder, str] = {}  # each holder evicted from, and its tenant label
        for (holder, leased, taker), n in blocks.items():
            # the taker was classified when it was first scheduled (`_admitted`)
            t = tenancy.get(taker) if taker is not None else None
            by_tier, by_tenant = (NO_CAUSE, None) if t is None else t.cause
            label = labels.get(holder)
            if label is None:
                label = labels[holder] = kv.label(holder.tenant_id)
            kv.accounting.count_eviction(label, holder.tier, leased, n, by_tier)
            if kv.events.wanted:
                kv.events.push(
                    Eviction(
                        at=now,
                        tenant_id=holder.tenant_id,
                        tier=holder.tier,
                        leased=leased,
                        blocks=n,
                        by_tier=by_tier,
                        by_tenant=by_tenant,
                    )
                )
        for holder in labels:
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
        kv = self.kvlease
        if kv.accounting.last is None:
            return
        dt = max(0.0, kv.clock() - kv.accounting.last.at)
        blocks = self._num_blocks(request)
        kv.accounting.request_block_seconds[request.request_id] = (
            kv.accounting.request_block_seconds.get(request.request_id, 0.0) + dt * blocks
        )

    def sample_accounting(self):
        """Occupancy by tenant and state now; integrates block-seconds; checks the books."""
        get_blocks = self.kv_cache_manager.coordinator.get_blocks
        return snapshot.sample(self.kvlease, get_blocks, self.deferred_frees)

    def state(self, sample: bool = True) -> EngineState:
        """The pool, leases, queues and cumulative totals, for the API process
        (`snapshot.engine_state`); sampled now unless `sample` is False and a sample exists."""
        snap = self.kvlease.accounting.last
        if sample or snap is None:
            snap = self.sample_accounting()
        waiting = self.waiting
        assert isinstance(waiting, TenantWaitingQueue)
        return snapshot.engine_state(
            self.kvlease, snap, len(self.running), len(waiting), waiting.bucket_sizes()
        )


def _block_takers(output: SchedulerOutput) -> dict[int, str]:
    """Block id -> the request a step's output hands it to as a new block. O(new blocks)
    in Python: of the running requests, the few that grew a block this step are picked out
    by `compress` (vLLM's `new_block_ids` is None for the others)."""
    takers = {}
    for new in output.scheduled_new_reqs:
        for group in new.block_ids:
            for block_id in group:
                takers[block_id] = new.req_id
    cached = output.scheduled_cached_reqs
    grown = filter(None, cached.new_block_ids)
    for req_id, new_ids in zip(compress(cached.req_ids, cached.new_block_ids), grown, strict=True):
        for group in new_ids:
            for block_id in group:
                takers[block_id] = req_id
    return takers


def _block_unit(managers: tuple[Any, ...]) -> int:
    """The block size where a running request with d computed tokens takes at most
    cdiv(d + n, size) - cdiv(d, size) new blocks for its next n: one KV cache group,
    whose manager counts and allocates blocks as vLLM's base manager does
    (`cdiv(tokens, block_size)` less those held: full attention, sliding window, chunked
    local). 0 elsewhere (hybrid models, Mamba's state blocks, ring buffers): every
    allocation then takes the full path."""
    if len(managers) != 1:
        return 0
    kind, base = type(managers[0]), SingleTypeKVCacheManager
    for method in ("get_num_blocks_to_allocate", "allocate_new_blocks"):
        if getattr(kind, method) is not getattr(base, method):
            return 0
    return managers[0].block_size


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
        vllm_config: VllmConfig = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
        if cls is TenantAwareScheduler and vllm_config.scheduler_config.async_scheduling:
            cls = TenantAwareAsyncScheduler
        return super().__new__(cls)


class TenantAwareAsyncScheduler(TenantAwareScheduler, AsyncScheduler):
    """kvlease on vLLM's async scheduler (what `TenantAwareScheduler` becomes where
    vLLM schedules asynchronously)."""
