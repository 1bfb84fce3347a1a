"""Payback: each leasing tier's reservation cap, kept only as large as it pays for.

A reservation (kvlease.engine.reservations) keeps a leased session's blocks from lower tiers
for its window. What it buys: every reserved block a next turn of the session reuses
saves `block_size` tokens of prefill. What it costs: every step in which a lower tier's
allocation is refused although the pool held the blocks (they were reserved) defers
that work by a step, about one token of it. On a pool the tiers' sessions fit, the first
outweighs the second; on one where more sessions sit in their windows than the caps
hold (many tenants, a small pool), new turns push the reserved blocks out before anyone
returns and lower tiers are turned away at almost every step: the reservation costs the
engine throughput for almost no reuse.

The rule, per leasing tier, over its *generations* (each time as many blocks as
GENERATION times its cap in the tier table have left its RESERVED segment, reused or
not, and at least MIN_GENERATION; or as soon as its reservation has refused work in
MAX_REFUSALS steps, so blocks that sit reserved while turning work away are judged
without waiting for them to leave):

    gain  = gain / 2  + block_size * (reserved blocks reused this generation)
    spent = spent / 2 + (steps this generation in which its reservation refused work)
    cap   = max(1, cap * 3 // 4)               if gain < min_payback * spent
            min(limit, cap + max(1, limit // 4))  otherwise

(halving the old sums: the estimate follows the traffic within a few generations). A
refused step is charged to the tiers whose reservations were hidden from the request,
in proportion to the blocks each had reserved. `min_payback` is the tier table's
`reserve_min_payback` (tokens of prefill a reservation must save per step it turns
work away; 0 keeps the cap at its limit). One block stays reservable, so the tier keeps
measuring what its reservation returns and grows back when that pays again.

Invariant: `caps[i]` is `limits[i]` where that is 0 or `min_payback[i]` is 0, else
between 1 and `limits[i]`. Costs: `refused` O(tiers) at most once a step; `update`
O(tiers) a step; no allocation. Plain Python; nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence

GENERATION = 4  # a decision per this many tier caps' worth of reserved blocks gone
MIN_GENERATION = 8  # and at least this many blocks
MAX_REFUSALS = 64  # or once its reservation has refused work in this many steps


class PaybackTuner:
    """Reservation caps per leasing tier (least important first) from what they return."""

    def __init__(self, limits: Sequence[int], block_size: int, min_payback: Sequence[float]):
        self.limits = list(limits)
        self.caps = list(limits)
        # blocks that end a generation, per tier (fixed: the table's cap sets it)
        self._generation = [max(MIN_GENERATION, GENERATION * limit) for limit in self.limits]
        self._block_size = block_size
        self._min_payback = list(min_payback)
        n = len(self.limits)
        self._left = [0] * n  # the queue's departure count at the last decision
        self._reused = [0] * n
        self._refused = [0.0] * n  # refused steps charged since the last decision
        self._gain = [0.0] * n  # tokens of prefill saved, halved each generation
        self._spent = [0.0] * n  # refused steps, halved each generation
        self._last_refusal = -1

    def refused(self, step: int, hidden_from: int, reserved: Sequence[int]) -> None:
        """In `step` an allocation was refused while the reservations of leasing tiers
        `hidden_from` and up (holding `reserved` blocks each) were hidden from it; the
        step is charged once, to those tiers by their share of the hidden blocks."""
        if step == self._last_refusal:
            return
        hidden = sum(reserved[hidden_from:])
        if hidden == 0:
            return
        self._last_refusal = step
        for i in range(hidden_from, len(reserved)):
            self._refused[i] += reserved[i] / hidden

    def update(self, left: Sequence[int], reused: Sequence[int]) -> bool:
        """Decide for every tier that completed a generation (`left` and `reused`: the
        free queue's cumulative counts); True if a cap changed."""
        changed = False
        for i, limit in enumerate(self.limits):
            full = (
                left[i] - self._left[i] >= self._generation[i] or self._refused[i] >= MAX_REFUSALS
            )
            if not (limit and self._min_payback[i] and full):
                continue
            self._gain[i] = self._gain[i] / 2 + (reused[i] - self._reused[i]) * self._block_size
            self._spent[i] = self._spent[i] / 2 + self._refused[i]
            self._left[i], self._reused[i], self._refused[i] = left[i], reused[i], 0.0
            if self._gain[i] < self._min_payback[i] * self._spent[i]:
                cap = max(1, self.caps[i] * 3 // 4)
            else:
                cap = min(limit, self.caps[i] + max(1, limit // 4))
            changed |= cap != self.caps[i]
            self.caps[i] = cap
        return changed

    def rebase(self, left: Sequence[int], reused: Sequence[int]) -> None:
        """Count the next generation from the free queue's counts `left` and `reused` (a
        replaced queue counts from 0)."""
        self._left, self._reused = list(left), list(reused)

    def forget(self) -> None:
        """Forget what the reservations returned and cost: caps back at their limits."""
        n = len(self.limits)
        self.caps = list(self.limits)
        self._refused, self._gain, self._spent = [0.0] * n, [0.0] * n, [0.0] * n
