"""`kvlease demo --requests 24 --no-dashboard`, as CI runs it: a fresh KVLEASE_HOME (the
demo model gets built), a real server, Prometheus and two requests per tenant.

Nothing here depends on the machine's speed: the demo's pressure is set in tokens
(`kvlease.demo.run.demand_blocks`), and the run ends after a number of requests, not seconds."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import procs
import pytest
from prometheus_client.parser import text_string_to_metric_families
from servers import free_port
from waiting import until, wait

from kvlease.engine import processes
from kvlease.exporters.ledger import UsageLedger

pytestmark = pytest.mark.engine


def _processes_of(home: Path) -> list[int]:
    """Processes whose environment names this KVLEASE_HOME: the demo's children inherit it."""
    marker = f"KVLEASE_HOME={home}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker in env:
            pids.append(int(entry.name))
    return pids


def _preemptions_by_tier(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "vllm_tenant_preemptions":
            for s in family.samples:
                if s.name.endswith("_total"):
                    out[s.labels["tier"]] = out.get(s.labels["tier"], 0) + s.value
    return out


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    home = tmp_path_factory.mktemp("demo-home")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVLEASE_", "VLLM_"))}
    env["KVLEASE_HOME"] = str(home)
    out = (home / "demo.out").open("w")
    argv = [sys.executable, "-m", "kvlease", "demo", "--requests", "24", "--no-dashboard"]
    argv += ["--port", str(port), "--prometheus-port", str(free_port())]
    proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    last_metrics = ""

    def scraped_until_it_exits() -> bool:
        nonlocal last_metrics
        with contextlib.suppress(httpx.HTTPError):
            r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
            if r.status_code == 200:
                last_metrics = r.text
        return proc.poll() is not None

    wait(scraped_until_it_exits, 1200, interval=2)  # 1200 s: a hang, not a slow machine
    if proc.poll() is None:
        proc.kill()
    out.close()
    return home, proc.wait(), (home / "demo.out").read_text(), last_metrics


def test_demo_exits_cleanly_after_its_duration(demo_run):
    home, code, output, _ = demo_run
    assert code == 0, output[-3000:]
    assert "building the demo model" in output
    assert "kvlease demo is running" in output and "kvlease demo summary" in output
    assert (home / "models").is_dir()


def test_the_summary_has_each_tiers_median_ttft_and_no_errors(demo_run):
    """TTFT p50 read "-" for every tier after a Ctrl-C, and errors 0 beside a live line's
    30 (the clients' figures were dropped); the conversation now ends before the
    server's context length by the server's own token count, so no turn is refused."""
    _, _, output, _ = demo_run
    summary = output[output.index("kvlease demo summary") :]
    rows = {line.split()[0]: line.split() for line in summary.splitlines()[2:5]}
    assert set(rows) == {"premium", "standard", "free"}, summary
    for tier, cells in rows.items():
        # tier, requests, rejected, errors, TTFT p50 ("0.42 s": two cells), ...
        assert cells[3] == "0" and re.fullmatch(r"\d+\.\d\d", cells[4]), (tier, summary)
    assert "errors by HTTP status" not in summary


def test_the_printed_commands_work_as_printed(demo_run):
    """`kvlease` is not on PATH after `make demo`: the banner prints the venv's script."""
    _, _, output, _ = demo_run
    [command] = [
        line.strip() for line in output.splitlines() if line.strip().endswith("--format summary")
    ]
    done = subprocess.run(shlex.split(command), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("tenant_id,amount,currency") and "free-00" in done.stdout


def test_the_heavy_tenant_keeps_a_queue_so_fair_share_has_something_to_show(demo_run):
    from kvlease.demo.run import HEAVY_STREAMS, demo_spec, heavy_tenant

    assert heavy_tenant(demo_spec(12, 0)) == {"free-00": HEAVY_STREAMS}
    _, _, output, metrics = demo_run
    entitled = {
        s.labels["tenant_id"]: s.value
        for family in text_string_to_metric_families(metrics)
        if family.name == "vllm_tenant_fair_entitled_tokens"
        for s in family.samples
        if s.name.endswith("_total")
    }
    assert entitled.get("free-00", 0) > 0, output[-2000:]


def test_the_demo_pool_is_smaller_than_what_its_streams_hold_at_once():
    from kvlease.demo.run import POOL_BLOCKS, demand_blocks, demo_spec

    assert demand_blocks(demo_spec(12, 0)) > POOL_BLOCKS - 1  # vLLM keeps one null block


def test_ledger_has_records_for_all_three_tiers(demo_run):
    home, _, output, _ = demo_run
    records = list(UsageLedger(f"sqlite:///{home / 'demo' / 'usage.db'}").read(0, 4e9))
    assert {"premium", "standard", "free"} <= {r.tier for r in records}
    assert f"({len(records)} records from this run)" in output


def test_metrics_showed_free_tier_preempted_and_premium_never(demo_run):
    _, _, output, metrics = demo_run
    preempted = _preemptions_by_tier(metrics)
    assert preempted.get("free", 0) > 0, output[-2000:]
    assert preempted.get("premium", 0) == 0


def test_no_process_is_left_behind(demo_run):
    home = demo_run[0]
    wait(lambda: not _processes_of(home), 10, interval=0.5)
    assert _processes_of(home) == []


def _starting(url: str) -> bool:
    """True while the server's placeholder answers 503: bound, the engine not yet up."""
    try:
        return httpx.get(f"{url}/metrics", timeout=2).status_code == 503
    except httpx.HTTPError:
        return False


def _run_folders() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob(f"{processes.FOLDER_PREFIX}*"))


def _start_demo(home: Path, model: str) -> tuple[subprocess.Popen, Path, int]:
    """`kvlease demo` with its own KVLEASE_HOME (holding a copy of the session's demo model:
    the run above builds one), returned while vLLM is still starting (the server's
    placeholder answers 503)."""
    shutil.copytree(model, home / "models" / Path(model).name)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVLEASE_", "VLLM_"))}
    env["KVLEASE_HOME"] = str(home)
    log = home / "demo.out"
    port = free_port()
    argv = [sys.executable, "-m", "kvlease", "demo", "--no-dashboard"]
    argv += ["--port", str(port), "--prometheus-port", str(free_port())]
    with log.open("w") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)

    def starting() -> bool:
        assert proc.poll() is None, log.read_text()[-3000:]
        return _starting(f"http://127.0.0.1:{port}")

    until(starting, "the server's placeholder answers 503", 900, 0.5)
    return proc, log, port


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_engine_starts_stops_everything_and_says_it_never_served(
    sig, tmp_path, demo_model
):
    """SIGINT (Ctrl-C) or SIGTERM while vLLM is still starting: the orderly way out,
    whatever the shell did to SIGINT, a summary that says the engine never served, a
    status that names the signal, and no process left behind, not even vLLM's resource
    tracker. (The run above covers stopping under traffic.)"""
    folders = _run_folders()
    proc, log, port = _start_demo(tmp_path, demo_model)
    assert _run_folders() - folders  # the server's, holding its sockets
    proc.send_signal(sig)
    code = proc.wait(300)
    output = log.read_text()
    assert code == 128 + sig, output[-3000:]
    assert "interrupted" in output and "kvlease demo summary" in output
    assert "the engine never served" in output
    until(lambda: not _processes_of(tmp_path), "the demo's processes to be reaped", 30, 0.1)
    assert _run_folders() <= folders
    until(lambda: procs.port_free(port), "the server's port to be free", 30, 0.1)


def test_a_killed_demos_children_stop_by_themselves(tmp_path, demo_model):
    """SIGKILL: the demo stops nothing, the kernel tells its children to (parent-death
    signal), and the server they include stops its engine too; the server's run folder is
    what is left, for the next start's sweep."""
    proc, _, _ = _start_demo(tmp_path, demo_model)
    proc.kill()
    proc.wait()
    until(lambda: not _processes_of(tmp_path), "the killed demo's children to end", 300, 0.5)
