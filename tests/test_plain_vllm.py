"""The pieces on a plain vLLM server, the way a user who keeps `vllm serve` runs them."""

from __future__ import annotations

import signal
import sys

import httpx
import openai
import pytest
from servers import start

from engine.channel import new_address

pytestmark = pytest.mark.engine


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
        "engine.vllm_scheduler.TenantAwareScheduler",
        "--middleware",
        "server.middleware.TenantMiddleware",
    ]
    env = {"VLLM_PLUGINS": "kvlease_admin", "KVLEASE_CHANNEL": new_address()}
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
    assert state["tenants"]["plain-tenant"]["cached_leased"] > 0
    [lease] = [x for x in state["leases"] if x["tenant_id"] == "plain-tenant"]
    assert lease["tier"] == "premium" and lease["session_id"] == "p1"
