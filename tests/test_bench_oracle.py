"""The leased hit's bound for a shared cap (bench/oracle.py) is the true optimum."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from bench.oracle import clairvoyant_kept

intervals = st.lists(
    st.tuples(st.integers(0, 8), st.integers(0, 5), st.integers(0, 3)).map(
        lambda t: (t[0], t[0] + t[1], t[2])  # (first, last, blocks), last >= first
    ),
    max_size=5,
)


def fits(given: list[tuple[int, int, int]], kept: tuple[int, ...], cap: int) -> bool:
    for step in range(20):
        pairs = zip(given, kept, strict=True)
        held = sum(k for (first, last, _), k in pairs if first <= step < last)
        if held > cap:
            return False
    return True


@settings(max_examples=300, deadline=None)
@given(intervals, st.integers(0, 3))
def test_the_clairvoyant_reservation_keeps_the_most_any_choice_can(given_, cap):
    kept = clairvoyant_kept(given_, cap)
    assert all(0 <= k <= blocks for k, (_, _, blocks) in zip(kept, given_, strict=True))
    assert fits(given_, tuple(kept), cap)
    choices = itertools.product(*(range(blocks + 1) for _, _, blocks in given_))
    best = max((sum(c) for c in choices if fits(given_, c, cap)), default=0)
    assert sum(kept) == best


def test_overlapping_sessions_share_the_cap_and_the_sooner_return_keeps_its_blocks():
    # Two sessions wait at once for a 12-block cap: one returns at step 50 wanting 10
    # blocks, one at step 80 wanting 12. The simple bound lets each find min(12, its
    # prefix), 22 blocks; shared, the sooner one keeps 10 and the later one the 2 left
    # while both wait, since it wants its blocks from step 20.
    assert clairvoyant_kept([(20, 80, 12), (10, 50, 10)], 12) == [2, 10]
    # Back to back, each has the cap to itself.
    assert clairvoyant_kept([(10, 50, 10), (50, 80, 12)], 12) == [10, 12]
