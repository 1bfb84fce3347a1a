"""The payback tuner: a tier's reservation cap shrinks when the steps its reservation turns
lower-tier work away outweigh the prefill its reused blocks save, and grows back when
they pay again."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvlease.engine.payback import GENERATION, MAX_REFUSALS, PaybackTuner

BLOCK = 16


class Queue:
    """The free queue's cumulative counts, as the tuner reads them."""

    def __init__(self, tiers: int) -> None:
        self.left = [0] * tiers
        self.reused = [0] * tiers

    def generation(self, tuner: PaybackTuner, tier: int, reused: int) -> bool:
        self.left[tier] += GENERATION * tuner.limits[tier]
        self.reused[tier] += reused
        return tuner.update(self.left, self.reused)

    def unpaid(self, tuner: PaybackTuner, generations: int) -> None:
        """Generations of tier 0 with one refused step each and nothing reused."""
        for step in range(generations):
            tuner.refused(step, 0, tuner.caps)
            self.generation(tuner, 0, reused=0)


def test_a_reservation_that_turns_work_away_without_reuse_shrinks_to_one_block():
    tuner = PaybackTuner([0, 12], BLOCK, [1.0, 1.0])
    queue, caps, step = Queue(2), [], 0
    for _ in range(12):
        for _ in range(5):  # five steps refused by premium's reservation each generation
            step += 1
            tuner.refused(step, 0, [0, 12])
        queue.generation(tuner, 1, reused=0)
        caps.append(tuner.caps[1])
    assert caps == [9, 6, 4, 3, 2, 1, 1, 1, 1, 1, 1, 1]
    assert tuner.caps[0] == 0  # a tier with no cap has nothing to tune


def test_a_reservation_whose_reuse_pays_for_its_refusals_keeps_its_cap():
    tuner = PaybackTuner([12], BLOCK, [1.0])
    queue, step = Queue(1), 0
    for _ in range(10):
        for _ in range(30):  # 30 refused steps, against 2 reused blocks = 32 tokens
            step += 1
            tuner.refused(step, 0, [12])
        assert not queue.generation(tuner, 0, reused=2)
        assert tuner.caps == [12]


def test_a_shrunk_cap_grows_back_by_a_quarter_when_reuse_pays_again():
    tuner = PaybackTuner([12], BLOCK, [1.0])
    queue = Queue(1)
    queue.unpaid(tuner, 8)
    assert tuner.caps == [1]
    grown = []
    for _ in range(5):
        queue.generation(tuner, 0, reused=4)  # no refusals now: any reuse pays
        grown.append(tuner.caps[0])
    assert grown == [4, 7, 10, 12, 12]


def test_a_refused_step_is_charged_once_to_the_hidden_tiers_by_their_reserved_blocks():
    tuner = PaybackTuner([8, 8], BLOCK, [1.0, 1.0])
    tuner.refused(1, 0, [2, 6])  # a free request: both reservations were hidden
    tuner.refused(1, 0, [2, 6])  # the same step again: not charged twice
    tuner.refused(2, 1, [2, 6])  # a standard request: only premium's was hidden
    tuner.refused(3, 0, [0, 0])  # nothing reserved: nothing refused it
    assert tuner._refused == [0.25, 1.75]


def test_min_payback_zero_keeps_the_tier_tables_cap():
    tuner = PaybackTuner([12], BLOCK, [0.0])
    Queue(1).unpaid(tuner, 50)
    assert tuner.caps == [12]


def test_no_decision_before_a_whole_generation_has_left():
    tuner = PaybackTuner([12], BLOCK, [1.0])
    tuner.refused(1, 0, [12])
    assert not tuner.update([GENERATION * 12 - 1], [0])
    assert tuner.update([GENERATION * 12], [0])
    assert tuner.caps == [9]


@settings(max_examples=200, deadline=None)
@given(
    limits=st.lists(st.integers(0, 40), min_size=1, max_size=3),
    events=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 200), st.booleans()), max_size=200),
)
def test_a_cap_stays_between_one_block_and_the_tier_tables(limits, events):
    tuner = PaybackTuner(limits, BLOCK, [1.0] * len(limits))
    left, reused = [0] * len(limits), [0] * len(limits)
    for step, (tier, blocks, refuse) in enumerate(events):
        tier %= len(limits)
        if refuse:
            tuner.refused(step, tier, [min(c, 5) for c in tuner.caps])
        left[tier] += blocks
        reused[tier] += blocks // 7
        tuner.update(left, reused)
        for cap, limit in zip(tuner.caps, limits, strict=True):
            assert (cap == 0) if limit == 0 else 1 <= cap <= limit


def test_forgetting_puts_the_caps_back_and_counts_from_the_queues_counts():
    tuner = PaybackTuner([12], BLOCK, [1.0])
    queue = Queue(1)
    queue.unpaid(tuner, 3)
    assert tuner.caps == [4]  # 12, 9, 6, 4
    tuner.forget()
    tuner.rebase(queue.left, queue.reused)
    assert tuner.caps == [12]
    assert not tuner.update(queue.left, queue.reused)  # nothing has left since


def test_blocks_that_sit_reserved_while_turning_work_away_are_judged_without_leaving():
    """A session that always has a request in flight never ends a turn, so its reserved
    blocks need not leave: the refused steps alone end a generation."""
    tuner = PaybackTuner([12], BLOCK, [1.0])
    for step in range(MAX_REFUSALS - 1):
        tuner.refused(step, 0, [12])
    assert not tuner.update([0], [0])
    tuner.refused(MAX_REFUSALS, 0, [12])
    assert tuner.update([0], [0])
    assert tuner.caps == [9]
