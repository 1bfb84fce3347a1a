"""The benchmarks' step-clock trace (bench/workload.py), their statistics (bench/report.py)
and their edited tier tables (bench/frontier.py)."""

from __future__ import annotations

from bench.frontier import SHIPPED, edited_tiers
from bench.report import percentile, shuffled, stats
from bench.workload import QUICK_SPEC
from kvlease.demo.workload import Turn, generate
from kvlease.engine.tenancy import TierTable
from kvlease.replay.sessions import StepTrace


def _session(*turns: tuple[float, int, int]) -> list[Turn]:
    return [Turn(at, "t0", "premium", "s0", k, i, o) for k, (at, i, o) in enumerate(turns)]


def test_a_first_turn_arrives_at_its_trace_time_in_steps():
    trace = StepTrace(_session((2.5, 10, 5)), steps_per_second=10, vocab=100, max_context=999)
    assert trace.due(24) == []
    (arrival,) = trace.due(25)
    assert arrival.step == 25 and len(arrival.prompt) == 10 and arrival.prefix_tokens == 0


def test_the_next_turn_waits_for_the_reply_then_the_think_time_and_repeats_the_context():
    trace = StepTrace(
        _session((0.0, 10, 5), (3.0, 4, 5)), steps_per_second=10, vocab=100, max_context=999
    )
    (first,) = trace.due(0)
    assert trace.next_step() is None and not trace.done  # the second turn waits for the reply
    reply = [1, 2, 3, 4, 5]
    trace.finished(first, reply, step=40)
    assert trace.due(70) == []
    (second,) = trace.due(71)  # 40 + 1 + 3 s x 10 steps/s
    assert second.prompt[:15] == first.prompt + reply and len(second.prompt) == 19
    assert second.prefix_tokens == 15 and second.think_seconds == 3.0
    trace.finished(second, reply, step=80)
    assert trace.done


def test_a_session_ends_before_its_context_passes_the_limit():
    trace = StepTrace(
        _session((0.0, 10, 5), (1.0, 10, 5), (2.0, 10, 5)),
        steps_per_second=10,
        vocab=100,
        max_context=25,
    )
    (first,) = trace.due(0)
    trace.finished(first, [1] * 5, step=3)  # 15 + 10 + 5 would pass 25
    assert trace.done and trace.dropped == 2


def test_every_run_gets_the_same_token_ids_under_its_own_request_ids():
    turns = generate(QUICK_SPEC)
    a = StepTrace(turns, 10, vocab=500, max_context=1400, run="a")
    b = StepTrace(turns, 10, vocab=500, max_context=1400, run="b")
    first_a, first_b = a.due(10**6), b.due(10**6)
    assert [x.prompt for x in first_a] == [x.prompt for x in first_b]
    assert {x.request_id for x in first_a}.isdisjoint(x.request_id for x in first_b)
    assert all(10 <= t < 500 for x in first_a for t in x.prompt)


def test_the_quick_trace_has_all_three_tiers():
    assert {t.tier for t in generate(QUICK_SPEC)} == {"premium", "standard", "free"}


def test_percentiles_are_observed_values_by_nearest_rank():
    values = list(range(1, 101))
    assert percentile(values, 50) == 50 and percentile(values, 99) == 99
    assert percentile([3.0], 99) == 3.0 and percentile([], 99) == 0.0
    assert stats([1, 2, 3, 10]) == {"mean": 4.0, "p50": 2, "p99": 10, "max": 10}


def test_interleaved_rounds_give_each_way_new_neighbours_and_repeat_from_run_to_run():
    ways = ["fcfs", "priority", "priority-stats", "kvlease", "kvlease-quiet", "lru", "fifo"]
    rounds = [shuffled(ways, i) for i in range(3)]
    assert all(sorted(r) == sorted(ways) for r in rounds)
    assert rounds == [shuffled(ways, i) for i in range(3)]  # seeded: the same next run
    # The way stepped just before kvlease (cyclic: the first follows the last one's step)
    before = {r[r.index("kvlease") - 1] for r in rounds}
    assert len(before) > 1  # rotating kept the same way before "kvlease" every round


def test_an_edited_tier_table_replaces_a_key_a_tier_has_and_adds_one_it_lacks(tmp_path):
    keys = {"standard": {"preempt_to_admit": True}, "free": {"reserve_quantile": 0.5}}
    path = edited_tiers(SHIPPED.read_text(), tmp_path, "way", keys)
    shipped, edited = TierTable.shipped(), TierTable.load(path)
    assert [t.preempt_to_admit for t in edited.values()] == [True, True, False]
    assert edited["free"].reservation.quantile == 0.5
    assert edited["premium"] == shipped["premium"] and edited["standard"].prices == (
        shipped["standard"].prices
    )
