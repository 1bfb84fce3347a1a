"""`kvlease dashboard`: runs `streamlit run dashboard/app.py` with its settings in the
environment (data.Config), so a token never shows in a process list.

How it stops: SIGTERM or SIGINT to `kvlease dashboard` is passed to Streamlit, which
ends its sessions (and, through `kvlease.dashboard.whatif`'s exit handler, every What if replay
and its folder); past STOP_SECONDS it is killed. The exit status is Streamlit's (128 +
the signal's number when a signal ended it). Streamlit is also told to stop if this
process dies first (Linux's parent-death signal), so it never outlives it; What if
folders a killed dashboard left are removed at the next start."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from kvlease.dashboard import data, whatif
from kvlease.engine.runtime import check_dependencies

APP = Path(__file__).with_name("app.py")
LOCAL_ADDRESSES = frozenset({"127.0.0.1", "localhost", "::1"})
STOP_SECONDS = 10.0  # Streamlit's time to end after SIGTERM before it is killed
PR_SET_PDEATHSIG = 1


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
    if removed := whatif.sweep_stale():
        print(f"kvlease dashboard: removed {removed} What if folder(s) a stopped dashboard left")
    print(f"kvlease dashboard: http://{args.address}:{args.port}", flush=True)
    # Its own session: a terminal's Ctrl-C reaches this process only, and is passed on once.
    proc = subprocess.Popen(
        command(args.port, args.address),
        env=env,
        preexec_fn=_die_with_parent,
        start_new_session=True,
    )
    return supervise(proc)


def supervise(proc: subprocess.Popen) -> int:
    """Wait for `proc`, passing SIGTERM and SIGINT on (then killing it after
    STOP_SECONDS). The status says how it ended: 128 + N when signal N stopped it (sent
    to this process or to it), else its own."""
    received: list[int] = []

    def forward(signum, _frame) -> None:
        received.append(signum)
        proc.send_signal(signum)
        timer = threading.Timer(STOP_SECONDS, proc.kill)
        timer.daemon = True
        timer.start()

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        return 128 + received[0]
    return 128 - code if code < 0 else code


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (Linux), so a `kvlease
    dashboard` killed with SIGKILL does not leave Streamlit holding its port."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
