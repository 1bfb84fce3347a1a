"""Scheduler overhead counted, not timed: instructions and simulated cache misses per
scheduled request, stock vLLM against kvlease, under valgrind's callgrind.

    python -m bench.instructions            # 256 running, bench.overhead's three loads
    python -m bench.instructions --quick    # 64 running, 20 steps (smoke test)

Wall-clock ratios on a shared 2-core machine spread (`bench.overhead --solo` read
1.018-1.134 in one row); counts repeat exactly, so a change of a few percent in what
kvlease does is seen at once. Each scheduler runs alone in a process under
`valgrind --tool=callgrind --cache-sim=yes`, built and warmed up as bench.overhead builds
it with valgrind's instrumentation off; the parent then turns it on (`callgrind_control
-i on`), and callgrind counts only inside the one `operator.call` that runs the counted
steps (`--toggle-collect` of `_operator_call`, the C function behind it). Python's hash
seed is fixed, the heap frozen as vLLM's EngineCore freezes it, and kvlease's clock
follows the steps (bench.overhead's `Load`), so both schedulers do the same work every
run. kvlease's occupancy sample, which decides nothing, is left out: bench.overhead takes
it on busy time, which valgrind slows fiftyfold (in real time it is about 0.1% of a step).

Per scheduled request the table gives instructions (Ir), first-level cache misses
(instructions and data), last-level misses, and kcachegrind's cycle estimate
Ir + 10 x L1 misses + 100 x LL misses, each as kvlease / stock. The simulated caches are
valgrind's model of this machine's (no prefetcher, no branch predictor): the estimate
bounds what the extra instructions and misses cost, the wall ratio says what they cost.
Results: bench/results/instructions.*
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import operator
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import report
from bench.overhead import LOADS, SOLO, TIME_TARGET, _load, build, time_steps

RESULTS = Path(__file__).parent / "results"
L1_MISS, LL_MISS = 10, 100  # kcachegrind's cycle estimate: cycles per miss


def counted(name: str, model: str, n: int, pressure: bool, chat: bool, steps: int) -> None:
    """The child: build and warm one scheduler, say `ready`, wait for `go` (the parent has
    turned instrumentation on), run `steps` steps inside `operator.call`, print the requests
    they scheduled."""
    module, cls = SOLO[name].split(":")
    load = build(getattr(importlib.import_module(module), cls), model, n, pressure, chat=chat)
    load.sample_if_due = lambda: None  # type: ignore[method-assign]  # see the docstring
    gc.collect()
    gc.freeze()
    print("ready", flush=True)
    sys.stdin.readline()
    _, scheduled = operator.call(time_steps, load, steps)
    print(json.dumps({"scheduled": scheduled * steps}), flush=True)


def count(name: str, model: str, n: int, pressure: bool, chat: bool, steps: int) -> dict:
    """Run `counted` under callgrind; its event totals and requests scheduled."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        job = json.dumps([name, model, n, pressure, chat, steps])
        argv = [
            "valgrind", "--tool=callgrind", "--cache-sim=yes", "--instr-atstart=no",
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
        totals = _totals(out)
    return {**totals, "scheduled": figure["scheduled"]}


def _totals(path: Path) -> dict[str, int]:
    """The event totals of a callgrind output file, by callgrind's event names."""
    events: list[str] = []
    values: list[int] = []
    for line in path.read_text().splitlines():
        if line.startswith("events:"):
            events = line.split()[1:]
        elif line.startswith(("summary:", "totals:")):
            values = [int(v) for v in line.split()[1:]]
    if not events or len(values) != len(events):
        raise RuntimeError(f"no event totals in {path}")
    return dict(zip(events, values, strict=True))


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 running, 20 steps")
    parser.add_argument("--model", default=None, help="default: the demo model's config")
    parser.add_argument("--steps", type=int, default=None, help="counted steps (default 300)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--counted", help=argparse.SUPPRESS)  # the child: a JSON job
    args = parser.parse_args()
    if args.counted:
        counted(*json.loads(args.counted))
        return 0
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            print(f"bench.instructions needs {tool}: apt-get install valgrind", file=sys.stderr)
            return 2
    from kvlease.demo.model import ensure_demo_model

    model = args.model or str(ensure_demo_model())
    n, steps = (64, args.steps or 20) if args.quick else (256, args.steps or 300)
    loads = LOADS[:1] if args.quick else LOADS
    rows = [row(model, n, pressure, chat, steps) for pressure, chat in loads]
    result = {"rows": rows, "machine": report.machine()}
    name = "instructions-quick" if args.quick else "instructions"
    report.write(args.out, name, result, table(rows) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
