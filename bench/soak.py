"""Load and soak: 64 concurrent streaming clients against a real `kvlease serve`.

    python -m bench.soak                   # 5 minutes
    python -m bench.soak --duration 60
    python -m bench.soak --quick           # 30 s, 16 clients (smoke test)

One client per tenant (tiers 1:3:8), each a chat loop through the stock
`openai` client: stream a reply, add it to the conversation, ask again; a new
conversation once it nears 1,400 tokens. Every 10 s the server's resident
memory (API process and EngineCore) is sampled. At the end the clients finish
what they asked, the server is stopped with SIGTERM (it drains and commits),
and its usage ledger must hold exactly one record per completed request.
Results: bench/results/soak.{json,md,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import secrets
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import openai
import psutil

from bench import report
from bench.postgres import free_port
from kvlease.demo.client import LoadStats, ask, prompt
from kvlease.demo.run import (
    MODEL,
    Demo,
    resolve_model,
    server_environment,
    session_token,
    start_server,
)
from kvlease.demo.workload import Turn, WorkloadSpec, tenant_names
from kvlease.engine.auth import KeyRing
from kvlease.engine.tenancy import TierTable
from kvlease.exporters.ledger import UsageLedger

CLIENTS = 64
QUICK_CLIENTS = 16
TURNS_AT_LEAST = 2  # per client: the load runs past its duration until they are done
POOL_BLOCKS = 512  # 16k tokens: enough that 64 short chats mostly fit, as a sized server would
SAMPLE_SECONDS = 10
WARMUP_SECONDS = 60
RESULTS = Path(__file__).parent / "results"


def rss_mib(pid: int) -> dict[str, float]:
    """Resident memory of the server and each of its children (the EngineCore), MiB."""
    root = psutil.Process(pid)
    out = {"api": root.memory_info().rss / 2**20}
    for child in root.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            out[child.name()] = out.get(child.name(), 0.0) + child.memory_info().rss / 2**20
    return out


async def client(
    base_url: str, token: str, tenant: str, tier: str, stats: LoadStats, stop: asyncio.Event
) -> None:
    """One tenant's chat until `stop`: turn k asks 40-99 tokens and 48-127 back (fixed by k,
    so runs compare); a new conversation before 1,400 tokens, or after an error."""
    api = openai.AsyncOpenAI(base_url=base_url, api_key=token, max_retries=0, timeout=600)
    history: list[dict[str, str]] = []
    context, k = 0, 0
    try:
        while not stop.is_set():
            k += 1
            turn = Turn(0.0, tenant, tier, f"{tenant}-c{k}", k, 40 + k * 7 % 60, 48 + k * 13 % 80)
            if context + turn.input_tokens + turn.output_tokens > 1400:
                history, context = [], 0
            context += turn.input_tokens + turn.output_tokens
            history.append({"role": "user", "content": prompt(turn)})
            answer = await ask(api, MODEL, history, turn, stats)
            if answer is None:
                history, context = [], 0
                await asyncio.sleep(1)
                continue
            history.append({"role": "assistant", "content": answer[0]})
    finally:
        await api.close()


async def drive(demo: Demo, tokens: list[tuple[str, str, str]], duration: float, pid: int):
    """The clients' load for `duration` seconds, and then until every client has had
    TURNS_AT_LEAST answers on average (a slow machine gets as many requests as a fast one)."""
    stats = LoadStats()
    stop = asyncio.Event()
    samples: list[dict[str, Any]] = []
    tasks = [
        asyncio.create_task(client(f"{demo.url}/v1", tok, tenant, tier, stats, stop))
        for tenant, tier, tok in tokens
    ]
    started = time.monotonic()
    enough = TURNS_AT_LEAST * len(tokens)
    while (elapsed := time.monotonic() - started) < duration or stats.total_requests < enough:
        rss = rss_mib(pid)
        samples.append({"t": round(elapsed), "total": sum(rss.values()), **rss})
        done = stats.total_requests
        print(
            f"  {elapsed:5.0f} s  {done} requests  {sum(stats.errors.values())} errors  "
            f"RSS {samples[-1]['total']:.0f} MiB",
            flush=True,
        )
        await asyncio.sleep(min(SAMPLE_SECONDS, max(0.5, duration - elapsed)))
    stop.set()  # clients finish the request they are in, then stop
    await asyncio.gather(*tasks)
    elapsed = time.monotonic() - started
    rss = rss_mib(pid)
    samples.append({"t": round(elapsed), "total": sum(rss.values()), **rss})
    return stats, samples, elapsed


def flatness(samples: list[dict[str, Any]], warmup: float) -> dict[str, float]:
    """Growth of total RSS after warm-up: last minus first post-warm-up sample."""
    after = [s for s in samples if s["t"] >= warmup] or samples[-2:]
    first, last = after[0]["total"], after[-1]["total"]
    return {
        "after_warmup_first_mib": first,
        "after_warmup_last_mib": last,
        "growth_mib": last - first,
        "growth_fraction": (last - first) / first,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    parser.add_argument("--quick", action="store_true", help="30 s, 16 clients (smoke test)")
    parser.add_argument("--clients", type=int, default=None, help=f"default {CLIENTS}")
    parser.add_argument("--model", default=None, help="default: the demo model")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    duration = 30.0 if args.quick else args.duration
    args.clients = args.clients or (QUICK_CLIENTS if args.quick else CLIENTS)
    warmup = min(WARMUP_SECONDS, duration / 3)
    model = resolve_model(args.model)
    tiers = TierTable.load()
    secret = secrets.token_urlsafe(48)
    keyring = KeyRing.from_secret(secret)
    demo = Demo(Path(tempfile.mkdtemp(prefix="kvlease-soak-")), free_port())
    env = server_environment(secret)
    names = tenant_names(WorkloadSpec.for_tenants(args.clients))
    tokens = [
        (tenant, tier, session_token(keyring, tiers, tenant, tier, session=tenant))
        for tenant, tier in names
    ]
    try:
        if not start_server(demo, model, TierTable.shipped(), None, env, num_blocks=POOL_BLOCKS):
            return 1
        pid = demo.procs["server"].pid
        stats, samples, elapsed = asyncio.run(drive(demo, tokens, duration, pid))
    finally:
        demo.stop_all()  # SIGTERM: the server drains and commits its ledger
    records = UsageLedger(f"sqlite:///{demo.ledger}").count(requests_only=True)
    latency = [x for v in stats.latency.values() for x in v]
    ttft = [x for v in stats.ttft.values() for x in v]
    errors = sum(stats.errors.values()) + sum(stats.rejected.values())
    flat = flatness(samples, warmup)
    result = {
        "duration_seconds": duration,
        "clients": args.clients,
        "pool_blocks": POOL_BLOCKS,
        "completed": stats.total_requests,
        "by_tier": dict(Counter(stats.requests)),
        "errors": errors,
        "last_errors": stats.last_errors,
        "seconds_with_drain": round(elapsed, 1),
        "output_tokens_per_second": sum(stats.output_tokens.values()) / elapsed,
        "latency_seconds": report.stats(latency),
        "ttft_seconds": report.stats(ttft),
        "by_tier_seconds": {
            tier: {
                "latency": report.stats(stats.latency[tier]),
                "ttft": report.stats(stats.ttft[tier]),
            }
            for tier in stats.latency
            if stats.latency[tier]
        },
        "rss": flat,
        "rss_samples": samples,
        "ledger_records": records,
        "targets": [
            {"target": "Soak errors", "wanted": "0", "measured": errors, "met": errors == 0},
            {
                "target": "Server RSS growth after warm-up",
                "wanted": "<= 2%",
                "measured": flat["growth_fraction"],
                "met": flat["growth_fraction"] <= 0.02,
            },
            {
                "target": "Ledger records = completed requests",
                "wanted": f"{stats.total_requests}",
                "measured": records,
                "met": records == stats.total_requests,
            },
        ],
        "machine": report.machine(),
    }
    name = "soak-quick" if args.quick else "soak"
    report.write(args.out, name, result, markdown(result))
    report.plot_lines(
        args.out / f"{name}.png",
        f"Server RSS under {args.clients} streaming clients",
        "seconds",
        "MiB",
        {key: ([s["t"] for s in samples], [s.get(key, 0) for s in samples])
         for key in samples[0] if key != "t"},
    )  # fmt: skip
    print(markdown(result))
    # A 30 s run has no steady state to judge memory by; errors and the ledger count always.
    judged = [t for t in result["targets"] if not (args.quick and "RSS" in t["target"])]
    return 0 if all(t["met"] for t in judged) else 1


def markdown(r: dict) -> str:
    lat, ttft = r["latency_seconds"], r["ttft_seconds"]
    return (
        "| clients | seconds | completed | errors | output tok/s | latency p50 / p99 s "
        "| TTFT p50 / p99 s | RSS after warm-up -> end | ledger records |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
        f"| {r['clients']} | {r['duration_seconds']:.0f} | {r['completed']} | {r['errors']} | "
        f"{r['output_tokens_per_second']:.0f} | {lat['p50']:.2f} / {lat['p99']:.2f} | "
        f"{ttft['p50']:.2f} / {ttft['p99']:.2f} | {r['rss']['after_warmup_first_mib']:.0f} -> "
        f"{r['rss']['after_warmup_last_mib']:.0f} MiB | {r['ledger_records']} |\n\n"
        + "| tier | completed | latency p50 / p99 s | TTFT p50 / p99 s |\n|---|---|---|---|\n"
        + "".join(
            f"| {tier} | {r['by_tier'][tier]} | {t['latency']['p50']:.2f} / "
            f"{t['latency']['p99']:.2f} | {t['ttft']['p50']:.2f} / {t['ttft']['p99']:.2f} |\n"
            for tier, t in r["by_tier_seconds"].items()
        )
        + "\n"
        + report.targets_table(r["targets"])
        + "\n"
    )


if __name__ == "__main__":
    sys.exit(main())
