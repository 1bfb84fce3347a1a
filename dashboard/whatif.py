"""The "What if" view's data: a `kvlease replay` run in the background, and its report as
DataFrames.

The page never replays in its own process (a replay loads vLLM, and the dashboard
must not): `ReplayJob` starts `kvlease replay --json FILE` as a child process and
reads the file when the child ends, and its progress bar's last line meanwhile.

Whoever can open the page can name files for the replay to read, so the page reads
only regular files under `KVLEASE_WHATIF_DIR`, of at most `MAX_INPUT_BYTES`
(`allowed_file`), and answers the same for a file that is missing as for one outside
that folder. The child is bounded: `CHILD_CPU_SECONDS` of CPU (the kernel ends it past
that) and `CHILD_MAX_RSS_BYTES` of memory (checked on every poll). A job is stopped
(its child ended, its folder removed) when it is replaced, when its browser session
has not polled it for `ORPHAN_SECONDS` (the session closed: `reap`), and when the
dashboard exits. Folders are `kvlease-whatif-*` in the temporary directory, which under
`kvlease dashboard` is its run folder: a killed dashboard's folders and replays are
removed with it (kvlease.engine.processes).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from kvlease.dashboard.data import WHATIF_DIR_ENV
from kvlease.engine.processes import die_with_parent
from kvlease.exporters.ledger import DB_ENV

MAX_INPUT_BYTES = 256 * 2**20
ORPHAN_SECONDS = 30.0  # a job its page has not polled for this long is stopped
FOLDER_PREFIX = "kvlease-whatif-"
CHILD_CPU_SECONDS = 3600
CHILD_MAX_RSS_BYTES = 6 * 2**30
SIDES = ("current", "proposed")
# The figures of a tier or tenant shown in tables: (JSON key, title).
COLUMNS = (
    ("requests", "requests"),
    ("ttft_p50_steps", "TTFT p50\nsteps"),
    ("ttft_p99_steps", "TTFT p99\nsteps"),
    ("ttft_p50_s", "TTFT p50\ns"),
    ("ttft_p99_s", "TTFT p99\ns"),
    ("preemptions", "preempted"),
    ("recomputed_tokens", "recomputed\ntokens"),
    ("leased_next_turn_hit", "leased\nhit"),
    ("kv_block_hours", "block-\nhours"),
    ("kv_retention_hours", "retention\nblock-hours"),
    ("fair_share_ratio", "fair\nshare"),
    ("cost", "cost"),
)
# The figures per tier shown side by side: (JSON key, title).
TIER_FIGURES = (
    ("ttft_p99_s", "TTFT p99 (s)"),
    ("ttft_p50_s", "TTFT p50 (s)"),
    ("preemptions", "Preemptions"),
    ("leased_next_turn_hit", "Leased next-turn prefix hit"),
    ("kv_block_hours", "KV block-hours"),
    ("cost", "Cost"),
)


class InputError(ValueError):
    """A file the page may not read; the message never says whether it exists."""


def allowed_file(name: str, folder: str | None) -> str:
    """`name` (relative to `folder`, or absolute) as a path the replay may read: a
    regular file under `folder` (symbolic links resolved) of at most MAX_INPUT_BYTES."""
    if not folder:
        raise InputError(f"reading files is off: set {WHATIF_DIR_ENV} to the folder to read")
    root = Path(folder).resolve()
    path = (root / name).resolve()
    refusal = InputError(f"{name!r} is not a readable file under {root}")
    if root not in path.parents:
        raise refusal
    try:
        info = path.stat()
    except OSError:
        raise refusal from None
    if not stat.S_ISREG(info.st_mode):
        raise refusal  # /dev/zero, a folder, a pipe
    if info.st_size > MAX_INPUT_BYTES:
        raise InputError(f"{name!r} is larger than {MAX_INPUT_BYTES // 2**20} MiB")
    return str(path)


# Every job not yet stopped, held strongly: a job whose session state was dropped (the
# browser went away) must still be found to be stopped.
_JOBS: set[ReplayJob] = set()
_JOBS_LOCK = threading.Lock()


def _new_folder() -> Path:
    return Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX))


@dataclass(eq=False)
class ReplayJob:
    """One background `kvlease replay` and its folder. `poll()` never blocks and marks the
    job as watched; `reap()` stops the ones nobody watches."""

    folder: Path = field(default_factory=_new_folder)
    process: subprocess.Popen | None = None
    report: dict[str, Any] | None = None  # read once, when the child has ended
    started: float = field(default_factory=time.monotonic)
    polled: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        with _JOBS_LOCK:
            _JOBS.add(self)
        _start_reaper()

    @property
    def html_path(self) -> Path:
        return self.folder / "report.html"

    @property
    def report_path(self) -> Path:
        return self.folder / "report.json"

    @property
    def log_path(self) -> Path:
        return self.folder / "replay.log"

    def write(self, name: str, text: str) -> str:
        """A file for the replay's arguments (an --assign table), in the job's folder."""
        path = self.folder / name
        path.write_text(text, encoding="utf-8")
        return str(path)

    def start(self, argv: list[str], usage_db: str | None = None) -> ReplayJob:
        """The ledger's URL goes in the child's environment, never on its command line. The
        child's progress bar and table go to the job's log."""
        command = [sys.executable, "-m", "kvlease", "replay", *argv]
        command += ["--json", str(self.report_path), "-o", str(self.html_path)]
        env = {**os.environ, **({DB_ENV: usage_db} if usage_db else {})}
        parent = os.getpid()
        with self.log_path.open("wb") as log:
            # Started from the one launcher thread, which lives as long as this process:
            # the kernel's parent-death signal follows the thread that started a child,
            # and Streamlit's script thread ends after each run of the page.
            self.process = _LAUNCHER.submit(
                subprocess.Popen,
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=lambda: _bound_child(parent),
                start_new_session=True,  # its own group: stop() ends its workers too
            ).result()
        return self

    def poll(self) -> tuple[str, Any]:
        """("running", the progress line), ("done", the report) or ("failed", the error)."""
        self.polled = time.monotonic()
        if self.process is None:
            raise RuntimeError("poll() before start()")
        code = self.process.poll()
        if code is None:
            if _rss(self.process.pid) > CHILD_MAX_RSS_BYTES:
                self.process.kill()
                self.process.wait()
                return "failed", f"the replay used more than {CHILD_MAX_RSS_BYTES >> 30} GiB"
            return "running", self._last_line()
        if code == 0 and self.report_path.exists():
            if self.report is None:
                self.report = json.loads(self.report_path.read_text())
            return "done", self.report
        return "failed", self._last_line() or f"kvlease replay exited with status {code}"

    def stop(self) -> None:
        """End the child and its workers (if running) and remove the job's folder."""
        if self.process is not None and self.process.poll() is None:
            _signal_group(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                _signal_group(self.process.pid, signal.SIGKILL)
                self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)
        with _JOBS_LOCK:
            _JOBS.discard(self)

    def _last_line(self) -> str:
        """The log's last non-empty line, or of a progress bar its last redraw."""
        try:
            text = self.log_path.read_bytes()[-4096:].decode("utf-8", "replace")
        except OSError:
            return ""
        parts = [p.strip() for p in text.replace("\r", "\n").split("\n") if p.strip()]
        return parts[-1] if parts else ""


_LAUNCHER = ThreadPoolExecutor(1, thread_name_prefix="kvlease-whatif-launcher")


def _bound_child(parent: int) -> None:
    """In the child before exec: a CPU-time limit the kernel enforces, and SIGTERM when
    the page's process dies (Streamlit killed: no `stop()` runs)."""
    resource.setrlimit(resource.RLIMIT_CPU, (CHILD_CPU_SECONDS, CHILD_CPU_SECONDS + 5))
    die_with_parent(parent)


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


@atexit.register
def stop_all() -> None:
    """Every job this process started: children ended, folders removed."""
    with _JOBS_LOCK:
        jobs = list(_JOBS)
    for job in jobs:
        job.stop()


def reap(now: float | None = None) -> int:
    """Stop the jobs no page has polled for ORPHAN_SECONDS (their browser session has
    closed: the page polls every 2 s while it is open); how many were stopped."""
    now = time.monotonic() if now is None else now
    with _JOBS_LOCK:
        orphans = [j for j in _JOBS if now - j.polled > ORPHAN_SECONDS]
    for job in orphans:
        job.stop()
    return len(orphans)


_reaper: threading.Thread | None = None


def _start_reaper() -> None:
    global _reaper
    with _JOBS_LOCK:
        if _reaper is not None:
            return

        def loop() -> None:
            while True:
                time.sleep(ORPHAN_SECONDS / 3)
                reap()

        _reaper = threading.Thread(target=loop, name="kvlease-whatif-reaper", daemon=True)
        _reaper.start()


def replay_argv(
    *,
    trace: str | None = None,
    start: str | None = None,
    end: str | None = None,
    tiers: str | None = None,
    assign: str | None = None,
    pool_blocks: int | None = None,
    current_pool_blocks: int | None = None,
    speed: float = 1.0,
) -> list[str]:
    """The `kvlease replay` arguments for the form's choices: a trace, else the ledger's
    window."""
    argv = ["--trace", trace] if trace else []
    for flag, value in (
        ("--from", None if trace else start),
        ("--to", None if trace else end),
        ("--tiers", tiers),
        ("--assign", assign),
        ("--pool-blocks", pool_blocks),
        ("--current-pool-blocks", current_pool_blocks),
    ):
        if value:
            argv += [flag, str(value)]
    if speed != 1.0:
        argv += ["--speed", str(speed)]
    return argv


def settings_line(report: dict[str, Any]) -> str:
    """What each side ran under, in one sentence."""
    s, cur, new = report["settings"], report["current"], report["proposed"]
    cost = s["step_cost"]
    return (
        f"current: tiers {s['current']['tiers']}, {s['current']['pool_blocks']} blocks; "
        f"proposed: tiers {s['proposed']['tiers']}, {s['proposed']['pool_blocks']} blocks; "
        f"step cost {cost['base']:.3g} s + {cost['prefill_token']:.3g} s per prompt token + "
        f"{cost['decode_request']:.3g} s per decoding request. {cur['requests']:,} requests "
        f"replayed; total cost {pair(cur['cost'], new['cost'])} {cur['currency']}."
        + "".join(f" {note}." for note in s["notes"])
    )


def tier_frame(report: dict[str, Any]) -> pd.DataFrame:
    """One row per (tier, side): the tier figures of both sides, long form."""
    rows = [
        {"tier": tier, "side": side, **figures}
        for side in SIDES
        for tier, figures in report[side]["tiers"].items()
    ]
    return pd.DataFrame(rows)


def tiers_of(report: dict[str, Any]) -> list[str]:
    """Every tier either side served, in the order the report lists them."""
    return list(dict.fromkeys([*report["current"]["tiers"], *report["proposed"]["tiers"]]))


def tier_table(report: dict[str, Any]) -> pd.DataFrame:
    """One row per tier, each figure as "current -> proposed"."""
    rows = []
    for tier in tiers_of(report):
        old = report["current"]["tiers"].get(tier, {})
        new = report["proposed"]["tiers"].get(tier, {})
        rows.append({"tier": tier, **{k: pair(old.get(k), new.get(k)) for k, _ in COLUMNS}})
    return pd.DataFrame(rows)


def movers_frame(report: dict[str, Any], key: str) -> pd.DataFrame:
    """The tenants whose `key` ("ttft_p99_s" or "cost") moves most."""
    rows = [
        {
            "tenant": m["tenant"],
            "tier": " -> ".join(dict.fromkeys(m["tier"])),
            "current": m[key][0],
            "proposed": m[key][1],
            "change": m[key][1] - m[key][0],
        }
        for m in report["movers"][key]
    ]
    return pd.DataFrame(rows, columns=["tenant", "tier", "current", "proposed", "change"])


def pair(old: Any, new: Any) -> str:
    """ "old -> new", or one value where both sides agree."""
    a, b = shown(old), shown(new)
    return a if a == b else f"{a} -> {b}"


def shown(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def proposal(report: dict[str, Any]) -> str:
    """The proposed change, in one sentence: the headline of the page and the report."""
    s = report["settings"]
    cur, new = s["current"], s["proposed"]
    changes = []
    if new["tiers"] != cur["tiers"]:
        changes.append(f"tier table {new['tiers']} instead of {cur['tiers']}")
    moved = s.get("assigned") or {}
    if moved:
        listed = ", ".join(f"{t} to {tier}" for t, tier in sorted(moved.items())[:5])
        more = f" and {len(moved) - 5} more" if len(moved) > 5 else ""
        changes.append(f"{len(moved)} tenant{'s' * (len(moved) > 1)} moved ({listed}{more})")
    if new["pool_blocks"] != cur["pool_blocks"]:
        changes.append(f"a pool of {new['pool_blocks']:,} blocks instead of {cur['pool_blocks']:,}")
    if not changes:
        return "Proposed: no change (the same tier table, tenants and pool on both sides)."
    return "Proposed: " + "; ".join(changes) + "."


def dropped(report: dict[str, Any]) -> str | None:
    """Why some recorded turns were not replayed, when some were not."""
    n = {side: report[side].get("dropped_turns", 0) for side in SIDES}
    if not any(n.values()):
        return None
    counts = pair(n["current"], n["proposed"])
    return (
        f"{counts} recorded turns were not replayed: their session's conversation would pass "
        "the engine's max_model_len, so vLLM would have refused them (the rest of such a "
        "session is dropped too, as its client would have started a new chat)."
    )


def reconciliation(report: dict[str, Any], billed: dict[str, Any]) -> pd.DataFrame:
    """The replay's current side against the ledger's bill for the same window: figure,
    ledger, replayed, difference, and why they may differ. `billed`: the ledger's
    requests, block_hours, retention_hours and cost (Decimal) for the window."""
    cur = report["current"]
    tiers = cur["tiers"].values()
    replayed = {
        "requests": cur["requests"],
        "block_hours": sum(t.get("kv_block_hours") or 0 for t in tiers),
        "retention_hours": sum(t.get("kv_retention_hours") or 0 for t in tiers),
        "cost": cur["cost"],
    }
    why = {
        "requests": f"{cur.get('dropped_turns', 0):,} turns dropped (context), and records "
        "without a tier left out",
        "block_hours": "re-timed on the calibrated clock: how long blocks are held follows "
        "the replayed schedule, not the recorded one",
        "retention_hours": "leases and reservations follow the replayed schedule",
        "cost": "tokens are priced the same; KV time and retention are re-timed, and dropped "
        "turns are not billed",
    }
    rows = []
    for key, title in (
        ("requests", "requests"),
        ("block_hours", "KV block-hours"),
        ("retention_hours", "KV retention block-hours"),
        ("cost", f"cost ({cur['currency']})"),
    ):
        ledger, again = float(billed[key]), float(replayed[key])
        rows.append(
            {
                "figure": title,
                "ledger": ledger,
                "replayed (current)": again,
                "difference": again - ledger,
                "why they differ": why[key] if round(again - ledger, 6) else "",
            }
        )
    return pd.DataFrame(rows)


_PROGRESS = re.compile(r"(\d+)/(\d+)")


def progress(line: str, elapsed: float) -> tuple[float | None, str]:
    """The progress bar's fraction (None before the replay counts any request) and a
    sentence that moves: the child first loads the replay engine, then counts requests."""
    match = _PROGRESS.search(line or "")
    if match and int(match[2]):
        done, total = int(match[1]), int(match[2])
        return done / total, f"{done:,} of {total:,} requests replayed, {elapsed:,.0f} s"
    return None, f"starting the replay engine (vLLM's scheduler, both sides), {elapsed:,.0f} s"
