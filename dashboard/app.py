"""kvlease's Streamlit page: layout only. Data comes from kvlease.dashboard.data, figures from
kvlease.dashboard.charts. Started by `kvlease dashboard`, which passes its settings in the
environment (see data.Config)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta

import pandas as pd
import streamlit as st
from streamlit.delta_generator import DeltaGenerator

from kvlease.dashboard import charts, data, health, usage, whatif
from kvlease.engine.budgets import BUDGETS_ENV, BudgetTable
from kvlease.engine.tenancy import TierTable
from kvlease.exporters import metrics as m
from kvlease.exporters import money, statement
from kvlease.exporters.periods import GRANULARITIES, parse_window

DEFAULT_ENGINE = "http://127.0.0.1:8000"
PAGES = {"live": "Live", "usage": "Usage & billing", "whatif": "What if"}

st.set_page_config(page_title="kvlease", layout="wide")
CONFIG = data.Config.from_env()


@st.cache_data(ttl=1.0, show_spinner=False, max_entries=8)
def load_live(source: str, url: str, token: str | None, minutes: int) -> data.Live:
    if source == "prometheus":
        return data.PrometheusSource(url).live(minutes)
    return data.EngineSource(url, token).live(minutes)


@st.cache_resource
def tier_table() -> TierTable:
    return TierTable.load()


@st.cache_data(ttl=10, show_spinner=False, max_entries=16)
def load_finance(url: str, start: float, end: float) -> usage.Finance:
    return usage.load_finance(url, start, end, tier_table())


@st.cache_data(ttl=10, show_spinner=False, max_entries=32)
def load_statement(url: str, tenant: str, start: float, end: float) -> usage.Statement:
    return usage.load_statement(url, tenant, start, end, tier_table())


@st.cache_data(ttl=10, show_spinner=False, max_entries=16)
def load_requests(url: str, tenant: str, start: float, end: float) -> pd.DataFrame:
    return usage.load_requests(url, tenant, start, end, REQUESTS_SHOWN)


@st.cache_data(ttl=30, show_spinner=False, max_entries=1)
def budget_table() -> BudgetTable | None:
    """The budget file `kvlease serve` enforces ($KVLEASE_BUDGETS), if there is one,
    re-read every 30 s as the server re-reads it when it changes."""
    path = os.environ.get(BUDGETS_ENV)
    return BudgetTable.load(path) if path else None


@st.cache_data(ttl=2.0, show_spinner=False, max_entries=2)
def load_alerts(url: str) -> list[dict]:
    return data.PrometheusSource(url).alerts()


@st.cache_data(ttl=30, show_spinner=False, max_entries=8)
def load_prometheus_totals(url: str, start: float, end: float) -> dict:
    return usage.PrometheusTotals(url).totals(start, end)


def live_page() -> None:
    with st.sidebar:
        sources = {"engine": "Engine admin API", "prometheus": "Prometheus (fleet)"}
        offered = [s for s in sources if getattr(CONFIG, s)] or ["engine"]
        source = st.radio("Source", offered, format_func=sources.get, key="source")
        if source == "prometheus":
            assert CONFIG.prometheus is not None  # offered only when set
            url, token = CONFIG.prometheus, None
        else:
            url = CONFIG.engine or DEFAULT_ENGINE
            # The server's token stays on the server: the field starts empty and only
            # overrides it; nothing the browser receives holds it.
            hint = "set on the server" if CONFIG.token else "an admin JWT"
            typed = st.text_input(
                "Admin token (JWT)", type="password", placeholder=hint, key="token"
            )
            token = typed or CONFIG.token
        minutes = st.slider("Window (minutes)", 1, 10, 5, key="minutes")
        top = st.number_input("Top tenants", 1, 500, 10, key="top")
        search = st.text_input("Search tenants", key="live_search")
    st.caption(f"{sources[source]}: {url}")
    live_panel(source, url, token or None, minutes, int(top), search)
    live_history(source, url, token or None, minutes, int(top))


def health_strip(live: data.Live, minutes: int) -> None:
    """What is wrong, if anything, before any chart: alerts, then five figures."""
    top = next(iter(tier_table()))
    try:
        alerts = (
            health.from_prometheus(load_alerts(CONFIG.prometheus))
            if CONFIG.prometheus
            else health.evaluate(live, top, minutes)
        )
        where = "Prometheus" if CONFIG.prometheus else "the engine's figures"
    except data.SourceError as err:
        alerts, where = health.evaluate(live, top, minutes), f"the engine's figures ({err})"
    s = health.strip(live, alerts, top)
    say = st.error if s.firing else st.warning if s.pending else st.success
    say(f"**{s.headline}**  \nAlerts from {where}.")
    # One element however many alerts: a refresh must not shift the charts below it, or
    # the browser mounts them again instead of updating them in place.
    st.markdown(
        "\n".join(f"- `{a.state}` **{a.name}** ({a.severity}): {a.summary}" for a in s.alerts)
        or " "
    )
    c1, c2, c3, c4, c5 = st.columns(5)
    c1.metric(
        "Pool held",
        f"{s.held:.0%}",
        help="Blocks holding anything: running requests, lease-kept and other cached "
        f"prefixes. {s.in_use:.0%} is in use by running requests (vLLM counts cached blocks "
        "as free: they are evicted, lease-kept last, when work needs room).",
    )
    c2.metric("Pool in use (running)", f"{s.in_use:.0%}", help="What the 95% alert reads.")
    c3.metric(
        "Lease hit",
        "-" if s.lease_hit is None else f"{s.lease_hit:.0%}",
        None if s.lease_hit is None else f"target {m.LEASE_HIT_ALERT:.0%}",
        delta_color="off",
        help="Of the prefix tokens running leases were keeping, the share leased sessions' "
        "next turns back inside their reservation window found in the cache, over the "
        "window (after it, a miss is the price of a shorter reservation: see Grafana).",
    )
    c4.metric(f"{s.top_tier.capitalize()} preemptions ({minutes} min)", s.top_preemptions)
    c5.metric("Waiting requests", "-" if s.waiting is None else s.waiting)


def event_timeline(events: pd.DataFrame) -> None:
    st.markdown("**Event timeline**")
    c1, c2, c3 = st.columns(3)
    kinds = c1.multiselect("Kinds", data.EVENT_KINDS, key="event_kinds")
    tiers = c2.multiselect("Tiers", sorted(set(events["tier"])), key="event_tiers")
    tenant = c3.text_input("Tenant contains", key="event_tenant")
    shown = data.filter_events(events, kinds, tiers, tenant)
    st.plotly_chart(charts.events_timeline(shown), key="events")
    st.dataframe(
        shown.head(EVENTS_LISTED),
        hide_index=True,
        key="event_list",
        column_config={
            "t": st.column_config.DatetimeColumn("time (UTC)", format="HH:mm:ss"),
            "tenant_id": "tenant",
            "n": st.column_config.NumberColumn("requests or blocks"),
        },
    )


def who_took_whose(events: pd.DataFrame) -> None:
    st.markdown(
        "**Who took whose cache** (this window: the tier or tenant that lost blocks, and "
        "the one whose allocation took them)"
    )
    by = st.radio("By", ["tier", "tenant"], horizontal=True, key="taken_by")
    table = data.who_took_whose(events, by)
    slot = st.empty()
    if table.empty:
        slot.caption("Nobody lost a block to anyone in this window.")
        return
    slot.dataframe(
        table.rename(
            columns={
                "victim": f"lost by ({by})",
                "cause": f"taken by ({by})",
                "preempted": "preempted requests",
                "evicted": "evicted cached blocks",
            }
        ),
        hide_index=True,
        key="taken",
    )


EVENTS_LISTED = 200


def fetch_live(
    source: str, url: str, token: str | None, minutes: int
) -> tuple[data.Live, str | None]:
    """The live picture, or, when the source fails, the last good one and a sentence
    saying since when: the page never blanks on one failed refresh. SourceError when
    there is nothing to keep (the first fetch failed)."""
    key = f"last_live:{source}:{url}:{minutes}"
    try:
        live = load_live(source, url, token, minutes)
    except data.SourceError as err:
        if key not in st.session_state:
            raise
        live, at = st.session_state[key]
        return live, f"{err} Showing the figures of {at:%H:%M:%S} UTC until it answers again."
    st.session_state[key] = (live, datetime.now(UTC))
    return live, None


# The history charts redraw less often than the figures above them: on two busy cores one
# run of every chart took longer than the 2-s refresh, so the page re-ran without end and
# never settled (bench/dashboard.py measures it). What an SRE acts on stays at the refresh.
HISTORY_REFRESH = max(10.0, CONFIG.refresh_seconds)


@st.fragment(run_every=HISTORY_REFRESH)
def live_history(source: str, url: str, token: str | None, minutes: int, top: int) -> None:
    try:
        live, _ = fetch_live(source, url, token, minutes)
    except data.SourceError:
        return  # the panel above says why
    st.caption(f"History: redrawn every {HISTORY_REFRESH:g} s")
    keep = data.top_tenant_ids(live.occupancy, top)
    st.plotly_chart(charts.occupancy_area(data.top_occupancy(live.occupancy, keep)), key="blocks")
    event_timeline(live.events)
    who_took_whose(live.events)
    st.plotly_chart(charts.lease_hit_lines(data.lease_hit_series(live.lease_reuse)), key="lease")
    fair = data.fair_share_table(live.fair_share, pd.Timestamp.now(tz="UTC"))
    st.markdown(
        "**Fair share within each tier** (tenants that waited; 1 is a tenant's share, "
        "under 1 it was served less than its weight entitles it to)"
    )
    st.dataframe(
        fair,
        hide_index=True,
        column_config={
            "tenant_id": "tenant",
            "now": st.column_config.NumberColumn("last minute", format="%.2f"),
            "window": st.column_config.NumberColumn("window", format="%.2f"),
        },
    )
    st.plotly_chart(charts.fair_share_bars(fair), key="fair")


@st.fragment(run_every=CONFIG.refresh_seconds)
def live_panel(source: str, url: str, token: str | None, minutes: int, top: int, search: str):
    try:
        live, stale = fetch_live(source, url, token, minutes)
    except data.SourceError as err:
        st.error(str(err))
        return
    health_strip(live, minutes)
    # Every element below keeps its place from one refresh to the next (a slot for what
    # comes and goes), so Streamlit updates the charts in place.
    status = st.empty()
    if stale:
        status.warning(stale)
    else:
        status.caption(
            f"Updated {datetime.now(UTC):%H:%M:%S} UTC, every {CONFIG.refresh_seconds:g} s"
        )
    idle = st.empty()
    if live.empty:
        idle.info("No tenant holds KV blocks yet: the engine has not served a tenant request.")

    left, right = st.columns([1, 3])
    left.plotly_chart(charts.pool_bar(live.pool_states, live.pool_blocks), key="pool")
    shown = data.pick_tenants(live.tenants, search, top)
    right.markdown(f"**Tenants** ({len(shown)} of {len(live.tenants)})")
    table = data.tenant_display(shown)
    right.dataframe(
        table,
        hide_index=True,
        key="live_tenants",
        column_config={
            **{
                c: st.column_config.NumberColumn(format="localized")
                for c in table.columns
                if table[c].dtype.kind in "if"
            },
            "Tenant": st.column_config.TextColumn(pinned=True),
            "Held blocks (running + lease-kept)": st.column_config.NumberColumn(
                format="localized", help="what the tenant keeps from others now"
            ),
            "Reserved block-seconds (5 min)": st.column_config.NumberColumn(
                format="localized",
                help="KV retention: block-seconds its leased sessions kept lower tiers out of "
                "between turns (billed)",
            ),
            "Retained block-seconds (5 min)": st.column_config.NumberColumn(
                format="localized",
                help="KV retention: block-seconds its leased sessions' blocks were kept, "
                "evicted last, between turns (billed)",
            ),
        },
    )
    engines = st.container()
    if len(live.engines) > 1:
        engines.markdown(
            f"**Engines** ({len(live.engines)}: data-parallel ranks, of every replica; "
            "the figures above are their sum)"
        )
        engines.dataframe(
            live.engines,
            hide_index=True,
            column_config={
                "pool_blocks": "pool blocks",
                "free_blocks": "free blocks",
                "held": st.column_config.NumberColumn("held", help="running + leased cached"),
            },
        )


def download(
    column: DeltaGenerator,
    label: str,
    data: str | bytes | Callable[[], str | bytes],
    file_name: str,
    mime: str,
    help: str | None = None,
) -> None:
    """A download button whose click only downloads. Streamlit's default also reruns the
    page, and a callable's file id dies when that rerun ends: on busy cores the click's own
    rerun can finish before the file is asked for, and the click downloads nothing (make
    test once clicked the FOCUS CSV and got nothing in 300 s). No page here needs the rerun."""
    column.download_button(
        label, data, file_name=file_name, mime=mime, help=help, on_click="ignore"
    )


def usage_page() -> None:
    db = CONFIG.usage_db
    if not db:
        st.info("No usage ledger configured: start the dashboard with --usage-db URL.")
        return
    c1, c2, c3, c4 = st.columns([2, 1, 1, 1])
    preset = c1.radio("Period", usage.PRESETS, horizontal=True, key="preset")
    first, after = usage.preset_window(preset, datetime.now(UTC).date())
    if preset == "Custom":
        first = c2.date_input("From (UTC)", first, key="from")
        after = c3.date_input("To (UTC, exclusive)", after, key="to")
    else:
        c2.caption(f"From {first} to {after} (UTC, exclusive)")
    granularity = c4.selectbox("Granularity", GRANULARITIES, index=1, key="granularity")
    search = st.text_input("Search tenants", key="usage_search")
    try:
        lo, hi = parse_window(str(first), str(after))
        finance = load_finance(db, lo, hi)
        budgets = usage.budget_status(finance.tenants, budget_table(), lo, hi, finance.currency)
    except (ValueError, data.SourceError) as err:
        st.error(str(err))
        return
    currency = finance.currency
    table = finance.tenants
    if search:
        table = table[table["tenant_id"].str.contains(search, case=False, regex=False)]
    cost, before = sum(table["cost"]), sum(table["previous_cost"])
    c1, c2, c3, c4 = st.columns(4)
    c1.metric(
        "Cost",
        f"{money.shown(cost, currency)} {currency}",
        f"{money.shown(cost - before, currency, sign=True)} vs the period before",
        delta_color="off",
    )
    c2.metric("Requests", f"{int(table['requests'].sum()):,}")
    c3.metric("Tenants", f"{int((table['requests'] > 0).sum()):,}")
    over = budgets[budgets["used"] >= usage.ALERT_RATIO] if not budgets.empty else budgets
    c4.metric("Budgets nearly spent or exceeded", len(over) if not budgets.empty else "-")
    tiers = tier_table()
    name = f"kvlease-usage-{first}-{after}"
    c1, c2 = st.columns(2)
    download(
        c1,
        "Download FOCUS CSV",
        lambda: usage.export_csv(db, lo, hi, "focus", granularity, tiers),
        f"{name}-{granularity}.csv",
        "text/csv",
        help="The file `kvlease usage export` writes for this period and granularity.",
    )
    download(
        c2,
        "Tenant summary CSV",
        lambda: usage.export_csv(db, lo, hi, "summary", granularity, tiers),
        f"{name}-summary.csv",
        "text/csv",
        help="One row per tenant, its statement's total: `kvlease usage export --format summary`.",
    )
    by_tenant, over_time, statement_tab, requests_tab, reconciliation = st.tabs(
        ["Tenants", "Over time", "Statement", "Requests", "Reconciliation"]
    )
    with by_tenant:
        tenants_view(table, currency, budgets)
    with over_time:
        c1, c2 = st.columns(2)
        measure = c1.radio("Show", ["cost", "tokens"], horizontal=True, key="measure")
        stack = c2.radio("Stack by", ["tier", "tenant"], horizontal=True, key="stack")
        series = usage.over_time(finance.daily, by=stack, measure=measure)
        unit = currency if measure == "cost" else "tokens"
        st.plotly_chart(charts.over_time(series, unit, stack), key="over_time")
    with statement_tab:
        statement_view(db, finance, lo, hi)
    with requests_tab:
        requests_view(db, finance, lo, hi)
    with reconciliation:
        reconciliation_view(finance, lo, hi)


def tenants_view(table: pd.DataFrame, currency: str, budgets: pd.DataFrame) -> None:
    shown = usage.tenant_table(table, currency, budgets)
    counts = {h: st.column_config.NumberColumn(h, format="localized") for h in shown.columns}
    st.dataframe(
        shown,
        hide_index=True,
        key="tenants",
        column_config={
            **{h: c for h, c in counts.items() if shown[h].dtype.kind in "if"},
            "Tenant": st.column_config.TextColumn(pinned=True),
            "Cost": st.column_config.TextColumn(f"Cost ({currency})", pinned=True),
            "Change": st.column_config.TextColumn(
                f"Change ({currency})", help="against the period of the same length before"
            ),
            "Budget this month": st.column_config.TextColumn(
                help="spend against the monthly budget (KVLEASE_BUDGETS); shown when the "
                "period is one calendar month"
            ),
            "Recomputed tokens (not billed)": st.column_config.NumberColumn(
                format="localized", help="computed again after a preemption; never billed"
            ),
        },
    )
    st.plotly_chart(charts.cost_bars(table[table["requests"] > 0], currency), key="cost_bars")


def _tenant_with_usage(finance: usage.Finance, key: str) -> str | None:
    """A tenant picker over those with usage, largest cost first (so the statement never
    opens on a tenant that owes nothing); None, said on the page, when there are none."""
    owing = finance.tenants[finance.tenants["requests"] > 0]
    if owing.empty:
        st.info("No usage in this period.")
        return None
    return st.selectbox("Tenant", list(owing["tenant_id"]), key=key)


def statement_view(db: str, finance: usage.Finance, lo: float, hi: float) -> None:
    if (tenant := _tenant_with_usage(finance, "statement_tenant")) is None:
        return
    try:
        s = load_statement(db, tenant, lo, hi)
    except data.SourceError as err:
        st.error(str(err))
        return
    st.caption(f"Statement {s.number} · {s.account.name} · {s.period}")
    st.dataframe(usage.statement_frame(s), hide_index=True, key="statement_lines")
    st.metric("Statement total", f"{money.shown(s.total, s.currency)} {s.currency}")
    c1, c2 = st.columns(2)
    name = f"kvlease-statement-{s.number}"
    download(c1, "Statement CSV", statement.to_csv(s), f"{name}.csv", "text/csv")
    download(
        c2,
        "Printable statement (HTML)",
        statement.to_html(s),
        f"{name}.html",
        "text/html",
        help="A self-contained A4 page: open it and print, or save as PDF.",
    )


REQUESTS_SHOWN = 500


def requests_view(db: str, finance: usage.Finance, lo: float, hi: float) -> None:
    if (tenant := _tenant_with_usage(finance, "requests_tenant")) is None:
        return
    try:
        frame = load_requests(db, tenant, lo, hi)
    except data.SourceError as err:
        st.error(str(err))
        return
    st.caption(
        f"The newest {min(len(frame), REQUESTS_SHOWN):,} of {tenant}'s requests in the period."
    )
    st.dataframe(
        frame,
        hide_index=True,
        key="requests",
        column_config={
            c: st.column_config.NumberColumn(format="localized")
            for c in frame.columns
            if frame[c].dtype.kind in "if"
        },
    )


def reconciliation_view(finance: usage.Finance, lo: float, hi: float) -> None:
    if not CONFIG.prometheus:
        st.info(
            "Start the dashboard with --prometheus URL to compare the ledger with the "
            "Prometheus counters of the same window."
        )
        return
    try:
        totals = load_prometheus_totals(CONFIG.prometheus, lo, hi)
    except data.SourceError as err:
        st.error(str(err))
        return
    st.caption(
        "Ledger totals against the increase of kvlease's counters over the same window. "
        "Prometheus extrapolates to the window's edges and starts at its first scrape: "
        "small differences are expected, a large one means lost records or samples."
    )
    st.dataframe(usage.reconcile(finance.tenants, totals), hide_index=True, key="reconcile")


def what_if_page() -> None:
    st.caption(
        "Replays recorded traffic through the real scheduler, offline, under the tier table "
        "in force and a proposed one: `kvlease replay`, run in the background."
    )
    sources = (["ledger"] if CONFIG.usage_db else []) + ["trace"]
    today = datetime.now(UTC).date()
    preset = st.radio(
        "Period", [usage.LAST_WEEK, *usage.PRESETS], horizontal=True, key="whatif_preset"
    )
    try:
        if preset == usage.LAST_WEEK and CONFIG.usage_db:
            first, after = usage.last_week_with_records(CONFIG.usage_db, today)
        else:
            first, after = usage.preset_window(
                "Custom" if preset == usage.LAST_WEEK else preset, today
            )
    except data.SourceError as err:
        st.error(str(err))
        return
    with st.form("whatif"):
        source = st.radio(
            "Traffic", sources, horizontal=True, key="whatif_source",
            format_func={"ledger": "Usage ledger", "trace": "Trace CSV"}.get,
        )  # fmt: skip
        c1, c2 = st.columns(2)
        start = c1.date_input("From (UTC)", first, key=f"whatif_from_{preset}")
        end = c2.date_input("To (UTC, exclusive)", after, key=f"whatif_to_{preset}")
        folder = CONFIG.whatif_dir or f"(set {whatif.WHATIF_DIR_ENV})"
        trace = st.text_input(f"Trace CSV (a file under {folder})", key="whatif_trace")
        tiers = st.text_input(
            f"Proposed tier table (a TOML file under {folder}; empty: the one in force)",
            key="whatif_tiers",
        )
        assign = st.text_area(
            "Move tenants (TOML)", placeholder='[tenants]\nacme = "premium"', key="whatif_assign"
        )
        c1, c2, c3 = st.columns(3)
        pool = c1.number_input("Proposed pool (blocks)", 2, 10**7, 64, key="whatif_pool")
        current = c2.number_input("Current pool (blocks)", 2, 10**7, 64, key="whatif_current")
        speed = c3.number_input("Traffic speed", 0.1, 100.0, 1.0, key="whatif_speed")
        run = st.form_submit_button("Run replay")
    if run:
        try:
            trace_file = (
                whatif.allowed_file(trace, CONFIG.whatif_dir) if source == "trace" else None
            )
            tiers_file = whatif.allowed_file(tiers, CONFIG.whatif_dir) if tiers else None
        except whatif.InputError as exc:
            st.error(str(exc))
            return
        job = st.session_state.get("whatif_job")
        if job is not None:
            job.stop()
        new = whatif.ReplayJob()
        argv = whatif.replay_argv(
            trace=trace_file,
            start=str(start),
            end=str(end),
            tiers=tiers_file,
            assign=new.write("assign.toml", assign) if assign.strip() else None,
            pool_blocks=int(pool),
            current_pool_blocks=int(current),
            speed=float(speed),
        )
        st.session_state["whatif_job"] = new.start(argv, CONFIG.usage_db)
        st.session_state["whatif_window"] = None if trace_file else (str(start), str(end))
    what_if_result()


@st.fragment(run_every=2.0)
def what_if_result() -> None:
    job = st.session_state.get("whatif_job")
    if job is None:
        return
    state, value = job.poll()
    if state == "running":
        fraction, text = whatif.progress(value, time.monotonic() - job.started)
        st.progress(fraction or 0.0, text=text)
        return
    if state == "failed":
        st.error(value)
        return
    st.subheader(whatif.proposal(value))
    if note := whatif.dropped(value):
        st.warning(note)
    frame = whatif.tier_frame(value)
    st.caption(whatif.settings_line(value))
    c1, c2 = st.columns(2)
    download(c1, "Report (HTML)", job.html_path.read_bytes(), "kvlease-what-if.html", "text/html")
    download(
        c2,
        "Report (JSON)",
        job.report_path.read_bytes(),
        "kvlease-what-if.json",
        "application/json",
    )
    st.subheader("Per tier, current -> proposed")
    st.dataframe(whatif.tier_table(value), hide_index=True, key="whatif_tiers_table")
    columns = st.columns(2)
    for i, (key, title) in enumerate(whatif.TIER_FIGURES):
        columns[i % 2].plotly_chart(charts.what_if_bars(frame, key, title), key=f"whatif_{key}")
    c1, c2 = st.columns(2)
    c1.subheader("TTFT p99 (s) moves most")
    c1.dataframe(whatif.movers_frame(value, "ttft_p99_s"), hide_index=True)
    c2.subheader(f"Cost ({value['current']['currency']}) moves most")
    c2.dataframe(whatif.movers_frame(value, "cost"), hide_index=True)
    window = st.session_state.get("whatif_window")
    if window and CONFIG.usage_db:
        st.subheader("The current side against the real bill")
        try:
            lo, hi = parse_window(*window)
            billed = usage.billed(load_finance(CONFIG.usage_db, lo, hi))
        except (ValueError, data.SourceError) as err:
            st.error(str(err))
            return
        st.dataframe(whatif.reconciliation(value, billed), hide_index=True, key="whatif_bill")


def _next_month(first: date) -> date:
    return (first + timedelta(days=32)).replace(day=1)


def login() -> bool:
    """True once this browser session has given the dashboard's password."""
    if CONFIG.password is None or st.session_state.get("signed_in"):
        return True
    st.header("kvlease")
    with st.form("login"):
        attempt = st.text_input("Password", type="password", key="password")
        if st.form_submit_button("Sign in"):
            if CONFIG.password_matches(attempt):
                st.session_state["signed_in"] = True
                st.rerun()
            st.error("Wrong password.")
    return False


if not login():
    st.stop()
with st.sidebar:
    st.title("kvlease")
    wanted = st.query_params.get("page", "live")
    page = st.radio(
        "Page",
        list(PAGES),
        index=list(PAGES).index(wanted) if wanted in PAGES else 0,
        format_func=PAGES.get,
        key="page",
    )
st.header(PAGES[page])
if page == "live":
    live_page()
elif page == "usage":
    usage_page()
else:
    what_if_page()
