"""Reservations: how long a leased session's blocks are kept from lower tiers.

A lease (kvlease.engine.leases) is the contract: for `lease_seconds` after a session's last
turn its cached prefix is evicted last. That costs nothing while blocks are free. A
*reservation* is stronger and costs the engine throughput: while it runs, lower tiers
may not take the blocks at all (they wait, or are preempted). So a reservation lasts
only while the session is likely to come back soon; after it the blocks are protected
by eviction order alone (the RETAINED segments of kvlease.engine.free_queue).

The rule, per tier (`reserve` in the tier table):
  never   no reservation: leases protect by eviction order only.
  lease   the reservation lasts as long as the lease.
  auto    when a session's turn ends at t, its blocks are reserved until t + w, with

              think = the q-quantile of its think times
              p = (returns + 1) / (turns - undecided + 2)   its return rate (Laplace)
              w = 0                                         if p < reserve_min_return
              w = min(think, reserve_max_seconds, lease_seconds)   otherwise

          `turns` counts finished turns (a session's last request in flight ending),
          `returns` those followed by a next turn of the same session while its lease
          ran, and think times are the gaps between the two. `undecided` counts the
          turns that ended less than `think` ago and have not returned yet, the one that
          just ended among them: too recent to call a miss, as most returns come later.
          (Counted as misses, they held a tier whose sessions came back two turns in
          three at a rate under 1/2 early on, so its first next turns found nothing
          reserved.) The rate is read from the most specific history with `MIN_HISTORY`
          turns: the session's, else its tenant's, else its tier's, else the prior
          (p = 1/2). The quantile from the most specific one with `MIN_GAPS` think times,
          else from the one with the most (the 0.75-quantile of three or fewer think
          times is the longest of them: too short a window for the next), else w =
          reserve_max_seconds. Without any think time, no turn is undecided: traffic
          whose sessions never come back (one-shot requests) soon reserves nothing, and
          a session that answers within seconds is reserved for seconds, not for the
          300 s of its lease.

          A window granted on the prior (no history yet) is provisional: when the
          tier's evidence turns (MIN_HISTORY turns ended, none returned, so p is below
          reserve_min_return) the provisional windows still open close at once
          (`take_withdrawn`); a first return keeps them. Else a cold start on one-shot
          traffic held each tier's first sessions' blocks for reserve_max_seconds.

Only the end of a turn opens a window: what a session frees while its turn still runs
(a preempted request, one of several in flight finishing) waits for no return, so it is
only retained. A window that ends while the session's returning turn waits to be admitted
closes at its admission instead (the scheduler's `_no_longer_returning`). The window never
outlives the lease, and the caps bound what is reserved at once
(kvlease.engine.policy.lease_caps_error), so a request that fits the unreserved pool never
waits for a reservation. Plain Python; nothing here imports vLLM.

Costs: `turn_ended` and `turn_started` O(1); `window` O(GAPS log GAPS) (a sort of at most
32 think times) plus O(undecided turns), once per finished turn. Memory: one `History` per
live session (the scheduler forgets it with the lease), per tenant and per tier, each at
most GAPS floats and ENDS turn ends.
"""

from __future__ import annotations

import contextlib
import enum
import math
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

GAPS = 32  # think times remembered per key: the newest, so the estimate follows drift
MIN_HISTORY = 3  # turns a history needs before it speaks for a session
MIN_GAPS = 4  # think times a history needs before its quantile speaks for a session
# Newest finished turns remembered per key, to tell which may still return. Beyond it, a
# turn too recent to call counts as a miss (less is reserved, never more); the premium
# tier at scale (bench/ablations.py) ends about 20 turns within one think time.
ENDS = 64


class ReserveMode(enum.StrEnum):
    AUTO = "auto"
    LEASE = "lease"
    NEVER = "never"


def reserve_mode(value: object) -> ReserveMode:
    """The mode `value` names; a ValueError that lists the modes otherwise (the tier
    table and the scheduler settings prefix it with where the value came from)."""
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return ReserveMode(value)
    modes = ", ".join(repr(m.value) for m in ReserveMode)
    raise ValueError(f"must be one of {modes}, got {value!r}")


@dataclass(frozen=True, slots=True)
class ReservePolicy:
    """One tier's reservation settings (the tier table's `reserve*` keys)."""

    mode: ReserveMode = ReserveMode.AUTO
    quantile: float = 0.75  # of the think times: how many returns the window should catch
    max_seconds: float = 60.0  # the longest window, whatever the history says
    min_return: float = 0.5  # below this return rate nothing is reserved
    min_payback: float = 1.0  # tokens of prefill saved per step it turns work away (payback)


@dataclass(slots=True)
class History:
    """Finished turns, returns, and the newest think times and turn ends of one key."""

    turns: int = 0
    returns: int = 0
    gaps: deque[float] = field(default_factory=lambda: deque(maxlen=GAPS))
    # (end, session) of its newest finished turns, oldest first: which may still return
    ends: deque[tuple[float, Hashable]] = field(default_factory=lambda: deque(maxlen=ENDS))

    def return_rate(self, undecided: int = 0) -> float:
        """Laplace's rate over the turns whose outcome is known: `undecided` of them
        ended too recently to tell."""
        return (self.returns + 1) / (self.turns - undecided + 2)

    def undecided(self, now: float, think: float, ended: dict[Hashable, float]) -> int:
        """Turns that ended less than `think` ago and have not returned yet: most
        returns come later than that, so they are neither returns nor misses.
        O(those turns)."""
        count = 0
        for end, session in reversed(self.ends):
            if end <= now - think:
                break
            count += ended.get(session) == end
        return count

    def quantile(self, q: float) -> float | None:
        """The q-quantile of the think times (nearest rank), or None without any."""
        if not self.gaps:
            return None
        ordered = sorted(self.gaps)
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _think(histories: list[History], q: float) -> float | None:
    """The q-quantile of think times from the most specific history with MIN_GAPS of
    them, else from the one with the most (the 0.75-quantile of three or fewer is their
    largest, too short a window for the next); None without any."""
    timed = next((h for h in histories if len(h.gaps) >= MIN_GAPS), None)
    if timed is None:
        timed = max(histories, key=lambda h: len(h.gaps), default=None)
    return timed.quantile(q) if timed is not None else None


class ReturnModel:
    """Turn and return histories by session, tenant and tier, and the window they give.

    Invariant: `_ended[s]` is the time session s's last turn ended, for exactly the
    sessions between turns that the scheduler has not forgotten; each turn is counted
    once in its session's, tenant's and tier's history, and each return once as well.
    `_provisional[tier]` holds the sessions whose window came from the prior alone, until
    the tier's first return or its evidence turns: at most MIN_HISTORY - 1 per tier.
    """

    def __init__(self) -> None:
        self._sessions: dict[Hashable, History] = {}
        self._tenants: dict[Hashable, History] = {}
        self._tiers: dict[str, History] = {}
        self._ended: dict[Hashable, float] = {}
        self._provisional: dict[str, list[Hashable]] = {}  # tier -> sessions windowed on the prior
        self._withdrawn: list[Hashable] = []  # their sessions, once the tier's evidence turned

    def _histories(self, session: Hashable, tenant: Hashable, tier: str) -> list[History]:
        return [
            self._sessions.setdefault(session, History()),
            self._tenants.setdefault(tenant, History()),
            self._tiers.setdefault(tier, History()),
        ]

    def turn_started(self, session: Hashable, tenant: Hashable, tier: str, now: float) -> None:
        """A session's request arrived while its lease ran: if it was between turns, that
        is a return, after a think time of now minus the end of its last turn."""
        ended = self._ended.pop(session, None)
        if ended is None:
            return
        gap = max(0.0, now - ended)
        self._provisional.pop(tier, None)  # a return: the windows granted on the prior stand
        for history in self._histories(session, tenant, tier):
            history.returns += 1
            history.gaps.append(gap)

    def turn_ended(self, session: Hashable, tenant: Hashable, tier: str, now: float) -> None:
        """A session's last request in flight ended: one more turn that may or may not
        be followed by a return."""
        self._ended[session] = now
        for history in self._histories(session, tenant, tier):
            history.turns += 1
            history.ends.append((now, session))

    def forget(self, session: Hashable) -> None:
        """The session's lease expired: a later request starts a new lease, not a return."""
        self._sessions.pop(session, None)
        self._ended.pop(session, None)

    def window(
        self, session: Hashable, tenant: Hashable, tier: str, lease: float, policy: ReservePolicy
    ) -> float:
        """Seconds to reserve a session's blocks after the turn that just ended (the
        module docstring's rule). Call after `turn_ended`."""
        if policy.mode is ReserveMode.NEVER or lease <= 0:
            return 0.0
        if policy.mode is ReserveMode.LEASE:
            return lease
        histories = [
            h
            for h in (self._sessions.get(session), self._tenants.get(tenant), self._tiers.get(tier))
            if h is not None
        ]
        think = _think(histories, policy.quantile)
        window = min(policy.max_seconds if think is None else think, policy.max_seconds, lease)
        history = next((h for h in histories if h.turns >= MIN_HISTORY), None)
        if history is None or think is None:
            undecided = 0  # without think times, a turn that has not returned is a miss
        else:  # the turn that just ended (at `_ended[session]`) is one of them
            undecided = history.undecided(self._ended[session], think, self._ended)
        if history is not None and history.return_rate(undecided) < policy.min_return:
            if think is None:  # turns ended and none came back: the prior was wrong
                self._withdrawn.extend(self._provisional.pop(tier, ()))
            return 0.0
        if history is None and think is None:  # on the prior alone
            self._provisional.setdefault(tier, []).append(session)
        return window

    def take_withdrawn(self) -> list[Hashable]:
        """Sessions whose provisional windows (granted on the prior) should close now: their
        tier's first MIN_HISTORY turns ended without a return. Each is given once."""
        withdrawn, self._withdrawn = self._withdrawn, []
        return withdrawn

    def tracked_sessions(self) -> int:
        return len(self._sessions)
