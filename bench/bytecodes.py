"""Where the scheduler's extra work goes: Python bytecodes per function, stock vLLM against
kvlease and kvlease with every mechanism off, inside the schedulers' own calls.

    python -m bench.bytecodes            # 256 running, bench.overhead's three loads
    python -m bench.bytecodes --quick    # 64 running, 10 steps, no pressure (smoke test)

bench.instructions counts how much more kvlease's scheduler executes per scheduled request;
this says where. Each scheduler runs alone in a process (Python's hash seed fixed), built
and warmed up as bench.overhead builds it; then for `steps` steps each of its COUNTED calls
runs under `sys.settrace` with opcode events on, and every bytecode executed is counted
against the function it belongs to (its own bytecodes, not its callees'). The three
schedulers are stock (vLLM's FCFS), kvlease as shipped, and kvlease with every mechanism
off (bench.overhead's EVERY_MECHANISM_OFF): kvlease minus that is what the policy's
mechanisms execute, that minus stock what kvlease's bookkeeping does (tier queues,
attribution, accounting) and what vLLM's own code does differently for it. Counts repeat
run to run without chat turns, so a change of one call a request shows; with them
kvlease's decisions moved a little between two runs (see docs/benchmarks.md). A
bytecode is not a fixed cost (a call, a new object or a cache miss costs many
instructions) and the tracer slows the run about fiftyfold, so this is a map, not a
measure: bench.instructions and bench.overhead measure. Results: bench/results/bytecodes.*
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import sysconfig
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench import report
from bench.instructions import options, prepared, runs
from bench.overhead import EVERY_MECHANISM_OFF, _load, time_steps

KVLEASE_ROOT = Path(__file__).resolve().parent.parent  # this checkout: kvlease's own files
CHECKOUT = str(KVLEASE_ROOT) + os.sep
STDLIB = sysconfig.get_path("stdlib") + os.sep
# The profiled schedulers: SOLO's class, and kvlease's settings beside the shipped ones
SCHEDULERS = {
    "stock": ("stock", None),
    "kvlease": ("kvlease", None),
    "every mechanism off": ("kvlease", EVERY_MECHANISM_OFF),
}
TOP = 20  # functions listed a load, by kvlease's extra bytecodes
STEPS = (10, 100)  # traced steps: --quick, full


def function_of(code: types.CodeType) -> str:
    """`path:qualified name`, the path relative to site-packages (`vllm/v1/core/...`), to
    Python's standard library (`stdlib/contextlib.py`) or to kvlease's checkout, so one
    function has one name on every machine."""
    path, packages = code.co_filename, "site-packages" + os.sep
    if packages in path:  # first: the venv may sit inside the checkout
        path = path.split(packages, 1)[1]
    elif path.startswith(STDLIB):
        path = "stdlib" + os.sep + path[len(STDLIB) :]
    elif path.startswith(CHECKOUT):
        path = path[len(CHECKOUT) :]
    return f"{path}:{code.co_qualname}"


def is_kvleases(function: str) -> bool:
    """Code of kvlease's own (its packages, in this checkout or installed), not vLLM's."""
    return function.split("/", 1)[0] in ("kvlease", "engine", "exporters", "replay")


def profiled(name: str, model: str, n: int, pressure: bool, chat: bool, steps: int) -> dict:
    """The child: build and warm one scheduler, then run `steps` steps with each COUNTED
    call traced; bytecodes executed per function and the requests scheduled."""
    counts: collections.Counter[types.CodeType] = collections.Counter()

    def opcodes(frame: types.FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            counts[frame.f_code] += 1
        return opcodes

    def calls(frame: types.FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        return opcodes

    def traced(method: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            sys.settrace(calls)
            try:
                return method(*args, **kwargs)
            finally:
                sys.settrace(None)

        return call

    kind, settings = SCHEDULERS[name]
    load = prepared(kind, model, n, pressure, chat, traced, settings)
    _, scheduled = time_steps(load, steps)
    functions: dict[str, int] = collections.Counter()
    for code, count in counts.items():
        functions[function_of(code)] += count
    return {"scheduled": round(scheduled * steps), "functions": dict(functions)}


def profile(name: str, model: str, n: int, pressure: bool, chat: bool, steps: int) -> dict:
    """Run `profiled` in a process of its own, hash seed fixed (dict and set order, and
    with them what the schedulers execute, repeat)."""
    job = json.dumps([name, model, n, pressure, chat, steps])
    argv = [sys.executable, "-m", "bench.bytecodes", "--profiled", job]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=KVLEASE_ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def row(model: str, n: int, pressure: bool, chat: bool, steps: int) -> dict[str, Any]:
    """The three schedulers profiled, two processes at a time; bytecodes per scheduled
    request, per function and in total."""
    with ThreadPoolExecutor(2) as pool:
        jobs = {
            name: pool.submit(profile, name, model, n, pressure, chat, steps) for name in SCHEDULERS
        }
        profiles = {name: job.result() for name, job in jobs.items()}
    per_request = {
        name: {f: count / run["scheduled"] for f, count in run["functions"].items()}
        for name, run in profiles.items()
    }
    return {
        "running": n,
        "pressure": pressure,
        "chat": chat,
        "steps": steps,
        "scheduled": {name: run["scheduled"] for name, run in profiles.items()},
        "per_request": per_request,
        "total": {name: sum(f.values()) for name, f in per_request.items()},
        "kvleases_own": {
            name: sum(v for f, v in figures.items() if is_kvleases(f))
            for name, figures in per_request.items()
        },
    }


def table(r: dict[str, Any], top: int = TOP) -> str:
    """One load: the totals, kvlease's own code, and the `top` functions by kvlease's
    extra bytecodes over stock's (a function stock runs more of shows negative)."""
    per, names = r["per_request"], list(SCHEDULERS)
    total = r["total"]

    def line(label: str, values: list[float]) -> str:
        extra = values[1] - values[0]
        cells = " | ".join(f"{v:,.1f}" for v in values)
        return f"| {label} | {cells} | {extra:+,.1f} | {extra / total['stock']:+.1%} |"

    lines = [
        f"**{r['running']:,} running, {_load(r)}** ({r['steps']} steps; bytecodes per "
        f"scheduled request; requests scheduled: "
        + ", ".join(f"{name} {r['scheduled'][name]:,}" for name in names)
        + ")",
        "",
        "| function | " + " | ".join(names) + " | kvlease - stock | of stock's total |",
        "|---|" + "---|" * (len(names) + 2),
        line("**every function**", [total[name] for name in names]),
        line("kvlease's own code", [r["kvleases_own"][name] for name in names]),
    ]
    functions = set().union(*(per[name] for name in names))
    extra = {f: per["kvlease"].get(f, 0.0) - per["stock"].get(f, 0.0) for f in functions}
    for f in sorted(functions, key=lambda f: (-abs(extra[f]), f))[:top]:
        lines.append(line(f"`{f}`", [per[name].get(f, 0.0) for name in names]))
    return "\n".join(lines)


def main() -> int:
    args = options(__doc__ or "", "profiled", STEPS)
    if args.profiled:
        print(json.dumps(profiled(*json.loads(args.profiled))), flush=True)
        return 0
    model, n, steps, loads = runs(args, STEPS)
    rows = [row(model, n, pressure, chat, steps) for pressure, chat in loads]
    result = {"rows": rows, "machine": report.machine()}
    text = "\n\n".join(table(r) for r in rows) + "\n"
    report.write(args.out, "bytecodes-quick" if args.quick else "bytecodes", result, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
