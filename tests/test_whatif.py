"""The What if view's pieces (`kvlease.dashboard.whatif`): the headline names the change, dropped
turns are said, the current side is set against the real bill, progress moves, and no
replay child or folder outlives its page or its dashboard."""

from __future__ import annotations

import subprocess
import sys
from datetime import date
from decimal import Decimal
from pathlib import Path

import procs
from records import NOV, rec
from waiting import until

from kvlease.dashboard import usage, whatif
from kvlease.demo.workload import WorkloadSpec, generate, save_trace
from kvlease.exporters.ledger import UsageLedger


def _report(**settings) -> dict:
    side = {
        "requests": 10,
        "dropped_turns": 0,
        "currency": "USD",
        "cost": 2.0,
        "tiers": {"free": {"kv_block_hours": 0.5, "kv_retention_hours": 0.25}},
        "tenants": {},
    }
    base = {
        "current": {"tiers": "in force", "pool_blocks": 64},
        "proposed": {"tiers": "in force", "pool_blocks": 64},
        "assigned": {},
    }
    return {"current": dict(side), "proposed": dict(side), "settings": base | settings}


def test_the_headline_names_the_proposed_change():
    assert whatif.proposal(_report()) == (
        "Proposed: no change (the same tier table, tenants and pool on both sides)."
    )
    report = _report(
        proposed={"tiers": "new.toml", "pool_blocks": 128}, assigned={"acme": "premium"}
    )
    assert whatif.proposal(report) == (
        "Proposed: tier table new.toml instead of in force; 1 tenant moved (acme to premium); "
        "a pool of 128 blocks instead of 64."
    )


def test_dropped_turns_are_said_with_the_reason():
    report = _report()
    assert whatif.dropped(report) is None
    report["current"]["dropped_turns"] = report["proposed"]["dropped_turns"] = 186
    assert whatif.dropped(report).startswith("186 recorded turns were not replayed")
    assert "max_model_len" in whatif.dropped(report)


def test_the_current_side_is_set_against_the_real_bill(tmp_path, tiers):
    ledger = UsageLedger(f"sqlite:///{tmp_path / 'u.db'}")
    ledger.write([rec(1, at=NOV + 3600), rec(2, at=NOV + 7200)])
    finance = usage.load_finance(ledger.url, NOV, NOV + 86400, tiers)
    billed = usage.billed(finance)
    assert billed["requests"] == 2 and billed["block_hours"] == Decimal("0.02")
    table = whatif.reconciliation(_report(), billed).set_index("figure")
    assert table.loc["requests", "difference"] == 8
    assert table.loc["cost (USD)", "ledger"] == float(billed["cost"])
    assert "re-timed" in table.loc["KV block-hours", "why they differ"]


def test_progress_moves_from_starting_to_counting():
    fraction, text = whatif.progress("", 3.2)
    assert fraction is None and text.startswith("starting the replay engine") and "3 s" in text
    line = "replay:  12%|#2        | 760/6316 [00:15<01:50, 50.1req/s]"
    fraction, text = whatif.progress(line, 20)
    assert fraction == 760 / 6316 and text.startswith("760 of 6,316 requests replayed")


def test_the_last_week_with_records_ends_on_the_newest_record(tmp_path):
    ledger = UsageLedger(f"sqlite:///{tmp_path / 'u.db'}")
    assert usage.last_week_with_records(ledger.url, date(2026, 12, 2)) == (
        date(2026, 11, 26),
        date(2026, 12, 3),
    )
    ledger.write([rec(1, at=NOV + 5 * 86400 + 60)])  # 6 November
    assert usage.last_week_with_records(ledger.url, date(2026, 12, 2)) == (
        date(2026, 10, 31),
        date(2026, 11, 7),
    )


def _sleeper(*marks: str) -> subprocess.Popen:
    """A real process, in its own group, whose command line carries `marks` (read back
    from /proc: for a moment after the spawn it is still empty)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)", *marks], start_new_session=True
    )
    cmdline = Path(f"/proc/{proc.pid}/cmdline")
    until(lambda: cmdline.read_bytes(), "the sleeper's command line", 30, interval=0.01)
    return proc


def test_a_job_no_page_polls_is_stopped_with_its_child():
    """The page polls every 2 s while its browser session is open; a closed session
    stops polling, and the job's child and folder go after ORPHAN_SECONDS."""
    job, watched = whatif.ReplayJob(), whatif.ReplayJob()
    job.process, watched.process = _sleeper(), _sleeper()
    whatif.reap()
    assert job.folder.exists() and job.process.poll() is None  # just started: not orphaned
    job.polled -= whatif.ORPHAN_SECONDS + 1  # its page last asked over 30 s ago
    assert watched.poll()[0] == "running"
    assert whatif.reap() >= 1
    assert job.process.returncode is not None and not job.folder.exists()
    assert watched.folder.exists() and watched.process.poll() is None
    watched.stop()
    assert watched.process.returncode is not None


# A page's process (Streamlit's, here a plain one) that starts a What if replay through
# the real ReplayJob, says the replay's pid, and waits to be killed.
HOST = """
import sys, time
from kvlease.dashboard import whatif
job = whatif.ReplayJob().start(["--trace", sys.argv[1], "--model", sys.argv[2], "--quiet"])
print(job.process.pid, job.report_path, flush=True)
time.sleep(600)
"""


def test_a_killed_pages_replay_and_its_workers_stop_by_themselves(tmp_path, demo_model):
    """Streamlit killed (no `stop()`, no atexit): the kernel tells the replay to stop
    (parent-death signal), and the replay ends its workers; before, it ran to its end."""
    trace = tmp_path / "trace.csv"
    spec = WorkloadSpec.for_tenants(11, duration=3600.0, sessions_per_second=2.0)  # hours of work
    save_trace(generate(spec), trace)
    host = subprocess.Popen(
        [sys.executable, "-c", HOST, str(trace), demo_model], stdout=subprocess.PIPE, text=True
    )
    try:
        assert host.stdout is not None
        pid, report = host.stdout.readline().split()
        replay = int(pid)

        def two_workers() -> bool:
            assert procs.running([replay]), "the replay ended first"
            return len(procs.children(replay, b"spawn_main")) == 2

        until(two_workers, "the replay's two workers", 300, 0.1)
        workers = procs.children(replay, b"spawn_main")
    finally:
        host.kill()
        host.wait()
    until(lambda: not procs.running([replay, *workers]), "the replay to end", 300, 0.1)
    assert not Path(report).exists()  # stopped, not run to its end (about 80 s of work)
