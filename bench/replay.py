"""`kvlease replay` against the real engine (fidelity), and on a week of traffic (speed).

    python -m bench.replay            # fidelity on the 60 s trace, then a week at 1 req/s
    python -m bench.replay --quick    # fidelity on the 12 s trace, then 15 minutes

Fidelity: bench/policy.py's trace plays on a real in-process kvlease engine (the
demo model, 64 blocks, arrivals at fixed steps), and the replay plays the same
trace on the same step clock with the engine's own limits. Per tier: TTFT in
steps (mean, p50, p99), preemptions, and the leased next-turn prefix hit; each
with its relative error.

Speed: a seeded week of chat sessions at about one request per second (the
workload of bench/workload.py, longer), replayed by `kvlease replay`'s own code
on the calibrated CPU clock and a 128-block pool, current against a proposed
table that moves the busiest free tenant to premium: both sides, two processes,
wall time from start to report. Results: bench/results/replay.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import report
from bench.inprocess import start_engine
from bench.policy import play
from bench.workload import SPEC, load
from demo.workload import generate
from engine.tenancy import TierTable
from replay import command, traffic
from replay.clock import CPU_DEMO, StepCost
from replay.report import percentile
from replay.sessions import Arrival

POOL = 64
SPS = 10.0
SPEED_POOL = 128
WEEK = 7 * 86400.0
SESSIONS_PER_SECOND = 0.33  # about 1.0 request per second with SPEC's mean of turns
RESULTS = Path(__file__).parent / "results"


def _figures(rows: list[tuple[str, int, int, int, bool, Any]]) -> dict[str, dict]:
    """Per tier, from (tier, ttft steps, cached, cacheable, leased, preemptions) rows."""
    out: dict[str, dict] = {}
    for tier in TierTable.load():
        mine = [r for r in rows if r[0] == tier]
        if not mine:
            continue
        ttft = [r[1] for r in mine]
        leased = [r for r in mine if r[4]]
        cacheable = sum(r[3] for r in leased)
        out[tier] = {
            "ttft_mean_steps": sum(ttft) / len(ttft),
            "ttft_p50_steps": percentile(ttft, 50),
            "ttft_p99_steps": percentile(ttft, 99),
            "preemptions": sum(r[5] for r in mine),
            "leased_next_turn_hit": (
                sum(min(r[2], r[3]) for r in leased) / cacheable if cacheable else None
            ),
        }
    return out


def _cacheable(a: Arrival) -> int:
    return max(0, a.prefix_tokens - 1) // 32 * 32


def fidelity(model: str, quick: bool) -> dict[str, Any]:
    from engine.vllm_scheduler import TenantAwareScheduler
    from replay.simulate import simulate

    turns = load(quick)
    tiers = TierTable.load()
    engine = start_engine("kvlease", model, TenantAwareScheduler, "fcfs", POOL)
    run = play(engine, turns, "real", SPS, tiers)
    preempted: dict[str, int] = {}
    for _, tier, _, _ in run.observations.preemptions:
        preempted[tier] = preempted.get(tier, 0) + 1
    real = _figures(
        [
            (
                r.arrival.turn.tier,
                r.first_step - r.arrival.step,
                r.cached,
                _cacheable(r.arrival),
                r.arrival.turn.turn > 0
                and r.arrival.think_seconds <= tiers[r.arrival.turn.tier].lease_seconds,
                0,
            )
            for r in run.requests
        ]
    )
    for tier, n in preempted.items():
        real[tier]["preemptions"] = n
    config = engine.llm.vllm_config.scheduler_config
    replay = simulate(
        turns,
        tiers,
        POOL,
        StepCost.fixed(SPS),
        model,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
    )
    replayed = _figures(
        [
            (s.tier, s.ttft_steps, s.cached_tokens, s.cacheable, s.leased, s.preemptions)
            for s in replay.served
        ]
    )
    rows = []
    for tier, figures in real.items():
        for key, value in figures.items():
            got = replayed[tier][key]
            error = None
            if value is not None and got is not None:
                error = abs(got - value) / value if value else float(got != value)
            rows.append({"tier": tier, "figure": key, "real": value, "replay": got, "error": error})
    return {
        "trace": "quick" if quick else "seeded",
        "requests": len(run.requests),
        "engine_steps": {"real": run.busy_steps, "replay": replay.steps},
        "rows": rows,
    }


def speed(quick: bool) -> dict[str, Any]:
    spec = replace(
        SPEC,
        duration=900.0 if quick else WEEK,
        sessions_per_second=SESSIONS_PER_SECOND,
        seed=3,
    )
    turns = generate(spec)
    busiest = max(
        {t.tenant_id for t in turns if t.tier == "free"},
        key=lambda name: sum(t.output_tokens for t in turns if t.tenant_id == name),
    )
    current = command.Side("current", None, SPEED_POOL, turns)
    proposed = command.Side(
        "proposed", None, SPEED_POOL, traffic.assign(turns, {busiest: "premium"})
    )
    limits = {
        "max_num_seqs": command.MAX_NUM_SEQS,
        "max_num_batched_tokens": command.MAX_NUM_BATCHED_TOKENS,
    }
    plan = command.Plan((current, proposed), CPU_DEMO, "", limits, [])
    began = time.perf_counter()
    result = command.run(plan)
    wall = time.perf_counter() - began
    return {
        "requests": len(turns),
        "span_hours": spec.duration / 3600,
        "requests_per_second_of_traffic": len(turns) / spec.duration,
        "pool_blocks": SPEED_POOL,
        "wall_seconds": round(wall, 1),
        "replayed_requests_per_second": round(2 * len(turns) / wall, 1),
        "current_preemptions": sum(t["preemptions"] for t in result["current"]["tiers"].values()),
        "proposed_preemptions": sum(t["preemptions"] for t in result["proposed"]["tiers"].values()),
    }


def markdown(result: dict[str, Any]) -> str:
    f = result["fidelity"]
    lines = [
        f"Fidelity: the {f['trace']} trace ({f['requests']} requests), real engine "
        f"({f['engine_steps']['real']} steps) against replay ({f['engine_steps']['replay']}).",
        "",
        "| tier | figure | real engine | replay | error |",
        "|---|---|---|---|---|",
    ]
    for row in f["rows"]:
        real, got, err = row["real"], row["replay"], row["error"]
        lines.append(
            f"| {row['tier']} | {row['figure']} | {_num(real)} | {_num(got)} | "
            f"{'-' if err is None else f'{err:.1%}'} |"
        )
    s = result["speed"]
    lines += [
        "",
        f"Speed: {s['requests']:,} requests over {s['span_hours']:.0f} h "
        f"({s['requests_per_second_of_traffic']:.2f} req/s), {s['pool_blocks']} blocks, both "
        f"sides: {s['wall_seconds']:.0f} s wall ({s['replayed_requests_per_second']:,.0f} "
        "replayed requests per second).",
    ]
    return "\n".join(lines) + "\n"


def _num(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the 12 s trace and 15 minutes")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["HF_HUB_OFFLINE"] = "1"
    from demo.model import ensure_demo_model

    model = str(ensure_demo_model())
    result = {
        "fidelity": fidelity(model, args.quick),
        "speed": speed(args.quick),
        "machine": report.machine(),
    }
    name = "replay-quick" if args.quick else "replay"
    report.write(args.out, name, result, markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
