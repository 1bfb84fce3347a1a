"""Scheduler overhead: TenantAwareScheduler against vLLM's own Scheduler, no model.

    python -m bench.overhead            # 64, 256 and 1,024 running requests, three loads
    python -m bench.overhead --quick    # fewer timed steps (smoke test)
    python -m bench.overhead --mechanisms   # and kvlease with each mechanism off
    python -m bench.overhead --solo     # one scheduler per process, processes alternating

Each is a real vLLM scheduler built as the engine builds it
(replay/synthetic.py) and fed a synthetic model output each step, so only
scheduling is timed: one `schedule()` plus `update_from_output()`, and the
scheduler's `add_request` for each request that arrives before the next step (the
engine core calls it between steps; building the request is not timed). Each
request has a 60-token prompt and 64 output tokens; whenever requests finish,
as many new ones arrive, so the engine stays in a
steady state of prefills and decodes with `n` requests running at most
(`max_num_seqs`) and a backlog of n/4 waiting:
- no pressure: the pool holds every request at its largest (4 blocks), beside
  every tier's leases at their caps (every scheduler's pool);
- pressure: the pool holds 3 blocks per running request, so growing requests
  are preempted every few steps and re-admitted. The schedulers may run different
  numbers of requests a step here: the ratio per scheduled request compares the cost
  of the same work. Two more kvleases show what the reservations take from the
  requests scheduled per step (nothing reserved: `reserve = never`) and what the
  policy costs beside kvlease's bookkeeping (tier queues, attribution, accounting),
  which stays on (every mechanism off: EVERY_MECHANISM_OFF). With `--mechanisms`, five
  more each turn one other mechanism off (MECHANISMS_OFF, named as bench/policy's
  ablations), a run of its own: eleven schedulers in the rotation instead of six
  read kvlease a few points higher against stock, so the headline runs without them;
- pressure, chat turns: the same pool, and requests that are the turns of chat
  sessions (`Load`'s chat mode: three turns, each prompt the session's context so far
  plus 4 tokens, 32-token replies), so sessions end turns, think and come back, and
  kvlease's reservation windows open. Stock, smaller requests in the same pool, runs
  short less often here (at 1,024 running never: the step's token budget binds first);
  kvlease's reservations may make it. A second table gives what they
  hold back (the most blocks reserved, the requests scheduled a step beside kvlease
  with nothing reserved) and what they buy: each next turn's share of its earlier
  context found in the prefix cache, per tier.
Requests come from 32 tenants in the three tiers (1:3:8), each carrying its tier's
priority, as kvlease's middleware sets it. Stock is vLLM's default FCFS; stock PRIORITY
(`--scheduling-policy priority`), which orders the waiting queue by tier and preempts
the least important, is timed in the same rotation: it is what an operator runs for
tiers without kvlease, and the policy benchmark's baseline. In the first two loads each
tenant has one session, always with requests in flight, so no turn ends and no
reservation window opens: they time the reservation's bookkeeping, not what it holds
back; the chat load does both.
The schedulers (stock, stock PRIORITY, the kvleases, and stock again for the noise
floor) are timed together, one step of each in turn, so every one meets the same drift
of the machine's speed, each going first in turn, `--repeats` times, with the heap
frozen for the garbage collector as vLLM's EngineCore freezes it after start. A step time
is the fastest repeat's mean step, as timeit reports; a ratio is the median of the
repeats' ratios, and the targets table gives their range.
kvlease's clock follows the steps (TICK seconds each), so its decisions, and with them
requests scheduled a step, preemptions and next-turn hits, repeat to the token; only its
occupancy sample, which decides nothing, comes on its busy time (`Load.sample_if_due`).
With `--solo`, stock and kvlease each run alone in a process of their own, as an engine
core runs one scheduler, processes alternating (stock first, then kvlease first) so both
meet the same drift; a pair's ratio is kvlease's fastest repeat over stock's, per scheduled
request, and the figure is the median over the pairs. Sharing a process and a rotation
reads kvlease a few points higher without pressure: each scheduler's data is colder when
its turn comes, and kvlease touches more of it.
Results: bench/results/overhead.* (overhead-mechanisms.* with `--mechanisms`,
overhead-solo.* with `--solo`)
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

from bench import report
from bench.policy import ABLATION_SETTINGS
from kvlease.demo.workload import TIERS
from kvlease.engine.settings import SAMPLE_SECONDS
from kvlease.engine.tenancy import TierTable
from kvlease.replay.synthetic import BLOCK, Policy, make_request, make_scheduler, step

SIZES = (64, 256, 1024)
LOADS = ((False, False), (True, False), (True, True))  # (pressure, chat) of each table block
RESULTS = Path(__file__).parent / "results"
PROMPT = 60
OUTPUT = 64  # a request holds 2 blocks at first and 4 at its end
WARMUP_STEPS = 2 * OUTPUT  # past the first wave: arrivals and finishes are mixed
# The chat load: sessions of CHAT_TURNS turns, each turn's prompt its session's context so
# far plus CHAT_NEW tokens (the first CHAT_FIRST), each reply CHAT_OUTPUT tokens: at most
# 5 blocks a request, as the steady load's 4
CHAT_TURNS, CHAT_FIRST, CHAT_NEW, CHAT_OUTPUT = 3, 28, 4, 32
# kvlease with every mechanism it can switch off switched off (bench.policy's ablations at
# once): what the mechanisms cost, in time and in requests scheduled per step
EVERY_MECHANISM_OFF = {
    "reserve": "never",
    "lease_order": False,
    "admission_preemption": False,
    "class_service": False,
    "fair_share": False,
    "victim_rule": "lru",
}
# One mechanism off at a time: bench.policy's ablations that turn one off (`reserve-never`
# is `kvlease-unreserved`; `reserve-lease`, `strict-fair` and `lru` change one instead):
# what each costs per scheduled request
MECHANISMS_OFF = {
    name: ABLATION_SETTINGS[name]
    for name in ("no-lease-order", "no-admission", "fifo", "fcfs-service", "no-payback")
}
SHIPPED = TierTable.shipped()  # the tiers, their priorities and lease caps
# Issue 30's targets: scheduler time per scheduled request over stock's, by pressure
TIME_TARGET = {False: 1.05, True: 1.10}
# kvlease's clock: TICK seconds a step, a loaded GPU engine's pace. The chat load's
# sessions think about 60 steps (3 s) between turns; a lease (60 s, 300 s) outlasts the run.
TICK = 0.05
SAMPLES_OFF = {"sample_seconds": 1e9}  # kvlease's own clock never finds a sample due


def tier_of(i: int) -> str:
    return TIERS[0] if i % 12 == 0 else TIERS[1] if i % 12 < 4 else TIERS[2]


class Load:
    """Keeps `n + n // 4` requests in the scheduler: one arrives for each that finishes.

    Steady (the default): request i comes from tenant i % 32's one session, which thus
    always has requests in flight: no turn ever ends. `chat`: each session has one request
    in flight at most and CHAT_TURNS turns; when a turn ends the session thinks while as
    many others are in flight as the load keeps, then the one that has thought longest
    sends its next turn, so reservation windows open and close as on a chat service."""

    def __init__(self, scheduler: Any, n: int, chat: bool = False) -> None:
        self.scheduler, self.target, self.chat = scheduler, n + n // 4, chat
        self.sent: list[Any] = []  # every request, to count preemptions at the end
        self.busy = 0.0  # seconds this scheduler has spent in its own steps
        # chat: (tenant index, session, turn, prompt) by request in flight, the sessions
        # thinking (their next turn and context), the sessions started and turns sent
        # back, and per tier what returning turns found cached of their context
        self.in_flight: dict[str, tuple[int, str, int, list[int]]] = {}
        self.thinking: deque[tuple[int, str, int, list[int]]] = deque()
        self.sessions = self.turns_back = self.tokens = 0
        self.context = dict.fromkeys(TIERS, 0)  # whole-block tokens of earlier turns
        self.cached = dict.fromkeys(TIERS, 0)  # of those, found in the prefix cache
        self.hits: dict[str, int] = {}  # request id -> its prefix-cache hit when scheduled
        self.reserved_most = 0  # kvlease: most blocks reserved after a step
        self.steps = 0  # steps this scheduler has taken
        self.adds, self.add_seconds = 0, 0.0  # its `add_request` calls and their time
        self.sampled = 0.0  # its busy time at kvlease's last occupancy sample
        self.kv = getattr(scheduler, "kvlease", None)  # kvlease's state; None on stock
        if self.kv is not None:
            # kvlease's clock follows the steps, TICK seconds each, so what it decides on
            # that clock (reservation windows from the think times sessions show, leases)
            # repeats to the token, whatever the machine's speed. Its occupancy sample,
            # which decides nothing, is taken by `sample_if_due` on its busy time instead
            # (SAMPLES_OFF keeps its own clock from taking it): as often a step as on an
            # engine that only schedules, however many schedulers take turns with it.
            origin = self.kv.clock()
            self.kv.clock = lambda: origin + self.steps * TICK
        self.top_up()

    def sample_if_due(self) -> None:
        """kvlease's occupancy sample, every SAMPLE_SECONDS of this scheduler's busy time
        (inside the timed step: what `schedule()` does first when a sample is due)."""
        if self.kv is not None and self.busy - self.sampled >= SAMPLE_SECONDS:
            self.scheduler.sample_accounting()
            self.sampled = self.busy

    def note(self, outputs: dict) -> None:
        """A step's outputs (outside the timed part): each chat request's prefix-cache hit,
        from its first scheduling's prefill stats."""
        if not self.chat:
            return
        for batch in outputs.values():
            for o in batch.outputs:
                if o.prefill_stats is not None and o.request_id not in self.hits:
                    self.hits[o.request_id] = o.prefill_stats.num_cached_tokens

    def top_up(self) -> float:
        """New requests for those that finished; returns the seconds the scheduler's
        `add_request` took for them (scheduler time: the engine core calls it between
        steps), not counting building them."""
        if self.kv is not None:
            self.reserved_most = max(self.reserved_most, self.kv.free_queue.reserved_blocks)
        if self.chat:
            self._end_turns()
        took = 0.0
        while len(self.scheduler.requests) < self.target:
            request = self._chat_turn() if self.chat else self._steady()
            started = time.perf_counter()
            self.scheduler.add_request(request)
            took += time.perf_counter() - started
            self.sent.append(request)
            self.adds += 1
        self.add_seconds += took
        return took

    def _steady(self) -> Any:
        i = len(self.sent) % 32
        return self._request(i, PROMPT, OUTPUT, f"t{i:02d}")

    def _chat_turn(self) -> Any:
        if len(self.thinking) > self.target:  # as many think as are in flight, about
            i, session, turn, context = self.thinking.popleft()
            prompt = context + self._fresh(CHAT_NEW)
            self.turns_back += 1
        else:
            i, session, turn = self.sessions % 32, f"c{self.sessions}", 0
            prompt = self._fresh(CHAT_FIRST)
            self.sessions += 1
        request = self._request(i, len(prompt), CHAT_OUTPUT, session, prompt)
        self.in_flight[request.request_id] = (i, session, turn, prompt)
        return request

    @staticmethod
    def _request(
        i: int, prompt_len: int, output: int, session: str, prompt: list[int] | None = None
    ) -> Any:
        """A request of tenant i, with its tier's priority as kvlease's middleware sets it
        (stock FCFS and kvlease ignore it; stock PRIORITY orders by it)."""
        tier = tier_of(i)
        priority = SHIPPED[tier].priority
        return make_request(
            f"t{i:02d}", tier, prompt_len, output, session, prompt=prompt, priority=priority
        )

    def _fresh(self, count: int) -> list[int]:
        """New prompt tokens (the replay's model always answers token 7)."""
        self.tokens += count
        return [(self.tokens * 31 + k) % 600 + 10 for k in range(count)]

    def _end_turns(self) -> None:
        for rid in [rid for rid in self.in_flight if rid not in self.scheduler.requests]:
            i, session, turn, prompt = self.in_flight.pop(rid)
            hit = self.hits.pop(rid, 0)
            if turn:  # a next turn: how much of its earlier turns' context was kept
                kept = (len(prompt) - CHAT_NEW) // BLOCK * BLOCK
                self.context[tier_of(i)] += kept
                self.cached[tier_of(i)] += min(kept, hit)
            if turn + 1 < CHAT_TURNS:
                self.thinking.append((i, session, turn + 1, prompt + [7] * CHAT_OUTPUT))

    def preemptions(self) -> int:
        return sum(r.num_preemptions for r in self.sent)


def build(
    cls: type,
    model: str,
    n: int,
    pressure: bool,
    kvlease: dict | None = None,
    chat: bool = False,
    policy: Policy = "fcfs",
) -> Load:
    largest = -(-(PROMPT + OUTPUT) // BLOCK)
    blocks = n * 3 + 1 if pressure else pool_with_lease_room((n + n // 4) * largest)
    kvlease = {**(kvlease or {}), **SAMPLES_OFF}  # `Load` takes the samples (stock reads none)
    scheduler = make_scheduler(cls, model, blocks, max_num_seqs=n, kvlease=kvlease, policy=policy)
    load = Load(scheduler, n, chat)
    time_steps(load, WARMUP_STEPS)
    return load


def pool_with_lease_room(live_blocks: int) -> int:
    """The smallest pool in which `live_blocks` stay free for live requests beside every
    lease at its cap, plus vLLM's null block: without pressure, leases (which reserve
    blocks from lower tiers) must not make kvlease run short where stock does not."""
    usable = live_blocks
    while SHIPPED.max_request_tokens(usable, 1) < live_blocks:
        usable += 1
    return usable + 1


def time_steps(load: Load, steps: int) -> tuple[float, float]:
    """Mean seconds per step (with its arrivals' `add_request`), and the mean number of
    requests scheduled in them."""
    return time_together([load], steps)[0]


def time_together(loads: list[Load], steps: int) -> list[tuple[float, float]]:
    """`time_steps` for every load at once, one step of each in turn: this machine's
    speed drifts within a run, and interleaved, every scheduler meets the same drift."""
    scheduled, seconds = [0] * len(loads), [0.0] * len(loads)
    for _ in range(steps):
        for i, load in enumerate(loads):
            started = time.perf_counter()
            load.sample_if_due()
            out, outputs = step(load.scheduler)
            took = time.perf_counter() - started
            load.steps += 1
            load.note(outputs)
            took += load.top_up()  # the arrivals before its next step
            seconds[i] += took
            load.busy += took
            scheduled[i] += len(out.num_scheduled_tokens)
    return [(seconds[i] / steps, scheduled[i] / steps) for i in range(len(loads))]


def measure(
    model: str,
    n: int,
    pressure: bool,
    steps: int,
    repeats: int,
    chat: bool = False,
    mechanisms: bool = False,
) -> dict[str, Any]:
    """One row: every scheduler timed together; with `mechanisms`, five more kvleases,
    each with one mechanism off (MECHANISMS_OFF), in the same rotation."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvlease.engine.vllm_scheduler import TenantAwareScheduler

    # A second stock scheduler, built after kvlease's, measures the noise floor: two
    # identical schedulers in one process differ by their place in memory and in the
    # rotation (up to 13% at 1,024 running on this machine).
    classes: dict[str, tuple[type, dict | None, Policy]] = {
        "stock": (Scheduler, None, "fcfs"),
        "stock-priority": (Scheduler, None, "priority"),
        "kvlease": (TenantAwareScheduler, None, "fcfs"),
        "stock-again": (Scheduler, None, "fcfs"),
        "kvlease-unreserved": (TenantAwareScheduler, {"reserve": "never"}, "fcfs"),
        "kvlease-off": (TenantAwareScheduler, EVERY_MECHANISM_OFF, "fcfs"),
    }
    if mechanisms:
        classes.update(
            (f"kvlease-{name}", (TenantAwareScheduler, settings, "fcfs"))
            for name, settings in MECHANISMS_OFF.items()
        )
    loads = {
        name: build(cls, model, n, pressure, kv, chat, policy)
        for name, (cls, kv, policy) in classes.items()
    }
    gc.collect()
    gc.freeze()  # as vLLM's EngineCore does once started: full collections skip this heap
    # Each repeat's mean step and requests scheduled per step, per scheduler.
    seconds: dict[str, list[float]] = {name: [] for name in classes}
    scheduled: dict[str, list[float]] = {name: [] for name in classes}
    names = list(classes)
    adding: dict[str, list[float]] = {name: [] for name in classes}  # per arrival
    for i in range(repeats):
        rotated = report.rotated(names, i)
        before = {name: (loads[name].adds, loads[name].add_seconds) for name in names}
        timed = time_together([loads[name] for name in rotated], steps)
        for name, (took, count) in zip(rotated, timed, strict=True):
            seconds[name].append(took)
            scheduled[name].append(count)
            adds, add_seconds = before[name]
            if loads[name].adds > adds:
                adding[name].append(
                    (loads[name].add_seconds - add_seconds) / (loads[name].adds - adds)
                )
    per_step = {name: statistics.mean(counts) for name, counts in scheduled.items()}

    def ratios(name: str, per_request: bool = True, base: str = "stock") -> list[float]:
        """`name`'s time (per scheduled request) over `base`'s in each repeat. In a repeat
        every scheduler steps in turn, so both meet the same host; the fastest repeats of
        two schedulers may be different repeats."""
        return [
            (seconds[name][i] / (scheduled[name][i] if per_request else 1))
            / (seconds[base][i] / (scheduled[base][i] if per_request else 1))
            for i in range(repeats)
        ]

    def ratio(name: str, per_request: bool = True, base: str = "stock") -> float:
        """The median of `ratios`."""
        return statistics.median(ratios(name, per_request, base))

    spread = ratios("kvlease")  # per scheduled request, against stock

    row = {
        "running": n,
        "pressure": pressure,
        "chat": chat,
        "scheduled_per_step": per_step,
        "stock_us": min(seconds["stock"]) * 1e6,
        "kvlease_us": min(seconds["kvlease"]) * 1e6,
        "ratio": ratio("kvlease", per_request=False),
        "ratio_per_request": statistics.median(spread),
        "ratio_per_request_range": (min(spread), max(spread)),  # over the repeats
        "stock_again_ratio": ratio("stock-again", per_request=False),
        # against stock PRIORITY, per scheduled request: kvlease, and PRIORITY against stock
        "priority_ratio_per_request": ratio("kvlease", base="stock-priority"),
        "priority_over_stock_per_request": ratio("stock-priority"),
        "unreserved_ratio_per_request": ratio("kvlease-unreserved"),
        # each scheduler's `add_request`, microseconds per arriving request (part of its
        # steps): the fastest repeat's mean, as for the steps (a collection of the garbage
        # collector's that happens to start in one costs a millisecond or more)
        "add_us": {k: min(v, default=0.0) * 1e6 for k, v in adding.items()},
        "off_ratio_per_request": ratio("kvlease-off"),
        "requests_sent": {k: len(load.sent) for k, load in loads.items()},
        "preemptions": {k: load.preemptions() for k, load in loads.items()},
        "turns_back": {k: load.turns_back for k, load in loads.items()},
        "reserved_most": loads["kvlease"].reserved_most,
        "pool_blocks": loads["kvlease"].scheduler.kv_cache_manager.block_pool.num_gpu_blocks,
        # per scheduler and tier: the share of returning turns' earlier context found cached
        "next_turn_hit": {
            k: {t: load.cached[t] / load.context[t] for t in TIERS if load.context[t]}
            for k, load in loads.items()
        },
    }
    if mechanisms:  # one mechanism off at a time, per scheduled request against stock
        row["mechanism_off_ratio_per_request"] = {
            name: ratio(f"kvlease-{name}") for name in MECHANISMS_OFF
        }
    return row


SOLO_SIZES = (256, 1024)  # the sizes issue 30's time targets are set at
SOLO = {  # module:class, imported in its own process
    "stock": "vllm.v1.core.sched.scheduler:Scheduler",
    "kvlease": "kvlease.engine.vllm_scheduler:TenantAwareScheduler",
}


def alone(
    name: str, model: str, n: int, pressure: bool, chat: bool, steps: int, repeats: int
) -> dict[str, Any]:
    """One scheduler in this process, nothing else built: its fastest repeat's mean step
    per scheduled request (us), and the process that ran it."""
    module, cls = SOLO[name].split(":")  # only its own: no kvlease scheduler beside stock
    load = build(getattr(importlib.import_module(module), cls), model, n, pressure, chat=chat)
    gc.collect()
    gc.freeze()
    per_request = []
    for _ in range(repeats):
        seconds, scheduled = time_steps(load, steps)
        per_request.append(seconds / scheduled * 1e6)
    return {"name": name, "us_per_request": min(per_request), "pid": os.getpid()}


def solo(
    model: str, n: int, pressure: bool, chat: bool, steps: int, repeats: int, pairs: int
) -> dict[str, Any]:
    """One row of `--solo`: `pairs` pairs of processes, each running `alone`."""
    runs: dict[str, list[float]] = {name: [] for name in SOLO}
    pids = set()
    for i in range(pairs):
        for name in report.rotated(list(SOLO), i):
            job = [name, model, n, pressure, chat, steps, repeats]
            argv = [sys.executable, "-m", "bench.overhead", "--alone", json.dumps(job)]
            done = subprocess.run(argv, capture_output=True, text=True, check=True)
            figure = json.loads(done.stdout.splitlines()[-1])
            runs[name].append(figure["us_per_request"])
            pids.add(figure["pid"])
    ratios = [k / s for s, k in zip(runs["stock"], runs["kvlease"], strict=True)]
    return {
        "running": n,
        "pressure": pressure,
        "chat": chat,
        "us_per_request": {name: statistics.median(v) for name, v in runs.items()},
        "ratio_per_request": statistics.median(ratios),
        "ratio_per_request_range": (min(ratios), max(ratios)),
        "processes": len(pids),
    }


def solo_table(rows: list[dict]) -> str:
    lines = [
        "| requests | load | stock, us per scheduled request | kvlease | kvlease / stock, "
        "median of the pairs (range) | target |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        us = r["us_per_request"]
        low, high = r["ratio_per_request_range"]
        lines.append(
            f"| {r['running']:,} | {_load(r)} | {us['stock']:.2f} | {us['kvlease']:.2f} | "
            f"{r['ratio_per_request']:.3f} ({low:.3f}-{high:.3f}) | "
            f"<= {TIME_TARGET[r['pressure']]:.2f}x |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer timed steps")
    parser.add_argument("--model", default=None, help="default: the demo model's config")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--mechanisms", action="store_true",
        help="also time kvlease with each mechanism off, in the same rotation (a run of its "
        "own: overhead-mechanisms.*; more schedulers in the rotation read kvlease higher)",
    )  # fmt: skip
    parser.add_argument(
        "--solo", action="store_true",
        help="stock and kvlease each alone in a process, processes alternating "
        "(overhead-solo.*)",
    )  # fmt: skip
    parser.add_argument("--pairs", type=int, default=None, help="--solo: pairs of processes")
    parser.add_argument("--alone", help=argparse.SUPPRESS)  # --solo's child: a JSON job
    args = parser.parse_args()
    if args.alone:
        print(json.dumps(alone(*json.loads(args.alone))))
        return 0
    from kvlease.demo.model import ensure_demo_model

    model = args.model or str(ensure_demo_model())
    suffix = "-quick" if args.quick else ""
    if args.solo:
        steps, repeats, pairs = (
            (20, 2, 1) if args.quick else (200, args.repeats or 5, args.pairs or 5)
        )
        sizes = (64,) if args.quick else SOLO_SIZES
        rows = [
            solo(model, n, pressure, chat, steps, repeats, pairs)
            for pressure, chat in LOADS
            for n in sizes
        ]
        result = {"steps": steps, "repeats": repeats, "pairs": pairs, "rows": rows}
        result["machine"] = report.machine()
        report.write(args.out, f"overhead-solo{suffix}", result, solo_table(rows) + "\n")
        print(solo_table(rows))
        return 0
    steps, repeats = (20, 3) if args.quick else (100, args.repeats or 7)
    rows = []
    for pressure, chat in LOADS:
        for n in SIZES:
            row = measure(model, n, pressure, steps, repeats, chat, args.mechanisms)
            rows.append(row)
            print(
                f"  {n:5} running, {_load(row):22}: "
                f"stock {row['stock_us']:8.0f} us, kvlease {row['kvlease_us']:8.0f} us, "
                f"ratio {row['ratio']:.3f} (stock / stock {row['stock_again_ratio']:.3f})",
                flush=True,
            )
    if args.mechanisms:
        result = {"steps": steps, "repeats": repeats, "rows": rows, "machine": report.machine()}
        report.write(args.out, f"overhead-mechanisms{suffix}", result, mechanisms(rows) + "\n")
        print(mechanisms(rows))
        return 0
    targets = [
        {
            "target": f"Scheduler time per scheduled request at {r['running']:,} running"
            f"{', ' + _load(r) if r['pressure'] else ''}, vs stock",
            "wanted": f"<= {TIME_TARGET[r['pressure']]:.2f}x",
            "measured": r["ratio_per_request"],
            "range": r["ratio_per_request_range"],
            "met": r["ratio_per_request"] <= TIME_TARGET[r["pressure"]],
        }
        for r in rows
        if r["running"] >= 256
    ] + [
        {
            "target": f"Requests scheduled per step at {r['running']:,} running, {_load(r)}, "
            "vs stock",
            "wanted": ">= 0.95x",
            "measured": r["scheduled_per_step"]["kvlease"] / r["scheduled_per_step"]["stock"],
            "met": r["scheduled_per_step"]["kvlease"] >= 0.95 * r["scheduled_per_step"]["stock"],
        }
        for r in rows
        if r["pressure"]
    ]
    result = {
        "steps": steps,
        "repeats": repeats,
        "rows": rows,
        "targets": targets,
        "machine": report.machine(),
    }
    report.write(args.out, f"overhead{suffix}", result, markdown(result))
    plot(rows, args.out / f"overhead{suffix}.png")
    print(markdown(result))
    return 0


def plot(rows: list[dict], path: Path) -> None:
    """The picture: per load, kvlease's time per scheduled request over stock's, with
    issue 30's targets."""
    report.plot_lines(
        path,
        "Scheduler time per scheduled request, kvlease / stock",
        "running requests",
        "ratio (median of the repeats)",
        series(rows),
        {f"target, {'pressure' if p else 'no pressure'}": TIME_TARGET[p] for p in (False, True)},
    )


def series(rows: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """The plot's lines: per load, running requests against kvlease's time per scheduled
    request over stock's."""
    lines: dict[str, tuple[list[int], list[float]]] = {}
    for r in rows:
        xs, ys = lines.setdefault(_load(r), ([], []))
        xs.append(r["running"])
        ys.append(r["ratio_per_request"])
    return lines


def _load(row: dict) -> str:
    if not row["pressure"]:
        return "no pressure"
    return "pressure, chat turns" if row["chat"] else "pressure"


def markdown(result: dict) -> str:
    lines = [
        "| requests | load | scheduled per step (stock / kvlease / kvlease, nothing "
        "reserved / every mechanism off) | stock us/step | kvlease us/step | ratio per step "
        "| ratio per scheduled request (nothing reserved / every mechanism off) "
        "| the same against stock PRIORITY (PRIORITY against stock) "
        "| noise floor: stock / stock |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['running']:,} | {_load(r)} | "
            f"{r['scheduled_per_step']['stock']:.0f} / {r['scheduled_per_step']['kvlease']:.0f}"
            f" / {r['scheduled_per_step']['kvlease-unreserved']:.0f}"
            f" / {r['scheduled_per_step']['kvlease-off']:.0f}"
            f" | {r['stock_us']:.0f} | "
            f"{r['kvlease_us']:.0f} | {r['ratio']:.3f} | {r['ratio_per_request']:.3f} "
            f"({r['unreserved_ratio_per_request']:.3f} / {r['off_ratio_per_request']:.3f})"
            f" | {r['priority_ratio_per_request']:.3f}"
            f" ({r['priority_over_stock_per_request']:.3f})"
            f" | {r['stock_again_ratio']:.3f} |"
        )
    return (
        "\n".join(lines)
        + "\n\n"
        + bought(result["rows"])
        + "\n\n"
        + arrivals(result["rows"])
        + "\n\n"
        + report.targets_table(result["targets"])
        + "\n"
    )


def mechanisms(rows: list[dict]) -> str:
    """Each mechanism's cost, by turning it off: kvlease's time per scheduled request over
    stock's, as shipped, with one mechanism off, and with every one off."""
    names = ("reserve-never", *MECHANISMS_OFF)
    lines = [
        "| requests | load | kvlease | " + " | ".join(names) + " | every mechanism off |",
        "|---|---|---|" + "---|" * (len(names) + 1),
    ]
    for r in rows:
        off = {"reserve-never": r["unreserved_ratio_per_request"]}
        off.update(r["mechanism_off_ratio_per_request"])
        lines.append(
            f"| {r['running']:,} | {_load(r)} | {r['ratio_per_request']:.3f} | "
            + " | ".join(f"{off[name]:.3f}" for name in names)
            + f" | {r['off_ratio_per_request']:.3f} |"
        )
    return "\n".join(lines)


def arrivals(rows: list[dict]) -> str:
    """What one arriving request costs each scheduler in `add_request` (part of the steps'
    times above): kvlease classifies it (tenant, tier, session, lease, fair-share account)
    and files it in its tier's queue."""
    names = ("stock", "stock-priority", "kvlease", "kvlease-off")
    lines = [
        "| requests | load | add_request, us per arriving request (stock / stock PRIORITY "
        "/ kvlease / every mechanism off) |",
        "|---|---|---|",
    ]
    for r in rows:
        figures = " / ".join(f"{r['add_us'][name]:.1f}" for name in names)
        lines.append(f"| {r['running']:,} | {_load(r)} | {figures} |")
    return "\n".join(lines)


def bought(rows: list[dict]) -> str:
    """Under the chat load: what kvlease's reservations hold back and what they buy, the
    next turns' share of their earlier context found in the prefix cache, per scheduler."""
    names = ("stock", "kvlease", "kvlease-unreserved")
    lines = [
        "| requests (pressure, chat turns) | kvlease reserved at most, blocks of the pool "
        "| requests a step (stock / kvlease / nothing reserved) "
        "| next-turn hit, premium (stock / kvlease / nothing reserved) | standard |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if not r["chat"]:
            continue
        hits = {
            tier: " / ".join(f"{r['next_turn_hit'][name].get(tier, 0):.0%}" for name in names)
            for tier in TIERS[:2]
        }
        lines.append(
            f"| {r['running']:,} | {r['reserved_most']} of {r['pool_blocks']} | "
            + " / ".join(f"{r['scheduled_per_step'][name]:.0f}" for name in names)
            + f" | {hits[TIERS[0]]} | {hits[TIERS[1]]} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
