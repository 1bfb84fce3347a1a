"""The benchmarks' workload: a multi-tenant chat trace as engine requests on a step clock.

The trace is `kvlease.demo.workload`'s: seeded Poisson sessions of 4 premium, 8
standard and 20 free tenants, geometric turns, exponential think time and
lognormal (heavy-tailed) lengths; or a trace file (timestamp, tenant, session,
input_tokens, output_tokens[, tier]) such as one converted from BurstGPT or
Mooncake. `kvlease.replay.sessions.StepTrace` turns it into token ids and arrival steps
for an in-process engine driven through `LLMEngine.add_request` and `step()`
(its docstring says how turns chain), as `kvlease replay` does offline.

    python -m bench.workload [--quick] [--trace FILE] [--save FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from kvlease.demo.workload import Turn, WorkloadSpec, describe, generate, load_trace, save_trace

SPEC = WorkloadSpec(
    tenants=(4, 8, 20),
    duration=60.0,
    sessions_per_second=0.5,
    mean_turns=3.0,
    mean_think_seconds=4.0,
    input_median=40,
    output_median=100,
    max_tokens=384,
    seed=1,
)
QUICK_SPEC = replace(SPEC, duration=12.0, sessions_per_second=1.0, seed=9)  # all three tiers
# Every session used once (a new user's first try, an API client naming a fresh session
# per call): as many requests as SPEC, none ever coming back.
ONE_SHOT_SPEC = replace(SPEC, mean_turns=1.0, sessions_per_second=1.5)


def shape(quick: bool = False, one_shot: bool = False) -> WorkloadSpec:
    """The seeded trace's shape: the smoke test's when quick (it wins), else one-shot
    sessions' or the multi-turn one."""
    return QUICK_SPEC if quick else ONE_SHOT_SPEC if one_shot else SPEC


def load(quick: bool = False, trace: Path | None = None, one_shot: bool = False) -> list[Turn]:
    """The benchmark trace: a file if given, else the seeded one (`shape`)."""
    if trace is not None:
        return load_trace(trace)
    return generate(shape(quick, one_shot))


def main() -> int:
    parser = argparse.ArgumentParser(description="Describe (or save) the benchmark trace.")
    parser.add_argument("--quick", action="store_true", help="the smoke-test trace")
    parser.add_argument("--trace", type=Path, help="a trace CSV to read instead")
    parser.add_argument("--save", type=Path, help="write the trace as CSV")
    args = parser.parse_args()
    turns = load(args.quick, args.trace)
    if args.save:
        save_trace(turns, args.save)
    print(json.dumps(describe(turns), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
