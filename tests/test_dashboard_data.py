"""The dashboard's data shaping and figures, as pure functions."""

from __future__ import annotations

import time

import msgspec
import pandas as pd
import pytest

from kvlease.dashboard import charts, data
from kvlease.engine.events import EngineState, Eviction, LeaseEvent, Message, Preemption, Totals
from kvlease.engine.labels import TenantLabels
from kvlease.exporters.history import History

NOW = time.time()
KVL = "kvl-" + "ab" * 16


def _state(**tenants) -> dict:
    return {
        "pool_blocks": 63,
        "free_blocks": 20,
        "running": 5,
        "waiting": 2,
        "tenants": {
            t: dict(zip(data.STATES, blocks, strict=True)) for t, blocks in tenants.items()
        },
        "tenant_tiers": {"acme": "premium", "bob": "free"},
        "lease_summary": {"acme": {"active": 2, "seconds_left_max": 290.0}},
    }


def _typed(state: dict) -> EngineState:
    """The scheduler's snapshot behind an /admin/state answer like `state`."""
    empty = {k: [] for k in Totals.__struct_fields__}
    base = {"at": 0.0, "leases": [], "leases_total": 0, "waiting_by_tier": {}}
    return msgspec.convert(base | {"events_dropped": 0, "totals": empty} | state, EngineState)


def _preemption(at: float, tenant: str, reason: str = "kv_pressure", blocks: int = 1):
    return Preemption(
        at=at,
        request_id=KVL,
        tenant_id=tenant,
        tier="free",
        session_id=None,
        reason=reason,
        mode="recompute",
        blocks=blocks,
        recomputed_tokens=0,
    )


def _history(state: dict, label=None) -> History:
    """Five samples over the last 100 s of *now*: the module's NOW may be minutes old by
    the time a test runs, and the window is 600 s."""
    history = History(label or TenantLabels(), window=600, every=1.0)
    now = time.time()
    for i in range(5):
        history.add_state({0: _typed(state)}, wall=now - 100 + i * 10)
    mono = time.monotonic()
    history.add_event(_preemption(mono - 30, "bob", "admit_higher_tier", 4))
    history.add_event(Eviction(at=mono - 20, tenant_id="bob", tier="free", leased=False, blocks=3))
    history.add_event(
        LeaseEvent(
            at=mono,
            tenant_id="acme",
            session_id=None,
            tier="premium",
            kind="renew",
            expires_at=None,
        )
    )  # not kept
    return history


def test_history_keeps_one_sample_per_interval_and_only_the_window():
    history = History(TenantLabels(), window=10, every=1.0)
    state = _typed(_state(acme=(3, 2, 1), idle=(0, 0, 0)))
    for i in range(40):
        history.add_state({0: state}, wall=NOW + i * 0.5)  # two snapshots per second
    kept = history.since(600, now=NOW + 20)["samples"]
    assert len(kept) == 10  # the window, at one per second
    assert [s["t"] for s in kept] == [NOW + 10 + i for i in range(10)]
    assert kept[0]["tenants"] == {"acme": [3, 2, 1]}  # tenants holding nothing are left out
    assert history.since(3, now=NOW + 20)["samples"] == kept[-3:]


def test_history_events_are_labelled_and_bounded():
    history = History(TenantLabels(max_labels=1), max_events=3)
    for tenant in ("a", "b", "c", "d"):
        history.add_event(_preemption(time.monotonic(), tenant))
    events = history.since(60)["events"]
    assert [e["tenant_id"] for e in events] == ["__other__"] * 3  # "a" took the one slot
    assert {e["kind"] for e in events} == {"preemption"}


def test_live_from_engine_joins_blocks_tiers_leases_and_recent_events():
    state = _state(acme=(3, 2, 1), bob=(4, 0, 6))
    history = _history(state)
    live = data.live_from_engine(state, history.since(600), time.time())
    assert live.utilisation == pytest.approx(43 / 63)
    assert (live.running, live.waiting) == (5, 2)
    rows = live.tenants.set_index("tenant_id")
    assert rows.loc["acme", "tier"] == "premium" and rows.loc["acme", "held"] == 5
    assert rows.loc["acme", "leases"] == 2 and rows.loc["acme", "lease_seconds_left"] == 290.0
    assert rows.loc["bob", "preemptions_5m"] == 1 and rows.loc["bob", "evictions_5m"] == 3
    assert len(live.occupancy) == 5 * 2 * 3  # samples x tenants x states
    assert str(live.occupancy["t"].dt.tz) == "UTC"
    assert sorted(live.events["kind"]) == ["eviction", "preemption"]
    assert live.events.set_index("kind").loc["eviction", "n"] == 3  # blocks, for evictions


def test_the_live_tenant_table_shows_the_kv_retention_of_the_last_five_minutes():
    """Cumulative retention totals in the samples: the table shows what grew in the last
    RECENT_SECONDS (a sample older than that is not the baseline)."""
    history = History(TenantLabels(), window=600, every=1.0)
    now = time.time()
    for i, (reserved, retained) in enumerate([(0, 0), (100, 10), (160, 40), (190, 90)]):
        state = _typed(_state(acme=(3, 2, 1)))
        state.totals.retention_block_seconds = [
            ("acme", "premium", "reserved", float(reserved)),
            ("acme", "premium", "retained", float(retained)),
        ]
        history.add_state({0: state}, wall=now - 400 + i * 120)  # -400, -280, -160, -40
    live = data.live_from_engine(_state(acme=(3, 2, 1)), history.since(600), now)
    acme = live.tenants.set_index("tenant_id").loc["acme"]
    assert (acme["reserved_5m"], acme["retained_5m"]) == (90.0, 80.0)  # -280 .. -40


def test_the_pool_bar_splits_what_vllm_calls_free_into_leased_cached_cached_and_empty():
    state = _state(acme=(3, 40, 1), bob=(4, 6, 2))  # 46 of 63 blocks hold leased prefixes
    live = data.live_from_engine(state, {"samples": [], "events": []}, time.time())
    assert live.pool_states == {"running": 7, "cached_leased": 46, "cached": 3, "empty": 7}
    bar = charts.pool_bar(live.pool_states, live.pool_blocks)
    assert [t.name for t in bar.data] == [
        "running (7)",
        "cached, leased (46)",
        "cached (3)",
        "empty (7)",
    ]


def _reuse_history(totals: list[list]) -> dict:
    """Engine history samples whose cumulative lease reuse is `totals[i]` at sample i."""
    history = History(TenantLabels(), window=600, every=1.0)
    now = time.time()
    for i, reuse in enumerate(totals):
        state = _typed(_state())
        state.totals.lease_reuse_tokens = reuse
        history.add_state({0: state}, wall=now - 100 + 10 * i)
    return history.since(600)


def test_the_lease_hit_ratio_comes_from_the_increments_within_the_window():
    """Of turns back inside their reservation window: a turn back after it (reserved
    False) is left out, as the alert leaves it out."""
    before = [("premium", "reused", True, 1000), ("premium", "lost", True, 1000)]
    then = [("premium", "reused", True, 1300), ("premium", "lost", True, 1100)]
    after_window = ("standard", "lost", False, 500)
    later = [*then, ("standard", "reused", True, 64), after_window]
    samples = _reuse_history([before, then, later])
    live = data.live_from_engine(_state(), samples, time.time())
    assert live.lease_hit_ratio == pytest.approx((300 + 64) / (300 + 100 + 64))
    series = data.lease_hit_series(live.lease_reuse, bucket_seconds=1)
    assert sorted(series["tier"]) == ["premium", "standard"]
    assert series.set_index("tier").loc["premium", "ratio"] == pytest.approx(0.75)
    figure = charts.lease_hit_lines(series)
    assert {t.name for t in figure.data} == {"premium", "standard"}


def test_without_a_leased_next_turn_the_ratio_is_unknown_not_zero():
    live = data.live_from_engine(_state(), _reuse_history([[], []]), time.time())
    assert live.lease_hit_ratio is None
    assert charts.lease_hit_lines(data.lease_hit_series(live.lease_reuse)).layout.annotations


def test_an_empty_engine_is_an_empty_picture_not_an_error():
    state = _state() | {"lease_summary": {}, "tenant_tiers": {}}
    live = data.live_from_engine(state, {"samples": [], "events": []}, time.time())
    assert live.empty and live.tenants.empty
    assert charts.occupancy_area(live.occupancy).layout.annotations[0].text.startswith("No tenant")
    assert charts.events_timeline(live.events).layout.annotations[0].text.startswith("No ")


def test_the_fair_share_view_ranks_tenants_kept_under_their_share_first():
    history = History(TenantLabels(), window=600, every=1.0)
    now = time.time()
    steps = [  # cumulative (served, entitled) for heavy and light, one sample every 10 s
        {"heavy": (0, 0), "light": (0, 0)},
        {"heavy": (900, 600), "light": (300, 600)},
        {"heavy": (1500, 1200), "light": (900, 1200)},
    ]
    for i, books in enumerate(steps):
        state = _typed(_state())
        state.totals.fair_share_tokens = [(t, "free", s, e) for t, (s, e) in books.items()]
        history.add_state({0: state}, wall=now - 100 + 10 * i)
    live = data.live_from_engine(_state(), history.since(600), now)
    table = data.fair_share_table(live.fair_share, pd.Timestamp(now, unit="s", tz="UTC"))
    assert table["tenant_id"].tolist() == ["light", "heavy"]  # under its share first
    assert table.set_index("tenant_id")["window"].to_dict() == {"light": 0.75, "heavy": 1.25}
    assert table["now"].isna().all()  # nothing in the last minute: not a made-up 1.0
    assert {b.name for b in charts.fair_share_bars(table).data} == {"free"}
    empty = data.fair_share_table(live.fair_share.iloc[0:0], pd.Timestamp.now(tz="UTC"))
    message = charts.fair_share_bars(empty).layout.annotations[0].text
    assert message.startswith("No tenant was served while it still had requests waiting")


def _vector(metric: dict, value: float) -> dict:
    return {"metric": metric, "value": [NOW, str(value)]}


def _matrix(metric: dict, values: list[float]) -> dict:
    return {"metric": metric, "values": [[NOW - 10 * i, str(v)] for i, v in enumerate(values)]}


def test_live_from_prometheus_sums_a_fleet_into_the_same_picture():
    instant = {
        "pool": [_vector({}, 126)],
        "free": [_vector({}, 26)],
        "running": [_vector({}, 9)],
        "waiting": [],
        "blocks": [
            _vector({"tenant_id": "acme", "state": "running"}, 8),
            _vector({"tenant_id": "acme", "state": "cached_leased"}, 4),
            _vector({"tenant_id": "bob", "state": "cached"}, 2),
        ],
        "tiers": [_vector({"tenant_id": "acme", "tier": "premium"}, 1)],
        "leases": [_vector({"tenant_id": "acme"}, 3)],
        "lease_left": [_vector({"tenant_id": "acme"}, 120.4)],
        "preemptions_5m": [_vector({"tenant_id": "bob"}, 2.0000001)],
        "evictions_5m": [],
        "retention_5m": [
            _vector({"tenant_id": "acme", "state": "reserved"}, 120.0),
            _vector({"tenant_id": "acme", "state": "retained"}, 30.04),
        ],
    }
    ranged = {
        "occupancy": [_matrix({"tenant_id": "acme", "state": "running"}, [8, 6, 0])],
        "preemptions": [_matrix({"tier": "free", "reason": "kv_pressure"}, [0, 2, 1])],
        "evictions": [_matrix({"tier": "standard", "leased": "true"}, [5])],
        "lease_reuse": [
            _matrix({"tier": "premium", "outcome": "reused"}, [90, 0]),
            _matrix({"tier": "premium", "outcome": "lost"}, [10, 0]),
        ],
        "fair_served": [_matrix({"tenant_id": "bob", "tier": "free"}, [50, 0])],
        "fair_entitled": [_matrix({"tenant_id": "bob", "tier": "free"}, [100, 0])],
    }
    live = data.live_from_prometheus(instant, ranged)
    assert (live.pool_blocks, live.free_blocks, live.running, live.waiting) == (126, 26, 9, None)
    rows = live.tenants.set_index("tenant_id")
    acme = rows.loc["acme", ["running", "cached_leased", "held", "leases"]]
    assert acme.tolist() == [8, 4, 12, 3]
    assert rows.loc["bob", "preemptions_5m"] == 2 and rows.loc["bob", "tier"] == ""
    assert rows.loc["acme", ["reserved_5m", "retained_5m"]].tolist() == [120.0, 30.0]
    assert len(live.occupancy) == 3
    assert sorted(zip(live.events["reason"], live.events["n"], strict=True)) == [
        ("kv_pressure", 1.0),
        ("kv_pressure", 2.0),
        ("leased_cache_eviction", 5.0),
    ]  # zero buckets dropped
    assert live.lease_hit_ratio == pytest.approx(0.9)
    assert len(live.lease_reuse) == 1  # the bucket with no leased next turn is dropped
    fair = live.fair_share
    assert fair[["tenant_id", "served", "entitled"]].values.tolist() == [["bob", 50.0, 100.0]]


def _tenants(n: int) -> pd.DataFrame:
    rows = [
        data._tenant_row(f"tenant-{i:04d}", tier="free", blocks=[i % 7, 0, i % 3]) for i in range(n)
    ]
    return pd.DataFrame(rows, columns=data.TENANT_COLUMNS)


def test_a_thousand_tenants_are_searched_and_cut_to_the_top():
    tenants = _tenants(1000)
    top = data.pick_tenants(tenants, top=10)
    assert len(top) == 10 and (top["held"] == 6).all()
    found = data.pick_tenants(tenants, search="TENANT-099", top=50)
    assert sorted(found["tenant_id"]) == [f"tenant-{i:04d}" for i in range(990, 1000)]


def test_tenants_outside_the_top_are_summed_into_other():
    occupancy = data._frame(
        [(NOW, t, "running", b) for t, b in (("a", 5), ("b", 1), ("c", 2))],
        data.OCCUPANCY_COLUMNS,
    )
    keep = data.top_tenant_ids(occupancy, 1)
    merged = data.top_occupancy(occupancy, keep)
    assert keep == ["a"]
    assert dict(zip(merged["tenant_id"], merged["blocks"], strict=True)) == {"a": 5, "other": 3}
    figure = charts.occupancy_area(merged)
    assert {t.name for t in figure.data} == {"a", "other"}


def _events(*rows) -> pd.DataFrame:
    return data._frame(list(rows), data.EVENT_COLUMNS)


def test_the_timeline_filters_by_kind_tier_and_tenant_newest_first():
    events = _events(
        (1_796_000_001.0, "preemption", "free", "bob", "kv_pressure", 1, "premium", "acme"),
        (1_796_000_002.0, "lease", "premium", "acme", "start", 1, None, None),
        (1_796_000_003.0, "eviction", "standard", "Cy", "cache_eviction", 4, "premium", "acme"),
        (1_796_000_004.0, "alert", "", "", "KvleasePoolNearlyFull firing", 1, None, None),
    )
    assert list(data.filter_events(events)["kind"]) == ["alert", "eviction", "lease", "preemption"]
    assert list(data.filter_events(events, kinds=["lease"])["tenant_id"]) == ["acme"]
    assert list(data.filter_events(events, tiers=["free", "standard"])["n"]) == [4, 1]
    assert list(data.filter_events(events, tenant="cy")["tenant_id"]) == ["Cy"]
    figure = charts.events_timeline(data.filter_events(events))
    assert {p for t in figure.data for p in t.y} == {"alert", "preemption", "eviction", "lease"}
    empty = charts.events_timeline(data.filter_events(events, tenant="nobody"))
    assert empty.layout.annotations[0].text.startswith("No event")


def test_who_took_whose_cache_pairs_each_victim_with_the_tier_that_took_it():
    events = _events(
        (1_796_000_001.0, "preemption", "free", "bob", "kv_pressure", 1, "premium", "acme"),
        (1_796_000_002.0, "preemption", "free", "bob", "admit_higher_tier", 1, "standard", "cy"),
        (1_796_000_003.0, "eviction", "free", "bob", "cache_eviction", 4, "premium", "acme"),
        (1_796_000_004.0, "eviction", "standard", "cy", "cache_eviction", 2, "none", None),
        (1_796_000_005.0, "lease", "premium", "acme", "start", 1, None, None),
    )
    table = data.who_took_whose(events)
    assert table.to_dict("records") == [
        {"victim": "free", "cause": "premium", "preempted": 1, "evicted": 4},
        {"victim": "standard", "cause": "- (cache reset)", "preempted": 0, "evicted": 2},
        {"victim": "free", "cause": "standard", "preempted": 1, "evicted": 0},
    ]
    by_tenant = data.who_took_whose(events, by="tenant")
    assert ("bob", "acme", 1, 4) in {tuple(r) for r in by_tenant.itertuples(index=False)}


def test_history_events_carry_the_cause_as_a_label():
    history = History(TenantLabels(max_labels=1), window=600)
    mono = time.monotonic()
    history.add_event(
        Eviction(
            at=mono,
            tenant_id="bob",
            tier="free",
            leased=False,
            blocks=3,
            by_tier="premium",
            by_tenant="acme",
        )
    )
    history.add_event(
        Eviction(at=mono, tenant_id="bob", tier="free", leased=False, blocks=1)
    )  # no cause known
    first, second = history.since(60)["events"]
    assert (first["by_tier"], first["by_tenant"]) == ("premium", "__other__")  # bounded
    assert (second["by_tier"], second["by_tenant"]) == ("none", None)


def test_lease_starts_and_expiries_reach_the_timeline_but_not_renewals():
    history = History(TenantLabels(), window=600, every=1.0)
    mono = time.monotonic()
    for kind in ("start", "renew", "expire"):
        history.add_event(
            LeaseEvent(
                at=mono,
                tenant_id="acme",
                session_id="s1",
                tier="premium",
                kind=kind,
                expires_at=None,
            )
        )
    live = data.live_from_engine(_state(), history.since(600), time.time())
    assert list(live.events["reason"]) == ["start", "expire"]
    assert set(live.events["kind"]) == {"lease"} and set(live.events["tenant_id"]) == {"acme"}
    assert list(live.tenants["evictions_5m"]) == [0]  # lease events are not evictions


def test_prometheus_alerts_become_timeline_events_where_each_firing_starts():
    series = [
        {
            "metric": {
                "alertname": "KvleaseLeaseEvictions",
                "alertstate": "firing",
                "tier": "free",
            },
            "values": [[100, "1"], [105, "1"], [110, "1"], [200, "1"], [205, "1"]],
        }
    ]
    live = data.live_from_prometheus({}, {"alerts": series})
    starts = live.events[live.events["kind"] == "alert"]
    assert [t.timestamp() for t in starts["t"]] == [100.0, 200.0]  # two firings, a gap between
    assert set(starts["reason"]) == {"KvleaseLeaseEvictions firing"}


def test_the_live_tenant_table_reads_plain_and_shows_dashes_not_none():
    state = _state(acme=(3, 2, 1), bob=(4, 0, 6))
    live = data.live_from_engine(state, _history(state).since(600), time.time())
    table = data.tenant_display(data.pick_tenants(live.tenants))
    assert list(table.columns[:5]) == [
        "Tenant",
        "Tier",
        "Held blocks (running + lease-kept)",
        "Preemptions (5 min)",
        "Evicted blocks (5 min)",
    ]
    rows = table.set_index("Tenant")
    assert (
        rows.loc["bob", "Lease time left (s)"] == "-"
        and rows.loc["acme", "Lease time left (s)"] == "290"
    )
    assert not table.isna().any().any()


def test_config_comes_from_the_environment_and_refresh_is_at_least_2_s():
    config = data.Config.from_env(
        {data.ENGINE_ENV: "http://e:8000", data.REFRESH_ENV: "0.5", data.TOKEN_ENV: "t"}
    )
    assert (config.engine, config.prometheus, config.token) == ("http://e:8000", None, "t")
    assert config.refresh_seconds == 2.0


def test_each_data_parallel_rank_is_a_row_beside_the_whole():
    from kvlease.exporters.view import EngineView

    view = EngineView()
    for rank, (pool, free, held) in enumerate([(63, 20, (5, 2, 1)), (63, 40, (1, 0, 3))]):
        state = _typed(_state(acme=held) | {"pool_blocks": pool, "free_blocks": free})
        view.apply(Message(state=state, engine=rank))
    live = data.live_from_engine(view.state_json(), {"samples": [], "events": []}, time.time())
    assert (live.pool_blocks, live.free_blocks, live.running) == (126, 60, 10)
    assert live.engines.values.tolist() == [["0", 63, 20, 7, 5, 2], ["1", 63, 40, 1, 5, 2]]
    assert live.tenants.set_index("tenant_id").loc["acme", "held"] == 8  # the whole


def test_prometheus_rows_name_each_replicas_ranks():
    instant = {
        "engine_pool": [
            _vector({"instance": "a:8000", "engine": "0"}, 63),
            _vector({"instance": "a:8000", "engine": "1"}, 63),
            _vector({"instance": "b:8000", "engine": "0"}, 255),
        ],
        "engine_free": [_vector({"instance": "b:8000", "engine": "0"}, 200)],
        "engine_running": [_vector({"instance": "a:8000", "engine": "1"}, 3)],
    }
    live = data.live_from_prometheus(instant, {})
    assert live.engines[["engine", "pool_blocks", "free_blocks", "running"]].values.tolist() == [
        ["a:8000/0", 63, 0, 0],
        ["a:8000/1", 63, 0, 3],
        ["b:8000/0", 255, 200, 0],
    ]
