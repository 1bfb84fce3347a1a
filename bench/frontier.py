"""The operator's reservation knob: leased hit against engine steps, one point per setting.

    python -m bench.frontier            # 64 and 128 blocks, ~10 min here
    python -m bench.frontier --quick    # the 12 s trace, 64 blocks (smoke test)

bench/policy.py's trace, on real in-process vLLM engines (bench/inprocess.py), played once
by stock PRIORITY and by kvlease with every leasing tier's `reserve_quantile` set to each
of QUANTILES, and with `reserve = "never"` and `"lease"` (the knob's two ends), all at
once, one engine step of each in turn. Step figures are deterministic, so one round
suffices; wall time is bench/policy.py's. Per setting: engine steps against PRIORITY's,
the leased next-turn hit of premium and standard (and its share of what a clairvoyant
reservation keeps under the same caps, bench/oracle.py), wasted prefill, premium TTFT
and the free tier's worst TTFT. Results: bench/results/frontier.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

from bench import policy, report
from bench.inprocess import start_engine
from bench.workload import load
from kvlease.demo.workload import TIERS
from kvlease.engine.tenancy import TIERS_ENV, TierTable

SHIPPED = resources.files("kvlease.engine").joinpath("tiers.toml")
QUANTILES = (0.5, 0.75, 0.9, 0.95)
POOLS = (64, 128)
RESULTS = Path(__file__).parent / "results"


def tier_file(text: str, quantile: float, folder: Path) -> Path:
    """The tier table `text` with `reserve_quantile = quantile` in every leasing tier."""
    leasing = [name for name, tier in TierTable.from_toml(text).items() if tier.lease_seconds > 0]
    path = edited_tiers(
        text, folder, f"q{quantile}", {n: {"reserve_quantile": quantile} for n in leasing}
    )
    assert all(
        t.reservation.quantile == quantile for t in TierTable.load(path).values() if t.lease_seconds
    )
    return path


def edited_tiers(text: str, folder: Path, name: str, keys: dict[str, dict[str, Any]]) -> Path:
    """The tier table `text` with `keys[tier]` set in each named tier (a line the tier
    already has for a key is replaced), written to `folder`/tiers-`name`.toml."""
    for tier, values in keys.items():
        header = f"[tiers.{tier}]\n"
        start = text.index(header) + len(header)
        end = text.find("\n[", start) + 1 or len(text)
        lines = [
            line for line in text[start:end].splitlines(keepends=True)
            if line.split("=")[0].strip() not in values
        ]  # fmt: skip
        added = [f"{key} = {json.dumps(value)}\n" for key, value in values.items()]
        text = text[:start] + "".join(added + lines) + text[end:]
    path = folder / f"tiers-{name}.toml"
    path.write_text(text)
    return path


def settings_by_way(folder: Path) -> dict[str, dict[str, Any]]:
    """Each setting's `additional_config.kvlease` (the tier table in force, changed)."""
    chosen = os.environ.get(TIERS_ENV)
    text = Path(chosen).read_text() if chosen else SHIPPED.read_text(encoding="utf-8")
    ways = {f"q={q}": {"tiers": str(tier_file(text, q, folder))} for q in QUANTILES}
    return {"reserve-never": {"reserve": "never"}, **ways, "reserve-lease": {"reserve": "lease"}}


def measure(model: str, pool: int, turns: list, folder: Path) -> dict[str, Any]:
    """Every setting and stock PRIORITY on `pool` blocks, played together once."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvlease.engine.vllm_scheduler import TenantAwareScheduler

    tiers = TierTable.load()
    caps = tiers.leased_caps(pool - 1)
    engines = {"priority": start_engine("priority", model, Scheduler, "priority", pool)}
    for way, settings in settings_by_way(folder).items():
        engines[way] = start_engine(way, model, TenantAwareScheduler, "fcfs", pool, settings)
    runs = policy.play_together([(e, name) for name, e in engines.items()], turns, 10.0, tiers)
    return {
        name: policy.summarize(run, tiers, caps) for name, run in zip(engines, runs, strict=True)
    }


def markdown(pools: dict[str, dict[str, Any]]) -> str:
    lines = []
    for pool, ways in pools.items():
        lines += [f"**{pool} blocks**", ""]
        lines += report.ablation_rows(
            ways, list(ways), None, "", TIERS, bound="leased_prefix_shared_bound"
        )
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the 12 s trace, 64 blocks")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["HF_HUB_OFFLINE"] = "1"
    from kvlease.demo.model import ensure_demo_model

    model = str(ensure_demo_model())
    turns = load(args.quick, None, False)
    folder = Path(tempfile.mkdtemp(prefix="kvlease-frontier-"))
    pools = {}
    for pool in POOLS[:1] if args.quick else POOLS:
        pools[str(pool)] = measure(model, pool, turns, folder)
        print(f"  {pool} blocks: done", flush=True)
    result = {"pools": pools, "quantiles": QUANTILES, "machine": report.machine()}
    name = "frontier-quick" if args.quick else "frontier"
    text = markdown(pools)
    report.write(args.out, name, result, text)
    report.plot_frontier_pools(args.out / f"{name}.png", pools, TIERS[:2])
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
