"""The live page's health strip (`kvlease.dashboard.health`): alerts from Prometheus's JSON or the
bundled rules evaluated on the engine's figures, and the pool counted as a person reads it."""

from __future__ import annotations

import time

import pandas as pd

from kvlease.dashboard import data, health


def _live(free=20, tenants=None, events=(), reuse=(), waiting=3) -> data.Live:
    rows = [
        data._tenant_row(t, tier=tier, blocks=blocks)
        for t, tier, blocks in tenants or [("acme", "premium", [3, 18, 44])]
    ]
    return data.Live(
        pool_blocks=66,
        free_blocks=free,
        running=4,
        waiting=waiting,
        occupancy=data._frame([], data.OCCUPANCY_COLUMNS),
        tenants=pd.DataFrame(rows, columns=data.TENANT_COLUMNS),
        events=data._frame(list(events), data.EVENT_COLUMNS),
        lease_reuse=data._frame(list(reuse), data.LEASE_COLUMNS),
        fair_share=data._frame([], data.FAIR_COLUMNS),
    )


def test_a_pool_full_of_cached_blocks_reads_held_not_empty():
    """The demo's "Pool in use 0%" beside a bar of 44 cached and 18 leased blocks."""
    live = _live(free=63, tenants=[("acme", "premium", [0, 18, 44])])
    s = health.strip(live, [], "premium")
    assert round(s.in_use, 2) == 0.05 and round(s.held, 2) == 0.94
    assert s.headline == "No alert firing or pending."


def test_the_engine_figures_fire_the_bundled_rules():
    now = time.time()
    live = _live(
        free=1,
        events=[
            (now - 10, "preemption", "premium", "acme", "kv_pressure", 1, "premium", "zed"),
            (now - 5, "eviction", "free", "bob", "leased_cache_eviction", 3, "free", "cy"),
            (now - 5, "eviction", "free", "bob", "cache_eviction", 9, "free", "cy"),
        ],
        reuse=[(now - 30, "premium", 10, 90)],
    )
    alerts = health.evaluate(live, "premium", minutes=5)
    assert [a.name for a in alerts] == [
        "KvleasePoolNearlyFull",
        "KvleasePremiumPreempted",
        "KvleaseLeaseEvictions",
        "KvleaseLeaseHitLow",
    ]
    assert "3 lease-protected cached blocks of free tenants" in alerts[2].summary
    s = health.strip(live, alerts, "premium")
    assert s.top_preemptions == 1 and s.lease_hit == 0.1
    assert s.headline.startswith("4 firing: KvleasePoolNearlyFull, KvleasePremiumPreempted")


def test_a_quiet_engine_fires_nothing():
    assert health.evaluate(_live(), "premium", minutes=5) == []


def test_prometheus_alerts_are_kvleases_only_firing_first():
    body = [
        {"labels": {"alertname": "Watchdog"}, "state": "firing"},
        {
            "labels": {"alertname": "KvleaseLeaseHitLow", "severity": "warning"},
            "state": "pending",
            "annotations": {"summary": "Leased standard sessions lose their prefix"},
        },
        {
            "labels": {"alertname": "KvleaseLeaseEvictions", "severity": "info"},
            "state": "firing",
            "annotations": {"summary": "Leased prefixes of free tenants were evicted"},
        },
    ]
    alerts = health.from_prometheus(body)
    assert [(a.name, a.state) for a in alerts] == [
        ("KvleaseLeaseEvictions", "firing"),
        ("KvleaseLeaseHitLow", "pending"),
    ]
    s = health.strip(_live(), alerts, "premium")
    assert s.headline == "1 firing: KvleaseLeaseEvictions; 1 pending: KvleaseLeaseHitLow."
