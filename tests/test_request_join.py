"""The join of vLLM's per-request stats with the scheduler's RequestDone, on a fake clock."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from clocks import ManualClock

from engine.events import RequestDone
from exporters.join import FinishedRequest, RequestJoin

KVL = "kvl-" + "ab" * 16


@pytest.fixture
def join():
    clock = ManualClock()
    j = RequestJoin(timeout=30.0, abort_grace=2.0, clock=clock)
    j.delivered = []  # type: ignore[attr-defined]
    j.consumers.append(j.delivered.append)
    return j, clock


def _stats(request_id: str = f"chatcmpl-{KVL}"):
    return SimpleNamespace(request_id=request_id, finish_reason=1)


def _done(status: str, request_id: str = KVL) -> RequestDone:
    return RequestDone(0.0, request_id, None, None, None, status, 0, 0, 0.0)


def test_both_halves_deliver_at_once_in_either_order(join):
    j, _ = join
    j.request_stats(_stats(), "entry")
    j.engine_event(_done("finished_stopped"))
    j.engine_event(_done("finished_length", "kvl-" + "cd" * 16))
    j.request_stats(_stats("cmpl-kvl-" + "cd" * 16), None)
    assert [(p.key, p.joined) for p in j.delivered] == [(KVL, True), ("kvl-" + "cd" * 16, True)]
    assert j.delivered[0].entry == "entry"


@pytest.mark.parametrize(
    "status, wait",
    [
        ("finished_aborted", 2.0),  # vLLM sends no stats for an abandoned request
        ("finished_stopped", 30.0),  # its stats are late, not missing
    ],
)
def test_an_engine_half_alone_is_delivered_after_its_wait(join, status, wait):
    j, clock = join
    j.request_left(KVL, "entry")  # the response ended early
    j.engine_event(_done(status))
    clock.now += wait - 0.1
    j.sweep()
    assert j.delivered == []
    clock.now += 0.2
    j.sweep()
    [p] = j.delivered
    assert (p.stats, p.done.status, p.entry) == (None, status, "entry")
    assert p.ended_at is not None


def test_stats_without_an_engine_half_are_delivered_after_the_timeout(join):
    j, clock = join
    j.request_stats(_stats(), "entry")
    clock.now += 30
    j.sweep()
    assert [(p.done, p.entry) for p in j.delivered] == [(None, "entry")]


def test_an_entry_alone_is_dropped_after_the_timeout(join):
    """A response that ended early for a request the engine never saw has no record."""
    j, clock = join
    j.request_left(KVL, "entry")
    clock.now += 30
    j.sweep()
    j.flush()
    assert j.delivered == []


def test_flush_delivers_every_half_join(join):
    j, _ = join
    j.engine_event(_done("finished_stopped"))
    j.request_left("kvl-" + "cd" * 16, "entry")
    j.flush()
    assert [p.key for p in j.delivered] == [KVL]


def test_pending_joins_are_bounded(join):
    j, _ = join
    j.max_pending = 3
    for i in range(10):
        j.request_stats(_stats(f"kvl-{i:032x}"), None)
    j.flush()
    assert [p.key for p in j.delivered] == [f"kvl-{i:032x}" for i in (7, 8, 9)]


def test_the_background_sweep_delivers_without_further_traffic():
    j = RequestJoin(abort_grace=0.0)
    delivered: list[FinishedRequest] = []
    j.consumers.append(delivered.append)
    j.start(interval=0.01)
    j.engine_event(_done("finished_aborted"))
    for _ in range(500):
        if delivered:
            break
        time.sleep(0.01)
    assert [p.key for p in delivered] == [KVL]
