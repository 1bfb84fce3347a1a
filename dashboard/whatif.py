"""The "What if" view's data: a `kvlease replay` run in the background, and its report as
DataFrames.

The page never replays in its own process (a replay loads vLLM, and the dashboard
must not): `ReplayJob` starts `kvlease replay --json FILE` as a child process and
reads the file when the child ends, and its progress bar's last line meanwhile.

Whoever can open the page can name files for the replay to read, so the page reads
only regular files under `KVLEASE_WHATIF_DIR`, of at most `MAX_INPUT_BYTES`
(`allowed_file`), and answers the same for a file that is missing as for one outside
that folder. The child is bounded: `CHILD_CPU_SECONDS` of CPU (the kernel ends it past
that) and `CHILD_MAX_RSS_BYTES` of memory (checked on every poll). A job's folder is
removed when the job is stopped, replaced, or the dashboard exits.
"""

from __future__ import annotations

import atexit
import json
import os
import resource
import shutil
import stat
import subprocess
import sys
import tempfile
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from dashboard.data import WHATIF_DIR_ENV
from exporters.ledger import DB_ENV

MAX_INPUT_BYTES = 256 * 2**20
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


_JOBS: weakref.WeakSet[ReplayJob] = weakref.WeakSet()


@dataclass(eq=False)
class ReplayJob:
    """One background `kvlease replay` and its folder. `poll()` never blocks."""

    folder: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvlease-whatif-")))
    process: subprocess.Popen | None = None
    report: dict[str, Any] | None = None  # read once, when the child has ended

    def __post_init__(self) -> None:
        _JOBS.add(self)

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
        command = [sys.executable, "-m", "server.cli", "replay", *argv]
        command += ["--json", str(self.report_path)]
        env = {**os.environ, **({DB_ENV: usage_db} if usage_db else {})}
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_bound_child
            )
        return self

    def poll(self) -> tuple[str, Any]:
        """("running", the progress line), ("done", the report) or ("failed", the error)."""
        code = self.process.poll() if self.process else None
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
        """End the child (if running) and remove the job's folder."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)

    def _last_line(self) -> str:
        """The log's last non-empty line, or of a progress bar its last redraw."""
        try:
            text = self.log_path.read_bytes()[-4096:].decode("utf-8", "replace")
        except OSError:
            return ""
        parts = [p.strip() for p in text.replace("\r", "\n").split("\n") if p.strip()]
        return parts[-1] if parts else ""


def _bound_child() -> None:
    """In the child before exec: a CPU-time limit the kernel enforces."""
    resource.setrlimit(resource.RLIMIT_CPU, (CHILD_CPU_SECONDS, CHILD_CPU_SECONDS + 5))


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


@atexit.register
def stop_all() -> None:
    """Every job this process started: children ended, folders removed."""
    for job in list(_JOBS):
        job.stop()


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
