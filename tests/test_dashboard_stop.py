"""`kvlease dashboard` stops with everything it started: SIGTERM and SIGINT reach its
Streamlit, which ends; the status says which signal; the port is free again. Killed
with SIGKILL, its Streamlit is told to stop by the kernel (parent-death signal), and the
next start on the same port succeeds."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from servers import free_port
from waiting import until

HANG = 120  # seconds: a hang, not a slow machine


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid:
                    out.append(int(entry.name))
    return out


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _start(port: int, log: Path) -> tuple[subprocess.Popen, int]:
    """`kvlease dashboard` on `port`, up (Streamlit answers its health check); its
    Streamlit's pid."""
    argv = [sys.executable, "-m", "kvlease", "dashboard", "--port", str(port)]
    argv += ["--engine", f"http://127.0.0.1:{free_port()}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLEASE_DASHBOARD")}
    proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)

    def up() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"http://127.0.0.1:{port}/_stcore/health", timeout=2).text == "ok"
        assert proc.poll() is None, log.read_text()
        return False

    until(up, "the dashboard to answer its health check")
    [streamlit] = _children(proc.pid)
    return proc, streamlit


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_dashboard_and_its_streamlit(sig, tmp_path):
    port = free_port()
    proc, streamlit = _start(port, tmp_path / "dashboard.log")
    proc.send_signal(sig)
    assert proc.wait(timeout=HANG) == 128 + sig
    until(lambda: _gone(streamlit), "Streamlit to end")
    until(lambda: _port_free(port), "the port to be free")


def test_a_killed_dashboard_takes_its_streamlit_along_and_starts_again(tmp_path):
    port = free_port()
    proc, streamlit = _start(port, tmp_path / "first.log")
    proc.kill()
    proc.wait()
    until(lambda: _gone(streamlit), "Streamlit to end after its parent was killed")
    until(lambda: _port_free(port), "the port to be free")
    again, _ = _start(port, tmp_path / "second.log")
    again.send_signal(signal.SIGTERM)
    assert again.wait(timeout=HANG) == 128 + signal.SIGTERM
