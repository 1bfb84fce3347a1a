"""`kvlease demo`: the whole system, live, on a CPU-only machine.

Builds the demo model if missing, makes a JWT key for this run only (it never
touches the disk), starts `kvlease serve` on a pool smaller than what the
tenants' streams hold at once (counted in tokens, so pressure comes on any
machine, fast or slow), Prometheus (when Debian's is installed) with the
bundled alert rules, and the dashboard; then plays a seeded multi-tenant chat
workload (demo/workload.py) through the stock `openai` client, one closed-loop
stream per tenant (demo/client.py), showing a live line, until `--duration`,
`--requests` or Ctrl-C. Everything it started is stopped (the server drains, so the
ledger has every record), a summary is printed, and the status is 0, or 128 + N when
signal N (SIGINT, SIGTERM) stopped it. Each child runs in its own session and is told to
stop by the kernel if the demo is killed (kvlease.engine.processes).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvlease.demo.client import LoadStats, play
from kvlease.demo.prometheus import write_config
from kvlease.demo.workload import TIERS, WorkloadSpec, stream_sessions, tenant_names
from kvlease.engine import processes
from kvlease.engine.auth import HS256_KEY_ENV, KeyRing, mint_token
from kvlease.engine.paths import kvlease_home
from kvlease.engine.tenancy import TierTable
from kvlease.exporters.metrics import PREEMPTIONS, TOKENS

MODEL = "kvlease-demo"
BLOCK_TOKENS = 32  # kvlease serve's block size for the demo model
POOL_BLOCKS = 64  # 63 usable; must stay under demand_blocks(): see there
MAX_MODEL_LEN = 2048  # at most; the tier table's lease caps may allow less (max_model_len())
CONTEXT_MARGIN = 200  # tokens the chat template adds over what the trace counts
STOP_SECONDS = 60


def demand_blocks(spec: WorkloadSpec) -> int:
    """KV blocks the tenants' streams hold at once when every tenant is at a median first
    turn. Every tenant always has a request in flight (closed loop, `ignore_eos`), and
    later turns only add context, so a pool under this is short within every tenant's
    first reply: the free tier is preempted on any machine, whatever its speed."""
    per_request = -(-(spec.input_median + spec.output_median) // BLOCK_TOKENS)
    return sum(spec.tenants) * per_request


def max_model_len(tiers: TierTable, num_blocks: int = POOL_BLOCKS) -> int:
    """The demo server's context length: the longest request its lease caps leave room
    for (vLLM keeps one block back), at most MAX_MODEL_LEN."""
    return min(MAX_MODEL_LEN, tiers.max_request_tokens(num_blocks - 1, BLOCK_TOKENS))


def demo_spec(tenants: int, seed: int) -> WorkloadSpec:
    return WorkloadSpec.for_tenants(
        tenants,
        duration=float("inf"),  # closed loop: session start times are not used
        mean_turns=4,
        output_median=200,
        max_tokens=256,
        seed=seed,
    )


@dataclass
class Demo:
    """The processes the demo started and where their files are."""

    run: Path
    port: int
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ledger(self) -> Path:
        return self.run / "usage.db"

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        """Its own process group, so Ctrl-C reaches only the demo, which stops it in order;
        told to stop (SIGTERM) by the kernel if the demo dies first."""
        log = (self.run / f"{name}.log").open("w")
        proc = processes.start_child(argv, env, stdout=log, stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def stop(self, name: str, timeout: float) -> None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def stop_all(self) -> None:
        """Dashboard and Prometheus first, then the server: SIGTERM drains in-flight
        requests and commits their ledger records before it exits."""
        for name in ("dashboard", "prometheus"):
            self.stop(name, 10)
        self.stop("server", STOP_SECONDS)
        for proc in self.procs.values():  # anything left: no orphans
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        self.procs.clear()


def run_demo(
    duration: float | None = None,
    requests: int | None = None,
    tenants: int = 12,
    port: int = 8000,
    dashboard: bool = True,
    dashboard_port: int = 8501,
    prometheus_port: int = 9090,
    model: str | None = None,
    tiers_path: str | None = None,
    seed: int = 0,
) -> int:
    tiers = TierTable.load(tiers_path)
    spec = demo_spec(tenants, seed)
    run = kvlease_home() / "demo"
    run.mkdir(parents=True, exist_ok=True)
    demo = Demo(run, port)
    started = time.time()  # the ledger outlives runs: the summary counts this one's records
    secret = secrets.token_urlsafe(48)  # this run only: in memory and the children's env
    keyring = KeyRing.from_secret(secret)
    env = server_environment(secret)
    with processes.interrupt_on_signals() as stopped_by:
        stats: LoadStats | None = None  # what the clients saw: kept when Ctrl-C stops them
        try:
            model = resolve_model(model)
            if not start_server(demo, model, tiers, tiers_path, env):
                return 1
            prom_url = _start_prometheus(demo, prometheus_port, env)
            admin = session_token(
                keyring, tiers, "demo-admin", "premium", roles=("admin", "finance")
            )
            dash_url = (
                _start_dashboard(demo, dashboard_port, prom_url, admin, env) if dashboard else None
            )
            _banner(demo, keyring, tiers, dash_url, prom_url)
            stats = LoadStats()
            _drive(demo, spec, keyring, tiers, duration, requests, stats)
        except KeyboardInterrupt:
            print("\ninterrupted", flush=True)
        finally:
            final = _scrape(demo)
            print("stopping: dashboard, Prometheus, then the server (it drains) ...", flush=True)
            try:
                demo.stop_all()
            except KeyboardInterrupt:  # a second Ctrl-C: no more waiting
                for proc in demo.procs.values():
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
        _summary(demo, spec, tiers, stats, final, started)
        return 128 + stopped_by[0] if stopped_by else 0


def session_token(keyring, tiers, tenant: str, tier: str, session=None, roles=()) -> str:
    return mint_token(
        keyring,
        tiers,
        tenant_id=tenant,
        tier=tier,
        roles=roles,
        session_id=session,
        ttl_seconds=86_400,
    )


def server_environment(secret: str) -> dict[str, str]:
    env = dict(os.environ)
    env[HS256_KEY_ENV] = secret
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def resolve_model(model: str | None) -> str:
    """`model` if given, else the demo model, built on first use."""
    if model is not None:
        return model
    from kvlease.demo.model import default_model_dir, ensure_demo_model

    if not (default_model_dir() / ".complete").exists():
        _say(f"building the demo model in {default_model_dir()} (once, about 10 s) ...")
    return str(ensure_demo_model())


def start_server(
    demo: Demo,
    model: str,
    tiers: TierTable,
    tiers_path: str | None,
    env: dict[str, str],
    num_blocks: int = POOL_BLOCKS,
) -> bool:
    """`kvlease serve` in its own process group, its ledger in the run folder; False (and
    the end of its log on stderr) if it exits before /health answers."""
    argv = [sys.executable, "-m", "kvlease", "serve", "--model", model]
    argv += ["--num-blocks", str(num_blocks), "--port", str(demo.port)]
    # The pool's size in tokens is what the demo's pressure rests on: never vLLM's
    # default block size (128 on CPU), which would make it four times larger.
    argv += [
        "--block-size",
        str(BLOCK_TOKENS),
        "--max-model-len",
        str(max_model_len(tiers, num_blocks)),
    ]
    argv += ["--usage-db", f"sqlite:///{demo.ledger}", "--served-model-name", MODEL]
    if tiers_path:
        argv += ["--tiers", tiers_path]
    _say(f"starting kvlease serve on {demo.url} ({num_blocks} KV blocks; vLLM takes ~60 s here)")
    proc = demo.spawn("server", argv, env)
    started = last = time.monotonic()
    while True:
        if proc.poll() is not None:
            log = (demo.run / "server.log").read_text()[-3000:]
            print(
                f"kvlease demo: the server exited with {proc.returncode}:\n{log}", file=sys.stderr
            )
            return False
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{demo.url}/health", timeout=2).status_code == 200:
                _say(f"engine ready after {time.monotonic() - started:.0f} s")
                return True
        if time.monotonic() - last >= 10:
            last = time.monotonic()
            _say(f"  engine starting ... {last - started:.0f} s")
        time.sleep(0.5)


def _start_prometheus(demo: Demo, port: int, env: dict[str, str]) -> str | None:
    binary = shutil.which("prometheus")
    if binary is None:
        _say("Prometheus not installed (apt-get install prometheus): skipping it")
        return None
    config = write_config(demo.run / "prometheus", [f"127.0.0.1:{demo.port}"], "2s")
    argv = [binary, f"--config.file={config}", f"--web.listen-address=127.0.0.1:{port}"]
    argv.append(f"--storage.tsdb.path={demo.run / 'prometheus' / 'data'}")
    demo.spawn("prometheus", argv, env)
    return f"http://127.0.0.1:{port}"


def _start_dashboard(
    demo: Demo, port: int, prom_url: str | None, token: str, env: dict[str, str]
) -> str:
    from kvlease.dashboard.launch import command, environment

    dash_env = {**env, **environment(demo.url, prom_url, f"sqlite:///{demo.ledger}", token)}
    demo.spawn("dashboard", command(port), dash_env)
    return f"http://127.0.0.1:{port}"


def _banner(demo, keyring, tiers, dash_url, prom_url) -> None:
    token = session_token(keyring, tiers, "premium-00", "premium", session="my-chat")
    month = time.strftime("%Y-%m", time.gmtime())
    kvlease = kvlease_command()
    lines = [
        "",
        "kvlease demo is running. Ctrl-C stops everything.",
        f"  dashboard   {dash_url or '(off: --no-dashboard)'}",
        f"  API         {demo.url}/v1  (OpenAI-compatible; model {MODEL!r})",
        f"  metrics     {demo.url}/metrics",
        f"  Prometheus  {prom_url or '(not installed)'}",
        f"  ledger      {demo.ledger}",
        "",
        "  a premium tenant's token for this run:",
        f"    export TOKEN={token}",
        f'    curl {demo.url}/v1/chat/completions -H "Authorization: Bearer $TOKEN" \\',
        f'      -H \'Content-Type: application/json\' -d \'{{"model": "{MODEL}", '
        '"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 20}\'',
        f"    python -c \"import openai; c = openai.OpenAI(base_url='{demo.url}/v1', "
        f"api_key='$TOKEN'); print(c.chat.completions.create(model='{MODEL}', "
        "messages=[{'role': 'user', 'content': 'Hi'}], max_tokens=20).choices[0].message)\"",
        "  this month's usage as FOCUS CSV, and a line per tenant:",
        f"    {kvlease} usage export --usage-db sqlite:///{demo.ledger} --month {month} "
        "--granularity day -o usage.csv",
        f"    {kvlease} usage export --usage-db sqlite:///{demo.ledger} --month {month} "
        "--format summary",
        "",
    ]
    print("\n".join(lines), flush=True)


def kvlease_command() -> str:
    """How to run `kvlease` from this shell: the name when it is on PATH, else the
    venv's script (after `make demo` it is `.venv/bin/kvlease`, not on PATH)."""
    if shutil.which("kvlease"):
        return "kvlease"
    script = Path(sys.executable).parent / "kvlease"
    with contextlib.suppress(ValueError):
        return str(script.relative_to(Path.cwd()))
    return str(script)


def _drive(demo, spec, keyring, tiers, duration, requests, stats: LoadStats) -> None:
    """Play the demo's traffic into `stats` (the caller's, so Ctrl-C keeps it)."""
    names = dict(tenant_names(spec))
    streams = heavy_tenant(spec)
    counts = " · ".join(f"{n} {t}" for t, n in zip(TIERS, spec.tenants, strict=True))
    heavy = ", ".join(f"{t} {n}" for t, n in streams.items())
    _say(
        f"traffic: {len(names)} tenants ({counts}), one chat stream each ({heavy} at once: "
        "fair share at work), ~4 turns a session"
    )

    def token_for(turn) -> str:
        return session_token(keyring, tiers, turn.tenant_id, turn.tier, session=turn.session_id)

    async def main() -> None:
        stop = asyncio.Event()
        player = asyncio.create_task(
            play(
                stream_sessions(spec),
                names,
                f"{demo.url}/v1",
                token_for,
                MODEL,
                stats,
                stop,
                max_context=max_model_len(tiers) - CONTEXT_MARGIN,
                max_requests=requests,
                streams=streams,
            )
        )
        ticker = asyncio.create_task(_ticker(demo, stats, names))
        try:
            if duration:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(player), duration)
            else:
                await player
        finally:
            stop.set()
            ticker.cancel()
            await asyncio.gather(player, ticker, return_exceptions=True)
            print(flush=True)

    asyncio.run(main())


HEAVY_STREAMS = 4  # concurrent chat streams of the demo's one heavy tenant


def heavy_tenant(spec) -> dict[str, int]:
    """The lowest tier's first tenant keeps HEAVY_STREAMS chats going at once: a queue of
    its own, so fair share has a tenant to hold to its share beside the tier's others."""
    last = [t for t, tier in tenant_names(spec) if tier == TIERS[-1]]
    return {last[0]: HEAVY_STREAMS} if len(last) > 1 else {}


async def _ticker(demo: Demo, stats: LoadStats, names: dict[str, str]) -> None:
    """The live line: requests, tokens/s and preemptions by tier (from /metrics)."""
    tty = sys.stdout.isatty()
    preempted: Counter[str] = Counter()
    async with httpx.AsyncClient(timeout=5) as client:
        n = 0
        while True:
            await asyncio.sleep(1)
            n += 1
            if n % 2 == 0:
                with contextlib.suppress(httpx.HTTPError):
                    text = (await client.get(f"{demo.url}/metrics")).text
                    preempted = _preemptions(text)
            line = _live_line(stats, preempted)
            if tty:
                print(f"\r{line}\033[K", end="", flush=True)
            elif n % 10 == 0:
                print(line, flush=True)


def _live_line(stats: LoadStats, preempted: Counter[str]) -> str:
    elapsed = time.monotonic() - stats.started
    reqs = " ".join(f"{t[0].upper()}{stats.requests[t]}" for t in TIERS)
    pre = " ".join(f"{t[0].upper()}{preempted[t]}" for t in TIERS)
    errors = sum(stats.errors.values())
    rejected = sum(stats.rejected.values())
    return (
        f"[{elapsed:4.0f} s] requests {stats.total_requests} ({reqs}) · "
        f"{stats.tokens_per_second():,.0f} tok/s · preemptions {pre}"
        + (f" · rejected {rejected} (tier cap)" if rejected else "")
        + (f" · errors {errors}" if errors else "")
    )


def _families(text: str) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _scrape(demo: Demo) -> str:
    """The server's /metrics, or "" when it has none to give (not up, or still starting:
    the placeholder answers 503 with a JSON error, not Prometheus text)."""
    with contextlib.suppress(httpx.HTTPError):
        r = httpx.get(f"{demo.url}/metrics", timeout=5)
        if r.status_code == 200:
            return r.text
    return ""


def _preemptions(text: str) -> Counter[str]:
    out: Counter[str] = Counter()
    for s in _families(text).get(PREEMPTIONS.family, []):
        if s.name.endswith("_total"):
            out[s.labels["tier"]] += int(s.value)
    return out


def _summary(
    demo: Demo, spec, tiers: TierTable, stats: LoadStats | None, metrics: str, since: float
) -> None:
    from kvlease.exporters import money
    from kvlease.exporters.ledger import RETENTION, UsageLedger
    from kvlease.exporters.pricing import record_cost

    tier_of = dict(tenant_names(spec))
    preempted = _preemptions(metrics) if metrics else Counter()
    tokens: dict[str, Counter[str]] = {t: Counter() for t in TIERS}
    for s in _families(metrics).get(TOKENS.family, []) if metrics else []:
        tier = tier_of.get(s.labels["tenant_id"])
        if tier and s.name.endswith("_total"):
            tokens[tier][s.labels["kind"]] += int(s.value)
    records = []
    if demo.ledger.exists():
        records = list(UsageLedger(f"sqlite:///{demo.ledger}", create=False).read(since, 4e9))
    cost: defaultdict[str, Decimal] = defaultdict(Decimal)
    by_tier: Counter[str] = Counter()
    for r in records:
        cost[r.tenant_id] += record_cost(r, tiers)  # KV retention records included
        by_tier[r.tier or "unclassified"] += r.outcome != RETENTION

    print("\nkvlease demo summary")
    if stats is None and not metrics and not records:
        print("the engine never served: stopped before it was ready (nothing to report)")
        return
    header = ("requests", "rejected", "errors", "TTFT p50", "preemptions", "prefix hits")
    print(f"{'tier':<10}" + "".join(f"{h:>13}" for h in header))
    for t in TIERS:
        done = stats.requests[t] if stats else by_tier[t]
        errors = stats.errors[t] if stats else 0
        rejected = stats.rejected[t] if stats else 0
        ttft = sorted(stats.ttft[t]) if stats else []
        p50 = f"{ttft[len(ttft) // 2]:.2f} s" if ttft else "-"
        hit = tokens[t]["cached_input"] / tokens[t]["input"] if tokens[t]["input"] else 0.0
        cells = (
            f"{done:,}",
            f"{rejected:,}",
            f"{errors:,}",
            p50,
            f"{preempted[t]:,}",
            f"{hit:.0%}",
        )
        print(f"{t:<10}" + "".join(f"{c:>13}" for c in cells))
    top = sorted(cost.items(), key=lambda kv: (-kv[1], kv[0]))[:12]
    print(f"cost per tenant ({tiers.currency}, from the ledger): ", end="")
    print(
        " · ".join(f"{tenant} {money.shown(value, tiers.currency)}" for tenant, value in top)
        or "none"
    )
    print(f"ledger: {demo.ledger} ({len(records)} records from this run)")
    if stats and stats.error_statuses:
        print(
            "errors by HTTP status: "
            + ", ".join(
                f"{status or 'no answer'} x{n}"
                for status, n in sorted(stats.error_statuses.items())
            )
        )
        if any(400 <= status < 500 for status in stats.error_statuses):
            print(
                "  a 4xx is vLLM refusing a request before any engine work: nothing to bill, "
                'so no ledger record (counted in vllm_tenant_requests_total{outcome="refused"})'
            )
    if stats and stats.last_errors:
        print("last errors:", *stats.last_errors, sep="\n  ")


def _say(message: str) -> None:
    print(f"kvlease demo: {message}", flush=True)
