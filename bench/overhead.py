"""Scheduler overhead: TenantAwareScheduler against vLLM's own Scheduler, no model.

    python -m bench.overhead            # 64, 256 and 1,024 running requests
    python -m bench.overhead --quick    # fewer timed steps (smoke test)

Both are real vLLM schedulers built as the engine builds them
(bench/synthetic.py) and fed a synthetic model output each step, so only
scheduling is timed: one `schedule()` plus `update_from_output()`.
- no pressure: the pool holds every request as it grows;
- pressure: the pool holds about 2.2 blocks per request while each grows to 3,
  so requests are preempted and re-admitted every step.
Requests come from 32 tenants in the three tiers (1:3:8), one session each.
The two classes are timed alternately, `--repeats` times; each figure is the
fastest repeat's mean step, as timeit reports. Results: bench/results/overhead.*
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

from bench import report
from bench.synthetic import BLOCK, make_request, make_scheduler, step
from engine.workload import TIERS

SIZES = (64, 256, 1024)
RESULTS = Path(__file__).parent / "results"
PROMPT = 2 * BLOCK - 4  # two blocks, a third needed after 4 decoded tokens


def tier_of(i: int) -> str:
    return TIERS[0] if i % 12 == 0 else TIERS[1] if i % 12 < 4 else TIERS[2]


def build(cls: type, model: str, n: int, pressure: bool, steps: int) -> Any:
    """`n` requests admitted; without pressure the pool holds them for `steps` more tokens."""
    grown = -(-(PROMPT + 50 + steps) // BLOCK)  # blocks a request holds at the end, at most
    blocks = int(n * 2.2) + 1 if pressure else n * grown + 1
    scheduler = make_scheduler(cls, model, blocks, max_num_seqs=n)
    for i in range(n):
        tenant = f"t{i % 32:02d}"
        tier = tier_of(i % 32)
        scheduler.add_request(make_request(tenant, tier, PROMPT, 10_000, session=tenant))
    for _ in range(50):  # admit everyone (prefill is 2,048 tokens a step)
        step(scheduler)
        if not scheduler.waiting:
            break
    return scheduler


def time_steps(scheduler: Any, steps: int) -> tuple[float, float]:
    """Mean seconds per step, and the mean number of requests running in them."""
    gc.collect()
    running = 0
    started = time.perf_counter()
    for _ in range(steps):
        running += len(step(scheduler).num_scheduled_tokens)
    return (time.perf_counter() - started) / steps, running / steps


def measure(model: str, n: int, pressure: bool, steps: int, repeats: int) -> dict[str, Any]:
    from vllm.v1.core.sched.scheduler import Scheduler

    from engine.vllm_scheduler import TenantAwareScheduler

    classes = {"stock": Scheduler, "kvlease": TenantAwareScheduler}
    schedulers = {
        name: build(cls, model, n, pressure, steps * repeats) for name, cls in classes.items()
    }
    best = {name: float("inf") for name in classes}
    scheduled = {name: 0.0 for name in classes}
    for i in range(repeats):
        for name in ("stock", "kvlease") if i % 2 == 0 else ("kvlease", "stock"):
            seconds, scheduled[name] = time_steps(schedulers[name], steps)
            best[name] = min(best[name], seconds)
    return {
        "running": n,
        "pressure": pressure,
        "scheduled_per_step": scheduled,
        "stock_us": best["stock"] * 1e6,
        "kvlease_us": best["kvlease"] * 1e6,
        "ratio": best["kvlease"] / best["stock"],
        "preemptions": {k: _preemptions(s) for k, s in schedulers.items()},
    }


def _preemptions(scheduler: Any) -> int:
    return sum(r.num_preemptions for r in scheduler.requests.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer timed steps")
    parser.add_argument("--model", default=None, help="default: the demo model's config")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    from engine.demo_model import ensure_demo_model

    model = args.model or str(ensure_demo_model())
    steps, repeats = (20, 3) if args.quick else (100, args.repeats or 7)
    rows = []
    for pressure in (False, True):
        for n in SIZES:
            row = measure(model, n, pressure, steps, repeats)
            rows.append(row)
            print(
                f"  {n:5} running, {'pressure' if pressure else 'no pressure':11}: "
                f"stock {row['stock_us']:8.0f} us, kvlease {row['kvlease_us']:8.0f} us, "
                f"ratio {row['ratio']:.3f}",
                flush=True,
            )
    targets = [
        {
            "target": f"Scheduler step at {r['running']:,} running"
            f"{', pressure' if r['pressure'] else ''}, vs stock",
            "wanted": "<= 1.05x",
            "measured": r["ratio"],
            "met": r["ratio"] <= 1.05,
        }
        for r in rows
        if r["running"] >= 256
    ]
    result = {
        "steps": steps,
        "repeats": repeats,
        "rows": rows,
        "targets": targets,
        "machine": report.machine(),
    }
    name = "overhead-quick" if args.quick else "overhead"
    report.write(args.out, name, result, markdown(result))
    report.plot_lines(
        args.out / f"{name}.png",
        "Scheduler step time, kvlease / stock",
        "running requests",
        "ratio",
        {
            label: ([r["running"] for r in rows if r["pressure"] == p],
                    [r["ratio"] for r in rows if r["pressure"] == p])
            for label, p in (("no pressure", False), ("pressure", True))
        },
    )  # fmt: skip
    print(markdown(result))
    return 0


def markdown(result: dict) -> str:
    lines = [
        "| requests | pressure | scheduled per step (stock / kvlease) | stock us/step "
        "| kvlease us/step | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['running']:,} | {'yes' if r['pressure'] else 'no'} | "
            f"{r['scheduled_per_step']['stock']:.0f} / {r['scheduled_per_step']['kvlease']:.0f} | "
            f"{r['stock_us']:.0f} | "
            f"{r['kvlease_us']:.0f} | {r['ratio']:.3f} |"
        )
    return "\n".join(lines) + "\n\n" + report.targets_table(result["targets"]) + "\n"


if __name__ == "__main__":
    sys.exit(main())
