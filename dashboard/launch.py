"""`kvlease dashboard`: runs `streamlit run dashboard/app.py` with its settings in the
environment (data.Config), so a token never shows in a process list.

How it stops (kvlease.engine.processes): SIGTERM or SIGINT to `kvlease dashboard` is
passed to Streamlit, which ends its sessions (and, through `kvlease.dashboard.whatif`'s
exit handler, every What if replay); past STOP_SECONDS its tree is killed. Its run
folder, which holds the What if folders, is removed; the status is 128 + the signal's
number. Streamlit is told to stop if this process dies first (Linux's parent-death
signal), and what a killed dashboard left is removed at the next start."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from kvlease.dashboard import data
from kvlease.engine import processes
from kvlease.engine.runtime import check_dependencies

APP = Path(__file__).with_name("app.py")
LOCAL_ADDRESSES = frozenset({"127.0.0.1", "localhost", "::1"})
STOP_SECONDS = 10.0  # Streamlit's time to end after SIGTERM before it is killed


def command(port: int, address: str = "127.0.0.1") -> list[str]:
    return [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(APP),
        "--server.port",
        str(port),
        "--server.address",
        address,
        "--server.headless",
        "true",
        "--browser.gatherUsageStats",
        "false",
        "--global.developmentMode",
        "false",
        "--client.toolbarMode",
        "viewer",
    ]


def environment(
    engine: str | None,
    prometheus: str | None,
    usage_db: str | None,
    token: str | None,
    refresh_seconds: float = 2.0,
) -> dict[str, str]:
    from kvlease.exporters.ledger import DB_ENV, default_url

    env = dict(os.environ)
    env[data.ENGINE_ENV] = engine or ""
    env[data.PROMETHEUS_ENV] = prometheus or ""
    env[DB_ENV] = usage_db or default_url()
    env[data.REFRESH_ENV] = str(refresh_seconds)
    if token:
        env[data.TOKEN_ENV] = token
    return env


def run_dashboard(args) -> int:
    check_dependencies()
    if args.refresh < 2:
        raise ValueError("--refresh must be at least 2 seconds")
    if args.address not in LOCAL_ADDRESSES and not os.environ.get(data.PASSWORD_ENV):
        raise ValueError(
            f"--address {args.address} serves the dashboard beyond this machine: set "
            f"{data.PASSWORD_ENV} so every browser must sign in"
        )
    env = environment(args.engine, args.prometheus, args.usage_db, args.token or None, args.refresh)
    if not (env[data.ENGINE_ENV] or env[data.PROMETHEUS_ENV]):
        env[data.ENGINE_ENV] = "http://127.0.0.1:8000"
    print(f"kvlease dashboard: http://{args.address}:{args.port}", flush=True)
    return processes.supervise(command(args.port, args.address), env, "dashboard", STOP_SECONDS)
