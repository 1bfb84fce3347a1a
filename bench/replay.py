"""`kvlease replay` against the real engine (fidelity), and on a week of traffic (speed).

    python -m bench.replay            # fidelity on the 60 s trace, then a week at 1 req/s
    python -m bench.replay --quick    # fidelity on the 12 s trace, then 15 minutes

Fidelity: bench/policy.py's trace plays on a real in-process kvlease engine (the
demo model, 64 blocks, arrivals at fixed steps), and the replay plays the same
trace on the same step clock with the engine's own limits. Per tier: TTFT in
steps (mean, p50, p99), preemptions, and the leased next-turn prefix hit; each
with its relative error; engine-wide, steps and wasted prefill (bench/policy.py's count).

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
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench import ablations, policy, report
from bench.inprocess import start_engine
from bench.workload import SPEC, load
from kvlease.demo.workload import generate
from kvlease.engine.tenancy import TierTable
from kvlease.replay import command, traffic
from kvlease.replay.clock import CPU_DEMO, StepCost
from kvlease.replay.report import summarize

if TYPE_CHECKING:  # vLLM loads only after main() has set its environment
    from kvlease.replay.simulate import Served

POOL = 64
SPS = 10.0
SPEED_POOL = 128
WEEK = 7 * 86400.0
SESSIONS_PER_SECOND = 0.33  # about 1.0 request per second with SPEC's mean of turns
RESULTS = Path(__file__).parent / "results"


FIGURES = ("ttft_p50_steps", "ttft_p99_steps", "preemptions", "leased_next_turn_hit")


def _figures(served: list[Served], tiers: TierTable) -> dict[str, dict]:
    """Per tier: TTFT mean in steps, and the report's own TTFT percentiles, preemptions and
    leased next-turn hit (kvlease.replay.report, which `kvlease replay` prints)."""
    from kvlease.replay.simulate import Replay

    report = summarize(Replay(served, 0, 0, 0.0, 0, {}), tiers)
    out = {}
    for tier, figures in report["tiers"].items():
        ttft = [s.ttft_steps for s in served if s.tier == tier]
        out[tier] = {"ttft_mean_steps": sum(ttft) / len(ttft)}
        out[tier].update((key, figures[key]) for key in FIGURES)
    return out


def _served(run: Any, tiers: TierTable) -> list[Served]:
    """The real run's requests as the replay records its own."""
    from kvlease.replay.simulate import Served

    preempted = Counter(rid for rid, *_ in run.observations.preemptions)
    served = []
    for r in run.requests:
        s = Served.arriving(r.arrival, tiers, r.arrival.step, r.arrival_s)
        s.first_step, s.cached_tokens = r.first_step, r.cached
        s.preemptions = preempted[r.arrival.request_id]
        served.append(s)
    return served


def fidelity(model: str, quick: bool) -> dict[str, Any]:
    from kvlease.engine.vllm_scheduler import TenantAwareScheduler
    from kvlease.replay.simulate import simulate

    turns = load(quick)
    tiers = TierTable.load()
    engine = start_engine("kvlease", model, TenantAwareScheduler, "fcfs", POOL)
    run = policy.play(engine, turns, "real", SPS, tiers)
    real = _figures(_served(run, tiers), tiers)
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
    replayed = _figures(replay.served, tiers)
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
        "wasted_prefill_tokens": {  # each bench's own count: the same rule
            "real": policy.summarize(run, tiers, tiers.leased_caps(POOL - 1))[
                "wasted_prefill_tokens"
            ],
            "replay": ablations.summarize(replay, tiers, POOL)["wasted_prefill_tokens"],
        },
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
        f"({f['engine_steps']['real']} steps) against replay ({f['engine_steps']['replay']}); "
        f"wasted prefill {f['wasted_prefill_tokens']['real']:,} tokens against "
        f"{f['wasted_prefill_tokens']['replay']:,}.",
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
        f"Speed: {s['requests']:,} requests over {s['span_hours']:g} h "
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
    from kvlease.demo.model import ensure_demo_model

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
