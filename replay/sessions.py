"""A trace's turns released to an engine on its clock, chained as a chat's turns are.

- a session's first turn arrives at tick `round(at x ticks_per_second)`;
- a later turn arrives the trace's think time after the previous reply finished
  (a user waits for the reply), so every policy sees the same closed loop;
- its prompt is the previous prompt, the previous reply's token ids, then the
  new user tokens: turns share a growing prefix, as a chat does;
- a session ends before its context would pass `max_context`.

A tick is an engine step where the caller counts steps (bench/policy.py: a
fixed number of steps per second) and 1/1024 s where it counts seconds
(`kvlease replay` on a calibrated clock). Lengths do not depend on the policy
(outputs run to `max_tokens`), so every policy replays the same requests.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

from kvlease.demo.workload import Turn


@dataclass(slots=True)
class Arrival:
    """One request of the trace, ready for `LLMEngine.add_request`."""

    request_id: str
    turn: Turn
    prompt: list[int]
    prefix_tokens: int  # context of the session's previous turn (prompt + reply) repeated here
    think_seconds: float  # trace time since the previous turn (0 for a first turn)
    step: int  # the tick it arrives at

    def cacheable(self, block: int) -> int:
        """Tokens of the previous turn's context the prefix cache could hold for it: whole
        blocks, without the reply's last token (never fed back, so never cached)."""
        return max(0, self.prefix_tokens - 1) // block * block

    def within_lease(self, lease_seconds: float) -> bool:
        """A next turn that came while its session's lease ran."""
        return self.turn.turn > 0 and self.think_seconds <= lease_seconds


class StepTrace:
    """Releases a trace's requests at ticks.

    Invariant: every turn is either pending (in the heap, with its arrival tick
    known), waiting for its session's previous reply, sent, or dropped because
    the session's context would pass `max_context`. `due()` and `finished()`
    are O(log n) per request. Token ids are made when a turn is released, so
    memory holds the contexts of sessions in flight, not of the whole trace.
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
        self._ids = range(10, vocab)  # token ids a user's words may take
        self.max_context = max_context
        self.run = run
        self.dropped = 0
        self._later: dict[str, list[Turn]] = {}
        self._heap: list[tuple[int, int, Turn, list[int], float]] = []
        self._outstanding = 0
        self._seq = 0
        for turn in sorted(turns, key=lambda t: (t.session_id, -t.turn)):  # popped from the end
            if turn.turn == 0:
                self._push(turn, [], 0.0, round(turn.at * steps_per_second))
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
            _, _, turn, context, think = heapq.heappop(self._heap)
            rng = random.Random(f"{turn.session_id}:{turn.turn}")  # the same ids in every run
            prompt = context + rng.choices(self._ids, k=turn.input_tokens)
            rid = f"{self.run}-{turn.session_id}-t{turn.turn}"
            self._outstanding += 1
            out.append(Arrival(rid, turn, prompt, len(context), think, step))
        return out

    def finished(self, arrival: Arrival, reply: list[int], step: int) -> None:
        """The reply is complete at tick `step`: the session's next turn comes its think
        time after the following tick."""
        self._outstanding -= 1
        later = self._later.get(arrival.turn.session_id)
        if not later:
            return
        nxt = later.pop()
        context = arrival.prompt + reply
        if len(context) + nxt.input_tokens + nxt.output_tokens > self.max_context:
            self.dropped += 1 + len(later)
            del self._later[arrival.turn.session_id]
            return
        think = max(0.0, nxt.at - arrival.turn.at)
        self._push(nxt, context, think, step + 1 + round(think * self.steps_per_second))

    def _push(self, turn: Turn, context: list[int], think: float, step: int) -> None:
        if turn.turn == 0 and turn.input_tokens + turn.output_tokens > self.max_context:
            self.dropped += 1 + len(self._later.pop(turn.session_id, []))
            return
        self._seq += 1
        heapq.heappush(self._heap, (step, self._seq, turn, context, think))
