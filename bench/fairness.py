"""Fairness benchmark: one tier, one tenant sending ten times as much as the others.

    python -m bench.fairness            # 1,500 engine steps per way, ~2 min here
    python -m bench.fairness --quick    # 300 steps (the CI smoke test)

Five tenants of one tier (free: no leases, so only fair share differs) share a
real in-process vLLM engine (demo model, 64-block pool, step clock). Closed
loop, everyone backlogged: "heavy" keeps 80 requests outstanding, each of the
four light tenants 8, and whoever's request finishes sends the next at once.
Every request is 64 prompt tokens and 64 generated ones, so a request costs 192
weighted tokens (kvlease.engine.fairness: prompt 1, generated 2). The ways:
  fcfs     stock vLLM Scheduler, FCFS (requests in the order sent)
  kvlease  TenantAwareScheduler, fair share on with its slack (the defaults): the oldest
           request (the heavy tenant's, sent first) goes first while its tenant is
           within kvlease.engine.settings.FAIR_SLACK weighted tokens of the least served,
           so the gap may grow by that much, and no more
  hog      kvlease, the light tenants keeping 1 request each: fair share is
           work-conserving, so the heavy tenant takes the rest of the pool
  capped   the same with the tier's max_tenant_kv_share = 0.5: the heavy
           tenant may hold half the pool, whatever it sends
  strict   kvlease with fair_slack = 0: strict fair share
Measured after a warm-up of 100 steps: each tenant's weighted service (tokens
computed, counted per step by position: prompt or generated), Jain's fairness
index over it, the heavy tenant's share, the worst gap between two tenants'
service since the warm-up in units of one request's cost, total service per
step, and the most KV blocks the heavy tenant held. Results:
bench/results/fairness.{json,md,png}.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from collections import defaultdict
from importlib import resources
from pathlib import Path
from typing import Any

from bench import report
from bench.inprocess import start_engine

POOL_BLOCKS = 64
PROMPT = OUTPUT = 64
REQUEST_COST = PROMPT + 2 * OUTPUT  # weighted tokens, as kvlease.engine.fairness counts them
TENANTS = {"heavy": 80, "light-1": 8, "light-2": 8, "light-3": 8, "light-4": 8}  # outstanding
HOG = {**TENANTS, **{t: 1 for t in TENANTS if t != "heavy"}}  # the others nearly idle
TIER = "free"
WARMUP = 100
CAP_SHARE = 0.5
RESULTS = Path(__file__).parent / "results"


def jain(values: list[float]) -> float:
    """Jain's fairness index: 1 when all are equal, 1/n when one takes everything."""
    total = sum(values)
    return total * total / (len(values) * sum(v * v for v in values)) if total else 1.0


def counting(cls: type) -> type:
    """`cls` plus a per-tenant count of weighted service each step. Decides nothing."""

    class Counting(cls):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.service: defaultdict[str, float] = defaultdict(float)

        def schedule(self, *args: Any, **kwargs: Any):
            out = super().schedule(*args, **kwargs)
            for rid, n in out.num_scheduled_tokens.items():
                request = self.requests[rid]
                start = request.num_computed_tokens - n
                prompt = min(n, max(0, request.num_prompt_tokens - start))
                tenant = request.sampling_params.extra_args["tenant_id"]
                self.service[tenant] += prompt + 2 * (n - prompt)
            return out

    Counting.__name__ = f"Counting{cls.__name__}"
    return Counting


def play(engine: Any, steps: int, tenants: dict[str, int], seed: int = 0) -> dict[str, Any]:
    """Run the closed loop for `steps` engine steps; per-tenant figures after the warm-up."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    llm = engine.llm
    scheduler = llm.engine_core.engine_core.scheduler
    rng = random.Random(seed)
    vocab = llm.model_config.get_vocab_size()
    sent = 0
    outstanding: set[str] = set()

    def send(tenant: str) -> None:
        nonlocal sent
        sent += 1
        params = SamplingParams(
            max_tokens=OUTPUT,
            ignore_eos=True,
            temperature=0.0,
            extra_args={"tenant_id": tenant, "tier": TIER},
            output_kind=RequestOutputKind.DELTA,
        )
        prompt = [rng.randrange(10, vocab) for _ in range(PROMPT)]
        outstanding.add(f"{tenant}-{sent}")
        llm.add_request(f"{tenant}-{sent}", {"prompt_token_ids": prompt}, params)

    initial = [t for t, n in tenants.items() for _ in range(n)]
    rng.shuffle(initial)  # the heavy tenant's requests arrive among the others'
    for tenant in initial:
        send(tenant)
    base: dict[str, float] = {}
    worst_gap = 0.0
    most_held = 0
    output_tokens = 0
    for step in range(steps):
        for out in llm.step():
            if step >= WARMUP and out.outputs:
                output_tokens += len(out.outputs[0].token_ids)
            if out.finished:
                outstanding.discard(out.request_id)
                send(out.request_id.rsplit("-", 1)[0])
        if step == WARMUP:
            base = dict(scheduler.service)
        if step > WARMUP:
            got = [scheduler.service[t] - base.get(t, 0.0) for t in TENANTS]
            worst_gap = max(worst_gap, max(got) - min(got))
        kv = getattr(scheduler, "kvlease", None)  # None: stock vLLM
        account = kv.shares[TIER].accounts.get("heavy") if kv else None
        if account is not None and account.requests:
            most_held = max(most_held, kv.held_blocks(account)[0])
    service = {t: scheduler.service[t] - base.get(t, 0.0) for t in TENANTS}
    llm.abort_request(list(outstanding))  # leave the engine empty for the next way
    while llm.has_unfinished_requests():
        llm.step()
    total = sum(service.values())
    measured = steps - WARMUP - 1
    return {
        "service": service,
        "jain": jain(list(service.values())),
        "heavy_share": service["heavy"] / total if total else 0.0,
        "worst_gap_requests": worst_gap / REQUEST_COST,
        "service_per_step": total / measured,
        "output_tokens_per_step": output_tokens / measured,
        "most_blocks_held_by_heavy": most_held,
        "cap_blocks": kvlease.kv_caps.get(TIER)
        if (kvlease := getattr(scheduler, "kvlease", None))
        else None,
    }


def capped_tiers(share: float) -> Path:
    text = resources.files("kvlease.engine").joinpath("tiers.toml").read_text(encoding="utf-8")
    text = text.replace(f"[tiers.{TIER}]\n", f"[tiers.{TIER}]\nmax_tenant_kv_share = {share}\n")
    path = Path(tempfile.mkdtemp(prefix="kvlease-fairness-")) / "tiers.toml"
    path.write_text(text, encoding="utf-8")
    return path


def targets(ways: dict[str, dict]) -> list[dict]:
    k, f, c = ways["kvlease"], ways["fcfs"], ways["capped"]
    rows = [
        ("Jain's index over the tenants' service", ">= 0.95", k["jain"], lambda v: v >= 0.95),
        ("Total service vs stock FCFS", ">= 0.97x", k["service_per_step"] / f["service_per_step"],
         lambda v: v >= 0.97),
        ("Blocks the capped tenant held, over its cap", "<= 1",
         c["most_blocks_held_by_heavy"] / c["cap_blocks"], lambda v: v <= 1),
    ]  # fmt: skip
    return [
        {"target": name, "wanted": wanted, "measured": value, "met": bool(ok(value))}
        for name, wanted, value, ok in rows
    ]


def markdown(result: dict) -> str:
    ways = result["ways"]
    lines = [
        "| way | Jain | heavy share | worst gap (requests) | service / step | output tok / step "
        "| " + " | ".join(TENANTS) + " |",
        "|---|---|---|---|---|---|" + "---|" * len(TENANTS),
    ]
    for name, w in ways.items():
        per = " | ".join(f"{w['service'][t]:,.0f}" for t in TENANTS)
        lines.append(
            f"| {name} | {w['jain']:.3f} | {w['heavy_share']:.0%} | "
            f"{w['worst_gap_requests']:.1f} | {w['service_per_step']:.1f} | "
            f"{w['output_tokens_per_step']:.2f} | {per} |"
        )
    capped, hog = ways["capped"], ways["hog"]
    lines += [
        "",
        f"The heavy tenant held at most {hog['most_blocks_held_by_heavy']} of "
        f"{POOL_BLOCKS - 1} KV blocks with the others nearly idle (hog), and "
        f"{capped['most_blocks_held_by_heavy']} under a cap of {capped['cap_blocks']} "
        f"({CAP_SHARE:.0%} of the pool).",
        "",
        report.targets_table(result["targets"]),
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="300 steps (smoke test)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--model", default=None, help="default: the demo model (built if missing)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    steps = args.steps or (300 if args.quick else 1500)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["HF_HUB_OFFLINE"] = "1"
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvlease.demo.model import ensure_demo_model
    from kvlease.engine.vllm_scheduler import TenantAwareScheduler

    model = args.model or str(ensure_demo_model())
    kvlease = counting(TenantAwareScheduler)
    engines = {
        "fcfs": start_engine("fcfs", model, counting(Scheduler), "fcfs", POOL_BLOCKS),
        "kvlease": start_engine("kvlease", model, kvlease, "fcfs", POOL_BLOCKS),
        "hog": None,
        "capped": start_engine(
            "capped", model, kvlease, "fcfs", POOL_BLOCKS,
            {"tiers": str(capped_tiers(CAP_SHARE))}, max_len=512,
        ),
        "strict": start_engine("strict", model, kvlease, "fcfs", POOL_BLOCKS, {"fair_slack": 0}),
    }  # fmt: skip
    ways = {}
    for name, engine in engines.items():
        load = TENANTS if name in ("fcfs", "kvlease", "strict") else HOG
        ways[name] = play(engine or engines["kvlease"], steps, load)
        print(f"  {name:8} Jain {ways[name]['jain']:.3f}, heavy {ways[name]['heavy_share']:.0%}")
    result = {
        "steps": steps,
        "pool_blocks": POOL_BLOCKS,
        "tenants": TENANTS,
        "ways": ways,
        "targets": targets(ways),
        "machine": report.machine(),
    }
    name = "fairness-quick" if args.quick else "fairness"
    report.write(args.out, name, result, markdown(result))
    plot(ways, args.out / f"{name}.png")
    print(markdown(result))
    return 0


def plot(ways: dict[str, dict], path: Path) -> None:
    """Weighted service per tenant, one line per way, the tenants named on the axis."""
    report.plot_lines(
        path,
        "Weighted service per tenant (heavy first)",
        "tenant",
        "weighted tokens served",
        {way: (list(w["service"]), list(w["service"].values())) for way, w in ways.items()},
    )


if __name__ == "__main__":
    sys.exit(main())
