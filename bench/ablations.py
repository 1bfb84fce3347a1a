"""What each kvlease mechanism costs and buys, at scale, through `kvlease replay`'s engine.

    python -m bench.ablations           # 1,000 tenants, ~11,400 multi-turn requests
    python -m bench.ablations --quick   # 100 tenants, ~1,000 requests: the CI smoke test

bench/policy.py measures the mechanisms on the real engine, on a 113-request trace.
This plays a seeded trace of 1,000 tenants (100 premium, 300 standard, 600 free) on
`kvlease.replay.simulate`'s engine (vLLM's real scheduler code, kvlease's mixin, synthetic model
outputs) and the calibrated CPU clock (`kvlease.replay.clock.CPU_DEMO`, bench/calibrate.py),
every way in its own process, two at a time:
  fcfs, priority   stock vLLM (PRIORITY with priority = tier), no stride
  kvlease          the shipped settings
  and kvlease with one mechanism off or changed (bench.policy.ABLATION_SETTINGS).
Sessions chain as a chat's do (a next turn follows the reply and a think time), so
each way replays the same requests, released on its own clock. Figures per way: engine
steps, seconds on the calibrated clock, wasted prefill (tokens computed twice after a
preemption plus earlier-turn context computed again: bench/policy.py's count), premium
TTFT, the leased next-turn hit (and what the caps allow at best), the free tier's worst
TTFT. Results: bench/results/ablations.*.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from bench import report
from bench.policy import ABLATION_SETTINGS, ABLATIONS, computed_twice, context_again
from bench.workload import SPEC
from kvlease.demo.workload import TIERS, generate
from kvlease.engine.tenancy import TierTable
from kvlease.replay import command
from kvlease.replay.clock import CPU_DEMO
from kvlease.replay.synthetic import BLOCK

RESULTS = Path(__file__).parent / "results"
POOL = 128
# About 11,400 requests (10,700 served: turns whose context would pass 1,400 tokens are
# left out) in 5.5 minutes: on the calibrated clock a step takes ~3 ms, so
# this is the pressure bench/policy.py's trace puts on its 64 blocks at 10 steps a second.
SCALE = replace(SPEC, tenants=(100, 300, 600), duration=330.0, sessions_per_second=12.0, seed=7)
QUICK = replace(SCALE, tenants=(10, 30, 60), duration=30.0)
STOCK = ("fcfs", "priority")
WAYS = (*STOCK, "kvlease", *ABLATIONS)


def run_way(way: str, turns: list, pool: int, model: str) -> dict[str, Any]:
    """One way's replay and its figures (in a worker process)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from kvlease.replay.simulate import simulate

    tiers = TierTable.load()
    began = time.perf_counter()
    result = simulate(
        turns,
        tiers,
        pool,
        CPU_DEMO,
        model,
        max_num_seqs=command.MAX_NUM_SEQS,
        max_num_batched_tokens=command.MAX_NUM_BATCHED_TOKENS,
        settings=ABLATION_SETTINGS.get(way),
        stock=way if way in STOCK else None,
    )
    figures = summarize(result, tiers, pool)
    figures["replay_wall_seconds"] = round(time.perf_counter() - began, 1)
    return figures


def summarize(result: Any, tiers: TierTable, pool: int) -> dict[str, Any]:
    caps = tiers.leased_caps(pool - 1)
    out: dict[str, Any] = {"tiers": {}}
    for tier in TIERS:
        served = [s for s in result.served if s.tier == tier]
        if not served:
            continue
        ttft = sorted(s.ttft_steps for s in served)
        leased = [s for s in served if s.leased]
        cacheable = sum(s.cacheable for s in leased)
        cap_tokens = caps.get(tier, 0) * BLOCK
        out["tiers"][tier] = {
            "requests": len(served),
            "ttft_steps": report.stats(ttft),
            "preemptions": sum(s.preemptions for s in served),
            "leased_prefix_hit": (
                sum(min(s.cached_tokens, s.cacheable) for s in leased) / cacheable
                if cacheable
                else None
            ),
            "leased_prefix_cap_bound": (
                sum(min(cap_tokens, s.cacheable) for s in leased) / cacheable if cacheable else None
            ),
        }
    recomputed = sum(
        computed_twice(s.computed_tokens, s.prompt_tokens, s.cached_tokens, s.output_tokens)
        for s in result.served
    )
    context = sum(context_again(s.cacheable, s.cached_tokens) for s in result.served)
    out.update(
        requests=len(result.served),
        dropped_turns=result.dropped,
        engine_steps=result.steps,
        clock_seconds=round(result.seconds, 1),
        recomputed_tokens=recomputed,
        context_recomputed_tokens=context,
        wasted_prefill_tokens=recomputed + context,
    )
    return out


def markdown(result: dict[str, Any]) -> str:
    ways = result["ways"]
    lines = [
        f"Machine: {result['machine']}",
        "",
        f"{result['requests']:,} requests from {result['tenants']:,} tenants over "
        f"{result['hours']:g} h of traffic, {result['pool_blocks']} blocks, calibrated CPU "
        "clock; every ratio against stock PRIORITY in this run.",
        "",
    ]
    order = ("kvlease", *ABLATIONS, "priority", "fcfs")
    lines += report.ablation_rows(ways, order, "clock_seconds", "clock s", TIERS, preemptions=True)
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100 tenants, 30 s of traffic")
    parser.add_argument("--pool-blocks", type=int, default=POOL)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from kvlease.demo.model import ensure_demo_model

    model = str(ensure_demo_model())
    spec = QUICK if args.quick else SCALE
    turns = generate(spec)
    print(f"{len(turns):,} requests from {sum(spec.tenants):,} tenants", flush=True)
    spawn = get_context("spawn")  # vLLM's rule: never fork after it loads
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=spawn) as workers:
        futures = {w: workers.submit(run_way, w, turns, args.pool_blocks, model) for w in WAYS}
        ways = {}
        for way, future in futures.items():
            ways[way] = future.result()
            print(f"  {way:15} {ways[way]['engine_steps']:,} steps", flush=True)
    result = {
        "requests": len(turns),
        "tenants": sum(spec.tenants),
        "hours": spec.duration / 3600,
        "pool_blocks": args.pool_blocks,
        "ways": ways,
        "machine": report.machine(),
    }
    name = "ablations-quick" if args.quick else "ablations"
    text = markdown(result)
    report.write(args.out, name, result, text.split("\n", 2)[2])
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
