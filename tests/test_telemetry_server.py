"""kvlease's telemetry on a real server under multi-tenant pressure: metrics linted by
promtool and stored by a real Prometheus (Debian's `prometheus`, installed by
`make test`); spans exported over OTLP/HTTP to a small receiver that decodes the
protobuf."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from prometheus_client.parser import text_string_to_metric_families
from servers import prometheus, start, wait_for_series
from waiting import until

from kvlease.exporters.metrics import FAMILIES

pytestmark = pytest.mark.engine
TIERS = ("premium", "standard", "free")
# Pressure set in tokens, not in timing: one request grows to (96 + 600) / 32 = 22 blocks,
# so any 3 of the 12 concurrent ones outgrow the 63 usable blocks, however fast each runs.
REPLY_TOKENS = 600


class OtlpReceiver:
    """An OTLP/HTTP traces endpoint on loopback that keeps every span it decodes."""

    def __init__(self) -> None:
        self.spans: list = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                for resource_spans in request.resource_spans:
                    for scope_spans in resource_spans.scope_spans:
                        receiver.spans.extend(scope_spans.spans)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def otlp():
    receiver = OtlpReceiver()
    yield receiver
    receiver.server.shutdown()


@pytest.fixture(scope="module")
def loaded(kvlease_home, tmp_path_factory, otlp, usage_db):
    """A 64-block server, tracing on, after rounds of 12 concurrent long requests (two, or
    more until one was preempted)."""
    assert 3 * -(-(96 + REPLY_TOKENS) // 32) > 63
    folder = tmp_path_factory.mktemp("telemetry")
    budgets = folder / "budgets.toml"  # a budget far above any spend: its gauge is scraped
    budgets.write_text('[tenants.premium-0]\nmonthly = "1000000"\n')
    srv = start(
        [
            sys.executable,
            "-m",
            "kvlease",
            "serve",
            "--num-blocks",
            "64",
            "--otel",
            "--usage-db",
            usage_db,
            "--budgets",
            str(budgets),
        ],
        kvlease_home,
        folder / "server.log",
        {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": otlp.url,
            "OTEL_BSP_SCHEDULE_DELAY": "200",
            "KVLEASE_LEDGER_WAIT_SECONDS": "120",  # a record that never comes shows as a hang
            "VLLM_ENABLE_RESPONSES_API_STORE": "1",  # stored responses, to continue them
        },
    )

    def one(i: int) -> int:
        tier = TIERS[i % 3]
        r = httpx.post(
            f"{srv.url}/v1/completions",
            timeout=300,
            headers=srv.headers(f"{tier}-{i}", tier, session=f"s{i}"),
            json={
                "model": "kvlease-demo",
                "prompt": f"Tenant {i} asks about caches. " * 6,
                "max_tokens": REPLY_TOKENS,
                "ignore_eos": True,
            },
        )
        return r.status_code

    try:
        # Two rounds at least, more until the pool has run short: the API process may take
        # the requests one at a time while the engine holds both cores, so whether 12
        # "concurrent" requests overlap in the engine is not up to the test.
        srv.rounds = 0
        while srv.rounds < 2 or (not srv.admin_state()["totals"]["preemptions"] and srv.rounds < 8):
            with ThreadPoolExecutor(12) as pool:
                assert list(pool.map(one, range(12))) == [200] * 12
            srv.rounds += 1
        until(lambda: not srv.admin_state()["running"], "the engine drained", 30, 0.25)
        yield srv
    finally:
        srv.stop(signal.SIGKILL)


def _families(server) -> dict:
    text = httpx.get(f"{server.url}/metrics/", follow_redirects=True).text
    return {f.name: f for f in text_string_to_metric_families(text)}, text


def _sum(families, name, sample=None, **labels) -> float:
    family = families[name]
    return sum(
        s.value
        for s in family.samples
        if (sample is None or s.name == sample)
        and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_kvlease_families_pass_promtool_lint(loaded):
    _, text = _families(loaded)
    ours = "\n".join(line for line in text.splitlines() if "vllm:" not in line) + "\n"
    assert "vllm_tenant_preemptions_total" in ours
    done = subprocess.run(
        ["promtool", "check", "metrics"], input=ours, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_per_tenant_counters_equal_vllms_own_totals(loaded):
    families, _ = _families(loaded)
    preemptions = _sum(families, "vllm_tenant_preemptions")
    assert preemptions > 0  # the pool is small enough to force them
    assert preemptions == _sum(families, "vllm:num_preemptions")
    assert _sum(families, "vllm_tenant_tokens", kind="input") == _sum(
        families, "vllm:request_prompt_tokens", sample="vllm:request_prompt_tokens_sum"
    )
    assert _sum(families, "vllm_tenant_tokens", kind="output") == _sum(
        families, "vllm:request_generation_tokens", sample="vllm:request_generation_tokens_sum"
    )
    assert _sum(families, "vllm_tenant_requests", outcome="completed") == 12 * loaded.rounds


def test_preemptions_carry_the_real_tenant_and_tier(loaded):
    families, _ = _families(loaded)
    samples = [s for s in families["vllm_tenant_preemptions"].samples if s.name.endswith("_total")]
    assert samples
    for s in samples:
        tenant, tier = s.labels["tenant_id"], s.labels["tier"]
        assert tier in TIERS and tenant.startswith(f"{tier}-")
        # whose allocation took the blocks: a tenant's tier, never a less important one
        assert TIERS.index(s.labels["by_tier"]) <= TIERS.index(tier), s.labels
    # Lower tiers lose more (which lower tier depends on who was running when the pool
    # ran short: HTTP arrivals are not ordered; premium alone can outgrow the pool).
    lower = sum(_sum(families, "vllm_tenant_preemptions", tier=t) for t in TIERS[1:])
    assert lower > _sum(families, "vllm_tenant_preemptions", tier="premium")


def test_a_real_prometheus_scrapes_and_stores_every_kvlease_metric(loaded, tmp_path):
    with prometheus([f"127.0.0.1:{loaded.port}"], tmp_path) as prom:
        wait_for_series(prom, "vllm_tenant_kv_pool_blocks")
        missing = []
        for family in FAMILIES:
            counted = ("histogram", "summary")  # their series are _count, _sum, ...
            name = f"{family.name}_count" if family.kind in counted else family.name
            r = httpx.get(f"{prom}/api/v1/query", params={"query": name}, timeout=5)
            if not r.json()["data"]["result"]:
                missing.append(name)
        assert missing == []


def _attributes(span) -> dict:
    out = {}
    for kv in span.attributes:
        value = kv.value
        out[kv.key] = getattr(value, value.WhichOneof("value"))
    return out


def test_spans_follow_genai_conventions_and_honour_an_incoming_traceparent(loaded, otlp):
    trace_id, parent_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    r = httpx.post(
        f"{loaded.url}/v1/chat/completions",
        timeout=120,
        headers={
            **loaded.headers("tracer", "premium", session="t1"),
            "traceparent": f"00-{trace_id}-{parent_id}-01",
        },
        json={
            "model": "kvlease-demo",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "trace me"}],
        },
    )
    assert r.status_code == 200
    [span] = until(
        lambda: [s for s in otlp.spans if s.trace_id.hex() == trace_id], "the span", 30, 0.2
    )
    assert span.parent_span_id.hex() == parent_id
    assert span.name == "chat kvlease-demo"
    a = _attributes(span)
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "kvlease-demo"
    assert a["gen_ai.usage.output_tokens"] == 4 and a["gen_ai.usage.input_tokens"] > 0
    assert (a["kvlease.tenant_id"], a["kvlease.tier"]) == ("tracer", "premium")
    assert a["kvlease.lease_active"] is True and "kvlease.kv_block_seconds" in a
    assert "kvlease.lease.start" in [e.name for e in span.events]
    assert all("Bearer" not in str(v) for v in a.values())


def test_spans_of_the_pressure_workload_carry_preemption_events(loaded, otlp):
    preempted = [s for s in otlp.spans if any(e.name == "kvlease.preemption" for e in s.events)]
    assert preempted
    event = next(e for e in preempted[0].events if e.name == "kvlease.preemption")
    attrs = {kv.key: kv.value for kv in event.attributes}
    assert attrs["kvlease.preemption.mode"].string_value == "recompute"
    assert attrs["kvlease.preemption.blocks"].int_value > 0
    assert _attributes(preempted[0])["kvlease.preemptions"] >= 1


def _ledger_records(usage_db, outcome=lambda o: o != "retention"):
    """The requests' records (retention records: `outcome=lambda o: o == "retention"`)."""
    from kvlease.exporters.ledger import UsageLedger

    return [r for r in UsageLedger(usage_db).read(0, 4e9) if outcome(r.outcome)]


def test_a_leased_sessions_time_between_turns_is_billed_as_kv_retention(loaded, usage_db):
    """Each premium and standard session sent a turn every round: the time between two
    turns (or a turn and its lease's end) is a retention record, keyed by the request
    that ended the first, with block-seconds; free sessions hold no lease, so none. The
    counter holds at least as much (it also counts the episodes still open)."""
    requests = {r.request_id: r for r in _ledger_records(usage_db)}
    kept = _ledger_records(usage_db, lambda o: o == "retention")
    by_tenant: dict[str, list] = {}
    for r in kept:
        by_tenant.setdefault(r.tenant_id, []).append(r)
        turn = requests[r.request_id.removesuffix(":retention")]
        assert (turn.tenant_id, turn.session_id, turn.tier) == (r.tenant_id, r.session_id, r.tier)
        assert r.started_at >= turn.ended_at - 1 and r.ended_at >= r.started_at
        assert r.kv_reserved_block_seconds + r.kv_retained_block_seconds > 0
        assert (r.input_tokens, r.output_tokens, r.kv_block_seconds) == (0, 0, 0.0)
    leasing = {f"{TIERS[i % 3]}-{i}" for i in range(12) if TIERS[i % 3] != "free"}
    assert set(by_tenant) <= leasing and not any(t.startswith("free") for t in by_tenant)
    assert by_tenant  # (an episode whose blocks pressure evicted at once holds nothing)
    billed = sum(r.kv_reserved_block_seconds + r.kv_retained_block_seconds for r in kept)

    def counted() -> bool:  # the next engine snapshot carries the totals
        families, _ = _families(loaded)
        return _sum(families, "vllm_tenant_kv_retention_block_seconds") >= billed * 0.999

    until(counted, "the retention counter reaching the ledger's retention block-seconds")


def test_every_answered_request_has_exactly_one_usage_record(loaded, usage_db):
    records = [r for r in _ledger_records(usage_db) if r.tenant_id.startswith(TIERS)]
    sent = 12 * loaded.rounds
    assert len(records) == sent and len({r.request_id for r in records}) == sent
    for r in records:
        assert r.tier == r.tenant_id.split("-")[0] and r.model == "kvlease-demo"
        assert r.output_tokens == REPLY_TOKENS and r.outcome == "completed"
        assert r.input_tokens > 0 and r.kv_block_seconds > 0
        if r.recomputed_by is not None:  # who preempted it, and for how many tokens
            causes = json.loads(r.recomputed_by)
            assert set(causes) <= set(TIERS) and sum(causes.values()) == r.recomputed_tokens
    assert sum(r.preemptions for r in records) > 0
    assert any(r.recomputed_by for r in records)


def test_the_record_is_committed_before_the_response_completes(loaded, usage_db):
    from kvlease.exporters.ledger import UsageLedger

    ledger = UsageLedger(usage_db)
    for i in range(3):
        r = httpx.post(
            f"{loaded.url}/v1/completions",
            timeout=60,
            headers=loaded.headers("durable", "standard"),
            json={"model": "kvlease-demo", "prompt": f"durable {i}", "max_tokens": 3},
        )
        assert r.status_code == 200
        key = r.headers["x-request-id"]
        # No waiting: the middleware held the last byte until this commit.
        assert [x.request_id for x in ledger.read(0, 4e9, ["durable"])].count(key) == 1


def test_billing_totals_equal_the_prometheus_counters(loaded, usage_db):
    import csv
    import io

    families, _ = _families(loaded)
    r = httpx.get(
        f"{loaded.url}/admin/usage.csv",
        headers=loaded.headers("fin", roles=["finance"]),
        params={"from": "2000-01-01", "to": "2100-01-01", "granularity": "day"},
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(r.text)))
    by_tenant: dict[str, dict[str, int]] = {}
    for row in rows:
        t = by_tenant.setdefault(row["SubAccountId"], {"input": 0, "output": 0, "recomputed": 0})
        t["input"] += int(row["x_InputTokens"])
        t["output"] += int(row["x_OutputTokens"])
        t["recomputed"] += int(row["x_RecomputedTokens"])
    for tenant, totals in by_tenant.items():
        for kind, value in totals.items():
            assert value == _sum(
                families,
                "vllm_tenant_tokens",
                tenant_id=tenant,
                kind=kind,
                sample="vllm_tenant_tokens_total",
            ), (tenant, kind)


def test_usage_routes_respect_roles_and_tenants(loaded, usage_db, tmp_path):
    r = httpx.get(f"{loaded.url}/admin/usage.csv", headers=loaded.headers("premium-0", "premium"))
    assert r.status_code == 403 and r.json()["error"]["code"] == "role_not_allowed"
    mine = httpx.get(
        f"{loaded.url}/admin/usage",
        headers=loaded.headers("premium-0", "premium"),
        params={"from": "2000-01-01", "to": "2100-01-01"},
    ).json()
    assert mine["rows"] and {row["SubAccountId"] for row in mine["rows"]} == {"premium-0"}
    # The finance download is exactly the CLI's export of the same window.
    params = {"from": "2000-01-01", "to": "2100-01-01", "granularity": "month"}
    download = httpx.get(
        f"{loaded.url}/admin/usage.csv",
        params=params,
        headers=loaded.headers("fin", roles=["finance"]),
    ).text
    out = tmp_path / "export.csv"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvlease",
            "usage",
            "export",
            "--usage-db",
            usage_db,
            "--from",
            "2000-01-01",
            "--to",
            "2100-01-01",
            "--granularity",
            "month",
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert out.read_text() == download


def _output_counter(server, tenant: str) -> float:
    families, _ = _families(server)
    return _sum(
        families,
        "vllm_tenant_tokens",
        tenant_id=tenant,
        kind="output",
        sample="vllm_tenant_tokens_total",
    )


def _record(usage_db: str, tenant: str):
    [record] = [r for r in _ledger_records(usage_db) if r.tenant_id == tenant]
    return record


def _openai(server, tenant: str):
    import openai

    return openai.OpenAI(
        base_url=f"{server.url}/v1", api_key=server.token(tenant, "standard"), timeout=60
    )


def _post(server, path: str, tenant: str, **body) -> httpx.Response:
    """A raw request of a standard-tier tenant to the demo model (what the openai client
    would not send as is)."""
    return httpx.post(
        f"{server.url}{path}",
        timeout=60,
        headers=server.headers(tenant, "standard"),
        json={"model": "kvlease-demo", **body},
    )


def test_n_choices_are_billed_as_the_client_was_told(loaded, usage_db):
    reply = _openai(loaded, "fan-n").chat.completions.create(
        model="kvlease-demo",
        messages=[{"role": "user", "content": "three answers, please"}],
        n=3,
        max_tokens=12,
        extra_body={"ignore_eos": True},
    )
    assert len(reply.choices) == 3 and reply.usage.completion_tokens == 36
    record = _record(usage_db, "fan-n")
    assert record.output_tokens == 36 == _output_counter(loaded, "fan-n")
    assert record.request_id in reply.id and not record.partial


def test_a_list_of_prompts_is_billed_whole(loaded, usage_db):
    reply = _openai(loaded, "fan-list").completions.create(
        model="kvlease-demo",
        prompt=["first prompt", "second prompt", "third prompt"],
        n=2,
        max_tokens=5,
        extra_body={"ignore_eos": True},
    )
    assert len(reply.choices) == 6 and reply.usage.completion_tokens == 30
    assert _record(usage_db, "fan-list").output_tokens == 30 == _output_counter(loaded, "fan-list")


def test_a_batch_of_conversations_is_billed_whole(loaded, usage_db):
    r = _post(
        loaded,
        "/v1/chat/completions/batch",
        "fan-batch",
        messages=[[{"role": "user", "content": f"conversation {i}"}] for i in range(4)],
        max_tokens=7,
        ignore_eos=True,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 28
    assert (
        _record(usage_db, "fan-batch").output_tokens == 28 == _output_counter(loaded, "fan-batch")
    )


def test_a_response_is_billed_once_and_not_held_past_its_commit(loaded, usage_db):
    """The server holds a last byte up to 120 s for its record (KVLEASE_LEDGER_WAIT_SECONDS):
    a response whose record never came would outlast the client's 60 s timeout."""
    response = _openai(loaded, "resp-t").responses.create(
        model="kvlease-demo", input="Say something.", max_output_tokens=16
    )
    record = _record(usage_db, "resp-t")
    assert record.output_tokens == response.usage.output_tokens == _output_counter(loaded, "resp-t")
    assert record.output_tokens > 0 and not record.partial
    import openai

    with pytest.raises(openai.NotFoundError):  # another tenant never sees it
        _openai(loaded, "resp-other").responses.retrieve(response.id)


@pytest.mark.parametrize(("tenant", "n"), [("fan-float", 3.0), ("fan-string", "3")])
def test_an_n_that_vllm_coerces_is_billed_whole(loaded, usage_db, tenant, n):
    """vLLM's request models read `3.0` and `"3"` as 3: three engine requests, all billed."""
    r = _post(
        loaded,
        "/v1/chat/completions",
        tenant,
        messages=[{"role": "user", "content": "three answers"}],
        n=n,
        max_tokens=12,
        ignore_eos=True,
    )
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 3 and r.json()["usage"]["completion_tokens"] == 36
    assert _record(usage_db, tenant).output_tokens == 36 == _output_counter(loaded, tenant)


def test_a_list_of_prompts_through_invocations_is_billed_whole(loaded, usage_db):
    r = _post(
        loaded,
        "/invocations",
        "fan-invoke",
        prompt=["first prompt", "second prompt", "third prompt"],
        max_tokens=12,
        ignore_eos=True,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 36
    record = _record(usage_db, "fan-invoke")
    assert record.output_tokens == 36 == _output_counter(loaded, "fan-invoke")
    assert record.input_tokens == r.json()["usage"]["prompt_tokens"]


def test_beam_search_is_refused_and_never_reaches_the_engine(loaded, usage_db):
    import openai

    with pytest.raises(openai.BadRequestError) as refused:
        _openai(loaded, "beam").completions.create(
            model="kvlease-demo",
            prompt="a beam",
            n=2,
            max_tokens=12,
            extra_body={"use_beam_search": True},
        )
    assert refused.value.body["code"] == "unsupported_parameter"
    assert _output_counter(loaded, "beam") == 0
    assert [r for r in _ledger_records(usage_db) if r.tenant_id == "beam"] == []


def test_every_generation_route_of_vllms_router_is_billed_or_refused(loaded):
    """Every POST route vLLM serves to tenants is one kvlease bills (its usage record held
    to its response), knows makes no engine request, or refuses. A vLLM that adds a route
    fails here until it is classified."""
    from kvlease.server.middleware import (
        GENERATION_PATHS,
        REFUSED_PATHS,
        makes_engine_requests,
        route_class,
    )

    spec = httpx.get(f"{loaded.url}/openapi.json", timeout=30).json()
    tenant_posts = [
        path.replace("{response_id}", "resp_x")
        for path, methods in spec["paths"].items()
        if "post" in methods and route_class(path.replace("{response_id}", "resp_x")) == "tenant"
    ]
    assert "/v1/chat/completions" in tenant_posts and "/invocations" in tenant_posts
    unclassified = [
        path
        for path in tenant_posts
        if path not in GENERATION_PATHS | REFUSED_PATHS and makes_engine_requests(path)
    ]
    assert unclassified == []
    for path in REFUSED_PATHS & set(tenant_posts):
        r = httpx.post(f"{loaded.url}{path}", json={}, headers=loaded.headers("t"), timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_supported"


def test_a_request_vllm_refuses_is_counted_refused_and_has_no_record(loaded, usage_db):
    r = _post(loaded, "/v1/completions", "refused-t", prompt="x", max_tokens=-1)
    assert r.status_code == 400
    families, _ = _families(loaded)
    refused = _sum(
        families,
        "vllm_tenant_requests",
        tenant_id="refused-t",
        outcome="refused",
        sample="vllm_tenant_requests_total",
    )
    assert refused == 1
    assert [x for x in _ledger_records(usage_db) if x.tenant_id == "refused-t"] == []


def test_only_the_owner_continues_a_stored_response(loaded):
    """Another tenant's `previous_response_id` once put that tenant's conversation in the
    prompt (200); it and an id that never existed now get the same 404."""
    import openai

    mine = _openai(loaded, "resp-owner").responses.create(
        model="kvlease-demo", input="Remember the word cobalt.", max_output_tokens=8
    )
    follow = _openai(loaded, "resp-owner").responses.create(
        model="kvlease-demo", input="Go on.", max_output_tokens=4, previous_response_id=mine.id
    )
    assert follow.id != mine.id
    answers = []
    for previous in (mine.id, "resp_kvl-" + "0" * 32):
        with pytest.raises(openai.NotFoundError) as refused:
            _openai(loaded, "resp-thief").responses.create(
                model="kvlease-demo", input="Go on.", previous_response_id=previous
            )
        answers.append(refused.value.body["message"].replace(previous, "ID"))
    assert answers[0] == answers[1]
