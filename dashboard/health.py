"""The live page's health strip: is something wrong, and what, in five seconds.

Alerts come from Prometheus when the dashboard has one (`/api/v1/alerts`: the bundled
rules, `grafana/alerts.yml`, firing and pending), else from the same rules evaluated
here on the engine's own figures over the page's window (`evaluate`): those six of
the rules that read engine figures; the budget and ledger rules need Prometheus.
Evaluated here, a rule has no `for:` duration: it fires while its condition holds over
the window, and nothing is ever pending.

Pure functions of `data.Live` and Prometheus's JSON: unit-tested without a server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd

from kvlease.dashboard import data
from kvlease.exporters import metrics as m

POOL_FULL = 0.95  # KvleasePoolNearlyFull's level


@dataclass(frozen=True)
class Alert:
    name: str
    state: str  # "firing" or "pending"
    severity: str
    summary: str


def from_prometheus(alerts: list[dict[str, Any]]) -> list[Alert]:
    """kvlease's alerts among Prometheus's (`/api/v1/alerts` data.alerts), firing first."""
    out = [
        Alert(
            a["labels"].get("alertname", ""),
            a.get("state", ""),
            a["labels"].get("severity", ""),
            a.get("annotations", {}).get("summary", ""),
        )
        for a in alerts
        if a.get("labels", {}).get("alertname", "").startswith("Kvlease")
        and a.get("state") in ("firing", "pending")
    ]
    return sorted(out, key=lambda a: (a.state != "firing", a.name, a.summary))


def evaluate(live: data.Live, top_tier: str, minutes: float) -> list[Alert]:
    """The engine-figure rules of grafana/alerts.yml over the page's window."""
    alerts = []
    window = f"in the last {minutes:g} min"
    if live.pool_blocks and live.utilisation > POOL_FULL:
        alerts.append(
            Alert(
                "KvleasePoolNearlyFull",
                "firing",
                "warning",
                f"KV pool {live.utilisation:.0%} in use (over {POOL_FULL:.0%})",
            )
        )
    if preempted := top_preemptions(live, top_tier):
        alerts.append(
            Alert(
                f"Kvlease{top_tier.capitalize()}Preempted",
                "firing",
                "warning",
                f"{preempted} {top_tier} requests preempted {window}",
            )
        )
    events = live.events
    leased = events[(events["kind"] == "eviction") & (events["reason"] == "leased_cache_eviction")]
    for tier, blocks in leased.groupby("tier")["n"].sum().items():
        alerts.append(
            Alert(
                "KvleaseLeaseEvictions",
                "firing",
                "info",
                f"{int(blocks)} lease-protected cached blocks of {tier} tenants evicted {window}",
            )
        )
    hit = live.lease_hit_ratio
    if hit is not None and hit < m.LEASE_HIT_ALERT:
        alerts.append(
            Alert(
                "KvleaseLeaseHitLow",
                "firing",
                "warning",
                f"leased next turns back inside their reservation window found {hit:.0%} "
                "of their prefix "
                f"(target {m.LEASE_HIT_ALERT:.0%}) {window}",
            )
        )
    fair = data.fair_share_table(live.fair_share, pd.Timestamp.now(tz="UTC"))
    for row in fair[fair["window"] < m.FAIR_SHARE_ALERT].itertuples():
        alerts.append(
            Alert(
                "KvleaseFairShareLow",
                "firing",
                "warning",
                f"tenant {row.tenant_id} ({row.tier}) got {row.window:.0%} of its fair share",
            )
        )
    return alerts


def top_preemptions(live: data.Live, top_tier: str) -> int:
    """Requests of the top tier preempted in the window."""
    events = live.events
    return int(
        events.loc[(events["kind"] == "preemption") & (events["tier"] == top_tier), "n"].sum()
    )


@dataclass(frozen=True)
class Strip:
    """The figures at the top of the live page."""

    alerts: list[Alert]
    held: float  # share of the pool holding anything: running + lease-kept + cached
    in_use: float  # share not free to vLLM (running; cached blocks count as free)
    lease_hit: float | None
    top_tier: str
    top_preemptions: int
    waiting: int | None

    @property
    def firing(self) -> list[Alert]:
        return [a for a in self.alerts if a.state == "firing"]

    @property
    def pending(self) -> list[Alert]:
        return [a for a in self.alerts if a.state == "pending"]

    @property
    def headline(self) -> str:
        """One sentence: what is wrong, or that nothing is."""
        if not self.alerts:
            return "No alert firing or pending."
        parts = []
        for state, group in (("firing", self.firing), ("pending", self.pending)):
            if group:
                names = ", ".join(dict.fromkeys(a.name for a in group))
                parts.append(f"{len(group)} {state}: {names}")
        return "; ".join(parts) + "."


def strip(live: data.Live, alerts: list[Alert], top_tier: str) -> Strip:
    states = live.pool_states
    held = sum(states[s] for s in data.STATES)
    return Strip(
        alerts=alerts,
        held=held / live.pool_blocks if live.pool_blocks else 0.0,
        in_use=live.utilisation,
        lease_hit=live.lease_hit_ratio,
        top_tier=top_tier,
        top_preemptions=top_preemptions(live, top_tier),
        waiting=live.waiting,
    )
