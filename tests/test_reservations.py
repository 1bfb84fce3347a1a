"""The reservation window (kvlease.engine.reservations): how long a session's blocks are kept
from lower tiers after a turn, from the think times and return rate it has shown."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvlease.engine.reservations import (
    MIN_GAPS,
    MIN_HISTORY,
    ReserveMode,
    ReservePolicy,
    ReturnModel,
)

AUTO = ReservePolicy()


def _turns(model: ReturnModel, session, gaps, tenant="acme", tier="premium", t0=0.0) -> float:
    """A session that ends a turn, comes back after each gap, and ends a last turn."""
    now = t0
    model.turn_ended(session, tenant, tier, now)
    for gap in gaps:
        now += gap
        model.turn_started(session, tenant, tier, now)
        now += 1.0  # the turn runs
        model.turn_ended(session, tenant, tier, now)
    return now


def test_a_session_that_answers_in_seconds_is_reserved_for_seconds_not_for_its_lease():
    model = ReturnModel()
    _turns(model, "s1", [2.0, 3.0, 4.0, 5.0])
    # Five turns, four returns: rate 5/7; the 0.75-quantile of 2, 3, 4, 5 s is 4 s.
    assert AUTO.quantile == 0.75
    assert model.window("s1", "acme", "premium", 300.0, AUTO) == 4.0


def test_one_shot_sessions_soon_reserve_nothing():
    model = ReturnModel()
    windows = []
    for n in range(10):
        model.turn_ended(f"s{n}", "acme", "premium", float(n))
        windows.append(model.window(f"s{n}", "acme", "premium", 300.0, AUTO))
    # Without history the prior reserves; from MIN_HISTORY one-shot turns on, the
    # tenant's return rate (1 / (n + 2)) is below 1/2 and nothing is reserved.
    assert windows[: MIN_HISTORY - 1] == [AUTO.max_seconds] * (MIN_HISTORY - 1)
    assert windows[MIN_HISTORY - 1 :] == [0.0] * (10 - MIN_HISTORY + 1)


def test_windows_granted_on_the_prior_close_when_the_tiers_first_turns_do_not_return():
    model = ReturnModel()
    for n in range(MIN_HISTORY - 1):  # no history yet: the prior reserves
        model.turn_ended(f"s{n}", "acme", "premium", float(n))
        assert model.window(f"s{n}", "acme", "premium", 300.0, AUTO) == AUTO.max_seconds
        assert model.take_withdrawn() == []
    model.turn_ended("standard", "bob", "standard", 1.5)  # another tier's evidence is its own
    model.window("standard", "bob", "standard", 300.0, AUTO)
    last = f"s{MIN_HISTORY - 1}"
    model.turn_ended(last, "acme", "premium", 10.0)
    # MIN_HISTORY turns, no return: the rate is below 1/2, so this turn reserves nothing
    # and the windows the prior opened are withdrawn, each once.
    assert model.window(last, "acme", "premium", 300.0, AUTO) == 0.0
    assert model.take_withdrawn() == [f"s{n}" for n in range(MIN_HISTORY - 1)]
    assert model.take_withdrawn() == []


def test_a_return_keeps_the_windows_granted_on_the_prior():
    model = ReturnModel()
    model.turn_ended("s0", "acme", "premium", 0.0)
    model.window("s0", "acme", "premium", 300.0, AUTO)
    model.turn_ended("s1", "acme", "premium", 1.0)
    model.window("s1", "acme", "premium", 300.0, AUTO)
    model.turn_started("s0", "acme", "premium", 3.0)  # s0 came back: the prior was right
    for n in range(2, 8):  # later one-shot sessions pull the rate below 1/2 ...
        model.turn_ended(f"s{n}", "acme", "premium", 10.0 * n)
        window = model.window(f"s{n}", "acme", "premium", 300.0, AUTO)
    assert window == 0.0
    assert model.take_withdrawn() == []  # ... but only the prior's windows are provisional


def test_a_new_session_starts_from_its_tenants_history_then_its_tiers():
    model = ReturnModel()
    _turns(model, "old", [1.0, 1.0, 1.0], tenant="acme")
    model.turn_ended("new", "acme", "premium", 100.0)
    assert model.window("new", "acme", "premium", 300.0, AUTO) == 1.0  # acme's think time
    model.turn_ended("other", "bob", "premium", 100.0)
    assert model.window("other", "bob", "premium", 300.0, AUTO) == 1.0  # the tier's


def test_turns_too_recent_to_have_returned_are_not_counted_as_misses():
    model = ReturnModel()
    # Four sessions each came back once after 4 s, and each has just ended its second
    # turn: 8 turns, 4 returns. Counting the four fresh ends (and the turn ending now)
    # as misses would give 5/11, under 1/2, and reserve nothing for a tier whose
    # sessions have come back every time so far.
    for n in range(4):
        model.turn_ended(f"s{n}", "acme", "premium", 0.0)
        model.turn_started(f"s{n}", "acme", "premium", 4.0)
        model.turn_ended(f"s{n}", "acme", "premium", 10.0)
    model.turn_ended("new", "acme", "premium", 11.0)
    assert model.window("new", "acme", "premium", 300.0, AUTO) == 4.0
    # Once a think time has passed without a return, those turns are misses: 5/11.
    model.turn_ended("later", "acme", "premium", 20.0)
    assert model.window("later", "acme", "premium", 300.0, AUTO) == 0.0


def test_the_window_comes_from_enough_think_times_not_from_the_longest_of_two():
    model = ReturnModel()
    _turns(model, "old", [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0], tenant="acme")
    _turns(model, "s1", [1.0, 1.0], tenant="acme", t0=200.0)
    # s1 has three turns but only two think times: their 0.75-quantile (1 s) would end
    # its window before most of acme's users answer; acme's twelve give 7 s.
    assert MIN_GAPS > 2
    assert model.window("s1", "acme", "premium", 300.0, AUTO) == 7.0


def test_a_return_after_the_lease_expired_is_not_a_return():
    model = ReturnModel()
    model.turn_ended("s1", "acme", "premium", 0.0)
    model.forget("s1")  # the lease expired
    model.turn_started("s1", "acme", "premium", 500.0)
    assert model.tracked_sessions() == 0


def test_the_modes_lease_and_never():
    model = ReturnModel()
    model.turn_ended("s1", "acme", "premium", 0.0)
    lease = ReservePolicy(mode=ReserveMode.LEASE)
    never = ReservePolicy(mode=ReserveMode.NEVER)
    assert model.window("s1", "acme", "premium", 300.0, lease) == 300.0
    assert model.window("s1", "acme", "premium", 300.0, never) == 0.0
    assert model.window("s1", "acme", "premium", 0.0, lease) == 0.0  # no lease, no reservation


events = st.lists(
    st.tuples(
        st.sampled_from(["end", "start", "forget"]),
        st.integers(0, 4),  # session
        st.integers(0, 2),  # tenant
        st.floats(0, 1000, allow_nan=False),  # time step
    ),
    max_size=80,
)
policies = st.builds(
    ReservePolicy,
    mode=st.sampled_from(list(ReserveMode)),
    quantile=st.floats(0.01, 1.0),
    max_seconds=st.floats(0, 1e6, allow_nan=False),
    min_return=st.floats(0, 1),
)


@settings(max_examples=300, deadline=None)
@given(ops=events, policy=policies, lease=st.floats(0, 1e4, allow_nan=False))
def test_the_window_never_outlives_the_lease_nor_the_tier_bound(ops, policy, lease):
    model = ReturnModel()
    now = 0.0
    for op, session, tenant, step in ops:
        now += step
        if op == "end":
            model.turn_ended(session, tenant, "premium", now)
            window = model.window(session, tenant, "premium", lease, policy)
            assert 0.0 <= window <= lease
            if policy.mode is ReserveMode.AUTO:
                assert window <= policy.max_seconds
            if policy.mode is ReserveMode.NEVER:
                assert window == 0.0
            # windows on the prior alone are remembered for a tier's first turns only
            assert len(model._provisional.get("premium", ())) < MIN_HISTORY
            assert len(model.take_withdrawn()) < MIN_HISTORY
        elif op == "start":
            model.turn_started(session, tenant, "premium", now)
        else:
            model.forget(session)
    assert model.tracked_sessions() <= 5
