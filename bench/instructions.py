"""Scheduler overhead counted, not timed: instructions and simulated cache misses per
scheduled request, stock vLLM against kvlease, under valgrind's callgrind.

    python -m bench.instructions            # 256 running, bench.overhead's three loads
    python -m bench.instructions --quick    # 64 running, 20 steps (smoke test)

Wall-clock ratios on a shared 2-core machine spread (`bench.overhead --solo` read
1.018-1.134 in one row); counts repeat exactly, so a change of a few percent in what
kvlease does is seen at once. Each scheduler runs alone in a process under
`valgrind --tool=callgrind --cache-sim=yes`, built and warmed up as bench.overhead builds
it with valgrind's instrumentation off; the parent then turns it on (`callgrind_control
-i on`). Only the scheduler's own work is counted: its `schedule`, `update_from_output`
and `add_request` (COUNTED) each go through `operator.call`, and callgrind collects only
inside that (`--toggle-collect` of `_operator_call`, the C function behind it), not while
the bench builds requests and model outputs. Python's hash seed is fixed, the heap
frozen as vLLM's EngineCore freezes it, and kvlease's clock follows the steps
(bench.overhead's `Load`), so both schedulers do the same work every run. kvlease's
occupancy sample, which decides nothing, is left out: bench.overhead takes it on busy
time, which valgrind slows fiftyfold (in real time it is about 0.1% of a step).

Per scheduled request the table gives instructions (Ir), first-level cache misses
(instructions and data), last-level misses, and kcachegrind's cycle estimate
Ir + 10 x L1 misses + 100 x LL misses, each as kvlease / stock. The simulated caches are
the machine's own, one core's (`core_caches`: its L1s, and its L2 as callgrind's last
level), with no prefetcher and no branch predictor: the estimate bounds what the extra
instructions and misses cost, the wall ratio says what they cost.
Results: bench/results/instructions.*
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib
import json
import operator
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import report
from bench.overhead import LOADS, SOLO, TIME_TARGET, Load, _load, build, time_steps

RESULTS = Path(__file__).parent / "results"
L1_MISS, LL_MISS = 10, 100  # kcachegrind's cycle estimate: cycles per miss
# The scheduler's methods the engine core calls: the only code counted. Counting all of
# bench.overhead's step (building the requests and the model output too) added about
# 9,000 instructions a request to both and read kvlease 0.2-1.3 points lower.
COUNTED = ("schedule", "update_from_output", "add_request")
STEPS = (20, 300)  # counted steps: --quick, full
# sysfs's (level, type) of a core's own caches -> callgrind's option (`core_caches`)
CACHE_OPTIONS = {("1", "Instruction"): "I1", ("1", "Data"): "D1", ("2", "Unified"): "LL"}


def prepared(
    kind: str,
    model: str,
    n: int,
    pressure: bool,
    chat: bool,
    wrap: Callable[[Any], Any],
    settings: dict | None = None,
) -> Load:
    """A scheduler of SOLO's `kind` (kvlease `settings` beside the shipped ones), built and
    warmed up as bench.overhead builds it, its COUNTED methods each replaced by
    `wrap(method)`, its occupancy sample left out (see the module docstring) and the heap
    frozen as vLLM's EngineCore freezes it: ready for its counted or traced steps."""
    module, cls = SOLO[kind].split(":")
    scheduler_cls = getattr(importlib.import_module(module), cls)
    load = build(scheduler_cls, model, n, pressure, kvlease=settings, chat=chat)
    load.sample_if_due = lambda: None  # type: ignore[method-assign]
    for method in COUNTED:
        setattr(load.scheduler, method, wrap(getattr(load.scheduler, method)))
    gc.collect()
    gc.freeze()
    return load


def counted(name: str, model: str, n: int, pressure: bool, chat: bool, steps: int) -> None:
    """The child: build and warm one scheduler, say `ready`, wait for `go` (the parent has
    turned instrumentation on), run `steps` steps, each of the scheduler's COUNTED calls
    inside `operator.call`, print the requests they scheduled."""

    def window(method: Any) -> Any:  # each call goes through operator.call: the counted window
        return functools.partial(operator.call, method)

    load = prepared(name, model, n, pressure, chat, window)
    print("ready", flush=True)
    sys.stdin.readline()
    _, scheduled = time_steps(load, steps)
    print(json.dumps({"scheduled": scheduled * steps}), flush=True)


def core_caches(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> dict[str, str]:
    """This machine's caches private to one core, as callgrind's options: first-level
    instruction and data, and the second level as callgrind's last level (`--LL`), so
    its "LL misses" are the accesses that leave the core. Valgrind's own detection read a
    64 MB last level on a virtual machine whose L3 is 8 MB, shared with its neighbours:
    every miss of the core's L2 went uncounted. Empty where sysfs does not say, or gives
    a geometry callgrind refuses (a set count not a power of two): valgrind then detects."""
    found: dict[str, str] = {}
    for index in sorted(root.glob("index*")):
        try:
            level, kind, size, ways, line = (
                (index / f).read_text().strip()
                for f in ("level", "type", "size", "ways_of_associativity",
                          "coherency_line_size")
            )  # fmt: skip
        except OSError:
            continue
        name = CACHE_OPTIONS.get((level, kind))
        if name and size.endswith("K"):
            nbytes, block = int(size[:-1]) * 1024, int(ways) * int(line)
            sets = nbytes // block if block else 0
            if sets and sets * block == nbytes and sets & (sets - 1) == 0:  # 2^k sets only
                found[name] = f"{nbytes},{ways},{line}"
    return found if len(found) == 3 else {}


def count(name: str, model: str, n: int, pressure: bool, chat: bool, steps: int) -> dict:
    """Run `counted` under callgrind; its event totals and requests scheduled."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        job = json.dumps([name, model, n, pressure, chat, steps])
        caches = [f"--{level}={geometry}" for level, geometry in core_caches().items()]
        argv = [
            "valgrind", "--tool=callgrind", "--cache-sim=yes", *caches, "--instr-atstart=no",
            "--collect-atstart=no", "--toggle-collect=_operator_call",
            f"--callgrind-out-file={out}",
            sys.executable, "-m", "bench.instructions", "--counted", job,
        ]  # fmt: skip
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        log = Path(tmp) / "stderr"
        with log.open("w") as stderr:
            child = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                text=True, env=env,
            )  # fmt: skip
        assert child.stdin is not None and child.stdout is not None

        def failed() -> RuntimeError:
            return RuntimeError(f"{name} under callgrind failed: {log.read_text()[-2000:]}")

        lines = iter(child.stdout.readline, "")
        if next((line for line in lines if line.strip() == "ready"), None) is None:
            child.wait()
            raise failed()
        subprocess.run(["callgrind_control", "-i", "on", str(child.pid)], check=True,
                       capture_output=True)  # fmt: skip
        child.stdin.write("go\n")
        child.stdin.flush()
        rest = list(lines)
        if child.wait() != 0 or not rest:
            raise failed()
        figure = json.loads(rest[-1])
        totals, caches = _totals(out)
    return {**totals, "scheduled": figure["scheduled"], "caches": caches}


def _totals(path: Path) -> tuple[dict[str, int], list[str]]:
    """The event totals of a callgrind output file, by callgrind's event names, and the
    caches it simulated ("I1 cache: 65536 B, 64 B, 4-way associative", ...)."""
    events: list[str] = []
    values: list[int] = []
    caches: list[str] = []
    for line in path.read_text().splitlines():
        if line.startswith("desc:") and " cache: " in line:
            caches.append(line.removeprefix("desc:").strip())
        elif line.startswith("events:"):
            events = line.split()[1:]
        elif line.startswith(("summary:", "totals:")):
            values = [int(v) for v in line.split()[1:]]
    if not events or len(values) != len(events):
        raise RuntimeError(f"no event totals in {path}")
    return dict(zip(events, values, strict=True)), caches


def per_request(totals: dict) -> dict[str, float]:
    """Instructions, L1 and LL misses, and the cycle estimate, per scheduled request."""
    l1 = totals["I1mr"] + totals["D1mr"] + totals["D1mw"]
    ll = totals["ILmr"] + totals["DLmr"] + totals["DLmw"]
    figures = {
        "Ir": totals["Ir"],
        "L1 misses": l1,
        "LL misses": ll,
        "cycles (est.)": totals["Ir"] + L1_MISS * l1 + LL_MISS * ll,
    }
    return {k: v / totals["scheduled"] for k, v in figures.items()}


def row(model: str, n: int, pressure: bool, chat: bool, steps: int) -> dict[str, Any]:
    """Both schedulers counted at once, one process each (two cores)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(SOLO)) as pool:
        jobs = {name: pool.submit(count, name, model, n, pressure, chat, steps) for name in SOLO}
        totals = {name: job.result() for name, job in jobs.items()}
    figures = {name: per_request(t) for name, t in totals.items()}
    return {
        "running": n,
        "pressure": pressure,
        "chat": chat,
        "steps": steps,
        "scheduled": {name: t["scheduled"] for name, t in totals.items()},
        "per_request": figures,
        "ratio": {k: figures["kvlease"][k] / figures["stock"][k] for k in figures["stock"]},
        "caches": totals["stock"]["caches"],  # both processes simulate the same
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| requests | load | stock, instructions per scheduled request | kvlease | "
        "kvlease / stock: instructions | L1 misses | LL misses | cycles (est.) | "
        "target (time) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio, per = r["ratio"], r["per_request"]
        lines.append(
            f"| {r['running']:,} | {_load(r)} | {per['stock']['Ir']:,.0f} | "
            f"{per['kvlease']['Ir']:,.0f} | {ratio['Ir']:.3f} | {ratio['L1 misses']:.3f} | "
            f"{ratio['LL misses']:.3f} | {ratio['cycles (est.)']:.3f} | "
            f"<= {TIME_TARGET[r['pressure']]:.2f}x |"
        )
    return "\n".join(lines)


def options(doc: str, child: str, steps: tuple[int, int]) -> argparse.Namespace:
    """The command line of a bench that runs each scheduler alone in a process of its own
    (this one, bench.bytecodes): `--quick` (64 running, `steps[0]` steps, no pressure),
    `--model`, `--steps` (default `steps[1]`), `--out`, and `--<child>`, the JSON job its
    child process is given."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"64 running, {steps[0]} steps")
    parser.add_argument("--model", default=None, help="default: the demo model's config")
    parser.add_argument("--steps", type=int, default=None, help=f"default {steps[1]}")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(f"--{child}", help=argparse.SUPPRESS)
    return parser.parse_args()


def runs(args: argparse.Namespace, steps: tuple[int, int]) -> tuple[str, int, int, tuple]:
    """(model, requests running, steps, loads) the options ask for."""
    from kvlease.demo.model import ensure_demo_model

    model = args.model or str(ensure_demo_model())
    if args.quick:
        return model, 64, args.steps or steps[0], LOADS[:1]
    return model, 256, args.steps or steps[1], LOADS


def main() -> int:
    args = options(__doc__ or "", "counted", STEPS)
    if args.counted:
        counted(*json.loads(args.counted))
        return 0
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            print(f"bench.instructions needs {tool}: apt-get install valgrind", file=sys.stderr)
            return 2
    model, n, steps, loads = runs(args, STEPS)
    rows = [row(model, n, pressure, chat, steps) for pressure, chat in loads]
    result = {"rows": rows, "machine": report.machine()}
    name = "instructions-quick" if args.quick else "instructions"
    text = f"Simulated caches: {'; '.join(rows[0]['caches'])}.\n\n{table(rows)}\n"
    report.write(args.out, name, result, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
