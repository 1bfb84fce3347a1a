import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlease.engine.policy import (
    Candidate,
    CostModel,
    EvictionClass,
    VictimRule,
    admission_victims,
    eviction_class,
    keep_key,
    lease_caps_error,
    leased_cap_blocks,
    leases_yield,
    may_take,
    preemption_mode,
    service_key,
    unreserved_blocks,
    victim_class,
    victim_order,
)

candidates = st.lists(
    st.builds(
        Candidate,
        classified=st.booleans(),
        leased=st.booleans(),
        tier_priority=st.integers(0, 3),
        last_activity=st.floats(0, 1e6, allow_nan=False),
        computed_tokens=st.integers(0, 10_000),
        seq=st.integers(0, 10**9),
    ),
    max_size=30,
    unique_by=lambda c: c.seq,
)
rules = st.sampled_from(list(VictimRule))


def _class(c: Candidate) -> tuple[int, int, int]:
    if not c.classified:
        return (0, 0, 0)
    return (1, int(c.leased), -c.tier_priority)


@given(cs=candidates, rule=rules, data=st.data())
def test_victim_order_is_deterministic_whatever_the_input_order(cs, rule, data):
    shuffled = data.draw(st.permutations(cs))
    assert victim_order(shuffled, rule) == victim_order(cs, rule)


@given(cs=candidates, rule=rules)
def test_victim_order_is_total(cs, rule):
    keys = [keep_key(c, rule) for c in cs]
    assert len(set(keys)) == len(keys)


@given(cs=candidates, rule=rules, extra=candidates)
def test_adding_candidates_never_reorders_the_others(cs, rule, extra):
    extra = [c for c in extra if c.seq not in {x.seq for x in cs}]
    before = victim_order(cs, rule)
    after = [c for c in victim_order(cs + extra, rule) if c in cs]
    assert after == before


@given(cs=candidates, rule=rules)
def test_victims_come_unclassified_then_unleased_then_lower_tier_first(cs, rule):
    order = victim_order(cs, rule)
    for a, b in itertools.pairwise(order):
        assert _class(a) <= _class(b)
        if _class(a) == _class(b):
            if not a.classified:  # vLLM's own order: the newest admission first
                assert a.seq > b.seq
            elif rule is VictimRule.LRU:
                assert a.last_activity <= b.last_activity
            else:
                assert a.computed_tokens <= b.computed_tokens


def _c(seq, **kw):
    base = dict(
        classified=True, leased=True, tier_priority=0, last_activity=0.0, computed_tokens=0, seq=seq
    )
    return Candidate(**{**base, **kw})


def test_worked_example_from_the_readme():
    unclassified = _c(1, classified=False)
    free = _c(2, leased=False, tier_priority=2, last_activity=5.0, computed_tokens=900)
    standard_old = _c(3, tier_priority=1, last_activity=1.0, computed_tokens=800)
    standard_new = _c(4, tier_priority=1, last_activity=9.0, computed_tokens=50)
    premium = _c(5, tier_priority=0, last_activity=0.0, computed_tokens=10)
    everyone = [premium, standard_new, standard_old, free, unclassified]
    assert victim_order(everyone, VictimRule.LRU) == [
        unclassified,
        free,
        standard_old,
        standard_new,
        premium,
    ]
    assert victim_order(everyone, VictimRule.LEAST_WORK) == [
        unclassified,
        free,
        standard_new,
        standard_old,
        premium,
    ]


def test_ties_preempt_the_later_arrival_first_as_vllm_does():
    early, late = _c(1), _c(2)
    assert victim_order([early, late], VictimRule.LRU) == [late, early]


def test_cpu_always_recomputes_and_records_why():
    decision = preemption_mode(500, 32, 16_000, CostModel(), offload_available=False)
    assert (decision.mode, decision.basis) == ("recompute", "offload_unavailable")


def test_without_model_numbers_the_seed_threshold_decides():
    assert preemption_mode(127, 16, 2032, CostModel(), True).mode == "recompute"
    assert preemption_mode(128, 16, 2048, CostModel(), True).mode == "offload"
    assert preemption_mode(128, 16, 2048, CostModel(), True).basis == "fallback_threshold"


def test_cost_model_compares_offload_round_trip_with_recompute():
    # Llama-3-8B-like: 128 KiB of KV per token, 8e9 params, 400 TFLOPS.
    fast_link = CostModel(
        kv_bytes_per_token=131_072,
        params=8_000_000_000,
        effective_flops=4e14,
        host_link_bytes_per_s=5e10,
    )
    slow_link = CostModel(
        kv_bytes_per_token=131_072,
        params=8_000_000_000,
        effective_flops=4e14,
        host_link_bytes_per_s=1e9,
    )
    decision = preemption_mode(512, 16, 8192, fast_link, True)
    assert (decision.mode, decision.basis) == ("offload", "cost_model")
    assert decision.offload_seconds == pytest.approx(2 * 512 * 16 * 131_072 / 5e10)
    assert decision.recompute_seconds == pytest.approx(8192 * 2 * 8e9 / 4e14)
    assert preemption_mode(512, 16, 8192, slow_link, True).mode == "recompute"


@pytest.mark.parametrize(
    ("has_prefix", "leased", "reserving", "expected"),
    [
        (False, True, True, EvictionClass.EMPTY),
        (True, False, True, EvictionClass.CACHED),
        (True, True, True, EvictionClass.RESERVED),
        (True, True, False, EvictionClass.RETAINED),
    ],
)
def test_eviction_class(has_prefix, leased, reserving, expected):
    assert eviction_class(has_prefix, leased, reserving) is expected


def test_leased_cap_is_a_fraction_of_the_pool_rounded_down():
    assert leased_cap_blocks(0.5, 23) == 11
    assert leased_cap_blocks(0.0, 23) == 0
    assert leased_cap_blocks(1.0, 23) == 23


@given(cs=candidates, rule=rules)
def test_an_unclassified_victim_is_the_newest_admission_whatever_the_rule(cs, rule):
    unclassified = [c for c in cs if not c.classified]
    if unclassified:
        assert victim_order(unclassified, rule)[0] == max(unclassified, key=lambda c: c.seq)


@given(
    ranks=st.lists(st.sampled_from([(0, 0, 0), (0, 0, 1), (0, 1, 2), (1, 1, 1 << 30)]), max_size=20)
)
def test_service_order_is_fcfs_within_a_class_and_classes_in_protection_order(ranks):
    keys = sorted(service_key(rank, admitted) for admitted, rank in enumerate(ranks))
    for a, b in itertools.pairwise(keys):
        assert a[0] <= b[0]
        if a[0] == b[0]:
            assert a[1] < b[1]


sized = st.tuples(candidates, st.lists(st.integers(0, 20), min_size=30, max_size=30))


@given(
    data=sized,
    head=st.sampled_from([(0, 0, 0), (0, 0, 1), (0, 1, 2)]),
    need=st.integers(0, 60),
    free=st.integers(0, 60),
    rule=rules,
)
def test_admission_preempts_only_lower_classes_least_first_and_only_what_closes_the_gap(
    data, head, need, free, rule
):
    cs, blocks = data
    pairs = list(zip(cs, blocks, strict=False))
    asked: list[int] = []

    def returns(i: int) -> int:
        asked.append(i)
        return pairs[i][1]

    chosen = admission_victims(head, need, free, [c for c, _ in pairs], rule, returns)
    if not chosen:
        lower = sum(b for c, b in pairs if _rank(c) > head)
        assert free >= need or free + lower < need
        return
    assert free < need
    assert asked == chosen  # only the victims were asked what they return
    victims = [pairs[i][0] for i in chosen]
    assert all(_rank(c) > head for c in victims)
    assert free + sum(pairs[i][1] for i in chosen) >= need
    assert free + sum(pairs[i][1] for i in chosen[:-1]) < need  # not one victim too many
    order = victim_order([c for c, _ in pairs if _rank(c) > head], rule)
    assert victims == order[: len(victims)]  # the cheapest of the lowest class first


def _rank(c: Candidate) -> tuple[int, int, int]:
    return victim_class(c.classified, c.leased, c.tier_priority)


def test_a_lease_yields_only_to_its_tier_or_a_more_important_one():
    premium, standard, free = 0, 1, 2
    assert may_take(premium, standard) and may_take(standard, standard)
    assert not may_take(free, standard) and not may_take(None, free)


def test_leases_yield_when_nothing_else_would_run():
    assert leases_yield(0) and not leases_yield(1)


def test_caps_that_leave_less_than_one_request_are_refused_with_the_numbers():
    assert lease_caps_error(63, {"standard": 9, "premium": 18}, 36) is None
    error = lease_caps_error(63, {"standard": 15, "premium": 31}, 36)
    assert error is not None and "reserve 46 of 63" in error and "needs 36" in error


@given(
    pool=st.integers(1, 200),
    fractions=st.lists(st.floats(0, 1), min_size=1, max_size=3),
    request=st.integers(1, 200),
)
def test_caps_are_accepted_exactly_when_one_request_fits_the_unreserved_pool(
    pool, fractions, request
):
    caps = {f"t{i}": leased_cap_blocks(f, pool) for i, f in enumerate(fractions)}
    ok = lease_caps_error(pool, caps, request) is None
    assert ok == (unreserved_blocks(pool, caps.values()) >= request)
