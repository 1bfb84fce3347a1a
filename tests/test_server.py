"""`kvlease serve` for real: vLLM's OpenAI server, the demo model, the stock `openai` client.

One server for the module (~60 s to start on two cores). The last test stops
it with SIGTERM.
"""

from __future__ import annotations

import base64
import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from decimal import Decimal
from pathlib import Path

import httpx
import jwt
import openai
import pytest
from servers import kvlease_serve
from waiting import until, wait

pytestmark = pytest.mark.engine
MODEL = "kvlease-demo"
CHAT = [{"role": "user", "content": "Tell me about the cache."}]


BUDGETS = """
refresh_seconds = 1
[tenants.spender]
monthly = "0.000001"
on_exceed = "block"
[tenants.warned]
monthly = "0.000001"
[tenants.roomy]
monthly = "1000000"
on_exceed = "block"
[tenants.burst]
monthly = "0.005"
on_exceed = "block"
"""


@pytest.fixture(scope="module")
def server(kvlease_home, tmp_path_factory, usage_db):
    folder = tmp_path_factory.mktemp("serve")
    (folder / "budgets.toml").write_text(BUDGETS)
    budgets = ["--budgets", str(folder / "budgets.toml")]
    srv = kvlease_serve(kvlease_home, folder / "server.log", "--usage-db", usage_db, *budgets)
    yield srv
    srv.stop(signal.SIGKILL)


def client(server, tenant, tier="free", **kw) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.url}/v1", api_key=server.token(tenant, tier, **kw), max_retries=0
    )


def test_engine_start_answers_503_in_openai_shape_then_serves(server):
    statuses = server.startup_statuses
    assert 503 in statuses and statuses[-1] == 200
    assert statuses.index(503) < statuses.index(200)


def test_openai_client_chats_and_completes_with_a_minted_token(server):
    c = client(server, "acme", "premium", session="chat-1")
    reply = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8)
    assert reply.choices[0].message.content
    assert reply.usage.completion_tokens == 8
    assert reply.id.startswith("chatcmpl-kvl-")

    chunks = list(c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, stream=True))
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed

    completion = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5)
    assert completion.usage.completion_tokens == 5
    assert [m.id for m in c.models.list()] == [MODEL]


def _budget_gauge(server, tenant: str) -> float:
    metrics = httpx.get(f"{server.url}/metrics").text.splitlines()
    gauge = f'vllm_tenant_budget_used_ratio{{tenant_id="{tenant}"}}'
    return float(next(x for x in metrics if x.startswith(gauge)).rsplit(" ", 1)[1])


def test_a_tenant_past_its_budget_gets_429_budget_exceeded_in_openai_shape(server, usage_db):
    """The month's spend (a record already in the ledger) is past the budget: once the
    refresher (every second, off the request path) has read it, requests get 429."""
    from dataclasses import replace

    from records import rec

    from kvlease.exporters.ledger import UsageLedger

    now = time.time()
    spent = replace(rec(7, "spender", "standard"), started_at=now - 2, ended_at=now)
    UsageLedger(usage_db, create=False).write([spent])
    c = client(server, "spender", "standard")
    # the KvleaseBudgetExceeded alert's gauge, once the spend refresh has read the ledger
    until(lambda: _budget_gauge(server, "spender") >= 1, "the spender's budget gauge at 1", 60)
    with pytest.raises(openai.RateLimitError) as refused:
        c.completions.create(model=MODEL, prompt="Budgets", max_tokens=4)
    error = refused.value.body if isinstance(refused.value.body, dict) else {}
    assert refused.value.status_code == 429 and refused.value.code == "budget_exceeded"
    assert "monthly budget" in error.get("message", "") and error.get("type")
    assert int(refused.value.response.headers["retry-after"]) > 0
    assert _budget_gauge(server, "spender") >= 1


def test_a_burst_cannot_spend_past_a_block_budget(server, usage_db):
    """40 requests at once on a fresh budget: each holds an upper bound of its cost while
    it runs, so the admitted ones cannot all pass on the same spend (main: all 40 were
    served and billed 1,837% of a budget)."""
    from concurrent.futures import ThreadPoolExecutor

    from kvlease.engine.tenancy import TierTable
    from kvlease.exporters.ledger import UsageLedger
    from kvlease.exporters.pricing import record_cost

    headers = server.headers("burst", "premium")
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 12, "ignore_eos": True}

    def one(_):
        return httpx.post(
            f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=120
        )

    with ThreadPoolExecutor(40) as pool:
        replies = list(pool.map(one, range(40)))
    statuses = sorted(r.status_code for r in replies)
    assert set(statuses) == {200, 429} and statuses.count(200) < 40, statuses
    refused = next(r for r in replies if r.status_code == 429).json()["error"]
    assert refused["code"] == "budget_exceeded"
    records = list(UsageLedger(usage_db, create=False).read(0, 4e9, ["burst"]))
    assert len(records) == statuses.count(200)
    tiers = TierTable.load()
    spent = sum(record_cost(r, tiers) for r in records)
    # Token costs are held from above; only KV block-hours (unknown until a request
    # ends, 0.01 USD a block-hour here) can pass the budget, by a few millionths.
    assert spent <= Decimal("0.005") + Decimal("0.00001"), spent


def test_a_warned_tenant_past_its_budget_is_served_with_a_header(server):
    c = client(server, "warned", "standard")

    def served_with_the_header():
        raw = c.completions.with_raw_response.create(model=MODEL, prompt="Hi", max_tokens=4)
        return raw if raw.headers.get("x-kvlease-budget") == "exceeded" else None

    raw = until(served_with_the_header, "the warning header once the spend is read", 60, 0.5)
    assert float(raw.headers["x-kvlease-budget-used"]) >= 1
    roomy = client(server, "roomy", "free").completions.with_raw_response.create(
        model=MODEL, prompt="Hi", max_tokens=4
    )
    assert float(roomy.headers["x-kvlease-budget-used"]) < 0.8
    assert "x-kvlease-budget" not in roomy.headers
    unbudgeted = client(server, "acme", "free").completions.with_raw_response.create(
        model=MODEL, prompt="Hi", max_tokens=4
    )
    assert "x-kvlease-budget-used" not in unbudgeted.headers


def test_a_session_header_reaches_the_ledger_through_the_openai_client(server, usage_db):
    from kvlease.exporters.ledger import UsageLedger

    c = openai.OpenAI(
        base_url=f"{server.url}/v1",
        api_key=server.token("sessioned", "premium"),
        default_headers={"X-Session-Id": "conv-7"},  # one token per tenant, a header per chat
        max_retries=0,
    )
    c.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    c.completions.create(
        model=MODEL, prompt="Hi", max_tokens=2, extra_headers={"X-Session-Id": "conv-8"}
    )
    ledger = UsageLedger(usage_db, create=False)
    sessions = sorted(r.session_id for r in ledger.read(0, 4e9, ["sessioned"]))
    assert sessions == ["conv-7", "conv-8"]  # committed before each response's last byte


def _b64(data: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()


def _auth_cases(server) -> dict[str, tuple[str | None, int, str]]:
    good = server.token("acme", "free")
    header, payload, sig = good.split(".")
    claims = jwt.decode(good, options={"verify_signature": False})
    now = int(time.time())
    return {
        "no token": (None, 401, "missing_token"),
        "alg none": (f"{_b64({'alg': 'none'})}.{payload}.", 401, "unsupported_algorithm"),
        "wrong key": (jwt.encode(claims, "x" * 48, algorithm="HS256"), 401, "invalid_signature"),
        "expired": (
            jwt.encode(
                {**claims, "iat": now - 7200, "exp": now - 3600}, server.secret, algorithm="HS256"
            ),
            401,
            "token_expired",
        ),
        "tampered tier": (
            f"{header}.{_b64({**claims, 'tier': 'premium'})}.{sig}",
            401,
            "invalid_signature",
        ),
        "unknown kid": (
            jwt.encode(claims, server.secret, algorithm="HS256", headers={"kid": "old"}),
            401,
            "unknown_kid",
        ),
        "10 KB token": (
            jwt.encode({**claims, "pad": "x" * 10_000}, server.secret, algorithm="HS256"),
            401,
            "token_too_large",
        ),
        "garbage": ("not-a-jwt", 401, "malformed_token"),
        "unknown tier": (
            jwt.encode({**claims, "tier": "platinum"}, server.secret, algorithm="HS256"),
            403,
            "tier_not_allowed",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "no token",
        "alg none",
        "wrong key",
        "expired",
        "tampered tier",
        "unknown kid",
        "10 KB token",
        "garbage",
        "unknown tier",
    ],
)
def test_bad_credentials_get_401_or_403_with_a_reason(server, case):
    token, status, code = _auth_cases(server)[case]
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        headers=headers,
        json={"model": MODEL, "messages": CHAT, "max_tokens": 4},
    )
    assert r.status_code == status
    error = r.json()["error"]
    assert error["code"] == code and error["message"]
    assert error["type"] == ("authentication_error" if status == 401 else "permission_error")


def test_openai_client_sees_an_authentication_error(server):
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="garbage", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        bad.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
    assert err.value.status_code == 401


def test_admin_routes_refuse_tenant_tokens_and_serve_admins(server):
    r = httpx.get(f"{server.url}/admin/state", headers=server.headers("acme", "premium"))
    assert r.status_code == 403 and r.json()["error"]["code"] == "role_not_allowed"
    r = httpx.post(f"{server.url}/reset_prefix_cache", headers=server.headers("acme"))
    assert r.status_code == 403
    state = server.admin_state()
    assert state["pool_blocks"] == 255
    assert {"running", "waiting", "waiting_by_tier", "leases", "tenants"} <= set(state)


def _cached(reply) -> int:
    return reply.usage.prompt_tokens_details.cached_tokens


PROMPT = [{"role": "user", "content": "A long shared system prompt about KV caches. " * 12}]


def test_prefix_cache_hits_within_a_tenant_never_across_tenants(server):
    alice, bob = client(server, "alice", "premium"), client(server, "bob", "premium")
    first = alice.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=2)
    assert _cached(first) == 0
    again = alice.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=2)
    assert _cached(again) >= 64
    other = bob.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=2)
    assert _cached(other) == 0


SECRET_TALK = [*PROMPT, {"role": "user", "content": "carol's secret conversation " * 10}]


def test_client_sent_tenant_fields_change_nothing(server):
    client(server, "carol", "premium", session="c1").chat.completions.create(
        model=MODEL, messages=SECRET_TALK, max_tokens=2
    )
    forged = {
        "vllm_xargs": {"tenant_id": "carol", "tier": "premium", "session_id": "c1"},
        "cache_salt": "carol",
        "priority": -1000,
    }
    reply = client(server, "mallory", "free").chat.completions.create(
        model=MODEL,
        messages=SECRET_TALK,
        max_tokens=2,
        extra_body=forged,
        extra_headers={"X-Vllm-Priority": "-1000"},
    )
    assert _cached(reply) == 0  # no hit on carol's cache
    state = server.admin_state()
    assert "mallory" in state["tenants"]
    assert not [x for x in state["leases"] if x["tenant_id"] == "mallory"]  # free: no lease


BAD_BODIES = [
    ("malformed JSON", b'{"model": "kvlease-demo", "messages": [', 400),
    ("wrong types", {"model": MODEL, "messages": 5}, 400),
    ("empty messages", {"model": MODEL, "messages": []}, 400),
    ("negative max_tokens", {"model": MODEL, "messages": CHAT, "max_tokens": -1}, 400),
    ("huge max_tokens", {"model": MODEL, "messages": CHAT, "max_tokens": 10**9}, 400),
    (
        "prompt too long",
        {
            "model": MODEL,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "cache " * 5000}],
        },
        400,
    ),
    ("unknown model", {"model": "gpt-17", "messages": CHAT}, 404),
    ("array body", [1, 2, 3], 400),
]


@pytest.mark.parametrize(("name", "body", "status"), BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_input_is_a_4xx_in_openai_shape(server, name, body, status):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        content=raw,
        headers={**server.headers("acme"), "Content-Type": "application/json"},
    )
    assert (
        r.status_code in (status, 422)
        if name in ("wrong types", "array body")
        else (r.status_code == status)
    )
    assert r.status_code < 500
    error = r.json()["error"]
    assert error["message"]
    ok = client(server, "acme").chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    assert ok.choices[0].message.content is not None


def test_schemathesis_finds_no_server_error(server, tmp_path):
    st = shutil.which("st", path=str(Path(sys.executable).parent))
    done = subprocess.run(
        [
            st,
            "run",
            f"{server.url}/openapi.json",
            "-H",
            f"Authorization: Bearer {server.token('fuzzer', 'standard')}",
            "--checks",
            "not_a_server_error",
            "--max-examples",
            "8",
            "--phases",
            "examples,fuzzing",
            "--request-timeout",
            "60",
            "--seed",
            "1",
            "--no-color",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-5000:]
    _wait_idle(server)
    ok = client(server, "acme").chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    assert ok.choices[0].message.content is not None


def _wait_idle(server, seconds: float = 120, after: float = 0.0) -> dict:
    """The first idle snapshot taken after `after` (the machine's monotonic clock)."""

    def idle() -> dict | None:
        state = server.admin_state()
        return state if state["at"] > after and not state["running"] + state["waiting"] else None

    return until(idle, "an idle engine", seconds, 0.25)


def test_a_client_disconnecting_mid_stream_frees_its_blocks_and_is_billed_once(server, usage_db):
    """A 100-token prompt plus 1,500 tokens (50 blocks) take about 8 s here; the
    client leaves after the first few."""
    _wait_idle(server)  # earlier tests' clients may have left work behind
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        headers=server.headers("leaver"),
        json={
            "model": MODEL,
            "prompt": "Stream forever, " * 12,
            "max_tokens": 1500,
            "stream": True,
            "ignore_eos": True,
        },
        timeout=60,
    ) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # the request is generating: it holds blocks
        for _ in range(5):
            next(lines)
        # Read the clock before leaving: the server may see the disconnect, abort and
        # publish its idle snapshot before this thread runs again, and an idle engine
        # publishes nothing more. The tokens below, not a deadline, show it stopped early.
        left = time.monotonic()
    state = _wait_idle(server, after=left)
    leaver = state["tenants"]["leaver"]
    assert leaver["running"] == 0
    assert state["free_blocks"] == state["pool_blocks"]  # every block is back in the pool
    # What it computed stays as an evictable cached prefix (its full prompt blocks),
    # and it is short: the engine stopped well before 50 blocks once the client had gone.
    assert 0 < leaver["cached"] < 20
    # vLLM reports no stats for a request its client abandoned; the record comes from
    # the engine's half alone, a couple of seconds later, with what was computed.
    records = _records_of(usage_db, "leaver", wait_for=1)
    [record] = records
    assert (record.outcome, record.model, record.tier) == ("aborted", MODEL, "free")
    assert 0 < record.output_tokens < 1500 and record.input_tokens > 0
    assert record.kv_block_seconds > 0
    # No second record: a request after it, through the same engine and stat logger,
    # is recorded, and vLLM hands its outputs and stats over in step order, so any late
    # half of the abandoned request has been joined by then.
    c = client(server, "leaver", "free")
    c.completions.create(model=MODEL, prompt="After", max_tokens=4)
    later = _records_of(usage_db, "leaver", wait_for=2)
    assert sorted(r.outcome for r in later) == ["aborted", "completed"]


def _records_of(usage_db: str, tenant: str, wait_for: int = 0, timeout: float = 15) -> list:
    from kvlease.exporters.ledger import UsageLedger

    ledger = UsageLedger(usage_db)

    def records() -> list:
        return list(ledger.read(0, 4e9, tenants=[tenant]))

    wait(lambda: len(records()) >= wait_for, timeout, interval=0.25)
    return records()


def test_sigterm_drains_in_flight_requests_then_exits_cleanly(server):
    """Runs last: it stops the module's server. The stream's client reads its first chunk,
    then nothing more until the late request is answered: the stream is in flight through
    the whole drain by construction, however fast the engine or slow the machine."""
    _wait_idle(server)
    streaming, hold, result = threading.Event(), threading.Event(), {"tokens": 0}

    def long_stream():
        c = client(server, "drainer", "standard")
        try:
            for chunk in c.completions.create(
                model=MODEL,
                prompt="Drain me",
                max_tokens=1800,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            ):
                if chunk.usage is not None:  # the last chunk: tokens, however many per chunk
                    result["tokens"] = chunk.usage.completion_tokens
                streaming.set()
                hold.wait()
        except openai.APIError as exc:
            result["error"] = exc
        streaming.set()

    worker = threading.Thread(target=long_stream)
    worker.start()
    assert streaming.wait(60)  # the first token arrived: the request is in the engine
    server.proc.send_signal(signal.SIGTERM)
    try:
        # The drain begins when the server's loop runs its signal handler, which logs this
        # line just after the middleware starts refusing: a request sent before that is
        # served (CI once got a 200 here), one sent after must get the 503.
        until(
            lambda: "shutdown triggered" in server.log.read_text(),
            "the server logs that its drain began",
            60,
        )
        # A new request during the drain: vLLM's renderer is stopping, so it once got a 500.
        late = httpx.post(
            f"{server.url}/v1/completions",
            headers=server.headers("late", "standard"),
            json={"model": MODEL, "prompt": "Too late", "max_tokens": 2},
            timeout=30,
        )
    finally:
        hold.set()
    assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
    assert int(late.headers["retry-after"]) > 0
    code = server.stop(signal.SIGTERM, timeout=60)
    worker.join(30)
    assert code == 128 + signal.SIGTERM  # stopped as asked (kvlease.engine.processes)
    assert "error" not in result and result["tokens"] == 1800  # drained, not cut off
    assert "request processing complete" in server.log.read_text()
