"""A replay's report for people: a terminal table, and a self-contained HTML page.

Both read the JSON that `kvlease replay --json` writes, and the HTML page draws
the same figures as the dashboard's "What if" view (kvlease.dashboard.charts).
"""

from __future__ import annotations

import html
from typing import Any

from kvlease.dashboard import charts, whatif

TOP_TENANTS = 10


def terminal(report: dict[str, Any]) -> Any:
    """A rich renderable: per tier and per top tenant, a current and a proposed row."""
    from rich.console import Group
    from rich.table import Table

    def table(title: str, rows: dict[str, tuple[dict, dict]], first: str) -> Table:
        t = Table(title=title, title_justify="left")
        t.add_column(first)
        t.add_column("side")
        for _, name in whatif.COLUMNS:
            t.add_column(name, justify="right")
        for label, sides in rows.items():
            for side, figures in zip(whatif.SIDES, sides, strict=True):
                cells = (whatif.shown(figures.get(k)) for k, _ in whatif.COLUMNS)
                shown_side = f"{side}: {figures['tier']}" if "tier" in figures else side
                t.add_row(label if side == "current" else "", shown_side, *cells)
            t.add_section()
        return t

    cur, new = report["current"], report["proposed"]
    tiers = {t: (cur["tiers"].get(t, {}), new["tiers"].get(t, {})) for t in whatif.tiers_of(report)}
    top = sorted(cur["tenants"], key=lambda t: -cur["tenants"][t]["requests"])[:TOP_TENANTS]
    tenants = {t: (cur["tenants"][t], new["tenants"].get(t, {})) for t in top}
    movers = Table(title="Moves most (current -> proposed)", title_justify="left")
    for name in ("tenant", "TTFT p99 s", "tenant", f"cost ({cur['currency']})"):
        movers.add_column(name)
    by_ttft, by_cost = report["movers"]["ttft_p99_s"][:5], report["movers"]["cost"][:5]
    for i in range(max(len(by_ttft), len(by_cost))):
        a = by_ttft[i] if i < len(by_ttft) else None
        b = by_cost[i] if i < len(by_cost) else None
        movers.add_row(
            a["tenant"] if a else "",
            whatif.pair(*a["ttft_p99_s"]) if a else "",
            b["tenant"] if b else "",
            whatif.pair(*b["cost"]) if b else "",
        )
    return Group(
        whatif.proposal(report),
        *([note] if (note := whatif.dropped(report)) else []),
        table("Per tier", tiers, "tier"),
        table("Top tenants", tenants, "tenant"),
        movers,
        whatif.settings_line(report),
    )


def page(report: dict[str, Any]) -> str:
    """The report as one HTML file: plotly's script inlined once, no network needed."""
    frame = whatif.tier_frame(report)
    figures = [charts.what_if_bars(frame, key, title) for key, title in whatif.TIER_FIGURES]
    parts = [
        fig.to_html(full_html=False, include_plotlyjs=(i == 0), default_height="320px")
        for i, fig in enumerate(figures)
    ]
    tables = [
        ("Per tier (current -> proposed)", whatif.tier_table(report)),
        ("TTFT p99 (s) moves most", whatif.movers_frame(report, "ttft_p99_s")),
        (f"Cost ({report['current']['currency']}) moves most", whatif.movers_frame(report, "cost")),
    ]
    body = "".join(
        f"<h2>{html.escape(t)}</h2>{f.to_html(index=False, border=0)}" for t, f in tables
    )
    settings = html.escape(whatif.settings_line(report))
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>kvlease what-if replay</title>"
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{padding:2px 8px;text-align:right}</style></head><body>"
        f"<h1>What if: current against proposed</h1>"
        f"<p><b>{html.escape(whatif.proposal(report))}</b></p><p>{settings}</p>"
        + (f"<p>{html.escape(note)}</p>" if (note := whatif.dropped(report)) else "")
        + f"{body}"
        f"{''.join(parts)}</body></html>"
    )
