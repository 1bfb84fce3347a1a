"""Where the dashboard's numbers come from, shaped into plain DataFrames.

Two live sources give the same `Live` picture: one engine's admin API
(`/admin/state` + `/admin/history`: a single node, exact, the last ten
minutes kept by the server) or a Prometheus server (a fleet of replicas,
summed by tenant). Usage and billing figures are in `kvlease.dashboard.usage`.

Fetching (`EngineSource`, `PrometheusSource`) is separate from shaping
(`live_from_engine`, `live_from_prometheus`), which
are pure and unit-tested. Every failure to reach a source is a `SourceError`
with a sentence for the banner, never a traceback.
"""

from __future__ import annotations

import hmac
import itertools
import os
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pandas as pd

from kvlease.engine.events import NO_CAUSE
from kvlease.exporters import metrics as m
from kvlease.exporters.ledger import DB_ENV
from kvlease.exporters.metrics import BLOCK_STATES as STATES

OTHER = "other"
RECENT_SECONDS = 300  # "in the last 5 minutes" in the tenant table
ENGINE_ENV = "KVLEASE_DASHBOARD_ENGINE"
PROMETHEUS_ENV = "KVLEASE_DASHBOARD_PROMETHEUS"
TOKEN_ENV = "KVLEASE_DASHBOARD_TOKEN"
REFRESH_ENV = "KVLEASE_DASHBOARD_REFRESH_SECONDS"
PASSWORD_ENV = "KVLEASE_DASHBOARD_PASSWORD"  # the variable's name; the password lives only there
WHATIF_DIR_ENV = "KVLEASE_WHATIF_DIR"  # the only folder the What if page reads files from

OCCUPANCY_COLUMNS = ["t", "tenant_id", "state", "blocks"]
TENANT_COLUMNS = [
    "tenant_id",
    "tier",
    "running",
    "cached_leased",
    "cached",
    "held",
    "leases",
    "lease_seconds_left",
    "preemptions_5m",
    "evictions_5m",
    "reserved_5m",  # KV retention block-seconds (leased blocks between turns), last 5 min
    "retained_5m",
]
EVENT_COLUMNS = ["t", "kind", "tier", "tenant_id", "reason", "n", "by_tier", "by_tenant"]
EVENT_KINDS = ("alert", "preemption", "eviction", "lease")  # the timeline's rows, top down
# prefix tokens of leased next turns back inside their reservation window, per interval
LEASE_COLUMNS = ["t", "tier", "reused", "lost"]
FAIR_COLUMNS = ["t", "tenant_id", "tier", "served", "entitled"]  # weighted tokens, per interval
# One row per engine (data-parallel rank; "instance/rank" across replicas), now.
ENGINE_COLUMNS = ["engine", "pool_blocks", "free_blocks", "held", "running", "waiting"]
POOL_STATES = (*STATES, "empty")  # the pool bar, bottom up


class SourceError(Exception):
    """A source could not be read; the message is shown as the page's banner."""


@dataclass(frozen=True)
class Config:
    """What `kvlease dashboard` passes to the Streamlit process (environment, not argv,
    so a token never shows in a process list)."""

    engine: str | None
    prometheus: str | None
    usage_db: str | None
    token: str | None  # stays in this process: never sent to a browser
    refresh_seconds: float = 2.0
    password: str | None = None  # the login every browser session must pass
    whatif_dir: str | None = None  # the What if page reads traces and tier tables here only

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Config:
        env = dict(os.environ if env is None else env)
        return cls(
            engine=env.get(ENGINE_ENV) or None,
            prometheus=env.get(PROMETHEUS_ENV) or None,
            usage_db=env.get(DB_ENV) or None,
            token=env.get(TOKEN_ENV) or None,
            refresh_seconds=max(2.0, float(env.get(REFRESH_ENV) or 2.0)),
            password=env.get(PASSWORD_ENV) or None,
            whatif_dir=env.get(WHATIF_DIR_ENV) or None,
        )

    def password_matches(self, attempt: str) -> bool:
        """Constant-time: the login gives away nothing by how long it takes."""
        expected = (self.password or "").encode()
        return bool(expected) and hmac.compare_digest(expected, attempt.encode())


@dataclass(frozen=True)
class Live:
    """One refresh of the live page. `occupancy` has OCCUPANCY_COLUMNS (t as UTC
    datetimes), `tenants` TENANT_COLUMNS, `events` EVENT_COLUMNS (n: preempted
    requests, or evicted blocks), `lease_reuse` LEASE_COLUMNS (tokens per interval),
    `fair_share` FAIR_COLUMNS (weighted tokens per interval while a tenant waited)."""

    pool_blocks: int
    free_blocks: int
    running: int | None
    waiting: int | None
    occupancy: pd.DataFrame
    tenants: pd.DataFrame
    events: pd.DataFrame
    lease_reuse: pd.DataFrame
    fair_share: pd.DataFrame
    engines: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=ENGINE_COLUMNS))

    @property
    def pool_states(self) -> dict[str, int]:
        """The pool by what its blocks hold now: running, cached_leased, cached, and empty
        (the rest). Leased and plain cached blocks count as free to vLLM, yet a lease
        keeps the first from lower tiers: the split tells what leases hold."""
        held = {s: int(self.tenants[s].sum()) if not self.tenants.empty else 0 for s in STATES}
        return {**held, "empty": max(0, self.pool_blocks - sum(held.values()))}

    @property
    def lease_hit_ratio(self) -> float | None:
        """Share of the prefix tokens running leases were keeping that leased sessions'
        next turns back inside their reservation window found in the cache, over the
        window; None without such a turn. The alert's figure: after its window a turn's
        miss is the price of not reserving, not a fault."""
        reused, lost = self.lease_reuse["reused"].sum(), self.lease_reuse["lost"].sum()
        return float(reused / (reused + lost)) if reused + lost > 0 else None

    @property
    def utilisation(self) -> float:
        """Share of the pool not free (free counts evictable cached blocks)."""
        if not self.pool_blocks:
            return 0.0
        return (self.pool_blocks - self.free_blocks) / self.pool_blocks

    @property
    def empty(self) -> bool:
        return self.tenants.empty and self.occupancy.empty


# -- the engine's admin API ---------------------------------------------------------------


class EngineSource:
    """One kvlease server's admin API; needs a token with the `admin` role."""

    def __init__(self, url: str, token: str | None, timeout: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout

    def live(self, minutes: float) -> Live:
        state = self._get("/admin/state")
        history = self._get(f"/admin/history?seconds={int(minutes * 60)}")
        return live_from_engine(state, history, time.time())

    def _get(self, path: str) -> dict[str, Any]:
        if not self.token:
            raise SourceError(self._why_no_token())
        try:
            r = httpx.get(
                self.url + path,
                headers={"Authorization": f"Bearer {self.token}"},
                timeout=self.timeout,
            )
        except httpx.HTTPError as exc:
            raise SourceError(f"The engine at {self.url} is not reachable ({exc}).") from None
        if r.status_code == 200:
            return r.json()
        raise SourceError(f"The engine at {self.url} answered {r.status_code}: {_message(r)}")

    def _why_no_token(self) -> str:
        """Without a token the page can still say whether the engine is there at all:
        vLLM's /health needs none."""
        needs = "the admin API needs a token with the admin role"
        try:
            httpx.get(self.url + "/health", timeout=self.timeout)
        except httpx.HTTPError as exc:
            return f"The engine at {self.url} is not reachable ({exc}); {needs} too."
        return f"The engine at {self.url} answers, but {needs}."


def _message(r: httpx.Response) -> str:
    try:
        return r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return r.text[:200] or r.reason_phrase


def live_from_engine(state: dict[str, Any], history: dict[str, Any], now: float) -> Live:
    """The live picture from one server's `/admin/state` and `/admin/history`."""
    samples = history.get("samples", [])
    events = history.get("events", [])
    reuse, fair = _engine_increments(samples)
    return _live(
        pool=state["pool_blocks"],
        free=state["free_blocks"],
        running=state.get("running"),
        waiting=state.get("waiting"),
        occupancy=_engine_occupancy(samples),
        tenants=_engine_tenants(state, samples, events, now),
        events=[_engine_event(e) for e in events],
        lease_reuse=reuse,
        fair_share=fair,
        engines=_engine_ranks(state),
    )


def _engine_occupancy(samples: list[dict[str, Any]]) -> list[tuple]:
    return [
        (sample["t"], tenant, s, blocks[i])
        for sample in samples
        for tenant, blocks in sample["tenants"].items()
        for i, s in enumerate(STATES)
    ]


def _engine_event(e: dict[str, Any]) -> tuple:
    tier = e["tier"] or "unclassified"
    return (e["t"], e["kind"], tier, e["tenant_id"], e["reason"], _event_n(e),
            e.get("by_tier"), e.get("by_tenant"))  # fmt: skip


def _engine_increments(samples: list[dict[str, Any]]) -> tuple[list[tuple], list[tuple]]:
    """Lease reuse and fair-share rows: increments between consecutive samples of the
    cumulative totals."""
    reuse, fair = [], []
    for before, after in itertools.pairwise(samples):
        for tier, (reused, lost) in after.get("lease_reuse", {}).items():
            was = before.get("lease_reuse", {}).get(tier, [0, 0])
            if reused - was[0] or lost - was[1]:
                reuse.append((after["t"], tier, reused - was[0], lost - was[1]))
        for key, (served, entitled) in after.get("fair_share", {}).items():
            was = before.get("fair_share", {}).get(key, [0.0, 0.0])
            if entitled - was[1] > 0:
                tenant, tier = key.rsplit("|", 1)
                fair.append((after["t"], tenant, tier, served - was[0], entitled - was[1]))
    return reuse, fair


def _engine_tenants(
    state: dict[str, Any], samples: list[dict[str, Any]], events: list[dict[str, Any]], now: float
) -> list[dict]:
    preempted: Counter[str] = Counter()
    evicted: Counter[str] = Counter()
    for e in events:
        if e["t"] >= now - RECENT_SECONDS:
            if e["kind"] == "preemption":
                preempted[e["tenant_id"]] += 1
            elif e["kind"] == "eviction":
                evicted[e["tenant_id"]] += e["blocks"]
    recent = [s for s in samples if s["t"] >= now - RECENT_SECONDS]
    retention: dict[str, list[float]] = {}
    if len(recent) > 1:
        first, last = recent[0].get("retention", {}), recent[-1].get("retention", {})
        for tenant, after in last.items():
            was = first.get(tenant, [0.0, 0.0])
            retention[tenant] = [after[0] - was[0], after[1] - was[1]]
    tiers = state.get("tenant_tiers", {})
    leases = state.get("lease_summary", {})
    names = sorted(set(state["tenants"]) | set(leases) | set(preempted) | set(evicted))
    return [
        _tenant_row(
            tenant,
            tier=tiers.get(tenant),
            blocks=[state["tenants"].get(tenant, {}).get(s, 0) for s in STATES],
            leases=leases.get(tenant, {}).get("active", 0),
            seconds_left=leases.get(tenant, {}).get("seconds_left_max"),
            preemptions=preempted.get(tenant, 0),
            evictions=evicted.get(tenant, 0),
            retention=retention.get(tenant, [0.0, 0.0]),
        )
        for tenant in names
    ]


def _engine_ranks(state: dict[str, Any]) -> list[tuple]:
    return [
        (
            rank,
            e["pool_blocks"],
            e["free_blocks"],
            sum(h["running"] + h["cached_leased"] for h in e["tenants"].values()),
            e["running"],
            e["waiting"],
        )
        for rank, e in sorted(state.get("engines", {}).items(), key=lambda kv: int(kv[0]))
    ]


def _live(
    *,
    pool: int,
    free: int,
    running: int | None,
    waiting: int | None,
    occupancy: list[tuple],
    tenants: list[dict],
    events: list[tuple],
    lease_reuse: list[tuple],
    fair_share: list[tuple],
    engines: list[tuple],
) -> Live:
    """The one place a `Live` is built: each source's rows become its frames."""
    return Live(
        pool_blocks=pool,
        free_blocks=free,
        running=running,
        waiting=waiting,
        occupancy=_frame(occupancy, OCCUPANCY_COLUMNS),
        tenants=pd.DataFrame(tenants, columns=TENANT_COLUMNS),
        events=_frame(events, EVENT_COLUMNS),
        lease_reuse=_frame(lease_reuse, LEASE_COLUMNS),
        fair_share=_frame(fair_share, FAIR_COLUMNS),
        engines=pd.DataFrame(engines, columns=ENGINE_COLUMNS),
    )


def _event_n(event: dict[str, Any]) -> int:
    """Requests for a preemption, blocks for an eviction, 1 for a lease start or expiry."""
    return event["blocks"] if event["kind"] == "eviction" else 1


def _tenant_row(
    tenant: str,
    *,
    tier: str | None,
    blocks: list[float],
    leases: float = 0,
    seconds_left: float | None = None,
    preemptions: float = 0,
    evictions: float = 0,
    retention: list[float] | None = None,
) -> dict:
    """One row of the tenant table (defaults: a tenant with no activity in the window)."""
    retention = retention or [0.0, 0.0]
    running, leased, cached = (int(b) for b in blocks)
    return {
        "tenant_id": tenant,
        "tier": tier or "",
        "running": running,
        "cached_leased": leased,
        "cached": cached,
        "held": running + leased,
        "leases": int(leases),
        "lease_seconds_left": round(seconds_left, 1) if leases and seconds_left else None,
        "preemptions_5m": round(preemptions),
        "evictions_5m": round(evictions),
        "reserved_5m": round(retention[0], 1),
        "retained_5m": round(retention[1], 1),
    }


def _frame(rows: list[tuple], columns: list[str]) -> pd.DataFrame:
    frame = pd.DataFrame(rows, columns=columns)
    frame["t"] = pd.to_datetime(frame["t"], unit="s", utc=True)
    return frame


# -- Prometheus -----------------------------------------------------------------------------

# Every query the live page runs against Prometheus, summed over replicas.
QUERIES = {
    "pool": f"sum({m.POOL_BLOCKS.name})",
    "free": f"sum({m.FREE_BLOCKS.name})",
    "running": f"sum({m.RUNNING.name})",
    "waiting": f"sum({m.WAITING.name})",
    "blocks": f"sum by (tenant_id, state) ({m.KV_BLOCKS.name})",
    "tiers": f"max by (tenant_id, tier) ({m.TENANT_INFO.name})",
    "leases": f"sum by (tenant_id) ({m.LEASES_ACTIVE.name})",
    "lease_left": f"max by (tenant_id) ({m.LEASE_SECONDS_LEFT.name})",
    "preemptions_5m": f"sum by (tenant_id) (increase({m.PREEMPTIONS.name}[5m]))",
    "evictions_5m": f"sum by (tenant_id) (increase({m.CACHED_EVICTIONS.name}[5m]))",
    "retention_5m": f"sum by (tenant_id, state) (increase({m.RETENTION_BLOCK_SECONDS.name}[5m]))",
    # per engine: each replica's data-parallel ranks
    "engine_pool": f"sum by (instance, engine) ({m.POOL_BLOCKS.name})",
    "engine_free": f"sum by (instance, engine) ({m.FREE_BLOCKS.name})",
    "engine_held": f'sum by (instance, engine) ({m.KV_BLOCKS.name}{{state!="cached"}})',
    "engine_running": f"sum by (instance, engine) ({m.RUNNING.name})",
    "engine_waiting": f"sum by (instance, engine) ({m.WAITING.name})",
}
# {step} is filled in per query: the increase over one step of the range.
RANGE_QUERIES = {
    "occupancy": f"sum by (tenant_id, state) ({m.KV_BLOCKS.name})",
    "preemptions": f"sum by (tenant_id, tier, reason, by_tier) "
    f"(increase({m.PREEMPTIONS.name}[{{step}}s]))",
    "evictions": f"sum by (tenant_id, tier, leased, by_tier) "
    f"(increase({m.CACHED_EVICTIONS.name}[{{step}}s]))",
    # the bundled rules' alerts while firing (Prometheus's own ALERTS series)
    "alerts": 'max by (alertname, alertstate, tier, tenant_id) (ALERTS{{alertname=~"Kvlease.*"}})',
    "lease_reuse": f"sum by (tier, outcome) "
    f'(increase({m.LEASE_REUSE.name}{{{{reserved="true"}}}}[{{step}}s]))',
    "fair_served": f"sum by (tenant_id, tier) (increase({m.FAIR_SERVED.name}[{{step}}s]))",
    "fair_entitled": f"sum by (tenant_id, tier) (increase({m.FAIR_ENTITLED.name}[{{step}}s]))",
}


class PrometheusSource:
    """A Prometheus server scraping one or more kvlease servers."""

    def __init__(self, url: str, timeout: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def live(self, minutes: float) -> Live:
        now = time.time()
        step = max(5, int(minutes * 60 / 120))  # about 120 points per series
        start = now - minutes * 60
        instant = {
            n: self._api("query", {"query": q, "time": now})["result"] for n, q in QUERIES.items()
        }
        window = {"start": start, "end": now, "step": step}
        ranged = {
            n: self._api("query_range", {"query": q.format(step=step), **window})["result"]
            for n, q in RANGE_QUERIES.items()
        }
        return live_from_prometheus(instant, ranged)

    def alerts(self) -> list[dict[str, Any]]:
        """Every alert Prometheus has firing or pending (`/api/v1/alerts`)."""
        return self._api("alerts", {})["alerts"]

    def _api(self, endpoint: str, params: dict[str, Any]) -> Any:
        try:
            r = httpx.get(f"{self.url}/api/v1/{endpoint}", params=params, timeout=self.timeout)
        except httpx.HTTPError as exc:
            raise SourceError(f"Prometheus at {self.url} is not reachable ({exc}).") from None
        try:
            body = r.json()
        except ValueError:
            body = {}
        if r.status_code != 200 or body.get("status") != "success":
            error = body.get("error") or r.text[:200]
            raise SourceError(f"Prometheus at {self.url} answered {r.status_code}: {error}")
        return body["data"]


def live_from_prometheus(
    instant: dict[str, list[dict[str, Any]]], ranged: dict[str, list[dict[str, Any]]]
) -> Live:
    """The live picture from Prometheus: QUERIES' instant results and RANGE_QUERIES'."""

    def scalar(name: str) -> float | None:
        result = instant.get(name) or []
        return float(result[0]["value"][1]) if result else None

    pool, free = scalar("pool"), scalar("free")
    running, waiting = scalar("running"), scalar("waiting")
    return _live(
        pool=int(pool or 0),
        free=int(free or 0),
        running=None if running is None else int(running),
        waiting=None if waiting is None else int(waiting),
        occupancy=[
            (float(ts), series["metric"]["tenant_id"], series["metric"]["state"], float(v))
            for series in ranged.get("occupancy", [])
            for ts, v in series["values"]
        ],
        tenants=_prometheus_tenants(instant),
        events=_prometheus_events(ranged) + _alert_starts(ranged.get("alerts", [])),
        lease_reuse=_prometheus_lease_reuse(ranged),
        fair_share=_prometheus_fair_share(ranged),
        engines=_prometheus_engines(instant),
    )


def _prometheus_tenants(instant: dict[str, list[dict[str, Any]]]) -> list[dict]:
    def by_tenant(name: str) -> dict[str, float]:
        return {
            r["metric"].get("tenant_id", ""): float(r["value"][1]) for r in instant.get(name, [])
        }

    held: dict[str, dict[str, float]] = {}
    for r in instant.get("blocks", []):
        held.setdefault(r["metric"]["tenant_id"], {})[r["metric"]["state"]] = float(r["value"][1])
    tiers = {r["metric"]["tenant_id"]: r["metric"]["tier"] for r in instant.get("tiers", [])}
    leases, left = by_tenant("leases"), by_tenant("lease_left")
    preempted, evicted = by_tenant("preemptions_5m"), by_tenant("evictions_5m")
    retention: dict[str, list[float]] = {}
    for r in instant.get("retention_5m", []):
        slot = m.RETENTION_STATES.index(r["metric"].get("state", "retained"))
        tenant = r["metric"].get("tenant_id", "")
        retention.setdefault(tenant, [0.0, 0.0])[slot] = float(r["value"][1])
    names = sorted(
        set(held) | {t for t, n in leases.items() if n} | {t for t, n in preempted.items() if n}
    )
    return [
        _tenant_row(
            t,
            tier=tiers.get(t),
            blocks=[held.get(t, {}).get(s, 0) for s in STATES],
            leases=leases.get(t, 0),
            seconds_left=left.get(t),
            preemptions=preempted.get(t, 0),
            evictions=evicted.get(t, 0),
            retention=retention.get(t, [0.0, 0.0]),
        )
        for t in names
    ]


def _prometheus_events(ranged: dict[str, list[dict[str, Any]]]) -> list[tuple]:
    """Preemptions and evictions per range step, where there were any. Prometheus keeps
    the causing tier, not the causing tenant (cardinality)."""

    def labels(s: dict[str, Any]) -> tuple[str, str]:
        return s["metric"].get("tier", ""), s["metric"].get("tenant_id", "")

    def eviction(s: dict[str, Any]) -> str:
        return "leased_cache_eviction" if s["metric"].get("leased") == "true" else "cache_eviction"

    kinds = (
        ("preemption", ranged.get("preemptions", []), lambda s: s["metric"].get("reason", "")),
        ("eviction", ranged.get("evictions", []), eviction),
    )
    return [
        (float(ts), kind, *labels(s), reason(s), float(v), s["metric"].get("by_tier"), None)
        for kind, series, reason in kinds
        for s in series
        for ts, v in s["values"]
        if float(v) > 0
    ]


def _prometheus_lease_reuse(ranged: dict[str, list[dict[str, Any]]]) -> list[tuple]:
    reuse: dict[tuple[float, str], list[float]] = {}
    for s in ranged.get("lease_reuse", []):
        slot = m.LEASE_OUTCOMES.index(s["metric"].get("outcome", "lost"))
        for ts, v in s["values"]:
            reuse.setdefault((float(ts), s["metric"].get("tier", "")), [0.0, 0.0])[slot] = float(v)
    return [(t, tier, r, lost) for (t, tier), (r, lost) in sorted(reuse.items()) if r + lost]


def _prometheus_fair_share(ranged: dict[str, list[dict[str, Any]]]) -> list[tuple]:
    fair: dict[tuple[float, str, str], list[float]] = {}
    for slot, name in enumerate(("fair_served", "fair_entitled")):
        for s in ranged.get(name, []):
            key = (s["metric"].get("tenant_id", ""), s["metric"].get("tier", ""))
            for ts, v in s["values"]:
                fair.setdefault((float(ts), *key), [0.0, 0.0])[slot] = float(v)
    return [(*k, served, ent) for k, (served, ent) in sorted(fair.items()) if ent > 0]


def _prometheus_engines(instant: dict[str, list[dict[str, Any]]]) -> list[tuple]:
    """One row per data-parallel rank of every replica (instance/engine)."""
    per_engine: dict[str, dict[str, float]] = {}
    for column in ENGINE_COLUMNS[1:]:
        name = "engine_" + column.removesuffix("_blocks")
        for r in instant.get(name, []):
            key = f"{r['metric'].get('instance', '')}/{r['metric'].get('engine', '0')}"
            per_engine.setdefault(key, {})[column] = float(r["value"][1])
    return [
        (key, *(int(v.get(c, 0)) for c in ENGINE_COLUMNS[1:]))
        for key, v in sorted(per_engine.items())
    ]


def _alert_starts(series: list[dict[str, Any]]) -> list[tuple]:
    """An event where each alert's ALERTS series starts, and again after each gap longer
    than its step: when it went pending or firing."""
    out = []
    for s in series:
        labels = s["metric"]
        who = (labels.get("tier", ""), labels.get("tenant_id", ""))
        what = f"{labels.get('alertname', '')} {labels.get('alertstate', '')}"
        times = [float(ts) for ts, _ in s["values"]]
        step = min((b - a for a, b in itertools.pairwise(times)), default=0.0)
        for before, t in zip([None, *times], times, strict=False):
            if before is None or t - before > step * 1.5:
                out.append((t, "alert", *who, what, 1.0, None, None))
    return out


# -- shaping for the page ---------------------------------------------------------------------


def lease_hit_series(reuse: pd.DataFrame, bucket_seconds: int = 30) -> pd.DataFrame:
    """Lease hit ratio per tier and time bucket (t, tier, ratio), buckets with no leased
    next turn left out."""
    if reuse.empty:
        return pd.DataFrame(columns=["t", "tier", "ratio"])
    bucketed = (
        reuse.assign(t=reuse["t"].dt.floor(f"{bucket_seconds}s"))
        .groupby(["t", "tier"], as_index=False)[["reused", "lost"]]
        .sum()
    )
    bucketed = bucketed[bucketed["reused"] + bucketed["lost"] > 0]
    ratio = bucketed["reused"] / (bucketed["reused"] + bucketed["lost"])
    return bucketed.assign(ratio=ratio)[["t", "tier", "ratio"]].reset_index(drop=True)


def fair_share_table(fair: pd.DataFrame, now: pd.Timestamp) -> pd.DataFrame:
    """Per tenant that waited in the window: its fair-share ratio now (the last minute)
    and over the window (served / entitled weighted tokens; 1 is its share), lowest
    window ratio first, so the tenants kept under their share lead."""
    columns = ["tenant_id", "tier", "now", "window"]
    if fair.empty:
        return pd.DataFrame(columns=columns)
    keys = ["tenant_id", "tier"]
    window = fair.groupby(keys)[["served", "entitled"]].sum()
    recent = (
        fair[fair["t"] >= now - pd.Timedelta(seconds=60)]
        .groupby(keys)[["served", "entitled"]]
        .sum()
    )
    out = pd.DataFrame({"window": window["served"] / window["entitled"]})
    out["now"] = recent["served"] / recent["entitled"]
    return out.reset_index()[columns].sort_values(["window", "tenant_id"]).reset_index(drop=True)


# The live tenant table as the page shows it: who, how much, who lost what, then detail.
TENANT_HEADERS = {
    "tenant_id": "Tenant",
    "tier": "Tier",
    "held": "Held blocks (running + lease-kept)",
    "preemptions_5m": "Preemptions (5 min)",
    "evictions_5m": "Evicted blocks (5 min)",
    "running": "Running blocks",
    "cached_leased": "Lease-kept cached blocks",
    "cached": "Other cached blocks",
    "leases": "Active leases",
    "lease_seconds_left": "Lease time left (s)",
    "reserved_5m": "Reserved block-seconds (5 min)",
    "retained_5m": "Retained block-seconds (5 min)",
}


def tenant_display(tenants: pd.DataFrame) -> pd.DataFrame:
    """`pick_tenants`' rows with plain headers, the figures an SRE acts on first, and `-`
    where a figure does not exist (no tier, no lease running)."""
    out = tenants.assign(
        tier=[t or "-" for t in tenants["tier"]],
        lease_seconds_left=[
            "-" if pd.isna(v) else f"{v:,.0f}" for v in tenants["lease_seconds_left"]
        ],
    )
    return out[list(TENANT_HEADERS)].rename(columns=TENANT_HEADERS)


def who_took_whose(events: pd.DataFrame, by: str = "tier") -> pd.DataFrame:
    """Who lost KV cache to whom in the window: a row per (victim, cause), the victim the
    tier (or tenant) that lost it, the cause the tier (or tenant) whose allocation took
    it; `preempted` requests and `evicted` cached blocks. Largest first."""
    columns = ["victim", "cause", "preempted", "evicted"]
    taken = events[events["kind"].isin(["preemption", "eviction"])]
    if taken.empty:
        return pd.DataFrame(columns=columns)
    victim = "tier" if by == "tier" else "tenant_id"
    cause = "by_tier" if by == "tier" else "by_tenant"
    frame = taken.assign(
        victim=taken[victim].fillna("-"),
        cause=taken[cause].fillna("-").replace({NO_CAUSE: "- (cache reset)"}),
        preempted=(taken["kind"] == "preemption") * taken["n"],
        evicted=(taken["kind"] == "eviction") * taken["n"],
    )
    out = frame.groupby(["victim", "cause"], as_index=False)[["preempted", "evicted"]].sum()
    out = out.sort_values(["evicted", "preempted", "victim"], ascending=[False, False, True])
    return out[columns].reset_index(drop=True)


def filter_events(events: pd.DataFrame, kinds=(), tiers=(), tenant: str = "") -> pd.DataFrame:
    """The timeline's events of the chosen kinds and tiers (none chosen: all), whose
    tenant contains `tenant` (any case); newest first."""
    keep = pd.Series(True, index=events.index)
    if kinds:
        keep &= events["kind"].isin(list(kinds))
    if tiers:
        keep &= events["tier"].isin(list(tiers))
    if tenant:
        keep &= events["tenant_id"].fillna("").str.contains(tenant, case=False, regex=False)
    return events[keep].sort_values("t", ascending=False).reset_index(drop=True)


def pick_tenants(tenants: pd.DataFrame, search: str = "", top: int = 20) -> pd.DataFrame:
    """The tenant table for display: matching `search` (substring, any case), then the
    `top` by blocks held (running + leased), then by cached blocks."""
    frame = tenants
    if search:
        frame = frame[frame["tenant_id"].str.contains(search, case=False, regex=False)]
    ordered = frame.assign(_total=frame["held"] + frame["cached"]).sort_values(
        ["held", "_total", "tenant_id"], ascending=[False, False, True]
    )
    return ordered.drop(columns="_total").head(top).reset_index(drop=True)


CHART_POINTS = 120  # per series: what a chart a few hundred pixels wide can show


def top_occupancy(
    occupancy: pd.DataFrame, keep: Iterable[str], points: int = CHART_POINTS
) -> pd.DataFrame:
    """Occupancy with every tenant outside `keep` summed into one `other` series, at
    most `points` times a series (the mean over each bucket): a page refresh sends and
    draws a few thousand points, not one per second per tenant and state."""
    keep = set(keep)
    frame = occupancy.assign(
        tenant_id=occupancy["tenant_id"].where(occupancy["tenant_id"].isin(keep), OTHER)
    )
    summed = frame.groupby(["t", "tenant_id", "state"], as_index=False)["blocks"].sum()
    if summed.empty or summed["t"].nunique() <= points:
        return summed
    span = (summed["t"].max() - summed["t"].min()) / points
    bucketed = summed.assign(t=summed["t"].dt.floor(span.ceil("s")))
    return bucketed.groupby(["t", "tenant_id", "state"], as_index=False)["blocks"].mean()


def top_tenant_ids(occupancy: pd.DataFrame, top: int) -> list[str]:
    """The `top` tenants by blocks over the window (area under their curve)."""
    if occupancy.empty:
        return []
    totals = occupancy.groupby("tenant_id")["blocks"].sum().sort_values(ascending=False)
    return list(totals.index[:top])
