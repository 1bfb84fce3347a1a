"""One replay: a trace's turns through the real vLLM scheduler and kvlease's, offline.

The engine is `kvlease.replay.synthetic`'s: vLLM's own `Scheduler` with kvlease's
mixin, as `kvlease serve` builds it, fed a synthetic model output each step.
Time is a step clock (`kvlease.replay.clock.StepCost`): each step advances it by what
such a step costs. kvlease's lease clock, block-seconds and the arrivals follow
it, and an idle engine jumps to the next arrival.

Steady decoding is replayed in strides. When nothing waits, every running request
is decoding, none finishes and none could need a block a lease holds before the
next arrival, the next k steps are all alike: one call samples k tokens per
request, the clock moves k steps and the scheduler counts them (`account_stride`:
fair share is charged as those steps would have). Those steps decide nothing, so a
stride changes no figure (tests/test_replay.py checks it against stride 1); it is
what makes a week of traffic take minutes.

`stock` replays on vLLM's own scheduler instead (FCFS, or PRIORITY with priority =
tier), with no stride, for what kvlease is measured against (bench/ablations.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvlease.demo.workload import Turn
from kvlease.engine.events import EVENT_CAPACITY, RequestDone, Retention
from kvlease.engine.policy import blocks_for
from kvlease.engine.tenancy import TierTable
from kvlease.replay.clock import StepCost, tick_seconds
from kvlease.replay.sessions import Arrival, StepTrace
from kvlease.replay.synthetic import (
    BLOCK,
    Policy,
    counting_stock_scheduler,
    make_request,
    make_scheduler,
    step,
)

MAX_STRIDE = 1024
MAX_CONTEXT = 1400  # as bench/policy.py: a session ends before its context passes this


@dataclass(slots=True)
class Served:
    """One replayed request, from arrival to its last token. Steps count engine steps."""

    tenant: str
    tier: str
    turn: int
    arrival_step: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    cacheable: int  # tokens of the previous turn's context a cache could hold (whole blocks)
    leased: bool  # a next turn within its tier's lease: its prefix was the lease's to keep
    first_step: int = -1
    first_s: float = 0.0
    cached_tokens: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0  # computed tokens its preemptions threw away
    computed_tokens: int = 0  # tokens the engine computed for it, work done twice included
    block_seconds: float = 0.0
    reserved_seconds: float = 0.0  # KV retention after it: its session's blocks, reserved
    retained_seconds: float = 0.0  # ... and retained, until the session's next turn

    @classmethod
    def arriving(cls, arrival: Arrival, tiers: TierTable, step: int, now: float) -> Served:
        turn = arrival.turn
        return cls(
            turn.tenant_id,
            turn.tier,
            turn.turn,
            step,
            now,
            len(arrival.prompt),
            turn.output_tokens,
            cacheable=arrival.cacheable(BLOCK),
            leased=arrival.within_lease(tiers[turn.tier].lease_seconds),
        )

    @property
    def ttft_steps(self) -> int:
        return self.first_step - self.arrival_step

    @property
    def ttft_s(self) -> float:
        return self.first_s - self.arrival_s


@dataclass
class Replay:
    """What a replay observed: each request, and the engine's fair-share books."""

    served: list[Served]
    steps: int
    calls: int  # scheduler calls: steps less those strides saved
    seconds: float  # the step clock's time from the first arrival to the last token
    dropped: int  # turns left out: their session's context would pass max_model_len
    fair_share: dict[tuple[str, str], list[float]]  # (tenant label, tier) -> [served, entitled]


class _Clock:
    """The lease clock the scheduler reads: the step clock's seconds past an origin, counted
    in whole ticks of `tick_seconds` (exact sums: bench/policy.py's engine reads the same)."""

    def __init__(self, ticks: float) -> None:
        self.now = 0.0
        self._ticks, self._tick = ticks, tick_seconds(ticks)

    def __call__(self) -> float:
        return 1e6 + round(self.now * self._ticks) * self._tick


def simulate(
    turns: list[Turn],
    tiers: TierTable,
    pool_blocks: int,
    cost: StepCost,
    model: str,
    tiers_path: str | None = None,
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_stride: int = MAX_STRIDE,
    progress: Callable[[int], object] | None = None,
    settings: dict[str, Any] | None = None,
    stock: Policy | None = None,
) -> Replay:
    """Replay `turns` under `tiers` (the table at `tiers_path`, or the one in force) on a
    pool of `pool_blocks` KV blocks, with kvlease `settings` (kvlease.engine.settings keys), or on
    stock vLLM (`stock`: "fcfs" or "priority"); `progress` is called with each batch of
    finished requests' count."""
    from kvlease.engine.vllm_scheduler import TenantAwareScheduler

    kvlease = {
        **({"tiers": tiers_path} if tiers_path else {}),
        "event_capacity": EVENT_CAPACITY,  # `_settle` reads them
        **(settings or {}),
    }
    scheduler = make_scheduler(
        TenantAwareScheduler if stock is None else counting_stock_scheduler(),
        model,
        pool_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        kvlease=kvlease or None,
        policy=stock or "fcfs",
    )
    if stock is not None:
        max_stride = 1  # strides need kvlease's free queue to know they are safe
        priority = {name: tiers[name].priority for name in tiers} if stock == "priority" else {}
    else:
        priority = {}
    # A tick: a step, or 1/1024 s on a fitted clock (a power of two: a millisecond in
    # grains would run the lease clock 0.04% fast)
    ticks = 1.0 / cost.base if cost.is_fixed else 1024.0
    clock = _Clock(ticks)
    if stock is None:  # kvlease's lease clock follows the step clock
        scheduler.kvlease.clock = clock
    vocab = scheduler.vllm_config.model_config.get_vocab_size()
    max_len = scheduler.vllm_config.model_config.max_model_len
    trace = StepTrace(turns, ticks, vocab, min(MAX_CONTEXT, max_len))
    live: dict[str, tuple[Served, Arrival]] = {}
    done: dict[str, Served] = {}  # finished, until the engine's RequestDone fills it in
    served: list[Served] = []
    settled: dict[str, Served] = {}  # by request id: a retention record names its turn's
    steps = calls = last_stride = 0
    next_books = 0.0
    while not trace.done:
        for arrival in trace.due(round(clock.now * ticks)):
            live[arrival.request_id] = _admit(
                scheduler, arrival, tiers, steps, clock.now, priority.get(arrival.turn.tier, 0)
            )
        if not scheduler.has_requests():
            due = trace.next_step()
            assert due is not None  # not done and nothing in the engine: an arrival is due
            clock.now = max(clock.now, due / ticks)  # idle: the next arrival
            continue
        out = scheduler.schedule()
        prefill, decoding = _shape(scheduler, out, last_stride)
        step_s = cost.seconds(prefill, decoding)
        stride = 1
        if prefill == 0 and max_stride > 1:
            stride = _stride(scheduler, out, step_s, clock.now, trace.next_step(), ticks)
            stride = min(stride, max_stride)
        for request_id, tokens in out.num_scheduled_tokens.items():
            # a stride's decodes are scheduled at the step after it (see _stride)
            live[request_id][0].computed_tokens += tokens
        _, outputs = step(scheduler, out, stride)
        if stride > 1:
            scheduler.account_stride(stride)
        calls += 1
        clock.now += stride * step_s
        finished = 0
        for batch in outputs.values():
            for o in batch.outputs:
                s, arrival = live[o.request_id]
                if s.first_step < 0 and o.new_token_ids:  # never in a stride: see _stride
                    s.first_step, s.first_s = steps, clock.now
                    s.cached_tokens = o.prefill_stats.num_cached_tokens if o.prefill_stats else 0
                if o.finish_reason is not None:
                    # The reply ends with this step: the user's think time starts at the next.
                    trace.finished(arrival, [7] * s.output_tokens, round(clock.now * ticks) - 1)
                    done[o.request_id] = s
                    del live[o.request_id]
                    if stock is not None:  # no engine events: the counting subclass's
                        s.preemptions = scheduler.preempted.pop(o.request_id, 0)
                        s.recomputed_tokens = scheduler.thrown.pop(o.request_id, 0)
                        served.append(done.pop(o.request_id))
                    finished += 1
        steps += stride
        last_stride = stride
        if stock is None:
            served += _settle(scheduler, done, settled)
        if stock is None and scheduler.waiting and clock.now >= next_books:  # fair-share books
            scheduler.kvlease.settle_fair_share()
            next_books = clock.now + 1.0
        if progress is not None and finished:
            progress(finished)
    books, end = {}, clock.now
    if stock is None:
        scheduler.kvlease.settle_fair_share()
        # Let every lease run out, so each session's last time between turns is billed.
        clock.now += max((t.lease_seconds for t in tiers.values()), default=0.0) + 1.0
        scheduler._expire_leases()
        served += _settle(scheduler, done, settled)
        books = dict(scheduler.kvlease.accounting.fair_share_tokens)
    first = min((s.arrival_s for s in served), default=0.0)
    return Replay(served, steps, calls, end - first, trace.dropped, books)


def _admit(
    scheduler: Any,
    arrival: Arrival,
    tiers: TierTable,
    steps: int,
    now: float,
    priority: int = 0,
) -> tuple[Served, Arrival]:
    turn = arrival.turn
    scheduler.add_request(
        make_request(
            turn.tenant_id,
            turn.tier,
            len(arrival.prompt),
            turn.output_tokens,
            session=turn.session_id,
            prompt=arrival.prompt,
            request_id=arrival.request_id,
            priority=priority,
        )
    )
    return Served.arriving(arrival, tiers, steps, now), arrival


def _shape(scheduler: Any, out: Any, last_stride: int) -> tuple[int, int]:
    """(prompt tokens computed, requests decoding) in this step. A request decodes when
    all it has left to compute is what the last step sampled for it."""
    prefill = decoding = 0
    requests = scheduler.requests
    for request_id, n in out.num_scheduled_tokens.items():
        request = requests[request_id]
        before = request.num_computed_tokens - n  # schedule() has counted this step's
        if request.num_output_tokens and request.num_tokens - before <= max(1, last_stride):
            decoding += 1
        else:
            prefill += n
    return prefill, decoding


def _stride(
    scheduler: Any, out: Any, step_s: float, now: float, next_tick: int | None, ticks: float
) -> int:
    """How many alike decode steps start here. A stride's tokens are computed at the
    step after it, so that step must come before anything that could decide otherwise:
    no request finishes in the stride (its last token is sampled after it, with all
    else computed), no arrival falls due in it or at the step after it, and the blocks
    it needs are free without touching any a lease holds. 1 unless nothing waits and
    every running request was scheduled."""
    running = scheduler.running
    if (
        not running
        or scheduler.waiting
        or len(out.num_scheduled_tokens) != len(running)
        or scheduler.kvlease.kv_caps
    ):
        return 1
    stride = min(r.max_tokens - r.num_output_tokens for r in running) - 1
    # The step after computes the stride's tokens: all of them must fit its token budget.
    stride = min(stride, scheduler.max_num_scheduled_tokens // len(running))
    if next_tick is not None and stride > 1:
        stride = min(stride, int(((next_tick - 0.5) / ticks - now) / step_s))
        while stride > 1 and round((now + stride * step_s) * ticks) >= next_tick:
            stride -= 1
    if stride <= 1:
        return 1
    blocks = len(running) * (blocks_for(stride, BLOCK) + 1)
    return stride if scheduler.kvlease.free_queue.free_unreserved >= blocks else 1


def _settle(scheduler: Any, done: dict[str, Served], settled: dict[str, Served]) -> list[Served]:
    """The engine's own figures for finished requests (its RequestDone events), and the
    KV retention after them (Retention events, on the request that opened each)."""
    out = []
    for event in scheduler.kvlease.events.drain():
        if isinstance(event, RequestDone) and event.request_id in done:
            s = settled[event.request_id] = done.pop(event.request_id)
            s.preemptions, s.recomputed_tokens = event.preemptions, event.recomputed_tokens
            s.block_seconds = event.block_seconds
            out.append(s)
        elif isinstance(event, Retention) and event.request_id in settled:
            s = settled[event.request_id]
            s.reserved_seconds += event.reserved_block_seconds
            s.retained_seconds += event.retained_block_seconds
    return out
