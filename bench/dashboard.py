"""How fast the live page shows what matters, in a real headless Chromium.

    python -m bench.dashboard              # 3 page loads per machine state
    python -m bench.dashboard --repeats 5
    python -m bench.dashboard --quick      # 1 load each, 4 clients, no warm-up (smoke test)

A real `kvlease serve` (the demo model, a 64-block pool) and a real `kvlease dashboard`
reading its admin API, on the same machine as the browser. Each page load opens the
live page in a fresh Chromium tab and times, from the navigation: the health strip's
headline (what an SRE reads first) and every chart drawn, and reads how long the tab's
main thread was busy until then (Chrome's TaskDuration: the page's own work, stretched
by whatever else holds the cores). Loaded: twelve chat clients keep vLLM busy on both
cores. Quiet: the clients have stopped and the engine idles; the page's window still
holds their traffic, so it draws the same kind of data. Medians of `--repeats` loads.
Results: bench/results/dashboard.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from statistics import median

import httpx

from bench import report
from bench.postgres import free_port
from bench.soak import client
from kvlease.demo.client import LoadStats
from kvlease.demo.run import Demo, resolve_model, server_environment, session_token, start_server
from kvlease.demo.workload import WorkloadSpec, tenant_names
from kvlease.engine.auth import KeyRing
from kvlease.engine.tenancy import TierTable

RESULTS = Path(__file__).parent / "results"
CLIENTS = 12
QUICK_CLIENTS = 4
CHARTS = 5  # pool bar, blocks per tenant, event timeline, lease hit, fair share
HEADLINE = "Alerts from"  # the health strip's source line, under its headline
PATIENCE_MS = 300_000  # a hang, not a slow page
FIGURES = ("headline_s", "charts_s", "main_thread_s")


def _load(stop: threading.Event, base_url: str, tokens) -> None:
    async def main() -> None:
        done = asyncio.Event()
        stats = LoadStats()
        tasks = [
            asyncio.create_task(client(base_url, tok, tenant, tier, stats, done))
            for tenant, tier, tok in tokens
        ]
        while not stop.is_set():
            await asyncio.sleep(0.5)
        done.set()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())


def _open_page(browser, url: str) -> dict[str, float]:
    """Seconds from navigation to the headline and to every chart drawn, and the tab's
    main-thread busy seconds until then."""
    page = browser.new_page(viewport={"width": 1440, "height": 2400})
    devtools = page.context.new_cdp_session(page)
    devtools.send("Performance.enable")
    started = time.monotonic()
    page.goto(f"{url}/?page=live", wait_until="commit")
    page.get_by_text(HEADLINE).first.wait_for(timeout=PATIENCE_MS)
    headline = time.monotonic() - started
    drawn = f"""() => Array.from(document.querySelectorAll('.js-plotly-plot'))
        .filter(el => el.querySelector('.main-svg')).length >= {CHARTS}"""
    page.wait_for_function(drawn, timeout=PATIENCE_MS)
    charts = time.monotonic() - started
    metrics = devtools.send("Performance.getMetrics")["metrics"]
    busy = next(m["value"] for m in metrics if m["name"] == "TaskDuration")
    page.close()
    return {"headline_s": headline, "charts_s": charts, "main_thread_s": busy}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--quick", action="store_true", help="one page load each, 4 clients, no warm-up"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    clients = QUICK_CLIENTS if args.quick else CLIENTS
    from playwright.sync_api import sync_playwright

    tiers = TierTable.load()
    secret = secrets.token_urlsafe(48)
    keyring = KeyRing.from_secret(secret)
    demo = Demo(Path(tempfile.mkdtemp(prefix="kvlease-bench-dashboard-")), free_port())
    env = server_environment(secret)
    tokens = [
        (tenant, tier, session_token(keyring, tiers, tenant, tier, session=tenant))
        for tenant, tier in tenant_names(WorkloadSpec.for_tenants(clients))
    ]
    admin = session_token(keyring, tiers, "bench-admin", "premium", roles=("admin",))
    stop = threading.Event()
    rounds: dict[str, list[dict[str, float]]] = {"loaded": [], "quiet": []}
    try:
        if not start_server(demo, resolve_model(None), TierTable.shipped(), None, env):
            return 1
        load = threading.Thread(target=_load, args=(stop, f"{demo.url}/v1", tokens))
        load.start()
        port = free_port()
        # `kvlease dashboard` as an operator runs it; the demo's stop_all ends it with the rest
        demo.spawn(
            "dashboard",
            [sys.executable, "-m", "kvlease", "dashboard", "--engine", demo.url,
             "--port", str(port)],
            {**os.environ, "KVLEASE_DASHBOARD_TOKEN": admin},
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/_stcore/health", timeout=2).text == "ok":
                    break
            time.sleep(0.5)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(
                executable_path=shutil.which("chromium") or "/usr/bin/chromium",
                args=["--no-sandbox", "--disable-gpu"],
            )
            if not args.quick:  # the smoke run skips it: its figures are not reported
                _open_page(browser, url)  # warm-up: Streamlit's first script run
            for state in rounds:
                if state == "quiet":
                    stop.set()
                    load.join()  # every client's last turn answered: the engine idles
                for _ in range(repeats):
                    rounds[state].append(_open_page(browser, url))
                    print(f"  {state}: {rounds[state][-1]}", flush=True)
            browser.close()
    finally:
        stop.set()
        demo.stop_all()
    result = {
        "machine": report.machine(),
        "repeats": repeats,
        "clients": clients,
        **{
            state: {k: median(r[k] for r in runs) for k in FIGURES}
            for state, runs in rounds.items()
        },
        "rounds": rounds,
    }
    lines = [
        "# The live page's first render (real Chromium, real server under load)",
        "",
        f"Loaded: {clients} chat clients keep vLLM busy on both cores beside the browser; "
        "quiet: they have stopped and the page shows their traffic. Medians of "
        f"{repeats} page loads, each in a fresh tab.",
        "",
        "| machine | health headline, s | all charts drawn, s | tab main thread busy, s |",
        "| --- | --- | --- | --- |",
        *(
            f"| {state} | {result[state]['headline_s']:.1f} | {result[state]['charts_s']:.1f} "
            f"| {result[state]['main_thread_s']:.1f} |"
            for state in rounds
        ),
    ]
    name = "dashboard-quick" if args.quick else "dashboard"
    report.write(args.out, name, result, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
