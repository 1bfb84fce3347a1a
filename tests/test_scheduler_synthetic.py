"""Both kvlease scheduler classes driven in-process with synthetic model outputs.

Real vLLM scheduling code, no model: every invariant is checked at every step.
"""

from __future__ import annotations

from importlib import resources
from itertools import pairwise
from pathlib import Path

import pytest
from clocks import ManualClock, OffsetClock
from engines import recording
from vllm.v1.request import RequestStatus
from waiting import until

from kvlease.engine.channel import ADDRESS_ENV, Receiver, new_address
from kvlease.engine.events import EVENT_CAPACITY, TenantHolding
from kvlease.engine.fairness import INPUT_COST, OUTPUT_COST
from kvlease.engine.policy import blocks_for
from kvlease.engine.vllm_scheduler import TenantAwareAsyncScheduler, TenantAwareScheduler
from kvlease.replay.synthetic import BLOCK, make_request, make_scheduler, step

TIERS = ("premium", "standard", "free")
CLASSES = [TenantAwareScheduler, TenantAwareAsyncScheduler]


def _scheduler(cls, demo_model, blocks=24, **kvlease):
    """A scheduler whose events these tests read (no channel: none are kept unless asked)."""
    settings = {"debug_accounting": True, "event_capacity": EVENT_CAPACITY, **kvlease}
    return make_scheduler(recording(cls), demo_model, blocks, kvlease=settings)


def _run(scheduler, limit=10_000, each_step=None) -> int:
    steps = 0
    while scheduler.has_requests():
        step(scheduler)
        scheduler.kvlease.free_queue.check()
        if each_step:
            each_step(scheduler)
        steps += 1
        assert steps < limit
    return steps


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("rule", ["lru", "least_work"])
def test_pressure_trace_completes_with_balanced_books_and_no_premium_preempted_early(
    cls, rule, demo_model
):
    scheduler = _scheduler(cls, demo_model, victim_rule=rule)
    for i in range(12):
        scheduler.add_request(make_request(f"t{i}", TIERS[i % 3], 40, 200, session=f"s{i}"))
    _run(scheduler)  # debug_accounting raises AccountingError on any imbalance
    assert scheduler.preemptions, "the trace must create pressure"
    assert not [p for p in scheduler.preemptions if p[0] == "premium" and set(p[1]) - {"premium"}]
    done = [e for e in scheduler.kvlease.events.drain() if type(e).__name__ == "RequestDone"]
    assert len(done) == 12 and {e.status for e in done} == {"finished_length_capped"}


@pytest.mark.parametrize("cls", CLASSES)
def test_running_is_served_by_class_then_admission_every_step(cls, demo_model):
    scheduler = _scheduler(cls, demo_model)

    def ordered(s):
        keys = [s._service_key(r) for r in s.running]
        assert keys == sorted(keys)
        ranks = [key[0] for key in keys]
        assert ranks == sorted(ranks)  # premium, standard, free, then unclassified

    for i in range(10):
        scheduler.add_request(make_request(f"t{i}", TIERS[i % 3], 30 + 7 * i, 120))
        scheduler.add_request(make_request(None, None, 50, 40))  # unclassified
    _run(scheduler, each_step=ordered)


@pytest.mark.parametrize("cls", CLASSES)
def test_admissions_in_one_step_take_turns_by_fair_share(cls, demo_model):
    """Each admission's prompt is charged before vLLM peeks for the next one, so within
    one step two tenants of a tier alternate (strict fair share), not one tenant's backlog
    first; and the step's admissions end in service order."""
    scheduler = _scheduler(cls, demo_model, blocks=64, fair_slack=0)
    for tenant in ("a", "a", "a", "b", "b", "b"):
        scheduler.add_request(make_request(tenant, "free", 64, 8))
    out, _ = step(scheduler)
    tenants = [scheduler.kvlease.tenancy[new.req_id].tenant_id for new in out.scheduled_new_reqs]
    assert tenants == ["a", "b", "a", "b", "a", "b"]
    keys = [scheduler._service_key(r) for r in scheduler.running]
    assert keys == sorted(keys)


@pytest.mark.parametrize(
    ("rule", "first_victim"), [("lru", "old-long"), ("least_work", "new-short")]
)
def test_victim_within_a_tenant_follows_the_configured_rule(rule, first_victim, demo_model):
    """Two requests of one tenant (one fair-share counter): the rule picks between them."""
    scheduler = _scheduler(TenantAwareScheduler, demo_model, victim_rule=rule)
    old_long = make_request("free-1", "free", 300, 200, arrival=1.0)
    new_short = make_request("free-1", "free", 40, 200, arrival=2.0)
    for request in (old_long, new_short):
        scheduler.add_request(request)
    step(scheduler)
    vip = make_request("vip", "premium", 400, 10, arrival=3.0)  # 13 blocks: 11 are free
    scheduler.add_request(vip)
    out, _ = step(scheduler)
    [first, *_] = [e for e in scheduler.kvlease.events.drain() if type(e).__name__ == "Preemption"]
    names = {old_long.request_id: "old-long", new_short.request_id: "new-short"}
    assert (names[first.request_id], first.reason) == (first_victim, "admit_higher_tier")
    assert vip.request_id in out.num_scheduled_tokens  # admitted in the same step
    assert first.request_id not in out.num_scheduled_tokens  # no thrash: the victim sits out
    assert first.request_id in {r.request_id for r in scheduler.waiting}


def test_the_request_being_served_is_its_own_victim_only_when_that_still_costs_least(
    demo_model,
):
    """vLLM stops serving `running` for the step once it preempts the request it is
    allocating for, leaving every request behind it unserved: so that request competes
    as a victim at its computed tokens plus one per request behind it."""
    scheduler = _scheduler(TenantAwareScheduler, demo_model, blocks=64)
    a, b, c, d = (make_request("fay", "free", n, 50) for n in (58, 100, 60, 20))  # one counter
    for request in (a, b, c, d):
        scheduler.add_request(request)
    step(scheduler)  # computed 58, 100, 60 and 20 tokens
    for order, serving, after in (
        ([a, c, b], a, [a, b, c]),  # a: 58 + 2 behind >= c's 60: c, the cheapest behind, goes
        ([d, c, b], d, [c, b, d]),  # d: 20 + 2 < c's 60: d itself, at the end for vLLM
        ([b, c, a], a, [b, c, a]),  # nobody behind a: a itself
    ):
        scheduler.running[:] = order
        scheduler._place_victim(serving)
        assert scheduler.running == after


def test_unclassified_requests_are_preempted_first(demo_model):
    scheduler = _scheduler(TenantAwareScheduler, demo_model)
    scheduler.add_request(make_request(None, None, 60, 300))
    scheduler.add_request(make_request("f", "free", 60, 300))
    scheduler.add_request(make_request("p", "premium", 60, 300))
    _run(scheduler)
    assert scheduler.preemptions[0][0] is None


def test_unknown_tier_is_treated_as_unclassified(demo_model, caplog):
    scheduler = _scheduler(TenantAwareScheduler, demo_model)
    request = make_request("acme", "platinum", 40, 4)
    scheduler.add_request(request)
    assert scheduler.kvlease.tenancy[request.request_id].tenant_id is None
    assert "unknown tier" in caplog.text
    _run(scheduler)


def test_event_overflow_is_counted_and_counters_stay_exact(demo_model):
    scheduler = _scheduler(TenantAwareScheduler, demo_model, event_capacity=3)
    for i in range(12):
        scheduler.add_request(make_request(f"t{i}", TIERS[i % 3], 40, 200, session=f"s{i}"))
    _run(scheduler)
    assert len(scheduler.kvlease.events) == 3
    assert scheduler.kvlease.events.dropped > 0
    assert sum(scheduler.kvlease.accounting.preemptions.values()) == len(scheduler.preemptions)


def test_without_a_channel_or_a_reader_no_event_is_kept_and_counters_stay_exact(demo_model):
    """A plain `vllm serve --scheduler-cls`: nothing reads the events, so none pile up
    (none counted as dropped either); the totals the snapshot carries are still exact."""
    scheduler = make_scheduler(recording(TenantAwareScheduler), demo_model, 24)
    for i in range(12):
        scheduler.add_request(make_request(f"t{i}", TIERS[i % 3], 40, 200, session=f"s{i}"))
    _run(scheduler)
    assert (len(scheduler.kvlease.events), scheduler.kvlease.events.dropped) == (0, 0)
    assert scheduler.preemptions  # events there were
    assert sum(scheduler.kvlease.accounting.preemptions.values()) == len(scheduler.preemptions)


def test_under_load_the_channel_sends_a_state_every_sample_and_each_request_done_in_its_step(
    demo_model, monkeypatch
):
    """Real ZeroMQ sockets, the scheduler's own publisher. While the engine stays busy the
    API process gets a state every `sample_seconds` of the scheduler's clock. (It used to
    get one only for a sample that fell due while the model ran, between `schedule()`
    and `update_from_output()`: on this clock, which moves between steps, none until the
    engine went idle.) A finished request's `RequestDone` leaves at the end of its own
    step (its response waits for its usage record); every other event waits for the next
    of those messages, and every event arrives once."""
    address, got = new_address(), []
    receiver = Receiver(address, got.append)
    monkeypatch.setenv(ADDRESS_ENV, address)
    settings = {"sample_seconds": 0.25}
    scheduler = make_scheduler(TenantAwareScheduler, demo_model, 24, kvlease=settings)
    # from the sample sent at start, on a clock the test moves
    scheduler.kvlease.clock = clock = ManualClock(scheduler.kvlease.last_sample)

    def done() -> list[str]:
        events = [e for m in list(got) for e in m.events]
        return [e.request_id for e in events if type(e).__name__ == "RequestDone"]

    try:
        for i in range(12):
            scheduler.add_request(make_request(f"t{i}", TIERS[i % 3], 40, 200, session=f"s{i}"))
        steps = finishing = 0
        while scheduler.has_requests():
            before = set(scheduler.requests)
            step(scheduler)
            if gone := before - set(scheduler.requests):
                finishing += 1
                # its RequestDone, with no later step
                until(lambda gone=gone: gone.issubset(done()), "its RequestDone", 30, 0.01)
            clock.now += 0.01  # one step: 10 ms
            steps += 1
        until(lambda: got and got[-1].state and got[-1].state.running == 0, "the idle message")
    finally:
        scheduler.kvlease.publisher.close()
        receiver.close()
    states = [m.state.at for m in got[1:] if m.state is not None]  # after the one at start
    assert steps * 0.01 / 0.25 - 1 <= len(states) <= steps * 0.01 / 0.25 + 2
    assert max(b - a for a, b in pairwise(states)) <= 0.25 + 0.01 + 1e-9
    assert len(got) <= 1 + len(states) + finishing < steps / 4  # not a message a step
    ids = done()
    assert sorted(ids) == sorted(set(ids)) and len(ids) == 12
    assert sum(len(m.events) for m in got) > len(ids)  # the rest rode along


def test_leases_expire_exactly_and_idle_sessions_are_forgotten(demo_model):
    scheduler = _scheduler(TenantAwareScheduler, demo_model)
    scheduler.kvlease.clock = clock = OffsetClock()
    scheduler.add_request(make_request("acme", "standard", 60, 8, session="chat"))
    _run(scheduler)
    state = scheduler.state()
    [lease] = state.leases
    assert lease.tenant_id == "acme" and 59 < lease.seconds_left <= 60
    assert state.tenants["acme"].cached_leased == 2  # 68 tokens: two full blocks
    clock.offset += lease.seconds_left - 0.01
    step(scheduler)
    assert scheduler.state().leases
    clock.offset += 0.02
    step(scheduler)
    state = scheduler.state()
    assert state.leases == []
    assert state.tenants["acme"] == TenantHolding(running=0, cached_leased=0, cached=2)
    assert scheduler.reset_prefix_cache()
    assert scheduler.kvlease.holders == {}
    assert scheduler.state().tenants == {}


def test_block_seconds_are_billed_for_running_and_leased_blocks_only(demo_model):
    scheduler = _scheduler(TenantAwareScheduler, demo_model)
    scheduler.kvlease.clock = clock = ManualClock()
    scheduler.add_request(make_request("std", "standard", 64, 4, session="a"))
    scheduler.add_request(make_request("fre", "free", 64, 4, session="b"))
    while scheduler.has_requests():
        clock.now += 1.0  # each step takes one second
        step(scheduler)
    held = dict(scheduler.kvlease.accounting.block_seconds)
    clock.now += 10.0
    scheduler.sample_accounting()
    after = scheduler.kvlease.accounting.block_seconds
    assert after["std"] == pytest.approx(held["std"] + 10.0 * 2)  # 2 leased blocks
    assert after["fre"] == pytest.approx(held["fre"])  # free tier: cached, not billed


def test_an_idle_gap_is_not_billed_to_the_next_request(demo_model):
    """Sampling on the clock (no debug mode): the first step after an idle minute must
    close that minute with what the idle engine held, before it allocates."""
    scheduler = make_scheduler(TenantAwareScheduler, demo_model, 24)
    scheduler.kvlease.clock = clock = ManualClock()
    scheduler.add_request(make_request("early", "free", 64, 4))
    steps = _run_on(scheduler, clock)
    clock.now += 60.0  # nothing runs for a minute
    scheduler.add_request(make_request("late", "free", 64, 4))
    steps = _run_on(scheduler, clock)
    # 64 prompt + 4 output tokens: at most 3 blocks of 32, for `steps` seconds
    assert 0 < scheduler.kvlease.accounting.block_seconds["late"] <= 3 * steps


def _run_on(scheduler, clock, seconds_per_step: float = 1.0) -> int:
    steps = 0
    while scheduler.has_requests():
        clock.now += seconds_per_step
        step(scheduler)
        steps += 1
    return steps


def test_scheduler_loads_by_dotted_path_as_plain_vllm_serve_does(demo_model):
    scheduler = make_scheduler(TenantAwareScheduler, demo_model, 24)
    config = scheduler.vllm_config.scheduler_config
    for cls in CLASSES:
        config.scheduler_cls = f"kvlease.engine.vllm_scheduler.{cls.__name__}"
        assert config.get_scheduler_cls() is cls


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_one_class_name_builds_the_variant_matching_vllms_async_setting(
    async_scheduling, demo_model
):
    scheduler = make_scheduler(
        TenantAwareScheduler, demo_model, 24, async_scheduling=async_scheduling
    )
    expected = TenantAwareAsyncScheduler if async_scheduling else TenantAwareScheduler
    assert type(scheduler) is expected


def test_engine_side_tenant_keys_stay_bounded_under_a_tenant_flood(demo_model, monkeypatch):
    monkeypatch.setenv("KVLEASE_MAX_TENANT_LABELS", "20")
    scheduler = _scheduler(TenantAwareScheduler, demo_model, blocks=64)
    for i in range(400):
        scheduler.add_request(make_request(f"flood-{i}", TIERS[i % 3], 40, 2, session=f"s{i}"))
    _run(scheduler)
    state = scheduler.state()
    for keys in (state.tenants, state.lease_summary, state.totals.block_seconds):
        assert len(keys) <= 21  # 20 tenants of their own, the rest as __other__
    assert "__other__" in state.lease_summary
    assert sum(x.active for x in state.lease_summary.values()) == state.leases_total


def _finish_turn(scheduler, request) -> None:
    scheduler.add_request(request)
    _run(scheduler)


def _conversation(turn_tokens: int, seed: int) -> list[int]:
    return [(seed * 97 + i) % 600 + 10 for i in range(turn_tokens)]


def test_a_lower_tier_never_takes_a_running_lease_while_it_can_preempt_its_own(demo_model):
    """Pool 23 blocks; the shipped caps let premium leases hold 4. A premium session's
    4-block prefix stays while three free requests outgrow the 19 blocks left: they
    preempt each other instead, and the premium's next turn finds its whole prefix.
    (With the payback on, a reservation that turns work away for 64 steps with nothing
    reused shrinks: test_a_reservation_that_only_turns_work_away_shrinks_to_one_block.)"""
    scheduler = _scheduler(TenantAwareScheduler, demo_model, reserve_payback=False)
    chat = _conversation(140, seed=1)
    _finish_turn(scheduler, make_request("pam", "premium", 0, 2, session="c", prompt=chat))
    holder = scheduler.kvlease.holders[("pam", "c")]
    assert holder.leased == 4  # 141 tokens of context: four full blocks of 32
    for i in range(3):
        scheduler.add_request(make_request(f"f{i}", "free", 100, 200, session=f"f{i}"))
    _run(scheduler, each_step=lambda s: _assert_leased(s, holder, 4))
    assert any(p[0] == "free" for p in scheduler.preemptions), "the churn must run short"
    assert holder.evicted_leased == 0
    turn2 = make_request("pam", "premium", 0, 2, session="c", prompt=chat + [5] * 20)
    scheduler.add_request(turn2)
    _, hit, _ = scheduler.kv_cache_manager.get_computed_blocks(turn2)
    assert hit == 128
    _run(scheduler)


def _assert_leased(scheduler, holder, blocks) -> None:
    assert holder.leased == blocks


def test_a_free_request_as_long_as_the_unreserved_pool_completes_beside_full_leases(
    demo_model,
):
    """Both leasing tiers at their caps (premium 4, standard 2 of 23 blocks): a free
    request of max_model_len (17 blocks) plus others still runs to the end."""
    scheduler = _scheduler(TenantAwareScheduler, demo_model)
    max_len = scheduler.max_model_len
    assert max_len == 17 * 32
    for i, (tier, tokens) in enumerate([("premium", 200), ("premium", 64), ("standard", 100)]):
        prompt = _conversation(tokens, seed=10 + i)
        _finish_turn(scheduler, make_request(f"l{i}", tier, 0, 1, session="s", prompt=prompt))
    leased = scheduler.kvlease.free_queue.reserved_sizes()
    assert leased == [2, 4]  # standard at its cap, premium at its cap
    long_free = make_request("big", "free", max_len - 40, 40)
    scheduler.add_request(long_free)
    for i in range(3):
        scheduler.add_request(make_request(f"f{i}", "free", 60, 120))
    _run(scheduler)
    assert long_free.is_finished() and len(long_free.output_token_ids) == 40
    assert scheduler.kvlease.free_queue.reserved_sizes() == [2, 4]


def test_a_tier_table_whose_caps_crowd_out_one_request_is_refused_at_start(demo_model, tmp_path):
    from kvlease.engine.settings import SettingsError

    greedy = (Path(__file__).parent.parent / "engine" / "tiers.toml").read_text()
    greedy = greedy.replace("leased_cache_cap = 0.2", "leased_cache_cap = 0.6")
    path = tmp_path / "greedy.toml"
    path.write_text(greedy)
    with pytest.raises(SettingsError, match=r"reserve \d+ of 23 KV blocks .* needs 14"):
        make_scheduler(
            TenantAwareScheduler, demo_model, 24, kvlease={"tiers": str(path)}, max_model_len=448
        )


def test_a_leased_next_turn_reports_what_its_lease_covered_and_reused(demo_model):
    scheduler = _scheduler(TenantAwareScheduler, demo_model)
    chat = _conversation(100, seed=3)
    _finish_turn(scheduler, make_request("sam", "standard", 0, 30, session="c", prompt=chat))
    context = chat + [7] * 30  # the synthetic model answers 7s
    scheduler.kvlease.events.drain()
    _finish_turn(scheduler, make_request("sam", "standard", 0, 2, session="c", prompt=context))
    [done] = [e for e in scheduler.kvlease.events.drain() if type(e).__name__ == "RequestDone"]
    assert done.lease_covered_tokens == 128  # 130 tokens of context: four whole blocks
    assert dict(scheduler.kvlease.accounting.lease_reuse_tokens) == {
        ("standard", "reused", True): 128,  # back at once: inside its reservation window
        ("standard", "lost", True): 0,
    }
    state = scheduler.state()
    assert sorted(state.totals.lease_reuse_tokens) == [
        ("standard", "lost", True, 0),
        ("standard", "reused", True, 128),
    ]
    # A first turn, or a session whose lease ran out, is not a leased next turn.
    _finish_turn(scheduler, make_request("new", "premium", 0, 2, session="x", prompt=chat))
    assert sum(scheduler.kvlease.accounting.lease_reuse_tokens.values()) == 128


def test_frees_vllm_defers_past_an_in_flight_step_stay_counted_and_owned(demo_model):
    """With deferred block freeing (KV-consumer connectors with async scheduling, or
    pipeline parallelism), a request that stops while a later step is in flight keeps
    its blocks until that step is done. They stay in the books (debug accounting checks
    every step) and, once vLLM returns them, are filed under the session's lease."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    scheduler = make_scheduler(
        TenantAwareScheduler,
        demo_model,
        24,
        kvlease={"debug_accounting": True},
        async_scheduling=True,
    )
    scheduler.defer_block_free = True  # as vLLM's own deferred-free tests force it
    params = SamplingParams(
        max_tokens=5,
        stop_token_ids=[42],
        extra_args={"tenant_id": "pam", "tier": "premium", "session_id": "c"},
    )
    request = Request(
        request_id="deferred",
        prompt_token_ids=_conversation(100, seed=9),
        sampling_params=params,
        pooling_params=None,
        cache_salt="pam",
        block_hasher=get_request_block_hasher(32, sha256),
    )

    def ran(out, token):
        ids = list(out.num_scheduled_tokens)
        return ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[token] for _ in ids],
        )

    scheduler.add_request(request)
    first, second = scheduler.schedule(), scheduler.schedule()  # step 2 in flight
    scheduler.update_from_output(first, ran(first, 42))  # stops: its free is deferred
    assert request.is_finished() and len(scheduler.deferred_frees) == 1
    holder = scheduler.kvlease.holders[("pam", "c")]
    assert holder.deferred == 1 and holder.leased == 0
    held = scheduler.state().tenants["pam"]
    assert held.running == 4  # 101 tokens in 4 blocks, still held
    scheduler.update_from_output(second, ran(second, 7))  # step 2 done: vLLM drains
    assert not scheduler.deferred_frees and holder.deferred == 0
    assert holder.leased == 3  # its three full blocks, under the premium lease
    scheduler.kvlease.free_queue.check()
    assert scheduler.state().tenants["pam"].running == 0


def _served(scheduler, tenants) -> dict[str, int]:
    return {
        t: sum(
            r.num_computed_tokens
            for r in scheduler.requests.values()
            if r.sampling_params.extra_args.get("tenant_id") == t
        )
        for t in tenants
    }


@pytest.mark.parametrize("cls", CLASSES)
def test_a_heavy_tenant_of_a_tier_gets_its_share_not_ten_times_it(cls, demo_model):
    """One tier, a tenant sending ten times as many requests as the other, on a pool that
    holds 11 of the 22: the light tenant is admitted at once, not behind the heavy one's
    backlog, and the counters of the two while both wait stay within VTC's bound for
    continuous batching, 2 x (largest prompt + 2 x the tokens the pool holds). Strict
    fair share (no slack): with it the heavy tenant's older requests would go first."""
    scheduler = _scheduler(cls, demo_model, blocks=24, fair_slack=0)
    heavy = [make_request("heavy", "free", 64, 32) for _ in range(20)]
    light = [make_request("light", "free", 64, 32) for _ in range(2)]
    for request in heavy + light:
        scheduler.add_request(request)
    step(scheduler)
    admitted = {r.request_id for r in scheduler.running}
    assert {r.request_id for r in light} <= admitted  # not behind the heavy tenant's 20
    share = scheduler.kvlease.shares["free"]
    bound = 2 * (64 * INPUT_COST + OUTPUT_COST * 23 * 32)
    while scheduler.has_requests():
        waiting = {a.tenant: a.counter for a in share.accounts.values() if a.waiting}
        if len(waiting) == 2:
            assert abs(waiting["heavy"] - waiting["light"]) <= bound
        step(scheduler)


@pytest.mark.parametrize("cls", CLASSES)
def test_a_tenant_with_one_request_waiting_is_booked_the_admission_it_waited_for(cls, demo_model):
    """vLLM appends a request to `running` right after taking it from the waiting queue,
    so the prompt charged at that admission is booked as service while the tenant waited
    (kvlease.engine.fairness): a light tenant beside a heavy one reads its share, not an
    entitlement with nothing served (a fair-share ratio of 0, and the alert)."""
    scheduler = _scheduler(cls, demo_model, blocks=24, fair_slack=0)
    for request in [make_request("heavy", "free", 64, 32) for _ in range(20)]:
        scheduler.add_request(request)
    scheduler.add_request(make_request("light", "free", 64, 32))
    step(scheduler)  # heavy's first, then light's only request, then heavy's ...
    books = scheduler.kvlease.shares["free"].shares()
    _, served, entitled = books["light"]
    assert served > 0 and 0.5 <= served / entitled <= 2
    assert books["heavy"][1] > 0
    _run(scheduler)


def test_fair_share_off_serves_a_tier_first_come_first_served(demo_model):
    scheduler = _scheduler(TenantAwareScheduler, demo_model, blocks=24, fair_share=False)
    heavy = [make_request("heavy", "free", 64, 32) for _ in range(20)]
    light = make_request("light", "free", 64, 32)
    for request in [*heavy, light]:
        scheduler.add_request(request)
    step(scheduler)
    assert light.request_id not in {r.request_id for r in scheduler.running}
    _run(scheduler)


def test_with_fair_slack_an_older_request_passes_a_tenant_within_the_slack(demo_model):
    """`fair_slack` reaches the tier's waiting queue: the heavy tenant's older requests
    go first while its counter stays within the slack of the light tenant's, so with a
    slack of 2,000 weighted tokens the light one waits behind some, and not behind all."""
    scheduler = _scheduler(TenantAwareScheduler, demo_model, blocks=24, fair_slack=2000)
    heavy = [make_request("heavy", "free", 64, 32) for _ in range(40)]
    light = make_request("light", "free", 64, 32)
    for request in [*heavy, light]:
        scheduler.add_request(request)
    admitted_before = 0
    while light.num_computed_tokens == 0:
        step(scheduler)
        admitted_before = sum(1 for r in heavy if r.num_computed_tokens)
    assert 11 < admitted_before < 40  # more than a pool's worth (11): some, not all
    _run(scheduler)


def _shipped_tiers_with(tmp_path: Path, old: str, new: str) -> str:
    """The shipped tier table with `old` replaced by `new`, written under `tmp_path`."""
    text = resources.files("kvlease.engine").joinpath("tiers.toml").read_text()
    assert old in text
    path = tmp_path / "tiers.toml"
    path.write_text(text.replace(old, new))
    return str(path)


def _capped_tiers(tmp_path: Path, share: float) -> str:
    return _shipped_tiers_with(
        tmp_path, "[tiers.free]\n", f"[tiers.free]\nmax_tenant_kv_share = {share}\n"
    )


@pytest.mark.parametrize("cls", CLASSES)
def test_a_tenant_at_its_kv_cap_waits_or_preempts_itself_never_another(cls, demo_model, tmp_path):
    tiers = _capped_tiers(tmp_path, 0.25)
    scheduler = make_scheduler(
        recording(cls), demo_model, 64, max_model_len=256,
        kvlease={"debug_accounting": True, "tiers": tiers},
    )  # fmt: skip
    cap = scheduler.kvlease.kv_caps["free"]
    hog = [make_request("hog", "free", 100, 150) for _ in range(6)]
    small = [make_request("small", "free", 100, 150)]  # 8 blocks at most: under its cap
    for request in hog + small:
        scheduler.add_request(request)

    held = [0]

    def within_cap(s):
        account = s.kvlease.shares["free"].accounts.get("hog")
        if account is not None:
            held.append(s.kvlease.held_blocks(account)[0])
            assert held[-1] <= cap

    _run(scheduler, each_step=within_cap)
    assert max(held) == cap  # the cap bound: the hog asked for 48 blocks
    assert all(r.num_preemptions == 0 for r in small)  # the hog paid for itself
    assert sum(r.num_preemptions for r in hog) == len(scheduler.preemptions) > 0


def test_a_kv_share_too_small_for_one_request_is_refused_at_start(demo_model, tmp_path):
    from kvlease.engine.settings import SettingsError

    with pytest.raises(SettingsError, match="max_tenant_kv_share lets one tenant hold 6 of 63"):
        make_scheduler(
            TenantAwareScheduler, demo_model, 64, max_model_len=256,
            kvlease={"tiers": _capped_tiers(tmp_path, 0.1)},
        )  # fmt: skip


def _turn_on(scheduler, clock, request) -> None:
    """One turn, a second per step, so that only the test moves the lease clock."""
    scheduler.add_request(request)
    _run_on(scheduler, clock)


def test_a_premium_turn_is_reserved_for_its_window_then_retained_until_its_lease_ends(
    demo_model,
):
    """No history yet: the window is the tier's `reserve_max_seconds` (60 s), well inside
    the 300 s lease. Within it the blocks are RESERVED; after it, RETAINED (evicted
    last, but any tier may take them); after the lease, plain cached blocks."""
    scheduler = _scheduler(TenantAwareScheduler, demo_model)
    scheduler.kvlease.clock = clock = ManualClock()
    chat = _conversation(140, seed=3)
    _turn_on(scheduler, clock, make_request("pam", "premium", 0, 2, session="c", prompt=chat))
    holder = scheduler.kvlease.holders[("pam", "c")]
    ended = clock.now
    assert (holder.leased, holder.reserved) == (4, 4)
    clock.now = ended + 55.0  # its steps take a few more seconds
    _turn_on(scheduler, clock, make_request("fay", "free", 32, 1))
    assert (holder.leased, holder.reserved) == (4, 4)
    clock.now = ended + 61.0
    _turn_on(scheduler, clock, make_request("fay", "free", 32, 1))
    assert (holder.leased, holder.reserved) == (4, 0)
    assert scheduler.kvlease.leases.active(("pam", "c"))
    clock.now = ended + 301.0
    _turn_on(scheduler, clock, make_request("fay", "free", 32, 1))
    assert (holder.leased, holder.cached) == (0, 4)


def test_a_leased_turn_is_counted_inside_or_after_its_reservation_window(demo_model):
    """The lease hit the alert holds to 90% is that of turns back inside their window;
    a turn back after it (its lease still running, 300 s) counts apart. With no history
    premium's window is its `reserve_max_seconds`, 60 s."""
    scheduler = _scheduler(TenantAwareScheduler, demo_model)
    scheduler.kvlease.clock = clock = ManualClock()
    chat = _conversation(100, seed=5)
    _turn_on(scheduler, clock, make_request("pam", "premium", 0, 30, session="c", prompt=chat))
    holder = scheduler.kvlease.holders[("pam", "c")]
    ended = holder.reserved_until - 60.0
    context = chat + [7] * 30
    clock.now = ended + 10.0
    _turn_on(scheduler, clock, make_request("pam", "premium", 0, 30, session="c", prompt=context))
    assert dict(scheduler.kvlease.accounting.lease_reuse_tokens) == {
        ("premium", "reused", True): 128,
        ("premium", "lost", True): 0,
    }
    ended = holder.reserved_until - 60.0
    clock.now = ended + 100.0  # its window closed 40 s ago; its lease runs 200 s more
    context += [7] * 30
    assert scheduler.kvlease.leases.active(("pam", "c"))
    _turn_on(scheduler, clock, make_request("pam", "premium", 0, 2, session="c", prompt=context))
    assert scheduler.kvlease.accounting.lease_reuse_tokens[("premium", "reused", False)] == 128


def test_a_turn_back_within_its_window_keeps_the_reservation_while_it_waits_for_blocks(
    demo_model, tmp_path
):
    """A standard session's 2 blocks are reserved for 30 s after its turn. Three free
    requests fill the other 21 blocks; the session's next turn comes back at 25 s and
    waits (standard does not preempt to be admitted) past the window's end, until free
    work is preempted. Its blocks stay reserved until it is admitted, so free work
    cannot evict them: it finds its whole prefix, and the window closes at admission."""
    tiers = _shipped_tiers_with(
        tmp_path, "[tiers.standard]\n", "[tiers.standard]\nreserve_max_seconds = 30\n"
    )
    scheduler = _scheduler(TenantAwareScheduler, demo_model, tiers=tiers)
    scheduler.kvlease.clock = clock = ManualClock()
    chat = _conversation(70, seed=7)
    _turn_on(scheduler, clock, make_request("sam", "standard", 0, 2, session="s", prompt=chat))
    holder = scheduler.kvlease.holders[("sam", "s")]
    ended = holder.reserved_until - 30.0  # the window's start: the turn's last step
    assert holder.reserved == 2 and clock.now - 1.0 <= ended <= clock.now
    clock.now = ended + 20.0
    for _ in range(3):
        scheduler.add_request(make_request("fay", "free", 200, 60))  # 7 blocks each
    step(scheduler)
    clock.now = ended + 25.0
    back = make_request("sam", "standard", 0, 2, session="s", prompt=chat + [5] * 100)
    scheduler.add_request(back)
    admitted_at = hit = None
    while scheduler.has_requests():
        clock.now += 1.0
        out, _ = step(scheduler)
        scheduler.kvlease.free_queue.check()
        if admitted_at is None and back.status is RequestStatus.RUNNING:
            admitted_at, hit = (
                clock.now,
                back.num_computed_tokens - out.num_scheduled_tokens[back.request_id],
            )
            assert not holder.reserving  # the window closed as the turn was admitted
        if admitted_at is None:
            assert holder.reserved == 2
    assert admitted_at is not None and admitted_at > ended + 30.0  # it waited past the window
    assert hit == 64  # its two blocks, from the cache


def test_blocks_a_session_frees_while_its_turn_still_runs_are_retained_not_reserved(
    demo_model,
):
    """Two requests of one premium session in flight: the short one's blocks wait for
    no return while the long one runs, so lower tiers are not kept from them; the turn's
    end (the long one finishing) opens the reservation window for what it frees."""
    scheduler = _scheduler(TenantAwareScheduler, demo_model)
    scheduler.kvlease.clock = clock = ManualClock()
    short = make_request("pam", "premium", 0, 2, session="c", prompt=_conversation(70, seed=5))
    long = make_request("pam", "premium", 0, 40, session="c", prompt=_conversation(70, seed=6))
    scheduler.add_request(short)
    scheduler.add_request(long)
    holder = scheduler.kvlease.holders[("pam", "c")]
    while long.request_id in scheduler.requests:
        clock.now += 1.0
        step(scheduler)
        scheduler.kvlease.free_queue.check()
        if short.request_id not in scheduler.requests and long.request_id in scheduler.requests:
            assert (holder.leased, holder.reserved) == (2, 0)  # short's 2 full blocks
    # long's 110 tokens: 3 full blocks, reserved; short's, which the turn's last request
    # did not reuse, are stale prefixes from then on: plain cached blocks
    assert (holder.leased, holder.reserved, holder.cached) == (3, 3, 2)


def test_one_shot_sessions_reserve_nothing_once_their_tenant_has_shown_they_never_return(
    demo_model,
):
    scheduler = _scheduler(TenantAwareScheduler, demo_model)
    scheduler.kvlease.clock = clock = ManualClock()
    reserved = []
    for n in range(5):
        prompt = _conversation(70, seed=20 + n)
        _turn_on(
            scheduler, clock, make_request("solo", "premium", 0, 2, session=f"q{n}", prompt=prompt)
        )
        holder = scheduler.kvlease.holders[("solo", f"q{n}")]
        reserved.append((holder.leased, holder.reserved))
    # Two turns on the prior (return rate 1/2); from the third, the tenant's return rate
    # (1/4, 1/5, ...) reserves nothing: the blocks are only retained by their lease.
    assert reserved == [(2, 2), (2, 2), (2, 0), (2, 0), (2, 0)]
    # The prior's two windows were provisional: the third turn's end closed them, long
    # before their 60 s, so nothing stays reserved for sessions that never came back.
    holders = [scheduler.kvlease.holders[("solo", f"q{n}")] for n in range(5)]
    assert [(h.leased, h.reserved) for h in holders] == [(2, 0)] * 5
    assert scheduler.kvlease.free_queue.reserved_sizes() == [0, 0]
    # and their reserved time is billed up to the close, not to the 60 s window's end
    episodes = scheduler.kvlease.retention.episodes
    closed = episodes[holders[2]].started
    for h in holders[:2]:
        assert episodes[h].reserved_seconds == pytest.approx(2 * (closed - episodes[h].started))


@pytest.mark.parametrize(("mode", "reserved"), [("lease", 2), ("never", 0)])
def test_the_reserve_setting_overrides_every_tiers_mode(demo_model, mode, reserved):
    scheduler = _scheduler(TenantAwareScheduler, demo_model, reserve=mode)
    scheduler.kvlease.clock = clock = ManualClock()
    for n in range(5):
        prompt = _conversation(70, seed=30 + n)
        _turn_on(
            scheduler, clock, make_request("solo", "premium", 0, 2, session=f"q{n}", prompt=prompt)
        )
        assert scheduler.kvlease.holders[("solo", f"q{n}")].reserved == reserved


def _retentions(scheduler) -> list:
    return [e for e in scheduler.kvlease.events.drain() if type(e).__name__ == "Retention"]


@pytest.mark.parametrize("events", [EVENT_CAPACITY, 0])
def test_the_time_between_turns_is_metered_as_reserved_then_retained_block_seconds(
    demo_model, events
):
    """4 blocks reserved for the 60 s window, then retained for the rest of the 300 s
    lease: one record of 240 reserved and 960 retained block-seconds, from the turn's
    request, when the lease ends; the totals for the metrics say the same. With nothing
    reading events (no channel) no record is built, and the totals are the same."""
    scheduler = _scheduler(TenantAwareScheduler, demo_model, event_capacity=events)
    scheduler.kvlease.clock = clock = ManualClock()
    chat = _conversation(140, seed=3)
    turn = make_request("pam", "premium", 0, 2, session="c", prompt=chat)
    _turn_on(scheduler, clock, turn)
    ended = clock.now
    for at in (30.0, 61.0, 200.0, 301.0):
        clock.now = ended + at
        _turn_on(scheduler, clock, make_request("fay", "free", 32, 1))
    records = _retentions(scheduler)
    assert len(records) == (1 if events else 0)
    for record in records:
        assert (record.request_id, record.tenant_id, record.tier, record.session_id) == (
            turn.request_id, "pam", "premium", "c",
        )  # fmt: skip
        assert ended - 1.0 <= record.started <= ended and record.at == record.started + 300.0
        assert record.reserved_block_seconds == pytest.approx(4 * 60.0)
        assert record.retained_block_seconds == pytest.approx(4 * 240.0)
    totals = {
        (t, tier, state): v
        for t, tier, state, v in scheduler.state().totals.retention_block_seconds
    }
    assert totals == pytest.approx(
        {("pam", "premium", "reserved"): 240.0, ("pam", "premium", "retained"): 960.0}
    )


def test_a_next_turn_closes_the_time_between_turns_and_a_free_turn_holds_nothing(demo_model):
    scheduler = _scheduler(TenantAwareScheduler, demo_model)
    scheduler.kvlease.clock = clock = ManualClock()
    chat = _conversation(140, seed=4)
    _turn_on(scheduler, clock, make_request("fay", "free", 0, 2, session="f", prompt=chat))
    first = make_request("pam", "premium", 0, 2, session="c", prompt=chat[:100])
    _turn_on(scheduler, clock, first)
    ended = clock.now
    clock.now = ended + 5.0
    scheduler.add_request(make_request("pam", "premium", 0, 2, session="c", prompt=chat))
    (record,) = _retentions(scheduler)
    assert record.request_id == first.request_id and record.at == ended + 5.0
    held = record.at - record.started  # 5 s, and the step the turn ended in
    assert record.reserved_block_seconds == pytest.approx(held * 3)  # 100 tokens: 3 blocks
    assert record.retained_block_seconds == 0.0
    _run_on(scheduler, clock)


# -- each mechanism can be turned off, for the ablations of bench/policy.py ----------------


def _reasons(scheduler) -> set[str]:
    return {e.reason for e in scheduler.kvlease.events.drain() if type(e).__name__ == "Preemption"}


def _into_a_full_pool(scheduler, tier: str = "premium") -> tuple[set[str], bool]:
    """Free work holds most of the pool when a request of `tier` arrives: (the preemption
    reasons of its step, whether it was admitted in it)."""
    for prompt in (300, 40):
        scheduler.add_request(make_request("free-1", "free", prompt, 200))
    step(scheduler)
    vip = make_request("vip", tier, 400, 10)  # 13 blocks: 11 are free
    scheduler.add_request(vip)
    out, _ = step(scheduler)
    return _reasons(scheduler), vip.request_id in out.num_scheduled_tokens


def test_a_tier_that_may_not_preempt_to_admit_waits_as_on_stock_vllm(demo_model, tmp_path):
    """The shipped table lets premium alone preempt to be admitted: a standard request
    into the same full pool waits for free blocks, unless its tier says otherwise."""
    shipped = _scheduler(TenantAwareScheduler, demo_model)
    assert _into_a_full_pool(shipped, "standard") == (set(), False)
    _run(shipped)
    tiers = _shipped_tiers_with(tmp_path, "preempt_to_admit = false", "preempt_to_admit = true")
    allowed = _scheduler(TenantAwareScheduler, demo_model, tiers=tiers)
    assert _into_a_full_pool(allowed, "standard") == ({"admit_higher_tier"}, True)
    _run(allowed)


def test_without_admission_preemption_a_waiting_tier_never_preempts_a_running_one(demo_model):
    on = _scheduler(TenantAwareScheduler, demo_model)
    assert _into_a_full_pool(on) == ({"admit_higher_tier"}, True)
    off = _scheduler(TenantAwareScheduler, demo_model, admission_preemption=False)
    assert _into_a_full_pool(off) == (set(), False)  # it waits, as with stock vLLM
    _run(off)


def test_without_class_ordered_service_running_is_first_come_first_served_and_victims_by_class(
    demo_model,
):
    scheduler = _scheduler(TenantAwareScheduler, demo_model, class_service=False)

    def admission_order(s):
        keys = [s._service_key(r) for r in s.running]
        assert keys == sorted(keys) and {k[0] for k in keys} <= {(0, 0, 0)}

    for i in range(12):
        scheduler.add_request(make_request(f"t{i}", TIERS[i % 3], 40, 200, session=f"s{i}"))
    _run(scheduler, each_step=admission_order)
    assert scheduler.preemptions, "the trace must create pressure"
    # The victim is still the lowest class running: premium only when nothing lower runs.
    assert not [p for p in scheduler.preemptions if p[0] == "premium" and set(p[1]) - {"premium"}]


def test_without_lease_eviction_order_a_closed_window_leaves_plain_cached_blocks(demo_model):
    scheduler = _scheduler(TenantAwareScheduler, demo_model, lease_order=False)
    scheduler.kvlease.clock = clock = ManualClock()
    chat = _conversation(140, seed=3)
    _turn_on(scheduler, clock, make_request("pam", "premium", 0, 2, session="c", prompt=chat))
    holder = scheduler.kvlease.holders[("pam", "c")]
    assert (holder.leased, holder.reserved) == (4, 4)  # the reservation still holds
    clock.now += 61.0
    _turn_on(scheduler, clock, make_request("fay", "free", 32, 1))
    assert (holder.leased, holder.cached) == (0, 4)  # not retained: LRU, as vLLM's
    assert scheduler.kvlease.leases.active(("pam", "c"))


@pytest.mark.parametrize(("payback", "cap"), [(True, 1), (False, 4)])
def test_a_reservation_that_only_turns_work_away_shrinks_to_one_block(demo_model, payback, cap):
    """Premium sessions that never come back, each reserving its 4 blocks (the tier's cap
    on 23) for its lease and pushing out the last one's, while free requests outgrow the
    unreserved pool: the reservation turns work away step after step and saves nothing,
    so the payback tuner shrinks premium's cap a quarter per generation (16 blocks gone)
    to one block by the thirteenth session, unless it is off."""
    scheduler = _scheduler(
        TenantAwareScheduler, demo_model, reserve="lease", reserve_payback=payback
    )
    scheduler.kvlease.clock = clock = ManualClock()
    premium = scheduler.kvlease.lease_index["premium"]
    for n in range(13):
        prompt = _conversation(140, seed=40 + n)
        scheduler.add_request(make_request(f"p{n}", "premium", 0, 2, session="c", prompt=prompt))
        for _ in range(3):
            scheduler.add_request(make_request("fay", "free", 100, 120))
        _run_on(scheduler, clock, seconds_per_step=0.01)  # within every lease
    queue = scheduler.kvlease.free_queue
    assert queue.reserved_left[premium] >= 12 * 4 and queue.reserved_reused[premium] == 0
    assert scheduler.kvlease.payback.caps[premium] == cap
    assert queue.reserved_sizes()[premium] == cap
    queue.check()


# -- who took whose cache ---------------------------------------------------------------


def test_an_admission_preemption_is_the_admitted_tiers_doing(demo_model):
    scheduler = _scheduler(TenantAwareScheduler, demo_model)
    for prompt in (300, 40):
        scheduler.add_request(make_request("free-1", "free", prompt, 200))
    step(scheduler)
    scheduler.add_request(make_request("vip", "premium", 400, 10))
    step(scheduler)
    [preempted] = [e for e in scheduler.kvlease.events.drain() if type(e).__name__ == "Preemption"]
    assert (preempted.tier, preempted.reason) == ("free", "admit_higher_tier")
    assert (preempted.by_tier, preempted.by_tenant) == ("premium", "vip")
    counted = {k[4] for k in scheduler.kvlease.accounting.preemptions}
    assert counted == {"premium"}


def test_every_preemption_and_eviction_names_the_allocation_that_caused_it(demo_model):
    """Under pressure each preemption is caused by a running or admitted request's
    allocation, and each request's recomputed tokens split by cause add up to its total."""
    scheduler = _scheduler(TenantAwareScheduler, demo_model)
    for i in range(12):
        scheduler.add_request(make_request(f"t{i}", TIERS[i % 3], 40, 200, session=f"s{i}"))
    events = []
    _run(scheduler, each_step=lambda s: events.extend(s.kvlease.events.drain()))
    kinds = {type(e).__name__ for e in events}
    preempted = [e for e in events if type(e).__name__ == "Preemption"]
    assert preempted and all(e.by_tier in TIERS and e.by_tenant for e in preempted)
    # kvlease takes from the lowest class first: a lower tier never takes a higher one's
    rank = {t: i for i, t in enumerate(TIERS)}
    assert all(rank[e.by_tier] <= rank[e.tier] for e in preempted), kinds
    for done in (e for e in events if type(e).__name__ == "RequestDone"):
        assert sum(done.recomputed_by.values()) == done.recomputed_tokens
    evicted = [e for e in events if type(e).__name__ == "Eviction"]
    assert all(e.by_tier in (*TIERS, "none") for e in evicted)


def test_under_pressure_an_eviction_names_the_allocation_the_free_queue_logged_it_with(
    demo_model,
):
    """In a step whose running requests may begin more blocks than are free, kvlease's
    wrapper allocates, and the free queue logs each block it evicts with the request
    allocating (the step's output could name another, were that request preempted later
    in the step and its block handed on). Here the third decode runs short and preempts
    itself. In the step before, with as few blocks free but no decode beginning a block,
    vLLM allocates alone."""
    scheduler = _scheduler(TenantAwareScheduler, demo_model)  # 23 blocks
    _finish_turn(scheduler, make_request("old", "free", 2 * BLOCK, 1))  # 2 blocks cached
    for name in ("f0", "f1", "f2"):  # 7 blocks each, the last one short of full by a token
        scheduler.add_request(make_request(name, "free", 7 * BLOCK - 1, 9, request_id=name))
    kv, manager = scheduler.kvlease, scheduler.kv_cache_manager
    step(scheduler)  # their prefills: the 21 empty blocks
    kv.events.drain()
    step(scheduler)  # each decode fills its last block: 2 blocks free for 3 running
    assert manager.allocate_slots == kv.allocate  # vLLM's own
    assert kv.free_queue.free_unreserved == 2
    step(scheduler)  # each decode begins a block: 3 wanted, 2 free
    assert manager.allocate_slots == kv.wrapped_allocate
    events = kv.events.drain()
    evicted = [e for e in events if type(e).__name__ == "Eviction"]
    assert sorted((e.tenant_id, e.by_tier, e.by_tenant, e.blocks) for e in evicted) == [
        ("old", "free", "f0", 1),
        ("old", "free", "f1", 1),
    ]
    assert [e.request_id for e in events if type(e).__name__ == "Preemption"] == ["f2"]


def test_an_eviction_without_pressure_names_the_request_its_block_went_to(demo_model):
    """In a step that cannot run short vLLM allocates through its own method (no
    wrapper); each cached block it evicts is still charged to the request that took it
    (read off the step's output)."""
    scheduler = _scheduler(TenantAwareScheduler, demo_model, blocks=300)
    for _ in range(9):  # one tenant's prefixes fill the cache: 9 x 33 of 299 blocks
        scheduler.add_request(make_request("old", "free", 32 * BLOCK, 1))
        _run(scheduler)
    scheduler.kvlease.events.drain()
    scheduler.add_request(make_request("new", "standard", 20 * BLOCK, 1))
    step(scheduler)
    assert scheduler.kv_cache_manager.allocate_slots == scheduler.kvlease.allocate  # vLLM's
    evicted = [e for e in scheduler.kvlease.events.drain() if type(e).__name__ == "Eviction"]
    assert {(e.tenant_id, e.by_tier, e.by_tenant) for e in evicted} == {("old", "standard", "new")}
    counted = {k: n for k, n in scheduler.kvlease.accounting.evicted_blocks.items() if n}
    assert {k[-1] for k in counted} == {"standard"}


def test_the_cheap_allocation_bound_is_used_only_where_vllm_counts_blocks_per_token():
    """A running request with d computed tokens takes at most cdiv(d + n, block_size) -
    cdiv(d, block_size) new blocks for its next n, so the allocation wrapper may skip its
    reservation path when that many are free. That holds
    for vLLM's base block count (one group of full attention, as the demo model's, or of
    sliding window), not for Mamba's state blocks, a ring buffer or several groups: there
    every allocation takes the full path."""
    from vllm.v1.core.single_type_kv_cache_manager import (
        CircularBufferManager,
        FullAttentionManager,
        MambaManager,
        SlidingWindowManager,
    )

    from kvlease.engine.vllm_scheduler import _block_unit

    def manager(kind):
        built = object.__new__(kind)  # only its kind and block size are read
        built.block_size = 64
        return built

    assert _block_unit((manager(FullAttentionManager),)) == 64
    assert _block_unit((manager(SlidingWindowManager),)) == 64
    assert _block_unit((manager(MambaManager),)) == 0
    assert _block_unit((manager(CircularBufferManager),)) == 0
    assert _block_unit((manager(FullAttentionManager), manager(MambaManager))) == 0


def test_the_demo_models_scheduler_takes_the_cheap_allocation_bound(demo_model):
    scheduler = _scheduler(TenantAwareScheduler, demo_model)
    assert scheduler.kvlease.block_unit == BLOCK


def test_a_decode_inside_its_last_block_skips_the_reservation_path_however_short_the_pool(
    demo_model,
):
    """A running request holds the blocks of its computed tokens, so a decode inside its
    last block takes no new block: the wrapper sends it straight to vLLM even when at most
    one unreserved block is free. Only allocations that begin a block take the full path
    (the reservation check, the victim). Pool 23 blocks, premium's 4 reserved, twelve
    3-block free requests churning through the other 19."""
    scheduler = _scheduler(TenantAwareScheduler, demo_model, reserve_payback=False)
    _finish_turn(scheduler, make_request("pam", "premium", 0, 2, session="c",
                                         prompt=_conversation(140, seed=1)))  # fmt: skip
    kv, manager = scheduler.kvlease, scheduler.kv_cache_manager
    allocate, allocate_leasing = kv.allocate, scheduler._allocate_leasing
    dry_decodes, full_path = [], []  # new blocks of: running allocations with at most one
    # unreserved block free; running allocations that took the full path

    def new_blocks(request, tokens, lookahead):
        held = len(manager.coordinator.get_blocks(request.request_id)[0])
        return blocks_for(request.num_computed_tokens + tokens + lookahead, BLOCK) - held

    def vllms(request, tokens, *args, num_lookahead_tokens=0, **kwargs):
        if request.status is RequestStatus.RUNNING and kv.free_queue.free_unreserved <= 1:
            dry_decodes.append(new_blocks(request, tokens, num_lookahead_tokens))
        return allocate(request, tokens, *args, num_lookahead_tokens=num_lookahead_tokens,
                        **kwargs)  # fmt: skip

    def leasing(request, running, most, args, kwargs):
        if running:
            full_path.append(new_blocks(request, args[0], kwargs["num_lookahead_tokens"]))
        return allocate_leasing(request, running, most, args, kwargs)

    kv.allocate, scheduler._allocate_leasing = vllms, leasing
    manager.allocate_slots = kv.wrapped_allocate  # `_choose_allocator` swaps only its own two
    for i in range(12):
        scheduler.add_request(make_request(f"f{i}", "free", 30, 60, session=f"f{i}"))
    _run(scheduler)
    assert kv.holders[("pam", "c")].reserved == 4
    assert dry_decodes.count(0) > 10, "decodes must run with at most one unreserved block free"
    assert full_path and min(full_path) >= 1  # each began a block


def _wrapper_trace(cls, demo_model, always_wrapped: bool) -> tuple[list, list, int]:
    """A premium session's lease reserving 4 blocks, its next turn, and free requests
    churning through the rest of a 23-block pool; on a clock that moves a step at a time.
    Returns each step's scheduled tokens, the events, and the steps vLLM allocated alone."""
    scheduler = _scheduler(cls, demo_model, reserve_payback=False)
    if always_wrapped:  # the wrapper in every step that may run short by the cheap bound
        scheduler._may_run_short = lambda free: True
    kv, manager = scheduler.kvlease, scheduler.kv_cache_manager
    kv.clock = clock = ManualClock()
    chat = _conversation(200, seed=1)
    turns = {0: chat[:140], 40: chat}  # step -> the premium session's turn
    scheduled, events, alone = [], [], 0
    for n in range(400):
        if n in turns:
            prompt = turns[n]
            scheduler.add_request(make_request("pam", "premium", 0, 2, session="c",
                                               prompt=prompt, request_id=f"pam{n}",
                                               arrival=float(n)))  # fmt: skip
        if 5 <= n < 29:
            prompt = [(n * 31 + i) % 600 + 10 for i in range(30 + n)]
            scheduler.add_request(make_request(f"f{n % 6}", "free", 0, 60, request_id=f"f{n}",
                                               prompt=prompt, arrival=float(n)))  # fmt: skip
        if n > max(turns) and not scheduler.has_requests():
            break
        out, _ = step(scheduler)
        alone += manager.allocate_slots == kv.allocate
        scheduled.append(dict(out.num_scheduled_tokens))
        events += kv.events.drain()
        kv.free_queue.check()
        clock.now += 0.05
    assert not scheduler.has_requests()
    return scheduled, events, alone


@pytest.mark.parametrize("cls", CLASSES)
def test_sparing_the_wrapper_where_no_running_request_can_run_short_changes_no_decision(
    cls, demo_model
):
    """The sharper bound (`_may_run_short`) leaves vLLM to allocate alone in steps where
    the wrapper would have allocated: the same requests are scheduled, preempted, evicted
    and reserved for, step for step, as with the wrapper in every step that may run short."""
    sharp = _wrapper_trace(cls, demo_model, always_wrapped=False)
    wrapped = _wrapper_trace(cls, demo_model, always_wrapped=True)
    assert sharp[0] == wrapped[0]
    assert sharp[1] == wrapped[1]
    kinds = {type(e).__name__ for e in sharp[1]}
    assert {"Preemption", "Eviction", "LeaseEvent"} <= kinds, kinds
    assert wrapped[2] < sharp[2]  # the sharper bound spared the wrapper in more steps
