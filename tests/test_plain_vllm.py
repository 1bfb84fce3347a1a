"""The pieces on a plain vLLM server, the way a user who keeps `vllm serve` runs them:
here with /metrics behind a token and tenant labels hashed, scraped by a real Prometheus."""

from __future__ import annotations

import signal
import sys

import httpx
import openai
import pytest
from servers import start

from kvlease.engine.channel import new_address
from kvlease.engine.labels import hashed_label

pytestmark = pytest.mark.engine
LABEL_KEY = "label-key-" + "x" * 32


@pytest.fixture(scope="module")
def plain(kvlease_home, demo_model, tmp_path_factory):
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        demo_model,
        "--served-model-name",
        "kvlease-demo",
        "--block-size",
        "32",
        "--max-model-len",
        "1024",
        "--num-gpu-blocks-override",
        "64",
        "--scheduler-cls",
        "kvlease.engine.vllm_scheduler.TenantAwareScheduler",
        "--middleware",
        "kvlease.server.middleware.TenantMiddleware",
    ]
    env = {
        "VLLM_PLUGINS": "kvlease_admin,kvlease_stats",
        "KVLEASE_CHANNEL": new_address(),
        "KVLEASE_METRICS_AUTH": "1",
        "KVLEASE_HASH_TENANT_LABELS": "1",
        "KVLEASE_TENANT_LABEL_KEY": LABEL_KEY,
    }
    srv = start(command, kvlease_home, tmp_path_factory.mktemp("plain") / "vllm.log", env)
    yield srv
    srv.stop(signal.SIGKILL)


def test_plain_vllm_server_refuses_requests_without_a_token(plain):
    r = httpx.post(
        f"{plain.url}/v1/chat/completions",
        json={"model": "kvlease-demo", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "missing_token"


def test_plain_vllm_server_schedules_by_the_verified_tenant(plain):
    c = openai.OpenAI(
        base_url=f"{plain.url}/v1",
        max_retries=0,
        api_key=plain.token("plain-tenant", "premium", session="p1"),
    )
    reply = c.chat.completions.create(
        model="kvlease-demo", messages=[{"role": "user", "content": "hello " * 40}], max_tokens=4
    )
    assert reply.usage.completion_tokens == 4
    state = plain.admin_state()  # the kvlease_admin plugin, fed by the scheduler's channel
    assert state["tenants"][hashed_label(LABEL_KEY.encode(), "plain-tenant")]["cached_leased"] > 0
    [lease] = [x for x in state["leases"] if x["tenant_id"] == "plain-tenant"]
    assert lease["tier"] == "premium" and lease["session_id"] == "p1"


def test_metrics_need_the_metrics_role_and_never_name_a_tenant(plain):
    assert httpx.get(f"{plain.url}/metrics").status_code == 401
    for path in ("/metrics", "/metrics/"):  # OPTIONS once answered 200 with every series
        assert httpx.options(f"{plain.url}{path}").status_code == 401
    tenant_only = plain.headers("plain-tenant", "premium")
    assert httpx.get(f"{plain.url}/metrics", headers=tenant_only).status_code == 403
    scraper = plain.headers("prometheus", "free", roles=["metrics"])
    text = httpx.get(f"{plain.url}/metrics/", headers=scraper, follow_redirects=True).text
    assert "vllm_tenant_kv_blocks" in text and "plain-tenant" not in text


def test_a_real_prometheus_scrapes_with_its_token(plain, tmp_path):
    from servers import prometheus, wait_for_series

    token = plain.token("prometheus", "free", roles=["metrics"])
    label = hashed_label(LABEL_KEY.encode(), "plain-tenant")
    with prometheus([plain.url.removeprefix("http://")], tmp_path, bearer=token) as prom:
        [up] = wait_for_series(prom, 'up{job="kvlease"} == 1')
        assert up["value"][1] == "1"
        wait_for_series(prom, f'vllm_tenant_kv_blocks{{tenant_id="{label}"}}')
