"""Plotly figures for the dashboard: pure functions of the DataFrames in kvlease.dashboard.data.

Each builder takes the frame as data.py shapes it and returns a figure; an
empty frame gives an empty chart that says so, never an error.
"""

from __future__ import annotations

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlease.dashboard.data import STATES
from kvlease.engine.tenancy import TierTable
from kvlease.exporters.metrics import FAIR_SHARE_ALERT, LEASE_HIT_ALERT

PALETTE = ("#6f42c1", "#1f77b4", "#9aa0a6", "#2ca02c", "#ff7f0e", "#8c564b")  # by importance
TENANT_PALETTE = px.colors.qualitative.Plotly  # one colour a tenant, in name order


def tier_colors(tiers: TierTable) -> dict[str, str]:
    """A colour per tier, most important first, and red for requests without a tier."""
    colors = {t: PALETTE[i % len(PALETTE)] for i, t in enumerate(tiers)}
    return {**colors, "unclassified": "#d62728"}


TIER_COLORS = tier_colors(TierTable.load())
STATE_TITLES = {"running": "running", "cached_leased": "cached, leased", "cached": "cached"}


def _empty(title: str, message: str) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_layout(title=title, xaxis_visible=False, yaxis_visible=False, height=260)
    return fig


POOL_COLORS = {"running": "#1f77b4", "cached_leased": "#6f42c1", "cached": "#9aa0a6"}
POOL_TITLES = {**STATE_TITLES, "empty": "empty"}


def pool_bar(states: dict[str, int], pool_blocks: int) -> go.Figure:
    """The pool as one stacked bar: running, leased cached, cached, empty (blocks). vLLM
    counts the two cached kinds as free; the bar shows what leases hold of it."""
    fig = go.Figure(
        [
            go.Bar(
                x=[n],
                y=["pool"],
                orientation="h",
                name=f"{POOL_TITLES[state]} ({n})",
                marker_color=POOL_COLORS.get(state, "#e8eaed"),
                hovertemplate=f"{POOL_TITLES[state]}: %{{x}} blocks<extra></extra>",
            )
            for state, n in states.items()
        ]
    )
    fig.update_layout(
        barmode="stack",
        title=f"KV pool: {pool_blocks} blocks",
        height=240,
        margin={"t": 50, "b": 70, "l": 30, "r": 30},
        xaxis={"range": [0, max(1, pool_blocks)]},  # blocks: the title says so
        yaxis={"visible": False},
        legend={"orientation": "h", "y": -0.35, "yanchor": "top"},  # below the tick labels
    )
    return fig


def lease_hit_lines(series: pd.DataFrame) -> go.Figure:
    """Lease hit ratio per tier over time (turns back inside their reservation window),
    with the 90% line the alert rule uses."""
    title = "Lease hit ratio inside the reservation window: prefix tokens found cached"
    if series.empty:
        return _empty(title, "No leased session sent a next turn in this window.")
    fig = px.line(
        series.sort_values("t"),
        x="t",
        y="ratio",
        color="tier",
        markers=True,
        color_discrete_map=TIER_COLORS,
        labels={"t": "", "ratio": "hit ratio", "tier": "tier"},
        title=title,
    )
    fig.add_hline(y=LEASE_HIT_ALERT, line_color="#d62728", line_dash="dot")
    fig.update_layout(height=300, yaxis={"range": [0, 1.05], "tickformat": ".0%"})
    return fig


def fair_share_bars(table: pd.DataFrame, top: int = 30) -> go.Figure:
    """Each waiting tenant's fair-share ratio over the window (1: its share), lowest
    first, with the line under which the alert rule fires."""
    title = "Fair share within the tier: service / entitled while waiting (1 = its share)"
    if table.empty:
        return _empty(
            title,
            "No tenant was served while it still had requests waiting in this window:<br>"
            "fair share compares tenants that keep a queue (several concurrent requests).",
        )
    shown = table.head(top)
    fig = px.bar(
        shown,
        x="tenant_id",
        y="window",
        color="tier",
        color_discrete_map=TIER_COLORS,
        labels={"tenant_id": "", "window": "served / entitled", "tier": "tier"},
        title=title,
    )
    fig.add_hline(y=1.0, line_color="#7f7f7f", line_dash="dash")
    fig.add_hline(y=FAIR_SHARE_ALERT, line_color="#d62728", line_dash="dot")
    fig.update_layout(height=300)
    return fig


def occupancy_area(occupancy: pd.DataFrame) -> go.Figure:
    """Blocks per tenant over time, stacked, one row per state. Built from graph objects,
    not plotly express: the live page draws it every refresh, and express takes several
    times as long for the same traces."""
    title = "KV blocks by tenant and state"
    if occupancy.empty:
        return _empty(title, "No tenant held KV blocks in this window.")
    tenants = sorted(occupancy["tenant_id"].unique())
    colors = {t: TENANT_PALETTE[i % len(TENANT_PALETTE)] for i, t in enumerate(tenants)}
    fig = make_subplots(
        rows=len(STATES),
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.06,
        subplot_titles=[STATE_TITLES[s] for s in STATES],
    )
    for row, state in enumerate(STATES, 1):
        wide = occupancy[occupancy["state"] == state].pivot_table(
            index="t", columns="tenant_id", values="blocks", aggfunc="sum", fill_value=0
        )
        for tenant in tenants:
            if tenant not in wide:
                continue
            fig.add_trace(
                go.Scatter(
                    x=wide.index,
                    y=wide[tenant],
                    name=tenant,
                    legendgroup=tenant,
                    showlegend=row == 1,
                    stackgroup=f"state{row}",
                    mode="lines",
                    line={"width": 0.5, "color": colors[tenant]},
                    hovertemplate=f"{tenant}: %{{y}} blocks<extra>{STATE_TITLES[state]}</extra>",
                ),
                row=row,
                col=1,
            )
        fig.update_yaxes(title_text="blocks", rangemode="tozero", row=row, col=1)
    fig.update_layout(title=title, height=520, legend_title_text="tenant")
    return fig


MAX_MARKERS = 500  # markers one timeline draws: a refresh stays cheap under a storm
EVENT_SYMBOLS = {"alert": "diamond", "preemption": "x", "eviction": "square", "lease": "circle"}


def events_timeline(events: pd.DataFrame) -> go.Figure:
    """Every event of the window on one time axis, a row per kind (alerts, preemptions,
    evictions, lease starts and expiries), coloured by tier; hover names the tenant, the
    reason and how many requests or blocks."""
    title = "Events: alerts, preemptions, evictions, leases"
    if events.empty:
        return _empty(title, "No event in this window (or none that the filters keep).")
    if len(events) > MAX_MARKERS:  # newest first (data.filter_events): the rest in the table
        title += f" (the newest {MAX_MARKERS:,} of {len(events):,})"
        events = events.head(MAX_MARKERS)
    order = [k for k in ("alert", "preemption", "eviction", "lease") if k in set(events["kind"])]
    fig = px.scatter(
        events,
        x="t",
        y="kind",
        color="tier",
        symbol="kind",
        symbol_map=EVENT_SYMBOLS,
        hover_data={"tenant_id": True, "reason": True, "n": True, "kind": False},
        category_orders={"kind": order},
        color_discrete_map=TIER_COLORS,
        labels={"t": "", "kind": "", "tenant_id": "tenant", "n": "requests or blocks"},
        title=title,
    )
    fig.update_traces(marker={"size": 10, "opacity": 0.8})
    fig.update_layout(height=120 + 60 * len(order), legend={"title": "tier"})
    return fig


def cost_bars(usage: pd.DataFrame, currency: str, top: int = 30) -> go.Figure:
    """Cost per tenant for the period, largest first."""
    title = f"Cost by tenant ({currency})"
    if usage.empty:
        return _empty(title, "No usage recorded in this period.")
    frame = usage.head(top).assign(cost=lambda f: f["cost"].astype(float))
    fig = px.bar(
        frame,
        x="tenant_id",
        y="cost",
        color="tier",
        color_discrete_map=TIER_COLORS,
        labels={"tenant_id": "tenant", "cost": currency},
        title=title,
    )
    fig.update_layout(height=360, xaxis={"categoryorder": "total descending"})
    return fig


def over_time(series: pd.DataFrame, unit: str, by: str) -> go.Figure:
    """Cost or tokens per UTC day, stacked by tier or by the top tenants."""
    title = f"{'Tokens' if unit == 'tokens' else 'Cost'} per day by {by} ({unit})"
    if series.empty:
        return _empty(title, "No usage recorded in this period.")
    fig = px.bar(
        series,
        x="day",
        y="value",
        color="series",
        color_discrete_map=TIER_COLORS if by == "tier" else None,
        labels={"day": "day (UTC)", "value": unit, "series": by},
        title=title,
    )
    fig.update_layout(height=380, barmode="stack")
    # A bar is a day: label days ("Dec 1"), never a midnight ("00:00:00 Dec 1, 2026").
    fig.update_xaxes(tickformat="%b %-d", dtick=86_400_000, hoverformat="%Y-%m-%d")
    return fig


WHAT_IF_COLORS = {"current": "#9aa0a6", "proposed": "#6f42c1"}


def what_if_bars(frame: pd.DataFrame, key: str, title: str) -> go.Figure:
    """One figure of a replay's report (kvlease.dashboard.whatif.tier_frame), current beside
    proposed for each tier."""
    if frame.empty or key not in frame or frame[key].isna().all():
        return _empty(title, "No request of any tier has this figure.")
    fig = px.bar(
        frame,
        x="tier",
        y=key,
        color="side",
        barmode="group",
        title=title,
        color_discrete_map=WHAT_IF_COLORS,
        labels={key: title, "side": ""},
    )
    fig.update_layout(height=300)
    return fig
