"""Retention metering: the block-seconds a lease holds between a session's turns.

A leased session's cached blocks sit in the free queue between its turns, either
RESERVED (lower tiers may not take them: capacity held idle for the tenant) or
RETAINED (evicted after every unleased block). Both are capacity the tenant bought,
billed as the "KV retention" SKU (reserved and retained at their own prices), so they
are metered here, per retention episode:

    an episode opens when a session's last request in flight ends while its lease
    runs, and closes when its next turn arrives, its lease expires, or the engine
    forgets the session; it yields one `Retention` event (the ledger's record of it).

Between samples the holder's block counts are integrated from the episode's last
integration time, with the counts at the integration (right Riemann, as
kvlease.engine.accounting does; a count change inside an interval is billed from the interval's
start, so the error is at most `sample_seconds` per change). The scheduler integrates
at each occupancy sample and at the exact moments it changes a segment itself: the
end of a reservation window (before `retain`) and of a lease (before `release`).

Costs: `open` and `close` O(1); `integrate_all` O(open episodes), once a sample, off the
per-step path. Memory: one `Episode` per session between turns of a running lease.
Plain Python; nothing here imports vLLM.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from kvlease.engine.events import Retention
from kvlease.engine.free_queue import Holder

STATES = ("reserved", "retained")  # the two prices of the KV retention SKU


@dataclass(slots=True)
class Episode:
    """One session's time between turns, from the request that ended the turn."""

    request_id: str  # the turn's last request: the record's idempotency key derives from it
    api_server: int  # the API process that owns that request (and writes the record)
    started: float  # the scheduler's clock
    at: float  # integrated up to here
    reserved_seconds: float = 0.0  # block-seconds in a RESERVED segment
    retained_seconds: float = 0.0  # block-seconds in a RETAINED segment


class RetentionMeter:
    """Open episodes by holder, and cumulative block-seconds by (tenant label, tier, state).

    Invariant: a holder has an episode only while its lease runs and no request of its
    session is in flight; every episode that closes with block-seconds yields exactly one
    event where events are wanted, so the ledger's retention records and `totals` add up
    to the same figures."""

    def __init__(self, model: str) -> None:
        self.model = model  # the served model name, for the records
        self.episodes: dict[Holder, Episode] = {}
        self.totals: defaultdict[tuple[str, str, str], float] = defaultdict(float)

    def open(self, holder: Holder, at: float, request_id: str, api_server: int) -> None:
        self.episodes[holder] = Episode(request_id, api_server, at, at)

    def integrate(self, holder: Holder, now: float, label: str) -> None:
        """Bill the holder's blocks in each segment from the last integration to `now`."""
        episode = self.episodes.get(holder)
        if episode is None or now <= episode.at:
            return
        dt, episode.at = now - episode.at, now
        if not holder.leased:
            return
        reserved = dt * holder.reserved
        retained = dt * (holder.leased - holder.reserved)
        episode.reserved_seconds += reserved
        episode.retained_seconds += retained
        assert holder.tier is not None
        for state, seconds in zip(STATES, (reserved, retained), strict=True):
            self.totals[(label, holder.tier, state)] += seconds

    def integrate_all(self, now: float, label_of) -> None:
        for holder in self.episodes:
            self.integrate(holder, now, label_of(holder.tenant_id))

    def close(self, holder: Holder, now: float, label: str, record: bool) -> Retention | None:
        """End the holder's episode at `now`: its record, or None if it held nothing or no
        record is wanted (`record`: nothing reads the events; `totals` count it all the
        same)."""
        self.integrate(holder, now, label)
        episode = self.episodes.pop(holder, None)
        if not record or episode is None:
            return None
        if not (episode.reserved_seconds or episode.retained_seconds):
            return None
        assert holder.tenant_id is not None and holder.tier is not None
        return Retention(
            at=now,
            request_id=episode.request_id,
            tenant_id=holder.tenant_id,
            tier=holder.tier,
            session_id=holder.session_id,
            model=self.model,
            started=episode.started,
            reserved_block_seconds=episode.reserved_seconds,
            retained_block_seconds=episode.retained_seconds,
            api_server=episode.api_server,
        )
