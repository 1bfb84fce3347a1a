"""Past one engine, for real: vLLM data parallel with two ranks behind two API processes
(replica A), a second single-engine replica (B) on the same PostgreSQL ledger, and one
Prometheus scraping both.

One fleet for the module (two replicas, three EngineCores; ~2 min to start on two
cores). Waits poll for an outcome (a scrape, a commit), never for a time.
"""

from __future__ import annotations

import concurrent.futures
import csv
import io
import signal
import time
from collections import Counter
from contextlib import redirect_stdout
from functools import partial

import httpx
import openai
import procs
import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families
from servers import kvlease_serve, prometheus
from waiting import until

from kvlease.dashboard.data import PrometheusSource
from kvlease.engine import processes
from kvlease.engine.affinity import session_rank
from kvlease.engine.tenancy import TierTable
from kvlease.exporters.metrics import BUDGET_USED, REQUESTS, TOKENS
from kvlease.grafana.build import usage_panels
from kvlease.server.cli import main

pytestmark = pytest.mark.engine
MODEL = "kvlease-demo"
BUDGETS = 'refresh_seconds = 1\n[tenants.spender]\nmonthly = "1000"\n'
SENT: Counter[tuple[int, str]] = Counter()  # requests sent per (replica port, tenant)


@pytest.fixture(scope="module")
def fleet(demo_model, kvlease_home, tmp_path_factory, postgres_url):
    folder = tmp_path_factory.mktemp("fleet")
    with psycopg.connect(postgres_url.replace("/kvlease", "/postgres"), autocommit=True) as c:
        c.execute("CREATE DATABASE fleet")
    db = postgres_url.replace("/kvlease", "/fleet")
    (folder / "budgets.toml").write_text(BUDGETS)
    common = ["--usage-db", db, "--budgets", str(folder / "budgets.toml")]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        started = [
            pool.submit(
                kvlease_serve,
                kvlease_home,
                folder / "a.log",
                "--data-parallel-size",
                "2",
                "--metrics-auth",  # its API processes' /metrics behind the metrics role
                *common,
            ),
            pool.submit(kvlease_serve, kvlease_home, folder / "b.log", *common),
        ]
    replicas = [f.result() for f in started if f.exception() is None]
    try:
        assert len(replicas) == 2, [str(f.exception()) for f in started if f.exception()]
        a, b = replicas
        targets = [f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"]
        scraper = a.token("prometheus", roles=["metrics"])
        with prometheus(targets, folder, bearer=scraper) as prom:
            yield a, b, prom, db
    finally:
        for replica in replicas:  # one that started is stopped, even if the other did not
            replica.stop(signal.SIGKILL)


def _client(server, tenant, tier="premium", session=None) -> openai.OpenAI:
    headers = {"X-Session-Id": session} if session else None
    return openai.OpenAI(
        base_url=f"{server.url}/v1",
        api_key=server.token(tenant, tier),
        default_headers=headers,
        max_retries=0,
    )


def _complete(server, tenant, prompt, tier="premium", session=None, max_tokens=8):
    SENT[(server.port, tenant)] += 1
    return _client(server, tenant, tier, session).completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0
    )


def _families(server) -> dict:
    headers = server.headers("prometheus", roles=["metrics"])  # A asks for it; B is public
    text = httpx.get(f"{server.url}/metrics", headers=headers, timeout=10).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def _own(server, family, **labels) -> dict[tuple, float]:
    """A replica's own figure, from its /metrics, by the labels asked for."""
    out: Counter[tuple] = Counter()
    for s in _families(server)[family].samples:
        if s.name.endswith(("_created",)):
            continue
        if all(s.labels.get(k) == v for k, v in labels.items() if v is not None):
            out[tuple(s.labels.get(k) for k in labels)] += s.value
    return dict(out)


# Prometheus, the dashboard and the shared ledger settle in scrapes: poll them at 2 Hz.
until_scraped = partial(until, interval=0.5)


def _query(prom: str, expr: str, at: float | None = None) -> list[dict]:
    params = {"query": expr} | ({"time": at} if at else {})
    return httpx.get(f"{prom}/api/v1/query", params=params, timeout=10).json()["data"]["result"]


def _raw_export(db: str) -> list[dict]:
    out = io.StringIO()
    with redirect_stdout(out):
        code = main(
            ["usage", "export", "--usage-db", db, "--format", "raw",
             "--from", "2020-01-01", "--to", "2100-01-01"]
        )  # fmt: skip
    assert code == 0
    return list(csv.DictReader(io.StringIO(out.getvalue())))


def test_replica_a_runs_two_ranks_behind_two_api_processes(fleet):
    a, _, _, _ = fleet
    log = a.log.read_text()
    assert "Started 2 API server processes" in log
    assert sorted(a.admin_state()["engines"]) == ["0", "1"]  # a kvlease scheduler on each


def test_sessions_stay_on_their_rank_and_find_their_lease_on_turn_two(fleet):
    a, _, _, db = fleet
    sessions = [f"chat-{i}" for i in range(6)]
    # Each conversation opens with its own words, so a hit can only be its own prefix.
    prompts = {s: f"{s} " + " ".join(f"{s}-word{j}" for j in range(90)) for s in sessions}
    for s in sessions:
        first = _complete(a, "chat-co", prompts[s], session=s)
        prompts[s] += first.choices[0].text + " and then?"
    cached = {}
    for s in sessions:
        second = _complete(a, "chat-co", prompts[s], session=s)
        cached[s] = second.usage.prompt_tokens_details.cached_tokens
    assert all(n >= 64 for n in cached.values()), cached  # every turn 2 hit its lease

    engines = a.admin_state()["engines"]
    assert sorted(engines) == ["0", "1"]
    placed = {
        lease["session_id"]: int(rank)
        for rank, state in engines.items()
        for lease in state["leases"]
        if lease["tenant_id"] == "chat-co"
    }
    assert placed == {s: session_rank("chat-co", s, 2) for s in sessions}
    assert set(placed.values()) == {0, 1}  # both ranks hold sessions

    def turn_twos():
        rows = [r for r in _raw_export(db) if r["tenant_id"] == "chat-co"]
        requests = [r for r in rows if r["outcome"] != "retention"]
        return rows if len(requests) == 12 and len(rows) == 18 else None

    rows = until_scraped(turn_twos, "12 chat-co records and 6 retention ones in the ledger")
    requests = [r for r in rows if r["outcome"] != "retention"]
    covered = sorted(int(r["lease_covered_tokens"]) for r in requests)
    assert covered[:6] == [0] * 6 and all(n > 0 for n in covered[6:])  # the leased turns
    # Each session's time between its turns, written by the API process that owned its
    # first turn's request, whichever rank held the blocks.
    first = {r["request_id"]: r["session_id"] for r in requests if r["lease_covered_tokens"] == "0"}
    kept = {r["request_id"].removesuffix(":retention"): r for r in rows if r not in requests}
    assert {k: r["session_id"] for k, r in kept.items()} == first
    # Reserved or only retained: once three of the tenant's sessions had ended a turn
    # without coming back yet, its return rate reserved nothing (kvlease.engine.reservations).
    held = [float(r["kv_reserved_block_seconds"]) + float(r["kv_retained_block_seconds"])
            for r in kept.values()]  # fmt: skip
    assert all(h > 0 for h in held)


def test_per_rank_blocks_add_up_to_the_whole(fleet):
    a, _, prom, _ = fleet
    _complete(a, "sum-co", "count the blocks " * 30, tier="standard", session="s1")
    state = a.admin_state()
    ranks = state["engines"].values()
    for key in ("pool_blocks", "free_blocks", "running", "waiting"):
        assert state[key] == sum(r[key] for r in ranks)
    for tenant, held in state["tenants"].items():
        for kind, n in held.items():
            assert n == sum(r["tenants"].get(tenant, {}).get(kind, 0) for r in ranks)
    own = _own(a, "vllm_tenant_kv_pool_blocks", engine=None)
    assert sorted(own) == [("0",), ("1",)] and sum(own.values()) == state["pool_blocks"]
    instance = f'instance="127.0.0.1:{a.port}"'
    by_engine = until_scraped(
        lambda: _query(prom, f"sum by (engine) (vllm_tenant_kv_pool_blocks{{{instance}}})"),
        "the ranks' pool gauges in Prometheus",
    )
    assert sum(float(r["value"][1]) for r in by_engine) == state["pool_blocks"]
    assert len(by_engine) == 2


def test_one_scrape_counts_every_api_process_once(fleet):
    a, _, _, _ = fleet
    for i in range(12):  # a connection each: the kernel spreads them over the processes
        _complete(a, "count-co", f"count me {i}", tier="free")
    assert httpx.get(f"{a.url}/metrics", timeout=10).status_code == 401  # --metrics-auth
    for path in ("/metrics", "/metrics/"):  # the multi-process answer too, whatever the method
        assert httpx.options(f"{a.url}{path}", timeout=10).status_code == 401
    for _ in range(6):  # whichever process answers, the same totals
        own = _own(a, REQUESTS.family, tenant_id="count-co", outcome="completed")
        assert own == {("count-co", "completed"): 12}
        vllm = _own(a, "vllm:request_success", finished_reason=None)
        assert sum(vllm.values()) == sum(n for (port, _), n in SENT.items() if port == a.port)


def test_the_fleet_adds_up_in_prometheus_the_dashboard_grafana_and_the_export(fleet):
    a, b, prom, db = fleet
    for i in range(4):
        _complete(a, "a-only", f"replica a {i}", tier="standard")
        _complete(b, "b-only", f"replica b {i}", tier="free")
        _complete(a, "both", f"either replica {i}")
        _complete(b, "both", f"either replica {i} again")
    _complete(a, "spender", "spend a little", tier="standard")

    def tokens(server):
        return _own(server, TOKENS.family, tenant_id=None, kind=None)

    # Prometheus: the fleet's sum by tenant and kind is the replicas' own figures added
    # (both read again each time: a response can end before vLLM reports its stats).
    def prometheus_tokens():
        own_a, own_b = tokens(a), tokens(b)
        fleet_own = _plus(own_a, own_b)
        got = {
            (r["metric"]["tenant_id"], r["metric"]["kind"]): float(r["value"][1])
            for r in _query(prom, f"sum by (tenant_id, kind) ({TOKENS.name})")
        }
        return (own_a, own_b, fleet_own) if got == fleet_own else None

    own_a, own_b, fleet_own = until_scraped(
        prometheus_tokens, "Prometheus's token sums equal to the replicas' own"
    )
    assert own_b.get(("a-only", "input"), 0) == 0 and own_a[("a-only", "input")] > 0

    # The Prometheus-source dashboard: blocks per tenant (engines idle: they stay put).
    def held(states):
        out: Counter[str] = Counter()
        for state in states:
            for tenant, h in state["tenants"].items():
                out[tenant] += h["running"] + h["cached_leased"] + h["cached"]
        return out

    own_held = held([a.admin_state(), b.admin_state()])

    def dashboard_held():
        live = PrometheusSource(prom).live(5)
        rows = live.tenants.set_index("tenant_id")
        got = Counter({t: int(r.running + r.cached_leased + r.cached) for t, r in rows.iterrows()})
        engines = set(live.engines["engine"])
        return got if got == own_held and len(engines) == 3 else None

    until_scraped(dashboard_held, "the dashboard's blocks per tenant equal to the replicas' own")

    # Grafana's panel queries over the fleet are the sums of each replica's.
    at = time.time()
    for panel in usage_panels(TierTable.load()):
        for query in panel.queries:
            if not query.expr.startswith("sum") or " / sum" in query.expr:
                continue  # a maximum, a quantile or a mean is not a sum of the replicas'
            exprs = {
                i: query.expr.replace("$__rate_interval", "5m")
                .replace("$__range", "1h")
                .replace("$job", ".*")
                .replace("$tier", ".*")
                .replace("$tenant", ".*")
                .replace("$instance", i)
                for i in (".*", f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}")
            }
            results = {i: _vector(_query(prom, e, at)) for i, e in exprs.items()}
            parts = _plus(results[f"127.0.0.1:{a.port}"], results[f"127.0.0.1:{b.port}"])
            whole = results[".*"]
            assert whole.keys() == parts.keys(), panel.title
            for key, value in whole.items():
                assert value == pytest.approx(parts[key], rel=1e-9), (panel.title, key)

    # The usage export on the shared ledger: one record per request, ids unique, and
    # the tokens each replica counted.
    def ledger():
        rows = [r for r in _raw_export(db) if r["outcome"] != "retention"]
        return rows if len(rows) == sum(SENT.values()) else None

    rows = until_scraped(ledger, "a record per request in the shared ledger")
    assert len({r["request_id"] for r in rows}) == len(rows)
    billed: Counter[tuple] = Counter()
    for r in rows:
        billed[(r["tenant_id"], "input")] += int(r["input_tokens"])
        billed[(r["tenant_id"], "output")] += int(r["output_tokens"])
    assert {k: v for k, v in fleet_own.items() if k[1] in ("input", "output")} == billed

    # Budgets read fleet-wide spend: B never served `spender`, yet sees A's spend.
    def b_sees_spend():
        used = _own(b, BUDGET_USED.name, tenant_id="spender")
        return used if used.get(("spender",), 0) > 0 else None

    until_scraped(b_sees_spend, "replica B's budget gauge for a tenant only A served")


def _plus(*figures: dict) -> dict:
    """Figures added key by key (zeros kept, unlike Counter's +)."""
    out: dict = {}
    for f in figures:
        for key, value in f.items():
            out[key] = out.get(key, 0) + value
    return out


def _vector(result: list[dict]) -> dict[tuple, float]:
    return {tuple(sorted(r["metric"].items())): float(r["value"][1]) for r in result}


def test_killed_mid_drain_the_data_parallel_server_still_ends_every_process(fleet):
    """Last in this module: it stops replica A. SIGTERM, then SIGKILL once the drain has
    begun (a supervisor out of patience): the API processes, both engine cores and the
    data-parallel coordinator end all the same (kvlease.engine.processes), and a sweep,
    as the next start runs, removes the run folder it left."""
    a = fleet[0]
    folder, tree = a.folder(), a.tree()
    names = " | ".join(procs.cmdline(p) for p in tree)
    assert "DPCoordinator" in names and names.count("EngineCore") == 2, names
    a.proc.send_signal(signal.SIGTERM)
    until(lambda: "[shutdown]" in a.log.read_text(), "the drain to begin", 120, 0.1)
    a.proc.kill()
    a.proc.wait()
    until(lambda: not procs.running(tree), "every process of the killed server to end", 180)
    assert folder is not None and folder in processes.sweep()
