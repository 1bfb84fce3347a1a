"""The engine's last minutes, kept in the API process for dashboards (`/admin/history`).

A dashboard opened during an incident must show what led up to it, not only
what happens from then on. So the API process keeps, from the snapshots and
events the engine channel already brings:
- occupancy samples: pool size, free blocks (also per data-parallel rank), per-tenant
  blocks by state and the
  cumulative lease reuse per tier (tokens reused, lost) and fair-share service per
  tenant (weighted tokens served, entitled), at most one per `every`
  seconds, for `window` seconds;
- preemption, cached-block eviction and lease start and expiry events (the live page's
  event timeline), for `window` seconds, at most `max_events` (the oldest go first);
  lease renewals (every turn of a leased session) are left out.

Times are wall clock (the engine stamps events on the machine's monotonic clock,
which every process shares; they are converted on arrival).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from kvlease.engine.accounting import LEASE_OUTCOMES
from kvlease.engine.events import NO_CAUSE, EngineState, Eviction, LeaseEvent, Preemption
from kvlease.engine.retention import STATES as RETENTION_STATES
from kvlease.exporters.ranks import merge_states

Label = Callable[[str | None], str]
LEASE_KINDS = ("start", "expire")  # kept on the timeline; "renew" is every leased turn


def _lease_reuse(state: EngineState) -> dict[str, list[int]]:
    """tier -> [reused, lost] prefix tokens of leased next turns back inside their
    reservation window, since the engine started: the hit the page holds to its target
    (after the window a miss is the price of not reserving; Grafana shows both)."""
    out: dict[str, list[int]] = {}
    for tier, outcome, reserved, n in state.totals.lease_reuse_tokens:
        if reserved:
            out.setdefault(tier, [0, 0])[LEASE_OUTCOMES.index(outcome)] = n
    return out


def _retention(state: EngineState) -> dict[str, list[float]]:
    """tenant -> [reserved, retained] block-seconds held between turns, since start."""
    out: dict[str, list[float]] = {}
    for tenant, _tier, state_name, seconds in state.totals.retention_block_seconds:
        out.setdefault(tenant, [0.0, 0.0])[RETENTION_STATES.index(state_name)] += seconds
    return out


def _fair_share(state: EngineState) -> dict[str, list[float]]:
    """ "tenant|tier" -> [served, entitled] weighted tokens while backlogged, since start."""
    return {f"{t}|{tier}": [s, e] for t, tier, s, e in state.totals.fair_share_tokens}


def _by(label: Label, event: object) -> str | None:
    """The causing tenant's label, when the event has a cause."""
    if not isinstance(event, Preemption | Eviction) or event.by_tier == NO_CAUSE:
        return None
    return label(event.by_tenant)


class History:
    """Bounded: at most window/every samples (each O(tenants holding blocks)) and
    `max_events` events. Adding is O(tenants) per kept sample, O(1) per event."""

    def __init__(
        self,
        label: Label,
        window: float = 600.0,
        every: float = 1.0,
        max_events: int = 20_000,
    ) -> None:
        self.label = label
        self.window = window
        self.every = every
        self._samples: deque[dict[str, Any]] = deque(maxlen=max(1, int(window / every)))
        self._events: deque[dict[str, Any]] = deque(maxlen=max_events)
        self._lock = threading.Lock()

    def add_state(self, engines: dict[int, EngineState], wall: float | None = None) -> None:
        """Each data-parallel rank's latest state: a sample keeps their whole and each
        rank's pool and free blocks (merged only when a sample is kept)."""
        wall = time.time() if wall is None else wall
        with self._lock:
            if self._samples and wall - self._samples[-1]["t"] < self.every:
                return
            state = merge_states(list(engines.values()))
            self._samples.append(
                {
                    "t": wall,
                    "pool_blocks": state.pool_blocks,
                    "free_blocks": state.free_blocks,
                    "tenants": {
                        tenant: [b.running, b.cached_leased, b.cached]
                        for tenant, b in state.tenants.items()
                        if b.running or b.cached_leased or b.cached
                    },
                    "lease_reuse": _lease_reuse(state),
                    "fair_share": _fair_share(state),
                    "retention": _retention(state),
                    "engines": {
                        str(rank): [e.pool_blocks, e.free_blocks] for rank, e in engines.items()
                    },
                }
            )

    def add_event(self, event: object, engine: int = 0) -> None:
        blocks = getattr(event, "blocks", 0)
        if isinstance(event, Preemption):
            kind, reason = "preemption", event.reason
        elif isinstance(event, Eviction):
            kind = "eviction"
            reason = "leased_cache_eviction" if event.leased else "cache_eviction"
        elif isinstance(event, LeaseEvent) and event.kind in LEASE_KINDS:
            kind, reason = "lease", event.kind
        else:
            return
        wall = time.time() - max(0.0, time.monotonic() - event.at)
        with self._lock:
            self._events.append(
                {
                    "t": wall,
                    "kind": kind,
                    "tenant_id": self.label(event.tenant_id),
                    "tier": event.tier,
                    "reason": reason,
                    "blocks": blocks,
                    # whose allocation took the blocks (preemptions, evictions; None else)
                    "by_tier": getattr(event, "by_tier", None),
                    "by_tenant": _by(self.label, event),
                    "engine": engine,
                }
            )

    def since(self, seconds: float, now: float | None = None) -> dict[str, list[dict[str, Any]]]:
        """Samples and events of the last `seconds` (at most the window), oldest first."""
        cutoff = (time.time() if now is None else now) - min(seconds, self.window)
        with self._lock:
            samples = [s for s in self._samples if s["t"] >= cutoff]
            events = [e for e in self._events if e["t"] >= cutoff]
        return {"samples": samples, "events": events}
