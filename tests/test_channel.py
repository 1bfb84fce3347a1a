"""The engine -> API channel with several engines and several API processes, and the
API process's merged view of the ranks: real ZeroMQ sockets, no vLLM."""

from __future__ import annotations

import threading
import time

import msgspec
from waiting import until

from kvlease.engine.channel import Publisher, Receiver, address_for, new_address
from kvlease.engine.events import EngineState, Message, Preemption, RequestDone, Totals
from kvlease.exporters.ranks import merge_states
from kvlease.exporters.view import EngineView


def _state(pool=10, free=4, tenants=None, **totals) -> EngineState:
    base = {key: [] for key in Totals.__struct_fields__[:6]}
    return msgspec.convert(
        {
            "at": time.monotonic(),
            "pool_blocks": pool,
            "free_blocks": free,
            "tenants": tenants or {},
            "tenant_tiers": {t: "premium" for t in tenants or {}},
            "leases": [],
            "leases_total": 0,
            "lease_summary": {t: {"active": 1, "seconds_left_max": 5.0} for t in tenants or {}},
            "running": 1,
            "waiting": 2,
            "waiting_by_tier": {"free": 2},
            "events_dropped": 0,
            "totals": {**base, **totals},
        },
        EngineState,
    )


def _done(request: str, api_server: int) -> RequestDone:
    return RequestDone(
        at=0.0,
        request_id=request,
        tenant_id="acme",
        tier="premium",
        session_id="s1",
        status="finished_stopped",
        preemptions=0,
        recomputed_tokens=0,
        block_seconds=1.0,
        api_server=api_server,
    )


def test_every_api_process_gets_every_ranks_messages():
    base = new_address()
    got: list[list[Message]] = [[], []]
    lock = threading.Lock()

    def keep(i):
        def on(message):
            with lock:
                got[i].append(message)

        return on

    receivers = [Receiver(address_for(base, i), keep(i)) for i in range(2)]
    ranks = [Publisher([address_for(base, i) for i in range(2)]) for _ in range(2)]
    try:
        for rank, publisher in enumerate(ranks):
            assert publisher.publish(Message([_done(f"r{rank}", rank)], _state(), rank)) == 0
        until(lambda: all(len(g) == 2 for g in got), "every message at every API process", 10, 0.01)
        for messages in got:
            assert sorted(m.engine for m in messages) == [0, 1]
    finally:
        for p in ranks:
            p.close()
        for r in receivers:
            r.close()


def test_a_full_api_process_bounds_its_backlog_and_counts_what_it_loses():
    publisher = Publisher([address_for(new_address(), 0)], capacity=3)  # nobody reads it
    try:
        lost = 0
        for i in range(20_000):  # past ZeroMQ's own queue
            lost += publisher.publish(Message([_done(f"r{i}", 0)]))
        assert lost > 0 and sum(n for _, n in publisher._backlogs[0]) <= 3
        assert publisher._backlogs[0]  # it goes before the next message
    finally:
        publisher.close()


def test_the_whole_is_the_ranks_summed():
    row = ["acme", "premium", "kv_pressure", "recompute", "premium"]
    a = _state(
        10,
        4,
        {"acme": {"running": 3, "cached_leased": 1, "cached": 0}},
        block_seconds=[["acme", 2.5]],
        preemptions=[[*row, 1]],
    )
    b = _state(
        12,
        7,
        {
            "acme": {"running": 1, "cached_leased": 0, "cached": 2},
            "bob": {"running": 2, "cached_leased": 0, "cached": 0},
        },
        block_seconds=[["acme", 1.5], ["bob", 1.0]],
        preemptions=[[*row, 2]],
    )
    whole = merge_states([a, b])
    assert (whole.pool_blocks, whole.free_blocks, whole.running, whole.waiting) == (22, 11, 2, 4)
    assert msgspec.to_builtins(whole.tenants["acme"]) == {
        "running": 4,
        "cached_leased": 1,
        "cached": 2,
    }
    assert sorted(whole.totals.block_seconds) == [("acme", 4.0), ("bob", 1.0)]
    assert whole.totals.preemptions == [
        ("acme", "premium", "kv_pressure", "recompute", "premium", 3)
    ]
    assert whole.lease_summary["acme"].active == 2 and whole.waiting_by_tier == {"free": 4}
    assert merge_states([a]) is a


def test_only_the_owning_api_process_joins_a_request_but_every_one_shows_it():
    mine, theirs = EngineView(api_server=0), EngineView(api_server=1)
    seen: dict[int, list] = {0: [], 1: []}
    mine.add_listener(seen[0].append)
    theirs.add_listener(seen[1].append)
    message = Message([_done("kvl-a", 0), _done("kvl-b", 1)], _state(), engine=1)
    for view in (mine, theirs):
        view.apply(message)
    assert [e.request_id for e in seen[0]] == ["kvl-a"]
    assert [e.request_id for e in seen[1]] == ["kvl-b"]
    assert list(mine.engines()) == [1] and mine.state_json()["engines"]["1"]["pool_blocks"] == 10
    mine.history.every = 0  # keep every sample
    mine.apply(Message(state=_state(pool=12, free=7), engine=0))
    sample = mine.history.since(60)["samples"][-1]
    assert sample["engines"] == {"0": [12, 7], "1": [10, 4]}
    assert (sample["pool_blocks"], sample["free_blocks"]) == (22, 11)  # the whole
    preempted = Preemption(
        at=time.monotonic(),
        request_id="kvl-c",
        tenant_id="acme",
        tier="free",
        session_id=None,
        reason="kv_pressure",
        mode="recompute",
        blocks=3,
        recomputed_tokens=64,
        api_server=1,
    )
    mine.apply(Message([preempted], engine=1))
    assert [e["engine"] for e in mine.history.since(60)["events"]] == [1]
