"""`kvlease dashboard` stops with everything it started: SIGTERM and SIGINT reach its
Streamlit, which ends; the status says which signal; the port is free again and its run
folder gone. Killed with SIGKILL, its Streamlit is told to stop by the kernel
(parent-death signal), and the next start on the same port succeeds and removes the run
folder the killed one left."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import procs
import pytest
from servers import free_port
from waiting import until

from kvlease.engine import processes

HANG = 120  # seconds: a hang, not a slow machine


def _run_folders(root: Path) -> list[Path]:
    return list(root.glob(f"{processes.FOLDER_PREFIX}dashboard-*"))


def _start(port: int, log: Path) -> tuple[subprocess.Popen, int]:
    """`kvlease dashboard` on `port`, its temporary directory the log's folder, up
    (Streamlit answers its health check); its Streamlit's pid."""
    argv = [sys.executable, "-m", "kvlease", "dashboard", "--port", str(port)]
    argv += ["--engine", f"http://127.0.0.1:{free_port()}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLEASE_DASHBOARD")}
    env["TMPDIR"] = str(log.parent)
    proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)

    def up() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"http://127.0.0.1:{port}/_stcore/health", timeout=2).text == "ok"
        assert proc.poll() is None, log.read_text()
        return False

    until(up, "the dashboard to answer its health check")
    [streamlit] = procs.children(proc.pid)
    return proc, streamlit


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_dashboard_and_its_streamlit(sig, tmp_path):
    port = free_port()
    proc, streamlit = _start(port, tmp_path / "dashboard.log")
    [folder] = _run_folders(tmp_path)
    proc.send_signal(sig)
    assert proc.wait(timeout=HANG) == 128 + sig
    assert not procs.running([streamlit]) and not folder.exists()  # it waited for its tree
    until(lambda: procs.port_free(port), "the port to be free")


def test_a_killed_dashboard_takes_its_streamlit_along_and_starts_again(tmp_path):
    port = free_port()
    proc, streamlit = _start(port, tmp_path / "first.log")
    [left] = _run_folders(tmp_path)
    proc.kill()
    proc.wait()
    until(lambda: not procs.running([streamlit]), "Streamlit to end after its parent was killed")
    until(lambda: procs.port_free(port), "the port to be free")
    assert left.exists()  # nobody removed it
    again, _ = _start(port, tmp_path / "second.log")
    assert f"removed {left}" in (tmp_path / "second.log").read_text()
    assert not left.exists()
    again.send_signal(signal.SIGTERM)
    assert again.wait(timeout=HANG) == 128 + signal.SIGTERM
