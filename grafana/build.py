"""The Grafana dashboards and alert rules, as code: `kvlease grafana build` writes
grafana/dashboards/*.json and grafana/alerts.yml.

Panels are plain data (`Panel`, `Query`) rendered with Grafana's own
foundation SDK (`grafana-foundation-sdk`), so a panel is a title, a sentence
and its PromQL. Every query reads only kvlease's `vllm_tenant_*` families
(exporters/metrics.py; a test holds them to it), filtered by the dashboard
variables: datasource, job, instance, tier, tenant (multi-select; its options
follow the tier picked, through `vllm_tenant_info`).

The estimated-cost panel prices tokens and block-hours with the tier table
the dashboards were built from (`--tiers`), per tenant's tier.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml
from grafana_foundation_sdk.builders import bargauge, stat, timeseries
from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import prometheus as prom
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import (
    DashboardLinkType,
    DataSourceRef,
    GridPos,
    Threshold,
    ThresholdsMode,
    VariableOption,
    VariableRefresh,
    VariableSort,
)

from kvlease.engine.settings import KEYS
from kvlease.engine.tenancy import TierTable
from kvlease.exporters import metrics as m
from kvlease.exporters.pricing import SKUS, Sku
from kvlease.exporters.writer import DEAD_LETTER_FILE, WAIT_ENV

HERE = Path(__file__).resolve().parent
DASHBOARD_DIR = HERE / "dashboards"
KUBERNETES_DIR = HERE.parent / "deploy" / "kubernetes"  # in a source checkout only
ALERTS_FILE = HERE / "alerts.yml"
DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
SEL = 'job=~"$job", instance=~"$instance"'
TENANT = f'{SEL}, tenant_id=~"$tenant"'
TIER = f'{SEL}, tier=~"$tier"'
RANGE = "$__range"  # the dashboard's time range


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


# Grafana units for what kvlease counts (custom `suffix:` units where Grafana has none).
BLOCKS = "suffix: blocks"
BLOCK_HOURS = "suffix: block-h"
BLOCKS_PER_S = "suffix: blocks/s"
TOKENS_PER_S = "suffix: tokens/s"
COUNT = "none"
RATIO = "percentunit"
GOOD, WARN, BAD = "green", "orange", "red"


@dataclass(frozen=True)
class Panel:
    """One panel. `thresholds`: (from value, colour) steps, the first from None (the base):
    they colour stats and bar gauges and are drawn as dashed lines on time series, so an
    alert's level is visible where its figure is."""

    title: str
    description: str
    queries: tuple[Query, ...]
    kind: str = "timeseries"  # timeseries | stat | bargauge
    unit: str = COUNT
    stacked: bool = False
    width: int = 12
    height: int = 8
    min: float | None = 0
    max: float | None = None
    thresholds: tuple[tuple[float | None, str], ...] = ()


def _over(alert: float, warn: float | None = None) -> tuple[tuple[float | None, str], ...]:
    """Green, then orange from `warn`, then red from `alert`: higher is worse."""
    return ((None, GOOD), *(((warn, WARN),) if warn is not None else ()), (alert, BAD))


def _under(alert: float) -> tuple[tuple[float | None, str], ...]:
    """Red, then green from `alert`: lower is worse."""
    return ((None, BAD), (alert, GOOD))


def _sum(fn: str, metric: str, by: str, sel: str = TENANT, window: str = "$__rate_interval") -> str:
    """sum [by (...)] (fn(metric{sel}[window])): the shape of most panels."""
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} ({fn}({metric}{{{sel}}}[{window}]))"


def _q(expr: str, legend: str = "") -> tuple[Query, ...]:
    return (Query(expr, legend),)


def lease_hit_ratio(sel: str, window: str, by: str = "tier", reserved: bool = True) -> str:
    """Reused / (reused + lost) prefix tokens of leased next turns, by `by`: of the turns
    back inside their reservation window (`reserved`), or of those back after it."""
    turns = ", ".join(s for s in (sel, f'reserved="{str(reserved).lower()}"') if s)
    reused = f'{turns}, outcome="{m.LEASE_OUTCOMES[0]}"'
    return (
        f"{_sum('increase', m.LEASE_REUSE.name, by, reused, window)} / "
        f"{_sum('increase', m.LEASE_REUSE.name, by, turns, window)}"
    )


def fair_share_ratio(sel: str, window: str, by: str = "tenant_id, tier") -> str:
    """Served / entitled weighted tokens while backlogged: 1 is a tenant's fair share."""
    return (
        f"{_sum('increase', m.FAIR_SERVED.name, by, sel, window)} / "
        f"{_sum('increase', m.FAIR_ENTITLED.name, by, sel, window)}"
    )


def kv_cache_panels(tiers: TierTable) -> list[Panel]:
    used = f"1 - sum({m.FREE_BLOCKS.name}{{{SEL}}}) / sum({m.POOL_BLOCKS.name}{{{SEL}}})"
    top = next(iter(tiers))
    return [
        Panel(
            "Pool in use",
            "Share of usable KV blocks that are not free (free counts evictable cached "
            "prefixes), summed over the selected instances.",
            _q(used, "in use"),
            kind="stat",
            unit=RATIO,
            width=6,
            max=1,
            thresholds=_over(0.95, 0.8),
        ),
        Panel(
            f"{top.capitalize()} preemptions",
            f"Running {top} requests preempted over the dashboard's time range: kvlease "
            f"preempts {top} work only when nothing of a lower tier is left to take, so "
            f"any is red (the Kvlease{top.capitalize()}Preempted alert).",
            _q(
                _sum("increase", m.PREEMPTIONS.name, "", f'{SEL}, tier="{top}"', RANGE)
                + " or vector(0)",  # none yet: 0, not "No data"
                "preemptions",
            ),
            kind="stat",
            width=6,
            thresholds=_over(1),
        ),
        Panel(
            "Leased prefix evictions",
            "Cached blocks a lease protected that were evicted over the dashboard's time "
            "range: the tier's leased cap or the pool is too small (the "
            "KvleaseLeaseEvictions alert).",
            _q(
                _sum("increase", m.CACHED_EVICTIONS.name, "", f'{SEL}, leased="true"', RANGE)
                + " or vector(0)",
                "evictions",
            ),
            kind="stat",
            unit=COUNT,
            width=6,
            thresholds=_over(1),
        ),
        Panel(
            "Waiting requests",
            "Requests in the scheduler's waiting queue now, all tiers.",
            _q(f"sum({m.WAITING.name}{{{SEL}}})", "waiting"),
            kind="stat",
            width=6,
        ),
        Panel(
            "Pool in use over time",
            "The same share over time; the alert fires above 95% for 5 minutes.",
            _q(used, "in use"),
            unit=RATIO,
            width=24,
            max=1,
            thresholds=_over(0.95, 0.8),
        ),
        Panel(
            "Blocks by tenant and state",
            "KV blocks each tenant holds: running (its requests), cached_leased (prefixes a "
            "lease protects), cached (evictable prefixes).",
            _q(
                f"sum by (tenant_id, state) ({m.KV_BLOCKS.name}{{{TENANT}}})",
                "{{tenant_id}} {{state}}",
            ),
            unit=BLOCKS,
            stacked=True,
            width=24,
            height=10,
        ),
        Panel(
            "Lease hit ratio by tier",
            "Of the prefix tokens a running lease was keeping when its session's next turn "
            "arrived, the share the prefix cache served (the rest was computed again): for "
            "turns back inside their reservation window, when lower tiers could not take "
            "the blocks, and for turns back after it, when only eviction order kept them. "
            f"The alert fires when the first is under {m.LEASE_HIT_ALERT:.0%} for 10 "
            "minutes; the second is the price of not reserving longer (reserve_quantile).",
            (
                Query(lease_hit_ratio(TIER, "$__rate_interval"), "{{tier}} in its window"),
                Query(
                    lease_hit_ratio(TIER, "$__rate_interval", reserved=False),
                    "{{tier}} after its window",
                ),
            ),
            unit=RATIO,
            max=1,
            thresholds=_under(m.LEASE_HIT_ALERT),
        ),
        Panel(
            "Lease reuse by tier (tokens)",
            "Prefix tokens of leased next turns per second: reused from the cache, or lost "
            "(computed again), for turns back inside their reservation window (reserved "
            "true) and after it (false).",
            _q(
                _sum("rate", m.LEASE_REUSE.name, "tier, outcome, reserved", TIER),
                "{{tier}} {{outcome}} (reserved {{reserved}})",
            ),
            unit=TOKENS_PER_S,
            stacked=True,
        ),
        Panel(
            "Fair share within the tier",
            "Each waiting tenant's service over its fair share of its tier (weighted tokens "
            "served while it had requests waiting, over its weight's part of its tier's): "
            "1 is its share, under 1 it got less. "
            f"The alert fires under {m.FAIR_SHARE_ALERT} for 10 minutes.",
            _q(fair_share_ratio(TENANT, "$__rate_interval"), "{{tenant_id}} ({{tier}})"),
            thresholds=_under(m.FAIR_SHARE_ALERT),
        ),
        Panel(
            "Active leases by tenant",
            "Sessions whose lease is running (premium 300 s, standard 60 s after the last "
            "request, by default).",
            _q(f"sum by (tenant_id) ({m.LEASES_ACTIVE.name}{{{TENANT}}})", "{{tenant_id}}"),
            stacked=True,
        ),
        Panel(
            "Lease time left",
            "Longest time left on any of the tenant's leases (a full lease while a request "
            "is in flight).",
            _q(
                f"max by (tenant_id) ({m.LEASE_SECONDS_LEFT.name}{{{TENANT}}})",
                "{{tenant_id}}",
            ),
            kind="bargauge",
            unit="s",
        ),
        Panel(
            "Preemptions by tier, reason and mode",
            "Running requests preempted per second: kv_pressure (the pool ran short), "
            "admit_higher_tier (to admit a waiting request of a higher tier), cache_reset; "
            "mode recompute or offload.",
            _q(
                _sum("rate", m.PREEMPTIONS.name, "tier, reason, mode", TIER),
                "{{tier}} {{reason}} {{mode}}",
            ),
            unit="reqps",
            stacked=True,
        ),
        Panel(
            "Blocks taken by priority and reason",
            "KV blocks taken from tenants per second, by tier priority (0 = premium): blocks "
            "of preempted requests and evicted cached prefixes (cache_eviction, "
            "leased_cache_eviction).",
            _q(
                _sum("rate", m.KV_EVICTIONS.name, "priority, preemption_reason"),
                "priority {{priority}} {{preemption_reason}}",
            ),
            unit=BLOCKS_PER_S,
            stacked=True,
        ),
        Panel(
            "Cached-block evictions by tier",
            "Cached prefix blocks evicted per second to make room, by tier and whether a "
            "lease protected them (leased evictions mean the leased cap or the pool is too "
            "small).",
            _q(
                _sum("rate", m.CACHED_EVICTIONS.name, "tier, leased", TIER),
                "{{tier}} leased={{leased}}",
            ),
            unit=BLOCKS_PER_S,
            stacked=True,
        ),
        Panel(
            "Who preempted whom",
            "Running requests preempted per second, by the victim's tier and the tier whose "
            "allocation or admission took the blocks (by_tier; none: a prefix-cache reset).",
            _q(
                _sum("rate", m.PREEMPTIONS.name, "tier, by_tier", TIER),
                "{{tier}} by {{by_tier}}",
            ),
            unit="reqps",
            stacked=True,
        ),
        Panel(
            "Who evicted whose prefix",
            "Cached prefix blocks evicted per second, by the owner's tier and the tier whose "
            "allocation took them (by_tier): who evicted whose prefix.",
            _q(
                _sum("rate", m.CACHED_EVICTIONS.name, "tier, by_tier", TIER),
                "{{tier}} by {{by_tier}}",
            ),
            unit=BLOCKS_PER_S,
            stacked=True,
        ),
        Panel(
            "Offloaded (swapped) blocks",
            "Blocks of requests preempted in offload mode and not yet resumed (always 0 "
            "without KV offloading, as on CPU).",
            _q(
                f"sum by (tenant_id) ({m.SWAPPED_BLOCKS.name}{{{TENANT}}})",
                "{{tenant_id}}",
            ),
            unit=BLOCKS,
        ),
        Panel(
            "Queue",
            "Requests running, and waiting by tier, in the scheduler.",
            (
                Query(f"sum({m.RUNNING.name}{{{SEL}}})", "running"),
                Query(
                    f"sum by (tier) ({m.WAITING.name}{{{TIER}}})",
                    "waiting {{tier}}",
                ),
            ),
        ),
        Panel(
            "Scheduler events dropped",
            "Events lost to a full event buffer (counters stay exact; spans and the live "
            "event timeline miss them).",
            _q(
                _sum("increase", m.EVENTS_DROPPED.name, "", SEL),
                "dropped",
            ),
            width=24,
            height=6,
            thresholds=_over(1),
        ),
    ]


def _cost_expr(tiers: TierTable) -> str:
    """Estimated cost by tenant over the dashboard's range, priced by the tenant's tier:
    (input - cached)/1k x input + cached/1k x cached + output/1k x output + block-hours x
    block-hour + KV retention block-hours x their reserved and retained prices, as the
    billing export computes it, one term per `pricing.SKUS` entry (its `series`). The
    input counter includes the cached tokens and the block-seconds counter the retention
    (leased blocks between turns), so those terms price them at the difference
    (`also_priced_as`). Prometheus extrapolates counters at the range's edges, so this
    estimates; the ledger is exact."""

    def increase(sku: Sku) -> str:
        family, matcher = sku.series
        labels = f"{TENANT}, {matcher}" if matcher else TENANT
        return f"increase({family}{{{labels}}}[$__range])"

    branches = []
    for tier in tiers:
        p = tiers[tier].prices
        terms = [
            (
                increase(sku),
                (
                    getattr(p, sku.price)
                    - (getattr(p, sku.also_priced_as) if sku.also_priced_as else 0)
                )
                / (1000 if sku.tokens else 3600),  # per token, or per block-second
            )
            for sku in SKUS
        ]
        priced = " or ".join(f"{e} * {_num(price)}" for e, price in terms if price)
        if not priced:
            continue
        info = f'max by (tenant_id) ({m.TENANT_INFO.name}{{{SEL}, tier="{tier}"}})'
        branches.append(f"(({priced}) * on (tenant_id) group_left () {info})")
    if not branches:
        return f"sum by (tenant_id) ({m.TENANT_INFO.name}{{{SEL}}}) * 0"
    return "sum by (tenant_id) (" + " or ".join(branches) + ")"


def _num(value: Decimal) -> str:
    return format(value.normalize(), "f")


def usage_panels(tiers: TierTable) -> list[Panel]:
    return [
        Panel(
            "Tokens per second by tenant and kind",
            "input (prompt), cached_input (prompt tokens served from the prefix cache), "
            "output, recomputed (computed again after a preemption; never billed).",
            _q(
                _sum("rate", m.TOKENS.name, "tenant_id, kind"),
                "{{tenant_id}} {{kind}}",
            ),
            unit=TOKENS_PER_S,
            stacked=True,
            width=24,
            height=10,
        ),
        Panel(
            "KV block-hours by tenant",
            "Block-hours held over the dashboard's time range (running plus leased cached "
            "blocks); the block-hour price applies to all but the KV retention between turns.",
            _q(
                _sum("increase", m.BLOCK_SECONDS.name, "tenant_id", window=RANGE) + " / 3600",
                "{{tenant_id}}",
            ),
            kind="bargauge",
            unit=BLOCK_HOURS,
        ),
        Panel(
            "KV retention block-hours by tenant",
            "Block-hours a tenant's leased sessions held between their turns over the "
            "dashboard's time range: reserved (lower tiers kept out) and retained (only "
            "evicted last), the KV retention SKU's two quantities.",
            _q(
                _sum("increase", m.RETENTION_BLOCK_SECONDS.name, "tenant_id, state", window=RANGE)
                + " / 3600",
                "{{tenant_id}} {{state}}",
            ),
            kind="bargauge",
            unit=BLOCK_HOURS,
        ),
        Panel(
            f"Estimated cost by tenant ({tiers.currency})",
            "Cost over the dashboard's time range at the tier table's prices (built with "
            "`kvlease grafana build --tiers`); Prometheus extrapolates, the ledger's FOCUS "
            "export is the bill.",
            _q(_cost_expr(tiers), "{{tenant_id}}"),
            kind="bargauge",
            unit=f"currency{tiers.currency}",
        ),
        Panel(
            "Monthly budget used by tenant",
            "Month-to-date spend over each budgeted tenant's monthly budget (the budget "
            "file, `kvlease serve --budgets`): 1 is the budget spent. Spend is the ledger's, "
            f"fleet-wide on a shared ledger. Alerts at {m.BUDGET_ALERT:.0%} and at 100%.",
            _q(f"max by (tenant_id) ({m.BUDGET_USED.name}{{{TENANT}}})", "{{tenant_id}}"),
            kind="bargauge",
            unit=RATIO,
            max=1,
            thresholds=_over(1, m.BUDGET_ALERT),
        ),
        Panel(
            "Requests by outcome",
            "Finished requests per second: completed, aborted (client gone), failed.",
            _q(
                _sum("rate", m.REQUESTS.name, "outcome"),
                "{{outcome}}",
            ),
            unit="reqps",
            stacked=True,
        ),
        Panel(
            "Requests by tenant",
            "Finished requests per second, by tenant.",
            _q(
                _sum("rate", m.REQUESTS.name, "tenant_id"),
                "{{tenant_id}}",
            ),
            unit="reqps",
            stacked=True,
        ),
        Panel(
            "Time to first token by tier (p50, p99)",
            "Engine time to first token (queued plus prefill), by tier.",
            quantiles(m.TTFT, "{{tier}}"),
            unit="s",
        ),
        Panel(
            "Mean time to first token by tenant",
            "Each tenant's mean engine time to first token over the interval (a count and a "
            "sum per tenant, not a histogram: cheap at a thousand tenants). The slowest "
            "tenants of a tier show who waits behind whom.",
            _q(
                f"{_sum('rate', m.TENANT_TTFT.name + '_sum', 'tenant_id')} / "
                f"{_sum('rate', m.TENANT_TTFT.name + '_count', 'tenant_id')}",
                "{{tenant_id}}",
            ),
            unit="s",
        ),
        Panel(
            "End-to-end latency by tier (p50, p99)",
            "Engine time from arrival to the last token, by tier.",
            quantiles(m.E2E, "{{tier}}"),
            unit="s",
        ),
        Panel(
            "Queue time by tier (p50, p99)",
            "Time requests waited in the scheduler's queue before they first ran, by tier: "
            "where a lower tier pays for a higher one.",
            quantiles(m.QUEUE_TIME, "{{tier}}"),
            unit="s",
        ),
        Panel(
            "Inter-token latency by tier (p50, p99)",
            "Each request's mean time between output tokens, by tier (requests with more "
            "than one output token).",
            quantiles(m.TIME_PER_OUTPUT_TOKEN, "{{tier}}"),
            unit="s",
        ),
        Panel(
            "Ledger records written",
            "Usage records committed to the ledger per second (one per finished request).",
            _q(_sum("rate", m.LEDGER_RECORDS.name, "", SEL), "records"),
            unit="wps",
        ),
        Panel(
            "Ledger problems",
            "Per interval: failed commits (retried, never dropped), records the database "
            "refused (set aside to the dead-letter file) and records written partial because "
            "the request join was full. Each fires an alert; anything above 0 is red.",
            (
                Query(_sum("increase", m.LEDGER_ERRORS.name, "", SEL), "write errors"),
                Query(_sum("increase", m.LEDGER_DEAD_LETTERS.name, "", SEL), "dead letters"),
                Query(_sum("increase", m.JOIN_OVERFLOWS.name, "", SEL), "partial (join full)"),
            ),
            thresholds=_over(1),
        ),
    ]


def quantiles(family: m.Family, legend: str) -> tuple[Query, ...]:
    """p50 and p99 of a histogram family by tier, over the rate interval."""

    def q(level: str) -> str:
        by_tier = _sum("rate", family.bucket, "le, tier", TIER)
        return f"histogram_quantile({level}, {by_tier})"

    return (Query(q("0.5"), f"p50 {legend}"), Query(q("0.99"), f"p99 {legend}"))


def _variables() -> list[Any]:
    def query_var(name: str, label: str, query: str, multi: bool = False) -> Any:
        return (
            dash.QueryVariable(name)
            .label(label)
            .query(query)
            .datasource(DS)
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(VariableSort.ALPHABETICAL_ASC)
            .include_all(True)
            .all_value(".*")  # "All" matches every tenant, even one missing from the list
            .multi(multi)
            .current(VariableOption(selected=True, text="All", value="$__all"))
        )

    return [
        dash.DatasourceVariable("datasource")
        .label("Data source")
        .type("prometheus")
        .current(VariableOption(selected=True, text="Prometheus", value="${DS_PROMETHEUS}")),
        query_var("job", "job", f"label_values({m.POOL_BLOCKS.name}, job)"),
        query_var(
            "instance",
            "instance",
            f'label_values({m.POOL_BLOCKS.name}{{job=~"$job"}}, instance)',
        ),
        query_var("tier", "tier", f"label_values({m.TENANT_INFO.name}{{{SEL}}}, tier)"),
        query_var(
            "tenant",
            "tenant",
            f'label_values({m.TENANT_INFO.name}{{{SEL}, tier=~"$tier"}}, tenant_id)',
            multi=True,
        ),
        dash.ConstantVariable("live_page")
        .label("kvlease live page")
        .description("Where `kvlease dashboard` serves the live page: the dashboards' link")
        .value(LIVE_PAGE),
    ]


def _panel(p: Panel, panel_id: int, at: GridPos) -> Any:
    builder = {"timeseries": timeseries, "stat": stat, "bargauge": bargauge}[p.kind].Panel()
    builder = (
        builder.id(panel_id)
        .title(p.title)
        .description(p.description)
        .datasource(DS)
        .unit(p.unit)
        .grid_pos(at)
    )
    if p.min is not None:
        builder = builder.min(p.min)
    if p.max is not None:
        builder = builder.max(p.max)
    steps = p.thresholds or ((None, GOOD),)
    builder = builder.thresholds(
        dash.ThresholdsConfig()
        .mode(ThresholdsMode.ABSOLUTE)
        .steps([Threshold(value=v, color=c) for v, c in steps])
    )
    for i, q in enumerate(p.queries):
        target = prom.Dataquery().expr(q.expr).ref_id("ABCDEFGH"[i]).datasource(DS)
        builder = builder.with_target(target.legend_format(q.legend) if q.legend else target)
    if p.kind == "timeseries":
        builder = builder.fill_opacity(25 if p.stacked else 10).legend(
            common_builders.VizLegendOptions()
            .display_mode(common.LegendDisplayMode.TABLE)
            .placement(common.LegendPlacement.RIGHT)
            .show_legend(True)
            .calcs(["lastNotNull", "max"])
        )
        if p.stacked:
            builder = builder.stacking(
                common_builders.StackingConfig().mode(common.StackingMode.NORMAL)
            )
        if p.thresholds:
            builder = builder.thresholds_style(
                common_builders.GraphThresholdsStyleConfig().mode(
                    common.GraphThresholdsStyleMode.DASHED
                )
            )
    else:
        builder = builder.reduce_options(
            common_builders.ReduceDataOptions().calcs(["lastNotNull"]).values(False)
        )
    return builder


GRID_COLUMNS = 24


def layout(panels: list[Panel]) -> list[GridPos]:
    """Left to right, a new row when a panel would pass the grid's 24 columns; a row is as
    tall as its tallest panel. Ids and positions are therefore stable across builds."""
    out, x, y, row = [], 0, 0, 0
    for p in panels:
        if not 0 < p.width <= GRID_COLUMNS:
            raise ValueError(f"panel {p.title!r}: width {p.width} is not 1-{GRID_COLUMNS}")
        if x + p.width > GRID_COLUMNS:
            x, y, row = 0, y + row, 0
        out.append(GridPos(h=p.height, w=p.width, x=x, y=y))
        x, row = x + p.width, max(row, p.height)
    return out


LIVE_PAGE = "http://localhost:8501"  # `kvlease dashboard`'s default address


def _links(uid: str) -> list[Any]:
    """The other kvlease dashboards (same time range and variables), and the live page."""
    return [
        dash.DashboardLink("kvlease dashboards")
        .type(DashboardLinkType.DASHBOARDS)
        .tags(["kvlease"])
        .as_dropdown(False)
        .include_vars(True)
        .keep_time(True),
        dash.DashboardLink("kvlease live page")
        .type(DashboardLinkType.LINK)
        .url("${live_page}")
        .icon("external link")
        .tooltip("kvlease dashboard: live KV state, events and usage (kvlease dashboard)")
        .target_blank(True),
    ]


def _dashboard(uid: str, title: str, description: str, panels: list[Panel]) -> dict[str, Any]:
    builder = (
        dash.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["kvlease", "vllm"])
        .refresh("10s")
        .time("now-1h", "now")
        .timezone("browser")
        .editable()
    )
    for variable in _variables():
        builder = builder.with_variable(variable)
    for link in _links(uid):
        builder = builder.link(link)
    for i, (panel, at) in enumerate(zip(panels, layout(panels), strict=True), 1):
        builder = builder.with_panel(_panel(panel, i, at))
    doc = json.loads(JSONEncoder(sort_keys=True).encode(builder.build()))
    # Import through the UI asks for the Prometheus data source (`__inputs`);
    # provisioning leaves ${DS_PROMETHEUS} unresolved and the variable falls back
    # to the default Prometheus data source.
    doc["__inputs"] = [
        {
            "name": "DS_PROMETHEUS",
            "label": "Prometheus",
            "description": "The Prometheus that scrapes kvlease's /metrics",
            "type": "datasource",
            "pluginId": "prometheus",
            "pluginName": "Prometheus",
        }
    ]
    doc["__requires"] = [
        {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"}
    ]
    return doc


def dashboards(tiers: TierTable) -> dict[str, dict[str, Any]]:
    """File name -> dashboard JSON."""
    return {
        "kvlease-kv-cache.json": _dashboard(
            "kvlease-kv-cache",
            "kvlease / Tenant KV cache",
            "Who holds the shared vLLM engine's KV cache, leases, and who loses blocks.",
            kv_cache_panels(tiers),
        ),
        "kvlease-usage.json": _dashboard(
            "kvlease-usage",
            "kvlease / Tenant usage",
            "Tokens, block-hours, requests, estimated cost and time to first token by tenant.",
            usage_panels(tiers),
        ),
    }


def render(tiers: TierTable) -> dict[str, str]:
    """File name -> the exact text `build` writes (so a test can compare)."""
    return {
        name: json.dumps(doc, indent=2, sort_keys=True) + "\n"
        for name, doc in dashboards(tiers).items()
    }


RUNBOOK = "docs/alerts.md"  # `kvlease grafana build --runbook URL` for where yours is served


def alert_rules(tiers: TierTable, runbook: str = RUNBOOK) -> list[dict[str, Any]]:
    """Prometheus alerting rules, each with a `runbook_url` to its section of the runbook
    (docs/alerts.md: an anchor per alert name, lower-cased); the first tier of the table is
    the one never to preempt."""
    rules = _rules(tiers)
    for rule in rules:
        rule["annotations"]["runbook_url"] = f"{runbook}#{rule['alert'].lower()}"
    return rules


def _rules(tiers: TierTable) -> list[dict[str, Any]]:
    top = next(iter(tiers))
    by = "sum by (job, instance)"
    return [
        {
            "alert": f"Kvlease{top.capitalize()}Preempted",
            "expr": f"sum by (job, instance, by_tier) "
            f'(increase({m.PREEMPTIONS.name}{{tier="{top}"}}[5m])) > 0',
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": f"{top} requests were preempted on {{{{ $labels.instance }}}}, "
                "for {{ $labels.by_tier }} work",
                "description": f"{{{{ $value | humanize }}}} {top} preemptions in 5 minutes. "
                f"kvlease preempts {top} work only when nothing of a lower class is left to "
                f"take: the pool is too small for the {top} load (or every running request "
                f"is {top}).",
            },
        },
        {
            "alert": "KvleasePoolNearlyFull",
            "expr": f"1 - {by} ({m.FREE_BLOCKS.name}) / {by} ({m.POOL_BLOCKS.name}) > 0.95",
            "for": "5m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": "KV pool above 95% on {{ $labels.instance }} for 5 minutes",
                "description": "{{ $value | humanizePercentage }} of the KV pool is in use. "
                "Expect preemptions of lower tiers and longer time to first token.",
            },
        },
        {
            "alert": "KvleaseLeaseEvictions",
            "expr": f"sum by (job, instance, tier, by_tier) "
            f'(increase({m.CACHED_EVICTIONS.name}{{leased="true"}}[10m])) > 0',
            "labels": {"severity": "info"},
            "annotations": {
                "summary": "Leased prefixes of {{ $labels.tier }} tenants were evicted on "
                "{{ $labels.instance }}, for {{ $labels.by_tier }} work",
                "description": "{{ $value | humanize }} lease-protected cached blocks evicted "
                "in 10 minutes: the leased-cache cap of the tier, or the pool, is too small "
                "for the sessions it protects.",
            },
        },
        {
            "alert": "KvleaseLeaseHitLow",
            "expr": f"{lease_hit_ratio('', '10m', 'job, instance, tier')} < {m.LEASE_HIT_ALERT}",
            "for": "10m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": "Leased {{ $labels.tier }} sessions lose their prefix on "
                "{{ $labels.instance }}",
                "description": "Leased next turns back inside their reservation window "
                "found {{ $value | humanizePercentage }} of the prefix their lease was "
                f"keeping (under {m.LEASE_HIT_ALERT:.0%} for 10 minutes): the tier's "
                "reservations (leased_cache_cap, or the cap the payback lowered it to) are "
                "smaller than its sessions' contexts, or the pool is too small for the "
                "leases it must honour.",
            },
        },
        {
            "alert": "KvleaseFairShareLow",
            "expr": f"{fair_share_ratio('', '10m', 'job, instance, tenant_id, tier')} "
            f"< {m.FAIR_SHARE_ALERT}",
            "for": "10m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": "Tenant {{ $labels.tenant_id }} ({{ $labels.tier }}) gets under "
                f"{m.FAIR_SHARE_ALERT:.0%} of its fair share on {{{{ $labels.instance }}}}",
                "description": "While it had requests waiting, it was served "
                "{{ $value | humanizePercentage }} of its weight's part of its tier's service "
                "for 10 minutes: a per-tenant KV cap (max_tenant_kv_share) or preemptions "
                "hold it back, fair share is off (KVLEASE_FAIR_SHARE), or its slack "
                "(KVLEASE_FAIR_SLACK) is large against the tier's traffic.",
            },
        },
        {
            "alert": "KvleaseEventsDropped",
            "expr": f"{by} (increase({m.EVENTS_DROPPED.name}[10m])) > 0",
            "labels": {"severity": "info"},
            "annotations": {
                "summary": "kvlease dropped scheduler events on {{ $labels.instance }}",
                "description": "The engine's event buffer overflowed: counters stay exact, but "
                "spans and the dashboard's event timeline miss {{ $value | humanize }} events. "
                f"Raise {KEYS['event_capacity']} or check that the API process keeps up.",
            },
        },
        {
            "alert": "KvleaseBudgetNearlySpent",
            "expr": f"max by (tenant_id) ({m.BUDGET_USED.name}) >= {m.BUDGET_ALERT}",
            "for": "5m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": "Tenant {{ $labels.tenant_id }} has spent "
                f"{m.BUDGET_ALERT:.0%} of its monthly budget",
                "description": "Month-to-date spend is {{ $value | humanizePercentage }} of "
                "the budget in the budget file; at 100% its requests get a warning header "
                "or HTTP 429 budget_exceeded (its on_exceed).",
            },
        },
        {
            "alert": "KvleaseBudgetExceeded",
            "expr": f"max by (tenant_id) ({m.BUDGET_USED.name}) >= 1",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": "Tenant {{ $labels.tenant_id }} has spent its monthly budget",
                "description": "Month-to-date spend is {{ $value | humanizePercentage }} of "
                "its budget: its requests are refused with 429 budget_exceeded or served "
                "with X-Kvlease-Budget: exceeded, until the month ends or the budget rises.",
            },
        },
        {
            "alert": "KvleaseLedgerWriteErrors",
            "expr": f"{by} (increase({m.LEDGER_ERRORS.name}[5m])) > 0",
            "labels": {"severity": "critical"},
            "annotations": {
                "summary": "Usage ledger commits are failing on {{ $labels.instance }}",
                "description": "{{ $value | humanize }} failed ledger commits in 5 minutes. "
                "Records are retried, not dropped, but responses wait for their record "
                f"({WAIT_ENV}): check the ledger database.",
            },
        },
        {
            "alert": "KvleaseLedgerDeadLetters",
            "expr": f"{by} (increase({m.LEDGER_DEAD_LETTERS.name}[10m])) > 0",
            "labels": {"severity": "critical"},
            "annotations": {
                "summary": "Usage records were refused by the ledger on {{ $labels.instance }}",
                "description": "{{ $value | humanize }} records the database would not take "
                f"were set aside to {DEAD_LETTER_FILE} under KVLEASE_HOME: they are not "
                "billed until an operator fixes and replays them.",
            },
        },
        {
            "alert": "KvleaseJoinOverflow",
            "expr": f"{by} (increase({m.JOIN_OVERFLOWS.name}[10m])) > 0",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": "The request join overflowed on {{ $labels.instance }}",
                "description": "{{ $value | humanize }} requests were recorded before both "
                "halves arrived (flagged partial in the ledger): the engine channel or the "
                "stat logger lags far behind.",
            },
        },
    ]


def render_alerts(tiers: TierTable, runbook: str = RUNBOOK) -> str:
    """The exact text of alerts.yml (so a test can compare)."""
    header = (
        "# Prometheus alerting rules for kvlease (load with rule_files: in prometheus.yml).\n"
        "# Generated by `kvlease grafana build` from grafana/build.py; do not edit.\n"
    )
    doc = {"groups": [{"name": "kvlease", "rules": alert_rules(tiers, runbook)}]}
    return header + yaml.safe_dump(doc, sort_keys=False, width=100)


def render_kubernetes(tiers: TierTable, runbook: str = RUNBOOK) -> dict[str, str]:
    """deploy/kubernetes's generated files: the dashboards as ConfigMaps the Grafana
    sidecar picks up (label `grafana_dashboard`), and the alert rules as a
    prometheus-operator PrometheusRule."""
    header = "# Generated by `kvlease grafana build` from grafana/build.py; do not edit.\n"
    maps = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": name.removesuffix(".json"),
                "labels": {"grafana_dashboard": "1", "app.kubernetes.io/part-of": "kvlease"},
                "annotations": {"grafana_folder": "kvlease"},
            },
            "data": {name: text},
        }
        for name, text in render(tiers).items()
    ]
    rule = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "kvlease", "labels": {"app.kubernetes.io/part-of": "kvlease"}},
        "spec": {"groups": [{"name": "kvlease", "rules": alert_rules(tiers, runbook)}]},
    }
    return {
        "grafana-dashboards.yaml": header + yaml.safe_dump_all(maps, sort_keys=False, width=100),
        "prometheusrule.yaml": header + yaml.safe_dump(rule, sort_keys=False, width=100),
    }


def build(
    out: Path = DASHBOARD_DIR, tiers: TierTable | None = None, runbook: str = RUNBOOK
) -> list[Path]:
    """Write the dashboards to `out`, and alerts.yml beside them (grafana/ by default), and
    their Kubernetes forms to deploy/kubernetes when writing the committed ones."""
    tiers = tiers or TierTable.load()
    out.mkdir(parents=True, exist_ok=True)
    files = {out / name: text for name, text in render(tiers).items()}
    alerts = render_alerts(tiers, runbook)
    files[ALERTS_FILE if out == DASHBOARD_DIR else out / "alerts.yml"] = alerts
    if out == DASHBOARD_DIR and KUBERNETES_DIR.is_dir():
        files |= {KUBERNETES_DIR / n: t for n, t in render_kubernetes(tiers, runbook).items()}
    for path, text in files.items():
        path.write_text(text)
    return list(files)


def panel_queries(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of a dashboard JSON."""
    return [
        (panel["title"], target["expr"])
        for panel in doc.get("panels", [])
        for target in panel.get("targets", [])
    ]
