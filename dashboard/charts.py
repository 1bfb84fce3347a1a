"""Plotly figures for the dashboard: pure functions of the DataFrames in dashboard.data.

Each builder takes the frame as data.py shapes it and returns a figure; an
empty frame gives an empty chart that says so, never an error.
"""

from __future__ import annotations

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

from dashboard.data import STATES
from engine.tenancy import TierTable

PALETTE = ("#6f42c1", "#1f77b4", "#9aa0a6", "#2ca02c", "#ff7f0e", "#8c564b")  # by importance


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


def pool_gauge(utilisation: float, pool_blocks: int) -> go.Figure:
    """Share of the pool not free, with the 95% line the alert rule uses."""
    fig = go.Figure(
        go.Indicator(
            mode="gauge+number",
            value=round(utilisation * 100, 1),
            number={"suffix": "%"},
            title={"text": f"KV pool in use ({pool_blocks} blocks)"},
            gauge={
                "axis": {"range": [0, 100]},
                "bar": {"color": "#1f77b4"},
                "threshold": {"line": {"color": "#d62728", "width": 3}, "value": 95},
            },
        )
    )
    fig.update_layout(height=230, margin={"t": 50, "b": 10, "l": 30, "r": 30})
    return fig


def occupancy_area(occupancy: pd.DataFrame) -> go.Figure:
    """Blocks per tenant over time, stacked, one row per state."""
    title = "KV blocks by tenant and state"
    if occupancy.empty:
        return _empty(title, "No tenant held KV blocks in this window.")
    fig = px.area(
        occupancy.sort_values(["t", "tenant_id"]),
        x="t",
        y="blocks",
        color="tenant_id",
        facet_row="state",
        category_orders={"state": list(STATES)},
        labels={"t": "", "blocks": "blocks", "tenant_id": "tenant"},
        title=title,
    )
    fig.for_each_annotation(lambda a: a.update(text=STATE_TITLES.get(a.text.split("=")[-1], "")))
    fig.update_layout(height=520, legend_title_text="tenant")
    fig.update_yaxes(matches=None, rangemode="tozero")
    return fig


def events_timeline(events: pd.DataFrame, bucket_seconds: int = 10) -> go.Figure:
    """Preempted requests and evicted cached blocks per time bucket, by tier and reason."""
    title = "Preemptions (requests) and cached-block evictions (blocks)"
    if events.empty:
        return _empty(title, "No preemptions or evictions in this window.")
    bucketed = (
        events.assign(t=events["t"].dt.floor(f"{bucket_seconds}s"))
        .groupby(["t", "kind", "tier", "reason"], as_index=False)["n"]
        .sum()
    )
    fig = px.bar(
        bucketed,
        x="t",
        y="n",
        color="tier",
        pattern_shape="reason",
        facet_row="kind",
        category_orders={"kind": ["preemption", "eviction"]},
        color_discrete_map=TIER_COLORS,
        labels={"t": "", "n": "", "tier": "tier", "reason": "reason"},
        title=title,
    )
    fig.for_each_annotation(lambda a: a.update(text=a.text.split("=")[-1]))
    fig.update_layout(height=420, bargap=0.1)
    fig.update_yaxes(matches=None)
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
