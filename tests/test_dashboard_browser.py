"""The dashboard against a real server under multi-tenant traffic: AppTest for the idle
and Prometheus cases, then `kvlease dashboard` (streamlit run) in a real headless
Chromium (Debian's, driven by Playwright). Screenshots go to test-artifacts/
($KVLEASE_TEST_ARTIFACTS), and the README shows them."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from servers import answers, free_port, prometheus, wait_for_series
from streamlit.testing.v1 import AppTest
from traffic import Traffic
from waiting import until

from kvlease.dashboard import data
from kvlease.dashboard.launch import APP
from kvlease.server.cli import main

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = Path(os.environ.get("KVLEASE_TEST_ARTIFACTS", ROOT / "test-artifacts"))
TENANTS = [
    ("premium-a", "premium"),
    ("standard-a", "standard"),
    ("standard-b", "standard"),
    ("free-a", "free"),
    ("free-b", "free"),
    ("free-c", "free"),
]
DASHBOARD = [sys.executable, "-m", "kvlease", "dashboard"]
# A deadline on a wait for the page's state turns a hang into a failure; it is not a
# speed check. On two busy cores (an engine, its load, Prometheus, a browser and the rest
# of the suite) the live page has taken over 90 s to draw its first chart.
HANG_MS = 300_000
SLOWER = ["--refresh", "4"]  # "at most every 2 s" is the rule; 4 s spares two busy cores
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@pytest.fixture(scope="module")
def server(pressured_server):
    return pressured_server


def _admin_env(server) -> dict[str, str]:
    return {
        data.ENGINE_ENV: server.url,
        data.TOKEN_ENV: server.token("ops", "premium", roles=["admin", "finance"]),
    }


def _app(monkeypatch, env: dict[str, str]) -> AppTest:
    for name in (data.ENGINE_ENV, data.PROMETHEUS_ENV, data.TOKEN_ENV, "KVLEASE_USAGE_DB"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # A guard against a hung script, not a speed check: on two busy cores (an engine,
    # its load, Prometheus and a browser) one run of the page has taken over 30 s.
    return AppTest.from_file(str(APP), default_timeout=600).run()  # a hang, not a slow run


def test_an_idle_engine_shows_an_empty_page_not_an_error(server, monkeypatch):
    app = _app(monkeypatch, _admin_env(server))
    assert not app.exception and not app.error
    assert app.info[0].value.startswith("No tenant holds KV blocks yet")
    assert app.metric[0].value == "0%"


@pytest.fixture(scope="module")
def prom(server, tmp_path_factory):
    """A Prometheus scraping the server from before the traffic: the usage page's
    reconciliation compares its counters with the ledger."""
    with prometheus([f"127.0.0.1:{server.port}"], tmp_path_factory.mktemp("prom")) as url:
        yield url


@pytest.fixture(scope="module")
def traffic(server, prom):
    with Traffic(server, TENANTS) as load:
        load.wait_for(6)
        yield load
    assert load.errors == []


@pytest.fixture(scope="module")
def dashboard(server, pressured_ledger, prom, tmp_path_factory):
    port = free_port()
    env = {**os.environ, **_admin_env(server), "KVLEASE_USAGE_DB": pressured_ledger}
    log = (tmp_path_factory.mktemp("dashboard") / "streamlit.log").open("w")
    argv = [*DASHBOARD, "--engine", server.url, "--usage-db", pressured_ledger]
    argv += ["--prometheus", prom]
    proc = subprocess.Popen(
        [*argv, "--port", str(port), *SLOWER],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        until(lambda: answers(f"{url}/_stcore/health"), "the dashboard answers", 60, 0.25)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
        log.close()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(
            executable_path=shutil.which("chromium") or "/usr/bin/chromium", args=CHROMIUM_ARGS
        )
        yield chromium
        chromium.close()


def _page(browser, **options):
    """A page whose every wait (a click's, an element's) has the hang deadline, not
    Playwright's 30 s: on busy cores the page has taken longer to draw."""
    page = browser.new_page(**options)
    page.set_default_timeout(HANG_MS)
    return page


def _download(page, button, path: Path) -> Path:
    """Click a download button and save its file at `path`. When Streamlit could not make
    the file it says so under the button for 5 s: that fails at once, with its words,
    instead of after the hang deadline."""
    downloads = []

    def keep(download) -> None:  # not `downloads.append`: Playwright tags its handlers
        downloads.append(download)

    page.on("download", keep)
    button.click()
    said = page.locator("[data-testid='stDownloadButtonError']")
    for _ in range(HANG_MS // 250):  # a hang's deadline, in polls that let events in
        if downloads or said.count():
            break
        page.wait_for_timeout(250)
    page.remove_listener("download", keep)
    assert downloads, f"no download; the button said {said.all_inner_texts()}"
    downloads[0].save_as(path)
    return path


# Points above zero in each plotly chart, from the traces plotly.js decoded (_fullData).
PLOTTED_POINTS = """() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(
    el => (el._fullData || []).reduce(
        (n, trace) => n + Array.from(trace.y || []).filter(v => Number(v) > 0).length, 0))"""


def _screenshot(page, path: Path, charts: int) -> None:
    """An artifact, not an assertion: taken once every chart is drawn and nothing is
    greyed out by a rerun, or after 20 s on these two busy cores, whichever is first."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    settled = f"""() => Array.from(document.querySelectorAll('.js-plotly-plot'))
        .filter(el => el.querySelector('.main-svg')).length == {charts}
        && !document.querySelector('[data-stale="true"]')"""
    with contextlib.suppress(PlaywrightTimeout):
        page.wait_for_function(settled, timeout=20_000)
    page.screenshot(path=path)


def test_browser_sees_tenants_and_a_live_chart(traffic, dashboard, browser):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page = _page(browser, viewport={"width": 1440, "height": 2300})
    page.goto(f"{dashboard}/?page=live", wait_until="domcontentloaded")
    # Each tenant shows up once it has held blocks in the window: on two busy cores a free
    # tenant's first request may still be waiting when premium's is drawn.
    for tenant, _ in TENANTS[:4]:
        legend = page.locator(".js-plotly-plot .legendtext", has_text=tenant)
        legend.first.wait_for()
    assert max(page.evaluate(PLOTTED_POINTS)) > 0  # the area chart has data, not a placeholder
    # The health strip leads: alerts (from the Prometheus the dashboard was given) and the
    # pool as held, then the event timeline with its filters.
    assert page.get_by_text("Pool held", exact=True).count() == 1
    assert page.get_by_text("Alerts from Prometheus.").count() == 1
    assert page.get_by_text("Event timeline", exact=True).count() == 1
    assert page.locator("[data-testid='stException']").count() == 0
    # It refreshes itself in place: the stamp moves on, and a marker set in this page
    # survives (a reload would wipe it).
    page.evaluate("() => { window.kvleaseMarker = 1 }")
    stamp = page.get_by_text("Updated ").first.inner_text()
    page.wait_for_function(
        "s => Array.from(document.querySelectorAll('p')).some("
        "p => p.innerText.startsWith('Updated ') && p.innerText !== s)",
        arg=stamp,
    )
    assert page.evaluate("() => window.kvleaseMarker") == 1
    _screenshot(page, ARTIFACTS / "dashboard-live.png", charts=4)
    page.close()


def test_prometheus_as_the_source_gives_the_same_tenants(server, traffic, monkeypatch, tmp_path):
    with prometheus([f"127.0.0.1:{server.port}"], tmp_path) as prom:
        wait_for_series(prom, "vllm_tenant_info")
        wait_for_series(prom, 'vllm_tenant_kv_blocks{tenant_id="premium-a"}')
        app = _app(monkeypatch, {data.PROMETHEUS_ENV: prom})
        assert not app.exception and not app.error
        tenants = app.dataframe[0].value.set_index("Tenant")
        # Leased sessions hold blocks at every instant; a free tenant may hold none just
        # then (preempted, its prefix evicted), so it is not required.
        assert {"premium-a", "standard-a"} <= set(tenants.index) <= {t for t, _ in TENANTS}
        assert tenants.loc["premium-a", "Tier"] == "premium"


def test_browser_downloads_the_cli_csv_from_the_usage_page(
    server, traffic, dashboard, browser, pressured_ledger, tmp_path
):
    # The ledger must hold still to be compared: halt() joins every client, and each
    # request's record is committed before its response's last byte.
    traffic.halt()
    page = _page(browser, viewport={"width": 1440, "height": 1500}, accept_downloads=True)
    page.goto(f"{dashboard}/?page=usage", wait_until="domcontentloaded")
    button = page.get_by_role("button", name="Download FOCUS CSV")
    button.wait_for()
    page.locator(".js-plotly-plot .xtick", has_text="premium-a").first.wait_for()
    got = _download(page, button, tmp_path / "page.csv")
    expected = tmp_path / "cli.csv"
    export = ["usage", "export", "--usage-db", pressured_ledger, "--granularity", "day"]
    assert main([*export, "-o", str(expected)]) == 0
    assert got.read_bytes() == expected.read_bytes()
    assert got.read_text().count("premium-a") >= 1
    _screenshot(page, ARTIFACTS / "dashboard-usage.png", charts=2)

    page.get_by_role("tab", name="Over time").click()
    # Cost per day, stacked by tier (the Tenants tab's hidden chart has legends too).
    bars = page.locator(".js-plotly-plot .legendtext:visible", has_text="premium")
    bars.first.wait_for()
    page.get_by_role("tab", name="Statement").click()
    page.get_by_text("Statement total").first.wait_for()
    button = page.get_by_role("button", name="Printable statement (HTML)")
    statement = _download(page, button, tmp_path / "statement.html")
    assert "Usage statement" in statement.read_text() and "Total (USD)" in statement.read_text()
    page.get_by_role("tab", name="Reconciliation").click()
    page.get_by_text("Ledger totals against the increase").first.wait_for()
    assert page.locator("[data-testid='stException']").count() == 0
    _screenshot(page, ARTIFACTS / "dashboard-reconciliation.png", charts=2)
    page.close()


def test_reconciliation_reads_the_real_prometheus_for_the_ledgers_window(
    traffic, prom, pressured_ledger, tiers
):
    """The counters Prometheus scraped and the ledger, for this month: per tenant label,
    the difference is what the view shows (increase() extrapolates; it is not zero)."""
    from kvlease.dashboard import usage
    from kvlease.exporters.periods import parse_window

    traffic.halt()
    lo, hi = parse_window(None, None)
    wait_for_series(prom, 'vllm_tenant_requests_total{tenant_id="premium-a"}')
    finance = usage.load_finance(pressured_ledger, lo, hi, tiers)
    totals = usage.PrometheusTotals(prom).totals(lo, hi)
    table = usage.reconcile(finance.tenants, totals).set_index(["tenant_id", "figure"])
    row = table.loc[("premium-a", "requests")]
    assert row["ledger"] == int(finance.tenants.set_index("tenant_id").loc["premium-a", "requests"])
    assert row["prometheus"] > 0
    assert row["difference"] == pytest.approx(row["prometheus"] - row["ledger"], abs=0.1)
    assert ("(all)", "output_tokens") in table.index
