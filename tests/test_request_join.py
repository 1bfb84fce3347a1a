"""The join of vLLM's per-request stats with the scheduler's RequestDone, on a fake clock."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from clocks import ManualClock
from waiting import until

from kvlease.engine.events import RequestDone
from kvlease.engine.tenancy import TenantContext
from kvlease.exporters.join import FinishedRequest, InFlight, RequestJoin
from kvlease.exporters.writer import to_record

KVL = "kvl-" + "ab" * 16
OTHER = "kvl-" + "cd" * 16


@pytest.fixture
def join():
    clock = ManualClock()
    j = RequestJoin(timeout=30.0, abort_grace=2.0, clock=clock)
    j.delivered = []  # type: ignore[attr-defined]
    j.consumers.append(j.delivered.append)
    return j, clock


def _entry(engine_requests: int | None = 1, path: str = "/v1/chat/completions") -> InFlight:
    return InFlight(TenantContext("acme", "premium"), path, 0, None, "m", engine_requests)


def _stats(request_id: str = f"chatcmpl-{KVL}", output: int = 5, reason: int = 1):
    return SimpleNamespace(
        request_id=request_id,
        finish_reason=reason,
        num_prompt_tokens=10,
        num_cached_tokens=0,
        num_generation_tokens=output,
        num_preemptions=0,
        e2e_latency=1.0,
    )


def _done(status: str, request_id: str = KVL, output: int = 5) -> RequestDone:
    return RequestDone(
        at=0.0,
        request_id=request_id,
        tenant_id=None,
        tier=None,
        session_id=None,
        status=status,
        preemptions=0,
        recomputed_tokens=0,
        block_seconds=0.5,
        prompt_tokens=10,
        output_tokens=output,
    )


def test_both_halves_deliver_at_the_responses_end_in_either_order(join):
    j, _ = join
    entry = _entry()
    j.request_stats(_stats(), entry)
    j.engine_event(_done("finished_stopped"))
    j.request_ended(KVL, entry)
    j.request_ended(OTHER, _entry())  # the response may end before either half arrives
    j.engine_event(_done("finished_length", OTHER))
    assert [p.key for p in j.delivered] == [KVL]
    j.request_stats(_stats(f"cmpl-{OTHER}"), None)
    assert [(p.key, p.joined) for p in j.delivered] == [(KVL, True), (OTHER, True)]
    assert j.delivered[0].entry is entry and not j.delivered[0].partial


def test_a_fan_out_is_one_record_with_its_children_summed(join):
    """n=3: three engine requests under one kvl- id, each with both halves."""
    j, _ = join
    j.in_flight[KVL] = entry = _entry(engine_requests=3)
    for i, output in enumerate((100, 200, 300)):
        j.request_stats(_stats(f"chatcmpl-{KVL}", output), None)  # vLLM: one external id
        j.engine_event(_done("finished_length", f"{i}_chatcmpl-{KVL}-0a1b2c3d", output))
        assert j.delivered == []
    j.request_ended(KVL, entry)
    [p] = j.delivered
    record = to_record(p)
    assert (record.output_tokens, record.input_tokens, record.kv_block_seconds) == (600, 30, 1.5)
    assert record.request_id == KVL and not record.partial


def test_a_complete_response_leaves_nothing_behind_once_delivered(join):
    j, _ = join
    entry = _entry()
    j.request_stats(_stats(), entry)
    j.engine_event(_done("finished_stopped"))
    j.request_ended(KVL, entry)  # the final byte
    assert len(j.delivered) == 1 and j._pending == {}


def test_a_fan_out_beyond_the_bodys_count_is_billed_whole(join):
    """The body said one engine request; vLLM ran four (a coerced `n`, a route that fans
    out on its own): the record sums all four, it is not cut at the first."""
    j, _ = join
    j.in_flight[KVL] = entry = _entry(engine_requests=1)
    for i in range(4):
        j.request_stats(_stats(f"chatcmpl-{KVL}", 12), None)
        j.engine_event(_done("finished_length", f"{i}_chatcmpl-{KVL}-0a1b2c3d", 12))
    assert j.delivered == []
    j.request_ended(KVL, entry)
    [p] = j.delivered
    assert (p.output_tokens, p.prompt_tokens, p.partial) == (48, 40, False)


def test_the_bodys_count_is_a_floor_for_halves_still_on_the_way(join):
    j, _ = join
    j.in_flight[KVL] = entry = _entry(engine_requests=2)
    j.request_stats(_stats(f"chatcmpl-{KVL}"), None)
    j.engine_event(_done("finished_length", f"0_chatcmpl-{KVL}-0a1b2c3d"))
    j.request_ended(KVL, entry)
    assert j.delivered == []  # the second child's halves are still on the channel
    j.engine_event(_done("finished_length", f"1_chatcmpl-{KVL}-0a1b2c3d"))
    j.request_stats(_stats(f"chatcmpl-{KVL}"), None)
    [p] = j.delivered
    assert p.output_tokens == 10 and not p.partial


def test_an_unknown_fan_out_waits_for_the_responses_end(join):
    """/v1/responses: sub-requests are counted when the response ends."""
    j, _ = join
    entry = _entry(engine_requests=None, path="/v1/responses")
    j.in_flight[KVL] = entry
    j.request_stats(_stats(f"resp_{KVL}_0"), entry)
    j.engine_event(_done("finished_stopped", f"resp_{KVL}_0-0a1b2c3d"))
    assert j.delivered == []
    j.request_ended(KVL, entry)
    [p] = j.delivered
    assert p.output_tokens == 5 and not p.partial


@pytest.mark.parametrize(
    "status, wait, partial",
    [
        ("finished_aborted", 2.0, False),  # vLLM sends no stats for an abandoned request
        ("finished_stopped", 30.0, True),  # its stats are late, not missing
    ],
)
def test_an_engine_half_alone_is_delivered_after_its_wait(join, status, wait, partial):
    j, clock = join
    entry = _entry()
    j.request_ended(KVL, entry)  # the response ended early
    j.engine_event(_done(status))
    clock.now += wait - 0.1
    j.sweep()
    assert j.delivered == []
    clock.now += 0.2
    j.sweep()
    [p] = j.delivered
    assert (p.stats, p.done[0].status, p.entry, p.partial) == ([], status, entry, partial)
    assert p.ended_at is not None


def test_stats_without_an_engine_half_are_delivered_flagged_after_the_timeout(join):
    j, clock = join
    entry = _entry()
    j.request_stats(_stats(), entry)
    clock.now += 30
    j.sweep()
    assert [(p.done, p.entry, p.partial) for p in j.delivered] == [([], entry, True)]


def test_an_entry_alone_is_dropped_after_the_timeout(join):
    """A response that ended early for a request the engine never saw has no record."""
    j, clock = join
    j.request_ended(KVL, _entry())
    clock.now += 30
    j.sweep()
    j.flush()
    assert j.delivered == []


def test_flush_delivers_every_half_join(join):
    j, _ = join
    j.engine_event(_done("finished_stopped"))
    j.request_ended(OTHER, _entry())
    j.flush()
    assert [(p.key, p.partial) for p in j.delivered] == [(KVL, True)]


def test_a_full_join_delivers_the_oldest_as_a_partial_record_and_counts_it(join):
    j, _ = join
    j.max_pending = 3
    for i in range(10):
        j.request_stats(_stats(f"kvl-{i:032x}"), None)
    assert [p.key for p in j.delivered] == [f"kvl-{i:032x}" for i in range(7)]
    assert all(p.partial for p in j.delivered) and j.overflowed == 7
    j.flush()
    assert len(j.delivered) == 10  # nothing dropped unseen


def test_the_background_sweep_delivers_without_further_traffic():
    j = RequestJoin(abort_grace=0.0)
    delivered: list[FinishedRequest] = []
    j.consumers.append(delivered.append)
    j.start(interval=0.01)
    j.engine_event(_done("finished_aborted"))
    until(lambda: delivered, "the sweep delivers", 5, interval=0.01)
    assert [p.key for p in delivered] == [KVL]
