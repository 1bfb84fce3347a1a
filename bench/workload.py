"""The benchmarks' workload: a multi-tenant chat trace as engine requests on a step clock.

The trace is `demo.workload`'s: seeded Poisson sessions of 4 premium, 8
standard and 20 free tenants, geometric turns, exponential think time and
lognormal (heavy-tailed) lengths; or a trace file (timestamp, tenant, session,
input_tokens, output_tokens[, tier]) such as one converted from BurstGPT or
Mooncake. `StepTrace` turns it into token ids and arrival steps for an
in-process engine driven through `LLMEngine.add_request` and `step()`:

- a session's first turn arrives at step `round(at x steps_per_second)`;
- a later turn arrives the trace's think time after the previous reply finished
  (a user waits for the reply), so every policy sees the same closed loop;
- its prompt is the previous prompt, the previous reply's token ids, then the
  new user tokens: turns share a growing prefix, as a chat does;
- a session ends before its context would pass `max_context`.

Lengths do not depend on the policy (outputs run to `max_tokens`), so every
policy replays the same requests.

    python -m bench.workload [--quick] [--trace FILE] [--save FILE]
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from demo.workload import Turn, WorkloadSpec, describe, generate, load_trace, save_trace

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


@dataclass(slots=True)
class Arrival:
    """One request of the trace, ready for `LLMEngine.add_request`."""

    request_id: str
    turn: Turn
    prompt: list[int]
    prefix_tokens: int  # context of the session's previous turn (prompt + reply) repeated here
    think_seconds: float  # trace time since the previous turn (0 for a first turn)
    step: int  # the step it arrives at


class StepTrace:
    """Releases a trace's requests at engine steps.

    Invariant: every turn is either pending (in the heap, with its arrival step
    known), waiting for its session's previous reply, sent, or dropped because
    the session's context would pass `max_context`. `due()` and `finished()`
    are O(log n) per request.
    """

    def __init__(
        self,
        turns: list[Turn],
        steps_per_second: float,
        vocab: int,
        max_context: int,
        run: str = "r",
    ) -> None:
        self.steps_per_second = steps_per_second
        self.vocab = vocab
        self.max_context = max_context
        self.run = run
        self.dropped = 0
        self._later: dict[str, list[Turn]] = {}
        self._heap: list[tuple[int, int, Arrival]] = []
        self._outstanding = 0
        self._seq = 0
        for turn in sorted(turns, key=lambda t: (t.session_id, t.turn)):
            if turn.turn == 0:
                self._push(turn, [], 0, 0.0, round(turn.at * steps_per_second))
            else:
                self._later.setdefault(turn.session_id, []).append(turn)

    @property
    def done(self) -> bool:
        return not self._heap and not self._outstanding

    def next_step(self) -> int | None:
        return self._heap[0][0] if self._heap else None

    def due(self, step: int) -> list[Arrival]:
        out = []
        while self._heap and self._heap[0][0] <= step:
            arrival = heapq.heappop(self._heap)[2]
            arrival.step = step
            self._outstanding += 1
            out.append(arrival)
        return out

    def finished(self, arrival: Arrival, reply: list[int], step: int) -> None:
        """The reply is complete: schedule the session's next turn after its think time."""
        self._outstanding -= 1
        later = self._later.get(arrival.turn.session_id)
        if not later:
            return
        nxt = later.pop(0)
        context = arrival.prompt + reply
        if len(context) + nxt.input_tokens + nxt.output_tokens > self.max_context:
            self.dropped += 1 + len(later)
            del self._later[arrival.turn.session_id]
            return
        think = max(0.0, nxt.at - arrival.turn.at)
        at = step + 1 + round(think * self.steps_per_second)
        self._push(nxt, context, len(context), think, at)

    def _push(self, turn: Turn, context: list[int], prefix: int, think: float, step: int) -> None:
        if turn.turn == 0 and turn.input_tokens + turn.output_tokens > self.max_context:
            self.dropped += 1 + len(self._later.pop(turn.session_id, []))
            return
        rng = random.Random(f"{turn.session_id}:{turn.turn}")  # the same ids in every run
        prompt = context + [rng.randrange(10, self.vocab) for _ in range(turn.input_tokens)]
        self._seq += 1
        rid = f"{self.run}-{turn.session_id}-t{turn.turn}"
        arrival = Arrival(rid, turn, prompt, prefix, think, step)
        heapq.heappush(self._heap, (step, self._seq, arrival))


def load(quick: bool = False, trace: Path | None = None) -> list[Turn]:
    """The benchmark trace: a file if given, else the seeded one (smaller when quick)."""
    if trace is not None:
        return load_trace(trace)
    return generate(QUICK_SPEC if quick else SPEC)


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
