"""`kvlease serve` stops with everything vLLM started and leaves nothing behind
(kvlease.engine.processes), through the real processes: SIGINT and SIGTERM end the API
server, engine core, worker and resource tracker, remove the run folder that held vLLM's
and kvlease's sockets, and free the port; a signal while the engine starts stops it
too; after a SIGKILL (with its API server) vLLM's engine ends by itself, and the next
start on the same port succeeds and removes what the killed one left. (A crash of every
process at once, and the shared memory it leaves: tests/test_ledger_crash.py; the
data-parallel server's stop: the last test of tests/test_scale_out.py, on its fleet.)"""

from __future__ import annotations

import os
import signal
import tempfile
from pathlib import Path

import procs
import pytest
from servers import free_port, kvlease_serve
from waiting import until, wait

from kvlease.engine import processes

pytestmark = pytest.mark.engine

HANG = 180  # seconds: a hang, not a slow machine


def _shared_memory() -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir()}


def _sockets() -> set[str]:
    """The socket files at the top of the temporary directory."""
    return {p.name for p in Path(tempfile.gettempdir()).iterdir() if p.is_socket()}


@pytest.fixture(scope="module")
def port() -> int:
    return free_port()


def _stops_cleanly(server, sig: int, port: int) -> None:
    """`sig` ends every process of `server` and removes its run folder, which held its
    sockets; its port is free again."""
    folder, tree = server.folder(), server.tree()
    assert folder is not None and any(p.is_socket() for p in folder.iterdir())
    names = " | ".join(procs.cmdline(p) for p in tree)
    assert "VLLM::EngineCore" in names and "resource_tracker" in names, names
    assert server.stop(sig, timeout=HANG) == 128 + sig
    left = procs.running(tree)
    assert not left, f"outlived kvlease serve: {procs.describe(left)}"
    assert not folder.exists()
    until(lambda: procs.port_free(port), "the port to be free", HANG)


def test_sigint_stops_every_process_and_removes_the_run_folder(
    demo_model, kvlease_home, tmp_path, port
):
    before, shared = _sockets(), _shared_memory()
    server = kvlease_serve(kvlease_home, tmp_path / "serve.log", port=port)
    _stops_cleanly(server, signal.SIGINT, port)
    assert _sockets() <= before, "sockets left in the temporary directory"
    assert _shared_memory() <= shared, "vLLM's shared memory left in /dev/shm"


def test_a_signal_while_the_engine_starts_stops_it_with_the_signals_status(
    demo_model, kvlease_home, tmp_path, port
):
    """vLLM's engine handshake can swallow the signal; the server then waited out the
    drain's deadline and was killed (137). Not ready yet, it has a short deadline and
    its status says it stopped as asked; its shared memory goes with it."""
    shared = _shared_memory()
    server = kvlease_serve(kvlease_home, tmp_path / "starting.log", port=port, answering=503)
    folder, tree = server.folder(), server.tree()
    assert folder is not None and not (folder / processes.READY_FILE).exists()
    assert server.stop(signal.SIGTERM, timeout=HANG) == 128 + signal.SIGTERM
    assert not procs.running(tree) and not folder.exists()
    assert _shared_memory() <= shared, "vLLM's shared memory left in /dev/shm"
    until(lambda: procs.port_free(port), "the port to be free", HANG)


def test_after_a_kill_the_next_start_on_the_port_cleans_up_and_stops_on_sigterm(
    demo_model, kvlease_home, tmp_path, port
):
    """SIGKILL to `kvlease serve` and its API server at once (an OOM kill): vLLM's engine
    core, which vLLM never told to follow its API server, ends by itself (it outlived it
    for good, holding 1.3 GB with its worker), the worker with it. (Something outlived
    180 s once in CI: the failure names what outlived the kill, and ends with its log.)"""
    before = _sockets()
    killed = kvlease_serve(kvlease_home, tmp_path / "killed.log", port=port)
    folder, tree, api = killed.folder(), killed.tree(), killed.api_pid()
    assert any("VLLM::EngineCore" in procs.cmdline(p) for p in tree)
    killed.proc.kill()  # SIGKILL: kvlease serve cleans nothing
    os.kill(api, signal.SIGKILL)  # nor does the API server
    killed.proc.wait()
    wait(lambda: not procs.running(tree), HANG)
    left = procs.running(tree)
    log = killed.log.read_text()[-4000:]  # as tests/servers.py reports a failed start
    assert not left, f"outlived the kill: {procs.describe(left)}; log:\n{log}"
    assert folder is not None and any(p.is_socket() for p in folder.iterdir())  # left
    again = kvlease_serve(kvlease_home, tmp_path / "again.log", port=port)
    try:
        assert f"removed {folder}" in again.log.read_text()
        assert not folder.exists()
        _stops_cleanly(again, signal.SIGTERM, port)
    finally:
        again.stop(signal.SIGKILL)  # only if an assertion failed: it is stopped by then
    assert _sockets() <= before, "sockets left in the temporary directory"
