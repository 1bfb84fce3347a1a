"""kvlease's metric families from scheduler snapshots and vLLM request stats: no server."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvlease.engine.events import Message, RequestDone
from kvlease.engine.labels import OTHER, UNCLASSIFIED, TenantLabels
from kvlease.exporters.metrics import FAMILIES, TenantMetrics
from kvlease.exporters.view import EngineView


def _state(tenants=None, tenant_tiers=None, **totals):
    base = {
        "preemptions": [],
        "preempted_blocks": [],
        "recomputed_tokens": [],
        "evicted_blocks": [],
        "block_seconds": [],
        "offloaded_blocks": [],
    }
    return {
        "at": 0.0,
        "pool_blocks": 63,
        "free_blocks": 40,
        "events_dropped": 2,
        "tenants": tenants or {},
        "tenant_tiers": tenant_tiers or {},
        "running": 4,
        "waiting": 6,
        "waiting_by_tier": {"premium": 1, "standard": 0, "free": 3, UNCLASSIFIED: 2},
        "leases_total": 0,
        "leases": [],
        "lease_summary": {},
        "totals": {**base, **totals},
    }


def _apply(view: EngineView, message: dict) -> None:
    """A channel message as the API process decodes it."""
    view.apply(msgspec.convert(message, Message))


def _stats(prompt=10, cached=4, output=6, reason=1):
    return SimpleNamespace(
        num_prompt_tokens=prompt,
        num_cached_tokens=cached,
        num_generation_tokens=output,
        finish_reason=reason,
        queued_time=0.1,
        prefill_time=0.2,
        e2e_latency=1.5,
        mean_time_per_output_token=0.03,
    )


def _done(tenant, recomputed=0, api_server=0):
    return RequestDone(
        at=0.0,
        request_id="kvl-" + "0" * 32,
        tenant_id=tenant,
        tier="premium",
        session_id=None,
        status="finished_stopped",
        preemptions=1,
        recomputed_tokens=recomputed,
        block_seconds=1.0,
        prompt_tokens=10,
        output_tokens=5,
        lease_covered_tokens=0,
        api_server=api_server,
    )


def _scrape(collector) -> dict:
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}, text


def test_every_family_is_named_under_vllm_tenant_with_help(tiers):
    names = [f.name for f in FAMILIES]
    assert len(names) == len(set(names))
    assert all(
        n.startswith("vllm_tenant_") and f.help for n, f in zip(names, FAMILIES, strict=True)
    )
    assert {"vllm_tenant_kv_cache_evictions_total", "vllm_tenant_active_swapped_blocks"} <= set(
        names
    )


def test_engine_totals_and_request_stats_become_samples(tiers):
    view = EngineView()
    _apply(
        view,
        {
            "events": [],
            "state": _state(
                tenants={"acme": {"running": 3, "cached_leased": 2, "cached": 1}},
                tenant_tiers={"acme": "premium"},
                preemptions=[["acme", "premium", "kv_pressure", "recompute", "premium", 2]],
                preempted_blocks=[["acme", "premium", "kv_pressure", 7]],
                evicted_blocks=[
                    ["acme", "premium", True, "standard", 3],
                    ["acme", "premium", True, "premium", 1],
                ],
                block_seconds=[["acme", 12.5]],
                recomputed_tokens=[["acme", 33]],
                lease_reuse_tokens=[
                    ["premium", "reused", True, 320],
                    ["premium", "lost", True, 32],
                    ["premium", "lost", False, 64],
                ],
                fair_share_tokens=[["acme", "premium", 96.0, 192.0]],
            )
            | {
                "fair_share": [
                    {
                        "tenant_id": "acme",
                        "tier": "premium",
                        "counter": 480.0,
                        "ratio": 0.5,
                        "waiting": 3,
                    }
                ],
                "reserved_caps": {"standard": 6, "premium": 3},
            },
        },
    )
    metrics = TenantMetrics(view, tiers, TenantLabels())
    metrics.request_finished("acme", "premium", _stats())
    metrics.request_finished(None, None, _stats(reason=2))
    metrics.engine_event(_done("acme", recomputed=33))
    families, _ = _scrape(metrics)

    def value(family, **labels):
        for s in families[family].samples:
            if all(s.labels.get(k) == v for k, v in labels.items()) and not s.name.endswith(
                ("_created",)
            ):
                return s.value
        raise KeyError(labels)

    assert value("vllm_tenant_kv_blocks", tenant_id="acme", state="running", engine="0") == 3
    assert value("vllm_tenant_info", tenant_id="acme", tier="premium") == 1
    assert value("vllm_tenant_running_requests") == 4
    assert value("vllm_tenant_waiting_requests", tier="free") == 3
    assert value("vllm_tenant_waiting_requests", tier=UNCLASSIFIED) == 2
    assert value("vllm_tenant_kv_reserved_cap_blocks", tier="premium", engine="0") == 3
    assert value("vllm_tenant_ledger_write_errors") == 0
    assert (
        value(
            "vllm_tenant_preemptions",
            tenant_id="acme",
            tier="premium",
            reason="kv_pressure",
            mode="recompute",
            by_tier="premium",
        )
        == 2
    )
    evicted = "vllm_tenant_cached_block_evictions"
    assert value(evicted, tenant_id="acme", leased="true", by_tier="standard") == 3
    assert value(evicted, tenant_id="acme", leased="true", by_tier="premium") == 1
    assert (
        value(
            "vllm_tenant_kv_cache_evictions",
            tenant_id="acme",
            priority="0",
            preemption_reason="kv_pressure",
        )
        == 7
    )
    assert (
        value(
            "vllm_tenant_kv_cache_evictions",
            tenant_id="acme",
            priority="0",
            preemption_reason="leased_cache_eviction",
        )
        == 4
    )
    assert value("vllm_tenant_tokens", tenant_id="acme", kind="recomputed") == 33
    assert value("vllm_tenant_tokens", tenant_id="acme", kind="cached_input") == 4
    assert value("vllm_tenant_requests", tenant_id=UNCLASSIFIED, outcome="aborted") == 1
    assert value("vllm_tenant_kv_block_seconds", tenant_id="acme") == 12.5
    assert value("vllm_tenant_events_dropped") == 2
    ttft = "vllm_tenant_time_to_first_token_seconds"
    assert value(ttft, tier="premium", le="0.25") == 0  # queued 0.1 + prefill 0.2
    assert value(ttft, tier="premium", le="0.5") == 1
    mine = families["vllm_tenant_tenant_time_to_first_token_seconds"].samples
    acme = {s.name.rsplit("_", 1)[-1]: s.value for s in mine if s.labels["tenant_id"] == "acme"}
    assert acme["count"] == 1 and acme["sum"] == pytest.approx(0.3)
    assert value("vllm_tenant_request_queue_time_seconds", tier="premium", le="0.1") == 1
    tpot = "vllm_tenant_request_time_per_output_token_seconds"
    assert (
        value(tpot, tier="premium", le="0.025") == 0 and value(tpot, tier="premium", le="0.05") == 1
    )
    assert value("vllm_tenant_active_swapped_blocks", tenant_id="acme") == 0
    reuse = "vllm_tenant_lease_reuse_tokens"
    assert value(reuse, tier="premium", outcome="reused", reserved="true") == 320
    assert value(reuse, tier="premium", outcome="lost", reserved="true") == 32
    assert value(reuse, tier="premium", outcome="lost", reserved="false") == 64
    # each outcome of a tier with a leased next turn starts at 0, so increase() sees it
    assert value(reuse, tier="premium", outcome="reused", reserved="false") == 0
    assert value("vllm_tenant_fair_virtual_tokens", tenant_id="acme", tier="premium") == 480
    assert value("vllm_tenant_fair_served_tokens", tenant_id="acme", tier="premium") == 96
    assert value("vllm_tenant_fair_entitled_tokens", tenant_id="acme", tier="premium") == 192


def test_labels_keep_allow_listed_and_first_tenants_and_fold_the_rest():
    labels = TenantLabels(max_labels=2, allow=["vip"])
    assert [labels(t) for t in ["a", "b", "c", "vip", "a", None]] == [
        "a",
        "b",
        OTHER,
        "vip",
        "a",
        UNCLASSIFIED,
    ]


def test_a_flood_of_100000_tenants_keeps_metrics_under_a_fixed_size(tiers):
    labels = TenantLabels(max_labels=500)
    view = EngineView()
    _apply(view, {"events": [], "state": _state()})
    metrics = TenantMetrics(view, tiers, labels)
    for i in range(100_000):
        metrics.request_finished(f"tenant-{i}", "free", _stats())
    families, text = _scrape(metrics)
    tenants = {s.labels["tenant_id"] for s in families["vllm_tenant_requests"].samples}
    assert len(tenants) == 501 and OTHER in tenants
    assert len(labels._known) == 500  # its lookup cache keeps no folded tenant
    assert len(text.encode()) < 500_000  # 501 labels x (tokens, requests, mean TTFT)
    other = [
        s.value
        for s in families["vllm_tenant_requests"].samples
        if s.labels["tenant_id"] == OTHER and s.name.endswith("_total")
    ]
    assert other == [100_000 - 500]


def test_hashed_tenant_labels_are_stable_and_never_name_the_tenant():
    from kvlease.engine.labels import hashed_label

    key = b"k" * 32
    labels = TenantLabels(max_labels=2, hash_key=key)
    first = labels("acme-corp")
    assert first == labels("acme-corp") == hashed_label(key, "acme-corp")
    assert first.startswith("t_") and "acme" not in first
    assert TenantLabels(hash_key=b"x" * 32)("acme-corp") != first  # keyed, not a plain hash
    labels("b"), labels("c")
    assert labels("d") == OTHER and labels(None) == UNCLASSIFIED


def test_hashing_without_a_long_enough_key_is_a_clear_error(monkeypatch):
    from kvlease.engine.labels import HASH_ENV, HASH_KEY_ENV, hash_key_from_env

    monkeypatch.setenv(HASH_ENV, "1")
    monkeypatch.setenv(HASH_KEY_ENV, "short")
    with pytest.raises(ValueError, match=HASH_KEY_ENV):
        hash_key_from_env()
    monkeypatch.setenv(HASH_KEY_ENV, "k" * 32)
    assert TenantLabels.from_env().hash_key == b"k" * 32
